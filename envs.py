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

Search QA (Search-R1 protocol; section at the end of the file)
----------------------------------------------------------------
* Data. `load_qa(path)` reads Search-R1's question files, JSONL or parquet (pyarrow needed):
  FlashRAG's flat rows (`id`, `question`, `golden_answers`) with `data_source`, or the verl rows
  that Search-R1's `scripts/data_process/qa_search_{train,test}_merge.py` write (`prompt` whose
  text ends in "Question: ...", `reward_model.ground_truth.target`, `extra_info.index`). Task ids
  are "<data_source>:<id>"; the task type comes from the source (`SEARCH_TASK_TYPES`: nq,
  triviaqa, popqa → single; hotpotqa, 2wikimultihopqa, musique, bamboogle → multi; this
  project's gen_single / gen_multi). `list_qa(root, split)` reads `<root>/<split>.jsonl|.parquet`.
  Bad files raise EnvDataError naming the file and the record or line. Fetching the real data
  (needs internet): the NQ + HotpotQA train set and the merged seven-set test file, as parquet,
      huggingface-cli download --repo-type dataset PeterJinGo/nq_hotpotqa_train --local-dir data/nq_hotpotqa_train
  (`data/nq_hotpotqa_train/{train,test}.parquet`; or rebuild them from FlashRAG with Search-R1's
  `scripts/data_process/qa_search_{train,test}_merge.py`), and for retrieval the E5 index and
  wiki-18 corpus served by Search-R1's own server (in a clone of PeterGriffinJin/Search-R1:
  `python scripts/download.py --save_path <dir>`, then `bash retrieval_launch.sh`, port 8000);
  then `python train.py --env search --data_root data/nq_hotpotqa_train --retriever_url
  http://127.0.0.1:8000` (`pip install pyarrow` for parquet).
  The shipped small set is `data/search_qa` (qa_gen.py: a fictional world, 300 train / 100 test
  questions, 170 passages, gold demonstrations verified against BM25 + this env).
* Retrievers: `search(queries, k) -> [[{"id", "title", "text", "score"}, ...] per query]`.
  `BM25Retriever(corpus.jsonl)` (bm25s, index cached next to the corpus, keyed by its content
  hash) and `HTTPRetriever(url)` (Search-R1 server protocol, `POST /retrieve` with
  {"queries", "topk", "return_scores"} → {"result": [[{"document": {"id", "contents"}, "score"}]]};
  timeout, retries with backoff, RetrieverError / RetrieverTimeout naming the URL).
  `retrieval_server.py` serves a BM25Retriever with that protocol.
* `SearchEnv(retriever, tasks, max_turns=4, top_k=3)`: `reset(task or id) -> ("", info)`,
  `step(model_text) -> (obs, reward, done, info)`. `<search> q </search>` → obs
  `<information> Doc 1 (Title: t) text ... </information>` (top-k, "No results." when no passage
  shares a word with q); `<answer> a </answer>` ends the episode with reward R_EM = 1.0 when
  `exact_match` (SQuAD normalisation: lowercase, punctuation and a/an/the removed, whitespace
  collapsed) holds against any gold answer, else 0; after `max_turns` turns the episode ends
  (`truncated`). info: won, task_type, task (the question), id, golden_answers, steps, searches,
  truncated, invalid_action, answer, error, admissible ([]).
* `build_search_prompt` / `parse_search_action`: the turn prompt (Search-R1's instruction in our
  words; the question is its own line `Question: ...`, where skills are inserted; history
  `Turn k: <action>` + result) and the action parser (canonical "<search> q </search>" or None).
* `SearchPool(retriever, tasks, max_turns, top_k, timeout)`: EnvPool's calls, in-process.

Search choices, all **[ours]**:
11. Bad input, decided and tested: a turn is valid only with exactly one opening and one closing
    <search>/<answer> tag, same name, closing after opening: unclosed tags, several actions,
    mismatched pairs, an empty content, a query over 300 or an answer over 200 characters are
    invalid turns (obs INVALID_SEARCH_OBS, `invalid_action`, one turn spent; the trainer charges
    p_fmt). Non-ASCII text is valid (real answers have accents: "Zürich"). An answer before any
    search is a normal turn and is scored (Search-R1 allows direct answers). Text outside the
    action (e.g. <think>) is not checked.
12. The pool runs in-process (a search step is milliseconds). The queries of one lock-step go
    to the retriever as one batch in a daemon thread bounded by `timeout`; on timeout or
    RetrieverError every episode that searched in that step ends as failed (done, reward 0,
    `error`), counted in `stats` (errors, timeouts, retriever_errors); the hung thread is
    abandoned, never joined. An unknown question id fails only its episode.
13. Passages with BM25 score 0 are not returned (a query gets at most k, maybe none); BM25
    tokenisation is bm25s's (lowercase words of 2+ characters, English stopwords, no stemming).
14. Each turn is a fresh prompt (question + the last `history_len` turns with their results), as
    for ALFWorld and verl-agent, where Search-R1 appends to one growing context; the history
    shows at least the last turn (its result is the current observation).

Run `python bench_env.py` for steps/s and `python bench_search.py` for retrieval latency; test with
`python -m pytest tests/test_envs.py -q` and `python -m pytest tests/test_search.py -q`.
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
import string
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
# The fixed texts of the ALFWorld turn prompt (`build_prompt`) and of the engine's intro, verbatim.
# [ours] The tiny preset's tokenizer makes each one a single token (train.train_tiny_tokenizer): they
# carry no information, and as words they were a third of every prompt's tokens. Kept in sync with
# the template by tests/test_train.py (each phrase occurs in a built prompt).
PROMPT_PHRASES = (_PROMPT_HEAD, TASK_PREFIX.strip(), "Prior to this step, you have already taken",
                  "step(s). Below are the most recent", "observations and the corresponding actions you took:",
                  "You are now at step", "and your current observation is:",
                  "Your admissible actions of the current situation are:", "', '", _PROMPT_TAIL,
                  "-= Welcome to TextWorld, ALFRED! =-",
                  "You are in the middle of a room. Looking quickly around you, you see")


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

    # What `rollout.run_episodes` takes from an env family (SearchPool has the search ones).
    task_key = "gamefile"
    task_prefix = TASK_PREFIX
    stop_texts = ("</action>",)
    build_prompt = staticmethod(build_prompt)
    parse_action = staticmethod(parse_action)

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


# =============================================================================================
# Search QA (Search-R1 protocol): data, retrievers, the env and its in-process pool

# Task type of a question from the data set it comes from (DESIGN §2: single-hop / multi-hop).
# gen_single / gen_multi are this project's generated set (qa_gen.py).
SEARCH_TASK_TYPES: dict[str, str] = {
    "nq": "single", "triviaqa": "single", "popqa": "single", "gen_single": "single",
    "hotpotqa": "multi", "2wikimultihopqa": "multi", "musique": "multi", "bamboogle": "multi",
    "gen_multi": "multi",
}
SEARCH_TYPES: tuple[str, ...] = ("single", "multi")
QUESTION_PREFIX = "Question: "  # the task line of a search prompt (skills are inserted after it)
R_EM = 1.0  # reward of an exactly matching answer
MAX_QUERY_CHARS = 300  # longer queries are invalid turns [ours]
MAX_ANSWER_CHARS = 200  # longer answers are invalid turns [ours]
SEARCH_STOP_TEXTS = ("</search>", "</answer>")  # generation stops after the first action tag
INVALID_SEARCH_OBS = ("Invalid turn: give exactly one <search> query </search> or one "
                      "<answer> answer </answer>.")
NO_RESULTS = "No results."


class RetrieverError(RuntimeError):
    """The retriever could not answer (server down, bad reply); the message names the URL/path."""


class RetrieverTimeout(RetrieverError):
    """The retriever did not answer within its time limit."""


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
    """("search" | "answer", content) of a model output, or None when the turn is invalid.

    Valid: exactly one opening and one closing tag in total over <search>/<answer>, the closing
    after the opening and of the same name; the content, whitespace collapsed, is non-empty and
    within MAX_QUERY_CHARS (search) / MAX_ANSWER_CHARS (answer). Everything outside the pair
    (e.g. <think>) is ignored. Non-ASCII content is valid.
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
    """The observation after a search: the passages as `Doc i (Title: t) text` in <information>."""
    if not passages:
        return f"<information> {NO_RESULTS} </information>"
    docs = [f"Doc {i} (Title: {_one_line(p.get('title', ''))}) {_one_line(p.get('text', ''))}"
            for i, p in enumerate(passages, 1)]
    return "<information> " + "\n".join(docs) + " </information>"


_SEARCH_HEAD = ("Answer the question. Reason inside <think> </think> first. When you lack knowledge, "
                "search with <search> query </search>; the top results come back inside "
                "<information> </information>. You may search several times. When you know the "
                "answer, give only the answer inside <answer> </answer>, for example "
                "<answer> Paris </answer>.")
SEARCH_PHRASES = (_SEARCH_HEAD, "earlier turn(s) not shown)")   # as PROMPT_PHRASES, for `build_search_prompt`


def build_search_prompt(question: str, obs: str, admissible=None, history=(), history_len: int = 4) -> str:
    """The turn prompt of the search env (Search-R1's template in our words).

    history: all (observation, action) pairs so far, oldest first; obs: the result of the last
    action. Turn k is shown as `Turn k: <action>` followed by its result; the last
    max(history_len, 1) turns are shown (the latest result is always visible). `admissible` is
    accepted for the common interface and ignored.
    """
    history = list(history)
    n = len(history)
    start = max(0, n - max(history_len, 1))
    lines = [_SEARCH_HEAD, QUESTION_PREFIX + _one_line(question)]
    if start:
        lines.append(f"({start} earlier turn(s) not shown)")
    for j in range(start, n):
        result = history[j + 1][0] if j + 1 < n else obs
        lines.append(f"Turn {j + 1}: {_one_line(history[j][1])}")
        lines.append(str(result).strip())
    lines.append(f"Now write turn {n + 1}.")
    return "\n".join(lines)


# -- data


def _read_jsonl(path: str, what: str) -> list[dict]:
    if not os.path.isfile(path):
        raise EnvDataError(f"{what} {path!r} does not exist")
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise EnvDataError(f"malformed {what} {path}:{n}: invalid JSON ({e})") from None
            if not isinstance(row, dict):
                raise EnvDataError(f"malformed {what} {path}:{n}: expected a JSON object")
            rows.append(row)
    if not rows:
        raise EnvDataError(f"{what} {path!r} is empty")
    return rows


def load_corpus(path: str) -> list[dict]:
    """Passages of a JSONL corpus: one {"id", "title", "text"} object a line (ids unique)."""
    rows = _read_jsonl(path, "corpus")
    seen: set[str] = set()
    out = []
    for n, row in enumerate(rows, 1):
        if not isinstance(row.get("id"), (str, int)) or not all(isinstance(row.get(k), str) for k in ("title", "text")):
            raise EnvDataError(f"malformed corpus {path}: passage {n} needs 'id' (text or number), "
                               f"'title' and 'text' (text), got keys {sorted(row)}")
        pid = str(row["id"])
        if pid in seen:
            raise EnvDataError(f"malformed corpus {path}: passage {n} repeats id {pid!r}")
        seen.add(pid)
        out.append({"id": pid, "title": row["title"], "text": row["text"]})
    return out


def _qa_record(row: dict, where: str, index: int) -> dict:
    """One question in the Search-R1 layout → {id, question, golden_answers, data_source, task_type[, demo]}."""
    question = row.get("question")
    if not isinstance(question, str):  # verl layout: the question is at the end of the prompt
        prompt = row.get("prompt")
        content = prompt[0].get("content") if isinstance(prompt, (list, tuple)) and prompt and \
            isinstance(prompt[0], dict) else None
        if isinstance(content, str) and "Question:" in content:
            question = content.rsplit("Question:", 1)[1]
    golds = row.get("golden_answers")
    if golds is None:
        golds = ((row.get("reward_model") or {}).get("ground_truth") or {}).get("target")
    if isinstance(golds, str):
        golds = [golds]
    golds = [str(g) for g in golds] if golds is not None and not isinstance(golds, dict) else None
    source = row.get("data_source")
    if not isinstance(question, str) or not question.strip():
        raise EnvDataError(f"malformed QA file {where}: record {index} has no 'question'")
    if not golds:
        raise EnvDataError(f"malformed QA file {where}: record {index} has no 'golden_answers' "
                           f"(nor reward_model.ground_truth.target)")
    if source not in SEARCH_TASK_TYPES:
        raise EnvDataError(f"malformed QA file {where}: record {index} has data_source {source!r}; "
                           f"known sources: {sorted(SEARCH_TASK_TYPES)}")
    raw_id = row.get("id")
    if raw_id is None:
        raw_id = (row.get("extra_info") or {}).get("index", index - 1)
    rec = {"id": f"{source}:{raw_id}", "question": " ".join(question.split()), "golden_answers": golds,
           "data_source": source, "task_type": SEARCH_TASK_TYPES[source]}
    if isinstance(row.get("demo"), dict):
        rec["demo"] = row["demo"]
    return rec


def load_qa(path: str) -> list[dict]:
    """Questions of a Search-R1 data file (.jsonl, or .parquet with pyarrow installed).

    Accepted fields: `question` (or the verl `prompt`, whose text ends with "Question: ..."),
    `golden_answers` (or `reward_model.ground_truth.target`), `data_source` (one of
    SEARCH_TASK_TYPES), optional `id` (else `extra_info.index`, else the position) and our `demo`.
    Task ids are "<data_source>:<id>" (the merged Search-R1 test file reuses ids across sources).
    """
    if path.endswith(".parquet"):
        if not os.path.isfile(path):
            raise EnvDataError(f"QA file {path!r} does not exist")
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise EnvDataError(f"reading {path} needs pyarrow (`pip install pyarrow`), or convert it to "
                               f"JSONL first") from None
        rows = pq.read_table(path).to_pylist()
        if not rows:
            raise EnvDataError(f"QA file {path!r} is empty")
    else:
        rows = _read_jsonl(path, "QA file")
    out = [_qa_record(row, path, n) for n, row in enumerate(rows, 1)]
    ids = Counter(r["id"] for r in out)
    dup = [i for i, c in ids.items() if c > 1]
    if dup:
        raise EnvDataError(f"malformed QA file {path}: repeated ids {dup[:5]}")
    return out


def list_qa(data_root: str, split: str, task_types=None) -> list[dict]:
    """Questions of `<data_root>/<split>.jsonl` (or `.parquet`), optionally only 'single'/'multi'."""
    fix = ("generate the small set with `python qa_gen.py --out <data_root>` or fetch Search-R1's "
           "data (see the envs.py docstring)")
    paths = [os.path.join(data_root, f"{split}.{ext}") for ext in ("jsonl", "parquet")]
    path = next((p for p in paths if os.path.isfile(p)), None)
    if path is None:
        raise EnvDataError(f"no QA split file {paths[0]!r} (nor .parquet); {fix}")
    rows = load_qa(path)
    if task_types is not None:
        wanted = {task_types} if isinstance(task_types, str) else set(task_types)
        bad = wanted - set(SEARCH_TYPES)
        if bad or not wanted:
            raise EnvDataError(f"unknown search task types {sorted(bad) or '(none)'}; expected {list(SEARCH_TYPES)}")
        rows = [r for r in rows if r["task_type"] in wanted]
        if not rows:
            raise EnvDataError(f"no questions of types {sorted(wanted)} in {path!r}")
    return rows


# -- retrievers: search(queries, k) -> one list of passage dicts {id, title, text, score} per query


def _contents_to_passage(doc: dict, score) -> dict:
    """A Search-R1 server document ({"id", "contents": '"Title"\\ntext'}) as a passage dict."""
    if "contents" in doc:
        title, _, text = str(doc["contents"]).partition("\n")
        title = title.strip().strip('"')
    else:
        title, text = str(doc.get("title", "")), str(doc.get("text", ""))
    return {"id": str(doc.get("id", "")), "title": title, "text": text.strip(),
            "score": float(score) if score is not None else None}


class BM25Retriever:
    """In-process BM25 (the `bm25s` package) over a JSONL corpus of {"id", "title", "text"}.

    The index of `title + text` (lowercased words of 2+ characters, English stopwords removed) is
    built once and saved next to the corpus in `.bm25_<corpus name>_<content hash>/`; a later
    retriever over the same bytes loads it (`from_cache` tells which happened). Passages with a
    zero score (no query word in them) are not returned, so a query may get fewer than k.
    """

    def __init__(self, corpus_path: str, cache: bool = True):
        import hashlib
        import bm25s
        self.corpus_path = corpus_path
        self.passages = load_corpus(corpus_path)
        with open(corpus_path, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()[:16]
        stem = os.path.splitext(os.path.basename(corpus_path))[0]
        self.cache_dir = os.path.join(os.path.dirname(os.path.abspath(corpus_path)), f".bm25_{stem}_{digest}")
        self.from_cache = False
        if cache and os.path.isfile(os.path.join(self.cache_dir, "params.index.json")):
            self.index = bm25s.BM25.load(self.cache_dir, show_progress=False)
            self.from_cache = True
        else:
            texts = [p["title"] + " " + p["text"] for p in self.passages]
            self.index = bm25s.BM25()
            self.index.index(bm25s.tokenize(texts, stopwords="en", show_progress=False), show_progress=False)
            if cache:  # written to a temp folder, then renamed: a crash leaves no half index
                tmp = f"{self.cache_dir}.tmp{os.getpid()}"
                self.index.save(tmp, show_progress=False)
                try:
                    os.replace(tmp, self.cache_dir)
                except OSError:  # another process saved it first
                    import shutil
                    shutil.rmtree(tmp, ignore_errors=True)

    def search(self, queries: list[str], k: int = 3) -> list[list[dict]]:
        import bm25s
        if not queries:
            return []
        k = min(k, len(self.passages))
        tokens = bm25s.tokenize(list(queries), stopwords="en", return_ids=False, show_progress=False)
        docs, scores = self.index.retrieve(tokens, k=k, show_progress=False, n_threads=1)
        out = []
        for row_d, row_s in zip(docs.tolist(), scores.tolist()):
            out.append([dict(self.passages[d], score=float(s)) for d, s in zip(row_d, row_s) if s > 0])
        return out


class HTTPRetriever:
    """Client of a Search-R1 retrieval server: POST <url> with {"queries", "topk", "return_scores"},
    reply {"result": [[{"document": {"id", "contents"}, "score"}, ...], ...]} (documents without
    scores are accepted too). `url` is the server's base or its /retrieve address.

    Each try waits at most `timeout` s; connection errors, timeouts and HTTP 5xx are retried
    `retries` times with exponential backoff (backoff, 2·backoff, ...); HTTP 4xx and malformed
    replies fail at once. Failure raises RetrieverTimeout / RetrieverError naming the URL.
    Loopback addresses bypass any HTTP proxy from the environment.
    """

    def __init__(self, url: str, timeout: float = 10.0, retries: int = 2, backoff: float = 0.5):
        import urllib.parse
        import urllib.request
        url = url.rstrip("/")
        self.url = url if url.endswith("/retrieve") else url + "/retrieve"
        self.timeout, self.retries, self.backoff = timeout, retries, backoff
        host = urllib.parse.urlsplit(self.url).hostname or ""
        handlers = [urllib.request.ProxyHandler({})] if host in ("localhost", "127.0.0.1", "::1") else []
        self._opener = urllib.request.build_opener(*handlers)

    def search(self, queries: list[str], k: int = 3) -> list[list[dict]]:
        import socket
        import urllib.error
        import urllib.request
        if not queries:
            return []
        body = json.dumps({"queries": list(queries), "topk": int(k), "return_scores": True}).encode("utf-8")
        last, timed_out = None, False
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            req = urllib.request.Request(self.url, data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
            try:
                with self._opener.open(req, timeout=self.timeout) as resp:
                    raw = resp.read()
            except urllib.error.HTTPError as e:
                detail = e.read()[:200].decode("utf-8", "replace")
                if e.code < 500:
                    raise RetrieverError(f"retrieval server {self.url} answered HTTP {e.code}: {detail}") from None
                last, timed_out = f"HTTP {e.code}: {detail}", False
                continue
            except (socket.timeout, TimeoutError) as e:
                last, timed_out = f"no reply within {self.timeout}s ({e})", True
                continue
            except urllib.error.URLError as e:
                timed_out = isinstance(e.reason, (socket.timeout, TimeoutError))
                last = f"no reply within {self.timeout}s" if timed_out else str(e.reason)
                continue
            except (ConnectionError, OSError) as e:
                last, timed_out = f"{type(e).__name__}: {e}", False
                continue
            return self._parse(raw, len(queries))
        cls = RetrieverTimeout if timed_out else RetrieverError
        raise cls(f"retrieval server {self.url} failed after {self.retries + 1} tries: {last}. Is it "
                  f"running? (`python retrieval_server.py --corpus <corpus.jsonl> --port <port>`, or "
                  f"Search-R1's own server)")

    def _parse(self, raw: bytes, n: int) -> list[list[dict]]:
        try:
            result = json.loads(raw)["result"]
            if not isinstance(result, list) or len(result) != n:
                raise ValueError(f"expected {n} result lists, got {type(result).__name__} "
                                 f"of length {len(result) if isinstance(result, list) else '-'}")
            out = []
            for hits in result:
                row = []
                for h in hits:
                    doc = h["document"] if "document" in h else h
                    row.append(_contents_to_passage(doc, h.get("score")))
                out.append(row)
            return out
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise RetrieverError(f"retrieval server {self.url} sent a malformed reply: {e}; "
                                 f"starts {raw[:200]!r}") from None


def call_with_timeout(fn, timeout: float):
    """fn() in a daemon thread; RetrieverTimeout after `timeout` s (the thread is abandoned, never
    joined, so a hung retriever cannot hang the caller or block interpreter exit)."""
    import threading
    box: dict = {}

    def run():
        try:
            box["out"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["err"] = e

    t = threading.Thread(target=run, daemon=True, name="rsipo-retrieval")
    t.start()
    t.join(timeout)
    if t.is_alive():
        raise RetrieverTimeout(f"the retriever did not answer within {timeout}s")
    if "err" in box:
        raise box["err"]
    return box["out"]


# -- the env


class SearchEnv:
    """One search episode at a time: reset(task) -> (obs, info); step(text) -> (obs, reward, done, info).

    task: a question record (`load_qa`) or its id in `tasks`. The first observation is "" (nothing
    searched yet). Every step is one turn: a valid search returns `format_passages` of the top
    `top_k` passages; a valid answer ends the episode with reward R_EM on an exact match (`won`);
    an invalid turn returns INVALID_SEARCH_OBS with `invalid_action` True. After `max_turns` turns
    without an answer the episode ends (`truncated`, reward 0). A retriever error or timeout ends
    the episode as failed (`error` set, reward 0).
    """

    def __init__(self, retriever, tasks: dict | None = None, max_turns: int = 4, top_k: int = 3,
                 timeout: float = 30.0):
        self.retriever, self.tasks = retriever, tasks or {}
        self.max_turns, self.top_k, self.timeout = max_turns, top_k, timeout
        self.task: dict | None = None
        self.done = True

    def reset(self, task) -> tuple[str, dict]:
        if isinstance(task, str):
            if task not in self.tasks:
                raise EnvDataError(f"unknown question id {task!r}")
            task = self.tasks[task]
        self.task, self.turns, self.searches, self.done, self.won = task, 0, 0, False, False
        return "", self._info()

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


class SearchPool:
    """Many SearchEnv episodes stepped in lock-step, in-process (search is cheap; no workers).

    Same calls as EnvPool: reset(task_ids) (a question id may repeat: each copy is its own
    episode), step(actions) -> None for finished episodes, `stats`, close(), context manager.
    The queries of one lock-step go to the retriever as one batch under one `timeout`; a timeout
    or retriever error fails the episodes that searched in that step (done, reward 0, `error`
    set, counted in `stats`) and the run goes on. Also carries what `rollout.run_episodes` needs
    from an env family: task_key, task_prefix, stop_texts, build_prompt, parse_action.
    """

    task_key = "id"
    task_prefix = QUESTION_PREFIX
    stop_texts = SEARCH_STOP_TEXTS
    build_prompt = staticmethod(build_search_prompt)
    parse_action = staticmethod(parse_search_action)

    def __init__(self, retriever, tasks, max_turns: int = 4, top_k: int = 3, timeout: float = 30.0):
        if not isinstance(tasks, dict):
            tasks = {t["id"]: t for t in tasks}
        self.retriever, self.tasks = retriever, tasks
        self.max_turns, self.top_k, self.timeout = max_turns, top_k, timeout
        self.stats = {"errors": 0, "timeouts": 0, "retriever_errors": 0, "searches": 0}
        self.envs: list[SearchEnv] = []
        self.active: list[bool] = []
        self._closed = False

    def reset(self, task_ids: list[str]) -> list[tuple[str, dict]]:
        self._check_open()
        self.envs, self.active, out = [], [], []
        for tid in task_ids:
            env = SearchEnv(self.retriever, self.tasks, self.max_turns, self.top_k, self.timeout)
            if tid not in self.tasks:
                self.stats["errors"] += 1
                info = {"won": False, "task_type": None, "task": None, "id": tid, "admissible": [],
                        "steps": 0, "truncated": False, "invalid_action": False,
                        "error": f"EnvDataError: unknown question id {tid!r}"}
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
        error = None
        if asked:
            self.stats["searches"] += len(asked)
            try:
                res = call_with_timeout(lambda: self.retriever.search([queries[i] for i in asked], self.top_k),
                                        self.timeout)
                if len(res) != len(asked):
                    raise RetrieverError(f"the retriever returned {len(res)} result lists for {len(asked)} queries")
                hits = {i: r[:self.top_k] for i, r in zip(asked, res)}
            except RetrieverError as e:
                self.stats["timeouts" if isinstance(e, RetrieverTimeout) else "retriever_errors"] += 1
                error = f"{type(e).__name__}: {e}"
        out: list = [None] * len(actions)
        for i in live:
            failed = error is not None and i in queries and queries[i] is not None
            r = self.envs[i].apply(actions[i], hits.get(i), error if failed else None)
            if failed:
                self.stats["errors"] += 1
            self.active[i] = not r[2]
            out[i] = r
        return out

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("SearchPool is closed")

    def close(self) -> None:
        self._closed = True

    def __enter__(self) -> "SearchPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
