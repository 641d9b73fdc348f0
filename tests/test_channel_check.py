"""scripts/channel_check.py: every arm's train.py command parses to the options it names, and the check runs end to
end from a tiny model folder (the in-prompt evaluation, a right and a wrong-procedure arm, the JSON)."""
import argparse
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
import channel_check as C  # noqa: E402
from harness.config import parse_args  # noqa: E402
from infra.env_backends import list_games  # noqa: E402
from test_skill_probe import _tiny_model  # noqa: E402


@pytest.mark.parametrize("setting", list(C.SETTINGS))
@pytest.mark.parametrize("skills,right,wrong", [("type", "generic", "wrong"), ("place", "oracle", "wrong_place")])
def test_every_arm_is_a_valid_train_command_with_the_reward_off(setting, skills, right, wrong):
    for arm in [*C.ARMS, *(f"{x}_wrong" for x in C.ARMS)]:
        flags = C.arm_flags(argparse.Namespace(skills=skills), arm)
        a = parse_args(["--model", "tiny", *C.COMMON, *C.SETTINGS[setting]["train"], *flags])
        assert a.distill_only and a.algo == "opsd" and a.c_kl == 0 and a.c_ent == 0 and a.opsd_keep == 1, arm
        assert a.teacher_loss == flags[flags.index("--teacher_loss") + 1], arm
        assert a.teacher_weights == flags[flags.index("--teacher_weights") + 1], arm
        if "--teacher_support" in flags:
            assert a.teacher_support == flags[flags.index("--teacher_support") + 1], arm
        assert a.teacher_skill == (wrong if arm.endswith("_wrong") else right), arm
        if arm.endswith("_wrong"):
            # the arm's own estimator and weights, the control's skill
            assert flags[:-2] == C.ARMS[arm.removesuffix("_wrong")], arm
    assert [C.arm_flags(argparse.Namespace(skills="type"), f"topk_ema_{side}")[3] for side in ("student", "union")] \
        == ["student", "union"]
    assert parse_args(["--model", "tiny", *C.COMMON, *C.ARMS["gated_beta0"]]).beta == 0
    assert C.BEST in C.ARMS and set(C.QUICK) <= set(C.ARMS)


def test_channel_check_end_to_end_on_a_tiny_model(tmp_path):
    data = ROOT / "data" / "alfworld_clean"
    _tiny_model(list_games(str(data), "train")[:4] + list_games(str(data), "valid_unseen")[:2], tmp_path / "m")
    out = tmp_path / "c" / "channel.json"
    small = ["--eval_games", "2", "--eval_repeats", "1", "--max_turns", "3", "--tasks_per_step", "2",
             "--group_size", "2", "--env_workers", "1", "--max_new_tokens", "16", "--tiny_hidden", "32"]
    r = C.main(["--arms", f"{C.BEST},{C.WRONG}", "--seeds", "0", "--env_steps", "10", "--warm_start",
                str(tmp_path / "m"), "--out", str(out), "--", *small])
    assert json.loads(out.read_text()) == json.loads(json.dumps(r))
    # in the prompt: 2 games x 1 episode, paired over games: every figure a multiple of 1/2
    for k in ("in_prompt_gain", "in_prompt_wrong_gain", "in_prompt_right_minus_wrong", "in_prompt_none"):
        assert abs(2 * r[k] - round(2 * r[k])) < 1e-9, k
    assert r["in_prompt_right_minus_wrong"] == pytest.approx(r["in_prompt_gain"] - r["in_prompt_wrong_gain"])
    for arm in (C.BEST, C.WRONG):
        (s,) = r["arms"][arm]["seeds"]
        # seed 0's evaluation of the start is the in-prompt 'none' evaluation: the same code, weights and numbers
        assert s["start"] == r["in_prompt_none"], arm
        assert s["gain"] == pytest.approx(s["end"] - s["start"]) and r["arms"][arm]["gain"] == s["gain"]
        assert s["rl_steps"] >= 1 and s["diagnostics"]["teacher/skill_token_share"] > 0.5
        assert "--distill_only true" in s["command"]
    prompts = {arm: (tmp_path / "c" / "channel_runs" / f"{arm}_s0" / "teacher_prompt.txt").read_text()
               for arm in (C.BEST, C.WRONG)}
    assert "sinkbasin and clean" in prompts[C.BEST] and "fridge and cool" in prompts[C.WRONG]
    c = r["channel_right_minus_wrong"]
    assert c["per_seed"] == [r["arms"][C.BEST]["gain"] - r["arms"][C.WRONG]["gain"]]
    assert r["arms"][C.BEST]["right_minus_wrong"]["per_seed"] == c["per_seed"]
    assert "through the channel" in C.report(r)
    assert r["data_root"] == "data/alfworld_clean" and "(data data/alfworld_clean)" in C.report(r)   # what it ran on
    with pytest.raises(SystemExit, match="--arms nope: unknown"):
        C.main(["--arms", "nope", "--out", str(out)])
