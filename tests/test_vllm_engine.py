"""VLLMEngine (rollout.py) against a fake `vllm` module, the project without vLLM, and the GPU check.

The fake has the calls VLLMEngine makes on vllm 0.32.0 (`LLM(**kw)`, `generate(prompts, params,
use_tqdm=)`, `sleep(level=)`, `wake_up(tags=)`, `reset_prefix_cache()`, the worker's model through
`llm_engine.model_executor.driver_worker.worker.model_runner.get_model()`) and answers with outputs
shaped like vLLM's: `RequestOutput.outputs[0]` with `token_ids`, `logprobs` as a list of
{token_id: Logprob(logprob=...)}, `finish_reason`, `stop_reason`. It records every call.
The last test drives the real vLLM and skips without CUDA and vllm.

Run: python -m pytest -q tests/test_vllm_engine.py
"""
import importlib.util
import json
import os
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
from rollout import STOP_TEXT, VLLMEngine, chat_ids  # noqa: E402


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


class FakeLLM:
    """Records calls; `reply(prompt_ids, params)` → (token_ids, logprob dicts, finish_reason, stop_reason)."""
    reply = None

    def __init__(self, **kw):
        self.kwargs, self.log, self.requests = kw, [], []
        self.inner = FakeInnerModel(self.log)
        runner = SimpleNamespace(get_model=lambda: self.inner)
        self.llm_engine = SimpleNamespace(model_executor=SimpleNamespace(
            driver_worker=SimpleNamespace(worker=SimpleNamespace(model_runner=runner))))

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
    return mod


@pytest.fixture(scope="module")
def tok():
    texts = ["go to desk 1 take apple 1 from desk 1 done", "user assistant <think> </think> <action> </action>"]
    return T.train_tiny_tokenizer(texts)


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


def test_sampling_params_temperature_greedy_stop_and_max_tokens(fake_vllm, tok):
    FakeLLM.reply = staticmethod(lambda p, sp: ([], [], "length", None))
    eng = make(tok)
    act = ids_of(tok, STOP_TEXT)
    assert len(act) == 1                        # </action> is one special token in the tiny vocabulary
    eng.generate(["go to desk 1"], temperature=0.7)
    sp = eng.llm.requests[-1][1]
    assert sp["temperature"] == 0.7 and sp["top_p"] == 0.9 and sp["top_k"] == 0
    assert sp["max_tokens"] == 8 and sp["logprobs"] == 0 and sp["n"] == 1
    assert sp["seed"] is None                   # no per-request seed: copies of a task must differ
    assert sp["stop"] == [STOP_TEXT] and sp["stop_token_ids"] == act
    assert sp["include_stop_str_in_output"] is True and sp["skip_special_tokens"] is False
    eng.generate(["go to desk 1"])             # engine default temperature 1.0
    assert eng.llm.requests[-1][1]["temperature"] == 1.0
    for kw in (dict(greedy=True), dict(temperature=0.0)):
        eng.generate(["go to desk 1"], **kw)
        sp = eng.llm.requests[-1][1]
        assert sp["temperature"] == 0.0 and sp["top_p"] == 1.0
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


def test_prompt_token_ids_are_our_chat_template_left_truncated(fake_vllm, tok):
    FakeLLM.reply = staticmethod(lambda p, sp: ([], [], "length", None))
    eng = make(tok)
    short, long = "go to desk 1", " ".join(["take apple 1 from desk 1"] * 10)
    gens = eng.generate([short, long], max_new_tokens=100)
    (p0, sp0), (p1, sp1) = eng.llm.requests
    assert p0 == chat_ids(tok, short) and len(p0) < 20
    full = chat_ids(tok, long)
    assert len(full) > 20 and p1 == full[-20:]             # the last max_prompt_tokens = 20 tokens
    assert [g.prompt_ids for g in gens] == [p0, p1]
    # 100 asked, clamped to max_model_len - len(prompt): 28 - len(p0) and 28 - 20 = 8
    assert sp0["max_tokens"] == 28 - len(p0) and sp1["max_tokens"] == 8


def test_allowed_actions_is_a_clear_error(fake_vllm, tok):
    eng = make(tok)
    with pytest.raises(ValueError, match="constrained"):
        eng.generate(["go"], allowed_actions=[["go to desk 1"]])


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


def test_text_is_cut_after_the_first_stop_text(fake_vllm, tok):
    ws = "go to desk 1 take".split()
    toks = [ids_of(tok, w)[0] for w in ws]
    FakeLLM.reply = staticmethod(lambda p, sp: (toks, [{t: Logprob(-1.0)} for t in toks], "stop", "desk"))
    eng = make(tok, stop_texts=["take", "desk"])
    g = eng.generate(["x"])[0]
    assert g.text == "go to desk"               # "desk" comes before "take": cut after it
    assert g.token_ids == toks                  # ids are what vLLM sampled
    g = eng.generate(["x"], stop=False)[0]
    assert g.text == "go to desk 1 take"


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
    assert eng.llm.log == [("sleep", 1), ("wake_up", ["weights"]), ("load_weights", 1),
                           ("wake_up", ["kv_cache"]), ("reset_prefix_cache",)]
    eng.generate(["x"])                          # awake again
    eng.llm.log.clear()
    eng.load_weights(w)                          # awake: push, then reset the prefix cache
    assert eng.llm.log == [("load_weights", 1), ("reset_prefix_cache",)]
    eng.llm.log.clear()
    eng.sleep(), eng.wake_up()
    assert eng.llm.log == [("sleep", 1), ("wake_up", None)]
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


def test_weight_sync_pushes_every_parameter_once_with_names_and_full_shapes(fake_vllm, tok):
    model = T.tiny_model(len(tok), T.Args(tiny_hidden=32, tiny_layers=2))
    params = list(model.named_parameters())     # tied embeddings: lm_head is not listed again
    assert "lm_head.weight" not in dict(params)
    eng = make(tok)
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
    mb = T.micro_batches
    assert mb([5, 5, 5, 5, 5], 2) == [[0, 1], [2, 3], [4]]          # by count (the CPU default)
    # budget 12 padded tokens: [3,4] → 2 x 4 = 8; adding 10 → 3 x 10 = 30 > 12; [10] alone; [2,2] → 4
    assert mb([3, 4, 10, 2, 2], 32, 12) == [[0, 1], [2], [3, 4]]
    assert mb([20, 1], 4, 12) == [[0], [1]]                          # longer than the budget: alone
    assert mb([], 4) == []


def test_score_tokens_by_token_budget_keeps_sample_order(tok):
    torch.manual_seed(0)
    m = T.tiny_model(len(tok), T.Args(tiny_hidden=32)).eval()
    S = [(ids_of(tok, "go to desk 1"), ids_of(tok, "take apple")), (ids_of(tok, "go"), ids_of(tok, "desk 1 take apple 1")),
         (ids_of(tok, "go to desk 1 take apple go to"), ids_of(tok, "go"))]
    a = T.score_tokens(m, S, tok.pad_token_id, "cpu", 32)
    b = T.score_tokens(m, S, tok.pad_token_id, "cpu", 1, micro_tokens=8)   # sorted by length, 3 forwards
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
    mods = sorted(p.stem for p in ROOT.glob("*.py")) + sorted(p.stem for p in (ROOT / "scripts").glob("*.py"))
    assert {"rollout", "train", "gpu_check", "vllm_cpu_smoke"} <= set(mods)
    code = BLOCK_VLLM.format(root=str(ROOT), scripts=str(ROOT / "scripts"), mods=mods)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"IMPORTED {len(mods)}" in r.stdout


# A stand-in `vllm` package for the plumbing run of scripts/gpu_check.py: the LLM is a Hugging Face
# model in fp32 that samples token by token and reports the sampled tokens' log-probs, and whose
# `load_weights` loads the pushed tensors; so the script's sync check must pass, on CPU, end to end.
HF_BACKED_VLLM = """
from types import SimpleNamespace
import torch
__version__ = "0.32.0"

class SamplingParams:
    def __init__(self, **kw):
        self.kw = kw

class LLM:
    def __init__(self, model, seed=0, **kw):
        from transformers import AutoModelForCausalLM
        self.m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        self.g = torch.Generator().manual_seed(seed)
        runner = SimpleNamespace(get_model=lambda: SimpleNamespace(load_weights=self._load))
        self.llm_engine = SimpleNamespace(model_executor=SimpleNamespace(
            driver_worker=SimpleNamespace(worker=SimpleNamespace(model_runner=runner))))

    def _load(self, weights):
        sd = dict(weights)
        bad = self.m.load_state_dict(sd, strict=False).unexpected_keys
        assert not bad, bad
        return set(sd)

    @torch.no_grad()
    def generate(self, prompts, params, use_tqdm=True):
        outs = []
        for p, sp in zip(prompts, params):
            ids, toks, lps = list(p["prompt_token_ids"]), [], []
            for _ in range(sp.kw["max_tokens"]):
                logp = self.m(torch.tensor([ids + toks])).logits[0, -1].float().log_softmax(-1)
                t = int(torch.multinomial(logp.exp(), 1, generator=self.g))
                toks.append(t)
                lps.append({t: SimpleNamespace(logprob=float(logp[t]))})
            outs.append(SimpleNamespace(outputs=[SimpleNamespace(token_ids=toks, logprobs=lps, text="",
                                                                 finish_reason="length", stop_reason=None)]))
        return outs

    def sleep(self, level=1):
        pass

    def wake_up(self, tags=None):
        return True

    def reset_prefix_cache(self):
        return True
"""


def test_gpu_check_plumbing_on_cpu_with_an_hf_backed_fake_vllm(tmp_path):
    (tmp_path / "fake" / "vllm").mkdir(parents=True)
    (tmp_path / "fake" / "vllm" / "__init__.py").write_text(HF_BACKED_VLLM)
    out = tmp_path / "r.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--cpu", "--hidden", "64", "--layers", "2",
           "--vocab_words", "300", "--prompts", "4", "--prompt_words", "12", "--gen_tokens", "8", "--steps", "2",
           "--micro_batch", "2", "--lr", "1e-2", "--work_dir", str(tmp_path / "m"), "--out", str(out)]
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "fake"), OMP_NUM_THREADS="1", MASTER_PORT="29541")
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    s = res["sync"]
    assert s["pass"] and s["tensors"] == 2 * 12 + 2            # every parameter of the tiny Qwen2, once
    assert res["before_update"]["max_abs"] < 1e-4               # fp32 on both sides: the same numbers
    assert s["max_abs_diff_after"] < 1e-4 and s["drift_mean_abs"] > 1e-2   # synced; the update moved it
    assert res["rollout"]["gen_tokens"] == 4 * 8 and res["update"]["steps_timed"] == 1


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
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--out", str(out), "--steps", "2"],
                       cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["sync"]["pass"] and res["sync"]["max_abs_diff_after"] < res["sync"]["threshold"]
