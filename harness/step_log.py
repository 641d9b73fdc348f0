"""What one RL step logs: its row of metrics.jsonl (`step_row`), built from what `train.rl_step`'s sections
computed, and the parts it is made of: the skills (`skill_metrics`), trust and the replay (`trust_metrics`), the
teacher's view of the student's own tokens (`teacher_gaps`), and why a step trains nothing (`idle_reason`). The
sections compute and return; only these functions turn their results into figures. Each figure's meaning is in
METHOD.md §5.8 and the report (harness/report.py) reads them."""
from __future__ import annotations

from typing import Optional

import numpy as np

from harness.config import Args
from harness.run import Run
from infra.distributed import all_gather_obj, all_reduce, all_reduce_named, print0
from rollout import sampler_gap

# The annotations name train.py's records (Batch, Sample, TaskRecord): strings, never evaluated; nothing imports train.


def step_row(run: Run, step: int, b: Batch, samples: list[Sample], skill_samples: list[Sample], extra: dict,
             skills: Optional[list[TaskRecord]] = None, fit: Optional[dict] = None,
             seen: Optional[dict] = None) -> dict:
    """The step's row of metrics.jsonl, built from what its sections computed: the totals every step logs (over
    ranks, one collective); GiGPO's anchors; the skills, their replay and trust (`skills`: every rank's records,
    opsd/rsipo; `fit`: the EB fit); the sampler against the trainer (`rollout.sampler_gap`); the teacher's view
    of the student's tokens and how much of its skill it sees (`seen`); a step that trains nothing (`idle_reason`,
    said once on the console and counted in the summary); then `extra` (the update's metrics, the sections'
    times). Also keeps the step's last won and lost episode (for the report)."""
    eps = b.eps + b.replay_eps
    t = all_reduce_named({
        "won": sum(e.won for e in b.eps), "episodes": sum(e.error is None for e in b.eps),
        "reward": sum(e.reward for e in b.eps if e.error is None),
        "invalid": sum(tr.invalid for tr in b.turns), "turns": len(b.turns),
        "env_errors": sum(e.error is not None for e in b.eps), "turns_updated": len(samples),
        "gen_tokens": sum(len(tr.response_ids) for tr in b.turns),
        "seq_tokens": sum(len(sm.prompt_ids) + len(sm.response_ids) for sm in samples + skill_samples),
        "seq_tokens_sq": sum((len(sm.prompt_ids) + len(sm.response_ids)) ** 2 for sm in samples + skill_samples),
        "response_tokens": sum(len(sm.response_ids) for sm in samples + skill_samples),
        "env_steps": sum(len(e.steps) for e in eps), "prompt_overflow": sum(e.overflow for e in eps),
        "teacher_overflow": b.teacher_overflow})
    run.env_steps += int(t["env_steps"])
    run.summary["env/ok_episodes"] = run.summary.get("env/ok_episodes", 0) + int(t["episodes"])
    if t["env_errors"] and not t["episodes"]:   # every episode of the step broke: say how (a collective)
        first = next(x for x in all_gather_obj(next((e.error for e in b.eps if e.error), None)) if x)
        run.summary.setdefault("env/first_error", first)
        print0(f"warning: step {step + 1}: every one of its {int(t['env_errors'])} episodes ended in an env error, "
               f"so it learns nothing; the first: {first}")
    n = max(1, t["episodes"])
    for key, won in (("won", True), ("lost", False)):
        e = next((e for e in reversed(b.eps) if e.won == won), None)
        if e is not None:
            run.episodes[key] = {"task": e.task, "task_type": e.task_type, "skill": b.records[e.group_id].skill,
                                 "reward": e.reward, "won": e.won, "steps": [list(s) for s in e.steps],
                                 "step": step + 1}
    row = {"step": step + 1, "train/success": t["won"] / n, "train/reward": t["reward"] / n,
           "train/invalid_frac": t["invalid"] / max(1, t["turns"]), "train/turns": int(t["turns"]),
           "train/env_errors": int(t["env_errors"]), "train/turns_updated": int(t["turns_updated"]),
           "rollout/gen_tokens": int(t["gen_tokens"]), "update/seq_tokens": int(t["seq_tokens"]),
           "update/seq_tokens_sq": int(t["seq_tokens_sq"]), "update/response_tokens": int(t["response_tokens"]),
           "train/env_steps": int(t["env_steps"]), "train/env_steps_total": run.env_steps,
           "rollout/prompt_overflow": int(t["prompt_overflow"]), "teacher/prompt_overflow": int(t["teacher_overflow"])}
    if b.anchored_frac is not None:
        row["gigpo/anchored_frac"] = b.anchored_frac
    if skills is not None:
        row.update(skill_metrics(run, skills))
        row.update(trust_metrics(skills, fit, len(run.bank) if run.args.bank_teacher else None))
    # the sampler's log-probs against π_old on the freely sampled tokens (top-p 1, unconstrained)
    row.update(sampler_gap([(sm.old, sm.sampled) for sm in samples + skill_samples if sm.sampled is not None]))
    if seen is not None and seen["prompts"]:
        row.update({"teacher/skill_tokens": seen["seen"] / seen["prompts"],
                    "teacher/skill_token_share": seen["seen"] / max(1, seen["total"])})
    row.update(teacher_gaps(run, [sm for sm in samples if sm.teacher is not None]))
    reason = idle_reason(run.args, b, samples, skill_samples)
    if reason:                            # [ours] a step that trains nothing says so, once, and is counted
        print0(f"warning: step {step + 1} updates nothing: {reason}")
        run.summary["update/idle_steps"] = run.summary.get("update/idle_steps", 0) + 1
        row.update({"update/idle": 1, "update/idle_reason": reason})
    return {**row, **extra}


def skill_metrics(run: Run, recs: list[TaskRecord]) -> dict:
    """The skills of the step, all ranks: how many tasks wrote one, how many are valid, their rewards (Eq. 5's
    g̃), their length, what the written ones name of their game (`Run.skill_facts`, where the preset knows the
    games), also by the outcome of the episode each was written from (won / lost)."""
    a, m = run.args, {}
    written = [r for r in recs if r.source is not None]
    rewards = [r.skill_reward(a.r_bad) for r in written]
    facts = [f for r in recs if r.skill and r.source in ("won", "lost") and run.skill_facts is not None
             for f in [run.skill_facts(r.skill, r.task_id)] if f]
    for key in ("object", "target", "place") if facts else ():
        m[f"skill/names_{key}"] = float(np.mean([f[key] for f in facts]))
    m["skill/written_frac"] = len(written) / max(1, len(recs))
    if written:                           # a step where no task wrote a skill has no validity or reward to log
        m.update({"skill/valid_frac": sum(r.skill is not None for r in written) / len(written),
                  "skill/rule_failed": float(sum(r.rule_failed for r in written)),
                  "skill/reward_mean": float(np.mean(rewards))})
    words = [len(r.skill.split()) for r in recs if r.skill]
    if words:
        m["skill/words"] = float(np.mean(words))
    for source in ("won", "lost"):
        mine = [g for r, g in zip(written, rewards) if r.source == source]
        m[f"skill/{source}_sources"] = float(len(mine))
        if mine:
            m[f"skill/{source}_reward"] = float(np.mean(mine))
    return m


def trust_metrics(recs: list[TaskRecord], fit: Optional[dict], bank: Optional[int] = None) -> dict:
    """λ and the replay gains of the step, all ranks: trust's mean and the share of tasks with a teacher; with a
    replay (`fit`, the EB fit) the shrinkage, the raw and shrunk gains, the uninformative replays, the gain per
    task type, and the gain and λ by the outcome of the skill's source episode; under --bank_teacher (`bank`: the
    bank's size) how many tasks the bank taught, and their mean λ."""
    ok = [r for r in recs if r.replay_ok]
    lam = np.array([r.trust for r in recs])
    m = {}
    if fit is not None:
        g, types = [r.gain for r in ok], [r.task_type for r in ok]
        m.update({"trust/shrink_mean": float(np.mean(fit["shrink"])),
                  "replay/shrunk_gain_mean": float(np.mean(fit["mean"])),
                  "replay/gain_mean": float(np.mean(g)),
                  "replay/uninformative": float(sum(not r.informative for r in ok))})
        for t in sorted(set(types)):
            m[f"replay/gain_{t}"] = float(np.mean([x for x, tx in zip(g, types) if tx == t]))
        for source in ("won", "lost"):
            mine = [r for r in ok if r.source == source]
            if mine:
                m[f"replay/{source}_gain"] = float(np.mean([r.gain for r in mine]))
                m[f"trust/{source}_mean"] = float(np.mean([r.trust for r in mine]))
    banked = [r.trust for r in recs if r.bank_skill is not None]
    if bank is not None:                  # [ours] --bank_teacher: 0 taught while the bank is empty
        m.update({"bank/skills": float(bank), "bank/taught": float(len(banked))})
        m.update({"bank/trust_mean": float(np.mean(banked))} if banked else {})
    m.update({"trust/mean": float(lam.mean()) if len(lam) else 0.0,
              "trust/frac_teacher": float((lam > 0).mean()) if len(lam) else 0.0,
              "replay/failed": float(sum(r.skill is not None for r in recs) - len(ok))})
    return m


def teacher_gaps(run: Run, scored: list[Sample]) -> dict:
    """[ours] How the teacher rates the student's own tokens before the update, d = ℓ^T − ℓ^old per token, all
    ranks: its mean, the share of tokens the gate of Eq. (11) would open (d > 0: σ(β·d) > ½), the sampled
    estimates of KL(π_old‖π_T) (k1: mean −d; k3: mean e^d − d − 1), the mean by the turn's index in its
    episode, and over the turns whose action uses the tool of its task type's procedure (the sink for clean:
    `Run.tool_action`, where the preset knows it) against the rest. Where the teacher carries a procedure the
    student lacks, the tool turns' gap is the larger."""
    sums: dict[str, float] = {}

    def add(key, d):
        sums[f"{key}/sum"] = sums.get(f"{key}/sum", 0.0) + float(d.sum())
        sums[f"{key}/n"] = sums.get(f"{key}/n", 0.0) + d.numel()
    for sm in scored:
        d = (sm.teacher - sm.old).float()                                # [r]
        action = run.pool.parse_action(sm.turn.response_text) or ""
        kind = "tool" if run.tool_action is not None and run.tool_action(action, sm.turn.task_type) else "other"
        add(f"gap_{kind}", d)
        add("gap_mean", d)
        add(f"gap_turn{min(sm.turn.step, 5)}", d)
        add("gate_gt_half", (d > 0).float())
        add("kl_k1", -d)
        add("kl_k3", d.exp() - d - 1)
    keys = [f"{k}/{x}" for k in ("gap_tool", "gap_other", "gap_mean", "gate_gt_half", "kl_k1", "kl_k3")
            + tuple(f"gap_turn{t}" for t in range(6)) for x in ("sum", "n")]
    tot = all_reduce_named({k: sums.get(k, 0.0) for k in keys})
    out = {}
    for key in dict.fromkeys(k.rsplit("/", 1)[0] for k in keys):
        if tot[f"{key}/n"]:
            name = key if key != "gap_turn5" else "gap_turn5plus"
            out[f"teacher/{name}"] = float(tot[f"{key}/sum"] / tot[f"{key}/n"])
    for kind in ("tool", "other"):
        if tot[f"gap_{kind}/n"]:
            out[f"teacher/tokens_{kind}"] = int(tot[f"gap_{kind}/n"])
    return out


def idle_reason(a: Args, b: Batch, samples: list[Sample], skill_samples: list[Sample]) -> Optional[str]:
    """Why no sample of the step, on any rank, carries a learning signal (a policy gradient, a trusted teacher
    or a skill-writing advantage), or None when one does (a collective)."""
    turns, invalid, pg, taught, skill = all_reduce([
        len(b.turns), sum(tr.invalid for tr in b.turns), sum(s.adv != 0 for s in samples),
        sum(s.trust > 0 for s in samples) if a.alpha > 0 else 0,
        sum(s.adv != 0 for s in skill_samples) if a.eta else 0])
    if pg or taught or skill:
        return None
    if not turns:
        return "no turn was played"
    why = ("the reward is off (--distill_only)" if a.distill_only else
           "every turn was invalid (no parsable action), so every group is tied" if invalid == turns else
           "every group is tied (all its turns scored alike), so every advantage is 0")
    return why + ("; and no turn has a trusted teacher (λ = 0)" if a.uses_skills and a.alpha > 0 else "")
