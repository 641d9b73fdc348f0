"""Tests for shrinkage.py (Eq. 3-4, 6-9): hand-derived numbers, the James-Stein reduction, limits.

Run: python -m pytest tests/test_shrinkage.py -q
"""
import math
import os
import sys
import warnings

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from shrinkage import EBResult, calibration, eb_shrink, replay_gain, teacher_trust  # noqa: E402


def phi(x):
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def eq6_map(tau2, g, v):
    """Eq. 6 written out independently of the module: (mu, tau^2 new) at tau2."""
    g, v = np.asarray(g, float), np.asarray(v, float)
    k = g.size
    w = 1.0 / (v + tau2)
    mu = np.sum(w * g) / np.sum(w)
    return mu, max(0.0, np.sum(w * (k / (k - 1) * (g - mu) ** 2 - v)) / np.sum(w))


# ---------------------------------------------------------------- eb_shrink: James-Stein reduction

def test_equal_variances_tau_positive_is_james_stein_hand_numbers():
    # g = [0, .1, .2, .3, .4], v = .01, k = 5: mean 0.2, S = .04+.01+0+.01+.04 = 0.1 > (k-1)v = .04
    # tau^2 = S/(k-1) - v = .025 - .01 = .015; B = (k-3)v/S = 2*.01/.1 = 0.2
    # g^ = .2 + .8(g - .2) = [.04, .12, .2, .28, .36]
    # V = .01(1 - (4/5)(.2)) + (2/2)(.2^2)(g - .2)^2 = .0084 + .04*[.04,.01,0,.01,.04]
    r = eb_shrink([0.0, 0.1, 0.2, 0.3, 0.4], [0.01] * 5)
    assert isinstance(r, EBResult)
    assert r.prior_mean == pytest.approx(0.2, abs=1e-14)
    assert r.prior_var == pytest.approx(0.015, abs=1e-14)
    np.testing.assert_allclose(r.shrink, 0.2, atol=1e-13)
    np.testing.assert_allclose(r.mean, [0.04, 0.12, 0.2, 0.28, 0.36], atol=1e-13)
    np.testing.assert_allclose(r.var, [0.01, 0.0088, 0.0084, 0.0088, 0.01], atol=1e-14)


def test_equal_variances_tau_positive_matches_closed_form_js():
    rng = np.random.default_rng(0)
    for k in (4, 5, 7, 12, 30):
        v = 0.02
        g = rng.normal(0.0, 0.5, k)
        S = np.sum((g - g.mean()) ** 2)
        assert S > (k - 1) * v  # the tau^2 > 0 regime
        B_js = min(1.0, (k - 3) * v / S)  # positive-part James-Stein toward the grand mean
        g_js = g.mean() + (1 - B_js) * (g - g.mean())
        V_js = v * (1 - (k - 1) / k * B_js) + 2 / (k - 3) * B_js**2 * (g - g.mean()) ** 2
        r = eb_shrink(g, np.full(k, v))
        assert r.prior_var == pytest.approx(S / (k - 1) - v, rel=1e-12)
        np.testing.assert_allclose(r.shrink, B_js, rtol=1e-11)
        np.testing.assert_allclose(r.mean, g_js, rtol=1e-11, atol=1e-14)
        np.testing.assert_allclose(r.var, V_js, rtol=1e-11)


def test_equal_variances_tau_zero_regime_is_morris_not_js():
    # Same g, v = .05: S = 0.1 <= (k-1)v = 0.2, so tau^2 = 0 and Eq. 7 gives B = (k-3)/(k-1) = 0.5,
    # while positive-part JS would give min(1, 2*.05/.1) = 1 (full collapse onto the mean).
    # g^ = .2 + .5(g - .2) = [.1, .15, .2, .25, .3];
    # V = .05(1 - .8*.5) + (2/2)(.25)(g - .2)^2 = .03 + .25*[.04, .01, 0, .01, .04]
    g = np.array([0.0, 0.1, 0.2, 0.3, 0.4])
    r = eb_shrink(g, [0.05] * 5)
    assert r.prior_var == 0.0
    assert r.prior_mean == pytest.approx(0.2, abs=1e-14)
    np.testing.assert_allclose(r.shrink, 0.5, atol=1e-14)
    assert not np.allclose(r.shrink, min(1.0, 2 * 0.05 / 0.1))  # differs from positive-part JS
    np.testing.assert_allclose(r.mean, [0.1, 0.15, 0.2, 0.25, 0.3], atol=1e-14)
    np.testing.assert_allclose(r.var, [0.04, 0.0325, 0.03, 0.0325, 0.04], atol=1e-14)


def test_equal_variances_general_form_min_of_cap_and_js():
    # Equal v in both regimes: B = min((k-3)/(k-1), (k-3)v/S).
    g = np.array([0.0, 0.1, 0.2, 0.3, 0.4, 0.7])
    k, S = g.size, np.sum((g - g.mean()) ** 2)
    for v in (0.001, 0.01, S / (k - 1), 0.1, 1.0):
        r = eb_shrink(g, np.full(k, v))
        np.testing.assert_allclose(r.shrink, min((k - 3) / (k - 1), (k - 3) * v / S), rtol=1e-12)


# ---------------------------------------------------------------- eb_shrink: limits

def test_huge_prior_variance_leaves_estimates_alone():
    # spread ~ 1, noise ~ 1e-8: B ~ (k-3)v/S ~ 1e-8, so g^ = g to ~1e-8 and V = v to ~1e-8 relative
    g = np.array([-1.0, -0.5, 0.1, 0.4, 1.0])
    v = np.array([1e-8, 2e-8, 1e-8, 3e-8, 1e-8])
    r = eb_shrink(g, v)
    assert np.all(r.shrink < 1e-7)
    np.testing.assert_allclose(r.mean, g, atol=1e-8)
    np.testing.assert_allclose(r.var, v, rtol=1e-6)


def test_identical_estimates_give_prior_mean():
    # g all 0.3: tau^2 = 0, mu = 0.3, B = (k-3)/(k-1) = 1/3, g^ = 0.3, V = v(1 - (3/4)(1/3)) = 3v/4
    v = np.array([0.01, 0.02, 0.04, 0.08])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no 0/0 on the way
        r = eb_shrink([0.3] * 4, v)
    assert r.prior_var == 0.0
    assert r.prior_mean == pytest.approx(0.3, abs=1e-15)
    np.testing.assert_allclose(r.mean, 0.3, atol=1e-15)
    np.testing.assert_allclose(r.shrink, 1 / 3, atol=1e-15)
    np.testing.assert_allclose(r.var, 0.75 * v, rtol=1e-14)


def test_all_zero_variance_no_division_by_zero():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no division by zero, no 0/0
        r = eb_shrink([0.2] * 5, [0.0] * 5)  # v = 0 and tau^2 = 0: floored denominator, B = 0
    assert r.prior_var == 0.0 and r.prior_mean == pytest.approx(0.2)
    np.testing.assert_array_equal(r.shrink, 0.0)
    np.testing.assert_allclose(r.mean, 0.2)
    np.testing.assert_array_equal(r.var, 0.0)
    # v = 0 but spread: tau^2 = S/(k-1) (all weights equal), B = 0, estimates kept
    g = np.array([0.0, 0.1, 0.2, 0.3, 0.4])
    r = eb_shrink(g, np.zeros(5))
    assert r.prior_var == pytest.approx(0.1 / 4, rel=1e-12)
    np.testing.assert_array_equal(r.shrink, 0.0)
    np.testing.assert_allclose(r.mean, g, atol=1e-15)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_fewer_than_four_values_no_shrinkage(k):
    g = np.array([0.5, -0.2, 0.1][:k])
    v = np.array([0.01, 0.04, 0.02][:k])
    r = eb_shrink(g, v)
    np.testing.assert_array_equal(r.mean, g)
    np.testing.assert_array_equal(r.var, v)
    np.testing.assert_array_equal(r.shrink, np.zeros(k))
    assert r.prior_mean == pytest.approx(g.mean(), abs=1e-15)
    assert r.prior_var == 0.0


def test_shrinkage_increases_with_one_tasks_variance():
    # Raising v_0 lowers (or keeps) tau^2 (Q decreases in each v_q), so v_0/(v_0 + tau^2) rises.
    g = np.array([0.1, -0.3, 0.25, 0.6, -0.1, 0.0])
    v = np.array([0.0, 0.02, 0.01, 0.03, 0.02, 0.05])
    B0 = []
    for v0 in np.geomspace(1e-4, 10.0, 40):
        v[0] = v0
        B0.append(eb_shrink(g, v).shrink[0])
    assert np.all(np.diff(B0) > 0)
    assert B0[-1] == pytest.approx(3 / 5, rel=1e-2)  # approaches the cap (k-3)/(k-1)


# ---------------------------------------------------------------- eb_shrink: unequal v, fixed point

def test_unequal_variances_k4_hand_fixed_point():
    # Built backwards: v = [.01,.01,.03,.03], tau^2 = .01 -> w = [50, 50, 25, 25].
    # g = [.4, .3, .4, 0]: sum w(g - .3) = 50(.1) + 0 + 25(.1) + 25(-.3) = 0 -> mu = 0.3
    #   (the unweighted mean 0.275 would be wrong);
    # Q = sum w(g - mu)^2 = 50(.01) + 0 + 25(.01) + 25(.09) = 3 = k-1 -> Eq. 6 fixed point at .01
    #   (the unweighted moment start is .1075/3 - .02 = .01583, not the answer).
    # B = (1/3) v/(v + .01) = [1/6, 1/6, 1/4, 1/4]
    # g^ = .3 + (1-B)(g-.3) = [.3 + (5/6)(.1), .3, .3 + .75(.1), .3 - .75(.3)]
    # V = v(1 - (3/4)B) + 2 B^2 (g-.3)^2:
    #   [.00875 + 2(1/36)(.01), .00875, .024375 + 2(1/16)(.01), .024375 + 2(1/16)(.09)]
    g, v = [0.4, 0.3, 0.4, 0.0], [0.01, 0.01, 0.03, 0.03]
    r = eb_shrink(g, v)
    assert r.prior_var == pytest.approx(0.01, rel=1e-12)
    assert r.prior_mean == pytest.approx(0.3, abs=1e-14)
    mu, tau2 = eq6_map(r.prior_var, g, v)  # the fixed-point equation holds
    assert tau2 == pytest.approx(r.prior_var, rel=1e-12)
    assert mu == pytest.approx(r.prior_mean, abs=1e-14)
    np.testing.assert_allclose(r.shrink, [1 / 6, 1 / 6, 1 / 4, 1 / 4], rtol=1e-12)
    np.testing.assert_allclose(r.mean, [0.3 + 0.5 / 6, 0.3, 0.375, 0.075], atol=1e-13)
    V = [0.00875 + 0.02 / 36, 0.00875, 0.025625, 0.035625]
    np.testing.assert_allclose(r.var, V, rtol=1e-12)


def test_unequal_variances_k4_tau_zero_weighted_mean():
    # g = [0,0,0,.1], v = [.01,.01,.01,.04]: at tau^2 = 0, w = [100,100,100,25],
    # mu = 2.5/325 = 1/130,
    # Q(0) = 300/130^2 + 25(.1 - 1/130)^2 = 0.231 < 3 -> tau^2 = 0 is the fixed point; B = 1/3.
    g, v = [0.0, 0.0, 0.0, 0.1], [0.01, 0.01, 0.01, 0.04]
    r = eb_shrink(g, v)
    assert r.prior_var == 0.0
    assert r.prior_mean == pytest.approx(1 / 130, abs=1e-15)
    assert eq6_map(0.0, g, v)[1] == 0.0
    mu = 1 / 130
    np.testing.assert_allclose(r.shrink, 1 / 3, atol=1e-15)
    np.testing.assert_allclose(r.mean, mu + (2 / 3) * (np.array(g) - mu), atol=1e-15)
    V = np.array(v) * 0.75 + 2 * (1 / 9) * (np.array(g) - mu) ** 2
    np.testing.assert_allclose(r.var, V, rtol=1e-13)


def test_fixed_point_holds_on_random_inputs():
    # Including cases where plain repetition of the Eq. 6 map 2-cycles (some v = 0) or crawls.
    rng = np.random.default_rng(1)
    for _ in range(300):
        k = int(rng.integers(4, 25))
        v = np.exp(rng.uniform(-12, 1, k)) * (rng.random(k) > 0.1)
        g = rng.normal(0.0, np.exp(rng.uniform(-5, 0)), k) + rng.normal(0.0, np.sqrt(v))
        r = eb_shrink(g, v)
        assert np.all(np.isfinite(r.mean)) and np.all(r.var >= 0)
        assert np.all((r.shrink >= 0) & (r.shrink <= (k - 3) / (k - 1) + 1e-15))
        if r.prior_var > 0:
            mu, tau2 = eq6_map(r.prior_var, g, v)
            assert tau2 == pytest.approx(r.prior_var, rel=1e-9)
            assert mu == pytest.approx(r.prior_mean, rel=1e-9, abs=1e-12)
            w = 1 / (v + r.prior_var)
            assert np.sum(w * (g - mu) ** 2) == pytest.approx(k - 1, rel=1e-9)


# ---------------------------------------------------------------- eb_shrink: bad input

@pytest.mark.parametrize(
    "g, v, match",
    [
        ([0.1, 0.2], [0.01], "differ in length"),
        ([0.1, float("nan"), 0.0, 0.2], [0.01] * 4, "estimates must be finite"),
        ([0.1, 0.2, 0.0, 0.2], [0.01, float("inf"), 0.01, 0.01], "variances must be finite"),
        ([0.1, 0.2, 0.0, 0.2], [0.01, -0.01, 0.01, 0.01], "variances must be >= 0"),
        ([[0.1, 0.2]], [[0.01, 0.01]], "1-D"),
        ([], [], "at least one"),
    ],
)
def test_eb_shrink_bad_input(g, v, match):
    with pytest.raises(ValueError, match=match):
        eb_shrink(g, v)


# ---------------------------------------------------------------- teacher_trust (Eq. 9)

def test_trust_raw_mode_hand_values():
    # Phi(.196/.1) = Phi(1.96) = 0.97500; Phi(0) = 0.5; Phi(-.1/.1) = Phi(-1) = 0.158655
    trust, info = teacher_trust([0.196, 0.0, -0.1], [0.01, 0.04, 0.01], ["a", "a", "b"], mode="raw")
    np.testing.assert_allclose(trust, [0.9750021048517795, 0.5, 0.15865525393145707], rtol=1e-12)
    np.testing.assert_array_equal(info["mean"], [0.196, 0.0, -0.1])
    np.testing.assert_array_equal(info["shrink"], 0.0)
    assert info["prior_mean"] == {} and info["pooled"] == []


def test_trust_zero_variance_edge_cases():
    trust, _ = teacher_trust([0.3, -0.3, 0.0], [0.0, 0.0, 0.0], ["a", "b", "c"], mode="raw")
    np.testing.assert_array_equal(trust, [1.0, 0.0, 0.5])
    trust, _ = teacher_trust([1e-12], [1e-300], ["a"], mode="raw")  # huge ratio, no overflow error
    assert trust[0] == 1.0


def test_trust_one_mode():
    trust, info = teacher_trust([-0.5, 0.2, 0.0], [0.01, 0.02, 0.0], ["a", "b", "b"], mode="one")
    np.testing.assert_array_equal(trust, [1.0, 1.0, 1.0])
    np.testing.assert_array_equal(info["var"], [0.01, 0.02, 0.0])


def test_trust_eb_per_type_and_pooling():
    # "pick": the JS hand example (5 tasks, own fit): g^ = [.04,.12,.2,.28,.36],
    #   V = [.01,.0088,.0084,.0088,.01] -> lambda_0 = Phi(.04/.1) = Phi(0.4) = 0.655422.
    # "heat": 2 tasks < min_group -> posterior from one fit over all 7 tasks.
    g_pick, v_pick = [0.0, 0.1, 0.2, 0.3, 0.4], [0.01] * 5
    g_heat, v_heat = [0.9, -0.6], [0.05, 0.02]
    g = [g_pick[0], g_heat[0]] + g_pick[1:] + [g_heat[1]]  # interleaved types
    v = [v_pick[0], v_heat[0]] + v_pick[1:] + [v_heat[1]]
    types = ["pick", "heat", "pick", "pick", "pick", "pick", "heat"]
    trust, info = teacher_trust(g, v, types, mode="eb")
    pick, heat = [0, 2, 3, 4, 5], [1, 6]
    np.testing.assert_allclose(info["mean"][pick], [0.04, 0.12, 0.2, 0.28, 0.36], atol=1e-13)
    np.testing.assert_allclose(info["var"][pick], [0.01, 0.0088, 0.0084, 0.0088, 0.01], atol=1e-14)
    assert trust[0] == pytest.approx(0.6554217416103242, rel=1e-12)
    np.testing.assert_allclose(
        trust[pick], [phi(m / math.sqrt(s)) for m, s in zip(info["mean"][pick], info["var"][pick])],
        rtol=1e-13)
    assert info["prior_mean"]["pick"] == pytest.approx(0.2, abs=1e-14)
    assert info["prior_var"]["pick"] == pytest.approx(0.015, abs=1e-14)
    pooled = eb_shrink(g, v)  # all 7 tasks, all types
    np.testing.assert_allclose(info["mean"][heat], pooled.mean[heat], rtol=1e-14)
    np.testing.assert_allclose(info["var"][heat], pooled.var[heat], rtol=1e-14)
    np.testing.assert_allclose(info["shrink"][heat], pooled.shrink[heat], rtol=1e-14)
    assert np.all(pooled.shrink[heat] > 0)  # the pooled fit really shrinks them
    assert not np.allclose(info["mean"][heat], eb_shrink(g_heat, v_heat).mean)  # not a 2-task fit
    assert info["prior_mean"]["heat"] == pooled.prior_mean
    assert info["prior_var"]["heat"] == pooled.prior_var
    assert info["pooled"] == ["heat"]
    np.testing.assert_allclose(
        trust[heat], [phi(m / math.sqrt(s)) for m, s in zip(pooled.mean[heat], pooled.var[heat])],
        rtol=1e-13)


def test_trust_eb_small_batch_is_raw():
    # 3 tasks in all: the pooled fit has k < 4, so nothing is shrunk and eb equals raw.
    g, v, t = [0.3, -0.1, 0.05], [0.02, 0.01, 0.03], ["a", "b", "a"]
    eb, info = teacher_trust(g, v, t, mode="eb")
    raw, _ = teacher_trust(g, v, t, mode="raw")
    np.testing.assert_array_equal(eb, raw)
    assert sorted(info["pooled"]) == ["a", "b"]
    assert info["prior_var"] == {"a": 0.0, "b": 0.0}


def test_trust_min_group_threshold():
    # 4 tasks of "a" + 4 of "b", min_group 5: both types pooled into one 8-task fit.
    g = [0.1, 0.3, -0.2, 0.5, 0.0, 0.2, 0.4, -0.1]
    v = [0.01, 0.02, 0.01, 0.03, 0.02, 0.01, 0.02, 0.01]
    t = ["a"] * 4 + ["b"] * 4
    _, info = teacher_trust(g, v, t, min_group=5)
    np.testing.assert_allclose(info["mean"], eb_shrink(g, v).mean, rtol=1e-14)
    _, info = teacher_trust(g, v, t, min_group=4)  # each type on its own
    np.testing.assert_allclose(info["mean"][:4], eb_shrink(g[:4], v[:4]).mean, rtol=1e-14)
    np.testing.assert_allclose(info["mean"][4:], eb_shrink(g[4:], v[4:]).mean, rtol=1e-14)
    assert info["pooled"] == []


def test_trust_empty_batch():
    trust, info = teacher_trust([], [], [], mode="eb")
    assert trust.shape == (0,) and info["mean"].shape == (0,)


def test_trust_bad_input():
    with pytest.raises(ValueError, match="unknown trust mode"):
        teacher_trust([0.1], [0.01], ["a"], mode="shrunk")
    with pytest.raises(ValueError, match="task_types"):
        teacher_trust([0.1, 0.2], [0.01, 0.01], ["a"])
    with pytest.raises(ValueError, match="min_group"):
        teacher_trust([0.1], [0.01], ["a"], min_group=3)
    with pytest.raises(ValueError, match="variances must be >= 0"):
        teacher_trust([0.1], [-0.01], ["a"])


# ---------------------------------------------------------------- replay_gain (Eq. 3-4)

def test_replay_gain_hand_numbers():
    # r_win = 10: replay [1,1,0,0] (M=4), control [0,0,0,1,0,0,0,0] (N=8)
    # g = 0.5 - 0.125 = 0.375
    # p_T = (2 + .5)/5 = .5 -> .25/4 = .0625;  p_C = (1 + .5)/9 = 1/6 -> (5/36)/8 = 5/288
    g, v = replay_gain([10, 10, 0, 0], [0, 0, 0, 10, 0, 0, 0, 0], r_win=10)
    assert g == pytest.approx(0.375, abs=1e-15)
    assert v == pytest.approx(0.0625 + 5 / 288, rel=1e-14)


def test_replay_gain_all_fail_has_positive_variance():
    # k = 0 everywhere: p = .5/(n+1) -> v = (1/10)(9/10)/4 + (1/18)(17/18)/8 > 0, g = 0
    g, v = replay_gain([0, 0, 0, 0], [0] * 8, r_win=1.0)
    assert g == 0.0
    assert v == pytest.approx(0.09 / 4 + (17 / 324) / 8, rel=1e-14)


def test_replay_gain_clips_counts_not_gain():
    # r/r_win = [1.2, -0.1] vs [0.5, 0.5]: g = 0.55 - 0.5 = 0.05 (unclipped);
    # counts: replay clip -> [1, 0], k = 1, p = 1.5/3 = .5 -> .25/2; control k = 1, p = .5 -> .25/2
    g, v = replay_gain([12.0, -1.0], [5.0, 5.0], r_win=10.0)
    assert g == pytest.approx(0.05, abs=1e-15)
    assert v == pytest.approx(0.25, rel=1e-14)


@pytest.mark.parametrize(
    "rep, ctl, r_win, match",
    [
        ([1.0], [0.0], 0.0, "r_win"),
        ([1.0], [0.0], float("nan"), "r_win"),
        ([], [0.0], 1.0, "replay_rewards"),
        ([1.0], [], 1.0, "control_rewards"),
        ([float("inf")], [0.0], 1.0, "finite"),
    ],
)
def test_replay_gain_bad_input(rep, ctl, r_win, match):
    with pytest.raises(ValueError, match=match):
        replay_gain(rep, ctl, r_win)


def test_replay_informative_only_when_outcomes_differ():
    from shrinkage import replay_informative
    assert not replay_informative([0.0, 0.0], [0.0, 0.0, 0.0])      # all lost: g = 0 whatever the skill says
    assert not replay_informative([10.0], [10.0, 10.0])             # all won
    assert replay_informative([10.0, 0.0], [0.0, 0.0])              # the replay won once
    assert replay_informative([0.0], [10.0, 0.0])                   # g = -0.5: evidence against the skill
    assert replay_informative([10.0, 10.0], [0.0, 0.0])             # all won vs all lost: the clearest evidence


def test_calibration_hand_numbers():
    # lambda = [0.9, 0.7, 0.2, 0.5], fresh gains [+0.5, -0.25, 0, -0.5] -> y = [1, 0, 1/2, 0]
    # Brier = (0.1^2 + 0.7^2 + 0.3^2 + 0.5^2) / 4 = (0.01 + 0.49 + 0.09 + 0.25) / 4 = 0.21
    # mean y = 3/8; base = ((5/8)^2 + (3/8)^2 + (1/8)^2 + (3/8)^2) / 4 = (25 + 9 + 1 + 9) / 256 = 44/256
    c = calibration([0.9, 0.7, 0.2, 0.5], [0.5, -0.25, 0.0, -0.5], n_bins=2)
    assert c["n"] == 4 and c["ties"] == 1
    assert c["brier"] == pytest.approx(0.21)
    assert c["base_brier"] == pytest.approx(44 / 256)
    assert c["brier_decided"] == pytest.approx((0.01 + 0.49 + 0.25) / 3)   # the tie (lambda 0.2) left out
    # bins [0, .5): lambda 0.2 only; [.5, 1]: 0.9, 0.7, 0.5 -> mean 0.7, y mean 1/3, gain mean -0.25/3
    lo, hi = c["bins"]
    assert (lo["n"], lo["trust"], lo["helped"], lo["gain"]) == (1, pytest.approx(0.2), 0.5, 0.0)
    assert (hi["n"], hi["trust"], hi["helped"]) == (3, pytest.approx(0.7), pytest.approx(1 / 3))
    assert hi["gain"] == pytest.approx(-0.25 / 3)


def test_calibration_perfect_forecast_and_edges():
    # lambda equal to the realised outcome: Brier 0; lambda = 1 falls in the top bin, 0 in the bottom one
    c = calibration([1.0, 0.0, 1.0], [0.5, -1.0, 0.25], n_bins=4)
    assert c["brier"] == 0.0 and [b["n"] for b in c["bins"]] == [1, 2]
    assert calibration([], [])["brier"] is None


@pytest.mark.parametrize("lam,d,match", [([0.5], [0.1, 0.2], "one length"), ([1.5], [0.1], r"\[0, 1\]"),
                                         ([0.5], [float("nan")], "finite")])
def test_calibration_bad_input(lam, d, match):
    with pytest.raises(ValueError, match=match):
        calibration(lam, d)


def test_an_uninformative_replay_gets_no_trust_but_stays_in_the_fit():
    g, v, types = [0.5, 0.0, -0.25, 0.25, 0.0], [0.05, 0.04, 0.05, 0.06, 0.04], ["a"] * 5
    informative = [True, False, True, True, True]
    lam, info = teacher_trust(g, v, types, informative=informative)
    base, base_info = teacher_trust(g, v, types)
    assert lam[1] == 0.0 and base[1] > 0                                  # Φ(ĝ/√V) > 0 would trust any text
    assert np.array_equal(np.delete(lam, 1), np.delete(base, 1))           # the others, as without the rule
    assert np.array_equal(info["mean"], base_info["mean"])                 # its g = 0 still entered the fit
    one, _ = teacher_trust(g, v, types, mode="one", informative=informative)
    assert one.tolist() == [1.0, 0.0, 1.0, 1.0, 1.0]
