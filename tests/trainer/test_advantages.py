"""Group advantages against hand-worked numbers and a float64 loop reference."""

import math

import pytest
import torch

from vespo.advantages import group_advantages, zero_variance_groups


def test_hand_worked_group():
    # one group of 4 rewards [1, 0, 0, 1]: mean 0.5, unbiased std sqrt(((.5)^2 * 4) / 3) = sqrt(1/3)
    r = torch.tensor([1.0, 0.0, 0.0, 1.0])
    g = torch.zeros(4, dtype=torch.long)
    std = math.sqrt(1 / 3)
    assert torch.allclose(group_advantages(r, g, "mean"), torch.tensor([0.5, -0.5, -0.5, 0.5]))
    assert torch.allclose(group_advantages(r, g, "grpo"), torch.tensor([0.5, -0.5, -0.5, 0.5]) / (std + 1e-6))
    # rloo: 1 - mean(0, 0, 1) = 2/3 ; 0 - mean(1, 0, 1) = -2/3
    assert torch.allclose(group_advantages(r, g, "rloo"), torch.tensor([2, -2, -2, 2]) / 3.0)


@pytest.mark.parametrize("estimator", ["grpo", "mean", "rloo"])
def test_matches_loop_reference_on_random_groups(estimator):
    gen = torch.Generator().manual_seed(0)
    groups = torch.randint(0, 7, (60,), generator=gen)
    rewards = torch.rand(60, generator=gen).double()
    out = group_advantages(rewards.float(), groups, estimator).double()
    for gid in groups.unique():
        idx = (groups == gid).nonzero().flatten()
        x = rewards[idx]
        n = len(x)
        for j, i in enumerate(idx):
            if estimator == "mean":
                ref = x[j] - x.mean()
            elif estimator == "rloo":
                ref = x[j] - (x.sum() - x[j]) / (n - 1) if n > 1 else 0.0
            else:
                ref = (x[j] - x.mean()) / ((x.std() if n > 1 else 0.0) + 1e-6)
            assert float(out[i]) == pytest.approx(float(ref), rel=1e-5, abs=1e-6)


def test_identical_rewards_give_zero_and_are_flagged():
    r = torch.tensor([1.0, 1.0, 0.0, 1.0])
    g = torch.tensor([0, 0, 1, 1])
    for est in ("grpo", "mean", "rloo"):
        assert torch.equal(group_advantages(r, g, est)[:2], torch.zeros(2))
    assert zero_variance_groups(r, g).tolist() == [True, True, False, False]


def test_errors():
    with pytest.raises(ValueError, match="unknown advantage estimator 'x'"):
        group_advantages(torch.zeros(2), torch.zeros(2, dtype=torch.long), "x")
    with pytest.raises(ValueError, match=r"non-finite values at rows \[1\]"):
        group_advantages(torch.tensor([0.0, float("nan")]), torch.zeros(2, dtype=torch.long))
