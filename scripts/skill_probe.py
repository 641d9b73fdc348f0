"""Does a policy use a skill in its prompt? The question behind RSIPO's teacher (METHOD.md §2.7).

On held-out ALFWorld games it plays the same episodes (same sampling seed in every condition, so
the comparisons are paired) with:
  none        no skill (the usual evaluation);
  oracle      the rule-based workflow `tiny.rule_skill` of the game itself, naming where its
              walkthrough found the object (privileged: what the tiny warm start was trained with);
  generic     the same workflow without the object's place;
  other       the oracle skill of a held-out game of another task type (a wrong skill);
  wrong       the generic workflow with another type's tool and verb (`tiny.wrong_skill_of_game`: the same
              sentence, the wrong procedure; only when every probed game's type has a tool, e.g. --types clean);
  wrong_place the oracle skill naming another receptacle of the room (`tiny.wrong_place_skill_of_game`: the
              same sentence, the wrong place; one the walkthrough looked in and saw without the object);
  bank        a skill of the game's task type from a run's `skill_bank.json` (the policy's own, validated).
and prints success per condition and per task type. With --bank it also checks each banked skill against
its game's truth (traj_data.json and walkthrough.json): does it name the task's object, its target
(the receptacle, or the lamp for look), the tool of its type (sinkbasin / microwave / fridge) and
where the walkthrough found the object, and does it name a tool of another type. Then it scores the turns of the `none`
episodes the way RSIPO's teacher does — the same response tokens with the oracle skill, then the generic
one, inserted after the task line — and prints the teacher–student gap ℓ^T − ℓ^S (nats per token, mean and
the share of turns where the teacher assigns the sampled action a higher probability), its spread (the
share of tokens near 0, the mean gate σ(β·gap) of Eq. 11 at β 5 and 50), and the gap on the action tokens
of the turns that use their type's tool, on those of the other turns, and on the reasoning tokens.
If the oracle skill does not raise success and the gap is ≈ 0, the model ignores skills, and the
OPSD term of Eq. 11 has nothing to distil.

Stage 0, the premise check **[ours]** (recipes/README.md): with a model of one's own on 128 fixed games it ends
with one go/no-go line and the JSON's `premise`: go when the generic (right type-level) skill adds at least 5
points over none and beats the wrong-type skill ('other') by 2 s.e., paired over games; beside it the teacher's
token gaps (mean, the share of tokens the gate opens, the gap by turn).

    python scripts/skill_probe.py --model Qwen/Qwen2.5-7B-Instruct --data_root ~/.cache/alfworld --split valid_seen \
        --games 128 --repeats 1 --out runs/premise_q7b.json

With --own it measures the policy's own skills instead, the way the trainer writes them, against an
independent control (the ground truth that the replay gain and `--calibrate` estimate). For each game it plays
--sources skill-free episodes at the training temperature, and the policy writes a skill from a won one and
from a lost one (`write_skills`' analyzer prompt and decoding at --skill_temperature, one retry; from the same
won episode once per temperature listed, 0 = greedy).
Each skill is then played --repeats times, and so are a skill-free control
(its own episodes, not those the source came from) and the generic type-level skill. It prints, per condition,
the gain over the control paired over games, and how the skills fare under the skill rule (they name the
task's object and target: `skills.names_task`).

    python scripts/skill_probe.py --model runs/default/warm_start
    python scripts/skill_probe.py --model runs/default/final --bank runs/default/skill_bank.json
    python scripts/skill_probe.py --model runs/default/final --own --data_root data/alfworld_clean --split train
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness import config, tiny  # noqa: E402
import envs  # noqa: E402
import rollout  # noqa: E402
from skills import analyzer_prompt, names_task, parse_skill, skill_token_budget  # noqa: E402
from infra.env_backends import game_task_type, list_games  # noqa: E402
from envs import EnvPool  # noqa: E402
from rollout import HFEngine, run_episodes  # noqa: E402


# train.py's defaults (its Args) for a model that is not the tiny preset's; a tiny one takes config.TINY
REAL_MODEL_DEFAULTS = {"max_turns": 50, "history_len": 2, "max_new_tokens": 512, "constrained": False}


def success(eps) -> dict[str, float]:
    return {"all": sum(e.won for e in eps) / max(1, len(eps)), **rollout.mean_by((e.task_type, e.won) for e in eps)}


def score_bank(bank: dict) -> dict[str, dict[str, float]]:
    """Share of banked skills (per task type and all) whose `skill_facts` hold; skills without a game file skipped."""
    rows: dict[str, list[dict[str, bool]]] = {}
    for ttype, entries in bank.items():
        for e in entries:
            wt = tiny.walkthrough_of(e["task_id"]) if e.get("task_id") else None
            if wt is not None and wt.exists():
                rows.setdefault(ttype, []).append(tiny.skill_facts(e["text"], wt))
    out = {}
    for ttype, r in list(rows.items()) + [("all", [x for v in rows.values() for x in v])]:
        if r:
            out[ttype] = {"skills": len(r), **{k: sum(x[k] for x in r) / len(r) for k in r[0]}}
    return out


def write_skills(engine, episodes, temperature: float, max_tokens: int, max_words: int = 80) -> list:
    """The skills the policy writes from `episodes` (train.write_skills' analyzer prompt and decoding: the
    latest steps that fit the prompt budget, one retry of an unparsable answer); None where none parsed."""
    from train import analyzer_prompt_fit
    prompts = [analyzer_prompt_fit(engine, e, max_words, engine.max_prompt_tokens) for e in episodes]
    out = [None] * len(episodes)
    for _ in range(2):
        todo = [k for k, p in enumerate(prompts) if p is not None and out[k] is None]
        gens = engine.generate([prompts[k] for k in todo], temperature=temperature, greedy=temperature <= 0,
                               max_new_tokens=max_tokens, stop=False) if todo else []
        for k, g in zip(todo, gens):
            out[k] = parse_skill(g.text, max_words)
    return out


def own_skills(engine, pool, games: list[str], generic: dict, a) -> dict:
    """--own: the policy's own skills, from won and from lost episodes, against an independent control (see
    the module docstring). Per condition: games, success with the skill and without it on those games, the
    paired gain ± s.e., and the share of skills that keep the skill rule, with the gain of those that do."""
    max_tokens = config.TINY["skill_max_tokens"] if tiny.is_tiny(a.model) else \
        skill_token_budget(lambda t: engine.tok.encode(t, add_special_tokens=False))

    def play(gs, n, skills, seed):
        torch.manual_seed(seed)               # the same seed for the control and every skill: paired episodes
        eps = run_episodes(engine, pool, [{pool.task_key: g} for g in gs], n, history_len=a.history_len,
                           skills={i: skills[g] for i, g in enumerate(gs)} if skills else None,
                           temperature=a.temperature, greedy=a.temperature <= 0, constrained=a.constrained)
        return eps, rollout.mean_by((e.task_id, e.won) for e in eps)

    t0 = time.time()
    sources, _ = play(games, a.sources, None, a.seed + 1)      # the episodes skills are written from
    rng = random.Random(a.seed)
    picked = {}
    for g, group in zip(games, rollout.by_task(sources, a.sources)):
        for kind, won in (("won", True), ("lost", False)):
            pool_ = [e for e in group if e.won == won]
            if pool_:
                picked.setdefault(kind, {})[g] = rng.choice(pool_)
    written = {}
    temps = [float(t) for t in a.skill_temperature.split(",")]
    for name, kind, temp in [(f"won_T{t:g}", "won", t) for t in temps] + [(f"lost_T{temps[0]:g}", "lost", temps[0])]:
        eps = picked.get(kind, {})
        texts = write_skills(engine, list(eps.values()), temp, max_tokens)
        written[name] = {g: t for g, t in zip(eps, texts) if t}
    _, control = play(games, a.repeats, None, a.seed)
    out = {"source_success": sum(e.won for e in sources) / max(1, len(sources)),
           "games_with_won": len(picked.get("won", {})), "games_with_lost": len(picked.get("lost", {})),
           "control_success": sum(control.values()) / max(1, len(control)), "conditions": {}}
    print(f"source episodes: {100 * out['source_success']:.1f}% won; {out['games_with_won']} of {len(games)} games "
          f"have a won one; control {100 * out['control_success']:.1f}% ({time.time() - t0:.0f}s)", flush=True)
    conditions = [("generic", generic)] + list(written.items())
    if a.cross:
        conditions += cross_skills(games, written.get(f"won_T{temps[0]:g}", {}), rng)
    won_by = {}
    for name, skills in conditions:
        gs = [g for g in games if g in skills]
        if not gs:
            continue
        _, with_skill = play(gs, a.repeats, skills, a.seed)
        won_by[name] = with_skill
        gain, se, n = rollout.paired_gain(control, with_skill)
        keeps = {g: names_task(skills[g], envs.task_terms(_task_of(g))) for g in gs}
        row = {"games": n, "success": sum(with_skill.values()) / n, "control": sum(control[g] for g in gs) / n,
               "gain": gain, "se": se, "rule_share": sum(keeps.values()) / n,
               "examples": [skills[g] for g in gs[:3]]}
        for part, sel in (("kept", True), ("broken", False)):
            mine = [g for g in gs if keeps[g] == sel]
            if len(mine) > 1:
                pg, pse, pn = rollout.paired_gain({g: control[g] for g in mine}, {g: with_skill[g] for g in mine})
                row[f"rule_{part}"] = {"games": pn, "gain": pg, "se": pse}
        out["conditions"][name] = row
        parts = [(part, row.get("rule_" + part)) for part in ("kept", "broken")]
        print(f"{name:11s} {n:3d} games: {100 * row['success']:5.1f}% vs {100 * row['control']:5.1f}% without, "
              f"gain {100 * gain:+.1f} ± {100 * se:.1f}; skill rule kept by {100 * row['rule_share']:.0f}%"
              + "".join(f"; {part} {100 * r['gain']:+.1f} ± {100 * r['se']:.1f} ({r['games']} games)"
                        for part, r in parts if r) + f" ({time.time() - t0:.0f}s)", flush=True)
    for right, wrong in (("cross", "cross_wrong"), ("generic", "cross_wrong")) if "cross_wrong" in won_by else ():
        both = [g for g in won_by[wrong] if g in won_by[right]]   # paired over the games that have both
        d, se, n = rollout.paired_gain({g: won_by[wrong][g] for g in both}, {g: won_by[right][g] for g in both})
        out[f"{right}_minus_cross_wrong"] = {"gain": d, "se": se, "games": n}
        print(f"{right} − cross_wrong (paired over {n} games): {100 * d:+.1f} ± {100 * se:.1f}", flush=True)
    return out


def cross_skills(games: list[str], own: dict, rng) -> list[tuple[str, dict]]:
    """--own --cross [ours]: what a skill the policy wrote in one game is worth in another game of its type. For
    each game, the won-source skill of another game of its type drawn at random: as written (cross_raw), made over
    for this game's object and target (cross: `skills.adapt_skill`, the bank teacher's rewrite), and that with the
    wrong procedure (cross_wrong: `tiny.swap_procedure`; types with a tool only)."""
    from skills import adapt_skill
    by_type: dict[str, list[str]] = {}
    for g in games:
        by_type.setdefault(game_task_type(g), []).append(g)
    raw, made_over, wrong = {}, {}, {}
    for g in games:
        peers = [h for h in by_type[game_task_type(g)] if h != g and h in own]
        if not peers:
            continue
        h = rng.choice(peers)
        raw[g] = own[h]
        made_over[g] = adapt_skill(own[h], envs.task_terms(_task_of(h)), envs.task_terms(_task_of(g)))
        swapped = tiny.swap_procedure(made_over[g], game_task_type(g))
        if swapped:
            wrong[g] = swapped
    return [("cross_raw", raw), ("cross", made_over), ("cross_wrong", wrong)]


GATE_BETAS = (5, 50)


def action_start(tok, response_ids: list[int]) -> int:
    """The index of the first response token whose prefix decodes to text holding "<action>" (the length when
    none does): the tokens from there on are the action, those before it the reasoning. A longer prefix holds
    whatever a shorter one does, so a binary search finds it in log2(length) decodes."""
    lo, hi = 1, len(response_ids) + 1     # the answer lies in [lo, hi]; hi = none holds it
    while lo < hi:
        mid = (lo + hi) // 2
        if "<action>" in tok.decode(response_ids[:mid]):
            hi = mid
        else:
            lo = mid + 1
    return min(lo, len(response_ids))


def token_gaps(diffs: list, turns: list, tok) -> dict:
    """How a teacher rates the student's sampled tokens, ℓ^T − ℓ^S per token: overall, its spread (the share near
    0 and far from it, the mean gate σ(β·gap) of Eq. 11 at several β), and on three parts of the responses: the
    action of a turn whose action uses its type's tool (`tiny.tool_action`), the action of the other turns,
    and the reasoning before the actions."""
    tok_gap = torch.cat(diffs)
    turn_gap = torch.stack([d.sum() for d in diffs])
    out = {"turns": len(diffs), "tokens": int(tok_gap.numel()), "mean_per_token": tok_gap.mean().item(),
           "mean_abs_per_token": tok_gap.abs().mean().item(),
           "turn_share_teacher_higher": (turn_gap > 0).float().mean().item(), "mean_per_turn": turn_gap.mean().item(),
           "share_abs_lt_0.01": (tok_gap.abs() < 0.01).float().mean().item(),
           "share_gt_0.1": (tok_gap > 0.1).float().mean().item(),
           "share_lt_-0.1": (tok_gap < -0.1).float().mean().item(),
           "gate_gt_half": (tok_gap > 0).float().mean().item(),     # the share of tokens Eq. (11)'s gate opens
           **{f"gate_mean_beta{b}": torch.sigmoid(b * tok_gap).mean().item() for b in GATE_BETAS}}
    by_turn: dict[str, list] = {}
    for d, tr in zip(diffs, turns):       # the gap by the turn's index in its episode (5: the fifth and later)
        by_turn.setdefault(str(min(tr.step, 5)), []).append(d)
    out["gap_by_turn"] = {t: torch.cat(by_turn[t]).mean().item() for t in sorted(by_turn)}
    parts = {"action_tool": [], "action_other": [], "think": []}
    for d, tr in zip(diffs, turns):
        start = action_start(tok, tr.response_ids)
        action = envs.parse_action(tr.response_text) or ""
        parts["think"].append(d[:start])
        parts["action_tool" if tiny.tool_action(action, tr.task_type) else "action_other"].append(d[start:])
    for name, xs in parts.items():
        x = torch.cat(xs) if xs else torch.zeros(0)
        out[f"tokens_{name}"] = int(x.numel())
        out[f"gap_{name}"] = x.mean().item() if x.numel() else float("nan")
        out[f"share_higher_{name}"] = (x > 0).float().mean().item() if x.numel() else float("nan")
    return out


PREMISE_POINTS = 5.0   # [ours] the right skill must add this many points of success in the prompt


def premise(games_won: dict) -> dict | None:
    """[ours] Stage 0, the premise RSIPO needs before anyone spends GPU-days: does this model act on a skill in its
    prompt? Go when the right type-level skill adds at least PREMISE_POINTS points over no skill and beats a wrong-type
    skill by 2 s.e., both paired over games; None without the two conditions."""
    if "generic" not in games_won or "other" not in games_won:
        return None
    right, right_se, n = rollout.paired_gain(games_won["none"], games_won["generic"])
    wrong, wrong_se, _ = rollout.paired_gain(games_won["none"], games_won["other"])
    diff, diff_se, _ = rollout.paired_gain(games_won["other"], games_won["generic"])
    go = 100 * right >= PREMISE_POINTS and diff > 2 * diff_se
    line = (f"premise check: {'GO' if go else 'NO-GO'}: "
            f"the right skill {100 * right:+.1f} ± {100 * right_se:.1f} points "
            f"over none (needs ≥ {PREMISE_POINTS:g}), a wrong-type skill {100 * wrong:+.1f} ± {100 * wrong_se:.1f}, "
            f"right − wrong {100 * diff:+.1f} ± {100 * diff_se:.1f} (needs > 2 s.e.), {n} games")
    return {"right_minus_none": right, "right_se": right_se, "wrong_minus_none": wrong, "wrong_se": wrong_se,
            "right_minus_wrong": diff, "right_minus_wrong_se": diff_se, "games": n, "go": go, "line": line}


def _task_of(gamefile: str) -> str:
    """The task sentence of a game, from the first observation of its stored walkthrough."""
    steps = json.loads(tiny.walkthrough_of(gamefile).read_text())["steps"]
    return envs.task_from_intro(steps[0]["obs"])


def parse_args(argv=None) -> argparse.Namespace:
    """The command line. The flags not given take what train.py would use for this model (the tiny preset's, or
    the released ones), the temperature 0.4 (1 with --own); a --model without config.json is refused."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="a Hugging Face model folder (e.g. runs/default/warm_start)")
    p.add_argument("--data_root", default="data/alfworld")
    p.add_argument("--split", default="valid_unseen")
    p.add_argument("--games", type=int, default=60, help="held-out games (round-robin over task types)")
    p.add_argument("--repeats", type=int, default=3, help="episodes per game and condition")
    p.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature of the episodes (default 0.4; with --own 1, the training rollouts')")
    p.add_argument("--own", action="store_true", help="measure the policy's own skills (module docstring)")
    p.add_argument("--sources", type=int, default=8, help="--own: skill-free episodes per game to write skills from")
    p.add_argument("--cross", action="store_true", help="--own [ours]: also each game with a skill written in another "
                   "game of its type, as written, made over for its object and target, and with the wrong procedure")
    p.add_argument("--conditions", default="all", help="comma list of the given-skill conditions to play (none, "
                   "oracle, generic, wrong, wrong_place, other, bank), or all")
    p.add_argument("--skill_temperature", default="1,0", help="--own: T_skill of the skills written (a comma list: "
                   "each gives a condition won_T<t> from the same won episodes, 0 = greedy; lost_T<t> at the first)")
    p.add_argument("--max_turns", type=int, default=None, help="episode cap (default: train.py's for this model)")
    p.add_argument("--history_len", type=int, default=None, help="history shown (default: train.py's)")
    p.add_argument("--max_new_tokens", type=int, default=None, help="response tokens per turn (default: train.py's)")
    p.add_argument("--constrained", type=lambda s: {"true": True, "false": False}[s.lower()], default=None,
                   help="decode only admissible actions (default: train.py's: on for a tiny-preset model only)")
    p.add_argument("--bank", default="", help="a run's skill_bank.json (adds the 'bank' condition)")
    p.add_argument("--types", default="all", help="comma list of task types to probe (pick,look,clean,heat,cool,pick2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--out", default="", help="write the results as JSON here")
    a = p.parse_args(argv)
    if not (Path(a.model) / "config.json").exists():
        raise SystemExit(f"error: --model {a.model}: not a Hugging Face model folder (no config.json)")
    # the flags not given take what train.py would use for this model (the tiny preset's, or the released ones)
    defaults = {**REAL_MODEL_DEFAULTS, **(config.TINY if tiny.is_tiny(a.model) else {})}
    for k in ("max_turns", "history_len", "max_new_tokens", "constrained"):
        if getattr(a, k) is None:
            setattr(a, k, defaults[k])
    if a.temperature is None:
        a.temperature = 1.0 if a.own else 0.4
    return a


def choose_games(a) -> tuple[list[str], list[str], dict[str, str]]:
    """(split, games, types): the split's games of the --types probed, in the order of train.py's --eval_games
    evaluation, the first --games of them, and each game's task type. Refused when no game has those types or
    a game has no walkthrough.json (the oracle, generic and other skills are written from it)."""
    split = list_games(a.data_root, a.split)
    types = {g: game_task_type(g) for g in split}
    if a.types != "all":
        want = set(a.types.split(","))
        split = [g for g in split if types[g] in want]
        if not split:
            raise SystemExit(f"error: --types {a.types}: no game of those types in {a.data_root} {a.split} "
                             f"(it has {', '.join(sorted(set(types.values())))})")
    split = rollout.round_robin_by_type(split, types)   # the order of train.py's --eval_games evaluation
    games = split[:a.games] if a.games else split
    no_truth = [g for g in split if not tiny.walkthrough_of(g).exists()]
    if no_truth:   # the oracle, generic and other skills are written from each game's walkthrough.json
        raise SystemExit(f"error: {len(no_truth)} of the {len(split)} games in {a.data_root} {a.split} have no "
                         f"walkthrough.json beside them (e.g. {no_truth[0]}): the probe's skills need it")
    return split, games, types


def skill_conditions(a, split: list[str], games: list[str], types: dict[str, str], rng) -> dict:
    """The conditions to play, name -> {game: skill} (None for none): none, oracle, generic, wrong (when every
    probed type has a tool), wrong_place (when every game has one), other (when the split has another type),
    those outside --conditions dropped (none, oracle and generic are always played)."""
    oracle = {g: tiny.oracle_skill_of_game(g) for g in games}
    generic = {g: tiny.generic_skill_of_game(g) for g in games}
    other = {}
    for g in games:   # the oracle skill of a game of another type, from the whole split (--games 1 has no other)
        pick = [h for h in split if types[h] != types[g]]
        if pick:
            other[g] = tiny.oracle_skill_of_game(rng.choice(pick))
    conds = {"none": None, "oracle": oracle, "generic": generic}
    wrong = {g: tiny.wrong_skill_of_game(g) for g in games}
    if all(wrong.values()):
        conds["wrong"] = wrong
    else:
        print("a probed type has no tool to swap: the 'wrong' condition is left out (e.g. --types clean)")
    wrong_place = {g: tiny.wrong_place_skill_of_game(g) for g in games}
    if all(wrong_place.values()):
        conds["wrong_place"] = wrong_place
    if other:
        conds["other"] = other
    else:
        print(f"no game of another task type in {a.split}: the 'other' condition is left out")
    if a.conditions != "all":             # the none episodes are the control and the teacher's view: always played
        conds = {k: v for k, v in conds.items() if k in {"none", "oracle", "generic", *a.conditions.split(",")}}
    return conds


def bank_condition(a, games: list[str], types: dict[str, str], rng, conds: dict) -> dict:
    """--bank: print the banked skills against their games' truth (`score_bank`) and add the 'bank' condition to
    `conds` (a banked skill of each game's type, where the bank has one); return the scores."""
    bank = json.loads(Path(a.bank).read_text())["skills"]
    facts = score_bank(bank)
    print(f"banked skills against their games' truth (share naming it; {a.bank}):")
    print(f"{'type':8s}{'skills':>8s}"
          + "".join(f"{k:>12s}" for k in ("object", "target", "tool", "place", "wrong_tool")))
    for ttype, r in facts.items():
        print(f"{ttype:8s}{r['skills']:8d}" + "".join(f"{100 * r[k]:11.0f}%" for k in
                                                       ("object", "target", "tool", "place", "wrong_tool")))
    conds["bank"] = {g: rng.choice(bank[types[g]])["text"] for g in games if bank.get(types[g])}
    return facts


def play_conditions(engine, pool, conds: dict, games: list[str], a) -> tuple[dict, dict, list]:
    """Play --repeats episodes of every game under each condition, from the same sampling seed (paired
    episodes); return (success per condition, each game's success per condition, the none episodes). The pool is
    closed at the end."""
    results, games_won, eps_none = {}, {}, None
    try:
        for name, sk in conds.items():
            t0 = time.time()
            torch.manual_seed(a.seed)   # common random numbers across conditions
            tasks = [{pool.task_key: g} for g in games]
            skills = {i: sk[g] for i, g in enumerate(games) if sk and g in sk} if sk else None
            eps = run_episodes(engine, pool, tasks, a.repeats, history_len=a.history_len, skills=skills,
                               temperature=a.temperature, greedy=a.temperature <= 0, constrained=a.constrained)
            results[name] = success(eps)
            games_won[name] = rollout.mean_by((e.task_id, e.won) for e in eps)
            if name == "none":
                eps_none = eps
            print(f"{name:8s} success {results[name]['all']:.3f} on {len(eps)} episodes ({time.time() - t0:.0f}s)",
                  flush=True)
    finally:
        pool.close()
    return results, games_won, eps_none


def skills_after_wins(engine, eps_none: list, a) -> dict:
    """The skills the policy writes itself after its won 'none' episodes (the analyzer prompt, T 1), against
    their games' truth: valid, and naming the object, the target, the tool of the type, the place; printed."""
    won = [e for e in eps_none if e.won]
    gens = engine.generate([analyzer_prompt(e.task, True, e.steps) for e in won], temperature=1.0,
                           max_new_tokens=config.TINY["skill_max_tokens"] if tiny.is_tiny(a.model)
                           else 256, stop=False) if won else []
    texts = [parse_skill(g.text) for g in gens]
    fs = [tiny.skill_facts(t, tiny.walkthrough_of(e.task_id)) for t, e in zip(texts, won) if t]
    written = {"won_episodes": len(won), "valid": sum(t is not None for t in texts),
               **{k: (sum(f[k] for f in fs) / len(fs) if fs else float("nan"))
                  for k in ("object", "target", "tool", "place")},
               "examples": [t for t in texts if t][:3]}
    print(f"skills written after {len(won)} won episodes: {written['valid']} valid; naming the tool "
          f"{100 * written['tool']:.0f}%, the object {100 * written['object']:.0f}%, "
          f"the place {100 * written['place']:.0f}%")
    return written


def teacher_token_gaps(model, tok, engine, pool, eps_none: list, conds: dict) -> dict:
    """The teacher's view of the student's own turns (no skill in the student's prompt): per skill (oracle,
    generic), `token_gaps` of the same response tokens scored with the skill after the task line."""
    turns = [(e, tr) for e in eps_none for tr in e.turns]
    student = [(tr.prompt_ids, tr.response_ids) for _, tr in turns]
    ls = rollout.score_tokens(model, student, tok.pad_token_id, "cpu", 32)
    gaps = {}
    for name in ("oracle", "generic"):
        teacher = [rollout.teacher_pair(engine, tr, conds[name][e.task_id], rollout.task_line(pool, e.task))
                   for e, tr in turns]
        lt = rollout.score_tokens(model, teacher, tok.pad_token_id, "cpu", 32)
        gaps[name] = token_gaps([t - s for t, s in zip(lt, ls)], [tr for _, tr in turns], tok)
    return gaps


def compare_with_none(results: dict, games_won: dict) -> dict:
    """Each condition against none, paired over games (the same sampling seed in every condition), and the
    right procedure against the wrong one and the right place against the wrong one where both were played."""
    vs_none = {name: dict(zip(("gain", "se", "games"), rollout.paired_gain(games_won["none"], games_won[name])))
               for name in results if name != "none"}
    if "wrong" in results:                # what the procedure itself is worth: the right workflow against the wrong
        vs_none["generic_minus_wrong"] = dict(zip(("gain", "se", "games"),
                                                  rollout.paired_gain(games_won["wrong"], games_won["generic"])))
    if "wrong_place" in results:          # what the place is worth: the oracle skill against the wrong place
        vs_none["oracle_minus_wrong_place"] = dict(zip(("gain", "se", "games"), rollout.paired_gain(
            games_won["wrong_place"], games_won["oracle"])))
    return vs_none


def print_report(a, games: list[str], results: dict, vs_none: dict, gaps: dict):
    """Print the success table per condition and task type with each condition's gain over none, the paired
    differences, and the teacher's token gaps per skill."""
    cols = ["all"] + sorted({k for r in results.values() for k in r} - {"all"})
    print(f"\nheld-out success (%), {len(games)} games x {a.repeats} episodes, T {a.temperature}, {a.model}")
    print(f"{'condition':10s}" + "".join(f"{c:>8s}" for c in cols))
    for name, r in results.items():
        print(f"{name:10s}" + "".join(f"{100 * r.get(c, float('nan')):8.1f}" for c in cols)
              + (f"   vs none {100 * vs_none[name]['gain']:+.1f} ± {100 * vs_none[name]['se']:.1f}"
                 if name in vs_none else ""))
    for k in ("generic_minus_wrong", "oracle_minus_wrong_place"):
        if k in vs_none:
            d = vs_none[k]
            print(f"{k.replace('_minus_', ' − ')} (paired over games): {100 * d['gain']:+.1f} ± {100 * d['se']:.1f}")
    for name, g in gaps.items():
        print(f"\nteacher ({name} skill) - student on the 'none' turns: {g['mean_per_token']:+.4f} nat/token "
              f"(|gap| {g['mean_abs_per_token']:.4f}), {g['mean_per_turn']:+.3f} nat/turn, teacher higher on "
              f"{100 * g['turn_share_teacher_higher']:.0f}% of {g['turns']} turns")
        print(f"  tokens with |gap| < 0.01: {100 * g['share_abs_lt_0.01']:.0f}%, > 0.1 above: "
              f"{100 * g['share_gt_0.1']:.0f}%, below: {100 * g['share_lt_-0.1']:.0f}%; the gate σ(β·gap) averages "
              + ", ".join(f"{g[f'gate_mean_beta{b}']:.3f} at β {b}" for b in GATE_BETAS))
        for part in ("action_tool", "action_other", "think"):
            if g[f"tokens_{part}"]:
                print(f"  {part:13s} {g[f'tokens_{part}']:6d} tokens, gap {g[f'gap_{part}']:+.4f} nat/token, "
                      f"teacher higher on {100 * g[f'share_higher_{part}']:.0f}%")


def write_json(path: str, results: dict):
    """Write the results as JSON at `path` (its folder made) and say so."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(results, indent=1))
    print(f"saved {path}")


def main(argv=None):
    a = parse_args(argv)
    split, games, types = choose_games(a)
    rng = random.Random(a.seed)
    conds = skill_conditions(a, split, games, types, rng)
    from transformers import AutoModelForCausalLM
    tok = rollout.load_tokenizer(a.model)   # with a chat template (else a clear error) and a pad that is not EOS
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
    engine = HFEngine(model, tok, max_new_tokens=a.max_new_tokens)
    facts = bank_condition(a, games, types, rng, conds) if a.bank else {}

    pool = EnvPool(num_workers=a.workers, max_steps=a.max_turns)
    if a.own:
        try:
            out = own_skills(engine, pool, games, conds["generic"], a)
        finally:
            pool.close()
        if a.out:
            write_json(a.out, {"args": vars(a), **out})
        return out
    results, games_won, eps_none = play_conditions(engine, pool, conds, games, a)
    written = skills_after_wins(engine, eps_none, a)
    gaps = teacher_token_gaps(model, tok, engine, pool, eps_none, conds)
    vs_none = compare_with_none(results, games_won)
    print_report(a, games, results, vs_none, gaps)
    verdict = premise(games_won)
    if verdict:
        print("\n" + verdict["line"])
    if a.out:
        write_json(a.out, {"args": vars(a), "success": results, "vs_none": vs_none, "gap": gaps["oracle"],
                           "gaps": gaps, "premise": verdict, "bank_facts": facts, "written": written})


if __name__ == "__main__":
    main()
