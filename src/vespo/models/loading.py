"""Load and save a policy: any local Hugging Face causal-LM directory plus its tokenizer.

``load_policy`` refuses a tokenizer without a pad token (it raises rather than guessing, since
padding with EOS would hide where responses end). ``encode_prompt`` renders chat messages with
the tokenizer's chat template when it has one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                                  "float16": torch.float16}


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
    """Model (eval mode) and tokenizer from a local directory; errors name the path."""
    torch_dtype = resolve_dtype(dtype)
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"policy path {str(path)!r} is not a directory")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"policy path {str(path)!r} has no config.json (not a Hugging Face model dir)")
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:
        raise ValueError(f"tokenizer at {str(path)!r} has no pad token; set tokenizer.pad_token and save it again")
    kwargs: dict[str, Any] = {"dtype": torch_dtype}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    return model.eval(), tokenizer


def save_policy(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, path: str | Path) -> Path:
    """Write model (safetensors) and tokenizer to ``path``; returns the path."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
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
