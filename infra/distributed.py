"""Distributed helpers: the process group, reductions, FSDP2 sharding, rank-aligned micro-batches, and sharded
checkpoints. The only file that knows about ranks' bookkeeping; the trainer calls these at its edges.

* `setup()` joins torchrun's process group (gloo on CPU; on GPU NCCL for CUDA tensors and gloo for CPU
  tensors, `backend`) and sets the module's RANK and WORLD; without torchrun a CPU run is a world of one
  without a group, and one GPU joins a group of one, so that every GPU path is the FSDP2 path. `print0`,
  `all_reduce` (sum / max of host floats), `all_gather_obj`, `barrier` work in both cases. Every
  collective of the project's own goes through this module (tests/test_distributed.py checks it).
* `shard(model, param_dtype)`: FSDP2 `fully_shard` of every decoder block, then the root; fp32 master
  weights with bf16 compute and fp32 gradient reduction on GPU. `full_state` gathers the full state dict
  (the Hugging Face export), `copy_params` copies the policy into the rollout copy one tensor at a time.
* `aligned_micro_batches`: FSDP2 needs every rank to run the same number of forward/backward passes, so a
  rank with fewer micro-batches runs zero-weight dummies **[ours]**.
* Checkpoints with torch.distributed.checkpoint **[ours]** layout: `save_checkpoint` writes
  `<run>/ckpt/step_N/` (each rank its own shard of the policy and AdamW, rank 0 the RNG states of every
  rank and a small `extra` dict), atomically (a `.tmp` folder renamed once complete) and keeps the
  previous complete one; `load_checkpoint` resumes the newest one that loads, naming a damaged one and
  falling back; `check_resume` refuses a checkpoint written with other flags.
* `cpu_threads`: intra-op threads per rank, OMP_NUM_THREADS when set.
* `exit_process(code)`: end a rank at once, once its work is on disk, skipping the interpreter's teardown.

Test: pytest tests/test_checkpoint.py tests/test_train.py (two gloo ranks under torchrun)
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import random
import shutil
import sys
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

RANK, WORLD = 0, 1   # set by setup()


def backend(cuda: bool) -> str:
    """The process group's backends: on GPU one group with NCCL for CUDA tensors and gloo for CPU tensors,
    so a reduction of host numbers (the trainer's counts and metrics) and of GPU tensors (FSDP2) both have
    a backend; a plain "nccl" group refuses CPU tensors ("No backend type associated with device type cpu").
    Gloo alone on CPU."""
    return "cpu:gloo,cuda:nccl" if cuda else "gloo"


def setup(timeout_min: float = 60.0) -> tuple[int, int]:
    """Join the torchrun process group (`backend`) and set RANK, WORLD. One GPU without torchrun runs as
    a world of one, so that every GPU path is the FSDP2 path: fp32 master weights, bf16 compute (`shard`).
    On GPU the rank's device is set before the group is made, and the group is bound to it (`device_id`).
    `timeout_min` [ours]: how long a collective may wait for the slowest rank (torch's NCCL default of 10
    minutes is shorter than one rank's share of a 7B evaluation, or rank 0 writing a 30 GB checkpoint)."""
    global RANK, WORLD
    if "RANK" not in os.environ and int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        raise SystemExit(f"error: SLURM started {os.environ['SLURM_NTASKS']} tasks of train.py without torchrun: "
                         "each would be a world of one, writing the same run folder. Launch one torchrun per node, "
                         "e.g. srun --ntasks-per-node 1 torchrun --nnodes $SLURM_NNODES --nproc_per_node 8 "
                         "--rdzv_backend c10d --rdzv_endpoint $MASTER_ADDR:29500 train.py ... (recipes/README.md)")
    cuda = torch.cuda.is_available()
    if "RANK" not in os.environ and cuda and not dist.is_initialized():
        import socket
        with socket.socket() as s:   # a free port for the one-process rendezvous
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if "RANK" in os.environ and not dist.is_initialized():
        import datetime
        why = loopback_gloo(os.environ)
        if why:
            raise SystemExit(f"error: {why}")
        kw = {}
        if cuda:
            local = int(os.environ.get("LOCAL_RANK", 0))
            torch.cuda.set_device(local)   # before the group: NCCL binds its communicator to this device
            kw["device_id"] = torch.device("cuda", local)
        dist.init_process_group(backend(cuda), timeout=datetime.timedelta(minutes=timeout_min), **kw)
    RANK = dist.get_rank() if dist.is_initialized() else 0
    WORLD = dist.get_world_size() if dist.is_initialized() else 1
    return RANK, WORLD


# The oldest Linux driver branch that runs each CUDA major version of torch's builds (NVIDIA's CUDA release
# notes: CUDA 12.x needs R525 or newer, CUDA 13.x R580 or newer).
MIN_DRIVER = {12: 525, 13: 580}


def nvidia_driver(path: str = "/proc/driver/nvidia/version") -> Optional[str]:
    """The NVIDIA kernel driver's version ("580.159.04"), or None when no NVIDIA driver is loaded."""
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    import re
    m = re.search(r"Kernel Module(?: for \S+)?\s+(\d+\.\d+(?:\.\d+)?)", text)
    return m.group(1) if m else "unknown"


_HERE = object()   # why_no_gpu's default: this machine's torch build and driver


def why_no_gpu(torch_cuda=_HERE, driver=_HERE) -> str:
    """Why torch sees no CUDA GPU, in words: a CPU build of torch, no NVIDIA driver, or a driver older than
    the CUDA that torch was built for (torch 2.13 from the package index is built for CUDA 13, which needs
    driver 580 or newer; R535-R570 drivers see no GPU through it). By default about this machine
    (`torch.version.cuda`, `nvidia_driver()`)."""
    torch_cuda = torch.version.cuda if torch_cuda is _HERE else torch_cuda
    driver = nvidia_driver() if driver is _HERE else driver
    if torch_cuda is None:
        return (f"this torch ({torch.__version__}) is a CPU build; install the CUDA build of torch==2.13.0 "
                "(on a GPU machine `pip install torch==2.13.0` from the package index is built for CUDA 13)")
    if driver is None:
        return f"no NVIDIA driver is loaded (torch is built for CUDA {torch_cuda})"
    need = MIN_DRIVER.get(int(torch_cuda.split(".")[0]))
    have = int(driver.split(".")[0]) if driver.split(".")[0].isdigit() else None
    if need and have is not None and have < need:
        return (f"the NVIDIA driver {driver} is too old for torch's CUDA {torch_cuda}, which needs driver {need} or "
                f"newer: update the driver, or install a torch built for an older CUDA (vLLM 0.32.0 needs CUDA 13)")
    return (f"torch (CUDA {torch_cuda}) and the NVIDIA driver {driver} should work together; check "
            "CUDA_VISIBLE_DEVICES and nvidia-smi")


def print0(*a, **k):
    if RANK == 0:
        print(*a, **k, flush=True)


def all_reduce(x: float | list[float], op="sum") -> np.ndarray:
    t = torch.tensor(np.atleast_1d(np.asarray(x, dtype=np.float64)))
    if dist.is_initialized():
        dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
    return t.numpy()


def all_reduce_named(stats: dict[str, float], op="sum") -> dict[str, float]:
    """`all_reduce` of named numbers: {name: the value reduced over ranks}, in one collective. Every rank
    must pass the same names in the same order."""
    return dict(zip(stats, (float(v) for v in all_reduce(list(stats.values()), op))))


def all_reduce_union(stats: dict[str, float]) -> dict[str, float]:
    """Sums over ranks of named numbers whose names may differ between ranks (a name a rank lacks counts as
    0 there), sorted by name: the names are gathered first, because all-reducing lists of different lengths
    aborts gloo ("Received data size doesn't match") and hangs NCCL."""
    keys = sorted(set().union(*all_gather_obj(sorted(stats))))
    return dict(zip(keys, (float(v) for v in all_reduce([stats.get(k, 0.0) for k in keys]))))


def barrier():
    """Every rank waits here for the others (a no-op without a group)."""
    if dist.is_initialized():
        dist.barrier()


def exit_process(code: int):
    """End this process now with exit status `code`: stdout and stderr flushed, the interpreter's teardown
    skipped. Call it once the process group is destroyed and every output is written. [ours] Two reasons. The
    teardown can take seconds that a scheduler's grace period lacks (a preempted run). And with gloo it can
    abort a rank whose work is complete: objects that hold the destroyed group are freed while the interpreter
    finalizes, and std::terminate ends the process ("terminate called without an active exception", SIGABRT,
    no Python frame on the stack): one of 15 runs of the two-rank checkpoint test on 2 cores."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def all_gather_obj(x):
    if not dist.is_initialized():
        return [x]
    out = [None] * WORLD
    dist.all_gather_object(out, x)
    return out


def loopback_gloo(environ, resolve=None) -> Optional[str]:
    """Why a start on several hosts would hang, or None. Gloo (the host collectives, and vLLM's CPU groups) binds
    to the address this host's name resolves to; where that is loopback (Debian's default /etc/hosts maps the
    hostname to 127.0.1.1), the other hosts cannot reach it and the start waits out --dist_timeout. Several hosts:
    WORLD_SIZE above LOCAL_WORLD_SIZE; GLOO_SOCKET_IFNAME set means the user chose the interface."""
    import socket
    world = int(environ.get("WORLD_SIZE", 1))
    local = int(environ.get("LOCAL_WORLD_SIZE", world))
    if world <= local or environ.get("GLOO_SOCKET_IFNAME"):
        return None
    host = socket.gethostname()
    try:
        addr = (resolve or socket.gethostbyname)(host)
    except OSError:
        return None
    if not addr.startswith("127."):
        return None
    return (f"{world} ranks on several hosts, and this host's name {host!r} resolves to {addr} (loopback), where "
            "gloo would listen and the other hosts cannot reach it: set GLOO_SOCKET_IFNAME (and NCCL_SOCKET_IFNAME) "
            "to the network interface the hosts share, e.g. GLOO_SOCKET_IFNAME=eth0 (`ip -br addr` lists them)")


def seed_rank(seed: int):
    """Python's, NumPy's and torch's generators from `seed` plus this rank: each rank draws its own numbers (a
    model built from a seed re-seeds for itself, so that every rank builds the same one)."""
    random.seed(seed + RANK)
    np.random.seed(seed + RANK)
    torch.manual_seed(seed + RANK)


def rng_states() -> dict:
    """This rank's Python, NumPy, torch (and CUDA: the HF engine samples from it on a GPU) generator states."""
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}


def set_rng_states(saved: list[dict], key: str):
    """This rank's generators from the states every rank saved (`rng_states`, all-gathered); a rank the saved run
    did not have draws streams of its own (`fresh_streams` from `key` and its rank), not another rank's copy."""
    if RANK >= len(saved):
        fresh_streams(f"{key}-{RANK}")
        return
    r = saved[RANK]
    random.setstate(r["python"])
    np.random.set_state(r["numpy"])
    torch.set_rng_state(r["torch"])
    if r.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(r["cuda"])


def fresh_streams(key: str):
    """Python's, NumPy's, torch's (and CUDA's) generators seeded from `key`: a rank that a checkpoint holds no
    states for (a resume on more ranks) draws its own numbers; copying another rank's would make both sample the
    same episodes (and under vLLM, which draws its request seeds from NumPy, the same first turns)."""
    seed = random.Random(key).getrandbits(32)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)               # CUDA's generators too, where there are any


def local_world(environ=os.environ) -> int:
    """The ranks on this host (torchrun's LOCAL_WORLD_SIZE; without torchrun, the world): the ones that share
    its cores."""
    return int(environ.get("LOCAL_WORLD_SIZE", WORLD))


def cpu_threads(world: int, environ=os.environ) -> int:
    """Intra-op threads per rank: OMP_NUM_THREADS when the user set it, else the cores shared out."""
    if environ.get("OMP_NUM_THREADS", "").isdigit() and int(environ["OMP_NUM_THREADS"]) > 0:
        return int(environ["OMP_NUM_THREADS"])
    return max(1, (os.cpu_count() or 2) // max(1, world))


def shard(model, param_dtype: Optional[torch.dtype] = None):
    """FSDP2: fully_shard every decoder block, then the root (only when running distributed; a model already
    sharded is returned as it is). Parameters stay in their dtype (fp32: the master weights); `param_dtype`
    bf16 (default on GPU) computes the forward and backward in bf16 and reduces gradients in fp32."""
    from torch.distributed.fsdp import FSDPModule, fully_shard, MixedPrecisionPolicy
    if not dist.is_initialized() or isinstance(model, FSDPModule):
        return model
    param_dtype = param_dtype or (torch.bfloat16 if torch.cuda.is_available() else torch.float32)
    mp = None
    if param_dtype != torch.float32:
        mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    kw = {"mp_policy": mp} if mp else {}
    for block in model.model.layers:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    return model


def load_sharded(path: str, dtype: torch.dtype, device, param_dtype: Optional[torch.dtype] = None,
                 grad_ckpt: bool = False):
    """A Hugging Face causal LM from `path`, FSDP2-sharded as it loads: rank 0 reads the checkpoint into host
    memory, every other rank builds the model on the meta device (no memory), all shard it (`shard`) and
    allocate their shards on `device`, and rank 0's tensors are broadcast one at a time into the shards
    (`set_model_state_dict(broadcast_from_rank0=True)`); the buffers that are no part of the state dict
    (the rotary frequencies) come from rank 0 as well. So only rank 0 ever holds the whole model, in host
    memory, and no GPU does (at 7B in fp32: 28 GiB on one host process, against 28 GiB per rank, and 28 GiB
    more on every GPU, when each rank loads it and moves it whole). A collective; needs a process group."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    full = AutoModelForCausalLM.from_pretrained(path, dtype=dtype) if RANK == 0 else None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype)
    try:
        model.generation_config = GenerationConfig.from_pretrained(path)   # the checkpoint's eos ids (HFEngine)
    except OSError:
        pass
    if grad_ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = shard(model, param_dtype)
    model.to_empty(device=device)
    set_model_state_dict(model, full.state_dict() if full is not None else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    copy_buffers(model, all_gather_obj(dict(full.named_buffers()) if full is not None else None)[0])
    del full
    return model


def sharded_like(model, dtype: torch.dtype, device, param_dtype: Optional[torch.dtype] = None):
    """An FSDP2 model of `model`'s architecture, sharded as `shard` shards it, its parameters allocated in `dtype`
    on `device` and not filled (fill them: `ema_params(out, model, 0.0)`, or a checkpoint's load), its buffers
    `model`'s. No file is read and no rank holds the whole model (an EMA teacher at 7B: 30 GB that rank 0 read from
    disk and broadcast, only to overwrite them)."""
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        out = AutoModelForCausalLM.from_config(model.config, dtype=dtype)
    out.generation_config = model.generation_config
    out = shard(out, param_dtype)
    out.to_empty(device=device)
    copy_buffers(out, {_plain(n): b for n, b in model.named_buffers()})
    return out


def _plain(name: str) -> str:
    """A parameter's or buffer's name without activation checkpointing's wrapper."""
    return name.replace("_checkpoint_wrapped_module.", "")


def unsharded_copy(model, dtype: torch.dtype, device):
    """A plain (unsharded) copy of a possibly FSDP2-sharded Hugging Face model, in `dtype` on `device`: built
    from its config on the meta device, then filled one gathered parameter at a time (`copy_params`) and
    given the same buffers. A collective when `model` is sharded."""
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        out = AutoModelForCausalLM.from_config(model.config, dtype=dtype)
    out.generation_config = model.generation_config
    out.to_empty(device=device)
    out.tie_weights()                     # to_empty gives a tied head a parameter of its own: tie it again
    copy_params(out, model)
    copy_buffers(out, dict(model.named_buffers()))
    return out


@torch.no_grad()
def copy_buffers(dst, src: dict):
    """dst's buffers := the tensors of the same names in `src`, in src's dtype (the ones no state dict carries,
    e.g. rotary frequencies, which a model built on the meta device lacks; fp32 in every Hugging Face model)."""
    for n, b in dst.named_buffers():
        b.data = src[n].detach().to(device=b.device).clone()


def rollout_copy(model, dtype: torch.dtype, device):
    """[ours] The HF engine's rollout weights (π_old): a plain copy of the policy (FSDP2-sharded or not) whose
    parameters are in `dtype` and whose buffers are exactly the policy's, dtype included. Casting the whole
    copy (`.to(torch.bfloat16)`) would round the rotary frequencies (`inv_freq`) as well: the sampler's angles
    would then drift from the trainer's by position × the rounding error (about 2 rad at position 2,048), and
    π_old, the teacher and the samples would come from another model than π_θ. A collective when sharded."""
    from torch.distributed.fsdp import FSDPModule
    out = unsharded_copy(model, dtype, device) if isinstance(model, FSDPModule) else copy.deepcopy(model).to(device)
    with torch.no_grad():
        for p in out.parameters():        # parameters only; a tied head is one parameter, cast once
            p.data = p.data.to(dtype)
    copy_buffers(out, dict(model.named_buffers()))
    return out.eval()


@torch.no_grad()
def copy_params(dst, src) -> int:
    """dst's parameters := src's, one tensor at a time (src may be FSDP2-sharded: then a collective, every rank
    calls it): no rank ever holds more than one gathered parameter, where a full state dict would gather the
    whole model at once (28 GiB of fp32 at 7B). dst is an unsharded copy of the same architecture, in any
    dtype and on any device. Returns how many tensors were copied."""
    into = dict(dst.named_parameters())
    n = 0
    for name, p in src.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        into[name.replace("_checkpoint_wrapped_module.", "")].copy_(t)
        n += 1
    if n != len(into):
        raise RuntimeError(f"copy_params: {n} parameters copied into a model that has {len(into)}")
    return n


@torch.no_grad()
def ema_params(dst, src, decay: float) -> int:
    """dst ← decay·dst + (1 − decay)·src, parameter by parameter; decay 0 copies. src may be FSDP2-sharded: a dst
    sharded the same way (the same `shard` on the same ranks) is updated shard by shard on each rank with no
    communication; a plain dst takes one gathered tensor at a time (a collective: every rank calls it). dst's
    dtype is kept (an average in fp32 keeps the updates lr 1e-6 makes, which bf16 would round away).
    An FSDP2 model whose parameters are gathered (its root after a no-grad forward that did not reshard) is refused:
    the average would go into the gathered compute-dtype copies and be lost at the next reshard."""
    from torch.distributed.fsdp import FSDPModule
    for which, m in (("dst", dst), ("src", src)):
        if isinstance(m, FSDPModule) and not all(hasattr(p, "to_local") for p in m.parameters()):
            raise RuntimeError(f"ema_params: {which} is an FSDP2 model whose parameters are gathered (unsharded): "
                               "call its reshard() first, or the average is written into copies FSDP2 drops")
    into = {_plain(name): q for name, q in dst.named_parameters()}
    n = 0
    for name, p in src.named_parameters():
        q = into[_plain(name)]
        if hasattr(q, "to_local"):        # both sharded alike: this rank's shards
            q, t = q.to_local(), p.to_local()
        else:
            t = p.full_tensor() if hasattr(p, "full_tensor") else p
        if decay == 0.0:
            q.copy_(t)
        else:
            q.lerp_(t.to(q.dtype), 1.0 - decay)
        n += 1
    if n != len(into):
        raise RuntimeError(f"ema_params: {n} parameters averaged into a model that has {len(into)}")
    return n


def full_state(model, rank0_only: bool = False) -> dict:
    """Full (unsharded) state dict on every rank (rank0_only: on rank 0, {} elsewhere), on CPU; a
    collective under FSDP2 (all ranks call it)."""
    if dist.is_initialized():
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, StateDictOptions
        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=rank0_only))
        return {k: v.detach().cpu() for k, v in sd.items()}
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def param_checksum(model) -> list[float]:
    """[Σ w, Σ w²] over every parameter, in float64, over all ranks' shards: what a checkpoint's weights
    must give again once loaded, on any world size (up to the order of the sums). A collective under FSDP2."""
    return checksum_total(*local_checksum(model))


def local_checksum(model) -> tuple[list[float], bool]:
    """This rank's part of `param_checksum` (no collective), and whether the model is sharded."""
    s = torch.zeros(2, dtype=torch.float64)
    sharded = False
    for p in model.parameters():
        sharded |= hasattr(p, "to_local")
        t = (p.to_local() if hasattr(p, "to_local") else p).detach().double()
        s += torch.stack([t.sum(), (t * t).sum()]).cpu()
    return s.tolist(), sharded


def checksum_total(local: list[float], sharded: bool) -> list[float]:
    """The ranks' `local_checksum` parts summed (a collective when sharded)."""
    return all_reduce(local).tolist() if sharded else list(local)


def clip_grad_norm(model, max_norm: float) -> float:
    """Clip the gradients in place to a total norm of `max_norm` and return the norm before clipping, over every
    rank's shards under FSDP2 (a DTensor there); non-finite when any gradient is."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


def micro_batches(lengths: list[int], micro_batch: int, micro_tokens: int = 0) -> list[list[int]]:
    """Consecutive index groups: `micro_batch` sequences each, or with `micro_tokens` > 0 [ours] as many
    as fit count × longest <= micro_tokens (a longer sequence goes alone)."""
    out: list[list[int]] = []
    longest = 0
    for i, n in enumerate(lengths):
        if not out or (len(out[-1]) >= micro_batch if not micro_tokens
                       else max(longest, n) * (len(out[-1]) + 1) > micro_tokens):
            out.append([])
            longest = 0
        out[-1].append(i)
        longest = max(longest, n)
    return out


def global_mini_batches(items: list, lengths: list[int], size: int, seed: int) -> tuple[list[list], int]:
    """One epoch's mini-batches over the items of every rank, whatever the number of ranks: the ranks' items in
    rank order are shuffled with `seed` (the same on every rank) and cut into mini-batches of `size` (the last may
    be smaller), exactly as one rank holding them all would cut them. Each mini-batch is then dealt out so that
    every rank holds an equal share to within one item: an item stays on its own rank while that rank has room,
    and the rest go, longest first, to the rank with room and the fewest tokens (`lengths`) so far. Only those
    moved are sent (one object gather). Returns this rank's part of each mini-batch, in the shuffled order, and
    the number of items over all ranks. A collective; on one rank it is a shuffle."""
    owners = [(r, i, n) for r, part in enumerate(all_gather_obj(lengths)) for i, n in enumerate(part)]
    order = list(range(len(owners)))
    random.Random(seed).shuffle(order)
    place: dict[tuple[int, int], tuple[int, int]] = {}   # (rank, index) → (mini-batch, position) here
    dest: dict[tuple[int, int], int] = {}                 # (rank, index) → the rank that trains it
    for m, start in enumerate(range(0, len(order), size)):
        chunk = [owners[g] for g in order[start:start + size]]
        room = [len(chunk) // WORLD + (r < len(chunk) % WORLD) for r in range(WORLD)]
        tokens = [0] * WORLD
        movers = []
        for pos, (r, i, n) in enumerate(chunk):
            place[r, i] = (m, pos)
            if room[r]:
                dest[r, i], room[r], tokens[r] = r, room[r] - 1, tokens[r] + n
            else:
                movers.append((r, i, n))
        for r, i, n in sorted(movers, key=lambda x: -x[2]):
            to = min((k for k in range(WORLD) if room[k]), key=lambda k: tokens[k])
            dest[r, i], room[to], tokens[to] = to, room[to] - 1, tokens[to] + n
    sent = all_gather_obj([(RANK, i, x) for i, x in enumerate(items) if dest[RANK, i] != RANK])
    arrived = {(r, i): x for part in sent for r, i, x in part if dest[r, i] == RANK}
    mine = [(place[RANK, i], x) for i, x in enumerate(items) if dest[RANK, i] == RANK]
    mine += [(place[key], x) for key, x in arrived.items()]
    out: list[list] = [[] for _ in range(math.ceil(len(order) / size))] if order else []
    for (m, pos), x in sorted(mine, key=lambda t: t[0]):
        out[m].append(x)
    return out, len(order)


def aligned_micro_batches(items: list, lengths: list[int], micro_batch: int, micro_tokens: int, dummy):
    """Yield (micro-batch, is_dummy) over `items` grouped by `micro_batches` (sorted by length first when
    cutting by a token budget [ours]), then one-item `dummy` batches until this rank has run as many as
    the rank that needs the most: FSDP2 needs every rank to run the same number of forward/backward passes."""
    order = sorted(range(len(items)), key=lengths.__getitem__) if micro_tokens else list(range(len(items)))
    groups = micro_batches([lengths[i] for i in order], micro_batch, micro_tokens)
    for u in range(int(all_reduce(len(groups), "max")[0])):
        yield ([items[order[j]] for j in groups[u]], False) if u < len(groups) else ([dummy], True)


# ---------------------------------------------------------------------------------------------
# Checkpoints

# [ours] Layout: <run>/ckpt/step_000008/ holds the policy and its AdamW as torch.distributed.checkpoint
# (DCP) shards, each rank writing and reading only its own part (__<rank>_0.distcp, .metadata), then
# extra.pt (the step, every rank's RNG states, `extra`: small python objects, no tensors), args.json and
# the COMPLETE marker. A folder is written as step_000008.tmp and renamed into place once every rank has
# written; each save keeps itself and the newest complete checkpoint before it (the fallback).

def checkpoints(run_dir: Path) -> list[Path]:
    """The run's complete checkpoints (step_<n> with the COMPLETE marker), newest first."""
    dirs = [d for d in (run_dir / "ckpt").glob("step_*") if d.name[5:].isdigit() and (d / "COMPLETE").exists()]
    return sorted(dirs, key=lambda d: int(d.name[5:]), reverse=True)


def agreed_checkpoints(run_dir: Path) -> list[Path]:
    """`checkpoints` as rank 0 lists them, on every rank (a collective). On a shared file system with attribute
    caching the ranks' own listings can differ, and ranks that decided differently whether to resume, which
    checkpoint to load or whether to save would call different collectives and hang: rank 0 decides for all."""
    names = all_gather_obj([d.name for d in checkpoints(run_dir)] if RANK == 0 else None)[0]
    return [run_dir / "ckpt" / n for n in names]


def _fsync(path: Path):   # a file's data, or a folder's entries, on disk before the rename relies on them
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(run_dir: Path, model, opt, step: int, args, extra: dict, models: Optional[dict] = None):
    """Write <run>/ckpt/step_<step>: sharded, atomic (see above). [ours] At most two complete checkpoints at any
    moment: before writing, every step_* folder but the newest complete one before this step (the fallback) is
    deleted (older ones, a later one of an abandoned timeline, crashed temp folders), so the disk holds the
    fallback and the new one, never a third (7B: 2 × 91 GB, not 3). Collective under FSDP2: no rank ever holds the
    full state. `models`: other modules the run must resume with (name → module, e.g. an EMA teacher)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict
    from torch.utils._pytree import tree_leaves
    if any(isinstance(x, torch.Tensor) for x in tree_leaves(extra)):
        raise TypeError("save_checkpoint: `extra` must hold plain python objects, no tensors")
    final = run_dir / "ckpt" / f"step_{step:06d}"
    tmp = final.with_name(final.name + ".tmp")
    if RANK == 0:
        keep = next((d for d in checkpoints(run_dir) if int(d.name[5:]) < step), None)   # the fallback
        for d in (run_dir / "ckpt").glob("step_*"):   # a crashed save of this step included: it starts over
            if d != keep:
                shutil.rmtree(d, ignore_errors=True)
        tmp.mkdir(parents=True)
    if dist.is_initialized():
        dist.barrier()
    checksum = param_checksum(model)
    # An optimizer that has not stepped yet has no state, and get_state_dict would make one by taking a zero-lr
    # step: Adam's count would read 1 with zero moments, in the checkpoint and in the running optimizer, and the
    # first real update would be 0.744× a fresh one. Its checkpoint holds the weights alone.
    stepped = bool(opt.state)
    if stepped:
        msd, osd = get_state_dict(model, opt)   # under FSDP2 this rank's shards (DTensors), no gather
        state = {"model": msd, "optim": osd}
    else:
        state = {"model": get_model_state_dict(model)}
    state.update({name: get_model_state_dict(m) for name, m in (models or {}).items()})
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp), no_dist=not dist.is_initialized())
    # gathered after dcp.save (whatever it might draw), so they are the states the run goes on with;
    # a collective, so past it every rank has written its shards
    rng = all_gather_obj(rng_states())
    if RANK == 0:
        torch.save({"step": step, "rng": rng, "extra": extra, "checksum": checksum, "optim": stepped}, tmp / "extra.pt")
        (tmp / "args.json").write_text(json.dumps(dataclasses.asdict(args), indent=1))
        (tmp / "COMPLETE").write_text(json.dumps({"step": step, "world": WORLD}))
        for f in ("extra.pt", "args.json", "COMPLETE", "."):
            _fsync(tmp / f)
        os.replace(tmp, final)
        _fsync(final.parent)
    if dist.is_initialized():
        dist.barrier()


# Flags a resumed run must share with the checkpoint it resumes (the rest, e.g. --steps, may change).
def check_resume(run_dir: Path, args, may_change=(), fallback: Optional[Path] = None):
    """Refuse, before any compute, to resume a run with other flags than it was written with: every flag of a
    checkpoint's args.json but `may_change` (the caller's list) must be the same now (a GRPO run's ckpt picked up
    by an --algo rsipo run of the same --run_name, another --data_root, another --lr). Every complete checkpoint is
    checked (a damaged newest one falls back to the previous); with none, the `fallback` file of flags if it exists
    (a run folder's config.json: a warm start it will reuse). Flags the file does not have (older code) are not
    compared. Rank 0 reads and decides for all (a collective): on a shared file system that lags, another rank's
    own reads could decide otherwise."""
    verdict = None
    found = checkpoints(run_dir) if RANK == 0 else []
    files = [d / "args.json" for d in found] or ([fallback] if fallback is not None and RANK == 0 else [])
    for f in files:
        saved = json.loads(f.read_text()) if f.exists() else {}
        now = vars(args)
        diff = [k for k in sorted(saved) if k in now and k not in may_change and saved[k] != now[k]]
        if diff:
            verdict = (f"error: {f.parent} was written with other flags than this run's: "
                       + ", ".join(f"--{k} {saved[k]} (now {now[k]})" for k in diff)
                       + ". Resume with the same flags (these may change: "
                       + ", ".join(f"--{k}" for k in may_change) + "), use another --run_name, or --resume false "
                       "--overwrite true to start the run over")
            break
    verdict = all_gather_obj(verdict)[0]
    if verdict:
        raise SystemExit(verdict)


def _read_extra(d: Path):
    """extra.pt of checkpoint d (the step, the RNG states, the run's state), or why it cannot be read."""
    try:
        return torch.load(d / "extra.pt", map_location="cpu", weights_only=False)
    except Exception as e:
        return f"{d / 'extra.pt'}: unreadable ({type(e).__name__}: {' '.join(str(e).split())[:200]})"


def checkpoint_damage(d: Path) -> Optional[str]:
    """The first missing or truncated file of checkpoint folder d, or its unreadable DCP metadata, as
    "path: why"; None when every file the metadata names is there in full. (A shard damaged in place,
    same size, shows only when DCP fails to read it.)"""
    import torch.distributed.checkpoint as dcp
    try:
        md = dcp.FileSystemReader(d).read_metadata()
    except Exception as e:
        return f"{d / '.metadata'}: unreadable ({type(e).__name__}: {e})"
    need = {"extra.pt": 1}   # bytes each file must have: the end of its last item
    for s in md.storage_data.values():
        need[s.relative_path] = max(need.get(s.relative_path, 0), s.offset + s.length)
    for name, n in sorted(need.items()):
        size = (d / name).stat().st_size if (d / name).exists() else None
        if size is None or size < n:
            return f"{d / name}: " + ("missing" if size is None else f"{size} bytes, the metadata needs {n}")
    return None


def load_checkpoint(run_dir: Path, model, opt, models: Optional[dict] = None) -> Optional[dict]:
    """Restore the newest complete checkpoint that loads (collective under FSDP2): this rank's shards of the
    policy and AdamW, and its RNG states. The weights loaded must give the checksum saved with them
    (`param_checksum`), else the checkpoint does not load. Returns {"step", "rng", "extra", "path"}; None without
    checkpoints. A damaged one is named and the previous one tried; when none loads, an error naming each.

    [ours] Every decision is taken once for all ranks, so that no rank can walk into another checkpoint's
    collective while the others wait in this one (on a shared file system one rank's read can fail alone):
    rank 0 lists the checkpoints, checks their files and reads extra.pt, and shares what it found; each rank's
    own preparation is agreed on (all-gathered) before the collective load, and the load's outcome after it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict, set_model_state_dict,
                                                         set_state_dict)
    bad = []
    for d in agreed_checkpoints(run_dir):   # rank 0's listing and verdicts for all
        err = all_gather_obj(checkpoint_damage(d) if RANK == 0 else None)[0]
        st = None
        if err is None:                   # rank 0 reads the run's state; every rank takes it from there
            st = all_gather_obj(_read_extra(d) if RANK == 0 else None)[0]
            err, st = (st, None) if isinstance(st, str) else (None, st)
        if err is None:                   # this rank's preparation, agreed on before the collective load
            try:
                opt.state.clear()         # each try starts fresh: no state from a failed try's partial load
                others = {name: get_model_state_dict(m) for name, m in (models or {}).items()}
                state = {"model": get_model_state_dict(model), **others}
                if st.get("optim", True):
                    state["model"], state["optim"] = get_state_dict(model, opt)
                mine = None
            except Exception as e:
                mine = f"rank {RANK}: {type(e).__name__}: {' '.join(str(e).split())[:200]}"
            failed = [x for x in all_gather_obj(mine) if x]
            err = f"{d}: the ranks could not prepare its load: " + "; ".join(failed) if failed else None
        if err is None:
            try:   # dcp.load raises on every rank when one rank's read fails
                dcp.load(state, storage_reader=dcp.FileSystemReader(d), no_dist=not dist.is_initialized())
                if "optim" in state:
                    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
                else:                     # saved before the optimizer's first step: the weights alone, no state
                    set_model_state_dict(model, state["model"])
                for name, m in (models or {}).items():
                    set_model_state_dict(m, state[name])
                local = local_checksum(model)   # this rank's sums; the collective comes once all ranks agree
                mine = None
            except (Exception, dcp.CheckpointException) as e:   # the latter is a BaseException: each rank's error
                why = ({r: x for r, (x, _) in e.failures.items()} if isinstance(e, dcp.CheckpointException)
                       else {RANK: e})
                mine = "; ".join(f"rank {r}: {type(x).__name__}: {' '.join(str(x).split())[:200]}"
                                 for r, x in sorted(why.items()))
            failed = [x for x in all_gather_obj(mine) if x]   # the ranks agree: loaded everywhere, or nowhere
            err = f"{d}: does not load: " + "; ".join(dict.fromkeys(failed)) if failed else None
        if err is None and st.get("checksum") is not None:   # every rank loaded: the same verdict on every rank
            got, want = checksum_total(*local), st["checksum"]
            if not np.allclose(got, want, rtol=1e-9, atol=0.0):
                err = f"{d}: does not load: the loaded weights give the checksum {got}, the saved ones gave {want}"
        if err is None:
            set_rng_states(st["rng"], f"resume-{st['step']}")
            return {**st, "path": d}
        print0(f"checkpoint damaged, {err}; trying the previous one")
        bad.append(err)
    if bad:
        raise SystemExit("error: no checkpoint of this run loads:\n  " + "\n  ".join(bad)
                         + "\nremove them, or use --resume false to start over")
    return None
