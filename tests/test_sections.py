"""The RL step's sections on their own, each from hand-made episodes and records, each asserting the rule it
implements: write_skills (Eq. 2), replay (Eq. 3-4), skill_advantages (Eq. 5), trust (Eq. 6-9), keep_skills
(§2.10). tests/test_replay_control.py holds the source choice and the skill rule; test_train.py `score_teacher`."""
import math
import random
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import train as T  # noqa: E402
from harness import step_log  # noqa: E402
from harness.run import Run  # noqa: E402
from rollout import Episode  # noqa: E402
from skills import SKILL_PREFIX, SkillBank  # noqa: E402
sys.path.insert(0, str(ROOT / "tests"))
from env_doubles import TASK, SimEngine, SimPool  # noqa: E402

SKILL = "take the apple to the fridge; written from a won episode"   # what SimEngine writes after a win


def _run(args, pool=None, engine=None) -> Run:
    return Run(args, Path("."), torch.device("cpu"), None, [], pool or SimPool({}, {}, 0), engine=engine,
               skill_rng=random.Random(0), bank=SkillBank(args.bank_capacity))


def _group(rewards: list[float], task_id: str = "g0") -> list[Episode]:
    return [Episode(task_id, "pick", TASK, 0, i, steps=[("obs", "act")], reward=r, won=r > 0)
            for i, r in enumerate(rewards)]


def _batch(groups: list[list[Episode]], args) -> T.Batch:
    tasks = [{"gamefile": g[0].task_id} for g in groups]
    records = [T.TaskRecord(g[0].task_id, "pick") for g in groups]
    return T.Batch(tasks, [e for g in groups for e in g], [], [], records)


# ---- write_skills (Eq. 2) ----------------------------------------------------------------------------------

def test_write_skills_writes_one_skill_per_task_with_a_win_and_none_without():
    args = T.Args(algo="rsipo", group_size=4)
    run = _run(args, engine=SimEngine())
    b = _batch([_group([0, 10, 0, 0], "a"), _group([0, 0, 0, 0], "b")], args)
    T.write_skills(run, b)
    a, none = b.records
    assert (a.source, a.skill, a.replay_ok) == ("won", SKILL, True)
    assert (none.source, none.skill, none.replay_ok) == (None, None, False)
    assert b.skill_gens[0].text.startswith('{"skill"') and b.skill_gens[1].text == ""   # no sample for b


def test_generic_teacher_skill_gives_every_task_its_games_workflow_without_writing():
    args = T.Args(algo="opsd", group_size=2, teacher_skill="generic")
    run = _run(args, engine=None)
    run.given_skill = lambda task_id: f"the workflow of {task_id}"
    b = _batch([_group([0, 0], "a"), _group([10, 0], "b")], args)
    T.give_skills(run, b)                 # an engine of None: nothing is generated
    assert [(r.source, r.skill, r.replay_ok) for r in b.records] == \
        [("generic", "the workflow of a", True), ("generic", "the workflow of b", True)]


# ---- replay (Eq. 3-4) --------------------------------------------------------------------------------------

def _replayed(control: str, group_rewards: list[float], pool) -> tuple[T.TaskRecord, T.Batch]:
    args = T.Args(algo="rsipo", group_size=len(group_rewards), replay_m=2, replay_control=control, history_len=0)
    run = _run(args, pool=pool, engine=SimEngine())
    b = _batch([_group(group_rewards, "task0")], args)
    b.records[0].skill, b.records[0].source, b.records[0].replay_ok = SKILL, "won", True
    T.replay(run, b)
    return b.records[0], b


def test_replay_plays_m_episodes_with_the_skill_against_m_fresh_ones_without():
    # p 0 without a skill, 1 with a won-source skill: both replays win, both fresh controls lose
    pool = SimPool({"task0": 0.0}, {"won": 1.0}, seed=0)
    rec, b = _replayed("fresh", [0, 10, 0, 0], pool)
    with_skill = [e for e in b.replay_eps if e.skill]
    assert len(b.replay_eps) == 4 and len(with_skill) == 2 and pool.env_steps == 4
    assert all(SKILL_PREFIX in e.turns[0].prompt_text for e in with_skill)
    assert all(SKILL_PREFIX not in e.turns[0].prompt_text for e in b.replay_eps if not e.skill)
    # Eq. (3): 1 − 0; Eq. (4) with the smoothed rates (2 + ½)/3 and ½/3
    assert rec.gain == 1.0 and rec.var == pytest.approx(2 * (2.5 / 3) * (0.5 / 3) / 2)
    assert rec.informative and rec.replay_ok


@pytest.mark.parametrize("control, gain", [("split", 1.0 - 0.5), ("group", 1.0 - 0.25)])
def test_replay_with_the_rollouts_as_control(control, gain):
    # the group's second half (split) or all of it (group) is the control: no fresh episode is played
    pool = SimPool({"task0": 0.0}, {"won": 1.0}, seed=0)
    rec, b = _replayed(control, [0, 0, 10, 0], pool)
    assert len(b.replay_eps) == 2 and pool.env_steps == 2
    assert rec.gain == pytest.approx(gain)


def test_a_replay_all_won_against_a_control_all_won_is_uninformative():
    pool = SimPool({"task0": 1.0}, {"won": 0.0}, seed=0)
    rec, _ = _replayed("fresh", [10, 10], pool)
    assert rec.gain == 0.0 and not rec.informative and rec.replay_ok


class ErrorPool(SimPool):
    """A pool whose episodes that follow a skill end in an env error."""

    def step(self, actions):
        out = super().step(actions)
        return [(o, r, d, {**info, "error": "engine died"}) if a and a.startswith("follow skill") else (o, r, d, info)
                for (o, r, d, info), a in zip(out, actions)]


def test_a_replay_with_an_env_error_is_left_out_without_a_gain():
    rec, _ = _replayed("fresh", [0, 10], ErrorPool({"task0": 0.5}, {"won": 0.0}, seed=0))
    assert not rec.replay_ok and rec.gain is None and rec.skill == SKILL


# ---- skill_advantages (Eq. 5) ---------------------------------------------------------------------------------

def _records(args) -> list[T.TaskRecord]:
    return [T.TaskRecord("a", "pick", source="won", skill="s", gain=0.6, replay_ok=True),
            T.TaskRecord("b", "pick", source="won", skill="s", gain=0.2, replay_ok=True),
            T.TaskRecord("c", "pick", source="won", skill="s", replay_ok=False),   # env error: no gain
            T.TaskRecord("d", "pick", source="won", skill=None),                   # invalid
            T.TaskRecord("e", "heat", source="won", skill="s", gain=0.5, replay_ok=True)]


def test_skill_rewards_are_eq5_per_type_without_the_failed_replays():
    args = T.Args(algo="rsipo", group_size=2)
    run, recs = _run(args), _records(args)
    T.skill_advantages(run, recs)
    # pick: rewards 0.6, 0.2 and r_bad −1 (the invalid skill) against their mean −0.2/3; the failed replay has
    # no reward and no sample. heat: one task, so the baseline is its running mean before this step, 0.
    pick = (0.6 + 0.2 - 1.0) / 3
    assert [recs[i].skill_adv for i in (0, 1, 3)] == pytest.approx([0.6 - pick, 0.2 - pick, -1.0 - pick])
    assert recs[2].skill_adv is None and recs[4].skill_adv == pytest.approx(0.5)
    assert run.skill_means == pytest.approx({"pick": 0.1 * pick, "heat": 0.1 * 0.5})   # EMAs from 0, momentum 0.9


def test_skill_metrics_count_the_written_the_valid_and_their_rewards():
    args = T.Args(algo="rsipo", group_size=2)
    recs = _records(args) + [T.TaskRecord("f", "pick", source=None)]   # wrote no skill
    m = step_log.skill_metrics(_run(args), recs)
    assert m["skill/written_frac"] == pytest.approx(5 / 6) and m["skill/valid_frac"] == pytest.approx(4 / 5)
    # Eq. (5)'s g̃ of the five that wrote one: 0.6, 0.2, −1 (replay failed: no gain, r_bad here), −1, 0.5
    assert m["skill/reward_mean"] == pytest.approx((0.6 + 0.2 - 1 - 1 + 0.5) / 5)
    assert m["skill/won_sources"] == 5.0 and m["skill/lost_sources"] == 0.0 and "skill/lost_reward" not in m


# ---- trust (Eq. 6-9) ---------------------------------------------------------------------------------------

def _trusted(replayed: bool, trust: str = "eb") -> list[T.TaskRecord]:
    args = T.Args(algo="rsipo" if replayed else "opsd", group_size=2, trust=trust)
    recs = [T.TaskRecord("a", "pick", source="won", skill="s", gain=0.5, var=0.04, replay_ok=True),
            T.TaskRecord("b", "pick", source="won", skill="s", gain=0.0, var=0.04, replay_ok=True, informative=False),
            T.TaskRecord("c", "pick", source="won", skill="s", gain=0.3, var=0.04, replay_ok=False),   # env error
            T.TaskRecord("d", "pick", source=None)]                                                    # no skill
    T.trust(_run(args), recs, replayed=replayed)
    return recs


def test_trust_is_zero_for_an_uninformative_replay_a_failed_one_and_no_skill():
    for mode in ("eb", "raw"):
        recs = _trusted(True, mode)
        assert recs[0].trust > 0.5 and [r.trust for r in recs[1:]] == [0.0, 0.0, 0.0], mode
    phi = 0.5 * (1 + math.erf(0.5 / 0.2 / 2 ** 0.5))          # raw: Φ(g / √v) = Φ(2.5)
    assert _trusted(True, "raw")[0].trust == pytest.approx(phi)


def test_without_a_replay_every_valid_skill_is_trusted_fully():
    recs = _trusted(False)
    assert [r.trust for r in recs] == [1.0, 1.0, 0.0, 0.0]        # λ ≡ 1 for each valid skill


# ---- keep_skills (§2.10) -----------------------------------------------------------------------------------

def test_the_bank_keeps_replayed_skills_whose_shrunk_gain_is_positive():
    args = T.Args(algo="rsipo", group_size=2)
    run = _run(args)
    recs = [T.TaskRecord("a", "pick", skill="keep", gain=0.4, shrunk=0.1, replay_ok=True),
            T.TaskRecord("b", "pick", skill="shrunk to 0", gain=0.4, shrunk=0.0, replay_ok=True),
            T.TaskRecord("c", "pick", skill="replay failed", gain=0.4, shrunk=0.3, replay_ok=False),
            T.TaskRecord("d", "pick", skill=None, gain=0.4, shrunk=0.3, replay_ok=True)]
    T.keep_skills(run, recs, step=4)
    kept = run.bank.best("pick", 8)
    assert [(e.text, e.mean_gain, e.shrunk_gain, e.step) for e in kept] == [("keep", 0.4, 0.1, 5)]


# ---- bank_teachers (§2.10) [ours] -------------------------------------------------------------------------

def test_the_bank_teaches_a_task_without_a_trusted_skill_its_types_best_skill_made_over():
    args = T.Args(algo="rsipo", group_size=2, bank_teacher=True)
    run = _run(args)
    run.bank.add("clean", "clean the bowl at the sinkbasin, then put the bowl in the cabinet.", 0.5, 0.3, "g1", 1,
                 trust=0.6, task="put a clean bowl in cabinet.")
    run.bank.add("clean", "a weaker skill about the bowl", 0.2, 0.1, "g2", 1,
                 trust=0.9, task="put a clean bowl in cabinet.")
    recs = [T.TaskRecord("t1", "clean", skill="its own", trust=0.7, task="put a clean cup in desk."),   # trusted
            T.TaskRecord("t2", "clean", task="put a clean mug in shelf."),                     # no win, no skill
            T.TaskRecord("t3", "clean", skill="no evidence", trust=0.0, task="put a clean pan in drawer."),
            T.TaskRecord("t4", "heat", task="put a hot egg in fridge.")]                       # no heat skill banked
    T.bank_teachers(run, recs)
    t1, t2, t3, t4 = recs
    assert (t1.bank_skill, t1.trust, t1.teacher_skill()) == (None, 0.7, "its own")
    assert t2.bank_skill == "clean the mug at the sinkbasin, then put the mug in the shelf." and t2.trust == 0.6
    assert t2.teacher_skill() == t2.bank_skill and t2.skill is None      # the written skill stays as it was
    assert (t3.bank_skill == "clean the pan at the sinkbasin, then put the pan in the drawer."
            and t3.skill == "no evidence")
    assert (t4.bank_skill, t4.trust) == (None, 0.0)                      # an empty type teaches nothing
    m = step_log.trust_metrics(recs, None, bank=len(run.bank))
    assert m["bank/taught"] == 2.0 and m["bank/trust_mean"] == pytest.approx(0.6) and m["bank/skills"] == 2.0
    assert "bank/taught" not in step_log.trust_metrics(recs, None)       # without the flag: no bank figures
    # an empty bank early in a run: no task is taught, and the step says 0
    empty = [T.TaskRecord("t2", "clean", task="put a clean mug in shelf.")]
    T.bank_teachers(_run(args), empty)
    assert empty[0].bank_skill is None and step_log.trust_metrics(empty, None, bank=0)["bank/taught"] == 0.0


def test_bank_teacher_settings_that_cannot_work_are_refused_before_any_rollout(tmp_path):
    with pytest.raises(SystemExit, match="--bank_teacher needs --algo rsipo"):
        T.parse_args(["--algo", "opsd", "--bank_teacher", "true"])
    bad = tmp_path / "bank.json"
    bad.write_text("{not json")
    with pytest.raises(SystemExit, match=f"--skill_bank {bad}: not a skill bank file"):
        T.setup(T.parse_args(["--algo", "rsipo", "--skill_bank", str(bad), "--out_dir", str(tmp_path)]))
    good = tmp_path / "good.json"
    b = SkillBank(4)
    b.add("clean", "wash it", 0.5, 0.3, "g", 1, trust=0.5, task="put a clean mug in shelf.")
    b.save(str(good))
    from harness.run import initial_bank
    data = type("Data", (), {"train": ["a", "b"], "task_type": {"a": "clean", "b": "clean"}})()
    assert initial_bank(T.parse_args(["--algo", "rsipo", "--skill_bank", str(good)]), data).to_dict() == b.to_dict()
    data.task_type["b"] = ""
    with pytest.raises(SystemExit, match="--bank_teacher: 1 training tasks have no task type"):
        initial_bank(T.parse_args(["--algo", "rsipo", "--bank_teacher", "true"]), data)


# ---- rl_step: which sections run ---------------------------------------------------------------------------

SCORE = ["training_samples", "score_policy", "score_teacher"]


@pytest.mark.parametrize("algo, sections", [
    ("grpo", ["rollout_and_advantages", *SCORE, "update", "sync_weights", "step_row"]),
    ("gigpo", ["rollout_and_advantages", *SCORE, "update", "sync_weights", "step_row"]),
    ("opsd", ["rollout_and_advantages", "write_skills", "share_records", "trust(replayed=False)",
              *SCORE, "update(use_teacher=True)", "sync_weights", "step_row"]),
    ("rsipo", ["rollout_and_advantages", "write_skills", "replay", "share_records", "skill_advantages",
               "trust(replayed=True)", "keep_skills", *SCORE, "update(use_teacher=True)", "sync_weights", "step_row"]),
])
def test_rl_step_alone_decides_which_sections_run(monkeypatch, algo, sections):
    called = []

    def spy(name, result=None):
        def section(*args, **kw):
            flags = ", ".join(f"{k}={v}" for k, v in kw.items() if k in ("replayed",) or (k == "use_teacher" and v))
            called.append(f"{name}({flags})" if flags else name)
            return result
        return section
    for name in ("write_skills", "give_skills", "replay", "skill_advantages", "trust", "keep_skills", "sync_weights"):
        monkeypatch.setattr(T, name, spy(name))
    monkeypatch.setattr(T, "rollout_and_advantages", spy("rollout_and_advantages", T.Batch([], [], [], [], [])))
    monkeypatch.setattr(T, "share_records", spy("share_records", []))
    monkeypatch.setattr(T, "training_samples", spy("training_samples", ([], [])))
    monkeypatch.setattr(T, "score_policy", spy("score_policy"))
    monkeypatch.setattr(T, "score_teacher", spy("score_teacher", {}))
    monkeypatch.setattr(T, "update", spy("update", {}))
    monkeypatch.setattr(T, "step_row", spy("step_row", {}))
    run = _run(T.Args(algo=algo, group_size=2))
    run.preempt = type("NoSignal", (), {"check": staticmethod(lambda: None)})()
    run.tok = type("Tok", (), {"pad_token_id": 0})()
    T.rl_step(run, 0)
    assert called == sections
