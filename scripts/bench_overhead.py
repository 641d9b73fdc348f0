"""The trainer's overhead: its update and its generation against bare PyTorch / Hugging Face on the same work.

    python scripts/bench_overhead.py --out results/bench_overhead.json           # SmolLM2-135M on CPU
    python scripts/bench_overhead.py --model tiny-qwen --iters 2                 # a quick look

* **Update.** The same samples (B sequences of P prompt + R response tokens, random ids) through
  (a) `train.update`: RSIPO's loss (clipped policy gradient, k3 KL to given reference log-probs, entropy
  bonus), token-budget micro-batches, gradient clipping, AdamW, its metrics; and (b) a bare step: one
  padded forward with logits at the response positions (what the trainer computes too), the mean
  log-likelihood of the response tokens, backward, gradient clipping, AdamW. Both see the same tokens and
  run the same number of forward/backward passes (one micro-batch each). Ratio = trainer tokens/s over
  bare tokens/s (prompt + response tokens).
* **Generation.** The same prompts through (a) `rollout.HFEngine.generate` (our chat template off:
  the prompts are token ids decoded to text and re-encoded, left padding, the sampler's log-probs kept by
  its logits processor, stop handling) and (b) a bare `model.generate(do_sample=True)` on the same
  padded ids. EOS is disabled on both, so each row generates exactly G tokens. Ratio = engine tokens/s
  over bare tokens/s (generated tokens).

Each figure is the median of `--iters` timed repeats after one warm-up. Alone on the machine: the cores
are the measurement.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
from bench_memory import load  # noqa: E402   SmolLM2, or a 1-block Qwen2 with Qwen's vocabulary


def timed(fn, iters: int) -> float:
    fn()                                   # warm-up
    ts = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def update_pair(model, tok, a) -> dict:
    import rollout
    import train
    g = torch.Generator().manual_seed(0)
    V = min(model.config.vocab_size, len(tok))
    pairs = [(torch.randint(100, V - 100, (a.prompt,), generator=g).tolist(),
              torch.randint(100, V - 100, (a.response,), generator=g).tolist()) for _ in range(a.batch)]
    pad = tok.pad_token_id
    with torch.no_grad():                  # π_old = π_ref = the model: ratio 1, KL 0, as at a step's start
        old = rollout.score_tokens(model, pairs, pad, "cpu", a.batch)
    samples = [train.Sample(p, r, 1.0 if i % 2 else -1.0, o, ref=o) for i, ((p, r), o) in enumerate(zip(pairs, old))]
    args = train.Args(model="smollm2", mini_batch=a.batch, micro_batch=a.batch, micro_tokens=0, lr=1e-7,
                      c_kl=0.01, c_ent=a.c_ent, drop_zero_adv=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-7)

    def trainer():
        train.update(model, opt, samples, train.UpdateConfig.from_args(args), pad, "cpu", use_teacher=False)

    def bare():
        model.train()
        opt.zero_grad(set_to_none=True)
        ids, attn, tgt, mask = rollout.collate(pairs, pad, "cpu")
        P = ids.shape[1] - tgt.shape[1]
        keep = torch.arange(P - 1, ids.shape[1] - 1)
        logits = model(input_ids=ids, attention_mask=attn, logits_to_keep=keep).logits       # [B, R, V]
        lp = torch.log_softmax(logits.float(), -1).gather(-1, tgt[..., None]).squeeze(-1)    # [B, R]
        loss = -(lp * mask).sum() / mask.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    tokens = a.batch * (a.prompt + a.response)
    t_tr, t_bare = timed(trainer, a.iters), timed(bare, a.iters)
    return {"tokens": tokens, "trainer_s": t_tr, "bare_s": t_bare, "trainer_tokens_per_s": tokens / t_tr,
            "bare_tokens_per_s": tokens / t_bare, "ratio": t_bare / t_tr}


def generate_pair(model, tok, a) -> dict:
    from rollout import HFEngine
    g = torch.Generator().manual_seed(1)
    V = min(model.config.vocab_size, len(tok))
    eng = HFEngine(model, tok, max_new_tokens=a.gen, max_prompt_tokens=10 ** 6)
    eng.eos_ids = [-1]                     # no early end: exactly G tokens per row on both sides
    prompts = [tok.decode(torch.randint(100, V - 100, (a.prompt,), generator=g).tolist()) for _ in range(a.batch)]
    ids = [eng.encode(p) for p in prompts]
    L = max(len(x) for x in ids)
    input_ids = torch.full((len(ids), L), tok.pad_token_id)
    attn = torch.zeros((len(ids), L), dtype=torch.long)
    for b, x in enumerate(ids):
        input_ids[b, L - len(x):], attn[b, L - len(x):] = torch.tensor(x), 1

    def engine():
        eng.generate(prompts, stop=False)

    @torch.no_grad()
    def bare():
        model.eval()
        model.generate(input_ids=input_ids, attention_mask=attn, do_sample=True, top_k=0, top_p=1.0,
                       temperature=1.0, max_new_tokens=a.gen, min_new_tokens=a.gen, pad_token_id=tok.pad_token_id)

    n = a.batch * a.gen
    t_eng, t_bare = timed(engine, a.iters), timed(bare, a.iters)
    return {"tokens": n, "engine_s": t_eng, "bare_s": t_bare, "engine_tokens_per_s": n / t_eng,
            "bare_tokens_per_s": n / t_bare, "ratio": t_bare / t_eng}


def main(argv=None):
    p = argparse.ArgumentParser(description="trainer overhead against bare PyTorch / HF (see the docstring)")
    p.add_argument("--model", default="smollm2", choices=["smollm2", "tiny-qwen"])
    p.add_argument("--batch", type=int, default=8, help="sequences")
    p.add_argument("--prompt", type=int, default=192, help="prompt tokens")
    p.add_argument("--response", type=int, default=64, help="response tokens (update)")
    p.add_argument("--gen", type=int, default=32, help="generated tokens (generation)")
    p.add_argument("--iters", type=int, default=3, help="timed repeats (median), after one warm-up")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument("--c_ent", type=float, default=0.001, help="the trainer's entropy bonus (0: no entropy term)")
    p.add_argument("--only", default="", choices=["", "update", "generate"], help="measure one of the two")
    p.add_argument("--cache_dir", default="~/.cache/rsipo")
    p.add_argument("--out", default="", help="write the results as JSON here")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    model, tok = load(a.model, a.cache_dir)
    res = {"date": time.strftime("%Y-%m-%d"), "command": " ".join(["python"] + sys.argv), "model": a.model,
           "threads": torch.get_num_threads(), "torch": torch.__version__,
           **{k: f(model, tok, a) for k, f in (("update", update_pair), ("generate", generate_pair))
              if a.only in ("", k)}}
    for k in [k for k in ("update", "generate") if k in res]:
        r = res[k]
        mine = r.get("trainer_tokens_per_s", r.get("engine_tokens_per_s"))
        print(f"{k:9s} ours {mine:8.1f} tok/s | bare {r['bare_tokens_per_s']:8.1f} tok/s | ratio {r['ratio']:.2f}",
              flush=True)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
