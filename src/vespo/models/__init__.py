"""Policy models: the character tokenizer, tiny model factory, loading, and response log-probs.

    logprobs.py          forward paths to the response's hidden states, response_logprobs
    chunked.py           the LM head's log-softmax in [tokens, vocab] blocks (a custom autograd kernel)
    truncation.py        top-k / top-p: the support sampling draws from, log-probs renormalised over it
    compile.py           run.compile: torch.compile of the decoder layers
    checkpointing.py     model.gradient_checkpointing, and PrefixCache: the shared prompts' keys and values
    kv_cache.py          the decoder's KV-cache keyword on every supported transformers, checked to be used

    from vespo.models import build_char_tokenizer, tiny_model, load_policy, save_policy, response_logprobs
"""

from vespo.models.checkpointing import PrefixCache, enable_checkpointing
from vespo.models.chunked import chunked_logprobs
from vespo.models.compile import compile_decoder_layers
from vespo.models.loading import build_model, encode_prompt, load_policy, resolve_dtype, save_policy
from vespo.models.logprobs import positions_from_mask, response_hidden_states, response_logprobs
from vespo.models.moe import ReplayCount, count_replay, is_moe, moe_routers, record_routing, replay_routing
from vespo.models.tiny import ARCHS, SIZES, tiny_config, tiny_model
from vespo.models.tokenizer import build_char_tokenizer, char_vocab

__all__ = [
    "ARCHS",
    "PrefixCache",
    "SIZES",
    "ReplayCount",
    "build_char_tokenizer",
    "build_model",
    "char_vocab",
    "chunked_logprobs",
    "compile_decoder_layers",
    "count_replay",
    "enable_checkpointing",
    "encode_prompt",
    "is_moe",
    "load_policy",
    "moe_routers",
    "positions_from_mask",
    "record_routing",
    "replay_routing",
    "resolve_dtype",
    "response_hidden_states",
    "response_logprobs",
    "save_policy",
    "tiny_config",
    "tiny_model",
]
