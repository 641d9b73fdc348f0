"""Rollout: typed records, generation engines and the lock-step multi-turn loop (METHOD.md §2.1, §7).

Contract
--------
* `Turn` is one training sample: the prompt the policy saw at one step of one episode, the
  response it sampled (every response token is trained), the sampler's log-probs (for
  diagnostics only: the trainer recomputes old log-probs), whether the response had a parsable
  action (`invalid` → the format penalty), and the task / group / episode it belongs to.
* `Episode` holds its turns, the episode reward (ALFWorld: 10 on a win), `won`, the (observation,
  action) steps that the skill analyzer reads, and any env error.
* Engines share one interface, `generate(prompts, ...) -> list[Generation]` over plain-text user
  prompts (the engine applies the tokenizer's chat template). `HFEngine` batches Hugging Face
  `generate` (left padding, KV cache, temperature / top-p, stop after the first of `stop_texts`,
  default `</action>`; the search env's are `</search>`, `</answer>`); the vLLM engine
  (GPU, harness/vllm_engine.py) implements the same call.
* `run_episodes` plays N episodes per task from the same initial state in lock-step: one batched
  generate for every still-active episode per turn, one batched step of the env pool. The env
  family is the pool's business: it supplies `task_key`, `build_prompt`, `parse_action` and
  `task_prefix`, and for constrained decoding `format_action` (envs.EnvPool: ALFWorld; envs.SearchPool:
  search QA), so the loop is env-agnostic.

Choices, all **[ours]**:
1. Constrained decoding, `allowed_responses` (off by default; on only in the tiny CPU preset): generation
   is limited to the token sequences of the given responses, in `run_episodes` the pool's
   `format_action` of each admissible action (ALFWorld: `<think> </think> <action> {action} </action>`). This
   departs from the paper's free decoding; it makes a 0.5 M-parameter model learnable in minutes.
   The trainer still scores the sampled tokens under the unconstrained policy.
2. A response with no parsable action is sent to the env as an empty command ("Nothing happens.",
   one step spent) and flagged `invalid` for the format penalty.

Test: pytest tests/test_rollout.py
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, NamedTuple, Optional

import numpy as np
import torch

from infra import distributed
import rsipo
from infra.distributed import all_gather_obj, all_reduce, micro_batches
from skills import insert_skill

STOP_TEXT = "</action>"


@dataclass
class Turn:
    prompt_ids: list[int]
    response_ids: list[int]
    sampler_logprobs: list[float]
    invalid: bool                              # no parsable action → format penalty
    task_id: str
    task_type: str
    group_id: int
    episode_id: int
    step: int
    prompt_text: str = ""
    response_text: str = ""
    free: bool = True                          # sampler log-probs comparable with π_old (top-p 1, unconstrained)


@dataclass
class Episode:
    task_id: str
    task_type: str
    task: str                                  # the task sentence
    group_id: int
    episode_id: int
    turns: list[Turn] = field(default_factory=list)
    steps: list[tuple[str, str]] = field(default_factory=list)   # (observation, action) for the analyzer
    reward: float = 0.0
    won: bool = False
    error: Optional[str] = None
    skill: Optional[str] = None                # skill in the prompt (replays / teacher), None = student
    min_margin: float = math.inf               # greedy: the smallest top-1 − top-2 gap of any of its tokens
    overflow: int = 0                          # turns whose prompt did not fit even without history (invalid)
    step_rewards: list[float] = field(default_factory=list)   # the env's reward at each step


@dataclass
class Generation:
    text: str                     # exactly tok.decode(token_ids): the text that is parsed
    token_ids: list[int]          # the response: up to and including the stop text's last token, no EOS, no padding
    logprobs: list[float]         # the sampler's log-prob of each token, under the distribution it was drawn from
    prompt_ids: list[int]
    free: bool = True             # sampled (T > 0) at top-p 1, unconstrained: the log-probs are the trainer's π_old's
                                  # at the sampling temperature
    min_margin: float = math.inf  # greedy: the smallest top-1 − top-2 log-prob gap of its tokens (a near-tie)


def chat_ids(tokenizer, prompt: str) -> list[int]:
    """Token ids of a single-turn chat prompt with the generation header (the chat template)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template: give --model "
                         "an instruct / chat checkpoint (its tokenizer_config.json holds `chat_template`)")
    msgs = [{"role": "user", "content": prompt}]
    out = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    if isinstance(out, dict) or hasattr(out, "keys"):
        out = out["input_ids"]
    return list(out)


def response_end(toks: list[int], decode, eos_ids, stop_ids=(), stop_texts=()) -> int:
    """Length of the response inside a generated row: up to an EOS id (excluded), a single-token stop id
    (included), or the token that completes a stop text (included), whichever comes first; everything
    after it is padding or tokens sampled past the stop. `decode`: ids → text."""
    n = len(toks)
    for j, t in enumerate(toks):
        if t in eos_ids:
            n = j
            break
        if t in stop_ids:
            n = j + 1
            break
    if stop_texts and any(s in decode(toks[:n]) for s in stop_texts):
        lo, hi = 1, n                        # the shortest prefix whose text holds a stop text (monotone in length)
        while lo < hi:
            mid = (lo + hi) // 2
            if any(s in decode(toks[:mid]) for s in stop_texts):
                hi = mid
            else:
                lo = mid + 1
        n = lo
    return n


class _PrefixTrie:
    """Allowed continuations for constrained decoding: token-id sequences stored as a trie."""

    def __init__(self, seqs: list[list[int]], end_id: int):
        self.root: dict = {}
        self.end_id = end_id
        for s in seqs:
            node = self.root
            for t in s:
                node = node.setdefault(t, {})

    def allowed(self, prefix: list[int]) -> list[int]:
        node = self.root
        for t in prefix:
            node = node.get(t)
            if node is None:
                return [self.end_id]
        return list(node.keys()) or [self.end_id]


def top_p_mask(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus filter: logits of the tokens outside the smallest set whose probability reaches top_p → -inf
    (the most likely token always stays). logits [B, V] → [B, V]."""
    if top_p >= 1.0:
        return logits
    sorted_logits, idx = logits.sort(dim=-1, descending=True)                     # [B, V]
    probs = sorted_logits.softmax(-1)
    before = probs.cumsum(-1) - probs                                            # mass of the tokens ranked above
    drop = torch.zeros_like(before, dtype=torch.bool).scatter(-1, idx, before >= top_p)   # vocabulary order
    return logits.masked_fill(drop, float("-inf"))


class SamplerLogprobs:
    """A logits processor that *is* the sampler's temperature and top-p, and keeps the log-prob of each
    sampled token under the distribution it was drawn from, one [B, V] row at a time (the token sampled
    at step t is read from input_ids at step t + 1). `output_scores` would keep every step's [B, V]
    scores: about 62 GB at 64 prompts × 512 tokens with Qwen's 152k vocabulary."""

    def __init__(self, temperature: float, top_p: float, margins: bool = False):
        self.temperature, self.top_p = temperature, top_p
        self.prev: Optional[torch.Tensor] = None      # [B, V] log-probs of the last step's distribution
        self.taken: list[torch.Tensor] = []           # [B] per generated token
        self.margins: Optional[list[torch.Tensor]] = [] if margins else None   # [B] per step: top-1 − top-2

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.prev is not None:
            self.taken.append(self.prev.gather(-1, input_ids[:, -1:]).squeeze(-1))
        scores = top_p_mask(scores.float() / self.temperature, self.top_p)            # [B, V]
        self.prev = scores.log_softmax(-1)
        if self.margins is not None:      # greedy: how near the chosen token came to a tie
            top2 = self.prev.topk(2, dim=-1).values                               # [B, 2]
            self.margins.append(torch.nan_to_num(top2[:, 0] - top2[:, 1], posinf=math.inf))
        return scores

    def min_margins(self, lengths: list[int]) -> list[float]:
        """Per row, the smallest top-1 − top-2 log-prob gap over its first `lengths[b]` tokens (inf: none)."""
        if not self.margins:
            return [math.inf] * len(lengths)
        m = torch.stack(self.margins, dim=1).cpu()                                  # [B, steps]
        return [float(m[b, :n].min()) if n else math.inf for b, n in enumerate(lengths)]

    def logprobs(self, new_tokens: torch.Tensor) -> torch.Tensor:
        """[B, T] log-probs of the generated tokens [B, T] (after generate returned)."""
        if self.prev is None:
            return torch.zeros(new_tokens.shape, dtype=torch.float32)
        last = self.prev.gather(-1, new_tokens[:, len(self.taken):len(self.taken) + 1]).squeeze(-1)
        return torch.stack(self.taken + [last], dim=1)[:, :new_tokens.shape[1]].cpu()


def neutral_generation_config(**kw):
    """A GenerationConfig that holds only what the trainer's π_old assumes: no repetition or length
    penalties, no top-k, no forced or suppressed tokens; temperature and top-p are applied by
    `SamplerLogprobs`. HF fills any field left None from the checkpoint's generation_config.json
    (Qwen2.5-Instruct: repetition_penalty 1.05, top_k 20, top_p 0.8, temperature 0.7), which made the
    sampler differ from the trainer by 0.3 nat/token; so every such field is set here."""
    from transformers import GenerationConfig
    return GenerationConfig(temperature=1.0, top_p=1.0, top_k=0, min_p=None, typical_p=1.0, epsilon_cutoff=0.0,
                            eta_cutoff=0.0, repetition_penalty=1.0, encoder_repetition_penalty=1.0,
                            no_repeat_ngram_size=0, length_penalty=1.0, min_length=0, min_new_tokens=None,
                            bad_words_ids=None, suppress_tokens=None, begin_suppress_tokens=None,
                            forced_bos_token_id=None, forced_eos_token_id=None, sequence_bias=None,
                            renormalize_logits=False, num_beams=1, **kw)


class HFEngine:
    """Batched Hugging Face generation for CPU runs and tests (same interface as the vLLM engine).

    Prompts must fit `max_prompt_tokens` (callers drop history to fit: `fit_prompt`); a longer one is an
    error, never silently cut. `eos_ids`: the ids that end a response (the tokenizer's EOS, plus the
    checkpoint's generation_config eos ids, e.g. Qwen's <|endoftext|> besides <|im_end|>). A response is
    cut where generation stopped (`response_end`), so padding never enters `token_ids` whatever the pad id.
    Sampling follows `neutral_generation_config` plus our temperature / top-p (`SamplerLogprobs`): exactly
    the distribution the trainer's π_old computes at T 1."""

    def __init__(self, model, tokenizer, max_new_tokens: int = 512, temperature: float = 1.0,
                 top_p: float = 1.0, max_prompt_tokens: int = 2048, stop_texts: Optional[list[str]] = None):
        self.model, self.tok = model, tokenizer
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.top_p = top_p
        self.max_prompt_tokens = max_prompt_tokens
        # Generation stops after the first of these texts (ALFWorld: </action>; search: the pool's).
        self.stop_texts = list(stop_texts) if stop_texts else [STOP_TEXT]
        stops = [tokenizer.encode(t, add_special_tokens=False) for t in self.stop_texts]
        # one token each in the tiny vocabulary: stop on the ids; else on the strings
        self.stop_ids = [x[0] for x in stops] if all(len(x) == 1 for x in stops) else []
        gc_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        gc_eos = [gc_eos] if isinstance(gc_eos, int) else list(gc_eos or [])
        self.eos_ids = [i for i in dict.fromkeys([tokenizer.eos_token_id] + gc_eos)
                        if i is not None and i < len(tokenizer)]
        if tokenizer.pad_token_id is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
            raise ValueError(f"HFEngine needs a pad token that is not EOS (pad {tokenizer.pad_token_id}, EOS "
                             f"{tokenizer.eos_token_id}): rollout.load_tokenizer picks one")
        self.pad_id = tokenizer.pad_token_id
        self.batch_size = 64                    # prompts per `generate` call of the model

    def encode(self, prompt: str) -> list[int]:
        return chat_ids(self.tok, prompt)

    def prompt_len(self, prompt: str) -> int:
        return len(self.encode(prompt))

    @torch.no_grad()
    def generate(self, prompts: list[str], temperature: Optional[float] = None, greedy: bool = False,
                 allowed_responses: Optional[list[list[str]]] = None, max_new_tokens: Optional[int] = None,
                 stop: bool = True, batch_size: Optional[int] = None,
                 seeds: Optional[list[int]] = None) -> list[Generation]:
        """`seeds` (one per prompt) is accepted for the vLLM engine's interface and not used: HF `generate`
        draws a batch's samples from one generator (`evaluate` seeds it for common random numbers)."""
        out: list[Generation] = []
        batch_size = batch_size or self.batch_size
        for i in range(0, len(prompts), batch_size):
            chunk = prompts[i:i + batch_size]
            allow = allowed_responses[i:i + batch_size] if allowed_responses is not None else None
            out += self._generate(chunk, temperature, greedy, allow, max_new_tokens, stop)
        return out

    def _generate(self, prompts, temperature, greedy, allowed_responses, max_new_tokens, stop):
        temperature = self.temperature if temperature is None else temperature
        greedy = greedy or temperature <= 0
        ids = [self.encode(p) for p in prompts]
        refuse_long_prompts(ids, self.max_prompt_tokens)
        L = max(len(x) for x in ids)
        input_ids = torch.full((len(ids), L), self.pad_id, dtype=torch.long)         # [B, L] left-padded
        attn = torch.zeros((len(ids), L), dtype=torch.long)
        for b, x in enumerate(ids):
            input_ids[b, L - len(x):] = torch.tensor(x)
            attn[b, L - len(x):] = 1
        device = next(self.model.parameters()).device
        eos = self.eos_ids + (self.stop_ids if stop else [])
        sampler = SamplerLogprobs(1.0 if greedy else temperature, 1.0 if greedy else self.top_p, margins=greedy)
        multi = stop and not self.stop_ids            # stop texts of several tokens: HF's stop-string criterion
        gc = neutral_generation_config(do_sample=not greedy, max_new_tokens=max_new_tokens or self.max_new_tokens,
                                       pad_token_id=self.pad_id, eos_token_id=eos,
                                       stop_strings=self.stop_texts if multi else None)
        kw = {"logits_processor": [sampler], **({"tokenizer": self.tok} if multi else {})}
        if allowed_responses is not None:     # each prompt's whole responses: a trie of their tokens
            tries = [_PrefixTrie([self.tok.encode(r, add_special_tokens=False) for r in responses],
                                 self.tok.eos_token_id) for responses in allowed_responses]
            kw["prefix_allowed_tokens_fn"] = lambda b, seq: tries[b].allowed(seq[L:].tolist())
        was_training, saved = self.model.training, self.model.generation_config
        self.model.eval()
        self.model.generation_config = gc      # HF fills unset fields from it: none may come from the checkpoint
        try:
            seqs = self.model.generate(input_ids=input_ids.to(device), attention_mask=attn.to(device),
                                       generation_config=gc, **kw)[:, L:]             # [B, T]
        finally:
            self.model.generation_config = saved
            self.model.train(was_training)
        lp = sampler.logprobs(seqs)                                                  # [B, T]
        seqs = seqs.cpu()
        free = not greedy and self.top_p >= 1.0 and allowed_responses is None
        decode = lambda t: self.tok.decode(t, skip_special_tokens=False)             # noqa: E731
        ends = [response_end(seqs[b].tolist(), decode, self.eos_ids, self.stop_ids if stop else (),
                             self.stop_texts if stop and not self.stop_ids else ()) for b in range(len(prompts))]
        margins = sampler.min_margins(ends)
        gens = []
        for b, n in enumerate(ends):
            toks = seqs[b].tolist()[:n]
            gens.append(Generation(decode(toks), toks, lp[b, :n].tolist(), ids[b], free, margins[b]))
        return gens


def fit_prompt(build: Callable[[int], str], n_max: int, count: Callable[[str], int], budget: int) -> Optional[str]:
    """The prompt `build(k)` with the most history items k ≤ n_max that fits `budget` tokens (`count`: text →
    tokens, monotone in k), or None when even k = 0 does not fit. The oldest history goes first; the task,
    skill and instructions are never cut (a prompt cut from the left lost exactly those)."""
    p = build(n_max)
    if count(p) <= budget:
        return p
    lo, hi = 0, n_max - 1                     # the largest fitting k in [0, n_max - 1], by bisection
    if count(build(0)) > budget:
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count(build(mid)) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return build(lo)


def refuse_long_prompts(ids: list[list[int]], max_prompt_tokens: int):
    """Both engines' one check of their input: a prompt over the budget is a caller's error, never cut here (a
    prompt cut from the left loses its task line)."""
    too_long = [len(x) for x in ids if len(x) > max_prompt_tokens]
    if too_long:
        raise ValueError(f"a prompt of {too_long[0]} tokens exceeds --max_prompt_tokens {max_prompt_tokens} "
                         "(callers fit prompts by dropping history: rollout.fit_prompt)")


def request_seed(seed: int, task_id: str, copy: int, turn: int) -> int:
    """A sampling seed for one generation request: a 31-bit hash of (seed, task id, copy, turn)."""
    import zlib
    return zlib.crc32(f"{seed}|{task_id}|{copy}|{turn}".encode()) & 0x7FFFFFFF


def run_episodes(engine, pool, tasks: list[dict], n_per_task: int, *, history_len: int = 5,
                 skills: Optional[dict[int, str]] = None, temperature: Optional[float] = None,
                 greedy: bool = False, constrained: bool = False, group_offset: int = 0, reserve: int = 0,
                 progress: Optional[Callable[[int], None]] = None, seed: Optional[int] = None,
                 stop: Optional[Callable[[], bool]] = None) -> list[Episode]:
    """Play `n_per_task` episodes of every task in lock-step; all copies of a task start identically.

    tasks: dicts with the pool's `task_key` (ALFWorld `gamefile`, search `id`; optional
    `task_type`); skills: task index → skill text that is inserted after the task line of every
    prompt (teacher context / replay). The env family's prompt builder, action parser and task-line
    prefix come from the pool (`pool.build_prompt`, `pool.parse_action`, `pool.task_prefix`). Returns the
    episodes in task-major order; episode i belongs to task i // n_per_task, group id group_offset + that.

    Every prompt fits the engine's `max_prompt_tokens` minus `reserve` (room for a skill line the teacher
    inserts later): the oldest history turns are left out until it does (`fit_prompt`). A turn whose prompt
    cannot fit even with no history is not generated: the env gets an empty action (one step spent, as
    for an unparsable response), the episode counts it in `ep.overflow`, and there is no training sample.

    `stop` [ours]: checked before each lock-step turn (this rank only, no collective); when it says so, the
    episodes are left where they are and returned unfinished: the caller, told of a SIGTERM, discards them.

    `seed` [ours]: each generation request gets its own sampling seed, a hash of (seed, task id, copy, turn)
    (`request_seed`), which an engine that samples each request on its own (vLLM) uses; so the same turn of
    the same episode draws the same random numbers in two evaluations, on any rank and in any batch.
    """
    make_prompt = pool.build_prompt
    parse = pool.parse_action
    gamefiles = [t[pool.task_key] for t in tasks for _ in range(n_per_task)]
    eps, obs, adm = start_episodes(pool, tasks, gamefiles, n_per_task, skills or {}, group_offset)
    active = [ep.error is None for ep in eps]
    step = 0
    while any(active) and not (stop is not None and stop()):
        actions: list[Optional[str]] = [None] * len(eps)
        live = [i for i, a in enumerate(active) if a]
        idx, prompts = [], []              # the live episodes whose prompt fits, and their prompts
        for i in live:
            ep = eps[i]

            def build(h, ep=ep, i=i):
                p = make_prompt(ep.task, obs[i], adm[i], ep.steps, history_len=h)
                return insert_skill(p, ep.skill, task_line(pool, ep.task)) if ep.skill else p
            p = fit_prompt(build, history_len, engine.prompt_len, engine.max_prompt_tokens - reserve)
            if p is None:            # too long even without history: an invalid turn, counted
                ep.overflow += 1
                actions[i] = ""
                continue
            idx.append(i)
            prompts.append(p)
        seeds = [request_seed(seed, gamefiles[i], i % n_per_task, step) for i in idx] if seed is not None else None
        gens = engine.generate(prompts, temperature=temperature, greedy=greedy,
                               allowed_responses=[[pool.format_action(x) for x in adm[i]] for i in idx]
                               if constrained else None,
                               seeds=seeds) if prompts else []
        for i, p, g in zip(idx, prompts, gens):
            act = parse(g.text)
            ep = eps[i]
            ep.min_margin = min(ep.min_margin, g.min_margin)
            ep.turns.append(Turn(prompt_ids=g.prompt_ids, response_ids=g.token_ids,
                                 sampler_logprobs=g.logprobs,
                                 invalid=act is None, task_id=ep.task_id, task_type=ep.task_type,
                                 group_id=ep.group_id, episode_id=ep.episode_id, step=step,
                                 prompt_text=p, response_text=g.text, free=g.free))
            actions[i] = act if act is not None else ""
        results = pool.step(actions)
        for i in live:
            active[i] = record_step(eps[i], results[i], actions[i], obs, adm, i)
        step += 1
        if progress:
            progress(step)
    return eps


def start_episodes(pool, tasks: list[dict], gamefiles: list[str], n_per_task: int, skills: dict[int, str],
                   group_offset: int) -> tuple[list[Episode], list[str], list[list[str]]]:
    """Reset the pool on every copy of every task: the episodes (a reset's error marks its episode), and each
    one's first observation and admissible actions."""
    eps, obs, adm = [], [], []
    for i, (o, info) in enumerate(pool.reset(gamefiles)):
        k = i // n_per_task
        ep = Episode(task_id=gamefiles[i], task_type=info.get("task_type", tasks[k].get("task_type", "")),
                     task=info.get("task", ""), group_id=group_offset + k, episode_id=i, skill=skills.get(k))
        if info.get("error"):
            ep.error = info["error"]
        eps.append(ep)
        obs.append(o)
        adm.append(info.get("admissible", []))
    return eps, obs, adm


def record_step(ep: Episode, result, action: str, obs: list, adm: list, i: int) -> bool:
    """One env step's result into episode `ep` (number i of obs and adm, which take its next observation and
    admissible actions); whether the episode goes on. A result of None: the pool says it had already ended."""
    if result is None:
        return False
    o, reward, done, info = result
    ep.steps.append((obs[i], action))
    ep.step_rewards.append(float(reward))
    ep.reward += float(reward)
    ep.won = ep.won or bool(info.get("won", False))
    if info.get("error"):
        ep.error = info["error"]
    obs[i], adm[i] = o, info.get("admissible", [])
    return not done


# ---------------------------------------------------------------------------------------------
# Tokenizers: a chat template and a pad token that is not EOS

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


# ---------------------------------------------------------------------------------------------
# Log-probs of sampled tokens under a model: π_old, π_ref and the teacher (METHOD.md §2.7)

def collate(samples: list[tuple[list[int], list[int]]], pad_id: int, device):
    """(prompt_ids, response_ids) → input_ids [B, P+R] and attention mask [B, P+R], with every prompt
    left-padded to the longest (P) and every response right-padded to the longest (R), so that all
    responses start at column P; targets [B, R] (the response tokens) and their mask [B, R].
    `token_logprobs_of` then computes logits for the R response positions only: prompts are 75-90% of
    an ALFWorld turn's tokens, and the [B, T, V] logits and log-softmax were the update's memory."""
    P = max(len(p) for p, _ in samples)
    R = max(len(r) for _, r in samples)
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


def token_logprobs_of(model, ids, attn, targets, with_entropy=False, with_all=False, temperature: float = 1.0):
    """Log-probs [B, R] of `collate`'s targets (and the entropy [B, R]), from logits at the R positions
    that predict them (P-1 .. P+R-2; HF's `logits_to_keep`) and one shared fp32 log-softmax. Positions
    count from each row's first real token, as in generation with left padding. `with_all`: a third value,
    the whole fp32 log-softmax [B, R, V] (the teacher term's support, Eq. 11c-d; the same tensor, no copy).
    `temperature`: the logits are divided by it first, as verl does, so that the log-probs are those of the
    distribution the tokens were sampled from (T ≤ 0, greedy, divides by 1)."""
    P = ids.shape[1] - targets.shape[1]
    pos = (attn.cumsum(-1) - 1).clamp(min=0)                                     # [B, P+R]
    keep = torch.arange(P - 1, ids.shape[1] - 1, device=ids.device)              # [R]
    logits = model(input_ids=ids, attention_mask=attn, position_ids=pos, logits_to_keep=keep).logits   # [B, R, V]
    if temperature > 0 and temperature != 1.0:
        logits = logits.float() / temperature                                    # [B, R, V] the sampler's
    if not with_all:
        return rsipo.logprobs_and_entropy(logits, targets, with_entropy)         # [B, R] fp32 each
    logp_all = torch.log_softmax(logits.float(), dim=-1)                         # [B, R, V]
    lp = logp_all.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)           # [B, R]
    ent = -(logp_all.exp() * logp_all).sum(-1) if with_entropy else None         # [B, R]
    return lp, ent, logp_all




def task_line(pool, task: str) -> str:
    """The line of a prompt that states the task (the pool's prefix and the task sentence): where a skill goes
    (`skills.insert_skill`), for the replays, the teacher and the stage-1 data alike."""
    return pool.task_prefix + task


def teacher_pair(engine, turn: Turn, skill: str, task_line: str) -> tuple[list[int], list[int]]:
    """The teacher's input (METHOD.md §2.7): the student's prompt with the skill inserted after the task
    line (`task_line` = the pool's task prefix + the task sentence), and the student's own response tokens."""
    return engine.encode(insert_skill(turn.prompt_text, skill, task_line)), turn.response_ids


class Support(NamedTuple):
    """What scoring keeps of a distribution for Eq. (11c-d), per response token of one sample."""
    ids: Optional[torch.Tensor]           # [r, S] int32 token ids (−1: an empty slot); None = the whole vocabulary
    lp: torch.Tensor                      # [r, S] their log-probs, or [r, V] all of them
    tail: Optional[torch.Tensor]          # [r] log of the mass outside `ids`, exact (rsipo.support_logprobs)


@torch.no_grad()
def score_tokens(model, samples, pad_id, device, micro_batch, micro_tokens: int = 0, temperature: float = 1.0,
                 top: int = 0, support=None) -> list:
    """Per-sample log-probs of the response tokens under `model` (no grad), unpadded [len(r)].
    An FSDP2-sharded model (GPU: the policy under --engine vllm, the reference) runs the same number of
    forwards on every rank (one-token dummies), then reshards (the root stays gathered otherwise).
    `temperature`: as in `token_logprobs_of` (the sampling temperature of the responses).
    `top` K > 0: each sample gives (log-probs [r], the ids of the model's K most likely tokens [r, K] int32).
    `support` (Eq. 11c-d): "vocab" gives (log-probs [r], Support(None, the whole log-softmax [r, V], None)); a
    function (sample index, its log-softmax [r, V]) → ids [r, S] gives (log-probs [r], Support(ids, their log-probs,
    the exact tail)). One sample's [r, V] copy at a time holds the tail's logsumexp."""
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
        wide = bool(top) or support is not None
        lp, _, *logp_all = token_logprobs_of(model, ids, attn, tgt, with_all=wide, temperature=temperature)
        for b, i in enumerate(idx):
            r = len(samples[i][1])
            out[i] = lp[b, :r].float().cpu()
            if not wide:
                continue
            row = logp_all[0][b, :r]                                              # [r, V]
            if top:
                out[i] = (out[i], row.topk(top, dim=-1).indices.int().cpu())
            elif support == "vocab":
                out[i] = (out[i], Support(None, row.cpu(), None))
            else:
                keep = support(i, row)                                            # [r, S]
                kept, tail = rsipo.support_logprobs(row, keep.to(row.device))     # [r, S], [r]
                out[i] = (out[i], Support(keep.int().cpu(), kept.cpu(), tail.cpu()))
    model.train(was_training)
    if sharded:
        model.reshard()
    return out


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


# ---------------------------------------------------------------------------------------------
# Evaluation on held-out tasks

# [ours] A greedy token that beat the runner-up by less than this many nats is a near-tie: float noise of another
# batch shape or world size (another padding, another matmul order) can flip it, and with it the episode.
NEAR_TIE = 1e-3


def evaluate(engine, pool, games: list[str], *, repeats: int, seed: int, history_len: int, temperature: float,
             constrained: bool = False, source_of: Optional[dict[str, str]] = None,
             stop: Optional[Callable[[], bool]] = None,
             skills: Optional[dict[str, str]] = None) -> tuple[dict, dict[str, float]]:
    """Success on held-out games (`repeats` episodes each, sampled at `temperature`, greedy at 0): the metrics
    (overall, per task type) and the success per game (for `paired_gain`); games split across ranks.
    `source_of` (task id → data source; search QA) adds the success per data source, `eval/success_<source>`,
    and their unweighted mean, `eval/success_source_mean`: the figure Search-R1 and its successors report
    (exact match per data set, then the mean over data sets). `stop`: as in `run_episodes` (the figures of an
    evaluation cut short mean nothing; the caller drops them). `skills` (game → skill): each game's episodes
    carry its skill in every prompt (§2.9), the skill's worth in the prompt, paired with the same evaluation
    without one (scripts/channel_check.py)."""
    mine = games[distributed.RANK::distributed.WORLD]
    # [ours] common random numbers, so that start-vs-end is paired and an unchanged policy scores the same
    # (the training RNG is left untouched). HF engine: every evaluation starts its rank's generator from
    # the same seed, which pairs the episodes for as long as they agree (one generator serves the batch).
    # vLLM: every request carries its own seed from (run seed, game, copy, turn), so each turn of each
    # episode draws the same numbers in every evaluation, whatever else is in the batch.
    seed = 1_000_003 * (seed + 1)
    cuda = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(seed + distributed.RANK)
        eps = run_episodes(engine, pool, [{pool.task_key: g} for g in mine], repeats, history_len=history_len,
                           temperature=temperature, greedy=temperature <= 0, constrained=constrained,
                           seed=seed, stop=stop,
                           skills={j: skills[g] for j, g in enumerate(mine) if g in skills} if skills else None) \
            if mine else []
    rows = [r for part in all_gather_obj([(e.task_type, e.won, len(e.steps), e.task_id, e.min_margin) for e in eps])
            for r in part]
    out = {"eval/success": float(np.mean([w for _, w, *_ in rows])) if rows else 0.0,
           "eval/episodes": len(rows), "eval/mean_steps": float(np.mean([r[2] for r in rows])) if rows else 0.0}
    if temperature <= 0:                  # greedy: episodes where a token won by less than NEAR_TIE
        out["eval/near_ties"] = sum(r[4] < NEAR_TIE for r in rows)
    out.update({f"eval/success_{t}": v for t, v in mean_by((t, w) for t, w, *_ in rows).items()})
    if source_of and rows:
        by_source = mean_by((source_of[r[3]], r[1]) for r in rows)
        out.update({f"eval/success_{src}": v for src, v in by_source.items()})
        out["eval/success_source_mean"] = float(np.mean(list(by_source.values())))
    return out, mean_by((r[3], r[1]) for r in rows)


def by_task(xs: list, n: int) -> list[list]:
    """`run_episodes`' task-major list cut into its tasks' groups of `n` (episode i belongs to task i // n)."""
    return [xs[k:k + n] for k in range(0, len(xs), n)]


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


def round_robin_by_type(ids: list[str], type_of: dict[str, str]) -> list[str]:
    """`ids` reordered round-robin over their task types (sorted type names, each type's own order kept),
    so that any prefix covers all types: the held-out games of an `--eval_games` evaluation."""
    by_type: dict[str, list[str]] = {}
    for i in ids:
        by_type.setdefault(type_of[i], []).append(i)
    return [group[j] for j in range(max(map(len, by_type.values()), default=0))
            for _, group in sorted(by_type.items()) if j < len(group)]
