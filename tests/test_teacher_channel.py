"""The teacher channel's diagnostics: --teacher_skill generic (each game's type-level workflow as the teacher's
skill) and the teacher − student gap on the tool actions of a procedure against the rest (train.teacher_gaps)."""
import random
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import envs  # noqa: E402
import train as T  # noqa: E402
from harness import cpu_preset  # noqa: E402
from harness.run import Run  # noqa: E402
from rollout import Turn  # noqa: E402

CLEAN = sorted((ROOT / "data/alfworld_clean/json_2.1.1/train").glob("*/*/game.tw-pddl"))[0]


def test_tool_actions_of_each_type():
    assert cpu_preset.tool_action("go to sinkbasin 1", "clean") and cpu_preset.tool_action("clean mug 1 with sinkbasin 1", "clean")
    assert not cpu_preset.tool_action("go to countertop 1", "clean")
    assert cpu_preset.tool_action("heat potato 1 with microwave 1", "heat") and not cpu_preset.tool_action("go to sinkbasin 1", "heat")
    assert not cpu_preset.tool_action("go to sinkbasin 1", "pick")   # pick has no tool


def test_generic_teacher_skill_is_the_games_type_level_workflow():
    args = T.parse_args(["--algo", "opsd", "--teacher_skill", "generic"])
    run = Run(args, Path("."), torch.device("cpu"), None, [], None, skill_rng=random.Random(0),
              generic_skill=cpu_preset.generic_skill_of_game)
    b = T.Batch([{"gamefile": str(CLEAN)}], [], [], [], [T.TaskRecord(str(CLEAN), "clean")])
    T.write_skills(run, b)   # no engine: nothing is generated
    rec = b.records[0]
    assert rec.skill == cpu_preset.game_rule_skills(CLEAN.with_name("walkthrough.json"), with_place=False)[0]
    assert "sinkbasin" in rec.skill and rec.replay_ok and rec.source == "generic"
    assert b.skill_gens[0].token_ids == []                          # no skill-writing sample
    for argv in (["--algo", "rsipo", "--teacher_skill", "generic"], ["--algo", "opsd", "--teacher_skill", "generic",
                                                                      "--env", "search"]):
        with pytest.raises(SystemExit, match="--teacher_skill"):
            T.parse_args(argv)


def test_teacher_gaps_split_tool_actions_from_the_rest():
    class Pool:
        parse_action = staticmethod(envs.parse_action)

    run = Run(T.Args(), Path("."), torch.device("cpu"), None, [], Pool(), tool_action=cpu_preset.tool_action)

    def sample(action, teacher, old):
        turn = Turn([1], [2, 3], [], False, "g", "clean", 0, 0, 0,
                    response_text=f"<think> </think> <action> {action} </action>")
        return T.Sample([1], [2, 3], 0.0, torch.tensor(old), teacher=torch.tensor(teacher), turn=turn)
    gaps = T.teacher_gaps(run, [sample("go to sinkbasin 1", [-1.0, -0.5], [-2.0, -1.5]),     # +1, +1
                                sample("clean mug 1 with sinkbasin 1", [-1.0, -1.0], [-1.0, -4.0]),   # 0, +3
                                sample("go to shelf 1", [-2.0, -2.0], [-1.0, -1.5])])    # -1, -0.5
    assert gaps["teacher/gap_tool"] == pytest.approx(5 / 4) and gaps["teacher/tokens_tool"] == 4
    assert gaps["teacher/gap_other"] == pytest.approx(-0.75) and gaps["teacher/tokens_other"] == 2
    run.tool_action = None                    # no preset that knows the tools: every turn is "other"
    assert set(T.teacher_gaps(run, [sample("go to sinkbasin 1", [0.0, 0.0], [0.0, 0.0])])) == {
        "teacher/gap_other", "teacher/tokens_other"}
