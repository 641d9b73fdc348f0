"""Memory plan: the GPU memory one rank of `train.py` needs, per term, for a model and the flags; its table for
Qwen2.5-1.5B / 3B / 7B on 8 × 80 GB GPUs; and its check against peaks measured on the CPU.

    python scripts/memory_plan.py                        # the table (recipes/README.md), defaults vs the old flags
    python scripts/memory_plan.py --measure --out results/memory_plan.json   # estimate vs measured, CPU

The terms (bytes; P parameters, W ranks, c the compute dtype's bytes, 2 for bf16 and 4 for fp32):
* **Trainer state**, FSDP2-sharded: fp32 master weights 4P/W, fp32 gradients 4P/W, AdamW's two moments 8P/W.
* **Reference** (the KL term): bf16, sharded, 2P/W.
* **Teacher** (`--teacher_weights ema | refresh`): its own fp32 weights, sharded like the policy, 4P/W, in both
  phases (live uses π_old's weights, frozen the reference's: nothing more).
* **Gathered weights** while the policy computes: the root module's parameters (embedding, LM head, final
  norm), which FSDP2 keeps gathered through forward and backward, in c bytes, and their unsharded gradients
  before the root's reduce-scatter at the end of backward (c bytes to hold, 4 to reduce in fp32: at 7B, with
  its untied 152k × 3584 embedding and head, 6.1 GiB), and two decoder blocks at a time (the one computing
  and the one prefetched) plus one block's gradients before their reduce-scatter (c + 4 bytes likewise).
* **Activations** of one micro-batch of T tokens (`--micro_tokens`), per token and block, what autograd
  keeps for backward in a Qwen2 / Llama block (HF's code, SDPA attention): the two RMSNorms' fp32 inputs
  and their normalised and weighted outputs (2·(4d + 2cd)), the rotated query and key and the value that
  SDPA keeps (c(d + 2d_kv)), the attention output and its reshaped copy (2cd), and the MLP's gate, up,
  activation and product (4cf). With `--grad_ckpt`, only each block's input (cd) is kept, and one block's
  activations are rebuilt at a time in backward.
* **Logits** at the response positions only (`rollout.token_logprobs_of`): per position and vocabulary
  entry, the logits (c), their fp32 copy (4 when c = 2), the log-softmax, its exp and one product or
  gradient of the same shape (4 + 4 + 4 + 4). A micro-batch of T tokens holds floor(T / (p + r))
  sequences of p prompt and r response tokens (at least one), so that many times r positions.
* **vLLM** (`--engine vllm`): `--gpu_memory_utilization` of the GPU while it generates; asleep during the
  update (`--vllm_sleep_level` 2, the default: weights discarded, KV cache freed; level 1 would offload the
  weights to pinned host memory), where a residual of `vllm_asleep_gib` (CUDA graphs, allocator pools) is
  assumed **[ours]**. With the HF engine, the bf16 rollout copy instead, 2P, always.

The peak is the larger of the rollout phase (trainer state, reference, teacher, vLLM's share) and the update
phase (trainer state, reference, teacher, vLLM asleep, gathered weights, activations, logits). Not counted: the CUDA
context (~0.5 GiB), fragmentation of the caching allocator, NCCL buffers.

`--measure` checks the parts a CPU can measure: the peak host memory of one update micro-batch (forward and
backward, fp32, one process: gradients 4P, activations, logits) of SmolLM2-135M and of a 1-block Qwen2 with
Qwen's 151,936-row vocabulary, in a fresh process each (scripts/bench_memory.py's `update response`
measurement), with and without activation checkpointing, against `estimate(...)`'s same terms. glibc's
mmap threshold is fixed at 128 KiB for the measurement (`MALLOC_MMAP_THRESHOLD_`), so that freed tensors
leave the resident set: with its default, which grows, the checkpointed run's churn of recomputed blocks
stays resident (SmolLM2: 3.6 GiB resident against 1.3 GiB with the fixed threshold).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GIB = 2 ** 30
TABLE_SIZES = ("1.5B", "3B", "7B")   # the sizes the recipes train

# Qwen2.5-Instruct configs (config.json of the released checkpoints)
QWEN25 = {
    "0.5B": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
    "1.5B": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True),
    "3B": dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
               num_attention_heads=16, num_key_value_heads=2, tie_word_embeddings=True),
    "7B": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
               num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False),
}


def param_counts(cfg: dict) -> tuple[int, int, int]:
    """(all parameters, one decoder block's, the root's: embedding, untied LM head, final norm) of a Qwen2."""
    d, f, V, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    d_kv = cfg["num_key_value_heads"] * d // cfg["num_attention_heads"]
    block = (d * d + d) + 2 * (d * d_kv + d_kv) + d * d + 3 * d * f + 2 * d   # q (bias), k, v (bias), o, MLP, 2 norms
    root = V * d * (1 if cfg.get("tie_word_embeddings") else 2) + d
    return L * block + root, block, root


def act_bytes_per_token(cfg: dict, c: int, grad_ckpt: bool) -> tuple[float, float]:
    """(bytes kept per token for all blocks, bytes of one block's activations per token) in a forward with
    backward to come; with grad_ckpt the first is the blocks' inputs only."""
    d, f = cfg["hidden_size"], cfg["intermediate_size"]
    d_kv = cfg["num_key_value_heads"] * d // cfg["num_attention_heads"]
    one = 2 * (4 * d + 2 * c * d) + c * (d + 2 * d_kv) + 2 * c * d + 4 * c * f
    L = cfg["num_hidden_layers"]
    return (L * c * d if grad_ckpt else L * one), one


def logit_bytes_per_entry(c: int) -> int:
    return c + (4 if c != 4 else 0) + 16


def estimate(cfg: dict, *, world: int = 8, gpu_gib: float = 80.0, micro_tokens: int = 8192, prompt: int = 1536,
             response: int = 512, grad_ckpt: bool = True, c: int = 2, engine: str = "vllm",
             gpu_memory_utilization: float = 0.35, vllm_asleep_gib: float = 2.0, reference: bool = True,
             teacher: str = "live") -> dict:
    """Per-rank GPU memory in GiB, term by term (module docstring). `micro_tokens` 0 means the trainer's
    count-based micro-batches: give the token count they hold (micro_batch × (prompt + response)) instead."""
    P, block, root = param_counts(cfg)
    seq = prompt + response
    n_seq = max(1, micro_tokens // seq)
    T = n_seq * seq
    keep, one_block = act_bytes_per_token(cfg, c, grad_ckpt)
    t = {
        "trainer_state": 16 * P / world,
        "reference": 2 * P / world if reference else 0.0,
        "teacher": 4 * P / world if teacher in ("ema", "refresh") else 0.0,
        "gathered_weights": c * root + (c + 4) * root + 2 * c * block + (c + 4) * block,
        "activations": T * keep + (T * one_block if grad_ckpt else 0.0),
        "logits": n_seq * response * cfg["vocab_size"] * logit_bytes_per_entry(c),
    }
    t = {k: v / GIB for k, v in t.items()}
    if engine == "vllm":
        t["vllm_awake"], t["vllm_asleep"] = gpu_memory_utilization * gpu_gib, vllm_asleep_gib
    else:
        t["vllm_awake"] = t["vllm_asleep"] = 2 * P / GIB   # the HF engine's bf16 rollout copy
    base = t["trainer_state"] + t["reference"] + t["teacher"]
    t["rollout_phase"] = base + t["vllm_awake"]
    t["update_phase"] = base + t["vllm_asleep"] + t["gathered_weights"] + t["activations"] + t["logits"]
    t["peak"] = max(t["rollout_phase"], t["update_phase"])
    t["fits"] = t["peak"] <= gpu_gib
    t["micro_batch_sequences"], t["micro_batch_tokens"], t["params_b"] = n_seq, T, P / 1e9
    return t


def table(world: int = 8, gpu_gib: float = 80.0) -> str:
    """Markdown table: each Qwen2.5 size under the GPU defaults and under the flags they replaced."""
    from harness import config
    d = config.GPU
    rows = ["| model | flags | weights+grads+Adam | reference | teacher | gathered | activations | logits "
            "| vLLM awake / asleep | rollout phase | update phase | fits 80 GB |", "|" + "---|" * 12]
    gpu = dict(micro_tokens=d["micro_tokens"], grad_ckpt=d["grad_ckpt"])
    for name in TABLE_SIZES:
        cfg = QWEN25[name]
        for label, kw in ((f"defaults (`--micro_tokens {d['micro_tokens']} --grad_ckpt {str(d['grad_ckpt']).lower()}`)",
                           gpu),
                          ("defaults, `--teacher_weights ema`", dict(gpu, teacher="ema")),
                          ("`--micro_batch 32`, no checkpointing", dict(micro_tokens=32 * 2048, grad_ckpt=False))):
            e = estimate(cfg, world=world, gpu_gib=gpu_gib, **kw)
            rows.append(f"| {name} | {label} | {e['trainer_state']:.1f} | {e['reference']:.1f} | {e['teacher']:.1f} "
                        f"| {e['gathered_weights']:.1f} "
                        f"| {e['activations']:.1f} | {e['logits']:.1f} "
                        f"| {e['vllm_awake']:.0f} / {e['vllm_asleep']:.0f} "
                        f"| {e['rollout_phase']:.1f} | {e['update_phase']:.1f} | {'yes' if e['fits'] else '**no**'} |")
    return "\n".join(rows)


def measure(cache_dir: str, batch: int, prompt: int, response: int, models=("qwen-tiny", "smollm2"),
            ckpts=(False, True)) -> list[dict]:
    """Measured peak over the loaded model (CPU, fp32) of one update micro-batch, next to the estimate."""
    out = []
    for model in models:
        for ckpt in ckpts:
            cmd = [sys.executable, str(ROOT / "scripts" / "bench_memory.py"), "--one", model, "update", "response",
                   "--batch", str(batch), "--prompt", str(prompt), "--response", str(response),
                   "--cache_dir", cache_dir]
            cmd += ["--grad_ckpt"] if ckpt else []
            # glibc returns a freed large block to the system only above its mmap threshold, which it raises
            # as blocks are freed; fixed at 128 KiB, the process's peak resident memory follows the live tensors
            env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
            r = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
            m = json.loads(r.stdout.strip().splitlines()[-1])
            cfg = m["config"]
            e = estimate(cfg, world=1, micro_tokens=batch * (prompt + response), prompt=prompt, response=response,
                         grad_ckpt=ckpt, c=4, reference=False)
            P = param_counts(cfg)[0]
            est = 4 * P / GIB + e["activations"] + e["logits"]   # gradients, activations, logits: all a CPU step adds
            meas = m["peak_over_loaded_mb"] / 1024
            out.append({"model": model, "grad_ckpt": ckpt, "params": P, "measured_gib": round(meas, 3),
                        "estimate_gib": round(est, 3), "ratio": round(est / meas, 3),
                        "terms_gib": {"gradients": round(4 * P / GIB, 3), "activations": round(e["activations"], 3),
                                      "logits": round(e["logits"], 3)}})
            print(f"{model:10s} grad_ckpt={ckpt!s:5s} measured {meas:6.3f} GiB, estimate {est:6.3f} GiB "
                  f"(ratio {est / meas:.2f})", flush=True)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description="GPU memory plan of train.py (see the module docstring)")
    p.add_argument("--world", type=int, default=8, help="ranks (GPUs)")
    p.add_argument("--gpu_gib", type=float, default=80.0, help="memory of one GPU")
    p.add_argument("--measure", action="store_true", help="check the estimate against peaks measured on the CPU")
    p.add_argument("--batch", type=int, default=8, help="--measure: sequences in the micro-batch")
    p.add_argument("--prompt", type=int, default=512, help="--measure: prompt tokens")
    p.add_argument("--response", type=int, default=64, help="--measure: response tokens")
    p.add_argument("--cache_dir", default="~/.cache/rsipo")
    p.add_argument("--out", default="", help="write the results as JSON here")
    a = p.parse_args(argv)
    res: dict = {"date": time.strftime("%Y-%m-%d"), "command": " ".join(["python"] + sys.argv)}
    if a.measure:
        res["measured"] = measure(a.cache_dir, a.batch, a.prompt, a.response)
    else:
        res["table"] = table(a.world, a.gpu_gib)
        print(res["table"])
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
