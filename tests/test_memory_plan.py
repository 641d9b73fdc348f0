"""scripts/memory_plan.py: the per-rank memory terms on hand numbers, the GPU defaults it chose, and the
estimate against a peak measured on this CPU."""
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
import memory_plan as MP  # noqa: E402
import train as T  # noqa: E402
from harness import config  # noqa: E402

GIB = 2 ** 30
# d 8, 2 heads of 4, 1 KV head (d_kv 4), MLP 16, 2 blocks, vocabulary 100, untied
CFG = dict(vocab_size=100, hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
           num_key_value_heads=1, tie_word_embeddings=False)


def test_parameter_counts_by_hand():
    # block: q 8·8+8, k and v 8·4+4 each, o 8·8, MLP 3·8·16, two norms 2·8 = 72 + 72 + 64 + 384 + 16 = 608
    P, block, root = MP.param_counts(CFG)
    assert block == 608 and root == 2 * 100 * 8 + 8 and P == 2 * 608 + 1608
    assert MP.param_counts({**CFG, "tie_word_embeddings": True})[2] == 808


def test_estimate_terms_by_hand():
    # micro_tokens 100, sequences of 30 + 10: 2 sequences, 80 tokens, 20 response positions; bf16 (c = 2)
    e = MP.estimate(CFG, world=2, gpu_gib=1.0, micro_tokens=100, prompt=30, response=10, grad_ckpt=False, c=2,
                    gpu_memory_utilization=0.5, vllm_asleep_gib=0.0)
    P = 2824
    assert e["micro_batch_sequences"] == 2 and e["micro_batch_tokens"] == 80
    assert e["trainer_state"] * GIB == pytest.approx(16 * P / 2)
    assert e["reference"] * GIB == pytest.approx(2 * P / 2)
    # the root (1608) gathered in bf16 and its gradient held in bf16 and fp32; two blocks (608) and one's gradient
    assert e["gathered_weights"] * GIB == pytest.approx(2 * 1608 + 6 * 1608 + 2 * 2 * 608 + 6 * 608)
    # per token and block: 2·(4·8 + 2·2·8) + 2·(8 + 2·4) + 2·2·8 + 4·2·16 = 128 + 32 + 32 + 128 = 320
    assert e["activations"] * GIB == pytest.approx(80 * 2 * 320)
    assert e["logits"] * GIB == pytest.approx(20 * 100 * (2 + 4 + 16))
    assert e["vllm_awake"] == 0.5 and e["rollout_phase"] == pytest.approx((9 * P) / GIB + 0.5)
    ck = MP.estimate(CFG, world=2, micro_tokens=100, prompt=30, response=10, grad_ckpt=True, c=2)
    assert ck["activations"] * GIB == pytest.approx(80 * 2 * 2 * 8 + 80 * 320)   # block inputs + one block rebuilt
    assert MP.estimate(CFG, micro_tokens=10, prompt=30, response=10)["micro_batch_sequences"] == 1   # one at least
    # an ema (or refresh) teacher: its fp32 weights, sharded, 4P/W, in both phases; live and frozen add nothing
    ema = MP.estimate(CFG, world=2, gpu_gib=1.0, micro_tokens=100, prompt=30, response=10, grad_ckpt=False, c=2,
                      gpu_memory_utilization=0.5, vllm_asleep_gib=0.0, teacher="ema")
    assert ema["teacher"] * GIB == pytest.approx(4 * P / 2) and e["teacher"] == 0.0
    assert (ema["rollout_phase"] - e["rollout_phase"]) * GIB == pytest.approx(4 * P / 2)
    assert (ema["update_phase"] - e["update_phase"]) * GIB == pytest.approx(4 * P / 2)
    # at 7B on 8 GPUs: 47.5 GiB (rollout) and 41.5 (update) with it, 44.0 and 37.9 without
    seven = {w: MP.estimate(MP.QWEN25["7B"], teacher=w) for w in ("live", "ema")}
    assert [round(seven[w][k], 1) for w in ("live", "ema") for k in ("rollout_phase", "update_phase")] == \
        [44.0, 37.9, 47.5, 41.5]


def test_gpu_defaults_fit_7b_on_eight_80gb_gpus_and_the_old_flags_do_not():
    d = config.GPU
    for cfg in MP.QWEN25.values():
        assert MP.estimate(cfg, world=8, gpu_gib=80, micro_tokens=d["micro_tokens"], grad_ckpt=d["grad_ckpt"])["fits"]
        assert not MP.estimate(cfg, world=8, gpu_gib=80, micro_tokens=32 * 2048, grad_ckpt=False)["fits"]
    assert "| 7B | defaults" in MP.table()


def _merged(model: str, gpu: bool) -> dict:
    return {k: v
            for k, (v, _) in config.preset_values({"model": model, "env": "alfworld", "algo": "rsipo"}, gpu).items()}


def test_real_models_on_a_gpu_get_the_gpu_defaults_unless_flags_say_otherwise(monkeypatch):
    assert _merged("Qwen/Qwen2.5-7B-Instruct", gpu=True) == config.GPU
    assert _merged("Qwen/Qwen2.5-7B-Instruct", gpu=False) == {}
    assert "grad_ckpt" not in _merged("tiny", gpu=True)
    monkeypatch.setattr(T.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(T.Args, "validate", lambda self: None)   # no GPU here to validate against
    a = T.parse_args(["--model", "Qwen/Qwen2.5-7B-Instruct"])
    assert (a.micro_tokens, a.grad_ckpt) == (8192, True)
    a = T.parse_args(["--model", "Qwen/Qwen2.5-7B-Instruct", "--micro_tokens", "0", "--grad_ckpt", "false"])
    assert (a.micro_tokens, a.grad_ckpt) == (0, False)


def test_estimate_within_25_percent_of_the_measured_cpu_peak(tmp_path):
    """A 1-block Qwen2 with Qwen's 151,936-row vocabulary: gradients, activations and the logits of one
    micro-batch, measured in a fresh process (peak resident memory over the loaded model)."""
    rows = [r for r in MP.measure(str(tmp_path), batch=4, prompt=256, response=32, models=("qwen-tiny",),
                                  ckpts=(False,))]
    assert len(rows) == 1 and 0.75 <= rows[0]["ratio"] <= 1.25, rows
    assert rows[0]["terms_gib"]["logits"] > 0.5 * rows[0]["measured_gib"]   # the vocabulary dominates, as at 7B
