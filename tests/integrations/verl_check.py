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
5. vespo's `dppo` equals verl's own `dppo_tv` / `dppo_kl` (loss and gradient, every verl aggregation mode,
   with and without data-parallel batch info, with and without a ratio cap), through the `vespo_dppo`
   registration and called directly; its masked-token fraction equals verl's `actor/pg_clipfrac`.
6. vespo's `geo_mask` rollout correction keeps exactly the sequences verl's Geo-RS rejection
   (`rollout_rs=seq_mean_k1`) keeps, and a GRPO loss with it equals verl's `vanilla` loss weighted by
   verl's mask.
8. vespo's icepop equals verl's IcePop (rollout_is=token, "0.5_5.0") weight for weight and, on GRPO, loss for
   loss; with mu = the engine's log-probs vespo equals verl's bypass mode (REINFORCE with token TIS or IcePop,
   PPO-clip with Geo-RS; PPO-clip with IcePop is plain PPO in verl, whose IS weights are then metrics only, and
   vespo refuses that setting, which cannot act).
7. Every metric verl logs is the mini-batch's whatever the micro-batching: one mini-batch in one call and
   in four micro-batches, their metrics combined as verl combines them (`Metric` with MEAN over the
   calls that report a key, as `ppo_loss` wraps policy-loss metrics), give the same values.
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
    from vespo.losses import get_loss, loss_names, prepare_inputs

    old, logp, adv, mask = random_batch(21)
    diffs = {}
    for name in loss_names():
        spec = get_loss(name)
        options = VESPO_OPTIONS if name == "vespo" else {}
        agg = spec.config_cls().agg
        torch.manual_seed(0)  # clip_cov draws from torch's global generator: the same draw in both calls
        ours, _ = get_policy_loss_fn(verl_loss_name(name))(old, logp, adv, mask, agg, config, None)
        x = prepare_inputs(logp, old, adv, mask.to(torch.float64))
        torch.manual_seed(0)
        direct = spec.fn(x, spec.config_cls(**options, agg=agg)).loss
        diffs[name] = abs(ours.item() - direct.item())
    return diffs


ADAPTIVE_OPTIONS = {"rule": "ess", "ess_target": 0.9, "k_neg": 4.0}


def check_adaptive() -> dict:
    """vespo_adaptive configured through Hydra equals vespo.losses' own; [B, T] and [B] advantages agree."""
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    from vespo.losses import get_loss, prepare_inputs

    overrides = [f"+actor_rollout_ref.actor.policy_loss.vespo_adaptive.{k}={v}" for k, v in ADAPTIVE_OPTIONS.items()]
    config = actor_config_from_hydra(overrides, loss_mode="vespo_adaptive")
    fn = get_policy_loss_fn("vespo_adaptive")
    old, logp, adv, mask = random_batch(41, B=10)
    old = old - 0.8 * torch.randn(old.shape, generator=torch.Generator().manual_seed(42), dtype=old.dtype)  # stale
    ours, metrics = fn(old, logp, adv, mask, "token-mean", config, None)
    spec = get_loss("vespo_adaptive")
    cfg = spec.config_cls(**ADAPTIVE_OPTIONS)
    direct = spec.fn(prepare_inputs(logp, old, adv[:, 0], mask.to(torch.float64)), cfg)  # sequence advantages [B]
    base = get_loss("vespo").fn(prepare_inputs(logp, old, adv[:, 0], mask.to(torch.float64)),
                                get_loss("vespo").config_cls(k_neg=4.0))
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


# (vespo dppo options, verl loss, verl actor options): clip_ratio* are verl's divergence thresholds, and
# clip_ratio_c its ratio cap (1e30: none, as the paper's script; 3.0 is verl's actor.yaml default)
DPPO_CASES = {
    "tv": ({"divergence": "tv"}, "dppo_tv", {"clip_ratio_low": 0.15, "clip_ratio_high": 0.15, "clip_ratio_c": 1e30}),
    "kl": ({"divergence": "kl"}, "dppo_kl", {"clip_ratio_low": 0.05, "clip_ratio_high": 0.05, "clip_ratio_c": 1e30}),
    "tv_cap": ({"divergence": "tv", "delta_low": 0.1, "delta_high": 0.25, "ratio_cap": 3.0}, "dppo_tv",
               {"clip_ratio_low": 0.1, "clip_ratio_high": 0.25, "clip_ratio_c": 3.0}),
    "kl_cap": ({"divergence": "kl", "delta_low": 0.02, "delta_high": 0.1, "ratio_cap": 3.0}, "dppo_kl",
               {"clip_ratio_low": 0.02, "clip_ratio_high": 0.1, "clip_ratio_c": 3.0}),
}


def moved_batch(seed: int, B: int = 8, T: int = 9, spread: float = 0.6):
    """Like random_batch, with log-ratios large enough (~ spread) that the trust regions bind on both sides."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2.5  # [B, T]
    logp = (old + spread * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=-1e-3).requires_grad_()
    adv = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, T).clone()  # [B, T]
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]  # [B, T] bool
    return old, logp, adv, mask


def loss_and_grad(fn, batch, mode: str, config) -> tuple[torch.Tensor, torch.Tensor, dict]:
    old, logp, adv, mask = batch
    loss, metrics = fn(old, logp, adv, mask, mode, config, None)
    return loss.detach(), torch.autograd.grad(loss, logp)[0], metrics


def diff(a, b) -> float:
    """Largest abs difference of two (loss, grad) pairs."""
    return max((a[0] - b[0]).abs().item(), (a[1] - b[1]).abs().max().item())


def check_dppo() -> dict:
    """vespo's dppo against verl's dppo_tv / dppo_kl on random inputs: max abs differences and mask fractions."""
    from omegaconf import OmegaConf
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    from vespo.losses import get_loss, prepare_inputs

    ours_fn = get_policy_loss_fn("vespo_dppo")
    batch_infos = {"local": {}, "dp2": {"dp_size": 2, "batch_num_tokens": 60, "global_batch_size": 16}}
    worst, fractions = {}, {}
    for case, (options, verl_name, verl_options) in DPPO_CASES.items():
        for seed, mode in enumerate(VERL_MODES):
            for label, info in batch_infos.items():
                info = {"dp_size": 2} if mode == "token-sum" and label == "dp2" else info
                batch = moved_batch(100 * seed + len(case))
                verl_cfg = OmegaConf.create({"clip_ratio": 0.2, **verl_options, "global_batch_info": info})
                theirs = loss_and_grad(get_policy_loss_fn(verl_name), batch, mode, verl_cfg)
                ours_cfg = {"policy_loss": {"vespo_dppo": options}, "global_batch_info": info}
                ours = loss_and_grad(ours_fn, batch, mode, ours_cfg)
                worst[f"{case}/{mode}/{label}"] = diff(ours, theirs)
                masked = ours[2]["actor/loss/trust_mask_frac_high"] + ours[2]["actor/loss/trust_mask_frac_low"]
                fractions[f"{case}/{mode}/{label}"] = (masked, theirs[2]["actor/pg_clipfrac"])
        old, logp, adv, mask = batch = moved_batch(7)
        spec = get_loss("dppo")
        direct = spec.fn(prepare_inputs(logp, old, adv, mask), spec.config_cls(**options))  # vespo.losses itself
        ours = direct.loss.detach(), torch.autograd.grad(direct.loss, logp)[0]
        verl_cfg = OmegaConf.create({"clip_ratio": 0.2, **verl_options, "global_batch_info": {}})
        worst[f"{case}/direct"] = diff(ours, loss_and_grad(get_policy_loss_fn(verl_name), batch, "token-mean", verl_cfg))
    return {"diff": worst, "mask_fraction": fractions}


GEO_BANDS = ["0.999_1.001", "0.98_1.03"]  # verl's preset and an asymmetric band (the direction matters)


def check_geo_mask() -> dict:
    """verl's Geo-RS (seq_mean_k1 on log pi_old/pi_rollout, band "lo_hi") against vespo's geo_mask with
    geo_low = 1/hi, geo_high = 1/lo: mismatched sequences and the GRPO/vanilla loss difference per band."""
    from omegaconf import OmegaConf
    from verl.trainer.ppo.core_algos import get_policy_loss_fn
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_rejection_mask

    from vespo.losses import get_loss, prepare_inputs
    from vespo.losses.rollout_correction import RolloutCorrection, geo_keep

    out = {}
    for i, band in enumerate(GEO_BANDS):
        old, logp, adv, mask = batch = moved_batch(50 + i, B=64, T=9, spread=0.1)
        g = torch.Generator().manual_seed(60 + i)
        rollout = old - 0.02 * torch.randn(old.shape, generator=g, dtype=old.dtype)  # [B, T]
        verl_mask, _ = compute_rollout_rejection_mask(old - rollout, mask.to(old.dtype), "seq_mean_k1", band)
        verl_keep = verl_mask.sum(-1) == mask.sum(-1)  # [B] a rejected sequence loses all its tokens
        lo, hi = (float(x) for x in band.split("_"))
        rc = RolloutCorrection(mode="geo_mask", geo_low=1 / hi, geo_high=1 / lo)
        mask_f = mask.to(old.dtype)
        ours_keep = geo_keep(torch.where(mask, rollout - old, 0.0), mask_f, rc)[:, 0]  # [B]; rollout_d, 0 on padding
        vanilla = OmegaConf.create({"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.2,
                                    "clip_ratio_c": 3.0, "global_batch_info": {}})
        old_, logp_, adv_, mask_ = batch
        loss, _ = get_policy_loss_fn("vanilla")(old_, logp_, adv_, mask_, "token-mean", vanilla, verl_mask)
        theirs = loss.detach(), torch.autograd.grad(loss, logp_)[0]
        spec = get_loss("grpo")
        x = prepare_inputs(logp_, old_, adv_, mask_, rollout_logp=rollout)
        mine = spec.fn(x, spec.config_cls(rollout_correction=rc))
        ours = mine.loss.detach(), torch.autograd.grad(mine.loss, logp_)[0]
        valid = mask.any(-1)
        out[band] = {"mismatched": int((ours_keep != verl_keep)[valid].sum()), "kept": int(ours_keep[valid].sum()),
                     "sequences": int(valid.sum()), "loss_diff": diff(ours, theirs)}
    # a row with token log-ratios +50 and -49: verl clamps each to +-20 before the mean (kept), SkyRL does not
    # (mean 0.5: masked); vespo's geo_token_clamp=20 follows verl, its default SkyRL
    log_ratio = torch.tensor([[50.0, -49.0]], dtype=torch.float64)  # log pi_old / pi_rollout
    verl_mask, _ = compute_rollout_rejection_mask(log_ratio, torch.ones_like(log_ratio), "seq_mean_k1", "0.99_1.01")
    kept = {"verl": bool(verl_mask.all())}
    for name, clamp in (("vespo_default", None), ("vespo_clamp20", 20.0)):
        rc = RolloutCorrection(mode="geo_mask", geo_low=1 / 1.01, geo_high=1 / 0.99, geo_token_clamp=clamp)
        kept[name] = bool(geo_keep(-log_ratio, torch.ones_like(log_ratio), rc).all())
    out["extreme_row_kept"] = kept
    return out


def verl_loss_config(rollout_correction: dict, B: int, tokens: int):
    """The slice of verl's actor config its vanilla and bypass-mode losses read."""
    from omegaconf import OmegaConf

    return OmegaConf.create({"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0,
                             "policy_loss": {"rollout_correction": rollout_correction},
                             "global_batch_info": {"dp_size": 1, "batch_num_tokens": tokens, "global_batch_size": B}})


BYPASS_CASES = {  # verl's bypass-mode rollout_correction -> vespo's (loss, options) with mu = the engine's log-probs
    "reinforce_tis": ({"loss_type": "reinforce", "rollout_is": "token", "rollout_is_threshold": 2.0},
                      ("reinforce", {"is_level": "none", "rollout_correction": {"mode": "tis_token", "threshold": 2.0}})),
    "reinforce_icepop": ({"loss_type": "reinforce", "rollout_is": "token", "rollout_is_threshold": "0.5_5.0"},
                         ("reinforce", {"is_level": "none", "rollout_correction": {"mode": "icepop"}})),
    "ppo_clip_icepop": ({"loss_type": "ppo_clip", "rollout_is": "token", "rollout_is_threshold": "0.5_5.0"},
                        None),  # verl: IS weights are metrics only, so this is plain PPO; vespo refuses IcePop there
    "ppo_clip_geo_rs": ({"loss_type": "ppo_clip", "rollout_rs": "seq_mean_k1", "rollout_rs_threshold": "0.9_1.2"},
                        ("grpo", {"rollout_correction": {"mode": "geo_mask", "geo_low": 1 / 1.2, "geo_high": 1 / 0.9}})),
}


def check_icepop_and_bypass() -> dict:
    """IcePop (verl's rollout_is=token with threshold "0.5_5.0"): its weights, and GRPO with it against verl's
    `vanilla` weighted by them (mu recomputed); verl's bypass mode (`compute_policy_loss_bypass_mode`, old_log_prob
    = the engine's) against vespo with mu = the engine's log-probs, loss and gradient, token-mean over the batch."""
    from verl.trainer.ppo.core_algos import compute_policy_loss_bypass_mode, get_policy_loss_fn
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights

    from vespo.losses import get_loss, prepare_inputs
    from vespo.losses.rollout_correction import RolloutCorrection, correction_weight

    old, logp, adv, mask = moved_batch(70, B=32, T=9, spread=0.5)
    g = torch.Generator().manual_seed(71)
    rollout = old - 0.5 * torch.randn(old.shape, generator=g, dtype=old.dtype)  # [B, T] a large engine gap
    mask_f, tokens = mask.to(old.dtype), int(mask.sum())
    theirs_w, _ = compute_rollout_correction_weights(old - rollout, mask_f, "token", "0.5_5.0")
    ours_w = correction_weight(torch.where(mask, rollout - old, 0.0), mask_f, RolloutCorrection(mode="icepop"))
    out = {"icepop_weight_diff": float(((ours_w - theirs_w) * mask_f).abs().max()),
           "icepop_zeroed": int(((theirs_w == 0) & mask).sum()), "tokens": tokens}
    config = verl_loss_config({}, len(old), tokens)
    loss, _ = get_policy_loss_fn("vanilla")(old, logp, adv, mask, "token-mean", config, theirs_w)
    theirs = loss.detach(), torch.autograd.grad(loss, logp)[0]
    spec = get_loss("grpo")
    x = prepare_inputs(logp, old, adv, mask, rollout_logp=rollout)
    mine = spec.fn(x, spec.config_cls(rollout_correction={"mode": "icepop"}), normalizer=tokens)
    out["decoupled_grpo_icepop_diff"] = diff((mine.loss.detach(), torch.autograd.grad(mine.loss, logp)[0]), theirs)
    for case, (verl_rc, ours) in BYPASS_CASES.items():
        config = verl_loss_config(verl_rc, len(old), tokens)
        loss, _ = compute_policy_loss_bypass_mode(rollout, logp, adv, mask, "token-mean", config)
        theirs = loss.detach(), torch.autograd.grad(loss, logp)[0]
        name, options = ours or ("grpo", {})
        spec = get_loss(name)
        mine = spec.fn(prepare_inputs(logp, rollout, adv, mask, bypass=True), spec.config_cls(**options),
                       normalizer=tokens)
        out[f"bypass_{case}_diff"] = diff((mine.loss.detach(), torch.autograd.grad(mine.loss, logp)[0]), theirs)
        out[f"bypass_{case}_acted"] = float(max(mine.metrics.get("rollout/masked_frac", 0.0),
                                                mine.metrics.get("rollout/truncated_frac", 0.0)))
    return out


def check_micro_batching(config) -> dict[str, float]:
    """Largest difference of any metric between one call on a mini-batch and four micro-batch calls, per loss."""
    from verl.trainer.ppo import core_algos
    from verl.utils.metric import AggregationType, Metric
    from verl.utils.py_functional import append_to_dict

    old, logp, adv, mask = moved_batch(11, B=8, T=9)
    adv[[1, 5]] = -adv[[1, 5]].abs() - 0.3  # A < 0 rows in two of the micro-batches
    out = {}
    for name in ("vespo", "vespo_grpo", "vespo_dppo"):
        fn = core_algos.get_policy_loss_fn(name)

        def logged(rows: slice) -> dict[str, float]:
            config.global_batch_info.update(dp_size=1, global_batch_size=8, batch_num_tokens=int(mask.sum()))
            collected: dict = {}
            for part in (rows,) if rows.stop == 8 else [slice(i, i + 2) for i in range(0, 8, 2)]:
                _, metrics = fn(old[part], logp[part], adv[part], mask[part], "token-mean", config, None)
                append_to_dict(collected, Metric.from_dict(metrics, aggregation=AggregationType.MEAN))
            return {key: float(metric.aggregate()) for key, metric in collected.items()}  # a Metric per key

        whole, split = logged(slice(0, 8)), logged(slice(0, 2))
        assert set(whole) == set(split) and "actor/is/ess" in whole, (sorted(whole), sorted(split))
        out[name] = max(abs(whole[k] - split[k]) / max(abs(whole[k]), 1e-12) for k in whole)
    return out


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
        "dppo": check_dppo(),
        "geo_mask": check_geo_mask(),
        "icepop_bypass": check_icepop_and_bypass(),
        "micro_batching": check_micro_batching(config),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
