"""Side by side: GRPO, GRPO+OPSD and RSIPO on the CPU setup, several seeds, the same env-step budget.

Each (algorithm, seed) is one `train.py` run in its own process, stopped when it has spent
`--env_steps` environment steps (student rollouts plus, for RSIPO, trajectory replays), so that
RSIPO pays for its replays. By default every run starts from one shared warm start (built once,
with the RSIPO warm-start data, so that it can also write skills), so the algorithms differ only
in RL and the spread of `after warm start` over seeds is the evaluation noise. Runs that already
finished are reused (their summary.json), so an interrupted comparison resumes.
Writes <out>/compare.md (table), <out>/compare.json and
<out>/compare.png (held-out success, and training success against environment steps).

    python scripts/compare.py                            # 3 seeds x grpo/opsd/rsipo, tiny default (README)
    python scripts/compare.py --seeds 0 --algos grpo,rsipo --env_steps 4000 \
        -- --steps 40   # extra train.py flags after --
"""
from __future__ import annotations

import argparse
import json
import re
import signal
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the repository root: train.py runs there, as in the README
sys.path.insert(0, str(ROOT))
TYPES = ["pick", "look", "clean", "heat", "cool", "pick2"]
INTERNALS = ["skill/valid_frac", "skill/names_target", "replay/gain_mean", "replay/uninformative", "trust/mean",
             "trust/shrink_mean", "opsd/gate_mean", "opsd/gap_mean", "gigpo/anchored_frac", "train/success",
             "skill/won_sources", "skill/lost_sources", "replay/won_gain", "replay/lost_gain", "trust/won_mean",
             "trust/lost_mean", "time/step"]


def warm_start(a, extra: list[str]) -> list[str]:
    """The train.py flags that start a run from the shared warm start (building it first if needed)."""
    if a.warm_start == "none":
        return []
    path = Path(a.warm_start)
    if a.warm_start == "auto":
        path = Path(a.out) / "warm_start" / "warm_start"
        if not (Path(a.out) / "warm_start" / "summary.json").exists():
            cmd = [sys.executable, str(ROOT / "train.py"), "--algo", "rsipo", "--steps", "0", "--seed", "0",
                   "--out_dir", a.out, "--run_name", "warm_start", *extra]
            print("warm start:", " ".join(cmd), flush=True)
            run_child(cmd)
    if not (path / "config.json").exists():
        raise SystemExit(f"error: --warm_start {path}: not a Hugging Face model folder (no config.json)")
    # a tiny-preset checkpoint gets the tiny preset's settings by itself (tiny.is_tiny); flags given after
    # `--` come later on the command line and win
    return ["--model", str(path), "--sft_steps", "0"]


def run_one(algo: str, seed: int, a, extra: list[str]) -> dict:
    name = f"{algo}_s{seed}"
    summary = Path(a.out) / name / "summary.json"
    if not summary.exists():
        cmd = [sys.executable, str(ROOT / "train.py"), "--algo", algo, "--seed", str(seed), "--steps", str(a.max_steps),
               "--max_env_steps", str(a.env_steps), "--out_dir", a.out, "--run_name", name, *extra]
        print("running:", " ".join(cmd), flush=True)
        run_child(cmd)
    return load_run(Path(a.out) / name)


def run_child(cmd: list[str]):
    """Run one train.py child and wait for it. A SIGTERM or Ctrl-C to this script is passed on to the child, which
    writes a checkpoint and exits (the same command later resumes it), and this script exits after it: a child never
    outlives the script that started it. A child that fails ends the script with its exit code."""
    child = subprocess.Popen(cmd, cwd=ROOT)
    previous = {sig: signal.signal(sig, lambda signum, frame: child.send_signal(signal.SIGTERM))
                for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        rc = child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if child.poll() is None:          # this script is ending for another reason: the child ends with it
            child.kill()
            child.wait()
    if rc in (130, 143):
        raise SystemExit(f"stopped: {cmd[1]} wrote a checkpoint and exited ({rc}); the same command resumes it")
    if rc:
        raise SystemExit(f"error: {' '.join(cmd)} exited with {rc}")


def check_args(algos: list[str], extra: list[str]):
    """Every algorithm name and the train.py flags after `--`, checked before any run starts (a warm start takes
    minutes): an unknown name or a bad flag is an error at once."""
    from harness.config import CHOICES, parse_args
    bad = [x for x in algos if x not in CHOICES["algo"]]
    if bad:
        raise SystemExit(f"error: --algos {','.join(bad)}: unknown; the algorithms are {', '.join(CHOICES['algo'])}")
    for algo in algos:
        parse_args(["--algo", algo, *extra])   # train.py's own checks, with its own messages


def load_run(run_dir: Path, keys=None) -> dict:
    """A finished run's summary with its training curve, held-out curve and the means of its internals (`keys`,
    default INTERNALS: each metric's mean over the RL steps that logged it)."""
    s = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]
    s["curve"] = [(r["train/env_steps_total"], r["train/success"]) for r in rows if "train/env_steps_total" in r]
    s["eval_curve"] = eval_curve(s, rows)
    # the run's internals, means over its RL steps (those it logged: RSIPO's skills, replay and trust; GiGPO's anchors)
    s["internals"] = {k: statistics.mean(v) for k in (INTERNALS if keys is None else keys)
                      if (v := [r[k] for r in rows if isinstance(r.get(k), (int, float))])}
    # and the trust check over the whole run (rsipo with --calibrate): Brier scores of eb and raw trust
    s["internals"].update({k: s[k] for k in ("calib/brier_eb", "calib/brier_raw", "calib/base_brier", "calib/tasks")
                           if k in s})
    return s


def eval_curve(summary: dict, rows: list[dict]) -> list[tuple[int, float]]:
    """Held-out success against env steps spent: the start (0), every --eval_every evaluation (logged in its
    step's row), and the final evaluation at the run's last env-step count; [] without both ends."""
    if summary.get("eval/success_at_start") is None or summary.get("eval/success") is None:
        return []
    steps = [r for r in rows if "train/env_steps_total" in r]
    mid = [(r["train/env_steps_total"], r["eval/success"]) for r in steps[:-1] if "eval/success" in r]
    return [(0, summary["eval/success_at_start"])] + mid + [(steps[-1]["train/env_steps_total"] if steps else 0,
                                                             summary["eval/success"])]


def mean_curve(runs: list[dict]) -> list[tuple[float, float, float]]:
    """(mean env steps, mean held-out success, its s.e. over seeds) at each evaluation the runs share by index."""
    curves = [r["eval_curve"] for r in runs if r.get("eval_curve")]
    out = []
    for k in range(min(map(len, curves), default=0)):
        xs, ys = [c[k][0] for c in curves], [c[k][1] for c in curves]
        se = statistics.stdev(ys) / len(ys) ** 0.5 if len(ys) > 1 else 0.0
        out.append((statistics.mean(xs), statistics.mean(ys), se))
    return out


def steps_to_reach(curve: list[tuple[float, float, float]], target: float) -> float | None:
    """The env steps at which a mean curve first reaches `target` (linear between evaluations), or None."""
    for (x0, y0, _), (x1, y1, _) in zip(curve, curve[1:]):
        if y1 >= target:
            return x1 if y1 == y0 or y0 >= target else x0 + (target - y0) / (y1 - y0) * (x1 - x0)
    return None


def mean_se(xs: list[float]) -> tuple[float, float]:
    """The mean (nan for none) and its standard error (std with n − 1, over √n; nan under 2 values)."""
    return (statistics.mean(xs) if xs else float("nan"),
            statistics.stdev(xs) / len(xs) ** 0.5 if len(xs) > 1 else float("nan"))


def by_seed_text(d: list[float], mean: float, se: float, seeds: list[int], games: tuple | None) -> str:
    """'by seed (0, 1): +1.0, +2.0 → **+1.5 ± 0.5** points (1 s.e. over seeds; 3.0 s.e.)', and where the runs logged
    their games, '; over its N (seed, game) pairs …' from `games` = (mean, s.e., N)."""
    return (f"by seed ({', '.join(map(str, seeds))}): {', '.join(f'{100 * x:+.1f}' for x in d)} → "
            f"**{100 * mean:+.1f} ± {100 * se:.1f}** points "
            f"(1 s.e. over seeds; {mean / se if se else float('nan'):.1f} s.e.)"
            + (f"; over its {games[2]} (seed, game) pairs {100 * games[0]:+.1f} ± {100 * games[1]:.1f} "
               f"({games[0] / games[1] if games[1] else 0:.1f} s.e.)" if games else ""))


def paired(base: list[dict], other: list[dict]) -> tuple[list[float], float, float]:
    """Held-out success after RL, `other` − `base`, seed by seed (runs of one seed share the warm start and the
    evaluation's random numbers): the differences, their mean and its standard error over seeds."""
    d = [o["eval/success"] - b["eval/success"] for b, o in zip(base, other)
         if b.get("eval/success") is not None and o.get("eval/success") is not None]
    return d, *mean_se(d)


def paired_over_games(base: list[dict], other: list[dict]) -> tuple[float, float, int] | None:
    """Held-out success after RL, `other` − `base`, game by game within each seed (the same games, the same
    evaluation seed), pooled over the seeds: the mean difference, its standard error over the (seed, game) pairs,
    and their number; None under 2 pairs. It counts the evaluation's noise only, not the spread of training over
    seeds: with several seeds, the s.e. over seeds is the one to judge by; this one shows how much of it the
    held-out games alone would give."""
    d = []
    for b, o in zip(base, other):
        a, c = b.get("eval/by_game") or {}, o.get("eval/by_game") or {}
        d += [c[g] - a[g] for g in a if g in c]
    return (*mean_se(d), len(d)) if len(d) > 1 else None


def paired_lines(res: dict, seeds: list[int]) -> list[str]:
    """One line per algorithm against the first one (grpo by default): the paired difference per seed (and over
    the (seed, game) pairs, where the runs logged their games), a step's wall time against the first's; and where
    the runs evaluated along the way (--eval_every), the env steps each needs to reach the first's final held-out
    success (mean curves over seeds)."""
    base, *others = list(res)
    out = []
    for algo in others:
        d, mean, se = paired(res[base], res[algo])
        games = paired_over_games(res[base], res[algo])
        if games and len(d) == 1:         # one seed: no s.e. over seeds, the pairs are its games
            mean, se, n = games
            out.append(f"\n{algo} − {base}, held-out success after RL, seed {seeds[0]}, paired over its {n} games: "
                       f"**{100 * mean:+.1f} ± {100 * se:.1f}** points "
                       f"(1 s.e. over games; {mean / se if se else 0:.1f} s.e.)")
        elif d:
            out.append(f"\n{algo} − {base}, held-out success after RL paired "
                       + by_seed_text(d, mean, se, seeds, games))
        ratio = [o["internals"]["time/step"] / b["internals"]["time/step"] for b, o in zip(res[base], res[algo])
                 if "time/step" in b.get("internals", {}) and "time/step" in o.get("internals", {})]
        if ratio:                         # the cost: a step's wall time against the base's, seed by seed
            out.append(f"\n{algo}'s step time (mean `time/step`) over {base}'s: "
                       f"{', '.join(f'{r:.2f}' for r in ratio)} → mean {statistics.mean(ratio):.2f}×")
    ref = mean_curve(res[base])
    if len(ref) > 2:                      # evaluations between the start and the end
        target = ref[-1][1]
        for algo in [base] + others:
            reach = steps_to_reach(mean_curve(res[algo]), target)
            share = ("not reached" if reach is None else
                     f"{reach:,.0f} env steps ({100 * reach / ref[-1][0]:.0f}% of {base}'s)")
            out.append(f"\n{algo} reaches {base}'s final held-out success ({100 * target:.1f}%): {share}")
    return out


def parse_contrast(expr: str, arms: list[str]) -> dict[str, float]:
    """'rsipo_bank-rsipo_alpha0-0.5*opsd_generic+0.5*opsd_alpha0' → {arm: weight}; a clear error for an arm not
    in the table or for text that is not such a sum."""
    term = re.compile(r"\s*([+-]?)\s*(?:(\d*\.?\d+)\s*\*\s*)?([A-Za-z_]\w*)\s*")
    weights, pos = {}, 0
    while pos < len(expr):
        m = term.match(expr, pos)
        if not m or (pos and not m.group(1)):     # every term after the first needs its sign
            raise SystemExit(f"error: --contrast {expr}: not a weighted sum of arms at '{expr[pos:]}'; "
                             "e.g. rsipo_bank-rsipo_alpha0-0.5*opsd_generic+0.5*opsd_alpha0")
        sign, w, arm = m.groups()
        if arm not in arms:
            raise SystemExit(f"error: --contrast {expr}: unknown arm {arm}; the arms are {', '.join(arms)}")
        weights[arm] = weights.get(arm, 0.0) + (-1 if sign == "-" else 1) * float(w or 1)
        pos = m.end()
    if not weights:
        raise SystemExit("error: --contrast is empty")
    return weights


def contrast(res: dict, weights: dict[str, float]) -> tuple[list[float], float, float, tuple | None]:
    """The weighted sum of the arms' held-out success after RL (a difference of differences, e.g. one algorithm's
    teacher share α 1 − α 0 less half of another's), seed by seed where every arm was evaluated: the values, their
    mean and its s.e. over seeds; and the same sum game by game pooled over the seeds, as (mean, s.e., pairs) or
    None under 2 games."""
    per_seed, per_game = [], []
    for runs in zip(*(res[arm] for arm in weights)):
        if any(r.get("eval/success") is None for r in runs):
            continue
        per_seed.append(sum(w * r["eval/success"] for w, r in zip(weights.values(), runs)))
        games = [r.get("eval/by_game") or {} for r in runs]
        per_game += [sum(w * g[k] for w, g in zip(weights.values(), games))
                     for k in games[0] if all(k in g for g in games)]
    return per_seed, *mean_se(per_seed), (*mean_se(per_game), len(per_game)) if len(per_game) > 1 else None


def fmt(xs: list[float]) -> str:
    if not xs:
        return "–"
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{100 * statistics.fmean(xs):.1f} ± {100 * sd:.1f}"


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--algos", default="grpo,opsd,rsipo")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--env_steps", type=int, default=12000, help="environment-step budget per run")
    p.add_argument("--max_steps", type=int, default=100, help="RL step cap (the budget usually ends a run first)")
    p.add_argument("--out", default="runs/compare")
    p.add_argument("--warm_start", default="auto",
                   help="'auto' (one shared warm start under <out>/warm_start), a model folder, "
                        "or 'none' (each run its own)")
    p.add_argument("--collect", default="", help="tabulate runs that exist instead of running any: a comma list of "
                   "label=prefix, the runs of each seed S at <prefix><S> (e.g. grpo=runs/tb/grpo/grpo_s); the first is "
                   "the base of the paired differences")
    p.add_argument("--contrast", default="", help="also print a weighted sum of the arms' held-out success, by seed "
                   "and over (seed, game) pairs, e.g. 'rsipo_bank-rsipo_alpha0-0.5*opsd_generic+0.5*opsd_alpha0' "
                   "(> 0: RSIPO's teacher share is more than half of OPSD's)")
    a = p.parse_args(argv)
    algos = a.algos.split(",")
    try:
        seeds = [int(s) for s in a.seeds.split(",")]
    except ValueError:
        raise SystemExit(f"error: --seeds {a.seeds}: a comma list of integers, e.g. 0,1,2") from None
    if not a.collect:
        check_args(algos, extra)
    arms = dict(x.split("=", 1) for x in a.collect.split(",")) if a.collect else {}
    weights = parse_contrast(a.contrast, list(arms) if a.collect else algos) if a.contrast else None
    if a.collect:                         # runs made by several invocations (other flags each), side by side
        res = {label: [load_run(Path(f"{prefix}{s}")) for s in seeds] for label, prefix in arms.items()}
    else:
        flags = warm_start(a, extra) + extra
        res = {algo: [run_one(algo, s, a, flags) for s in seeds] for algo in algos}

    cmd = (f"--collect {a.collect}" if a.collect else f"--algos {a.algos} --env_steps {a.env_steps} --warm_start "
           f"{a.warm_start}" + (" -- " + " ".join(extra) if extra else ""))
    lines = [f"Held-out success (%), mean ± std over seeds {seeds}"
             + ("" if a.collect else f", {a.env_steps} env steps per run")
             + f" (`python scripts/compare.py --seeds {a.seeds} {cmd}`)", "",
             "| algo | after warm start | after RL | gain (paired) | " + " | ".join(TYPES) + " | RL steps |",
             "|---" * (5 + len(TYPES)) + "|"]
    table = {}
    for algo, runs in res.items():
        start = [r.get("eval/success_at_start") for r in runs if r.get("eval/success_at_start") is not None]
        end = [r.get("eval/success") for r in runs if r.get("eval/success") is not None]
        per = {t: [r[f"eval/success_{t}"] for r in runs if f"eval/success_{t}" in r] for t in TYPES}
        steps = [len(r["curve"]) for r in runs]
        # end − start of each run: both evaluations of a seed draw the same random numbers (rollout.evaluate)
        gain = [r["eval/success"] - r["eval/success_at_start"] for r in runs
                if r.get("eval/success") is not None and r.get("eval/success_at_start") is not None]
        gain_mean, gain_se = mean_se(gain)           # over seeds
        table[algo] = {"start": start, "end": end, "gain": gain, "gain_mean": gain_mean,
                       "gain_se": gain_se, "per_type": per, "rl_steps": steps,
                       "internals": [r["internals"] for r in runs]}
        lines.append(f"| {algo} | {fmt(start)} | {fmt(end)} | {fmt(gain)} | " + " | ".join(fmt(per[t]) for t in TYPES)
                     + f" | {', '.join(map(str, steps))} |")
    lines += paired_lines(res, seeds)
    if weights:
        d, mean, se, games = contrast(res, weights)
        lines.append(f"\n{a.contrast}, held-out success after RL " + by_seed_text(d, mean, se, seeds, games))
    md = "\n".join(lines) + "\n"
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.md").write_text(md)
    (out / "compare.json").write_text(json.dumps({"table": table, "config": vars(a), "extra": extra}, indent=1))
    print(md)

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    mean_curves = {algo: mean_curve(runs) for algo, runs in res.items()}
    curves = any(len(c) > 2 for c in mean_curves.values())
    fig, ax = plt.subplots(1, 3 if curves else 2, figsize=(16 if curves else 11, 3.8))
    for i, (algo, runs) in enumerate(res.items()):
        c = f"C{i}"
        for j, r in enumerate(runs):
            xs, ys = zip(*r["curve"]) if r["curve"] else ([], [])
            ax[1].plot(xs, ys, color=c, alpha=0.6, label=algo if j == 0 else None)
        if curves and mean_curves[algo]:   # held-out success against env steps, mean ± s.e. over seeds
            xs, ys, se = zip(*mean_curves[algo])
            ax[2].errorbar(xs, ys, yerr=se, color=c, capsize=3, marker="o", label=algo)
        ax[0].errorbar([i - 0.1, i + 0.1],
                       [statistics.fmean(table[algo][k] or [0]) for k in ("start", "end")],
                       yerr=[statistics.stdev(table[algo][k]) if len(table[algo][k]) > 1 else 0
                             for k in ("start", "end")],
                       fmt="o-", color=c, capsize=3)
    ax[0].set_xticks(range(len(res)), list(res)), ax[0].set_ylabel("held-out success (start → end)")
    ax[1].set_xlabel("environment steps"), ax[1].set_ylabel("training-rollout success"), ax[1].legend()
    if curves:
        ax[2].set_xlabel("environment steps"), ax[2].set_ylabel("held-out success (mean ± s.e. over seeds)")
        ax[2].legend()
    fig.tight_layout()
    fig.savefig(out / "compare.png", dpi=100)
    print(f"wrote {out / 'compare.md'} and {out / 'compare.png'}")


if __name__ == "__main__":
    main()
