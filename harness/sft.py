"""The SFT warm start (stage 1, METHOD.md §4): chat samples from a JSONL file, and behaviour cloning on
their response tokens under a padded-token budget. train.warm_start calls `sft`."""
from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Callable, Optional

import torch

import rsipo
from harness.config import RESUME_MAY_CHANGE
from infra import distributed as D
from infra.distributed import aligned_micro_batches, print0
from infra.io import jsonl_lines
from rollout import chat_ids, collate, token_logprobs_of


def load_sft_jsonl(path: str) -> list[tuple[str, str]]:
    """Chat samples from --sft_data: JSONL lines {"messages": [..., {"role": "user", ...}, {"role": "assistant",
    ...}]} or {"prompt", "response"}; or a parquet file (`load_sft_parquet`)."""
    if path.endswith(".parquet"):
        return load_sft_parquet(path)
    out = []
    for n, d in jsonl_lines(path):
        try:
            if isinstance(d, ValueError):
                raise d
            out.append(chat_pair(d))
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise SystemExit(f"error: --sft_data {path}:{n}: not a chat sample ({e})")
    if not out:
        raise SystemExit(f"error: --sft_data {path} holds no samples")
    return out


def chat_pair(d: dict) -> tuple[str, str]:
    """(the last user turn, the assistant's answer) of one sample: chat messages, or a prompt and a response."""
    if "messages" in d:
        m = list(d["messages"])
        return m[-2]["content"], m[-1]["content"]
    return d["prompt"], d["response"]


def load_sft_parquet(path: str) -> list[tuple[str, str]]:
    """[ours] Chat samples from a parquet file, as published SFT sets come: a `messages` column (lists of {role,
    content}) or `prompt` and `response` columns of text. Says which it found; a file with neither is an error
    naming the columns it has."""
    import pyarrow.parquet as pq
    try:
        table = pq.read_table(path)
    except Exception as e:
        raise SystemExit(f"error: --sft_data {path}: not a readable parquet file ({type(e).__name__}: {e})")
    cols = set(table.column_names)
    use = ["messages"] if "messages" in cols else ["prompt", "response"] if {"prompt", "response"} <= cols else None
    if use is None:
        raise SystemExit(f"error: --sft_data {path}: a parquet file needs a 'messages' column or 'prompt' and "
                         f"'response' columns; it has {', '.join(sorted(cols))}")
    rows = table.select(use).to_pylist()
    out = []
    for n, d in enumerate(rows):
        try:
            out.append(chat_pair(d))
        except (KeyError, IndexError, TypeError) as e:
            raise SystemExit(f"error: --sft_data {path}: row {n} is not a chat sample ({type(e).__name__}: {e})")
    if not out:
        raise SystemExit(f"error: --sft_data {path} holds no samples")
    print0(f"--sft_data {path}: {len(out)} samples from the parquet column(s) {', '.join(use)}")
    return out


def sft_loss_backward(model, batch: list[tuple[list[int], list[int]]], pad_id: int, device, micro_tokens: int) -> float:
    """Backward of the token-mean cross-entropy on the response tokens of every rank's batch; returns that loss.
    The token count is summed over ranks and divided by the world size (as `train.token_counts`): FSDP averages
    the ranks' gradients, so a rank whose loss is its tokens' sum over N / W gives the mean over all N tokens,
    whatever each rank's share of them.

    [ours] With `micro_tokens` > 0 the batch is sorted by length and split into micro-batches of at most
    that many padded tokens, each scaled by the batch's token count, so the summed gradient is the one
    of the whole padded batch (up to float rounding) at a fraction of the padding: the warm-start data
    mixes 20-token action turns with 800-token analyzer prompts. All ranks run the same number of
    backward passes (FSDP2 collectives), padding with zero-weight dummies."""
    n_tok = float(D.all_reduce(float(sum(len(r) for _, r in batch)))[0]) / D.WORLD
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
    return float(D.all_reduce(total)[0]) / D.WORLD       # the mean over every rank's tokens


def sft(model, tok, pairs: list[tuple[str, str]], args, device, stop: Optional[Callable[[], bool]] = None,
        state_dir: Optional[Path] = None) -> tuple[float, int, bool]:
    """Behaviour cloning: token-mean cross-entropy on response tokens, AdamW with cosine decay. Returns the
    last batch's loss, how many steps were skipped for a non-finite gradient norm (the weights stay as
    they were: one NaN step would poison every weight), and whether it stopped early.

    [ours] Preemption: `stop` (a collective every rank calls at each step: has any rank seen SIGTERM?) ends it
    after the current step, with its state (weights, AdamW, the step, the batch sampler and the RNGs) saved
    as a checkpoint in `state_dir`; a later call with the same `state_dir` resumes from there, so that the
    warm start continues where it stopped and ends as an uninterrupted one would."""
    from tqdm import tqdm
    rng = random.Random(args.seed + 17 * D.RANK)
    # the response as the model writes it after the chat template's generation header, then EOS
    enc = [(chat_ids(tok, p), tok.encode(r, add_special_tokens=False) + [tok.eos_token_id]) for p, r in pairs]
    n_long = sum(len(p) > args.max_prompt_tokens for p, _ in enc)
    if n_long:   # a prompt cut to fit would lose its task line: such samples are left out
        print0(f"sft: {n_long} of {len(enc)} samples have prompts over --max_prompt_tokens {args.max_prompt_tokens}; "
               "left out")
        enc = [(p, r) for p, r in enc if len(p) <= args.max_prompt_tokens]
        if not enc:
            raise SystemExit(f"error: no SFT sample fits --max_prompt_tokens {args.max_prompt_tokens}")
    opt = torch.optim.AdamW(model.parameters(), lr=args.sft_lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / max(1, args.sft_steps))))
    start, loss, skipped = 0, float("nan"), 0
    if state_dir is not None and D.agreed_checkpoints(state_dir):   # a warm start that a SIGTERM stopped
        D.check_resume(state_dir, args, RESUME_MAY_CHANGE)
        st = D.load_checkpoint(state_dir, model, opt)
        start, loss, skipped = st["step"], st["extra"]["loss"], st["extra"]["skipped"]
        saved = st["extra"]["rng"]       # one sampler state per rank of the stopped run
        # a rank the stopped run did not have draws its own fresh stream (another rank's would repeat its batches)
        rng = random.Random(f"{args.seed}-{D.RANK}-{start}") if D.RANK >= len(saved) else rng
        if D.RANK < len(saved):
            rng.setstate(saved[D.RANK])
        sched.last_epoch = start - 1
        sched.step()                      # the learning rate of step `start`
        print0(f"sft: resumed at step {start} of {args.sft_steps} from {st['path']}")
    print0(f"sft: {len(enc)} samples, steps {start + 1}..{args.sft_steps} of batch {args.sft_batch}")
    model.train()
    bar = tqdm(range(start, args.sft_steps), desc="sft", disable=D.RANK != 0, mininterval=5, initial=start,
               total=args.sft_steps)
    for s in bar:
        # every rank agrees on a SIGTERM: save the state after `s` steps and stop
        if stop is not None and state_dir is not None and stop():
            D.save_checkpoint(state_dir, model, opt, s, args, {"loss": loss, "skipped": skipped,
                                                               "rng": D.all_gather_obj(rng.getstate())})
            return loss, skipped, True
        batch = [enc[rng.randrange(len(enc))] for _ in range(args.sft_batch)]
        opt.zero_grad(set_to_none=True)
        loss = sft_loss_backward(model, batch, tok.pad_token_id, device, args.sft_micro_tokens)
        if math.isfinite(D.clip_grad_norm(model, args.grad_clip)):   # a non-finite one would make every weight NaN
            opt.step()
        else:
            skipped += 1
        sched.step()
        if s % 20 == 0 or s == args.sft_steps - 1:
            bar.set_postfix(loss=f"{loss:.3f}", skipped=skipped)
    if skipped:
        print0(f"sft: {skipped} of {args.sft_steps} optimizer steps skipped for a non-finite gradient")
    return loss, skipped, False
