"""The real entry point, run tiny: one process, two gloo ranks under torchrun, resume, bad config."""
import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import train as T  # noqa: E402
from infra import distributed as D  # noqa: E402
import rollout as R  # noqa: E402
from harness import tiny  # noqa: E402
from harness import calibration, run as harness_run, sft as harness_sft  # noqa: E402

TINY = ["--sft_steps", "40", "--steps", "2", "--tasks_per_step", "2", "--group_size", "2",
        "--eval_games", "2", "--max_turns", "4", "--mini_batch", "8", "--micro_batch", "4",
        "--save_every", "1", "--lr", "2e-4", "--tiny_hidden", "64", "--max_new_tokens", "24",
        "--drop_zero_adv", "false", "--eval_repeats", "1"]


def _state(run: Path):
    """The run's newest complete checkpoint read whole in this process (tests only): step, rng, extra, model, optim."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    d = D.checkpoints(run)[0]
    with tempfile.TemporaryDirectory() as t:
        dcp_to_torch_save(d, Path(t) / "whole.pt")
        whole = torch.load(Path(t) / "whole.pt", map_location="cpu", weights_only=False)
    return {**torch.load(d / "extra.pt", map_location="cpu", weights_only=False), **whole}


def _changed_from_warm_start(run: Path, model: dict) -> list[str]:
    """Parameters that differ from the warm start (the reference) saved in <run>/warm_start."""
    from safetensors.torch import load_file
    return [k for k, v in load_file(run / "warm_start" / "model.safetensors").items() if not torch.equal(v, model[k])]


@pytest.mark.parametrize("argv, flag", [
    (["--group_size", "1"], "--group_size"),
    (["--steps", "-1"], "--steps"),
    (["--micro_batch", "0"], "--micro_batch"),
    (["--algo", "ppo"], "--algo"),
    (["--model", "nonexistent-model"], "--model"),
    (["--sft_data", "/no/such/file.jsonl"], "--sft_data"),
    (["--top_p", "0"], "--top_p"),
    (["--sft_micro_tokens", "-1"], "--sft_micro_tokens"),
    (["--algo", "grpo", "--calibrate", "2"], "--calibrate"),   # no trust to check
])
def test_bad_config_fails_before_compute_naming_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        T.parse_args(argv)
    assert flag in str(e.value)


def test_missing_data_root_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match=r"^error: .*nope.*(json_2.1.1|not found|does not exist)"):
        T.main(["--data_root", str(tmp_path / "nope"), "--out_dir", str(tmp_path)])


def test_resume_refuses_a_checkpoint_of_another_algo(tmp_path):
    # A GRPO run's checkpoint under the same --run_name must not be picked up by an RSIPO run
    # (it would "resume" at the GRPO run's last step and train nothing).
    ck = tmp_path / "r" / "ckpt" / "step_000003"
    ck.mkdir(parents=True)
    (ck / "args.json").write_text(json.dumps(dataclasses.asdict(T.Args(algo="grpo"))))
    (ck / "COMPLETE").write_text("{}")
    with pytest.raises(SystemExit, match=r"step_000003 was written with other flags than this run's: --algo grpo "
                                         r"\(now rsipo\)"):
        T.main(["--algo", "rsipo", "--out_dir", str(tmp_path), "--run_name", "r"])
    D.check_resume(tmp_path / "r", T.Args(algo="grpo", steps=99), may_change=("steps",))   # a longer run: accepted
    with pytest.raises(SystemExit, match=r"--steps 12 \(now 99\)"):
        D.check_resume(tmp_path / "r", T.Args(algo="grpo", steps=99))              # unless --steps may not change


def test_sft_jsonl_loader(tmp_path):
    p = tmp_path / "sft.jsonl"
    p.write_text(json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})
                 + "\n" + json.dumps({"prompt": "q2", "response": "a2"}) + "\n")
    assert harness_sft.load_sft_jsonl(str(p)) == [("q", "a"), ("q2", "a2")]
    p.write_text("{not json}\n")
    with pytest.raises(SystemExit, match="sft.jsonl:1"):
        harness_sft.load_sft_jsonl(str(p))


def test_sft_parquet_loader_reads_messages_or_prompt_and_response_columns(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq
    chats = [[{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
              {"role": "assistant", "content": "a"}]]
    pq.write_table(pa.table({"messages": chats, "source": ["x"]}), tmp_path / "m.parquet")
    assert harness_sft.load_sft_jsonl(str(tmp_path / "m.parquet")) == [("q", "a")]
    assert "1 samples from the parquet column(s) messages" in capsys.readouterr().out
    pq.write_table(pa.table({"prompt": ["q2", "q3"], "response": ["a2", "a3"]}), tmp_path / "p.parquet")
    assert harness_sft.load_sft_jsonl(str(tmp_path / "p.parquet")) == [("q2", "a2"), ("q3", "a3")]
    pq.write_table(pa.table({"question": ["q"], "answer": ["a"]}), tmp_path / "bad.parquet")
    with pytest.raises(SystemExit, match="needs a 'messages' column or 'prompt' and 'response' columns; it has "
                                         "answer, question"):
        harness_sft.load_sft_jsonl(str(tmp_path / "bad.parquet"))


def test_single_process_run_and_exact_resume(tmp_path):
    full = T.main(TINY + ["--out_dir", str(tmp_path), "--run_name", "full"])
    run = tmp_path / "full"
    assert {"eval/success_at_start", "eval/success", "config", "eval/gain", "eval/gain_se"} <= set(full)
    assert full["eval/gain"] == pytest.approx(full["eval/success"] - full["eval/success_at_start"])
    assert (run / "summary.json").exists() and (run / "curves.png").exists()
    assert (run / "final" / "config.json").exists()
    rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/success" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in steps)
    st = _state(run)
    assert st["step"] == 2
    # RL changed the parameters: the final policy differs from the reference (= warm start).
    assert _changed_from_warm_start(run, st["model"])

    # Interrupted after step 1 (a run with --steps 1), then resumed to 2: same step-2 result.
    T.main(TINY[:3] + ["1"] + TINY[4:] + ["--out_dir", str(tmp_path), "--run_name", "cut"])
    T.main(TINY + ["--out_dir", str(tmp_path), "--run_name", "cut"])
    rows_cut = [json.loads(l) for l in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    s2 = [r for r in rows_cut if r.get("step") == 2 and "train/success" in r]
    assert len(s2) == 1
    for k in ("train/turns", "train/reward", "loss", "pg/ratio_mean", "kl/k3"):
        assert s2[0][k] == pytest.approx(steps[1][k], rel=1e-5, abs=1e-7), k
    st_cut = _state(tmp_path / "cut")
    for k, v in st["model"].items():
        assert torch.allclose(v, st_cut["model"][k], atol=1e-6), k
    # the same command once more: the run is done; it evaluates again and leaves final/ as it was
    before = (tmp_path / "cut" / "final" / "model.safetensors").stat()
    T.main(TINY + ["--out_dir", str(tmp_path), "--run_name", "cut"])
    after = (tmp_path / "cut" / "final" / "model.safetensors").stat()
    assert (before.st_ino, before.st_mtime_ns) == (after.st_ino, after.st_mtime_ns)


def _skill_writing_sft(path: Path) -> Path:
    """The tiny warm start's skill-writing samples alone (the analyzer prompt → its game's rule-based skill) as
    --sft_data: 250 steps on them write parseable skills, where TINY's 40 steps on every sample write none."""
    import envs
    from skills import ANALYZER_HEAD
    args = T.parse_args(TINY)
    pairs = tiny.warm_start_pairs(args, envs.env_data(args, None), None, skills=True)
    path.write_text("".join(json.dumps({"prompt": p, "response": r}) + "\n" for p, r in pairs
                            if p.startswith(ANALYZER_HEAD)))
    return path


def test_rsipo_run_end_to_end_single_process(tmp_path):
    # a warm start that writes parseable skills, and every task writes one (the 2-step warm start wins nothing):
    # so skills are replayed, trusted and checked afresh, and the assertions below have something to check
    T.main(TINY + ["--algo", "rsipo", "--steps", "1", "--calibrate", "1",
                   "--out_dir", str(tmp_path), "--run_name", "rs",
                   "--sft_data", str(_skill_writing_sft(tmp_path / "skills.jsonl")), "--sft_steps", "250",
                   "--skill_groups", "all", "--skill_rule", "false"])
    run = tmp_path / "rs"
    row = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if "train/success" in l][0]
    assert row["skill/written_frac"] == 1.0 and row["skill/valid_frac"] > 0     # parsed skills, replayed below
    assert "replay/gain_mean" in row and "trust/shrink_mean" in row
    # the RSIPO sections ran: skills were written and parsed, trust computed, skill samples trained
    for k in ("skill/written_frac", "trust/mean", "time/skills", "time/replay"):
        assert k in row, k
    # validity and reward only where a skill was written; the facts of the valid skills against their games
    # (skill_facts) whenever one parsed
    assert ("skill/valid_frac" in row) == ("skill/reward_mean" in row) == (row["skill/written_frac"] > 0)
    assert 0.0 <= row.get("skill/valid_frac", 0) <= 1.0 and 0.0 <= row["trust/mean"] <= 1.0
    assert ("skill/names_object" in row) == (row.get("skill/valid_frac", 0) > 0)
    assert (run / "skill_bank.json").exists()
    st = _state(run)
    assert "skill_means" in st["extra"] and "bank" in st["extra"]
    # the trust check replayed every scored skill afresh (1 episode with it, 1 without, per task)
    n_scored = round(2 * row["skill/written_frac"] * row.get("skill/valid_frac", 0)) - row["replay/failed"]
    cal = [json.loads(l) for l in (run / "calibration.jsonl").read_text().splitlines()]
    assert row["calib/tasks"] == len(cal) == n_scored > 0
    for r in cal:
        assert 0 <= r["trust_eb"] <= 1 and 0 <= r["trust_raw"] <= 1 and r["fresh_gain"] in (-1.0, 0.0, 1.0)
    assert row["calib/env_steps"] >= 2 * n_scored   # each fresh episode takes at least one env step
    summary = json.loads((run / "summary.json").read_text())
    assert summary["calib/tasks"] == n_scored and "calib/brier_eb" in summary


def test_calibrate_replays_each_scored_skill_afresh(tmp_path, monkeypatch):
    # the trust check on the real engine and env: records set by hand (the 40-step warm start writes no
    # parseable skill), every fresh episode recorded by a spy around the real run_episodes
    run = T.setup(T.parse_args(TINY + ["--algo", "rsipo", "--sft_steps", "0", "--eval", "false", "--calibrate", "2",
                                       "--out_dir", str(tmp_path), "--run_name", "cal"]))
    seen = []
    try:
        T.build_policy(run)
        T.begin(run)
        g = run.data.train[:3]
        recs = [T.TaskRecord(g[0], "pick", skill="go to the shelf.", gain=0.5, replay_ok=True, trust=0.7,
                             posterior={"eb": 0.7, "raw": 0.9}),
                T.TaskRecord(g[1], "pick"),                                   # no skill: nothing to check
                T.TaskRecord(g[2], "pick", skill="open the fridge.", replay_ok=True, posterior={"eb": 0.2, "raw": 0.1})]
        b = T.Batch([{run.pool.task_key: x} for x in g], [], [], [], recs)
        real = calibration.run_episodes
        monkeypatch.setattr(calibration, "run_episodes", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
        calib = calibration.calibrate(run, b, step=4)
        run.preempt = type("Signalled", (), {"seen": True})()        # SIGTERM seen on this rank: cut at once
        cut = calibration.calibrate(run, b, step=5)
    finally:
        T.teardown(run)
    assert cut == {"calib/env_steps": 0, "calib/tasks": 0} and len(seen) == 2 and not any(e.steps for e in seen[1])
    eps = seen[0]   # tasks 0 and 2 with their skill, 2 episodes each, then the same tasks without one
    assert [e.task_id for e in eps] == [g[0], g[0], g[2], g[2]] * 2
    assert [e.skill for e in eps] == ["go to the shelf."] * 2 + ["open the fridge."] * 2 + [None] * 4
    rows = [json.loads(l) for l in (tmp_path / "cal" / "calibration.jsonl").read_text().splitlines()]
    assert [(r["step"], r["task_id"], r["trust_eb"], r["trust_raw"]) for r in rows] == [(5, g[0], 0.7, 0.9),
                                                                                        (5, g[2], 0.2, 0.1)]
    win = [e.reward / run.args.r_win for e in eps]
    for j, r in enumerate(rows):   # mean with the skill − mean of the fresh control, per task
        assert r["fresh_gain"] == pytest.approx((win[2 * j] + win[2 * j + 1]) / 2
                                                - (win[4 + 2 * j] + win[5 + 2 * j]) / 2)
    assert calib["calib/tasks"] == 2 and calib["calib/env_steps"] == sum(len(e.steps) for e in eps)


def test_sigterm_before_the_update_abandons_the_step_and_the_resumed_run_redoes_it_exactly(tmp_path, monkeypatch):
    """SIGTERM during step 2's skill writing: the step is abandoned at the next check, the state the step began
    with is restored (RNGs, bank, running means) and written as the checkpoint of step 1 (none was due: save
    every 10), the run exits with 143; the same command then resumes and matches a run never interrupted."""
    import signal
    flags = TINY + ["--algo", "rsipo", "--steps", "3", "--save_every", "10",
                    "--eval", "false", "--out_dir", str(tmp_path)]
    handler = signal.getsignal(signal.SIGTERM)
    full = T.main(flags + ["--run_name", "full"])
    real, calls = T.write_skills, {"n": 0}

    def write_skills(run, b):               # the scheduler's signal arrives in the middle of step 2
        real(run, b)
        calls["n"] += 1
        if calls["n"] == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(T, "write_skills", write_skills)
    with pytest.raises(SystemExit) as e:
        T.main(flags + ["--run_name", "cut"])
    assert e.value.code == 143 and calls["n"] == 2
    assert [d.name for d in D.checkpoints(tmp_path / "cut")] == ["step_000001"]
    assert signal.getsignal(signal.SIGTERM) == handler   # the run gave the handler back
    monkeypatch.setattr(T, "write_skills", real)
    cut = T.main(flags + ["--run_name", "cut"])

    def steps(run):
        rows = [json.loads(x) for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in r.items() if not k.startswith(("time/", "mem/"))}
                for r in rows if "train/success" in r]

    assert [r["step"] for r in steps("cut")] == [1, 2, 3]
    assert steps("full") == steps("cut")
    assert cut["sft/final_loss"] == full["sft/final_loss"]


@pytest.mark.skipif(sys.platform != "linux", reason="torchrun with gloo is tested on Linux")
@pytest.mark.parametrize("algo", ["grpo", "rsipo"])
def test_torchrun_two_cpu_ranks(tmp_path, algo):
    # GRPO with the default --drop_zero_adv and KL on: one task per rank, so a rank whose group all failed (or
    # all won) runs only zero-weight dummies while the other trains (the case that aborted gloo)
    # (free decoding: the 40-step warm start then writes some unparsable turns, whose format penalty gives its
    # otherwise all-failed groups a policy gradient on some ranks and steps and not on others; on data/alfworld's
    # six types, where it does: on the default's clean games a 40-step warm start's groups are all alike)
    flags = TINY + ["--drop_zero_adv", "true", "--c_kl", "0.01", "--constrained", "false",
                    "--preset", "none", "--data_root", "data/alfworld"] if algo == "grpo" else TINY
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(29533 + (algo == "rsipo")), str(ROOT / "train.py"), *flags, "--env_workers", "1", "--algo", algo,
           "--out_dir", str(tmp_path), "--run_name", "ddp"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    run = tmp_path / "ddp"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["config"]["tasks_per_step"] == 2 and "eval/success" in summary
    rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/success" in r]
    assert len(steps) == 2 and any(r["train/turns_updated"] > 0 for r in steps)
    # a step with samples to update on took an optimizer step (with the KL term, for grpo: c_kl 0.01)
    assert all(r["update/grad_norm"] > 0 and "kl/k3" in r for r in steps if r["train/turns_updated"] > 0)
    # the mini-batches are those of one shared shuffle over both ranks' samples (TINY: --mini_batch 8)
    assert all(r["update/mini_batches"] == math.ceil(r["update/samples"] / 8) for r in steps)
    # both ranks rolled out: 2 tasks x 2 episodes, one task per rank
    assert _changed_from_warm_start(run, _state(run)["model"])


UNEVEN_UPDATE = """
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from harness import tiny
from infra import distributed as D
import train as T
D.setup()
args = T.Args(tiny_hidden=32, c_kl=0.01, c_ent=0.001, micro_batch=2, mini_batch=8)
torch.manual_seed(0)
model = D.shard(tiny.tiny_model(50, args))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
ref = torch.full((2,), -4.0)
# rank 0: two student turns and one skill sample, all with a reference; rank 1: nothing at all
# (its groups were all-fail or all-win and --drop_zero_adv dropped them; it wrote no skill)
mine = [T.Sample([1, 2, 3], [4, 5], 1.0, torch.full((2,), -3.0), ref),
        T.Sample([1, 2], [6, 7], -1.0, torch.full((2,), -3.0), ref),
        T.Sample([3, 4], [8, 9], 0.5, torch.full((2,), -3.0), ref, skill=True)] if D.RANK == 0 else []
m = T.update(model, opt, mine, T.UpdateConfig.from_args(args), pad_id=0, device="cpu", use_teacher=False)
open(sys.argv[2] + f"/rank{D.RANK}.json", "w").write(json.dumps(m))
torch.distributed.barrier()
torch.distributed.destroy_process_group()
D.exit_process(0)   # no gloo teardown abort after the work is done
"""


@pytest.mark.skipif(sys.platform != "linux", reason="torchrun with gloo is tested on Linux")
def test_two_ranks_where_one_runs_only_dummy_micro_batches_with_kl_on(tmp_path):
    # A rank with no samples of a kind runs zero-weight dummies, which have no reference and so no kl/k3 key:
    # the ranks' metric lists differed in length and gloo aborted the all-reduce. (Rank 1 holds no sample; the
    # one mini-batch is dealt 2 to 1, and the skill sample's call runs a dummy on the rank without it.)
    script = tmp_path / "uneven.py"
    script.write_text(UNEVEN_UPDATE)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29541",
           str(script), str(ROOT), str(tmp_path)]
    r = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    m0, m1 = (json.loads((tmp_path / f"rank{i}.json").read_text()) for i in (0, 1))
    untimed = lambda m: {k: v for k, v in m.items() if not k.startswith("time/")}   # noqa: E731 (each rank's clock)
    assert untimed(m0) == untimed(m1)   # every rank reports the same reduced metrics
    # the KL terms of both kinds are there (rank 0's) and positive: ℓ_ref = -4 differs from the policy's ℓ
    assert m0["kl/k3"] > 0 and m0["skill_kl/k3"] > 0 and m0["update/grad_norm"] > 0
    assert m0["update/tokens"] == 4   # student response tokens over both ranks: 2 + 2 on rank 0, none on rank 1


def test_nan_loss_skips_the_optimizer_step_and_keeps_parameters():
    args = T.Args(tiny_hidden=32, c_kl=0.0, c_ent=0.0, micro_batch=4, mini_batch=8)
    torch.manual_seed(0)
    model = tiny.tiny_model(50, args)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    s = T.Sample([1, 2, 3], [4, 5], float("nan"), torch.zeros(2))   # a NaN advantage → NaN loss
    m = T.update(model, opt, [s], T.UpdateConfig.from_args(args), pad_id=0, device="cpu", use_teacher=False)
    assert m["update/skipped"] == 1 and "update/grad_norm" not in m
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    # a finite sample does move the parameters
    s = T.Sample([1, 2, 3], [4, 5], 1.0, torch.full((2,), -3.0))
    m = T.update(model, opt, [s], T.UpdateConfig.from_args(args), pad_id=0, device="cpu", use_teacher=False)
    assert m["update/grad_norm"] > 0
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_lr_warmup_ramps_with_adams_own_step_count():
    args = T.Args(tiny_hidden=32, c_kl=0.0, c_ent=0.0, micro_batch=4, mini_batch=8, lr=1e-3, lr_warmup=4)
    torch.manual_seed(0)
    model = tiny.tiny_model(50, args)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    s = T.Sample([1, 2, 3], [4, 5], 1.0, torch.full((2,), -3.0))
    cfg = T.UpdateConfig.from_args(args)
    lrs = [T.update(model, opt, [s], cfg, pad_id=0, device="cpu", use_teacher=False)["update/lr"] for _ in range(5)]
    # steps taken before each update: 0, 1, 2, 3, 4 → lr · min(1, (n+1)/4)
    assert lrs == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3])


def test_draw_tasks_by_type_is_even_and_uniform_is_unchanged():
    import random
    types = ["pick"] * 5 + ["look"] * 2 + ["heat"] * 10
    got = T.draw_tasks(random.Random(3), types, 8, by_type=True)
    assert len(set(got)) == 8
    counts = {t: sum(types[i] == t for i in got) for t in ("pick", "look", "heat")}
    # 8 over 3 types: 3/3/2 in some order, but look has only 2 tasks → look 2, the rest 3 + 3
    assert counts["look"] == 2 and counts["pick"] == 3 and counts["heat"] == 3
    # the uniform draw is exactly random.sample (resumed runs replay the same sequence)
    assert T.draw_tasks(random.Random(3), types, 8, by_type=False) == random.Random(3).sample(range(17), 8)
    # n above the number of tasks is capped (no endless loop): every task once
    assert sorted(T.draw_tasks(random.Random(3), types, 50, by_type=True)) == list(range(17))


def test_sft_micro_batches_give_the_whole_batch_gradient():
    # Lengths 4, 7, 12, 30 with a 16-token budget: sorted, [4, 7] pads to 2·7 = 14 ≤ 16, 12 alone
    # (2·12 > 16), 30 alone → 3 backward passes; each scaled by the batch's 2+3+4+6 = 15 response
    # tokens, so loss and gradient must equal the single padded batch's token mean.
    args = T.Args(tiny_hidden=32)
    torch.manual_seed(0)
    model = tiny.tiny_model(50, args)
    batch = [(list(range(1, 25)), [5, 6, 7, 8, 9, 10]), ([3, 4], [5, 6]), ([1, 2, 3, 4], [7, 8, 9]),
             ([2] * 8, [9, 8, 7, 6])]
    assert D.micro_batches(sorted(len(p) + len(r) for p, r in batch), 4, 16) == [[0, 1], [2], [3]]

    def grads(micro_tokens):
        model.zero_grad(set_to_none=True)
        loss = harness_sft.sft_loss_backward(model, batch, pad_id=0, device="cpu", micro_tokens=micro_tokens)
        return loss, [p.grad.clone() for p in model.parameters()]

    whole, g_whole = grads(0)
    split, g_split = grads(16)
    # the reference: the token mean of the padded batch computed directly
    ids, attn, tgt, mask = R.collate(batch, 0, "cpu")
    lp, _ = R.token_logprobs_of(model, ids, attn, tgt)
    assert mask.sum() == 15
    assert whole == pytest.approx(float(-(lp * mask).sum() / 15), rel=1e-5)
    assert split == pytest.approx(whole, rel=1e-5)
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-7) for a, b in zip(g_whole, g_split))
    assert any(a.abs().sum() > 0 for a in g_split)


def test_sft_skips_a_step_whose_gradient_is_not_finite(monkeypatch):
    """One non-finite gradient would make every weight NaN (seen at 0.5B on a GPU: the evaluation after SFT
    then failed in sampling): such a step is skipped and counted, and a finite one still trains."""
    args = T.Args(tiny_hidden=32, sft_steps=3, sft_batch=2, sft_lr=1e-2)
    tok = tiny.train_tiny_tokenizer(["go to the fridge now", "open it"])
    torch.manual_seed(0)
    model = tiny.tiny_model(len(tok), args)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    pairs = [("go to the fridge", "now"), ("open", "it")]
    real = harness_sft.sft_loss_backward
    poison = {"steps": {0, 2}, "n": 0}

    def backward(model, batch, pad_id, device, micro_tokens):   # steps 0 and 2 get a NaN gradient
        loss = real(model, batch, pad_id, device, micro_tokens)
        if poison["n"] in poison["steps"]:
            next(model.parameters()).grad[0, 0] = float("nan")
        poison["n"] += 1
        return loss

    monkeypatch.setattr(harness_sft, "sft_loss_backward", backward)
    loss, skipped, _ = harness_sft.sft(model, tok, pairs, args, "cpu")
    assert skipped == 2 and poison["n"] == 3
    after = model.state_dict()
    assert all(torch.isfinite(v).all() for v in after.values())
    assert any(not torch.equal(before[k], after[k]) for k in before)   # step 1 trained


def test_real_models_get_the_released_settings_and_tiny_its_own(capsys):
    real = T.parse_args(["--model", "org/some-instruct"])
    assert (real.lr, real.sft_lr, real.c_kl, real.max_new_tokens, real.skill_max_tokens, real.constrained) == \
        (1e-6, 5e-6, 0.01, 512, 0, False)          # 0: the skill budget comes from the tokenizer
    tiny = T.parse_args(["--preset", "none"])    # the tiny preset alone (the default run's adds to it: test_config)
    assert (tiny.lr, tiny.sft_lr, tiny.c_kl, tiny.max_new_tokens, tiny.skill_max_tokens, tiny.constrained) == \
        (5e-5, 2e-3, 0.05, 48, 96, True)
    assert T.parse_args(["--model", "org/x", "--env", "search"]).c_kl == 0.001
    assert T.parse_args(["--lr", "3e-5"]).lr == 3e-5   # a flag given wins over the preset
    # --help shows what a run will use: the default and the presets' values
    with pytest.raises(SystemExit):
        T.parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "[default 1e-06; tiny: 5e-05]" in out and "[default 1.0; tiny: 0.3]" in out
    with pytest.raises(SystemExit):
        T.parse_args(["--constrained", "maybe"])      # not silently false
    assert "--constrained: expected true or false, got 'maybe'" in capsys.readouterr().err


def test_master_weights_are_fp32_even_where_bf16_compute_is_used(tmp_path, monkeypatch):
    # On one GPU without torchrun, --dtype auto used to load bf16 weights, and AdamW at lr 1e-6 then changed
    # ~2% of them per step. Now every path loads fp32 master weights; bf16 is FSDP2's compute dtype.
    from transformers import Qwen2Config, Qwen2ForCausalLM
    tok = tiny.train_tiny_tokenizer(["go to desk 1"])
    (Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=2))
     .to(torch.bfloat16).save_pretrained(tmp_path))
    tok.save_pretrained(tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    args = T.Args(model=str(tmp_path), dtype="auto")
    model, _ = harness_run.load_model_and_tokenizer(args, tmp_path, None, str(tmp_path))
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert T.compute_dtype(args) == torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="--dtype"):
        T.parse_args(["--dtype", "bfloat16"])


def test_score_gives_lambda_zero_to_a_turn_whose_teacher_prompt_does_not_fit(tmp_path):
    # `score_teacher` is the one place a turn's λ is set: its task's trust where the teacher prompt fits, else 0 (no
    # teacher log-probs). Two tasks trusted at 0.8, one with a skill far over the prompt budget.
    run = T.setup(T.parse_args(TINY + ["--algo", "rsipo", "--sft_steps", "0", "--eval", "false", "--out_dir",
                                       str(tmp_path), "--run_name", "sc"]))
    try:
        T.build_policy(run)
        T.begin(run)
        b = T.rollout_and_advantages(run)
        b.skill_gens = [R.Generation("", [], [], [])] * len(b.records)
        too_long = " ".join(["go to the shelf"] * (run.args.max_prompt_tokens // 2))
        for rec, skill in zip(b.records, ["open the fridge.", too_long]):
            rec.skill, rec.trust = skill, 0.8
        samples, skills = T.training_samples(run, b)
        T.score_policy(run, samples, skills)
        T.score_teacher(run, b, samples)
    finally:
        T.teardown(run)
    fits, over = ([sm for sm in samples if sm.turn.group_id == k] for k in (0, 1))
    assert fits and all(sm.teacher is not None and sm.trust == 0.8 for sm in fits)
    assert over and all(sm.teacher is None and sm.trust == 0.0 for sm in over)
    assert b.teacher_overflow == len(over)


def test_update_refuses_a_trusted_sample_without_teacher_log_probs():
    # λ > 0 with no ℓ^T would still raise the turn's tokens by λ·σ(0)·∇ℓ through ℓ^T := ℓ: `score_teacher` never makes
    # one, and update says so rather than train on it
    args = T.Args(tiny_hidden=32, c_kl=0.0, c_ent=0.0, micro_batch=4, mini_batch=8, alpha=1.0)
    model = tiny.tiny_model(50, args)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    s = T.Sample([1, 2, 3], [4, 5], 0.5, torch.full((2,), -3.0), trust=0.8)   # teacher None
    with pytest.raises(ValueError, match="no teacher log-probs"):
        T.update(model, opt, [s], T.UpdateConfig.from_args(args), pad_id=0, device="cpu", use_teacher=True)


def _update_grads(samples, **kw):
    args = T.Args(**{"tiny_hidden": 32, "c_kl": 0.0, "c_ent": 0.0, "micro_batch": 4, "mini_batch": 8, "alpha": 0.0,
                     "grad_clip": 1e9, **kw})   # no clipping: it would rescale both gradients to the same norm
    torch.manual_seed(0)
    model = tiny.tiny_model(50, args)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    T.update(model, opt, samples, T.UpdateConfig.from_args(args), pad_id=0, device="cpu",
             use_teacher=kw.get("alpha", 0) > 0)
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_teacher_only_turns_do_not_dilute_the_policy_gradient():
    # Under --drop_zero_adv GRPO trains only A ≠ 0 turns; RSIPO also keeps teacher-only turns (A = 0) for the
    # OPSD term. They must not enter the PG term's token mean: the A = +1 turn's PG gradient is GRPO's
    # (before, a teacher-only turn of the same length halved it: −0.025 against −0.05).
    win = T.Sample([1, 2, 3], [4, 5], 1.0, torch.full((2,), -3.0))
    teacher_only = T.Sample([1, 2], [6, 7], 0.0, torch.full((2,), -3.0), trust=0.7)
    alone = _update_grads([win], drop_zero_adv=True)
    both = _update_grads([win, teacher_only], drop_zero_adv=True)
    assert all(torch.allclose(a, b, atol=1e-7) for a, b in zip(alone, both))
    assert any(a.abs().sum() > 0 for a in alone)


def test_skill_tokens_are_regularised_like_action_tokens():
    # KL on skill-writing tokens has the per-token weight of KL on action tokens (one token mean over all
    # trained tokens): a skill sample with A = 0 gives the same gradient as the same tokens as a turn with A = 0
    ref = torch.full((2,), -4.0)
    turn = T.Sample([1, 2, 3], [4, 5], 0.0, torch.full((2,), -3.0), ref)
    as_skill = T.Sample([3, 4], [8, 9], 0.0, torch.full((2,), -3.0), ref, skill=True)
    as_turn = T.Sample([3, 4], [8, 9], 0.0, torch.full((2,), -3.0), ref)
    g_skill = _update_grads([turn, as_skill], c_kl=0.5, drop_zero_adv=False)
    g_turn = _update_grads([turn, as_turn], c_kl=0.5, drop_zero_adv=False)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(g_skill, g_turn))
    assert any(a.abs().sum() > 0 for a in g_skill)


def test_algo_gigpo_is_grpo_with_the_step_advantage():
    a = T.parse_args(["--algo", "gigpo"])
    assert (a.step_adv, a.step_gamma, a.uses_skills) == (1.0, 0.95, False)
    assert T.parse_args(["--algo", "gigpo", "--step_adv", "0.5"]).step_adv == 0.5
    assert T.parse_args(["--algo", "rsipo", "--step_adv", "1"]).uses_skills   # combines with RSIPO
    assert T.parse_args([]).step_adv == 0.0


def test_gigpo_run_end_to_end_single_process(tmp_path):
    T.main(TINY + ["--algo", "gigpo", "--steps", "1", "--eval", "false",
                   "--out_dir", str(tmp_path), "--run_name", "gi"])
    row = [json.loads(l) for l in (tmp_path / "gi" / "metrics.jsonl").read_text().splitlines()
           if "train/success" in l][0]
    # N = 2 copies of each task start from the same observation: their first turns share an anchor state
    assert 0 < row["gigpo/anchored_frac"] <= 1 and "skill/valid_frac" not in row
    assert torch.isfinite(torch.tensor(row["loss"]))


def test_path_flags_expand_home_and_variables(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("RSIPO_TEST_DATA", "/data/x")
    a = T.parse_args(["--data_root", "~/.cache/alfworld", "--out_dir", "$RSIPO_TEST_DATA/runs",
                      "--sft_walkthroughs", "",
                      "--sft_rl_games", "true"])   # the default run clones no RL game: it would have nothing
    assert a.data_root == str(tmp_path / ".cache/alfworld") and a.out_dir == "/data/x/runs"
    assert a.run_name == "default"                                   # not a path: left as given


def test_bad_data_is_one_error_line_not_a_traceback(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "train.py"), "--data_root", str(tmp_path / "nonexistent"),
                        "--out_dir", str(tmp_path), "--steps", "0"], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1].startswith("error: ") and "nonexistent" in r.stderr


def test_steps_0_evaluates_a_checkpoint_once(tmp_path, monkeypatch):
    # evaluating a policy without training (--steps 0): one evaluation, reported as both the start and the end
    calls = []
    real = harness_run.evaluate
    monkeypatch.setattr(harness_run, "evaluate", lambda *a, **k: calls.append(1) or real(*a, **k))
    s = T.main(TINY + ["--steps", "0", "--sft_steps", "0", "--out_dir", str(tmp_path), "--run_name", "ev"])
    assert len(calls) == 1
    assert s["eval/success"] == s["eval/success_at_start"] and s["eval/by_game"] == s["eval_at_start/by_game"]
    assert s["eval/episodes"] == 2                      # --eval_games 2, --eval_repeats 1
    assert not (tmp_path / "ev" / "final").exists()     # no weight changed: no copy of --model's weights


def test_a_step_that_updates_nothing_says_why(tmp_path, capsys):
    # an untrained model under free decoding writes no parsable action: every turn is invalid, every group tied
    T.main(["--algo", "grpo", "--sft_steps", "0", "--steps", "1", "--constrained", "false", "--tasks_per_step", "2",
            "--group_size", "2", "--max_turns", "2", "--eval", "false", "--tiny_hidden", "32", "--out_dir",
            str(tmp_path), "--run_name", "idle"])
    assert "warning: step 1 updates nothing: every turn was invalid" in capsys.readouterr().out
    row = [json.loads(x) for x in (tmp_path / "idle" / "metrics.jsonl").read_text().splitlines()][-1]
    assert row["train/invalid_frac"] == 1.0 and row["update/idle"] == 1 and row["train/turns_updated"] == 0
    assert json.loads((tmp_path / "idle" / "summary.json").read_text())["update/idle_steps"] == 1
    assert ("1 of 1 RL steps updated nothing: step 1: every turn was invalid"
            in (tmp_path / "idle" / "report.html").read_text())


def test_a_warm_start_alone_writes_its_weights_once(tmp_path):
    # stage 1 (no RL step): final/ is warm_start/ under a second name, not a second copy of the weights
    T.main(["--sft_steps", "10", "--steps", "0", "--eval", "false", "--tiny_hidden", "32", "--out_dir", str(tmp_path),
            "--run_name", "ws"])
    run = tmp_path / "ws"
    assert (run / "warm_start" / "model.safetensors").exists()
    assert (run / "final").is_symlink() and os.readlink(run / "final") == "warm_start"
    assert (run / "final" / "config.json").exists()
