"""The teacher channel's diagnostics: --teacher_skill generic (each game's type-level workflow as the teacher's
skill) and the teacher − student gap on the tool actions of a procedure against the rest
(harness.step_log.teacher_gaps)."""
import copy
import dataclasses
import math
import random
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import envs  # noqa: E402
import rsipo  # noqa: E402
import rollout  # noqa: E402
import train as T  # noqa: E402
from harness import step_log  # noqa: E402
from harness import config, tiny  # noqa: E402
from infra import distributed as D  # noqa: E402
from harness.run import Run  # noqa: E402
from rollout import Turn  # noqa: E402

CLEAN = sorted((ROOT / "data/alfworld_clean/json_2.1.1/train").glob("*/*/game.tw-pddl"))[0]


def test_tool_actions_of_each_type():
    assert tiny.tool_action("go to sinkbasin 1", "clean") and tiny.tool_action("clean mug 1 with sinkbasin 1", "clean")
    assert not tiny.tool_action("go to countertop 1", "clean")
    assert (tiny.tool_action("heat potato 1 with microwave 1", "heat")
            and not tiny.tool_action("go to sinkbasin 1", "heat"))
    assert not tiny.tool_action("go to sinkbasin 1", "pick")   # pick has no tool


def test_generic_teacher_skill_is_the_games_type_level_workflow():
    args = T.parse_args(["--algo", "opsd", "--teacher_skill", "generic"])
    run = Run(args, Path("."), torch.device("cpu"), None, [], None, skill_rng=random.Random(0),
              given_skill=tiny.generic_skill_of_game)
    b = T.Batch([{"gamefile": str(CLEAN)}], [], [], [], [T.TaskRecord(str(CLEAN), "clean")])
    T.give_skills(run, b)    # no engine: nothing is generated
    rec = b.records[0]
    assert rec.skill == tiny.game_rule_skills(CLEAN.with_name("walkthrough.json"), with_place=False)[0]
    assert "sinkbasin" in rec.skill and rec.replay_ok and rec.source == "generic"
    assert b.skill_gens[0].token_ids == []                          # no skill-writing sample
    for argv in (["--algo", "rsipo", "--teacher_skill", "generic"], ["--algo", "opsd", "--teacher_skill", "generic",
                                                                      "--env", "search"]):
        with pytest.raises(SystemExit, match="--teacher_skill"):
            T.parse_args(argv)


def test_teacher_gaps_split_tool_actions_from_the_rest():
    class Pool:
        parse_action = staticmethod(envs.parse_action)

    run = Run(T.Args(), Path("."), torch.device("cpu"), None, [], Pool(), tool_action=tiny.tool_action)

    def sample(action, teacher, old, step=0):
        turn = Turn([1], [2, 3], [], False, "g", "clean", 0, 0, step,
                    response_text=f"<think> </think> <action> {action} </action>")
        return T.Sample([1], [2, 3], 0.0, torch.tensor(old), teacher=torch.tensor(teacher), turn=turn)
    gaps = step_log.teacher_gaps(run, [sample("go to sinkbasin 1", [-1.0, -0.5], [-2.0, -1.5]),     # +1, +1
                                sample("clean mug 1 with sinkbasin 1", [-1.0, -1.0], [-1.0, -4.0]),   # 0, +3
                                sample("go to shelf 1", [-2.0, -2.0], [-1.0, -1.5], step=7)])    # -1, -0.5
    assert gaps["teacher/gap_tool"] == pytest.approx(5 / 4) and gaps["teacher/tokens_tool"] == 4
    assert gaps["teacher/gap_other"] == pytest.approx(-0.75) and gaps["teacher/tokens_other"] == 2
    # over all six tokens: d = 1, 1, 0, 3, -1, -0.5
    assert gaps["teacher/gap_mean"] == pytest.approx(3.5 / 6) and gaps["teacher/kl_k1"] == pytest.approx(-3.5 / 6)
    assert gaps["teacher/gate_gt_half"] == pytest.approx(3 / 6)          # d > 0 on 1, 1, 3
    k3 = 2 * (math.e - 2) + (math.e ** 3 - 4) + math.exp(-1) + (math.exp(-0.5) - 0.5)
    assert gaps["teacher/kl_k3"] == pytest.approx(k3 / 6)
    assert gaps["teacher/gap_turn0"] == pytest.approx(5 / 4) and gaps["teacher/gap_turn5plus"] == pytest.approx(-0.75)
    assert "teacher/gap_turn1" not in gaps                                # no turn there
    run.tool_action = None                    # no preset that knows the tools: every turn is "other"
    keys = set(step_log.teacher_gaps(run, [sample("go to sinkbasin 1", [0.0, 0.0], [0.0, 0.0])]))
    assert {"teacher/gap_other", "teacher/tokens_other"} <= keys and not any("tool" in k for k in keys)


# ---- the teacher's weights (--teacher_weights, METHOD.md §2.8.2) ------------------------------------------------

def _linear(value: float) -> torch.nn.Module:
    m = torch.nn.Linear(2, 2, bias=False)
    torch.nn.init.constant_(m.weight, value)
    return m


def test_ema_and_refresh_teachers_follow_the_policy_at_their_pace():
    policy, teacher = _linear(1.0), _linear(0.0)
    run = Run(T.Args(teacher_weights="ema", teacher_ema=0.9), Path("."), torch.device("cpu"), None, [], None)
    run.model, run.teacher = policy, teacher
    T.follow_policy(run, step=0)
    assert torch.allclose(teacher.weight, torch.full((2, 2), 0.1))           # 0.9·0 + 0.1·1
    torch.nn.init.constant_(policy.weight, 2.0)
    T.follow_policy(run, step=1)
    assert torch.allclose(teacher.weight, torch.full((2, 2), 0.9 * 0.1 + 0.1 * 2.0))
    run.args, run.teacher = T.Args(teacher_weights="refresh", teacher_refresh=3), _linear(0.0)
    for step in (0, 1):                                                       # not yet at the 3rd step's end
        T.follow_policy(run, step)
        assert run.teacher.weight.abs().sum() == 0
    T.follow_policy(run, step=2)
    assert torch.equal(run.teacher.weight, policy.weight)                     # a snapshot
    for weights in ("live", "frozen"):                                        # no weights of their own
        run.args, run.teacher = T.Args(teacher_weights=weights), None
        T.follow_policy(run, step=0)


def test_a_checkpoint_keeps_the_teachers_own_weights(tmp_path):
    policy, teacher = _linear(1.0), _linear(0.25)
    opt = torch.optim.SGD(policy.parameters(), lr=0.1)
    D.save_checkpoint(tmp_path, policy, opt, 3, T.Args(), {}, models={"teacher": teacher})
    torch.nn.init.constant_(teacher.weight, -5.0)
    state = D.load_checkpoint(tmp_path, policy, opt, models={"teacher": teacher})
    assert state["step"] == 3 and torch.allclose(teacher.weight, torch.full((2, 2), 0.25))


@pytest.mark.parametrize("weights", ["live", "frozen", "ema", "refresh"])
def test_score_asks_the_chosen_weights_for_the_teacher(tmp_path, weights):
    # the reference and the teacher's own copy are made to differ from π_old: ℓ^T must be the chosen model's
    argv = ["--algo", "opsd", "--teacher_skill", "generic", "--teacher_weights", weights, "--sft_steps", "0",
            "--eval", "false", "--tasks_per_step", "2", "--group_size", "2", "--max_turns", "3", "--tiny_hidden",
            "32", "--c_kl", "0", "--opsd_keep", "1", "--out_dir", str(tmp_path), "--run_name", weights]
    run = T.setup(T.parse_args(argv))
    try:
        T.build_policy(run)
        T.begin(run)
        assert ((run.ref is not None) == (weights == "frozen")
                and (run.teacher is not None) == (weights in ("ema", "refresh")))
        with torch.no_grad():
            for i, m in enumerate(x for x in (run.ref, run.teacher) if x is not None):
                for p in m.parameters():
                    p.add_(0.05 * (i + 1) * torch.randn_like(p))
        b = T.rollout_and_advantages(run)
        T.give_skills(run, b)
        T.trust(run, T.share_records(b), replayed=False)
        samples, skills = T.training_samples(run, b)
        T.score_policy(run, samples, skills)
        seen = T.score_teacher(run, b, samples)
        chosen = {"live": run.rollout_model, "frozen": run.ref}.get(weights, run.teacher)
        sm = next(s for s in samples if s.teacher is not None)
        pair = rollout.teacher_pair(run.engine, sm.turn, b.records[sm.turn.group_id].skill,
                                    run.pool.task_prefix + b.eps[sm.turn.episode_id].task)
        assert torch.allclose(sm.teacher, run.logprobs(chosen, [pair])[0], atol=1e-6)
        if weights != "live":
            assert not torch.allclose(sm.teacher, run.logprobs(run.rollout_model, [pair])[0], atol=1e-3)
        assert seen["seen"] / seen["prompts"] > 10 and 0.9 <= seen["seen"] / seen["total"] <= 1.0
        text = (tmp_path / weights / "teacher_prompt.txt").read_text()
        assert b.records[0].skill.split(";")[0].split()[-1] in text and "Skill for this task" in text
    finally:
        T.teardown(run)


def test_a_teacher_prompt_that_holds_none_of_its_skill_stops_the_run(tmp_path):
    tok = tiny.train_tiny_tokenizer(["go to the sinkbasin and clean the mug", "Your task is to: clean a mug"])
    run = Run(T.Args(), tmp_path, torch.device("cpu"), None, [], None)
    run.tok = tok
    prompt = tok.encode("Your task is to: clean a mug", add_special_tokens=False)
    turn = Turn(prompt, [1], [], False, "g", "clean", 0, 0, 0)
    b = T.Batch([], [], [], [], [T.TaskRecord("g", "clean", skill="go to the sinkbasin")])
    line = tok.encode("Skill for this task: [go to the sinkbasin]", add_special_tokens=False)
    sm = T.Sample(prompt, [1], 0.0, torch.zeros(1), turn=turn, teacher_prompt=prompt[:5] + line + prompt[5:])
    assert T.skill_in_teacher_prompts(run, b, [sm]) == {"seen": 4, "total": 4, "prompts": 1}
    assert "go to the sinkbasin" in (tmp_path / "teacher_prompt.txt").read_text()
    b.records[0].skill = "fetch zebras"                  # words the tokenizer does not know: all <unk>
    sm.teacher_prompt = prompt[:5] + tok.encode("Skill for this task: [fetch zebras]", add_special_tokens=False) \
        + prompt[5:]
    with pytest.raises(RuntimeError, match="holds none of its skill"):
        T.skill_in_teacher_prompts(run, b, [sm])
    b.records[0].skill = "go to the sinkbasin"           # a prompt the skill line never reached
    sm.teacher_prompt = prompt
    with pytest.raises(RuntimeError, match="holds none of its skill"):
        T.skill_in_teacher_prompts(run, b, [sm])


def test_support_of_pads_the_teachers_side_and_leaves_rows_without_one_finite():
    logp_all = torch.log_softmax(torch.randn(2, 3, 6), -1)               # [B, R, V]
    ids = torch.tensor([[5, 0], [1, -1]], dtype=torch.int32)             # sample 0: 2 positions, S = 2 (a union slot)
    lp = torch.tensor([[-0.1, -3.0], [-0.5, -math.inf]])
    tail = torch.tensor([-2.5, -1.2])
    with_teacher = T.Sample([1], [2, 3], 0.0, torch.zeros(2), teacher=torch.zeros(2),
                            support=rollout.Support(ids, lp, tail))
    without = T.Sample([1], [2, 3, 4], 0.0, torch.zeros(3))
    args = T.UpdateConfig.from_args(T.Args(teacher_loss="topk"))
    full, got_ids, got_lp, got_tail = T.support_of([with_teacher, without], logp_all, args)
    assert full is logp_all and got_ids.shape == (2, 3, 2)
    assert (torch.equal(got_ids[0, :2], ids.long()) and torch.equal(got_lp[0, :2], lp)
            and torch.equal(got_tail[0, :2], tail))
    x = rsipo.teacher_inputs(logp_all[..., 0], torch.tensor([True, False]), None, full, got_ids, got_lp, got_tail)
    assert torch.equal(x["student_support"][0, 0], logp_all[0, 0, [5, 0]])
    assert x["support_valid"][0, 1].tolist() == [True, False]
    assert torch.equal(x["teacher_support"][1], x["student_support"][1].detach())   # no teacher: its own (KL 0)
    vocab = T.Sample([1], [2, 3], 0.0, torch.zeros(2), teacher=torch.zeros(2),
                     support=rollout.Support(None, torch.log_softmax(torch.zeros(2, 6), -1), None))
    _, no_ids, v_lp, no_tail = T.support_of([vocab], logp_all[:1],
                                            T.UpdateConfig.from_args(T.Args(teacher_loss="full")))
    assert no_ids is None and no_tail is None and torch.allclose(v_lp[0, :2], torch.full((2, 6), -math.log(6)))


def _scored_run(tmp_path, name, *flags):
    """A tiny opsd run's first step up to the update: rollouts, the given skills, trust, and the three scorings."""
    argv = ["--algo", "opsd", "--teacher_skill", "generic", "--sft_steps", "0", "--eval", "false", "--tasks_per_step",
            "2", "--group_size", "2", "--max_turns", "3", "--tiny_hidden", "32", "--c_kl", "0", "--opsd_keep", "1",
            "--out_dir", str(tmp_path), "--run_name", name, *flags]
    run = T.setup(T.parse_args(argv))
    T.build_policy(run)
    T.begin(run)
    b = T.rollout_and_advantages(run)
    T.give_skills(run, b)
    T.trust(run, T.share_records(b), replayed=False)
    samples, skills = T.training_samples(run, b)
    T.score_policy(run, samples, skills)
    T.score_teacher(run, b, samples)
    return run, b, samples


@pytest.mark.parametrize("side", ["student", "teacher", "union"])
def test_score_keeps_the_support_of_each_side_with_the_teachers_exact_tail(tmp_path, side):
    run, b, samples = _scored_run(tmp_path, side, "--teacher_loss", "topk", "--teacher_topk", "3",
                                  "--teacher_support", side, "--teacher_weights", "ema")
    try:
        sm = next(s for s in samples if s.teacher is not None)
        assert sm.student_top is None                                     # freed once scored
        pair = rollout.teacher_pair(run.engine, sm.turn, b.records[sm.turn.group_id].skill,
                                    run.pool.task_prefix + b.eps[sm.turn.episode_id].task)
        (_, teacher_all), (_, student_all) = (
            run.logprobs(m, [p], support="vocab")[0]
            for m, p in ((run.teacher, pair),
                         (run.rollout_model, (sm.prompt_ids, sm.response_ids))))
        t_all, s_all = teacher_all.lp, student_all.lp                          # [r, V] each
        ids = sm.support.ids.long()
        held = [set(row) - {-1} for row in ids.tolist()]
        s_top = [set(row) for row in s_all.topk(3, dim=-1).indices.tolist()]
        t_top = [set(row) for row in t_all.topk(3, dim=-1).indices.tolist()]
        want = {"student": s_top, "teacher": t_top, "union": [a | b for a, b in zip(s_top, t_top)]}[side]
        assert held == want
        assert ids.shape[-1] == (6 if side == "union" else 3)
        kept = sm.support.lp
        assert torch.allclose(kept[ids >= 0], t_all.gather(-1, ids.clamp(min=0))[ids >= 0], atol=1e-6)
        fill = torch.where(ids < 0, ids[:, :1], ids)                        # an empty slot repeats a held id
        rest = torch.ones_like(t_all, dtype=torch.bool).scatter(-1, fill, False)
        exact = torch.stack([t_all[i][rest[i]].logsumexp(-1) for i in range(len(t_all))])
        assert torch.allclose(sm.support.tail, exact, atol=1e-5)
    finally:
        T.teardown(run)


def test_the_taught_normaliser_divides_the_teacher_term_by_the_taught_tokens_only(tmp_path):
    run, b, samples = _scored_run(tmp_path, "norm", "--teacher_loss", "topk", "--mini_batch", "512")
    try:
        samples[0].teacher, samples[0].support, samples[0].trust = None, None, 0.0   # one turn without a teacher
        taught = [s for s in samples if s.teacher is not None]
        assert 0 < len(taught) < len(samples)
        terms = {}
        for norm in ("all", "taught"):
            model = copy.deepcopy(run.model)
            args = T.UpdateConfig.from_args(dataclasses.replace(run.args, teacher_norm=norm))
            opt = torch.optim.SGD(model.parameters(), lr=0.0)
            terms[norm] = T.update(model, opt, samples, args, run.tok.pad_token_id, run.device, True)["opsd/loss"]
        ratio = sum(len(s.response_ids) for s in samples) / sum(len(s.response_ids) for s in taught)
        assert terms["taught"] == pytest.approx(ratio * terms["all"], rel=1e-5) and terms["all"] > 0
    finally:
        T.teardown(run)


def test_a_toy_estimator_registered_in_rsipo_trains_with_no_edit_elsewhere(tmp_path, monkeypatch):
    # the estimator table is the one place that says what an estimator needs: register a toy one (λ times the
    # squared gap to ℓ^T) and a tiny run's step computes it, from the flag to the update's metrics
    def toy(x):
        value = rsipo.masked_token_mean(x.trust[:, None] * (x.logp - x.teacher_logp) ** 2, x.mask, x.n_tokens)
        return value, {"opsd/loss": float(value), "opsd/toy": 1.0}
    monkeypatch.setitem(rsipo.TEACHER_ESTIMATORS, "toy", rsipo.Estimator(toy, ("teacher_logp",)))
    argv = ["--algo", "opsd", "--teacher_skill", "generic", "--teacher_loss", "toy", "--sft_steps", "0", "--eval",
            "false", "--tasks_per_step", "2", "--group_size", "2", "--max_turns", "3", "--tiny_hidden", "32",
            "--opsd_keep", "1", "--out_dir", str(tmp_path), "--run_name", "toy"]
    run = T.setup(T.parse_args(argv))
    try:
        T.build_policy(run)
        T.begin(run)
        run.preempt = type("NoSignal", (), {"check": staticmethod(lambda: None), "seen": False})()
        before = [p.detach().clone() for p in run.model.parameters()]
        row = T.rl_step(run, 0)
        assert row["opsd/toy"] == 1.0 and row["opsd/loss"] > 0
        assert any(not torch.equal(a, p) for a, p in zip(before, run.model.parameters()))
    finally:
        T.teardown(run)


def test_bad_teacher_options_are_refused_naming_the_flag(tmp_path):
    for argv, flag in ((["--teacher_loss", "kl"], "--teacher_loss"),
                       (["--teacher_weights", "old"], "--teacher_weights"),
                       (["--teacher_ema", "1"], "--teacher_ema"), (["--teacher_topk", "0"], "--teacher_topk"),
                       (["--algo", "grpo", "--distill_only", "true"], "--distill_only"),
                       (["--algo", "rsipo", "--teacher_skill", "wrong"], "--teacher_skill")):
        with pytest.raises(SystemExit, match=flag):
            T.parse_args(argv)
    a = T.parse_args(["--algo", "opsd", "--teacher_loss", "topk", "--teacher_topk", "301"])
    with pytest.raises(SystemExit, match="--teacher_topk 301 is more than the model's vocabulary"):
        config.check_teacher_support(a, 300)
    config.check_teacher_support(a, 301)
    with pytest.raises(SystemExit, match="--teacher_loss full"):
        config.check_teacher_support(T.parse_args(["--algo", "opsd", "--teacher_loss", "full"]), 151_936)
    # a wrong-procedure teacher has no skill for a type without a tool: refused before any worker starts
    with pytest.raises(SystemExit, match="--teacher_skill wrong: no skill for"):
        T.setup(T.parse_args(["--algo", "opsd", "--teacher_skill", "wrong", "--preset", "none", "--data_root",
                              "data/alfworld", "--out_dir", str(tmp_path)]))


def test_the_wrong_procedure_skill_swaps_only_the_tool_and_verb():
    right, wrong = tiny.generic_skill_of_game(str(CLEAN)), tiny.wrong_skill_of_game(str(CLEAN))
    assert "go to the sinkbasin and clean the" in right and "go to the fridge and cool the" in wrong
    assert right.replace("sinkbasin and clean", "fridge and cool") == wrong
    pick = next(g for g in sorted((ROOT / "data/alfworld/json_2.1.1/train")
                                  .glob("pick_and_place_simple*/*/game.tw-pddl")))
    assert tiny.wrong_skill_of_game(str(pick)) is None and tiny.generic_skill_of_game(str(pick))


MEDIUM = ROOT / "data/alfworld_medium/json_2.1.1"


def test_the_wrong_place_skill_names_another_receptacle_the_walkthrough_saw_without_the_object():
    # its walkthrough: cabinet 1 (a dishsponge), cabinet 2 and 3 (nothing), then the soapbar taken from cabinet 4;
    # the room also has countertop 1 (not reached), sinkbasin 1-2 (the tool) and toilet 1 (the target)
    (game,) = [g for g in sorted(MEDIUM.glob("valid_unseen/*SoapBar-None-Toilet*/*/game.tw-pddl"))
               if "take soapbar 1 from cabinet 4" in g.with_name("walkthrough.json").read_text()][:1]
    oracle, wrong = tiny.oracle_skill_of_game(str(game)), tiny.wrong_place_skill_of_game(str(game))
    assert oracle.startswith("the soapbar was at cabinet 4; otherwise go to each receptacle")
    place = wrong[len("the soapbar was at "):].split(";")[0]
    assert place in ("cabinet 1", "cabinet 2", "cabinet 3")               # looked in, no soapbar there
    assert oracle.replace("cabinet 4;", f"{place};", 1) == wrong             # the one fact that differs
    assert tiny.wrong_place_skill_of_game(str(game)) == wrong               # the same game, the same place
    assert tiny.GIVEN_SKILLS["oracle"] is tiny.oracle_skill_of_game
    assert tiny.oracle_skill_of_game(str(ROOT / "nowhere/game.tw-pddl")) is None
    # every game of the shipped splits has both, so --teacher_skill oracle | wrong_place trains on every task
    games = sorted(MEDIUM.glob("*/*/*/game.tw-pddl"))
    places = [tiny.wrong_place_skill_of_game(str(g)) for g in games]
    assert len(games) == 180 and all(places)
    assert all(w != tiny.oracle_skill_of_game(str(g)) for g, w in zip(games, places))


def test_a_tiny_rsipo_step_with_the_bank_teacher_teaches_the_groups_without_a_win(tmp_path):
    # a randomly initialised policy wins nothing, so no group writes a skill: with --bank_teacher every task is
    # taught by the bank's clean skill (--skill_bank), made over for its own object and target
    from skills import SkillBank
    bank = SkillBank(8)
    bank.add("clean", "go to the sinkbasin and clean the bowl with it; then go to the cabinet and move the bowl to it.",
             0.5, 0.3, "g", 1, trust=0.75, task="put a clean bowl in cabinet.")
    bank.save(str(tmp_path / "bank.json"))
    argv = ["--algo", "rsipo", "--bank_teacher", "true", "--skill_bank", str(tmp_path / "bank.json"), "--sft_steps",
            "0", "--eval", "false", "--tasks_per_step", "2", "--group_size", "2", "--max_turns", "3", "--tiny_hidden",
            "32", "--opsd_keep", "1", "--teacher_loss", "topk", "--teacher_weights", "ema", "--out_dir", str(tmp_path),
            "--run_name", "bank"]
    run = T.setup(T.parse_args(argv))
    try:
        T.build_policy(run)
        T.begin(run)
        run.preempt = type("NoSignal", (), {"check": staticmethod(lambda: None), "seen": False})()
        row = T.rl_step(run, 0)
    finally:
        T.teardown(run)
    assert row["train/success"] == 0 and row["skill/written_frac"] == 0
    assert row["bank/taught"] == 2 and row["bank/trust_mean"] == 0.75 and row["trust/frac_teacher"] == 1.0
    assert row["opsd/kl"] >= 0 and row["teacher/skill_token_share"] > 0.5
    text = (tmp_path / "bank" / "teacher_prompt.txt").read_text()
    assert "bowl" not in text and "go to the sinkbasin and clean the" in text   # made over for its own task
