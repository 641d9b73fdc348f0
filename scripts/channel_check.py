"""Does the teacher channel carry what a skill carries in the prompt? Context distillation alone, against controls.

Every arm starts from one warm start with the reward off (`train.py --distill_only true`: every advantage 0; here
also no KL and no entropy term), so the skill-free student learns only through the teacher term. Each task's
teacher is given its game's type-level skill (`--algo opsd --teacher_skill generic`, λ ≡ 1). An arm's gain is
its held-out success after − before, paired over the games of each run (`eval/gain`), then averaged over seeds
(± 1 s.e. over seeds). The yardstick is the same skill's worth in the prompt, measured at the warm start by the
same evaluation on the same held-out games (`in_prompt_gain`), and that of the wrong-procedure skill, the same
sentence with another type's tool and verb (`in_prompt_wrong_gain`). METHOD.md §5.9 gives the arms' reasons.

The arms (train.py flags on top of the common ones; `--arms` picks some):
  gated_live     Eq. (11) as published: the gated term, the live teacher (π_old with the skill)
  gated_beta0    the same with β 0: the gate ½ on every token, the same push on sampled tokens, no information
  signed_live    Eq. (11b), live teacher                 signed_ema   Eq. (11b), an EMA teacher
  topk_live      Eq. (11c), K 32, live teacher           topk_frozen  Eq. (11c), the frozen warm start
  topk_ema       Eq. (11c), an EMA teacher (decay 0.9)   topk_refresh Eq. (11c), a snapshot every 4 steps
                 (these four on the teacher's top-K: --teacher_support teacher)
  topk_ema_student  Eq. (11c), EMA teacher, on the student's top-K (π_old's; SDPO, TRL)
  topk_ema_union    Eq. (11c), EMA teacher, on both sides' top-K (verl's distillation)
  full_live      Eq. (11d), live teacher                 full_frozen  Eq. (11d), the frozen warm start
  negative       Eq. (11e): no teacher; advantage −1 on the sampled tokens π_old gave less than 0.2
  <arm>_wrong    any arm with the wrong-procedure skill (its right − wrong difference is paired by seed; BEST's is
                 the JSON's channel_right_minus_wrong)
--quick runs BEST and gated_beta0 on 2 seeds with 3 episodes per held-out game (train.py's 5 elsewhere), under 30
minutes on 2 cores from a clean checkout, the warm start included.
One JSON: in_prompt_gain, in_prompt_se, in_prompt_wrong_gain, in_prompt_wrong_se, and per arm gain, se,
seeds (with each seed's start, end and gain, its eval curve, the means of its teacher diagnostics), transfer (gain /
in_prompt_gain), and channel_right_minus_wrong.

    python scripts/channel_check.py --quick --out runs/channel_quick.json
    python scripts/channel_check.py --out runs/channel_clean/channel.json                       # every arm, 3 seeds
    python scripts/channel_check.py --setting testbed --out runs/channel_testbed/channel.json
    python scripts/channel_check.py --setting testbed --skills place --arms topk_ema,topk_ema_wrong --out runs/cp.json
    python scripts/channel_check.py --arms topk_ema --env_steps 24000 --eval_every 4 --out runs/channel_24k/channel.json

--skills place **[ours]** gives the teachers the workflow naming where the object lies in each game
(`--teacher_skill oracle`) and the control the same sentence naming another receptacle (`wrong_place`); the
JSON's in-prompt figures are then those two skills'.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
from compare import load_run, run_child  # noqa: E402

LIVE, FROZEN, EMA, REFRESH = (["--teacher_weights", w] for w in ("live", "frozen", "ema", "refresh"))
TOPK = ["--teacher_loss", "topk", "--teacher_support", "teacher"]
ARMS = {
    "gated_live": ["--teacher_loss", "gated", *LIVE],
    "gated_beta0": ["--teacher_loss", "gated", "--beta", "0", *LIVE],
    "signed_live": ["--teacher_loss", "signed", *LIVE],
    "signed_ema": ["--teacher_loss", "signed", *EMA],
    "topk_live": [*TOPK, *LIVE],
    "topk_frozen": [*TOPK, *FROZEN],
    "topk_ema": [*TOPK, *EMA],
    "topk_refresh": [*TOPK, *REFRESH],
    "topk_ema_student": ["--teacher_loss", "topk", "--teacher_support", "student", *EMA],
    "topk_ema_union": ["--teacher_loss", "topk", "--teacher_support", "union", *EMA],
    "full_live": ["--teacher_loss", "full", *LIVE],
    "full_frozen": ["--teacher_loss", "full", *FROZEN],
    "negative": ["--teacher_loss", "negative", *LIVE],
}
BEST = "topk_ema"          # the self-improving arm the quick check and the wrong-skill control run (RESULTS.md)
WRONG = f"{BEST}_wrong"
QUICK = [BEST, "gated_beta0"]
# reward off, no KL, no entropy; λ ≡ 1 and every teacher turn kept (opsd_keep 1); α 1 for every estimator
COMMON = ["--algo", "opsd", "--distill_only", "true", "--c_kl", "0", "--c_ent", "0", "--opsd_keep", "1", "--alpha",
          "1", "--sft_steps", "0"]
# --skills: the teacher's skill and its control (train.py --teacher_skill; harness/tiny.GIVEN_SKILLS), which differ
# in one fact: type, the type-level workflow against the wrong procedure; place [ours], the workflow naming where
# the object lies in its game against the same sentence naming another receptacle of the room
SKILLS = {"type": ("generic", "wrong"), "place": ("oracle", "wrong_place")}
SETTINGS = {
    # the default run's clean games; the warm start holds the clean procedure out (RESULTS.md chain R2)
    "clean": {"train": ["--data_root", "data/alfworld_clean", "--constrained", "false"], "env_steps": 8000,
              "warm_start": ["--preset", "none", "--data_root", "data/alfworld", "--steps", "0", "--eval", "false",
                             "--sft_hold_out", "clean"]},
    # the medium-room testbed (chain R5), its three types with a tool (the wrong-procedure skill needs one)
    "testbed": {"train": ["--preset", "none", "--data_root", "data/alfworld_medium", "--task_types", "clean,heat,cool"],
                "env_steps": 12000,
                "warm_start": ["--preset", "none", "--data_root", "data/alfworld_medium", "--sft_walkthroughs",
                               "data/alfworld_medium_sft", "--steps", "0", "--eval", "false", "--sft_steps", "2400"]},
}
DIAGNOSTICS = ["teacher/gap_mean", "teacher/gap_tool", "teacher/gap_other", "teacher/gate_gt_half", "teacher/kl_k1",
               "teacher/kl_k3", "teacher/skill_token_share", "opsd/kl", "opsd/gate_mean", "opsd/low_frac",
               "train/success", "update/grad_norm"]


def mean_se(xs: list[float]) -> tuple[float, float]:
    """Mean and its standard error (std with n − 1 over √n; nan for one value)."""
    if not xs:
        return float("nan"), float("nan")
    return statistics.fmean(xs), (statistics.stdev(xs) / len(xs) ** 0.5 if len(xs) > 1 else float("nan"))


def warm_start(a) -> Path:
    """--warm_start, or the setting's own warm start built once under <out dir>/warm_start."""
    if a.warm_start != "auto":
        path = Path(a.warm_start)
    else:
        path = Path(a.runs) / "warm_start" / "warm_start"
        if not (path.parent / "summary.json").exists():
            cmd = [sys.executable, "train.py", *SETTINGS[a.setting]["warm_start"], "--out_dir", a.runs,
                   "--run_name", "warm_start"]
            print("warm start:", " ".join(cmd), flush=True)
            run_child(cmd)
    if not (path / "config.json").exists():
        raise SystemExit(f"error: --warm_start {path}: not a Hugging Face model folder (no config.json)")
    return path


def skill_flags(a, wrong: bool = False) -> list[str]:
    """The teacher's skill (or its control) as train.py flags, for --skills."""
    return ["--teacher_skill", SKILLS[a.skills][int(wrong)]]


def in_prompt(a, ws: Path) -> dict:
    """The skills' worth in the prompt at the warm start: the held-out evaluation of train.py (its games, seed 0,
    --eval_repeats at --eval_temperature, common random numbers) without a skill, with each game's skill and with
    its control (--skills: the wrong procedure or the wrong place); gains paired over games."""
    from harness import tiny
    from harness.config import parse_args
    from harness.run import build_policy, setup, teardown
    from rollout import evaluate, paired_gain
    args = parse_args(["--model", str(ws), *COMMON, *skill_flags(a), *SETTINGS[a.setting]["train"], "--seed", "0",
                       "--out_dir", a.runs, "--run_name", "in_prompt", "--resume", "false", *a.extra])
    run = setup(args)
    try:
        build_policy(run)
        right, wrong = (tiny.GIVEN_SKILLS[k] for k in SKILLS[a.skills])
        given = {"none": None, "right": right, "wrong": wrong}
        won = {}
        for name, skill_of in given.items():
            skills = {g: skill_of(g) for g in run.eval_games} if skill_of else None
            ev, won[name] = evaluate(run.engine, run.pool, run.eval_games, repeats=args.eval_repeats, seed=args.seed,
                                     history_len=args.history_len, temperature=args.eval_temperature,
                                     constrained=args.constrained, skills=skills)
            print(f"in the prompt, {name}: held-out success {100 * ev['eval/success']:.1f}%", flush=True)
    finally:
        teardown(run)
    out = {"in_prompt_none": statistics.fmean(won["none"].values())}
    for name, key in (("right", "in_prompt"), ("wrong", "in_prompt_wrong")):
        gain, se, n = paired_gain(won["none"], won[name])
        out.update({f"{key}_gain": gain, f"{key}_se": se})
    out["in_prompt_games"], out["in_prompt_skills"] = n, dict(zip(("right", "wrong"), SKILLS[a.skills]))
    d, se, _ = paired_gain(won["wrong"], won["right"])
    out.update({"in_prompt_right_minus_wrong": d, "in_prompt_right_minus_wrong_se": se})
    return out


def arm_flags(a, arm: str) -> list[str]:
    """An arm's train.py flags on top of COMMON: its estimator and teacher weights, and the teacher's skill (an arm
    named <arm>_wrong: that arm's estimator and weights with the control's skill)."""
    wrong = arm.endswith("_wrong")
    return ARMS[arm.removesuffix("_wrong")] + skill_flags(a, wrong=wrong)


def run_arm(a, ws: Path, arm: str, seed: int) -> dict:
    """One (arm, seed): a train.py run in its own process (reused when its summary.json exists)."""
    flags = arm_flags(a, arm)
    name = f"{arm}_s{seed}" if a.skills == "type" else f"{arm}_{a.skills}_s{seed}"
    summary = Path(a.runs) / name / "summary.json"
    cmd = [sys.executable, "train.py", "--model", str(ws), *COMMON, *SETTINGS[a.setting]["train"], *flags,
           "--seed", str(seed), "--steps", "1000", "--max_env_steps", str(a.env_steps), "--eval_every",
           str(a.eval_every), "--out_dir", a.runs, "--run_name", name, *a.extra]
    if not summary.exists():
        print("running:", " ".join(cmd), flush=True)
        run_child(cmd)
    s = load_run(summary.parent, keys=DIAGNOSTICS)
    return {"seed": seed, "start": s["eval/success_at_start"], "end": s["eval/success"], "gain": s["eval/gain"],
            "gain_se": s["eval/gain_se"], "rl_steps": len(s["curve"]), "curve": s["eval_curve"],
            "diagnostics": s["internals"],
            "command": " ".join(cmd[1:])}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--setting", default="clean", choices=list(SETTINGS))
    p.add_argument("--skills", default="type", choices=list(SKILLS), help="the teacher's skill and its control: "
                   "type (the type-level workflow; the wrong procedure) | place [ours] (the workflow naming where "
                   "the object lies; another receptacle)")
    p.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}, seeds 0 and 1, 3 episodes a "
                   "held-out game")
    p.add_argument("--arms", default="all", help=f"comma list of {', '.join(ARMS)} (each also as <arm>_wrong), "
                   "or all")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--env_steps", type=int, default=0, help="env-step budget a run (0 = the setting's: clean 8,000, "
                   "testbed 12,000)")
    p.add_argument("--eval_every", type=int, default=0, help="held-out evaluations along each run (train.py's flag)")
    p.add_argument("--warm_start", default="auto", help="a model folder, or auto (built once under the runs' folder)")
    p.add_argument("--out", required=True, help="the JSON to write; the runs go to its folder's runs/ (or --runs)")
    p.add_argument("--runs", default="", help="the folder of the runs (default: <folder of --out>/channel_runs)")
    a = p.parse_args(argv)
    a.extra = (["--eval_repeats", "3"] if a.quick else []) + extra   # quick: the evaluations are half its time
    a.runs = a.runs or str(Path(a.out).resolve().parent / "channel_runs")
    a.env_steps = a.env_steps or SETTINGS[a.setting]["env_steps"]
    arms = QUICK if a.quick else ([*ARMS, WRONG] if a.arms == "all" else a.arms.split(","))
    unknown = [x for x in arms if x.removesuffix("_wrong") not in ARMS]
    if unknown:
        raise SystemExit(f"error: --arms {','.join(unknown)}: unknown; the arms are {', '.join(ARMS)}, each also as "
                         "<arm>_wrong")
    seeds = [0, 1] if a.quick else [int(s) for s in a.seeds.split(",")]
    ws = warm_start(a)
    from harness.config import parse_args   # the data the runs read: the setting's, or a --data_root after --
    data = parse_args(["--model", str(ws), *COMMON, *SETTINGS[a.setting]["train"], *a.extra]).data_root
    out = {"setting": a.setting, "data_root": data, "skills": a.skills, "warm_start": str(ws), "env_steps": a.env_steps,
           "seeds": seeds,
           "common_flags": COMMON + SETTINGS[a.setting]["train"] + a.extra,
           "command": "python scripts/channel_check.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    prompt_file = Path(a.runs) / ("in_prompt.json" if a.skills == "type" else f"in_prompt_{a.skills}.json")
    if not prompt_file.exists():
        Path(a.runs).mkdir(parents=True, exist_ok=True)
        prompt_file.write_text(json.dumps(in_prompt(a, ws), indent=1))
    out.update(json.loads(prompt_file.read_text()))
    out["arms"] = {}
    for arm in arms:
        runs = [run_arm(a, ws, arm, s) for s in seeds]
        gain, se = mean_se([r["gain"] for r in runs])
        out["arms"][arm] = {"flags": arm_flags(a, arm), "gain": gain, "se": se,
                            "transfer": gain / out["in_prompt_gain"] if out["in_prompt_gain"] else float("nan"),
                            "seeds": runs}
    for arm in [x for x in arms if f"{x}_wrong" in out["arms"]]:
        d = [r["gain"] - w["gain"] for r, w in zip(out["arms"][arm]["seeds"], out["arms"][f"{arm}_wrong"]["seeds"])]
        diff, se = mean_se(d)
        out["arms"][arm]["right_minus_wrong"] = {"per_seed": d, "diff": diff, "se": se}
        if arm == BEST:
            out["channel_right_minus_wrong"] = {"arm": BEST, "per_seed": d, "diff": diff, "se": se}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(report(out))
    print(f"wrote {a.out}")
    return out


def report(out: dict) -> str:
    lines = [f"setting {out['setting']} (data {out.get('data_root', '?')}), {out['env_steps']} env steps a run, seeds "
             f"{out['seeds']}, warm start {out['warm_start']}",
             f"in the prompt (held-out, {out['in_prompt_games']} games, "
             f"none {100 * out['in_prompt_none']:.1f}%): right "
             f"skill {100 * out['in_prompt_gain']:+.1f} ± {100 * out['in_prompt_se']:.1f}, wrong skill "
             f"{100 * out['in_prompt_wrong_gain']:+.1f} ± {100 * out['in_prompt_wrong_se']:.1f}, right − wrong "
             f"{100 * out['in_prompt_right_minus_wrong']:+.1f} ± {100 * out['in_prompt_right_minus_wrong_se']:.1f}",
             f"{'arm':16s} {'gain ± s.e. (seeds)':>22s} {'transfer':>9s}  per seed (start → end)"]
    for arm, r in out["arms"].items():
        per = ", ".join(f"{100 * s['start']:.1f}→{100 * s['end']:.1f}" for s in r["seeds"])
        lines.append(f"{arm:16s} {100 * r['gain']:+10.1f} ± {100 * r['se']:4.1f}      "
                     f"{100 * r['transfer']:7.0f}%  {per}")
    for arm, r in out["arms"].items():
        if "right_minus_wrong" in r:
            c = r["right_minus_wrong"]
            lines.append(f"through the channel ({arm}), right − wrong paired by seed: {100 * c['diff']:+.1f} ± "
                         f"{100 * c['se']:.1f}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
