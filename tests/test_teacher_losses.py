"""The teacher term's estimators in rsipo.py (METHOD.md §2.8.1), each against numbers derived by hand: value and
gradient of the signed term (Eq. 11b), the top-K and full reverse KL (Eq. 11c-d) on each support (the student's,
the teacher's, the union) with the teacher's exact tail, the rule for rows without a teacher, the teacher-free
control (Eq. 11e), λ scaling each, the estimator table, and finite values where teacher entries are −inf or
padding."""
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
    loss, m = rsipo.support_kl(s, q, torch.tensor([1.0]), torch.ones(1, 1))
    kl = -math.log(3) + 5 / 3 * math.log(2)
    assert loss.item() == pytest.approx(kl) and m["opsd/kl"] == pytest.approx(kl)
    loss.backward()
    # ∂KL/∂z_j = p_j (log p_j − log q_j − KL)
    want = [(1 / 3) * (math.log(1 / 3) - math.log(qj) - kl) for qj in (0.5, 0.25, 0.25)]
    assert z.grad[0, 0].tolist() == pytest.approx(want)


def test_topk_kl_keeps_its_support_and_one_tail_bucket():
    # V = 4: p = (.4, .3, .2, .1), q = (.1, .5, .3, .1); the teacher's top 2 are tokens 1 and 2.
    # Support (.3, .2) against (.5, .3), tail .5 against .2.
    p = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64)
    q = torch.tensor([0.1, 0.5, 0.3, 0.1], dtype=torch.float64)
    s_all = _leaf(p.log().tolist())
    top = torch.tensor([1, 2])
    s = s_all[top].view(1, 1, 2)
    t, t_tail = rsipo.support_logprobs(q.log().view(1, 1, 4), top.view(1, 1, 2))
    assert t_tail.item() == pytest.approx(math.log(0.2))
    loss, m = rsipo.support_kl(s, t, torch.tensor([1.0]), torch.ones(1, 1), teacher_tail=t_tail)
    want = 0.3 * math.log(0.3 / 0.5) + 0.2 * math.log(0.2 / 0.3) + 0.5 * math.log(0.5 / 0.2)
    assert loss.item() == pytest.approx(want, abs=1e-9) and m["opsd/tail_mass"] == pytest.approx(0.5)
    full = 0.4 * math.log(4) + 0.3 * math.log(0.6) + 0.2 * math.log(2 / 3)
    assert want <= full                                             # coarse-graining never exceeds the full KL
    # K = V: the tail is empty and top-K is the full KL (up to the student's 1e-6 floor of its own tail)
    all_ids = torch.arange(4).view(1, 1, 4)
    all_t, empty = rsipo.support_logprobs(q.log().view(1, 1, 4), all_ids)
    assert empty.item() == -math.inf
    k_v, _ = rsipo.support_kl(p.log().view(1, 1, 4), all_t, torch.tensor([1.0]), torch.ones(1, 1), teacher_tail=empty)
    assert float(k_v) == pytest.approx(full, abs=1e-4)


P = [0.5, 0.3, 0.15, 0.05]       # the student: 50% on token 0, which the teacher gives 10%
Q = [0.1, 0.7, 0.1, 0.1]         # the teacher: token 1


def _one_position(side):
    """Student P, teacher Q at one position, K = 1: the support chosen as the trainer chooses it (π_old's top-K
    for the student side, the teacher's for its own, both for the union), the teacher's side as scoring keeps it,
    the student's as the update gathers it; returns the KL and the gradient on the student's logits."""
    z = _leaf([[[math.log(x) for x in P]]])
    logp_all = torch.log_softmax(z, -1)                                       # [1, 1, 4]
    q_all = torch.tensor([[Q]], dtype=torch.float64).log()                    # [1, 1, 4]
    student_top = logp_all.detach().topk(1, dim=-1).indices                   # π_old's top-1: token 0
    ids = rsipo.support_ids(q_all, 1, side, student_top)
    t, tail = rsipo.support_logprobs(q_all, ids)
    x = rsipo.teacher_inputs(logp_all[..., 0], torch.tensor([True]), logp_all=logp_all, ids=ids, support_lp=t,
                             tail=tail)
    loss, m = rsipo.teacher_loss("topk", logp_all[..., 0], torch.tensor([1.0]), torch.ones(1, 1), **x)
    loss.backward()
    return loss.item(), z.grad[0, 0].tolist(), ids


def test_the_three_supports_by_hand_at_one_position():
    ln = math.log
    # teacher side S = {1}: outcomes (token 1, rest) = (.3, .7) against (.7, .3)
    kl_t = 0.3 * ln(0.3 / 0.7) + 0.7 * ln(0.7 / 0.3)
    # student side S = {0} (SDPO, TRL): (token 0, rest) = (.5, .5) against (.1, .9)
    kl_s = 0.5 * ln(0.5 / 0.1) + 0.5 * ln(0.5 / 0.9)
    # union S = {0, 1}: (.5, .3, rest .2) against (.1, .7, .2)
    kl_u = 0.5 * ln(0.5 / 0.1) + 0.3 * ln(0.3 / 0.7)
    kl_full = sum(p * ln(p / q) for p, q in zip(P, Q))
    # ∂KL_S/∂z_j = p_j (log q_θ(c) − log q_T(c) − KL_S), c the outcome token j falls in
    push = {"teacher": 0.5 * (ln(0.7 / 0.3) - kl_t), "student": 0.5 * (ln(0.5 / 0.1) - kl_s),
            "union": 0.5 * (ln(0.5 / 0.1) - kl_u)}
    for side, kl in (("teacher", kl_t), ("student", kl_s), ("union", kl_u)):
        value, grad, ids = _one_position(side)
        assert value == pytest.approx(kl, abs=1e-12), side
        assert grad[0] == pytest.approx(push[side], abs=1e-12), side    # descent lowers token 0 by this much
        assert sum(grad) == pytest.approx(0.0, abs=1e-12)               # softmax: the logits' gradient sums to 0
        assert all(kl <= kl_full for kl in (kl_t, kl_s, kl_u))
    assert sorted(_one_position("union")[2].flatten().tolist()) == [0, 1]
    # the full KL pushes token 0 down by 0.5 (ln 5 − KL): the student's support comes nearer it than the teacher's
    full_push = 0.5 * (ln(0.5 / 0.1) - kl_full)
    assert push["teacher"] < full_push < push["student"]
    assert (push["teacher"], full_push, push["student"]) == pytest.approx((0.2542, 0.5164, 0.5493), abs=1e-4)


def test_support_ids_union_holds_each_token_once():
    q_all = torch.tensor([0.0, 3.0, 2.0, -1.0, 4.0, -2.0, -3.0, 1.0]).view(1, 8)   # the teacher's top 3: 4, 1, 2
    student = torch.tensor([[2, 7, 4]])
    u = rsipo.support_ids(q_all, 3, "union", student)
    assert u.shape == (1, 6) and sorted(x for x in u[0].tolist() if x >= 0) == [1, 2, 4, 7]
    assert u[0].tolist().count(-1) == 2
    assert sorted(rsipo.support_ids(q_all, 3, "teacher")[0].tolist()) == [1, 2, 4]
    assert rsipo.support_ids(q_all, 3, "student", student).tolist() == [[2, 7, 4]]
    with pytest.raises(ValueError, match="needs student_ids"):
        rsipo.support_ids(q_all, 3, "union")
    with pytest.raises(ValueError, match="must be one of"):
        rsipo.support_ids(q_all, 3, "both", student)
    # empty slots: −inf log-prob, and the tail is the mass of every token not held
    lp = torch.log_softmax(q_all, -1)
    kept, tail = rsipo.support_logprobs(lp, u)
    held = torch.tensor([1, 2, 4, 7])
    assert (kept[u < 0] == -math.inf).all() and torch.allclose(kept[u >= 0].exp().sum(), lp[0, held].exp().sum())
    rest = torch.ones(8, dtype=torch.bool)
    rest[held] = False
    assert tail.item() == pytest.approx(float(lp[0, rest].logsumexp(-1)), abs=1e-6)


def test_the_teachers_tail_is_exact_where_it_is_near_certain():
    # The teacher puts all but T = 4/(e^25 + 4) ≈ 5.6e-11 on token 0; the student puts 0.41 elsewhere.
    # Top-1 support {0}: KL = .59 ln(.59/(1 − T)) + .41 ln(.41/T) ≈ 9.00. A tail floored at 1e-6 gives 4.99.
    V = 5
    z = torch.tensor([25.0, 0.0, 0.0, 0.0, 0.0])
    T = 4 / (math.exp(25) + 4)
    exact = 0.59 * math.log(0.59 / (1 - T)) + 0.41 * math.log(0.41 / T)
    floored = 0.59 * math.log(0.59) + 0.41 * math.log(0.41 / 1e-6)
    for dtype in (torch.float64, torch.float32):   # the trainer scores in fp32
        q_all = torch.log_softmax(z.to(dtype), -1).view(1, 1, V)
        t, tail = rsipo.support_logprobs(q_all, torch.zeros(1, 1, 1, dtype=torch.long))
        assert tail.item() == pytest.approx(math.log(T), rel=1e-5)
        s = torch.tensor([[[math.log(0.59)]]], dtype=dtype)
        loss, _ = rsipo.support_kl(s, t, torch.tensor([1.0]), torch.ones(1, 1), teacher_tail=tail)
        assert loss.item() == pytest.approx(exact, rel=1e-5)
    assert (exact, floored) == pytest.approx((9.0048, 4.9875), abs=1e-4)


def test_a_row_without_a_teacher_gets_no_value_and_no_gradient():
    # two rows at λ 1; row 1 has no teacher: teacher_inputs fills it with the student's own values
    z = _leaf([[[0.0, 1.0, 2.0]], [[2.0, 0.0, -1.0]]])
    logp_all = torch.log_softmax(z, -1)
    q_all = torch.log_softmax(torch.tensor([[[2.0, 0.0, 0.0]], [[9.0, 9.0, 9.0]]], dtype=torch.float64), -1)
    ids = rsipo.support_ids(q_all, 2, "teacher")
    t, tail = rsipo.support_logprobs(q_all, ids)
    has = torch.tensor([True, False])
    x = rsipo.teacher_inputs(logp_all[..., 0], has, logp_all=logp_all, ids=ids, support_lp=t, tail=tail)
    loss, _ = rsipo.teacher_loss("topk", logp_all[..., 0], torch.ones(2), torch.ones(2, 1), n_tokens=2, **x)
    loss.backward()
    assert z.grad[1].abs().max() == 0 and z.grad[0].abs().max() > 0
    only0, _ = rsipo.support_kl(x["student_support"][:1], t[:1], torch.ones(1), torch.ones(1, 1), tail[:1])
    assert loss.item() == pytest.approx(only0.item() / 2)
    # the whole vocabulary (Eq. 11d) and the sampled-token estimators fill the same way
    xv = rsipo.teacher_inputs(logp_all[..., 0], has, teacher_logp=q_all[..., 0], logp_all=logp_all, support_lp=q_all)
    assert torch.equal(xv["teacher_support"][1], logp_all[1].detach())
    assert torch.equal(xv["teacher_logp"][1], logp_all[1, :, 0].detach())


def test_support_kl_is_finite_with_minus_inf_teacher_entries_and_padded_rows():
    z = _leaf([[[0.0, 1.0, 2.0], [0.0, 0.0, 0.0]]])               # two positions; the second is padding
    t = torch.tensor([[[-math.inf, -0.2, -2.0], [0.0, 0.0, 0.0]]], dtype=torch.float64)   # padding: zeros
    mask = torch.tensor([[1.0, 0.0]])
    for tail in (None, torch.tensor([[-5.0, 0.0]], dtype=torch.float64)):
        s = torch.log_softmax(z, -1)
        loss, _ = rsipo.support_kl(s, t, torch.tensor([1.0]), mask, teacher_tail=tail)
        (g,) = torch.autograd.grad(loss, z)
        assert math.isfinite(loss.item()) and torch.isfinite(g).all()
        assert g[0, 1].abs().sum() == 0                             # the padded position: no gradient
    # the −inf entry counts as LOGP_FLOOR: student mass p_0 there costs p_0·(log p_0 + 30)
    loss, _ = rsipo.support_kl(torch.log_softmax(z, -1), t, torch.tensor([1.0]), mask)
    p = torch.softmax(torch.tensor([0.0, 1.0, 2.0], dtype=torch.float64), -1)
    tt = torch.tensor([rsipo.LOGP_FLOOR, -0.2, -2.0], dtype=torch.float64)
    assert loss.item() == pytest.approx(float((p * (p.log() - tt)).sum()))


def test_support_kl_refuses_logits_given_for_log_probs():
    logits = torch.tensor([[[2.0, 1.0, 0.5]]])                     # logsumexp 2.46 > 0: not log-probabilities
    lp = torch.log_softmax(logits, -1)
    with pytest.raises(ValueError, match="teacher support log-probs.*not logits"):
        rsipo.support_kl(lp, logits, torch.ones(1), torch.ones(1, 1))
    with pytest.raises(ValueError, match="student support log-probs"):
        rsipo.support_kl(logits, lp, torch.ones(1), torch.ones(1, 1))
    rsipo.support_kl(lp, lp, torch.ones(1), torch.ones(1, 1))    # log-softmax values pass
    # a position outside the mask may hold anything
    rsipo.support_kl(lp, logits, torch.ones(1), torch.zeros(1, 1))


def _inputs(seed=0):
    torch.manual_seed(seed)
    logp = torch.randn(2, 3, dtype=torch.float64) - 2
    teacher = torch.randn(2, 3, dtype=torch.float64) - 2
    sup_s = torch.log_softmax(torch.randn(2, 3, 4, dtype=torch.float64), -1)
    sup_t = torch.log_softmax(torch.randn(2, 3, 6, dtype=torch.float64), -1)
    t_part, t_tail = rsipo.support_logprobs(sup_t, torch.arange(4).repeat(2, 3, 1))
    return logp, dict(teacher_logp=teacher, old_logp=logp, student_support=sup_s, teacher_support=t_part,
                      teacher_tail=t_tail)


def test_trust_scales_each_estimator():
    logp, kw = _inputs()
    mask = torch.ones(2, 3)
    for kind in rsipo.TEACHER_ESTIMATORS:
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
    with pytest.raises(ValueError, match="needs student_support, teacher_support, teacher_tail"):
        rsipo.teacher_loss("topk", x, torch.ones(1), torch.ones(1, 2), teacher_logp=x)
    with pytest.raises(ValueError, match="'negative' needs old_logp"):   # the control is never silently dropped
        rsipo.teacher_loss("negative", x, torch.ones(1), torch.ones(1, 2), teacher_logp=x)
    with pytest.raises(ValueError, match="'gated' needs teacher_logp"):
        rsipo.teacher_loss("gated", x, torch.ones(1), torch.ones(1, 2), old_logp=x)


def test_a_new_estimator_is_one_row_of_the_table(monkeypatch):
    # the table is the one place that says what an estimator reads: a toy one (λ·mean squared gap) computes by
    # name once registered, and its missing input is named
    toy = rsipo.Estimator(lambda x: (rsipo.masked_token_mean(x.trust[:, None] * (x.logp - x.teacher_logp) ** 2,
                                                             x.mask, x.n_tokens), {"opsd/loss": 0.0}),
                          ("teacher_logp",))
    monkeypatch.setitem(rsipo.TEACHER_ESTIMATORS, "toy", toy)
    logp = _leaf([[-1.0, -2.0]])
    loss, _ = rsipo.teacher_loss("toy", logp, torch.tensor([0.5]), torch.ones(1, 2), teacher_logp=torch.zeros(1, 2))
    assert loss.item() == pytest.approx(0.5 * (1 + 4) / 2)
    with pytest.raises(ValueError, match="'toy' needs teacher_logp"):
        rsipo.teacher_loss("toy", logp, torch.ones(1), torch.ones(1, 2))


def test_the_loss_takes_the_teacher_term_computed_by_its_caller():
    # Eq. (12) takes the teacher term as a value (what it needs is the estimator table's business): 16 parameters
    import inspect
    params = inspect.signature(rsipo.rsipo_loss).parameters
    assert len(params) <= 16 and "teacher_term" in params
    assert not {"teacher_logp", "teacher_support", "teacher_kind", "trust", "beta"} & set(params)


def test_gated_term_floors_a_ruled_out_teacher_token():
    # a −inf teacher entry: σ(−inf)·(−inf) would be NaN; raised to −30, the gate is ~0 and the value finite
    logp = _leaf([[-1.0, -0.5]])
    teacher = torch.tensor([[-math.inf, -0.5]], dtype=torch.float64)
    loss, _ = rsipo.opsd_loss(logp, teacher, torch.tensor([1.0]), torch.ones(1, 2), beta=1.0)
    loss.backward()
    want = (1 / (1 + math.exp(29))) * (-29.0) / 2                  # σ(β·(−30 + 1))·(−29), token 1 gives 0
    assert loss.item() == pytest.approx(want) and torch.isfinite(logp.grad).all()


# ---- the teacher-free control (Eq. 11e) ---------------------------------------------------------------------

def test_lowprob_control_pushes_down_only_tokens_below_the_threshold():
    old = torch.tensor([[0.5, 0.1, 0.05]], dtype=torch.float64).log()
    logp = _leaf([[-0.7, -2.3, -3.0]])
    loss, m = rsipo.lowprob_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 3), threshold=0.2)
    assert loss.item() == pytest.approx((-2.3 - 3.0) / 3) and m["opsd/low_frac"] == pytest.approx(2 / 3)
    loss.backward()
    assert logp.grad[0].tolist() == pytest.approx([0.0, 1 / 3, 1 / 3])   # descent lowers the two low tokens


def test_rsipo_loss_adds_alpha_times_the_teacher_term():
    logp, kw = _inputs(1)
    old = logp + 0.1
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    mask = torch.ones(2, 3)
    base, _ = rsipo.rsipo_loss(logp, old, adv, mask, c_kl=0, c_ent=0, alpha=0.5)
    for kind in rsipo.TEACHER_ESTIMATORS:
        term = rsipo.teacher_loss(kind, logp, torch.ones(2), mask, **kw)
        total, m = rsipo.rsipo_loss(logp, old, adv, mask, teacher_term=term, alpha=0.5, c_kl=0, c_ent=0)
        assert float(total) == pytest.approx(float(base) + 0.5 * float(term[0])), kind
        assert m["opsd/loss"] == term[1]["opsd/loss"]
        off, _ = rsipo.rsipo_loss(logp, old, adv, mask, teacher_term=term, alpha=0.0, c_kl=0, c_ent=0)
        assert float(off) == float(base)
