"""What the env families of envs.py run on: ALFWorld's game data and textworld's engine, search
QA's question data, corpora and retrievers. This module never imports envs.

Contract
--------
* ALFWorld data. `list_games(data_root, split, task_types=None)` -> the sorted paths of the
  solvable games of `<data_root>/json_2.1.1/<split>/`, found as alfworld's own collector finds
  them; `game_task_type(gamefile)` -> its short task type (`TASK_TYPES`: pick, look, clean, heat,
  cool, pick2). Games: `alfworld-download` (the official 3,553/140/134 games) or this project's
  generator, `python scripts/alfworld_gen.py --out data/alfworld`.
* ALFWorld engine. `GameCache(capacity).get(gamefile)` -> a loaded game (`process_cache()` is the
  process's shared one); `_make_engine()` -> textworld's `PddlEnv` (Fast Downward's library for the
  state, the game's grammar for the text) whose `start(game)` is `PddlEnv.load` + `reset`. Games
  load through alfworld's `AlfredDemangler` exactly as alfworld does ("apple 1", "fridge 1"); the
  texts are byte-identical to stock textworld's.
* Search data. `list_qa(root, split, task_types)` / `load_qa(path)` -> question records {id,
  question, golden_answers, data_source, task_type[, demo]} from Search-R1's JSONL or parquet files
  (fetching the real data: `list_qa`); `load_corpus(path)` -> passages {id, title, text}.
* Retrievers: `search(queries, k) -> [[{"id", "title", "text", "score"}, ...] per query]`, best
  first: `BM25Retriever(corpus.jsonl)` in-process, `HTTPRetriever(url)` for a Search-R1 server
  (`scripts/retrieval_server.py` serves a BM25Retriever that way); `call_with_timeout` bounds a call.
* Errors: bad data raises `EnvDataError` (a ValueError) naming the file and the fix; a failed
  retrieval raises `RetrieverError`, one not answered in time `RetrieverTimeout`.

Choices the paper leaves open, all **[ours]**:
1. Loaded games are cached per process (`GameCache`, LRU, 64 games): parsing the grammar and the
   domain, translating PDDL to SAS and naming the objects happen once per game; a reset rebuilds
   the initial state from the cached translation (`CachedPddlState`), ~3x cheaper than
   `PddlEnv.reset`, which translates twice (the second, planner-only translation is skipped: no
   planner runs here). It reaches into textworld 1.7's private fields; the version is pinned.
2. Template memo (`_install_textgen_memo`): textworld re-parses every grammar template with TatSu
   at every derivation (~70% of a step); both parses are pure functions of their strings, so they
   are memoised process-wide: ~3.5x more steps/s, same texts. `env_backends.MEMO_TEXTGEN = False`
   before the first reset (or before creating an EnvPool, whose workers inherit it) turns it off.
3. `list_games` skips 'movable'/'Sliced' folders and games without a `solvable` key, as alfworld
   does; a game.tw-pddl that is not valid JSON is an error.
4. BM25 drops passages with score 0, which share no word with the query (so a query gets at most
   k, maybe none); tokenisation is bm25s's (lowercase words of 2+ characters, English stopwords, no
   stemming); the index is cached on disk next to the corpus, keyed by its content hash.

Test: tests/test_envs.py (games; the engine replays stored traces and matches untouched textworld
on random play), tests/test_search.py (QA data, BM25, HTTP). Speed: scripts/bench_env.py, bench_search.py.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import sys
import time
from collections import Counter, OrderedDict, defaultdict
from dataclasses import dataclass

from infra.io import jsonl_lines, write_folder

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
GAME_KEYS = ("pddl_domain", "grammar", "pddl_problem")  # required keys of a game.tw-pddl


class EnvDataError(ValueError):
    """Missing, empty or malformed env data: games, question files, corpora (the message names the
    path and the fix)."""


# ---------------------------------------------------------------------------------------------
# Game data


def _short_type(name: str) -> str:
    if name in TASK_TYPES:
        return TASK_TYPES[name]
    if name in TASK_TYPES_LONG:
        return name
    raise EnvDataError(f"unknown ALFWorld task type {name!r}; expected one of "
                       f"{list(SHORT_TASK_TYPES)} or {list(TASK_TYPES)}")


def read_json(path: str, what: str) -> dict:
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
    data = read_json(path, "game file")
    missing = [k for k in GAME_KEYS if not isinstance(data.get(k), str)]
    if missing:
        raise EnvDataError(f"malformed game file {path}: missing or non-text keys {missing} "
                           f"(a game.tw-pddl needs {list(GAME_KEYS)})")
    return data


def game_task_type(gamefile: str) -> str:
    """Short task type of a game, from the traj_data.json beside it (else the folder name)."""
    traj_path = os.path.join(os.path.dirname(gamefile), "traj_data.json")
    if os.path.exists(traj_path):
        task_type = read_json(traj_path, "traj_data.json").get("task_type")
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

    Walks `<data_root>/json_2.1.1/<split>/` like alfworld's own collector
    (`AlfredTWEnv.collect_game_files`): every folder with a `traj_data.json` and a `game.tw-pddl`
    whose `solvable` is true is a game. Skipped as by alfworld (choice 3 of the module docstring):
    'movable'/'Sliced' folders, judged on the path below the split folder (so a data root whose
    own path contains "Sliced" still works), and games without a `solvable` key. The list is
    sorted, so the same data always gives the same order.
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
           "generate games with `python scripts/alfworld_gen.py --out <data_root>`")
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
    """Per-process LRU cache of loaded games (choice 1 of the module docstring). Not thread-safe."""

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
    engine_class()  # installs the template memo before the first grammar derivation
    from alfworld.agents.environment.alfred_tw_env import AlfredDemangler
    from textworld.envs.pddl import PddlEnv
    return AlfredDemangler(PddlEnv(_env_infos()))


MEMO_TEXTGEN = True  # memoise textworld's template parsing (choice 2 of the module docstring) [ours]


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
def engine_class():
    """textworld's PddlEnv taught to start episodes of cached games (built on first use, so that
    importing this module does not import textworld)."""
    from textworld.core import GameState
    from textworld.envs.pddl import PddlEnv
    from textworld.envs.pddl import logic as pddl_logic
    _install_textgen_memo()

    class CachedPddlState(pddl_logic.PddlState):
        """textworld 1.7's PddlState.__init__ minus the two PDDL->SAS translations: the state's
        comes from the cached game, and the planner's is skipped, since no planner ever runs here
        (no `policy_commands`, no replanning)."""

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
    """A new engine: one live game state, in its own copy of Fast Downward's shared library (the
    library keeps one global state; `fast_downward.load_lib` copies the 33 MB file, ~0.1 s)."""
    return engine_class()(_env_infos())


# =============================================================================================
# Search QA (Search-R1 protocol): question data, corpus, retrievers

# Task type of a question from the data set it comes from (METHOD.md §5.5: single-hop / multi-hop).
# gen_single / gen_multi are this project's generated set (scripts/qa_gen.py).
SEARCH_TASK_TYPES: dict[str, str] = {
    "nq": "single", "triviaqa": "single", "popqa": "single", "gen_single": "single",
    "hotpotqa": "multi", "2wikimultihopqa": "multi", "musique": "multi", "bamboogle": "multi",
    "gen_multi": "multi",
}
SEARCH_TYPES: tuple[str, ...] = ("single", "multi")


class RetrieverError(RuntimeError):
    """The retriever could not answer (server down, bad reply); the message names the URL/path."""


class RetrieverTimeout(RetrieverError):
    """The retriever did not answer within its time limit."""


# -- data


def _read_jsonl(path: str, what: str) -> list[tuple[int, dict]]:
    """(line number, object) for each non-blank line; a file that is missing, empty or not JSON objects raises."""
    if not os.path.isfile(path):
        raise EnvDataError(f"{what} {path!r} does not exist")
    rows = []
    for n, row in jsonl_lines(path):
        if isinstance(row, ValueError):
            raise EnvDataError(f"malformed {what} {path}:{n}: invalid JSON ({row})")
        if not isinstance(row, dict):
            raise EnvDataError(f"malformed {what} {path}:{n}: expected a JSON object")
        rows.append((n, row))
    if not rows:
        raise EnvDataError(f"{what} {path!r} is empty")
    return rows


CORPUS_LAYOUTS = ('{"id", "title", "text"}', '{"id", "contents": "\\"Title\\"\\ntext"} (wiki-18, Search-R1)',
                  '{"id", "title", "text", "contents"} (pyserini stored documents)')


def split_contents(contents: str) -> tuple[str, str]:
    """Search-R1's and wiki-18's `contents` → (title, text): '"Title"\ntext', the title in quotes on the first
    line."""
    title, _, text = contents.partition("\n")
    return title.strip().strip('"'), text.strip()


def load_corpus(path: str) -> list[dict]:
    """Passages of a JSONL corpus, one object a line, in any of CORPUS_LAYOUTS: our {"id", "title", "text"},
    wiki-18's {"id", "contents"} (Search-R1's corpus, its `contents` '"Title"\ntext'), or pyserini's stored
    documents (all four; title and text are used). Ids must be unique. → [{"id", "title", "text"}]"""
    seen: set[str] = set()
    out = []
    for n, row in _read_jsonl(path, "corpus"):
        pid = row.get("id")
        if isinstance(row.get("title"), str) and isinstance(row.get("text"), str):
            title, text = row["title"], row["text"]
        elif isinstance(row.get("contents"), str):
            title, text = split_contents(row["contents"])
        else:
            pid = None
        if not isinstance(pid, (str, int)):
            raise EnvDataError(f"malformed corpus {path}:{n}: a passage in no known layout (fields found: "
                               f"{sorted(row)}); accepted, one JSON object a line: {'; '.join(CORPUS_LAYOUTS)}")
        pid = str(pid)
        if pid in seen:
            raise EnvDataError(f"malformed corpus {path}:{n}: repeats passage id {pid!r}")
        seen.add(pid)
        out.append({"id": pid, "title": title, "text": text})
    return out


QA_LAYOUTS = ("FlashRAG: {id, question, golden_answers}, the data source its folder's name (<source>/<split>.jsonl) "
              "or a data_source field",
              "Search-R1 (verl): {data_source, prompt: [user message ending 'Question: ...'], reward_model: "
              "{ground_truth: {target}}, extra_info: {split, index}}",
              "verl-agent: the same with prompt [system, ..., user] and extra_info.question; sources searchR1_<name>")


def _question_of(row: dict):
    """The question of a QA row: `question`, else verl-agent's `extra_info.question`, else the last user
    message of a verl `prompt` (after its last "Question:" when it has one)."""
    if isinstance(row.get("question"), str):
        return row["question"]
    extra = row.get("extra_info") if isinstance(row.get("extra_info"), dict) else {}
    if isinstance(extra.get("question"), str):
        return extra["question"]
    prompt = row.get("prompt")
    users = [m.get("content") for m in prompt if isinstance(m, dict) and m.get("role") == "user"] \
        if isinstance(prompt, (list, tuple)) else []
    if users and isinstance(users[-1], str):
        return users[-1].rsplit("Question:", 1)[-1]
    return None


def _qa_record(row: dict, where: str, index: int, source: str = "", split: str = "") -> dict:
    """One question in any of QA_LAYOUTS → {id, question, golden_answers, data_source, task_type[, demo]}.
    `source`: the data source when the row has none (FlashRAG: the file's folder); `split`: the file's split,
    which makes a position-based id (`extra_info.index`, restarting in every split) unique across splits."""
    question = _question_of(row)
    golds = row.get("golden_answers")
    if golds is None:
        golds = ((row.get("reward_model") or {}).get("ground_truth") or {}).get("target")
    if isinstance(golds, str):
        golds = [golds]
    golds = [str(g) for g in golds] if golds is not None and not isinstance(golds, dict) else None
    raw_source = row.get("data_source") or source
    src = raw_source.removeprefix("searchR1_") if isinstance(raw_source, str) else raw_source   # verl-agent's names
    what = f"QA file {where} (fields found: {sorted(row)})"
    if not isinstance(question, str) or not question.strip():
        raise EnvDataError(f"malformed {what} has no 'question'; accepted layouts: {'; '.join(QA_LAYOUTS)}")
    if not golds:
        raise EnvDataError(f"malformed {what} has no 'golden_answers' (nor reward_model.ground_truth.target)")
    if src not in SEARCH_TASK_TYPES:
        raise EnvDataError(f"malformed {what} has data_source {raw_source!r}; known sources: "
                           f"{sorted(SEARCH_TASK_TYPES)} (FlashRAG files: name the folder after the source)")
    extra = row.get("extra_info") if isinstance(row.get("extra_info"), dict) else {}
    if row.get("id") is not None:
        rid = f"{src}:{row['id']}"
    else:                                 # a position: qualified by the split, so train and test cannot collide
        rid = f"{src}:{extra.get('split') or split}-{extra.get('index', index - 1)}"
    rec = {"id": rid, "question": " ".join(question.split()), "golden_answers": golds,
           "data_source": src, "task_type": SEARCH_TASK_TYPES[src]}
    if isinstance(row.get("demo"), dict):
        rec["demo"] = row["demo"]
    return rec


def load_qa(path: str, source: str = "") -> list[dict]:
    """Questions of a QA data file (.jsonl, or .parquet), in any of QA_LAYOUTS.

    FlashRAG's rows (`id`, `question`, `golden_answers`) take their data source from `source` (their
    folder's name, `list_qa`) unless they carry `data_source`; the verl rows that Search-R1's
    `scripts/data_process/qa_search_{train,test}_merge.py` write have `data_source`, the question at the end
    of the user message of `prompt`, the answers in `reward_model.ground_truth.target` and
    `extra_info.{split,index}`; verl-agent's add a system message before it and `extra_info.question`, and
    spell the sources `searchR1_nq`, .... The data source (one of SEARCH_TASK_TYPES) gives the task type.
    Task ids are "<data_source>:<id>", or "<data_source>:<split>-<index>" without an `id` (the merged
    Search-R1 test file reuses ids across sources; indices restart in every split). A bad file raises
    EnvDataError naming the file, the record or line, the fields found and the layouts accepted.
    """
    split = os.path.splitext(os.path.basename(path))[0]
    if path.endswith(".parquet"):
        if not os.path.isfile(path):
            raise EnvDataError(f"QA file {path!r} does not exist")
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise EnvDataError(f"reading {path} needs pyarrow (`pip install -r requirements.txt`), or convert it "
                               f"to JSONL first") from None
        try:
            rows = list(enumerate(pq.read_table(path).to_pylist(), 1))
        except Exception as e:            # noqa: BLE001 - pyarrow raises its own types for a bad file
            raise EnvDataError(f"malformed QA file {path}: not a readable parquet file "
                               f"({type(e).__name__}: {e})") from None
        if not rows:
            raise EnvDataError(f"QA file {path!r} is empty")
    else:
        rows = _read_jsonl(path, "QA file")
    out = [_qa_record(row, f"{path}, row {n}" if path.endswith(".parquet") else f"{path}:{n}", n, source, split)
           for n, row in rows]
    ids = Counter(r["id"] for r in out)
    dup = [i for i, c in ids.items() if c > 1]
    if dup:
        raise EnvDataError(f"malformed QA file {path}: repeated ids {dup[:5]}")
    return out


def list_qa(data_root: str, split: str, task_types=None) -> list[dict]:
    """Questions of `<data_root>/<split>.jsonl` (or `.parquet`), or of FlashRAG's folders
    `<data_root>/<source>/<split>.jsonl` (one per data source, named after it), optionally only 'single'/'multi'.

    The shipped small set is `data/search_qa` (scripts/qa_gen.py: a fictional world, 300 train /
    100 test questions, 170 passages, gold demonstrations verified against BM25 + envs.SearchEnv).
    Search-R1's real data (needs internet): the NQ + HotpotQA train set and the merged seven-set
    test file, as parquet,
        huggingface-cli download --repo-type dataset PeterJinGo/nq_hotpotqa_train --local-dir data/nq_hotpotqa_train
    (`data/nq_hotpotqa_train/{train,test}.parquet`; or rebuild them from FlashRAG with Search-R1's
    `scripts/data_process/qa_search_{train,test}_merge.py`), and for retrieval the E5 index and
    wiki-18 corpus served by Search-R1's own server (in a clone of PeterGriffinJin/Search-R1:
    `python scripts/download.py --save_path <dir>`, then `bash retrieval_launch.sh`, port 8000);
    then `python train.py --env search --data_root data/nq_hotpotqa_train --retriever_url
    http://127.0.0.1:8000`. Without a server, wiki-18's `wiki-18.jsonl` copied to `<data_root>/corpus.jsonl`
    serves the in-process BM25 (its whole 21 M passages need tens of GB of memory to index).
    """
    fix = ("generate the small set with `python scripts/qa_gen.py --out <data_root>` or fetch "
           "Search-R1's data (see env_backends.list_qa)")
    paths = [os.path.join(data_root, f"{split}.{ext}") for ext in ("jsonl", "parquet")]
    path = next((p for p in paths if os.path.isfile(p)), None)
    folders = sorted(d for d in (os.listdir(data_root) if os.path.isdir(data_root) else [])
                     if os.path.isfile(os.path.join(data_root, d, f"{split}.jsonl")))
    if path is not None:
        rows = load_qa(path)
    elif folders:                         # FlashRAG: the data source is the folder's name
        rows = [r for d in folders for r in load_qa(os.path.join(data_root, d, f"{split}.jsonl"), source=d)]
        dup = [i for i, c in Counter(r["id"] for r in rows).items() if c > 1]
        if dup:
            raise EnvDataError(f"the {split} files under {data_root} repeat ids {dup[:5]}")
    else:
        raise EnvDataError(f"no QA split file {paths[0]!r} (nor .parquet, nor FlashRAG's <source>/{split}.jsonl "
                           f"folders); {fix}")
    if task_types is not None:
        wanted = {task_types} if isinstance(task_types, str) else set(task_types)
        bad = wanted - set(SEARCH_TYPES)
        if bad or not wanted:
            raise EnvDataError(f"unknown search task types {sorted(bad) or '(none)'}; expected {list(SEARCH_TYPES)}")
        rows = [r for r in rows if r["task_type"] in wanted]
        if not rows:
            raise EnvDataError(f"no questions of types {sorted(wanted)} in the {split} split of {data_root!r}")
    return rows


# -- retrievers: search(queries, k) -> one list of passage dicts {id, title, text, score} per query


def _contents_to_passage(doc: dict, score) -> dict:
    """A Search-R1 server document ({"id", "contents": '"Title"\\ntext'}) as a passage dict."""
    if "contents" in doc:
        title, text = split_contents(str(doc["contents"]))
    else:
        title, text = str(doc.get("title", "")), str(doc.get("text", ""))
    return {"id": str(doc.get("id", "")), "title": title, "text": text.strip(),
            "score": float(score) if score is not None else None}


def import_bm25s():
    """`bm25s`, imported with JAX kept on the CPU. When JAX is installed, importing bm25s runs a JAX top-k,
    and JAX's first use on a GPU machine preallocates 75% of the GPU's memory for this process (seen on an
    H200: 105 GiB, and the trainer then ran out of memory moving a 0.5B model to the GPU). bm25s's
    retrieval is asked for its numpy backend as well. A JAX_PLATFORMS the user set is kept."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import bm25s
    return bm25s


class BM25Retriever:
    """In-process BM25 (the `bm25s` package) over a JSONL corpus of {"id", "title", "text"}.

    The index of `title + text` (lowercased words of 2+ characters, English stopwords removed) is
    built once and saved next to the corpus in `.bm25_<corpus name>_<content hash>/`; a later
    retriever over the same bytes loads it (`from_cache` tells which happened). Passages with a
    zero score (no query word in them) are not returned, so a query may get fewer than k.
    """

    def __init__(self, corpus_path: str, cache: bool = True):
        import hashlib
        bm25s = import_bm25s()
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
                write_folder(self.cache_dir, lambda tmp: self.index.save(str(tmp), show_progress=False))

    def search(self, queries: list[str], k: int = 3) -> list[list[dict]]:
        bm25s = import_bm25s()
        if not queries:
            return []
        k = min(k, len(self.passages))
        tokens = bm25s.tokenize(list(queries), stopwords="en", return_ids=False, show_progress=False)
        docs, scores = self.index.retrieve(tokens, k=k, show_progress=False, n_threads=1, backend_selection="numpy")
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
                  f"running? (`python scripts/retrieval_server.py --corpus <corpus.jsonl> --port <port>`, or "
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

