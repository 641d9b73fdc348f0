"""harness/tiny.py: the tiny preset's tokenizer (phrase tokens, save/load), its warm-start data."""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from harness import tiny  # noqa: E402
import rollout as R  # noqa: E402
import train as T  # noqa: E402


def test_tiny_tokenizer_round_trips_through_a_saved_checkpoint(tmp_path):
    # AutoTokenizer would rebuild a saved tiny tokenizer as Qwen2's BPE class (other ids);
    # load_tokenizer must give back exactly the ids the policy was trained with.
    tok = tiny.train_tiny_tokenizer(["go to desk 1", "take mug 1 from desk 1 <think> </think> <action> </action>"])
    tok.save_pretrained(tmp_path)
    back = R.load_tokenizer(str(tmp_path))
    s = "<think> </think> <action> take mug 1 from desk 1 </action>"
    assert back.encode(s, add_special_tokens=False) == tok.encode(s, add_special_tokens=False)
    assert R.chat_ids(back, "go to desk 1") == R.chat_ids(tok, "go to desk 1")
    assert back.eos_token_id == tok.eos_token_id and back.pad_token_id == tok.pad_token_id


def test_template_phrases_occur_in_the_prompts_and_become_single_tokens(tmp_path):
    from harness.tiny import ANALYZER_PHRASES, PROMPT_PHRASES, SEARCH_PHRASES
    from envs import build_prompt, build_search_prompt
    from skills import SKILL_PREFIX, analyzer_prompt, insert_skill
    intro = ("-= Welcome to TextWorld, ALFRED! =- You are in the middle of a room. Looking quickly around you, "
             "you see a desk 1, and a shelf 1. Your task is to: put a mug in shelf.")
    alf = build_prompt("put a mug in shelf.", "You arrive at desk 1.", ["go to shelf 1", "take mug 1 from desk 1"],
                       [(intro, "go to desk 1")], history_len=2)
    alf = insert_skill(alf, "take the mug to the shelf", "Your task is to: put a mug in shelf.")
    search = build_search_prompt("who?", "no", history=[("q", "<search> a </search>")] * 2, history_len=1)
    an = analyzer_prompt("put a mug in shelf.", True, [("obs", "go to desk 1")]) + \
        analyzer_prompt("put a mug in shelf.", False, [("obs", "go to desk 1")])
    # the phrase lists stay in sync with the templates: every fixed text occurs verbatim
    for p in PROMPT_PHRASES:
        assert p in intro + alf, p
    for p in SEARCH_PHRASES:
        assert p in search, p
    for p in ANALYZER_PHRASES:
        assert p in an + alf, p
    tok = tiny.train_tiny_tokenizer([alf, an, "user assistant"])
    words = tiny.train_tiny_tokenizer([alf, an, "user assistant"], phrases=())
    ids = tok.encode(alf, add_special_tokens=False)
    toks = tok.convert_ids_to_tokens(ids)
    in_prompt = PROMPT_PHRASES + (SKILL_PREFIX.strip(),)   # "Skill for this task:"
    # each phrase in the prompt is one token (the tail holds <think> etc. inside it: longest match wins)
    for p in in_prompt:
        assert toks.count(p) == alf.count(p) > 0, p
    # the same count as the word tokenizer on the prompt with every phrase replaced by one word
    one_word = alf
    for p in sorted(in_prompt, key=len, reverse=True):
        one_word = one_word.replace(p, " PHRASE ")
    assert len(ids) == len(words.encode(one_word, add_special_tokens=False))
    assert len(ids) < 0.5 * len(words.encode(alf, add_special_tokens=False))   # this short prompt: 188 → 78
    # responses keep their word tokens and decode unchanged; the phrases survive save/load
    r = "<think> </think> <action> go to shelf 1 </action>"
    assert tok.encode(r, add_special_tokens=False) == [tok.convert_tokens_to_ids(w) for w in r.split()]
    assert tok.decode(tok.encode(r, add_special_tokens=False)) == r
    tok.save_pretrained(tmp_path)
    assert R.load_tokenizer(str(tmp_path)).encode(alf, add_special_tokens=False) == ids


def test_warm_start_adds_the_walkthrough_only_games(tmp_path):
    from infra.env_backends import list_games
    games = list_games(str(ROOT / "data" / "alfworld"), "train")[:2]
    extra = sorted((ROOT / "data" / "alfworld_sft").glob("json_2.1.1/*/*/*/walkthrough.json"))[:3]
    own = tiny.walkthrough_samples(games, 2)
    both = tiny.walkthrough_samples(games + [str(p) for p in extra], 2)
    # one sample per walkthrough step with an action
    n_extra = sum(sum(s["action"] is not None for s in json.loads(p.read_text())["steps"]) for p in extra)
    assert n_extra > 0 and len(both) == len(own) + n_extra
    with pytest.raises(SystemExit, match="--sft_walkthroughs"):
        T.parse_args(["--sft_walkthroughs", str(tmp_path / "missing")])


def test_walkthrough_folders_read_the_train_split_of_each_folder_in_order(tmp_path):
    for root, split, name in [("b", "train", "t1"), ("b", "valid_unseen", "v1"), ("a", "train", "t2"),
                              ("a", "train", "t0")]:
        d = tmp_path / root / "json_2.1.1" / split / name / "trial"
        d.mkdir(parents=True)
        (d / "walkthrough.json").write_text("{}")
    got = [str(Path(p).relative_to(tmp_path).parts[0]) + "/" + Path(p).parent.parent.name
           for p in tiny.walkthrough_folders(f"{tmp_path / 'b'}, {tmp_path / 'a'}")]
    assert got == ["b/t1", "a/t0", "a/t2"]           # b first as listed; no valid_unseen game (it is held out)
    assert tiny.walkthrough_folders("") == []
    with pytest.raises(SystemExit, match=r"--sft_walkthroughs folder not found: .*missing"):
        T.parse_args(["--sft_walkthroughs", f"{tmp_path / 'a'},{tmp_path / 'missing'}"])
    with pytest.raises(SystemExit, match="--sft_rl_games false with no --sft_walkthroughs"):
        T.parse_args(["--sft_rl_games", "false", "--sft_walkthroughs", ""])


def test_the_default_warm_start_clones_the_other_folders_not_the_rl_games(monkeypatch):
    import types
    from infra.env_backends import list_games

    def pairs(argv, **kw):
        monkeypatch.chdir(ROOT)
        a = T.parse_args(argv)
        return tiny.warm_start_pairs(a, types.SimpleNamespace(train=list_games(a.data_root, "train")), None,
                                           skills=a.uses_skills, **kw)
    default = pairs([])
    # the same samples as the clean-held-out warm start built on data/alfworld (its RL games plus data/alfworld_sft)
    assert default == pairs(["--preset", "none", "--data_root", "data/alfworld", "--sft_hold_out", "clean"])
    assert len(pairs(["--sft_rl_games", "true"])) > len(default)         # the flag is what leaves the RL games out
    # with a procedure held out, grpo clones the same samples (else it would never see clean done at all) ...
    assert pairs(["--algo", "grpo"]) == default
    # ... and without one, walkthroughs only (no skill samples), as before
    assert len(pairs(["--algo", "grpo", "--preset", "none", "--data_root", "data/alfworld"])) < \
        len(pairs(["--algo", "rsipo", "--preset", "none", "--data_root", "data/alfworld"]))
    # the tokenizer's texts still cover the RL games (their walkthroughs are in as_flags=False)
    texts = pairs([], as_flags=False)
    assert len(texts) > len(default) and default[0] in texts


def test_skill_conditioned_turns_follow_the_informed_trace(tmp_path):
    import shutil
    from infra.env_backends import list_games
    src = Path(list_games(str(ROOT / "data" / "alfworld"), "train")[0]).parent
    game = tmp_path / "g" / "trial"
    shutil.copytree(src, game)
    wt = json.loads((game / "walkthrough.json").read_text())
    plain = [s["action"] for s in wt["steps"] if s["action"] is not None]
    place = tiny.game_truth(game / "walkthrough.json")["took"][0]
    # a hand-made informed trace: straight to the place, then (for the test) one more action
    first = wt["steps"][0]
    wt["informed"] = [dict(first, action=f"go to {place}"), dict(first, action="look"), dict(first, action=None)]
    (game / "walkthrough.json").write_text(json.dumps(wt))
    pairs = tiny.walkthrough_samples([str(game / "walkthrough.json")], 2, skills=True)
    skill, _ = tiny.game_rule_skills(game / "walkthrough.json")
    acting = [(p, r) for p, r in pairs if r.startswith("<think>")]
    with_skill = [r for p, r in acting if skill in p]
    without = [r for p, r in acting if skill not in p]
    act = "<think> </think> <action> {} </action>".format
    # skill-free turns: the plain walkthrough; skill-conditioned turns: the informed trace, whose first
    # action goes where the skill says the object is
    assert without == [act(a) for a in plain]
    assert with_skill == [act(f"go to {place}"), act("look")] and place in skill
    # without an informed trace every plain turn is also the skill-conditioned one (as before)
    del wt["informed"]
    (game / "walkthrough.json").write_text(json.dumps(wt))
    pairs = tiny.walkthrough_samples([str(game / "walkthrough.json")], 2, skills=True)
    assert [r for p, r in pairs if r.startswith("<think>") and skill in p] == [act(a) for a in plain]


def test_skill_place_false_changes_only_the_written_skill():
    from infra.env_backends import list_games
    wt = Path(list_games(str(ROOT / "data" / "alfworld"), "train")[0]).with_name("walkthrough.json")
    place = tiny.game_truth(wt)["took"][0]
    with_place = tiny.walkthrough_samples([str(wt)], 2, skills=True)
    workflow = tiny.walkthrough_samples([str(wt)], 2, skills=True, skill_place=False)
    analyzer = [i for i, (p, r) in enumerate(with_place) if r.startswith("{")]
    assert len(analyzer) == 2 and len(workflow) == len(with_place)
    # the success sample (the first) is the only one that changes: its skill no longer names the place
    # ("the <object> was at <place>; otherwise ..."), and is rule_skill's workflow without it
    won = analyzer[0]
    assert f"was at {place}" in with_place[won][1] and place not in workflow[won][1]
    assert json.loads(workflow[won][1])["skill"] == tiny.game_rule_skills(wt, with_place=False)[0]
    assert [x for i, x in enumerate(workflow) if i != won] == [x for i, x in enumerate(with_place) if i != won]
    # skill-conditioned acting turns still carry the place-naming skill
    assert any(f"was at {place}" in p for p, r in workflow if r.startswith("<think>"))


def test_extractive_skill_copies_the_actions_from_the_first_take_without_places():
    heat = ["go to cabinet 1", "open cabinet 1", "take mug 1 from cabinet 1", "go to microwave 1",
            "heat mug 1 with microwave 1", "go to countertop 1", "move mug 1 to countertop 1"]
    assert tiny.extractive_skill(heat) == ("take mug 1; go to microwave 1; heat mug 1 with microwave 1; "
                                                 "go to countertop 1; move mug 1 to countertop 1.")
    # pick2: the second search's moves and the second take's place are left out
    pick2 = ["go to shelf 1", "take cd 1 from shelf 1", "go to safe 1", "open safe 1", "move cd 1 to safe 1",
             "go to desk 1", "go to drawer 2", "open drawer 2", "take cd 2 from drawer 2", "go to safe 1",
             "move cd 2 to safe 1"]
    assert tiny.extractive_skill(pick2) == ("take cd 1; go to safe 1; move cd 1 to safe 1; take cd 2; "
                                                  "go to safe 1; move cd 2 to safe 1.")
    assert tiny.extractive_skill(["go to desk 1", "open drawer 1"]) == ""


def _games_of(kind: str) -> list[str]:
    from infra.env_backends import game_task_type, list_games
    return [g for g in list_games(str(ROOT / "data" / "alfworld"), "train") if game_task_type(g) == kind][:3]


def test_hold_out_teacher_keeps_only_the_skill_conditioned_turns_of_the_held_out_type():
    from skills import SKILL_PREFIX
    heat, cool = _games_of("heat"), _games_of("cool")
    full = tiny.walkthrough_samples(heat, 2, skills=True)
    held = tiny.walkthrough_samples(heat, 2, skills=True, hold_out="heat")
    acting = [p for p, r in full if r.startswith("<think>")]
    assert acting and [p for p, r in held if r.startswith("<think>")] == [p for p in acting if SKILL_PREFIX in p]
    assert [s for s in full if s[1].startswith("{")] == [s for s in held if s[1].startswith("{")]   # skills stay
    assert tiny.walkthrough_samples(cool, 2, skills=True, hold_out="heat") == \
        tiny.walkthrough_samples(cool, 2, skills=True)                      # other types unchanged
    assert tiny.walkthrough_samples(heat, 2, skills=False, hold_out="heat") == []   # GRPO's: nothing of it
    twice = tiny.walkthrough_samples(heat, 2, skills=True, hold_out="heat", hold_out_repeat=2)
    held_acting = [s for s in held if s[1].startswith("<think>")]
    assert sorted(s for s in twice if s[1].startswith("<think>")) == sorted(held_acting * 2)   # each one twice
    assert len(held_acting) * 2 == len(acting)        # as many acting samples of the type as without the hold-out


def test_hold_out_pure_drops_the_type_and_writes_extractive_skills():
    heat, cool = _games_of("heat"), _games_of("cool")
    assert tiny.walkthrough_samples(heat, 2, skills=True, hold_out="heat", hold_out_mode="pure") == []
    pure = tiny.walkthrough_samples(cool, 2, skills=True, hold_out="heat", hold_out_mode="pure")
    written = [json.loads(r)["skill"] for p, r in pure if r.startswith("{")][::2]   # per game: success, then failure
    assert written and all(" with fridge " in w and " from " not in w for w in written), written
    assert not any("heat" in r for p, r in pure)                                  # no response heats anything
    with pytest.raises(ValueError, match="hold_out_mode"):
        tiny.walkthrough_samples(cool, 2, skills=True, hold_out="heat", hold_out_mode="both")


def test_hold_out_flag_is_checked_before_any_compute(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        T.parse_args(["--sft_hold_out", "boil"])
    assert "--sft_hold_out" in str(e.value)
    with pytest.raises(SystemExit) as e:
        T.parse_args(["--sft_hold_out", "heat", "--sft_hold_out_mode", "both"])
    assert "--sft_hold_out_mode" in str(e.value)
    with pytest.raises(SystemExit) as e:           # a split without the type: RL could not find it
        T.main(["--data_root", "data/alfworld", "--sft_hold_out", "heat", "--task_types", "pick,cool", "--out_dir",
                str(tmp_path)])
    assert "--sft_hold_out heat" in str(e.value) and "has no game of that type" in str(e.value)
