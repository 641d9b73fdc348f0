"""scripts/gpu_check.py end to end on CPU (`--size tiny`): it drives train.py under torchrun through an SFT
warm start, an evaluation, RSIPO steps with a checkpoint each, a second run that resumes, and its checks."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_check  # noqa: E402


def test_gpu_check_runs_train_py_end_to_end_on_cpu(tmp_path):
    # --teacher: the EMA teacher, the top-K term and T 0.7 through the SFT, the steps, the save and the resume
    out = tmp_path / "r.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--size", "tiny", "--teacher", "--work_dir",
           str(tmp_path / "w"),
           "--cache_dir", str(tmp_path / "cache"), "--out", str(out), "--sft_steps", "2", "--steps_a", "1",
           "--steps_b", "2", "--tasks", "2", "--group", "2", "--eval_games", "2", "--max_new_tokens", "8",
           "--", "--micro_batch", "2"]
    r = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["pass"] and all(res["checks"].values()) and len(res["checks"]) == 10
    assert res["train_args"][:6] == gpu_check.TEACHER and "teacher_term_when_taught" in res["checks"]
    # the 2-step warm start of a random model writes no valid skill, so no turn has a teacher on CPU (the GPU run's
    # 20 SFT steps do); the EMA teacher's own weights are in the checkpoint run B resumed from
    import torch.distributed.checkpoint as dcp
    ckpt = sorted((tmp_path / "w" / "runs" / "check_tiny_hf" / "ckpt").glob("step_*"))[-1]
    assert any(k.startswith("teacher.") for k in dcp.FileSystemReader(ckpt).read_metadata().state_dict_metadata)
    assert [s["step"] for s in res["steps"]] == [1, 2]
    log_b = (tmp_path / "w" / "run_b.log").read_text()
    assert "resumed from" in log_b and "at step 1 (weights match the checksum saved with them)" in log_b
    log_a = (tmp_path / "w" / "run_a.log").read_text()
    assert "--micro_batch 2" in log_a and "--teacher_weights ema" in log_a   # arguments reach train.py
    ph = res["run_a"]["phases"]
    assert {"phase/time/sft", "phase/time/eval_at_start", "phase/time/save", "phase/time/eval"} <= set(ph)
    assert (set(res["run_b"]["phases"]) >= {"phase/time/save", "phase/time/eval"}
           and "phase/time/sft" not in res["run_b"]["phases"])
    s = res["steps"][0]
    assert s["gen_tokens"] > 0 and s["update_tokens"] > 0 and s["update_tokens_per_s"] > 0
    assert set(s["seconds"]) >= {"rollout", "skills", "score", "update", "sync", "step"}
    assert s["rollout/logp_diff_mean"] < 1e-4          # fp32, the same weights on both sides, at T 0.7
    assert s["update/first_logp_gap_mean"] < 1e-4      # π_θ before its first optimizer step is π_old
    blocks, head, _ = gpu_check.matmul_params(res["model"])
    assert res["matmul_params"] == blocks + head
    assert "PASS" in r.stdout


def test_model_flops_count_on_a_hand_sized_model(tmp_path):
    """Matmul weights of a built tiny Qwen2: per block q, k, v, o and the three MLP matrices (no biases, no
    norms); the head is V·d whether tied or not."""
    h, L, heads, kv, inter, _ = gpu_check.SIZES["tiny"]
    d_kv = kv * (h // heads)
    args = gpu_check.parse(["--size", "tiny", "--work_dir", str(tmp_path), "--cache_dir", str(tmp_path / "c")])
    blocks, head, cfg = gpu_check.matmul_params(gpu_check.build_model(args))
    assert blocks == L * (2 * h * h + 2 * h * d_kv + 3 * h * inter) and head == 151936 * h
    assert cfg["vocab_size"] == 151936 and cfg["tie_word_embeddings"]


def test_update_flops_by_hand():
    # 100 block weights, head 50, 2 layers, d_attn 4; sequences of 3 and 5 tokens with 1 and 2 response tokens:
    # forward 2·100·8 + 2·2·4·(9 + 25) + 2·50·3 = 1600 + 544 + 300 = 2444, ×3 with the backward
    assert gpu_check.update_flops(100, 50, 2, 4, 8, 34, 3) == 3 * 2444
    # the figures are per GPU: the same row on 2 ranks gives half the tokens/s and half the MFU of 1 rank
    row = {"step": 1, "update/seq_tokens": 8, "update/seq_tokens_sq": 34, "update/response_tokens": 3,
           "time/update": 2.0, "time/rollout": 1.0, "rollout/gen_tokens": 10}
    cfg = {"num_hidden_layers": 2, "num_attention_heads": 1, "hidden_size": 4}
    one, two = (gpu_check.step_figures(row, 100, 50, cfg, 1.0, w) for w in (1, 2))
    assert one["update_mfu"] == 3 * 2444 / 2.0 and two["update_mfu"] == one["update_mfu"] / 2
    assert two["update_tokens_per_s"] == 2.0 and two["gen_tokens_per_s"] == 5.0


def test_quick_preset_and_flags_that_win_over_it(tmp_path):
    q = gpu_check.parse(["--quick", "--work_dir", str(tmp_path)])
    assert (q.sft_steps, q.steps_a, q.steps_b, q.eval_games) == (20, 2, 3, 8)
    assert gpu_check.parse(["--quick", "--steps_b", "4", "--", "--sft_steps", "9"]).steps_b == 4   # given: kept
    assert gpu_check.parse([]).sft_steps == 60 and gpu_check.parse([]).tol_gap == 0.05
    t = gpu_check.parse(["--teacher", "--", "--temperature", "1.0"])
    assert t.train_args == gpu_check.TEACHER + ["--temperature", "1.0"] and gpu_check.parse([]).train_args == []
