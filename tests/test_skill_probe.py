"""scripts/skill_probe.py: the oracle skill of a shipped game, and the probe run end to end on the real
engine with a tiny randomly initialised model saved as a Hugging Face folder."""
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import train as T  # noqa: E402
from harness import tiny  # noqa: E402
from infra.env_backends import list_games  # noqa: E402

DATA = ROOT / "data" / "alfworld"
GAME = DATA / "json_2.1.1/valid_unseen/look_at_obj_in_light-BasketBall-None-DeskLamp-301/trial_small_2_00055_1059828510"


def _tiny_model(games, folder: Path):
    """A randomly initialised tiny model, with a tokenizer trained on the games' warm-start text, saved as a
    Hugging Face folder."""
    pairs = tiny.walkthrough_samples(games, 2, skills=True)
    tok = tiny.train_tiny_tokenizer([p + " " + r for p, r in pairs] + ["user assistant"])
    torch.manual_seed(0)
    tiny.tiny_model(len(tok), T.Args(tiny_hidden=32)).save_pretrained(folder)
    tok.save_pretrained(folder)


def test_game_rule_skills_name_where_the_walkthrough_took_the_object():
    # walkthrough: go to desk 1, take basketball 1 from desk 1, use desklamp 1; task type look
    won, failed = tiny.game_rule_skills(GAME / "walkthrough.json")
    assert won.startswith("the basketball was at desk 1; otherwise go to each receptacle")
    assert won.endswith("then go to the desklamp and use the desklamp.")
    assert failed.startswith("do not repeat the same action")
    assert failed.endswith("use it while holding the basketball.") and "desk 1" not in failed
    # without the place: the same workflow minus "the basketball was at desk 1; otherwise "
    assert tiny.game_rule_skills(GAME / "walkthrough.json", with_place=False)[0] == won.split("; otherwise ", 1)[1]


def test_skill_probe_runs_every_condition(tmp_path):
    sys.path.insert(0, str(ROOT / "scripts"))
    import skill_probe
    games = list_games(str(DATA), "train")[:6] + list_games(str(DATA), "valid_unseen")[:6]
    _tiny_model(games, tmp_path / "m")
    bank = {"skills": {t: [{"text": f"a {t} skill"}] for t in ("pick", "look", "clean", "heat", "cool", "pick2")}}
    (tmp_path / "bank.json").write_text(json.dumps(bank))
    out = tmp_path / "probe.json"
    skill_probe.main(["--model", str(tmp_path / "m"), "--games", "6", "--repeats", "1", "--max_turns", "3",
                      "--workers", "1", "--bank", str(tmp_path / "bank.json"), "--out", str(out)])
    r = json.loads(out.read_text())
    assert list(r["success"]) == ["none", "oracle", "generic", "wrong_place", "other", "bank"]
    for cond in r["success"].values():   # 6 episodes: every rate is k/6; one game per task type (round-robin)
        assert abs(cond["all"] * 6 - round(cond["all"] * 6)) < 1e-9
        assert set(cond) == {"all", "pick", "look", "clean", "heat", "cool", "pick2"}
    # paired differences against none over the 6 games: each a multiple of 1/6, its s.e. finite
    assert set(r["vs_none"]) == {"oracle", "generic", "wrong_place", "other", "bank", "oracle_minus_wrong_place"}
    # stage 0's verdict: right and wrong-type gains as vs_none gives them, and go only past both bars
    p = r["premise"]
    assert (p["right_minus_none"] == r["vs_none"]["generic"]["gain"]
            and p["wrong_minus_none"] == r["vs_none"]["other"]["gain"])
    assert p["go"] == (100 * p["right_minus_none"] >= 5 and p["right_minus_wrong"] > 2 * p["right_minus_wrong_se"])
    assert p["line"].startswith("premise check: " + ("GO" if p["go"] else "NO-GO"))
    for v in r["vs_none"].values():
        assert v["games"] == 6 and abs(v["gain"] * 6 - round(v["gain"] * 6)) < 1e-9 and v["se"] >= 0
    g = r["gap"]
    assert 6 <= g["turns"] <= 18 and g["tokens"] > g["turns"]   # 6 episodes of 1..3 turns, several tokens each
    assert g["mean_abs_per_token"] > 0   # the skill changes the prompt, so an untrained model's scores move
    assert set(r["gaps"]) == {"oracle", "generic"} and r["gaps"]["oracle"] == g
    for x in r["gaps"].values():          # every response token is in exactly one part
        assert x["tokens_think"] + x["tokens_action_tool"] + x["tokens_action_other"] == x["tokens"] == g["tokens"]


def test_token_gaps_split_the_action_of_tool_turns_from_the_rest():
    sys.path.insert(0, str(ROOT / "scripts"))
    import math
    import skill_probe
    from rollout import Turn

    class Tok:                              # one word per token id
        words = ["<think>", "x", "</think>", "<action>", "go", "to", "sinkbasin", "shelf", "1", "</action>"]

        def decode(self, ids):
            return " ".join(self.words[i] for i in ids)

    def turn(action_ids):
        ids = [0, 1, 2, 3, *action_ids, 9]
        return Turn([1], ids, [], False, "g", "clean", 0, 0, 0, response_text=Tok().decode(ids))
    tool, other = turn([4, 5, 6, 8]), turn([4, 5, 7, 8])   # go to sinkbasin 1 | go to shelf 1
    assert skill_probe.action_start(Tok(), tool.response_ids) == 4   # "<action>" is token 3: the action from 4
    assert skill_probe.action_start(Tok(), [0, 1]) == 2               # no action: all reasoning
    assert skill_probe.action_start(Tok(), [3, 4]) == 1 and skill_probe.action_start(Tok(), [0, 1, 2, 3]) == 4
    d_tool = torch.tensor([0.0, 0.005, -0.2, 0.0, 0.5, 0.0, 2.0, 0.0, 0.0])
    d_other = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -1.0, 0.0, -0.5])
    g = skill_probe.token_gaps([d_tool, d_other], [tool, other], Tok())
    assert g["tokens"] == 18 and g["turns"] == 2
    assert g["mean_per_token"] == pytest.approx((0.005 - 0.2 + 0.5 + 2.0 - 1.0 - 0.5) / 18)
    assert g["mean_per_turn"] == pytest.approx((2.305 - 1.5) / 2) and g["turn_share_teacher_higher"] == 0.5
    assert g["share_abs_lt_0.01"] == pytest.approx(13 / 18)
    assert g["share_gt_0.1"] == pytest.approx(2 / 18) and g["share_lt_-0.1"] == pytest.approx(3 / 18)
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    assert g["gate_mean_beta5"] == pytest.approx(
        (13 * 0.5 - 0.5 + sig(0.025) + sig(-1.0) + sig(2.5) + sig(10.0) + sig(-5.0) + sig(-2.5)) / 18, abs=1e-6)
    # the reasoning: the first 4 tokens of each turn; the actions: 5 tokens each
    assert g["tokens_think"] == 8 and g["gap_think"] == pytest.approx((0.005 - 0.2) / 8)
    assert g["tokens_action_tool"] == 5 and g["gap_action_tool"] == pytest.approx(2.5 / 5)
    assert g["share_higher_action_tool"] == pytest.approx(2 / 5)
    assert g["tokens_action_other"] == 5 and g["gap_action_other"] == pytest.approx(-1.5 / 5)
    assert g["share_higher_action_other"] == 0.0


def test_skill_probe_on_one_task_type(tmp_path):
    sys.path.insert(0, str(ROOT / "scripts"))
    import pytest
    import skill_probe
    games = list_games(str(DATA), "train")[:6]
    _tiny_model(games, tmp_path / "m")
    out = tmp_path / "probe.json"
    skill_probe.main(["--model", str(tmp_path / "m"), "--types", "heat", "--games", "2", "--repeats", "1",
                      "--max_turns", "2", "--workers", "1", "--out", str(out)])
    r = json.loads(out.read_text())
    # no other type to draw a wrong-type skill from; heat has a tool, so the wrong-procedure skill is probed
    assert list(r["success"]) == ["none", "oracle", "generic", "wrong", "wrong_place"]
    assert set(r["vs_none"]) == {"oracle", "generic", "wrong", "wrong_place", "generic_minus_wrong",
                                 "oracle_minus_wrong_place"}
    d = r["vs_none"]["oracle_minus_wrong_place"]   # paired over the same 2 games: a difference of the two gains
    assert d["gain"] == pytest.approx(r["vs_none"]["oracle"]["gain"] - r["vs_none"]["wrong_place"]["gain"])
    assert all(set(c) == {"all", "heat"} for c in r["success"].values())
    assert r["written"]["won_episodes"] == round(r["success"]["none"]["all"] * 2)
    with pytest.raises(SystemExit) as e:
        skill_probe.main(["--model", str(tmp_path / "m"), "--types", "boil", "--games", "2"])
    assert "--types boil" in str(e.value)


def test_skill_facts_against_the_games_truth(tmp_path):
    sys.path.insert(0, str(ROOT / "scripts"))
    import skill_probe
    wt = GAME / "walkthrough.json"   # look: basketball, found at desk 1, desklamp
    right = tiny.game_rule_skills(wt)[0]
    assert tiny.skill_facts(right, wt) == {"object": True, "target": True, "tool": True, "place": True,
                                                  "wrong_tool": False}
    # another object, no lamp, the wrong place, a tool of another type ("desk 10" is not "desk 1")
    wrong = "the mug was at desk 10; go to the microwave and heat the mug; then go to the desk."
    assert tiny.skill_facts(wrong, wt) == {"object": False, "target": False, "tool": True, "place": False,
                                                  "wrong_tool": True}
    bank = {"look": [{"text": right, "task_id": str(GAME / "game.tw-pddl")},
                     {"text": wrong, "task_id": str(GAME / "game.tw-pddl")},
                     {"text": right}]}   # no game: skipped
    s = skill_probe.score_bank(bank)
    assert s["look"]["skills"] == 2 and s["look"]["object"] == 0.5 and s["all"]["wrong_tool"] == 0.5


def test_own_mode_writes_with_the_trainers_prompt_and_retries_once(tmp_path):
    sys.path.insert(0, str(ROOT / "scripts"))
    import skill_probe
    from rollout import Episode, Generation

    class Engine:
        max_prompt_tokens = 10_000
        prompt_len = staticmethod(lambda p: len(p.split()))

        def __init__(self, answers):
            self.answers, self.calls = list(answers), []

        def generate(self, prompts, **kw):
            self.calls.append((prompts, kw))
            return [Generation(self.answers.pop(0), [1], [0.0], [0]) for _ in prompts]

    eps = [Episode("g", "clean", "put a clean mug in shelf.", 0, i, steps=[("obs", "go to sinkbasin 1")], won=w)
           for i, w in enumerate([True, False])]
    engine = Engine(['{"skill": "rinse the mug"}', "no json", "still none"])
    out = skill_probe.write_skills(engine, eps, 0.0, 64)
    assert out == ["rinse the mug", None]                  # the second failed twice: one retry, then None
    (first, kw), (retry, _) = engine.calls
    assert "Outcome: SUCCESS" in first[0] and "Outcome: FAILURE" in first[1] and retry == [first[1]]
    assert kw["greedy"] and kw["max_new_tokens"] == 64 and kw["stop"] is False


def test_own_mode_runs_end_to_end(tmp_path):
    sys.path.insert(0, str(ROOT / "scripts"))
    import skill_probe
    games = list_games(str(DATA), "train")[:6]
    _tiny_model(games, tmp_path / "m")
    out = tmp_path / "own.json"
    skill_probe.main(["--model", str(tmp_path / "m"), "--own", "--split", "train", "--games", "3", "--repeats", "2",
                      "--sources", "2", "--max_turns", "2", "--workers", "1", "--out", str(out)])
    r = json.loads(out.read_text())
    assert r["args"]["temperature"] == 1.0                  # the training rollouts' temperature by default
    assert r["games_with_won"] + r["games_with_lost"] >= 3  # every game has a won or a lost source episode
    assert abs(r["control_success"] * 6 - round(r["control_success"] * 6)) < 1e-9   # 3 games x 2 episodes
    g = r["conditions"]["generic"]                          # the type-level skill is played on every game
    assert g["games"] == 3 and abs(g["gain"] * 2 - round(g["gain"] * 2)) < 1e-9 and 0 <= g["rule_share"] <= 1
    assert g["rule_share"] == 1.0                            # the generic workflow names the object and target


def test_cross_skills_take_another_games_skill_made_over_and_its_wrong_procedure():
    sys.path.insert(0, str(ROOT / "scripts"))
    import random
    import skill_probe
    import envs
    from skills import adapt_skill
    medium = ROOT / "data" / "alfworld_medium"
    cleans = [g for g in list_games(str(medium), "valid_unseen") if "pick_clean" in g][:3]
    own = {g: tiny.game_rule_skills(tiny.walkthrough_of(g))[0] for g in cleans[:2]}   # the third wrote none
    (_, raw), (_, made), (_, wrong) = skill_probe.cross_skills(cleans, own, random.Random(0))
    assert set(raw) == set(cleans)                       # each game gets a skill of another game of its type
    for g in cleans:
        src = next(h for h in own if own[h] == raw[g] and h != g)
        terms, src_terms = (envs.task_terms(skill_probe._task_of(x)) for x in (g, src))
        assert made[g] == adapt_skill(raw[g], src_terms, terms)
        assert all(t in made[g] for t in terms)           # it names this game's object and target
        assert wrong[g] == made[g].replace("go to the sinkbasin and clean the", "go to the fridge and cool the")
        assert wrong[g] != made[g]


def test_premise_check_goes_only_past_both_bars():
    sys.path.insert(0, str(ROOT / "scripts"))
    import skill_probe
    none = {g: 0.0 for g in "abcd"}
    # the right skill wins 3 of 4 games, the wrong one none: +75 ± 25 over none, right − wrong +75 ± 25 (3 s.e.)
    go = skill_probe.premise({"none": none, "generic": {"a": 1, "b": 1, "c": 1, "d": 0}, "other": dict(none)})
    assert go["go"] and go["right_minus_none"] == 0.75 and go["right_minus_wrong_se"] == pytest.approx(0.25)
    # the wrong skill does as well: right − wrong 0, no-go though the right skill adds 75 points
    same = skill_probe.premise({"none": none, "generic": {"a": 1, "b": 1, "c": 1, "d": 0},
                                "other": {"a": 1, "b": 1, "c": 1, "d": 0}})
    assert not same["go"] and same["right_minus_wrong"] == 0.0 and same["line"].startswith("premise check: NO-GO")
    # under 5 points (1 of 40 games won): no-go
    small = skill_probe.premise({"none": {str(i): 0 for i in range(40)},
                                 "generic": {str(i): float(i == 0) for i in range(40)},
                                 "other": {str(i): 0 for i in range(40)}})
    assert not small["go"] and small["right_minus_none"] == pytest.approx(0.025)
    assert skill_probe.premise({"none": none, "generic": none}) is None


def test_skill_probe_refuses_games_without_a_walkthrough_before_loading_a_model(tmp_path):
    sys.path.insert(0, str(ROOT / "scripts"))
    import shutil
    import skill_probe
    dst = tmp_path / "data" / GAME.relative_to(DATA)
    shutil.copytree(GAME, dst, ignore=shutil.ignore_patterns("walkthrough.json"))
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")   # not a loadable model: the probe must stop before loading it
    with pytest.raises(SystemExit) as e:
        skill_probe.main(["--model", str(tmp_path / "m"), "--data_root", str(tmp_path / "data"), "--split",
                          "valid_unseen", "--games", "1"])
    assert "1 of the 1 games" in str(e.value) and "walkthrough.json" in str(e.value)
