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
  ``support_kl``           reverse KL(π_θ‖π_T) over the teacher's top-K tokens and one tail bucket (Eq. 11c),
                           or over the whole vocabulary (Eq. 11d)
  ``lowprob_loss``         the teacher-free control: advantage −1 on the tokens π_old gave less than τ (Eq. 11e)
  ``teacher_loss``         one of the four by name (``TEACHER_LOSSES``), as ``rsipo_loss`` calls it
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
   of sample per call. Student turns: ``rsipo_loss(..., advantages=A (Eq. 1), teacher_logp=ℓ^T,
   trust=λ, pg_weight=1)``. Skill writing: ``rsipo_loss(..., advantages=A^skill (Eq. 5),
   teacher_logp=None, pg_weight=η)``; the PG term is then η·L_skill with its own token mean over
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
   ``pg/approx_kl`` is Schulman's k3 estimate of KL(π_old‖π_θ): (ρ − 1) − log ρ.
   ``pg/clip_frac`` counts tokens where the clipped branch is the active one (its gradient is 0).
7. **verl's clamps, by default.** Eq. (10) has verl's dual clip (``clip_ratio_c`` 3: a negative-advantage
   token's surrogate is at least c·A), and ``kl_k3`` verl's ``low_var_kl`` clamps (log-ratio to ±20, each
   token's k3 to at most 10). ``None`` turns either off and gives the textbook formula; both are tested
   against hand-derived numbers.
8. **Masked before the exponential.** Log-ratios (ρ, the k3 KL, the teacher gap) are set to 0 at
   positions outside the mask *before* ``exp``: a padded position holds arbitrary numbers (the
   trainer fills ℓ_ref = 0 there), and exp(−ℓ) at ℓ < −88.7 is inf in fp32, which the mask's
   multiplication by 0 would turn into NaN.
9. **[ours] Three token means, so that algorithms are compared on equal terms.** The trainer
   passes, per mini-batch: for the PG term (``pg_n_tokens``) the tokens of the turns that carry a
   policy gradient, i.e. under ``--drop_zero_adv`` the turns with A ≠ 0, exactly GRPO's sample set:
   teacher-only turns (A = 0, kept for the OPSD term) no longer dilute RSIPO's PG term (they halved
   the gradient of an A = +1 turn in a mini-batch of two). For KL and entropy (``reg_n_tokens``)
   every trained token of the mini-batch, turns and skill-writing responses alike, so a skill
   token is regularised exactly like an action token (as a separate mean over the few skill
   tokens it weighed ~n_turn/n_skill times more, ~50x at the recipes' batch). For OPSD
   (``n_tokens``) the student tokens. The skill PG term stays η times its own token mean.
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
    "teacher_loss",
    "TEACHER_LOSSES",
    "LOGP_FLOOR",
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
    no gradient.

    logp, old_logp, mask: [B,L]; advantages: [B] (broadcast over tokens) or [B,L].
    Metrics: pg/loss, pg/clip_frac, pg/dual_clip_frac, pg/ratio_mean, pg/approx_kl, n_tokens.
    """
    A = _per_token(advantages, logp)  # [B,1] or [B,L]
    log_ratio = _masked(logp - old_logp.detach(), mask)  # [B,L]  0 outside the mask (note 8)
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


def opsd_loss(
    logp: Tensor,
    teacher_logp: Tensor,
    trust: Tensor,
    mask: Tensor,
    beta: float = 5.0,
    n_tokens: float | Tensor | None = None,
) -> tuple[Tensor, dict]:
    """Eq. (11): L_OPSD = TokenMean[λ_q · σ(β·sg(ℓ^T − ℓ)) · (ℓ^T − ℓ)], ℓ^T detached.

    logp (student, with grad), teacher_logp, mask: [B,L]; trust λ: [B] (or [B,L]).
    ∂L/∂ℓ_t = −λ·gate_t/n ≤ 0 for λ ≥ 0: gradient descent raises every sampled token's log-prob,
    teacher-endorsed ones (gate → 1) fully, rejected ones (gate → 0) barely — never pushed down.
    Metrics: opsd/loss, opsd/gate_mean, opsd/gate_frac_gt_half, opsd/gap_mean, opsd/trust_mean.
    """
    lam = _per_token(trust.detach(), logp)  # [B,1] or [B,L]
    d = _masked(teacher_logp.detach() - logp, mask)  # [B,L]  ℓ^T − ℓ, 0 outside the mask (note 8)
    gate = torch.sigmoid(beta * d.detach())  # [B,L]  σ(β·sg(ℓ^T − ℓ))
    loss = masked_token_mean(lam * gate * d, mask, n_tokens)  # Eq. (11)
    with torch.no_grad():
        metrics = {
            "opsd/loss": float(loss.detach()),
            "opsd/gate_mean": _local_mean(gate, mask),
            "opsd/gate_frac_gt_half": _local_mean((gate > 0.5).float(), mask),
            "opsd/gap_mean": _local_mean(d, mask),
            "opsd/trust_mean": float(trust.detach().float().mean()) if trust.numel() else 0.0,
        }
    return loss, metrics


# ----------------------------------------------------------------------------------------------
# The teacher term's other estimators [ours] (METHOD.md §2.8.1). Eq. (11) moves only the sampled token, and
# only upwards; these follow the reverse KL from the skill-conditioned teacher more closely. λ multiplies each.

TEACHER_LOSSES = ("gated", "signed", "topk", "full", "negative")

LOGP_FLOOR = -30.0   # [ours] teacher log-probs are raised to this: a token the teacher rules out (−inf) costs
                     # a finite 30 nats per unit of student mass instead of an infinite KL


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
            "opsd/trust_mean": float(trust.detach().float().mean()) if trust.numel() else 0.0,
        }
    return loss, metrics


def _log1mexp(x: Tensor) -> Tensor:
    """log(1 − exp(x)) for x < 0, stable at both ends (x is first lowered to at most −1e-6: a top-K that holds
    all the mass up to float error leaves a tail of 1e-6, not log 0)."""
    x = x.clamp(max=-1e-6)
    return torch.where(x > -0.6931, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def support_kl(
    student_logp: Tensor,
    teacher_logp: Tensor,
    trust: Tensor,
    mask: Tensor,
    tail: bool = True,
    n_tokens: float | Tensor | None = None,
) -> tuple[Tensor, dict]:
    """Eq. (11c)/(11d): the reverse KL from the teacher,
    KL(π_θ‖π_T) = Σ_v π_θ(v)·(log π_θ(v) − log π_T(v)), over a support S of the teacher's choosing,
    trust-weighted: L = TokenMean[λ · KL_S].

    student_logp, teacher_logp: [B,L,K] the log-probs of the same K tokens per position (the student's with
    grad, gathered from its full log-softmax; the teacher's detached). tail (top-K, Eq. 11c): the mass outside
    S is one more category, 1 − Σ_S π, for each side, so KL_S is the KL between two distributions over K + 1
    outcomes: ≥ 0, at most the full KL (coarse-graining), equal to it when S is the whole vocabulary. Without
    tail (Eq. 11d) S must be the whole vocabulary. Teacher log-probs are raised to LOGP_FLOOR; positions
    outside the mask contribute neither value nor gradient (padded teacher rows may hold anything).
    Gradient per student logit z_j (full vocabulary): λ·π_θ(j)·(log π_θ(j) − log π_T(j) − KL)/n.
    Metrics: opsd/loss, opsd/kl (the token mean of KL_S without λ), opsd/tail_mass (the student's, tail only).
    """
    lam = _per_token(trust.detach(), student_logp[..., 0])  # [B,1] or [B,L]
    m = mask.bool().unsqueeze(-1)  # [B,L,1]
    s = torch.where(m, student_logp, student_logp.detach())  # [B,L,K]  outside the mask: no gradient
    t = torch.where(m, teacher_logp.detach().clamp(min=LOGP_FLOOR), s.detach())  # [B,L,K]  KL 0 outside
    kl = (s.exp() * (s - t)).sum(-1)  # [B,L]  Σ_S π_θ (log π_θ − log π_T)
    if tail:
        s_tail = _log1mexp(torch.logsumexp(s, -1))  # [B,L]  log(1 − Σ_S π_θ)
        t_tail = _log1mexp(torch.logsumexp(t, -1)).clamp(min=LOGP_FLOOR)  # [B,L]
        kl = kl + s_tail.exp() * (s_tail - t_tail)  # [B,L]  the tail bucket
    loss = masked_token_mean(lam * kl, mask, n_tokens)  # Eq. (11c) / (11d)
    with torch.no_grad():
        metrics = {"opsd/loss": float(loss.detach()), "opsd/kl": _local_mean(kl, mask),
                   "opsd/trust_mean": float(trust.detach().float().mean()) if trust.numel() else 0.0}
        if tail:
            metrics["opsd/tail_mass"] = _local_mean(s_tail.exp(), mask)
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
                   "opsd/trust_mean": float(trust.detach().float().mean()) if trust.numel() else 0.0}
    return loss, metrics


def teacher_loss(
    kind: str,
    logp: Tensor,
    trust: Tensor,
    mask: Tensor,
    *,
    teacher_logp: Tensor | None = None,
    old_logp: Tensor | None = None,
    student_support: Tensor | None = None,
    teacher_support: Tensor | None = None,
    beta: float = 5.0,
    clip: float = 2.0,
    threshold: float = 0.2,
    n_tokens: float | Tensor | None = None,
) -> tuple[Tensor, dict]:
    """The teacher term of Eq. (12) by name (``TEACHER_LOSSES``): gated (Eq. 11: teacher_logp), signed (Eq. 11b:
    teacher_logp), topk (Eq. 11c) and full (Eq. 11d): student_support and teacher_support [B,L,K] (K = V for
    full), negative (Eq. 11e: old_logp). An unknown kind or a missing input is a ValueError."""
    needs = {"gated": ("teacher_logp",), "signed": ("teacher_logp",), "topk": ("student_support", "teacher_support"),
             "full": ("student_support", "teacher_support"), "negative": ("old_logp",)}
    if kind not in needs:
        raise ValueError(f"teacher loss {kind!r}: must be one of {', '.join(TEACHER_LOSSES)}")
    given = {"teacher_logp": teacher_logp, "old_logp": old_logp, "student_support": student_support,
             "teacher_support": teacher_support}
    missing = [k for k in needs[kind] if given[k] is None]
    if missing:
        raise ValueError(f"teacher loss {kind!r} needs {', '.join(missing)}")
    if kind == "gated":
        return opsd_loss(logp, teacher_logp, trust, mask, beta=beta, n_tokens=n_tokens)
    if kind == "signed":
        return signed_teacher_loss(logp, teacher_logp, trust, mask, clip=clip, n_tokens=n_tokens)
    if kind == "negative":
        return lowprob_loss(logp, old_logp, trust, mask, threshold=threshold, n_tokens=n_tokens)
    return support_kl(student_support, teacher_support, trust, mask, tail=kind == "topk", n_tokens=n_tokens)


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
    teacher_logp: Tensor | None = None,
    trust: Tensor | None = None,
    clip_eps: float = 0.2,
    beta: float = 5.0,
    alpha: float = 0.01,
    c_kl: float = 0.01,
    c_ent: float = 0.001,
    pg_weight: float = 1.0,
    n_tokens: float | Tensor | None = None,
    pg_n_tokens: float | Tensor | None = None,
    reg_n_tokens: float | Tensor | None = None,
    teacher_kind: str = "gated",
    student_support: Tensor | None = None,
    teacher_support: Tensor | None = None,
    teacher_clip: float = 2.0,
    low_threshold: float = 0.2,
    clip_ratio_c: float | None = 3.0,
    kl_clamp: float | None = 10.0,
) -> tuple[Tensor, dict]:
    """Eq. (12) for a batch of samples of one kind:
    L = pg_weight·L_PG + α·L_OPSD + c_KL·KL_k3 − c_H·H.

    Student turns: advantages = Eq. (1), teacher_logp/trust given, pg_weight = 1.
    Skill-writing samples: advantages = A^skill (Eq. 5), teacher_logp = None, pg_weight = η —
    the PG term is then η·L_skill; adding the two calls' losses gives Eq. (12) (deviation 3).
    A term is skipped when its input is None or its coefficient is 0: entropy=None or c_ent=0 →
    no entropy bonus; ref_logp=None or c_kl=0 → no KL; no teacher (teacher_logp and teacher_support
    None) or alpha=0 → no OPSD. ``teacher_kind`` picks the teacher term's estimator (``teacher_loss``:
    gated is Eq. 11; topk and full take ``student_support`` / ``teacher_support``, negative ``old_logp``).
    With no OPSD term this is exactly the GRPO loss (tested). All tensors [B,L] except
    advantages/trust ([B] or [B,L]). Token-mean denominators (deviation 9): ``n_tokens`` for the
    OPSD term, ``pg_n_tokens`` for the PG term and ``reg_n_tokens`` for KL and entropy, each
    defaulting to ``n_tokens`` (as in ``masked_token_mean``).
    """
    pg_n = n_tokens if pg_n_tokens is None else pg_n_tokens
    reg_n = n_tokens if reg_n_tokens is None else reg_n_tokens
    pg, metrics = policy_loss(logp, old_logp, advantages, mask, clip_eps=clip_eps, n_tokens=pg_n,
                              clip_ratio_c=clip_ratio_c)
    loss = pg_weight * pg  # Eq. (12) L_PG (or η·L_skill)
    if (teacher_logp is not None or teacher_support is not None) and alpha != 0.0:
        if trust is None:
            raise ValueError("a teacher given without trust (pass ones for λ ≡ 1)")
        opsd, m = teacher_loss(teacher_kind, logp, trust, mask, teacher_logp=teacher_logp, old_logp=old_logp,
                               student_support=student_support, teacher_support=teacher_support, beta=beta,
                               clip=teacher_clip, threshold=low_threshold, n_tokens=n_tokens)
        loss = loss + alpha * opsd  # Eq. (12) α·L_OPSD (Eq. 11, or 11b-11e by teacher_kind)
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
