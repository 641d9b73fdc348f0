"""Tests for envs.py and the ALFWorld half of infra/env_backends.py: prompt and action parsing, game listing,
AlfWorldEnv on the real engine with the shipped games (data/alfworld, written by
scripts/alfworld_gen.py), and EnvPool (lock-step, independent copies of a game, worker crash, worker
timeout, clean shutdown). No mocks of the engine; the hung worker is a SleepyEnv (tests/env_doubles.py)
injected through EnvPool's env_class.
Run: python -m pytest tests/test_envs.py -q   (about a minute on 2 cores)
"""

import json
import multiprocessing as mp
import os
import signal
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from infra import env_backends  # noqa: E402
import envs  # noqa: E402
from infra.env_backends import TASK_TYPES, EnvDataError, GameCache, game_task_type, list_games  # noqa: E402
from env_doubles import SLEEP, SleepyEnv  # noqa: E402
import skills  # noqa: E402
from envs import (MAX_ACTION_CHARS, NOTHING_HAPPENS, R_WIN, AlfWorldEnv, EnvPool, build_prompt,
                  parse_action)  # noqa: E402

DATA = os.path.join(ROOT, "data", "alfworld")
needs_games = pytest.mark.skipif(not os.path.isdir(os.path.join(DATA, "json_2.1.1", "train")),
                                 reason="no shipped games; run `python scripts/alfworld_gen.py --out data/alfworld`")


# ----------------------------------------------------------------------------- constants


def test_task_types_both_ways():
    assert sorted(TASK_TYPES.values()) == sorted(["pick", "look", "clean", "heat", "cool", "pick2"])
    assert env_backends.TASK_TYPES_LONG["pick2"] == "pick_two_obj_and_place"
    assert all(env_backends.TASK_TYPES_LONG[s] == lg for lg, s in TASK_TYPES.items())
    assert R_WIN == 10.0


# ----------------------------------------------------------------------------- prompt


HEAD = "You are an expert agent operating in the ALFRED embodied environment.\n"
TAIL = ("Now it's your turn to take an action. First reason inside <think> </think>, "
        "then give exactly one action inside <action> </action>.")


def test_prompt_no_history_exact():
    p = build_prompt("put a clean apple in fridge.", "-= Welcome =-\n\nYou see a fridge 1.\n\nYour task is to: x.",
                     ["go to fridge 1", "look"], [])
    assert p == (HEAD + "Your task is to: put a clean apple in fridge.\n"
                 "You are now at step 1 and your current observation is: -= Welcome =- You see a fridge 1. "
                 "Your task is to: x.\n"
                 "Your admissible actions of the current situation are: ['go to fridge 1', 'look'].\n" + TAIL)


def test_prompt_history_exact_and_truncated():
    hist = [(f"obs {k}", f"act {k}") for k in range(1, 8)]  # 7 steps taken
    p = build_prompt("find a mug.", "You arrive at\tdesk 1.", ["look"], hist, history_len=3)
    assert p == (HEAD + "Your task is to: find a mug.\n"
                 "Prior to this step, you have already taken 7 step(s). Below are the most recent 3 "
                 "observations and the corresponding actions you took:\n"
                 "[Observation 5: 'obs 5', Action 5: 'act 5']\n"
                 "[Observation 6: 'obs 6', Action 6: 'act 6']\n"
                 "[Observation 7: 'obs 7', Action 7: 'act 7']\n"
                 "You are now at step 8 and your current observation is: You arrive at desk 1.\n"
                 "Your admissible actions of the current situation are: ['look'].\n" + TAIL)
    # fewer steps than the window: all shown; the default window is 5
    p2 = build_prompt("find a mug.", "o", ["look"], hist[:2])
    assert "already taken 2 step(s). Below are the most recent 2 observations" in p2
    assert "[Observation 1: 'obs 1', Action 1: 'act 1']\n[Observation 2: 'obs 2', Action 2: 'act 2']\n" in p2
    assert build_prompt("t", "o", [], hist).count("[Observation") == 5
    # history_len 0 hides history but still counts steps in "step n+1"
    p0 = build_prompt("t", "o", ["look"], hist, history_len=0)
    assert "Prior to this step" not in p0 and "You are now at step 8 " in p0


def test_prompt_without_admissible_and_task_line():
    p = build_prompt("put a  mug\nin sink.", "o", ["look"], [], with_admissible=False)
    assert "admissible" not in p
    lines = p.split("\n")
    assert lines[1] == "Your task is to: put a mug in sink."  # its own line, one line
    assert p == HEAD + "Your task is to: put a mug in sink.\nYou are now at step 1 and your current " \
        "observation is: o\n" + TAIL


def test_prompt_skill_insertion_point():
    p = build_prompt("find a mug.", "Your task is to: find a mug.", ["look"], [("a", "b")])
    q = skills.insert_skill(p, "go to the shelf first", envs.TASK_PREFIX + "find a mug.")
    assert q.split("\n")[2] == "Skill for this task: [go to the shelf first]"
    assert q.split("\n")[1] == "Your task is to: find a mug."


# ----------------------------------------------------------------------------- parse_action


@pytest.mark.parametrize("text,expected", [
    ("<think>go</think><action>go to fridge 1</action>", "go to fridge 1"),
    ("<think></think><action>look</action>", "look"),
    ("<action>open fridge 1</action>", "open fridge 1"),  # no think block: allowed
    ("<think>x</think><action>go to fridge 1", None),  # missing close tag
    ("<action>look</action> then <action>inventory</action>", "inventory"),  # last one wins
    ("<action>look</action> then <action>inventory", "look"),  # last *closed* pair
    ("<action><action>take apple 1</action>", "take apple 1"),  # innermost opening
    ("<action></action>", None),
    ("<action>   </action>", None),
    ("<action>" + "a" * (MAX_ACTION_CHARS + 1) + "</action>", None),
    ("<action>" + "a" * MAX_ACTION_CHARS + "</action>", "a" * MAX_ACTION_CHARS),
    ("<action>go to caf\u00e9 1</action>", None),
    ("<ACTION>Go To Fridge 1</Action>", "go to fridge 1"),
    ("<action>  go   to\tfridge 1  </action>", "go to fridge 1"),
    ("<action>go to\nfridge 1</action>", None),
    ("no tags at all", None),
    ("", None),
    (None, None),
])
def test_parse_action(text, expected):
    assert parse_action(text) == expected


# ----------------------------------------------------------------------------- list_games (tmp data)


def _write_game(folder, task_type="pick_and_place_simple", game=None, solvable=True):
    os.makedirs(folder, exist_ok=True)
    game = game if game is not None else {"pddl_domain": "d", "grammar": "g", "pddl_problem": "p",
                                          "solvable": solvable, "walkthrough": []}
    with open(os.path.join(folder, "game.tw-pddl"), "w") as f:
        f.write(game if isinstance(game, str) else json.dumps(game))
    with open(os.path.join(folder, "traj_data.json"), "w") as f:
        json.dump({"task_type": task_type, "pddl_params": {}}, f)
    return os.path.join(folder, "game.tw-pddl")


def test_list_games_missing_root(tmp_path):
    with pytest.raises(EnvDataError, match="does not exist.*alfworld-download"):
        list_games(str(tmp_path / "nope"), "train")


def test_list_games_missing_split_lists_present(tmp_path):
    (tmp_path / "json_2.1.1" / "train").mkdir(parents=True)
    (tmp_path / "json_2.1.1" / "valid_seen").mkdir()
    with pytest.raises(EnvDataError) as e:
        list_games(str(tmp_path), "valid_unseen")
    msg = str(e.value)
    assert "valid_unseen" in msg and "['train', 'valid_seen']" in msg
    assert "alfworld-download" in msg and "scripts/alfworld_gen.py" in msg


def test_list_games_empty_split(tmp_path):
    (tmp_path / "json_2.1.1" / "train" / "some-folder").mkdir(parents=True)
    with pytest.raises(EnvDataError, match="no games found"):
        list_games(str(tmp_path), "train")


def test_list_games_filters_skips_and_sorts(tmp_path):
    split = tmp_path / "json_2.1.1" / "train"
    b = _write_game(str(split / "pick_and_place_simple-B-None-C-1" / "t0"))
    a = _write_game(str(split / "pick_and_place_simple-A-None-C-1" / "t0"))
    h = _write_game(str(split / "pick_heat_then_place_in_recep-A-None-C-1" / "t0"), "pick_heat_then_place_in_recep")
    _write_game(str(split / "pick_and_place_simple-A-None-C-2" / "t0"), solvable=False)
    _write_game(str(split / "pick_and_place_simple-Sliced-None-C-2" / "t0"))
    _write_game(str(split / "pick_and_place_simple-movable-None-C-2" / "t0"))
    nogame = split / "pick_and_place_simple-Z-None-C-2" / "t0"
    nogame.mkdir(parents=True)
    (nogame / "traj_data.json").write_text(json.dumps({"task_type": "pick_and_place_simple"}))
    assert list_games(str(tmp_path), "train") == sorted([a, b, h])
    assert list_games(str(tmp_path), "train", ["pick"]) == sorted([a, b])
    assert list_games(str(tmp_path), "train", ["pick_heat_then_place_in_recep"]) == [h]
    assert list_games(str(tmp_path), "train", "heat") == [h]
    assert game_task_type(h) == "heat"
    with pytest.raises(EnvDataError, match="no games found"):
        list_games(str(tmp_path), "train", ["cool"])


def test_list_games_unknown_task_type(tmp_path):
    _write_game(str(tmp_path / "json_2.1.1" / "train" / "x" / "t0"))
    with pytest.raises(EnvDataError, match="unknown ALFWorld task type 'pickup'"):
        list_games(str(tmp_path), "train", ["pickup"])


def test_list_games_malformed_json(tmp_path):
    g = _write_game(str(tmp_path / "json_2.1.1" / "train" / "x" / "t0"), game="{not json")
    with pytest.raises(EnvDataError, match="invalid JSON") as e:
        list_games(str(tmp_path), "train")
    assert g in str(e.value)


def test_load_malformed_game_names_path(tmp_path):
    bad_json = _write_game(str(tmp_path / "a" / "t0"), game="[1, 2")
    no_keys = _write_game(str(tmp_path / "b" / "t0"), game={"solvable": True, "grammar": "g"})
    env = AlfWorldEnv(cache=GameCache())
    with pytest.raises(EnvDataError, match="invalid JSON") as e:
        env.reset(bad_json)
    assert bad_json in str(e.value)
    with pytest.raises(EnvDataError, match="missing") as e:
        env.reset(no_keys)
    assert no_keys in str(e.value) and "pddl_domain" in str(e.value)
    with pytest.raises(EnvDataError, match="does not exist"):
        env.reset(str(tmp_path / "nope" / "game.tw-pddl"))


# ----------------------------------------------------------------------------- shipped games


@pytest.fixture(scope="module")
def games():
    return list_games(DATA, "train")


@pytest.fixture(scope="module")
def one_per_type(games):
    first = {}
    for g in games:
        first.setdefault(game_task_type(g), g)
    assert sorted(first) == sorted(TASK_TYPES.values())
    return [first[t] for t in env_backends.SHORT_TASK_TYPES]


def _walkthrough(gamefile):
    with open(gamefile) as f:
        return json.load(f)["walkthrough"]


def _trace(gamefile):
    with open(os.path.join(os.path.dirname(gamefile), "walkthrough.json")) as f:
        return json.load(f)["steps"]


@needs_games
def test_shipped_splits_list(games):
    assert len(games) >= 6 and games == sorted(games)
    for split in ("valid_seen", "valid_unseen"):
        assert list_games(DATA, split)


@needs_games
def test_reset_deterministic_and_info(games):
    g = games[0]
    env = AlfWorldEnv()
    obs1, info1 = env.reset(g)
    env.step("look")
    obs2, info2 = env.reset(g)
    other = AlfWorldEnv(cache=GameCache())  # a second instance with its own cache and engine
    obs3, info3 = other.reset(g)
    assert obs1 == obs2 == obs3 and info1 == info2 == info3
    assert envs.TASK_PREFIX + info1["task"] in obs1
    assert info1["task"] == _trace(g)[0]["obs"].rsplit(envs.TASK_PREFIX, 1)[1].strip()
    assert set(info1) >= {"won", "task_type", "task", "admissible", "gamefile", "steps"}
    assert info1["won"] is False and info1["steps"] == 0 and info1["task_type"] == game_task_type(g)
    assert info1["admissible"] == sorted(info1["admissible"]) and "help" not in info1["admissible"]
    assert "look" in info1["admissible"] and info1["gamefile"] == os.path.abspath(g)


@needs_games
def test_walkthrough_wins_each_type_and_matches_stored_trace(one_per_type):
    argv = list(sys.argv)
    env = AlfWorldEnv()
    for g in one_per_type:
        trace, actions = _trace(g), _walkthrough(g)
        obs, info = env.reset(g)
        assert obs == trace[0]["obs"]
        assert info["admissible"] == [a for a in trace[0]["admissible"] if a != "help"]
        for k, action in enumerate(actions):
            obs, reward, done, info = env.step(action)
            last = k == len(actions) - 1
            assert obs == trace[k + 1]["obs"], (g, k)
            if not last:  # the stored trace has no admissible list after the final step
                assert info["admissible"] == [a for a in trace[k + 1]["admissible"] if a != "help"]
            assert reward == (R_WIN if last else 0.0) and done == last and info["won"] == last
        assert info["steps"] == len(actions) and not info["truncated"] and not info["invalid_action"]
    assert sys.argv == argv  # fast_downward's sys.argv hack is undone


STOCK_ENGINE = r"""
import json, sys
import textworld
from textworld.envs.pddl import PddlEnv
from alfworld.agents.environment.alfred_tw_env import AlfredDemangler
plays, out_path = json.load(open(sys.argv[1])), sys.argv[2]
env = AlfredDemangler(PddlEnv(textworld.EnvInfos(admissible_commands=True, won=True)))
out = []
for gamefile, actions in plays:
    env.load(gamefile)
    s = env.reset()
    trace = [[s.feedback, s.admissible_commands, s.won]]
    for a in actions:
        s, _, _ = env.step(a)
        trace.append([s.feedback, s.admissible_commands, s.won])
    out.append(trace)
json.dump(out, open(out_path, "w"))
"""


@needs_games
def test_random_play_matches_untouched_textworld(one_per_type, tmp_path):
    """Cached states and the template memo change nothing: random play (admissible and not) gives
    the same texts as stock textworld + AlfredDemangler in a fresh interpreter."""
    import random
    import subprocess
    env, plays, ours = AlfWorldEnv(max_steps=100), [], []
    for k, g in enumerate(one_per_type):
        rng = random.Random(k)
        obs, info = env.reset(g)
        actions, trace = [], [[obs, info["admissible"], False]]
        for _ in range(15):
            a = rng.choice(info["admissible"] + ["look", "help", "fly to the moon"])
            obs, _, done, info = env.step(a)
            actions.append(a)
            trace.append([obs, info["admissible"], info["won"]])
            if done:
                break
        plays.append([g, actions])
        ours.append(trace)
    (tmp_path / "plays.json").write_text(json.dumps(plays))
    subprocess.run([sys.executable, "-c", STOCK_ENGINE, str(tmp_path / "plays.json"), str(tmp_path / "out.json")],
                   check=True, timeout=120, cwd=ROOT)
    stock = json.loads((tmp_path / "out.json").read_text())
    for trace_ours, trace_stock in zip(ours, stock, strict=True):
        assert len(trace_ours) == len(trace_stock)
        for (o1, a1, w1), (o2, a2, w2) in zip(trace_ours, trace_stock):
            assert o1 == o2 and a1 == [a for a in a2 if a != "help"] and w1 == w2


def test_task_from_intro():
    intro = "-= Welcome =-\n\nYou see a desk 1.\n\nYour task is to: put a  mug in\nsink."
    assert envs.task_from_intro(intro) == "put a mug in sink."
    with pytest.raises(EnvDataError, match="no 'Your task is to: ' line"):
        envs.task_from_intro("You see a desk 1.")


@needs_games
def test_engine_level_malformed_games_name_path(games, tmp_path):
    with open(games[0]) as f:
        good = json.load(f)
    cases = {"bad_problem": (dict(good, pddl_problem="(define (problem x)"), "cannot load game"),
             "no_task_line": (dict(good, grammar=good["grammar"].replace("Your task is to: ", "Do: ")),
                              "no 'Your task is to: ' line")}
    env = AlfWorldEnv(cache=GameCache())
    for name, (game, message) in cases.items():
        path = _write_game(str(tmp_path / name / "t0"), game=game)
        with pytest.raises(EnvDataError, match=message) as e:
            env.reset(path)
        assert path in str(e.value)
    obs, info = env.reset(games[0])  # the env is still usable
    assert info["error"] is None and not info["won"]


@needs_games
def test_non_admissible_invalid_and_truncation(games):
    g = games[0]
    env = AlfWorldEnv(max_steps=4)
    _, info0 = env.reset(g)
    obs, r, done, info = env.step("fly to the moon")  # goes to the engine
    assert (obs, r, done, info["won"], info["invalid_action"]) == (NOTHING_HAPPENS, 0.0, False, False, False)
    assert info["admissible"] == info0["admissible"] and info["steps"] == 1
    for k, bad in enumerate(["   ", "x" * (MAX_ACTION_CHARS + 1), "go to caf\u00e9 1"]):
        obs, r, done, info = env.step(bad)
        assert obs == NOTHING_HAPPENS and r == 0.0 and info["invalid_action"] is True
        assert info["steps"] == k + 2 and info["admissible"] == info0["admissible"]
    assert done and info["truncated"] and not info["won"]  # 4 steps = max_steps
    with pytest.raises(RuntimeError):
        env.step("look")
    # None counts as an invalid action; a win on the very last allowed step is not "truncated"
    actions = _walkthrough(g)
    env = AlfWorldEnv(max_steps=len(actions) + 1)
    env.reset(g)
    assert env.step(None)[3]["invalid_action"]
    for a in actions:
        obs, r, done, info = env.step(a)
    assert r == R_WIN and done and info["won"] and not info["truncated"]


@needs_games
def test_game_cache_reuse_and_bound(games):
    cache = GameCache(capacity=2)
    env = AlfWorldEnv(cache=cache)
    for g in games[:3]:
        env.reset(g)
    assert len(cache) == 2 and games[0] not in cache and games[2] in cache
    t = time.perf_counter()
    env.reset(games[2])
    assert cache.hits == 1 and cache.misses == 3
    assert time.perf_counter() - t < 0.5  # a cached reset skips the load


# ----------------------------------------------------------------------------- EnvPool


STEP_TIMEOUT = 4.0


@pytest.fixture(scope="module")
def pool():
    if not os.path.isdir(os.path.join(DATA, "json_2.1.1", "train")):
        pytest.skip("no shipped games")
    p = EnvPool(num_workers=2, max_steps=50, step_timeout=STEP_TIMEOUT, env_class=SleepyEnv)
    yield p
    p.close()


def _play(pool, scripts):
    """Lock-step: episode i plays scripts[i] (then 'look'); returns per-episode result lists."""
    results = [[] for _ in scripts]
    k = 0
    while any(pool.active):
        actions = [s[k] if k < len(s) else "look" for s in scripts]
        out = pool.step(actions)
        for i, o in enumerate(out):
            if o is not None:
                results[i].append(o)
            else:
                assert not pool.active[i]
        k += 1
    return results


@needs_games
def test_pool_walkthroughs_win_lockstep(pool, one_per_type):
    resets = pool.reset(one_per_type)
    env = AlfWorldEnv()
    for g, (obs, info) in zip(one_per_type, resets):
        assert (obs, info) == env.reset(g)  # worker processes produce the same texts
    scripts = [_walkthrough(g) for g in one_per_type]
    results = _play(pool, scripts)
    for g, s, res in zip(one_per_type, scripts, results):
        assert len(res) == len(s), g
        assert [r for _, r, _, _ in res] == [0.0] * (len(s) - 1) + [R_WIN]
        assert res[-1][3]["won"] and res[-1][2] and res[-1][3]["error"] is None
        assert [o for o, _, _, _ in res] == [st["obs"] for st in _trace(g)[1:]]
    assert pool.step([None] * len(one_per_type)) == [None] * len(one_per_type)


@needs_games
def test_pool_copies_of_one_game_are_independent(pool, games):
    g = games[0]
    wt = _walkthrough(g)
    resets = pool.reset([g] * 5)  # workers 0,1,0,1,0
    assert len({obs for obs, _ in resets}) == 1
    scripts = [wt, ["look"] * 3 + wt, ["inventory"] * 60, wt[:1] + ["look"] * 60, [None] * 60]
    results = _play(pool, scripts)
    assert results[0][-1][3]["won"] and len(results[0]) == len(wt)
    assert results[1][-1][3]["won"] and len(results[1]) == len(wt) + 3
    for i in (2, 3, 4):
        assert len(results[i]) == 50 and results[i][-1][3]["truncated"] and not results[i][-1][3]["won"]
    assert results[3][0][0] == results[0][0][0]  # same first action, same answer from the same state
    assert results[3][1][0] != results[0][1][0] or wt[1] == "look"
    assert all(r[3]["invalid_action"] for r in results[4])


@needs_games
def test_pool_bad_gamefile_fails_one_episode(pool, games):
    errors = pool.stats["errors"]
    resets = pool.reset([games[0], "/no/such/game.tw-pddl", games[1]])
    assert resets[0][1]["error"] is None and resets[2][1]["error"] is None
    assert "does not exist" in resets[1][1]["error"] and resets[1][0] == ""
    assert pool.active == [True, False, True] and pool.stats["errors"] == errors + 1
    out = pool.step(["look", "look", "look"])
    assert out[1] is None and out[0][3]["steps"] == 1 and out[2][3]["steps"] == 1
    with pytest.raises(ValueError):
        pool.step(["look"])


@needs_games
def test_pool_worker_crash_is_contained(pool, games):
    g = games[1]
    pool.reset([g] * 4)
    pool.step(["look"] * 4)
    before, old_pid = dict(pool.stats), pool.pids[0]
    os.kill(old_pid, signal.SIGKILL)  # worker 0 runs episodes 0 and 2
    out = pool.step(["look"] * 4)
    for i in (0, 2):
        obs, r, done, info = out[i]
        assert done and r == 0.0 and not info["won"] and info["error"] == "worker crashed"
        assert info["steps"] == 2
    for i in (1, 3):
        assert out[i][3]["error"] is None and not out[i][2] and out[i][3]["steps"] == 2
    assert pool.active == [False, True, False, True]
    assert pool.stats["crashes"] == before["crashes"] + 1
    assert pool.stats["restarts"] == before["restarts"] + 1
    assert pool.stats["errors"] == before["errors"] + 2
    assert pool.pids[0] != old_pid and not _alive(old_pid)
    # the replacement worker plays a full episode
    pool.reset([g, g])
    res = _play(pool, [_walkthrough(g)] * 2)
    assert res[0][-1][3]["won"] and res[1][-1][3]["won"]


@needs_games
def test_pool_step_timeout(pool, games):
    pool.reset(games[:4])
    before, old_pid = dict(pool.stats), pool.pids[1]
    t = time.monotonic()
    out = pool.step(["look", SLEEP + " 60", "look", "look"])  # worker 1 (episodes 1, 3) hangs
    assert time.monotonic() - t < STEP_TIMEOUT + 30
    for i in (1, 3):
        assert out[i][2] and out[i][1] == 0.0 and out[i][3]["error"] == "timeout" and not out[i][3]["won"]
    for i in (0, 2):
        assert out[i][3]["error"] is None
    assert pool.stats["timeouts"] == before["timeouts"] + 1
    assert pool.stats["restarts"] == before["restarts"] + 1
    assert pool.pids[1] != old_pid and not _alive(old_pid)
    out = pool.step(["look"] * 4)
    assert out[1] is None and out[3] is None and out[0] is not None


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is not alive
        return f.read().split(")")[-1].split()[0] != "Z"


@needs_games
def test_pool_close_leaves_no_children(games):
    with EnvPool(num_workers=2, step_timeout=STEP_TIMEOUT) as p:
        pids = p.pids
        p.reset(games[:2])
        assert all(_alive(pid) for pid in pids)
        t = time.monotonic()  # the default env_class is AlfWorldEnv: the sleep string is just a command
        out = p.step([SLEEP + " 60", "look"])
        assert out[0][0] == NOTHING_HAPPENS and time.monotonic() - t < STEP_TIMEOUT
    assert not any(_alive(pid) for pid in pids)
    assert not [c for c in mp.active_children() if c.pid in pids]
    p.close()  # idempotent
    with pytest.raises(RuntimeError):
        p.reset(games[:1])
