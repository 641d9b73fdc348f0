"""scripts/compare.py: the shared warm start's flags, its errors, and the table built from finished runs."""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
import compare as C  # noqa: E402


class A:
    out = "unused"


def test_warm_start_flags_and_bad_folder(tmp_path):
    a = A()
    a.warm_start = "none"
    assert C.warm_start(a, []) == []
    a.warm_start = str(tmp_path)                       # no config.json: not a model folder
    with pytest.raises(SystemExit, match="config.json"):
        C.warm_start(a, [])
    (tmp_path / "config.json").write_text("{}")
    assert C.warm_start(a, []) == ["--model", str(tmp_path), "--sft_steps", "0"]
    # the tiny preset's settings travel with the shared warm start: a run loading it from a path gets them
    from harness import tiny
    import train as T
    tiny.train_tiny_tokenizer(["go to desk 1"]).save_pretrained(tmp_path)
    args = T.parse_args(C.warm_start(a, []) + ["--preset", "none"])
    assert (args.opsd_keep, args.replay_m, args.constrained, args.lr, args.max_new_tokens) == (0.3, 2, True, 5e-5, 48)
    args = T.parse_args(C.warm_start(a, []))           # the default preset: the default run's RL settings as well
    assert (args.opsd_keep, args.constrained, args.max_env_steps, args.alpha) == (0.3, False, 8000, 0.1)
    assert T.parse_args(C.warm_start(a, []) + ["--lr", "1e-4"]).lr == 1e-4   # a flag given still wins


def test_table_from_finished_runs(tmp_path):
    # finished runs are reused, not rerun: fake two seeds of two algorithms
    ends = {("grpo", 0): 0.2, ("grpo", 1): 0.3, ("rsipo", 0): 0.4, ("rsipo", 1): 0.4}
    for (algo, seed), end in ends.items():
        run = tmp_path / f"{algo}_s{seed}"
        run.mkdir()
        (run / "summary.json").write_text(json.dumps({"eval/success_at_start": 0.1, "eval/success": end,
                                                      "eval/success_pick": end}))
        (run / "metrics.jsonl").write_text("\n".join(json.dumps({"train/env_steps_total": 1000 * s,
                                                                 "train/success": 0.1 * s}) for s in (1, 2, 3)))
    C.main(["--algos", "grpo,rsipo", "--seeds", "0,1", "--out", str(tmp_path), "--warm_start", "none"])
    md = (tmp_path / "compare.md").read_text()
    # grpo: mean(20, 30) = 25.0, sample std = sqrt(((20-25)^2 + (30-25)^2) / 1) = 7.07; rsipo: 40.0 ± 0.0
    # paired gain end − start: grpo 10 and 20 → 15.0 ± 7.1; rsipo 30 and 30 → 30.0 ± 0.0
    assert "| grpo | 10.0 ± 0.0 | 25.0 ± 7.1 | 15.0 ± 7.1 | 25.0 ± 7.1 |" in md
    assert "| rsipo | 10.0 ± 0.0 | 40.0 ± 0.0 | 30.0 ± 0.0 | 40.0 ± 0.0 |" in md
    assert "| 3, 3 |" in md                        # RL steps per seed, from metrics.jsonl
    # rsipo − grpo by seed: 40 − 20 = +20, 40 − 30 = +10 → mean 15, s.e. stdev(20, 10)/√2 = 5, 3.0 s.e.
    assert "rsipo − grpo, held-out success after RL paired by seed (0, 1): +20.0, +10.0 → **+15.0 ± 5.0**" in md
    assert md.rstrip().endswith("3.0 s.e.)")
    assert (tmp_path / "compare.png").stat().st_size > 0
    table = json.loads((tmp_path / "compare.json").read_text())["table"]
    assert table["grpo"]["end"] == [0.2, 0.3]
    assert table["grpo"]["gain"] == pytest.approx([0.1, 0.2])
    # mean gain 0.15; its s.e. over seeds: stdev(0.1, 0.2) = 0.0707107, over √2 = 0.05
    assert table["grpo"]["gain_mean"] == pytest.approx(0.15) and table["grpo"]["gain_se"] == pytest.approx(0.05)
    # internals: means over each run's logged steps (train/success 0.1, 0.2, 0.3 → 0.2)
    assert table["rsipo"]["internals"][0]["train/success"] == pytest.approx(0.2)


def test_held_out_curves_and_the_env_steps_to_reach_the_baselines_end(tmp_path):
    # two seeds each; --eval_every logs eval/success in the step rows of steps 2 (and 4, the last: the final
    # evaluation's value comes from summary.json). grpo: 0.1 → 0.2 (2,000 steps) → 0.3 (4,000);
    # rsipo: 0.1 → 0.3 → 0.4: it reaches grpo's final 0.3 at 2,000 env steps, 50% of grpo's 4,000
    for algo, mid, end in (("grpo", 0.2, 0.3), ("rsipo", 0.3, 0.4)):
        for seed in (0, 1):
            run = tmp_path / f"{algo}_s{seed}"
            run.mkdir()
            (run / "summary.json").write_text(json.dumps({"eval/success_at_start": 0.1, "eval/success": end}))
            rows = [{"train/env_steps_total": 1000 * k, "train/success": 0.1,
                     **({"eval/success": mid} if k == 2 else {})} for k in (1, 2, 3, 4)]
            (run / "metrics.jsonl").write_text("\n".join(map(json.dumps, rows)))
    C.main(["--algos", "grpo,rsipo", "--seeds", "0,1", "--out", str(tmp_path), "--warm_start", "none"])
    md = (tmp_path / "compare.md").read_text()
    assert "grpo reaches grpo's final held-out success (30.0%): 4,000 env steps (100% of grpo's)" in md
    assert "rsipo reaches grpo's final held-out success (30.0%): 2,000 env steps (50% of grpo's)" in md
    assert C.mean_curve([{"eval_curve": [(0, 0.1), (1000, 0.2)]}, {"eval_curve": [(0, 0.3), (3000, 0.4)]}]) == \
        [(0, pytest.approx(0.2), pytest.approx(0.1)), (2000, pytest.approx(0.3), pytest.approx(0.1))]
    assert C.steps_to_reach([(0, 0.1, 0), (1000, 0.3, 0)], 0.2) == pytest.approx(500)   # halfway, linear
    assert C.steps_to_reach([(0, 0.1, 0), (1000, 0.15, 0)], 0.2) is None


def test_same_metrics_compares_every_value_but_time_and_memory(tmp_path):
    import same_metrics as SM
    before = [{"step": 1, "loss": 0.5, "time/step": 3.0, "mem/update": 1.0}, {"step": 2, "loss": 0.25}]
    assert SM.differences(before, [{**before[0], "time/step": 9.0, "mem/update": 2.0}, before[1]]) == []
    assert SM.differences(before, [before[0], {"step": 2, "loss": 0.26}]) == ["row 1: loss: 0.25 → 0.26"]
    assert SM.differences(before, [before[0], {"step": 2, "loss": 0.25, "kl": 0.1}]) == ["row 1: kl: <absent> → 0.1"]
    assert SM.differences(before, before[:1]) == ["rows: 2 → 1"]
    for name, rows in (("a", before), ("b", [before[0], {"step": 2, "loss": 0.3}])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert SM.main([str(tmp_path / "a"), str(tmp_path / "a")]) == 0
    assert SM.main([str(tmp_path / "a"), str(tmp_path / "b")]) == 1


def _finished_run(run: Path, summary: dict, step_times=()):
    """A finished run's two files, as --collect reads them: its summary and one RL step's row (or one per
    `step_times`, each with its `time/step`)."""
    run.mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps({"eval/success_at_start": 0.1, **summary}))
    rows = [{"train/env_steps_total": 1000 * (k + 1), "train/success": 0.1, "time/step": t}
            for k, t in enumerate(step_times)] or [{"train/env_steps_total": 1000, "train/success": 0.1}]
    (run / "metrics.jsonl").write_text("\n".join(map(json.dumps, rows)))


def test_collect_tabulates_runs_made_apart_side_by_side(tmp_path):
    # two configurations run by two invocations, in two folders: --collect pairs them by seed without running
    for folder, algo, ends in (("base", "grpo", (0.2, 0.3)), ("off", "rsipo", (0.25, 0.45))):
        for seed, end in enumerate(ends):
            _finished_run(tmp_path / folder / f"{algo}_s{seed}", {"eval/success": end})
    out = tmp_path / "table"
    C.main(["--seeds", "0,1", "--out", str(out), "--collect",
            f"grpo={tmp_path}/base/grpo_s,rsipo_a0={tmp_path}/off/rsipo_s"])
    md = (out / "compare.md").read_text()
    # +5 and +15 → +10.0 ± 5.0 (2.0 s.e.)
    assert "rsipo_a0 − grpo, held-out success after RL paired by seed (0, 1): +5.0, +15.0 → **+10.0 ± 5.0**" in md
    assert "--collect grpo=" in md and not (tmp_path / "table" / "grpo_s0").exists()   # nothing was run


def test_one_seed_pairs_the_runs_over_their_held_out_games(tmp_path):
    # one seed gives no s.e. over seeds: the two runs are paired game by game (the same games and evaluation seed)
    games = {"grpo": {"g1": 0.2, "g2": 0.4, "g3": 0.6, "g4": 0.0},
             "rsipo": {"g1": 0.4, "g2": 0.4, "g3": 1.0, "g4": 0.2}}
    for algo, by_game in games.items():
        _finished_run(tmp_path / algo / f"{algo}_s0", {"eval/success": 0.3, "eval/by_game": by_game})
    out = tmp_path / "table"
    C.main(["--seeds", "0", "--out", str(out), "--collect",
            f"grpo={tmp_path}/grpo/grpo_s,rsipo={tmp_path}/rsipo/rsipo_s"])
    md = (out / "compare.md").read_text()
    # differences 0.2, 0, 0.4, 0.2: mean 0.2; stdev √((0 + 0.04 + 0.04 + 0) / 3) = 0.1633, over √4 = 0.0816
    assert "rsipo − grpo, held-out success after RL, seed 0, paired over its 4 games: **+20.0 ± 8.2** points" in md
    assert "nan" not in md


def test_several_seeds_also_pair_over_seed_game_pairs_and_time_a_step(tmp_path):
    # 2 seeds × 3 games; ends are the games' means. seed 0: grpo (0, 1, 0), rsipo (1, 1, 0); seed 1: grpo (0, 0, 0),
    # rsipo (1, 1, 0). Step times: grpo 10 and 20 s (mean 15), then 10; rsipo 21, then 15
    runs = {("grpo", 0): ((0, 1, 0), (10, 20)), ("grpo", 1): ((0, 0, 0), (10,)),
            ("rsipo", 0): ((1, 1, 0), (21,)), ("rsipo", 1): ((1, 1, 0), (15,))}
    for (algo, seed), (wins, times) in runs.items():
        _finished_run(tmp_path / algo / f"{algo}_s{seed}", {"eval/success": sum(wins) / 3,
                      "eval/by_game": {f"g{i}": w for i, w in enumerate(wins)}}, times)
    out = tmp_path / "table"
    C.main(["--seeds", "0,1", "--out", str(out), "--collect",
            f"grpo={tmp_path}/grpo/grpo_s,rsipo={tmp_path}/rsipo/rsipo_s"])
    md = (out / "compare.md").read_text()
    # by seed: +33.3 and +66.7 → +50.0, s.e. stdev(33.3, 66.7)/√2 = 23.57/1.414 = 16.7 (3.0 s.e.)
    assert "paired by seed (0, 1): +33.3, +66.7 → **+50.0 ± 16.7** points (1 s.e. over seeds; 3.0 s.e.)" in md
    # the 6 (seed, game) differences 1, 0, 0, 1, 1, 0: mean 0.5, stdev √(6 · 0.25 / 5) = 0.5477, over √6 = 0.2236
    assert "; over its 6 (seed, game) pairs +50.0 ± 22.4 (2.2 s.e.)" in md
    # step time: 21 / 15 = 1.40, 15 / 10 = 1.50 → 1.45
    assert "rsipo's step time (mean `time/step`) over grpo's: 1.40, 1.50 → mean 1.45×" in md
    assert C.paired_over_games([{"eval/by_game": {"g0": 1}}], [{"eval/by_game": {"g0": 0}}]) is None   # one pair


def test_a_contrast_of_arms_by_seed_and_over_seed_game_pairs(tmp_path):
    # 2 seeds × 2 games, the ends the games' means. seed 0: a (0, 0), b (1, 1), c (1, 0); seed 1: a (0, 1),
    # b (1, 1), c (1, 1)
    wins = {("a", 0): (0, 0), ("b", 0): (1, 1), ("c", 0): (1, 0), ("a", 1): (0, 1), ("b", 1): (1, 1), ("c", 1): (1, 1)}
    for (arm, seed), w in wins.items():
        _finished_run(tmp_path / arm / f"s{seed}", {"eval/success": sum(w) / 2,
                      "eval/by_game": {f"g{i}": x for i, x in enumerate(w)}})
    assert C.parse_contrast("b-a-0.5*c+0.5*a", ["a", "b", "c"]) == {"b": 1.0, "a": -0.5, "c": -0.5}
    out = tmp_path / "table"
    C.main(["--seeds", "0,1", "--out", str(out), "--contrast", "b-a-0.5*c", "--collect",
            ",".join(f"{arm}={tmp_path}/{arm}/s" for arm in "abc")])
    md = (out / "compare.md").read_text()
    # by seed: 1 − 0 − 0.5 · 0.5 = 0.75 and 1 − 0.5 − 0.5 · 1 = 0; mean 0.375, s.e. stdev(0.75, 0) / √2 = 0.375
    assert "b-a-0.5*c, held-out success after RL by seed (0, 1): +75.0, +0.0 → **+37.5 ± 37.5** points" in md
    # by game: 0.5, 1, 0.5, −0.5; mean 0.375, stdev √(1.1875 / 3) = 0.6292, over √4 = 0.3146 (1.2 s.e.)
    assert "; over its 4 (seed, game) pairs +37.5 ± 31.5 (1.2 s.e.)" in md
    for expr, said in (("b-d", "unknown arm d; the arms are a, b, c"), ("b a", "not a weighted sum of arms at 'a'"),
                       ("b-2*", "not a weighted sum")):
        with pytest.raises(SystemExit, match=said):
            C.main(["--seeds", "0,1", "--out", str(tmp_path / "bad"), "--contrast", expr, "--collect",
                    ",".join(f"{arm}={tmp_path}/{arm}/s" for arm in "abc")])
    assert not (tmp_path / "bad").exists()


def test_bad_arguments_are_refused_before_any_run(tmp_path):
    import time
    t0 = time.time()
    for argv, said in ((["--algos", "grpo,bogus"], "--algos bogus: unknown; the algorithms are grpo, gigpo"),
                       (["--seeds", "0,x"], "--seeds 0,x: a comma list of integers"),
                       (["--algos", "grpo", "--", "--group_size", "1"], "--group_size")):
        with pytest.raises(SystemExit, match=said):
            C.main(argv + ["--out", str(tmp_path / "c")] if "--" not in argv else
                   argv[:argv.index("--")] + ["--out", str(tmp_path / "c")] + argv[argv.index("--"):])
    assert time.time() - t0 < 30 and not (tmp_path / "c").exists()      # no warm start was begun


def test_a_stopped_comparison_ends_its_child_which_checkpoints(tmp_path):
    # compare.py under SIGTERM: its train.py child gets the signal, writes its checkpoint and exits, and so does the
    # script; no train.py is left running
    import os
    import signal
    import subprocess
    import time
    out = tmp_path / "cmp"
    cmd = [sys.executable, str(ROOT / "scripts" / "compare.py"), "--algos", "grpo", "--seeds", "0", "--warm_start",
           "none", "--out", str(out), "--", "--sft_steps", "200", "--steps", "1", "--eval", "false", "--tiny_hidden",
           "32"]
    script = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)

    def children():
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                line = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace")
            except OSError:               # a process that ended meanwhile
                continue
            if "train.py" in line and str(out) in line:
                found.append(int(pid))
        return found
    try:
        deadline = time.time() + 120
        while not (out / "grpo_s0" / "config.json").exists() and time.time() < deadline:   # past its set-up
            time.sleep(0.5)
        time.sleep(3)                     # into its SFT
        assert children(), "the child train.py did not start"
        script.send_signal(signal.SIGTERM)
        log = script.communicate(timeout=120)[0]
    finally:
        script.kill()
    assert script.returncode != 0 and "stopped:" in log and "the same command resumes it" in log, log[-2000:]
    assert "preempted (SIGTERM) during the warm start" in log and not children()
