"""The replay gain's control (Eq. 3, --replay_control), the choice of the skill's source (--skill_groups) and
the skill rule (--skill_rule), through the trainer's own sections: write_skills → replay → share_records →
skill_rewards → trust, on hand-made episodes and on scripts/replay_sim.py's known-truth environment."""
import json
import random
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import envs  # noqa: E402
import skills  # noqa: E402
import train as T  # noqa: E402
from harness import step_log  # noqa: E402
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "tests"))
import replay_sim as S  # noqa: E402  (the simulation script, which this file tests)
from env_doubles import SimEngine, SimPool  # noqa: E402
from harness.tiny import game_truth  # noqa: E402
from rollout import Episode  # noqa: E402


# ---- the simulation: E[g] per source against the known effect ------------------------------------------------

def _bias(design: str, steps: int = 150):
    # p = 0.09 for every task, N 8, M 2: a skill from a won and one from a lost episode both add +0.10
    args = T.Args(algo="rsipo", group_size=8, replay_m=2, tasks_per_step=8, replay_control=design,
                  skill_groups="all", history_len=0)
    rows, _ = S.simulate(args, steps, lambda rng: 0.09, {"won": 0.10, "lost": 0.10}, seed=3)
    return S.summarize(rows, steps * 8)


@pytest.mark.parametrize("design", ["fresh", "split"])
def test_replay_gain_is_unbiased_for_won_and_lost_sources(design):
    s = _bias(design)
    for source in ("won", "lost"):
        x = s[source]
        assert x["share"] > 0.15, source                     # both sources occur often enough to be measured
        assert abs(x["bias"]) < 3.5 * x["se"], (source, x)   # E[g] = the true effect, +0.10, within MC error
        assert x["se"] < 0.025


def test_the_group_control_is_biased_by_the_source_choice():
    # The earlier design: the control is the group the source was chosen from. A won-source task's control is
    # known to hold a win (its mean is p / P(≥ 1 win) ≈ 0.17, not 0.09), a lost-source one's to hold none:
    # E[g] ≈ +0.02 and +0.19 for one true effect of +0.10 (METHOD.md §2.4).
    s = _bias("group")
    assert s["won"]["bias"] < -4 * s["won"]["se"] and s["won"]["bias"] == pytest.approx(-0.08, abs=0.03)
    assert s["lost"]["bias"] > 4 * s["lost"]["se"] and s["lost"]["bias"] == pytest.approx(0.09, abs=0.03)
    assert s["lost"]["negative"] == 0.0                       # a lost-source skill can never read negative


# ---- hand-made episodes: which episode is the source, which the control --------------------------------------

class Pool:
    """What write_skills asks of a pool: the skill rule's terms."""
    task_terms = staticmethod(envs.task_terms)


class Engine:
    """Answers every analyzer prompt with the next of `answers`; records the prompts."""

    def __init__(self, answers):
        self.answers, self.prompts = list(answers), []

    def prompt_len(self, prompt):
        return len(prompt.split())

    def generate(self, prompts, **kw):
        self.prompts += prompts
        return [T.Generation(self.answers.pop(0), [1, 2], [0.0, 0.0], [0]) for _ in prompts]


def _group(wins: list[bool], task_id: str = "g0", task: str = "put a clean apple in fridge.") -> list[Episode]:
    return [Episode(task_id, "clean", task, 0, i, steps=[(f"obs {i}", f"action {i}")], reward=10.0 * w, won=w)
            for i, w in enumerate(wins)]


def _write(wins, answers, **flags):
    args = T.Args(algo="rsipo", group_size=len(wins), **flags)
    engine = Engine(answers)
    run = S.Run(args, Path("."), torch.device("cpu"), None, [], Pool(), engine=engine, skill_rng=random.Random(0))
    b = T.Batch([{"gamefile": "g0"}], _group(wins), [], [], [T.TaskRecord("g0", "clean")])
    T.write_skills(run, b)
    return b.records[0], engine.prompts


GOOD = '{"skill": "take the apple, clean it in the sinkbasin, put it in the fridge"}'


@pytest.mark.parametrize("wins, flags, source, shown", [
    ([False, False, False, True], {}, "won", "obs 3"),                                    # the won one
    ([False] * 4, {}, None, None),                                                        # no win: no skill
    ([False] * 4, {"skill_groups": "all"}, "lost", None),                                 # the paper's: a lost one
    ([False, False, False, True], {"replay_control": "split"}, None, None),               # the win is in
                                                                                          # the control half
    ([False, False, False, True], {"replay_control": "split", "skill_groups": "all"}, "lost", None),
    ([False, True, False, False], {"replay_control": "split"}, "won", "obs 1"),
])
def test_the_source_is_a_won_episode_of_the_source_half(wins, flags, source, shown):
    rec, prompts = _write(wins, [GOOD, GOOD], **flags)
    assert rec.source == source
    assert (rec.skill is not None) == (source is not None) and len(prompts) == (source is not None)
    if shown:
        assert shown in prompts[0] and "Outcome: SUCCESS" in prompts[0]
    if source == "lost":
        assert "Outcome: FAILURE" in prompts[0]
        half = len(wins) // 2 if flags.get("replay_control") == "split" else len(wins)
        assert any(f"obs {i}" in prompts[0] for i in range(half))


def test_the_skill_rule_rejects_a_skill_that_misses_the_task_s_object_or_target():
    # the first answer names the apple but not the fridge: invalid, retried once; the retry names both
    rec, prompts = _write([True, False], ['{"skill": "take the apple and clean it"}', GOOD])
    assert rec.skill == json.loads(GOOD)["skill"] and not rec.rule_failed and len(prompts) == 2
    rec, _ = _write([True, False], ['{"skill": "take the apple"}', '{"skill": "go to the fridge"}'])
    assert rec.skill is None and rec.rule_failed and rec.source == "won"
    rec, _ = _write([True, False], ['{"skill": "take the apple"}'], skill_rule=False)   # off: any parsable skill
    assert rec.skill == "take the apple"


def test_a_rule_failed_skill_scores_r_bad_and_a_task_without_a_skill_is_not_in_eq5():
    args = T.Args(algo="rsipo", group_size=2)
    run = S.Run(args, Path("."), torch.device("cpu"), None, [], Pool(), skill_rng=random.Random(0))
    recs = [T.TaskRecord("a", "clean", source="won", skill="s a", gain=0.5, replay_ok=True),
            T.TaskRecord("b", "clean", source="won", skill=None, rule_failed=True),
            T.TaskRecord("c", "clean", source="lost", skill="s c", gain=-0.5, replay_ok=True),
            T.TaskRecord("d", "clean", source=None)]                    # wrote no skill
    m = step_log.skill_metrics(run, recs)
    T.skill_advantages(run, recs)
    # Eq. (5) over a, b, c only: rewards 0.5, -1, -0.5 against their mean -1/3
    assert [r.skill_adv for r in recs[:3]] == pytest.approx([0.5 + 1 / 3, -1 + 1 / 3, -0.5 + 1 / 3])
    assert recs[3].skill_adv is None
    assert m["skill/written_frac"] == 0.75 and m["skill/valid_frac"] == pytest.approx(2 / 3)
    assert m["skill/rule_failed"] == 1.0 and m["skill/won_sources"] == 2.0 and m["skill/lost_sources"] == 1.0
    assert m["skill/won_reward"] == pytest.approx(-0.25) and m["skill/lost_reward"] == pytest.approx(-0.5)


def test_trust_is_logged_by_source():
    args = T.Args(algo="rsipo", group_size=2, trust="raw")
    run = S.Run(args, Path("."), torch.device("cpu"), None, [], Pool(), skill_rng=random.Random(0))
    recs = [T.TaskRecord("a", "clean", source="won", skill="s", gain=0.5, var=0.04, replay_ok=True),
            T.TaskRecord("b", "clean", source="won", skill="s", gain=0.0, var=0.04, replay_ok=True, informative=False),
            T.TaskRecord("c", "clean", source="lost", skill="s", gain=-0.2, var=0.04, replay_ok=True)]
    fit = T.trust(run, recs, replayed=True)
    phi = lambda z: 0.5 * (1 + __import__("math").erf(z / 2 ** 0.5))   # noqa: E731
    assert [r.trust for r in recs] == pytest.approx([phi(2.5), 0.0, phi(-1.0)])   # raw: Φ(g/√v); uninformative: 0
    m = step_log.trust_metrics(recs, fit)
    assert m["replay/won_gain"] == pytest.approx(0.25) and m["replay/lost_gain"] == pytest.approx(-0.2)
    assert m["trust/won_mean"] == pytest.approx(phi(2.5) / 2)
    assert m["trust/lost_mean"] == pytest.approx(phi(-1.0))


# ---- the skill rule's terms, read off every shipped game's task sentence --------------------------------------

def test_task_terms_name_the_object_and_target_of_every_shipped_game():
    games = sorted((ROOT / "data").glob("alfworld*/json_2.1.1/*/*/*/walkthrough.json"))
    assert len(games) > 500
    for wt in games[::7]:
        truth = game_truth(wt)
        task = envs.task_from_intro(json.loads(wt.read_text())["steps"][0]["obs"])
        target = truth["toggle"] if truth["type"] == "look" else truth["recep"]
        assert envs.task_terms(task) == (truth["object"], target), (wt, task)
    assert envs.task_terms("go to the moon.") == ()
    assert skills.names_task("Take the apples, then go to fridge 1.", ("apple", "fridge"))
    assert not skills.names_task("take the pineapple to the fridge", ("apple", "fridge"))   # a word, not a substring
    assert skills.names_task("anything", ())
