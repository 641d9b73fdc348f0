"""Sharded checkpoints (distributed.save_checkpoint / load_checkpoint, torch.distributed.checkpoint): exact restore of
model, AdamW and RNG; the previous checkpoint kept; fallback from a damaged one; crashed temp folders ignored;
per-rank shard files and exact resume under two gloo ranks (torchrun runs this file as its worker)."""
import json
import math
import os
import random
import shutil
import subprocess
import sys
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
from test_train import TINY, _state  # noqa: E402

ARGS = T.Args(tiny_hidden=32)


def _model_opt(seed: int, sharded: bool = False):
    torch.manual_seed(seed)
    model = tiny.tiny_model(50, ARGS)
    if sharded:
        model = D.shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train_step(model, opt) -> float:
    """One AdamW step on a batch drawn from all three RNGs: a wrong RNG restore changes the step."""
    ids = (torch.randint(0, 50, (2, 8)) + random.randrange(50) + int(np.random.randint(50))) % 50
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _params(model) -> dict:
    return {k: v.clone() for k, v in D.full_state(model).items()}


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _adam(opt) -> dict:   # param index → (step, exp_avg, exp_avg_sq), copied
    return {i: {n: t.clone() for n, t in s.items()} for i, s in opt.state_dict()["state"].items()}


def test_save_then_load_restores_model_optimizer_and_rng_exactly(tmp_path):
    model, opt = _model_opt(0)
    _train_step(model, opt)
    extra = {"bank": {"skills": [["pick", "go to desk 1"]]}, "skill_means": {"pick": 0.5}}
    D.save_checkpoint(tmp_path, model, opt, 1, ARGS, extra)
    params, adam = _params(model), _adam(opt)
    loss_next = _train_step(model, opt)   # the uninterrupted run's next step
    params_next = _params(model)

    model2, opt2 = _model_opt(1)          # other weights, no Adam state, other RNG states
    random.seed(7)
    np.random.seed(7)
    st = D.load_checkpoint(tmp_path, model2, opt2)
    assert st["step"] == 1 and st["extra"] == extra and st["path"].name == "step_000001"
    assert _equal(_params(model2), params)
    a2 = _adam(opt2)
    assert a2.keys() == adam.keys() and all(_equal(a2[i], adam[i]) for i in adam)   # exp_avg, exp_avg_sq, step
    assert _train_step(model2, opt2) == loss_next and _equal(_params(model2), params_next)   # RNG too
    assert sorted(p.name for p in st["path"].iterdir()) == [".metadata", "COMPLETE", "__0_0.distcp", "args.json",
                                                            "extra.pt"]
    with pytest.raises(TypeError, match="no tensors"):
        D.save_checkpoint(tmp_path, model, opt, 2, ARGS, {"ref": model.state_dict()})


def test_a_checkpoint_before_the_first_optimizer_step_leaves_adam_fresh(tmp_path):
    # Saved before any optimizer step (a SIGTERM during the warm start, a step whose update was skipped): the
    # optimizer must have no state, in the run that saved and in the one that resumes, so that the first real
    # update is a fresh AdamW step (get_state_dict's zero-lr step made it 0.744x one, with step count 2).
    def first_update(model, opt):
        before = _params(model)
        _train_step(model, opt)
        return {k: v - before[k] for k, v in _params(model).items()}, _adam(opt)

    model, opt = _model_opt(0)
    D.save_checkpoint(tmp_path, model, opt, 0, ARGS, {})
    assert not opt.state                                  # saving did not step the optimizer
    model2, opt2 = _model_opt(1)
    st = D.load_checkpoint(tmp_path, model2, opt2)
    assert st["step"] == 0 and not opt2.state and _equal(_params(model2), _params(model))
    rng = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    fresh_model, fresh_opt = _model_opt(0)
    want, want_adam = first_update(fresh_model, fresh_opt)
    random.setstate(rng[0]), np.random.set_state(rng[1]), torch.set_rng_state(rng[2])
    got, got_adam = first_update(model2, opt2)
    assert all(torch.allclose(got[k], want[k], rtol=1e-6, atol=1e-9) for k in want)
    assert all(float(s["step"]) == 1.0 for s in got_adam.values())
    assert sorted(p.name for p in st["path"].iterdir()) == [".metadata", "COMPLETE", "__0_0.distcp", "args.json",
                                                            "extra.pt"]


def _damage(d: Path, how: str) -> Path:
    """Damage checkpoint folder d; the file a report must name."""
    shard = d / "__0_0.distcp"
    if how == "truncated":
        shard.write_bytes(shard.read_bytes()[:shard.stat().st_size // 2])
    elif how == "deleted":
        shard.unlink()
    elif how == "garbage":   # same size: only DCP's read can tell, the report names the folder
        shard.write_bytes(bytes(shard.stat().st_size))
        return d
    elif how == "metadata":
        (d / ".metadata").write_bytes(b"not a pickle")
        return d / ".metadata"
    return shard


@pytest.mark.parametrize("how", ["truncated", "deleted", "garbage", "metadata"])
def test_keeps_the_previous_checkpoint_and_falls_back_from_a_damaged_one(tmp_path, how, capsys):
    model, opt = _model_opt(0)
    saved = {}
    for step in (1, 2, 3):
        _train_step(model, opt)
        D.save_checkpoint(tmp_path, model, opt, step, ARGS, {"at": step})
        saved[step] = _params(model)
    ck = tmp_path / "ckpt"
    assert [d.name for d in D.checkpoints(tmp_path)] == ["step_000003", "step_000002"]
    assert sorted(os.listdir(ck)) == ["step_000002", "step_000003"]   # step 1 deleted, the previous one kept
    # a save that crashed before its rename: a temp folder with every file but the marker, ignored
    shutil.copytree(ck / "step_000003", ck / "step_000004.tmp", ignore=shutil.ignore_patterns("COMPLETE"))
    bad = _damage(ck / "step_000003", how)

    model2, opt2 = _model_opt(1)
    st = D.load_checkpoint(tmp_path, model2, opt2)
    assert st["step"] == 2 and st["extra"] == {"at": 2} and _equal(_params(model2), saved[2])
    out = capsys.readouterr().out
    assert f"checkpoint damaged, {bad}" in out and "trying the previous one" in out, out
    # the run goes on from step 2: its save of step 3 replaces the damaged one and clears the temp folder
    _train_step(model2, opt2)
    D.save_checkpoint(tmp_path, model2, opt2, 3, ARGS, {"at": 3})
    assert sorted(os.listdir(ck)) == ["step_000002", "step_000003"]
    assert D.load_checkpoint(tmp_path, *_model_opt(2))["extra"] == {"at": 3}
    # none loads: an error naming each bad file
    bad3, bad2 = _damage(ck / "step_000003", how), _damage(ck / "step_000002", how)
    with pytest.raises(SystemExit) as e:
        D.load_checkpoint(tmp_path, *_model_opt(2))
    assert f"{bad3}:" in str(e.value) and f"{bad2}:" in str(e.value), str(e.value)


def test_loaded_weights_must_match_the_checksum_saved_with_them(tmp_path, capsys):
    """A checkpoint whose weights load without error but are not the ones saved (here: the newest one's
    recorded checksum is off by one part in 1e6) is refused, and the run falls back to the previous one."""
    model, opt = _model_opt(0)
    saved = {}
    for step in (1, 2):
        _train_step(model, opt)
        D.save_checkpoint(tmp_path, model, opt, step, ARGS, {"at": step})
        saved[step] = _params(model)
    ps = [p.detach().double() for p in model.parameters()]      # a tied head counted once
    want = [float(sum(p.sum() for p in ps)), float(sum((p ** 2).sum() for p in ps))]
    extra = tmp_path / "ckpt" / "step_000002" / "extra.pt"
    st = torch.load(extra, weights_only=False)
    assert st["checksum"] == pytest.approx(want, rel=1e-12)        # Σw and Σw² of every parameter
    st["checksum"][1] *= 1 + 1e-6
    torch.save(st, extra)
    model2, opt2 = _model_opt(1)
    got = D.load_checkpoint(tmp_path, model2, opt2)
    assert got["step"] == 1 and _equal(_params(model2), saved[1])
    out = capsys.readouterr().out
    assert "step_000002: does not load: the loaded weights give the checksum" in out, out


def test_no_checkpoint_loads_nothing_and_old_runs_checkpoints_are_cleared(tmp_path):
    assert D.checkpoints(tmp_path) == [] and D.load_checkpoint(tmp_path, *_model_opt(0)) is None
    model, opt = _model_opt(0)
    D.save_checkpoint(tmp_path, model, opt, 8, ARGS, {})
    # a restart with --resume false saves step 1: the old run's step 8 must not be resumed later
    D.save_checkpoint(tmp_path, model, opt, 1, ARGS, {})
    assert [d.name for d in D.checkpoints(tmp_path)] == ["step_000001"]


# ---------------------------------------------------------------------------------------------
# Two gloo ranks (FSDP2)
# ---------------------------------------------------------------------------------------------

def _two_rank_worker(out: Path):
    """Under torchrun, 2 ranks: save after step 1; a fresh sharded model and AdamW resumed from it take the same
    step 2 as the uninterrupted run; with rank 1's shard of step 2 truncated, a load falls back to step 1."""
    D.setup()
    random.seed(D.RANK)   # per-rank python / numpy RNG: each rank draws its own batch
    np.random.seed(D.RANK)
    model, opt = _model_opt(0, sharded=True)
    _train_step(model, opt)
    D.save_checkpoint(out, model, opt, 1, ARGS, {"at": 1})
    params1 = _params(model)
    loss2 = _train_step(model, opt)
    params2 = _params(model)

    model, opt = _model_opt(1, sharded=True)
    assert D.load_checkpoint(out, model, opt)["step"] == 1 and _equal(_params(model), params1)
    assert _train_step(model, opt) == loss2 and _equal(_params(model), params2)
    D.save_checkpoint(out, model, opt, 2, ARGS, {"at": 2})

    if D.RANK == 0:
        shard = out / "ckpt" / "step_000002" / "__1_0.distcp"
        shard.write_bytes(shard.read_bytes()[:100])
    torch.distributed.barrier()
    model, opt = _model_opt(2, sharded=True)
    assert D.load_checkpoint(out, model, opt)["step"] == 1 and _equal(_params(model), params1)
    # a shared file system whose listing is stale on rank 1 (NFS attribute caching): rank 0's decides for both,
    # so that both load the same checkpoint (rank 1 alone would find none and leave rank 0 in a collective)
    listing = D.checkpoints
    if D.RANK == 1:
        D.checkpoints = lambda run_dir: []
    D.check_resume(out, ARGS)
    model, opt = _model_opt(3, sharded=True)
    assert D.load_checkpoint(out, model, opt)["step"] == 1 and _equal(_params(model), params1)
    assert [d.name for d in D.agreed_checkpoints(out)] == ["step_000002", "step_000001"]
    D.checkpoints = listing
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _torchrun(args: list, port: int, timeout: int = 600):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port), *args]
    r = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def _assert_sharded(d: Path):
    """More than one shard file, and none holds the whole state: the model and AdamW tensor bytes each holds,
    from DCP's metadata (a file's size also counts a per-tensor header, large next to the tiny model's tensors)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata
    md = FileSystemReader(d).read_metadata()
    held: dict = {}
    for fqn, m in md.state_dict_metadata.items():
        for c in m.chunks if isinstance(m, TensorStorageMetadata) else []:
            f = md.storage_data[MetadataIndex(fqn, c.offsets)].relative_path
            held[f] = held.get(f, 0) + math.prod(c.sizes) * m.properties.dtype.itemsize
    assert sorted(held) == ["__0_0.distcp", "__1_0.distcp"], held
    assert max(held.values()) < 0.6 * sum(held.values()), held


@pytest.mark.skipif(sys.platform != "linux", reason="torchrun with gloo is tested on Linux")
def test_two_ranks_write_per_rank_shards_and_resume_exactly(tmp_path):
    r = _torchrun([__file__, str(tmp_path)], 29551)
    assert "step_000002/__1_0.distcp: 100 bytes" in r.stdout, r.stdout[-3000:]
    _assert_sharded(tmp_path / "ckpt" / "step_000001")


@pytest.mark.skipif(sys.platform != "linux", reason="torchrun with gloo is tested on Linux")
def test_two_ranks_end_to_end_resume_matches_the_uninterrupted_run(tmp_path):
    # train.main under 2 ranks for 2 steps; then a copy of the run cut back to its step-1 checkpoint (a run
    # interrupted after step 1) resumed to step 2: the same step-2 metrics and parameters.
    argv = [str(ROOT / "train.py"), *TINY, "--env_workers", "1", "--eval", "false", "--out_dir", str(tmp_path)]
    _torchrun(argv + ["--run_name", "full"], 29552, timeout=900)
    full, cut = tmp_path / "full", tmp_path / "cut"
    assert [d.name for d in D.checkpoints(full)] == ["step_000002", "step_000001"]
    _assert_sharded(full / "ckpt" / "step_000002")
    shutil.copytree(full, cut)
    shutil.rmtree(cut / "ckpt" / "step_000002")
    rows = [json.loads(line) for line in (full / "metrics.jsonl").read_text().splitlines()]
    (cut / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows if r["step"] <= 1))
    r = _torchrun(argv + ["--run_name", "cut"], 29553, timeout=900)
    assert "resumed from" in r.stdout and "step_000001 at step 1" in r.stdout, r.stdout[-3000:]
    s2 = [r for r in rows if r["step"] == 2 and "train/success" in r]
    s2_cut = [json.loads(line) for line in (cut / "metrics.jsonl").read_text().splitlines()]
    s2_cut = [r for r in s2_cut if r["step"] == 2 and "train/success" in r]
    assert len(s2) == len(s2_cut) == 1
    for k in ("train/turns", "train/reward", "loss", "pg/ratio_mean", "kl/k3", "update/grad_norm"):
        assert s2_cut[0][k] == pytest.approx(s2[0][k], rel=1e-5, abs=1e-7), k
    a, b = _state(full), _state(cut)
    assert a["step"] == b["step"] == 2
    for k, v in a["model"].items():
        assert torch.allclose(v, b["model"][k], atol=1e-6), k


def test_threads_respect_omp_num_threads():
    assert D.cpu_threads(2, {"OMP_NUM_THREADS": "3"}) == 3           # the user's choice stands
    assert D.cpu_threads(2, {}) == max(1, (os.cpu_count() or 2) // 2)  # else the cores shared out over ranks
    assert D.cpu_threads(1, {"OMP_NUM_THREADS": "0"}) == max(1, os.cpu_count() or 2)
    # the cores are shared by the ranks of this host: 2 of 16 ranks per node share it, not 16
    assert D.local_world({"LOCAL_WORLD_SIZE": "2"}) == 2 and D.local_world({}) == D.WORLD


def test_each_rank_seeds_its_own_generators(monkeypatch):
    monkeypatch.setattr(D, "RANK", 1)
    D.seed_rank(5)
    assert torch.initial_seed() == 6 and random.random() == random.Random(6).random()
    assert np.random.rand() == np.random.RandomState(6).rand()


if __name__ == "__main__":   # torchrun worker of test_two_ranks_write_per_rank_shards_and_resume_exactly
    _two_rank_worker(Path(sys.argv[1]))
    D.exit_process(0)   # the group is destroyed: no gloo teardown abort after the work is done


@pytest.mark.skipif(sys.platform != "linux", reason="torchrun with gloo is tested on Linux")
def test_sigterm_mid_run_then_restart_matches_the_uninterrupted_run(tmp_path):
    """2 ranks, 3 RL steps. SIGTERM to torchrun in step 2: the ranks agree, the step is abandoned (before its
    update) or finished (after), a checkpoint of the steps done is written and the run exits non-zero; the
    same command then resumes, and every step's metrics equal those of a run never interrupted."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_preemption import torchrun_sigterm
    argv = [str(ROOT / "train.py"), *TINY, "--steps", "3", "--env_workers", "1", "--eval", "false",
            "--out_dir", str(tmp_path)]
    _torchrun(argv + ["--run_name", "full"], 29554, timeout=900)
    # a tiny step takes about a second: the signal lands in step 1's end or in step 2
    rc, log, _ = torchrun_sigterm(argv + ["--run_name", "cut"], 29555, lambda out: "\nstep    1 |" in out,
                                  timeout=300)
    assert rc != 0 and "preempted (SIGTERM): checkpoint of step" in log, log[-3000:]
    done = int(log.split("preempted (SIGTERM): checkpoint of step ")[1].split()[0])
    assert done in (1, 2) and D.checkpoints(tmp_path / "cut")[0].name == f"step_{done:06d}"
    r = _torchrun(argv + ["--run_name", "cut"], 29556, timeout=900)
    assert f"at step {done} (weights match" in r.stdout, r.stdout[-3000:]

    def steps(run):
        rows = [json.loads(x) for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in r.items() if not k.startswith(("time/", "mem/"))}
                for r in rows if "train/success" in r]

    full, cut = steps("full"), steps("cut")
    assert [r["step"] for r in cut] == [1, 2, 3]
    for a, b in zip(full, cut):
        assert a.keys() == b.keys()
        assert all(a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-7) for k in a), (a, b)
    assert _equal(_state(tmp_path / "full")["model"], _state(tmp_path / "cut")["model"])


@pytest.mark.skipif(sys.platform != "linux", reason="torchrun with gloo is tested on Linux")
def test_a_run_checkpointed_on_two_ranks_resumes_on_one(tmp_path):
    """DCP reshards: the step-1 checkpoint of a 2-rank run, resumed by `python train.py` (one rank, no process
    group), takes the same step 2 as the 2-rank run, up to the order of float sums. Rollouts are greedy here
    (each rank samples with its own random stream, so sampled episodes differ with the world size) and one
    mini-batch holds the step's samples (so the optimizer takes the same steps)."""
    flags = [*TINY, "--temperature", "0", "--skill_temperature", "0", "--mini_batch", "64", "--env_workers", "1",
             "--eval", "false", "--out_dir", str(tmp_path)]
    _torchrun([str(ROOT / "train.py"), *flags, "--run_name", "two"], 29557, timeout=900)
    two, one = tmp_path / "two", tmp_path / "one"
    shutil.copytree(two, one)
    shutil.rmtree(one / "ckpt" / "step_000002")
    rows = [json.loads(x) for x in (two / "metrics.jsonl").read_text().splitlines()]
    (one / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows if r["step"] <= 1))
    r = subprocess.run([sys.executable, str(ROOT / "train.py"), *flags, "--run_name", "one"], cwd=ROOT,
                       env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "step_000001 at step 1 (weights match the checksum saved with them)" in r.stdout, r.stdout[-3000:]
    s2 = next(r for r in rows if r["step"] == 2 and "train/success" in r)
    s2_one = next(json.loads(x) for x in (one / "metrics.jsonl").read_text().splitlines()
                  if json.loads(x)["step"] == 2 and "train/success" in json.loads(x))
    keys = [k for k in s2 if not k.startswith(("time/", "mem/"))]
    assert set(keys) == {k for k in s2_one if not k.startswith(("time/", "mem/"))}
    assert s2["update/grad_norm"] > 0 and s2["kl/k3"] > 0          # the update moved the weights
    assert all(s2[k] == pytest.approx(s2_one[k], rel=1e-4, abs=1e-6) for k in keys), \
        {k: (s2[k], s2_one[k]) for k in keys if s2[k] != pytest.approx(s2_one[k], rel=1e-4, abs=1e-6)}
