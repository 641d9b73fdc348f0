"""A cluster run that survives: never more than two complete checkpoints, a run refused at start when its
out_dir cannot hold one, a resume decided once for all ranks when one rank's reads fail (2 gloo ranks, within
seconds, not the --dist_timeout hang, also when a rank fails after the load), new ranks of a resume on more ranks
drawing streams of their own, and a warm-start SFT stopped on 1 rank resumed on 2. torchrun runs this file as its
worker."""
import json
import os
import random
import subprocess
import sys
import time
from collections import namedtuple
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import train as T  # noqa: E402
from infra import distributed as D  # noqa: E402
from harness import tiny  # noqa: E402
from test_train import TINY  # noqa: E402

ARGS = T.Args(tiny_hidden=32)


def _model_opt(sharded: bool = False):
    torch.manual_seed(0)
    model = tiny.tiny_model(50, ARGS)
    model = D.shard(model) if sharded else model
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model, opt):
    ids = torch.arange(16).view(2, 8) % 50
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


def test_a_save_never_leaves_more_than_two_complete_checkpoints(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp
    seen = []
    real_save = dcp.save

    def counting_save(*args, **kw):       # while a save writes its shards: the fallback alone is complete
        seen.append(len(D.checkpoints(tmp_path)))
        return real_save(*args, **kw)
    monkeypatch.setattr(dcp, "save", counting_save)
    model, opt = _model_opt()
    for step in range(1, 6):
        _step(model, opt)
        D.save_checkpoint(tmp_path, model, opt, step, ARGS, {})
        seen.append(len(D.checkpoints(tmp_path)))
    assert seen == [0, 1] + [1, 2] * 4        # before each write: one (the newest); after it: two
    assert [d.name for d in D.checkpoints(tmp_path)] == ["step_000005", "step_000004"]
    (tmp_path / "ckpt" / "step_000009").mkdir()                        # a later step of an abandoned timeline
    (tmp_path / "ckpt" / "step_000006.tmp").mkdir()                    # and a crashed save of this one
    D.save_checkpoint(tmp_path, model, opt, 6, ARGS, {})
    assert sorted(d.name for d in (tmp_path / "ckpt").iterdir()) == ["step_000005", "step_000006"]


def test_a_run_whose_out_dir_cannot_hold_a_checkpoint_is_refused_at_start(tmp_path, monkeypatch):
    import shutil
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(SystemExit) as e:
        T.main(TINY + ["--out_dir", str(tmp_path), "--run_name", "full"])
    msg = str(e.value)
    n = sum(p.numel() for p in tiny.tiny_model(len(tiny.train_tiny_tokenizer(["a"])), ARGS).parameters())
    assert "has 0.00 GB free" in msg and "this run needs" in msg and "--check_disk false" in msg
    assert "a checkpoint 12 bytes each" in msg and "two checkpoints" in msg and "final/" in msg and n > 0
    assert "quota" in msg and "lfs quota" in msg                       # statvfs does not see quotas: it says so
    assert not (tmp_path / "full" / "ckpt").exists()                   # nothing was computed or written
    # a checkpoint's size is 12 B a parameter (16 with an EMA teacher); a run's peak holds two, final/ and, when it
    # trains its own warm start, warm_start/ (4 B a parameter each)
    from harness.run import checkpoint_bytes, disk_need
    assert checkpoint_bytes(10, T.Args()) == 120 and checkpoint_bytes(10, T.Args(teacher_weights="ema")) == 160
    ema = T.Args(teacher_weights="ema", model="tiny")
    assert disk_need(10, ema) == {"two checkpoints": 320, "final/": 40, "warm_start/": 40}
    assert disk_need(10, T.Args(teacher_weights="ema", model="Qwen/Qwen2.5-7B-Instruct")) == {
        "two checkpoints": 320, "final/": 40}                           # no --sft_data: no warm start of its own
    assert disk_need(10, T.Args(model="tiny", steps=0)) == {"warm_start/": 40}   # a warm start alone
    # 7B (7.62 B parameters) with an EMA teacher and its own warm start: 2 × 121.9 + 30.5 + 30.5 ≈ 305 GB, where one
    # checkpoint is 122
    assert sum(disk_need(7_620_000_000, ema).values()) / 1e9 == pytest.approx(304.8)


def test_grace_and_cores_are_sized_from_the_run():
    from harness.run import grace_needed, too_few_cores
    # the longest section no signal cuts short (update + sync here), then the save
    row = {"time/skills": 20.0, "time/score": 50.0, "time/update": 40.0, "time/sync": 15.0, "time/rollout": 300.0}
    assert grace_needed(row, save_s=30.0) == 85.0
    assert grace_needed({"time/score": 5.0}, 1.0) == 6.0
    # 8 ranks on a node with 1 usable core (srun without --cpus-per-task): named; 80 cores: fine
    msg = too_few_cores(1, 8, 2)
    assert "1 core(s)" in msg and "32 wanted" in msg and "SRUN_CPUS_PER_TASK" in msg
    assert too_few_cores(80, 8, 2) is None and too_few_cores(None, 8, 2) is None


def test_the_memory_watch_reads_the_devices_own_figure(monkeypatch, capsys):
    # torch's allocator sees vLLM's pool in part and NCCL's buffers not at all: the watch reads what the driver
    # reports in use (total − free), the largest at the end of a section
    from harness.run import Run, Timer, watch_step
    cuda = torch.cuda
    used = iter([30, 34, 31])                                          # GiB in use at each section's end
    for name, fn in (("is_available", lambda: True), ("synchronize", lambda: None),
                     ("reset_peak_memory_stats", lambda: None), ("max_memory_allocated", lambda: 5 * 2**30),
                     ("max_memory_reserved", lambda: 6 * 2**30),
                     ("mem_get_info", lambda: ((80 - next(used)) * 2**30, 80 * 2**30))):
        monkeypatch.setattr(cuda, name, fn)
    timer = Timer()
    for section in ("rollout", "update", "sync"):
        with timer(section):
            pass
    assert timer.times["mem/device_used"] == 34.0 and timer.times["mem/reserved"] == 6.0
    run = Run(T.Args(), Path("."), torch.device("cpu"), None, [], None)
    for step in range(1, 6):                                           # the first 5 steps: 30 GiB each
        watch_step(run, {"step": step, "mem/device_used": 30.0})
    watch_step(run, {"step": 6, "mem/device_used": 32.0})
    assert "warning" not in capsys.readouterr().out
    watch_step(run, {"step": 7, "mem/device_used": 34.0, "mem/reserved": 6.0})
    assert "GPU memory in use 34.0 GiB at step 7 is more than 10% above the first 5 steps' 30.0" in \
        capsys.readouterr().out


def _worker(out: Path):
    """2 ranks: two checkpoints; rank 1's own reads of the newest fail in two ways."""
    import torch.distributed.checkpoint as dcp
    D.setup(timeout_min=1.0)              # a rank left waiting would abort after a minute, not an hour
    model, opt = _model_opt(sharded=True)
    for step in (1, 2):
        _step(model, opt)
        D.save_checkpoint(out, model, opt, step, ARGS, {"at": step})
    results = {}
    real_load, real_reader = torch.load, dcp.FileSystemReader
    # 1. rank 1 cannot read the newest checkpoint's extra.pt (a lagging shared file system): rank 0's read is shared
    if D.RANK == 1:
        torch.load = lambda f, *a, **k: (_ for _ in ()).throw(OSError("stale file handle")) \
            if "step_000002" in str(f) else real_load(f, *a, **k)
    t0 = time.time()
    st = D.load_checkpoint(out, *_model_opt(sharded=True))
    results["extra"] = (st["step"], time.time() - t0)
    torch.load = real_load

    # 2. rank 1 cannot read the newest checkpoint's shards: both ranks give it up together and load the previous
    class Failing(real_reader):
        def read_data(self, plan, planner):
            if "step_000002" in str(self.path) and D.RANK == 1:
                raise OSError("stale file handle")
            return super().read_data(plan, planner)
    dcp.FileSystemReader = Failing
    t0 = time.time()
    st = D.load_checkpoint(out, *_model_opt(sharded=True))
    results["shards"] = (st["step"], time.time() - t0)
    dcp.FileSystemReader = real_reader

    # 3. rank 1 fails after dcp.load (setting the loaded state): both ranks give the checkpoint up at the same point,
    # not one in the checksum's all_reduce while the other waits in the outcome's all_gather
    import torch.distributed.checkpoint.state_dict as sd
    real_set = sd.set_state_dict

    calls = []

    def set_once_failing(*a, **k):        # the first checkpoint tried fails on this rank, the next one loads
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("out of memory setting the state")
        return real_set(*a, **k)
    if D.RANK == 1:
        sd.set_state_dict = set_once_failing
    t0 = time.time()
    st = D.load_checkpoint(out, *_model_opt(sharded=True))
    results["after_load"] = (st["step"], time.time() - t0)
    sd.set_state_dict = real_set
    got = D.all_gather_obj(results)
    if D.RANK == 0:
        (out / "resume.json").write_text(json.dumps(got))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _torchrun(args: list, port: int, timeout: int = 600):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port), *args]
    r = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


@pytest.mark.skipif(sys.platform != "linux", reason="torchrun with gloo is tested on Linux")
def test_a_resume_is_decided_once_when_one_ranks_reads_fail(tmp_path):
    r = _torchrun([__file__, str(tmp_path)], 29571)
    ranks = json.loads((tmp_path / "resume.json").read_text())
    for rank in ranks:                     # both ranks load the same checkpoint, within seconds (the group's
        assert rank["extra"][0] == 2 and rank["shards"][0] == 1 and rank["after_load"][0] == 1   # timeout: 60 s)
        assert rank["extra"][1] < 30 and rank["shards"][1] < 30 and rank["after_load"][1] < 30
    assert "step_000002: does not load: rank 1: " in r.stdout and "stale file handle" in r.stdout   # the log says why
    assert "rank 1: RuntimeError: out of memory setting the state" in r.stdout


def _rng_worker(out: Path):
    """2 ranks resume a checkpoint that 1 rank wrote: each reports its next draws."""
    D.setup(timeout_min=1.0)
    model, opt = _model_opt(sharded=True)
    D.load_checkpoint(out, model, opt)
    draws = {"python": random.random(), "numpy": float(np.random.rand()), "torch": float(torch.rand(1))}
    got = D.all_gather_obj(draws)
    if D.RANK == 0:
        (out / "draws.json").write_text(json.dumps(got))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


@pytest.mark.skipif(sys.platform != "linux", reason="torchrun with gloo is tested on Linux")
def test_a_resume_on_more_ranks_gives_the_new_rank_streams_of_its_own(tmp_path):
    model, opt = _model_opt()
    _step(model, opt)
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    D.save_checkpoint(tmp_path, model, opt, 1, ARGS, {})
    saved = {"python": random.random(), "numpy": float(np.random.rand()), "torch": float(torch.rand(1))}
    _torchrun([__file__, str(tmp_path), "rng"], 29573)
    rank0, rank1 = json.loads((tmp_path / "draws.json").read_text())
    assert rank0 == pytest.approx(saved)  # rank 0 goes on with the saved run's streams
    assert all(rank1[k] != rank0[k] for k in saved)   # the new rank draws its own, not a copy of rank 0's


@pytest.mark.skipif(sys.platform != "linux", reason="torchrun with gloo is tested on Linux")
def test_a_warm_start_stopped_on_one_rank_resumes_on_two(tmp_path, monkeypatch):
    # the SFT's state after 10 of 20 steps, saved by 1 rank; then 2 ranks continue it (the sampler state of the
    # new rank 1 is fresh: it has none saved)
    argv = TINY + ["--sft_steps", "20", "--steps", "0", "--eval", "false", "--out_dir", str(tmp_path), "--run_name",
                   "sft", "--env_workers", "1"]
    from harness import sft as harness_sft
    calls = {"n": 0}

    def stop_after_10():
        calls["n"] += 1
        return calls["n"] > 10
    real = harness_sft.sft
    monkeypatch.setattr(harness_sft, "sft", lambda *a, **k: real(*a, **{**k, "stop": stop_after_10}))
    monkeypatch.setattr(T, "sft", lambda *a, **k: real(*a, **{**k, "stop": stop_after_10}))
    with pytest.raises(SystemExit) as e:
        T.main(argv)
    assert e.value.code == 143 and D.checkpoints(tmp_path / "sft" / "sft")[0].name == "step_000010"
    r = _torchrun([str(ROOT / "train.py"), *argv], 29572)
    assert "sft: resumed at step 10 of 20" in r.stdout, r.stdout[-3000:]
    assert (tmp_path / "sft" / "warm_start" / "config.json").exists()


if __name__ == "__main__":   # torchrun worker of the two tests above
    (_rng_worker if sys.argv[2:] == ["rng"] else _worker)(Path(sys.argv[1]))
    D.exit_process(0)
