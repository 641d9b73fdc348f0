"""Tests for rsipo.py: hand-derived numbers (derivation next to each assertion), clip/gate
gradients, micro-batch exactness, the RSIPO -> GRPO reduction, and a tiny end-to-end update.

Run: python -m pytest tests/test_rsipo.py -q
"""

import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rsipo import (  # noqa: E402
    entropy_from_logits,
    group_advantages,
    kl_k3,
    masked_token_mean,
    opsd_loss,
    policy_loss,
    rsipo_loss,
    skill_advantages,
    token_logprobs,
    turn_scores,
)

TOL = dict(rtol=0, atol=1e-6)


def sig(x):
    return 1.0 / (1.0 + math.exp(-x))


# ---------------------------------------------------------------------------------------------
# Step 1 and Eq. (1)


def test_turn_scores_format_penalty():
    R = torch.tensor([10.0, 10.0, 0.0, 0.0])
    invalid = torch.tensor([False, True, False, True])
    # s = R - 0.1*invalid = [10, 9.9, 0, -0.1]
    assert torch.allclose(turn_scores(R, invalid, 0.1), torch.tensor([10.0, 9.9, 0.0, -0.1]), **TOL)
    # integer rewards are promoted to float
    s = turn_scores(torch.tensor([1, 0]), torch.tensor([True, False]), 0.01)
    assert s.dtype == torch.float32 and torch.allclose(s, torch.tensor([0.99, 0.0]), **TOL)


def test_group_advantages_two_groups_penalty_and_singleton():
    # Interleaved, non-contiguous group ids: group 7 = turns 0,2,4,6; group 3 = turns 1,3,5;
    # group 11 = turn 7 alone.
    R = torch.tensor([10.0, 0.0, 10.0, 0.0, 0.0, 0.0, 0.0, 10.0])
    invalid = torch.tensor([False, True, False, False, False, False, False, False])
    gid = torch.tensor([7, 3, 7, 3, 7, 3, 7, 11])
    s = turn_scores(R, invalid, 0.1)  # [10, -0.1, 10, 0, 0, 0, 0, 10]
    A = group_advantages(s, gid, stabilizer=0.0)
    # group 7: s = [10,10,0,0], mean 5, dev ±5, unbiased var = 4*25/3 -> std = 10/sqrt(3)
    #   A = ±5/(10/sqrt 3) = ±sqrt(3)/2 = ±0.8660254
    h = math.sqrt(3) / 2
    # group 3: s = [-0.1, 0, 0], mean -0.1/3, dev = (0.1/3)*(-2, 1, 1),
    #   unbiased var = (0.1/3)^2 * (4+1+1)/2 -> std = (0.1/3)*sqrt(3) -> A = (-2, 1, 1)/sqrt(3)
    r3 = 1 / math.sqrt(3)
    # group 11: one sample, std := 0, dev = 0 -> A = 0
    expected = torch.tensor([h, -2 * r3, h, r3, -h, r3, -h, 0.0])
    assert torch.allclose(A, expected, rtol=0, atol=1e-5)
    # with the default eps = 1e-6 the smallest std (0.0577) moves A by a relative 1e-6/0.0577 < 2e-5
    assert torch.allclose(group_advantages(s, gid), expected, rtol=2e-5, atol=1e-7)
    assert A[7].item() == 0.0


def test_group_advantages_degenerate_groups():
    # all-equal group -> std 0 -> dev 0 -> A exactly 0; single sample -> 0; empty input -> empty
    A = group_advantages(torch.tensor([1.0, 1.0, 1.0, 5.0]), torch.tensor([0, 0, 0, 1]))
    assert torch.equal(A, torch.zeros(4))
    assert group_advantages(torch.zeros(0), torch.zeros(0, dtype=torch.long)).numel() == 0


# ---------------------------------------------------------------------------------------------
# log-probs, entropy, token mean


def test_token_logprobs_and_entropy_fp32():
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [math.log(3.0), 0.0, 0.0, 0.0]]], dtype=torch.bfloat16)
    targets = torch.tensor([[2, 0]])
    lp = token_logprobs(logits, targets)
    H = entropy_from_logits(logits)
    assert lp.dtype == torch.float32 and H.dtype == torch.float32
    # token 0: uniform over 4 -> log(1/4); token 1: probs [3,1,1,1]/6 -> log(3/6) = log 0.5
    # (bf16 rounds log 3 = 1.0986 to 1.1016, hence atol 2e-3 on token 1)
    assert torch.allclose(lp, torch.tensor([[math.log(0.25), math.log(0.5)]]), rtol=0, atol=2e-3)
    # H uniform = log 4; H([.5,1/6,1/6,1/6]) = .5 log 2 + .5 log 6
    assert torch.allclose(H, torch.tensor([[math.log(4), 0.5 * math.log(2) + 0.5 * math.log(6)]]),
                          rtol=0, atol=2e-3)


def test_masked_token_mean_microbatch_equals_full_batch():
    torch.manual_seed(0)
    x = torch.randn(4, 6, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1], [1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0]])
    # full: sum over 12 masked tokens / 12
    full = masked_token_mean(x, mask)
    assert torch.allclose(full, (x * mask).sum() / 12, **TOL)
    (g_full,) = torch.autograd.grad(full, x)
    # micro-batches of rows {0,1} (9 tokens) and {2,3} (3 tokens), each with n_tokens = 12:
    # 9/12 * mean_a + 3/12 * mean_b = full mean; gradients likewise 1/12 on every masked token
    parts = [masked_token_mean(x[i:i + 2], mask[i:i + 2], n_tokens=int(mask.sum())) for i in (0, 2)]
    assert torch.allclose(parts[0] + parts[1], full, **TOL)
    (g_mb,) = torch.autograd.grad(parts[0] + parts[1], x)
    assert torch.allclose(g_mb, g_full, **TOL)
    assert torch.allclose(g_full, mask / 12.0, **TOL)
    # empty mask: n clamped to 1 -> 0, not nan
    assert masked_token_mean(x, torch.zeros_like(mask)).item() == 0.0


def test_policy_loss_microbatch_equals_full_batch():
    torch.manual_seed(1)
    logp = (torch.randn(4, 5) * 0.3 - 1).requires_grad_()
    old = logp.detach() + torch.randn(4, 5) * 0.3
    adv = torch.randn(4)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]])
    full, _ = policy_loss(logp, old, adv, mask)
    (g_full,) = torch.autograd.grad(full, logp)
    n = int(mask.sum())
    tot = sum(policy_loss(logp[i:i + 2], old[i:i + 2], adv[i:i + 2], mask[i:i + 2], n_tokens=n)[0] for i in (0, 2))
    (g_mb,) = torch.autograd.grad(tot, logp)
    assert torch.allclose(tot, full, **TOL) and torch.allclose(g_mb, g_full, **TOL)


# ---------------------------------------------------------------------------------------------
# Eq. (10)


def test_policy_loss_clip_values_and_gradients():
    # six one-token samples (B=6, L=1), eps = 0.2, n = 6 tokens
    ratio = torch.tensor([1.1, 1.1, 1.5, 1.5, 0.5, 0.5])
    A = torch.tensor([2.0, -2.0, 1.0, -1.0, 1.0, -1.0])
    old = torch.full((6, 1), -1.0)
    logp = (old + ratio.log().unsqueeze(1)).clone().requires_grad_()
    mask = torch.ones(6, 1)
    loss, m = policy_loss(logp, old, A, mask, clip_eps=0.2)
    # per-token min(ρA, clip(ρ)A):
    #   ρ=1.1 A= 2: inside  -> 2.2          ρ=1.1 A=-2: inside -> -2.2
    #   ρ=1.5 A= 1: min(1.5, 1.2) = 1.2 (clipped)   ρ=1.5 A=-1: min(-1.5, -1.2) = -1.5 (unclipped)
    #   ρ=0.5 A= 1: min(0.5, 0.8) = 0.5 (unclipped) ρ=0.5 A=-1: min(-0.5, -0.8) = -0.8 (clipped)
    # sum = 2.2 - 2.2 + 1.2 - 1.5 + 0.5 - 0.8 = -0.6 -> loss = -(-0.6)/6 = 0.1
    assert abs(loss.item() - 0.1) < 1e-6
    loss.backward()
    # d loss/d logp = -ρA/6 where unclipped (dρ/dℓ = ρ), 0 where clipped:
    #   [-2.2, 2.2, 0, 1.5, -0.5, 0] / 6
    expected = torch.tensor([-2.2, 2.2, 0.0, 1.5, -0.5, 0.0]).unsqueeze(1) / 6
    assert torch.allclose(logp.grad, expected, **TOL)
    assert logp.grad[2].item() == 0.0 and logp.grad[5].item() == 0.0
    # 2 of 6 tokens clipped; mean ratio (1.1+1.1+1.5+1.5+.5+.5)/6 = 1.0333;
    # approx_kl = mean((ρ-1) - log ρ)
    assert abs(m["pg/clip_frac"] - 2 / 6) < 1e-6
    assert abs(m["pg/ratio_mean"] - 6.2 / 6) < 1e-6
    akl = sum((r - 1) - math.log(r) for r in [1.1, 1.1, 1.5, 1.5, 0.5, 0.5]) / 6
    assert abs(m["pg/approx_kl"] - akl) < 1e-6
    assert m["n_tokens"] == 6.0


def test_policy_loss_on_policy_is_minus_mean_advantage_and_mask():
    # ρ = 1 everywhere: loss = -TokenMean[A]; per-sample A broadcast over tokens, masked token ignored
    logp = torch.full((2, 3), -0.7, requires_grad=True)
    A = torch.tensor([1.0, -3.0])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    loss, m = policy_loss(logp, logp.detach(), A, mask)
    # tokens: 1,1,1,-3 -> mean 0/4 = 0 -> loss 0 ; grad -A/4 on masked tokens
    assert abs(loss.item()) < 1e-7 and m["pg/clip_frac"] == 0.0
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[-0.25, -0.25, -0.25], [0.75, 0.0, 0.0]]), **TOL)
    # [B,L] advantages give the same result as the broadcast [B] ones
    loss2, _ = policy_loss(logp, logp.detach(), A.unsqueeze(1).expand(2, 3), mask)
    assert torch.allclose(loss2, loss, **TOL)


# ---------------------------------------------------------------------------------------------
# k3 KL


def test_kl_k3_hand_values_zero_and_nonnegative():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[-2.0, -1.0]])
    kl, m = kl_k3(logp, ref, torch.ones(1, 2))
    # d = ref - logp = [-1, 1]; k3 = e^d - d - 1 = [e^-1, e - 2] = [0.3678794, 0.7182818]; mean 0.5430806
    assert abs(kl.item() - (math.exp(-1) + math.e - 2) / 2) < 1e-6
    assert abs(m["kl/k3"] - 0.5430806) < 1e-6
    kl.backward()
    # d k3 / d logp = -e^d + 1 -> [1 - e^-1, 1 - e] / 2 = [0.3160603, -0.8591409]
    assert torch.allclose(logp.grad, torch.tensor([[(1 - math.exp(-1)) / 2, (1 - math.e) / 2]]), **TOL)
    # zero at logp == ref (and zero gradient)
    x = torch.randn(3, 4, requires_grad=True)
    kl0, _ = kl_k3(x, x.detach(), torch.ones(3, 4))
    kl0.backward()
    assert kl0.item() == 0.0 and torch.count_nonzero(x.grad) == 0
    # always >= 0 (e^d >= 1 + d)
    torch.manual_seed(2)
    a, b = torch.randn(64, 16) * 3, torch.randn(64, 16) * 3
    d = b - a
    assert (d.exp() - d - 1 >= 0).all()
    assert kl_k3(a, b, torch.ones(64, 16))[0].item() >= 0


def test_padded_positions_never_reach_an_exponential():
    # A padded position holds ref = 0 (the trainer's fill) and a very negative ℓ: unmasked, the k3 term
    # there is exp(0 - (-100)) = e^100 → inf in fp32, and inf·0 = NaN poisons the masked loss and its grad.
    logp = torch.tensor([[-1.0, -100.0]], requires_grad=True)
    ref = torch.tensor([[-2.0, 0.0]])
    old = torch.tensor([[-1.0, 0.0]])
    teacher = torch.tensor([[-0.5, 0.0]])
    mask = torch.tensor([[1.0, 0.0]])
    term = opsd_loss(logp, teacher, torch.tensor([1.0]), mask)
    loss, m = rsipo_loss(logp, old, torch.tensor([1.0]), mask, entropy=torch.ones(1, 2), ref_logp=ref,
                         teacher_term=term, alpha=1.0, c_kl=1.0, c_ent=0.0)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    # only the response token counts: k3 at d = -1 is e^-1 - (-1) - 1 = 0.3678794
    assert abs(m["kl/k3"] - math.exp(-1)) < 1e-6
    assert logp.grad[0, 1].item() == 0.0


# ---------------------------------------------------------------------------------------------
# Eq. (5)


def test_skill_advantages_two_types_invalid_and_single_task():
    gains = torch.tensor([0.5, 0.1, 0.3, 0.2])
    types = ["pick", "pick", "pick", "heat"]
    valid = torch.tensor([True, True, False, True])
    adv, rm = skill_advantages(gains, types, valid, r_bad=-1.0, running_means=None, momentum=0.9)
    # pick: g = [0.5, 0.1, r_bad=-1.0] (invalid uses r_bad), mean = -0.4/3 = -0.1333333
    #   A = [0.5+0.1333, 0.1+0.1333, -1+0.1333] = [0.6333333, 0.2333333, -0.8666667]
    # heat: one task, never seen -> running mean 0 -> A = 0.2
    assert torch.allclose(adv, torch.tensor([0.6333333, 0.2333333, -0.8666667, 0.2]), rtol=0, atol=1e-6)
    # EMA from 0: pick 0.9*0 + 0.1*(-0.1333333) = -0.0133333; heat 0.1*0.2 = 0.02
    assert abs(rm["pick"] - (-0.4 / 30)) < 1e-7 and abs(rm["heat"] - 0.02) < 1e-7
    # second batch: heat alone again, running mean 0.5 given -> baseline 0.5 (pre-update):
    #   A = 0.2 - 0.5 = -0.3; update 0.9*0.5 + 0.1*0.2 = 0.47; other types kept untouched
    prev = {"heat": 0.5, "cool": 0.3}
    adv2, rm2 = skill_advantages(torch.tensor([0.2]), ["heat"], torch.tensor([True]), running_means=prev)
    assert abs(adv2.item() - (-0.3)) < 1e-6
    assert abs(rm2["heat"] - 0.47) < 1e-7 and rm2["cool"] == 0.3
    assert prev == {"heat": 0.5, "cool": 0.3}  # input not mutated
    # invalid single-task skill: g = r_bad = -1, baseline 0 -> A = -1
    adv3, _ = skill_advantages(torch.tensor([0.9]), ["look"], torch.tensor([False]), r_bad=-1.0)
    assert abs(adv3.item() + 1.0) < 1e-7


# ---------------------------------------------------------------------------------------------
# Eq. (11)


def test_opsd_loss_hand_value_gradient_sign_and_magnitude():
    logp = torch.tensor([[-1.0, -2.0, -0.3]], requires_grad=True)
    teacher = torch.tensor([[-0.5, -3.0, -7.0]])
    trust = torch.tensor([0.5])
    mask = torch.tensor([[1, 1, 0]])  # third token masked out
    loss, m = opsd_loss(logp, teacher, trust, mask, beta=5.0)
    # d = ℓ^T - ℓ = [0.5, -1.0]; gate = σ(5d) = [σ(2.5), σ(-5)] = [0.9241418, 0.0066929]
    # loss = λ/n Σ gate·d = 0.5/2 * (0.9241418*0.5 - 0.0066929*1.0) = 0.25*0.4553780 = 0.1138445
    g1, g2 = sig(2.5), sig(-5.0)
    assert abs(loss.item() - 0.25 * (g1 * 0.5 - g2)) < 1e-6
    assert abs(loss.item() - 0.1138445) < 1e-6
    loss.backward()
    # ∂L/∂ℓ = -λ·gate/n (gate and ℓ^T detached): [-0.5*0.9241418/2, -0.5*0.0066929/2, 0]
    #   = [-0.2310355, -0.0016732, 0]; both ≤ 0: the teacher-endorsed token (gate>½) is raised
    #   strongly, the rejected one (gate small) only weakly — never pushed down.
    expected = torch.tensor([[-0.5 * g1 / 2, -0.5 * g2 / 2, 0.0]])
    assert torch.allclose(logp.grad, expected, rtol=0, atol=1e-7)
    assert (logp.grad <= 0).all() and logp.grad[0, 1] < 0
    # metrics: gate mean (g1+g2)/2; 1 of 2 gates > ½; gap mean (0.5-1)/2 = -0.25; trust 0.5
    assert abs(m["opsd/gate_mean"] - (g1 + g2) / 2) < 1e-6
    assert m["opsd/gate_frac_gt_half"] == 0.5
    assert abs(m["opsd/gap_mean"] + 0.25) < 1e-6 and m["opsd/trust_mean"] == 0.5


def test_opsd_gradient_never_positive_random_and_zero_trust():
    torch.manual_seed(3)
    logp = (torch.randn(8, 10) - 2).requires_grad_()
    teacher = torch.randn(8, 10) - 2
    trust = torch.rand(8)
    mask = (torch.rand(8, 10) > 0.3).long()
    loss, _ = opsd_loss(logp, teacher, trust, mask, beta=5.0)
    loss.backward()
    n = mask.sum()
    # every token: ∂L/∂ℓ = -λ·σ(β(ℓ^T-ℓ))/n ≤ 0, on both sides of gate = ½
    expected = -trust[:, None] * torch.sigmoid(5.0 * (teacher - logp.detach())) * mask / n
    assert torch.allclose(logp.grad, expected, rtol=1e-6, atol=1e-9)
    assert (logp.grad <= 0).all()
    d = teacher - logp.detach()
    assert ((d > 0) & (mask > 0)).any() and ((d < 0) & (mask > 0)).any()  # both regimes covered
    # λ = 0 -> loss 0 and no gradient
    x = logp.detach().clone().requires_grad_()
    l0, _ = opsd_loss(x, teacher, torch.zeros(8), mask)
    l0.backward()
    assert l0.item() == 0.0 and torch.count_nonzero(x.grad) == 0


# ---------------------------------------------------------------------------------------------
# Eq. (12) and the RSIPO -> GRPO reduction


def _batch(seed=4, B=4, L=7, V=11):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, L, V, generator=g, requires_grad=True)
    targets = torch.randint(0, V, (B, L), generator=g)
    old = token_logprobs(logits.detach(), targets) + 0.2 * torch.randn(B, L, generator=g)
    ref = token_logprobs(logits.detach(), targets) + 0.3 * torch.randn(B, L, generator=g)
    teacher = token_logprobs(logits.detach(), targets) + torch.randn(B, L, generator=g)
    adv = torch.randn(B, generator=g)
    mask = (torch.rand(B, L, generator=g) > 0.25).long()
    return logits, targets, old, ref, teacher, adv, mask


def test_rsipo_reduces_to_grpo_exactly():
    logits, targets, old, ref, teacher, adv, mask = _batch()
    kw = dict(clip_eps=0.2, c_kl=0.01, c_ent=0.001)

    def grpo():
        lp, H = token_logprobs(logits, targets), entropy_from_logits(logits)
        pg, _ = policy_loss(lp, old, adv, mask, clip_eps=0.2)
        kl, _ = kl_k3(lp, ref, mask)
        return pg + 0.01 * kl - 0.001 * masked_token_mean(H, mask)

    def rsipo(**extra):
        lp, H = token_logprobs(logits, targets), entropy_from_logits(logits)
        return rsipo_loss(lp, old, adv, mask, entropy=H, ref_logp=ref, **kw, **extra)[0]

    base = grpo()
    (g_base,) = torch.autograd.grad(base, logits)
    # no teacher; teacher with alpha = 0 (even a non-finite teacher term is ignored)
    lp0 = token_logprobs(logits, targets)
    nan_term = opsd_loss(lp0, torch.full_like(teacher, float("nan")), torch.ones(4), mask)
    for extra in (dict(alpha=0.01), dict(teacher_term=opsd_loss(lp0, teacher, torch.ones(4), mask), alpha=0.0),
                  dict(teacher_term=nan_term, alpha=0.0)):
        loss = rsipo(**extra)
        (g,) = torch.autograd.grad(loss, logits)
        assert torch.allclose(loss, base, rtol=0, atol=1e-7)
        assert torch.allclose(g, g_base, rtol=0, atol=1e-8)
    # pure PG: no ref, no entropy -> exactly policy_loss
    lp = token_logprobs(logits, targets)
    l1, m1 = rsipo_loss(lp, old, adv, mask, clip_eps=0.2, alpha=0.0, c_kl=0.01, c_ent=0.001)
    l2, _ = policy_loss(lp, old, adv, mask, clip_eps=0.2)
    assert torch.equal(l1, l2) and set(m1) == {"pg/loss", "pg/clip_frac", "pg/dual_clip_frac", "pg/ratio_mean",
                                               "pg/approx_kl", "n_tokens", "loss"}


def test_rsipo_full_loss_is_sum_of_terms_and_skill_call():
    logits, targets, old, ref, teacher, adv, mask = _batch(seed=5)
    lp, H = token_logprobs(logits, targets), entropy_from_logits(logits)
    trust = torch.tensor([0.9, 0.1, 0.5, 0.0])
    loss, m = rsipo_loss(lp, old, adv, mask, entropy=H, ref_logp=ref, teacher_term=opsd_loss(lp, teacher, trust, mask),
                         clip_eps=0.2, alpha=0.01, c_kl=0.01, c_ent=0.001)
    # Eq. (12) for student turns: L_PG + α L_OPSD + c_KL KL - c_H H
    pg, _ = policy_loss(lp, old, adv, mask, 0.2)
    op, _ = opsd_loss(lp, teacher, trust, mask, 5.0)
    kl, _ = kl_k3(lp, ref, mask)
    want = pg + 0.01 * op + 0.01 * kl - 0.001 * masked_token_mean(H, mask)
    assert torch.allclose(loss, want, rtol=0, atol=1e-7)
    assert {"opsd/gate_mean", "kl/k3", "entropy", "loss"} <= set(m)
    # skill-writing samples: same function, A^skill, no teacher, pg_weight = η -> η·L_skill
    a_skill = torch.tensor([0.6, -0.9, 0.2, 0.0])
    ls, _ = rsipo_loss(lp, old, a_skill, mask, pg_weight=0.1, alpha=0.01, c_kl=0.0, c_ent=0.0)
    assert torch.allclose(ls, 0.1 * policy_loss(lp, old, a_skill, mask, 0.2)[0], rtol=0, atol=1e-8)


def test_end_to_end_linear_policy_learns():
    torch.manual_seed(6)
    B, L, D, V = 4, 5, 8, 13
    policy = torch.nn.Linear(D, V)
    feats = torch.randn(B, L, D)
    targets = torch.randint(0, V, (B, L))
    mask = torch.ones(B, L)
    mask[1, 3:] = 0
    with torch.no_grad():
        old = token_logprobs(policy(feats), targets)  # rollout log-probs = reference
        teacher = old + 0.5  # the teacher endorses every sampled token
    adv = torch.tensor([1.0, 0.5, 2.0, 1.0])  # positive advantages: raise the sampled tokens
    trust = torch.full((B,), 0.8)
    w0 = policy.weight.detach().clone()
    opt = torch.optim.SGD(policy.parameters(), lr=0.5)
    losses = []
    for _ in range(5):
        logits = policy(feats)  # [B,L,V]
        lp = token_logprobs(logits, targets)
        loss, m = rsipo_loss(lp, old, adv, mask, entropy=entropy_from_logits(logits), ref_logp=old,
                             teacher_term=opsd_loss(lp, teacher, trust, mask), alpha=0.01, c_kl=0.01, c_ent=0.001)
        assert math.isfinite(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert not torch.allclose(policy.weight, w0)
    with torch.no_grad():
        lp_new = token_logprobs(policy(feats), targets)
    # the sampled tokens became more likely on average
    assert masked_token_mean(lp_new - old, mask).item() > 0


# ---------------------------------------------------------------------------------------------
# GiGPO's step-level advantage (deviation 10)


def test_step_returns_and_anchor_group_advantages_by_hand():
    from rsipo import step_advantages, step_returns
    # two episodes of one task. ep 0: obs a, b, c, wins at its 3rd step (r = 10); ep 1: obs a, d, its
    # 1st turn unparsable (r = -0.1). γ = 0.95.
    r = torch.tensor([0.0, 0.0, 10.0, -0.1, 0.0])
    ep = torch.tensor([0, 0, 0, 1, 1])
    G = step_returns(r, ep, 0.95)
    # ep 0: G2 = 10, G1 = 0 + 0.95·10 = 9.5, G0 = 0.95·9.5 = 9.025; ep 1: G1 = 0, G0 = -0.1
    assert torch.allclose(G, torch.tensor([9.025, 9.5, 10.0, -0.1, 0.0]), **TOL)
    # anchors: turn 0 and turn 3 acted on the same first observation; the others are alone
    A = step_advantages(G, torch.tensor([0, 1, 2, 0, 3]))
    # group {9.025, -0.1}: mean 4.4625, unbiased std |9.025 + 0.1|/√2 = 6.45235; A = ±4.5625/6.45235 = ±0.707107
    assert torch.allclose(A, torch.tensor([0.7071067, 0.0, 0.0, -0.7071067, 0.0]), atol=1e-5)


def test_a_gigpo_group_without_repeated_states_is_grpo_exactly():
    from rsipo import step_advantages, step_returns
    torch.manual_seed(0)
    s = torch.randn(12)
    gid = torch.tensor([0] * 6 + [1] * 6)
    grpo = group_advantages(s, gid)
    step = step_advantages(step_returns(torch.randn(12), torch.arange(12) // 3, 0.95), torch.arange(12))
    assert torch.count_nonzero(step) == 0 and torch.equal(grpo + 1.0 * step.to(grpo.dtype), grpo)


def test_separate_token_means_for_pg_opsd_and_regularisers():
    # one sample, 2 tokens; the PG term over n_tokens = 4, KL over reg_n_tokens = 8, OPSD over its own n_tokens = 2
    logp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    old, ref, teach = torch.full((1, 2), -1.0), torch.full((1, 2), -2.0), torch.full((1, 2), -1.0)
    term = opsd_loss(logp, teach, torch.tensor([1.0]), torch.ones(1, 2), n_tokens=2.0)
    loss, m = rsipo_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 2), ref_logp=ref, teacher_term=term,
                         alpha=1.0, c_kl=1.0, c_ent=0.0, n_tokens=4.0, reg_n_tokens=8.0)
    # ρ = 1: PG = −(1 + 1)/4 = −0.5; k3 at d = −1: e^-1 − (−1) − 1 = 0.3678794 per token → 2·0.3679/8;
    # OPSD: d = 0 → 0
    assert abs(m["pg/loss"] + 0.5) < 1e-6 and abs(m["kl/k3"] - 2 * math.exp(-1) / 8) < 1e-6
    loss.backward()
    # ∂/∂ℓ per token: PG −1/4; KL (1 − e^d)/8 = (1 − e^-1)/8; OPSD −λ·σ(0)/2 = −0.25
    g = -0.25 + (1 - math.exp(-1)) / 8 - 0.25
    assert torch.allclose(logp.grad, torch.full((1, 2), g), **TOL)
