"""[ours] The replay gain (Eq. 3) where the truth is known: the trainer's own `write_skills`, `replay` and `trust`
(train.py) run on a simulated environment in which every task is won with a known probability p, and a skill in
the prompt adds a known effect that depends on whether the skill was written from a won or a lost episode.

It answers what no real environment can: is g_q, per task, an unbiased estimate of the skill's true effect,
for skills from won and from lost episodes alike, under each `--replay_control`? (METHOD.md §2.4 derives the
bias of the group control: a won-source task's control is known to hold a win, a lost-source task's to hold
none.) tests/test_replay_control.py asserts it; the command below compares the designs.

    python scripts/replay_sim.py                       # fresh / split / group at a 6% base rate
                                                       # (the default run's start)
    python scripts/replay_sim.py --p_mean 0.25 --won_effect 0.0 --lost_effect -0.1

Only the environment and the generator are simulated, and only in the way that the estimator cannot tell
apart from a real run: an episode is one step, won with probability clip(p + effect, 0, 1), and the
"policy" writes a skill that says which kind of episode it read. Everything between them is the trainer's code.
"""
from __future__ import annotations

import argparse
import math
import random
import re
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))                 # the repository root
sys.path.insert(0, str(ROOT / "tests"))       # the simulated pool and generator: tests/env_doubles.py
import train as T  # noqa: E402
from env_doubles import SimEngine, SimPool  # noqa: E402
from harness.run import Run  # noqa: E402
from rollout import run_episodes  # noqa: E402

def simulate(args, n_steps: int, p_of, effects: dict[str, float], seed: int = 0) -> tuple[list[dict], int]:
    """`n_steps` steps of B = args.tasks_per_step tasks through train.write_skills → replay → share_records →
    skill_advantages → trust, each task's p drawn by `p_of(rng)`. Returns one dict per task whose skill was replayed
    (p, source, true effect: the change in win probability its skill makes, g, v, λ, informative), and the
    env steps spent (one per episode: rollouts, replays and fresh controls)."""
    rng = random.Random(seed)
    p = {f"task{i}": p_of(rng) for i in range(n_steps * args.tasks_per_step)}
    pool = SimPool(p, effects, seed)
    run = Run(args, Path("."), torch.device("cpu"), None, [], pool, engine=SimEngine(),
              skill_rng=random.Random(seed + 1))
    out = []
    names = list(p)
    for step in range(n_steps):
        tasks = [{"gamefile": t} for t in names[step * args.tasks_per_step:(step + 1) * args.tasks_per_step]]
        eps = run_episodes(run.engine, pool, tasks, args.group_size, history_len=args.history_len)
        records = [T.TaskRecord(t["gamefile"], "pick") for t in tasks]
        b = T.Batch(tasks, eps, [tr for e in eps for tr in e.turns], [], records)
        T.write_skills(run, b)
        T.replay(run, b)
        recs = T.share_records(b)
        T.skill_advantages(run, recs)
        T.trust(run, recs, replayed=True)
        for r in recs:
            if r.replay_ok:
                base = p[r.task_id]
                out.append({"p": base, "source": r.source, "gain": r.gain, "var": r.var, "trust": r.trust,
                            "informative": r.informative,
                            "effect": min(1.0, max(0.0, base + effects[r.source])) - base})
    return out, pool.env_steps


def summarize(rows: list[dict], n_tasks: int) -> dict:
    """Per source: share of tasks, mean g − true effect (bias) and its standard error, RMSE of g against the
    true effect, mean λ; over all: how often λ ranks a won-source skill above a lost-source one (AUC)."""
    out = {}
    for source in ("won", "lost"):
        rs = [r for r in rows if r["source"] == source]
        if not rs:
            continue
        err = np.array([r["gain"] - r["effect"] for r in rs])
        out[source] = {"share": len(rs) / n_tasks, "bias": float(err.mean()),
                       "se": float(err.std(ddof=1) / math.sqrt(len(rs))) if len(rs) > 1 else float("nan"),
                       "rmse": float(np.sqrt((err ** 2).mean())), "trust": float(np.mean([r["trust"] for r in rs])),
                       "gain": float(np.mean([r["gain"] for r in rs])),
                       "negative": float(np.mean([r["gain"] < 0 for r in rs]))}
    won = [r["trust"] for r in rows if r["source"] == "won"]
    lost = [r["trust"] for r in rows if r["source"] == "lost"]
    if won and lost:
        out["auc"] = float(np.mean([(w > l) + 0.5 * (w == l) for w in won for l in lost]))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--p_mean", type=float, default=0.06, help="mean win probability of a task without a skill")
    ap.add_argument("--p_conc", type=float, default=4.0, help="task p ~ Beta(p_mean·c, (1 − p_mean)·c)")
    ap.add_argument("--won_effect", type=float, default=0.18, help="a won-source skill's effect on the win probability")
    ap.add_argument("--lost_effect", type=float, default=0.0, help="a lost-source skill's effect")
    ap.add_argument("--steps", type=int, default=250, help="steps of 8 tasks")
    ap.add_argument("--group_size", type=int, default=8)
    ap.add_argument("--replay_m", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    p_of = lambda rng: rng.betavariate(a.p_mean * a.p_conc, (1 - a.p_mean) * a.p_conc)   # noqa: E731
    effects = {"won": a.won_effect, "lost": a.lost_effect}
    print(f"base rate {a.p_mean}, effects {effects}, N {a.group_size}, M {a.replay_m}, {a.steps} steps x 8 tasks")
    print(f"{'control':8s} {'groups':7s} {'source':7s} {'share':>6s} {'E[g]':>7s} {'effect':>7s} {'bias ± se':>15s} "
          f"{'P(g<0)':>7s} {'RMSE':>6s} {'mean λ':>7s} {'AUC':>5s} {'episodes/task':>14s}")
    for design in ("fresh", "split", "group"):
        for groups in ("all", "won"):
            args = T.Args(algo="rsipo", group_size=a.group_size, replay_m=a.replay_m, tasks_per_step=8,
                          replay_control=design, skill_groups=groups, history_len=0)
            rows, env_steps = simulate(args, a.steps, p_of, effects, seed=a.seed)
            s = summarize(rows, a.steps * 8)
            for source in ("won", "lost"):
                if source not in s:
                    continue
                x = s[source]
                eff = float(np.mean([r["effect"] for r in rows if r["source"] == source]))
                print(f"{design:8s} {groups:7s} {source:7s} {x['share']:6.2f} {x['gain']:+7.3f} {eff:+7.3f} "
                      f"{x['bias']:+8.3f} ± {x['se']:.3f} {x['negative']:7.2f} {x['rmse']:6.3f} {x['trust']:7.3f} "
                      f"{s.get('auc', float('nan')):5.2f} {env_steps / (a.steps * 8):14.2f}")


if __name__ == "__main__":
    main()
