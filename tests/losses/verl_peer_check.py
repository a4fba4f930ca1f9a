"""vespo's gmpo, dro, kl_cov and clip_cov against verl 0.9.1's own policy losses (run in .venv-verl by
test_verl_peers.py).

    .venv-verl/bin/python tests/losses/verl_peer_check.py      # prints one JSON line of results

verl's functions (verl/trainer/ppo/core_algos.py: geo_mean, dro, kl_cov, clip_cov) run as shipped on float64
inputs with token-broadcast advantages [B, T], as verl passes them; vespo's run on the same batch with [B]
advantages. Each entry is the largest |difference| of loss and gradient over seeds and log-ratio scales.
clip_cov draws its cut tokens from torch's global generator in both: each call is preceded by the same seed.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

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
                      "batch_normalize": check_batch_normalize()}))


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


if __name__ == "__main__":
    main()
