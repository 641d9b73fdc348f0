"""Rollout: typed records, generation engines and the lock-step multi-turn loop (DESIGN §2 step 1, §3).

Contract
--------
* `Turn` is one training sample: the prompt the policy saw at one step of one episode, the
  response it sampled, a per-token `loss_mask` over the response, the sampler's log-probs (for
  diagnostics only: the trainer recomputes old log-probs), whether the response had a parsable
  action (`invalid` → the format penalty), and the task / group / episode it belongs to.
* `Episode` holds its turns, the episode reward (ALFWorld: 10 on a win), `won`, the (observation,
  action) steps that the skill analyzer reads, and any env error.
* Engines share one interface, `generate(prompts, ...) -> list[Generation]` over plain-text user
  prompts (the engine applies the tokenizer's chat template). `HFEngine` batches Hugging Face
  `generate` (left padding, KV cache, temperature / top-p, stop at `</action>`); the vLLM engine
  (GPU) implements the same call.
* `run_episodes` plays N episodes per task from the same initial state in lock-step: one batched
  generate for every still-active episode per turn, one batched step of the env pool.

Choices, all **[ours]**:
1. `allowed_actions` decoding (off by default; on only in the tiny CPU preset): generation is
   limited to token sequences `<think> </think> <action> {an admissible action} </action>`. This
   departs from the paper's free decoding; it makes a 0.5 M-parameter model learnable in minutes.
   The trainer still scores the sampled tokens under the unconstrained policy.
2. A response with no parsable action is sent to the env as an empty command ("Nothing happens.",
   one step spent) and flagged `invalid` for the format penalty.

Test: pytest tests/test_rollout.py
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from envs import TASK_PREFIX, build_prompt, parse_action
from skills import insert_skill

STOP_TEXT = "</action>"


@dataclass
class Turn:
    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]                       # 1 on response tokens that are trained
    sampler_logprobs: list[float]
    invalid: bool                              # no parsable action → format penalty
    task_id: str
    task_type: str
    group_id: int
    episode_id: int
    step: int
    prompt_text: str = ""
    response_text: str = ""


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


@dataclass
class Generation:
    text: str
    token_ids: list[int]
    logprobs: list[float]
    prompt_ids: list[int]


def chat_ids(tokenizer, prompt: str) -> list[int]:
    """Token ids of a single-turn chat prompt with the generation header (the chat template)."""
    msgs = [{"role": "user", "content": prompt}]
    out = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    if isinstance(out, dict) or hasattr(out, "keys"):
        out = out["input_ids"]
    return list(out)


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


class HFEngine:
    """Batched Hugging Face generation for CPU runs and tests (same interface as the vLLM engine)."""

    def __init__(self, model, tokenizer, max_new_tokens: int = 512, temperature: float = 1.0,
                 top_p: float = 1.0, max_prompt_tokens: int = 2048):
        self.model, self.tok = model, tokenizer
        self.max_new_tokens, self.temperature, self.top_p = max_new_tokens, temperature, top_p
        self.max_prompt_tokens = max_prompt_tokens
        stop = tokenizer.encode(STOP_TEXT, add_special_tokens=False)
        self.stop_id = stop[0] if len(stop) == 1 else None  # one token in the tiny vocabulary
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def encode(self, prompt: str) -> list[int]:
        ids = chat_ids(self.tok, prompt)
        return ids[-self.max_prompt_tokens:]

    @torch.no_grad()
    def generate(self, prompts: list[str], temperature: Optional[float] = None, greedy: bool = False,
                 allowed_actions: Optional[list[list[str]]] = None, max_new_tokens: Optional[int] = None,
                 stop: bool = True, batch_size: int = 64) -> list[Generation]:
        out: list[Generation] = []
        for i in range(0, len(prompts), batch_size):
            chunk = prompts[i:i + batch_size]
            allow = allowed_actions[i:i + batch_size] if allowed_actions is not None else None
            out += self._generate(chunk, temperature, greedy, allow, max_new_tokens, stop)
        return out

    def _generate(self, prompts, temperature, greedy, allowed_actions, max_new_tokens, stop):
        temperature = self.temperature if temperature is None else temperature
        ids = [self.encode(p) for p in prompts]
        L = max(len(x) for x in ids)
        input_ids = torch.full((len(ids), L), self.pad_id, dtype=torch.long)         # [B, L] left-padded
        attn = torch.zeros((len(ids), L), dtype=torch.long)
        for b, x in enumerate(ids):
            input_ids[b, L - len(x):] = torch.tensor(x)
            attn[b, L - len(x):] = 1
        eos = [self.tok.eos_token_id] + ([self.stop_id] if (stop and self.stop_id is not None) else [])
        kw = dict(max_new_tokens=max_new_tokens or self.max_new_tokens, pad_token_id=self.pad_id,
                  eos_token_id=eos, output_scores=True, return_dict_in_generate=True)
        if stop and self.stop_id is None:
            kw.update(stop_strings=[STOP_TEXT], tokenizer=self.tok)
        if greedy or temperature <= 0:
            kw.update(do_sample=False)
        else:
            kw.update(do_sample=True, temperature=temperature, top_p=self.top_p, top_k=0)
        if allowed_actions is not None:
            tries = []
            for acts in allowed_actions:
                seqs = [self.tok.encode(f"<think> </think> <action> {a} {STOP_TEXT}", add_special_tokens=False)
                        for a in acts]
                tries.append(_PrefixTrie(seqs, self.tok.eos_token_id))
            kw["prefix_allowed_tokens_fn"] = lambda b, seq: tries[b].allowed(seq[L:].tolist())
        was_training = self.model.training
        self.model.eval()
        res = self.model.generate(input_ids=input_ids, attention_mask=attn, **kw)
        if was_training:
            self.model.train()
        seqs = res.sequences[:, L:]                                                   # [B, T]
        # Log-probs of the sampled tokens under the sampling distribution (diagnostics only).
        scores = torch.stack(res.scores, dim=1).float().log_softmax(-1)               # [B, T, V]
        lp = scores.gather(-1, seqs.unsqueeze(-1)).squeeze(-1)                        # [B, T]
        gens = []
        for b in range(len(prompts)):
            toks = seqs[b].tolist()
            n = len(toks)
            for j, t in enumerate(toks):
                if t in eos:
                    n = j + 1 if t == self.stop_id else j
                    break
            toks = toks[:n]
            text = self.tok.decode(toks, skip_special_tokens=False)
            if self.stop_id is None and STOP_TEXT in text:   # stop string: cut after it
                text = text[: text.index(STOP_TEXT) + len(STOP_TEXT)]
            gens.append(Generation(text, toks, lp[b, :n].tolist(), ids[b]))
        return gens


def run_episodes(engine, pool, tasks: list[dict], n_per_task: int, *, history_len: int = 5,
                 skills: Optional[dict[int, str]] = None, temperature: Optional[float] = None,
                 greedy: bool = False, constrained: bool = False, group_offset: int = 0,
                 progress: Optional[Callable[[int], None]] = None) -> list[Episode]:
    """Play `n_per_task` episodes of every task in lock-step; all copies of a task start identically.

    tasks: dicts with `gamefile` (and optional `task_type`); skills: task index → skill text that is
    inserted after the task line of every prompt (teacher context / replay). Returns the episodes
    in task-major order; episode i belongs to task i // n_per_task, group id group_offset + that.
    """
    gamefiles = [t["gamefile"] for t in tasks for _ in range(n_per_task)]
    starts = pool.reset(gamefiles)
    eps: list[Episode] = []
    obs, adm = [], []
    for i, (o, info) in enumerate(starts):
        k = i // n_per_task
        ep = Episode(task_id=gamefiles[i], task_type=info.get("task_type", tasks[k].get("task_type", "")),
                     task=info.get("task", ""), group_id=group_offset + k, episode_id=i,
                     skill=(skills or {}).get(k))
        if info.get("error"):
            ep.error = info["error"]
        eps.append(ep)
        obs.append(o)
        adm.append(info.get("admissible", []))
    active = [ep.error is None for ep in eps]
    step = 0
    while any(active):
        idx = [i for i, a in enumerate(active) if a]
        prompts = []
        for i in idx:
            ep = eps[i]
            p = build_prompt(ep.task, obs[i], adm[i], ep.steps, history_len=history_len)
            if ep.skill:
                p = insert_skill(p, ep.skill, TASK_PREFIX + ep.task)
            prompts.append(p)
        gens = engine.generate(prompts, temperature=temperature, greedy=greedy,
                               allowed_actions=[adm[i] for i in idx] if constrained else None)
        actions: list[Optional[str]] = [None] * len(eps)
        for i, p, g in zip(idx, prompts, gens):
            act = parse_action(g.text)
            ep = eps[i]
            ep.turns.append(Turn(prompt_ids=g.prompt_ids, response_ids=g.token_ids,
                                 loss_mask=[1] * len(g.token_ids), sampler_logprobs=g.logprobs,
                                 invalid=act is None, task_id=ep.task_id, task_type=ep.task_type,
                                 group_id=ep.group_id, episode_id=ep.episode_id, step=step,
                                 prompt_text=p, response_text=g.text))
            actions[i] = act if act is not None else ""
        results = pool.step(actions)
        for i in idx:
            r = results[i]
            ep = eps[i]
            if r is None:   # the pool says this episode was already finished
                active[i] = False
                continue
            o, reward, done, info = r
            ep.steps.append((obs[i], actions[i]))
            ep.reward += float(reward)
            ep.won = ep.won or bool(info.get("won", False))
            if info.get("error"):
                ep.error = info["error"]
            obs[i], adm[i] = o, info.get("admissible", [])
            if done:
                active[i] = False
        step += 1
        if progress:
            progress(step)
    return eps
