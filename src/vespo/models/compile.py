"""``run.compile``: torch.compile of the policy's decoder layers, or eager (with a warning) where it cannot."""

from __future__ import annotations

import warnings

import torch
from torch import nn


def compile_decoder_layers(model: nn.Module) -> bool:
    """torch.compile each decoder layer of ``model`` in place; False (and a warning) if this machine cannot.

    The layers are where the FLOPs and the many small elementwise ops are; compiling them fuses
    the norms, rotary embedding and gated MLP into a few kernels, while masks, the KV cache and the
    LM head stay eager. Shapes are dynamic (batch and length change every step), so one graph per
    layer serves every batch. A first compilation is checked on a tiny function; if it fails (no C++
    compiler, an unsupported platform), the layers stay eager.
    """
    try:
        torch.compile(lambda x: x * 2.0, dynamic=False)(torch.ones(2))
    except Exception as e:  # noqa: BLE001 - any failure means: run eager
        warnings.warn(f"torch.compile is unavailable here ({type(e).__name__}: {e}); running eager", stacklevel=2)
        return False
    for layer in _decoder_layers(model):
        layer.compile(dynamic=True)
    return True


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    body = getattr(model, model.base_model_prefix)
    layers = getattr(body, "layers", None)
    if layers is None:
        raise TypeError(f"compile_decoder_layers needs a model whose body has .layers; got {type(body).__name__}")
    return list(layers)
