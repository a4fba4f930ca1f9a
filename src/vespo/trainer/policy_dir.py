"""The policy a run leaves behind, and the policy any run directory, checkpoint or model directory holds.

    RUN_DIR/policy/     the policy as a Hugging Face directory (save_pretrained: config.json,
                        model.safetensors, tokenizer files) plus run_config.json; with LoRA, the merged weights
    RUN_DIR/adapter/    with LoRA only: the adapters alone, a peft directory (PeftModel.from_pretrained on the
                        run's base: model.path, or the warm-started weights it trained on)

``load_trained_policy`` is what ``vespo eval --model`` opens: a run directory (its ``policy/``, else its
latest checkpoint), a checkpoint (its weights in the run's architecture, vespo.trainer.checkpoint) or a
Hugging Face model directory.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from vespo.errors import CheckpointError, ModelError
from vespo.models.forward import policy_keys
from vespo.rundir import CHECKPOINTS, POLICY
from vespo.trainer.checkpoint import CONFIG_FILE, SHARDS_DIR, latest_checkpoint
from vespo.trainer.safe_load import read_shards


def save_run_policy(run_dir: str | Path, model: torch.nn.Module, tokenizer: Any, config: dict,
                    weights: dict[str, torch.Tensor] | None = None) -> Path:
    """Write ``RUN_DIR/policy/`` (replacing the previous one as a whole); returns its path.

    ``weights``: the full weights when ``model`` itself holds shards (a sharded learner gathers them);
    the directory is then written from a fresh copy of the architecture holding them."""
    from vespo.models.loading import save_policy

    if weights is not None:
        from transformers import AutoModelForCausalLM

        full = AutoModelForCausalLM.from_config(model.config)
        full.load_state_dict(weights)
        model = full
    return save_policy(model, tokenizer, Path(run_dir) / POLICY, config)


def save_lora_policy(run_dir: str | Path, model: torch.nn.Module, tokenizer: Any, config: dict) -> Path:
    """``RUN_DIR/policy/`` with the merged weights of a policy with LoRA adapters, and ``RUN_DIR/adapter/`` (replaced
    as a whole); returns the policy's path."""
    import shutil

    from vespo.models.loading import save_policy
    from vespo.models.lora import ADAPTER_DIR, merged_policy, save_adapter

    path = save_policy(merged_policy(model), tokenizer, Path(run_dir) / POLICY, config)
    final, tmp = Path(run_dir) / ADAPTER_DIR, Path(run_dir) / f"{ADAPTER_DIR}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    save_adapter(model, tmp, base=config.get("model", {}).get("path"))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return path


def policy_weights(path: str | Path, model: torch.nn.Module) -> None:
    """Load a run checkpoint's weights (a learner's LogprobModule: ``policy.*``) into a plain policy ``model``
    in place, in one process."""
    target = {"model": {f"policy.{k}": v for k, v in model.state_dict().items()}}
    read_shards(Path(path) / SHARDS_DIR, target, CheckpointError)
    model.load_state_dict(policy_keys(target["model"]))


def policy_from_checkpoint(path: str | Path, dtype: str | None = None) -> tuple[torch.nn.Module, Any]:
    """(model in eval mode, tokenizer): the run's architecture, built from the checkpoint's
    ``run_config.json`` (a tiny model, or the ``model.path`` it started from), with the
    checkpoint's weights; in ``dtype`` (default: the run's ``model.dtype``)."""
    from vespo.config import from_dict
    from vespo.models.loading import build_model, resolve_dtype
    from vespo.models.lora import attach_lora, lora_on, merged_policy

    path = Path(path)
    config_file = path / CONFIG_FILE
    if not config_file.is_file():
        raise CheckpointError(f"checkpoint {path} has no {CONFIG_FILE}; it is incomplete or not a vespo checkpoint")
    cfg = from_dict(json.loads(config_file.read_text()))
    model, tokenizer = build_model(cfg.model, seed=cfg.run.seed)
    if lora_on(cfg.model.lora):  # the checkpoint holds the base and the adapters: merged into the plain model
        policy_weights(path, attach_lora(model, cfg.model.lora))
        model = merged_policy(model)
    else:
        policy_weights(path, model)
    return model.to(resolve_dtype(dtype or cfg.model.dtype)).eval(), tokenizer


def load_trained_policy(path: str | Path, dtype: str = "float32") -> tuple[torch.nn.Module, Any, str]:
    """(model, tokenizer, what was loaded) from what ``vespo eval --model`` accepts:

    - a run directory: its ``policy/``, else its latest checkpoint;
    - a checkpoint directory (``RUN_DIR/checkpoints/step-NNNNNN``): its weights in the run's architecture;
    - a Hugging Face model directory (``config.json`` and weights), e.g. ``RUN_DIR/policy``.
    """
    from vespo.models.loading import load_policy

    path = Path(path)
    if (path / POLICY / "config.json").is_file():
        model, tokenizer = load_policy(path / POLICY, dtype=dtype)
        return model, tokenizer, f"{path / POLICY} (the run's final policy)"
    if (path / SHARDS_DIR).is_dir() and (path / CONFIG_FILE).is_file() and not (path / "config.json").is_file():
        model, tokenizer = policy_from_checkpoint(path, dtype)
        return model, tokenizer, f"{path} (a checkpoint)"
    if (path / CHECKPOINTS).is_dir():
        latest = latest_checkpoint(path)
        if latest is None:
            raise ModelError(f"run directory {path} has no {POLICY}/ and no complete checkpoint yet; evaluate it "
                             "after its first checkpoint (run.checkpoint_every), or pass a model directory")
        model, tokenizer = policy_from_checkpoint(latest, dtype)
        return model, tokenizer, f"{latest} (the run has no {POLICY}/ yet: its latest checkpoint)"
    model, tokenizer = load_policy(path, dtype=dtype)
    return model, tokenizer, str(path)
