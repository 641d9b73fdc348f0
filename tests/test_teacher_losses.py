"""The teacher term's estimators in rsipo.py (METHOD.md §2.8.1), each against numbers derived by hand: value and
gradient of the signed term (Eq. 11b), the top-K and full reverse KL (Eq. 11c-d), the teacher-free control
(Eq. 11e), λ scaling each, and finite values where teacher entries are −inf or padding."""
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import rsipo  # noqa: E402


def _leaf(x):
    return torch.tensor(x, dtype=torch.float64, requires_grad=True)


# ---- signed (Eq. 11b) --------------------------------------------------------------------------------------

def test_signed_term_value_and_gradient_by_hand():
    logp = _leaf([[-1.0, -2.0, -0.5]])
    teacher = torch.tensor([[-1.5, -1.0, -4.0]], dtype=torch.float64)
    mask = torch.ones(1, 3)
    # d = ℓ − ℓ^T = 0.5, −1.0, 3.5; clipped at 2: 0.5, −1.0, 2.0; value Σ clip(d)·d / 3 = (0.25 + 1 + 7) / 3
    loss, m = rsipo.signed_teacher_loss(logp, teacher, torch.tensor([1.0]), mask, clip=2.0)
    assert loss.item() == pytest.approx(8.25 / 3)
    loss.backward()
    assert logp.grad[0].tolist() == pytest.approx([0.5 / 3, -1.0 / 3, 2.0 / 3])   # λ·clip(d)/n
    assert m["opsd/clip_frac"] == pytest.approx(1 / 3) and m["opsd/gap_mean"] == pytest.approx(-3.0 / 3)
    # λ ½ halves value and gradient; a masked token has neither
    logp2 = _leaf([[-1.0, -2.0, -0.5]])
    loss2, _ = rsipo.signed_teacher_loss(logp2, teacher, torch.tensor([0.5]), torch.tensor([[1.0, 1.0, 0.0]]))
    assert loss2.item() == pytest.approx(0.5 * (0.25 + 1.0) / 2)
    loss2.backward()
    assert logp2.grad[0].tolist() == pytest.approx([0.5 * 0.5 / 2, -0.5 * 1.0 / 2, 0.0])


def test_signed_term_raises_a_token_the_teacher_prefers_and_lowers_one_it_does_not():
    # unlike Eq. (11), whose gradient raises every sampled token
    logp = _leaf([[-2.0, -1.0]])
    teacher = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)
    loss, _ = rsipo.signed_teacher_loss(logp, teacher, torch.tensor([1.0]), torch.ones(1, 2))
    loss.backward()
    assert logp.grad[0, 0] < 0 < logp.grad[0, 1]   # descent: token 0 up, token 1 down
    gated = _leaf([[-2.0, -1.0]])
    g_loss, _ = rsipo.opsd_loss(gated, teacher, torch.tensor([1.0]), torch.ones(1, 2))
    g_loss.backward()
    assert (gated.grad < 0).all()                  # the gate only attenuates


def test_signed_term_is_finite_where_the_teacher_rules_a_token_out():
    logp = _leaf([[-1.0, -0.5]])
    teacher = torch.tensor([[-math.inf, -0.5]], dtype=torch.float64)
    loss, _ = rsipo.signed_teacher_loss(logp, teacher, torch.tensor([1.0]), torch.ones(1, 2), clip=2.0)
    loss.backward()
    assert math.isfinite(loss.item()) and loss.item() == pytest.approx(2.0 * 29.0 / 2)   # floor −30: d = 29
    assert torch.isfinite(logp.grad).all() and logp.grad[0, 0] == pytest.approx(1.0)


# ---- top-K and full reverse KL (Eq. 11c-d) -------------------------------------------------------------------

def test_full_reverse_kl_value_and_gradient_by_hand():
    # student uniform over 3 tokens, teacher (1/2, 1/4, 1/4): KL(p‖q) = −log 3 + (5/3) log 2
    z = _leaf([[[0.0, 0.0, 0.0]]])                                  # student logits [1, 1, 3]
    s = torch.log_softmax(z, -1)
    q = torch.tensor([[[0.5, 0.25, 0.25]]], dtype=torch.float64).log()
    loss, m = rsipo.support_kl(s, q, torch.tensor([1.0]), torch.ones(1, 1), tail=False)
    kl = -math.log(3) + 5 / 3 * math.log(2)
    assert loss.item() == pytest.approx(kl) and m["opsd/kl"] == pytest.approx(kl)
    loss.backward()
    # ∂KL/∂z_j = p_j (log p_j − log q_j − KL)
    want = [(1 / 3) * (math.log(1 / 3) - math.log(qj) - kl) for qj in (0.5, 0.25, 0.25)]
    assert z.grad[0, 0].tolist() == pytest.approx(want)


def test_topk_kl_keeps_the_teachers_top_tokens_and_one_tail_bucket():
    # V = 4: p = (.4, .3, .2, .1), q = (.1, .5, .3, .1); the teacher's top 2 are tokens 1 and 2.
    # Support (.3, .2) against (.5, .3), tail .5 against .2.
    p = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64)
    q = torch.tensor([0.1, 0.5, 0.3, 0.1], dtype=torch.float64)
    s_all = _leaf(p.log().tolist())
    top = torch.tensor([1, 2])
    s = s_all[top].view(1, 1, 2)
    t = q.log()[top].view(1, 1, 2)
    loss, m = rsipo.support_kl(s, t, torch.tensor([1.0]), torch.ones(1, 1), tail=True)
    want = 0.3 * math.log(0.3 / 0.5) + 0.2 * math.log(0.2 / 0.3) + 0.5 * math.log(0.5 / 0.2)
    assert loss.item() == pytest.approx(want, abs=1e-9) and m["opsd/tail_mass"] == pytest.approx(0.5)
    full = 0.4 * math.log(4) + 0.3 * math.log(0.6) + 0.2 * math.log(2 / 3)
    assert want <= full                                             # coarse-graining never exceeds the full KL
    # K = V: the tail is empty and top-K is the full KL (up to the 1e-6 floor of the tail)
    all_s, all_t = p.log().view(1, 1, 4), q.log().view(1, 1, 4)
    k_v, _ = rsipo.support_kl(all_s, all_t, torch.tensor([1.0]), torch.ones(1, 1), tail=True)
    assert float(k_v) == pytest.approx(full, abs=1e-5)


def test_support_kl_is_finite_with_minus_inf_teacher_entries_and_padded_rows():
    z = _leaf([[[0.0, 1.0, 2.0], [0.0, 0.0, 0.0]]])               # two positions; the second is padding
    t = torch.tensor([[[-math.inf, -0.1, -2.0], [0.0, 0.0, 0.0]]], dtype=torch.float64)   # padding: zeros
    mask = torch.tensor([[1.0, 0.0]])
    for tail in (False, True):
        s = torch.log_softmax(z, -1)
        loss, _ = rsipo.support_kl(s, t, torch.tensor([1.0]), mask, tail=tail)
        (g,) = torch.autograd.grad(loss, z)
        assert math.isfinite(loss.item()) and torch.isfinite(g).all()
        assert g[0, 1].abs().sum() == 0                             # the padded position: no gradient
    # the −inf entry counts as LOGP_FLOOR: student mass p_0 there costs p_0·(log p_0 + 30)
    loss, _ = rsipo.support_kl(torch.log_softmax(z, -1), t, torch.tensor([1.0]), mask, tail=False)
    p = torch.softmax(torch.tensor([0.0, 1.0, 2.0], dtype=torch.float64), -1)
    tt = torch.tensor([rsipo.LOGP_FLOOR, -0.1, -2.0], dtype=torch.float64)
    assert loss.item() == pytest.approx(float((p * (p.log() - tt)).sum()))


def test_trust_scales_each_estimator():
    torch.manual_seed(0)
    logp = torch.randn(2, 3, dtype=torch.float64) - 2
    teacher = torch.randn(2, 3, dtype=torch.float64) - 2
    sup_s = torch.log_softmax(torch.randn(2, 3, 4, dtype=torch.float64), -1)
    sup_t = torch.log_softmax(torch.randn(2, 3, 4, dtype=torch.float64), -1)
    mask = torch.ones(2, 3)
    for kind in rsipo.TEACHER_LOSSES:
        kw = dict(teacher_logp=teacher, old_logp=logp, student_support=sup_s, teacher_support=sup_t)
        one, _ = rsipo.teacher_loss(kind, logp, torch.tensor([1.0, 1.0]), mask, **kw)
        mixed, _ = rsipo.teacher_loss(kind, logp, torch.tensor([0.25, 0.0]), mask, **kw)
        row0, _ = rsipo.teacher_loss(kind, logp, torch.tensor([1.0, 1.0]), torch.tensor([[1.0] * 3, [0.0] * 3]),
                                     n_tokens=6, **kw)
        assert float(mixed) == pytest.approx(0.25 * float(row0)), kind   # λ 0 removes row 1, ¼ scales row 0
        assert float(one) != 0.0, kind


def test_teacher_loss_refuses_an_unknown_kind_or_missing_inputs():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="must be one of"):
        rsipo.teacher_loss("kl", x, torch.ones(1), torch.ones(1, 2), teacher_logp=x)
    with pytest.raises(ValueError, match="needs student_support, teacher_support"):
        rsipo.teacher_loss("topk", x, torch.ones(1), torch.ones(1, 2), teacher_logp=x)


# ---- the teacher-free control (Eq. 11e) ---------------------------------------------------------------------

def test_lowprob_control_pushes_down_only_tokens_below_the_threshold():
    old = torch.tensor([[0.5, 0.1, 0.05]], dtype=torch.float64).log()
    logp = _leaf([[-0.7, -2.3, -3.0]])
    loss, m = rsipo.lowprob_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 3), threshold=0.2)
    assert loss.item() == pytest.approx((-2.3 - 3.0) / 3) and m["opsd/low_frac"] == pytest.approx(2 / 3)
    loss.backward()
    assert logp.grad[0].tolist() == pytest.approx([0.0, 1 / 3, 1 / 3])   # descent lowers the two low tokens


def test_rsipo_loss_adds_alpha_times_the_chosen_estimator():
    torch.manual_seed(1)
    logp = torch.randn(2, 3, dtype=torch.float64) - 1
    old = logp + 0.1
    teacher = logp - 0.3
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    mask = torch.ones(2, 3)
    sup_s = torch.log_softmax(torch.randn(2, 3, 5, dtype=torch.float64), -1)
    sup_t = torch.log_softmax(torch.randn(2, 3, 5, dtype=torch.float64), -1)
    base, _ = rsipo.rsipo_loss(logp, old, adv, mask, c_kl=0, c_ent=0, alpha=0.5)
    for kind in rsipo.TEACHER_LOSSES:
        total, _ = rsipo.rsipo_loss(logp, old, adv, mask, teacher_logp=teacher, trust=torch.ones(2), alpha=0.5,
                                    c_kl=0, c_ent=0, teacher_kind=kind, student_support=sup_s, teacher_support=sup_t)
        term, _ = rsipo.teacher_loss(kind, logp, torch.ones(2), mask, teacher_logp=teacher, old_logp=old,
                                     student_support=sup_s, teacher_support=sup_t)
        assert float(total) == pytest.approx(float(base) + 0.5 * float(term)), kind
