"""A training run's plumbing, below train.py: the `Run` every section reads, set-up (ranks, seeds, tasks,
env pool, policy, engine), resuming from a checkpoint, checkpoints and the policy's saved copies,
SIGTERM handling, metrics.jsonl, and the end (final evaluation, summary, report) and teardown.
train.py holds the method; nothing here decides what a step computes."""
from __future__ import annotations

import copy
import dataclasses
import json
import os
import random
import shutil
import signal
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.distributed as dist

from harness import tiny
from harness.config import RESUME_MAY_CHANGE, changed_defaults, check_teacher_support
from harness.tiny import is_tiny
from infra import distributed as D
from harness import run_dir as run_dir_lib
from infra.distributed import (agreed_checkpoints, all_gather_obj, all_reduce, check_resume, full_state,
                               load_checkpoint, print0, save_checkpoint)
from infra.io import jsonl_lines, write_json
from envs import EnvData, env_data, make_pool
from infra.env_backends import EnvDataError
from harness.vllm_engine import VLLMEngine
from rollout import HFEngine, evaluate, load_tokenizer, paired_gain, round_robin_by_type, score_tokens
from skills import SKILL_PREFIX, SkillBank, skill_token_budget


@dataclass
class Run:
    """What every section reads or updates, built by `setup`, `build_policy` and `train.begin`."""
    args: Any                             # train.Args
    run_dir: Path
    device: torch.device
    data: EnvData
    eval_games: list[str]
    pool: Any
    model: Any = None                     # the trained policy (FSDP2-sharded when distributed)
    tok: Any = None
    engine: Any = None                    # HFEngine over the rollout copy, or VLLMEngine
    rollout_model: Any = None             # [ours] the unsharded rollout weights (π_old) of the HF engine
    opt: Any = None
    ref: Any = None                       # the frozen reference π_ref (the warm start): the KL term and the
                                          # frozen teacher
    teacher: Any = None                   # [ours] --teacher_weights ema | refresh: the teacher's own weights (fp32)
    model_path: str = ""
    task_rng: random.Random = None
    skill_rng: random.Random = None
    bank: SkillBank = None
    skill_means: dict = field(default_factory=dict)   # Eq. (5)'s running means per task type
    rows: list[dict] = field(default_factory=list)    # metrics.jsonl
    summary: dict = field(default_factory=dict)
    start: int = 0                        # the first RL step to run (a resumed run's checkpoint step)
    stepped: bool = False                 # an RL step ran in this process (final/ is rewritten only then)
    env_steps: int = 0                    # env steps spent so far, all ranks (rollouts and replays)
    skill_max_tokens: int = 0             # the skill-writing budget in tokens (build_policy)
    skill_reserve: int = 0                # prompt tokens kept free for the teacher's skill line
    episodes: dict = field(default_factory=dict)      # the latest won and lost episode, for the report
    phases: Any = field(default_factory=lambda: Timer())   # the run's phases outside the steps (sft, eval, save)
    preempt: Any = None                   # Preemption: SIGTERM → a checkpoint and exit 143
    skill_facts: Optional[Callable] = None   # [ours] (skill, task id) → what the skill gets right about its game,
                                             # or None; filled by a preset that knows the games (the tiny one)
    given_skill: Optional[Callable] = None   # [ours] task id → the skill its teacher is given (--teacher_skill:
                                             # tiny.GIVEN_SKILLS, e.g. generic, its type-level workflow)
    tool_action: Optional[Callable] = None    # [ours] (action, task type) → whether it uses the type's tool

    def stop_now(self) -> bool:           # this rank has seen SIGTERM: cut the current rollout or evaluation short
        return self.preempt is not None and self.preempt.seen

    def logprobs(self, model, pairs, temperature: float = 1.0, **keep):   # per-sample response log-probs under
        return score_tokens(model, pairs, self.tok.pad_token_id, self.device,     # `model`, no grad (`keep`: top,
                            self.args.micro_batch, self.args.micro_tokens, temperature, **keep)   # support)

    def rows_trained(self) -> bool:       # whether any RL step ran (in this process or before a resume)
        return any("train/success" in r for r in self.rows)

    def saved_models(self) -> dict:       # what a checkpoint holds besides the policy and its optimizer
        return {"teacher": self.teacher} if self.teacher is not None else {}


class Timer:
    """Wall time of named sections: `with timer("update"): ...`; `timer.times` → {"time/update": s, ...}.
    On GPU also each section's peak of the memory torch allocated, in GiB: {"mem/update": ...} (the
    largest over repeats of a section), the peak torch's caching allocator reserved over all of them
    (`mem/reserved`), and the device's memory in use at the end of each section as the driver reports it
    (`mem/device_used`, the largest; what nvidia-smi shows, vLLM's pool and NCCL's buffers included, which torch's
    allocator does not see or sees only in part: vLLM measures itself this way)."""

    def __init__(self):
        self.t0, self.times = time.time(), {}
        self.cuda = torch.cuda.is_available()

    @contextmanager
    def __call__(self, name: str):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t = time.time()
        yield
        if self.cuda:
            torch.cuda.synchronize()
            gib = torch.cuda.max_memory_allocated() / 2**30
            self.times[f"mem/{name}"] = max(self.times.get(f"mem/{name}", 0.0), gib)
            reserved = torch.cuda.max_memory_reserved() / 2**30
            self.times["mem/reserved"] = max(self.times.get("mem/reserved", 0.0), reserved)
            free, total = torch.cuda.mem_get_info()
            self.times["mem/device_used"] = max(self.times.get("mem/device_used", 0.0), (total - free) / 2**30)
        self.times[f"time/{name}"] = self.times.get(f"time/{name}", 0.0) + time.time() - t


class Sections:
    """One RL step's sections (`train.rl_step`): `with section("replay"): ...` times the section (`Timer`: its
    wall time, and its memory on a GPU) and then, where the step may still be abandoned, asks every rank whether
    one has seen SIGTERM (`Preemption.check`, a collective; `check=False` for the update and what follows it)."""

    def __init__(self, preempt: Optional["Preemption"]):
        self.timer, self.preempt = Timer(), preempt

    @contextmanager
    def __call__(self, name: str, check: bool = True):
        with self.timer(name):
            yield
        if check and self.preempt is not None:
            self.preempt.check()


class Preempted(Exception):
    """Every rank agreed to stop before this step's update: the step is abandoned."""


class Preemption:
    """[ours] SIGTERM, a scheduler's notice before it kills the job, stops the run with at most one step lost; so does
    SIGINT (Ctrl-C; a second Ctrl-C stops at once, without a checkpoint).
    The handler only records the signal (`seen`: a rank's rollouts and evaluations stop at their next turn,
    `Run.stop_now`, and the SFT after its current step); the ranks agree on it with `requested()`, a collective
    that every rank calls at the same points: each SFT step, after an evaluation, before the first step,
    between a step's sections and at its end.
    Seen before the update, the step is abandoned (`Preempted`; the loop restores the state the step began
    with, so a resumed run redoes it exactly); seen later, the step finishes. Then a checkpoint of the steps
    done is written and the run exits with 143 (128 + SIGTERM), so that the same command resumes.
    Under torchrun, SIGTERM sent to torchrun reaches the workers, and torch's elastic agent kills them
    --shutdown_timeout seconds later (30 by default): the update, the scoring and a skill-writing call are not
    cut short, so the grace period must outlast them (METHOD.md §5.3; recipes/README.md)."""

    def __init__(self):
        self.seen, self.name = False, "SIGTERM"
        self.previous = {s: signal.signal(s, self._record) for s in (signal.SIGTERM, signal.SIGINT)}   # main thread's

    def _record(self, signum, frame):
        if self.seen and signum == signal.SIGINT:   # Ctrl-C a second time: stop at once, without a checkpoint
            raise KeyboardInterrupt
        if not self.seen:
            self.name = signal.Signals(signum).name
            print(f"[rank {D.RANK}] {self.name}: the run stops at the next safe point and writes a checkpoint"
                  + (" (Ctrl-C again: at once, without one)" if signum == signal.SIGINT else ""), flush=True)
        self.seen = True

    @property
    def exit_code(self) -> int:           # 128 + the signal's number, as a shell reports it
        return 130 if self.name == "SIGINT" else 143

    def requested(self) -> bool:
        """Whether any rank has seen SIGTERM (a collective: all ranks call it at the same point)."""
        return bool(all_reduce(float(self.seen), "max")[0] > 0)

    def check(self):
        """Between the sections before the update: abandon the step when any rank has seen SIGTERM."""
        if self.requested():
            raise Preempted()

    def step(self, run: "Run", step: int, fn):
        """`fn(run, step)`, one RL step: abandoned before its update (`Preempted`), it is undone (`snapshot`) and
        the run stops with a checkpoint of the steps before it, which a resumed run redoes exactly."""
        snap = snapshot(run)
        try:
            return fn(run, step)
        except Preempted:
            restore(run, snap)
            stop_preempted(run, step)

    def phase(self, run: "Run", fn, done, cut_ok: bool = False):
        """`fn()`, a phase a SIGTERM cuts short (the start and its evaluation, an evaluation, the end): cut short, the
        run stops with a checkpoint of the `done` steps (a number, or a function giving it once the phase is cut)
        and the same command redoes the phase; `cut_ok`: its result is dropped ({}) and the run goes on to its next
        `stop_if_seen`."""
        try:
            return fn()
        except Preempted:
            if cut_ok:
                return {}
            stop_preempted(run, done() if callable(done) else done)

    def stop_if_seen(self, run: "Run", done: int):
        """At the end of the start and of each step: stop with a checkpoint of the `done` steps when any rank has
        seen SIGTERM (a collective)."""
        if self.requested():
            stop_preempted(run, done)

    def close(self):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def snapshot(run: "Run") -> dict:
    """What a step changes before its update (RNGs, the skill bank and running means, the trust-check file):
    restored when the step is abandoned, so the checkpoint holds the state of the steps done."""
    calib = run.run_dir / "calibration.jsonl"
    return {"random": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,   # the HF engine's, on a GPU
            "task_rng": run.task_rng.getstate(), "skill_rng": run.skill_rng.getstate(),
            "bank": copy.deepcopy(run.bank), "skill_means": copy.deepcopy(run.skill_means),
            "calibration_bytes": calib.stat().st_size if calib.exists() else 0}


def restore(run: "Run", snap: dict):
    random.setstate(snap["random"])
    np.random.set_state(snap["numpy"])
    torch.set_rng_state(snap["torch"])
    if snap["cuda"] is not None:
        torch.cuda.set_rng_state(snap["cuda"])
    run.task_rng.setstate(snap["task_rng"])
    run.skill_rng.setstate(snap["skill_rng"])
    run.bank, run.skill_means = snap["bank"], snap["skill_means"]
    calib = run.run_dir / "calibration.jsonl"
    if D.RANK == 0 and calib.exists():
        with open(calib, "r+b") as f:
            f.truncate(snap["calibration_bytes"])


def stop_preempted(run: "Run", done: int):
    """Write the checkpoint after `done` steps (unless the newest one is that) and exit with 143 (SIGTERM) or 130
    (SIGINT, Ctrl-C)."""
    newest = agreed_checkpoints(run.run_dir)   # rank 0's listing: every rank saves, or none
    if not newest or int(newest[0].name[5:]) != done:
        save(run, done)
    print0(f"preempted ({run.preempt.name}): checkpoint of step {done} written; the same command resumes from it")
    raise SystemExit(run.preempt.exit_code)


def save(run: "Run", done: int):
    """The run's checkpoint after `done` RL steps (a collective), and the skill bank beside it."""
    t0 = time.time()
    with run.phases("save"):
        save_checkpoint(run.run_dir, run.model, run.opt, done, run.args,
                        {"summary": {k: v for k, v in run.summary.items() if k != "config"},
                         "skill_means": run.skill_means, "bank": run.bank.to_dict(),
                         "skill_rng": all_gather_obj(run.skill_rng.getstate())}, run.saved_models())
    if D.RANK == 0 and run.args.algo == "rsipo":
        run.bank.save(run.run_dir / "skill_bank.json")
    run.summary["time/last_save"] = time.time() - t0


# [ours] The sections a SIGTERM cannot cut short (Preemption): after the last check a step still runs its update and
# weight sync; a signal seen just before a check may wait for one whole scoring or skill-writing section; then the
# checkpoint is written.
UNCUT = (("time/skills",), ("time/score",), ("time/update", "time/sync"))


def grace_needed(row: dict, save_s: float) -> float:
    """The longest a run can take from a SIGTERM to its exit after this step: its longest section that no signal
    cuts short, then a checkpoint's save (`save_s`). torchrun's --shutdown_timeout must exceed it."""
    return max(sum(row.get(k, 0.0) for k in keys) for keys in UNCUT) + save_s


def watch_step(run: "Run", row: dict):
    """[ours] After each step: the grace a SIGTERM needs (`grace/needed_s`, the largest so far, said once when it
    first grows past what torchrun gives by default) and, on a GPU, the device memory in use (`mem/device_used`)
    against the first 5 steps' (a warning each time it passes 110% of them: memory that creeps up ends in an OOM
    tens of steps later)."""
    s = run.summary
    need = grace_needed(row, s.get("time/last_save", 0.0))
    if need > s.get("grace/needed_s", 0.0):
        if s.get("grace/needed_s", 0.0) <= 30 < need:
            print0(f"note: a SIGTERM may now need {need:.0f} s to end in a checkpoint (the longest uncut section, "
                   "then a save): under torchrun give --shutdown_timeout above that, and the scheduler's signal "
                   "more lead (recipes/README.md, the grace period)")
        s["grace/needed_s"] = need
    if "mem/device_used" in row:          # the driver's figure: vLLM's pool and NCCL's buffers included
        first = s.setdefault("mem/first_steps", [])
        if len(first) < 5:
            first.append(row["mem/device_used"])
        elif row["mem/device_used"] > 1.1 * max(first):
            print0(f"warning: GPU memory in use {row['mem/device_used']:.1f} GiB at step {row['step']} is more than "
                   f"10% above the first 5 steps' {max(first):.1f} GiB")
            s["mem/growth_warnings"] = s.get("mem/growth_warnings", 0) + 1


def progress(msg: str):   # a line above the progress bar (rank 0)
    if D.RANK == 0:
        from tqdm import tqdm
        tqdm.write(msg)


def log_row(run: "Run", row: dict):
    run.rows.append(row)
    if D.RANK == 0:
        with open(run.run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        if run.args.wandb:
            import wandb
            if wandb.run is None:
                wandb.init(project="rsipo", name=run.args.run_name, config=dataclasses.asdict(run.args))
            wandb.log(row, step=row["step"])


def resolve_model(args) -> str:
    """--model as a path or hub name: 'tiny' stays (built from a config), a preset of tiny.MODELS
    ('smollm2') becomes its converted folder in --cache_dir (rank 0 converts, the others wait). A name that can
    only be a path (it starts with / . ~ or has more than one /) must exist, and a folder must hold a Hugging Face
    model (config.json): else an error that says so, not a hub lookup or a tokenizer's traceback."""
    path = Path(args.model)
    if args.model.startswith(("/", ".", "~")) or args.model.count("/") > 1 or path.exists():
        if not path.exists():
            raise SystemExit(f"error: --model {args.model}: no such file or folder (a hub name is org/name, e.g. "
                             "Qwen/Qwen2.5-7B-Instruct)")
        if not (path / "config.json").exists():
            raise SystemExit(f"error: --model {args.model}: not a Hugging Face model folder (no config.json): give "
                             "the folder that holds config.json and the weights (a run's warm_start/ or final/)")
    if args.model not in tiny.MODELS:
        return args.model
    convert = tiny.MODELS[args.model]
    if D.RANK == 0:
        convert(args.cache_dir)
    D.barrier()
    return convert(args.cache_dir)


def load_model_and_tokenizer(args, run_dir: Path, texts_fn, model_path: str = "", device="cpu"):
    """tiny: the run's tokenizer (trained on `texts_fn()` the first time) and a model from a config;
    else the checkpoint's tokenizer and weights (`model_path`: `resolve_model(args)`), sharded on `device`
    as they load when there is a process group (`distributed.load_sharded`)."""
    from transformers import AutoModelForCausalLM
    if args.model == "tiny":
        tok_dir = run_dir / "tokenizer"
        if (tok_dir / "tokenizer.json").exists():
            tok = load_tokenizer(str(tok_dir))
        else:
            specials = tiny.SEARCH_SPECIALS if args.env == "search" else ()
            tok = tiny.train_tiny_tokenizer(texts_fn(), specials)
            if D.RANK == 0:
                tok.save_pretrained(tok_dir)
        torch.manual_seed(args.seed)
        model = tiny.tiny_model(len(tok), args)
    else:
        tok = load_tokenizer(model_path or args.model)
        # fp32 master weights on every path: AdamW at lr 1e-6 changed ~2% of bf16 weights a step (the
        # rest rounded away); bf16 compute is FSDP2's mixed precision (`shard`, `compute_dtype`). Under a
        # process group the model is sharded as it loads (only rank 0 reads it whole, into host memory).
        if dist.is_initialized():
            model = D.load_sharded(model_path or args.model, torch.float32, device, compute_dtype(args), args.grad_ckpt)
        else:
            model = AutoModelForCausalLM.from_pretrained(model_path or args.model, dtype=torch.float32)
    return model, tok


def compute_dtype(args) -> torch.dtype:
    """--dtype: auto is bf16 on GPU, fp32 on CPU."""
    if args.dtype == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]


def too_few_cores(cores: Optional[int], local_ranks: int, env_workers: int) -> Optional[str]:
    """[ours] Why this process's cores are too few for its host's ranks, or None: each rank runs a trainer, a sampler
    and its env workers, so a GPU host wants local ranks × (2 + --env_workers) cores."""
    want = local_ranks * (2 + env_workers)
    if cores is None or cores >= want:
        return None
    return (f"this process may run on {cores} core(s), and its host's {local_ranks} rank(s) each run a trainer, a "
            f"sampler and {env_workers} env workers ({want} wanted). Under SLURM (22.05 and later) srun does not pass "
            "--cpus-per-task on to its tasks: give srun --cpus-per-task, or export "
            "SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK (recipes/README.md)")


def claim_run_dir(run_dir: Path, args):
    """[ours] The run's folder, for this run alone (harness/run_dir.py; rank 0 decides, every rank stops on its
    verdict before any compute): made (a read-only --out_dir is said so), locked against a second run, and, under
    --resume false, refused where it holds a run unless --overwrite, which clears it."""
    why = None
    if D.RANK == 0:
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            why = run_dir_lib.claim(run_dir)
        except OSError as e:
            why = (f"error: --out_dir {args.out_dir}: cannot write the run folder {run_dir} ({e.strerror}): give "
                   "--out_dir a folder this user may write to")
        held = run_dir_lib.holds_a_run(run_dir) if not why and not args.resume else []
        if held and not args.overwrite:
            why = (f"error: --resume false on {run_dir}, which holds a run ({', '.join(held)}): it would be "
                   "overwritten. Give --overwrite true to start it over (its files are deleted), drop --resume "
                   "false to resume it, or use another --run_name")
        elif held:
            run_dir_lib.clear(run_dir)
            print0(f"--overwrite: cleared {run_dir} ({', '.join(held)}); the run starts over")
        if why and (run_dir / run_dir_lib.LOCK).exists():
            run_dir_lib.release(run_dir)
    why = all_gather_obj(why)[0]
    if why:
        raise SystemExit(why)


def setup(args) -> "Run":
    """Ranks, seeds, the tasks and the env pool; refuses a checkpoint of other core flags before any compute.
    A real model on a machine whose NVIDIA GPU torch cannot see is said plainly (it would run on the CPU)."""
    D.setup(args.dist_timeout)
    if not torch.cuda.is_available() and D.nvidia_driver() is not None and not is_tiny(args.model):
        print0(f"warning: an NVIDIA driver is loaded but torch sees no GPU, so this runs on the CPU: "
               f"{D.why_no_gpu()}")
    torch.set_num_threads(D.cpu_threads(D.local_world()))   # the cores of this host, shared by its ranks
    if torch.cuda.is_available():
        few = too_few_cores(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
                            D.local_world(), args.env_workers)
        if few:
            print0(f"warning: {few}")
    D.seed_rank(args.seed)
    run_dir = Path(args.out_dir) / args.run_name
    claim_run_dir(run_dir, args)
    try:
        return open_run(args, run_dir)
    except BaseException:                 # refused or failed: the folder is free again
        if D.RANK == 0:
            run_dir_lib.release(run_dir)
        raise


def open_run(args, run_dir: Path) -> "Run":
    """`setup`'s part once the folder is this run's: the flags checked against the run's own, the tasks, then the
    env pool, the last thing, so that every refusal comes before a worker starts."""
    if args.resume:                       # every flag but RESUME_MAY_CHANGE as the run was written with
        check_resume(run_dir, args, RESUME_MAY_CHANGE, fallback=run_dir / "config.json")
    if args.tasks_per_step < D.WORLD:
        raise SystemExit(f"error: --tasks_per_step {args.tasks_per_step} must be >= the number of ranks ({D.WORLD})")
    if args.engine == "vllm" and not dist.is_initialized():
        raise SystemExit("error: --engine vllm needs a GPU process group (torchrun, or one CUDA GPU)")
    try:                                  # bad data: its message (file, line, what was found), not a traceback
        data = env_data(args, None if args.task_types == "all" else args.task_types.split(","))
        if args.sft_hold_out and args.sft_hold_out not in data.train_types:   # refused before any worker starts
            raise SystemExit(f"error: --sft_hold_out {args.sft_hold_out}: the {args.train_split} split of "
                             f"{args.data_root} has no game of that type (it has "
                             f"{', '.join(sorted(set(data.train_types)))}), so RL could not find its procedure")
        bank = initial_bank(args, data)   # a bank file that does not parse: refused before any worker starts
        given = given_skills(args, data)
        pool = make_pool(args, data)
    except EnvDataError as e:
        raise SystemExit(f"error: {e}") from None
    eval_games = round_robin_by_type(data.eval, data.task_type)[:args.eval_games] if args.eval_games else data.eval
    device = torch.device(f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu")
    print0(f"RSIPO trainer | algo={args.algo} model={args.model} world={D.WORLD} device={device} train tasks="
           f"{len(data.train)} eval tasks={len(eval_games)} constrained={args.constrained}")
    print0("flags not at Args' default (--help lists them all):\n"
           + "\n".join(f"  {c}" for c in changed_defaults(args)))
    return Run(args, run_dir, device, data, eval_games, pool, summary={"config": dataclasses.asdict(args)},
               task_rng=random.Random(args.seed * 7919 + 1), skill_rng=random.Random(args.seed * 104729 + D.RANK),
               bank=bank,
               skill_facts=tiny.skill_facts_of_game if args.env == "alfworld" else None,
               given_skill=given,
               tool_action=tiny.tool_action if args.env == "alfworld" else None)


def initial_bank(args, data: EnvData) -> SkillBank:
    """The skill bank a fresh run starts with: empty, or --skill_bank's file (its capacity). Refused before any
    rollout: a file that does not parse (named, with what is wrong), and --bank_teacher where a training task has
    no type (the bank is kept, and its skills reach tasks, by type)."""
    untyped = [t for t in data.train if not data.task_type.get(t)]
    if args.bank_teacher and untyped:
        raise SystemExit(f"error: --bank_teacher: {len(untyped)} training tasks have no task type (e.g. {untyped[0]});"
                         " the bank keeps skills by type and teaches a task those of its own type")
    if not args.skill_bank:
        return SkillBank(args.bank_capacity)
    try:
        return SkillBank.load(args.skill_bank)
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: --skill_bank {e}") from None


def checkpoint_bytes(n_params: int, args) -> int:
    """[ours] One checkpoint's size: fp32 weights and AdamW's two moments (12 bytes a parameter), and the fp32 weights
    of an ema or refresh teacher (4 more). 7B: about 91 GB; a run holds at most two (the fallback and the newest)."""
    return n_params * (12 + 4 * (args.teacher_weights in ("ema", "refresh")))


def disk_need(n_params: int, args) -> dict[str, int]:
    """[ours] What a run keeps in --out_dir at its peak, in bytes: two checkpoints (the newest and its fallback, from
    the second save on), final/ and, when the run trains its own warm start, warm_start/ (fp32 Hugging Face copies,
    4 bytes a parameter; a warm start alone, --steps 0, writes warm_start/ and links final/ to it)."""
    weights = 4 * n_params
    sft = bool(args.sft_steps and (args.sft_data or args.model == "tiny"))   # as train.warm_start decides
    if not args.steps:
        return {"warm_start/": weights} if sft else {}
    need = {"two checkpoints": 2 * checkpoint_bytes(n_params, args) if args.save_every else 0, "final/": weights}
    return {**need, "warm_start/": weights} if sft else need


QUOTA_HINT = ("free space as the file system reports it; a user or group quota (Lustre, GPFS, NFS) is not seen: "
              "check it yourself (Lustre: lfs quota -u $USER <mount>)")


def check_disk(run: "Run"):
    """Refuse to start a run whose --out_dir has less free space than the run will keep there at its peak
    (`disk_need`; rank 0 looks, every rank stops): a full disk found at a save loses the steps before it. Quotas
    are not seen (`QUOTA_HINT`). --check_disk false skips this."""
    a = run.args
    if not a.check_disk:
        return
    n = sum(p.numel() for p in run.model.parameters())        # a DTensor counts its whole parameter
    parts = disk_need(n, a)
    need = sum(parts.values())
    free = shutil.disk_usage(run.run_dir).free if D.RANK == 0 else 0
    why = None
    if D.RANK == 0 and free < need:
        what = ", ".join(f"{k} {v / 1e9:.2f} GB" for k, v in parts.items() if v)
        why = (f"error: --out_dir {a.out_dir} has {free / 1e9:.2f} GB free, and this run needs {need / 1e9:.2f} GB "
               f"there at its peak ({what}; {n / 1e9:.3f} B parameters, a checkpoint "
               f"{checkpoint_bytes(n, a) // n} bytes each: fp32 weights, AdamW's two moments"
               + (", the teacher's weights" if checkpoint_bytes(n, a) // n > 12 else "") + "): point --out_dir at "
               "scratch space (recipes/README.md: the disk budget), or --check_disk false. The figure is the "
               + QUOTA_HINT)
    why = all_gather_obj(why)[0]
    if why:
        raise SystemExit(why)


def given_skills(args, data: EnvData) -> Optional[Callable]:
    """[ours] --teacher_skill generic | wrong | oracle | wrong_place: task id → the skill its teacher is given
    (`tiny`), after a check that every training task has one (a teacher without its skill would train on nothing,
    silently)."""
    if args.env != "alfworld":
        return None
    given = tiny.GIVEN_SKILLS
    if args.teacher_skill in given:
        missing = [t for t in data.train if given[args.teacher_skill](t) is None]
        if missing:
            kinds = sorted({data.task_type[t] for t in missing})
            raise SystemExit(
                f"error: --teacher_skill {args.teacher_skill}: no skill for {len(missing)} of the {len(data.train)} "
                f"training tasks (types {', '.join(kinds)}; e.g. {missing[0]}). generic needs the walkthrough.json "
                "that scripts/alfworld_gen.py writes beside each game (so do oracle and wrong_place); wrong swaps the "
                "tool of clean, heat and cool and has none for the other types: add --task_types clean,heat,cool")
    return given.get(args.teacher_skill, tiny.generic_skill_of_game)


def build_policy(run: "Run"):
    """The policy and its tokenizer, the rollout engine, and the resolved config (printed and saved)."""
    a = run.args
    run.model_path = resolve_model(a)
    run.model, run.tok = load_model_and_tokenizer(
        a, run.run_dir, lambda: tiny.tokenizer_texts(a, run.data, run.pool), run.model_path, run.device)
    check_teacher_support(a, run.model.config.vocab_size)
    check_disk(run)
    # [ours] the skill-writing budget: --skill_max_tokens, or room for the longest skill parse_skill accepts
    run.skill_max_tokens = a.skill_max_tokens or skill_token_budget(
        lambda t: run.tok.encode(t, add_special_tokens=False), a.skill_max_words)
    if not a.skill_max_tokens:
        print0(f"skill-writing budget: {run.skill_max_tokens} tokens (from the tokenizer, skill_token_budget)")
    print0("config (resolved; also in config.json):\n" + "\n".join(
        "  " + "  ".join(f"--{k} {v}" for k, v in chunk) for chunk in _chunks(list(dataclasses.asdict(a).items()), 6)))
    if D.RANK == 0:
        write_json(run.run_dir / "config.json", dataclasses.asdict(a))
    from torch.distributed.fsdp import FSDPModule
    sharded = isinstance(run.model, FSDPModule)   # a real model under a process group: sharded as it loaded
    if a.grad_ckpt and not sharded:       # recompute each decoder block in backward (non-reentrant: fine under FSDP2)
        run.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if not sharded:
        run.model.to(run.device)
    kw = dict(max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_p=a.top_p,
              max_prompt_tokens=a.max_prompt_tokens, stop_texts=list(run.pool.stop_texts))
    if a.engine == "vllm" and not (a.steps or a.eval):   # [ours] a warm start alone (stage 1): nothing to sample
        run.engine = None
    elif a.engine == "vllm":              # [ours] no rollout copy: vLLM samples, the FSDP2 policy scores π_old
        max_model_len = a.max_prompt_tokens + max(a.max_new_tokens, run.skill_max_tokens)
        run.engine = VLLMEngine(run.model_path, run.tok, max_model_len=max_model_len,
                                seed=a.seed + D.RANK, gpu_memory_utilization=a.gpu_memory_utilization,
                                sleep_level=a.vllm_sleep_level, **kw)
    else:
        # parameters in the compute dtype (bf16 on a GPU), buffers exactly the policy's (rotary frequencies
        # in fp32); a sharded policy is copied one gathered tensor at a time
        run.rollout_model = D.rollout_copy(run.model, torch.bfloat16 if run.device.type == "cuda" else torch.float32,
                                           run.device)
        for p in run.rollout_model.parameters():
            p.requires_grad_(False)
        run.engine = HFEngine(run.rollout_model, run.tok, **kw)
    # student prompts of opsd/rsipo leave room for the skill line the teacher inserts later
    run.skill_reserve = 0 if not a.uses_skills or run.engine is None else \
        run.engine.prompt_len(SKILL_PREFIX + "[]") + run.skill_max_tokens


def _chunks(xs: list, n: int):
    return [xs[i:i + n] for i in range(0, len(xs), n)]


def save_policy(run: "Run", path: Path, rng: Optional[list] = None):
    """A Hugging Face checkpoint of the policy: the only full-state copy (rank 0 writes; a collective). Written
    to <path>.tmp and renamed to `path` (a link there, e.g. final/ → warm_start/, is replaced, not written through),
    so a crash leaves a complete copy or none. `rng`: every rank's generator states, kept beside it as rng.pt."""
    tmp = path.with_name(path.name + ".tmp")
    if D.RANK == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    if run.rollout_model is not None:
        if D.RANK == 0:
            run.rollout_model.save_pretrained(tmp)
    else:
        sd = full_state(run.model, rank0_only=True)
        if D.RANK == 0:
            run.model.save_pretrained(tmp, state_dict=sd)
    if D.RANK == 0:
        run.tok.save_pretrained(tmp)
        if rng is not None:
            torch.save(rng, tmp / "rng.pt")
        if path.is_symlink() or path.is_file():
            path.unlink()
        elif path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    D.barrier()


def load_policy(run: "Run", path: Path) -> bool:
    """The policy's weights from a Hugging Face folder `save_policy` wrote (rank 0 reads it; under FSDP2 its tensors
    are broadcast into every rank's shards), and every rank's generator states from its rng.pt. Returns whether
    the states were there (without them the run goes on with the streams it has)."""
    from transformers import AutoModelForCausalLM
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    full = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict() if D.RANK == 0 else {}
    if dist.is_initialized():
        set_model_state_dict(run.model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    else:
        run.model.load_state_dict(full)
    rng = path / "rng.pt"
    if rng.exists():
        D.set_rng_states(torch.load(rng, weights_only=False), "warm-start")
    return rng.exists()


def finish(run: "Run"):
    """The final evaluation (when --eval), then, always: final/, summary.json, curves.png, the skill bank,
    episodes.json and report.html."""
    a, s = run.args, run.summary
    if a.eval and a.steps == 0 and "eval_at_start/by_game" in s:   # no RL step: the start's evaluation is the end's
        ev = {k.replace("eval_at_start/", "eval/"): v for k, v in s.items()
              if k.startswith("eval_at_start/") and k != "eval_at_start/by_game"}
        s.update(ev, **{"eval/by_game": s["eval_at_start/by_game"]})
    elif a.eval:
        ev, s["eval/by_game"] = evaluate_and_print(run, "eval", "after RL")
        s.update(ev)
        if "eval_at_start/by_game" in s:
            g, se, n = paired_gain(s["eval_at_start/by_game"], s["eval/by_game"])
            s.update({"eval/gain": g, "eval/gain_se": se, "eval/gain_games": n})
            print0(f"held-out gain, paired over {n} tasks: {100 * g:+.1f} ± {100 * se:.1f} points (1 s.e.)")
        log_row(run, {"step": run.rows[-1]["step"] if run.rows else 0, **ev})
    final, warm = run.run_dir / "final", run.run_dir / "warm_start"
    if not run.rows_trained() and (warm / "config.json").exists():   # no RL step: the warm start is the final policy
        if D.RANK == 0 and not final.exists():          # written once (7B: 30 GB), linked under the second name
            os.symlink("warm_start", final)
        D.barrier()
    elif not run.rows_trained():                        # an evaluation of --model: no weight changed
        print0(f"final/ not written: no step changed the weights of --model {a.model}")
    elif run.stepped or not (final / "config.json").exists():   # not again for a resume that only evaluates
        with run.phases("save_policy"):
            save_policy(run, final)
    s.update({f"phase/{k}": v for k, v in run.phases.times.items()})   # this process's sft, eval, save: time, memory
    if D.RANK == 0 and a.calibrate:       # the trust check over the whole run (METHOD.md §5.7)
        from harness import report
        rows, _ = report.read_calibration(run.run_dir / "calibration.jsonl")
        for mode, t in report.calibration_table(rows).items() if rows else ():
            s.update({f"calib/brier_{mode}": t["brier"], "calib/base_brier": t["base_brier"], "calib/tasks": t["n"]})
            print0(f"trust check, {mode}: Brier {t['brier']:.4f} over {t['n']} skills "
                   f"(base rate {t['base_brier']:.4f})")
    if D.RANK == 0:                       # one writer, atomic files
        write_json(run.run_dir / "summary.json", s)
        write_json(run.run_dir / "episodes.json", {"won": run.episodes.get("won"), "lost": run.episodes.get("lost")})
        if a.algo == "rsipo":
            run.bank.save(run.run_dir / "skill_bank.json")
            print0(f"skill bank ({len(run.bank)} skills), a few of them:\n{run.bank.summary(2)}")
        from harness import report
        print0(f"report: {report.write_report(run.run_dir)}")
        curves = run.run_dir / "report" / "curves.png"      # the report's learning curves, also at the top level
        if curves.exists():
            shutil.copyfile(curves, run.run_dir / "curves.png")
    print0(f"summary: success at start {s.get('eval/success_at_start')} → end {s.get('eval/success')} "
           f"| {run.run_dir / 'summary.json'}")
    D.barrier()                           # every rank done before any tears down (gloo aborts a rank left behind)
    if run.stepped and not s.get("env/ok_episodes"):   # a run that played no episode to its end: not a success
        raise SystemExit(f"error: every episode of this run ended in an env error (the first: "
                         f"{s.get('env/first_error')}): the environment is broken (its data, the env workers, the "
                         "retriever), and nothing was learned")


def teardown(run: Optional["Run"]):
    """vLLM first (its shutdown destroys its process groups and torch's default one), then the env pool and
    the process group."""
    try:
        if run is not None and getattr(run.engine, "close", None):
            run.engine.close()
    finally:
        if run is not None:               # preempted: no time to wait for the env workers to stop on their own
            run.pool.close(timeout=0.1 if run.stop_now() else 5.0)
            if D.RANK == 0:
                run_dir_lib.release(run.run_dir)
        if dist.is_initialized():
            dist.destroy_process_group()


def evaluate_and_print(run: "Run", phase: str, when: str) -> tuple[dict, dict]:
    """Held-out evaluation as the `phase` of the run's timer (rollout.evaluate), and one line saying it. A SIGTERM
    cuts it short on the rank that saw it; then every rank raises `Preempted` (a collective decides)."""
    a, t0 = run.args, time.time()
    with run.phases(phase):
        ev, by_game = evaluate(run.engine, run.pool, run.eval_games, repeats=a.eval_repeats, seed=a.seed,
                               history_len=a.history_len, temperature=a.eval_temperature, constrained=a.constrained,
                               source_of={i: r["data_source"] for i, r in run.data.records.items()} or None,
                               stop=run.stop_now)
    if run.preempt is not None and run.preempt.requested():   # cut short on some rank: the figures mean nothing
        raise Preempted()
    print0(f"eval {when}: success {ev['eval/success']:.3f} on {ev['eval/episodes']} episodes "
           f"({len(run.eval_games)} tasks x {a.eval_repeats}, {time.time() - t0:.0f}s)"
           + (f"; mean over data sources {ev['eval/success_source_mean']:.3f}"
              if "eval/success_source_mean" in ev else ""))
    return ev, by_game


def resume(run: "Run") -> bool:
    """Load the newest checkpoint into the policy and optimizer, with the run's state saved beside it (step,
    skill bank and running means, RNG, metrics rows up to that step, env steps spent). False: none to load."""
    a = run.args
    state = load_checkpoint(run.run_dir, run.model, run.opt, run.saved_models()) \
        if a.resume and agreed_checkpoints(run.run_dir) else None
    if state is None:
        return False
    ex = state["extra"]
    run.start, run.skill_means = state["step"], ex.get("skill_means", {})
    run.summary.update(ex.get("summary", {}))
    if ex.get("bank"):
        run.bank = SkillBank.from_dict(ex["bank"])
    if ex.get("skill_rng"):
        if D.RANK < len(ex["skill_rng"]):
            run.skill_rng.setstate(ex["skill_rng"][D.RANK])
        else:                             # a rank the saved run did not have draws a stream of its own
            run.skill_rng = random.Random(f"{a.seed}-skills-{run.start}-{D.RANK}")
    path = run.run_dir / "metrics.jsonl"
    rows = [r for _, r in jsonl_lines(path) if isinstance(r, dict)] if path.exists() else []
    run.rows = [r for r in rows if r.get("step", 0) <= run.start]
    if D.RANK == 0 and len(run.rows) < len(rows):   # rows of steps after the checkpoint (lost to a kill): cut
        run_dir_lib.cut_rows(path, run.start)
    run.env_steps = next((r["train/env_steps_total"] for r in reversed(run.rows) if "train/env_steps_total" in r), 0)
    print0(f"resumed from {state['path']} at step {run.start}" + (" (weights match the checksum saved with them)"
                                                                   if state.get("checksum") else ""))
    return True
