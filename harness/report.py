"""harness/report.py: a one-page HTML report of a training run, written at its end or by hand.

Contract
--------
`write_report(run_dir) -> Path` writes `<run_dir>/report.html` and its plots `<run_dir>/report/*.png`
(referenced relatively, so the folder can be copied or served as is), and returns the HTML's path.
It reads whatever of these exists in `run_dir`; a missing, unreadable or partial input only leaves
its section out, with a short note in its place. Bad inputs never raise: only failing to write the
report itself (a full or read-only disk) raises OSError, so a run ends with at worst that to catch.

    config.json      the resolved flags, a flat object (else summary.json's "config" is used)
    metrics.jsonl    one object per line, each with "step". RL step rows carry "train/success",
                     "train/reward", "loss", "pg/loss", "kl/k3", "entropy", "update/grad_norm", ...
                     and for RSIPO "skill/*", "replay/*", "trust/*", "opsd/*". Evaluation results
                     carry "eval/success" and "eval/success_<type>": in their own row (the final
                     evaluation) or merged into an RL step row (--eval_every). Unreadable lines (a run
                     killed mid-write) are skipped; a step logged twice (a resumed run) keeps its last row.
    summary.json     "eval/success_at_start", "eval/success", "eval_at_start/success_<type>",
                     "eval/success_<type>", "eval/gain", "eval/gain_se", "eval/gain_games", "config"
    skill_bank.json  RSIPO's bank, skills.SkillBank.to_dict: {"version", "capacity", "skills":
                     {task type: [{"text", "task_type", "task_id", "step", "uses", "mean_gain",
                     "shrunk_gain"}, ...]}}
    calibration.jsonl  [ours] RSIPO with --calibrate: one row per scored skill and step, {"step",
                     "task_id", "task_type", "trust", "trust_eb", "trust_raw", "gain", "fresh_gain",
                     "informative"}; a (step, task_id) logged twice keeps its last row.
    episodes.json    two sample training episodes, written by train.py at the end of a run:

        {"won": EP or null, "lost": EP or null}
        EP = {"task": str,            # the task line the agent was given
              "task_type": str,       # pick, look, clean, heat, cool, pick2 (ALFWorld); single, multi (search)
              "skill": str or null,   # the skill in the student's prompt (RSIPO), null if none
              "reward": float,        # the episode's return
              "won": bool,
              "steps": [[observation, action], ...],   # per turn: what the agent saw, then what it did
              "step": int}            # the RL step the episode was played in

The page, top to bottom: header (run name, algo, model, env, steps done [of asked], seed, the
date summary.json was written; held-out success start → end and the paired gain ± 1 s.e.);
learning curves (training success and reward per RL step with the held-out points; loss terms);
held-out success by task type before and after (bars and a table); RSIPO internals per step
(replay gain per type, shrinkage, trust, OPSD gate and teacher − student gap, skill validity; only
the panels whose metrics exist); the trust check (with calibration.jsonl: a reliability plot of Eq. 9's
λ under eb and raw trust against fresh replays, and their Brier scores); the skill bank's best skills per
type by shrunk gain; one won and one lost sample episode with their skill (observations clipped to
OBS_CHARS characters, long episodes to their first and last turns); the resolved config. Runs of 40
steps or more are drawn faint per step under a moving average over ~5% of the steps.
All text from the run (skills, observations, actions, config values) is HTML-escaped; the page has
no JavaScript and no external assets. Plots use matplotlib's Agg canvas, without pyplot's global state.

Run:   python -m harness.report runs/<name>          (prints the report's path)
Test:  OMP_NUM_THREADS=1 python -m pytest tests/test_report.py -q
"""
from __future__ import annotations

import argparse
import datetime as _dt
import html
import json
import math
import sys
from pathlib import Path

from infra.io import jsonl_lines, write_text

OBS_CHARS = 300        # an observation longer than this is clipped, with a marker saying how much was cut
ACTION_CHARS = 200
SKILL_CHARS = 800      # skills are a line of at most --skill_max_words words; this only guards the page
EPISODE_HEAD, EPISODE_TAIL = 8, 4   # turns shown of a long episode: its first and last ones
BANK_TOP = 3           # best skills shown per task type
PLOT_DIR = "report"
PLOTS = ("curves.png", "losses.png", "by_type.png", "rsipo.png", "calibration.png")
# Task types in the order the envs list them; others (a new env) follow, sorted.
TYPE_ORDER = ("pick", "look", "clean", "heat", "cool", "pick2", "single", "multi")
HEADER_KEYS = ("algo", "model", "env", "steps", "seed")

CSS = """
body{font:14px/1.45 system-ui,-apple-system,'Segoe UI',sans-serif;color:#222;
     max-width:1180px;margin:18px auto;padding:0 16px}
h1{font-size:22px;margin:0 0 4px}
h2{font-size:17px;margin:26px 0 8px;padding-bottom:3px;border-bottom:1px solid #ccc}
h3{font-size:14px;margin:10px 0 4px}
.meta span{margin-right:18px;color:#555}
.meta b{color:#222;font-weight:600}
.headline{font-size:18px;margin:10px 0 2px}
.headline .big{font-weight:700}
.note{color:#777;font-style:italic;font-size:13px;margin:4px 0}
table{border-collapse:collapse;font-size:13px}
th,td{padding:3px 9px;border-bottom:1px solid #e6e6e6;text-align:left;vertical-align:top}
th{background:#f4f4f4;font-weight:600;white-space:nowrap}
td.n{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
td.skilltext{max-width:760px;overflow-wrap:anywhere}
tr.grp td{border-top:2px solid #d0d0d0}
img{max-width:100%;height:auto;display:block;margin:4px 0}
.row{display:flex;gap:28px;flex-wrap:wrap;align-items:flex-start}
.eps{display:grid;grid-template-columns:1fr 1fr;gap:16px}
.ep{border:1px solid #ddd;border-radius:4px;padding:6px 10px;min-width:0}
.ep.won{border-top:4px solid #2e9e44}
.ep.lost{border-top:4px solid #c8413b}
.ep .facts{color:#555;font-size:13px}
.skill{background:#fff8dc;border-left:3px solid #d9a400;padding:4px 8px;margin:6px 0;font-size:13px;
       overflow-wrap:anywhere}
.turn{margin:5px 0}
.obs{white-space:pre-wrap;overflow-wrap:anywhere;font:12px/1.35 ui-monospace,Menlo,Consolas,monospace;
     background:#f5f5f5;padding:3px 6px;margin:0}
.act{font:12px/1.35 ui-monospace,Menlo,Consolas,monospace;color:#0b5cad;overflow-wrap:anywhere;padding:1px 6px}
.cut{color:#a33;font-style:italic}
.cfg td{font:12px/1.3 ui-monospace,Menlo,Consolas,monospace;padding:1px 8px}
"""


# ---------------------------------------------------------------------------------------------
# Reading the run: each reader returns (data or None, a note or None) and never raises
# ---------------------------------------------------------------------------------------------

def _esc(x) -> str:
    return html.escape(str(x), quote=True)


def _read_json(path: Path, what: str):
    if not path.exists():
        return None, f"no {path.name}"
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        return None, f"{path.name} unreadable ({type(e).__name__}: {e})"
    if not isinstance(d, dict):
        return None, f"{path.name} is not a JSON object ({what} expected)"
    return d, None


def _read_jsonl(path: Path, keep):
    """The objects of a JSONL file for which `keep(obj)` returns a key (a later line with the same key
    replaces an earlier one: a resumed run logs again the steps after its checkpoint), and a note
    counting the lines that are not JSON or that `keep` refuses (None). ([], note) if unreadable."""
    try:
        lines = jsonl_lines(path)
    except OSError as e:
        return {}, f"{path.name} unreadable ({e})"
    out, bad = {}, 0
    for _, obj in lines:
        key = keep(obj) if isinstance(obj, dict) else None
        if key is None:
            bad += 1
        else:
            out[key] = obj
    return out, (f"{bad} unreadable line(s) of {path.name} skipped" if bad else None)


def _read_metrics(path: Path):
    """Rows in step order; a step logged twice keeps its last row."""
    if not path.exists():
        return [], "no metrics.jsonl"

    def key(r):   # an RL step row and a final-eval row share a step: kept apart so neither hides the other
        if _num(r.get("step")) is None:
            return None
        return ("train" if "train/success" in r or "eval/success" not in r else "eval", r["step"])
    by_step, note = _read_jsonl(path, key)
    return [r for _, r in sorted(by_step.items(), key=lambda kv: (kv[0][1], kv[0][0] == "eval"))], note


def read_calibration(path: Path):
    """calibration.jsonl's rows, one per (step, task_id), the last one kept; rows without a finite
    trust_eb, trust_raw and fresh_gain are skipped (and counted in the note)."""
    if not path.exists():
        return [], None
    rows, note = _read_jsonl(path, lambda r: None if any(_num(r.get(k)) is None for k in
                                                         ("trust_eb", "trust_raw", "fresh_gain"))
                             else (str(r.get("step")), str(r.get("task_id"))))
    return list(rows.values()), note


def calibration_table(rows, n_bins: int = 5) -> dict:
    """shrinkage.calibration of Eq. 9's λ under eb and under raw trust, over the same fresh replays."""
    import shrinkage
    d = [r["fresh_gain"] for r in rows]
    return {mode: shrinkage.calibration([r[f"trust_{mode}"] for r in rows], d, n_bins) for mode in ("eb", "raw")}


def _num(v):
    """A finite float, or None for what cannot be plotted (strings, bools, NaN, inf)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    v = float(v)
    return v if math.isfinite(v) else None


def _series(rows, key):
    pts = [(r["step"], _num(r.get(key))) for r in rows]
    pts = [(s, v) for s, v in pts if v is not None]
    return [s for s, _ in pts], [v for _, v in pts]


def _keys(rows) -> set:
    return {k for r in rows for k in r}


def _step_range(train, evals, summary):
    """x limits shared by every per-step panel: the RL steps, and step 0 when there is an eval before RL."""
    steps = [r["step"] for r in train + evals]
    if _num(summary.get("eval/success_at_start")) is not None:
        steps.append(0)
    if not steps:
        return None
    lo, hi = min(steps), max(steps)
    pad = max(0.3, 0.03 * (hi - lo))
    return lo - pad, hi + pad


def _order_types(types) -> list:
    types = set(types)
    return [t for t in TYPE_ORDER if t in types] + sorted(types - set(TYPE_ORDER) - {"source_mean"}) + \
        ["source_mean"] * ("source_mean" in types)


# ---------------------------------------------------------------------------------------------
# Plots: small multiples on a bare Agg canvas (no pyplot: train.py's own figures stay untouched)
# ---------------------------------------------------------------------------------------------

LONG = 40   # series at least this long are drawn faint per step with a moving average over them


def _figure(spans, ncols: int, panel_w: float, panel_h: float):
    """Axes for panels `spans[i]` grid columns wide, packed left to right in rows of `ncols` columns.
    Constrained layout, because it makes room for legends placed outside the axes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    places, row, col = [], 0, 0
    for span in (min(s, ncols) for s in spans):
        if col + span > ncols:
            row, col = row + 1, 0
        places.append((row, col, span))
        col += span
    width = ncols if row else col   # a single short row gets a narrower figure, not empty slots
    fig = Figure(figsize=(panel_w * width, panel_h * (row + 1)), constrained_layout=True)
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(row + 1, width)
    return fig, [fig.add_subplot(grid[r, c:c + s]) for r, c, s in places]


def _save(fig, out: Path) -> str:
    fig.savefig(out, dpi=100)
    return f"{PLOT_DIR}/{out.name}"


def _smooth(ys, k):
    """Centered moving average over k points (shrinking at the ends)."""
    h = k // 2
    return [sum(ys[max(0, i - h):i + h + 1]) / len(ys[max(0, i - h):i + h + 1]) for i in range(len(ys))]


def _line(ax, xs, ys, label=None, i=0, raw=True, **kw):
    """The i-th series of a panel. Short: markers (a 2-step run would show a bare segment), later series
    smaller, so that series with equal values (all 0 early on) all stay visible. Long: per-step values
    faint (left out with raw=False, where many series would be noise) under a moving average over ~5%."""
    kw.setdefault("color", f"C{i}")
    if len(xs) < LONG:
        kw.setdefault("marker", "osD^v"[i % 5])
        kw.setdefault("markersize", max(2.5, 6 - 1.2 * i))
        ax.plot(xs, ys, label=label, **kw)
        return
    if raw:
        ax.plot(xs, ys, color=kw["color"], alpha=0.25, linewidth=0.8)
    kw.setdefault("linewidth", 1.6)
    ax.plot(xs, _smooth(ys, max(3, len(xs) // 20)), label=label, **kw)


def _style(ax, title, ylabel=None, xlim=None, legend="below"):
    """Titles, ticks and grid alike on every panel; legend "below" the axes (never over the data;
    "below4": in 4 columns), "inside" (matplotlib's best place), or None."""
    from matplotlib.ticker import FuncFormatter, MaxNLocator
    ax.set_title(title, fontsize=11)
    ax.set_xlabel("RL step", fontsize=9)
    if ylabel:
        ax.set_ylabel(ylabel, fontsize=9)
    ax.tick_params(labelsize=8)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))   # steps are whole: no "1.25" ticks on short runs
    # plain tick labels: matplotlib's "1e-5" offset text above the axis collides with the panel title (KL)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.3g}"))
    if xlim:   # one step range for every panel, so a metric logged on some steps only lines up with the rest
        ax.set_xlim(*xlim)
    ax.grid(alpha=0.3)
    if not legend or not ax.get_legend_handles_labels()[0]:
        return
    if legend.startswith("below"):
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), frameon=False,
                  ncol=4 if legend == "below4" else 2)
    else:
        ax.legend(fontsize=8, loc="best")


def plot_curves(train, evals, summary, out: Path, xlim=None) -> str | None:
    """Success (train and held-out) and reward per RL step."""
    sx, sy = _series(train, "train/success")
    rx, ry = _series(train, "train/reward")
    ex, ey = _series(evals, "eval/success")
    start = _num(summary.get("eval/success_at_start"))
    if start is not None and 0 not in ex:   # the evaluation before RL is in summary.json only
        ex, ey = [0] + ex, [start] + ey
    if not (sx or rx or ex):
        return None
    fig, (a, b) = _figure([1, 1], 2, panel_w=5.9, panel_h=3.0)
    if sx:
        _line(a, sx, sy, "train rollouts", 0)
    if ex:
        a.plot(ex, ey, "s--", color="C1", markersize=6, label="held-out eval")
    a.set_ylim(-0.03, 1.03)
    _style(a, "Success rate", "success", xlim, legend="inside")
    if rx:
        _line(b, rx, ry, None, 2)
    _style(b, "Mean episode reward", "reward", xlim)
    return _save(fig, out)


LOSS_PANELS = [("Loss", [("loss", "total"), ("pg/loss", "policy gradient"), ("opsd/loss", "OPSD")]),
               ("KL to reference (k3)", [("kl/k3", None)]),
               ("Entropy (nats/token)", [("entropy", None)]),
               ("Gradient norm", [("update/grad_norm", None)])]


def plot_losses(train, out: Path, xlim=None) -> str | None:
    """Loss terms per update; a step with nothing to update (all groups tied) logs none."""
    keys = _keys(train)
    panels = [(t, [(k, lab) for k, lab in ks if k in keys]) for t, ks in LOSS_PANELS]
    panels = [(t, ks) for t, ks in panels if ks]
    if not panels:
        return None
    fig, axes = _figure([1] * len(panels), 4, panel_w=2.95, panel_h=2.6)
    for ax, (title, ks) in zip(axes, panels):
        for i, (k, lab) in enumerate(ks):
            _line(ax, *_series(train, k), lab, i)
        _style(ax, title, xlim=xlim)
    return _save(fig, out)


def plot_by_type(table, out: Path) -> str | None:
    """Grouped bars: held-out success before and after RL, overall and per task type."""
    import numpy as np
    labels = [t for t, _, _ in table]
    x = np.arange(len(labels))
    fig, (ax,) = _figure([1], 1, panel_w=max(4.5, 0.9 * len(labels) + 1.5), panel_h=2.8)
    for off, idx, lab, color in ((-0.2, 1, "before RL", "#9bb7d4"), (0.2, 2, "after RL", "#e08a2c")):
        vals = [row[idx] for row in table]
        h = [v if v is not None else 0 for v in vals]
        bars = ax.bar(x + off, h, 0.4, label=lab, color=color)
        for bar, v in zip(bars, vals):
            ax.annotate("n/a" if v is None else f"{v:.2f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=7, xytext=(0, 1), textcoords="offset points")
    ax.set_xticks(x, labels, fontsize=9)
    ax.set_ylim(0, 1.1)
    ax.set_ylabel("held-out success", fontsize=9)
    ax.tick_params(labelsize=8)
    ax.grid(axis="y", alpha=0.3)
    # above the axes: inside, it hid the value label of a bar at 1.0
    ax.legend(fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=2, frameon=False)
    return _save(fig, out)


def _rsipo_panels(keys, types):
    """(title, [(key, label, style)]) for each RSIPO panel whose metrics the run logged."""
    gain = [("replay/gain_mean", "mean", {"color": "k", "linewidth": 2}),
            ("replay/shrunk_gain_mean", "shrunk mean", {"color": "k", "linestyle": "--"})]
    gain += [(f"replay/gain_{t}", t, {"color": f"C{i}", "linewidth": 1, "raw": False}) for i, t in enumerate(types)]
    panels = [
        ("Replay gain (with − without skill)", gain),
        ("Shrink factor (mean)", [("trust/shrink_mean", None, {})]),
        ("Trust", [("trust/mean", "mean λ", {}), ("trust/frac_teacher", "frac. tasks with teacher", {}),
                   ("opsd/trust_mean", "mean λ on OPSD turns", {"linestyle": ":"})]),
        ("OPSD gate", [("opsd/gate_mean", "mean", {}), ("opsd/gate_frac_gt_half", "frac. > 0.5", {})]),
        ("Teacher − student log-prob", [("opsd/gap_mean", None, {})]),
        ("Skill validity", [("skill/valid_frac", "valid", {"color": "k", "linewidth": 2}),
                            ("skill/names_object", "names object", {}), ("skill/names_target", "names target", {}),
                            ("skill/names_place", "names place", {})]),
        ("Skill reward (mean)", [("skill/reward_mean", None, {})]),
        ("Replay gain by the skill's source", [("replay/won_gain", "written after a win", {}),
                                               ("replay/lost_gain", "after a loss", {})]),
        ("Trust by the skill's source", [("trust/won_mean", "written after a win", {}),
                                         ("trust/lost_mean", "after a loss", {})]),
        ("Skill reward by source", [("skill/won_reward", "written after a win", {}),
                                    ("skill/lost_reward", "after a loss", {})]),
        ("Skill length (words)", [("skill/words", None, {})]),
    ]
    out = [(t, [s for s in ks if s[0] in keys]) for t, ks in panels]
    return [(t, ks) for t, ks in out if ks]


def plot_rsipo(train, out: Path, xlim=None) -> str | None:
    keys = _keys(train)
    types = _order_types(k[len("replay/gain_"):] for k in keys
                         if k.startswith("replay/gain_") and k != "replay/gain_mean")
    panels = _rsipo_panels(keys, types)
    if not panels:
        return None
    # the replay gain has a line per task type: two columns wide, its legend below in 4 columns
    wide = [t.startswith("Replay gain") and len(ks) > 3 for t, ks in panels]
    spans = [2 if w else 1 for w in wide]
    # 4 columns, or 3 where that leaves fewer empty slots in the last row (9 columns of panels: 3 x 3)
    ncols = min((4, 3), key=lambda c: (-sum(spans) % c, -c))
    fig, axes = _figure(spans, ncols, panel_w=11.8 / ncols, panel_h=2.6)
    for ax, (title, ks), w in zip(axes, panels, wide):
        for i, (k, lab, style) in enumerate(ks):
            _line(ax, *_series(train, k), lab, i, **style)
        if title.startswith(("Replay gain", "Teacher", "Skill reward")):
            ax.axhline(0, color="grey", linewidth=0.8)
        _style(ax, title, xlim=xlim, legend="below4" if w else "below")
    return _save(fig, out)


def plot_calibration(table, out: Path) -> str | None:
    """Reliability: per λ bin, the share of fresh replays the skill won (ties ½) against the mean λ; and
    the mean fresh gain per bin. One series per trust mode, marker area ∝ tasks in the bin."""
    if not any(t["bins"] for t in table.values()):
        return None
    fig, axes = _figure([1, 1], 2, panel_w=5.2, panel_h=3.6)
    for i, (mode, t) in enumerate(table.items()):
        xs = [b["trust"] for b in t["bins"]]
        size = [12 + 120 * b["n"] / max(1, t["n"]) for b in t["bins"]]
        for ax, key in zip(axes, ("helped", "gain")):
            ax.plot(xs, [b[key] for b in t["bins"]], color=f"C{i}", linewidth=1,
                    label=f"{mode}: Brier {t['brier']:.3f} (n {t['n']})")
            ax.scatter(xs, [b[key] for b in t["bins"]], s=size, color=f"C{i}", zorder=3)
    axes[0].plot([0, 1], [0, 1], color="grey", linestyle="--", linewidth=0.8, label="calibrated")
    axes[1].axhline(0, color="grey", linewidth=0.8)
    for ax, title, ylabel in ((axes[0], "Reliability: fresh replay won", "share won (ties ½)"),
                              (axes[1], "Fresh replay gain", "win rate with − without skill")):
        _style(ax, title, ylabel, legend="below")
        ax.set_xlabel("λ (Eq. 9 posterior), binned", fontsize=9)
        ax.set_xticks([0, 0.2, 0.4, 0.6, 0.8, 1.0])   # _style's integer ticks are for RL steps
        ax.set_xlim(0, 1)
    return _save(fig, out)


# ---------------------------------------------------------------------------------------------
# Sections: each returns HTML; `_guard` turns any failure into a note, so a run never crashes here
# ---------------------------------------------------------------------------------------------

def _note(text) -> str:
    return f'<p class="note">{_esc(text)}</p>'


def _guard(name, fn, *args) -> str:
    try:
        return fn(*args)
    except Exception as e:   # noqa: BLE001 -- a report must not end a run; say what went wrong instead
        return _note(f"{name}: left out ({type(e).__name__}: {e})")


def _pct(v) -> str:
    return "n/a" if v is None else f"{100 * v:.1f}%"


def _fmt(v) -> str:
    """A config value as the command line would take it; an empty string stays visible."""
    return (v or '""') if isinstance(v, str) else json.dumps(v)


def section_header(name, config, summary, train, notes, date) -> str:
    meta = []
    for k in HEADER_KEYS:
        v = config.get(k)
        if k == "steps" and train:   # a stopped or budgeted run did fewer than it was asked to
            done = max(r["step"] for r in train)
            v = f"{done}" if v in (None, done) else f"{done} of {_fmt(v)}"
        meta.append(f"<span>{k} <b>{_esc('?' if v is None else _fmt(v))}</b></span>")
    meta.append(f"<span>{_esc(date)}</span>")
    start, end = _num(summary.get("eval/success_at_start")), _num(summary.get("eval/success"))
    head = []
    if start is not None or end is not None:
        head.append(f'Held-out success <span class="big">{_pct(start)} → {_pct(end)}</span>')
    gain, se, n = (_num(summary.get(k)) for k in ("eval/gain", "eval/gain_se", "eval/gain_games"))
    if gain is not None:
        games = f"{int(n)} games, " if n is not None else ""
        err = f" ± {100 * se:.1f}" if se is not None else ""
        head.append(f'paired gain <span class="big">{100 * gain:+.1f}{err} points</span> ({games}1 s.e.)')
    out = [f"<h1>Run report: {_esc(name)}</h1>", f'<div class="meta">{"".join(meta)}</div>']
    out.append(f'<p class="headline">{" &nbsp;·&nbsp; ".join(head)}</p>' if head
               else _note("No held-out evaluation in summary.json (a run with --eval false, or unfinished)."))
    held = config.get("sft_hold_out")
    if held:
        out.append(_note(f"The warm start held out the {held} procedure (--sft_hold_out {held}, "
                         f"{config.get('sft_hold_out_mode', 'teacher')} mode): it never acted a {held} game without a "
                         f"skill, so what the student gains on {held} games RL found. Its row leads the table by "
                         "type."))
    idle = [r for r in train if r.get("update/idle")]
    if idle:                              # steps whose update had no learning signal (harness.step_log.idle_reason)
        reasons = "; ".join(f"step {r['step']}: {r.get('update/idle_reason', '?')}" for r in idle[:5])
        more = " …" if len(idle) > 5 else ""
        out.append(_note(f"{len(idle)} of {len(train)} RL steps updated nothing: {reasons}{more}"))
    out += [_note(text) for text in notes]
    return "\n".join(out)


def section_curves(train, evals, summary, plot_dir) -> str:
    if not (train or evals):
        return _note("Learning curves: left out (no rows in metrics.jsonl).")
    xlim = _step_range(train, evals, summary)
    imgs = [p for p in (plot_curves(train, evals, summary, plot_dir / "curves.png", xlim),
                        plot_losses(train, plot_dir / "losses.png", xlim)) if p]
    if not imgs:
        return _note("Learning curves: left out (no plottable values in metrics.jsonl).")
    out = ["<h2>Learning curves</h2>"] + [f'<img src="{p}" alt="learning curves">' for p in imgs]
    if train and "loss" not in _keys(train):
        out.append(_note("No loss terms logged: no step had a turn to update."))
    return "\n".join(out)


def _by_type_table(summary, evals, held: str = ""):
    """[(type, start, end)]: the held-out type first ('<type> (held out)'), then 'all', then each other task type
    either evaluation scored."""
    def per_type(d, prefix):
        return {k[len(prefix):]: _num(v) for k, v in d.items()
                if k.startswith(prefix) and k != "eval/success_at_start"}
    start = per_type(summary, "eval_at_start/success_")
    end = per_type(summary, "eval/success_")
    if not end and evals:   # summary.json missing or partial: the last evaluation logged
        end = per_type(evals[-1], "eval/success_")
        end_all = _num(evals[-1].get("eval/success"))
    else:
        end_all = _num(summary.get("eval/success"))
    types = _order_types(set(start) | set(end))
    if not types:
        return []
    lead = [(f"{held} (held out)", start.get(held), end.get(held))] if held in types else []
    return lead + [("all", _num(summary.get("eval/success_at_start")), end_all)] + \
        [(t, start.get(t), end.get(t)) for t in types if t != held]


def section_by_type(summary, evals, plot_dir, held: str = "") -> str:
    table = _by_type_table(summary, evals, held)
    if not table:
        return _note("Held-out success by task type: left out (no per-type evaluation in summary.json "
                     "or metrics.jsonl).")
    rows = []
    for t, s, e in table:
        d = f"{100 * (e - s):+.1f}" if s is not None and e is not None else ""
        t = "data sources, unweighted mean" if t == "source_mean" else t   # search: Search-R1's headline figure
        rows.append(f'<tr><td>{_esc(t)}</td><td class="n">{_pct(s)}</td><td class="n">{_pct(e)}</td>'
                    f'<td class="n">{d}</td></tr>')
    img = plot_by_type(table, plot_dir / "by_type.png")
    return "\n".join(["<h2>Held-out success by task type</h2>", '<div class="row">',
                      f'<div><img src="{img}" alt="held-out success by task type"></div>',
                      "<div><table><tr><th>type</th><th>before RL</th><th>after RL</th><th>change (points)</th></tr>",
                      *rows, "</table></div></div>"])


RSIPO_PREFIXES = ("skill/", "replay/", "trust/", "opsd/")


def section_rsipo(train, evals, summary, plot_dir) -> str:
    if not any(k.startswith(RSIPO_PREFIXES) for k in _keys(train)):
        return _note("RSIPO internals: left out (no skill/replay/trust/opsd metrics; GRPO logs none).")
    img = plot_rsipo(train, plot_dir / "rsipo.png", _step_range(train, evals, summary))
    if not img:
        return _note("RSIPO internals: left out (none of the plotted skill/replay/trust/opsd metrics logged).")
    out = ["<h2>RSIPO internals</h2>", f'<img src="{img}" alt="RSIPO internals per step">']
    if "replay/gain_mean" not in _keys(train):
        out.append(_note("No replay gains logged: no valid skill was replayed in any step."))
    table = by_source_table(train)
    if table:
        out.append(_note("By the outcome of the episode each skill was written from (means over the steps, "
                         "weighted by the skills written; replay gain and λ over the replayed skills)."))
        out.append("<table><tr><th>source</th><th>skills written</th><th>skill reward</th><th>replay gain</th>"
                   "<th>trust λ</th></tr>")
        for source, t in table.items():
            cells = [str(t["written"])] + ["n/a" if t[k] is None else f"{t[k]:+.3f}" for k in ("reward", "gain")]
            cells.append("n/a" if t["trust"] is None else f"{t['trust']:.3f}")
            out.append(f"<tr><td>{source}</td>" + "".join(f'<td class="n">{c}</td>' for c in cells) + "</tr>")
        out.append("</table>")
    return "\n".join(out)


def by_source_table(train) -> dict:
    """{won, lost: skills written, and the mean skill reward, replay gain and λ over the run's steps, each
    step weighted by its skills of that source} from metrics.jsonl's skill/<source>_*, replay/<source>_gain,
    trust/<source>_mean; {} for a run that logged none."""
    out = {}
    for source in ("won", "lost"):
        rows = [r for r in train if (_num(r.get(f"skill/{source}_sources")) or 0) > 0]
        if not rows:
            continue
        w = [_num(r[f"skill/{source}_sources"]) for r in rows]

        def mean(key):
            pts = [(x, _num(r.get(key))) for x, r in zip(w, rows) if _num(r.get(key)) is not None]
            return sum(x * v for x, v in pts) / sum(x for x, _ in pts) if pts else None
        out[source] = {"written": int(sum(w)), "reward": mean(f"skill/{source}_reward"),
                       "gain": mean(f"replay/{source}_gain"), "trust": mean(f"trust/{source}_mean")}
    return out


def section_calibration(rows, note, plot_dir) -> str:
    if not rows:
        return _note(note) if note else ""   # runs without --calibrate: nothing to say
    table = calibration_table(rows)
    out = ["<h2>Trust check</h2>",
           _note(f"{len(rows)} scored skills replayed afresh (with the skill and without, independent of the "
                 "episodes λ came from). Outcome: 1 if the fresh replay won more often with the skill, 0 if "
                 "less, ½ on a tie. Brier = mean (λ − outcome)²; the base rate's Brier is what a λ "
                 "without information scores.")]
    img = plot_calibration(table, plot_dir / "calibration.png")
    if img:
        out.append(f'<img src="{img}" alt="trust reliability plot">')
    out.append("<table><tr><th>trust</th><th>tasks</th><th>ties</th><th>Brier</th><th>base-rate Brier</th>"
               "<th>Brier without ties</th></tr>")
    for mode, t in table.items():
        decided = "n/a" if t["brier_decided"] is None else f"{t['brier_decided']:.4f}"
        out.append(f"<tr><td>{mode}</td><td>{t['n']}</td><td>{t['ties']}</td><td>{t['brier']:.4f}</td>"
                   f"<td>{t['base_brier']:.4f}</td><td>{decided}</td></tr>")
    out.append("</table>")
    if note:
        out.append(_note(note))
    return "\n".join(out)


def section_bank(bank, bank_note) -> str:
    if bank is None:
        return _note(f"Skill bank: left out ({bank_note}; only RSIPO writes one).")
    skills = bank.get("skills")
    if not isinstance(skills, dict):
        return _note("Skill bank: left out (skill_bank.json has no 'skills' object).")
    entries = {t: [e for e in v if isinstance(e, dict)] for t, v in skills.items() if isinstance(v, list)}
    total = sum(len(v) for v in entries.values())
    head = ["<h2>Skill bank</h2>",
            _note(f"{total} skills over {len(entries)} task types (capacity {_fmt(bank.get('capacity', '?'))} "
                  f"per type); the best {BANK_TOP} per type by shrunk gain ĝ.")]
    if not total:
        return "\n".join(head[:1] + [_note("The bank is empty: no skill had a shrunk gain ĝ > 0.")])

    def key(e):
        g = _num(e.get("shrunk_gain"))
        return -math.inf if g is None else g
    rows = []
    for t in _order_types(entries):
        for j, e in enumerate(sorted(entries[t], key=key, reverse=True)[:BANK_TOP]):
            g, m = _num(e.get("shrunk_gain")), _num(e.get("mean_gain"))
            first = ('<tr class="grp">', f"<td><b>{_esc(t)}</b></td>") if j == 0 else ("<tr>", "<td></td>")
            nums = ["" if g is None else f"{g:+.3f}", "" if m is None else f"{m:+.3f}",
                    _esc(e.get("uses", "")), _esc(e.get("step", ""))]
            rows.append(first[0] + first[1] + "".join(f'<td class="n">{x}</td>' for x in nums)
                        + f'<td class="skilltext">{_clip(e.get("text", ""), SKILL_CHARS)}</td></tr>')
    return "\n".join(head + ["<table><tr><th>type</th><th>shrunk gain ĝ</th><th>mean gain</th><th>uses</th>"
                             "<th>added at step</th><th>skill</th></tr>", *rows, "</table>"])


def _clip(text, n) -> str:
    """Escaped text, cut at n characters with a marker (cut before escaping: no half entities)."""
    text = "" if text is None else str(text)
    if len(text) <= n:
        return _esc(text)
    return f'{_esc(text[:n])}<span class="cut"> … [{len(text) - n} more characters]</span>'


def _episode(kind, ep) -> str:
    title = f'<div class="ep {kind}"><h3>{kind.title()} episode</h3>'
    if not isinstance(ep, dict):
        return title + _note(f"no {kind} episode in this run") + "</div>"
    steps = ep.get("steps") if isinstance(ep.get("steps"), list) else []
    reward = _num(ep.get("reward"))
    facts = [f"type <b>{_esc(ep.get('task_type', '?'))}</b>",
             f"reward <b>{'?' if reward is None else f'{reward:g}'}</b>",
             f"{len(steps)} turns", f"RL step {_esc(ep.get('step', '?'))}"]
    skill = ep.get("skill")
    out = [title,
           f'<div><b>Task:</b> {_clip(ep.get("task", ""), OBS_CHARS)}</div>',
           f'<div class="facts">{" · ".join(facts)}</div>',
           f'<div class="skill"><b>Skill:</b> {_clip(skill, SKILL_CHARS)}</div>' if skill
           else '<div class="skill"><i>no skill in the prompt</i></div>']
    shown = list(enumerate(steps, 1))
    if len(shown) > EPISODE_HEAD + EPISODE_TAIL + 1:
        gap = len(shown) - EPISODE_HEAD - EPISODE_TAIL
        shown = shown[:EPISODE_HEAD] + [(None, gap)] + shown[-EPISODE_TAIL:]
    for i, turn in shown:
        if i is None:
            out.append(f'<div class="turn cut">… {turn} turns left out …</div>')
            continue
        obs, act = (list(turn) + ["", ""])[:2] if isinstance(turn, (list, tuple)) else (turn, "")
        act = _clip(act, ACTION_CHARS) if act else "<i>(empty action)</i>"
        out.append(f'<div class="turn"><pre class="obs">{_clip(obs, OBS_CHARS)}</pre>'
                   f'<div class="act">{i}. &gt; {act}</div></div>')
    return "\n".join(out + ["</div>"])


def section_episodes(eps, eps_note) -> str:
    if eps is None:
        return _note(f"Sample episodes: left out ({eps_note}).")
    if not any(isinstance(eps.get(k), dict) for k in ("won", "lost")):
        return _note("Sample episodes: left out (episodes.json holds neither a won nor a lost episode).")
    return "\n".join(["<h2>Sample episodes</h2>", '<div class="eps">',
                      _episode("won", eps.get("won")), _episode("lost", eps.get("lost")), "</div>"])


def section_config(config) -> str:
    if not config:
        return _note("Config: left out (no usable config.json, and no 'config' in summary.json).")
    items = sorted(config.items())
    k = math.ceil(len(items) / 3)   # three short tables side by side keep a 70-flag config on one screen
    tables = []
    for part in (items[i:i + k] for i in range(0, len(items), k)):
        rows = "".join(f"<tr><td>{_esc(key)}</td><td>{_clip(_fmt(v), 120)}</td></tr>" for key, v in part)
        tables.append(f'<table class="cfg">{rows}</table>')
    return "\n".join(["<h2>Config</h2>", '<div class="row">', *tables, "</div>"])


# ---------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------

def _date(run_dir: Path) -> str:
    """When the run ended: the flags hold no date, the files' times do."""
    for name, what in (("summary.json", "finished"), ("metrics.jsonl", "last logged")):
        try:
            return f"{what} {_dt.datetime.fromtimestamp((run_dir / name).stat().st_mtime):%Y-%m-%d %H:%M}"
        except OSError:
            continue
    return f"report {_dt.datetime.now():%Y-%m-%d %H:%M}"


def write_report(run_dir) -> Path:
    """Write <run_dir>/report.html (and <run_dir>/report/*.png); return its path. See the module docstring."""
    run_dir = Path(run_dir)
    plot_dir = run_dir / PLOT_DIR
    plot_dir.mkdir(parents=True, exist_ok=True)
    for name in PLOTS:   # a plot this report leaves out must not survive from an earlier one
        try:
            (plot_dir / name).unlink()
        except OSError:
            pass
    summary, s_note = _read_json(run_dir / "summary.json", "the run summary")
    summary = summary or {}
    config, c_note = _read_json(run_dir / "config.json", "the flags")
    if config is None and isinstance(summary.get("config"), dict):
        config = summary["config"]
    config = config or {}
    rows, m_note = _read_metrics(run_dir / "metrics.jsonl")
    train = [r for r in rows if "eval/success" not in r or "train/success" in r]
    evals = [r for r in rows if "eval/success" in r]
    bank, b_note = _read_json(run_dir / "skill_bank.json", "a skill bank")
    eps, e_note = _read_json(run_dir / "episodes.json", "sample episodes")
    calib, cal_note = read_calibration(run_dir / "calibration.jsonl")
    name = config.get("run_name") or run_dir.resolve().name
    c_note = c_note if (run_dir / "config.json").exists() else None   # older runs have none: no note
    notes = [n for n in (s_note, c_note, m_note) if n]
    body = [
        _guard("Header", section_header, name, config, summary, train, notes, _date(run_dir)),
        _guard("Learning curves", section_curves, train, evals, summary, plot_dir),
        _guard("Held-out success by task type", section_by_type, summary, evals, plot_dir,
               config.get("sft_hold_out", "")),
        _guard("RSIPO internals", section_rsipo, train, evals, summary, plot_dir),
        _guard("Trust check", section_calibration, calib, cal_note, plot_dir),
        _guard("Skill bank", section_bank, bank, b_note),
        _guard("Sample episodes", section_episodes, eps, e_note),
        _guard("Config", section_config, config),
    ]
    page = (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">\n'
            f"<title>Run report: {_esc(name)}</title>\n<style>{CSS}</style></head>\n<body>\n"
            + "\n".join(body) + "\n</body></html>\n")
    out = run_dir / "report.html"
    write_text(out, page)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Write <run_dir>/report.html, a one-page report of a training run "
                                            "(learning curves, held-out success, RSIPO internals, skills, "
                                            "sample episodes, config).")
    p.add_argument("run_dir", help="a run folder, e.g. runs/<name> (metrics.jsonl, summary.json, ...)")
    a = p.parse_args(argv)
    if not Path(a.run_dir).is_dir():
        p.error(f"{a.run_dir}: not a folder")
    print(write_report(a.run_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
