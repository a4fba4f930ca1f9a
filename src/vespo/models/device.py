"""Device names of the config (auto, cpu, cuda, cuda:N) turned into torch devices."""

from __future__ import annotations

import torch

from vespo.config import ConfigError


def resolve_device(name: str | None, fallback: str = "auto") -> torch.device:
    """``auto`` is CUDA when a CUDA device is present and the CPU otherwise; None uses ``fallback``."""
    name = fallback if name is None else name
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} was asked for (model.device / rollout.device), but torch sees no CUDA "
                          "device; use auto or cpu")
    return device
