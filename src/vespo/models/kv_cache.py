"""Handing a KV cache to a transformers decoder, on every transformers version vespo accepts.

    out = run_with_cache(body, cache, new_positions=S, input_ids=ids, ...)   # checked: the cache grew by S

The decoder's keyword for the cache was renamed: ``cache`` from transformers 5.24 on,
``past_key_values`` before. A decoder whose forward takes ``**kwargs`` accepts the other name without a
word and drops it, so decoding would run without its cache (each step attends to nothing before
itself). ``cache_keyword`` reads the name from the forward's own signature, and ``run_with_cache``
checks after the forward that the cache really holds ``new_positions`` more positions.

Length is read on an attention layer: a hybrid model's linear-attention layers (Qwen3-Next,
Qwen3.5-MoE) carry a recurrent state, not one entry per position, and count positions differently
across transformers versions (or not at all).
"""

from __future__ import annotations

import inspect

from torch import nn
from transformers import Cache
from transformers.cache_utils import DynamicLayer

CACHE_KEYWORDS = ("cache", "past_key_values")  # transformers >= 5.24, then the earlier name

_keywords: dict[type, str] = {}


def cache_keyword(body: nn.Module) -> str:
    """The name under which ``body``'s forward takes its KV cache, read from its signature (once per class)."""
    cls = type(body)
    if cls not in _keywords:
        params = inspect.signature(cls.forward).parameters
        names = [name for name in CACHE_KEYWORDS if name in params]
        if not names:
            raise TypeError(f"{cls.__name__}.forward takes no KV cache (no parameter named "
                            f"{' or '.join(CACHE_KEYWORDS)}): vespo decodes with a cache")
        _keywords[cls] = names[0]
    return _keywords[cls]


def attention_length(cache: Cache) -> int | None:
    """Positions held by ``cache``'s first key/value layer; 0 before any layer exists, None when every
    layer is a linear-attention state (no per-position entries to count)."""
    if not cache.layers:
        return 0
    for layer in cache.layers:
        if isinstance(layer, DynamicLayer):  # full or sliding attention, alone or beside a linear state
            return int(layer.get_seq_length())
    return None


def run_with_cache(body: nn.Module, cache: Cache, new_positions: int, **inputs):
    """``body(**inputs)`` with ``cache`` under the decoder's own keyword; raises RuntimeError unless the
    cache then holds ``new_positions`` more positions than before (a cache the forward ignored)."""
    before = attention_length(cache)
    out = body(**inputs, **{cache_keyword(body): cache})
    after = attention_length(cache)
    if after is None:
        raise TypeError(f"{type(body).__name__}'s cache has no attention layer whose length vespo can check")
    if after - (before or 0) != new_positions:
        raise RuntimeError(f"{type(body).__name__} did not extend the KV cache it was given: it grew by "
                           f"{after - (before or 0)} positions over a forward of {new_positions}; decoding without "
                           "its cache would be wrong (is the installed transformers one vespo supports?)")
    return out
