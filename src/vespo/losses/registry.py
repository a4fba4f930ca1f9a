"""The loss registry: name -> LossSpec(name, fn, config_cls). Add a loss by adding a file that registers.

A loss is ``fn(x: LossInputs, cfg, normalizer=None) -> LossOutput``: the checked inputs of
:func:`vespo.losses.inputs.prepare_inputs` (prepared once, by the caller), the loss's own config and
the aggregation's normalizer. A new loss is one module that defines its config (a subclass of
``BaseLossConfig``) and its function, and calls ``register`` when imported.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

_REGISTRY: dict[str, LossSpec] = {}


@dataclass(frozen=True)
class LossSpec:
    """A registered loss: ``fn(x: LossInputs, cfg, normalizer=None) -> LossOutput``.

    ``per_row``: each row's loss and gradient depend on that row alone, so micro-batches with the whole
    mini-batch's normalizer sum to the mini-batch's gradient. False for a loss that reads a statistic of
    the batch it is given (vespo_adaptive's kernel shape, m2po's mask): it adapts per call.
    """

    name: str
    fn: Callable
    config_cls: type
    per_row: bool = True


def register(spec: LossSpec) -> LossSpec:
    if spec.name in _REGISTRY:
        raise ValueError(f"loss {spec.name!r} is already registered")
    _REGISTRY[spec.name] = spec
    return spec


def loss_names() -> list[str]:
    """The registered loss names, sorted."""
    return sorted(_REGISTRY)


def get_loss(name: str) -> LossSpec:
    """The LossSpec registered under ``name``; an unknown name raises ValueError listing the choices."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown loss {name!r}; choose one of: {', '.join(loss_names())}")
    return _REGISTRY[name]
