"""[ours] The trust check (`--calibrate M`, METHOD.md §5.7), a section the trainer runs after trust when asked:
each scored skill is replayed afresh against a fresh control, so that Eq. (9)'s λ can be held against an
independent measure of the skill's gain (calibration.jsonl; the report's Brier scores, harness/report.py)."""
from __future__ import annotations

import json

import shrinkage
from infra import distributed as D
from infra.distributed import all_gather_obj, all_reduce
from rollout import by_task, run_episodes


def calibrate(run, b, step: int) -> dict:
    """[ours] The trust check of METHOD.md §5.7: each scored skill is replayed afresh, `--calibrate` episodes
    with it and as many without (a fresh control), independent of the episodes its λ came from. One row
    per task in calibration.jsonl: λ as trained, Eq. (9)'s posterior under eb and raw trust, the replay
    gain it was computed from, and the fresh gain. These episodes train nothing and do not count
    toward --max_env_steps. A SIGTERM cuts them short at their next turn, like the rollouts (the step is then
    abandoned and its rows dropped). Returns the check's env steps and tasks (`calib/env_steps`, `calib/tasks`)."""
    a, M = run.args, run.args.calibrate
    idx = [k for k, r in enumerate(b.records) if r.replay_ok and r.posterior]
    rows, n_steps = [], 0
    if idx:
        tasks = [b.tasks[k] for k in idx]
        eps = run_episodes(run.engine, run.pool, tasks + tasks, M, history_len=a.history_len,
                           skills={j: b.records[k].skill for j, k in enumerate(idx)},   # first half: with the skill
                           temperature=a.temperature, constrained=a.constrained, stop=run.stop_now)
        n_steps = sum(len(e.steps) for e in eps)
        groups = by_task(eps, M)
        for j, k in enumerate(idx if not run.stop_now() else []):   # cut short: unfinished, no rows
            with_skill, control, rec = groups[j], groups[len(idx) + j], b.records[k]
            if any(e.error for e in with_skill + control):
                continue
            fresh, _ = shrinkage.replay_gain([e.reward for e in with_skill], [e.reward for e in control], a.r_win)
            rows.append({"step": step + 1, "task_id": rec.task_id, "task_type": rec.task_type, "gain": rec.gain,
                         "informative": rec.informative, "trust": rec.trust, "trust_eb": rec.posterior["eb"],
                         "trust_raw": rec.posterior["raw"], "fresh_gain": fresh})
    rows = [r for part in all_gather_obj(rows) for r in part]
    if D.RANK == 0 and rows:
        with open(run.run_dir / "calibration.jsonl", "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return {"calib/env_steps": int(all_reduce([n_steps])[0]), "calib/tasks": len(rows)}
