"""Rollout correction: importance weights of the trainer's pi_old over the inference engine's pi_rollout.

The rollout engine's log-probs differ from the trainer's recompute of the same policy (other
kernels, precision, MoE routing). With rho_t = pi_old / pi_rollout per token:

    tis_token   w_t = min(rho_t, C)                       truncated, per token
    tis_seq     w_i = min(prod_t rho_t, C)                truncated, per sequence
    mis_token   w_t = rho_t if rho_t <= C else 0          masked, per token
    mis_seq     w_i = prod_t rho_t if <= C else 0         masked, per sequence
    geo_mask    w_i = 1 if geo_low <= rho_bar_i <= geo_high else 0,   rho_bar_i = exp(mean_t log rho_t)
    icepop      w_t = rho_t if icepop_low <= rho_t <= icepop_high else 0,   rho_t = exp(clamp(log rho_t, +-20))
    reject      w = 1 if the divergence statistic (reject_by: k1, k2 or k3, per token or per sequence as its sum,
                mean or max) is within its bound else 0: verl's rollout_rs rejection (:func:`reject_keep`)

``reject_by`` (with ``reject_high``, ``reject_low``) also filters the importance modes tis_*, mis_* and icepop:
w = (their weight) x (1 if the statistic is within its bound else 0), verl's rollout_is combined with rollout_rs
(compute_rollout_correction_and_rejection_mask: the IS weights times the rejected response mask), so every verl
preset that pairs a rejection with IS weights is one setting, e.g. decoupled_k3_rs_token_tis is
``{mode: tis_token, threshold: 2, reject_by: seq_mean_k3, reject_high: 0.01}``. The weights are normalized
(``batch_normalize``) before the rejection, as verl's are. VESPO adds both logs to log W: the importance part's
and log 1e-8 for each rejected token (token_*) or once for a rejected sequence (seq_*).

Each weight is an importance part (rho, or min(rho, C)) times a rejection part (the 0/1 of the mask;
1 for tis_*). geo_mask is geometric sequence masking (verl's Geo-RS presets, SkyRL's
`sequence_mask_metric=geometric`): a filter, not a reweighting. It compares log rho_bar_i (the mean token
log-ratio over the sequence's valid tokens) with log geo_low and log geo_high, so no exp is taken. Its
band is on pi_old / pi_rollout, as SkyRL's is (defaults 0.99 / 1.01, SkyRL's); verl's
`rollout_rs=seq_mean_k1` with `rollout_rs_threshold="lo_hi"` bands the inverse ratio, so it equals
geo_low = 1/hi, geo_high = 1/lo (verl's presets use "0.999_1.001"). SkyRL averages the raw token
log-ratios (the default, ``geo_token_clamp=None``); verl clamps each to +-20 first
(``geo_token_clamp=20``): a row with token log-ratios +50 and -49 has mean 0.5 under SkyRL and 0 under
verl. icepop is verl's `rollout_is="token"` with `rollout_is_threshold="lo_hi"` (presets
`decoupled_token_icepop`, `bypass_pg_token_icepop`, band 0.5 / 5), inclusive at both ends.

Where the ratio comes from (``LossInputs.bypass``):

    decoupled   mu = the trainer's recompute pi_old: rho = pi_old / pi_rollout, the whole weight applies
    bypass      mu = the engine's own log-probs (verl's bypass mode): rho = pi_theta / pi_rollout, detached.
                A loss whose own ratio pi_theta / mu is already that weight (every loss but reinforce with
                is_level=none) takes only the rejection part, as verl's bypass PPO-clip does; tis_*, which
                has none, is refused (:data:`BYPASS_TRUNCATION`). icepop is refused there too
                (:data:`BYPASS_ICEPOP`): its ratio is pi_old / pi_rollout (the paper: the two engines at theta_old)
                and bypass mode has no pi_old; verl's bypass PPO-clip drops IcePop (plain PPO), so a band on
                pi_theta / pi_rollout would be neither method. reinforce with is_level=none takes the whole weight
                (verl's bypass REINFORCE, IcePop included).

Weights are detached. Every loss but VESPO multiplies its per-token loss by w (vespo.losses.base.finish);
VESPO adds log w to its sequence log-weight log W instead (as the VESPO paper does), so a masked token
(w = 0) sends that sequence's W, and hence phi, to ~0 (a rejected token or sequence adds log 1e-8 to its
log W). A masked token or sequence stays in the aggregation's token / sequence count (verl instead drops
rejected tokens from its response mask, and so from its count). Log-weights are clamped to
[log 1e-8, 20] like VESPO's official numerics, which keeps masked weights finite in log space.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

ROLLOUT_CORRECTION_MODES: tuple[str, ...] = ("none", "tis_token", "tis_seq", "mis_token", "mis_seq", "geo_mask",
                                             "icepop", "reject")
# reject: the divergence statistic (verl's rollout_rs options), per token or per sequence (sum, mean, max)
REJECT_BY: tuple[str, ...] = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
                              "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")
TRUNCATING: tuple[str, ...] = ("tis_token", "tis_seq")  # importance part only: nothing is rejected
LOG_W_MIN = math.log(1e-8)  # official lower clamp of a log-weight
LOG_W_MAX = 20.0  # official upper clamp of a log-weight
ICEPOP_LOG_CLAMP = 20.0  # verl's SAFETY_BOUND on the token log-ratio before exp
BYPASS_TRUNCATION = (
    "rollout_correction.mode={mode} cannot act with mu = the engine's log-probs (staleness.behavior=rollout, "
    "verl's bypass mode): the loss's own ratio pi_theta/mu already is pi_theta/pi_rollout, and a truncated "
    "weight on top would count it twice; use a rejection mode (mis_token, mis_seq, geo_mask, reject), "
    "or loss reinforce with is_level=none (verl's bypass REINFORCE)"
)
BYPASS_ICEPOP = (
    "rollout_correction.mode=icepop cannot act with mu = the engine's log-probs (staleness.behavior=rollout, "
    "verl's bypass mode) on a loss with its own ratio: IcePop weighs by pi_old / pi_rollout, the two engines' ratio "
    "at the weights that sampled the batch, and with mu = pi_rollout there is no pi_old (verl's bypass PPO-clip "
    "drops IcePop: plain PPO); use staleness.behavior=recompute in sync mode (the paper's IcePop, verl's "
    "decoupled_token_icepop), or loss reinforce with is_level=none (verl's bypass REINFORCE with IcePop)"
)
BYPASS_BATCH_NORMALIZE = (
    "rollout_correction.batch_normalize cannot act with mu = the engine's log-probs (staleness.behavior=rollout, "
    "verl's bypass mode) on a loss with its own ratio: only the rejection part of the weight applies there, and a "
    "0/1 rejection is not an importance weight to normalize; use staleness.behavior=recompute, or loss reinforce "
    "with is_level=none"
)
NORMALIZABLE: tuple[str, ...] = ("tis_token", "tis_seq", "mis_token", "mis_seq", "icepop")  # importance weights
FILTERABLE: tuple[str, ...] = ("reject",) + NORMALIZABLE  # the modes reject_by applies to


@dataclass
class RolloutCorrection:
    """How to correct for the gap between the rollout engine and the trainer (pi_old / pi_rollout)."""

    mode: str = "none"
    """none | tis_token | tis_seq | mis_token | mis_seq (truncate or mask, per token or per sequence) |
    geo_mask (mask a sequence whose geometric-mean ratio leaves [geo_low, geo_high]) | icepop (zero a
    token's weight outside [icepop_low, icepop_high]) | reject (0/1 by reject_by, which also filters tis_*, mis_*
    and icepop). With mu = the engine's log-probs the ratio is pi_theta / pi_rollout and only the rejection part
    acts; tis_* and icepop are refused there (module docstring)."""
    threshold: float = 2.0
    """C: weights above it are truncated to C (tis_*) or masked to 0 (mis_*); must be > 0."""
    geo_low: float = 0.99
    """geo_mask: lower bound of the geometric-mean ratio pi_old / pi_rollout of a kept sequence; in (0, 1]."""
    geo_high: float = 1.01
    """geo_mask: upper bound of the geometric-mean ratio of a kept sequence; >= 1."""
    geo_token_clamp: float | None = None
    """geo_mask: clamp each token log-ratio to +-this before the mean; None (SkyRL's default) or 20 (verl's); > 0."""
    icepop_low: float = 0.5
    """icepop: lower bound alpha of a kept token's ratio (verl's presets: 0.5); > 0."""
    icepop_high: float = 5.0
    """icepop: upper bound beta of a kept token's ratio (verl's presets: 5.0); >= icepop_low."""
    batch_normalize: bool = False
    """Divide the weights by their mean over the call: over its valid tokens for token modes, over its rows for
    *_seq (verl's rollout_is_batch_normalize). Importance-weight modes only (tis_*, mis_*, icepop); refused with
    mu = the engine's log-probs on a loss with its own ratio (only a rejection applies there)."""
    reject_by: str | None = None
    """The divergence that rejects, verl's rollout_rs option: token_k1|k2|k3, seq_sum_k1|k2|k3,
    seq_mean_k1|k2|k3, seq_max_k2|k3 (k1 = log(pi_rollout / pi), k2 = (log r)^2 / 2, k3 = r - 1 - log r of
    r = pi / pi_rollout clamped at +-20). Required with mode=reject; optional with tis_*, mis_* and icepop
    (a rejection on top of their weight, verl's rollout_is with rollout_rs); refused with none and geo_mask."""
    reject_high: float | None = None
    """Upper bound of a kept statistic (for k1 a ratio pi_rollout / pi: exp(k1) <= reject_high); > 0.
    Required with reject_by, refused without it."""
    reject_low: float | None = None
    """With a k1 option: lower bound of the kept ratio exp(k1); None is 1 / reject_high (verl's single
    threshold). Refused with k2 / k3 (they have no lower bound) and without reject_by."""

    def __post_init__(self) -> None:
        if self.mode not in ROLLOUT_CORRECTION_MODES:
            raise ValueError(
                f"rollout_correction.mode must be one of {', '.join(ROLLOUT_CORRECTION_MODES)}; got {self.mode!r}"
            )
        if not (isinstance(self.threshold, (int, float)) and math.isfinite(self.threshold) and self.threshold > 0):
            raise ValueError(f"rollout_correction.threshold must be a finite number > 0; got {self.threshold!r}")
        if not (_real(self.geo_low) and 0 < self.geo_low <= 1):
            raise ValueError(f"rollout_correction.geo_low must be a finite number in (0, 1]; got {self.geo_low!r}")
        if not (_real(self.geo_high) and self.geo_high >= 1):
            raise ValueError(f"rollout_correction.geo_high must be a finite number >= 1; got {self.geo_high!r}")
        if self.geo_token_clamp is not None and not (_real(self.geo_token_clamp) and self.geo_token_clamp > 0):
            raise ValueError("rollout_correction.geo_token_clamp must be None or a finite number > 0; "
                             f"got {self.geo_token_clamp!r}")
        if not (_real(self.icepop_low) and self.icepop_low > 0):
            raise ValueError(f"rollout_correction.icepop_low must be a finite number > 0; got {self.icepop_low!r}")
        if not (_real(self.icepop_high) and self.icepop_high >= self.icepop_low):
            raise ValueError("rollout_correction.icepop_high must be a finite number >= icepop_low; "
                             f"got {self.icepop_high!r}")
        self._check_reject()
        if not isinstance(self.batch_normalize, bool):
            raise ValueError(f"rollout_correction.batch_normalize must be true or false; got {self.batch_normalize!r}")
        if self.batch_normalize and self.mode not in NORMALIZABLE:
            raise ValueError("rollout_correction.batch_normalize applies to importance weights "
                             f"({', '.join(NORMALIZABLE)}); mode={self.mode!r} has none to normalize")

    def _check_reject(self) -> None:
        options = {"reject_by": self.reject_by, "reject_high": self.reject_high, "reject_low": self.reject_low}
        given = [name for name, value in options.items() if value is not None]
        if self.mode not in FILTERABLE:
            if given:
                raise ValueError(f"rollout_correction.{given[0]} applies to mode {', '.join(FILTERABLE)}; "
                                 f"got mode={self.mode!r}")
            return
        if self.reject_by is None and self.mode != "reject":
            if given:
                raise ValueError(f"rollout_correction.{given[0]} cannot act without rollout_correction.reject_by "
                                 f"(the statistic it bounds); got mode={self.mode!r} with no reject_by")
            return
        if self.reject_by not in REJECT_BY:
            raise ValueError(f"rollout_correction.reject_by must be one of {', '.join(REJECT_BY)}; "
                             f"got {self.reject_by!r}")
        if self.reject_high is None:
            raise ValueError("rollout_correction.reject_high (the bound) is required with "
                             f"reject_by={self.reject_by!r}")
        if not (_real(self.reject_high) and self.reject_high > 0):
            raise ValueError(f"rollout_correction.reject_high must be a finite number > 0; got {self.reject_high!r}")
        if not self.reject_by.endswith("k1"):
            if self.reject_low is not None:
                raise ValueError(f"rollout_correction.reject_low applies to a k1 option only; got "
                                 f"reject_by={self.reject_by!r}")
            return
        if self.reject_low is None:
            self.reject_low = 1.0 / self.reject_high
        if not (_real(self.reject_low) and 0 < self.reject_low <= self.reject_high):
            raise ValueError("rollout_correction.reject_low must be a finite number in (0, reject_high]; "
                             f"got {self.reject_low!r}")


def _real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class Correction:
    """One loss call's rollout correction, computed once (:func:`correct`): the weight w a loss multiplies by,
    log w where VESPO adds it to log W, and where tis_* truncated w at C."""

    weight: Tensor  # [B, T] token modes, [B, 1] *_seq and geo_mask ([B, T] with a token_* reject_by): w, detached
    #                 (batch-normalized when asked, before the rejection)
    log_weight: Tensor | None  # the same shape: log w clamped to [log 1e-8, 20], padding 0; [B, 1] row sums with
    #                            reject_by on an importance mode; None unless asked for
    truncated: Tensor | None  # tis_*: where rho > C, [B, T] or [B, 1] bool; None for other modes


@torch.no_grad()
def correct(rollout_d: Tensor | None, mask_f: Tensor, cfg: RolloutCorrection, rejection_only: bool = False,
            log_space: bool = False) -> Correction | None:
    """The rollout correction of ``cfg.mode`` (None for none): its weight and, with ``log_space``, its log-weight.

    ``rollout_d`` is log pi_rollout - log of the policy the ratio is of, per token, 0 on padding (padding then
    gets w = 1 when C >= 1); ``mask_f`` [B, T] is the 0/1 mask. ``rejection_only``: the 0/1 rejection part alone
    (bypass mode, module docstring); tis_* and icepop then raise (:data:`BYPASS_TRUNCATION`,
    :data:`BYPASS_ICEPOP`). With ``cfg.batch_normalize``
    the weights are divided by their mean over the call (:func:`batch_mean`), and its log taken off each log w
    (per token, or once per sequence). A masked weight's log w is log 1e-8.
    """
    mode, cut = cfg.mode, None
    if mode == "none":
        return None
    if mode == "geo_mask":
        keep = geo_keep(rollout_d, mask_f, cfg)  # [B, 1]
        weight, log_w = keep.to(mask_f.dtype), torch.where(keep, 0.0, LOG_W_MIN).to(mask_f.dtype)
        return Correction(weight, log_w if log_space else None, None)
    if mode == "reject":
        keep, log_keep = _rejection(rollout_d, mask_f, cfg)
        return Correction(keep, log_keep if log_space else None, None)
    if mode == "icepop":
        log_rho, keep = icepop_keep(rollout_d, cfg, rejection_only)  # [B, T]; bypass mode raises
        weight = torch.where(keep, log_rho.exp(), log_rho.new_zeros(()))
        log_w = torch.where(keep, log_rho, torch.full_like(log_rho, LOG_W_MIN))
    else:  # tis_*, mis_*
        log_rho = _log_rho(rollout_d, cfg, rejection_only)  # [B, T] or [B, 1]
        log_c = math.log(cfg.threshold)
        if mode in TRUNCATING:
            weight, log_w, cut = torch.exp(log_rho.clamp(max=log_c)), log_rho.clamp(max=log_c), log_rho > log_c
        else:
            weight = ((log_rho <= log_c).to(mask_f.dtype) if rejection_only else
                      torch.where(log_rho <= log_c, torch.exp(log_rho.clamp(max=log_c)), log_rho.new_zeros(())))
            kept = torch.zeros_like(log_rho) if rejection_only else log_rho
            log_w = torch.where(log_rho <= log_c, kept, torch.full_like(log_rho, LOG_W_MIN))
    log_w = log_w.clamp(LOG_W_MIN, LOG_W_MAX)
    if cfg.batch_normalize:
        if rejection_only:
            raise ValueError(BYPASS_BATCH_NORMALIZE)
        mean = batch_mean(weight, mask_f)
        weight, log_w = weight / mean, log_w - mean.log()
    if log_w.shape[-1] != 1 or mask_f.shape[-1] == 1:  # token modes: padding gets 0
        log_w = log_w * mask_f  # log_w is finite, so this equals where(mask, log_w, 0)
    if cfg.reject_by is not None:  # the rejection on top: w times 0/1, log W gets both logs (summed per row)
        keep, log_keep = _rejection(rollout_d, mask_f, cfg)
        weight = weight * keep
        log_w = log_w.sum(dim=-1, keepdim=True) + log_keep.sum(dim=-1, keepdim=True)  # [B, 1]
    return Correction(weight, log_w if log_space else None, cut)


def _rejection(rollout_d: Tensor | None, mask_f: Tensor, cfg: RolloutCorrection) -> tuple[Tensor, Tensor]:
    """The 0/1 weight of ``cfg.reject_by`` ([B, T] for token_*, [B, 1] for seq_*) and its log: 0 where kept,
    log 1e-8 where rejected (once per rejected sequence; per rejected token, 0 on padding)."""
    keep = reject_keep(rollout_d, mask_f, cfg)  # [B, T] or [B, 1]
    log_keep = torch.where(keep, 0.0, LOG_W_MIN).to(mask_f.dtype)
    log_keep = log_keep * mask_f if cfg.reject_by.startswith("token") else log_keep
    return keep.to(mask_f.dtype), log_keep


def correction_weight(rollout_d: Tensor | None, mask_f: Tensor, cfg: RolloutCorrection,
                      rejection_only: bool = False) -> Tensor | None:
    """The detached weight w of :func:`correct`: [B, T] for token modes, [B, 1] for *_seq and geo_mask; None if
    mode is none."""
    correction = correct(rollout_d, mask_f, cfg, rejection_only)
    return None if correction is None else correction.weight


@torch.no_grad()
def batch_mean(weight: Tensor, mask_f: Tensor) -> Tensor:
    """verl's rollout_is_batch_normalize factor: the mean weight over the valid tokens ([B, T] weights) or over the
    rows with a valid token ([B, 1] weights); 1 where that mean is <= 1e-8 (verl leaves the weights then).  # []"""
    if weight.shape[-1] == 1 and mask_f.shape[-1] != 1:
        valid = (mask_f.sum(dim=-1, keepdim=True) > 0).to(weight.dtype)  # [B, 1]
    else:
        valid = mask_f
    mean = (weight * valid).sum() / valid.sum().clamp(min=1.0)
    return torch.where(mean > 1e-8, mean, torch.ones_like(mean))


@torch.no_grad()
def geo_keep(rollout_d: Tensor | None, mask_f: Tensor, cfg: RolloutCorrection) -> Tensor:
    """geo_mask: which sequences keep their place, log geo_low <= mean_t log rho_t <= log geo_high.  # [B, 1] bool

    ``rollout_d`` [B, T] is log pi_rollout - log rho's policy, 0 on padding; ``mask_f`` [B, T] the 0/1 mask.
    With ``cfg.geo_token_clamp`` each token's log-ratio is clamped first (verl). A row without valid
    tokens has mean 0 and is kept (it has nothing to train on anyway).
    """
    _require(rollout_d, cfg)
    d = rollout_d.detach().double()  # [B, T]
    if cfg.geo_token_clamp is not None:
        d = d.clamp(-cfg.geo_token_clamp, cfg.geo_token_clamp)
    tokens = mask_f.sum(dim=-1, keepdim=True).clamp(min=1.0)  # [B, 1]
    mean_log_rho = -d.sum(dim=-1, keepdim=True) / tokens.double()  # [B, 1]
    return (mean_log_rho >= math.log(cfg.geo_low)) & (mean_log_rho <= math.log(cfg.geo_high))


@torch.no_grad()
def reject_keep(rollout_d: Tensor | None, mask_f: Tensor, cfg: RolloutCorrection) -> Tensor:
    """reject: which tokens ([B, T], token_*) or sequences ([B, 1]) keep their place, verl's
    compute_rollout_rejection_mask for one option: the statistic of log r = clamp(log pi / pi_rollout, +-20)
    (k1 = -log r, k2 = (log r)^2 / 2, k3 = e^(log r) - 1 - log r), per token or summed / averaged / maximized over
    the row's valid tokens; k1 kept in [log reject_low, log reject_high], k2 / k3 kept <= reject_high."""
    _require(rollout_d, cfg)
    level, kind = cfg.reject_by.rsplit("_", 1)
    log_r = (-rollout_d.detach()).clamp(-ICEPOP_LOG_CLAMP, ICEPOP_LOG_CLAMP)  # [B, T]
    stat = {"k1": -log_r, "k2": 0.5 * log_r.square(), "k3": log_r.exp() - 1.0 - log_r}[kind]  # [B, T]
    valid = mask_f > 0
    if level == "seq_sum":
        stat = torch.where(valid, stat, 0.0).sum(dim=-1, keepdim=True)  # [B, 1]
    elif level == "seq_mean":
        stat = torch.where(valid, stat, 0.0).sum(dim=-1, keepdim=True) / mask_f.sum(dim=-1, keepdim=True).clamp(min=1.0)
    elif level == "seq_max":
        top = torch.where(valid, stat, -math.inf).amax(dim=-1, keepdim=True)
        stat = torch.where(valid.any(dim=-1, keepdim=True), top, 0.0)
    if kind == "k1":
        return (stat >= math.log(cfg.reject_low)) & (stat <= math.log(cfg.reject_high))
    return stat <= cfg.reject_high


@torch.no_grad()
def icepop_keep(rollout_d: Tensor | None, cfg: RolloutCorrection,
                rejection_only: bool = False) -> tuple[Tensor, Tensor]:
    """icepop: clamp(log rho_t, +-20) [B, T] and whether icepop_low <= exp(that) <= icepop_high [B, T] (verl
    compares the ratio itself with the band). ``rejection_only`` (bypass mode on a loss with its own ratio)
    raises :data:`BYPASS_ICEPOP`: rho is pi_old / pi_rollout, which that mode cannot form."""
    if rejection_only:
        raise ValueError(BYPASS_ICEPOP)
    _require(rollout_d, cfg)
    log_rho = (-rollout_d.detach()).clamp(-ICEPOP_LOG_CLAMP, ICEPOP_LOG_CLAMP)  # [B, T], 0 on padding
    rho = log_rho.exp()
    return log_rho, (rho >= cfg.icepop_low) & (rho <= cfg.icepop_high)


def _log_rho(rollout_d: Tensor | None, cfg: RolloutCorrection, rejection_only: bool = False) -> Tensor | None:
    """log rho per token [B, T], or summed per sequence [B, 1] for *_seq modes."""
    if cfg.mode == "none":
        return None
    if rejection_only and cfg.mode in TRUNCATING:
        raise ValueError(BYPASS_TRUNCATION.format(mode=cfg.mode))
    _require(rollout_d, cfg)
    log_rho = -rollout_d.detach()  # [B, T], 0 on padding
    return log_rho.sum(dim=-1, keepdim=True) if cfg.mode.endswith("_seq") else log_rho


def _require(rollout_d: Tensor | None, cfg: RolloutCorrection) -> None:
    if rollout_d is None:
        raise ValueError(f"rollout_correction.mode={cfg.mode!r} needs rollout_logp, but rollout_logp is None")
