"""Random loss inputs for the tests: ragged masks, garbage in the padding, chosen log-ratio scale."""

from __future__ import annotations

import torch

from vespo.losses import prepare_inputs
from vespo.losses.aggregation import NORM_AGG


def make_batch(B=6, T=7, scale=0.3, seed=0, dtype=torch.float64, token_adv=False, rollout=False, pad="nan"):
    """A dict of loss inputs. Row 0 is full, the last row is all-masked; padding holds ``pad`` values."""
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=g, dtype=dtype) * 3 - 0.05  # [B, T] in (-3.05, -0.05)
    old_logp = logp - scale * torch.randn(B, T, generator=g, dtype=dtype)  # [B, T]
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0], lengths[-1] = T, 0
    mask = torch.arange(T)[None, :] < lengths[:, None]  # [B, T] bool
    shape = (B, T) if token_adv else (B,)
    adv = torch.randn(shape, generator=g, dtype=dtype)
    adv[1] = -adv[1].abs() - 0.1  # at least one negative and one positive advantage
    adv[0] = adv[0].abs() + 0.1
    batch = {"logp": logp, "old_logp": old_logp, "advantages": adv, "mask": mask}
    if rollout:
        batch["rollout_logp"] = old_logp - 0.5 * torch.randn(B, T, generator=g, dtype=dtype)
    for name in ("logp", "old_logp", "rollout_logp"):
        if name in batch:
            if pad == "garbage":  # finite values far outside any real log-prob, different per tensor
                fill = 60 * torch.randn(B, T, generator=g, dtype=dtype)
                batch[name] = torch.where(mask, batch[name], fill)
            else:
                fill = {"nan": float("nan"), "-inf": -float("inf"), "zero": 0.0}[pad]
                batch[name] = batch[name].masked_fill(~mask, fill)
    return batch


def to_lists(batch):
    """The batch as nested python lists (what the float64 reference takes)."""
    return {k: v.tolist() for k, v in batch.items()}


def call_loss(spec, logp, old_logp, advantages, mask, cfg, normalizer=None, rollout_logp=None, bypass=False):
    """``spec.fn`` on the inputs prepared once by ``prepare_inputs``, as the trainer calls a loss. ``bypass``:
    old_logp is the engine's log-probs (rollout_logp is then not passed)."""
    x = prepare_inputs(logp, old_logp, advantages, mask, None if bypass else rollout_logp, bypass=bypass)
    return spec.fn(x, cfg, normalizer)


def agg_kwargs(agg, norm_length=9.0):
    """Config options for aggregation mode ``agg``: seq-mean-token-sum-norm takes its constant length C too."""
    return {"agg": agg, "norm_length": norm_length if agg == NORM_AGG else None}
