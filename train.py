"""RSIPO trainer: the warm start and the RL loop, one step of which runs the method's sections in order.

    python train.py                                   # the tiny CPU default (clean held out): RSIPO, ~10 min on 2 cores
    python train.py --algo grpo                       # the GRPO baseline (--algo opsd: SEED/SDAR-style)
    torchrun --nproc_per_node 2 train.py --steps 2 --sft_steps 40 --tasks_per_step 2 --group_size 2
    python train.py --model smollm2 --steps 2 ...     # a real pretrained model on CPU (README)
    torchrun --nproc_per_node 8 train.py --engine vllm --model Qwen/Qwen2.5-7B-Instruct ...   # recipes/README.md

One RL step (`rl_step`) calls, in the order of METHOD.md §2:
    rollout_and_advantages (Eq. 1) → write_skills (Eq. 2; or give_skills, --teacher_skill) → replay (Eq. 3-4) →
    share_records → skill_advantages (Eq. 5) → trust (Eq. 6-9) → keep_skills (§2.10) →
    calibrate (--calibrate) → training_samples → score_policy (old / reference log-probs) →
    score_teacher (the teacher, its support, the skill-in-prompt check) →
    update (Eq. 10-12: teacher_inputs, teacher_loss, rsipo_loss) → sync_weights →
    follow_policy (the teacher's own weights) → step_row (what the step logs)
each inside one `Sections` context (harness/run.py: timed, and before the update a SIGTERM check after it).
`--algo grpo` runs rollout, scoring, update; `opsd` adds skills and the teacher with λ ≡ 1; `rsipo` all of it.
`rl_step` alone decides which sections run; the file follows it: the records, the step, its sections in call
order, the update in its parts, then the warm start, the reference and `main`.
Every section is a function of the `Run` (what the whole run holds) and the step's `Batch`; a test can call
each on its own. Per task, the sections fill one `TaskRecord`; the records are gathered once a step. The sections
compute and return; one place, `step_row` (harness/step_log.py, "What a step logs"), builds the metrics row.
`main` reads as the run's phases: step → evaluate → log → save. The plumbing below them (set-up, resume,
checkpoints, SIGTERM behind `Preemption`, the files written at the end) is harness/run.py; the flags and presets
harness/config.py; SFT harness/sft.py; ranks and sharding infra/distributed.py; the tiny model and its data (and
SmolLM2) harness/tiny.py.

Choices, all **[ours]** (METHOD.md §5 gives the reasons):
1. On the HF engine each rank rolls out with an unsharded copy of the policy (the rollout weights, π_old),
   synced after every update: the CPU analogue of pushing weights into vLLM; no-grad passes need no FSDP
   collectives. With vLLM (GPU) there is no copy: the FSDP2 policy scores π_old before the update.
2. Config (harness/config.py): `Args` holds the released settings a real model gets; named presets replace
   some of them for the flags not given: `tiny` (the CPU model), `heldout` (the default run, `--preset`),
   `search`, `gigpo`, `gpu`. `--help` shows them; the run prints each changed default with its source, and
   saves its resolved config (config.json).
3. RL tasks are drawn evenly over task types (`--tasks_by_type`, `draw_tasks`) or uniformly (the papers').
4. `--drop_zero_adv` leaves advantage-0 turns without a teacher out of the update; `--opsd_keep p` keeps a
   fraction p of the teacher-only ones (their only signal is the OPSD term).
5. The analyzer reads a won episode of the task when there is one, and a group with no win writes no skill
   (--skill_groups); a skill must name its task's object and target (--skill_rule); the replay's control is
   M fresh skill-free episodes, never the group the source was chosen from (--replay_control, METHOD.md
   §2.4); a task whose replay hit an env error is left out of trust and Eq. 5; a replay that agrees entirely
   with its control gives no teacher.
6. Evaluation samples at T 0.4 with common random numbers (rollout.evaluate); the held-out gain is paired
   over games (`eval/gain` ± `eval/gain_se`).
"""
from __future__ import annotations

import copy
import dataclasses
import math
import random
import shutil
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

import rsipo
import shrinkage
from harness import tiny
from harness.config import Args, parse_args
from harness.run import (Preemption, Run, Sections, build_policy, compute_dtype, evaluate_and_print, finish,
                         load_policy, log_row, progress, resume, save, save_policy, setup, teardown, watch_step)
from harness.sft import load_sft_jsonl, sft
from harness.calibration import calibrate
from harness.step_log import step_row
from infra import distributed as D
from infra.io import write_text
from infra.distributed import (aligned_micro_batches, all_gather_obj, all_reduce, all_reduce_named, all_reduce_union,
                               print0, shard)
from rollout import (Episode, Generation, Support, Turn, by_task, collate, fit_prompt, run_episodes, sampler_gap,
                     task_line, teacher_pair, token_logprobs_of)
from skills import ANALYZER_MAX_STEPS, adapt_skill, analyzer_prompt, names_task, parse_skill


# ---- One step's records ------------------------------------------------------------------------------------------

@dataclass
class TaskRecord:
    """One task of a step: what write_skills, replay and trust compute for it. Gathered once a step."""
    task_id: str
    task_type: str
    source: Optional[str] = None          # the outcome of the episode the skill was written from: "won" or "lost"
                                          # (or the --teacher_skill given); None = no skill written
    skill: Optional[str] = None           # Eq. (2): the parsed skill; None when invalid or not written
    rule_failed: bool = False             # the last answer parsed but broke the skill rule (--skill_rule)
    gain: Optional[float] = None          # g_q, Eq. (3); None until a replay measures it
    var: float = 0.0                      # v_q, Eq. (4)
    replay_ok: bool = False               # a valid skill whose replays ran without env errors
    informative: bool = True              # replays and control did not all win, or all lose
    shrunk: float = 0.0                   # ĝ_q, Eq. (8), of a replayed skill
    trust: float = 0.0                    # λ_q, Eq. (9); 0 = no teacher signal for the task's turns
    skill_adv: Optional[float] = None     # A^skill_q, Eq. (5); None = no skill sample
    posterior: Optional[dict] = None      # [ours] --calibrate: Eq. (9)'s λ under trust modes eb and raw
    task: str = ""                        # the task sentence (the bank keeps it with the skill written for it)
    bank_skill: Optional[str] = None      # [ours] --bank_teacher: the banked skill its teacher reads, made over

    def teacher_skill(self) -> Optional[str]:   # the skill in the teacher's prompt: the bank's, else its own
        return self.bank_skill or self.skill

    def skill_reward(self, r_bad: float) -> float:
        """Eq. (5)'s g̃ of a task that wrote a skill: its replay gain, or r_bad for an invalid skill (and, in the
        metrics only, for a valid one without a measured gain: never replayed, or its replay failed). The trainer's
        one place r_bad stands in for a gain (rsipo.skill_advantages, a library function, applies the same rule)."""
        return self.gain if self.skill is not None and self.gain is not None else r_bad


@dataclass
class Batch:
    """One step's data on this rank: K tasks, N episodes each (task-major), their turns and advantages."""
    tasks: list[dict]
    eps: list[Episode]
    turns: list[Turn]
    adv: list[float]                      # Eq. (1), one per turn
    records: list[TaskRecord]
    skill_gens: list[Generation] = field(default_factory=list)   # the skill-writing responses, per task
    replay_eps: list[Episode] = field(default_factory=list)
    teacher_overflow: int = 0             # kept turns whose teacher prompt did not fit (no teacher signal)
    anchored_frac: Optional[float] = None  # GiGPO: the share of turns in an anchor-state group of two or more


@dataclass
class Sample:
    """One sequence of the update: a student turn or a skill-writing response (METHOD.md §2.8)."""
    prompt_ids: list[int]
    response_ids: list[int]
    adv: float                                  # Eq. (1) for turns, Eq. (5) for skills
    old: torch.Tensor                           # [r] log π_old of the response tokens
    ref: Optional[torch.Tensor] = None          # [r] log π_ref
    teacher: Optional[torch.Tensor] = None      # [r] ℓ^T: same tokens, skill in the prompt (§2.7)
    support: Optional[Support] = None           # the teacher's side of Eq. (11c-d): its support, log-probs, tail
    student_top: Optional[torch.Tensor] = None  # [r, K] π_old's top-K ids (a student-side support), until scored
    teacher_prompt: Optional[list[int]] = None  # the teacher's prompt ids (§2.9), checked to hold its skill
    trust: float = 0.0                          # λ_q, Eq. (9); 0 wherever `teacher` is None (`score_teacher`)
    skill: bool = False                         # a skill-writing sample: weight η, no teacher
    turn: Optional[Turn] = None                 # the student turn it came from
    sampled: Optional[list[float]] = None       # the sampler's log-probs, where comparable with π_old (free sampling)


# ---- One RL step, section by section (METHOD.md §2) --------------------------------------------------------------

def rl_step(run: Run, step: int) -> dict:
    """One step of the method; returns its row of metrics.jsonl. Which sections run is decided here, and only
    here: grpo and gigpo roll out, score and update; opsd adds skills (its own, or with --teacher_skill the games'
    given ones) and a teacher that trusts every valid one (λ ≡ 1); rsipo replays each skill, trusts it by its
    replay gain, trains the skill writer (Eq. 5) and banks the validated skills. Between the sections before the
    update, a SIGTERM on any rank abandons the step (`Preemption`). The sections compute; what the step logs is
    built from their results at the end (`step_row`, harness/step_log.py)."""
    a = run.args
    section = Sections(run.preempt)       # each section timed; before the update, a SIGTERM check after each
    rsipo_sections = a.algo == "rsipo"
    recs, fit, calib = [], None, {}
    with section("rollout"):
        b = rollout_and_advantages(run)
    if a.uses_skills:
        with section("skills"):
            (write_skills if a.teacher_skill == "own" else give_skills)(run, b)
        if rsipo_sections:
            with section("replay"):
                replay(run, b)
        with section("trust"):
            recs = share_records(b)
            if rsipo_sections:
                skill_advantages(run, recs)
            fit = trust(run, recs, replayed=rsipo_sections)
            if rsipo_sections:
                keep_skills(run, recs, step)
            if a.bank_teacher:
                bank_teachers(run, recs)
        if a.calibrate:
            with section("calibrate"):
                calib = calibrate(run, b, step)
    with section("score"):                # the last point to abandon: the update changes the weights
        samples, skill_samples = training_samples(run, b)
        score_policy(run, samples, skill_samples)
        seen = score_teacher(run, b, samples)
    with section("update", check=False):
        update_metrics = update(run.model, run.opt, samples + skill_samples, UpdateConfig.from_args(a),
                                run.tok.pad_token_id, run.device, use_teacher=a.uses_skills)
    with section("sync", check=False):
        sync_weights(run)
        follow_policy(run, step)
    step_time = {**section.timer.times, "time/step": time.time() - section.timer.t0}
    return step_row(run, step, b, samples, skill_samples, {**update_metrics, **step_time, **calib},
                    skills=recs if a.uses_skills else None, fit=fit, seen=seen)


def rollout_and_advantages(run: Run) -> Batch:
    """Student rollouts (§2.1): N episodes of each of this rank's tasks from the same start, then their
    advantages (`advantages`). An episode that an env error cut short (a worker crash, a timeout) is no outcome of
    the policy: its turns are left out of the group statistics and the update, as of the success rate
    (`train/env_errors` counts them)."""
    a = run.args
    N = run.args.group_size
    picks = draw_tasks(run.task_rng, run.data.train_types, a.tasks_per_step, a.tasks_by_type)
    tasks = [{run.pool.task_key: run.data.train[i]} for i in picks[D.RANK::D.WORLD]]
    eps = run_episodes(run.engine, run.pool, tasks, N, history_len=a.history_len, temperature=a.temperature,
                       constrained=a.constrained, reserve=run.skill_reserve, stop=run.stop_now)   # group id = task k
    turns = policy_turns(eps)
    adv, anchored = advantages(eps, turns, a)
    records = [TaskRecord(t[run.pool.task_key], group[0].task_type, task=group[0].task)
               for t, group in zip(tasks, by_task(eps, N))]
    return Batch(tasks, eps, turns, adv, records, anchored_frac=anchored)


def policy_turns(eps: list[Episode]) -> list[Turn]:
    """The turns of the episodes that ended without an env error: the outcomes of the policy."""
    return [tr for e in eps if e.error is None for tr in e.turns]


def advantages(eps: list[Episode], turns: list[Turn], a: Args) -> tuple[list[float], Optional[float]]:
    """Eq. (1) over each task's turn-samples (`turns`, indexed into `eps` by episode id), with the format penalty of
    unparsable turns; `--adv_norm mean` leaves out the division by the std (verl-agent's mean_norm). GiGPO's step
    term (`--step_adv` ω): each step's γ-discounted return of the env rewards over every step of its episode (a
    step whose turn was dropped keeps its place), minus that turn's own format penalty, as verl-agent scores a
    step; normalised within anchor-state groups (the turns of a task's group that acted on the same observation).
    `--distill_only`: every advantage 0. Returns one advantage per turn, and with the step term the share of
    turns in an anchor group of two or more (else None)."""
    std_norm = a.adv_norm == "mean_std"
    if not turns or a.distill_only:       # [ours] reward off: the teacher term alone trains (channel_check.py)
        return [0.0] * len(turns), None
    R = torch.tensor([eps[tr.episode_id].reward for tr in turns])             # [T] episode rewards
    invalid = torch.tensor([tr.invalid for tr in turns])                      # [T]
    gid = torch.tensor([tr.group_id for tr in turns])                         # [T]
    adv = rsipo.group_advantages(rsipo.turn_scores(R, invalid, a.p_fmt), gid, std_norm=std_norm)   # [T] Eq. (1)
    anchored = None
    if a.step_adv > 0:                    # GiGPO's step term
        score = step_scores(eps, turns, a.step_gamma, a.p_fmt)                # [T]
        anchors: dict = {}
        aid = torch.tensor([anchors.setdefault((tr.group_id, eps[tr.episode_id].steps[tr.step][0]), len(anchors))
                            for tr in turns])                                  # [T] anchor-state group ids
        adv = adv + a.step_adv * rsipo.step_advantages(score, aid, std_norm=std_norm).to(adv.dtype)
        anchored = float((torch.bincount(aid)[aid] > 1).float().mean())
    return adv.tolist(), anchored


def step_scores(eps: list[Episode], turns: list[Turn], gamma: float, p_fmt: float) -> torch.Tensor:
    """GiGPO's score of each turn's step, as verl-agent computes it: G_t = r_t + γ·G_{t+1} over every step of the
    episode's env rewards (a step whose turn was dropped keeps its place in the chain), then that turn's own
    format penalty, s_t = G_t − p_fmt·invalid_t (an invalid turn lowers only its own row). Returns [T] float64."""
    G = {k: rsipo.step_returns(torch.tensor(eps[k].step_rewards, dtype=torch.float64),
                               torch.zeros(len(eps[k].step_rewards), dtype=torch.long), gamma)
         for k in {tr.episode_id for tr in turns}}                           # episode → [steps] returns
    invalid = torch.tensor([tr.invalid for tr in turns], dtype=torch.float64)
    return torch.stack([G[tr.episode_id][tr.step] for tr in turns]) - p_fmt * invalid


def draw_tasks(rng: random.Random, types: list[str], n: int, by_type: bool) -> list[int]:
    """Indices of this step's RL tasks: n distinct tasks uniformly, or by_type [ours]: task types in a
    shuffled cycle (as even as n allows), a uniformly drawn unused task of each."""
    n = min(n, len(types))
    if not by_type:
        return rng.sample(range(len(types)), n)
    pools: dict[str, list[int]] = {}
    for i, t in enumerate(types):
        pools.setdefault(t, []).append(i)
    order = sorted(pools)
    rng.shuffle(order)
    out: list[int] = []
    while len(out) < n:
        for t in order:
            if len(out) < n and pools[t]:
                out.append(pools[t].pop(rng.randrange(len(pools[t]))))
    return out


def source_and_control(group: list[Episode], design: str) -> tuple[list[Episode], list[Episode]]:
    """[ours] (--replay_control) The rollouts of one task that the skill's source may be drawn from, and those
    that are the skill-free control of Eq. (3): split, the first N/2 and the other N/2; fresh, all N and none
    (the control is played beside the replays); group, all N and all N. Only a control that had no part in
    choosing the source measures the skill without bias (METHOD.md §2.4)."""
    if design == "split":
        half = len(group) // 2
        return group[:half], group[half:]
    return group, (group if design == "group" else [])


def analyzer_prompt_fit(engine, episode: Episode, max_words: int, budget: int) -> Optional[str]:
    """The analyzer prompt (Eq. 2) for one episode with its latest steps that fit `budget` tokens (the oldest
    go first), or None when even none fit."""
    return fit_prompt(lambda n: analyzer_prompt(episode.task, episode.won, episode.steps, max_words, max_steps=n),
                      ANALYZER_MAX_STEPS, engine.prompt_len, budget)


def write_skills(run: Run, b: Batch):
    """Eq. (2): for each task the policy reads one of its episodes through the analyzer prompt and writes a
    skill. The source is a won episode when there is one [ours]; a group with no win writes avoidance rules
    from a lost episode (--skill_groups all) or no skill (won [ours]). An answer that does not parse, or that
    breaks the skill rule (--skill_rule [ours]: it must name the task's object and target), is retried once
    (§2.3). An analyzer prompt shows the episode's latest steps that fit the prompt budget; one that cannot
    fit writes no skill."""
    a = run.args
    b.skill_gens = [Generation("", [], [], [])] * len(b.records)
    chosen: list[Optional[Episode]] = []
    for rec, group in zip(b.records, by_task(b.eps, a.group_size)):
        candidates, _ = source_and_control(group, a.replay_control)
        won = [e for e in candidates if e.won]
        if won or a.skill_groups == "all":
            source = run.skill_rng.choice(won or candidates)
            rec.source = "won" if source.won else "lost"
            chosen.append(source)
        else:
            chosen.append(None)           # [ours] no win to distil: no skill, no replay, no teacher
    prompts = [None if e is None else analyzer_prompt_fit(run.engine, e, a.skill_max_words, a.max_prompt_tokens)
               for e in chosen]
    for attempt in range(2):              # the first try, then one retry of the invalid ones
        todo = [k for k, p in enumerate(prompts) if p is not None and (attempt == 0 or b.records[k].skill is None)]
        if not todo:
            break
        gens = run.engine.generate([prompts[k] for k in todo], temperature=a.skill_temperature,
                                   max_new_tokens=run.skill_max_tokens, stop=False)
        for k, gen in zip(todo, gens):
            rec = b.records[k]
            skill = parse_skill(gen.text, a.skill_max_words)
            terms = run.pool.task_terms(chosen[k].task)
            rec.rule_failed = bool(skill) and a.skill_rule and not names_task(skill, terms)
            b.skill_gens[k] = gen
            rec.skill = None if rec.rule_failed else skill
    for rec in b.records:
        rec.replay_ok = rec.skill is not None


def give_skills(run: Run, b: Batch):
    """[ours] The teacher channel's diagnostic in place of Eq. (2) (--teacher_skill generic | wrong | oracle |
    wrong_place): every task's teacher is given its game's type-level workflow, the same sentence with the wrong
    procedure, the workflow naming where the object lies, or that sentence naming another place; nothing is written,
    so there is no skill-writing sample."""
    b.skill_gens = [Generation("", [], [], [])] * len(b.records)
    for rec in b.records:
        rec.source = run.args.teacher_skill
        rec.skill = run.given_skill(rec.task_id)
        rec.replay_ok = rec.skill is not None


def replay(run: Run, b: Batch):
    """Eq. (3)-(4) (§2.4): M episodes of each task with its skill inserted after the task line of every
    prompt, from the same start, against a skill-free control that did not choose the source
    (--replay_control [ours]: M fresh episodes played in the same lock-step, or the rollouts of the other half)."""
    a = run.args
    N = run.args.group_size
    M = a.replay_m or max(1, N // 2)      # [ours] M = N/2 by default
    idx = [k for k, r in enumerate(b.records) if r.skill is not None]
    tasks = [b.tasks[k] for k in idx]
    fresh = a.replay_control == "fresh"
    # the replays (the first len(idx) tasks, each with its skill) and, for fresh, the same tasks without one
    b.replay_eps = run_episodes(run.engine, run.pool, tasks + tasks if fresh else tasks, M, history_len=a.history_len,
                                skills={j: b.records[k].skill for j, k in enumerate(idx)},
                                temperature=a.temperature, constrained=a.constrained, stop=run.stop_now) if idx else []
    played = by_task(b.replay_eps, M)
    groups = by_task(b.eps, N)
    for j, k in enumerate(idx):
        rec, reps = b.records[k], played[j]
        control = played[len(idx) + j] if fresh else source_and_control(groups[k], a.replay_control)[1]
        if any(e.error for e in reps + control):   # left out of trust and Eq. (5), counted in replay/failed
            rec.replay_ok = False
            continue
        rewards, control_rewards = [e.reward for e in reps], [e.reward for e in control]
        rec.gain, rec.var = shrinkage.replay_gain(rewards, control_rewards, a.r_win)   # Eq. (3)-(4)
        rec.informative = shrinkage.replay_informative(rewards, control_rewards)


def share_records(b: Batch) -> list[TaskRecord]:
    """The step's one gather: the task records of every rank, in rank order. Every rank computes Eq. (5)-(9)
    from the same records; this rank's `b.records` become its part of them."""
    parts = all_gather_obj(b.records)
    recs = [r for p in parts for r in p]
    mine = sum(len(p) for p in parts[:D.RANK])
    b.records = recs[mine:mine + len(b.records)]
    return recs


def skill_advantages(run: Run, recs: list[TaskRecord]):
    """Eq. (5) (§2.5): the skill-writing advantage A^skill over the tasks that wrote a skill and have a skill
    reward (the replay gain; an invalid skill: r_bad; a skill whose replay failed has none), against running
    means per task type."""
    a = run.args
    rewarded = [r for r in recs if r.source is not None and (r.skill is None or r.replay_ok)]
    A, run.skill_means = rsipo.skill_advantages(
        torch.tensor([r.skill_reward(a.r_bad) for r in rewarded], dtype=torch.float32),
        [r.task_type for r in rewarded], torch.tensor([r.skill is not None for r in rewarded]), r_bad=a.r_bad,
        running_means=run.skill_means)
    for r, adv in zip(rewarded, A.tolist()):
        r.skill_adv = adv


def trust(run: Run, recs: list[TaskRecord], replayed: bool) -> Optional[dict]:
    """Eq. (6)-(9) (§2.6): the empirical-Bayes trust λ_q in each task's teacher and the shrunk gain ĝ_q, from
    the replay gains of every rank's tasks, set on the records; λ 0 where the replay carried no evidence. Without
    a replay (opsd) λ ≡ 1 for every valid skill. Returns the EB fit's info (`shrinkage.teacher_trust`), or None
    where nothing was replayed."""
    a = run.args
    ok = [i for i, r in enumerate(recs) if r.replay_ok]
    lam = np.zeros(len(recs))
    info = None
    if not replayed:
        lam[ok] = 1.0                     # the SEED/SDAR family: fresh skills, λ ≡ 1, no replay
    elif ok:
        g = [recs[i].gain for i in ok]
        v = [recs[i].var for i in ok]
        types = [recs[i].task_type for i in ok]
        lam_ok, info = shrinkage.teacher_trust(g, v, types, mode=a.trust,                  # Eq. (6)-(9); λ 0 where
                                               informative=[recs[i].informative for i in ok])   # there is no evidence
        lam[ok] = lam_ok
        for i, shrunk in zip(ok, info["mean"]):
            recs[i].shrunk = float(shrunk)
        if a.calibrate:                   # both modes' posteriors, to hold against a fresh replay (calibrate)
            both = {mode: shrinkage.teacher_trust(g, v, types, mode=mode)[0] for mode in ("eb", "raw")}
            for j, i in enumerate(ok):
                recs[i].posterior = {mode: float(x[j]) for mode, x in both.items()}
    for r, trusted in zip(recs, lam):
        r.trust = float(trusted)
    return info


def keep_skills(run: Run, recs: list[TaskRecord], step: int):
    """§2.10: the skills whose replay ran are offered to the bank, which keeps the validated ones: shrunk gain
    ĝ > 0 (`SkillBank.add`)."""
    for r in recs:
        if r.skill is not None and r.replay_ok:
            run.bank.add(r.task_type, r.skill, r.gain, r.shrunk, r.task_id, step + 1, r.trust, r.task)


def bank_teachers(run: Run, recs: list[TaskRecord]):
    """[ours] --bank_teacher (METHOD.md §2.10): what the policy found in one task reaches the tasks of its type it has
    not won. A task with no trusted fresh skill (λ 0: no win to write from, an invalid skill, a replay without
    evidence) is taught by the bank's best skill of its type (the highest shrunk gain, this step's validated ones
    included), made over for its object and target from the two task lines (`skills.adapt_skill`), at the trust λ
    that skill earned at its last validation. An empty bank teaches nothing: those tasks train as without it."""
    for r in recs:
        best = run.bank.best(r.task_type) if r.trust == 0 else []
        if best:
            r.bank_skill = adapt_skill(best[0].text, run.pool.task_terms(best[0].task), run.pool.task_terms(r.task))
            r.trust = best[0].trust


def training_samples(run: Run, b: Batch) -> tuple[list[Sample], list[Sample]]:
    """The samples of the update (METHOD.md §2.7): the student turns, each with its advantage and its task's λ, and
    the skill-writing responses (rsipo), by the [ours] rules: --drop_zero_adv leaves out a turn with neither a
    policy gradient nor a teacher, --opsd_keep subsamples the teacher-only ones, η = 0 trains no skill writing."""
    a = run.args
    samples = []
    for tr, A in zip(b.turns, b.adv):
        lam = b.records[tr.group_id].trust
        if a.drop_zero_adv and A == 0.0 and lam == 0.0:
            continue                      # [ours] no policy-gradient and no teacher signal
        if A == 0.0 and lam > 0 and a.opsd_keep < 1.0 and run.skill_rng.random() >= a.opsd_keep:
            continue                      # [ours] a teacher-only turn, subsampled (--opsd_keep)
        samples.append(Sample(tr.prompt_ids, tr.response_ids, A, None, trust=lam, turn=tr,
                              sampled=tr.sampler_logprobs if tr.free else None))
    # [ours] η = 0 turns skill-writing training off altogether (its KL and entropy too)
    skill_tasks = [k for k, r in enumerate(b.records)
                   if r.skill_adv is not None and b.skill_gens[k].token_ids and a.eta > 0]
    gens = [b.skill_gens[k] for k in skill_tasks]
    skill_samples = [Sample(g.prompt_ids, g.token_ids, b.records[k].skill_adv, None, skill=True,
                            sampled=g.logprobs if g.free else None) for g, k in zip(gens, skill_tasks)]
    return samples, skill_samples


def old_policy(run: Run):
    """π_old, the weights that sampled: the rollout copy on the HF engine; with vLLM the FSDP2 policy itself, whose
    weights vLLM holds (synced after the last update, and this step's update has not run)."""
    return run.rollout_model if run.rollout_model is not None else run.model


def score_policy(run: Run, samples: list[Sample], skill_samples: list[Sample]):
    """π_old's and π_ref's log-probs of every trained response (§2.7), each at the temperature its tokens were
    sampled at, as verl (`sampled_at`); for the turns with a teacher under a student-side top-K support
    (--teacher_support student | union), π_old's K most likely tokens too."""
    a = run.args
    if a.engine == "vllm":
        run.engine.sleep()                # generation is over for this step: free vLLM's GPU memory
    top = a.teacher_topk if (a.uses_skills and a.teacher_support != "teacher"
                             and rsipo.TEACHER_ESTIMATORS[a.teacher_loss].support == "topk") else 0
    for group, temp, k in ((skill_samples, sampled_at(a, True), 0), (samples, sampled_at(a, False), top)):
        pairs = [(sm.prompt_ids, sm.response_ids) for sm in group]
        for sm, o in zip(group, run.logprobs(old_policy(run), pairs, temp, top=k)):
            sm.old, sm.student_top = o if k else (o, None)
        for sm, r in zip(group, run.logprobs(run.ref, pairs, temp)
                         if a.c_kl > 0 and run.ref is not None else []):
            sm.ref = r


def score_teacher(run: Run, b: Batch, samples: list[Sample]) -> dict:
    """The teacher (§2.7): each turn with λ > 0 rescored with its task's skill inserted after the task line of
    its prompt, ℓ^T = log π_T(y | teacher prompt), by the weights of --teacher_weights [ours], and with a support
    estimator what it keeps of the teacher's distribution (`teacher_keep`). Here, and only here, a turn's λ becomes 0
    where it has no teacher log-probs (a teacher prompt over --max_prompt_tokens). Returns the proof that each
    teacher saw its skill (`skill_in_teacher_prompts`)."""
    a = run.args
    kept = [sm for sm in samples if sm.trust > 0]   # grpo and gigpo trust no teacher: every λ is 0
    teach = [teacher_pair(run.engine, sm.turn, b.records[sm.turn.group_id].teacher_skill(),
                          task_line(run.pool, b.eps[sm.turn.episode_id].task)) for sm in kept]
    fit = [j for j, (p, _) in enumerate(teach) if len(p) <= a.max_prompt_tokens]
    teacher_model = {"live": old_policy(run), "frozen": run.ref}.get(a.teacher_weights, run.teacher)
    keep = teacher_keep(a, [kept[j].student_top for j in fit])
    for j, scored in zip(fit, run.logprobs(teacher_model, [teach[j] for j in fit], sampled_at(a, False), **keep)):
        kept[j].teacher, kept[j].support = scored if keep else (scored, None)   # ℓ^T (and the support)
        kept[j].teacher_prompt = teach[j][0]
    for sm in samples:
        sm.student_top = None
        if sm.teacher is None:            # no teacher for this turn: λ = 0
            sm.trust = 0.0
    b.teacher_overflow = len(kept) - len(fit)
    return skill_in_teacher_prompts(run, b, [sm for sm in samples if sm.teacher is not None])


def teacher_keep(a, student_top: list) -> dict:
    """What scoring keeps of the teacher's distribution, as the estimator's row of rsipo.TEACHER_ESTIMATORS says:
    nothing beyond ℓ^T, all of it (vocab), or the top-K support of --teacher_support [ours] (student: π_old's K
    most likely tokens, `student_top`, one per sample scored; teacher: the teacher's own; union: both)."""
    support = rsipo.TEACHER_ESTIMATORS[a.teacher_loss].support
    if support == "vocab":
        return {"support": "vocab"}
    if support != "topk":
        return {}
    pick = lambda i, row: rsipo.support_ids(row, a.teacher_topk, a.teacher_support,   # noqa: E731
                                            None if student_top[i] is None else student_top[i].to(row.device))
    return {"support": pick}


def sampled_at(a, skill: bool) -> float:
    """The temperature the trainer divides the logits by: the one a kind of sample was drawn at (rollouts at
    --temperature, skill-writing at --skill_temperature; greedy, T ≤ 0, at 1). verl does the same; at any other
    temperature the update would be off-policy without saying so."""
    t = a.skill_temperature if skill else a.temperature
    return t if t > 0 else 1.0


def skill_in_teacher_prompts(run: Run, b: Batch, scored: list[Sample]) -> dict:
    """[ours] Proof that each teacher sees its skill: the skill's tokens (encoded alone, the tokenizer's unknown
    token left out) that its teacher prompt holds beyond the student's prompt. A teacher whose prompt holds none of
    its skill stops the run: it would distil nothing, silently (a skill lost to truncation, or written in words the
    tokenizer does not know). The run's first teacher prompt goes to teacher_prompt.txt. Returns the skill tokens
    seen, those wanted and the prompts, summed over ranks (a collective)."""
    unk = run.tok.unk_token_id
    seen, total = 0, 0
    for sm in scored:
        ids, skill = sm.teacher_prompt, b.records[sm.turn.group_id].teacher_skill()
        wanted = [t for t in run.tok.encode(skill, add_special_tokens=False) if t != unk]
        head = next((i for i, (x, y) in enumerate(zip(ids, sm.prompt_ids)) if x != y),
                    min(len(ids), len(sm.prompt_ids)))   # where the two prompts part
        added = ids[head:len(ids) - (len(sm.prompt_ids) - head)]   # the tokens the skill line put in
        found = sum((Counter(wanted) & Counter(added)).values())   # the skill's tokens among them
        if not found:
            raise RuntimeError(f"the teacher prompt of task {sm.turn.task_id} holds none of its skill {skill!r} "
                               f"({len(wanted)} known tokens of it; the prompt adds {len(added)} tokens to the "
                               f"student's): the teacher would not see its skill")
        seen, total = seen + found, total + len(wanted)
        path = run.run_dir / "teacher_prompt.txt"
        if D.RANK == 0 and not path.exists():
            write_text(path, f"skill ({found} of its {len(wanted)} known tokens in the prompt): {skill}\n\n"
                       f"the teacher's prompt, as the model reads it ({len(ids)} tokens; the student's has "
                       f"{len(sm.prompt_ids)}):\n{run.tok.decode(ids, skip_special_tokens=False)}\n")
    return all_reduce_named({"seen": seen, "total": total, "prompts": len(scored)})


# ---- The update, Eq. (10)-(12) -----------------------------------------------------------------------------------

@dataclass
class UpdateConfig:
    """What the update reads of a run's flags (Eq. 10-12, their token means, the batching and the optimizer step),
    and nothing else: `update` takes this, not the run's whole Args (`from_args`), so that a copier knows what it
    needs. Each field is the --flag of the same name (harness/config.py)."""
    mini_batch: int
    micro_batch: int
    micro_tokens: int
    drop_zero_adv: bool
    grad_clip: float
    lr: float
    lr_warmup: int
    clip_eps: float
    clip_ratio_c: float
    kl_clamp: float
    alpha: float
    beta: float
    eta: float
    c_kl: float
    c_ent: float
    temperature: float
    skill_temperature: float
    teacher_loss: str
    teacher_support: str
    teacher_norm: str
    teacher_clip: float
    teacher_low: float

    @classmethod
    def from_args(cls, a) -> "UpdateConfig":
        return cls(**{f.name: getattr(a, f.name) for f in dataclasses.fields(cls)})


def update(model, opt, samples: list[Sample], args: UpdateConfig, pad_id, device, use_teacher: bool):
    """One epoch over the samples of every rank in mini-batches of --mini_batch samples (Eq. 10-12). The mini-batches
    are those one rank holding every sample would cut after one shuffle (`distributed.global_mini_batches`), each
    dealt out equally over the ranks, so the update does not depend on the number of ranks or on how unequal their
    episodes were. Within a mini-batch the student turns and the skill-writing samples run as separate calls
    (rsipo.py note 3) with three token means over all ranks (rsipo.py note 9) [ours]: the PG term over the turns
    that carry a policy gradient (the A ≠ 0 ones under --drop_zero_adv: GRPO's own sample set), OPSD over the
    student turns, KL and entropy over every trained token; the skill PG term is η times its own token mean. All
    ranks run the same number of micro-batches (FSDP2), padding with zero-weight dummies."""
    if use_teacher and any(s.trust and s.teacher is None for s in samples):
        raise ValueError("a sample with λ > 0 has no teacher log-probs (score sets λ = 0 for those)")
    t0 = time.time()
    seed = all_gather_obj(random.getrandbits(63))[0]   # rank 0's draw: one shuffle for every rank
    minis, n_samples = D.global_mini_batches([dataclasses.replace(s, turn=None) for s in samples],
                                             [len(s.prompt_ids) + len(s.response_ids) for s in samples],
                                             args.mini_batch, seed)
    sums = UpdateSums(len(minis))
    metrics = {"update/samples": n_samples, "time/deal": time.time() - t0}   # the exchange's cost
    dummy = Sample([pad_id], [pad_id], 0.0, torch.zeros(1))
    model.train()
    for m, chunk in enumerate(minis):
        opt.zero_grad(set_to_none=True)
        tokens = token_counts(chunk, args.drop_zero_adv)
        for skill in (False, True):   # student turns, then skill-writing samples
            part = [s for s in chunk if s.skill == skill]
            # [ours] with a token budget similar lengths go together (order is free in a mini-batch);
            # ranks with fewer micro-batches run zero-weight dummies to keep FSDP collectives in step
            lengths = [len(s.prompt_ids) + len(s.response_ids) for s in part]
            for sub, empty in aligned_micro_batches(part, lengths, args.micro_batch, args.micro_tokens, dummy):
                micro_step(model, sub, skill, empty, tokens, args, pad_id, device, use_teacher and not skill, sums,
                           first=m == 0)
        optimizer_step(model, opt, args, metrics, len(minis))
    return {**metrics, **sums.reduce(samples)}


@dataclass
class TokenCounts:
    """The token counts one mini-batch's means divide by, each summed over all ranks and divided by the world
    size: FSDP averages the gradients over ranks, so a rank whose loss is its tokens' sum over N / W gives,
    averaged, the sum over every rank's tokens over N (the global token mean)."""
    turn: float                           # student turns' response tokens: the teacher term (--teacher_norm all)
    taught: float                         # those of the turns with a teacher (--teacher_norm taught)
    pg: float                             # those of turns with a policy gradient: the PG term
    skill: float                          # skill-writing samples' tokens: the skill PG term


def token_counts(chunk: list[Sample], drop_zero_adv: bool) -> TokenCounts:
    pg_bearing = [s for s in chunk if not s.skill and (s.adv != 0.0 or not drop_zero_adv)]
    local = [sum(len(s.response_ids) for s in chunk if not s.skill),
             sum(len(s.response_ids) for s in chunk if not s.skill and s.teacher is not None),
             sum(len(s.response_ids) for s in pg_bearing), sum(len(s.response_ids) for s in chunk if s.skill)]
    return TokenCounts(*(float(x) / D.WORLD for x in all_reduce(local)))


def micro_step(model, sub: list[Sample], skill: bool, empty: bool, tokens: TokenCounts, args: UpdateConfig, pad_id,
               device, use_teacher: bool, sums: "UpdateSums", first: bool):
    """Forward and backward of one micro-batch of student turns or (`skill`) skill samples, or of a dummy that
    weighs 0 (`empty`): the loss of Eq. (12) over its mini-batch's token counts; its metrics go into `sums`."""
    ids, attn, tgt, mask = collate([(s.prompt_ids, s.response_ids) for s in sub], pad_id, device)
    if empty:
        mask = mask * 0
    wide = use_teacher and rsipo.TEACHER_ESTIMATORS[args.teacher_loss].support != "none"   # Eq. (11c-d)
    logp, ent, *logp_all = token_logprobs_of(model, ids, attn, tgt, with_entropy=args.c_ent > 0, with_all=wide,
                                             temperature=sampled_at(args, skill))   # [B, R] (, [B, R, V])
    old = _place([s.old for s in sub], sub, logp.shape, device)
    if first:
        sums.add_first_gap((logp.detach() - old).abs() * mask, mask)
    ref = _place([s.ref for s in sub], sub, logp.shape, device) if sub[0].ref is not None else None
    term = None
    if use_teacher:                       # the teacher term, computed here and handed to Eq. (12)
        has = torch.tensor([s.teacher is not None for s in sub], device=device)              # [B]
        x = rsipo.teacher_inputs(logp, has, _place([s.teacher for s in sub], sub, logp.shape, device),
                                 *(support_of(sub, logp_all[0], args) if wide else ()))
        n_teach = tokens.taught if args.teacher_norm == "taught" else tokens.turn
        term = rsipo.teacher_loss(args.teacher_loss, logp, torch.tensor([s.trust for s in sub], device=device),
                                  mask, old_logp=old, n_tokens=max(n_teach, 1.0), beta=args.beta,
                                  clip=args.teacher_clip, threshold=args.teacher_low, **x)
    adv = torch.tensor([s.adv for s in sub], device=device)                               # [B]
    loss, step_metrics = rsipo.rsipo_loss(
        logp, old, adv, mask, entropy=ent, ref_logp=ref, teacher_term=term, clip_eps=args.clip_eps,
        alpha=args.alpha, c_kl=args.c_kl, c_ent=args.c_ent, pg_weight=args.eta if skill else 1.0,
        n_tokens=max(tokens.skill if skill else tokens.pg, 1.0), reg_n_tokens=max(tokens.turn + tokens.skill, 1.0),
        clip_ratio_c=args.clip_ratio_c or None, kl_clamp=args.kl_clamp or None)
    loss.backward()
    sums.add(step_metrics, skill, float(mask.sum()))


def support_of(sub: list[Sample], logp_all: torch.Tensor, args: UpdateConfig) -> tuple:
    """The student's whole log-softmax [B, R, V] (with grad) and the teacher's side of Eq. (11c-d) kept at scoring,
    padded to [B, R, S] ids (None: the whole vocabulary), [B, R, S] (or [B, R, V]) log-probs, [B, R] tails; a row
    without a teacher holds any finite values (rsipo.teacher_inputs fills it with the student's own)."""
    B, R, V = logp_all.shape
    vocab = rsipo.TEACHER_ESTIMATORS[args.teacher_loss].support == "vocab"
    S = V if vocab else next((len(s.support.ids[0]) for s in sub if s.support is not None and len(s.support.ids)), 1)
    ids = None if vocab else torch.arange(S, device=logp_all.device).repeat(B, R, 1)   # [B, R, S]
    lp = torch.zeros((B, R, S), device=logp_all.device)
    tail = torch.zeros((B, R), device=logp_all.device)
    for b, s in enumerate(sub):
        if s.support is not None:
            r = len(s.support.lp)
            lp[b, :r] = s.support.lp.to(lp)
            if ids is not None:
                ids[b, :r], tail[b, :r] = s.support.ids.to(ids), s.support.tail.to(tail)
    return logp_all, ids, lp, None if ids is None else tail


def optimizer_step(model, opt, args: UpdateConfig, metrics: dict, n_mini: int):
    """Clip the gradient norm and step AdamW at the (warmed-up) rate; a non-finite norm skips the step."""
    norm = D.clip_grad_norm(model, args.grad_clip)
    if not math.isfinite(norm):
        print0(f"  non-finite grad norm ({norm}): optimizer step skipped")
        metrics["update/skipped"] = metrics.get("update/skipped", 0) + 1
        opt.zero_grad(set_to_none=True)
        return
    if args.lr_warmup:   # [ours] Adam's first steps are sign-like; ramp the rate up
        state = next(iter(opt.state.values()), {})   # steps taken so far: Adam's own (checkpointed) count
        done = int(state["step"]) if "step" in state else 0
        for g in opt.param_groups:
            g["lr"] = args.lr * min(1.0, (done + 1) / args.lr_warmup)
    opt.step()
    metrics["update/lr"] = opt.param_groups[0]["lr"]
    metrics["update/grad_norm"] = metrics.get("update/grad_norm", 0.0) + norm / n_mini


CONTRIB = {"loss", "pg/loss", "kl/k3", "entropy", "opsd/loss"}


def is_loss_term(name: str) -> bool:
    """A loss term (its value already over the global token count), with or without the skill samples' prefix."""
    return name.removeprefix("skill_") in CONTRIB


@dataclass
class UpdateSums:
    """One update's metrics on this rank, summed: the loss terms (summed over micro-batches, averaged over
    mini-batches), every other metric weighted by its micro-batch's tokens (skill samples' names prefixed
    skill_), the student tokens, and |ℓ − ℓ_old| over the first mini-batch. [ours] That mini-batch runs before
    any optimizer step, where π_θ is π_old: a gap above the compute dtype's noise means the sampler's weights or
    buffers are not the trained ones."""
    n_mini: int                           # the update's mini-batches (loss terms are averaged over them)
    loss_terms: dict = field(default_factory=dict)
    weighted: dict = field(default_factory=dict)
    turn_tokens: float = 0.0
    gap: list = field(default_factory=lambda: [0.0, 0.0, 0.0])   # sum, tokens, max

    def add(self, step_metrics: dict, skill: bool, n_tokens: float):
        self.turn_tokens += n_tokens * (not skill)
        for k, v in step_metrics.items():
            k = f"skill_{k}" if skill else k
            if is_loss_term(k):
                self.loss_terms[k] = self.loss_terms.get(k, 0.0) + float(v) / self.n_mini
            elif not k.endswith("n_tokens"):
                self.weighted[k] = self.weighted.get(k, 0.0) + float(v) * n_tokens

    def add_first_gap(self, gap: torch.Tensor, mask: torch.Tensor):
        self.gap[0] += float(gap.sum())
        self.gap[1] += float(mask.sum())
        self.gap[2] = max(self.gap[2], float(gap.max()))

    def reduce(self, samples: list[Sample]) -> dict:
        """Over all ranks: loss terms are already over the global token count (their mean over ranks), the
        others become token means."""
        total = all_reduce_union({**self.loss_terms, **self.weighted, "n/turn_tokens": self.turn_tokens,
                                  "n/skill_tokens": sum(len(s.response_ids) for s in samples if s.skill)})
        n_turn, n_skill = total.pop("n/turn_tokens"), total.pop("n/skill_tokens")
        out = {k: v / D.WORLD if is_loss_term(k) else v / max(1.0, n_skill if k.startswith("skill_") else n_turn)
               for k, v in total.items()}
        gap_sum, gap_tokens = all_reduce(self.gap[:2])
        out["update/first_logp_gap_mean"] = float(gap_sum / max(1.0, gap_tokens))
        out["update/first_logp_gap_max"] = float(all_reduce(self.gap[2], "max")[0])
        out["update/mini_batches"] = self.n_mini
        out["update/tokens"] = n_turn
        return out


def _place(rows: list[torch.Tensor | None], samples: list[Sample], shape, device) -> torch.Tensor:
    """Per-sample response vectors → a [B, R] tensor aligned with `collate`'s targets (0 where absent)."""
    out = torch.zeros(shape, device=device)
    for b, v in enumerate(rows):
        if v is not None:
            out[b, :len(v)] = v.to(device)
    return out


# ---- After the update --------------------------------------------------------------------------------------------

def sync_weights(run: Run):
    """The rollout weights follow the policy: the rollout copy reloads it (HF engine), or the FSDP2
    parameters are pushed into vLLM (a collective; the prefix cache is reset)."""
    if run.rollout_model is None:
        if run.engine is not None:        # no sampler in a warm start alone (build_policy)
            run.engine.load_weights(run.model.named_parameters())
    else:
        D.copy_params(run.rollout_model, run.model)   # one gathered tensor at a time


def follow_policy(run: Run, step: int):
    """[ours] The teacher's own weights after the update (--teacher_weights, METHOD.md §2.8.2): ema averages the
    policy in (θ_T ← d·θ_T + (1 − d)·θ, d = --teacher_ema, once a step); refresh copies the policy every
    --teacher_refresh steps. live (π_old) and frozen (the warm start) keep no weights of their own."""
    a = run.args
    if a.teacher_weights == "ema":
        D.ema_params(run.teacher, run.model, a.teacher_ema)
    elif a.teacher_weights == "refresh" and (step + 1) % a.teacher_refresh == 0:
        D.ema_params(run.teacher, run.model, 0.0)


# ---- The warm start and the reference; the run's phases ----------------------------------------------------------

def begin(run: Run):
    """Resume from the newest checkpoint, or warm-start (SFT) and evaluate the start; then the reference.
    A SIGTERM during the SFT saves its state and exits 143 (the same command continues the SFT); one during the
    evaluation of the start raises `Preempted` (main writes the step-0 checkpoint; resuming redoes the evaluation)."""
    a = run.args
    run.model = shard(run.model, compute_dtype(a))
    run.opt = torch.optim.AdamW(run.model.parameters(), lr=a.lr, weight_decay=a.weight_decay)
    run.teacher = teacher_copy(run)       # before resume: a checkpoint holds the teacher's weights too
    if resume(run):
        for _ in range(run.start):        # replay the task sampler: a resumed run draws the same tasks
            draw_tasks(run.task_rng, run.data.train_types, a.tasks_per_step, a.tasks_by_type)
        run.ref = reference(run, resumed=True)   # before the sync: the rollout copy still holds the start
        sync_weights(run)
        if a.eval and run.start == 0 and "eval/success_at_start" not in run.summary:
            evaluate_start(run)           # a SIGTERM cut it short: the warm start was saved, its evaluation not
    else:
        warm_start(run)                   # syncs the rollout weights after SFT
        if run.teacher is not None:       # the teacher starts as the warm-started policy
            D.ema_params(run.teacher, run.model, 0.0)
        if a.eval:
            evaluate_start(run)
        run.ref = reference(run, resumed=False)


def warm_start(run: Run):
    """SFT on --sft_data (or the tiny preset's walkthroughs), saved as warm_start/. [ours] A SIGTERM during the
    SFT ends it after the current step with its state in <run>/sft (harness/sft.py) and exits 143."""
    a = run.args
    done = run.run_dir / "warm_start"
    if (done / "config.json").exists():   # [ours] this run's warm start is complete (a kill came before the first
        exact = load_policy(run, done)    # checkpoint): taken as it is, never trained again
        print0(f"warm start: {done} is complete; taken as it is, not trained again"
               + ("" if exact else " (its random streams were not saved: the run draws fresh ones)"))
        sync_weights(run)
        return
    pairs = load_sft_jsonl(a.sft_data) if a.sft_data else (
        tiny.warm_start_pairs(a, run.data, run.pool, skills=a.uses_skills) if a.model == "tiny" else [])
    if pairs and a.sft_steps:
        t0 = time.time()
        with run.phases("sft"):
            loss, run.summary["sft/skipped"], stopped = sft(run.model, run.tok, pairs, a, run.device,
                                                            stop=run.preempt.requested if run.preempt else None,
                                                            state_dir=run.run_dir / "sft")
            run.summary["sft/final_loss"] = loss
        if stopped:
            print0(f"preempted ({run.preempt.name}) during the warm start: its state is saved in sft/; the same "
                   "command continues it")
            raise SystemExit(run.preempt.exit_code)
        print0(f"sft: {len(pairs)} samples, {a.sft_steps} steps, final loss {loss:.4f}, {time.time() - t0:.0f}s")
    sync_weights(run)
    if pairs and a.sft_steps:             # the warm-started policy: reusable with --model, and the reference
        with run.phases("save_policy"):
            save_policy(run, run.run_dir / "warm_start", rng=all_gather_obj(D.rng_states()))
        if D.RANK == 0:                   # the SFT's own state is no longer needed
            shutil.rmtree(run.run_dir / "sft", ignore_errors=True)


def evaluate_start(run: Run):
    """The evaluation before RL (summary: eval/success_at_start, eval_at_start/*)."""
    evaluation, run.summary["eval_at_start/by_game"] = evaluate_and_print(run, "eval_at_start", "before RL")
    run.summary["eval/success_at_start"] = evaluation["eval/success"]
    run.summary.update({k.replace("eval/", "eval_at_start/"): v for k, v in evaluation.items()})
    run.rows.append({"step": 0, **evaluation})


def reference(run: Run, resumed: bool):
    """The frozen reference, the warm-started policy: the KL term's, and the teacher of --teacher_weights frozen
    (None when neither needs it). GPU: read back from disk in bf16 and FSDP2-sharded; CPU: a copy of the rollout
    weights (re-read from warm_start/ on resume)."""
    a = run.args
    if a.c_kl <= 0 and a.teacher_weights != "frozen":
        return None
    from transformers import AutoModelForCausalLM
    warm = run.run_dir / "warm_start"
    if run.device.type == "cuda" and dist.is_initialized() and a.model != "tiny":
        src = warm if (warm / "config.json").exists() else run.model_path
        ref = D.load_sharded(str(src), torch.bfloat16, run.device).eval()   # sharded as it loads
    else:
        ref = copy.deepcopy(run.rollout_model).eval()
        if resumed and (warm / "config.json").exists():   # the rollout copy holds the initial weights
            with torch.random.fork_rng(devices=[]):       # reading leaves the restored RNG where it was
                ref.load_state_dict(AutoModelForCausalLM.from_pretrained(warm).state_dict())
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


def teacher_copy(run: Run):
    """[ours] --teacher_weights ema | refresh: the teacher's own weights, fp32 (an average of steps at lr 1e-6
    vanishes in bf16), filled from the policy once it is warm-started or from a checkpoint; None otherwise. A real
    model on GPUs: FSDP2-sharded like the policy and built empty (`ema_params` then works shard by shard; nothing
    is read from disk), 4 bytes a parameter over the ranks (7B on 8 GPUs: 3.8 GB each); else a plain copy on every
    rank (CPU)."""
    a = run.args
    if a.teacher_weights not in ("ema", "refresh"):
        return None
    if run.device.type == "cuda" and dist.is_initialized() and a.model != "tiny":   # built empty, filled by the caller
        teacher = D.sharded_like(run.model, torch.float32, run.device, compute_dtype(a))
    else:
        teacher = D.rollout_copy(run.model, torch.float32, run.device)
    for p in teacher.parameters():
        p.requires_grad_(False)
    return teacher.eval()


def main(argv=None) -> dict:
    """set up → policy → warm start or resume → RL steps (each: step → evaluate every --eval_every → log →
    save every --save_every, until --steps or the --max_env_steps budget) → final evaluation and files →
    teardown. A SIGTERM ends the run with a checkpoint at the next safe point (`Preemption`: its step, phase
    and stop_if_seen)."""
    run = None
    try:
        run = setup(parse_args(argv))
        a = run.args
        guard = run.preempt = Preemption()
        build_policy(run)
        guard.phase(run, lambda: begin(run), done=lambda: run.start)   # cut short in the start's evaluation
        guard.stop_if_seen(run, run.start)
        done = run.start                  # RL steps done
        for step in tqdm(range(run.start, a.steps), desc="rl", disable=D.RANK != 0, initial=run.start, total=a.steps):
            if a.max_env_steps and run.env_steps >= a.max_env_steps:
                break                     # resumed after the budget was spent: on to the final evaluation
            row = guard.step(run, step, rl_step)
            run.stepped = True
            if a.eval_every and (step + 1) % a.eval_every == 0 and step + 1 < a.steps:
                row.update(guard.phase(run, lambda: evaluate_and_print(run, "eval_every", f"at step {step + 1}")[0],
                                       done=step + 1, cut_ok=True))   # cut short: the stop below saves the step
            log_row(run, row)
            watch_step(run, row)
            progress(f"step {step + 1:4d} | success {row['train/success']:.3f} | reward {row['train/reward']:.2f} | "
                     f"invalid {row['train/invalid_frac']:.3f} | kl {row.get('kl/k3', 0):.4f} | "
                     f"{row['time/step']:.0f}s (rollout {row['time/rollout']:.0f}s)")
            out_of_budget = bool(a.max_env_steps) and run.env_steps >= a.max_env_steps
            if a.save_every and ((step + 1) % a.save_every == 0 or step + 1 == a.steps or out_of_budget):
                save(run, step + 1)
            done = step + 1
            guard.stop_if_seen(run, done)
            if out_of_budget:             # [ours] the budget ends the run, --steps or not: said so
                print0(f"env-step budget {a.max_env_steps} reached after step {step + 1}" + (
                    f"; warning: that is before --steps {a.steps}, so --max_env_steps ends the run (raise it, or 0 "
                    "for no budget)" if step + 1 < a.steps else ""))
                break
        guard.phase(run, lambda: finish(run), done=done)   # cut short in the final evaluation: redone on resume
    finally:
        if run is not None and run.preempt is not None:
            run.preempt.close()
        teardown(run)
    return run.summary


if __name__ == "__main__":
    try:
        main()
    except SystemExit as e:
        if e.code in (130, 143):          # preempted: the checkpoint is on disk and the pools are closed
            D.exit_process(e.code)
        raise
    if D.WORLD > 1:                       # every output written and the group destroyed: no gloo teardown abort
        D.exit_process(0)
