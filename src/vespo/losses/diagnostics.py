"""Diagnostics every loss returns: detached 0-dim tensors, namespaced, reduced by the caller.

    is/log_w_min|p50|p90|max   sequence log-weight log W = sum_t m (logp - old_logp), unclamped
    is/w_mean                  mean of W, with W clamped to [1e-8, e^20] (VESPO's official range)
    is/ess                     (sum W)^2 / (n sum W^2), exact in log space, in (0, 1]
    is/n_seq                   number of sequences with at least one valid token (n)
    kl/k1, kl/k3               d = old_logp - logp per valid token (clamped to +-20): mean(d), mean(e^d - 1 - d)
    rollout/k1, rollout/k3     the same with d = rollout_logp - old_logp (engine vs trainer)
    loss/clip_frac_low|high    fraction of valid tokens where the lower / upper clip binds
    vespo/phi_{pos,neg}_{mean,min,max}, vespo/n_pos, vespo/n_neg, vespo/phi_small_frac

VESPO's kernel (vespo and vespo_adaptive) also reports the weight it actually used, after the
token clamp, rollout correction, length normalization and the final clamp to [log 1e-8, 20]
(``is/*`` stays the raw log W), and the terms of the paper's variance bound per sign of A, over
the sequences s of that sign with that sign's kernel phi:

    vespo/log_w_min|p50|p90|max   the log W the kernel used
    vespo/w_ess                   ESS of that W
    vespo/eq_w_{pos,neg}          self-normalized E_Q[W] = sum_s phi_s W_s / sum_s phi_s
    vespo/phi_{pos,neg}_sum       sum_s phi_s (the normalizer of Q on the batch)
    vespo/phi_{pos,neg}_ess       (sum_s phi_s)^2 / (n sum_s phi_s^2), the ESS of the coefficients

Names follow the reduction over micro-batches, mini-batches and processes that
:func:`metric_reduction` states: *_max by max, *_min by min, *_sum by sum, n_* by sum, all else by mean.

Empty selections (no valid sequence, no A<0 sequence, ...) report 0 for every statistic and
the count key (n_seq, n_pos, n_neg) says how many entries the statistic was taken over, so no
metric is ever NaN. Quantiles use linear interpolation, as torch.quantile does. Everything is
computed without host syncs.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from vespo.losses.kernel import sign_log_phi
from vespo.losses.rollout_correction import LOG_W_MAX, LOG_W_MIN

KL_D_CLAMP = 20.0  # |d| is clamped to 20 (in k1 and k3) so that huge log-ratios keep k3 finite
PHI_SMALL = 1e-3  # phi below this counts towards vespo/phi_small_frac


def metric_reduction(name: str) -> str:
    """How a metric combines across micro-batches, mini-batches and processes: max | min | sum | mean.

    By its name: ending in ``_max`` -> max, ``_min`` -> min, ``_sum`` -> sum, a last path segment
    starting with ``n_`` (a count, e.g. ``is/n_seq``) -> sum, anything else -> mean.
    """
    if name.endswith("_max"):
        return "max"
    if name.endswith("_min"):
        return "min"
    if name.endswith("_sum") or name.rsplit("/", 1)[-1].startswith("n_"):
        return "sum"
    return "mean"


@torch.no_grad()
def masked_quantile(x: Tensor, valid: Tensor, q: float) -> Tensor:
    """The q-quantile of x[valid] (linear interpolation); 0 when nothing is valid."""
    return masked_quantiles(x, valid, (q,))[0]


@torch.no_grad()
def masked_quantiles(x: Tensor, valid: Tensor, qs: tuple[float, ...]) -> list[Tensor]:
    """The qs-quantiles of x[valid] (linear interpolation) from one sort; 0 when nothing is valid."""
    if x.numel() == 0:
        return [x.new_zeros(()) for _ in qs]
    values = torch.where(valid, x, torch.full_like(x, math.inf)).flatten().sort().values  # valid ones first
    n = torch.count_nonzero(valid)
    last = (n - 1).clamp(min=0).to(x.dtype)
    pos = torch.stack([q * last for q in qs])  # [Q] (python-float q times a tensor, as before, for equal rounding)
    lo, hi = pos.floor().long(), pos.ceil().long()
    value = values[lo] + (values[hi] - values[lo]) * (pos - lo.to(x.dtype))  # [Q]
    return list(torch.where(n > 0, value, x.new_zeros(())).unbind())


@torch.no_grad()
def masked_stats(x: Tensor, valid: Tensor, prefix: str) -> dict[str, Tensor]:
    """{prefix}_mean, _min, _max of x[valid]; all 0 when nothing is valid."""
    n = torch.count_nonzero(valid)
    zero = x.new_zeros(())
    mean = torch.where(valid, x, zero).sum() / n.clamp(min=1)
    if x.numel() == 0:
        return {f"{prefix}_mean": zero, f"{prefix}_min": zero, f"{prefix}_max": zero}
    lo = torch.where(valid, x, torch.full_like(x, math.inf)).amin()
    hi = torch.where(valid, x, torch.full_like(x, -math.inf)).amax()
    return {
        f"{prefix}_mean": mean,
        f"{prefix}_min": torch.where(n > 0, lo, zero),
        f"{prefix}_max": torch.where(n > 0, hi, zero),
    }


@torch.no_grad()
def is_metrics(log_w: Tensor, valid: Tensor) -> dict[str, Tensor]:
    """Distribution of the sequence log-weights ``log_w [B]`` over the ``valid [B]`` sequences."""
    n = torch.count_nonzero(valid)
    lw = log_w.detach()
    w = torch.where(valid, lw.clamp(LOG_W_MIN, LOG_W_MAX).exp(), lw.new_zeros(()))  # [B]
    return {
        **log_weight_quantiles(lw, valid, "is/log_w"),
        "is/w_mean": w.sum() / n.clamp(min=1),
        "is/ess": effective_sample_size(lw, valid),
        "is/n_seq": n.to(lw.dtype),
    }


@torch.no_grad()
def log_weight_quantiles(log_w: Tensor, valid: Tensor, prefix: str) -> dict[str, Tensor]:
    """{prefix}_min, _p50, _p90, _max of ``log_w [B]`` over the ``valid [B]`` entries (0 when none)."""
    q_min, q50, q90, q_max = masked_quantiles(log_w, valid, (0.0, 0.5, 0.9, 1.0))
    return {f"{prefix}_min": q_min, f"{prefix}_p50": q50, f"{prefix}_p90": q90, f"{prefix}_max": q_max}


@torch.no_grad()
def effective_sample_size(log_weights: Tensor, valid: Tensor) -> Tensor:
    """(sum w)^2 / (n sum w^2) over the last dim's valid entries, from log w, in (0, 1]; 0 when none.

    ``log_weights`` and ``valid`` broadcast; the result has their shape without the last dim.
    """
    lw = torch.where(valid, log_weights, torch.full_like(log_weights, -math.inf))
    n = valid.sum(dim=-1)
    log_n = n.clamp(min=1).to(lw.dtype).log()
    log_ess = 2 * torch.logsumexp(lw, -1) - torch.logsumexp(2 * lw, -1) - log_n
    return torch.where(n > 0, log_ess.exp(), lw.new_zeros(()))


@torch.no_grad()
def self_normalized_mean(log_weights: Tensor, x: Tensor, valid: Tensor) -> Tensor:
    """sum_i w_i x_i / sum_i w_i over the last dim's valid entries, from log w (stable); 0 when none.

    With w = phi(W) and x = W this is the batch estimate of E_Q[W] under VESPO's proposal Q.
    ``log_weights``, ``x`` and ``valid`` broadcast; the result drops the last dim.
    """
    lw = torch.where(valid, log_weights, torch.full_like(log_weights, -math.inf))
    p = torch.softmax(lw, dim=-1).nan_to_num(nan=0.0)  # an empty selection gives NaN: 0 instead
    return (p * torch.where(valid, x, x.new_zeros(()))).sum(dim=-1)


SIGN_NAMES = ("pos", "neg")  # row 0: A >= 0, row 1: A < 0


@torch.no_grad()
def kernel_metrics(log_w: Tensor, seq_valid: Tensor, groups: Tensor, k: Tensor, lam: Tensor) -> dict[str, Tensor]:
    """The log W VESPO's kernel used and the terms of the variance bound per sign of A (module docstring).

    ``log_w [B]`` is the kernel's sequence log-weight, ``seq_valid [B]`` the non-empty rows,
    ``groups [2, B]`` the sequences of each sign, ``k, lam [2]`` the (pos, neg) kernel shape used.
    Computed in float64 and returned in log_w's dtype.
    """
    x = log_w.detach().double()  # [B]
    log_phi = sign_log_phi(x, k.double(), lam.double())  # [2, B]
    eq_w = self_normalized_mean(log_phi, x.exp(), groups)  # [2]
    phi = torch.where(groups, log_phi.exp(), x.new_zeros(()))  # [2, B]
    phi_sum = phi.sum(dim=-1).nan_to_num(nan=0.0, posinf=0.0)  # [2]; phi is finite for log W <= 20
    phi_ess = effective_sample_size(log_phi, groups)  # [2]
    out = {**log_weight_quantiles(x, seq_valid, "vespo/log_w"), "vespo/w_ess": effective_sample_size(x, seq_valid)}
    for row, sign in enumerate(SIGN_NAMES):
        out[f"vespo/eq_w_{sign}"] = eq_w[row]
        out[f"vespo/phi_{sign}_sum"] = phi_sum[row]
        out[f"vespo/phi_{sign}_ess"] = phi_ess[row]
    return {key: value.to(log_w.dtype) for key, value in out.items()}


@torch.no_grad()
def kl_metrics(d: Tensor, tokens: Tensor, prefix: str) -> dict[str, Tensor]:
    """k1 = mean(d), k3 = mean(e^d - 1 - d) over valid tokens, for d [B, T] = log q - log p (0 on padding)
    and ``tokens [B]`` valid tokens per row."""
    d = d.detach().clamp(-KL_D_CLAMP, KL_D_CLAMP)  # [B, T]; padding holds 0, which adds 0 to both sums
    n = tokens.sum().clamp(min=1)
    k1_sum = d.sum()
    return {f"{prefix}/k1": k1_sum / n, f"{prefix}/k3": (torch.expm1(d).sum() - k1_sum) / n}


@torch.no_grad()
def policy_kl_metrics(clamped_log_ratio: Tensor, tokens: Tensor, out: Tensor | None = None) -> dict[str, Tensor]:
    """kl/k1 and kl/k3 from the +-20-clamped log(pi_theta / pi_old) [B, T] (0 on padding): d = -log ratio.

    The same numbers as kl_metrics(-log ratio, tokens, "kl"), without its (here idle) clamp; ``out``
    ([B, T], optional) is a scratch buffer that saves an allocation.
    """
    d = torch.neg(clamped_log_ratio, out=out) if out is not None else -clamped_log_ratio  # [B, T]
    n = tokens.sum().clamp(min=1)
    k1_sum = d.sum()
    return {"kl/k1": k1_sum / n, "kl/k3": (d.expm1_().sum() - k1_sum) / n}


@torch.no_grad()
def clip_metrics(n_low: Tensor, n_high: Tensor, tokens: Tensor) -> dict[str, Tensor]:
    """Fraction of valid tokens where the lower / upper clip bound is active, from int64 counts.

    ``tokens [B]`` holds the valid tokens per row; the fractions are int64 / int64, as count_nonzero gives.
    """
    n = token_count(tokens).clamp(min=1)
    return {"loss/clip_frac_low": n_low / n, "loss/clip_frac_high": n_high / n}


def token_count(tokens: Tensor) -> Tensor:
    """The exact number of valid tokens (int64) from the per-row float counts ``tokens [B]``."""
    return tokens.to(torch.int64).sum()


def count_selected(flags: Tensor, select: Tensor) -> Tensor:
    """int64 number of entries where the 0/1 float ``flags [B, T]`` is 1 and bool ``select`` ([B, 1] or [B, T]) holds.

    flags must be 0 on padding. Rows are summed in the float dtype (exact: a row has < 2^24 tokens).
    """
    if select.shape[-1] == 1:
        return (flags.sum(dim=-1) * select[:, 0]).to(torch.int64).sum()
    return (flags * select).sum(dim=-1).to(torch.int64).sum()


@torch.no_grad()
def phi_metrics(phi: Tensor, nonneg_adv: Tensor, valid: Tensor) -> dict[str, Tensor]:
    """VESPO's phi split by the kernel it used (A >= 0: positive pair), over the valid entries."""
    pos, neg = valid & nonneg_adv, valid & ~nonneg_adv
    small = torch.count_nonzero((phi < PHI_SMALL) & valid).to(phi.dtype) / torch.count_nonzero(valid).clamp(min=1)
    return {
        **masked_stats(phi, pos, "vespo/phi_pos"),
        **masked_stats(phi, neg, "vespo/phi_neg"),
        "vespo/n_pos": torch.count_nonzero(pos).to(phi.dtype),
        "vespo/n_neg": torch.count_nonzero(neg).to(phi.dtype),
        "vespo/phi_small_frac": small,
    }


def base_metrics(
    loss: Tensor,
    log_w: Tensor,
    seq_valid: Tensor,
    clamped_log_ratio: Tensor,
    tokens: Tensor,
    rollout_d: Tensor | None,
    scratch: Tensor | None = None,
) -> dict[str, Tensor]:
    """The metrics every loss reports: pg loss, is/*, kl/* (and rollout/* when rollout log-probs are given).

    ``clamped_log_ratio [B, T]`` is log(pi_theta / pi_old) clamped to +-20, 0 on padding;
    ``scratch`` an optional [B, T] buffer the caller no longer needs.
    """
    metrics = {"loss/pg_loss": loss.detach(), **is_metrics(log_w, seq_valid),
               **policy_kl_metrics(clamped_log_ratio, tokens, scratch)}
    if rollout_d is not None:
        metrics.update(kl_metrics(rollout_d, tokens, "rollout"))
    return metrics
