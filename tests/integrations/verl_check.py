"""Checks of vespo.integrations.verl, run inside the verl virtualenv (.venv-verl) by test_verl.py.

    .venv-verl/bin/python tests/integrations/verl_check.py     # prints one JSON line of results

1. The documented Hydra overrides (loss_mode=vespo, policy_loss._target_=VespoPolicyLossConfig,
   +policy_loss.vespo.k_pos=...) build verl's actor config, and building it registers `vespo`.
2. `get_policy_loss_fn("vespo")` on random inputs equals a float64 reference written from the paper's kernel
   and aggregated by verl's own `agg_loss`, for every verl aggregation mode, with and without
   data-parallel batch info, and with token- and sequence-level rollout correction weights.
3. It equals vespo's own loss computed directly from vespo.losses; `vespo_<name>` likewise.
4. `vespo_adaptive` takes its rule from `+policy_loss.vespo_adaptive.*` overrides and, with verl's
   token-broadcast advantages [B, T], chooses the same shape as with sequence advantages [B].
"""

from __future__ import annotations

import json
import math
import os

import torch

VESPO_OPTIONS = {"k_pos": 1.5, "lambda_pos": 2.5, "k_neg": 3.5, "lambda_neg": 1.5}
VERL_MODES = ["token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


def actor_config_from_hydra(extra: list[str] | None = None, loss_mode: str = "vespo"):
    """verl's actor config built from its own ppo_trainer.yaml with the documented overrides."""
    import verl
    from hydra import compose, initialize_config_dir
    from verl.utils.config import omega_conf_to_dataclass

    overrides = [
        f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode}",
        "actor_rollout_ref.actor.policy_loss._target_=vespo.integrations.verl.VespoPolicyLossConfig",
        *[f"+actor_rollout_ref.actor.policy_loss.vespo.{k}={v}" for k, v in VESPO_OPTIONS.items()],
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.n=4",
        *(extra or []),
    ]
    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = compose("ppo_trainer", overrides=overrides)
    return omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)


def random_batch(seed: int, B: int = 6, T: int = 7):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2.0  # [B, T]
    logp = (old + 0.15 * torch.randn(B, T, generator=g, dtype=torch.float64)).requires_grad_()  # [B, T]
    adv = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, T).clone()  # [B, T], sequence-level
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]  # [B, T] bool, as verl passes it
    return old, logp, adv, mask


def reference_phi(log_w: torch.Tensor, adv_seq: torch.Tensor) -> torch.Tensor:
    """The paper's kernel log φ = λ + k·log W − λ·W, (k, λ) by the sign of A; log W clamped to [-18.42, 20]."""
    k = torch.where(adv_seq >= 0, VESPO_OPTIONS["k_pos"], VESPO_OPTIONS["k_neg"])
    lam = torch.where(adv_seq >= 0, VESPO_OPTIONS["lambda_pos"], VESPO_OPTIONS["lambda_neg"])
    log_w = log_w.clamp(math.log(1e-8), 20.0)
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w))


def reference_loss(old, logp, adv, mask, mode, batch_info, seq_log_rollout=None):
    """−sg[φ(W)]·A·logp per token, aggregated by verl's agg_loss (an oracle independent of vespo)."""
    from verl.trainer.ppo.core_algos import agg_loss

    m = mask.to(torch.float64)
    log_w = ((logp.detach() - old).clamp(-20.0, 20.0) * m).sum(-1)  # [B]
    if seq_log_rollout is not None:
        log_w = log_w + seq_log_rollout
    phi = reference_phi(log_w, adv[:, 0])  # [B]
    loss_mat = -phi[:, None] * adv * logp  # [B, T]
    return agg_loss(loss_mat, m, mode, **batch_info)


def compare(fn, config, batch, mode, batch_info, weights=None, seq_log_rollout=None) -> float:
    """Largest abs difference between verl-registered loss and the reference: value and gradient."""
    old, logp, adv, mask = batch
    object.__setattr__(config, "global_batch_info", dict(batch_info))  # verl mutates this dict per micro-batch
    ours, metrics = fn(old, logp, adv, mask, mode, config, weights)
    ref = reference_loss(old, logp, adv, mask, mode, batch_info, seq_log_rollout)
    g_ours, g_ref = (torch.autograd.grad(x, logp)[0] for x in (ours, ref))
    assert all(isinstance(v, float) for v in metrics.values()), metrics
    return max(abs(ours.item() - ref.item()), (g_ours - g_ref).abs().max().item())


def check_reference(fn, config) -> dict[str, float]:
    worst = {}
    batch_infos = {"local": {}, "dp2": {"dp_size": 2, "batch_num_tokens": 40, "global_batch_size": 12}}
    for seed, mode in enumerate(VERL_MODES):
        for label, info in batch_infos.items():
            if mode == "token-sum" and label == "dp2":
                info = {"dp_size": 2}
            worst[f"{mode}/{label}"] = compare(fn, config, random_batch(seed), mode, info)
    old, logp, adv, mask = batch = random_batch(11)
    g = torch.Generator().manual_seed(12)
    m = mask.to(torch.float64)
    token_w = torch.exp(0.3 * torch.randn(old.shape, generator=g, dtype=torch.float64)) * m  # [B, T]
    token_w[0, 0] = 0.0  # a token verl masked out: its log weight floors at log 1e-8
    seq_log_tok = (torch.log(token_w.clamp(min=1e-8)) * m).sum(-1)  # [B]
    worst["rollout/token"] = compare(fn, config, batch, "token-mean", {}, token_w, seq_log_tok)
    seq_w = torch.exp(0.5 * torch.randn(old.shape[0], 1, generator=g, dtype=torch.float64))  # [B, 1]
    cfg_seq = actor_config_from_hydra(["+actor_rollout_ref.actor.policy_loss.vespo.rollout_is=sequence"])
    worst["rollout/sequence"] = compare(fn, cfg_seq, batch, "token-mean", {}, seq_w.expand_as(old) * m,
                                        torch.log(seq_w[:, 0]))
    return worst


def check_against_vespo(config) -> dict[str, float]:
    """Every registered vespo_* loss equals vespo.losses' own, on one random batch."""
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    from vespo.integrations.verl import verl_loss_name
    from vespo.losses import get_loss, loss_names

    old, logp, adv, mask = random_batch(21)
    diffs = {}
    for name in loss_names():
        spec = get_loss(name)
        options = VESPO_OPTIONS if name == "vespo" else {}
        agg = spec.config_cls().agg
        ours, _ = get_policy_loss_fn(verl_loss_name(name))(old, logp, adv, mask, agg, config, None)
        direct = spec.fn(logp, old, adv, mask.to(torch.float64), spec.config_cls(**options, agg=agg)).loss
        diffs[name] = abs(ours.item() - direct.item())
    return diffs


ADAPTIVE_OPTIONS = {"rule": "ess", "ess_target": 0.9, "k_neg": 4.0}


def check_adaptive() -> dict:
    """vespo_adaptive configured through Hydra equals vespo.losses' own; [B, T] and [B] advantages agree."""
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    from vespo.losses import get_loss

    overrides = [f"+actor_rollout_ref.actor.policy_loss.vespo_adaptive.{k}={v}" for k, v in ADAPTIVE_OPTIONS.items()]
    config = actor_config_from_hydra(overrides, loss_mode="vespo_adaptive")
    fn = get_policy_loss_fn("vespo_adaptive")
    old, logp, adv, mask = random_batch(41, B=10)
    old = old - 0.8 * torch.randn(old.shape, generator=torch.Generator().manual_seed(42), dtype=old.dtype)  # stale
    ours, metrics = fn(old, logp, adv, mask, "token-mean", config, None)
    spec = get_loss("vespo_adaptive")
    cfg = spec.config_cls(**ADAPTIVE_OPTIONS)
    direct = spec.fn(logp, old, adv[:, 0], mask.to(torch.float64), cfg)  # sequence advantages [B]
    base = get_loss("vespo").fn(logp, old, adv[:, 0], mask.to(torch.float64), get_loss("vespo").config_cls(k_neg=4.0))
    shape = {key: metrics[f"actor/vespo/{key}"] for key in ("k_pos", "lambda_pos", "k_neg", "lambda_neg")}
    return {
        "options": dict(config.policy_loss.vespo_adaptive),
        "diff": abs(ours.item() - direct.loss.item()),
        "shape": shape,
        "shape_diff": max(abs(shape[k] - direct.metrics[f"vespo/{k}"].item()) for k in shape),
        "differs_from_vespo": abs(ours.item() - base.loss.item()),
    }


def unknown_option_error() -> str:
    """The error a misspelled option raises, as the user sees it."""
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    old, logp, adv, mask = random_batch(31)
    config = {"policy_loss": {"vespo": {"kpos": 2.0}}}  # a plain mapping works as a config too
    try:
        get_policy_loss_fn("vespo")(old, logp, adv, mask, "token-mean", config, None)
    except ValueError as err:
        return str(err)
    return ""


def main() -> None:
    from verl.trainer.ppo import core_algos

    registered_before = "vespo" in core_algos.POLICY_LOSS_REGISTRY
    config = actor_config_from_hydra()  # instantiating VespoPolicyLossConfig imports our module
    fn = core_algos.get_policy_loss_fn("vespo")
    result = {
        "registered_before_config": registered_before,
        "fn_module": fn.__module__,
        "registry": sorted(core_algos.POLICY_LOSS_REGISTRY),
        "verl_gspo_module": core_algos.get_policy_loss_fn("gspo").__module__,
        "options": dict(config.policy_loss.vespo),
        "reference_diff": check_reference(fn, config),
        "vespo_diff": check_against_vespo(config),
        "adaptive": check_adaptive(),
        "unknown_option_error": unknown_option_error(),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
