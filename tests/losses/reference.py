"""Independent float64 references of every policy loss, written with the math module from the formulas of
the VESPO paper (arXiv 2602.10693) and of the baselines it compares; adaptive VESPO's rules from docs/adaptive.md;
DPPO from arXiv 2602.04879 (binary TV / KL trust-region mask), M2PO from arXiv 2510.01161 (second-moment
mask), geometric sequence masking from verl's Geo-RS / SkyRL's geometric sequence mask.

Each reference walks the batch token by token in plain Python and returns the aggregated loss and
its ANALYTIC gradient dL/dlogp_it (worked out by hand below, not by autograd), so a test comparing
it with vespo.losses checks both the forward formula and the backward pass. Inputs are nested
lists: logp, old_logp, mask [B][T]; advantages [B] or [B][T]; rollout_logp [B][T] or None.
OPSM from DeepSeek-V3.2 Eq. 9 (SPEC 7b), IcePop from verl's rollout_corr_helper, prime-rl's default loss and
Dr.GRPO's seq-mean-token-sum-norm as SPEC 7b defines them; verl's bypass mode (SPEC 7b) for mu = the engine's.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

TOKEN_CLAMP = 20.0  # token log-ratios are clamped to +-20 before exp
LOG_W_MIN, LOG_W_MAX = math.log(1e-8), 20.0  # official clamp of VESPO's log W
LOG_S_MAX = 10.0  # GSPO's token-form log ratio is clamped at 10


def reference_loss(name, logp, old_logp, advantages, mask, cfg, normalizer=None, rollout_logp=None, bypass=False,
                   lag=None):
    """(loss, grad[B][T]) of loss ``name`` under config ``cfg`` (read as plain attributes).

    ``bypass``: old_logp is the engine's log-probs, so the rollout correction's ratio is pi_theta / pi_rollout
    with pi_rollout = old_logp, and only its rejection part applies unless the loss has no ratio of its own
    (reinforce with is_level=none). The correction and OPSM are detached: they scale value and gradient alike.
    ``lag``: versions behind the learner, one per row [B] or one per token [B][T] (decoupled_ppo).
    """
    B, T = len(logp), len(logp[0]) if logp else 0
    adv = [[_adv(advantages, i, t) for t in range(T)] for i in range(B)]
    weight = _agg_weights(mask, cfg.agg, normalizer, getattr(cfg, "norm_length", None))
    own_ratio = not (name == "reinforce" and cfg.is_level == "none")
    source = SimpleNamespace(base=logp if bypass else old_logp, rollout=old_logp if bypass else rollout_logp,
                             rejection_only=bypass and own_ratio, lag=lag)
    rc = cfg.rollout_correction
    corr = _correction_weights(source, mask, rc) if not name.startswith("vespo") else None
    keep = _opsm_keep(logp, old_logp, adv, mask, getattr(cfg, "opsm_delta", None))
    per_token = TOKEN_FNS[name](logp, old_logp, adv, mask, cfg, source)
    loss, grad = 0.0, [[0.0] * T for _ in range(B)]
    for i in range(B):
        for t in range(T):
            if not mask[i][t]:
                continue
            value, dvalue = per_token[i][t]
            scale = weight[i][t] * (1.0 if corr is None else corr[i][t]) * keep[i][t]
            loss += value * scale
            grad[i][t] = dvalue * scale
    return loss, grad


def _adv(advantages, i, t):
    row = advantages[i]
    return float(row[t]) if isinstance(row, (list, tuple)) else float(row)


# ---- aggregation: the weight of token (i, t) in the scalar loss -------------------------------------


def _agg_weights(mask, mode, normalizer, norm_length=None):
    lengths = [sum(1 for m in row if m) for row in mask]
    n_tokens = normalizer if normalizer is not None else max(sum(lengths), 1)
    n_seqs = normalizer if normalizer is not None else max(sum(1 for n in lengths if n > 0), 1)
    weights = []
    for row, n in zip(mask, lengths):
        if mode == "token-mean":
            w = 1.0 / n_tokens
        elif mode == "seq-mean-token-mean":
            w = 1.0 / (max(n, 1) * n_seqs)
        elif mode == "seq-mean-token-sum-norm":  # Dr.GRPO: sequences x a constant length C
            w = 1.0 / (n_seqs * norm_length)
        else:  # seq-mean-token-sum
            w = 1.0 / n_seqs
        weights.append([w] * len(row))
    return weights


# ---- OPSM: keep unless A < 0 and the mean token log(mu / pi_theta) exceeds delta ------------------------


def _opsm_keep(logp, old_logp, adv, mask, delta):
    keep = []
    for i, row in enumerate(mask):
        d = [old_logp[i][t] - logp[i][t] for t in range(len(row)) if row[t]]
        mean = sum(d) / len(d) if d else 0.0
        keep.append([0.0 if delta is not None and adv[i][t] < 0 and mean > delta else 1.0 for t in range(len(row))])
    return keep


# ---- rollout correction: rho = pi_base / pi_rollout (pi_base = pi_old, or pi_theta in bypass mode) ------


def _log_rhos(source, mask, i):
    """log rho of each valid token of row i."""
    return [source.base[i][t] - source.rollout[i][t] for t in range(len(mask[i])) if mask[i][t]]


def _correction_weights(source, mask, rc):
    """Multiplicative per-token weight (losses other than VESPO); with batch_normalize divided by verl's batch mean
    (over the valid tokens, or for *_seq over the rows with a valid token), left alone if that mean is <= 1e-8.
    With reject_by on an importance mode, verl's compute_rollout_correction_and_rejection_mask: the (normalized)
    IS weight times the rejection's 0/1 response mask."""
    out = _raw_correction_weights(source, mask, rc)
    if out is None:
        return out
    if getattr(rc, "batch_normalize", False):
        mean = correction_batch_mean(out, mask, rc)
        out = [[w / mean for w in row] for row in out]
    if _filters(rc):
        out = [[w * (1.0 if kept else 0.0) for w, kept in zip(row, reject_kept(source, mask, rc, i))]
               for i, row in enumerate(out)]
    return out


def _filters(rc):
    """Whether a reject_by rejection sits on top of an importance mode's weight."""
    return rc.mode != "reject" and getattr(rc, "reject_by", None) is not None


def correction_batch_mean(weights, mask, rc):
    if rc.mode.endswith("_seq"):
        rows = [weights[i][0] for i in range(len(mask)) if any(mask[i])]
    else:
        rows = [weights[i][t] for i in range(len(mask)) for t in range(len(mask[i])) if mask[i][t]]
    mean = sum(rows) / max(len(rows), 1)
    return mean if mean > 1e-8 else 1.0


def _raw_correction_weights(source, mask, rc):
    B, T = len(mask), len(mask[0]) if mask else 0
    if rc.mode == "none":
        return None
    C = rc.threshold
    out = [[1.0] * T for _ in range(B)]
    for i in range(B):
        if rc.mode == "geo_mask":
            out[i] = [1.0 if geo_kept(source, mask, rc, i) else 0.0] * T
            continue
        if rc.mode == "reject":
            out[i] = [1.0 if kept else 0.0 for kept in reject_kept(source, mask, rc, i)]
            continue
        log_rhos = [source.base[i][t] - source.rollout[i][t] if mask[i][t] else 0.0 for t in range(T)]
        if rc.mode.endswith("_seq"):
            log_rhos = [sum(log_rhos)] * T
        for t in range(T):
            if rc.mode == "icepop":  # rho = pi_old / pi_rollout: bypass mode has no pi_old
                assert not source.rejection_only, "icepop in bypass mode is refused"
                rho = math.exp(min(max(log_rhos[t], -20.0), 20.0))
                out[i][t] = rho if rc.icepop_low <= rho <= rc.icepop_high else 0.0
                continue
            rho = math.exp(min(log_rhos[t], 700.0))
            if rc.mode.startswith("tis"):
                assert not source.rejection_only, "tis_* in bypass mode is refused"
                out[i][t] = min(rho, C)
            else:
                out[i][t] = (1.0 if source.rejection_only else rho) if rho <= C else 0.0
    return out


def _correction_log_w(source, mask, rc, i):
    """The term VESPO adds to log W_i: sum over tokens (or the sequence) of a clamped log weight; with
    batch_normalize minus log(batch mean) per weight."""
    total = _raw_correction_log_w(source, mask, rc, i)
    if getattr(rc, "batch_normalize", False):
        per = 1 if rc.mode.endswith("_seq") else sum(1 for m in mask[i] if m)
        total -= per * math.log(correction_batch_mean(_raw_correction_weights(source, mask, rc), mask, rc))
    if _filters(rc):  # plus the rejection's log: log 1e-8 per rejected token, or once for a rejected sequence
        kept = reject_kept(source, mask, rc, i)
        if rc.reject_by.startswith("token"):
            total += sum(LOG_W_MIN for t in range(len(kept)) if mask[i][t] and not kept[t])
        elif not kept[0]:
            total += LOG_W_MIN
    return total


def _raw_correction_log_w(source, mask, rc, i):
    if rc.mode == "none":
        return 0.0
    if rc.mode == "geo_mask":  # a masked sequence adds log 1e-8
        return 0.0 if geo_kept(source, mask, rc, i) else LOG_W_MIN
    if rc.mode == "reject":  # each rejected token, or a rejected sequence once, adds log 1e-8
        kept = reject_kept(source, mask, rc, i)
        if rc.reject_by.startswith("token"):
            return sum(0.0 if kept[t] else LOG_W_MIN for t in range(len(kept)) if mask[i][t])
        return 0.0 if kept[0] else LOG_W_MIN
    log_c = math.log(rc.threshold)
    log_rhos = _log_rhos(source, mask, i)
    if rc.mode.endswith("_seq"):
        log_rhos = [sum(log_rhos)]
    total = 0.0
    for x in log_rhos:
        if rc.mode == "icepop":
            assert not source.rejection_only, "icepop in bypass mode is refused"
            x = min(max(x, -20.0), 20.0)
            x = x if rc.icepop_low <= math.exp(x) <= rc.icepop_high else LOG_W_MIN
        elif rc.mode.startswith("tis"):
            assert not source.rejection_only, "tis_* in bypass mode is refused"
            x = min(x, log_c)
        elif x > log_c:  # mis: a masked weight is 0, i.e. log 1e-8 after the clamp
            x = LOG_W_MIN
        elif source.rejection_only:  # mis in bypass mode: only the mask
            x = 0.0
        total += min(max(x, LOG_W_MIN), LOG_W_MAX)
    return total


def reject_kept(source, mask, rc, i):
    """verl's compute_rollout_rejection_mask for one option, row i: kept per token (the row's verdict repeated for
    a sequence option). log r = clamp(log pi_base / pi_rollout, +-20); k1 = -log r, k2 = log r^2 / 2,
    k3 = r - 1 - log r."""
    level, kind = rc.reject_by.rsplit("_", 1)
    T = len(mask[i])
    stats = []
    for t in range(T):
        lr = min(max(source.base[i][t] - source.rollout[i][t], -20.0), 20.0) if mask[i][t] else 0.0
        stats.append({"k1": -lr, "k2": 0.5 * lr * lr, "k3": math.exp(lr) - 1.0 - lr}[kind])
    valid = [stats[t] for t in range(T) if mask[i][t]]
    if level != "token":
        seq = {"seq_sum": sum(valid), "seq_mean": sum(valid) / max(len(valid), 1),
               "seq_max": max(valid) if valid else 0.0}[level]
        stats = [seq] * T
    if kind == "k1":
        return [math.log(rc.reject_low) <= x <= math.log(rc.reject_high) for x in stats]
    return [x <= rc.reject_high for x in stats]


def geo_kept(source, mask, rc, i):
    """Geometric sequence masking: the geometric mean of pi_base / pi_rollout over the row in [geo_low, geo_high];
    each token's log-ratio clamped to +-geo_token_clamp first when that is set (verl)."""
    log_rhos = _log_rhos(source, mask, i)
    clamp = getattr(rc, "geo_token_clamp", None)
    if clamp is not None:
        log_rhos = [min(max(x, -clamp), clamp) for x in log_rhos]
    mean = sum(log_rhos) / len(log_rhos) if log_rhos else 0.0
    return math.log(rc.geo_low) <= mean <= math.log(rc.geo_high)


# ---- per-token (value, d value / d logp) of each loss --------------------------------------------


def _ratio(lp, olp):
    """r = exp(clamp(lr, +-20)) and dr/dlogp (0 where the clamp is active)."""
    lr = lp - olp
    r = math.exp(min(max(lr, -TOKEN_CLAMP), TOKEN_CLAMP))
    return r, (r if -TOKEN_CLAMP < lr < TOKEN_CLAMP else 0.0)


def _ppo(r, dr, A, lo, hi, dual_c):
    """max(-A r, -A clip(r, lo, hi)), then min(., -A c) for A < 0; returns (value, d/dlogp)."""
    unclipped = -A * r
    clipped = -A * min(max(r, lo), hi)
    if unclipped >= clipped:
        value, d = unclipped, -A * dr
    else:
        value, d = clipped, (-A * dr if lo < r < hi else 0.0)
    if dual_c is not None and A < 0 and value > -A * dual_c:
        value, d = -A * dual_c, 0.0
    return value, d


def _reinforce(logp, old, adv, mask, cfg, rollout):
    out = []
    for i, row in enumerate(logp):
        log_w = sum(min(max(row[t] - old[i][t], -TOKEN_CLAMP), TOKEN_CLAMP) for t in range(len(row)) if mask[i][t])
        W = math.exp(min(log_w, LOG_W_MAX))
        cells = []
        for t, lp in enumerate(row):
            r, _ = _ratio(lp, old[i][t])
            w = {"none": 1.0, "token": r, "sequence": W}[cfg.is_level]
            cells.append((-w * adv[i][t] * lp, -w * adv[i][t]))
        out.append(cells)
    return out


def _grpo(logp, old, adv, mask, cfg, rollout):
    lo, hi = 1.0 - cfg.eps_low, 1.0 + cfg.eps_high
    return [
        [_ppo(*_ratio(lp, old[i][t]), adv[i][t], lo, hi, cfg.dual_clip_c) for t, lp in enumerate(row)]
        for i, row in enumerate(logp)
    ]


def _gspo(logp, old, adv, mask, cfg, rollout):
    lo, hi = 1.0 - cfg.eps_low, 1.0 + cfg.eps_high
    out = []
    for i, row in enumerate(logp):
        n = sum(1 for m in mask[i] if m)
        log_s = sum(row[t] - old[i][t] for t in range(len(row)) if mask[i][t]) / max(n, 1)
        s = math.exp(min(log_s, LOG_S_MAX))  # token form: value s_i, d s_it / d logp_it = s_i below the clamp
        ds = s if log_s < LOG_S_MAX else 0.0
        out.append([_ppo(s, ds, adv[i][t], lo, hi, None) for t in range(len(row))])
    return out


def _sapo(logp, old, adv, mask, cfg, rollout):
    out = []
    for i, row in enumerate(logp):
        cells = []
        for t, lp in enumerate(row):
            A = adv[i][t]
            tau = cfg.tau_pos if A > 0 else cfg.tau_neg
            r, dr = _ratio(lp, old[i][t])
            sig = 1.0 / (1.0 + math.exp(-tau * (r - 1.0)))
            # d/dlogp [-A sig(tau(r-1)) 4/tau] = -A * 4/tau * tau sig (1-sig) * dr
            cells.append((-sig * 4.0 / tau * A, -A * 4.0 * sig * (1.0 - sig) * dr))
        out.append(cells)
    return out


def _cispo(logp, old, adv, mask, cfg, rollout):
    lo = -math.inf if cfg.eps_low is None else 1.0 - cfg.eps_low
    out = []
    for i, row in enumerate(logp):
        cells = []
        for t, lp in enumerate(row):
            w = min(max(_ratio(lp, old[i][t])[0], lo), 1.0 + cfg.eps_high)
            cells.append((-w * adv[i][t] * lp, -w * adv[i][t]))
        out.append(cells)
    return out


def _dppo(logp, old, adv, mask, cfg, rollout):
    """-A sg[min(r, C)] logp inside the trust region, 0 outside; the ratio is detached, so d/dlogp = -A min(r, C)."""
    out = []
    for i, row in enumerate(logp):
        cells = []
        for t, lp in enumerate(row):
            A = adv[i][t]
            w = min(_ratio(lp, old[i][t])[0], math.inf if cfg.ratio_cap is None else cfg.ratio_cap)
            if not mask[i][t] or dppo_outside(lp, old[i][t], A, cfg):
                w = 0.0
            cells.append((-A * w * lp, -A * w))
        out.append(cells)
    return out


def dppo_outside(lp, olp, A, cfg):
    """Whether the token left DPPO's trust region on the side its advantage pushes (p = pi, q = mu)."""
    p, q = math.exp(lp), math.exp(olp)
    if cfg.divergence == "tv":  # binary total variation, signed: p - q
        return p - q > cfg.delta_high if A > 0 else p - q < -cfg.delta_low
    # KL(Bernoulli(q) || Bernoulli(p)) of the sampled token against the rest of the vocabulary; undefined
    # (NaN) where a "probability" exceeds 1, which only the side's direction then decides
    tail = (1 - q + 1e-8) / (1 - p + 1e-8)
    kl = q * (olp - lp) + (1 - q) * math.log(tail) if tail > 0 else math.nan
    return (not kl <= cfg.delta_high and p > q) if A > 0 else (not kl <= cfg.delta_low and p < q)


def _m2po(logp, old, adv, mask, cfg, rollout):
    """-M r A with M the batch's second-moment mask (and 0 beyond the +-20 clamp); d/dlogp = -M A dr."""
    kept = m2po_kept(logp, old, mask, cfg.m2_threshold)
    out = []
    for i, row in enumerate(logp):
        cells = []
        for t, lp in enumerate(row):
            r, dr = _ratio(lp, old[i][t])
            beyond = abs(lp - old[i][t]) > TOKEN_CLAMP  # no gradient beyond the clamp, hence no value
            M = 1.0 if (i, t) in kept and not beyond else 0.0
            cells.append((-M * r * adv[i][t], -M * adv[i][t] * dr))
        out.append(cells)
    return out


def m2po_kept(logp, old, mask, tau):
    """The (i, t) M2PO keeps: drop the largest (log r)^2 (ties in row-major order) until the mean of the rest
    is below tau; if no such point exists, keep only the smallest."""
    tokens = [(i, t) for i in range(len(mask)) for t in range(len(mask[i])) if mask[i][t]]
    m2 = {(i, t): (logp[i][t] - old[i][t]) ** 2 for i, t in tokens}
    ordered = sorted(tokens, key=lambda it: -m2[it])  # stable: equal values keep row-major order
    for k in range(len(ordered)):
        rest = ordered[k:]
        if sum(m2[it] for it in rest) / len(rest) < tau:
            return set(rest)
    return set(ordered[-1:])


def _prime_rl(logp, old, adv, mask, cfg, rollout):
    """-keep A r + tau (log r)^2, r un-detached; d/dlogp = -keep A r + 2 tau log r. keep: inside prime-rl's
    binary-TV region (p - q > delta_high masks A > 0, p - q < -delta_low masks A <= 0) and |log r| <= 20."""
    out = []
    for i, row in enumerate(logp):
        cells = []
        for t, lp in enumerate(row):
            A, log_r = adv[i][t], lp - old[i][t]
            dp = math.exp(lp) - math.exp(old[i][t])
            outside = dp > cfg.delta_high if A > 0 else dp < -cfg.delta_low
            pg = -A * math.exp(log_r) if not outside and abs(log_r) <= TOKEN_CLAMP else 0.0
            cells.append((pg + cfg.kl_tau * log_r**2, pg + 2.0 * cfg.kl_tau * log_r))
        out.append(cells)
    return out


def _vespo(logp, old, adv, mask, cfg, rollout):
    out = []
    for i, row in enumerate(logp):
        log_w = vespo_log_w(logp, old, mask, cfg, rollout, i)
        cells = []
        for t, lp in enumerate(row):
            A = adv[i][t]
            phi = vespo_phi(log_w, A, cfg)
            cells.append((-phi * A * lp, -phi * A))
        out.append(cells)
    return out


def vespo_log_w(logp, old, mask, cfg, rollout, i):
    """The log W_i VESPO's kernel uses: token clamp, rollout correction, length norm, final clamp."""
    row = logp[i]
    n = sum(1 for m in mask[i] if m)
    if getattr(cfg, "nomu_group", None):
        old = nomu_old_logp(logp, mask, cfg.nomu_group)
    log_w = sum(min(max(row[t] - old[i][t], -TOKEN_CLAMP), TOKEN_CLAMP) for t in range(len(row)) if mask[i][t])
    log_w += _correction_log_w(rollout, mask, cfg.rollout_correction, i)
    log_w /= {"none": 1.0, "sqrt": math.sqrt(max(n, 1)), "linear": float(max(n, 1))}[cfg.length_norm]
    return min(max(log_w, LOG_W_MIN), LOG_W_MAX)


def nomu_old_logp(logp, mask, group):
    """The authors' _compute_nomu_group_mean: each row's mean token log pi (0 for an empty row), averaged over its
    group of ``group`` consecutive rows, spread over the row's tokens as old_logp = group mean / T_i."""
    lengths = [max(sum(1 for m in row if m), 1) for row in mask]
    seq_mean = [sum(lp for lp, m in zip(logp[i], mask[i]) if m) / lengths[i] for i in range(len(logp))]
    out = []
    for i in range(len(logp)):
        start = i - i % group
        g = sum(seq_mean[start:start + group]) / group
        out.append([g / lengths[i]] * len(logp[i]))
    return out


def vespo_phi(log_w, A, cfg):
    """phi(W) = W^k exp(lam (1 - W)) with the (k, lam) pair of A's sign, computed in log space."""
    k, lam = (cfg.k_pos, cfg.lambda_pos) if A >= 0 else (cfg.k_neg, cfg.lambda_neg)
    lam = max(lam, 1e-4)
    return math.exp(lam + k * log_w - lam * math.exp(log_w))


# ---- adaptive VESPO: the kernel shape per sign from the batch (docs/adaptive.md) -------------------


def _vespo_adaptive(logp, old, adv, mask, cfg, rollout):
    shape = adaptive_shape(logp, old, adv, mask, cfg, rollout)
    chosen = SimpleNamespace(k_pos=shape["pos"][0], lambda_pos=shape["pos"][1],
                             k_neg=shape["neg"][0], lambda_neg=shape["neg"][1],
                             rollout_correction=cfg.rollout_correction, length_norm=cfg.length_norm)
    return _vespo(logp, old, adv, mask, chosen, rollout)


def adaptive_shape(logp, old, adv, mask, cfg, rollout):
    """{"pos": (k, lam), "neg": (k, lam)}: each sign's shape by cfg.rule on the log W of its sequences.

    A sequence belongs to a sign if one of its valid tokens has an advantage of that sign.
    """
    base = {"pos": (cfg.k_pos, cfg.lambda_pos), "neg": (cfg.k_neg, cfg.lambda_neg)}
    budget = {"pos": cfg.budget_pos, "neg": cfg.budget_neg}
    members = {"pos": [], "neg": []}
    for i in range(len(logp)):
        signs = {("pos" if adv[i][t] >= 0 else "neg") for t in range(len(mask[i])) if mask[i][t]}
        for sign in signs:
            members[sign].append(vespo_log_w(logp, old, mask, cfg, rollout, i))
    shape = {}
    for sign, xs in members.items():
        k0, lam0 = base[sign]
        if len(xs) < 2 or min(xs) == max(xs):  # nothing to adapt to: the base shape
            shape[sign] = (k0, lam0)
        elif cfg.rule == "budget":
            # decreasing in lam; lam_min if the budget holds there, lam_max if it fails there
            g = lambda lam, xs=xs, k0=k0, c=budget[sign]: eq_w(xs, k0, lam) - c  # noqa: E731
            if g(cfg.lambda_min) <= 0:
                lam = cfg.lambda_min
            elif g(cfg.lambda_max) > 0:
                lam = cfg.lambda_max
            else:
                log_lam = bisect(lambda u, g=g: g(math.exp(u)), math.log(cfg.lambda_min), math.log(cfg.lambda_max))
                lam = math.exp(log_lam)
            shape[sign] = (k0, lam)
        else:
            # ESS of phi^s, decreasing in s; s_max if the target holds there, s_min if it fails there
            g = lambda s, xs=xs, k0=k0, lam0=lam0: ess(xs, s * k0, s * lam0) - cfg.ess_target  # noqa: E731
            if g(cfg.scale_max) >= 0:
                scale = cfg.scale_max
            elif g(cfg.scale_min) < 0:
                scale = cfg.scale_min
            else:
                scale = bisect(g, cfg.scale_min, cfg.scale_max)
            shape[sign] = (scale * k0, scale * lam0)
    return shape


def _log_phis(xs, k, lam):
    lam = max(lam, 1e-4)
    return [lam + k * x - lam * math.exp(x) for x in xs]


def eq_w(xs, k, lam):
    """Self-normalized E_Q[W] = sum phi_i W_i / sum phi_i over the log-weights xs."""
    lps = _log_phis(xs, k, lam)
    top = max(lps)
    ws = [math.exp(lp - top) for lp in lps]
    return sum(w * math.exp(x) for w, x in zip(ws, xs)) / sum(ws)


def ess(xs, k, lam):
    """(sum phi_i)^2 / (n sum phi_i^2) over the log-weights xs."""
    lps = _log_phis(xs, k, lam)
    top = max(lps)
    ws = [math.exp(lp - top) for lp in lps]
    return sum(ws) ** 2 / (len(ws) * sum(w * w for w in ws))


def bisect(g, lo, hi, iterations=200):
    """The root of a decreasing g with g(lo) > 0 >= g(hi), by plain bisection."""
    for _ in range(iterations):
        mid = (lo + hi) / 2
        if g(mid) > 0:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


# ---- the peers' newer losses (each docstring: the peer's file it follows) --------------------------------


def _dro(logp, old, adv, mask, cfg, rollout):
    """verl's compute_policy_loss_dro: -(A logp - beta/2 (log r)^2); d/dlogp = -A + beta log r."""
    return [[(-(adv[i][t] * lp - 0.5 * cfg.beta * (lp - old[i][t]) ** 2), -adv[i][t] + cfg.beta * (lp - old[i][t]))
             for t, lp in enumerate(row)] for i, row in enumerate(logp)]


def _ipo(logp, old, adv, mask, cfg, rollout):
    """prime-rl's ipo_loss_fn: -keep A r + tau (log r)^2, keep = |pi - mu| <= delta (and |log r| <= 20)."""
    out = []
    for i, row in enumerate(logp):
        cells = []
        for t, lp in enumerate(row):
            A, log_r = adv[i][t], lp - old[i][t]
            outside = abs(math.exp(lp) - math.exp(old[i][t])) > cfg.delta
            pg = -A * math.exp(log_r) if not outside and abs(log_r) <= TOKEN_CLAMP else 0.0
            cells.append((pg + cfg.kl_tau * log_r**2, pg + 2.0 * cfg.kl_tau * log_r))
        out.append(cells)
    return out


def _topr(logp, old, adv, mask, cfg, rollout):
    """ROLL's _compute_topr_loss with the split by A's sign: w = w_pos (A > 0), w_neg min(r, 1) (A <= 0)."""
    out = []
    for i, row in enumerate(logp):
        cells = []
        for t, lp in enumerate(row):
            A = adv[i][t]
            w = cfg.positive_weight if A > 0 else cfg.negative_weight * min(_ratio(lp, old[i][t])[0], 1.0)
            cells.append((-w * A * lp, -w * A))
        out.append(cells)
    return out


def _gmpo(logp, old, adv, mask, cfg, rollout):
    """verl's compute_policy_loss_geo_mean: -A_i exp(mean_t c_t), c_t the log-ratio clipped by A_t's sign, A_i the
    token mean of A. Token form: each token carries the row's value and d/dlogp_t = -A_i rho_i c'_t."""
    out = []
    for i, row in enumerate(logp):
        valid = [t for t in range(len(row)) if mask[i][t]]
        n = max(len(valid), 1)
        mean_adv = sum(adv[i][t] for t in valid) / n
        clipped, slope = {}, {}
        for t in valid:
            d, A = row[t] - old[i][t], adv[i][t]
            dc = min(max(d, -TOKEN_CLAMP), TOKEN_CLAMP)
            inside = abs(d) < TOKEN_CLAMP
            if A > 0:
                clipped[t], slope[t] = min(dc, cfg.eps_high), 1.0 if inside and dc < cfg.eps_high else 0.0
            elif A < 0:
                clipped[t], slope[t] = max(dc, -cfg.eps_low), 1.0 if inside and dc > -cfg.eps_low else 0.0
            else:
                clipped[t], slope[t] = 0.0, 0.0
        rho = math.exp(sum(clipped.values()) / n)
        out.append([(-mean_adv * rho, -mean_adv * rho * slope.get(t, 0.0)) for t in range(len(row))])
    return out


def _covariances(logp, adv, mask):
    """[(cov_j, (i, t))] over the valid tokens in row-major order: (A_j - mean A)(logp_j - mean logp)."""
    tokens = [(i, t) for i in range(len(mask)) for t in range(len(mask[i])) if mask[i][t]]
    n = max(len(tokens), 1)
    a_mean = sum(adv[i][t] for i, t in tokens) / n
    lp_mean = sum(logp[i][t] for i, t in tokens) / n
    return [((adv[i][t] - a_mean) * (logp[i][t] - lp_mean), (i, t)) for i, t in tokens]


def kl_cov_selected(logp, adv, mask, ratio):
    """verl's kl_cov selection: the max(1, floor(N ratio)) tokens of largest covariance."""
    covs = _covariances(logp, adv, mask)
    k = max(1, int(len(covs) * ratio)) if covs else 0
    return {it for _, it in sorted(covs, key=lambda c: -c[0])[:k]}


def _kl_cov(logp, old, adv, mask, cfg, rollout):
    """verl's compute_policy_loss_kl_cov: -A r, plus coef |log r| on the selected tokens."""
    chosen = kl_cov_selected(logp, adv, mask, cfg.kl_cov_ratio)
    out = []
    for i, row in enumerate(logp):
        cells = []
        for t, lp in enumerate(row):
            A, log_r = adv[i][t], lp - old[i][t]
            r, dr = _ratio(lp, old[i][t])
            value, d = -A * r, -A * dr
            if (i, t) in chosen:
                value += cfg.coef * abs(log_r)
                d += cfg.coef * (1.0 if log_r > 0 else -1.0 if log_r < 0 else 0.0)
            cells.append((value, d))
        out.append(cells)
    return out


def clip_cov_cut(logp, old, adv, mask, cfg):
    """verl's clip_cov draw: candidates (unclipped, lb < cov < ub) in row-major order, permuted by
    torch.randperm from the global generator, the first max(1, floor(N ratio)) of them."""
    import torch

    lo, hi = 1.0 - cfg.eps_low, 1.0 + cfg.eps_high
    candidates = []
    for cov, (i, t) in _covariances(logp, adv, mask):
        r, A = _ratio(logp[i][t], old[i][t])[0], adv[i][t]
        clipped = -A * min(max(r, lo), hi) > -A * r
        if not clipped and cfg.clip_cov_lb < cov < cfg.clip_cov_ub:
            candidates.append((i, t))
    n_valid = sum(1 for row in mask for m in row if m)
    count = max(int(cfg.clip_cov_ratio * n_valid), 1)
    if not candidates:
        return set()
    return {candidates[j] for j in torch.randperm(len(candidates)).tolist()[:count]}


def _clip_cov(logp, old, adv, mask, cfg, rollout):
    cut = clip_cov_cut(logp, old, adv, mask, cfg)
    lo, hi = 1.0 - cfg.eps_low, 1.0 + cfg.eps_high
    return [[(0.0, 0.0) if (i, t) in cut else _ppo(*_ratio(lp, old[i][t]), adv[i][t], lo, hi, None)
             for t, lp in enumerate(row)] for i, row in enumerate(logp)]


def _areal_alpha(lag):
    """compute_prox_logp_approximations' alpha for a token ``lag`` versions behind the learner, with AReaL's versions
    (areal/trainer/rl_trainer.py: the trainer and the rollout move to global_step + 1 after step global_step's
    update; areal/infra/remote_inf_engine.py tags each token with the rollout's version): v_theta = current_version,
    v_proximal = current_version - 1, v_behave = current_version - lag; (v_proximal - v_behave) / (v_theta - v_behave)
    where v_theta > v_behave, else 0, clamped to [0, 1]. current_version = 100 (any value gives the same)."""
    current = 100.0
    v_theta, v_prox, v_behave = current, current - 1.0, current - lag
    diff, gap = v_theta - v_behave, v_prox - v_behave
    return min(max(gap / diff if diff > 0 else 0.0, 0.0), 1.0)


def _token_lag(lag, i, t):
    """The lag of token (i, t): ``lag`` is None (0), one per row [B], or one per token [B][T]."""
    if lag is None:
        return 0.0
    row = lag[i]
    return float(row[t]) if isinstance(row, (list, tuple)) else float(row)


def _decoupled_ppo(logp, old, adv, mask, cfg, rollout):
    """AReaL's ppo_actor_loss_fn with compute_prox_logp_approximations' loglinear pi_prox: alpha from each token's
    lag (``_areal_alpha``), log pi_prox = old + alpha (logp - old) (detached), PPO-clip on r = exp(logp - log pi_prox)
    (d r / d logp = r), times the behaviour weight w = pi_prox / old when behave is mask (0 outside the bounds) or
    clamp."""
    out = []
    for i, row in enumerate(logp):
        cells = []
        for t, lp in enumerate(row):
            a = _areal_alpha(_token_lag(rollout.lag, i, t)) if mask[i][t] else 0.0
            A, d = adv[i][t], lp - old[i][t]
            lr = (1.0 - a) * d
            r = math.exp(min(max(lr, -TOKEN_CLAMP), TOKEN_CLAMP))
            value, dv = _ppo(r, r if abs(lr) <= TOKEN_CLAMP else 0.0, A, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high,
                             cfg.dual_clip_c)
            if cfg.behave != "none":
                w = math.exp(min(max(a * d, -TOKEN_CLAMP), TOKEN_CLAMP))
                low = cfg.behave_low
                if cfg.behave == "mask":
                    b = w if w <= cfg.behave_high and (low is None or w >= low) else 0.0
                else:
                    b = min(max(w, 0.0 if low is None else low), cfg.behave_high)
                value, dv = value * b, dv * b
            cells.append((value, dv))
        out.append(cells)
    return out


TOKEN_FNS = {
    "reinforce": _reinforce,
    "grpo": _grpo,
    "gspo": _gspo,
    "sapo": _sapo,
    "cispo": _cispo,
    "dppo": _dppo,
    "m2po": _m2po,
    "prime_rl": _prime_rl,
    "vespo": _vespo,
    "vespo_adaptive": _vespo_adaptive,
    "luspo": _gspo,  # GSPO's token form; the length weighting is the aggregation (seq-mean-token-sum)
    "gmpo": _gmpo,
    "dro": _dro,
    "ipo": _ipo,
    "topr": _topr,
    "kl_cov": _kl_cov,
    "clip_cov": _clip_cov,
    "decoupled_ppo": _decoupled_ppo,
}
