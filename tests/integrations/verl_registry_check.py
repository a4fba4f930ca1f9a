"""The losses vespo's verl plug-in registers against docs/integrations.md's table of them and against verl's own
counterparts (run in .venv-verl by test_verl_registry.py).

    .venv-verl/bin/python tests/integrations/verl_registry_check.py    # prints one JSON line of results

1. The table "Every registered loss" lists exactly the names `vespo.integrations.verl` registers, each with the
   vespo loss it runs, and names for each a verl 0.9.1 policy loss (`loss_mode`) or none.
2. Each named counterpart is one of verl's registered losses, and on float64 batches (token-broadcast advantages,
   ragged masks, a log-ratio scale at which the clips act) the registered `vespo_<name>`, called through verl's
   `get_policy_loss_fn` with the options below, gives verl's loss and gradient: the largest |difference| per row
   and aggregation mode (verl's `sapo` and `geo_mean` aggregate one way whatever `loss_agg_mode` says: compared
   in that mode only).
   verl's kl_cov and clip_cov draw their tokens from torch's global generator, as vespo's do: each call is
   preceded by the same seed.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

DOCS = Path(__file__).resolve().parents[2] / "docs" / "integrations.md"
HEADING = "### Every registered loss"
VERL_MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
# counterpart -> (the vespo options, verl's actor-config overrides, the aggregation modes compared)
OPTIONS = {
    "vanilla": ({}, {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0}, VERL_MODES),
    "gspo": ({"eps_low": 3e-4, "eps_high": 4e-4}, {"clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4}, VERL_MODES),
    "sapo": ({"tau_pos": 1.0, "tau_neg": 1.05}, {"tau_pos": 1.0, "tau_neg": 1.05}, ["seq-mean-token-mean"]),
    "cispo": ({"eps_low": 0.2, "eps_high": 0.28}, {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28}, VERL_MODES),
    "gpg": ({"is_level": "none"}, {}, VERL_MODES),
    "dppo_tv": ({"divergence": "tv"}, {"clip_ratio_low": 0.15, "clip_ratio_high": 0.15, "clip_ratio_c": 1e30},
                VERL_MODES),
    "dppo_kl": ({"divergence": "kl"}, {"clip_ratio_low": 0.05, "clip_ratio_high": 0.05, "clip_ratio_c": 1e30},
                VERL_MODES),
    "geo_mean": ({"eps_low": 0.4, "eps_high": 0.4}, {"clip_ratio_low": 0.4, "clip_ratio_high": 0.4},
                 ["seq-mean-token-mean"]),
    "dro": ({"beta": 0.1}, {"policy_loss": {"dro_beta": 0.1}}, VERL_MODES),
    "kl_cov": ({"kl_cov_ratio": 0.2, "coef": 0.5}, {"policy_loss": {"kl_cov_ratio": 0.2, "ppo_kl_coef": 0.5}},
               VERL_MODES),
    "clip_cov": ({"clip_cov_ratio": 0.3, "clip_cov_lb": 0.05, "clip_cov_ub": 2.0, "eps_high": 0.28},
                 {"clip_ratio_high": 0.28, "policy_loss": {"clip_cov_ratio": 0.3, "clip_cov_lb": 0.05,
                                                           "clip_cov_ub": 2.0}}, VERL_MODES),
}


def registry_table(path: Path = DOCS) -> dict[str, tuple[str, str | None]]:
    """The table under HEADING: registered name -> (vespo loss, verl's counterpart or None)."""
    lines = path.read_text().split("\n")
    rows = {}
    for line in lines[lines.index(HEADING) + 1:]:
        if line.startswith("#"):
            break
        if not line.startswith("| `"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        counterpart = re.match(r"`([^`]+)`", cells[2])
        rows[cells[0].strip("`")] = (cells[1].strip("`"), counterpart.group(1) if counterpart else None)
    return rows


def batch(seed: int, B: int = 8, T: int = 9):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3.0 - 0.05  # [B, T]
    logp = old + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, T).clone()  # [B, T], as verl passes it
    adv[0], adv[1] = adv[0].abs() + 0.1, -adv[1].abs() - 0.1
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]  # [B, T] bool
    return old, logp, adv, mask


def loss_and_grad(fn, old, logp, adv, mask, mode, config, seed):
    lp = logp.clone().requires_grad_(True)
    torch.manual_seed(seed)
    loss, metrics = fn(old, lp, adv, mask, loss_agg_mode=mode, config=config, rollout_is_weights=None)
    return loss.detach(), torch.autograd.grad(loss, lp)[0], metrics


def verl_actor_config(overrides: dict):
    """verl's own ActorConfig (cispo asserts its type) with the clip ratios and policy_loss fields set."""
    from verl.workers.config import ActorConfig, PolicyLossConfig

    overrides = dict(overrides)
    policy_loss = PolicyLossConfig(**overrides.pop("policy_loss", {}))
    return ActorConfig(strategy="fsdp", ppo_mini_batch_size=8, ppo_micro_batch_size_per_gpu=8,
                       use_dynamic_bsz=False, rollout_n=1, policy_loss=policy_loss, **overrides)


def compare(registered: str, counterpart: str) -> tuple[dict[str, float], float]:
    """The largest |difference| of loss and gradient per aggregation mode, and verl's largest clip fraction."""
    from omegaconf import OmegaConf
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    options, verl_overrides, modes = OPTIONS[counterpart]
    theirs_fn, ours_fn = get_policy_loss_fn(counterpart), get_policy_loss_fn(registered)
    worst, clipped = dict.fromkeys(modes, 0.0), 0.0
    for seed in range(3):
        old, logp, adv, mask = batch(seed)
        for mode in modes:
            theirs = loss_and_grad(theirs_fn, old, logp, adv, mask.double(), mode, verl_actor_config(verl_overrides),
                                   seed)
            ours_cfg = OmegaConf.create({"policy_loss": {registered: options}, "global_batch_info": {}})
            ours = loss_and_grad(ours_fn, old, logp, adv, mask, mode, ours_cfg, seed)
            worst[mode] = max(worst[mode], float((theirs[0] - ours[0]).abs()),
                              float((theirs[1] - ours[1]).abs().max()))
            clipped = max(clipped, float(theirs[2].get("actor/pg_clipfrac", 0.0)))
    return worst, clipped


def main() -> None:
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    import vespo.integrations.verl as plugin

    table = registry_table()
    verl_own = sorted(k for k in POLICY_LOSS_REGISTRY if k not in plugin.REGISTERED)
    pairs = {name: (name, counterpart) for name, (_, counterpart) in table.items()
             if counterpart is not None and counterpart in OPTIONS}
    pairs["vespo_dppo/dppo_kl"] = ("vespo_dppo", "dppo_kl")  # the table's note: divergence kl is verl's dppo_kl
    compared = {key: compare(*pair) for key, pair in pairs.items()}
    print(json.dumps({
        "registered": sorted(plugin.REGISTERED),
        "table": sorted(table),
        "runs": {name: loss for name, (loss, _) in table.items()},
        "expected_runs": {plugin.verl_loss_name(n): n for n in plugin.loss_names()},
        "counterparts": {name: counterpart for name, (_, counterpart) in table.items()},
        "verl_own": verl_own,
        "diff": {name: diff for name, (diff, _) in compared.items()},
        "clipfrac": {name: clipped for name, (_, clipped) in compared.items()},
    }))


if __name__ == "__main__":
    main()
