"""The built-in character-level tokenizer: one token per character of ``vespo.charset.CHARSET``.

Ids 0..3 are the special tokens (pad, eos, bos, unk, in the order of ``SPECIAL_TOKENS``); the
characters follow in ``CHARSET`` order. Any other character encodes to ``<unk>``. The result is a
``PreTrainedTokenizerFast``, so it saves and loads with ``save_pretrained`` / ``from_pretrained``.
"""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from vespo.charset import BOS_TOKEN, CHARSET, EOS_TOKEN, PAD_TOKEN, SPECIAL_TOKENS, UNK_TOKEN


def char_vocab() -> dict[str, int]:
    """Token -> id: the special tokens first, then every character of the charset."""
    tokens = list(SPECIAL_TOKENS) + list(CHARSET)
    if len(set(tokens)) != len(tokens):
        raise ValueError("vespo.charset.CHARSET repeats a character or a special token")
    return {tok: i for i, tok in enumerate(tokens)}


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """A fast tokenizer with one token per character; pad/eos/bos/unk set."""
    core = Tokenizer(models.WordLevel(vocab=char_vocab(), unk_token=UNK_TOKEN))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # every char alone
    core.decoder = decoders.Fuse()  # join characters back without separators
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        bos_token=BOS_TOKEN,
        unk_token=UNK_TOKEN,
        padding_side="left",  # prompts are left-padded (the Rollout layout)
        clean_up_tokenization_spaces=False,
    )
