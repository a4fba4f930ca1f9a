"""Diagnostics that survive splitting: every loss returns per-row statistics, and metrics are formed
from the rows of the whole batch.

A loss call returns ``rows``: a dict of detached float64 tensors, each [B] (one entry per sequence).
Rows of several calls (micro-batches, data-parallel ranks) concatenate, and :func:`summarize`
turns the rows of the whole mini-batch into its metrics, so a logged ratio, ESS or quantile is the
batch's value whatever the micro-batching or the number of ranks (up to float rounding):

    rows = concat_rows([out.rows for out in micro_batch_outputs])   # or gathered over ranks
    metrics = summarize(rows)                                        # {"is/ess": tensor(...), ...}

The rows every loss reports (``base_rows``) and the metrics made of them:

    tokens, loss          loss/pg_loss = sum of each row's share of the aggregated loss
    log_w                 is/log_w_min|p50|p90|max (exact quantiles, linear interpolation),
                          is/w_mean (W clamped to [1e-8, e^20]), is/ess = (sum W)^2 / (n sum W^2),
                          is/n_seq = n, over the rows with a valid token; log W unclamped
    kl_k1, kl_k3          kl/k1, kl/k3: token means of d and e^d - 1 - d, d = old_logp - logp (clamped +-20)
    rollout_k1, _k3       rollout/k1, rollout/k3: the same with d = rollout_logp - old_logp (when given)

Every ``TOKEN_FRACTIONS`` row (a per-row count of tokens) becomes that count over all valid tokens
(loss/clip_frac_low|high, loss/dual_clip_frac, DPPO's loss/trust_mask_frac_low|high and
loss/ratio_cap_frac, M2PO's loss/m2_mask_frac, the rollout correction's rollout/masked_frac); every
``TOKEN_MEANS`` row (a per-row sum) its mean over all valid tokens. M2PO's rows:

    m2, m2_kept           m2po/m2: the batch's second moment mean (log r)^2 over all valid tokens;
                          m2po/m2_kept: the same over the tokens it kept (below its threshold)

VESPO's kernel adds its rows (``kernel_rows``):

    vespo/phi_{pos,neg}_{mean,min,max}, vespo/n_pos, vespo/n_neg, vespo/phi_small_frac
    vespo/log_w_min|p50|p90|max, vespo/w_ess      the log W the kernel used (after the token clamp,
                                                  rollout correction, length normalization, final clamp)
    vespo/eq_w_{pos,neg}     self-normalized E_Q[W] = sum_s phi_s W_s / sum_s phi_s over the sequences of a sign
    vespo/phi_{pos,neg}_sum  sum_s phi_s;   vespo/phi_{pos,neg}_ess = (sum_s phi_s)^2 / (n sum_s phi_s^2)

Empty selections (no valid sequence, no A < 0 sequence, ...) report 0 and the count key (n_seq,
n_pos, n_neg) says how many entries a statistic was taken over, so no metric is NaN.
Across the updates of a rollout step, metrics combine by their names (vespo.metrics.reduction).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from vespo.losses.kernel import log_phi as kernel_log_phi
from vespo.losses.rollout_correction import LOG_W_MAX, LOG_W_MIN

Rows = dict[str, Tensor]  # name -> [B] float64, detached; one entry per sequence

KL_D_CLAMP = 20.0  # |d| is clamped to 20 in k1 and k3 so that huge log-ratios keep k3 finite
PHI_SMALL = 1e-3  # phi below this counts towards vespo/phi_small_frac
SIGN_NAMES = ("pos", "neg")  # A >= 0, A < 0
# row name -> metric: a per-row count of tokens, reported as a fraction of all valid tokens
TOKEN_FRACTIONS = {
    "clip_low": "loss/clip_frac_low",
    "clip_high": "loss/clip_frac_high",
    "dual_clip": "loss/dual_clip_frac",
    "trust_mask_high": "loss/trust_mask_frac_high",  # DPPO, prime_rl: A > 0 tokens outside the trust region
    "trust_mask_low": "loss/trust_mask_frac_low",  # DPPO, prime_rl: A < 0 tokens outside the trust region
    "ratio_cap": "loss/ratio_cap_frac",  # DPPO: kept tokens whose ratio was truncated at ratio_cap; TOPR: A <= 0 at 1
    "cov_selected": "loss/cov_frac",
    "behave_masked": "loss/behave_mask_frac",  # decoupled_ppo: tokens whose pi_prox / mu left the bounds
    "behave_clamped": "loss/behave_clamp_frac",  # decoupled_ppo: tokens whose pi_prox / mu was clamped  # KL-Cov / Clip-Cov: the high-covariance tokens penalized / cut
    "m2_masked": "loss/m2_mask_frac",  # M2PO: tokens masked to bring the second moment under its threshold
    "rollout_masked": "rollout/masked_frac",  # rollout correction weight 0 (mis_*, geo_mask, icepop)
    "rollout_truncated": "rollout/truncated_frac",  # tis_*: rollout correction weight truncated at C
    "opsm_masked": "loss/opsm_mask_frac",  # OPSM: tokens of sequences masked as too far off-policy
}
# row name -> metric: a per-row sum over tokens, reported as a mean over all valid tokens
TOKEN_MEANS = {"kl_k1": "kl/k1", "kl_k3": "kl/k3", "rollout_k1": "rollout/k1", "rollout_k3": "rollout/k3",
               "m2": "m2po/m2"}


# ---------------------------------------------------------------- rows (per loss call)


@torch.no_grad()
def base_rows(log_ratio: Tensor, mask_f: Tensor, loss_share: Tensor, rollout_d: Tensor | None,
              engine_log_ratio: Tensor | None = None) -> Rows:
    """The rows every loss reports, from ``log_ratio [B, T]`` (0 on padding), ``mask_f [B, T]``, each token's
    share of the aggregated loss ``loss_share [B, T]``, ``rollout_d [B, T]`` and ``engine_log_ratio [B, T]``
    (log pi_theta - log pi_rollout; both None without the engine's log-probs)."""
    d = (-log_ratio.detach()).clamp(-KL_D_CLAMP, KL_D_CLAMP).double()  # [B, T], 0 on padding
    rows = {"tokens": mask_f.double().sum(dim=-1), "loss": loss_share.detach().double().sum(dim=-1),
            "log_w": log_ratio.detach().double().sum(dim=-1), **_kl_rows(d, "kl")}
    if rollout_d is not None:
        rows.update(_kl_rows(rollout_d.detach().double().clamp(-KL_D_CLAMP, KL_D_CLAMP), "rollout"))
    if engine_log_ratio is not None:
        rows["engine_log_w"] = engine_log_ratio.detach().double().sum(dim=-1)  # log pi_theta / pi_rollout per row
    return rows


def _kl_rows(d: Tensor, prefix: str) -> Rows:
    """Per-row sums of d and e^d - 1 - d for d [B, T] (0 on padding, where both terms are 0)."""
    return {f"{prefix}_k1": d.sum(dim=-1), f"{prefix}_k3": (torch.expm1(d) - d).sum(dim=-1)}


@torch.no_grad()
def token_counts(flags: Tensor, mask_f: Tensor) -> Tensor:
    """Per-row number of valid tokens where the bool ``flags`` ([B, T] or [B, 1]) hold.  # [B] float64"""
    return (flags.to(mask_f.dtype) * mask_f).double().sum(dim=-1)


@torch.no_grad()
def kernel_rows(phi: Tensor, adv: Tensor, mask: Tensor, kernel_log_w: Tensor, k: Tensor, lam: Tensor) -> Rows:
    """VESPO's rows: phi split by the sign of A, the log W the kernel used, and its shape per row.

    ``phi`` and ``adv`` are [B, 1] (sequence advantages: one entry per row) or [B, T] (token
    advantages: one entry per valid token); ``kernel_log_w [B, 1]``; ``k, lam`` [B, 2] or [2] (pos, neg).
    """
    B = phi.shape[0]
    valid = mask.any(dim=-1, keepdim=True) if phi.shape[-1] == 1 and mask.shape[-1] != 1 else mask  # like phi
    phi64, rows = phi.double(), {}
    for sign, picked in zip(SIGN_NAMES, (valid & (adv >= 0), valid & (adv < 0))):
        rows[f"phi_{sign}_n"] = picked.double().sum(dim=-1)
        rows[f"phi_{sign}_sum"] = torch.where(picked, phi64, 0.0).sum(dim=-1)
        rows[f"phi_{sign}_min"] = _row_extreme(torch.where(picked, phi64, math.inf), torch.amin, math.inf)
        rows[f"phi_{sign}_max"] = _row_extreme(torch.where(picked, phi64, -math.inf), torch.amax, -math.inf)
    rows["phi_small_n"] = (valid & (phi < PHI_SMALL)).double().sum(dim=-1)
    rows["in_pos"] = (valid & (adv >= 0)).any(dim=-1).double()  # rows in each sign's group (a row may be in both
    rows["in_neg"] = (valid & (adv < 0)).any(dim=-1).double()  # with token advantages of both signs)
    rows["kernel_log_w"] = kernel_log_w[:, 0].double()
    shape_k, shape_lam = k.double().expand(B, 2), lam.double().expand(B, 2)  # [B, 2]
    for col, sign in enumerate(SIGN_NAMES):
        rows[f"kernel_k_{sign}"] = shape_k[:, col].clone()
        rows[f"kernel_lambda_{sign}"] = shape_lam[:, col].clone()
    return rows


def _row_extreme(x: Tensor, op, empty: float) -> Tensor:
    """op (amin or amax) of each row of ``x [B, T]``; ``empty`` for a row of no entries.  # [B]"""
    return op(x, dim=-1) if x.shape[-1] else x.new_full(x.shape[:1], empty)


def concat_rows(parts: list[Rows]) -> Rows:
    """The rows of several calls (micro-batches, ranks) as one batch's; keys missing from a part are an error."""
    parts = [p for p in parts if p]
    if not parts:
        return {}
    keys = list(parts[0])
    for p in parts[1:]:
        if set(p) != set(keys):
            raise ValueError(f"rows to concatenate have different keys: {sorted(keys)} vs {sorted(p)}")
    return {k: torch.cat([p[k].reshape(-1) for p in parts]) for k in keys}


# ---------------------------------------------------------------- metrics (per batch)


@torch.no_grad()
def summarize(rows: Rows) -> dict[str, Tensor]:
    """The metrics of a batch from its rows (module docstring): detached 0-dim float64 tensors."""
    if not rows:
        return {}
    valid = rows["tokens"] > 0  # [B]
    tokens = rows["tokens"].sum().clamp(min=1.0)
    out = {"loss/pg_loss": rows["loss"].sum(), **weight_stats(rows["log_w"], valid, "is")}
    out["is/w_mean"] = _mean(rows["log_w"].clamp(LOG_W_MIN, LOG_W_MAX).exp(), valid)
    out["is/n_seq"] = valid.sum().double()
    for key, name in {**TOKEN_MEANS, **TOKEN_FRACTIONS}.items():
        if key in rows:
            out[name] = rows[key].sum() / tokens
    if "m2_kept" in rows:
        out["m2po/m2_kept"] = rows["m2_kept"].sum() / (rows["tokens"].sum() - rows["m2_masked"].sum()).clamp(min=1.0)
    if "kernel_log_w" in rows:
        out.update(_kernel_metrics(rows, valid))
    for key, value in rows.items():
        if key.startswith("adaptive/"):
            out.update(_adaptive_metric(key.removeprefix("adaptive/"), value, rows))
    return out


def weight_stats(log_w: Tensor, valid: Tensor, prefix: str) -> dict[str, Tensor]:
    """{prefix}/log_w_min|p50|p90|max and {prefix}/ess (or w_ess) of the sequence log-weights ``log_w [B]``."""
    x = log_w[valid]
    qs = torch.quantile(x, x.new_tensor([0.0, 0.5, 0.9, 1.0])) if x.numel() else x.new_zeros(4)
    ess_name = "is/ess" if prefix == "is" else f"{prefix}/w_ess"
    return {f"{prefix}/log_w_min": qs[0], f"{prefix}/log_w_p50": qs[1], f"{prefix}/log_w_p90": qs[2],
            f"{prefix}/log_w_max": qs[3], ess_name: effective_sample_size(log_w, valid)}


def _kernel_metrics(rows: Rows, valid: Tensor) -> dict[str, Tensor]:
    out = weight_stats(rows["kernel_log_w"], valid, "vespo")
    n_entries = rows["phi_pos_n"].sum() + rows["phi_neg_n"].sum()
    out["vespo/phi_small_frac"] = rows["phi_small_n"].sum() / n_entries.clamp(min=1.0)
    x = rows["kernel_log_w"]  # [B]
    for sign in SIGN_NAMES:
        n = rows[f"phi_{sign}_n"].sum()
        some = n > 0
        out[f"vespo/n_{sign}"] = n
        out[f"vespo/phi_{sign}_mean"] = rows[f"phi_{sign}_sum"].sum() / n.clamp(min=1.0)
        out[f"vespo/phi_{sign}_min"] = torch.where(some, _extreme(rows[f"phi_{sign}_min"], torch.amin), 0.0)
        out[f"vespo/phi_{sign}_max"] = torch.where(some, _extreme(rows[f"phi_{sign}_max"], torch.amax), 0.0)
        group = valid & (rows[f"in_{sign}"] > 0)  # [B]
        log_phi = kernel_log_phi(x, rows[f"kernel_k_{sign}"], rows[f"kernel_lambda_{sign}"])  # [B]
        out[f"vespo/eq_w_{sign}"] = self_normalized_mean(log_phi, x.exp(), group)
        phi = torch.where(group, log_phi.exp(), 0.0)
        out[f"vespo/phi_{sign}_sum"] = phi.sum().nan_to_num(nan=0.0, posinf=0.0)
        out[f"vespo/phi_{sign}_ess"] = effective_sample_size(log_phi, group)
    return out


def _extreme(x: Tensor, op) -> Tensor:
    return op(x) if x.numel() else x.new_zeros(())


def _adaptive_metric(name: str, value: Tensor, rows: Rows) -> dict[str, Tensor]:
    """A per-row statistic of adaptive VESPO's chosen shape (``name`` ends in _pos or _neg): its mean over the
    sequences of that sign (over all rows when the batch has none of that sign)."""
    sign = name.rsplit("_", 1)[-1]
    group = (rows[f"in_{sign}"] > 0) & (rows["tokens"] > 0) if sign in SIGN_NAMES else rows["tokens"] >= 0
    if not bool(group.any()):
        group = torch.ones_like(group)
    return {f"vespo/{name}": _mean(value, group)}


def _mean(x: Tensor, valid: Tensor) -> Tensor:
    return torch.where(valid, x, 0.0).sum() / valid.sum().clamp(min=1)


def effective_sample_size(log_weights: Tensor, valid: Tensor) -> Tensor:
    """(sum w)^2 / (n sum w^2) over the last dim's valid entries, from log w, in (0, 1]; 0 when none.

    ``log_weights`` and ``valid`` broadcast; the result has their shape without the last dim.
    """
    lw = torch.where(valid, log_weights, torch.full_like(log_weights, -math.inf))
    n = valid.sum(dim=-1)
    log_n = n.clamp(min=1).to(lw.dtype).log()
    log_ess = 2 * torch.logsumexp(lw, -1) - torch.logsumexp(2 * lw, -1) - log_n
    return torch.where(n > 0, log_ess.exp(), lw.new_zeros(()))


def self_normalized_mean(log_weights: Tensor, x: Tensor, valid: Tensor) -> Tensor:
    """sum_i w_i x_i / sum_i w_i over the last dim's valid entries, from log w (stable); 0 when none.

    With w = phi(W) and x = W this is the batch estimate of E_Q[W] under VESPO's proposal Q.
    ``log_weights``, ``x`` and ``valid`` broadcast; the result drops the last dim.
    """
    lw = torch.where(valid, log_weights, torch.full_like(log_weights, -math.inf))
    p = torch.softmax(lw, dim=-1).nan_to_num(nan=0.0)  # an empty selection gives NaN: 0 instead
    return (p * torch.where(valid, x, x.new_zeros(()))).sum(dim=-1)
