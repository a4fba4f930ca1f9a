"""load_policy / save_policy / encode_prompt on local directories."""

import pytest
import torch

from vespo.models import build_char_tokenizer, encode_prompt, load_policy, save_policy, tiny_model


def test_save_load_round_trip_gives_same_logits(tmp_path):
    tok = build_char_tokenizer()
    model = tiny_model("qwen3_moe", "nano", tokenizer=tok, seed=1)
    save_policy(model, tok, tmp_path / "policy")
    loaded, loaded_tok = load_policy(tmp_path / "policy")
    ids = torch.tensor([tok.encode("12+30=")])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
    assert loaded_tok.encode("12+30=") == tok.encode("12+30=")
    assert not loaded.training


def test_load_in_bfloat16_and_with_eager_attention(tmp_path):
    tok = build_char_tokenizer()
    save_policy(tiny_model("llama", "nano", tokenizer=tok), tok, tmp_path)
    model, _ = load_policy(tmp_path, dtype="bfloat16", attn_implementation="eager")
    assert next(model.parameters()).dtype == torch.bfloat16
    assert model.config._attn_implementation == "eager"


def test_bad_path_names_the_path(tmp_path):
    missing = tmp_path / "no_such_model"
    with pytest.raises(FileNotFoundError, match="no_such_model"):
        load_policy(missing)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="empty.*no config.json"):
        load_policy(tmp_path / "empty")


def test_tokenizer_without_pad_token_is_refused(tmp_path):
    tok = build_char_tokenizer()
    save_policy(tiny_model("qwen3", "nano", tokenizer=tok), tok, tmp_path)
    tok.pad_token = None
    tok.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="has no pad token"):
        load_policy(tmp_path)


def test_bad_dtype_lists_choices(tmp_path):
    with pytest.raises(ValueError, match="unknown dtype 'fp8'; choose one of: float32, bfloat16, float16"):
        load_policy(tmp_path, dtype="fp8")


def test_encode_prompt_text_messages_and_chat_template():
    tok = build_char_tokenizer()
    assert encode_prompt(tok, "1+2=") == tok.encode("1+2=")
    messages = [{"role": "user", "content": "1+2="}]
    assert encode_prompt(tok, messages) == tok.encode("1+2=")  # no template: the content itself
    tok.chat_template = "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }};{% endfor %}a:"
    assert encode_prompt(tok, messages) == tok.encode("u:1+2=;a:")
