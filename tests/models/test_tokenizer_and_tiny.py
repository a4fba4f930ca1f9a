"""The character tokenizer and the tiny model factory."""

import pytest
import torch
from transformers import AutoTokenizer

from vespo.charset import CHARSET, SPECIAL_TOKENS
from vespo.models import SIZES, build_char_tokenizer, tiny_model


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def test_one_token_per_char_and_specials_first(tok):
    assert len(tok) == len(CHARSET) + len(SPECIAL_TOKENS)
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    ids = tok("ab 12", add_special_tokens=False)["input_ids"]
    # 'a' is the 11th charset char (after 10 digits) -> 4 + 10 = 14; ' ' follows the 26 letters -> 4 + 36 = 40
    assert ids == [14, 15, 40, 5, 6]
    assert tok.decode(ids) == "ab 12"


def test_every_charset_char_round_trips(tok):
    ids = tok(CHARSET, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(CHARSET) and tok.unk_token_id not in ids
    assert tok.decode(ids) == CHARSET


def test_unknown_char_is_unk_and_specials_skip(tok):
    assert tok("a\nb", add_special_tokens=False)["input_ids"] == [14, tok.unk_token_id, 15]
    assert tok.decode([14, tok.eos_token_id, tok.pad_token_id], skip_special_tokens=True) == "a"


def test_save_and_load_round_trip(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    text = "(3+4)*2=?"
    assert loaded(text)["input_ids"] == tok(text)["input_ids"]
    assert loaded.pad_token_id == tok.pad_token_id and loaded.eos_token_id == tok.eos_token_id


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen3_moe"])
def test_tiny_model_is_seeded_float32_with_tokenizer_ids(arch, tok):
    a = tiny_model(arch, "nano", tokenizer=tok, seed=3)
    b = tiny_model(arch, "nano", tokenizer=tok, seed=3)
    c = tiny_model(arch, "nano", tokenizer=tok, seed=4)
    assert all(p.dtype == torch.float32 for p in a.parameters())
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not all(torch.equal(p, q) for p, q in zip(a.parameters(), c.parameters()))
    assert (a.config.pad_token_id, a.config.eos_token_id, a.config.vocab_size) == (0, 1, len(tok))


def test_xs_preset_and_size_range(tok):
    xs = tiny_model("qwen3", "xs", vocab_size=len(tok))
    cfg = xs.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim, cfg.intermediate_size, cfg.tie_word_embeddings) == (128, 2, 4, 2, 32, 256, True)
    assert 0.25e6 < sum(p.numel() for p in xs.parameters()) < 0.35e6
    moe = tiny_model("qwen3_moe", "xs", vocab_size=len(tok))
    assert (moe.config.num_experts, moe.config.num_experts_per_tok) == (8, 2)
    assert list(SIZES) == ["nano", "xs", "s", "m"]


def test_overrides_and_bad_names(tok):
    m = tiny_model("llama", "nano", vocab_size=len(tok), num_hidden_layers=3)
    assert m.config.num_hidden_layers == 3
    with pytest.raises(ValueError, match="unknown arch 'gpt9'; choose one of: deepseek_v2, deepseek_v3, dots1, flex_olmo, glm4_moe, "
                       "glm4_moe_lite, gpt_oss, llama, mixtral, olmoe, qwen2_moe, qwen3, qwen3_5_moe, qwen3_moe, qwen3_next"):
        tiny_model("gpt9", "xs", vocab_size=57)
    with pytest.raises(ValueError, match="unknown size 'xxl'"):
        tiny_model("qwen3", "xxl", vocab_size=57)
    with pytest.raises(ValueError, match="vocab_size or tokenizer"):
        tiny_model("qwen3", "xs")
