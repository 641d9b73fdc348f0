"""The game generator (scripts/alfworld_gen.py): real scenes in, official-layout games out,
walkthroughs that win in the engine."""
import json
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import alfworld_gen as G  # noqa: E402


def test_mangle_matches_alfred_ids():
    # ALFRED's own mangling example, character by character.
    assert G.mangle("Apple|-01.50|+00.90|+00.30") == \
        "Apple_bar__minus_01_dot_50_bar__plus_00_dot_90_bar__plus_00_dot_30"


def test_scene_split_disjoint():
    train, unseen = set(G.scenes_for("train")), set(G.scenes_for("valid_unseen"))
    assert len(train) == 96 and len(unseen) == 24 and not train & unseen
    assert set(G.scenes_for("valid_seen")) == train


def test_sample_is_deterministic_and_small_room_size():
    scene = G.load_scene(10)  # a real kitchen: 'Microwave' and 'Fridge' are in it
    a = G.sample_game(scene, "pick_heat_then_place_in_recep", random.Random(3), "small", 3)
    b = G.sample_game(scene, "pick_heat_then_place_in_recep", random.Random(3), "small", 3)
    assert a is not None and a == b
    assert 5 <= len(a.receptacles) <= 8
    assert any(G.rtype(r) == "Microwave" for r in a.receptacles)
    # every object sits in a receptacle of the room that canContain it
    can = G._can_contain()
    for o, r in a.placement.items():
        assert r in a.receptacles and o.split("|")[0] in can[G.rtype(r)]
    prob = G.problem_pddl(a, "p")
    assert "(canContain" in prob and "(heatable" in prob and "(:goal" in prob


def test_generate_split_writes_official_layout_and_walkthroughs_win(tmp_path):
    paths = G.generate_split(tmp_path, "train", 6, "small", seed=5, verbose=False)
    assert len(paths) == 6
    types = set()
    for p in paths:
        assert p.name == "game.tw-pddl" and p.parent.parent.parent.name == "train"
        game = json.loads(p.read_text())
        assert set(game) >= {"pddl_domain", "grammar", "pddl_problem", "solvable", "walkthrough"}
        traj = json.loads((p.parent / "traj_data.json").read_text())
        types.add(traj["task_type"])
        assert traj["turk_annotations"]["anns"][0]["task_desc"] in game["grammar"]
        wt = json.loads((p.parent / "walkthrough.json").read_text())
        assert [s["action"] for s in wt["steps"][:-1]] == game["walkthrough"]
    assert types == set(G.TASK_TYPES)  # the generator cycles through the six types
    res = G.verify(tmp_path, verbose=False)
    assert res == {"games": 6, "won": 6, "failed": []}
    # Same seed, same games, byte for byte.
    again = G.generate_split(tmp_path / "again", "train", 2, "small", seed=5, verbose=False)
    assert [q.read_text() for q in again] == [q.read_text() for q in paths[:2]]


def test_loads_with_alfworlds_own_collector(tmp_path):
    from alfworld.agents.environment.alfred_tw_env import AlfredTWEnv
    G.generate_split(tmp_path, "valid_unseen", 2, "small", seed=1, verbose=False)
    cfg = {"env": {"goal_desc_human_anns_prob": 0, "task_types": [1, 2, 3, 4, 5, 6]},
           "dataset": {"eval_ood_data_path": str(tmp_path / "json_2.1.1" / "valid_unseen"), "num_eval_games": -1},
           "general": {"training_method": "dqn"}}
    env = AlfredTWEnv(cfg, train_eval="eval_out_of_distribution")
    assert env.num_games == 2


def test_one_task_type_only(tmp_path):
    assert G.long_types("heat,pick2") == ("pick_heat_then_place_in_recep", "pick_two_obj_and_place")
    paths = G.generate_split(tmp_path, "valid_unseen", 2, "small", seed=7, verbose=False, types=G.long_types("heat"))
    assert [json.loads((p.parent / "traj_data.json").read_text())["task_type"] for p in paths] == \
        ["pick_heat_then_place_in_recep"] * 2
    with pytest.raises(ValueError, match="--types"):
        G.generate_split(tmp_path, "train", 1, "small", seed=0, verbose=False, types=("boil",))
    with pytest.raises(SystemExit):                  # the command line names the flag
        G.main(["--out", str(tmp_path / "x"), "--train", "1", "--valid_seen", "0", "--valid_unseen", "0",
                "--types", "boil"])


def test_bad_room_and_missing_root(tmp_path):
    with pytest.raises(ValueError, match="room"):
        G.generate_split(tmp_path, "train", 1, "huge", seed=0, verbose=False)
    with pytest.raises(FileNotFoundError, match="no games"):
        G.verify(tmp_path / "nothing", verbose=False)


def test_walkthroughs_only_writes_the_same_trace_without_the_game_file(tmp_path):
    # same seed and split as a full generation → the same games; only game.tw-pddl is left out
    full = G.generate_split(tmp_path / "full", "train", 2, "small", seed=5, verbose=False)
    only = G.generate_split(tmp_path / "only", "train", 2, "small", seed=5, verbose=False, with_game=False)
    for f, o in zip(full, only):
        assert f.exists() and not o.exists()
        assert sorted(p.name for p in o.parent.iterdir()) == ["traj_data.json", "walkthrough.json"]
        assert (o.parent / "walkthrough.json").read_text() == (f.parent / "walkthrough.json").read_text()


def test_medium_rooms_step_cap_and_informed_expert(tmp_path):
    paths = G.generate_split(tmp_path, "train", 6, "medium", seed=5, verbose=False, max_steps=20, informed=True)
    sizes = []
    for p in paths:
        wt = json.loads((p.parent / "walkthrough.json").read_text())
        traj = json.loads((p.parent / "traj_data.json").read_text())
        sizes.append(traj["generator"]["n_receptacles"])
        acts, told = [s["action"] for s in wt["steps"][:-1]], [s["action"] for s in wt["informed"][:-1]]
        assert len(acts) <= 20 and len(told) <= 20            # shipped only if the expert wins within the cap
        # the informed expert goes first to where the plain one took the object, and takes one there
        place = next(a for a in acts if a.startswith("take ")).split(" from ", 1)[1]
        assert told[0] == f"go to {place}"
        assert next(a for a in told if a.startswith("take ")).endswith(f" from {place}")
        env = G.load_engine(str(p))                           # its trace wins in the engine too
        env.reset()
        assert [bool(env.step(a)[0]["won"]) for a in told][-1]
        # one step under the expert's need, the same game is refused
        pp = traj["pddl_params"]
        with pytest.raises(G.ExpertFailed, match=f"more than {len(acts) - 1} steps"):
            G.play_expert(env, pp["object_target"], pp["parent_target"], traj["task_type"], pp["toggle_target"],
                          max_steps=len(acts) - 1)
    assert max(sizes) >= 12 and all(s <= 16 for s in sizes)  # 12-16 receptacles where the scene has them


class _State(dict):
    def __init__(self, feedback, admissible, won=False):
        super().__init__(won=won)
        self.feedback, self.admissible_commands = feedback, admissible


class _RoomWithoutSink:
    """A stand-in engine: a clean task in a room with a countertop that holds the cloth and no sinkbasin."""
    def reset(self):
        return _State("You are in a room.", ["go to countertop 1", "go to cabinet 1"])

    def step(self, cmd):
        if cmd == "go to countertop 1":
            return _State("On the countertop 1, you see a cloth 1.",
                          ["take cloth 1 from countertop 1", "go to cabinet 1"]), 0, False
        return _State("You pick up the cloth 1.", ["go to countertop 1", "go to cabinet 1"]), 0, False


def test_expert_refuses_a_room_without_the_tool_instead_of_crashing():
    # the generator skips a game the expert cannot play; a missing tool once ended the run with StopIteration
    with pytest.raises(G.ExpertFailed, match="no sinkbasin in this room"):
        G.play_expert(_RoomWithoutSink(), "Cloth", "Cabinet", "pick_clean_then_place_in_recep")
