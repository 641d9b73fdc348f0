"""A scheduler's SIGTERM inside a long section: the warm start's SFT stops after its current step with its state
saved, and an evaluation is cut short at its next turn; the run exits 143 within seconds, and the same command
resumes and ends as a run never interrupted. In process (the signal sent by the code under test) and under
torchrun with a 5-second grace period (the signal sent to torchrun, as a scheduler does; its agent kills the
workers once the grace period is over, and they must be gone by then)."""
import json
import os
import signal
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import train as T  # noqa: E402
from harness import run as harness_run, sft as harness_sft  # noqa: E402
from infra import distributed as D  # noqa: E402
from test_train import TINY, _state  # noqa: E402
sys.path.insert(0, str(ROOT / "scripts"))
from bench_preemption import torchrun_sigterm  # noqa: E402

FLAGS = TINY + ["--algo", "grpo", "--steps", "2", "--save_every", "10"]


def _weights(folder: Path) -> dict:
    from safetensors.torch import load_file
    return load_file(folder / "model.safetensors")


def _rows(run: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "mem/"))} for r in rows]


def test_sigterm_in_the_warm_start_saves_the_sft_state_and_the_resumed_run_matches(tmp_path, monkeypatch):
    flags = FLAGS + ["--out_dir", str(tmp_path)]
    full = T.main(flags + ["--run_name", "full"])
    real, calls = harness_sft.sft_loss_backward, {"n": 0}

    def backward(*a, **k):                  # the signal arrives during SFT step 10 (of 40)
        calls["n"] += 1
        if calls["n"] == 10:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*a, **k)

    monkeypatch.setattr(harness_sft, "sft_loss_backward", backward)
    with pytest.raises(SystemExit) as e:
        T.main(flags + ["--run_name", "cut"])
    cut = tmp_path / "cut"
    assert e.value.code == 143 and calls["n"] == 10          # it stopped after the step it was in
    assert [d.name for d in D.checkpoints(cut / "sft")] == ["step_000010"] and not D.checkpoints(cut)
    assert not (cut / "warm_start").exists()
    monkeypatch.setattr(harness_sft, "sft_loss_backward", real)
    resumed = T.main(flags + ["--run_name", "cut"])
    assert resumed["sft/final_loss"] == full["sft/final_loss"]
    w_full, w_cut = _weights(tmp_path / "full" / "warm_start"), _weights(cut / "warm_start")
    assert all(torch.equal(w_full[k], w_cut[k]) for k in w_full)
    assert _rows(tmp_path / "full") == _rows(cut) and not (cut / "sft").exists()


def test_sigterm_in_the_evaluation_before_rl_cuts_it_short_and_the_resumed_run_redoes_it(tmp_path, monkeypatch):
    flags = FLAGS + ["--out_dir", str(tmp_path), "--eval_games", "4", "--eval_repeats", "2"]
    full = T.main(flags + ["--run_name", "full"])
    real, turns = harness_run.evaluate, {"n": 0}

    def evaluate(*a, stop, **k):            # the signal arrives at the evaluation's second turn
        def stop_after_signal():
            turns["n"] += 1
            if turns["n"] == 2:
                os.kill(os.getpid(), signal.SIGTERM)
            return stop()
        return real(*a, stop=stop_after_signal, **k)

    monkeypatch.setattr(harness_run, "evaluate", evaluate)
    with pytest.raises(SystemExit) as e:
        T.main(flags + ["--run_name", "cut"])
    cut = tmp_path / "cut"
    assert e.value.code == 143 and turns["n"] == 2           # no turn was played after the signal
    assert [d.name for d in D.checkpoints(cut)] == ["step_000000"] and (cut / "warm_start").exists()
    monkeypatch.setattr(harness_run, "evaluate", real)
    resumed = T.main(flags + ["--run_name", "cut"])
    for k in ("eval/success_at_start", "eval/success", "sft/final_loss"):
        assert resumed[k] == full[k], k
    assert resumed["eval_at_start/by_game"] == full["eval_at_start/by_game"]
    assert _rows(tmp_path / "full") == _rows(cut)
    assert all(torch.equal(a, b) for a, b in zip(_state(tmp_path / "full")["model"].values(),
                                                 _state(cut)["model"].values()))


def _torchrun(cmd_args: list, port: int, signal_when=None, grace: int = 5, delay: float = 0.0):
    """bench_preemption.torchrun_sigterm with a `grace`-second shutdown timeout; a signalled run's workers must
    stop on their own, inside it, not be killed by the agent."""
    rc, log, seconds = torchrun_sigterm(cmd_args, port, signal_when, delay, grace, timeout=600)
    if seconds is not None:
        assert "forcefully exiting" not in log, log[-3000:]
    return rc, log, seconds


@pytest.mark.skipif(sys.platform != "linux", reason="torchrun with gloo is tested on Linux")
def test_two_ranks_stop_the_warm_start_inside_a_five_second_grace_period_and_resume_it(tmp_path):
    argv = [str(ROOT / "train.py"), *FLAGS, "--sft_steps", "400", "--env_workers", "1", "--eval", "false",
            "--out_dir", str(tmp_path), "--run_name", "r"]
    rc, log, seconds = _torchrun(argv, 29561, lambda out: "steps 1..400" in out, delay=1.0)
    assert seconds is not None and seconds < 5.0, (seconds, log[-3000:])
    assert "preempted (SIGTERM) during the warm start" in log, log[-3000:]
    saved = D.checkpoints(tmp_path / "r" / "sft")
    assert len(saved) == 1 and 0 < int(saved[0].name[5:]) < 400 and not D.checkpoints(tmp_path / "r")
    rc, log, _ = _torchrun(argv, 29562)
    assert rc == 0 and f"sft: resumed at step {int(saved[0].name[5:])} of 400" in log, log[-3000:]
    assert (tmp_path / "r" / "summary.json").exists() and not (tmp_path / "r" / "sft").exists()


@pytest.mark.skipif(sys.platform != "linux", reason="torchrun with gloo is tested on Linux")
def test_two_ranks_stop_an_evaluation_inside_a_five_second_grace_period(tmp_path):
    argv = [str(ROOT / "train.py"), *FLAGS, "--env_workers", "1", "--eval_games", "12", "--eval_repeats", "4",
            "--max_turns", "20", "--out_dir", str(tmp_path), "--run_name", "r"]
    rc, log, seconds = _torchrun(argv, 29563, lambda out: "sft: " in out and "final loss" in out)
    assert seconds is not None and seconds < 5.0, (seconds, log[-3000:])
    assert "preempted (SIGTERM): checkpoint of step 0 written" in log, log[-3000:]
    assert [d.name for d in D.checkpoints(tmp_path / "r")] == ["step_000000"]
    rc, log, _ = _torchrun(argv, 29564)
    assert rc == 0 and "eval before RL" in log and "eval after RL" in log, log[-3000:]
