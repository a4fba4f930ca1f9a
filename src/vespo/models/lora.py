"""LoRA (``model.lora``): low-rank adapters on a frozen base, with peft (``pip install 'vespo[lora]'``).

The adapters are injected into the policy in place (peft's ``inject_adapter_in_model``): the model keeps its
Hugging Face class and forward paths, each targeted linear module becomes ``W x + (alpha / r) B A x`` with W
frozen, and only A and B require gradients, so the learner's optimizer holds the adapters alone. B starts at
0: the policy with fresh adapters is its base exactly.

    attach_lora(policy, cfg.model.lora)     adapters on a built policy (after any warm start of its base)
    adapter_state(policy)                   the adapters' tensors: what a weight push sends to an engine
    base_state(policy)                      the frozen base's tensors: what an engine is built with, once
    merged_policy(policy)                   a plain model of the same architecture, W + (alpha / r) B A
    merge_adapters(model, bases)            each adapted weight set to W + (alpha / r) B A in place (an engine's copy)
    save_adapter(policy, path, base)        the adapters alone as a peft directory (PeftModel.from_pretrained)

An engine built from a copy of the policy (with its adapters) holds the base once; every later push loads the
adapters only (``HFEngine.load_weights`` accepts a state dict of exactly the adapter keys). The engine generates with
the adapters merged (``merge_adapters``): each adapted module's weight holds W + (alpha / r) B A, formed in float32
from the frozen W it keeps aside, so a decode step runs the plain model's matmuls and none of peft's per-module
adapter path (two extra small matmuls, a scale and an add per module per token); every push merges again from W,
never by subtracting the old product, so the merged weights do not drift.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from vespo.errors import ModelError

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from vespo.config import LoraConfig

ADAPTER = "default"  # peft's name of the one adapter
ADAPTER_DIR = "adapter"  # RUN_DIR/adapter: the adapters alone, beside RUN_DIR/policy (merged)


def lora_on(cfg: LoraConfig) -> bool:
    return cfg.rank > 0


def attach_lora(model: nn.Module, cfg: LoraConfig) -> nn.Module:
    """Inject ``cfg``'s adapters into ``model`` in place (its other weights frozen); returns it. A target module the
    model does not have, or one that is a tied embedding, is refused in one line naming model.lora.target_modules."""
    from vespo.config import ConfigError

    try:
        import peft
    except ImportError:
        raise ModelError("model.lora needs peft: pip install 'vespo[lora]'") from None
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = sorted(set(cfg.target_modules) - names)
    if missing:
        linear = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise ConfigError(f"model.lora.target_modules: {missing} match no module of the model; its linear modules "
                          f"are {linear}")
    tied = {"lm_head", "embed_tokens"} & set(cfg.target_modules)
    if tied and getattr(model.config, "tie_word_embeddings", False):
        raise ConfigError(f"model.lora.target_modules: {sorted(tied)} is a tied embedding of this model (its input "
                          "and output share one weight); adapt the decoder's linear modules instead")
    config = peft.LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                             target_modules=list(cfg.target_modules), bias="none")
    peft.inject_adapter_in_model(config, model, adapter_name=ADAPTER)  # also sets model.peft_config
    for p in model.parameters():
        if not p.requires_grad:
            p.grad = None  # a warm start's last gradient would stay in memory for the whole run
    return model


def has_lora(model: nn.Module) -> bool:
    return ADAPTER in (getattr(model, "peft_config", None) or {})


def is_adapter_key(key: str) -> bool:
    """Whether a state-dict key is one of the adapters' (``...lora_A.default.weight``, ``...lora_B...``)."""
    return ".lora_A." in key or ".lora_B." in key


def adapter_state(model: nn.Module) -> dict[str, Tensor]:
    """The adapters' tensors on the CPU, keyed as in ``model.state_dict()``."""
    return {k: v.detach().cpu() for k, v in model.state_dict().items() if is_adapter_key(k)}


def base_state(model: nn.Module) -> dict[str, Tensor]:
    """The frozen base's tensors on the CPU, keyed as in ``model.state_dict()`` (``...q_proj.base_layer.weight``)."""
    return {k: v.detach().cpu() for k, v in model.state_dict().items() if not is_adapter_key(k)}


def load_base(model: nn.Module, base: dict[str, Tensor]) -> None:
    """Load a base state (``base_state``) into a model with the same adapters; every base key must be there."""
    result = model.load_state_dict(base, strict=False)
    missing = [k for k in result.missing_keys if not is_adapter_key(k)]
    if missing or result.unexpected_keys:
        raise KeyError(f"load_base: missing keys {missing[:5]}, unexpected keys {result.unexpected_keys[:5]}")


def merged_state(model: nn.Module) -> dict[str, Tensor]:
    """The weights of the plain architecture, each adapted module's W + (alpha / r) B A, on the CPU, in the base's
    dtype (the delta is formed in float32 or better)."""
    from peft.tuners.lora import LoraLayer

    deltas = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            delta = module.get_delta_weight(ADAPTER).detach()
            deltas[f"{name}.base_layer.weight"] = delta
    merged = {}
    for key, value in model.state_dict().items():
        if is_adapter_key(key):
            continue
        value = value.detach()
        if key in deltas:
            exact = torch.promote_types(value.dtype, torch.float32)
            value = (value.to(exact) + deltas[key].to(exact)).to(value.dtype)
        merged[key.replace(".base_layer.", ".")] = value.cpu()
    return merged


def merged_policy(model: nn.Module) -> PreTrainedModel:
    """A plain model of ``model``'s architecture (no adapters) holding the merged weights, on the CPU, eval mode."""
    from transformers import AutoModelForCausalLM

    dtype = next(model.parameters()).dtype
    plain = AutoModelForCausalLM.from_config(model.config, dtype=dtype)
    result = plain.load_state_dict(merged_state(model), strict=False)
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    if set(result.missing_keys) - tied or result.unexpected_keys:
        raise KeyError(f"merged_policy: missing {result.missing_keys[:5]}, unexpected {result.unexpected_keys[:5]}")
    return plain.eval()


def lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The modules that carry adapters (peft's LoraLayer), by name."""
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def frozen_bases(model: nn.Module) -> dict[str, Tensor]:
    """Each adapted module's frozen weight W (the tensor itself, detached: no copy), by module name."""
    return {name: m.get_base_layer().weight.detach() for name, m in lora_layers(model).items()}


def merge_adapters(model: nn.Module, bases: dict[str, Tensor]) -> None:
    """Write W + (alpha / r) B A into each adapted module's weight, in place, and mark the adapter merged (peft's
    forward then runs the module's base layer alone). ``bases``: each module's W, which this never writes; the sum is
    formed in float32 (or the wider dtype of W) from W and the module's own A and B, then cast to the weight's dtype.
    Merging again after new adapters load starts from W again: the result is the same as merging once."""
    for name, module in lora_layers(model).items():
        weight = module.get_base_layer().weight
        base = bases[name]
        exact = torch.promote_types(base.dtype, torch.float32)
        delta = module.get_delta_weight(ADAPTER).detach().to(exact)
        with torch.no_grad():
            weight.copy_((base.to(exact) + delta).to(weight.dtype))
        module.merged_adapters = [ADAPTER]


def save_adapter(model: nn.Module, path: str | Path, base: str | None = None) -> Path:
    """The adapters alone as a peft directory (adapter_config.json, adapter_model.safetensors) that
    ``PeftModel.from_pretrained(base_model, path)`` loads; ``base``: where the base model is (recorded only)."""
    import peft
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = peft.get_peft_model_state_dict(model, adapter_name=ADAPTER)  # adapter name dropped from the keys
    save_file({f"base_model.model.{k}": v.detach().cpu().contiguous() for k, v in state.items()},
              str(path / "adapter_model.safetensors"))
    config = model.peft_config[ADAPTER].to_dict()
    config.update(base_model_name_or_path=base, task_type="CAUSAL_LM")
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2, default=_plain))
    return path


def _plain(value):
    return sorted(value) if isinstance(value, set) else str(value)
