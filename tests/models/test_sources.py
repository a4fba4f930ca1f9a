"""model.path in its four forms: a local directory, a Hub id (from the Hub's own cache layout, offline),
a .gguf file, offline:NAME; and the one-line errors of each."""

from __future__ import annotations

import pytest
import torch

from vespo.errors import MissingPathError, ModelError
from vespo.models import build_char_tokenizer, load_policy, save_policy, tiny_model
from vespo.models.sources import OFFLINE_MODELS, resolve_model_dir


def _hub_snapshot(cache, repo_id: str, revision: str = "0123456789abcdef0123456789abcdef01234567"):
    """A model in huggingface_hub's cache layout (models--org--name/snapshots/REV, refs/main), as a download
    leaves it."""
    org, name = repo_id.split("/")
    root = cache / f"models--{org}--{name}"
    tok = build_char_tokenizer()
    model = tiny_model("llama", "nano", tokenizer=tok, seed=3)
    save_policy(model, tok, root / "snapshots" / revision)
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(revision)
    return model


def _offline_hub(monkeypatch, cache):
    """huggingface_hub reads its cache and offline settings once, at import: patch them where it keeps them."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


def test_a_local_directory_is_itself(tmp_path):
    assert resolve_model_dir(tmp_path) == tmp_path
    assert resolve_model_dir(str(tmp_path / "missing")) == tmp_path / "missing"  # load_policy names it missing


def test_a_hub_id_resolves_to_its_cached_snapshot(tmp_path, monkeypatch):
    _offline_hub(monkeypatch, tmp_path / "hub")
    model = _hub_snapshot(tmp_path / "hub", "vespo-test/tiny-llama")
    loaded, tokenizer = load_policy("vespo-test/tiny-llama")
    ids = torch.tensor([tokenizer.encode("12+30=")])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)


def test_an_unreachable_hub_id_is_one_clear_error(tmp_path, monkeypatch):
    _offline_hub(monkeypatch, tmp_path / "hub")
    with pytest.raises(ModelError, match="'nobody/no-such-model' is not a local directory, and the Hugging Face Hub "
                                         "could not give it"):
        load_policy("nobody/no-such-model")


def test_gguf_errors_name_the_file(tmp_path):
    with pytest.raises(MissingPathError, match="GGUF file .*absent.gguf.* not found"):
        load_policy(tmp_path / "absent.gguf")
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    with pytest.raises(ModelError, match="corrupt.gguf' cannot be read as a causal LM"):
        resolve_model_dir(corrupt)


def test_offline_catalogue_names_its_models():
    with pytest.raises(ModelError, match="unknown offline model 'gpt5'; choose one of: smollm2-135m-instruct"):
        resolve_model_dir("offline:gpt5")
    assert set(OFFLINE_MODELS) == {"smollm2-135m-instruct"}
