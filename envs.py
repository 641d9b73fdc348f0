"""Environments: the env and pool interface, ALFWorld and search QA behind it (each with its turn
prompt and action parser) and their lock-step pools (METHOD.md §7). What the
envs run on (game data, the engine, QA data, retrievers) is infra/env_backends.py.

Contract
--------
* An env: `reset(task) -> (obs, info)`, `step(action_text) -> (obs, reward, done, info)`; `info`
  always has won, task_type (short), task (the task sentence or the question), admissible, steps,
  truncated, invalid_action and error (None unless the episode failed).
* A pool, what `rollout.run_episodes` drives: `reset(tasks) -> [(obs, info)]` (a task may repeat:
  each copy is its own episode), `step(actions) -> [(obs, reward, done, info) or None]` (None once
  an episode is over), `active`, `stats`, `close()` or `with`; and its env family's `task_key`,
  `task_prefix`, `stop_texts`, `build_prompt` (the turn prompt), `parse_action` and `task_terms` (what a
  skill for the task must name, train.write_skills' skill rule) (pure functions).
* ALFWorld: `AlfWorldEnv(max_steps=50)` plays a gamefile on the real engine, reward `R_WIN` = 10 on
  the winning step, prompt: the verl-agent/GiGPO template in our words. `EnvPool(num_workers,
  max_steps, step_timeout, env_class=AlfWorldEnv)` runs the episodes in worker processes.
* Search QA (Search-R1): `SearchEnv(retriever, tasks, max_turns=4, top_k=3)`: `<search> q </search>`
  returns passages, `<answer> a </answer>` ends the episode, reward `R_EM` = 1 on an exact match;
  prompt: Search-R1's instruction in our words. `SearchPool`: EnvPool's calls, in-process.

Choices the paper leaves open, all **[ours]** (details in the docstring named):
1. An empty, non-ASCII or over-200-character ALFWorld action (or None) is an invalid action that
   costs a step and never reaches the engine (`_check_action`): no admissible command looks so.
2. `parse_action` reads the last closed <action> pair and normalises it; <think> is not checked:
   the format penalty is about a parsable action only. verl-agent requires <think>...</think> and takes
   the first <action>; generation stops at the first </action>, so first and last are the same pair.
3. Prompts put each observation on one line and number history entries with their real step
   numbers; the task (question) line stands alone, where skills.py inserts a skill (`build_prompt`).
4. Each live episode needs its own copy of Fast Downward's library (one global state; 33 MB,
   ~0.1 s to copy): an AlfWorldEnv keeps its copy for life and pool workers reuse their envs.
5. Workers are spawned, not forked: safe next to torch, CUDA and threads, at ~1-2 s a worker.
   They ignore SIGINT and exit when their pipe closes: a killed parent leaves none behind.
6. A worker that dies or misses its per-message timeout fails only its own episodes and is
   replaced at once; a game that cannot load fails only its own episode (`EnvPool`).
7. A search turn is valid only with exactly one <search> or <answer> pair (`split_search_action`);
   anything else is an invalid turn (the trainer charges p_fmt). Non-ASCII is valid ("Zürich").
   Search-R1 acts on the first pair, scores the last <answer> (`qa_em.py`), and matches tags case-
   sensitively with no length cap; ours refuses two actions in one turn (one reading for the format
   penalty), takes <Answer>, and caps an answer at 200 characters. Generation stops at the first
   closing tag, so a turn holds one pair and the readings agree on what models write.
8. The search pool runs in-process (a search step takes milliseconds): one batched retrieval per
   lock-step under `timeout`; a failed one fails the episodes that searched (`SearchPool`).
9. Each search turn is a fresh prompt (question + last turns), as for ALFWorld, where Search-R1
   appends to one growing context (`build_search_prompt`).
10. The skill rule's terms (`task_terms`, `names_task`): an ALFWorld skill must name the object and the
    target of its task sentence, read off the template; a search skill has no such terms.

Test: tests/test_envs.py, tests/test_search.py; speed: scripts/bench_env.py, scripts/bench_search.py.
"""

from __future__ import annotations

import os
import re
import string
from dataclasses import dataclass, field

from infra.env_workers import WorkerPool
from infra.env_backends import (BM25Retriever, EnvDataError, GameCache, HTTPRetriever, RetrieverError, RetrieverTimeout,
                                _Game, _make_engine, call_with_timeout, game_task_type, list_games, list_qa,
                                process_cache)

R_WIN = 10.0  # reward on the winning step (verl-agent / SEED ALFWorld setting)
TASK_PREFIX = "Your task is to: "  # the task line of the intro and of the prompt
NOTHING_HAPPENS = "Nothing happens."  # the engine's answer to a command that is not admissible
MAX_ACTION_CHARS = 200  # longer action texts are invalid [ours]


def task_from_intro(intro: str) -> str:
    """The task sentence of an intro text ("... Your task is to: put a mug in sink." -> "put a mug
    in sink."), whitespace collapsed; EnvDataError when the text has no task line."""
    if TASK_PREFIX not in intro:
        raise EnvDataError(f"the intro has no {TASK_PREFIX!r} line: {intro[:200]!r}")
    return " ".join(intro.rsplit(TASK_PREFIX, 1)[1].split())


# ---------------------------------------------------------------------------------------------
# One episode at a time


def _check_action(action) -> str | None:
    """The action text to send to the engine, or None when it is invalid (choice 1).

    The text is stripped; an empty, non-ASCII or over-MAX_ACTION_CHARS action (or None) is invalid:
    AlfWorldEnv.step answers "Nothing happens." without calling the engine, sets
    `info["invalid_action"]`, and counts the step. Otherwise the text goes to the engine as is (it
    matches exact, lowercase commands; `parse_action` already normalises)."""
    if not isinstance(action, str):
        return None
    action = action.strip()
    if not action or len(action) > MAX_ACTION_CHARS or not action.isascii():
        return None
    return action


class AlfWorldEnv:
    """One ALFWorld episode at a time on the real engine (env_backends: textworld's PddlEnv, loaded
    through alfworld's AlfredDemangler). reset(gamefile) -> (obs, info); step(action) -> (obs,
    reward, done, info).

    The first observation is the game's intro, ending in "Your task is to: ..."; it is the same
    string every time for the same game. Reward is R_WIN on the step that wins, else 0; `done` when
    won or after `max_steps` steps (`info["truncated"]`). A command that is not admissible goes to
    the engine, which answers "Nothing happens."; an invalid action (`_check_action`) does not.
    `info`: won, task_type (short), task (the task sentence as the intro states it, with its period:
    "put a clean apple in fridge.", `task_from_intro`), admissible (sorted, without "help"),
    gamefile (absolute), steps, truncated, invalid_action, error (None).
    max_steps: the episode ends (info["truncated"]) after this many steps without a win.
    cache: where loaded games are kept; None shares the process-wide `process_cache()`.
    The engine (a private copy of Fast Downward's library) is made at the first reset and kept for
    the env's lifetime (choice 4).
    """

    def __init__(self, max_steps: int = 50, cache: GameCache | None = None):
        if max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {max_steps}")
        self.max_steps = max_steps
        self.cache = cache if cache is not None else process_cache()
        self._engine = None  # created at the first reset (copies Fast Downward's library)
        self._game: _Game | None = None
        self._state = None
        self.steps = 0
        self.won = False
        self.done = True

    @staticmethod
    def blank_info(gamefile: str) -> dict:
        """The info of an episode that has not started, or could not (the pool's, before a reset answers)."""
        return {"won": False, "task_type": None, "task": None, "admissible": [], "gamefile": gamefile, "steps": 0,
                "truncated": False, "invalid_action": False, "error": None}

    def _info(self, *, truncated=False, invalid_action=False) -> dict:
        game = self._game
        admissible = [c for c in self._state["admissible_commands"] if c != "help"]
        return {"won": self.won, "task_type": game.task_type, "task": game.task,
                "admissible": sorted(admissible), "gamefile": game.path, "steps": self.steps,
                "truncated": truncated, "invalid_action": invalid_action, "error": None}

    def reset(self, gamefile: str) -> tuple[str, dict]:
        """Start an episode of `gamefile` from its initial state; returns (intro text, info)."""
        game = self.cache.get(gamefile)
        if self._engine is None:
            self._engine = _make_engine()
        self._game, self.steps, self.won, self.done = game, 0, False, False
        try:
            self._state = self._engine.start(game)
            if game.task is None:
                game.task = task_from_intro(self._state.feedback)
        except Exception as e:
            self._game, self.done = None, True
            raise EnvDataError(f"cannot start game {game.path}: {type(e).__name__}: {e}") from e
        return self._state.feedback, self._info()

    def step(self, action: str | None) -> tuple[str, float, bool, dict]:
        """One command; reward R_WIN on the winning step; done when won or out of steps."""
        if self._game is None:
            raise RuntimeError("AlfWorldEnv.step before reset")
        if self.done:
            raise RuntimeError("AlfWorldEnv.step after the episode ended; call reset")
        command = _check_action(action)
        self.steps += 1
        if command is None:
            obs, invalid = NOTHING_HAPPENS, True  # not sent to the engine; the state is unchanged
        else:
            self._state, _, _ = self._engine.step(command)
            obs, invalid = self._state.feedback, False
        reward = 0.0
        if not invalid and self._state["won"]:
            self.won, reward = True, R_WIN
        truncated = not self.won and self.steps >= self.max_steps
        self.done = self.won or truncated
        return obs, reward, self.done, self._info(truncated=truncated, invalid_action=invalid)

    def close(self) -> None:
        self._engine = self._state = self._game = None
        self.done = True


# ---------------------------------------------------------------------------------------------
# Prompt and action parsing (pure functions)

PROMPT_HEAD = "You are an expert agent operating in the ALFRED embodied environment."
PROMPT_TAIL = ("Now it's your turn to take an action. First reason inside <think> </think>, "
               "then give exactly one action inside <action> </action>.")


def _one_line(text) -> str:
    return " ".join(str(text).split())


def build_prompt(task: str, obs: str, admissible, history, history_len: int = 5,
                 with_admissible: bool = True) -> str:
    """The ALFWorld turn prompt (the verl-agent/GiGPO template in our words).

    history: all (observation, action) pairs of the episode so far, oldest first; the last
    `history_len` are shown, one line each, numbered with their real step numbers (with
    history_len 5 and 12 steps taken, the block shows steps 8-12); an empty history omits the
    whole history sentence. Every observation's whitespace is collapsed to one line. The task is
    its own line, `Your task is to: <task>`, so that skills.py can insert a skill right after it."""
    history = list(history)
    n = len(history)
    shown = history[n - history_len:] if history_len > 0 else []
    lines = [PROMPT_HEAD, TASK_PREFIX + _one_line(task)]
    if shown:
        first = n - len(shown) + 1
        lines.append(f"Prior to this step, you have already taken {n} step(s). Below are the most "
                     f"recent {len(shown)} observations and the corresponding actions you took:")
        lines += [f"[Observation {first + j}: '{_one_line(o)}', Action {first + j}: '{_one_line(a)}']"
                  for j, (o, a) in enumerate(shown)]
    lines.append(f"You are now at step {n + 1} and your current observation is: {_one_line(obs)}")
    if with_admissible:
        actions = ", ".join(f"'{a}'" for a in admissible)
        lines.append(f"Your admissible actions of the current situation are: [{actions}].")
    lines.append(PROMPT_TAIL)
    return "\n".join(lines)


# An <action> ... </action> pair with no other <action> opening inside it.
_ACTION_RE = re.compile(r"<action>((?:(?!<action>).)*?)</action>", re.IGNORECASE | re.DOTALL)


def parse_action(text: str) -> str | None:
    """The last well-formed <action>...</action> of a model output, normalised, or None (choice 2).

    Takes the content of the last complete pair (tags case-insensitive and exact, no spaces inside
    the tag), strips it, collapses runs of spaces and tabs, lowercases it; None when there is no
    closed pair, or the action is empty, over MAX_ACTION_CHARS, non-ASCII or spans lines. The
    <think> block is optional and not checked."""
    if not isinstance(text, str):
        return None
    found = _ACTION_RE.findall(text)
    if not found:
        return None
    action = found[-1].strip()
    if not action or "\n" in action or "\r" in action or not action.isascii():
        return None
    action = " ".join(action.split()).lower()
    if len(action) > MAX_ACTION_CHARS:
        return None
    return action


# The task sentences of ALFWorld's goal templates (alfworld's goal_library), each naming the object and the
# target: the receptacle, or for look the lamp.
_TASK_TEMPLATES = [re.compile(p) for p in (
    r"^put a (?:clean|hot|cool) (?P<obj>[a-z0-9]+) (?:in|on) (?P<target>[a-z0-9]+)\.?$",
    r"^(?:clean|heat|cool) some (?P<obj>[a-z0-9]+) and put it (?:in|on) (?P<target>[a-z0-9]+)\.?$",
    r"^put two (?P<obj>[a-z0-9]+) (?:in|on) (?P<target>[a-z0-9]+)\.?$",
    r"^find two (?P<obj>[a-z0-9]+) and put them (?:in|on) (?P<target>[a-z0-9]+)\.?$",
    r"^put (?:a|some) (?P<obj>[a-z0-9]+) (?:in|on) (?P<target>[a-z0-9]+)\.?$",
    r"^look at (?P<obj>[a-z0-9]+) under the (?P<target>[a-z0-9]+)\.?$",
    r"^examine the (?P<obj>[a-z0-9]+) with the (?P<target>[a-z0-9]+)\.?$")]


def format_action(action: str) -> str:
    """The whole response that takes `action` (what constrained decoding allows, and the warm start's target)."""
    return f"<think> </think> <action> {action} </action>"


def task_terms(task: str) -> tuple[str, ...]:
    """The object and the target an ALFWorld task sentence names ("put a clean apple in fridge." → (apple,
    fridge)), or () for a sentence of no known template: the words a skill for the task must name under the
    skill rule (`names_task`)."""
    text = " ".join(task.lower().split())
    for pattern in _TASK_TEMPLATES:
        m = pattern.match(text)
        if m:
            return m["obj"], m["target"]
    return ()


# ---------------------------------------------------------------------------------------------
# Worker pool


class EnvPool(WorkerPool):
    """Episodes of AlfWorldEnv stepped in lock-step by `num_workers` worker processes.

    `reset(gamefiles)` starts one episode per entry, each in its own env inside a worker: episode i
    of a batch runs in worker i % num_workers (`pids[w]` is worker w's process id); the same game
    may appear many times, each copy with its own engine state. `step(actions)` advances every
    active episode by one action, one message per worker, and returns None for episodes that are
    over; `None` as the action of an active episode is an invalid action (`_check_action`).
    Failures (choice 6), each counted in `stats` (errors = failed episodes, crashes, timeouts,
    restarts), and the caller goes on:
    * a worker that dies, or does not answer a step within `step_timeout` (a reset, which may load
      many games, within `reset_timeout`), ends its active episodes as failed (done, reward 0, won
      False, `info["error"]` "worker crashed" / "timeout") and is killed (its episodes' states are
      gone) and replaced at once; a replacement that cannot start within `start_timeout` raises:
      that is a broken install;
    * a gamefile that cannot be loaded fails only its own episode: `reset` returns ("", info) with
      `info["error"]` set, and the episode is inactive (`active[i]` False, `step` returns None).
    Workers are spawned (choice 5): each start, at construction and at each restart, costs ~1-2 s
    of imports. `close()` (or `with EnvPool(...) as pool:`) stops them.
    env_class: the env each worker runs an episode in, called as `env_class(max_steps, cache=...)`:
    AlfWorldEnv or a subclass of it (another reward, extra logging, a test double). Workers are
    spawned, so it travels by name: define it at the top level of an importable module.
    """

    # What `rollout.run_episodes` takes from an env family (SearchPool has the search ones).
    task_key = "gamefile"
    task_prefix = TASK_PREFIX
    stop_texts = ("</action>",)
    build_prompt = staticmethod(build_prompt)
    parse_action = staticmethod(parse_action)
    format_action = staticmethod(format_action)
    task_terms = staticmethod(task_terms)

    def __init__(self, num_workers: int = 2, max_steps: int = 50, step_timeout: float = 30.0,
                 reset_timeout: float = 120.0, start_timeout: float = 120.0,
                 env_class: type[AlfWorldEnv] = AlfWorldEnv):
        super().__init__(env_class, num_workers, max_steps, step_timeout, reset_timeout, start_timeout)


# =============================================================================================
# Search QA (Search-R1 protocol): the env, its prompt and parser, its in-process pool

QUESTION_PREFIX = "Question: "  # the task line of a search prompt (skills are inserted after it)
R_EM = 1.0  # reward of an exactly matching answer
MAX_QUERY_CHARS = 300  # longer queries are invalid turns [ours]
MAX_ANSWER_CHARS = 200  # longer answers are invalid turns [ours]
SEARCH_STOP_TEXTS = ("</search>", "</answer>")  # generation stops after the first action tag
INVALID_SEARCH_OBS = ("Invalid turn: give exactly one <search> query </search> or one "
                      "<answer> answer </answer>.")
NO_RESULTS = "No results."


# -- answers


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lowercase, drop punctuation, drop the articles a/an/the, collapse spaces."""
    text = str(text).lower()
    text = "".join(ch for ch in text if ch not in _PUNCT)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


_PUNCT = frozenset(string.punctuation)


def exact_match(prediction: str, golds) -> bool:
    """True when the normalised prediction equals any normalised gold answer."""
    if isinstance(golds, str):
        golds = [golds]
    pred = normalize_answer(prediction)
    return any(pred == normalize_answer(g) for g in golds)


# -- tags

_SEARCH_TAG_RE = re.compile(r"<(/?)(search|answer)>", re.IGNORECASE)


def split_search_action(text) -> tuple[str, str] | None:
    """("search" | "answer", content) of a model output, or None when the turn is invalid (choice 7).

    Valid: exactly one opening and one closing tag in total over <search>/<answer>, the closing
    after the opening and of the same name; the content, whitespace collapsed, is non-empty and
    within MAX_QUERY_CHARS (search) / MAX_ANSWER_CHARS (answer). So unclosed tags, several actions,
    mismatched pairs, an empty content and over-long text are invalid turns (SearchEnv answers
    INVALID_SEARCH_OBS, sets `invalid_action`, and the turn is spent). Everything outside the pair
    (e.g. <think>) is ignored. Non-ASCII content is valid (real answers have accents: "Zürich").
    An answer before any search is a valid turn and is scored (Search-R1 allows direct answers).
    """
    if not isinstance(text, str):
        return None
    tags = list(_SEARCH_TAG_RE.finditer(text))
    if len(tags) != 2:
        return None  # no action, an unclosed tag, or several actions
    (o, c) = tags
    name = o.group(2).lower()
    if o.group(1) or not c.group(1) or c.group(2).lower() != name:
        return None
    content = " ".join(text[o.end():c.start()].split())
    limit = MAX_QUERY_CHARS if name == "search" else MAX_ANSWER_CHARS
    if not content or len(content) > limit:
        return None
    return name, content


def parse_search_action(text) -> str | None:
    """The canonical action text "<search> q </search>" / "<answer> a </answer>", or None."""
    parsed = split_search_action(text)
    return None if parsed is None else f"<{parsed[0]}> {parsed[1]} </{parsed[0]}>"


def format_passages(passages: list[dict]) -> str:
    """The observation after a search: the passages as Search-R1 writes them, `Doc i(Title: "t") text` a line
    (its title is wiki-18's quoted first line of `contents`), in <information>."""
    if not passages:
        return f"<information> {NO_RESULTS} </information>"
    docs = [f'Doc {i}(Title: "{_one_line(p.get("title", ""))}") {_one_line(p.get("text", ""))}'
            for i, p in enumerate(passages, 1)]
    return "<information> " + "\n".join(docs) + " </information>"


SEARCH_HEAD = ("Answer the question. Reason inside <think> </think> first. When you lack knowledge, "
                "search with <search> query </search>; the top results come back inside "
                "<information> </information>. You may search several times. When you know the "
                "answer, give only the answer inside <answer> </answer>, for example "
                "<answer> Paris </answer>.")


def build_search_prompt(question: str, obs: str, admissible=None, history=(), history_len: int = 4) -> str:
    """The turn prompt of the search env (Search-R1's instruction in our words).

    The question is its own line, `Question: ...`, where skills are inserted. history: all
    (observation, action) pairs so far, oldest first; obs: the result of the last action. Turn k
    is shown as `Turn k: <action>` followed by its result; the last max(history_len, 1) turns are
    shown (the latest result is always visible). Each turn is a fresh prompt (choice 9).
    `admissible` is accepted for the common interface and ignored.
    """
    history = list(history)
    n = len(history)
    start = max(0, n - max(history_len, 1))
    lines = [SEARCH_HEAD, QUESTION_PREFIX + _one_line(question)]
    if start:
        lines.append(f"({start} earlier turn(s) not shown)")
    for j in range(start, n):
        result = history[j + 1][0] if j + 1 < n else obs
        lines.append(f"Turn {j + 1}: {_one_line(history[j][1])}")
        lines.append(str(result).strip())
    lines.append(f"Now write turn {n + 1}.")
    return "\n".join(lines)


# -- the env


class SearchEnv:
    """One search episode at a time: reset(task) -> (obs, info); step(text) -> (obs, reward, done, info).

    task: a question record (`env_backends.load_qa`) or its id in `tasks`. The first observation
    is "" (nothing searched yet). Every step is one turn: a valid `<search> q </search>` returns
    `format_passages` of the top `top_k` passages, `<information> Doc 1(Title: "t") text ...
    </information>` ("No results." when no passage shares a word with q); a valid `<answer> a
    </answer>` ends the episode with reward R_EM when `exact_match` holds against any gold answer
    (`won`), else 0; an invalid turn returns INVALID_SEARCH_OBS with `invalid_action` True. After
    `max_turns` turns without an answer the episode ends (`truncated`, reward 0). A retriever error
    or timeout ends the episode as failed (`error` set, reward 0). `info`: won, task_type, task
    (the question), id, golden_answers, admissible ([]), steps, searches, truncated,
    invalid_action, answer, error.
    """

    def __init__(self, retriever, tasks: dict | None = None, max_turns: int = 4, top_k: int = 3,
                 timeout: float = 1.0):
        self.retriever = retriever
        self.tasks = tasks or {}
        self.max_turns = max_turns
        self.top_k = top_k
        self.timeout = timeout
        self.task: dict | None = None
        self.done = True

    def reset(self, task) -> tuple[str, dict]:
        if isinstance(task, str):
            if task not in self.tasks:
                raise EnvDataError(f"unknown question id {task!r}")
            task = self.tasks[task]
        self.task, self.turns, self.searches, self.done, self.won = task, 0, 0, False, False
        return "", self._info()

    @staticmethod
    def blank_info(task_id: str) -> dict:
        """The info of an episode that has not started, or could not."""
        return {"won": False, "task_type": None, "task": None, "id": task_id, "admissible": [], "steps": 0,
                "truncated": False, "invalid_action": False, "error": None}

    def _info(self, **kw) -> dict:
        t = self.task
        info = {"won": self.won, "task_type": t["task_type"], "task": t["question"], "id": t["id"],
                "golden_answers": list(t["golden_answers"]), "admissible": [], "steps": self.turns,
                "searches": self.searches, "truncated": False, "invalid_action": False, "answer": None,
                "error": None}
        info.update(kw)
        return info

    def query_of(self, action_text) -> str | None:
        """The search query of a turn, if it is a valid search (what the pool batches)."""
        parsed = split_search_action(action_text)
        return parsed[1] if parsed and parsed[0] == "search" else None

    def apply(self, action_text, passages: list[dict] | None = None, error: str | None = None):
        """Advance one turn given the retrieval result of its query (the pool retrieves in batch)."""
        if self.task is None or self.done:
            raise RuntimeError("SearchEnv.step before reset or after the episode ended")
        self.turns += 1
        if error is not None:
            self.done = True
            return "", 0.0, True, self._info(error=error)
        parsed = split_search_action(action_text)
        reward, answer = 0.0, None
        if parsed is None:
            obs = INVALID_SEARCH_OBS
        elif parsed[0] == "search":
            self.searches += 1
            obs = format_passages(passages or [])
        else:
            answer = parsed[1]
            self.won = exact_match(answer, self.task["golden_answers"])
            reward, obs, self.done = (R_EM if self.won else 0.0), "", True
        truncated = not self.done and self.turns >= self.max_turns
        self.done = self.done or truncated
        return obs, reward, self.done, self._info(truncated=truncated, invalid_action=parsed is None, answer=answer)

    def step(self, action_text):
        query = None if self.done else self.query_of(action_text)
        if query is None:
            return self.apply(action_text)
        try:
            hits = call_with_timeout(lambda: self.retriever.search([query], self.top_k), self.timeout)[0]
        except RetrieverError as e:
            return self.apply(action_text, error=f"{type(e).__name__}: {e}")
        return self.apply(action_text, hits[:self.top_k])


def search_task_terms(question: str) -> tuple[str, ...]:
    """A question names no object and target of a fixed template: the skill rule asks nothing of search skills."""
    return ()


class SearchPool:
    """Many SearchEnv episodes stepped in lock-step, in-process (search is cheap; no workers).

    Same calls as EnvPool: reset(task_ids) (a question id may repeat: each copy is its own
    episode), step(actions) -> None for finished episodes, `stats`, close(), context manager.
    The queries of one lock-step go to the retriever in requests of at most `batch` queries, each in a
    daemon thread under a budget of `timeout` seconds per query it holds (`call_with_timeout`, choice 8)
    [ours]: a slow index (a flat E5 index without a GPU) gets time in proportion to the work, and a
    request that times out or raises RetrieverError fails only the episodes whose queries it held (done,
    reward 0, `error` set, counted in `stats`: errors, timeouts, retriever_errors); the run goes on, the
    hung thread is abandoned, never joined. An unknown
    question id fails only its episode. Also carries what `rollout.run_episodes` needs from an env
    family: task_key, task_prefix, stop_texts, build_prompt, parse_action.
    """

    task_key = "id"
    task_prefix = QUESTION_PREFIX
    stop_texts = SEARCH_STOP_TEXTS
    build_prompt = staticmethod(build_search_prompt)
    parse_action = staticmethod(parse_search_action)
    task_terms = staticmethod(search_task_terms)

    def __init__(self, retriever, tasks, max_turns: int = 4, top_k: int = 3, timeout: float = 1.0, batch: int = 32):
        if not isinstance(tasks, dict):
            tasks = {t["id"]: t for t in tasks}
        self.retriever = retriever
        self.tasks = tasks
        self.max_turns = max_turns
        self.top_k = top_k
        self.timeout = timeout
        self.batch = batch
        self.stats = {"errors": 0, "timeouts": 0, "retriever_errors": 0, "searches": 0}
        self.envs: list[SearchEnv] = []
        self.active: list[bool] = []
        self._closed = False

    def reset(self, task_ids: list[str]) -> list[tuple[str, dict]]:
        self._check_open()
        self.envs = []
        self.active = []
        out = []
        for tid in task_ids:
            env = SearchEnv(self.retriever, self.tasks, self.max_turns, self.top_k, self.timeout)
            if tid not in self.tasks:
                self.stats["errors"] += 1
                info = dict(SearchEnv.blank_info(tid), error=f"EnvDataError: unknown question id {tid!r}")
                self.envs.append(env)
                self.active.append(False)
                out.append(("", info))
                continue
            out.append(env.reset(tid))
            self.envs.append(env)
            self.active.append(True)
        return out

    def step(self, actions: list) -> list:
        self._check_open()
        if len(actions) != len(self.envs):
            raise ValueError(f"SearchPool.step got {len(actions)} actions for {len(self.envs)} episodes")
        live = [i for i, a in enumerate(self.active) if a]
        queries = {i: self.envs[i].query_of(actions[i]) for i in live}
        asked = [i for i in live if queries[i] is not None]
        hits: dict[int, list[dict]] = {}
        errors: dict[int, str] = {}
        self.stats["searches"] += len(asked)
        for part in (asked[j:j + self.batch] for j in range(0, len(asked), self.batch)):
            try:
                res = call_with_timeout(lambda part=part: self.retriever.search([queries[i] for i in part], self.top_k),
                                        self.timeout * len(part))
                if len(res) != len(part):
                    raise RetrieverError(f"the retriever returned {len(res)} result lists for {len(part)} queries")
                hits.update({i: r[:self.top_k] for i, r in zip(part, res)})
            except RetrieverError as e:
                self.stats["timeouts" if isinstance(e, RetrieverTimeout) else "retriever_errors"] += 1
                errors.update({i: f"{type(e).__name__}: {e}" for i in part})
        out: list = [None] * len(actions)
        for i in live:
            failed = i in errors
            r = self.envs[i].apply(actions[i], hits.get(i), errors.get(i))
            if failed:
                self.stats["errors"] += 1
            self.active[i] = not r[2]
            out[i] = r
        return out

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("SearchPool is closed")

    def close(self, timeout: float = 5.0) -> None:   # EnvPool's call; in-process, nothing to wait for
        self._closed = True

    def __enter__(self) -> "SearchPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------
# A run's tasks and pool, from its flags


@dataclass
class EnvData:
    """The tasks of one env family: task ids (gamefiles / question ids), their types, search records."""
    train: list[str]
    eval: list[str]
    task_type: dict[str, str]
    records: dict = field(default_factory=dict)   # search: question id → record (env_backends.load_qa)

    @property
    def train_types(self) -> list[str]:   # the task type of each training task, in order (train.draw_tasks)
        return [self.task_type[t] for t in self.train]


def env_data(args, types) -> EnvData:
    """The train and eval tasks of --env from --data_root's --train_split and --eval_split (`types`: the task
    types kept, None = all)."""
    if args.env == "search":
        tr = list_qa(args.data_root, args.train_split, types)
        ev = list_qa(args.data_root, args.eval_split, types)
        _refuse_overlap([r["id"] for r in tr], [r["id"] for r in ev], args)
        recs = {r["id"]: r for r in tr + ev}
        return EnvData([r["id"] for r in tr], [r["id"] for r in ev], {i: r["task_type"] for i, r in recs.items()}, recs)
    tr = list_games(args.data_root, args.train_split, types)
    ev = list_games(args.data_root, args.eval_split, types)
    _refuse_overlap(tr, ev, args)
    return EnvData(tr, ev, {g: game_task_type(g) for g in tr + ev})


def _refuse_overlap(train: list[str], held_out: list[str], args):
    """A task id in both splits would train on a held-out task (and, for search, one id would name two
    questions): refused, naming a few."""
    both = sorted(set(train) & set(held_out))
    if both and args.train_split != args.eval_split:
        raise EnvDataError(f"{len(both)} task ids are in both --train_split {args.train_split} and --eval_split "
                           f"{args.eval_split} of {args.data_root}, e.g. {both[:3]}: give each question an id unique "
                           "across the splits")


def make_pool(args, data: EnvData):
    """ALFWorld: worker processes. Search: in-process, BM25 over <data_root>/corpus.jsonl or HTTP."""
    if args.env != "search":
        return EnvPool(num_workers=args.env_workers, max_steps=args.max_turns)
    if args.retriever_url:   # per-try timeout: a third of the step's budget (the client retries twice)
        retriever = HTTPRetriever(args.retriever_url, timeout=args.retrieval_timeout * args.retrieval_batch / 3,
                                  retries=2)
    else:
        retriever = BM25Retriever(os.path.join(args.data_root, "corpus.jsonl"))
    return SearchPool(retriever, data.records, max_turns=args.max_turns, top_k=args.top_k,
                      timeout=args.retrieval_timeout, batch=args.retrieval_batch)

