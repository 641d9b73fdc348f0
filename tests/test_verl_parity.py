"""Where the recipes claim verl / verl-agent's numbers, the same numbers, each derived by hand (METHOD.md, "Where
we differ from verl and verl-agent"): the dual clip, the policy ratio's log held to ±20, the clamped k3 KL,
mean_norm, GiGPO's step score (the
penalty after the discounted return, a dropped turn keeping its place), env-error episodes out of the group
statistics, and the trainer's log-probs at the sampling temperature."""
import json
import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import rsipo  # noqa: E402
import train as T  # noqa: E402
from rollout import Episode, Turn, token_logprobs_of  # noqa: E402
from harness import tiny  # noqa: E402


def test_dual_clip_caps_a_negative_advantage_token_at_c():
    # A = −1, ρ = 4: −min(ρA, clip(ρ)A) = 4 with gradient 4; verl's dual clip gives min(4, c = 3) = 3, gradient 0
    for c, value, grad in ((3.0, 3.0, 0.0), (None, 4.0, 4.0)):
        logp = torch.tensor([[math.log(4.0)]], requires_grad=True)
        loss, m = rsipo.policy_loss(logp, torch.zeros(1, 1), torch.tensor([-1.0]), torch.ones(1, 1), clip_ratio_c=c)
        loss.backward()
        assert loss.item() == pytest.approx(value) and logp.grad.item() == pytest.approx(grad)
        assert m["pg/dual_clip_frac"] == (1.0 if c else 0.0)
    # below c, and for a positive advantage, nothing changes: ρ = 2, A = −1 → 2 (gradient 2); ρ = 4, A = +1 → −1.2
    for ratio, A, value in ((2.0, -1.0, 2.0), (4.0, 1.0, -1.2)):
        logp = torch.tensor([[math.log(ratio)]], requires_grad=True)
        loss, m = rsipo.policy_loss(logp, torch.zeros(1, 1), torch.tensor([A]), torch.ones(1, 1))
        assert loss.item() == pytest.approx(value) and m["pg/dual_clip_frac"] == 0.0


def test_the_policy_ratio_is_held_to_log_20_as_verl():
    # log ρ = 100: e^100 is inf in fp32 and its gradient NaN; held to ±20 as verl, the clipped surrogate takes over
    # (A = +1: −(1 + ε) = −1.2; A = −1: the dual clip's c·A, −(−3) = 3), each with gradient 0
    for A, value in ((1.0, -1.2), (-1.0, 3.0)):
        logp = torch.tensor([[100.0]], requires_grad=True)
        loss, m = rsipo.policy_loss(logp, torch.zeros(1, 1), torch.tensor([A]), torch.ones(1, 1))
        loss.backward()
        assert loss.item() == pytest.approx(value) and logp.grad.item() == 0.0
        assert m["pg/ratio_mean"] == pytest.approx(math.exp(20), rel=1e-6)
    # without the dual clip a negative advantage meets e^20 itself: finite, where e^100 was inf
    logp = torch.tensor([[100.0]], requires_grad=True)
    loss, _ = rsipo.policy_loss(logp, torch.zeros(1, 1), torch.tensor([-1.0]), torch.ones(1, 1), clip_ratio_c=None)
    loss.backward()
    assert loss.item() == pytest.approx(math.exp(20), rel=1e-6) and logp.grad.item() == 0.0


def test_k3_kl_is_clamped_as_verls_low_var_kl():
    # one token 10 nats below the reference: k3 = e^10 − 11 ≈ 22015, clamped to 10 with no gradient
    for clamp, value, grad in ((10.0, 10.0, 0.0), (None, math.exp(10) - 11, -(math.exp(10) - 1))):
        logp = torch.tensor([[-12.0]], dtype=torch.float64, requires_grad=True)
        loss, m = rsipo.kl_k3(logp, torch.tensor([[-2.0]], dtype=torch.float64), torch.ones(1, 1), clamp=clamp)
        loss.backward()
        assert loss.item() == pytest.approx(value) and logp.grad.item() == pytest.approx(grad)
        assert m["kl/clamp_frac"] == (1.0 if clamp else 0.0)
    # far past exp's range the log-ratio is held to ±20 first: a finite value and gradient, not inf·0
    logp = torch.tensor([[-200.0]], requires_grad=True)
    loss, _ = rsipo.kl_k3(logp, torch.zeros(1, 1), torch.ones(1, 1))
    loss.backward()
    assert loss.item() == 10.0 and logp.grad.item() == 0.0


def test_mean_norm_leaves_out_the_std():
    s = torch.tensor([1.0, 2.0, 6.0, 5.0, 5.0])
    g = torch.tensor([0, 0, 0, 1, 1])
    assert rsipo.group_advantages(s, g, std_norm=False).tolist() == pytest.approx([-2.0, -1.0, 3.0, 0.0, 0.0])
    std = math.sqrt((4 + 1 + 9) / 2)   # unbiased std of 1, 2, 6 about their mean 3
    assert rsipo.group_advantages(s, g).tolist() == pytest.approx([-2 / std, -1 / std, 3 / std, 0, 0], rel=1e-5)


def test_a_tied_group_gets_exactly_zero_where_float32_statistics_leave_noise():
    # six returns of 9.9: verl's float32 mean and std leave (9.9 − 9.9000006) / (1.04e-6 + 1e-6) = −0.466 each
    x = torch.full((6,), 9.9)
    assert ((x - x.mean()) / (x.std() + 1e-6)).tolist() == pytest.approx([-0.4664] * 6, abs=1e-3)
    assert rsipo.group_advantages(x, torch.zeros(6, dtype=torch.long)).tolist() == [0.0] * 6
    assert rsipo.group_advantages(torch.tensor([3.0]), torch.zeros(1, dtype=torch.long)).tolist() == [0.0]


def _episode(k: int, rewards: list[float], steps: list[int], invalid=(), obs=None, error=None, group=0):
    """An episode k of group `group` whose env gave `rewards` at its steps, with turns at `steps` (a step without
    a turn was dropped); every step on observation obs[step] (default: its index)."""
    obs = obs or [f"o{i}" for i in range(len(rewards))]
    turns = [Turn([1], [2], [], i in invalid, "g", "pick", group, k, i) for i in steps]
    return Episode("g", "pick", "task", group, k, turns=turns, steps=[(obs[i], "a") for i in range(len(rewards))],
                   reward=sum(rewards), won=sum(rewards) > 0, error=error, step_rewards=list(rewards))


def test_gigpo_step_score_discounts_env_rewards_only_and_a_dropped_turn_keeps_its_place():
    # three steps, the reward 10 at the last; the middle step's turn was dropped (its prompt did not fit)
    eps = [_episode(0, [0.0, 0.0, 10.0], steps=[0, 2])]
    turns = T.policy_turns(eps)
    assert T.step_scores(eps, turns, 0.95, 0.1).tolist() == pytest.approx([0.95 ** 2 * 10, 10.0])   # 9.025, not 9.5
    # the format penalty stays on its own row: an invalid second turn lowers that row alone
    eps = [_episode(0, [0.0, 0.0], steps=[0, 1], invalid=(1,))]
    assert T.step_scores(eps, T.policy_turns(eps), 0.95, 0.1).tolist() == pytest.approx([0.0, -0.1])


def test_two_lost_episodes_from_one_start_get_no_step_advantage_for_the_others_invalid_turn():
    # they share their first observation (an anchor group); one's second turn is invalid. Discounting the penalty
    # into the first turn would give that pair [+0.707, −0.707]; verl-agent's score gives them [0, 0]
    eps = [_episode(0, [0.0, 0.0], steps=[0, 1], obs=["start", "x"]),
           _episode(1, [0.0, 0.0], steps=[0, 1], invalid=(1,), obs=["start", "y"])]
    a = T.Args(step_adv=1.0, p_fmt=0.1)
    turns = T.policy_turns(eps)
    adv, anchored = T.advantages(eps, turns, a)
    eq1 = rsipo.group_advantages(rsipo.turn_scores(torch.zeros(4), torch.tensor([0, 0, 0, 1]), 0.1),
                                 torch.zeros(4, dtype=torch.long))
    first = [i for i, tr in enumerate(turns) if tr.step == 0]
    assert [adv[i] for i in first] == pytest.approx([eq1[i].item() for i in first])   # the step term adds 0
    assert anchored == pytest.approx(0.5)


def test_env_error_episodes_leave_the_group_statistics():
    # rewards 10 and 0, and a third episode cut short by a worker crash: the group is the first two alone
    eps = [_episode(0, [10.0], steps=[0]), _episode(1, [0.0], steps=[0]),
           _episode(2, [0.0], steps=[0], error="worker died")]
    turns = T.policy_turns(eps)
    assert [tr.episode_id for tr in turns] == [0, 1]
    adv, _ = T.advantages(eps, turns, T.Args())
    assert adv == pytest.approx([1 / math.sqrt(2), -1 / math.sqrt(2)], rel=1e-5)   # with it: 1.155, −0.577, −0.577


def test_trainer_log_probs_are_at_the_sampling_temperature():
    torch.manual_seed(0)
    model = tiny.tiny_model(20, T.Args(tiny_hidden=32)).eval()
    ids = torch.tensor([[3, 4, 5, 6]])
    attn = torch.ones_like(ids)
    tgt = ids[:, 2:]
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, 1:3]                           # the positions predicting 5, 6
        lp, _ = token_logprobs_of(model, ids, attn, tgt, temperature=0.5)
    want = torch.log_softmax(logits / 0.5, -1).gather(-1, tgt.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(lp, want, atol=1e-5)
    a = T.Args(temperature=0.7, skill_temperature=0.0)
    assert T.sampled_at(a, False) == 0.7 and T.sampled_at(a, True) == 1.0     # greedy skills: no division


def test_a_run_at_temperature_0_7_has_the_sampler_and_the_trainer_agree(tmp_path):
    # free decoding at T 0.7: the sampler's log-probs are of the tempered distribution, and so are π_old's and
    # π_θ's before the first optimizer step
    T.main(["--algo", "grpo", "--temperature", "0.7", "--constrained", "false", "--sft_steps", "20", "--steps", "1",
            "--tasks_per_step", "2", "--group_size", "2", "--max_turns", "3", "--eval", "false", "--tiny_hidden", "32",
            "--drop_zero_adv", "false", "--out_dir", str(tmp_path), "--run_name", "t07"])
    row = [json.loads(x) for x in (tmp_path / "t07" / "metrics.jsonl").read_text().splitlines()][-1]
    assert row["rollout/logp_diff_tokens"] > 0 and row["rollout/logp_diff_max"] < 1e-4
    assert row["update/first_logp_gap_max"] < 1e-4
