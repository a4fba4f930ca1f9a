"""decoupled_ppo (AReaL's decoupled PPO with the log-linear proximal policy) with rows at several lags and tokens of
one row at several versions (partial rollouts): the float64 reference written from AReaL's
compute_prox_logp_approximations and ppo_actor_loss_fn (tests/losses/reference.py `_decoupled_ppo`), what lags 0 and 1
and the interpolation mean by hand, a row that spans two versions worked by hand, a mutation test, and its refusals."""

from __future__ import annotations

import itertools

import pytest
import torch

from vespo.buffer import token_lags
from vespo.losses import get_loss, prepare_inputs
from vespo.types import TrainBatch

from .batches import make_batch, to_lists
from .reference import reference_loss

LAGS = torch.tensor([0.0, 1.0, 2.0, 3.0, 7.0, 1.0])  # make_batch's 6 rows (the last is empty)
OPTIONS = [{}, {"behave": "mask", "behave_high": 1.3, "behave_low": 0.8}, {"behave": "clamp", "behave_high": 1.2},
           {"eps_high": 0.28, "dual_clip_c": 3.0, "behave": "mask"}]


def run(batch, cfg, lag=None, token_lag=None):
    logp = batch["logp"].clone().requires_grad_(True)
    x = prepare_inputs(logp, batch["old_logp"], batch["advantages"], batch["mask"], bypass=True, lag=lag,
                       token_lag=token_lag)
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


def random_token_lags(batch, seed):
    """Each token's lag: row i's tokens sampled by versions v - 7 .. v, nondecreasing along the response (a partial
    rollout goes on under newer weights), garbage (-1) on padding."""
    g = torch.Generator().manual_seed(seed)
    B, T = batch["mask"].shape
    steps = torch.randint(0, 2, (B, T), generator=g).cumsum(dim=1)  # [B, T] versions gained along the row
    lag = (7 - steps).clamp(min=0).to(torch.float64)
    return torch.where(batch["mask"], lag, -1.0)


@pytest.mark.parametrize("options", OPTIONS)
def test_matches_areals_form_with_a_version_per_token(options):
    cfg = get_loss("decoupled_ppo").config_cls(**options)
    for seed, token_adv in itertools.product(range(3), (False, True)):
        batch = make_batch(scale=0.3, seed=seed, token_adv=token_adv)
        token_lag = random_token_lags(batch, seed)
        spans = [set(token_lag[i][batch["mask"][i]].tolist()) for i in range(len(token_lag))]
        assert max(len(s) for s in spans) >= 3  # rows really span versions
        out, grad = run(batch, cfg, token_lag=token_lag)
        ref_loss, ref_grad = reference_loss("decoupled_ppo", cfg=cfg, bypass=True, lag=token_lag.tolist(),
                                            **to_lists(batch))
        torch.testing.assert_close(out.loss.detach(), torch.tensor(ref_loss, dtype=torch.float64), rtol=1e-9,
                                   atol=1e-12)
        torch.testing.assert_close(grad, torch.tensor(ref_grad, dtype=torch.float64), rtol=1e-9, atol=1e-12)


def test_the_ratio_is_pi_over_mu_to_the_power_one_over_lag():
    """alpha = (L - 1) / L for L >= 1 and 0 at L = 0, log pi_prox = log mu + alpha (log pi - log mu), so
    pi / pi_prox = (pi / mu)^(1 - alpha) = (pi / mu)^(1 / L): at lags 0 and 1 the loss is PPO on pi / mu (GRPO without
    the dual clip), and lag 3 changes it."""
    batch = make_batch(scale=0.05, seed=2)  # small ratios: inside the clip, so the loss is -A r per token
    cfg = get_loss("decoupled_ppo").config_cls()
    mask, adv = batch["mask"], batch["advantages"][:, None]
    d = torch.where(mask, batch["logp"] - batch["old_logp"], 0.0)
    for lag in (0.0, 1.0, 2.0, 3.0):
        out, _ = run(batch, cfg, torch.full((6,), lag))
        r = (d / max(lag, 1.0)).exp()
        expected = torch.where(mask, -adv * r, 0.0).sum() / mask.sum()
        torch.testing.assert_close(out.loss.detach(), expected, rtol=1e-12, atol=1e-15)
    grpo = get_loss("grpo")
    plain = grpo.fn(prepare_inputs(batch["logp"], batch["old_logp"], batch["advantages"], mask),
                    grpo.config_cls(dual_clip_c=None))
    for lag in (torch.zeros(6), torch.ones(6), None):
        torch.testing.assert_close(run(batch, cfg, lag)[0].loss.detach(), plain.loss, rtol=1e-12, atol=0)


def test_a_row_that_spans_two_versions_by_hand():
    """The learner is at version 5; a row's first two tokens were sampled at version 2 (lag 3), its third at
    version 4 (lag 1: the rollout went on under newer weights), the fourth is padding. A = 1, d = log pi - log mu
    = (0.3, 0.3, 0.15), eps 0.2 (clip at 1.2), token-mean over 3 tokens.

        alpha = ((3 - 1) / 3, 2 / 3, 0)          log r = (1 - alpha) d = (0.1, 0.1, 0.15)
        r     = (1.1051709, 1.1051709, 1.1618342), all inside the clip, so l_t = -A r_t and dl_t / dlogp_t = -r_t
        L     = -(2 (1.1051709) + 1.1618342) / 3 = -1.1240587;  dL/dlogp = -r / 3 = (-0.3683903, -0.3683903, -0.3872781)

    Read at the row's oldest version (lag 3 for every token) the third token would be r = exp(0.05) = 1.0512711 and
    L = -1.0872043: what vespo computed before it read each token's version."""
    logp = torch.tensor([[-1.0, -2.0, -0.5, float("nan")]], dtype=torch.float64)
    old = logp - torch.tensor([[0.3, 0.3, 0.15, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    versions = torch.tensor([[2, 2, 4, 0]])  # the version that sampled each token, 0 on padding
    batch = TrainBatch(prompt_ids=torch.ones(1, 2, dtype=torch.long), prompt_mask=torch.ones(1, 2, dtype=torch.long),
                       response_ids=torch.ones(1, 4, dtype=torch.long), response_mask=mask, rollout_logp=old.float(),
                       rewards=torch.ones(1), advantages=torch.ones(1), group_ids=torch.zeros(1, dtype=torch.long),
                       versions=torch.tensor([2]), versions_max=torch.tensor([4]), token_versions=versions,
                       truncated=torch.zeros(1, dtype=torch.bool))
    token_lag = token_lags(batch, 5)
    assert token_lag.tolist() == [[3, 3, 1, 0]]
    inputs = {"logp": logp, "old_logp": old, "advantages": torch.ones(1, dtype=torch.float64), "mask": mask > 0}
    out, grad = run(inputs, get_loss("decoupled_ppo").config_cls(), token_lag=token_lag)
    torch.testing.assert_close(out.loss.detach(), torch.tensor(-1.1240587, dtype=torch.float64), rtol=0, atol=1e-7)
    torch.testing.assert_close(grad, torch.tensor([[-0.3683903, -0.3683903, -0.3872781, 0.0]], dtype=torch.float64),
                               rtol=0, atol=1e-7)
    oldest, _ = run(inputs, get_loss("decoupled_ppo").config_cls(), lag=5 - batch.versions)
    torch.testing.assert_close(oldest.loss.detach(), torch.tensor(-1.0872043, dtype=torch.float64), rtol=0, atol=1e-7)


def test_reference_catches_a_wrong_interpolation():
    """Mutation test: alpha taken one version off (the reference told lag + 1, which is alpha = L / (L + 1)) is
    caught."""
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
    token_lag = random_token_lags(batch, 0)
    with pytest.raises(ValueError, match="token_lag must hold finite values >= 0 on valid tokens"):
        run(batch, get_loss("decoupled_ppo").config_cls(), token_lag=-token_lag)
    with pytest.raises(ValueError, match=r"token_lag must be a tensor of shape \[B, T\]"):
        run(batch, get_loss("decoupled_ppo").config_cls(), token_lag=LAGS)
    with pytest.raises(ValueError, match="pass lag .per row. or token_lag .per token., not both"):
        run(batch, get_loss("decoupled_ppo").config_cls(), lag=LAGS, token_lag=token_lag)
