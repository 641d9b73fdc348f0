"""A run folder nothing can silently overwrite or share (harness/run_dir.py, harness.run.claim_run_dir): a resume
with changed flags, --resume false on a run, a second run on a folder in use, each refused with the reason and
nothing on disk changed; a stale lock taken over; metrics rows of lost steps cut on resume; a complete warm start
reused, not trained again; SIGINT handled as SIGTERM; an empty --run_name refused."""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import train as T  # noqa: E402
from harness import run_dir as RD  # noqa: E402
from harness.run import Preemption  # noqa: E402
from test_train import TINY  # noqa: E402

SMALL = TINY[:3] + ["1"] + TINY[4:] + ["--eval", "false"]   # one RL step, a checkpoint after it


def _snapshot(folder: Path) -> dict:
    """Every file under the folder with its size and modification time: what "nothing on disk changed" compares."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != RD.LOCK}


@pytest.fixture(scope="module")
def done_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("runs")
    T.main(SMALL + ["--out_dir", str(out), "--run_name", "r"])
    return out / "r"


def test_a_resume_with_another_data_root_or_lr_is_refused_and_changes_nothing(done_run):
    before = _snapshot(done_run)
    for flag, value, said in (("--data_root", "data/alfworld", "--data_root data/alfworld_clean (now data/alfworld)"),
                              ("--lr", "1e-3", "--lr 0.0002 (now 0.001)"),   # never silently the optimizer's saved one
                              ("--group_size", "4", "--group_size 2 (now 4)")):
        with pytest.raises(SystemExit) as e:
            T.main(SMALL + ["--out_dir", str(done_run.parent), "--run_name", "r", flag, value])
        msg = str(e.value)
        assert said in msg and "written with other flags" in msg, msg
        assert "--steps" in msg and "--overwrite true" in msg                 # what may change, and the way out
    assert _snapshot(done_run) == before and not (done_run / RD.LOCK).exists()
    from harness.config import RESUME_MAY_CHANGE
    assert {"steps", "max_env_steps", "eval_every", "save_every", "micro_batch"} <= set(RESUME_MAY_CHANGE)
    assert not {"lr", "data_root", "group_size", "algo", "seed", "teacher_loss"} & set(RESUME_MAY_CHANGE)


def test_resume_false_on_a_run_is_refused_unless_overwrite_which_starts_it_over(done_run, capsys):
    before = _snapshot(done_run)
    with pytest.raises(SystemExit, match=r"--resume false on .* which holds a run \(ckpt, warm_start, final, "
                                         r"metrics.jsonl\): it would be overwritten. Give --overwrite true"):
        T.main(SMALL + ["--out_dir", str(done_run.parent), "--run_name", "r", "--resume", "false"])
    assert _snapshot(done_run) == before
    copy = done_run.parent / "r2"
    T.main(SMALL + ["--out_dir", str(done_run.parent), "--run_name", "r2"])
    stale = copy / "ckpt" / "step_000009"                                    # a file of the old run's
    stale.mkdir()
    T.main(SMALL + ["--out_dir", str(done_run.parent), "--run_name", "r2", "--resume", "false", "--overwrite", "true"])
    assert "--overwrite: cleared" in capsys.readouterr().out and not stale.exists()
    rows = [json.loads(x) for x in (copy / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/success" in r] == [1]           # one run's rows, not two


def test_a_second_run_on_a_folder_in_use_is_refused_and_a_stale_lock_is_taken_over(done_run):
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; sys.path.insert(0, sys.argv[1]); "
                               "from harness import run_dir; from pathlib import Path; "
                               "print(run_dir.claim(Path(sys.argv[2])), flush=True); time.sleep(60)",
                               str(ROOT), str(done_run)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "None"                    # the other process holds the folder
        before = _snapshot(done_run)
        with pytest.raises(SystemExit, match=rf"is in use by process {holder.pid} on "):
            T.main(SMALL + ["--out_dir", str(done_run.parent), "--run_name", "r"])
        assert _snapshot(done_run) == before
    finally:
        holder.kill()
        holder.wait()
    # its process is gone: the lock is stale and taken over, and released at the end
    assert json.loads((done_run / RD.LOCK).read_text())["pid"] == holder.pid
    T.main(SMALL + ["--out_dir", str(done_run.parent), "--run_name", "r"])
    assert not (done_run / RD.LOCK).exists()


def test_a_lock_whose_pid_now_belongs_to_another_process_is_stale(tmp_path):
    me = {"host": os.uname().nodename, "pid": os.getpid(), "started": "0"}    # this pid, another start time
    (tmp_path / RD.LOCK).write_text(json.dumps(me))
    assert RD.claim(tmp_path) is None and json.loads((tmp_path / RD.LOCK).read_text())["started"] != "0"
    RD.release(tmp_path)
    assert not (tmp_path / RD.LOCK).exists()


def test_rows_of_steps_a_kill_lost_are_cut_on_resume(tmp_path):
    # two steps with a checkpoint each; the second checkpoint lost (a kill after the step's row, before its save):
    # the resume redoes step 2, and metrics.jsonl holds each step once
    argv = TINY + ["--eval", "false", "--out_dir", str(tmp_path), "--run_name", "k"]
    T.main(argv)
    run = tmp_path / "k"
    import shutil
    shutil.rmtree(run / "ckpt" / "step_000002")
    T.main(argv)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/success" in r] == [1, 2]
    assert RD.cut_rows(run / "metrics.jsonl", 1) == [r for r in rows if r["step"] <= 1]
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == \
        [r["step"] for r in rows if r["step"] <= 1]


def test_a_complete_warm_start_is_taken_as_it_is_and_the_run_goes_on_exactly(tmp_path, capsys):
    # stage 1 alone, then the same run with an RL step: the warm start is not trained again, and the step's weights
    # are those of the run that did both at once (the warm start's random streams are kept beside it)
    argv = SMALL + ["--out_dir", str(tmp_path)]
    T.main(argv + ["--run_name", "once"])
    T.main(argv[:3] + ["0"] + argv[4:] + ["--run_name", "twice"])              # --steps 0: the warm start alone
    assert (tmp_path / "twice" / "warm_start" / "rng.pt").exists()
    capsys.readouterr()
    T.main(argv + ["--run_name", "twice"])
    out = capsys.readouterr().out
    assert "is complete; taken as it is, not trained again" in out and "sft:" not in out
    a, b = (load_file(tmp_path / r / "final" / "model.safetensors") for r in ("once", "twice"))
    assert all((a[k] == b[k]).all() for k in a)


def test_sigint_is_handled_as_sigterm_and_a_second_one_stops_at_once():
    before = signal.getsignal(signal.SIGINT)
    guard = Preemption()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.1)
        assert guard.seen and guard.name == "SIGINT" and guard.exit_code == 130
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.1)
    finally:
        guard.close()
    assert signal.getsignal(signal.SIGINT) is before                     # the handler it found, put back


@pytest.mark.parametrize("name", ["", " ", ".", "a/b"])
def test_an_empty_or_pathlike_run_name_is_refused(name):
    with pytest.raises(SystemExit, match="--run_name"):
        T.parse_args(["--run_name", name])


# ---- errors that name the fix ---------------------------------------------------------------------------------

def test_a_model_path_that_is_no_model_or_does_not_exist_is_said_so(tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "readme.txt").write_text("not a model")
    for model, said in ((str(tmp_path / "notes"), "not a Hugging Face model folder (no config.json)"),
                        (str(tmp_path / "missing"), "no such file or folder (a hub name is org/name"),
                        ("./runs/nope/final", "no such file or folder")):
        with pytest.raises(SystemExit, match=rf"--model .*{re.escape(said)}"):
            T.main(["--model", model, "--out_dir", str(tmp_path), "--run_name", "m"])


def test_an_out_dir_that_cannot_be_written_is_said_so(tmp_path):
    (tmp_path / "a_file").write_text("x")                                 # a folder cannot be made inside a file
    with pytest.raises(SystemExit, match=r"--out_dir .*a_file: cannot write the run folder .* give --out_dir a folder"):
        T.main(SMALL + ["--out_dir", str(tmp_path / "a_file")])


def test_a_corrupted_walkthrough_names_its_file(tmp_path):
    from harness import tiny
    game = sorted((ROOT / "data/alfworld_clean/json_2.1.1/train").glob("*/*/game.tw-pddl"))[0]
    import shutil
    copy = tmp_path / "g"
    shutil.copytree(game.parent, copy)
    (copy / "walkthrough.json").write_text('{"steps": [')
    with pytest.raises(SystemExit, match=rf"malformed walkthrough.json {copy / 'walkthrough.json'}: invalid JSON"):
        tiny.game_truth(copy / "walkthrough.json")
    (copy / "walkthrough.json").write_text('{"stepz": []}')
    with pytest.raises(SystemExit, match="no 'steps'"):
        tiny.generic_skill_of_game(str(copy / "game.tw-pddl"))


def test_a_run_whose_every_episode_breaks_says_why_and_exits_non_zero(tmp_path, capsys):
    # every game file of the data replaced by one the engine cannot load: each episode ends in an env error
    import shutil
    data = tmp_path / "data"
    shutil.copytree(ROOT / "data/alfworld_clean", data)
    for g in data.rglob("game.tw-pddl"):       # a well-formed file whose problem the engine cannot load
        game = json.loads(g.read_text())
        game["pddl_problem"] = "(define (problem broken))"
        g.write_text(json.dumps(game))
    with pytest.raises(SystemExit, match=r"every episode of this run ended in an env error \(the first: .+\): the "
                                         r"environment is broken"):
        T.main(SMALL + ["--sft_steps", "0", "--data_root", str(data), "--out_dir", str(tmp_path), "--run_name", "b"])
    out = capsys.readouterr().out
    assert ("warning: step 1: every one of its 4 episodes ended in an env error, so it learns nothing; "
            "the first: " in out)
