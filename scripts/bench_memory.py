"""Peak host memory of the update's forward/backward and of generation, before and after the response-only logits.

Two measurements per model, each variant in a fresh process (peak RSS over the process's life, minus the
RSS once the model is loaded, so the figure is what the step itself allocates):
* `update`: one micro-batch of B sequences (P prompt + R response tokens), log-probs and entropy, backward.
  `full`: logits at every position and two fp32 log-softmaxes (one for ℓ, one for the entropy): the
  trainer's path before. `response`: `rollout.collate` + `rollout.token_logprobs_of`, logits at the R response
  positions and one shared log-softmax: the trainer's path now.
* `generate`: B prompts of P tokens, G sampled tokens. `scores`: HF `generate(output_scores=True)`, every
  step's [B, V] scores kept to read one log-prob per token (the engine before). `engine`: `rollout.HFEngine`,
  the sampled token's log-prob taken as generation goes (now).

Models, no downloads: `smollm2` (SmolLM2-135M-Instruct, 49k vocabulary, harness/tiny.py) and `qwen-tiny` (a
1-block Qwen2, hidden 64, with Qwen's 151,936-row vocabulary: the logits dominate, as at 7B per token).

    python scripts/bench_memory.py --out results/bench_memory.json
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def rss_mb() -> float:
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024   # Linux: KiB


def load(name: str, cache: str):
    from harness import tiny
    import rollout
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM
    if name == "smollm2":
        path = tiny.smollm2(cache)
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), rollout.load_tokenizer(path)
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True)
    return Qwen2ForCausalLM(cfg), tiny.qwen_tokenizer(cache)


def one(a) -> dict:
    """Run one variant in this process and return its figures."""
    import rsipo
    import rollout
    model, tok = load(a.model, a.cache_dir)
    if a.grad_ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    g = torch.Generator().manual_seed(0)
    V = model.config.vocab_size
    prompts = [torch.randint(100, min(V, len(tok)) - 100, (a.prompt,), generator=g).tolist() for _ in range(a.batch)]
    base = rss_mb()
    t0 = time.time()
    if a.what == "update":
        resp = [torch.randint(100, min(V, len(tok)) - 100, (a.response,), generator=g).tolist() for _ in range(a.batch)]
        samples = list(zip(prompts, resp))
        model.train()
        if a.variant == "full":   # every position's logits; ℓ and H from two log-softmaxes
            ids = torch.tensor([p + r for p, r in samples])
            logits = model(input_ids=ids).logits                                       # [B, P+R, V]
            lp = rsipo.token_logprobs(logits[:, :-1], ids[:, 1:])
            ent = rsipo.entropy_from_logits(logits[:, :-1])
            loss = -(lp[:, a.prompt - 1:].mean() + 0.001 * ent[:, a.prompt - 1:].mean())
        else:
            ids, attn, tgt, mask = rollout.collate(samples, tok.pad_token_id, "cpu")
            lp, ent = rollout.token_logprobs_of(model, ids, attn, tgt, with_entropy=True)  # [B, R]
            loss = -(lp.mean() + 0.001 * ent.mean())
        loss.backward()
    else:
        model.eval()
        if a.variant == "scores":
            with torch.no_grad():
                out = model.generate(input_ids=torch.tensor(prompts), attention_mask=torch.ones(a.batch, a.prompt,
                                     dtype=torch.long), do_sample=True, top_k=0, max_new_tokens=a.gen,
                                     min_new_tokens=a.gen, output_scores=True, return_dict_in_generate=True,
                                     pad_token_id=tok.pad_token_id)
                lp = torch.stack(out.scores, 1).float().log_softmax(-1)                 # [B, G, V]
                lp.gather(-1, out.sequences[:, a.prompt:, None])
        else:
            from rollout import HFEngine
            eng = HFEngine(model, tok, max_new_tokens=a.gen, max_prompt_tokens=10 ** 6)
            eng.eos_ids = [-1]                      # no early end: exactly G tokens per row, as the other variant
            eng.generate([tok.decode(p) for p in prompts], stop=False)
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "tie_word_embeddings")
    return {"model": a.model, "what": a.what, "variant": a.variant, "vocab": V, "batch": a.batch,
            "grad_ckpt": a.grad_ckpt, "config": {k: getattr(model.config, k) for k in keys},
            "prompt": a.prompt, "response": a.response if a.what == "update" else a.gen,
            "peak_over_loaded_mb": round(peak_mb() - base, 1), "seconds": round(time.time() - t0, 2)}


def main(argv=None):
    p = argparse.ArgumentParser(description="peak memory of update and generation, before vs after (docstring)")
    p.add_argument("--models", default="qwen-tiny,smollm2")
    p.add_argument("--batch", type=int, default=8, help="sequences per micro-batch / prompts per generate call")
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens")
    p.add_argument("--response", type=int, default=64, help="response tokens in the update")
    p.add_argument("--gen", type=int, default=128, help="generated tokens")
    p.add_argument("--cache_dir", default="~/.cache/rsipo")
    p.add_argument("--grad_ckpt", action="store_true", help="activation checkpointing (update only)")
    p.add_argument("--out", default="", help="write the results as JSON here")
    p.add_argument("--one", nargs=3, metavar=("MODEL", "WHAT", "VARIANT"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.one:
        a.model, a.what, a.variant = a.one
        print(json.dumps(one(a)))
        return
    rows = []
    for m in a.models.split(","):
        for what, variants in (("update", ("full", "response")), ("generate", ("scores", "engine"))):
            for v in variants:
                cmd = [sys.executable, __file__, "--one", m, what, v, "--batch", str(a.batch), "--prompt",
                       str(a.prompt), "--response", str(a.response), "--gen", str(a.gen), "--cache_dir", a.cache_dir]
                r = subprocess.run(cmd, capture_output=True, text=True, check=True)
                rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
                print(f"{m:10s} {what:9s} {v:9s} peak +{rows[-1]['peak_over_loaded_mb']:8.1f} MB "
                      f"({rows[-1]['seconds']:.1f} s)", flush=True)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv),
                                           "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
