"""decoupled_ppo (AReaL's decoupled PPO with the log-linear proximal policy) with rows at several lags: the float64
reference written from AReaL's compute_prox_logp_approximations and ppo_actor_loss_fn (tests/losses/reference.py
`_decoupled_ppo`), what lag 0 and the interpolation mean by hand, a mutation test, and its refusals."""

from __future__ import annotations

import itertools

import pytest
import torch

from vespo.losses import get_loss, prepare_inputs

from .batches import make_batch, to_lists
from .reference import reference_loss

LAGS = torch.tensor([0.0, 1.0, 2.0, 3.0, 7.0, 1.0])  # make_batch's 6 rows (the last is empty)
OPTIONS = [{}, {"behave": "mask", "behave_high": 1.3, "behave_low": 0.8}, {"behave": "clamp", "behave_high": 1.2},
           {"eps_high": 0.28, "dual_clip_c": 3.0, "behave": "mask"}]


def run(batch, cfg, lag):
    logp = batch["logp"].clone().requires_grad_(True)
    x = prepare_inputs(logp, batch["old_logp"], batch["advantages"], batch["mask"], bypass=True, lag=lag)
    out = get_loss("decoupled_ppo").fn(x, cfg)
    (grad,) = torch.autograd.grad(out.loss, logp)
    return out, grad


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("scale", [0.05, 0.3, 1.0])
def test_matches_areals_form_at_every_lag(options, scale):
    cfg = get_loss("decoupled_ppo").config_cls(**options)
    for seed, token_adv in itertools.product(range(2), (False, True)):
        batch = make_batch(scale=scale, seed=seed, token_adv=token_adv)
        out, grad = run(batch, cfg, LAGS)
        ref_loss, ref_grad = reference_loss("decoupled_ppo", cfg=cfg, bypass=True, lag=LAGS.tolist(),
                                            **to_lists(batch))
        torch.testing.assert_close(out.loss.detach(), torch.tensor(ref_loss, dtype=torch.float64), rtol=1e-9,
                                   atol=1e-12)
        torch.testing.assert_close(grad, torch.tensor(ref_grad, dtype=torch.float64), rtol=1e-9, atol=1e-12)


def test_the_ratio_is_pi_over_mu_to_the_power_one_over_lag_plus_one():
    """log pi_prox = log mu + L/(L+1) (log pi - log mu), so pi / pi_prox = (pi / mu)^(1/(L+1)); at lag 0 the loss is
    PPO on pi / mu (GRPO without the dual clip), and a lag changes it."""
    batch = make_batch(scale=0.05, seed=2)  # small ratios: inside the clip, so the loss is -A r per token
    cfg = get_loss("decoupled_ppo").config_cls()
    mask, adv = batch["mask"], batch["advantages"][:, None]
    d = torch.where(mask, batch["logp"] - batch["old_logp"], 0.0)
    for lag in (0.0, 1.0, 3.0):
        out, _ = run(batch, cfg, torch.full((6,), lag))
        r = (d / (lag + 1.0)).exp()
        expected = torch.where(mask, -adv * r, 0.0).sum() / mask.sum()
        torch.testing.assert_close(out.loss.detach(), expected, rtol=1e-12, atol=1e-15)
    grpo = get_loss("grpo")
    plain = grpo.fn(prepare_inputs(batch["logp"], batch["old_logp"], batch["advantages"], mask),
                    grpo.config_cls(dual_clip_c=None))
    torch.testing.assert_close(run(batch, cfg, torch.zeros(6))[0].loss.detach(), plain.loss, rtol=1e-12, atol=0)
    torch.testing.assert_close(run(batch, cfg, None)[0].loss.detach(), plain.loss, rtol=1e-12, atol=0)


def test_reference_catches_a_wrong_interpolation():
    """Mutation test: alpha = L/(L+1) taken one version off (the reference told lag + 1) is caught."""
    batch = make_batch(scale=0.5, seed=3)
    cfg = get_loss("decoupled_ppo").config_cls(behave="clamp")
    _, grad = run(batch, cfg, LAGS)
    _, wrong = reference_loss("decoupled_ppo", cfg=cfg, bypass=True, lag=(LAGS + 1).tolist(), **to_lists(batch))
    assert not torch.allclose(grad, torch.tensor(wrong, dtype=torch.float64), rtol=1e-6)


def test_the_behaviour_filter_acts_and_its_bounds_are_refused_without_it():
    batch = make_batch(scale=1.0, seed=1)
    out, _ = run(batch, get_loss("decoupled_ppo").config_cls(behave="mask", behave_high=1.2), LAGS)
    assert 0 < float(out.metrics["loss/behave_mask_frac"]) < 1
    with pytest.raises(ValueError, match="behave_high applies to behave=mask or clamp"):
        get_loss("decoupled_ppo").config_cls(behave_high=2.0)
    with pytest.raises(ValueError, match="lag must hold finite values >= 0"):
        run(batch, get_loss("decoupled_ppo").config_cls(), -LAGS)
