"""Time forward + backward of every policy loss next to a plain unfused version of the same formula.

    OMP_NUM_THREADS=1 python bench/losses.py [--B 512] [--T 4096] [--repeats 5] [--device cpu]

For each loss, three timings from one run on the same inputs (float32, ragged mask, [B] advantages,
the loss's default config):
  - ours:  vespo.losses' function, with its input checks and all its diagnostics;
  - plain: the obvious eager torch code for the same formula (no validation, no diagnostics, no
           NaN-safe masking); its loss and gradient are checked against ours and the differences
           printed, so both sides compute the same thing;
  - base:  the cheapest policy gradient, -(A * logp) masked token-mean, shared by all rows.
Each time is the best of --repeats (ours and plain alternate, so load spikes hit both alike).
The goal is ours <= 2x plain.

For scale, "model step" is forward + backward of one transformer layer (hidden 1024, 16 heads,
FFN 4096, sequences of 512 tokens) timed on --proxy-tokens tokens and scaled linearly to B*T
tokens. It undercounts a real step (one layer of many, no LM head, attention at length 512 instead
of T), so the printed loss/step fractions are upper bounds.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from collections.abc import Callable

import torch
from torch import Tensor

from vespo.losses import get_loss, loss_names, prepare_inputs

LOG_W_MIN = math.log(1e-8)


def make_inputs(B: int, T: int, device: str) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(B, T, generator=g) * 3  # [B, T]
    old_logp = logp - 0.05 * torch.randn(B, T, generator=g)  # [B, T]
    lengths = torch.randint(T // 4, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]  # [B, T] bool
    adv = torch.randn(B, generator=g)  # [B]
    return {k: v.to(device) for k, v in dict(logp=logp, old_logp=old_logp, advantages=adv, mask=mask).items()}


# ---------------------------------------------------------------- plain references (the papers' formulas)


def plain_base(logp, old_logp, adv, mask, cfg):
    m = mask.to(logp.dtype)
    return -(adv[:, None] * logp * m).sum() / m.sum()


def plain_vespo(logp, old_logp, adv, mask, cfg):
    m = mask.to(logp.dtype)
    log_w = ((logp - old_logp).detach().clamp(-20, 20) * m).sum(-1).clamp(LOG_W_MIN, 20)  # [B]
    pos = adv >= 0
    k = torch.where(pos, cfg.k_pos, cfg.k_neg)
    lam = torch.where(pos, cfg.lambda_pos, cfg.lambda_neg).clamp(min=1e-4)
    phi = torch.exp(lam + k * log_w - lam * log_w.exp()).nan_to_num(0.0, 0.0, 0.0)  # [B]
    return -((phi * adv)[:, None] * logp * m).sum() / m.sum()


def plain_vespo_adaptive(logp, old_logp, adv, mask, cfg):
    """VESPO with (k, lam) per sign by the rule, each root by 60 steps of scalar bisection (host-synchronous)."""
    m = mask.to(logp.dtype)
    log_w = ((logp - old_logp).detach().clamp(-20, 20) * m).sum(-1).clamp(LOG_W_MIN, 20)  # [B]
    shape = {}
    for sign, rows, k0, lam0, c in ((1, adv >= 0, cfg.k_pos, cfg.lambda_pos, cfg.budget_pos),
                                    (-1, adv < 0, cfg.k_neg, cfg.lambda_neg, cfg.budget_neg)):
        x = log_w[rows].double()
        if len(x) < 2:
            shape[sign] = (k0, lam0)
        elif cfg.rule == "budget":
            def excess(lam):
                return (torch.softmax(k0 * x - lam * x.exp(), 0) * x.exp()).sum().item() - c
            lam = _bisect(lambda u: excess(math.exp(u)), math.log(cfg.lambda_min), math.log(cfg.lambda_max),
                          lo_first=True)
            shape[sign] = (k0, math.exp(lam))
        else:
            g = k0 * x + lam0 * (1 - x.exp())  # log phi at the base shape

            def excess(s):
                return (2 * torch.logsumexp(s * g, 0) - torch.logsumexp(2 * s * g, 0)).exp().item() / len(x) - cfg.ess_target
            s = _bisect(excess, cfg.scale_min, cfg.scale_max, lo_first=False)
            shape[sign] = (s * k0, s * lam0)
    pos = adv >= 0
    k = torch.where(pos, shape[1][0], shape[-1][0])
    lam = torch.where(pos, shape[1][1], shape[-1][1]).clamp(min=1e-4)
    phi = torch.exp(lam + k * log_w - lam * log_w.exp()).nan_to_num(0.0, 0.0, 0.0)  # [B]
    return -((phi * adv)[:, None] * logp * m).sum() / m.sum()


def _bisect(excess, lo, hi, lo_first):
    """Root of a decreasing ``excess`` in [lo, hi]; an end where the rule holds wins (lo first for the budget)."""
    f_lo, f_hi = excess(lo), excess(hi)
    if lo_first and f_lo <= 0:
        return lo
    if f_hi >= 0 and (not lo_first or f_hi > 0):
        return hi
    if f_lo < 0:
        return lo
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if excess(mid) > 0 else (lo, mid)
    return (lo + hi) / 2


def plain_grpo(logp, old_logp, adv, mask, cfg):
    m, a = mask.to(logp.dtype), adv[:, None]
    r = torch.exp((logp - old_logp).clamp(-20, 20))
    loss = torch.maximum(-a * r, -a * r.clamp(1 - cfg.eps_low, 1 + cfg.eps_high))
    loss = torch.where(a < 0, torch.minimum(loss, -a * cfg.dual_clip_c), loss)
    return (loss * m).sum() / m.sum()


def plain_gspo(logp, old_logp, adv, mask, cfg):
    m, a = mask.to(logp.dtype), adv[:, None]
    lengths = m.sum(-1, keepdim=True).clamp(min=1)
    log_s = ((logp.detach() - old_logp) * m).sum(-1, keepdim=True) / lengths  # [B, 1]
    s = torch.exp((log_s + logp - logp.detach()).clamp(max=10))  # [B, T]
    loss = torch.maximum(-a * s, -a * s.clamp(1 - cfg.eps_low, 1 + cfg.eps_high))
    return ((loss * m).sum(-1, keepdim=True) / lengths).mean()


def plain_sapo(logp, old_logp, adv, mask, cfg):
    m, a = mask.to(logp.dtype), adv[:, None]
    r = torch.exp((logp - old_logp).clamp(-20, 20))
    tau = torch.where(a > 0, cfg.tau_pos, cfg.tau_neg)
    loss = -torch.sigmoid(tau * (r - 1)) * 4 / tau * a
    return ((loss * m).sum(-1) / m.sum(-1).clamp(min=1)).mean()


def plain_cispo(logp, old_logp, adv, mask, cfg):
    m = mask.to(logp.dtype)
    w = torch.exp((logp - old_logp).clamp(-20, 20)).detach().clamp(max=1 + cfg.eps_high)
    return -(w * adv[:, None] * logp * m).sum() / m.sum()


def plain_dppo(logp, old_logp, adv, mask, cfg):
    m, a = mask.to(logp.dtype), adv[:, None]
    p, q = logp.detach().exp(), old_logp.exp()
    if cfg.divergence == "tv":
        high, low = p - q > cfg.delta_high, p - q < -cfg.delta_low
    else:
        kl = q * (old_logp - logp.detach()) + (1 - q) * torch.log((1 - q + 1e-8) / (1 - p + 1e-8))
        high, low = (kl > cfg.delta_high) & (p > q), (kl > cfg.delta_low) & (p < q)
    keep = ~torch.where(a > 0, high, low)
    w = torch.exp((logp - old_logp).clamp(-20, 20)).detach() * keep
    return -(w * a * logp * m).sum() / m.sum()


def plain_m2po(logp, old_logp, adv, mask, cfg):
    m = mask.to(logp.dtype)
    m2 = ((logp.detach() - old_logp) ** 2)[mask]  # [N]
    ordered, order = torch.sort(m2, descending=True, stable=True)
    rest = ordered.flip(0).cumsum(0).flip(0) / torch.arange(len(m2), 0, -1, device=m2.device)
    below = (rest < cfg.m2_threshold).nonzero()
    k = int(below[0]) if len(below) else len(m2) - 1
    kept = torch.zeros_like(m2, dtype=torch.bool)
    kept[order[k:]] = True
    keep = torch.zeros_like(mask)
    keep[mask] = kept
    r = torch.exp((logp - old_logp).clamp(-20, 20))
    return -(r * keep * adv[:, None] * m).sum() / m.sum()


def plain_reinforce(logp, old_logp, adv, mask, cfg):
    m = mask.to(logp.dtype)
    w = torch.exp((logp - old_logp).clamp(-20, 20)).detach()  # token-level IS, the default
    return -(w * adv[:, None] * logp * m).sum() / m.sum()


PLAIN: dict[str, Callable] = {
    "cispo": plain_cispo,
    "dppo": plain_dppo,
    "grpo": plain_grpo,
    "gspo": plain_gspo,
    "m2po": plain_m2po,
    "reinforce": plain_reinforce,
    "sapo": plain_sapo,
    "vespo": plain_vespo,
    "vespo_adaptive": plain_vespo_adaptive,
}

# ---------------------------------------------------------------- timing


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def loss_step(fn: Callable, inputs: dict[str, Tensor]) -> Callable[[], tuple[Tensor, Tensor]]:
    """One forward + backward of ``fn(logp, old_logp, advantages, mask) -> scalar`` from a fresh logp leaf."""

    def step():
        logp = inputs["logp"].detach().requires_grad_(True)
        loss = fn(logp, inputs["old_logp"], inputs["advantages"], inputs["mask"])
        loss.backward()
        return loss.detach(), logp.grad

    return step


def best_times(steps: list[Callable], repeats: int, device: str) -> list[float]:
    """Best wall time (ms) of each step over ``repeats`` rounds, the steps alternating within a round."""
    for step in steps:
        step()  # warm-up
    best = [math.inf] * len(steps)
    for _ in range(repeats):
        for i, step in enumerate(steps):
            synchronize(device)
            start = time.perf_counter()
            step()
            synchronize(device)
            best[i] = min(best[i], time.perf_counter() - start)
    return [b * 1e3 for b in best]


def model_step_ms(tokens: int, proxy_tokens: int, repeats: int, device: str) -> float:
    """One transformer layer's forward + backward, timed on proxy_tokens and scaled to ``tokens``."""
    seq = 512
    layer = torch.nn.TransformerEncoderLayer(1024, 16, 4096, dropout=0.0, batch_first=True, device=device)
    x = torch.randn(max(1, proxy_tokens // seq), seq, 1024, device=device)  # [N, L, H]

    def step():
        layer.zero_grad(set_to_none=True)
        layer(x).square().mean().backward()

    (ms,) = best_times([step], repeats, device)
    return ms * tokens / x.shape[0] / seq


def max_rel_diff(a: Tensor, b: Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


# ---------------------------------------------------------------- report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--B", type=int, default=512)
    parser.add_argument("--T", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--proxy-tokens", type=int, default=1024, help="tokens the model-step proxy is timed on")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    inputs = make_inputs(args.B, args.T, args.device)
    print(f"B={args.B} T={args.T} float32 on {args.device}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {os.cpu_count()} CPUs, load average {load()} at start")
    base_step = loss_step(lambda *a: plain_base(*a, None), inputs)
    step_ms = model_step_ms(args.B * args.T, args.proxy_tokens, min(args.repeats, 2), args.device)
    print(f"model step proxy (1 layer, hidden 1024, scaled to {args.B * args.T} tokens): {step_ms:,.0f} ms")
    print(f"{'loss':<10} {'ours ms':>8} {'plain ms':>9} {'ours/plain':>10} {'ours/base':>9} {'/ step':>8}"
          f" {'d loss':>8} {'d grad':>8}")
    for name in loss_names():
        spec = get_loss(name)
        cfg = spec.config_cls()
        ours = loss_step(lambda *a, s=spec, c=cfg: s.fn(prepare_inputs(*a), c).loss, inputs)  # checks included
        plain = loss_step(lambda *a, f=PLAIN[name], c=cfg: f(*a, c), inputs)
        (o_loss, o_grad), (p_loss, p_grad) = ours(), plain()
        ours_ms, plain_ms, base_ms = best_times([ours, plain, base_step], args.repeats, args.device)
        print(f"{name:<10} {ours_ms:8.1f} {plain_ms:9.1f} {ours_ms / plain_ms:9.2f}x {ours_ms / base_ms:8.2f}x"
              f" {ours_ms / step_ms:8.1e} {max_rel_diff(o_loss, p_loss):8.1e} {max_rel_diff(o_grad, p_grad):8.1e}")
    print(f"base = plain -(A*logp) masked token-mean, last timed {base_ms:.1f} ms; load average {load()} at end")


def load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


if __name__ == "__main__":
    main()
