"""harness/report.py: the one-page run report from hand-written run folders (an RSIPO run, a GRPO-like run,
broken inputs). No training: a few matplotlib figures, a few seconds."""
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from harness import report as R  # noqa: E402

HEADINGS = ["Learning curves", "Held-out success by task type", "RSIPO internals", "Trust check", "Skill bank",
            "Sample episodes", "Config"]
EVIL = '<script>alert("x")</script> & <b>'   # model-written text that must reach the page as text


def _write(run: Path, name: str, obj):
    (run / name).write_text(obj if isinstance(obj, str) else json.dumps(obj))


def _metrics(rows, tail=""):
    return "".join(json.dumps(r) + "\n" for r in rows) + tail


def _train_row(step, **extra):
    return {"step": step, "train/success": 0.1 * step, "train/reward": step - 0.5, "train/invalid_frac": 0.0,
            "loss": -0.01 * step, "pg/loss": -0.012 * step, "kl/k3": 1e-5 * step, "entropy": 1.0 / step,
            "update/grad_norm": 0.5, "time/step": 10.0, **extra}


def _rsipo_keys(step):
    return {"skill/valid_frac": 0.5, "skill/words": 20.0, "skill/reward_mean": 0.1 * step,
            "skill/names_object": 0.6, "skill/names_target": 0.4, "skill/names_place": 0.2,
            "replay/gain_mean": 0.05, "replay/gain_pick": 0.1, "replay/gain_cool": -0.05,
            "replay/shrunk_gain_mean": 0.02, "replay/uninformative": 1.0, "trust/shrink_mean": 0.4,
            "trust/mean": 0.3, "trust/frac_teacher": 0.5, "opsd/loss": 0.2, "opsd/gate_mean": 0.6,
            "opsd/gap_mean": 0.1, "opsd/trust_mean": 0.3, "skill/won_sources": 2.0, "skill/won_reward": 0.05 * step,
            "replay/won_gain": 0.05 * step, "trust/won_mean": 0.5, "skill/lost_sources": 0.0}


def _episode(won, skill, steps):
    return {"task": "put a cool apple in fridge", "task_type": "cool", "skill": skill,
            "reward": 10.0 if won else -0.2, "won": won, "steps": steps, "step": 3}


@pytest.fixture
def rsipo_run(tmp_path):
    run = tmp_path / "demo_dir"
    run.mkdir()
    _write(run, "config.json", {"run_name": "demo", "algo": "rsipo", "model": "tiny", "env": "alfworld",
                                "steps": 3, "seed": 7, "lr": 5e-05, "sft_data": ""})
    evals = {"eval/success_pick": 1.0, "eval/success_cool": 0.0}
    rows = [_train_row(1, **_rsipo_keys(1)),
            _train_row(2, **_rsipo_keys(2), **{"eval/success": 0.25, **evals}),   # --eval_every: merged
            _train_row(3, **_rsipo_keys(3)),
            {"step": 3, "eval/success": 0.5, **evals}]                             # the final evaluation
    _write(run, "metrics.jsonl", _metrics(rows, tail='{"step": 4, "train/succ'))  # killed mid-line
    # The headline by hand: 4 held-out games, success per game before (0, 0, 1, 0) and after (1, 0, 1, 0):
    # 1/4 = 25.0% → 2/4 = 50.0%; paired differences (1, 0, 0, 0): mean 0.25, sample std
    # sqrt((0.75² + 3·0.25²)/3) = 0.5, s.e. 0.5/√4 = 0.25, so "+25.0 ± 25.0 points" over "4 games".
    _write(run, "summary.json", {"eval/success_at_start": 0.25, "eval/success": 0.5, "eval/gain": 0.25,
                                 "eval/gain_se": 0.25, "eval/gain_games": 4,
                                 "eval_at_start/success_pick": 0.0, "eval_at_start/success_cool": 0.5,
                                 "eval/success_pick": 1.0, "eval/success_cool": 0.0})

    def entry(text, g):
        return {"text": text, "task_type": "pick", "task_id": "g1", "step": 2, "uses": 1,
                "mean_gain": 2 * g, "shrunk_gain": g}
    _write(run, "skill_bank.json", {"version": 1, "capacity": 8, "skills": {"pick": [
        entry("lowest skill, left out of the top 3", 0.1), entry("best skill " + EVIL, 0.4),
        entry("second skill", 0.3), entry("third skill", 0.2)]}})
    long_obs = "You arrive at countertop 1. " + "x" * (1000 - 28)      # 1000 characters: 700 cut at 300
    _write(run, "episodes.json", {"won": _episode(True, "skill " + EVIL, [[long_obs, "take <apple> & go"],
                                                                          ["You cool it.", "put apple in fridge"]]),
                                  "lost": None})
    _write(run, "calibration.jsonl", _metrics([{"step": 1, "task_id": "g1", "trust_eb": 0.6, "trust_raw": 0.7,
                                                "fresh_gain": 0.5}]))
    return run


def _png_refs(run: Path, page: str) -> list[str]:
    refs = re.findall(r'<img src="([^"]+)"', page)
    for ref in refs:
        data = (run / ref).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000, ref
    return refs


def test_rsipo_report(rsipo_run):
    out = R.write_report(rsipo_run)
    assert out == rsipo_run / "report.html"
    page = out.read_text()
    assert "<h1>Run report: demo</h1>" in page
    for h in HEADINGS:
        assert f"<h2>{h}</h2>" in page, h
    refs = _png_refs(rsipo_run, page)
    assert sorted(refs) == sorted(f"report/{n}" for n in R.PLOTS)
    # header and headline (derived in the fixture)
    assert "algo <b>rsipo</b>" in page and "steps <b>3</b>" in page and "seed <b>7</b>" in page
    assert '<span class="big">25.0% → 50.0%</span>' in page
    assert '<span class="big">+25.0 ± 25.0 points</span> (4 games, 1 s.e.)' in page
    # per-type table: all 25% → 50%, pick 0% → 100%, cool 50% → 0%
    for cells in (["all", "25.0%", "50.0%", "+25.0"], ["pick", "0.0%", "100.0%", "+100.0"],
                  ["cool", "50.0%", "0.0%", "-50.0"]):
        assert f"<td>{cells[0]}</td>" + "".join(f'<td class="n">{c}</td>' for c in cells[1:]) in page, cells
    # internals by the skill's source: 6 won-source skills over 3 steps, means 0.1; no lost-source skill
    assert ('<tr><td>won</td><td class="n">6</td><td class="n">+0.100</td><td class="n">+0.100</td>'
            '<td class="n">0.500</td></tr>') in page and "<td>lost</td>" not in page
    # skill bank: the top 3 by shrunk gain, best first
    assert "lowest skill" not in page
    assert page.index("best skill") < page.index("second skill") < page.index("third skill")
    assert "+0.400" in page
    # episodes: the won one with its skill and a clipped observation; the lost one absent, said so
    assert "Won episode" in page and "no lost episode in this run" in page
    assert "700 more characters" in page and "x" * 301 not in page
    # escaping: model-written text arrives as text, never as markup
    assert "<script" not in page
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt; &amp; &lt;b&gt;" in page
    assert "take &lt;apple&gt; &amp; go" in page
    # the partial last line of metrics.jsonl is skipped and said so; config shows an empty flag
    assert "1 unreadable line(s) of metrics.jsonl skipped" in page
    assert "<td>sft_data</td><td>&quot;&quot;</td>" in page and "<td>lr</td><td>5e-05</td>" in page


def test_grpo_like_run_leaves_sections_out(tmp_path):
    run = tmp_path / "g"
    run.mkdir()
    # no config.json (summary's config instead), no eval rows, no RSIPO keys, no bank, no episodes
    _write(run, "metrics.jsonl", _metrics([_train_row(s) for s in (1, 2, 3)]))
    _write(run, "summary.json", {"config": {"run_name": "g", "algo": "grpo", "steps": 3, "seed": 0, "eval": False}})
    (run / "report").mkdir()
    (run / "report" / "rsipo.png").write_bytes(b"stale")   # from an earlier report: must not survive
    page = R.write_report(run).read_text()
    assert "<h1>Run report: g</h1>" in page and "algo <b>grpo</b>" in page
    for h in ("Learning curves", "Config"):
        assert f"<h2>{h}</h2>" in page
    for h in ("Held-out success by task type", "RSIPO internals", "Skill bank", "Sample episodes"):
        assert f"<h2>{h}</h2>" not in page, h
        assert f"{h}: left out" in page, h
    assert "No held-out evaluation" in page
    assert sorted(_png_refs(run, page)) == ["report/curves.png", "report/losses.png"]
    assert not (run / "report" / "rsipo.png").exists()


def test_broken_inputs_never_raise(tmp_path):
    run = tmp_path / "broken"
    run.mkdir()
    _write(run, "summary.json", "{not json")
    _write(run, "config.json", "[1, 2]")
    _write(run, "skill_bank.json", {"version": 1, "skills": {"pick": [{"text": 3}, "junk"], "cool": "junk"}})
    _write(run, "episodes.json", {"won": {"steps": [["only an observation"], "a bare string", 5]}, "lost": 3})
    _write(run, "metrics.jsonl", _metrics([{"step": 1, "train/success": float("nan"), "train/reward": "high"},
                                           {"step": "two", "train/success": 1.0}, {"no_step": 1}]))
    page = R.write_report(run).read_text()
    assert "<h1>Run report: broken</h1>" in page            # the folder's name when no config names it
    assert "summary.json unreadable" in page and "config.json is not a JSON object" in page
    assert "2 unreadable line(s) of metrics.jsonl skipped" in page
    assert "Learning curves: left out (no plottable values" in page    # NaN and a string: nothing to draw
    assert "<h2>Sample episodes</h2>" in page and "(empty action)" in page
    _png_refs(run, page)
    assert R.write_report(tmp_path / "empty").exists()     # nothing at all: still a page (header and notes)


def test_metrics_rows_resumed_and_merged(tmp_path):
    # a resumed run logs steps 2.. again: the last row of a step wins whole (no stale keys from the first);
    # a final-eval row sharing its step with an RL step row stays a row of its own
    path = tmp_path / "metrics.jsonl"
    path.write_text(_metrics([_train_row(1), _train_row(2), {"step": 2, "train/success": 0.9},
                              {"step": 2, "eval/success": 0.5}]))
    rows, note = R._read_metrics(path)
    assert note is None and [(r["step"], "eval/success" in r) for r in rows] == [(1, False), (2, False), (2, True)]
    assert rows[1] == {"step": 2, "train/success": 0.9}


def test_command_line(rsipo_run, capsys):
    assert R.main([str(rsipo_run)]) == 0
    assert capsys.readouterr().out.strip() == str(rsipo_run / "report.html")
    with pytest.raises(SystemExit) as e:
        R.main(["--help"])
    assert e.value.code == 0 and "report.html" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        R.main([str(rsipo_run / "nope")])
    assert e.value.code == 2


def test_trust_check_section(tmp_path):
    # four scored skills, the first logged twice (a resumed run): its last row counts
    rows = [{"step": 1, "task_id": "a", "trust_eb": 0.1, "trust_raw": 0.1, "fresh_gain": 0.5},
            {"step": 1, "task_id": "a", "trust_eb": 0.9, "trust_raw": 0.6, "fresh_gain": 0.5},
            {"step": 1, "task_id": "b", "trust_eb": 0.7, "trust_raw": 0.8, "fresh_gain": -0.25},
            {"step": 2, "task_id": "a", "trust_eb": 0.2, "trust_raw": 0.3, "fresh_gain": 0.0},
            {"step": 2, "task_id": "c", "trust_eb": 0.5, "trust_raw": 1.0, "fresh_gain": -0.5}]
    _write(tmp_path, "calibration.jsonl", _metrics(rows, tail="{broken\n"))
    page = R.write_report(tmp_path).read_text()
    # outcomes y = 1, 0, 1/2, 0; eb: λ 0.9, 0.7, 0.2, 0.5 -> Brier (0.01 + 0.49 + 0.09 + 0.25) / 4 = 0.21
    # raw: λ 0.6, 0.8, 0.3, 1.0 -> (0.16 + 0.64 + 0.04 + 1.0) / 4 = 0.46; base rate (mean y 3/8): 44/256
    assert "Trust check" in page and "<td>eb</td><td>4</td><td>1</td><td>0.2100</td><td>0.1719</td>" in page
    assert "<td>raw</td><td>4</td><td>1</td><td>0.4600</td>" in page
    # without the tie (task a at step 2): eb (0.01 + 0.49 + 0.25) / 3 = 0.25
    assert "<td>0.1719</td><td>0.2500</td></tr>" in page
    assert "1 unreadable line(s) of calibration.jsonl skipped" in page
    assert (tmp_path / "report" / "calibration.png").stat().st_size > 0


def test_no_trust_check_without_calibration(tmp_path):
    _write(tmp_path, "metrics.jsonl", _metrics([_train_row(1)]))
    assert "Trust check" not in R.write_report(tmp_path).read_text()


def test_held_out_type_leads_the_table_by_type(tmp_path):
    run = tmp_path / "h"
    run.mkdir()
    _write(run, "config.json", {"run_name": "h", "algo": "grpo",
                                "sft_hold_out": "heat", "sft_hold_out_mode": "teacher"})
    _write(run, "summary.json", {"eval/success_at_start": 0.3, "eval/success": 0.4,
                                 "eval_at_start/success_pick": 0.5, "eval/success_pick": 0.5,
                                 "eval_at_start/success_heat": 0.1, "eval/success_heat": 0.3})
    _write(run, "metrics.jsonl", _metrics([_train_row(1)]))
    assert R._by_type_table(json.loads((run / "summary.json").read_text()), [], "heat") == \
        [("heat (held out)", 0.1, 0.3), ("all", 0.3, 0.4), ("pick", 0.5, 0.5)]
    assert [t for t, _, _ in R._by_type_table(json.loads((run / "summary.json").read_text()), [])] == \
        ["all", "pick", "heat"]                                       # no hold-out: the usual order
    page = R.write_report(run).read_text()
    assert "held out the heat procedure (--sft_hold_out heat, teacher mode)" in page
    rows = re.findall(r"<tr><td>([^<]*)</td>", page)
    assert rows[:3] == ["heat (held out)", "all", "pick"]
    assert "+20.0" in page                                            # heat's change, 10% → 30%


def test_by_source_table_weights_each_step_by_its_skills_of_that_source():
    # step 1: 3 won-source skills (reward 0.2, gain 0.3, λ 0.6), 1 lost-source (reward -1, no replay logged);
    # step 2: 1 won-source (reward -0.2, gain 0.1, λ 0.2), no lost-source skill
    rows = [{"step": 1, "skill/won_sources": 3.0, "skill/won_reward": 0.2, "replay/won_gain": 0.3,
             "trust/won_mean": 0.6,
             "skill/lost_sources": 1.0, "skill/lost_reward": -1.0},
            {"step": 2, "skill/won_sources": 1.0, "skill/won_reward": -0.2, "replay/won_gain": 0.1,
             "trust/won_mean": 0.2,
             "skill/lost_sources": 0.0}]
    t = R.by_source_table(rows)
    assert t["won"]["written"] == 4 and t["won"]["reward"] == pytest.approx((3 * 0.2 - 0.2) / 4)
    assert t["won"]["gain"] == pytest.approx((0.9 + 0.1) / 4) and t["won"]["trust"] == pytest.approx((1.8 + 0.2) / 4)
    assert t["lost"] == {"written": 1, "reward": -1.0, "gain": None, "trust": None}
    assert R.by_source_table([{"step": 1, "train/success": 0.1}]) == {}
