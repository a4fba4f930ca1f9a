"""Build, load and save a policy: any Hugging Face causal LM plus its tokenizer.

``build_model`` gives the policy a run starts from (a local directory, a Hub id, a GGUF file or an
offline catalogue model, resolved to a directory by ``vespo.models.sources``; or a tiny model over
the built-in character tokenizer). ``save_policy`` writes a standard Hugging Face directory
(``save_pretrained``: config.json, model.safetensors, tokenizer files) that
``AutoModelForCausalLM`` / ``AutoTokenizer`` and vLLM load without vespo. ``load_policy``
refuses a tokenizer without a pad token (it raises rather than guessing, since padding with EOS
would hide where responses end). ``encode_prompt`` renders chat messages with the tokenizer's
chat template when it has one.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from vespo.errors import FREE_AND_RESUME, DiskFullError, MissingPathError, ModelError, disk_full

if TYPE_CHECKING:
    from vespo.config import ModelConfig

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                                  "float16": torch.float16}


WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin")  # what from_pretrained loads (an index names such files)


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """'float32' / 'bfloat16' / 'float16' (or a torch dtype) -> torch dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of: {', '.join(DTYPES)}")
    return DTYPES[dtype]


def load_policy(
    path: str | Path,
    dtype: str | torch.dtype = "float32",
    attn_implementation: str | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Model (eval mode) and tokenizer from any ``model.path`` form (a local directory, a Hub id, a .gguf
    file, offline:NAME; see ``vespo.models.sources``); errors name the path."""
    from vespo.models.sources import resolve_model_dir

    torch_dtype = resolve_dtype(dtype)
    path = resolve_model_dir(path)
    if not path.is_dir():
        raise MissingPathError(f"policy path {str(path)!r} is not a directory; check the path (model.path or --model)")
    if not (path / "config.json").is_file():
        raise MissingPathError(f"policy path {str(path)!r} has no config.json (not a Hugging Face model dir); "
                               "pass the directory written by save_pretrained")
    if not any(any(path.glob(pattern)) for pattern in WEIGHT_FILES):
        raise ModelError(f"policy path {str(path)!r} has a config.json but no weights ({', '.join(WEIGHT_FILES)}); "
                         "the download or save_pretrained did not finish: pass a complete model directory")
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:
        raise ModelError(f"tokenizer at {str(path)!r} has no pad token; set tokenizer.pad_token and save it again")
    kwargs: dict[str, Any] = {"dtype": torch_dtype}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    return model.eval(), tokenizer


def build_model(model_cfg: ModelConfig, seed: int) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """(model, tokenizer) a run starts from: ``model_cfg.path`` (a local directory, a Hub id, a .gguf file or
    offline:NAME), or a tiny model
    of ``model_cfg.arch`` / ``size`` over the built-in character tokenizer (weights from ``seed``),
    in ``model_cfg.dtype``."""
    from vespo.models.tiny import tiny_model
    from vespo.models.tokenizer import build_char_tokenizer

    if model_cfg.path:
        return load_policy(model_cfg.path, dtype=model_cfg.dtype, attn_implementation=model_cfg.attn_implementation)
    tokenizer = build_char_tokenizer()
    model = tiny_model(arch=model_cfg.arch, size=model_cfg.size, tokenizer=tokenizer, seed=seed)
    if model_cfg.attn_implementation:
        model.set_attn_implementation(model_cfg.attn_implementation)
    return model.to(resolve_dtype(model_cfg.dtype)), tokenizer


def save_policy(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, path: str | Path,
                config: dict | None = None) -> Path:
    """Write model (safetensors) and tokenizer with ``save_pretrained`` to ``path``; returns the path.

    ``config`` (plain data, e.g. the run config) is written beside them as ``run_config.json``.
    The directory is written as ``PATH.tmp`` and renamed into place, so a crash leaves either the
    previous policy or the new one (or, between two renames, ``PATH.old``). ``path`` must be
    empty, absent, or a model directory (with config.json) that is replaced as a whole."""
    path = Path(path)
    if path.is_dir() and any(path.iterdir()) and not (path / "config.json").is_file():
        raise FileExistsError(f"{path} holds files but no config.json; refusing to replace it with a policy")
    tmp, old = path.with_name(path.name + ".tmp"), path.with_name(path.name + ".old")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if config is not None:
            (tmp / "run_config.json").write_text(json.dumps(config, indent=2, default=str))
    except Exception as e:  # a full disk (safetensors raises its own error): the partial copy goes, ``path`` stays
        if (full := disk_full(e)) is None:
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        raise DiskFullError(f"no room to write the policy {path} ({full.strerror}); "
                            f"{'the previous policy there is intact; ' if path.exists() else ''}"
                            "a run's last checkpoint holds its weights: " + FREE_AND_RESUME) from e
    shutil.rmtree(old, ignore_errors=True)
    if path.exists():
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)
    return path


def encode_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str | list[dict[str, str]]) -> list[int]:
    """Token ids of a prompt: chat messages go through the chat template, text is encoded as is."""
    if isinstance(prompt, str):
        return list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    # no template: join the message contents, one message per line
    return encode_prompt(tokenizer, "\n".join(m["content"] for m in prompt))
