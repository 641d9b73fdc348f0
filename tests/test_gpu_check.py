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
    out = tmp_path / "r.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--size", "tiny", "--work_dir", str(tmp_path / "w"),
           "--cache_dir", str(tmp_path / "cache"), "--out", str(out), "--sft_steps", "2", "--steps_a", "1",
           "--steps_b", "2", "--tasks", "2", "--group", "2", "--eval_games", "2", "--max_new_tokens", "8",
           "--", "--micro_batch", "2"]
    r = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["pass"] and all(res["checks"].values()) and len(res["checks"]) == 8
    assert [s["step"] for s in res["steps"]] == [1, 2]
    log_b = (tmp_path / "w" / "run_b.log").read_text()
    assert "resumed from" in log_b and "at step 1 (weights match the checksum saved with them)" in log_b
    assert "--micro_batch 2" in (tmp_path / "w" / "run_a.log").read_text()   # arguments after -- reach train.py
    ph = res["run_a"]["phases"]
    assert {"phase/time/sft", "phase/time/eval_at_start", "phase/time/save", "phase/time/eval"} <= set(ph)
    assert set(res["run_b"]["phases"]) >= {"phase/time/save", "phase/time/eval"} and "phase/time/sft" not in res["run_b"]["phases"]
    s = res["steps"][0]
    assert s["gen_tokens"] > 0 and s["update_tokens"] > 0 and s["update_tokens_per_s"] > 0
    assert set(s["seconds"]) >= {"rollout", "skills", "score", "update", "sync", "step"}
    assert s["rollout/logp_diff_mean"] < 1e-4          # fp32, the same weights on both sides
    assert res["matmul_params"] == gpu_check.matmul_params(res["model"])[0]
    assert "PASS" in r.stdout


def test_model_flops_count_on_a_hand_sized_model(tmp_path):
    """Matmul parameters of a built tiny Qwen2 (tied head): 2 blocks of q, k, v (with biases), o, and the
    three MLP matrices, the norms, and the head, which is the embedding."""
    h, L, heads, kv, inter, _ = gpu_check.SIZES["tiny"]
    d_kv = kv * (h // heads)
    block = (h * h + h) + 2 * (h * d_kv + d_kv) + h * h + 3 * h * inter + 2 * h
    want = L * block + h + 151936 * h
    args = gpu_check.parse(["--size", "tiny", "--work_dir", str(tmp_path), "--cache_dir", str(tmp_path / "c")])
    n, cfg = gpu_check.matmul_params(gpu_check.build_model(args))
    assert n == want and cfg["vocab_size"] == 151936 and cfg["tie_word_embeddings"]
