"""[ours] Whether two runs logged the same metrics: every row of metrics.jsonl, every key but the time and memory
ones, compared exactly. A refactor that keeps behaviour shows 0 differing values on fixed-seed runs:

    python train.py --model <a tiny checkpoint> --algo rsipo --steps 2 --tasks_per_step 4 --eval false \\
        --save_every 0 --out_dir runs/before --run_name rsipo          # at the old commit, then at the new one
    python scripts/same_metrics.py runs/before/rsipo runs/after/rsipo
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

VOLATILE = ("time/", "mem/")   # wall-clock and memory figures differ between any two runs


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def differences(before: list[dict], after: list[dict]) -> list[str]:
    """Each differing value as "row i: key: before → after"; a row or a key present on one side only counts."""
    out = [f"rows: {len(before)} → {len(after)}"] if len(before) != len(after) else []
    for i, (a, b) in enumerate(zip(before, after)):
        for k in sorted(set(a) | set(b)):
            if not k.startswith(VOLATILE) and a.get(k, "<absent>") != b.get(k, "<absent>"):
                out.append(f"row {i}: {k}: {a.get(k, '<absent>')} → {b.get(k, '<absent>')}")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("before", type=Path)
    p.add_argument("after", type=Path)
    a = p.parse_args(argv)
    before, after = rows(a.before), rows(a.after)
    diff = differences(before, after)
    n = sum(len([k for k in r if not k.startswith(VOLATILE)]) for r in before)
    print(f"{a.before} vs {a.after}: {len(before)} rows, {n} values compared, {len(diff)} differ")
    for d in diff:
        print("  " + d)
    return 1 if diff else 0


if __name__ == "__main__":
    sys.exit(main())
