"""Empirical-Bayes trust in the teacher: RSIPO Eq. 3-4 and 6-9 (METHOD.md §2.4, §2.6).

What this file implements (numpy + stdlib only)
  replay_gain(replay_rewards, control_rewards, r_win) -> (g, v)            Eq. 3-4
      g = mean(replay)/r_win - mean(control)/r_win; v = p_T(1-p_T)/M + p_C(1-p_C)/N
      with smoothed win rates p = (k + 1/2)/(n + 1) (the Jeffreys posterior mean).
  replay_informative(replay_rewards, control_rewards) -> bool              choice 7
  eb_shrink(estimates, variances) -> EBResult                              Eq. 6-8
      Morris (1983, JASA 78:47-55) parametric empirical Bayes for g_q ~ N(theta_q, v_q),
      theta_q ~ N(mu, tau^2), exactly as METHOD.md §2.6 writes it:
        w_q = 1/(v_q + tau^2);  mu = sum(w g)/sum(w)
        tau^2 = max(0, sum w_q[(k/(k-1))(g_q - mu)^2 - v_q] / sum w_q), at its fixed point  (6)
        B_q = min(1, ((k-3)/(k-1)) v_q/(v_q + tau^2))                                         (7)
        g^_q = mu + (1 - B_q)(g_q - mu)                                                        (8)
        V_q = v_q(1 - ((k-1)/k)B_q) + (2/(k-3)) B_q^2 (g_q - mu)^2                             (8)
      With k < 4 values there is nothing to shrink toward: g^ = g, V = v, B = 0.
  teacher_trust(gains, variances, task_types, mode) -> (trust, info)       Eq. 9
      lambda_q = Phi(g^_q / sqrt(V_q)), the posterior probability that the skill helps.
      mode "eb" (shrink per task type), "raw" (Phi(g/sqrt(v)), no shrinkage), "one" (lambda = 1).
  calibration(trust, fresh_gains, n_bins) -> dict                          [ours], METHOD.md §5.7
      lambda held against a fresh, independent replay of the same skill: outcome y = 1 if the
      fresh gain is > 0, 0 if < 0, 1/2 if = 0; Brier = mean (lambda - y)^2; reliability bins.

Choices that are ours, not the paper's (**[ours]**)
  1. Pooling: a task type with >= min_group (default 4) tasks is fit on its own tasks. Every task of
     a type with fewer than min_group tasks takes its posterior from ONE fit over the whole batch
     (all tasks of all types, the large types' tasks included); that type's prior in `info` is the
     pooled (mu, tau^2). If the whole batch has < 4 tasks, that fit is "no shrinkage".
     min_group < 4 is refused (Eq. 7 needs k >= 4; smaller groups would silently not shrink).
  2. Trust map lambda = Phi(g^/sqrt(V)) ([ours], METHOD.md §5). V = 0 gives 1 if g^ > 0,
     0 if g^ < 0, 1/2 if g^ = 0 (the limit of Phi, and 1/2 for no information on the sign).
  3. Solving Eq. 6: the fixed point is the one of the Eq. 6 map, but it is found with Newton steps,
     not by repeating the map. For tau^2 > 0 the map's fixed point is exactly the root of
     Q(tau^2) = sum w_q (g_q - mu)^2 = k - 1 (multiply Eq. 6 by sum w; this is the Paule-Mandel
     equation), and Q is convex and decreasing in tau^2 (partial minimum over mu of a jointly convex
     quadratic-over-linear), so Newton from the unweighted moment start lands left of the root
     after one step and then rises monotonically to it. tau^2 = 0 is taken exactly when it is
     itself a fixed point of the map (then it is the only one). Repeating the map does not always
     converge: on random inputs it oscillates (e.g. the 2-cycle 0 <-> a when some v_q = 0).
  4. v_q + tau^2 is floored at 1e-12 (`_EPS`) wherever it is divided by, so v = 0 with tau^2 = 0
     gives finite weights (a task with v = 0 has B = 0; if also tau^2 = 0 it dominates mu).
     Gains live on [-1, 1], so the floor only acts on degenerate inputs.
  5. k < 4: prior_mean is the plain mean and prior_var is 0 (reported for logging only).
  6. replay_gain: the win count is k = sum(clip(r / r_win, 0, 1)) (a fractional reward, e.g. F1,
     counts fractionally; a format penalty cannot make it negative). g uses the unclipped r / r_win.
  7. replay_informative: when every replay and every control episode has the same reward (all won or
     all lost), g = 0 by construction whatever the skill says, and lambda = Phi(0) = 1/2 would hand half
     trust to any parseable text (junk included). The trainer gives such tasks no teacher signal
     (lambda = 0); their g = 0 still enters Eq. 5 and the type's prior (it is a measured outcome).

Note on James-Stein (METHOD.md §2.6: "exactly James-Stein", and what it means here)
  With equal v the fixed point is mu = mean(g), tau^2 = max(0, S/(k-1) - v), S = sum (g - mean g)^2.
  * tau^2 > 0 (S > (k-1)v): B = (k-3)v/S exactly, the positive-part James-Stein factor (its
    positive part never binds here since B < (k-3)/(k-1) < 1). The reduction is exact.
  * tau^2 = 0 (S <= (k-1)v): Eq. 7 gives B = (k-3)/(k-1), while positive-part JS would give
    min(1, (k-3)v/S) >= (k-3)/(k-1). Here Morris shrinks LESS than JS.
  In both regimes, with equal v: B = min((k-3)/(k-1), (k-3)v/S).
  We follow Morris's formulas (METHOD.md §2.6) literally in both regimes; the min(1, .) in Eq. 7 therefore
  never binds (B <= (k-3)/(k-1) always), and g^ never collapses fully onto mu.
  Both regimes are tested.

Test: python -m pytest tests/test_shrinkage.py -q
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np

_EPS = 1e-12  # [ours] floor on v_q + tau^2 wherever it is a divisor (choice 4)


@dataclass
class EBResult:
    """Posterior of eb_shrink; arrays are (k,) in input order."""

    mean: np.ndarray  # (k,) posterior means g^_q, Eq. 8
    var: np.ndarray  # (k,) posterior variances V_q, Eq. 8
    shrink: np.ndarray  # (k,) shrinkage factors B_q, Eq. 7
    prior_mean: float  # mu, Eq. 6
    prior_var: float  # tau^2, Eq. 6


def _as_pair(estimates, variances) -> tuple[np.ndarray, np.ndarray]:
    g = np.asarray(estimates, dtype=np.float64)
    v = np.asarray(variances, dtype=np.float64)
    if g.ndim != 1 or v.ndim != 1:
        raise ValueError(f"estimates and variances must be 1-D, got shapes {g.shape} and {v.shape}")
    if g.shape != v.shape:
        raise ValueError(f"estimates and variances differ in length: {g.size} vs {v.size}")
    if not np.all(np.isfinite(g)):
        raise ValueError("estimates must be finite (found NaN or inf)")
    if not np.all(np.isfinite(v)):
        raise ValueError("variances must be finite (found NaN or inf)")
    if np.any(v < 0):
        raise ValueError(f"variances must be >= 0, got min {v.min()}")
    return g, v


def _eq6_map(tau2: float, g: np.ndarray, v: np.ndarray) -> tuple[float, float]:
    """One application of Eq. 6 at tau2: returns (mu, tau^2 new)."""
    k = g.size
    w = 1.0 / np.maximum(v + tau2, _EPS)  # (k,)  Eq. (6)
    mu = float(w @ g / w.sum())  # Eq. (6)
    return mu, max(0.0, float(w @ (k / (k - 1) * (g - mu) ** 2 - v) / w.sum()))  # Eq. (6)


def _solve_tau2(g: np.ndarray, v: np.ndarray, max_iter: int, tol: float) -> float:
    """Fixed point of the Eq. 6 map (choice 3 in the module docstring)."""
    k = g.size
    if _eq6_map(0.0, g, v)[1] == 0.0:
        return 0.0  # tau^2 = 0 is a fixed point, hence Q(0) <= k-1 and there is no positive one
    tau2 = max(0.0, float(np.var(g, ddof=1) - v.mean()))  # unweighted moment start
    for _ in range(max_iter):
        w = 1.0 / np.maximum(v + tau2, _EPS)  # (k,)
        r = w * (g - w @ g / w.sum()) ** 2  # (k,) terms of Q(tau^2); -Q'(tau^2) = sum w r
        new = max(0.0, float(tau2 + (r.sum() - (k - 1)) / (w @ r)))  # Newton on Q(tau^2) = k-1
        if abs(new - tau2) <= tol * max(new, _EPS):
            return new
        tau2 = new
    warnings.warn(f"eb_shrink: tau^2 not converged in {max_iter} steps (last {tau2:.3e})")
    return tau2


def eb_shrink(estimates, variances, max_iter: int = 200, tol: float = 1e-12) -> EBResult:
    """Morris parametric EB shrinkage of k noisy estimates toward their precision-weighted mean.

    estimates: (k,) g_q; variances: (k,) sampling variances v_q >= 0. tol is relative on tau^2.
    """
    g, v = _as_pair(estimates, variances)
    k = g.size
    if k == 0:
        raise ValueError("eb_shrink needs at least one estimate")
    if k < 4:  # nothing to shrink toward (choice 5)
        return EBResult(g.copy(), v.copy(), np.zeros(k), float(g.mean()), 0.0)
    tau2 = _solve_tau2(g, v, max_iter, tol)
    mu, _ = _eq6_map(tau2, g, v)
    B = np.minimum(1.0, (k - 3) / (k - 1) * v / np.maximum(v + tau2, _EPS))  # (k,)  Eq. (7)
    mean = mu + (1.0 - B) * (g - mu)  # (k,)  Eq. (8)
    var = v * (1.0 - (k - 1) / k * B) + 2.0 / (k - 3) * B**2 * (g - mu) ** 2  # (k,)  Eq. (8)
    return EBResult(mean, var, B, mu, tau2)


def _phi_ratio(m: np.ndarray, V: np.ndarray) -> np.ndarray:
    """Phi(m / sqrt(V)) elementwise; V = 0 -> 1, 0 or 1/2 by the sign of m (choice 2)."""
    out = [0.5 * (1.0 + math.erf(mi / math.sqrt(2.0 * Vi))) if Vi > 0 else 0.5 * (1.0 + np.sign(mi))
           for mi, Vi in zip(m.tolist(), V.tolist())]
    return np.asarray(out, dtype=np.float64)


def teacher_trust(gains, variances, task_types, mode: str = "eb", min_group: int = 4, informative=None):
    """Teacher trust lambda_q per task, Eq. 9.

    gains, variances: (B,) replay gains g_q and their variances v_q (Eq. 3-4); task_types: B
    hashable labels c(q). informative: (B,) bools, `replay_informative` of each task's replay, or None (all
    informative). [ours] A task whose replays and control all won, or all lost, gets lambda 0: its g = 0 says
    nothing about the skill, and Eq. 9 would hand lambda = 1/2 to any parseable text (its g still enters the
    fit, a measured outcome). Returns (trust (B,), info) with info keys:
      "mean", "var", "shrink": (B,) arrays g^_q, V_q, B_q actually used (raw g, v, 0 for raw/one);
      "prior_mean", "prior_var": {type: mu}, {type: tau^2} of the fit each type used
          (pooled fit for pooled types; {} for raw/one);
      "pooled": list of types that took the pooled whole-batch fit (choice 1).
    """
    g, v = _as_pair(gains, variances)
    types = list(task_types)
    if len(types) != g.size:
        raise ValueError(f"task_types has {len(types)} entries for {g.size} gains")
    if mode not in ("eb", "raw", "one"):
        raise ValueError(f"unknown trust mode {mode!r}; expected 'eb', 'raw' or 'one'")
    if min_group < 4:
        raise ValueError(f"min_group must be >= 4 (Eq. 7 needs k >= 4), got {min_group}")
    mean, var, B = g.copy(), v.copy(), np.zeros(g.size)  # (B,) each
    info = {"mean": mean, "var": var, "shrink": B, "prior_mean": {}, "prior_var": {}, "pooled": []}
    if mode == "eb" and g.size:
        groups: dict = {}
        for i, c in enumerate(types):
            groups.setdefault(c, []).append(i)
        small = [c for c, idx in groups.items() if len(idx) < min_group]
        pooled = eb_shrink(g, v) if small else None  # all tasks of all types, one group
        for c, idx in groups.items():
            fit, sel = (pooled, idx) if c in small else (eb_shrink(g[idx], v[idx]), slice(None))
            mean[idx], var[idx], B[idx] = fit.mean[sel], fit.var[sel], fit.shrink[sel]
            info["prior_mean"][c], info["prior_var"][c] = fit.prior_mean, fit.prior_var
        info["pooled"] = small
    trust = _phi_ratio(mean, var) if mode != "one" else np.ones(g.size)  # (B,)  Eq. (9)
    if informative is not None:
        trust = np.where(np.asarray(informative, dtype=bool), trust, 0.0)  # [ours] no evidence about the skill
    return trust, info


def replay_gain(replay_rewards, control_rewards, r_win: float) -> tuple[float, float]:
    """Replay gain g (Eq. 3) and its sampling variance v (Eq. 4) for one task.

    replay_rewards: (M,) episode rewards with the skill; control_rewards: (N,) without it.
    """
    if not (math.isfinite(r_win) and r_win > 0):
        raise ValueError(f"r_win must be a finite positive number, got {r_win}")
    xs = []
    for name, r in (("replay_rewards", replay_rewards), ("control_rewards", control_rewards)):
        x = np.asarray(r, dtype=np.float64) / r_win  # (M,) or (N,), rewards in win units
        if x.ndim != 1 or x.size == 0:
            raise ValueError(f"{name} must be a non-empty 1-D sequence, got shape {x.shape}")
        if not np.all(np.isfinite(x)):
            raise ValueError(f"{name} must be finite (found NaN or inf)")
        xs.append(x)
    x_t, x_c = xs
    g = float(x_t.mean() - x_c.mean())  # Eq. (3)
    p_t = (np.clip(x_t, 0.0, 1.0).sum() + 0.5) / (x_t.size + 1)  # smoothed win rate (choice 6)
    p_c = (np.clip(x_c, 0.0, 1.0).sum() + 0.5) / (x_c.size + 1)  # smoothed control win rate
    v = float(p_t * (1 - p_t) / x_t.size + p_c * (1 - p_c) / x_c.size)  # Eq. (4)
    return g, v


def replay_informative(replay_rewards, control_rewards) -> bool:
    """False when the replays and the control all have one and the same reward (all won or all lost):
    the replay then says nothing about the skill (choice 7)."""
    return len(set(map(float, replay_rewards)) | set(map(float, control_rewards))) > 1


def calibration(trust, fresh_gains, n_bins: int = 5) -> dict:
    """[ours] How well the trust lambda_q (the posterior probability that the skill helps, Eq. 9) predicts
    a fresh, independent replay of the same skill against fresh skill-free control episodes.

    trust: (B,) lambda_q in [0, 1]; fresh_gains: (B,) the fresh replays' win-rate differences (Eq. 3 on
    the new episodes). The outcome is y_q = 1 if the fresh gain is > 0, 0 if < 0 and 1/2 on a tie (the
    fresh replay does not tell the sign). Returns
      "n", "ties": tasks and ties; "brier": mean (lambda - y)^2 (0 is perfect; 1/4 for lambda = 1/2
      everywhere); "base_brier": the Brier score of the constant forecast mean(y) (what lambda must beat
      to carry information); "brier_decided": the Brier score over the tasks without a tie; "bins": per
      equal-width lambda bin with tasks, [lo, hi), n, mean lambda, mean y ("helped"), mean fresh gain.
    A calibrated lambda has mean y close to mean lambda in every bin. Even then y is noisy: a fresh replay
    of M episodes sees the sign of the true gain only with some probability.
    """
    lam = np.asarray(trust, dtype=np.float64)
    d = np.asarray(fresh_gains, dtype=np.float64)
    if lam.shape != d.shape or lam.ndim != 1:
        raise ValueError(f"trust and fresh_gains must be 1-D of one length, got {lam.shape} and {d.shape}")
    if not (np.all(np.isfinite(lam)) and np.all(np.isfinite(d))):
        raise ValueError("trust and fresh_gains must be finite (found NaN or inf)")
    if np.any((lam < 0) | (lam > 1)):
        raise ValueError("trust must lie in [0, 1]")
    if n_bins < 1:
        raise ValueError(f"n_bins must be >= 1, got {n_bins}")
    y = np.where(d > 0, 1.0, np.where(d < 0, 0.0, 0.5))   # (B,)
    out = {"n": int(lam.size), "ties": int((d == 0).sum()), "brier": None, "base_brier": None,
           "brier_decided": None, "bins": []}
    if not lam.size:
        return out
    out["brier"] = float(np.mean((lam - y) ** 2))
    out["base_brier"] = float(np.mean((y.mean() - y) ** 2))
    if (d != 0).any():
        out["brier_decided"] = float(np.mean((lam[d != 0] - y[d != 0]) ** 2))
    which = np.minimum((lam * n_bins).astype(int), n_bins - 1)   # lambda = 1 falls in the top bin
    for j in range(n_bins):
        sel = which == j
        if sel.any():
            out["bins"].append({"lo": j / n_bins, "hi": (j + 1) / n_bins, "n": int(sel.sum()),
                                "trust": float(lam[sel].mean()), "helped": float(y[sel].mean()),
                                "gain": float(d[sel].mean())})
    return out
