"""Property tests (hypothesis): over extreme but legal inputs, losses, gradients and metrics stay finite."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vespo.losses import AGG_MODES, ROLLOUT_CORRECTION_MODES, get_loss, loss_names

from .batches import agg_kwargs, call_loss

finite = st.floats(min_value=-1e4, max_value=1e4, allow_nan=False, allow_infinity=False)
pad_values = st.sampled_from([float("nan"), float("inf"), -float("inf"), 0.0, 1e30])


@st.composite
def loss_inputs(draw):
    B, T = draw(st.integers(1, 4)), draw(st.integers(0, 6))
    cells = lambda: draw(st.lists(st.lists(finite, min_size=T, max_size=T), min_size=B, max_size=B))  # noqa: E731
    dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.bfloat16]))
    rows = draw(st.lists(st.lists(st.booleans(), min_size=T, max_size=T), min_size=B, max_size=B))
    mask = torch.tensor(rows, dtype=torch.bool).reshape(B, T)
    pad = draw(pad_values)
    tensors = [torch.tensor(cells(), dtype=torch.float64).reshape(B, T).masked_fill(~mask, pad) for _ in range(3)]
    adv = torch.tensor(draw(st.lists(st.floats(-1e3, 1e3), min_size=B, max_size=B)), dtype=torch.float64)
    return [t.to(dtype) for t in tensors] + [adv.to(dtype), mask]


@settings(max_examples=60, deadline=None)
@given(
    inputs=loss_inputs(),
    name=st.sampled_from(loss_names()),
    agg=st.sampled_from(AGG_MODES),
    rc_mode=st.sampled_from(ROLLOUT_CORRECTION_MODES),
)
def test_outputs_and_gradients_stay_finite(inputs, name, agg, rc_mode):
    logp, old_logp, rollout_logp, adv, mask = inputs
    logp = logp.requires_grad_(True)
    spec = get_loss(name)
    options = {"reject_by": "seq_mean_k3", "reject_high": 0.1} if rc_mode == "reject" else {}  # reject needs its bound
    cfg = spec.config_cls(**agg_kwargs(agg), rollout_correction={"mode": rc_mode, **options})
    out = call_loss(spec, logp, old_logp, adv, mask, cfg, rollout_logp=rollout_logp)
    (grad,) = torch.autograd.grad(out.loss, logp)
    assert torch.isfinite(out.loss)
    assert torch.isfinite(grad).all() and (grad[~mask] == 0).all()
    assert all(torch.isfinite(v) for v in out.metrics.values()), {k: v for k, v in out.metrics.items()}
