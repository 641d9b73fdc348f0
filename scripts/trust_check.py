"""The trust check of METHOD.md §5.7 pooled over runs: is λ calibrated, and is eb trust better than raw?

Each RSIPO run started with `--calibrate M` writes calibration.jsonl: per scored skill, λ (Eq. 9's
posterior under eb and under raw trust, from the same replay) and the gain of a fresh, independent
replay of the skill. This script pools those rows over the runs given, and prints and writes, for eb and
raw: tasks, ties, the Brier score, the base-rate Brier (a constant forecast), the Brier score over the
tasks without a tie, the reliability bins, and the same per run.
Writes <out>/trust_check.json and <out>/trust_check.png (the reliability plot).

    python scripts/trust_check.py runs/tb_cmp/rsipo_s0 runs/tb_cmp/rsipo_s1 runs/tb_cmp/rsipo_s2 --out results/tb_cmp
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness import report  # noqa: E402


def pooled(run_dirs: list[str], n_bins: int = 5) -> dict:
    """{"pooled": {mode: shrinkage.calibration}, "runs": {run: {mode: ...}}} over the runs' calibration.jsonl."""
    rows, per_run = [], {}
    for d in run_dirs:
        path = Path(d) / "calibration.jsonl"
        if not path.exists():
            raise SystemExit(f"error: {path}: not found (was the run started with --calibrate M?)")
        r, note = report.read_calibration(path)
        if note:
            print(f"{d}: {note}")
        per_run[str(d)] = report.calibration_table(r, n_bins) if r else {}
        rows += r
    if not rows:
        raise SystemExit("error: no trust-check rows in the runs given")
    return {"pooled": report.calibration_table(rows, n_bins), "runs": per_run}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", help="run folders holding calibration.jsonl")
    p.add_argument("--out", default="", help="write trust_check.json and trust_check.png here")
    p.add_argument("--bins", type=int, default=5, help="equal-width λ bins of the reliability table")
    a = p.parse_args(argv)
    res = pooled(a.runs, a.bins)
    for name, table in [("pooled", res["pooled"])] + list(res["runs"].items()):
        print(f"\n{name}")
        for mode, t in table.items():
            decided = "n/a" if t["brier_decided"] is None else f"{t['brier_decided']:.4f}"
            print(f"  {mode:4s} tasks {t['n']:4d}  ties {t['ties']:4d}  Brier {t['brier']:.4f}  base rate "
                  f"{t['base_brier']:.4f}  without ties {decided}")
    print("\nreliability (pooled): λ bin, tasks, mean λ, share the fresh replay won (ties ½), mean fresh gain")
    for mode, t in res["pooled"].items():
        for b in t["bins"]:
            print(f"  {mode:4s} [{b['lo']:.1f}, {b['hi']:.1f})  {b['n']:4d}  "
                  f"{b['trust']:.3f}  {b['helped']:.3f}  {b['gain']:+.3f}")
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "trust_check.json").write_text(json.dumps({"runs_given": a.runs, **res}, indent=1))
        img = report.plot_calibration(res["pooled"], out / "trust_check.png")
        print(f"\nwrote {out / 'trust_check.json'}" + (f" and {out / 'trust_check.png'}" if img else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
