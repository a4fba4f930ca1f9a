"""Activation checkpointing of the training forwards, and the KV cache that lets them share prompts under it.

    enable_checkpointing(model)     # model.gradient_checkpointing: transformers' own, non-reentrant
                                    # (activation_checkpointing_enable; gradient_checkpointing_enable before 5.x)

    prompts = PrefixCache(model.config)                         # empty: the prompt pass records into it
    out = prompts.run(body, input_ids=prompt_ids, ...)          # the body, checked to have used the cache
    rows = prompts.select(copies)                               # each row's prompt keys/values: a prefix
    out = rows.run(body, input_ids=response_ids, ...)           # attends to prefix + itself

A ``DynamicCache`` grows on every ``update``: run a layer twice (activation checkpointing recomputes
each layer in backward) and its keys are appended twice. Here ``update`` is a function of its inputs
and of the prefix fixed at construction: it returns cat(prefix, new) and keeps the prefix as it was,
so a recomputed layer sees exactly what the first run saw. The new keys and values of every layer's
last call are kept in ``written`` (differentiable: they are the layer's own tensors), from which
``select`` builds the prefix of the next pass. Transformers' checkpointing drops any cache unless a
layer declares that it only reads it (``_can_checkpoint_with_cache``), which ``enable_checkpointing``
does: vespo's training forwards pass no other cache.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from vespo.models.kv_cache import cache_keyword


class PrefixCache(DynamicCache):
    """A cache holding a fixed prefix per layer; ``update`` returns cat(prefix, new) and stores nothing."""

    def __init__(self, config, prefix: list[tuple[Tensor, Tensor]] | None = None):
        super().__init__(config=config)
        self.model_config = config
        self.written: dict[int, tuple[Tensor, Tensor]] = {}
        for layer, (keys, values) in enumerate(prefix or []):
            DynamicCache.update(self, keys, values, layer)  # [b, kv_heads, P, head_dim] each

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        self.written[layer_idx] = (key_states, value_states)
        if layer_idx >= len(self.layers) or self.layers[layer_idx].get_seq_length() == 0:
            return key_states, value_states
        layer = self.layers[layer_idx]
        return torch.cat([layer.keys, key_states], dim=-2), torch.cat([layer.values, value_states], dim=-2)

    @staticmethod
    def fits(config) -> bool:
        """Whether every layer of ``config``'s model caches keys and values (not the recurrent state of a
        linear-attention layer, which a prefix of keys cannot carry)."""
        return all(isinstance(layer, DynamicLayer) for layer in DynamicCache(config=config).layers)

    def run(self, body: nn.Module, **inputs) -> Tensor:
        """``body``'s last hidden states over ``inputs`` with this cache, checked to have gone through it.

        ``use_cache=False``: the cache is given, not to be created (transformers' checkpointing would
        otherwise turn use_cache off with a warning); a model that then ignored the given cache would
        attend to nothing before its input, so every layer's update is checked to have run."""
        self.written.clear()
        out = body(**inputs, **{cache_keyword(body): self}, use_cache=False).last_hidden_state
        if len(self.written) != len(self.layers):
            raise TypeError(f"{type(body).__name__} did not use the KV cache it was given ({len(self.written)} of "
                            f"{len(self.layers)} layers did): the shared-prompt forward needs one that does")
        return out

    def select(self, rows: Tensor) -> PrefixCache:
        """A cache whose prefix is, for each of ``rows`` [b] (indices into this pass's batch), the keys and
        values this cache's pass wrote for that row (a differentiable gather)."""
        if not self.written:
            raise ValueError("PrefixCache.select before any layer wrote to the cache: run the prefix pass first")
        prefix = [(self.written[i][0][rows], self.written[i][1][rows]) for i in range(len(self.written))]
        return PrefixCache(self.model_config, prefix)


def enable_checkpointing(model: nn.Module, replays: bool = False) -> None:
    """Turn on activation checkpointing of every decoder layer of ``model`` (transformers'
    ``gradient_checkpointing_enable``, non-reentrant) and let the layers keep vespo's ``PrefixCache``,
    which a recomputed layer reads the same way twice (``_can_checkpoint_with_cache``). Raises
    ConfigError where it cannot act: a model class without checkpointing support, or router replay
    (``replays``), whose routing a layer recomputed in backward would not see."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    from vespo.config import ConfigError

    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ConfigError(f"model.gradient_checkpointing=true: {type(model).__name__} does not support activation "
                          "checkpointing in transformers; set model.gradient_checkpointing=false")
    if replays:
        raise ConfigError("model.gradient_checkpointing=true cannot run with MoE router replay: a layer recomputed "
                          "in backward would route afresh; set rollout.router_replay=none or turn checkpointing off")
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x's name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    for module in model.modules():
        if isinstance(module, GradientCheckpointingLayer):
            module._can_checkpoint_with_cache = True
