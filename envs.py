"""Environments: ALFWorld on the real text engine, the turn prompt and action parsing, and a pool
of worker processes that steps many episodes in lock-step (DESIGN §3 "Environment interface").

Contract
--------
* Data. `list_games(data_root, split, task_types=None)` walks `<data_root>/json_2.1.1/<split>/`
  like alfworld's own collector (`AlfredTWEnv.collect_game_files`): every folder with a
  `traj_data.json` and a `game.tw-pddl` whose `solvable` is true is a game; the list is sorted, so
  the same data always gives the same order. Task types are the six official names or their short
  names (`TASK_TYPES`: pick, look, clean, heat, cool, pick2). Missing folders, empty splits,
  unknown task types and malformed files raise `EnvDataError` (a ValueError) naming the path.
  Games come from `alfworld-download` (the official 3,553/140/134 games) or from this project's
  generator, `python alfworld_gen.py --out data/alfworld`.
* `AlfWorldEnv(max_steps=50)`: `reset(gamefile) -> (obs, info)`, `step(action) -> (obs, reward,
  done, info)`. The engine is textworld's `PddlEnv` (Fast Downward's library for the state, the
  game's grammar for the text), loaded through alfworld's `AlfredDemangler` exactly as alfworld
  does ("apple 1", "fridge 1"). The first observation is the game's intro, ending in
  "Your task is to: ..."; it is the same string every time for the same game. Reward is
  `R_WIN` = 10 on the step that wins, else 0; `done` when won or after `max_steps` steps
  (`info["truncated"]`). A command that is not admissible goes to the engine, which answers
  "Nothing happens.". `info` always has: won, task_type (short), task (the task sentence as the
  intro states it, `task_from_intro`, e.g. "put a clean apple in fridge." with its period),
  admissible (sorted, without "help"), gamefile (absolute), steps, truncated, invalid_action,
  error (None unless the episode failed).
* `build_prompt(...)` / `parse_action(text)`: the turn prompt (the verl-agent/GiGPO ALFWorld
  template in our words; the task is its own line `Your task is to: <task>` so that skills.py can
  insert a skill right after it) and the action parser, both pure functions.
* `EnvPool(num_workers, max_steps, step_timeout)`: one `AlfWorldEnv` per episode inside worker
  processes; `reset(gamefiles)` starts one episode per entry (episode i runs in worker
  i % num_workers; the same game may appear many times, each copy is its own engine state),
  `step(actions)` advances every active episode by one action with one message per worker,
  returning None for episodes that are over. A worker that dies or exceeds `step_timeout` ends its
  active episodes as failed (done, reward 0, won False, `info["error"]` = "worker crashed" /
  "timeout"), is killed and replaced; `pool.stats` counts it; the caller goes on. `pool.pids`
  lists the worker processes; `close()` (or `with EnvPool(...) as pool:`) stops them.

Choices the paper leaves open, all **[ours]**:
1. Loaded games are cached per process (`GameCache`, LRU, 64 games): the expensive part of a
   load (parsing the grammar and the domain, translating PDDL to Fast Downward's SAS form,
   naming the objects) happens once per game; a reset then builds the initial state from the
   cached translation (`CachedPddlState`), about 3x cheaper than `PddlEnv.reset`, which
   translates twice. Output is identical (the tests replay the generator's stored traces).
   The second, planner-only translation is skipped: no planner ever runs here (no
   `policy_commands`, no replanning). This reaches into textworld 1.7's `PddlEnv`/`PddlState`
   private fields; the version is pinned.
2. Each live episode needs its own copy of Fast Downward's shared library (the library keeps one
   global state; `fast_downward.load_lib` copies the 33 MB file, ~0.1 s). An `AlfWorldEnv` owns
   one copy for its lifetime; pool workers keep a free list of envs and reuse them across
   episodes, so a worker holds as many copies as its largest batch of concurrent episodes.
3. Action text: stripped; an empty, non-ASCII or over-200-character action (or None) is not sent
   to the engine: the observation is "Nothing happens.", `info["invalid_action"]` is True, and it
   counts as a step. Otherwise the text goes to the engine as is (it matches exact, lowercase
   commands; `parse_action` already normalises).
4. `parse_action` takes the content of the *last* complete `<action>...</action>` pair (tags
   case-insensitive and exact, no spaces inside the tag), strips it, collapses runs of spaces and
   tabs, lowercases it; None when there is no closed pair, or the action is empty, over 200
   characters, non-ASCII or spans lines. The `<think>` block is optional and not checked (the
   format penalty is about a parsable action only).
5. The prompt collapses the whitespace of every observation to one line; history entries are one
   line each and numbered with their real step numbers (with H = 5 and 12 steps taken, the block
   shows steps 8-12). An empty history omits the whole history sentence.
6. Pool processes use the "spawn" start method: a fresh interpreter per worker, safe next to
   torch, CUDA and threads (fork is not), at the price of ~1-2 s start-up (imports) per worker,
   paid at construction and at each restart. Workers ignore SIGINT (the parent decides when to
   stop) and exit when their pipe closes, so a killed parent leaves no workers behind.
7. Timeouts are per worker message: `step_timeout` bounds one worker's reply to one lock-step
   (all its episodes); resets, which may load many games, get `reset_timeout` (default 120 s).
   A timed-out worker is killed (its episodes' states are gone) and replaced at once (a
   replacement that cannot start within `start_timeout` raises: that is a broken install).
8. A gamefile that cannot be loaded fails only its own episode: `reset` returns ("", info) with
   `info["error"]` set and the episode inactive (`pool.active[i]` False, `step` returns None).
   `None` as the action of an active episode counts as an invalid action (point 3).
9. `list_games` skips 'movable'/'Sliced' folders like alfworld, judged on the path below the split
   folder (so a data root whose own path contains "Sliced" still works); a game without a
   `solvable` key is skipped like alfworld does; a game.tw-pddl that is not valid JSON is an error.
10. Speed: textworld's grammar re-parses every text template with TatSu at every derivation
    (each admissible command and each feedback, every step: ~70% of a step). The two parses are
    pure functions of their strings, so `_install_textgen_memo` memoises them process-wide (deep
    copies of the symbol lists; the read-only condition Rules as they are): ~3.5x more steps/s
    with byte-identical texts (the tests replay stored traces and compare random play against an
    untouched textworld in a subprocess). `envs.MEMO_TEXTGEN = False` before the first reset (or
    before creating an EnvPool, whose workers inherit it) turns it off.

Run `python bench_env.py` for steps/s; test with `python -m pytest tests/test_envs.py -q`.
"""

from __future__ import annotations

import atexit
import copy
import functools
import json
import multiprocessing as mp
import os
import re
import signal
import sys
import time
import traceback
import weakref
from collections import Counter, OrderedDict, defaultdict
from dataclasses import dataclass
from multiprocessing.connection import wait as mp_wait

# The six official ALFWorld task types and the short names used in logs and metrics.
TASK_TYPES: dict[str, str] = {
    "pick_and_place_simple": "pick",
    "look_at_obj_in_light": "look",
    "pick_clean_then_place_in_recep": "clean",
    "pick_heat_then_place_in_recep": "heat",
    "pick_cool_then_place_in_recep": "cool",
    "pick_two_obj_and_place": "pick2",
}
TASK_TYPES_LONG: dict[str, str] = {short: long for long, short in TASK_TYPES.items()}
SHORT_TASK_TYPES: tuple[str, ...] = tuple(TASK_TYPES.values())

R_WIN = 10.0  # reward on the winning step (verl-agent / SEED ALFWorld setting)
TASK_PREFIX = "Your task is to: "  # the task line of the intro and of the prompt
NOTHING_HAPPENS = "Nothing happens."  # the engine's answer to a command that is not admissible
MAX_ACTION_CHARS = 200  # longer action texts are invalid [ours]
GAME_KEYS = ("pddl_domain", "grammar", "pddl_problem")  # required keys of a game.tw-pddl
_TEST_SLEEP = "__test_sleep__"  # "__test_sleep__ <seconds>": honoured only with _test_hooks=True


class EnvDataError(ValueError):
    """Missing, empty or malformed game data (the message names the path and the fix)."""


# ---------------------------------------------------------------------------------------------
# Game data


def _short_type(name: str) -> str:
    if name in TASK_TYPES:
        return TASK_TYPES[name]
    if name in TASK_TYPES_LONG:
        return name
    raise EnvDataError(f"unknown ALFWorld task type {name!r}; expected one of "
                       f"{list(SHORT_TASK_TYPES)} or {list(TASK_TYPES)}")


def _read_json(path: str, what: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise EnvDataError(f"malformed {what} {path}: invalid JSON ({e})") from None
    except OSError as e:
        raise EnvDataError(f"cannot read {what} {path}: {e}") from None
    if not isinstance(data, dict):
        raise EnvDataError(f"malformed {what} {path}: expected a JSON object, got {type(data).__name__}")
    return data


def _read_game(path: str) -> dict:
    """Read a game.tw-pddl and check its required keys."""
    data = _read_json(path, "game file")
    missing = [k for k in GAME_KEYS if not isinstance(data.get(k), str)]
    if missing:
        raise EnvDataError(f"malformed game file {path}: missing or non-text keys {missing} "
                           f"(a game.tw-pddl needs {list(GAME_KEYS)})")
    return data


def game_task_type(gamefile: str) -> str:
    """Short task type of a game, from the traj_data.json beside it (else the folder name)."""
    traj_path = os.path.join(os.path.dirname(gamefile), "traj_data.json")
    if os.path.exists(traj_path):
        task_type = _read_json(traj_path, "traj_data.json").get("task_type")
        if not isinstance(task_type, str):
            raise EnvDataError(f"malformed traj_data.json {traj_path}: no 'task_type'")
        return _short_type(task_type)
    # Official folder names start with the task type: <task_type>-<Obj>-<Mrecep>-<Recep>-<scene>.
    folder = os.path.basename(os.path.dirname(os.path.dirname(os.path.abspath(gamefile))))
    prefix = folder.split("-", 1)[0]
    if prefix in TASK_TYPES:
        return TASK_TYPES[prefix]
    raise EnvDataError(f"cannot tell the task type of {gamefile}: no traj_data.json beside it and "
                       f"the folder name {folder!r} does not start with a task type")


def list_games(data_root: str, split: str, task_types=None) -> list[str]:
    """Sorted paths of the solvable games of `split`, optionally only of some task types.

    task_types: None (all) or an iterable of short ('pick') or official ('pick_and_place_simple')
    names. Raises EnvDataError for a missing data root or split, unknown task types, malformed
    files, and when no game is found.
    """
    wanted = None
    if task_types is not None:
        if isinstance(task_types, str):
            task_types = [task_types]
        wanted = {_short_type(t) for t in task_types}
        if not wanted:
            raise EnvDataError("task_types is empty; pass None for all task types")
    fix = ("get the official games with `alfworld-download` (then data_root is $ALFWORLD_DATA) or "
           "generate games with `python alfworld_gen.py --out <data_root>`")
    if not os.path.isdir(data_root):
        raise EnvDataError(f"ALFWorld data root {data_root!r} does not exist; {fix}")
    base = os.path.join(data_root, "json_2.1.1")
    split_dir = os.path.join(base, split)
    if not os.path.isdir(split_dir):
        present = sorted(d for d in os.listdir(base) if os.path.isdir(os.path.join(base, d))) \
            if os.path.isdir(base) else []
        raise EnvDataError(f"no split folder {split_dir!r} (splits present: {present or 'none'}); {fix}")
    games, skipped = [], Counter()
    for root, dirs, files in os.walk(split_dir):
        dirs.sort()
        if "traj_data.json" not in files:
            continue
        rel = os.path.relpath(root, split_dir)
        if "movable" in rel or "Sliced" in rel:
            skipped["movable/sliced"] += 1
            continue
        game_path = os.path.join(root, "game.tw-pddl")
        if not os.path.exists(game_path):
            skipped["no game.tw-pddl"] += 1
            continue
        task_type = game_task_type(game_path)
        if wanted is not None and task_type not in wanted:
            continue
        game = _read_game(game_path)
        if "solvable" not in game:
            skipped["no 'solvable' key"] += 1
            continue
        if not game["solvable"]:
            skipped["unsolvable"] += 1
            continue
        games.append(game_path)
    if not games:
        types = sorted(wanted) if wanted else "any"
        raise EnvDataError(f"no games found in {split_dir!r} (task types: {types}; skipped: "
                           f"{dict(skipped) or 'none'}); {fix}")
    return sorted(games)


# ---------------------------------------------------------------------------------------------
# The engine: textworld's PddlEnv, loaded once per game per process


@dataclass
class _Game:
    """Everything about a game that does not change during an episode (shared, read-only)."""
    path: str
    data: dict  # the game.tw-pddl contents
    logic: object  # textworld.envs.pddl.logic.GameLogic (domain + grammar)
    entity_infos: dict  # PDDL id -> EntityInfo with alfworld's demangled name ("apple 1")
    fd_task: object  # Fast Downward's normalised task (actions, types, objects)
    sas: str  # its SAS translation
    sas_bytes: bytes  # the same, as loaded into an engine at every reset
    init_facts: list  # the problem's initial facts as textworld Propositions
    name2type: dict
    task_type: str  # short name
    task: str | None = None  # the task sentence ("put a clean apple in fridge."), set at first start


def _load_game(path: str, loader) -> _Game:
    """Load a game the way alfworld does (PddlEnv + AlfredDemangler) and keep the reusable parts."""
    data = _read_game(path)
    task_type = game_task_type(path)
    argv = sys.argv  # fast_downward.pddl2sas overwrites sys.argv (a hack inside it); restore it
    try:
        loader.load(data)  # AlfredDemangler.load: GameLogic, PddlState (translation), names
    except Exception as e:
        raise EnvDataError(f"cannot load game {path}: {type(e).__name__}: {e}") from e
    finally:
        sys.argv = argv
    env = loader.unwrapped
    pddl_state = env._pddl_state
    init_facts = [fact for fact in (_atom2proposition(atom, pddl_state.name2type)
                                    for atom in pddl_state.task.init) if fact is not None]
    return _Game(path=path, data=data, logic=env._logic, entity_infos=dict(env._entity_infos),
                 fd_task=pddl_state.task, sas=pddl_state.sas, sas_bytes=pddl_state.sas.encode("utf-8"),
                 init_facts=init_facts, name2type=dict(pddl_state.name2type), task_type=task_type)


def task_from_intro(intro: str) -> str:
    """The task sentence of an intro text ("... Your task is to: put a mug in sink." -> "put a mug
    in sink."), whitespace collapsed; EnvDataError when the text has no task line."""
    if TASK_PREFIX not in intro:
        raise EnvDataError(f"the intro has no {TASK_PREFIX!r} line: {intro[:200]!r}")
    return " ".join(intro.rsplit(TASK_PREFIX, 1)[1].split())


def _atom2proposition(atom, name2type):
    """Initial fact of the problem as a Proposition (textworld's PddlState.__init__, verbatim logic)."""
    import fast_downward
    from textworld.logic import Proposition, Variable
    if isinstance(atom, fast_downward.translate.pddl.conditions.Atom):
        if atom.predicate == "=":
            return None
        return Proposition(atom.predicate, [Variable(arg, name2type[arg]) for arg in atom.args])
    if isinstance(atom, fast_downward.translate.pddl.f_expression.Assign):
        if atom.fluent.symbol == "total-cost":
            return None
        name = "{}".format(atom.expression.value)
        if str.isdigit(name):  # distance relations
            return None
        return Proposition(name, [Variable(arg, name2type[arg]) for arg in atom.fluent.args])
    return None


class GameCache:
    """Per-process LRU cache of loaded games (point 1 of the docstring). Not thread-safe."""

    def __init__(self, capacity: int = 64):
        if capacity < 1:
            raise ValueError(f"GameCache capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._games: OrderedDict[str, _Game] = OrderedDict()
        self._loader = None
        self.hits = self.misses = 0

    def get(self, gamefile: str) -> _Game:
        key = os.path.abspath(gamefile)
        game = self._games.get(key)
        if game is not None:
            self.hits += 1
            self._games.move_to_end(key)
            return game
        self.misses += 1
        if not os.path.isfile(key):
            raise EnvDataError(f"game file {gamefile!r} does not exist")
        if self._loader is None:
            self._loader = _make_loader()
        game = _load_game(key, self._loader)
        self._games[key] = game
        while len(self._games) > self.capacity:
            self._games.popitem(last=False)
        return game

    def __len__(self) -> int:
        return len(self._games)

    def __contains__(self, gamefile: str) -> bool:
        return os.path.abspath(gamefile) in self._games


_PROCESS_CACHE: GameCache | None = None


def process_cache() -> GameCache:
    """The game cache shared by the AlfWorldEnvs of this process that were given none."""
    global _PROCESS_CACHE
    if _PROCESS_CACHE is None:
        _PROCESS_CACHE = GameCache()
    return _PROCESS_CACHE


def _env_infos():
    import textworld
    return textworld.EnvInfos(admissible_commands=True, won=True, facts=False)


def _make_loader():
    _engine_class()  # installs the template memo before the first grammar derivation
    from alfworld.agents.environment.alfred_tw_env import AlfredDemangler
    from textworld.envs.pddl import PddlEnv
    return AlfredDemangler(PddlEnv(_env_infos()))


MEMO_TEXTGEN = True  # memoise textworld's template parsing (docstring point 10) [ours]


def _install_textgen_memo() -> None:
    """Process-wide: make textworld's grammar parse each template/condition string only once.

    `ContextSensitiveGrammar.derive` re-parses its start string with TatSu and `replace`/`query`
    re-parse condition strings at every call (each admissible command, each feedback, every step).
    Both parses are pure functions of the string: keep the results, hand out deep copies of the
    symbol lists (derive mutates them) and the Rule itself (read-only)."""
    from textworld.envs.pddl import textgen
    if not MEMO_TEXTGEN or getattr(textgen, "_rsipo_memo", False):
        return
    parse, base_rule = textgen._parse_and_convert, textgen.Rule
    symbols_memo: dict[str, list] = {}
    query_memo: dict[str, object] = {}

    def parse_memo(text, rule_name=None, trace=False, **kwargs):
        if rule_name != "symbols" or trace or kwargs or not isinstance(text, str):
            return parse(text, rule_name=rule_name, trace=trace, **kwargs)
        if text not in symbols_memo:
            symbols_memo[text] = parse(text, rule_name="symbols")
        return copy.deepcopy(symbols_memo[text])

    class MemoRule(base_rule):
        @classmethod
        def parse_conjunctive_query(cls, expr):
            rule = query_memo.get(expr)
            if rule is None:
                rule = query_memo[expr] = base_rule.parse_conjunctive_query(expr)
            return rule

    textgen._parse_and_convert, textgen.Rule, textgen._rsipo_memo = parse_memo, MemoRule, True


@functools.cache
def _engine_class():
    """textworld's PddlEnv taught to start episodes of cached games (built on first use, so that
    importing this module does not import textworld)."""
    from textworld.core import GameState
    from textworld.envs.pddl import PddlEnv
    from textworld.envs.pddl import logic as pddl_logic
    _install_textgen_memo()

    class CachedPddlState(pddl_logic.PddlState):
        """textworld 1.7's PddlState.__init__ minus the two PDDL->SAS translations."""

        def __init__(self, downward_lib, game: _Game):  # super().__init__ would translate again
            self._facts = defaultdict(set)
            self._vars_by_name = {}
            self._vars_by_type = defaultdict(set)
            self._var_counts = Counter()
            self._logic = game.logic
            self.downward_lib = downward_lib
            self.pddl_problem = game.data["pddl_problem"]
            self.task, self.sas = game.fd_task, game.sas
            self._actions = {a.name: a for a in self.task.actions}
            self.downward_lib.load_sas(game.sas_bytes)  # this engine's library now holds the state
            self.name2type = dict(game.name2type)
            self.add_facts(game.init_facts)
            atoms = (pddl_logic.Atom * self.downward_lib.get_state_size())()
            self.downward_lib.get_state(atoms)
            facts = [atom.get_fact(self.name2type) for atom in atoms]
            self.add_facts([fact for fact in facts if not fact.is_negation])

    class Engine(PddlEnv):
        """One PddlEnv = one private copy of Fast Downward's library = one live game state."""

        def start(self, game: _Game):
            """PddlEnv.load + PddlEnv.reset for a cached game (same state, same texts)."""
            self._game_file, self._game_data = game.path, game.data
            self.walkthrough = game.data.get("walkthrough")
            self._logic, self._entity_infos = game.logic, game.entity_infos
            self._pddl_state = CachedPddlState(self.downward_lib, game)
            self.prev_state, self.state, self._last_action, self._moves = None, GameState(), None, 0
            context = {"state": self._pddl_state, "facts": list(self._pddl_state.facts),
                       "variables": {}, "mapping": {}, "entity_infos": self._entity_infos}
            self.state.feedback = self._logic.grammar.derive("#intro#", context)
            self.state.raw = self.state.feedback
            self._gather_infos()
            return self.state

    return Engine


def _make_engine():
    return _engine_class()(_env_infos())


# ---------------------------------------------------------------------------------------------
# One episode at a time


def _check_action(action) -> str | None:
    """The action text to send to the engine, or None when it is invalid (docstring point 3)."""
    if not isinstance(action, str):
        return None
    action = action.strip()
    if not action or len(action) > MAX_ACTION_CHARS or not action.isascii():
        return None
    return action


class AlfWorldEnv:
    """One ALFWorld episode at a time on the real engine (textworld PddlEnv + AlfredDemangler).

    max_steps: the episode ends (info["truncated"]) after this many steps without a win.
    cache: where loaded games are kept; None shares the process-wide `process_cache()`.
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

_PROMPT_HEAD = "You are an expert agent operating in the ALFRED embodied environment."
_PROMPT_TAIL = ("Now it's your turn to take an action. First reason inside <think> </think>, "
                "then give exactly one action inside <action> </action>.")


def _one_line(text) -> str:
    return " ".join(str(text).split())


def build_prompt(task: str, obs: str, admissible, history, history_len: int = 5,
                 with_admissible: bool = True) -> str:
    """The turn prompt. history: all (observation, action) pairs of the episode so far, oldest
    first; the last `history_len` are shown, numbered with their real step numbers."""
    history = list(history)
    n = len(history)
    shown = history[n - history_len:] if history_len > 0 else []
    lines = [_PROMPT_HEAD, TASK_PREFIX + _one_line(task)]
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
    lines.append(_PROMPT_TAIL)
    return "\n".join(lines)


# An <action> ... </action> pair with no other <action> opening inside it.
_ACTION_RE = re.compile(r"<action>((?:(?!<action>).)*?)</action>", re.IGNORECASE | re.DOTALL)


def parse_action(text: str) -> str | None:
    """The last well-formed <action>...</action> of a model output, normalised, or None."""
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


# ---------------------------------------------------------------------------------------------
# Worker pool


def _worker_main(conn, max_steps: int, test_hooks: bool, memo_textgen: bool) -> None:
    """Worker process: owns AlfWorldEnvs (one per live episode, reused) and one game cache."""
    global MEMO_TEXTGEN
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's business
    MEMO_TEXTGEN = memo_textgen
    _engine_class()  # import textworld/alfworld now, so that start-up is not billed to a reset
    import alfworld.agents.environment.alfred_tw_env  # noqa: F401
    cache = GameCache()
    free: list[AlfWorldEnv] = []
    live: dict[int, AlfWorldEnv] = {}
    conn.send(("ready", os.getpid()))

    def error_result(e: BaseException) -> str:
        return f"{type(e).__name__}: {e}"

    while True:
        try:
            kind, payload = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            return
        if kind == "close":
            conn.send(("closed", None))
            return
        out = []
        if kind == "reset":
            free.extend(live.values())
            live.clear()
            for slot, gamefile in payload:
                env = free.pop() if free else AlfWorldEnv(max_steps, cache=cache)
                try:
                    out.append((slot, env.reset(gamefile), None))
                    live[slot] = env
                except Exception as e:  # noqa: BLE001 - one bad game fails one episode
                    free.append(env)
                    out.append((slot, None, error_result(e)))
        elif kind == "step":
            for slot, action in payload:
                env = live.get(slot)
                if env is None:
                    out.append((slot, None, "no such episode in this worker"))
                    continue
                try:
                    if test_hooks and isinstance(action, str) and action.startswith(_TEST_SLEEP):
                        time.sleep(float(action.split()[1]))
                    result = env.step(action)
                    out.append((slot, result, None))
                    if result[2]:
                        free.append(live.pop(slot))
                except Exception as e:  # noqa: BLE001 - an engine error fails one episode
                    traceback.print_exc()  # the worker's stderr is the parent's
                    free.append(live.pop(slot))
                    out.append((slot, None, error_result(e)))
        conn.send(("ok", out))


class _Worker:
    def __init__(self, ctx, max_steps: int, test_hooks: bool):
        self.conn, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=_worker_main, args=(child, max_steps, test_hooks, MEMO_TEXTGEN),
                                daemon=True, name="rsipo-env-worker")
        self.proc.start()
        child.close()
        self.ready = False

    def kill(self) -> None:
        try:
            self.conn.close()
        except OSError:
            pass
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=5)


_LIVE_POOLS: "weakref.WeakSet[EnvPool]" = weakref.WeakSet()


@atexit.register
def _close_live_pools() -> None:
    for pool in list(_LIVE_POOLS):
        pool.close()


class EnvPool:
    """Episodes of AlfWorldEnv stepped in lock-step by `num_workers` worker processes.

    Episode i of a batch runs in worker i % num_workers (`pids[w]` is worker w's process id).
    `stats`: errors (failed episodes), crashes, timeouts, restarts.
    _test_hooks: tests only; a worker then sleeps on the action "__test_sleep__ <seconds>".
    """

    def __init__(self, num_workers: int = 2, max_steps: int = 50, step_timeout: float = 30.0,
                 reset_timeout: float = 120.0, start_timeout: float = 120.0, _test_hooks: bool = False):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.num_workers, self.max_steps = num_workers, max_steps
        self.step_timeout, self.reset_timeout, self.start_timeout = step_timeout, reset_timeout, start_timeout
        self._test_hooks = _test_hooks
        self._ctx = mp.get_context("spawn")
        self.stats = {"errors": 0, "crashes": 0, "timeouts": 0, "restarts": 0}
        self._closed = False
        self._workers: list[_Worker] = []
        self._infos: list[dict] = []  # last info of each episode of the batch
        self.active: list[bool] = []
        _LIVE_POOLS.add(self)
        try:
            self._workers = [self._start_worker() for _ in range(num_workers)]
            self._wait_ready(self._workers)
        except BaseException:
            self.close()
            raise

    # -- worker management
    def _start_worker(self) -> _Worker:
        return _Worker(self._ctx, self.max_steps, self._test_hooks)

    def _wait_ready(self, workers: list[_Worker]) -> None:
        deadline = time.monotonic() + self.start_timeout
        for w in workers:
            left = deadline - time.monotonic()
            if not w.conn.poll(max(left, 0)):
                raise RuntimeError(f"env worker {w.proc.pid} did not start within {self.start_timeout}s")
            try:
                kind, _ = w.conn.recv()
            except (EOFError, OSError):
                kind = "died"
            if kind != "ready":
                raise RuntimeError(f"env worker {w.proc.pid} died while starting (exit code "
                                   f"{w.proc.exitcode}, its traceback is on stderr). Workers are "
                                   f"spawned: the main script needs an `if __name__ == '__main__':` "
                                   f"guard")
            w.ready = True

    def _restart(self, k: int) -> None:
        self._workers[k].kill()
        self._workers[k] = self._start_worker()
        self.stats["restarts"] += 1
        self._wait_ready([self._workers[k]])

    @property
    def pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers]

    def _exchange(self, messages: dict[int, tuple], timeout: float) -> dict[int, list | str]:
        """Send one message to each listed worker, collect the replies in parallel.
        Returns worker -> list of (slot, result, error) or the failure string."""
        replies: dict[int, list | str] = {}
        pending: dict = {}
        for k, msg in messages.items():
            try:
                self._workers[k].conn.send(msg)
                pending[self._workers[k].conn] = k
            except (OSError, ValueError):  # broken pipe: the worker is gone
                replies[k] = "worker crashed"
        deadline = time.monotonic() + timeout
        while pending:
            left = deadline - time.monotonic()
            ready = mp_wait(list(pending), timeout=max(left, 0)) if left > 0 else []
            if not ready:
                for conn, k in pending.items():
                    replies[k] = "timeout"
                break
            for conn in ready:
                k = pending.pop(conn)
                try:
                    kind, payload = conn.recv()
                    replies[k] = payload if kind == "ok" else "worker crashed"
                except (EOFError, OSError):
                    replies[k] = "worker crashed"
        for k, reply in replies.items():
            if isinstance(reply, str):
                self.stats["crashes" if reply == "worker crashed" else "timeouts"] += 1
                self._restart(k)
        return replies

    def _fail(self, i: int, error: str) -> tuple[str, float, bool, dict]:
        info = dict(self._infos[i], won=False, truncated=False, invalid_action=False, error=error,
                    admissible=[])
        self._infos[i] = info
        self.active[i] = False
        self.stats["errors"] += 1
        return "", 0.0, True, info

    # -- episodes
    def reset(self, gamefiles: list[str]) -> list[tuple[str, dict]]:
        """Start one episode per gamefile (copies of a game are independent episodes)."""
        self._check_open()
        n = len(gamefiles)
        self._infos = [{"won": False, "task_type": None, "task": None, "admissible": [], "gamefile": g,
                        "steps": 0, "truncated": False, "invalid_action": False, "error": None}
                       for g in gamefiles]
        self.active = [False] * n
        messages = {k: ("reset", [(i, gamefiles[i]) for i in range(k, n, self.num_workers)])
                    for k in range(self.num_workers)}
        replies = self._exchange(messages, self.reset_timeout)
        out: list = [None] * n
        for k, reply in replies.items():
            if isinstance(reply, str):
                for i in range(k, n, self.num_workers):
                    obs, _, _, info = self._fail(i, reply)
                    out[i] = (obs, info)
                continue
            for i, result, error in reply:
                if error is not None:
                    obs, _, _, info = self._fail(i, error)
                    out[i] = (obs, info)
                else:
                    obs, info = result
                    self._infos[i], self.active[i] = info, True
                    out[i] = (obs, info)
        return out

    def step(self, actions: list) -> list:
        """One action per episode (ignored for inactive ones); None for episodes that are over."""
        self._check_open()
        if len(actions) != len(self.active):
            raise ValueError(f"EnvPool.step got {len(actions)} actions for {len(self.active)} episodes")
        messages = {}
        for k in range(self.num_workers):
            batch = [(i, actions[i]) for i in range(k, len(actions), self.num_workers) if self.active[i]]
            if batch:
                messages[k] = ("step", batch)
        replies = self._exchange(messages, self.step_timeout)
        out: list = [None] * len(actions)
        for k, reply in replies.items():
            if isinstance(reply, str):
                for i, _ in messages[k][1]:
                    self._infos[i]["steps"] += 1
                    out[i] = self._fail(i, reply)
                continue
            for i, result, error in reply:
                if error is not None:
                    self._infos[i]["steps"] += 1
                    out[i] = self._fail(i, error)
                    continue
                obs, reward, done, info = result
                self._infos[i] = info
                self.active[i] = not done
                out[i] = (obs, reward, done, info)
        return out

    # -- shutdown
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("EnvPool is closed")

    def close(self, timeout: float = 5.0) -> None:
        """Stop all workers: ask, wait up to `timeout`, then terminate/kill. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for w in self._workers:
            try:
                w.conn.send(("close", None))
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + timeout
        for w in self._workers:
            w.proc.join(timeout=max(deadline - time.monotonic(), 0.1))
            if w.proc.is_alive():
                w.proc.terminate()
                w.proc.join(timeout=1)
            w.kill()
        _LIVE_POOLS.discard(self)

    def __enter__(self) -> "EnvPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close(timeout=1.0)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
