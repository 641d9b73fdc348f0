"""RSIPO advantages and losses: Eq. (1), (5), (10)-(12) as pure tensor functions.

Contract
--------
Everything here is a pure function of tensors (no modules, no optimiser, no distributed code,
no hyperparameter defaults read from anywhere but the call). Loss functions return
``(loss, metrics)``: ``loss`` is a scalar tensor carrying the graph, ``metrics`` a dict of
detached python floats. Shapes: B samples (one sample = one turn's response, or one skill-writing
response), L response tokens, V vocabulary, T turn-samples, K tasks.

Implemented (equation numbers are the ones in METHOD.md §2):

* ``turn_scores``        s_{i,t} = R_i − p_fmt·invalid_{i,t}                              (step 1)
* ``group_advantages``   A_{i,t} = (s_{i,t} − mean_q s) / (std_q s + stabilizer)                 (Eq. 1)
* ``token_logprobs`` / ``entropy_from_logits``   ℓ = log π(y_t | ·) and H, both in fp32
  (``logprobs_and_entropy``: both from one log-softmax)
* ``masked_token_mean``  TokenMean[x] = Σ x·mask / n_tokens
* ``policy_loss``        L_PG = −TokenMean[min(ρA, clip(ρ, 1−ε, 1+ε)A)], ρ = exp(ℓ − ℓ_old) (Eq. 10)
* ``kl_k3``              KL_k3(π_θ‖π_ref) = TokenMean[exp(ℓ_ref − ℓ) − (ℓ_ref − ℓ) − 1]
* ``skill_advantages``   A^skill_q = g_q − mean{g_q' : c(q') = c(q)}                       (Eq. 5)
* ``opsd_loss``          L_OPSD = TokenMean[λ_q · σ(β·sg(ℓ^T − ℓ)) · (ℓ^T − ℓ)]            (Eq. 11)
* the teacher term's other estimators **[ours]** (METHOD.md §2.8.1), each multiplied by λ_q like Eq. (11):
  ``signed_teacher_loss``  gradient λ·clip(ℓ − ℓ^T, ±c)·∇ℓ: on-policy distillation's advantage
                           −(ℓ − ℓ^T) (Eq. 11b)
  ``support_kl``           reverse KL(π_θ‖π_T) over a top-K support and one tail bucket (Eq. 11c), or over
                           the whole vocabulary (Eq. 11d)
  ``lowprob_loss``         the teacher-free control: advantage −1 on the tokens π_old gave less than τ (Eq. 11e)
* the support of Eq. (11c): ``support_ids`` (the student's, the teacher's or both sides' top-K), ``support_logprobs``
  (the teacher's log-probs there and its exact tail, at scoring), ``teacher_inputs`` (the student's side, and
  ``fill_rows``: a row without a teacher takes the student's own values)
* ``TEACHER_ESTIMATORS`` the one table of what each estimator reads and what scoring keeps of the teacher's
  distribution; ``teacher_loss`` computes one by name, and its result is ``rsipo_loss``'s ``teacher_term``
* ``rsipo_loss``         L = L_PG + α·L_OPSD + η·L_skill + c_KL·KL_k3 − c_H·H              (Eq. 12)

Deviations and choices not fixed by the paper
---------------------------------------------
1. **[ours] Eq. (1) uses the unbiased (n−1) standard deviation**, as ``torch.std`` does in
   GRPO/verl. A group with a single turn-sample has no spread: its std is taken as 0 and its
   advantage is exactly 0 (s equals its own mean). A group whose scores are all equal also gets
   advantage 0. Group statistics are over *turn-samples* (METHOD.md §2.2), so longer episodes weigh
   more in the group mean; group ids may be any integers (not necessarily contiguous).
2. **[ours] Eq. (5) single-task types.** When a task type has exactly one task in the batch, its
   baseline is the running mean of that type, *before* this batch's update (0 for a type never
   seen: g = 0 means "the skill neither helps nor hurts"). Running means are exponential moving
   averages ``m ← momentum·m + (1 − momentum)·batch_mean_c`` starting at 0, updated for every
   type present in the batch. Invalid skills enter both the batch mean and the running mean
   with r_bad in place of g (the baseline is of the same quantity the advantage is of). The
   input dict is not mutated; a new dict is returned.
3. **[ours] Skill term of Eq. (12) as a second call.** Student-turn micro-batches and
   skill-writing micro-batches are separate in the trainer, so ``rsipo_loss`` handles one kind
   of sample per call. Student turns: ``rsipo_loss(..., advantages=A (Eq. 1), teacher_term=teacher_loss(...),
   pg_weight=1)``. Skill writing: ``rsipo_loss(..., advantages=A^skill (Eq. 5), teacher_term=None,
   pg_weight=η)``; the PG term is then η·L_skill with its own token mean over
   skill tokens (pass that kind's ``n_tokens``). The sum of the two calls is Eq. (12). Whether
   the KL and entropy terms also cover skill tokens is the caller's choice (pass ``ref_logp`` /
   ``entropy`` or ``None``).
4. **Absent terms are skipped, not multiplied by zero**: a term is left out when its input is
   ``None`` or its coefficient is 0, so that ``alpha = 0`` or no teacher gives *exactly* the
   GRPO loss and gradient (the reduction test), even if teacher log-probs were non-finite.
5. **Token mean over micro-batches.** Every loss takes ``n_tokens``; when a mini-batch is split
   into micro-batches the caller passes the mini-batch's total token count, so that summing the
   micro-batch losses (gradient accumulation) gives the exact token mean of the whole mini-batch.
   Default: this call's own ``mask.sum()`` (clamped ≥ 1).
6. **Metrics.** ``*/loss`` entries are the value of the returned (possibly partial) term, so they
   add up across micro-batches; every other statistic is a mean over *this call's* masked tokens
   (``n_tokens`` in the metrics is that local count, for token-weighted aggregation).
   ``pg/approx_kl`` is Schulman's k3 estimate of KL(π_old‖π_θ): (ρ − 1) − log ρ (verl's ``ppo_kl`` is k1,
   the mean of −log ρ).
   ``pg/clip_frac`` counts tokens where the clipped branch is the active one (its gradient is 0).
7. **verl's clamps, by default.** Eq. (10) has verl's dual clip (``clip_ratio_c`` 3: a negative-advantage
   token's surrogate is at least c·A) and its log-ratio bound (±20 before the exponential, always), and
   ``kl_k3`` verl's ``low_var_kl`` clamps (log-ratio to ±20, each token's k3 to at most 10). ``None`` turns the
   dual clip or the k3 clamps off and gives the textbook formula; all are tested against hand-derived numbers.
8. **Masked before the exponential.** Log-ratios (ρ, the k3 KL, the teacher gap) are set to 0 at
   positions outside the mask *before* ``exp``: a padded position holds arbitrary numbers (the
   trainer fills ℓ_ref = 0 there), and exp(−ℓ) at ℓ < −88.7 is inf in fp32, which the mask's
   multiplication by 0 would turn into NaN.
9. **[ours] Three token means, so that algorithms are compared on equal terms.** The trainer
   passes, per mini-batch: for the PG term (``n_tokens``) the tokens of the turns that carry a
   policy gradient, i.e. under ``--drop_zero_adv`` the turns with A ≠ 0, exactly GRPO's sample set:
   teacher-only turns (A = 0, kept for the OPSD term) no longer dilute RSIPO's PG term (they halved
   the gradient of an A = +1 turn in a mini-batch of two). For KL and entropy (``reg_n_tokens``)
   every trained token of the mini-batch, turns and skill-writing responses alike, so a skill
   token is regularised exactly like an action token (as a separate mean over the few skill
   tokens it weighed ~n_turn/n_skill times more, ~50x at the recipes' batch). For the teacher
   term (``teacher_loss``'s ``n_tokens``) the student tokens, or only those of the turns with a
   teacher (the trainer's ``--teacher_norm``). The skill PG term stays η times its own token mean.
10. **GiGPO's step-level advantage** (``step_returns``, ``step_advantages``): within a task's
   group, turns that acted on the identical observation (an anchor state) form a step group;
   their step scores are normalised like Eq. (1) (unbiased std; a singleton or all-equal group gives
   0). As in verl-agent, a step's score is its γ-discounted return of the env rewards alone, G_t =
   r_t + γ·G_{t+1} over every step of the episode (a step whose turn was dropped keeps its place in
   the chain), minus the format penalty of that turn alone (the penalty is not discounted into
   earlier turns). The trainer adds ω·A_step to Eq. (1) (``--step_adv ω``; ``--algo gigpo``: GRPO
   with ω = 1, γ = 0.95, verl-agent's published defaults). The episode term is over turn-samples, as
   verl-agent's default (``compute_mean_std_cross_steps``). With no repeated state the step term is 0
   and the advantage is exactly Eq. (1) (tested).

Testing
-------
``python -m pytest tests/test_rsipo.py -q``: hand-derived values for every equation, clip and
gate gradient checks, micro-batch token-mean exactness, the RSIPO → GRPO reduction, and a tiny
end-to-end optimisation with a ``torch.nn.Linear`` policy. CPU only, a few seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

__all__ = [
    "turn_scores",
    "group_advantages",
    "token_logprobs",
    "entropy_from_logits",
    "logprobs_and_entropy",
    "masked_token_mean",
    "policy_loss",
    "kl_k3",
    "skill_advantages",
    "opsd_loss",
    "signed_teacher_loss",
    "support_kl",
    "lowprob_loss",
    "support_ids",
    "support_logprobs",
    "fill_rows",
    "teacher_inputs",
    "Estimator",
    "TeacherInputs",
    "TEACHER_ESTIMATORS",
    "teacher_loss",
    "LOGP_FLOOR",
    "RATIO_LOG_CLAMP",
    "rsipo_loss",
    "step_returns",
    "step_advantages",
]


# ----------------------------------------------------------------------------------------------
# Step 1-2: turn scores and group advantages


def turn_scores(episode_reward: Tensor, invalid: Tensor, p_fmt: float) -> Tensor:
    """s_{i,t} = R_i − p_fmt·invalid_{i,t}, one value per turn-sample.

    episode_reward: [T] the reward of the episode each turn belongs to; invalid: [T] bool, the
    turn's output had no parsable action. Returns [T] float.
    """
    r = episode_reward if episode_reward.is_floating_point() else episode_reward.float()  # [T]
    return r - p_fmt * invalid.to(r.dtype)  # [T]  step 1: format penalty per turn


def group_advantages(scores: Tensor, group_ids: Tensor, stabilizer: float = 1e-6, std_norm: bool = True) -> Tensor:
    """Eq. (1): A = (s − mean_g s) / (std_g s + stabilizer) over all turn-samples sharing a group id.

    scores: [T] float; group_ids: [T] long (any integers, e.g. the task index). Unbiased std
    (n − 1); a group of one sample gets std 0, hence advantage 0 (deviation 1). ``std_norm`` False is
    verl-agent's ``mean_norm``: A = s − mean_g s, no division (a tied group is still exactly 0). Vectorised
    with ``index_add_``; statistics in float64, result in the scores' dtype. Returns [T].
    """
    if scores.numel() == 0:
        return scores.clone()
    s = scores.double()  # [T]
    _, inv = torch.unique(group_ids, return_inverse=True)  # inv: [T] in [0, G)
    G = int(inv.max().item()) + 1
    count = torch.zeros(G, dtype=s.dtype, device=s.device).index_add_(0, inv, torch.ones_like(s))  # [G]
    mean = torch.zeros(G, dtype=s.dtype, device=s.device).index_add_(0, inv, s) / count  # [G]
    dev = s - mean[inv]  # [T]
    sq = torch.zeros(G, dtype=s.dtype, device=s.device).index_add_(0, inv, dev * dev)  # [G]
    std = (sq / (count - 1).clamp(min=1)).sqrt()  # [G] unbiased; single-sample group -> 0
    std_t = std[inv]  # [T]
    # zero spread (single sample or all-equal group) means dev == 0: advantage 0, even for stabilizer = 0
    scale = std_t + stabilizer if std_norm else torch.ones_like(std_t)  # [T]  mean_norm: no division
    adv = torch.where(std_t > 0, dev / scale, torch.zeros_like(dev))  # [T]  Eq. (1)
    out_dtype = scores.dtype if scores.is_floating_point() else torch.get_default_dtype()
    return adv.to(out_dtype)



def step_returns(step_rewards: Tensor, episode_ids: Tensor, gamma: float = 0.95) -> Tensor:
    """GiGPO's discounted step returns G_t = r_t + γ·G_{t+1} within each episode (deviation 10).

    step_rewards: [T] per-turn rewards; episode_ids: [T]; the turns of an episode appear in step
    order (not necessarily contiguous). Returns [T] float64-accurate returns in the rewards' dtype.
    """
    r = step_rewards.double()  # [T]
    out = torch.zeros_like(r)  # [T]
    for e in torch.unique(episode_ids).tolist():
        idx = (episode_ids == e).nonzero().flatten()  # [n] this episode's turns, in step order
        g = 0.0
        for i in reversed(idx.tolist()):
            g = float(r[i]) + gamma * g
            out[i] = g
    return out.to(step_rewards.dtype if step_rewards.is_floating_point() else torch.get_default_dtype())


def step_advantages(returns: Tensor, anchor_ids: Tensor, stabilizer: float = 1e-6, std_norm: bool = True) -> Tensor:
    """GiGPO's step-level advantage: Eq. (1)'s normalisation of the step scores within anchor-state
    groups (turns of one task's group that acted on the identical observation). anchor_ids: [T] any
    integers; a turn alone in its group gets 0. Returns [T]."""
    return group_advantages(returns, anchor_ids, stabilizer, std_norm)

# ----------------------------------------------------------------------------------------------
# Log-probs, entropy, token mean


def token_logprobs(logits: Tensor, targets: Tensor) -> Tensor:
    """ℓ_t = log softmax(logits_t)[targets_t] in fp32. logits [B,L,V], targets [B,L] -> [B,L]."""
    logp_all = torch.log_softmax(logits.float(), dim=-1)  # [B,L,V] fp32
    return logp_all.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)  # [B,L]


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Per-token entropy H_t = −Σ_v p log p in fp32. logits [B,L,V] -> [B,L]."""
    logp_all = torch.log_softmax(logits.float(), dim=-1)  # [B,L,V]
    return -(logp_all.exp() * logp_all).sum(-1)  # [B,L]


def logprobs_and_entropy(logits: Tensor, targets: Tensor, with_entropy: bool = True) -> tuple[Tensor, Tensor | None]:
    """``token_logprobs`` and ``entropy_from_logits`` from one fp32 log-softmax (the [B,L,V] tensors are
    the memory of a step: one log-softmax, not two). logits [B,L,V], targets [B,L] -> ([B,L], [B,L] or None)."""
    logp_all = torch.log_softmax(logits.float(), dim=-1)  # [B,L,V] fp32
    lp = logp_all.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)  # [B,L]
    return lp, (-(logp_all.exp() * logp_all).sum(-1) if with_entropy else None)  # [B,L]


def masked_token_mean(x: Tensor, mask: Tensor, n_tokens: float | Tensor | None = None) -> Tensor:
    """TokenMean[x] = Σ x·mask / n_tokens; n_tokens defaults to mask.sum(), clamped ≥ 1.

    Pass the mini-batch's total token count as ``n_tokens`` when it is split into micro-batches:
    the sum of the micro-batch values (and gradients) is then the exact mini-batch token mean.
    """
    m = mask.to(x.dtype)  # [B,L]
    if n_tokens is None:
        n = m.sum().clamp(min=1.0)
    else:
        n = torch.as_tensor(n_tokens, dtype=x.dtype, device=x.device).clamp(min=1.0)
    return (x * m).sum() / n  # scalar


def _local_mean(x: Tensor, mask: Tensor) -> float:
    """Detached mean of x over this call's masked tokens (metrics only)."""
    m = mask.to(torch.float32)
    return float((x.detach().float() * m).sum() / m.sum().clamp(min=1.0))


def _masked(x: Tensor, mask: Tensor) -> Tensor:
    """x where mask is set, 0 elsewhere (no arithmetic with what lies outside the mask)."""
    return torch.where(mask.bool(), x, torch.zeros_like(x))


def _per_token(a: Tensor, like: Tensor) -> Tensor:
    """Broadcast a per-sample [B] tensor to [B,L]; a [B,L] tensor is returned as is."""
    a = a.to(like.dtype)
    return a.unsqueeze(-1) if a.dim() == like.dim() - 1 else a


# ----------------------------------------------------------------------------------------------
# Eq. (10) and KL

RATIO_LOG_CLAMP = 20.0   # verl's bound on log ρ before the exponential (its `compute_policy_loss`)


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_eps: float = 0.2,
    n_tokens: float | Tensor | None = None,
    clip_ratio_c: float | None = 3.0,
) -> tuple[Tensor, dict]:
    """Eq. (10): L_PG = −TokenMean[min(ρA, clip(ρ, 1−ε, 1+ε)A)], ρ = exp(ℓ − ℓ_old),
    with verl's dual clip: where A < 0 the token's surrogate is at least c·A (``clip_ratio_c`` c = 3, verl's
    default; None = off), so a negative-advantage token whose ratio has grown past c adds −c·A to the loss and
    no gradient. As in verl the log-ratio is held to ±20 before the exponential (``RATIO_LOG_CLAMP``): a token at
    log-ratio 100 adds e^20·A (clipped by the surrogate) and no gradient, where e^100 is inf in fp32 and its
    gradient NaN.

    logp, old_logp, mask: [B,L]; advantages: [B] (broadcast over tokens) or [B,L].
    Metrics: pg/loss, pg/clip_frac, pg/dual_clip_frac, pg/ratio_mean, pg/approx_kl, n_tokens.
    """
    A = _per_token(advantages, logp)  # [B,1] or [B,L]
    log_ratio = _masked(logp - old_logp.detach(), mask)  # [B,L]  0 outside the mask (note 8)
    log_ratio = log_ratio.clamp(-RATIO_LOG_CLAMP, RATIO_LOG_CLAMP)  # [B,L]  as verl (e^100: inf, a NaN gradient)
    ratio = log_ratio.exp()  # [B,L]  ρ
    surr1 = ratio * A  # [B,L]  ρA
    surr2 = ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps) * A  # [B,L]  clip(ρ)A
    surr = torch.minimum(surr1, surr2)  # [B,L]
    dual = torch.zeros_like(surr, dtype=torch.bool)
    if clip_ratio_c is not None:
        floor = clip_ratio_c * A.expand_as(surr)  # [B,L]  c·A
        dual = (A < 0) & (surr < floor)  # [B,L] the dual clip is active (zero gradient)
        surr = torch.where(dual, floor, surr)  # [B,L]  max(min(ρA, clip(ρ)A), c·A) where A < 0
    loss = -masked_token_mean(surr, mask, n_tokens)  # Eq. (10)
    with torch.no_grad():
        clipped = (surr2 < surr1).float()  # [B,L] the clipped branch is active (zero gradient)
        approx_kl = (ratio - 1.0) - log_ratio  # [B,L] k3 of KL(π_old‖π_θ)
        metrics = {
            "pg/loss": float(loss.detach()),
            "pg/clip_frac": _local_mean(clipped, mask),
            "pg/dual_clip_frac": _local_mean(dual.float(), mask),
            "pg/ratio_mean": _local_mean(ratio, mask),
            "pg/approx_kl": _local_mean(approx_kl, mask),
            "n_tokens": float(mask.float().sum()),
        }
    return loss, metrics


def kl_k3(
    logp: Tensor,
    ref_logp: Tensor,
    mask: Tensor,
    n_tokens: float | Tensor | None = None,
    clamp: float | None = 10.0,
) -> tuple[Tensor, dict]:
    """k3 estimator of KL(π_θ‖π_ref) per token, token mean:
    exp(ℓ_ref − ℓ) − (ℓ_ref − ℓ) − 1 (≥ 0).

    ``clamp`` (verl's ``low_var_kl``, its default 10; None = the bare formula): the log-ratio is first held to
    ±20 and each token's k3 to at most ``clamp``, so a token far below the reference adds at most ``clamp``
    and no gradient (unclamped, one token 10 nats below adds e^10 ≈ 2·10⁴ to the gradient's scale).
    logp, ref_logp, mask: [B,L]. Metrics: kl/k3 (the returned value), kl/clamp_frac.
    """
    d = _masked(ref_logp.detach() - logp, mask)  # [B,L]  0 outside the mask, before exp (note 8)
    if clamp is not None:
        d = d.clamp(-20.0, 20.0)  # [B,L]  as verl, before exp
    k3 = d.exp() - d - 1.0  # [B,L] ≥ 0, 0 iff ℓ = ℓ_ref
    clamped = torch.zeros_like(k3, dtype=torch.bool)
    if clamp is not None:
        clamped = k3 > clamp
        k3 = k3.clamp(max=clamp)  # [B,L]
    loss = masked_token_mean(k3, mask, n_tokens)  # KL term of Eq. (12)
    return loss, {"kl/k3": float(loss.detach()), "kl/clamp_frac": _local_mean(clamped.float(), mask)}


# ----------------------------------------------------------------------------------------------
# Eq. (5): skill-generation advantage


def skill_advantages(
    gains: Tensor,
    task_types: list[str],
    valid: Tensor,
    r_bad: float = -1.0,
    running_means: dict | None = None,
    momentum: float = 0.9,
) -> tuple[Tensor, dict]:
    """Eq. (5): A^skill_q = g_q − mean{g_q' : c(q') = c(q)} over the batch.

    gains: [K] replay gains g_q (Eq. 3); task_types: K type names; valid: [K] bool, the skill
    parsed. Invalid skills use r_bad in place of g. A type with a single task in the batch uses
    the running mean of that type (0 if never seen) as its baseline [ours]. Running means are
    EMAs ``m ← momentum·m + (1 − momentum)·batch_mean`` from 0 [ours], updated for every type in
    the batch after the advantages are computed. Returns (A [K], new running-means dict).
    """
    if len(task_types) != gains.shape[0]:
        raise ValueError(f"{len(task_types)} task types for {gains.shape[0]} gains")
    dtype = gains.dtype if gains.is_floating_point() else torch.get_default_dtype()
    g = torch.where(valid.bool(), gains.to(dtype), torch.full_like(gains, r_bad, dtype=dtype))  # [K]
    old = dict(running_means or {})
    new = dict(old)
    baseline = torch.zeros_like(g)  # [K]
    for c in dict.fromkeys(task_types):  # unique types, first-seen order (K is small)
        idx = torch.tensor([i for i, t in enumerate(task_types) if t == c], device=g.device)
        batch_mean = g[idx].mean()
        if idx.numel() > 1:
            baseline[idx] = batch_mean  # batch mean of the type
        else:
            baseline[idx] = float(old.get(c, 0.0))  # [ours] running mean before this update
        new[c] = momentum * float(old.get(c, 0.0)) + (1.0 - momentum) * float(batch_mean)  # [ours] EMA
    adv = g - baseline  # [K]  Eq. (5)
    return adv, new


# ----------------------------------------------------------------------------------------------
# Eq. (11): trust-weighted, gated on-policy self-distillation

LOGP_FLOOR = -30.0   # [ours] teacher log-probs are raised to this: a token the teacher rules out (−inf) costs
                     # a finite 30 nats per unit of student mass instead of an infinite KL


def opsd_loss(
    logp: Tensor,
    teacher_logp: Tensor,
    trust: Tensor,
    mask: Tensor,
    beta: float = 5.0,
    n_tokens: float | Tensor | None = None,
) -> tuple[Tensor, dict]:
    """Eq. (11): L_OPSD = TokenMean[λ_q · σ(β·sg(ℓ^T − ℓ)) · (ℓ^T − ℓ)], ℓ^T detached
    and raised to LOGP_FLOOR (a −inf teacher entry would make the gate 0 and its product with −inf NaN).

    logp (student, with grad), teacher_logp, mask: [B,L]; trust λ: [B] (or [B,L]).
    ∂L/∂ℓ_t = −λ·gate_t/n ≤ 0 for λ ≥ 0: gradient descent raises every sampled token's log-prob,
    teacher-endorsed ones (gate → 1) fully, rejected ones (gate → 0) barely — never pushed down.
    Metrics: opsd/loss, opsd/gate_mean, opsd/gate_frac_gt_half, opsd/gap_mean, opsd/trust_mean.
    """
    lam = _per_token(trust.detach(), logp)  # [B,1] or [B,L]
    d = _masked(teacher_logp.detach().clamp(min=LOGP_FLOOR) - logp, mask)  # [B,L]  ℓ^T − ℓ, 0 outside the mask
    gate = torch.sigmoid(beta * d.detach())  # [B,L]  σ(β·sg(ℓ^T − ℓ))
    loss = masked_token_mean(lam * gate * d, mask, n_tokens)  # Eq. (11)
    with torch.no_grad():
        metrics = {
            "opsd/loss": float(loss.detach()),
            "opsd/gate_mean": _local_mean(gate, mask),
            "opsd/gate_frac_gt_half": _local_mean((gate > 0.5).float(), mask),
            "opsd/gap_mean": _local_mean(d, mask),
            "opsd/trust_mean": _trust_mean(trust),
        }
    return loss, metrics


def _trust_mean(trust: Tensor) -> float:
    return float(trust.detach().float().mean()) if trust.numel() else 0.0


# ----------------------------------------------------------------------------------------------
# The teacher term's other estimators [ours] (METHOD.md §2.8.1). Eq. (11) moves only the sampled token, and
# only upwards; these follow the reverse KL from the skill-conditioned teacher more closely. λ multiplies each.


def signed_teacher_loss(
    logp: Tensor,
    teacher_logp: Tensor,
    trust: Tensor,
    mask: Tensor,
    clip: float = 2.0,
    n_tokens: float | Tensor | None = None,
) -> tuple[Tensor, dict]:
    """Eq. (11b): the teacher as a per-token advantage A^T_t = −sg(clip(ℓ_t − ℓ^T_t, −c, c)), as in on-policy
    distillation: L = TokenMean[λ · sg(clip(ℓ − ℓ^T)) · (ℓ − ℓ^T)], ℓ^T detached.

    ∂L/∂ℓ_t = λ·clip(ℓ_t − ℓ^T_t)/n: descent lowers a sampled token the student rates above the
    teacher and raises one it rates below, in proportion to the gap. With the sample drawn from π_θ,
    E[(ℓ − ℓ^T)∇ℓ] is the gradient of the per-token reverse KL(π_θ‖π_T): this is its single-sample
    estimate, where Eq. (11) only ever raises. The value is λ·clip(d)·d ≥ 0 (a clipped squared gap), not a
    KL. logp (with grad), teacher_logp, mask: [B,L]; trust λ: [B] or [B,L]. Metrics: opsd/loss,
    opsd/gap_mean (ℓ^T − ℓ), opsd/clip_frac, opsd/trust_mean.
    """
    lam = _per_token(trust.detach(), logp)  # [B,1] or [B,L]
    d = _masked(logp - teacher_logp.detach().clamp(min=LOGP_FLOOR), mask)  # [B,L]  ℓ − ℓ^T, 0 outside the mask
    weight = d.detach().clamp(-clip, clip)  # [B,L]  −A^T
    loss = masked_token_mean(lam * weight * d, mask, n_tokens)  # Eq. (11b)
    with torch.no_grad():
        metrics = {
            "opsd/loss": float(loss.detach()),
            "opsd/gap_mean": -_local_mean(d, mask),
            "opsd/clip_frac": _local_mean((d.abs() > clip).float(), mask),
            "opsd/trust_mean": _trust_mean(trust),
        }
    return loss, metrics


def _log1mexp(x: Tensor) -> Tensor:
    """log(1 − exp(x)) for x < 0, stable at both ends. x is first lowered to at most −1e-6, so a support that holds
    all the mass up to float error leaves a tail of 1e-6, not log 0. Only the student's tail is computed this way
    (its error in the KL is at most 1e-6·(30 + 14) nats); the teacher's is exact (``support_logprobs``)."""
    x = x.clamp(max=-1e-6)
    return torch.where(x > -0.6931, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def _check_logprobs(x: Tensor, mask: Tensor, what: str):
    """Refuse values that cannot be log-probabilities of one distribution (their logsumexp above 0 at a masked
    position): raw logits passed where log-softmax values belong give a wrong KL without any other sign."""
    if x.numel() == 0 or not mask.bool().any():
        return
    worst = float(torch.logsumexp(x.detach().float(), -1)[mask.bool()].max())
    if worst > 1e-4:
        raise ValueError(f"{what}: their logsumexp reaches {worst:.4g} > 0 at some position: pass log-probabilities "
                         "(a log_softmax over the vocabulary, then gathered), not logits")


def support_kl(
    student_logp: Tensor,
    teacher_logp: Tensor,
    trust: Tensor,
    mask: Tensor,
    teacher_tail: Tensor | None = None,
    valid: Tensor | None = None,
    n_tokens: float | Tensor | None = None,
) -> tuple[Tensor, dict]:
    """Eq. (11c)/(11d): the reverse KL from the teacher,
    KL(π_θ‖π_T) = Σ_v π_θ(v)·(log π_θ(v) − log π_T(v)), over a support S (``support_ids``: the student's,
    the teacher's or both sides' top-K tokens), trust-weighted:
    L = TokenMean[λ · KL_S].

    student_logp, teacher_logp: [B,L,S] the log-probs of the same S tokens per position (the student's with grad,
    gathered from its full log-softmax; the teacher's detached). ``teacher_tail`` [B,L] (top-K, Eq. 11c): the log
    of the teacher's mass outside S, exact from its full log-softmax (``support_logprobs``); the mass outside S is
    one more category for each side (the student's is 1 − Σ_S π_θ), so KL_S is the KL between two distributions
    over S + 1 outcomes: ≥ 0, at most the full KL (coarse-graining), equal to it when S is the whole vocabulary.
    Without it (Eq. 11d) S must be the whole vocabulary. ``valid`` [B,L,S] bool: the slots that hold a token (a
    union of two top-Ks has fewer than 2K distinct ones); the others add nothing. Teacher log-probs are raised to
    LOGP_FLOOR; positions outside the mask contribute neither value nor gradient (padded rows may hold anything).
    Either side's values with a logsumexp above 0 are refused (logits passed for log-probs).
    Gradient per student logit z_j: λ·π_θ(j)·(log q_θ(c) − log q_T(c) − KL_S)/n, c the outcome j falls in.
    Metrics: opsd/loss, opsd/kl (the token mean of KL_S without λ), opsd/tail_mass (the student's mass outside
    S on the rows with λ > 0; tail only).
    """
    lam = _per_token(trust.detach(), student_logp[..., 0])  # [B,1] or [B,L]
    m = mask.bool().unsqueeze(-1)  # [B,L,1]
    ok = m if valid is None else m & valid.bool()  # [B,L,S]  the slots that count
    _check_logprobs(torch.where(ok, teacher_logp, -math.inf), mask, "teacher support log-probs")
    _check_logprobs(torch.where(ok, student_logp, -math.inf), mask, "student support log-probs")
    s = torch.where(ok, student_logp, student_logp.detach())  # [B,L,S]  no gradient where it does not count
    t = torch.where(ok, teacher_logp.detach().clamp(min=LOGP_FLOOR), s.detach())  # [B,L,S]
    kl = torch.where(ok, s.exp() * (s - t), torch.zeros_like(s)).sum(-1)  # [B,L]  Σ_S π_θ (log π_θ − log π_T)
    if teacher_tail is not None:
        held = torch.where(ok | ~m, s, -math.inf)  # [B,L,S]  outside the mask: any finite values
        s_tail = _log1mexp(torch.logsumexp(held, -1))  # [B,L]  log(1 − Σ_S π_θ)
        t_tail = torch.where(mask.bool(), teacher_tail.detach().clamp(min=LOGP_FLOOR), s_tail.detach())  # [B,L]
        kl = kl + _masked(s_tail.exp() * (s_tail - t_tail), mask)  # [B,L]  the tail bucket
    loss = masked_token_mean(lam * kl, mask, n_tokens)  # Eq. (11c) / (11d)
    with torch.no_grad():
        metrics = {"opsd/loss": float(loss.detach()), "opsd/kl": _local_mean(kl, mask),
                   "opsd/trust_mean": _trust_mean(trust)}
        if teacher_tail is not None:      # over the positions of rows with a teacher (λ > 0): the others' is filler
            metrics["opsd/tail_mass"] = _local_mean(s_tail.exp(), mask.bool() & (lam > 0).expand_as(mask))
    return loss, metrics


def lowprob_loss(
    logp: Tensor,
    old_logp: Tensor,
    trust: Tensor,
    mask: Tensor,
    threshold: float = 0.2,
    n_tokens: float | Tensor | None = None,
) -> tuple[Tensor, dict]:
    """Eq. (11e), the teacher-free control: a fixed advantage −1 on the sampled tokens that π_old gave a
    probability below `threshold` τ, 0 elsewhere: L = TokenMean[λ · 1[ℓ_old < log τ] · ℓ]; descent lowers
    those tokens (∂L/∂ℓ_t = λ/n on them). It uses no teacher, only which turns have one (λ), so a teacher
    estimator that does no better than it has carried none of the teacher's information.
    Metrics: opsd/loss, opsd/low_frac (the share of tokens it acts on), opsd/trust_mean.
    """
    lam = _per_token(trust.detach(), logp)  # [B,1] or [B,L]
    low = (old_logp.detach() < math.log(threshold)) & mask.bool()  # [B,L]
    loss = masked_token_mean(lam * low.to(logp.dtype) * _masked(logp, mask), mask, n_tokens)  # Eq. (11e)
    with torch.no_grad():
        metrics = {"opsd/loss": float(loss.detach()), "opsd/low_frac": _local_mean(low.float(), mask),
                   "opsd/trust_mean": _trust_mean(trust)}
    return loss, metrics


# ----------------------------------------------------------------------------------------------
# The support of Eq. (11c-d): which tokens, the teacher's log-probs there and its exact tail (at scoring), and
# the student's side with the rule for rows without a teacher (in the update)

SUPPORT_SIDES = ("student", "teacher", "union")


def support_ids(teacher_logp_all: Tensor, k: int, side: str = "student", student_ids: Tensor | None = None) -> Tensor:
    """The top-K support at each position [..., S]: the student's K most likely tokens (``student_ids``, π_old's:
    SDPO and TRL take the student's), the teacher's (from ``teacher_logp_all`` [..., V]: NeMo-RL's choice), or the
    union of both (verl's distillation), S = 2K with −1 in the slots of tokens both sides hold. Long ids."""
    if side == "student":
        if student_ids is None:
            raise ValueError("support side 'student' needs student_ids (π_old's top-K at each position)")
        return student_ids.long()
    own = teacher_logp_all.topk(k, dim=-1).indices  # [..., K]
    if side == "teacher":
        return own
    if side != "union":
        raise ValueError(f"support side {side!r}: must be one of {', '.join(SUPPORT_SIDES)}")
    if student_ids is None:
        raise ValueError("support side 'union' needs student_ids (π_old's top-K at each position)")
    both = torch.cat([own, student_ids.long()], -1).sort(-1).values  # [..., 2K]
    repeat = torch.zeros_like(both, dtype=torch.bool)
    repeat[..., 1:] = both[..., 1:] == both[..., :-1]
    return both.masked_fill(repeat, -1)  # [..., 2K]  each token once


def support_logprobs(logp_all: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
    """A distribution on a support, from its whole log-softmax logp_all [..., V]: the log-probs at ``ids``
    [..., S] (−inf in an empty slot, id −1) and the log of the mass outside them [...], exact (a logsumexp over
    the other V − S tokens, not log(1 − Σ_S p): where the teacher is near-certain that difference is below float
    precision, and a floored tail understates the KL of a student that disagrees)."""
    lp = logp_all.gather(-1, ids.clamp(min=0)).masked_fill(ids < 0, -math.inf)  # [..., S]
    fill = torch.where(ids < 0, ids[..., :1].clamp(min=0), ids)  # [..., S]  an empty slot repeats a held token
    tail = logp_all.scatter(-1, fill, -math.inf).logsumexp(-1)  # [...]  log Σ_{v ∉ S} p(v)
    return lp, tail


def fill_rows(has_teacher: Tensor, teacher: Tensor, student: Tensor) -> Tensor:
    """The rule for rows without a teacher (has_teacher [B] False): they take the student's own values, detached.
    The support KL then gives them neither value nor gradient; Eq. (11) still raises their sampled tokens by
    λ·σ(0)·∇ℓ, so such a row also needs λ = 0 (the trainer's rule). teacher, student: [B, ...]."""
    has = has_teacher.bool().view(-1, *([1] * (student.dim() - 1)))
    return torch.where(has, teacher.to(student.dtype), student.detach())


def teacher_inputs(
    logp: Tensor,
    has_teacher: Tensor,
    teacher_logp: Tensor | None = None,
    logp_all: Tensor | None = None,
    ids: Tensor | None = None,
    support_lp: Tensor | None = None,
    tail: Tensor | None = None,
) -> dict:
    """The teacher term's inputs for one micro-batch, as ``teacher_loss`` takes them, rows without a teacher
    filled by ``fill_rows``. logp [B,L] (with grad); has_teacher [B]; teacher_logp [B,L] (ℓ^T). A support
    estimator also takes the student's whole log-softmax logp_all [B,L,V] (with grad) and the teacher's side kept
    at scoring: ids [B,L,S] (None = the whole vocabulary), support_lp [B,L,S] (or [B,L,V]), tail [B,L]."""
    out = {}
    if teacher_logp is not None:
        out["teacher_logp"] = fill_rows(has_teacher, teacher_logp, logp)  # [B,L]
    if logp_all is None:
        return out
    has = has_teacher.bool().view(-1, 1, 1)
    if ids is None:  # the whole vocabulary (Eq. 11d)
        student = torch.where(has, logp_all, logp_all.detach())  # [B,L,V]  with grad where there is a teacher
        out.update(student_support=student, teacher_support=fill_rows(has_teacher, support_lp, logp_all))
        return out
    ids = torch.where(has, ids, torch.arange(ids.shape[-1], device=ids.device))  # [B,L,S]  no teacher: any S ids
    student = logp_all.gather(-1, ids.clamp(min=0))  # [B,L,S]
    student = torch.where(has, student, student.detach())  # with grad where there is a teacher
    valid = ids >= 0  # [B,L,S]
    s_tail = _log1mexp(torch.logsumexp(torch.where(valid, student, -math.inf), -1))  # [B,L]
    out.update(student_support=student, teacher_support=fill_rows(has_teacher, support_lp, student),
               teacher_tail=fill_rows(has_teacher, tail, s_tail), support_valid=valid)
    return out


# ----------------------------------------------------------------------------------------------
# The estimators by name: what each reads, and what scoring must keep of the teacher's distribution


@dataclass(frozen=True)
class Estimator:
    """A teacher estimator: ``loss(x)`` of a ``TeacherInputs`` x, the inputs it reads (``needs``: fields of x that
    must not be None), and what scoring keeps of the teacher's distribution at each position (``support``): none
    (ℓ^T of the sampled token only), topk (K tokens per ``support_ids`` and the exact tail) or vocab (all of it)."""
    loss: Callable[["TeacherInputs"], tuple[Tensor, dict]]
    needs: tuple[str, ...]
    support: str = "none"


@dataclass
class TeacherInputs:
    """Everything an estimator may read. logp, trust, mask: [B,L], [B], [B,L]; the rest as ``teacher_inputs``
    gives them, and the options each estimator takes."""
    logp: Tensor
    trust: Tensor
    mask: Tensor
    n_tokens: float | Tensor | None = None
    teacher_logp: Tensor | None = None
    old_logp: Tensor | None = None
    student_support: Tensor | None = None
    teacher_support: Tensor | None = None
    teacher_tail: Tensor | None = None
    support_valid: Tensor | None = None
    beta: float = 5.0
    clip: float = 2.0
    threshold: float = 0.2


TEACHER_ESTIMATORS: dict[str, Estimator] = {
    "gated": Estimator(lambda x: opsd_loss(x.logp, x.teacher_logp, x.trust, x.mask, x.beta, x.n_tokens),
                       ("teacher_logp",)),
    "signed": Estimator(lambda x: signed_teacher_loss(x.logp, x.teacher_logp, x.trust, x.mask, x.clip, x.n_tokens),
                        ("teacher_logp",)),
    "topk": Estimator(lambda x: support_kl(x.student_support, x.teacher_support, x.trust, x.mask, x.teacher_tail,
                                           x.support_valid, x.n_tokens),
                      ("student_support", "teacher_support", "teacher_tail"), "topk"),
    "full": Estimator(lambda x: support_kl(x.student_support, x.teacher_support, x.trust, x.mask,
                                           n_tokens=x.n_tokens),
                      ("student_support", "teacher_support"), "vocab"),
    "negative": Estimator(lambda x: lowprob_loss(x.logp, x.old_logp, x.trust, x.mask, x.threshold, x.n_tokens),
                          ("old_logp",)),
}


def teacher_loss(kind: str, logp: Tensor, trust: Tensor, mask: Tensor, **inputs) -> tuple[Tensor, dict]:
    """The teacher term of Eq. (12) by name (``TEACHER_ESTIMATORS``): gated (Eq. 11), signed (11b), topk (11c),
    full (11d), negative (11e). ``inputs``: the other fields of ``TeacherInputs`` (n_tokens, the estimator's inputs,
    beta / clip / threshold). An unknown kind, or an input the estimator needs left out, is a ValueError."""
    if kind not in TEACHER_ESTIMATORS:
        raise ValueError(f"teacher loss {kind!r}: must be one of {', '.join(TEACHER_ESTIMATORS)}")
    x = TeacherInputs(logp, trust, mask, **inputs)
    est = TEACHER_ESTIMATORS[kind]
    missing = [k for k in est.needs if getattr(x, k) is None]
    if missing:
        raise ValueError(f"teacher loss {kind!r} needs {', '.join(missing)}")
    return est.loss(x)


# ----------------------------------------------------------------------------------------------
# Eq. (12): total loss for one kind of sample


def rsipo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    entropy: Tensor | None = None,
    ref_logp: Tensor | None = None,
    teacher_term: tuple[Tensor, dict] | None = None,
    clip_eps: float = 0.2,
    alpha: float = 0.01,
    c_kl: float = 0.01,
    c_ent: float = 0.001,
    pg_weight: float = 1.0,
    n_tokens: float | Tensor | None = None,
    reg_n_tokens: float | Tensor | None = None,
    clip_ratio_c: float | None = 3.0,
    kl_clamp: float | None = 10.0,
) -> tuple[Tensor, dict]:
    """Eq. (12) for a batch of samples of one kind:
    L = pg_weight·L_PG + α·L_teacher + c_KL·KL_k3 − c_H·H.

    Student turns: advantages = Eq. (1), ``teacher_term`` = ``teacher_loss(...)`` (the caller computes it: which
    estimator, its inputs, its token mean), pg_weight = 1. Skill-writing samples: advantages = A^skill (Eq. 5), no
    teacher term, pg_weight = η — the PG term is then η·L_skill; adding the two calls' losses gives Eq. (12)
    (deviation 3). A term is skipped when its input is None or its coefficient is 0: entropy=None or c_ent=0 →
    no entropy bonus; ref_logp=None or c_kl=0 → no KL; teacher_term=None or alpha=0 → no teacher term. With no
    teacher term this is exactly the GRPO loss (tested). All tensors [B,L] except advantages ([B] or [B,L]).
    Token-mean denominators (deviation 9): ``n_tokens`` for the PG term, ``reg_n_tokens`` for KL and entropy
    (default ``n_tokens``), both as in ``masked_token_mean``.
    """
    reg_n = n_tokens if reg_n_tokens is None else reg_n_tokens
    pg, metrics = policy_loss(logp, old_logp, advantages, mask, clip_eps=clip_eps, n_tokens=n_tokens,
                              clip_ratio_c=clip_ratio_c)
    loss = pg_weight * pg  # Eq. (12) L_PG (or η·L_skill)
    if teacher_term is not None and alpha != 0.0:
        term, m = teacher_term
        loss = loss + alpha * term  # Eq. (12) α·L_OPSD (Eq. 11, or 11b-11e: teacher_loss)
        metrics.update(m)
    if ref_logp is not None and c_kl != 0.0:
        kl, m = kl_k3(logp, ref_logp, mask, n_tokens=reg_n, clamp=kl_clamp)
        loss = loss + c_kl * kl  # Eq. (12) c_KL·KL_k3(π_θ‖π_ref)
        metrics.update(m)
    if entropy is not None and c_ent != 0.0:
        ent = masked_token_mean(entropy, mask, reg_n)  # H, token mean
        loss = loss - c_ent * ent  # Eq. (12) −c_H·H
        metrics["entropy"] = float(ent.detach())
    metrics["loss"] = float(loss.detach())
    return loss, metrics
