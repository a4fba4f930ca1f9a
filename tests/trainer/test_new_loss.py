"""Adding a loss is one file: this module defines a loss, registers it, and the trainer runs it by name
(``loss.name=...``, its options under ``loss.options``) with no edit anywhere else."""

from dataclasses import dataclass

import pytest

from vespo.losses import LossInputs, LossOutput
from vespo.losses.base import BaseLossConfig, check_range, finish
from vespo.losses import registry
from vespo.losses.registry import LossSpec, get_loss, loss_names, register
from vespo.metrics import read_jsonl
from vespo.trainer import train

NAME = "test_scaled_reinforce"
CALLS: list[float] = []  # the scale each call of the loss was given


@dataclass
class ScaledReinforceConfig(BaseLossConfig):
    """Plain REINFORCE times a constant."""

    scale: float = 1.0
    """Multiplies the loss and its gradient; > 0."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range("scale", self.scale, 0.0, None, lo_open=True)


def scaled_reinforce_loss(x: LossInputs, cfg: ScaledReinforceConfig, normalizer=None) -> LossOutput:
    """-scale * A * logp per token, aggregated by ``cfg.agg``."""
    CALLS.append(cfg.scale)
    weight = x.tokens.new_full((x.tokens.shape[0], 1), cfg.scale)  # [B, 1] the gradient weight
    return finish(-weight * x.adv * x.logp, weight, x, cfg, normalizer)


@pytest.fixture
def registered():
    """The loss registered as its module would on import, and taken out again after the test (other tests in the
    same process list the registry)."""
    register(LossSpec(NAME, scaled_reinforce_loss, ScaledReinforceConfig))
    yield NAME
    registry._REGISTRY.pop(NAME)


def first_update(make_cfg, out, *overrides) -> dict:
    cfg = make_cfg("staleness.n=1", "run.steps=1", *overrides, out=out)
    train(cfg)
    return read_jsonl(f"{cfg.run.out_dir}/metrics.jsonl")[0]


def test_a_loss_registered_in_a_test_module_trains_by_name(make_cfg, registered):
    """The new loss trains one real step by name with its option; its gradient is exactly a quarter of plain
    REINFORCE's on the same samples (scaling by a power of two is exact in floating point)."""
    assert NAME in loss_names() and get_loss(NAME).fn is scaled_reinforce_loss
    CALLS.clear()
    ours = first_update(make_cfg, "new", f"loss.name={NAME}", "loss.options={scale: 0.25}")
    assert CALLS == [0.25]  # one update, one loss call, with the option from the command line
    plain = first_update(make_cfg, "plain", "loss.name=reinforce", "loss.options={is_level: none}")
    assert ours["reward/mean"] == plain["reward/mean"]  # the same samples
    assert plain["optim/grad_norm"] > 0
    assert ours["optim/grad_norm"] == pytest.approx(0.25 * plain["optim/grad_norm"], rel=1e-6)
    assert ours["loss/pg_loss"] == pytest.approx(0.25 * plain["loss/pg_loss"], rel=1e-6)
