"""Tests for skills.py: analyzer prompt (Eq. 2), parse_skill, insert_skill (§2.9), SkillBank (§2.10)."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from skills import (SKILL_PREFIX, SkillBank, SkillEntry, adapt_skill, analyzer_prompt, insert_skill,  # noqa: E402
                    parse_skill)

STEPS = [
    ("You are in the middle of a room. You see a cabinet 1, a fridge 1.", "go to countertop 1"),
    ("On the countertop 1, you see an apple 1.", "take apple 1 from countertop 1"),
    ("You pick up the apple 1 from the countertop 1.", "go to sinkbasin 1"),
]
TASK = "put a clean apple in fridge."

ALFWORLD_PROMPT = (
    "You are an expert agent operating in the ALFRED embodied environment.\n"
    "Your task is to: put a clean apple in fridge.\n"
    "You are in the middle of a room. Looking quickly around you, you see a cabinet 1, a fridge 1.\n"
    "Your admissible actions of the current situation are: [go to cabinet 1, go to fridge 1].\n"
    "Now it's your turn to take an action."
)


# ----------------------------------------------------------------------------- analyzer prompt


def test_analyzer_prompt_exact_success():
    p = analyzer_prompt(TASK, True, STEPS[:2], max_words=60)
    assert p == (
        "You are reviewing one episode of an agent acting in a text environment.\n"
        "Task: put a clean apple in fridge.\n"
        "Outcome: SUCCESS\n"
        "\n"
        "Episode:\n"
        "Step 1\n"
        "Observation: You are in the middle of a room. You see a cabinet 1, a fridge 1.\n"
        "Action: go to countertop 1\n"
        "\n"
        "Step 2\n"
        "Observation: On the countertop 1, you see an apple 1.\n"
        "Action: take apple 1 from countertop 1\n"
        "\n"
        "The agent succeeded. Write a reusable step-by-step workflow for this kind of task: "
        "the general steps that led to success.\n"
        'Use at most 60 words. Answer with exactly one JSON object and nothing else: {"skill": "..."}'
    )


def test_analyzer_prompt_blocks_in_order_and_outcome():
    p = analyzer_prompt(TASK, False, STEPS)
    assert "Task: put a clean apple in fridge.\nOutcome: FAILURE\n" in p
    assert "SUCCESS" not in p
    positions = []
    for k, (obs, act) in enumerate(STEPS, start=1):
        block = f"Step {k}\nObservation: {obs}\nAction: {act}\n"
        assert p.count(block) == 1
        positions.append(p.index(block))
    assert positions == sorted(positions)
    assert "Use at most 80 words." in p


def test_analyzer_request_differs_success_failure():
    ok = analyzer_prompt(TASK, True, STEPS).splitlines()
    bad = analyzer_prompt(TASK, False, STEPS).splitlines()
    assert ok[-2].startswith("The agent succeeded. Write a reusable step-by-step workflow")
    assert bad[-2] == ("The agent failed. Write avoidance rules for this kind of task: the "
                       "mistakes made in this episode and what to do instead.")
    assert "avoidance" not in ok[-2] and "workflow" not in bad[-2]
    assert ok[-1] == bad[-1]  # same JSON request


def test_analyzer_truncates_observations_and_collapses_whitespace():
    obs = "x" * 1000
    p = analyzer_prompt(TASK, True, [(obs, "look"), ("a\n\n  b", "go   to\tdesk 1")], max_obs_chars=50)
    assert f"Observation: {'x' * 50} [...]\nAction: look\n" in p
    assert "x" * 51 not in p
    assert "Observation: a b\nAction: go to desk 1\n" in p


def test_analyzer_keeps_last_steps_with_real_numbers():
    steps = [(f"obs {i}", f"act {i}") for i in range(1, 41)]
    p = analyzer_prompt(TASK, False, steps, max_steps=5)
    assert "Episode:\n(steps 1-35 omitted)\nStep 36\nObservation: obs 36\nAction: act 36\n" in p
    assert "Step 35\n" not in p and "obs 35\n" not in p
    assert p.count("\nStep ") == 5
    assert "Step 40\nObservation: obs 40\nAction: act 40\n" in p
    # bounded: 40 long steps cost no more than max_steps truncated blocks
    long = [("y" * 5000, "z" * 5000)] * 200
    assert len(analyzer_prompt(TASK, True, long, max_obs_chars=100, max_steps=10)) < 3000


def test_analyzer_empty_episode():
    p = analyzer_prompt(TASK, False, [])
    assert "Episode:\n(no steps)\n\nThe agent failed." in p


# ----------------------------------------------------------------------------- parse_skill


@pytest.mark.parametrize("text, expected", [
    ('{"skill": "Find the apple, clean it at the sink, then put it in the fridge."}',
     "Find the apple, clean it at the sink, then put it in the fridge."),
    ('```json\n{"skill": "1. go to sink\\n2. clean"}\n```', "1. go to sink 2. clean"),
    ('```\n{"skill": "fenced without language"}\n```', "fenced without language"),
    ('Here is my analysis of the episode.\nThe skill is:\n{"skill": "Check the fridge first."} Done.',
     "Check the fridge first."),
    ('<think>The agent {looped}. I should write {"skill": "draft"}</think>'
     '\n{"skill": "Open the fridge before putting."}',
     "Open the fridge before putting."),
    ('the template opened <think>; reasoning here</think>{"skill": "After think."}', "After think."),
    ('{"skill": "Use {object} at {receptacle}; never \\"toggle\\" twice } ok"}',
     'Use {object} at {receptacle}; never "toggle" twice } ok'),
    ('{"note": {"a": 1}, "skill": "nested object ok"}', "nested object ok"),
    ('prose {not json} then {"skill": "second span"}', "second span"),
    ('{"other": 1} {"skill": "the one with the key"}', "the one with the key"),
    ('{"skill": "  lots   of\n\twhitespace  "}', "lots of whitespace"),
    ('{"skill": "Café—naïve steps are fine"}', "Café—naïve steps are fine"),
])
def test_parse_skill_valid(text, expected):
    assert parse_skill(text) == expected


@pytest.mark.parametrize("text", [
    "",
    "I think the agent should go to the fridge.",  # no JSON
    '{"skill": "trailing comma",}',  # malformed
    "{'skill': 'python quotes'}",  # malformed
    '{"a": {"skill": "inner of a malformed span"}, oops}',  # malformed span skipped whole
    '{"advice": "no skill key"}',  # missing key
    '{"skill": ""}',  # empty
    '{"skill": "   \\n  "}',  # blank
    '{"skill": 42}',  # non-string
    '{"skill": ["go", "take"]}',  # non-string
    '{"skill": null}',
    '["skill", "a list"]',
    '{"skill": "先去水槽清洗苹果，然后放进冰箱。"}',  # Chinese
    '{"skill": "Step 1: 找到苹果 Step 2: 清洗"}',  # mostly Chinese
    # retry cases: truncated generation, unclosed think, echoed placeholder
    '{"skill": "1. Go to the countertop. 2. Take the',
    '<think>The agent failed because {"skill": "draft"} it never opened',
    '<think>long reasoning that ran out of tokens',
    '{"skill": "..."}',
    '```json\n{"skill": \n```',
])
def test_parse_skill_invalid(text):
    assert parse_skill(text) is None


def test_parse_skill_word_limit():
    words = ["w"] * 160
    assert parse_skill(json.dumps({"skill": " ".join(words)})) == " ".join(words)  # 2 x 80 ok
    assert parse_skill(json.dumps({"skill": " ".join(words + ["w"])})) is None  # huge
    assert parse_skill(json.dumps({"skill": "a b c d e"}), max_words=2) is None
    assert parse_skill(json.dumps({"skill": "a b c d"}), max_words=2) == "a b c d"


def test_parse_skill_non_ascii_threshold():
    # 10 non-space chars: 2 non-ASCII (20%) is accepted, 3 (30%) is not
    assert parse_skill(json.dumps({"skill": "abcdefgh éé"})) == "abcdefgh éé"
    assert parse_skill(json.dumps({"skill": "abcdefg ééé"})) is None
    assert parse_skill(json.dumps({"skill": "abcdefg ééé"}, ensure_ascii=False)) is None


def test_parse_skill_not_a_string():
    assert parse_skill(None) is None


# ----------------------------------------------------------------------------- insert_skill


def test_insert_skill_alfworld():
    out = insert_skill(ALFWORLD_PROMPT, "Find the apple, clean it, cool it.", TASK)
    lines = out.split("\n")
    assert lines[1] == "Your task is to: put a clean apple in fridge."
    assert lines[2] == "Skill for this task: [Find the apple, clean it, cool it.]"
    assert out == ALFWORLD_PROMPT.replace(
        "fridge.\nYou are", "fridge.\nSkill for this task: [Find the apple, clean it, cool it.]\nYou are")
    assert lines[:2] + lines[3:] == ALFWORLD_PROMPT.split("\n")


def test_insert_skill_replaces_existing_and_is_idempotent():
    once = insert_skill(ALFWORLD_PROMPT, "old skill", TASK)
    assert insert_skill(once, "old skill", TASK) == once
    new = insert_skill(once, "new\n skill", TASK)
    assert new == insert_skill(ALFWORLD_PROMPT, "new skill", TASK)
    assert new.count(SKILL_PREFIX) == 1 and "old skill" not in new


def test_insert_skill_empty_or_none_unchanged():
    assert insert_skill(ALFWORLD_PROMPT, "", TASK) == ALFWORLD_PROMPT
    assert insert_skill(ALFWORLD_PROMPT, None, TASK) == ALFWORLD_PROMPT
    assert insert_skill(ALFWORLD_PROMPT, "  \n ", TASK) == ALFWORLD_PROMPT


def test_insert_skill_missing_task_line():
    with pytest.raises(ValueError, match="task line 'heat some egg' not found"):
        insert_skill(ALFWORLD_PROMPT, "skill", "heat some egg")
    with pytest.raises(ValueError, match="not found"):
        insert_skill(ALFWORLD_PROMPT, "skill", "")


def test_insert_skill_first_match_and_last_line():
    p = "Question: who?\nContext\nQuestion: who?"
    assert insert_skill(p, "s", "who?") == "Question: who?\nSkill for this task: [s]\nContext\nQuestion: who?"
    assert insert_skill("Task: x", "s", "x") == "Task: x\nSkill for this task: [s]"
    assert insert_skill("Task: x\n", "s", "x") == "Task: x\nSkill for this task: [s]\n"
    assert insert_skill("Task: x\nSkill for this task: [a]", "b", "x") == "Task: x\nSkill for this task: [b]"
    assert insert_skill("Task: x\nSkill for this task: [a]\n", "b", "x") == "Task: x\nSkill for this task: [b]\n"


# ----------------------------------------------------------------------------- SkillBank


def test_bank_add_keep_reject():
    b = SkillBank()
    assert b.add("clean", "wash at sink", 0.5, 0.3, "g1", 1) is True
    assert b.add("clean", "bad skill", 0.5, 0.0, "g2", 1) is False  # shrunk gain not > 0
    assert b.add("clean", "worse skill", -0.2, -0.1, "g3", 1) is False
    assert b.add("clean", "nan skill", 0.5, float("nan"), "g4", 1) is False
    assert b.add("clean", "  ", 0.5, 0.4, "g5", 1) is False
    assert len(b) == 1
    assert b.best("clean") == [SkillEntry("wash at sink", "clean", "g1", 1, 1, 0.5, 0.3)]
    assert b.best("heat") == []


def test_bank_merge_identical_text():
    b = SkillBank()
    b.add("cool", "use the fridge", 0.5, 0.2, "g1", 3)
    assert b.add("cool", "use  the\nfridge", 0.25, 0.1, "g2", 7) is True
    assert b.add("cool", "use the fridge", 0.75, 0.05, "g3", 9) is True  # last, not max
    assert len(b) == 1
    e = b.best("cool")[0]
    assert (e.uses, e.mean_gain, e.shrunk_gain, e.task_id, e.step) == (3, 0.5, 0.05, "g1", 3)
    # same text under another type is a separate entry
    b.add("heat", "use the fridge", 0.5, 0.2, "g4", 9)
    assert len(b) == 2


def test_bank_eviction_order():
    b = SkillBank(capacity=3)
    assert b.add("pick", "a", 0.1, 0.30, "t", 1)
    assert b.add("pick", "b", 0.1, 0.10, "t", 2)
    assert b.add("pick", "c", 0.1, 0.20, "t", 3)
    assert b.add("pick", "d", 0.1, 0.25, "t", 4) is True  # evicts b (0.10)
    assert [e.text for e in b.best("pick", 10)] == ["a", "d", "c"]
    assert b.add("pick", "e", 0.1, 0.05, "t", 5) is False  # the newcomer is the lowest
    assert [e.text for e in b.best("pick", 10)] == ["a", "d", "c"]
    assert b.add("pick", "f", 0.1, 0.20, "t", 6) is True  # tie with c at 0.20: oldest (c) goes
    assert [e.text for e in b.best("pick", 10)] == ["a", "d", "f"]
    assert b.add("look", "g", 0.1, 0.01, "t", 7) is True  # capacity is per type
    assert len(b) == 4


def test_bank_best_sorted():
    b = SkillBank()
    for i, s in enumerate([0.2, 0.9, 0.5, 0.9]):
        b.add("heat", f"s{i}", 0.0, s, f"g{i}", i)
    assert [e.text for e in b.best("heat", 3)] == ["s1", "s3", "s2"]
    assert [e.text for e in b.best("heat")] == ["s1"]


def test_bank_save_load_roundtrip(tmp_path):
    b = SkillBank(capacity=4)
    b.add("clean", "wash at sink 1", 0.5, 0.3, "game-7", 10)
    b.add("clean", "wash at sink 1", 1 / 3, 0.2, "game-8", 11)
    b.add("pick2", "take both, one at a time", 0.7, 0.6, "game-9", 12)
    path = tmp_path / "ckpt" / "skills.json"
    b.save(str(path))
    assert sorted(os.listdir(path.parent)) == ["skills.json"]  # no temp file left
    text = path.read_text()
    assert text.startswith('{\n  "version": 2,\n  "capacity": 4,\n')  # pretty, readable
    c = SkillBank.load(str(path))
    assert c.to_dict() == b.to_dict()
    assert c.capacity == 4 and len(c) == 2
    assert c.best("clean")[0] == b.best("clean")[0]
    b.add("look", "turn on the lamp", 0.5, 0.5, "g", 13)
    b.save(str(path))  # overwrite in place
    assert SkillBank.load(str(path)).to_dict() == b.to_dict()


def test_bank_save_failure_keeps_old_file(tmp_path, monkeypatch):
    path = tmp_path / "skills.json"
    b = SkillBank()
    b.add("clean", "wash", 0.5, 0.3, "g1", 1)
    b.save(str(path))
    before = path.read_text()
    b.add("clean", "second", 0.5, 0.3, "g2", 2)

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(json, "dump", boom)
    with pytest.raises(OSError, match="disk full"):
        b.save(str(path))
    assert path.read_text() == before
    assert os.listdir(tmp_path) == ["skills.json"]


@pytest.mark.parametrize("content, match", [
    ("{not json", "invalid JSON"),
    ("[]", "'skills' object"),
    ('{"version": 1, "capacity": 8, "skills": {}}', "version 1, expected 2"),   # a bank without trust and task
    ('{"version": 2, "capacity": 0, "skills": {}}', "capacity"),
    ('{"version": 2, "capacity": 8, "skills": {"clean": {}}}', "must be a list"),
    ('{"version": 2, "capacity": 8, "skills": {"clean": [{"text": "x"}]}}', "exactly the keys"),
    ('{"version": 2, "capacity": 8, "skills": {"clean": [{"text": "x", "task_type": "clean", "task_id": "g", '
     '"step": "1", "uses": 1, "mean_gain": 0.1, "shrunk_gain": 0.1, "trust": 0.5, "task": "t"}]}}', "'step'"),
])
def test_bank_load_malformed(tmp_path, content, match):
    path = tmp_path / "skills.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=match) as info:
        SkillBank.load(str(path))
    assert str(path) in str(info.value)


def test_bank_keeps_each_skills_trust_and_task_sentence():
    b = SkillBank()
    b.add("clean", "wash the bowl at the sinkbasin", 0.5, 0.3, "g1", 1, trust=0.8, task="put a clean bowl in cabinet.")
    b.add("clean", "wash the bowl at the sinkbasin", 0.25, 0.2, "g2", 2, trust=0.6, task="other sentence")
    (e,) = b.skills["clean"]
    assert (e.trust, e.task, e.task_id) == (0.6, "put a clean bowl in cabinet.", "g1")   # last λ, first task


def test_adapt_skill_puts_the_new_tasks_object_and_target_in_place():
    skill = "take the Bowl from cabinet 2; clean the bowl at the sinkbasin; put the bowls in the cabinet."
    assert adapt_skill(skill, ("bowl", "cabinet"), ("mug", "shelf")) == \
        "take the mug from shelf 2; clean the mug at the sinkbasin; put the mugs in the shelf."
    # the roles swap at once, not one after the other
    assert adapt_skill("move the pan to the pot", ("pan", "pot"), ("pot", "pan")) == "move the pot to the pan"
    # whole words only: "cup" is no part of "cupboard"
    assert adapt_skill("take the cup from the cupboard", ("cup", "shelf"), ("mug", "desk")) == \
        "take the mug from the cupboard"
    # no terms (search QA), a different number, or repeated source terms: unchanged
    for src, dst in (((), ()), (("bowl",), ("mug", "shelf")), (("bowl", "bowl"), ("mug", "shelf"))):
        assert adapt_skill(skill, src, dst) == skill


def test_bank_summary():
    b = SkillBank()
    assert b.summary() == "Skill bank: empty"
    b.add("clean", "wash at sink", 0.5, 0.3, "g1", 1)
    b.add("clean", "low one", 0.1, 0.1, "g2", 2)
    b.add("clean", "lowest one", 0.1, 0.05, "g3", 3)
    b.add("cool", "use the fridge", -0.25, 0.125, "g4", 4)
    assert b.summary(n_per_type=2) == (
        "Skill bank: 4 skills, 2 task types (capacity 8 per type)\n"
        "[clean] 3 skills\n"
        "  1. shrunk gain +0.300, mean gain +0.500, uses 1 (task g1, step 1): wash at sink\n"
        "  2. shrunk gain +0.100, mean gain +0.100, uses 1 (task g2, step 2): low one\n"
        "[cool] 1 skills\n"
        "  1. shrunk gain +0.125, mean gain -0.250, uses 1 (task g4, step 4): use the fridge"
    )


def test_bank_capacity_validated():
    with pytest.raises(ValueError, match="capacity"):
        SkillBank(capacity=0)


def test_parse_skill_accepts_spaced_key_from_word_level_decoding():
    # the tiny tokenizer decodes {"skill": "..."} as {" skill ": " ... "}
    assert parse_skill('{" skill ": " go to desk 1 , take it . "}') == "go to desk 1 , take it ."
    assert parse_skill('{"skills": "x"}') is None


def test_rule_skill_success_and_failure_texts():
    from harness.tiny import rule_skill
    s = rule_skill("heat", "Apple", "CounterTop", won=True, visited=["countertop 2"])
    assert s.startswith("the apple was at countertop 2;")
    assert "go to the microwave and heat the apple with it" in s and s.endswith("move the apple to it.")
    f = rule_skill("pick2", "Mug", "Shelf", won=False)
    assert f.startswith("do not repeat the same action") and "move it to the shelf" in f
    look = rule_skill("look", "Book", toggle="DeskLamp")
    assert look.endswith("then go to the desklamp and use the desklamp.")
    # every rule skill is a valid skill for the parser (the warm start trains on them as JSON)
    import json
    for t in ("pick", "look", "clean", "heat", "cool", "pick2"):
        for won in (True, False):
            txt = rule_skill(t, "Apple", "Fridge", "DeskLamp", won)
            assert parse_skill(json.dumps({"skill": txt})) == txt
