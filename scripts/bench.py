"""Benchmark of one RL step: per-section time, rollout tokens/s, update tokens/s, RSIPO vs GRPO.

It runs the real trainer (`train.main`) for a few steps per algorithm on the same tasks (same
seed, same task sampler) with evaluation off, reads the per-step timings that the trainer logs
(`time/<section>` in metrics.jsonl), drops the first step (warm-up), and prints a table; the
figures are saved as JSON.

    python scripts/bench.py                           # tiny model, grpo and rsipo, 3 steps each
    python scripts/bench.py --model Qwen/Qwen2.5-0.5B-Instruct --algos grpo --steps 2 --max_new_tokens 64
    python scripts/bench.py -- --opsd_keep 0.3        # train.py flags after `--` go to every run

Rollout tokens/s = generated response tokens / rollout seconds. Update tokens/s = tokens of the
sequences (prompt + response) that went through forward+backward / update seconds.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root
import train  # noqa: E402

SECTIONS = ["rollout", "skills", "replay", "score", "update", "sync"]   # the sections train.rl_step times


def bench(algo: str, a, out_dir: str) -> dict:
    argv = ["--model", a.model, "--algo", algo, "--steps", str(a.steps), "--sft_steps", str(a.sft_steps),
            "--tasks_per_step", str(a.tasks_per_step), "--group_size", str(a.group_size),
            "--max_new_tokens", str(a.max_new_tokens), "--eval", "false", "--save_every", "0",
            "--out_dir", out_dir, "--run_name", f"bench_{algo}", "--resume", "false", "--overwrite", "true",
            "--seed", str(a.seed),
            "--data_root", a.data_root, "--preset", "none", *a.extra]   # the tiny preset alone, on all task types
    train.main(argv)
    rows = [json.loads(l) for l in (Path(out_dir) / f"bench_{algo}" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "time/step" in r][1:] or [r for r in rows if "time/step" in r]  # drop warm-up
    mean = lambda k: statistics.fmean(r.get(k, 0.0) for r in rows)
    expected = [s for s in SECTIONS if s != "skills" or algo in ("opsd", "rsipo")]
    expected = [s for s in expected if s != "replay" or algo == "rsipo"]
    missing = [s for s in expected if not any(f"time/{s}" in r for r in rows)]
    if missing:   # a renamed section would otherwise show as zeros
        raise SystemExit(f"error: the trainer logged no time/{missing[0]} "
                         f"(it logs {sorted(k for k in rows[0] if k.startswith('time/'))})")
    res = {f"time/{s}": mean(f"time/{s}") for s in SECTIONS}
    res["time/step"] = mean("time/step")
    res["rollout_tokens_per_s"] = (sum(r["rollout/gen_tokens"] for r in rows)
                                  / max(1e-9, sum(r["time/rollout"] for r in rows)))
    res["update_tokens_per_s"] = (sum(r["update/seq_tokens"] for r in rows)
                                 / max(1e-9, sum(r["time/update"] for r in rows)))
    res["turns_per_step"] = mean("train/turns")
    res["steps_measured"] = len(rows)
    return res


def main(argv=None):
    p = argparse.ArgumentParser(description="RL step benchmark (see the module docstring)")
    p.add_argument("--model", default="tiny")
    p.add_argument("--algos", default="grpo,rsipo")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--sft_steps", type=int, default=150, help="tiny warm start, so episodes look realistic")
    p.add_argument("--tasks_per_step", type=int, default=8)
    p.add_argument("--group_size", type=int, default=8)
    p.add_argument("--max_new_tokens", type=int, default=48)
    p.add_argument("--data_root", default="data/alfworld")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench.json")
    argv = sys.argv[1:] if argv is None else list(argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []   # more train.py flags, for every algo
    a = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    a.extra = extra
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for algo in a.algos.split(","):
            results[algo] = bench(algo, a, tmp)
    cols = list(results)
    print(f"\n{'section (s / step)':24s}" + "".join(f"{c:>12s}" for c in cols))
    for k in [f"time/{s}" for s in SECTIONS] + ["time/step"]:
        print(f"{k:24s}" + "".join(f"{results[c][k]:12.2f}" for c in cols))
    for k in ("rollout_tokens_per_s", "update_tokens_per_s", "turns_per_step"):
        print(f"{k:24s}" + "".join(f"{results[c][k]:12.0f}" for c in cols))
    if "grpo" in results and "rsipo" in results:
        r = results["rsipo"]["time/step"] / results["grpo"]["time/step"]
        results["rsipo_over_grpo_step_time"] = r
        print(f"RSIPO step time / GRPO step time: {r:.2f}x (goal <= 1.5x)")
    results["config"] = vars(a)
    Path(a.out).write_text(json.dumps(results, indent=1))
    print(f"saved {a.out}")
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
