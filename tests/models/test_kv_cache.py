"""The decoder's KV cache on the installed transformers (vespo.models.kv_cache).

The keyword is the one this transformers' forward names (``cache`` from 5.24 on, ``past_key_values``
before); on a dense model and on the hybrid linear-attention families the cache grows by the positions
run, and a cached step gives the logits of a full forward over every token; a decoder that drops the
cache it is handed is refused.
"""

import pytest
import torch
import transformers
from packaging.version import Version
from torch import nn
from transformers import DynamicCache

from vespo.models import build_char_tokenizer, tiny_model
from vespo.models.kv_cache import attention_length, cache_keyword, run_with_cache


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def test_the_keyword_is_the_installed_transformers_name(tok):
    body = tiny_model("llama", "nano", tokenizer=tok, seed=0).model
    renamed = Version(transformers.__version__).release >= (5, 24)
    assert cache_keyword(body) == ("cache" if renamed else "past_key_values")


@pytest.mark.parametrize("arch", ["llama", "qwen3_next", "qwen3_5_moe"])
def test_a_cached_step_equals_the_full_forward(tok, arch):
    model = tiny_model(arch, "nano", tokenizer=tok, seed=3)
    body = model.model
    ids = torch.tensor([tok.encode("12+34=5"), tok.encode("7*8=56+")])  # [2, 7]
    S = ids.shape[1] - 1
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        run_with_cache(body, cache, S, input_ids=ids[:, :S], use_cache=True)
        assert attention_length(cache) == S
        step = run_with_cache(body, cache, 1, input_ids=ids[:, S:], position_ids=torch.full((2, 1), S),
                              use_cache=True).last_hidden_state[:, -1]
        full = body(input_ids=ids, use_cache=False).last_hidden_state[:, -1]
    assert attention_length(cache) == S + 1
    torch.testing.assert_close(step, full, atol=1e-5, rtol=1e-5)


class DropsTheCache(nn.Module):
    """A decoder that takes the cache keyword and ignores it: what a transformers older than the keyword
    does with a name it does not know."""

    def __init__(self, body: nn.Module):
        super().__init__()
        self.body = body

    def forward(self, cache=None, past_key_values=None, **inputs):
        return self.body(**inputs)


def test_a_decoder_that_drops_the_cache_is_refused(tok):
    model = tiny_model("llama", "nano", tokenizer=tok, seed=0)
    ids = torch.tensor([tok.encode("12+3=")])
    with torch.no_grad(), pytest.raises(RuntimeError, match="DropsTheCache did not extend the KV cache"):
        run_with_cache(DropsTheCache(model.model), DynamicCache(config=model.config), ids.shape[1],
                       input_ids=ids, use_cache=True)


def test_a_decoder_without_a_cache_keyword_is_named(tok):
    class NoCache(nn.Module):
        def forward(self, input_ids):
            return input_ids

    with pytest.raises(TypeError, match="NoCache.forward takes no KV cache"):
        cache_keyword(NoCache())
