"""vespo's gmpo, dro, kl_cov and clip_cov against verl 0.9.1's own policy losses (run in .venv-verl by
test_verl_peers.py).

    .venv-verl/bin/python tests/losses/verl_peer_check.py      # prints one JSON line of results

verl's functions (verl/trainer/ppo/core_algos.py: geo_mean, dro, kl_cov, clip_cov) run as shipped on float64
inputs with token-broadcast advantages [B, T], as verl passes them; vespo's run on the same batch with [B]
advantages. Each entry is the largest |difference| of loss and gradient over seeds and log-ratio scales.
clip_cov draws its cut tokens from torch's global generator in both: each call is preceded by the same seed.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
from pathlib import Path
from types import SimpleNamespace

import yaml

import torch
from verl.trainer.ppo.core_algos import get_policy_loss_fn

from vespo.losses import get_loss, prepare_inputs

SCALES = (0.05, 0.3, 1.0)
SEEDS = range(4)


def batch(seed: int, scale: float, B: int = 8, T: int = 9):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3.0 - 0.05  # [B, T]
    logp = old + scale * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, generator=g, dtype=torch.float64)  # [B]
    adv[0], adv[1] = abs(adv[0]) + 0.1, -abs(adv[1]) - 0.1
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0] = T
    mask = torch.arange(T)[None, :] < lengths[:, None]  # [B, T], every row has a token (verl's mean counts all)
    return old, logp, adv, mask


def verl_config(**policy_loss):
    """The attributes verl's functions read from its ActorConfig."""
    return SimpleNamespace(clip_ratio=0.2, clip_ratio_low=policy_loss.pop("clip_ratio_low", 0.2),
                           clip_ratio_high=policy_loss.pop("clip_ratio_high", 0.2), global_batch_info={},
                           policy_loss=SimpleNamespace(**policy_loss))


def run_verl(mode, old, logp, adv, mask, config, agg, seed):
    lp = logp.clone().requires_grad_(True)
    torch.manual_seed(seed)
    loss, metrics = get_policy_loss_fn(mode)(old, lp, adv[:, None].expand_as(lp).clone(), mask.double(),
                                             loss_agg_mode=agg, config=config)
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.detach(), grad, metrics


def run_vespo(name, old, logp, adv, mask, cfg, seed):
    lp = logp.clone().requires_grad_(True)
    torch.manual_seed(seed)
    out = get_loss(name).fn(prepare_inputs(lp, old, adv, mask), cfg)
    (grad,) = torch.autograd.grad(out.loss, lp)
    return out.loss.detach(), grad, out


CASES = {  # case -> (vespo loss, its options, verl mode, verl's config options, verl agg)
    "gmpo": ("gmpo", {"eps_low": 0.4, "eps_high": 0.4}, "geo_mean",
             {"clip_ratio_low": 0.4, "clip_ratio_high": 0.4}, "token-mean"),
    "gmpo_asym": ("gmpo", {"eps_low": 0.1, "eps_high": 0.3}, "geo_mean",
                  {"clip_ratio_low": 0.1, "clip_ratio_high": 0.3}, "token-mean"),
    "dro_token_mean": ("dro", {"beta": 0.1}, "dro", {"dro_beta": 0.1}, "token-mean"),
    "dro_seq_mean": ("dro", {"beta": 2.0, "agg": "seq-mean-token-mean"}, "dro", {"dro_beta": 2.0},
                     "seq-mean-token-mean"),
    "kl_cov": ("kl_cov", {}, "kl_cov", {"kl_cov_ratio": 2e-4, "ppo_kl_coef": 0.1}, "token-mean"),
    "kl_cov_wide": ("kl_cov", {"kl_cov_ratio": 0.2, "coef": 0.5, "agg": "seq-mean-token-sum"}, "kl_cov", {"kl_cov_ratio": 0.2, "ppo_kl_coef": 0.5},
                    "seq-mean-token-sum"),
    "clip_cov": ("clip_cov", {}, "clip_cov", {"clip_cov_ratio": 2e-4, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0},
                 "token-mean"),
    "clip_cov_wide": ("clip_cov", {"clip_cov_ratio": 0.3, "clip_cov_lb": 0.05, "clip_cov_ub": 2.0, "eps_high": 0.28},
                      "clip_cov", {"clip_cov_ratio": 0.3, "clip_cov_lb": 0.05, "clip_cov_ub": 2.0,
                                   "clip_ratio_high": 0.28}, "token-mean"),
}


def main() -> None:
    diffs, acted = {}, {}
    for case, (name, options, mode, verl_options, agg) in CASES.items():
        worst, selected = 0.0, 0.0
        for seed in SEEDS:
            for scale in SCALES:
                old, logp, adv, mask = batch(seed, scale)
                v_loss, v_grad, _ = run_verl(mode, old, logp, adv, mask, verl_config(**verl_options), agg, seed)
                cfg = get_loss(name).config_cls(**options)
                o_loss, o_grad, out = run_vespo(name, old, logp, adv, mask, cfg, seed)
                worst = max(worst, float((v_loss - o_loss).abs()), float((v_grad - o_grad).abs().max()))
                selected += float(out.rows.get("cov_selected", out.rows.get("clip_high", torch.zeros(1))).sum())
        diffs[case], acted[case] = worst, selected
    print(json.dumps({"diff": diffs, "acted": acted, "rejection": check_rejection(),
                      "batch_normalize": check_batch_normalize(), "presets": check_presets(),
                      "presets_mutated": mutated_presets()}))


def check_rejection() -> dict:
    """vespo's mode=reject against verl's compute_rollout_rejection_mask, one option at a time, on every one of
    verl's 11 options: the tokens each keeps (mismatches), and how many it rejected."""
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_rejection_mask

    from vespo.losses.rollout_correction import REJECT_BY, RolloutCorrection, reject_keep

    bounds = {"k1": ("0.8_1.25", {"reject_low": 0.8, "reject_high": 1.25}), "k2": ("0.05", {"reject_high": 0.05}),
              "k3": ("0.05", {"reject_high": 0.05})}
    out = {}
    for option in REJECT_BY:
        verl_threshold, ours = bounds[option.rsplit("_", 1)[1]]
        mismatched, rejected = 0, 0
        for seed in SEEDS:
            old, logp, _, mask = batch(seed, 0.3)  # logp plays pi_old, old plays pi_rollout
            verl_mask, _ = compute_rollout_rejection_mask(logp - old, mask.double(), option, verl_threshold)
            keep = reject_keep(torch.where(mask, old - logp, 0.0), mask.double(), RolloutCorrection(mode="reject", reject_by=option, **ours))
            keep = keep.expand_as(mask) & mask
            mismatched += int((keep != (verl_mask > 0)).sum())
            rejected += int((mask & ~keep).sum())
        out[option] = {"mismatched": mismatched, "rejected": rejected}
    return out


def check_batch_normalize() -> dict:
    """rollout_correction.batch_normalize against verl's compute_rollout_correction_weights with
    rollout_is_batch_normalize=True: token and sequence TIS (C = 2) and token IcePop ("0.5_5.0"); the largest
    |difference| of the weights on the valid tokens, and the normalizing factor (not 1: it acted)."""
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights

    from vespo.losses.rollout_correction import RolloutCorrection, batch_mean, correction_weight

    cases = {"tis_token": ("token", 2.0, {"mode": "tis_token", "threshold": 2.0}),
             "tis_seq": ("sequence", 2.0, {"mode": "tis_seq", "threshold": 2.0}),
             "icepop": ("token", "0.5_5.0", {"mode": "icepop"})}
    out = {}
    for case, (level, threshold, ours) in cases.items():
        worst, factors = 0.0, []
        for seed in SEEDS:
            old, logp, _, mask = batch(seed, 0.3 if level == "token" else 0.1)  # logp: pi_old, old: pi_rollout
            theirs, metrics = compute_rollout_correction_weights(logp - old, mask.double(), level, threshold, True)
            mask_f = mask.double()
            d = torch.where(mask, old - logp, 0.0)  # rollout_d as prepare_inputs gives it: 0 on padding
            cfg = RolloutCorrection(**ours, batch_normalize=True)
            mine = correction_weight(d, mask_f, cfg).expand_as(mask_f)
            worst = max(worst, float(((mine - theirs) * mask_f).abs().max()))
            plain = correction_weight(d, mask_f, RolloutCorrection(**ours))
            factors.append(float(batch_mean(plain, mask_f)))
            worst = max(worst, abs(factors[-1] - metrics["rollout_is_batch_norm_factor"]))
        out[case] = {"diff": worst, "factor_min": min(factors), "factor_max": max(factors)}
    return out


DOCS = Path(__file__).resolve().parents[2] / "docs" / "losses.md"
PRESET_SCALES = (0.0003, 0.001, 0.003, 0.03, 0.1, 0.3, 1.0)  # the geo band (+-0.001) and k3's 0.01 split the rows


class VerlConfig(SimpleNamespace):
    """The attributes and ``get`` verl's vanilla and bypass-mode losses read from their ActorConfig."""

    def get(self, key, default=None):
        return getattr(self, key, default)


def preset_table(path: Path = DOCS) -> dict[str, str]:
    """docs/losses.md's table "verl's presets": verl preset -> the vespo setting (its code span)."""
    lines = path.read_text().split("\n")
    start = lines.index("### verl's presets")
    rows = {}
    for line in lines[start + 1:]:
        if line.startswith("## "):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("| `") else []
        if len(cells) == 3:
            rows[cells[0].strip("`")] = re.fullmatch(r"`([^`]*)`", cells[2]).group(1)
    return rows


def vespo_setting(line: str) -> tuple[str, dict, bool]:
    """(loss name, its options, bypass) of a vespo setting such as `loss.name=grpo staleness.behavior=rollout
    "loss.options.rollout_correction={mode: reject, ...}"`; the loss defaults to grpo (verl's vanilla)."""
    name, options, behavior = "grpo", {}, None
    for item in shlex.split(line):
        key, _, raw = item.partition("=")
        value = yaml.safe_load(raw)
        if key == "loss.name":
            name = value
        elif key.startswith("loss.options."):
            options[key.removeprefix("loss.options.")] = value
        elif key == "staleness.behavior":
            behavior = value
        else:
            raise ValueError(f"unexpected override {item!r}")
    assert behavior in ("recompute", "rollout"), line
    return name, options, behavior == "rollout"


def verl_presets() -> dict[str, dict]:
    """Every preset (classmethod) of verl's RolloutCorrectionConfig, as its fields."""
    from verl.trainer.config.algorithm import RolloutCorrectionConfig

    out = {}
    for attr, value in vars(RolloutCorrectionConfig).items():
        if isinstance(value, classmethod):
            preset = getattr(RolloutCorrectionConfig, attr)()
            if isinstance(preset, RolloutCorrectionConfig):
                out[attr] = {f.name: getattr(preset, f.name) for f in dataclasses.fields(preset)}
    return out


def run_verl_preset(preset: dict, old, logp, rollout, adv, mask):
    """verl's loss, gradient and per-token correction factor (IS weight x rejected mask) under one preset:
    decoupled mode as verl's trainer runs it (compute_rollout_correction_and_rejection_mask on pi_old / pi_rollout,
    then its vanilla loss with the IS weights, the rejected mask and the count of its kept tokens), bypass mode
    through compute_policy_loss_bypass_mode (old := rollout, the count taken before the loss rejects)."""
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

    fields = {k: preset[k] for k in ("rollout_is", "rollout_is_threshold", "rollout_is_batch_normalize",
                                     "rollout_rs", "rollout_rs_threshold")}
    mask_f = mask.double()
    lp = logp.clone().requires_grad_(True)
    token_adv = adv[:, None].expand_as(lp).clone()
    if preset["bypass_mode"]:
        is_proto, kept, _ = compute_rollout_correction_and_rejection_mask(logp, rollout, mask_f, **fields)
        is_w = is_proto.batch["rollout_is_weights"] if is_proto is not None else None
        factor = kept * (is_w if is_w is not None and preset["loss_type"] == "reinforce" else 1.0)
        config = VerlConfig(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0,
                            policy_loss=VerlConfig(rollout_correction=preset),
                            global_batch_info={"batch_num_tokens": float(mask_f.sum()), "dp_size": 1})
        loss, _ = get_policy_loss_fn("bypass_mode")(rollout, lp, token_adv, mask_f, loss_agg_mode="token-mean",
                                                    config=config)
        count = None
    else:
        is_proto, kept, _ = compute_rollout_correction_and_rejection_mask(old, rollout, mask_f, **fields)
        is_w = is_proto.batch["rollout_is_weights"] if is_proto is not None else None
        factor = kept * (is_w if is_w is not None else 1.0)
        count = float(kept.sum())
        config = VerlConfig(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0,
                            policy_loss=VerlConfig(), global_batch_info={"batch_num_tokens": count, "dp_size": 1})
        loss, _ = get_policy_loss_fn("vanilla")(old, lp, token_adv, kept, loss_agg_mode="token-mean", config=config,
                                                rollout_is_weights=is_w)
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.detach(), grad, factor, count, kept


def run_vespo_setting(setting: str, old, logp, rollout, adv, mask, normalizer):
    """vespo's loss, gradient and per-token correction weight (x mask) under one setting of the table."""
    from vespo.losses.base import rollout_correction

    name, options, bypass = vespo_setting(setting)
    spec = get_loss(name)
    cfg = spec.config_cls(**options)
    lp = logp.clone().requires_grad_(True)
    x = prepare_inputs(lp, rollout if bypass else old, adv, mask, None if bypass else rollout, bypass=bypass)
    out = spec.fn(x, cfg, normalizer)
    (grad,) = torch.autograd.grad(out.loss, lp)
    correction = rollout_correction(x, cfg)
    weight = torch.ones_like(x.mask_f) if correction is None else correction.weight.expand_as(x.mask_f)
    return out.loss.detach(), grad, weight * x.mask_f


def check_presets() -> dict:
    """Every verl preset against its vespo setting in docs/losses.md: the largest |difference| of the per-token
    correction factor, the loss and its gradient over seeds and scales (decoupled batches where verl rejected every
    token, whose token-mean verl divides by 0, compare the factor only), and how many valid tokens verl's rejection
    kept and rejected, how many IS weights it truncated, and how many kept tokens IcePop's band zeroed."""
    table, presets = preset_table(), verl_presets()
    out = {"table": sorted(table), "verl": sorted(presets), "rows": {}}
    for name in sorted(set(table) & set(presets)):
        preset = presets[name]
        row = {"weight": 0.0, "loss": 0.0, "grad": 0.0, "kept": 0, "rejected": 0,
               "truncated": 0, "zeroed": 0, "max_abs_seq_log_ratio": 0.0, "compared": 0,
               **{k: preset[k] for k in ("rollout_is", "rollout_is_threshold", "rollout_rs", "bypass_mode",
                                         "loss_type")}}
        for seed in SEEDS:
            for scale in PRESET_SCALES:
                old, _, adv, mask = batch(seed, 0.3)
                g = torch.Generator().manual_seed(1000 + seed)  # the engine and pi_theta each `scale` from pi_old
                rollout = old - scale * torch.randn(old.shape, generator=g, dtype=torch.float64)
                logp = old + scale * torch.randn(old.shape, generator=g, dtype=torch.float64)
                v_loss, v_grad, v_factor, count, kept = run_verl_preset(preset, old, logp, rollout, adv, mask)
                empty = count == 0  # decoupled, every token rejected: verl's token-mean is 0 / 0
                o_loss, o_grad, o_weight = run_vespo_setting(table[name], old, logp, rollout, adv, mask,
                                                             None if empty else count)
                row["weight"] = max(row["weight"], float((v_factor - o_weight).abs().max()))
                if not empty:
                    row["loss"] = max(row["loss"], float((v_loss - o_loss).abs()))
                    row["grad"] = max(row["grad"], float((v_grad - o_grad).abs().max()))
                    row["compared"] += 1
                row["kept"] += int(kept.sum())
                row["zeroed"] += int(((v_factor == 0) & (kept > 0)).sum())  # IcePop's band (the mask kept them)
                row["rejected"] += int(mask.sum()) - int(kept.sum())
                base = logp if preset["bypass_mode"] else old
                d = torch.where(mask, base - rollout, 0.0)
                level, threshold = preset["rollout_is"], preset["rollout_is_threshold"]
                if level is not None and not isinstance(threshold, str):
                    ratio = d.exp() if level == "token" else d.sum(-1, keepdim=True).exp().expand_as(d)
                    row["truncated"] += int(((ratio > threshold) & mask).sum())
                row["max_abs_seq_log_ratio"] = max(row["max_abs_seq_log_ratio"], float(d.sum(-1).abs().max()))
        out["rows"][name] = row
    return out


def mutated_presets() -> dict:
    """Mutation check: vespo's k1 band read the wrong way round (on pi_old / pi_rollout: low and high swapped and
    inverted) against verl's sequence TIS with seq_sum_k1 "0.7_1.6"; the valid tokens whose factor differs."""
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

    from vespo.losses.rollout_correction import RolloutCorrection, correction_weight

    differ = 0
    for seed in SEEDS:
        old, _, _, mask = batch(seed, 0.3)
        rollout = old - 0.1 * torch.randn(old.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        is_proto, kept, _ = compute_rollout_correction_and_rejection_mask(
            old, rollout, mask.double(), rollout_is="sequence", rollout_is_threshold=2.0, rollout_rs="seq_sum_k1",
            rollout_rs_threshold="0.7_1.6")
        theirs = is_proto.batch["rollout_is_weights"] * kept
        rc = RolloutCorrection(mode="tis_seq", threshold=2.0, reject_by="seq_sum_k1", reject_low=1 / 1.6,
                               reject_high=1 / 0.7)
        mine = correction_weight(torch.where(mask, rollout - old, 0.0), mask.double(), rc).expand_as(theirs) * mask
        differ += int(((mine - theirs).abs() > 1e-12).sum())
    return {"differ": differ}


if __name__ == "__main__":
    main()
