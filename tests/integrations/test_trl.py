"""VespoGRPOTrainer: a real TRL GRPOTrainer run on a tiny model, and its loss against TRL's own `vespo`.

The model (Qwen3 "nano") and the character tokenizer are built from configs, no hub access. One
generation batch of 8 completions is split into 2 optimizer steps (steps_per_generation=2), so
TRL computes old log-probs and the second step is off-policy.

vLLM does not run here, so the tests of TRL's vLLM importance-sampling correction give a real
batch the sampler log-probs vLLM would have returned (TRL's `sampling_per_token_logps`, differing
from the trainer's) and the ratio TRL forms from them (`importance_sampling_ratio`, computed below
as TRL 1.16's `_generate_and_score_completions` does), and switch the correction on
(`use_vllm`, `vllm_importance_sampling_*`); TRL's own loss code then runs as shipped. They compare
twice: through the model (float32; the model's own backward adds float32 rounding to the parameter
gradients), and in float64 on the log-probs themselves, where the gradient dL/dlogp of both losses
must agree to 1e-9.
"""

from __future__ import annotations

import math

import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from vespo.integrations.trl import (  # noqa: E402
    VespoGRPOTrainer,
    _check_supported,
    check_trl_version,
    trl_rollout_correction,
)
from vespo.losses import get_loss  # noqa: E402
from vespo.models import build_char_tokenizer, tiny_model  # noqa: E402


def distinct_chars(completions, **kwargs) -> list[float]:
    """Reward: the share of distinct characters in the completion (0 for an empty one)."""
    return [len(set(c)) / max(len(c), 1) for c in completions]


def make_trainer(tmp_path, cls=VespoGRPOTrainer, config=None, **kwargs):
    """A trainer on the tiny model; ``config``: GRPOConfig fields to change, ``kwargs``: the trainer's."""
    torch.manual_seed(0)
    tokenizer = build_char_tokenizer()
    model = tiny_model("qwen3", "nano", tokenizer=tokenizer, seed=0)
    settings = {
        "output_dir": str(tmp_path),
        "per_device_train_batch_size": 4,
        "num_generations": 4,
        "steps_per_generation": 2,
        "max_completion_length": 6,
        "max_steps": 3,
        "learning_rate": 5e-3,
        "loss_type": "vespo",
        "beta": 0.0,
        "bf16": False,
        "use_cpu": True,
        "report_to": "none",
        "logging_steps": 1,
        "save_strategy": "no",
        "seed": 0,
        "dataloader_num_workers": 0,
    }
    args = GRPOConfig(**{**settings, **(config or {})})
    data = datasets.Dataset.from_dict({"prompt": ["12+3=", "ab", "sort 312:", "x"]})
    return cls(model=model, reward_funcs=distinct_chars, args=args, train_dataset=data,
               processing_class=tokenizer, **kwargs)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    trainer = make_trainer(tmp_path_factory.mktemp("trl"))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    return trainer, before


def test_three_steps_train_and_log_vespo_metrics(trained):
    trainer, before = trained
    assert trainer.state.global_step == 3
    changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert changed, "no parameter changed in 3 optimizer steps"
    logged = {key for entry in trainer.state.log_history for key in entry}
    assert {"is/ess", "vespo/phi_pos_mean", "entropy"} <= logged, sorted(logged)


def _batch(trainer):
    """A real batch TRL prepared (its second micro-batch), behavior log-probs perturbed so W varies."""
    batch = dict(trainer._buffered_inputs[1])
    g = torch.Generator().manual_seed(3)
    noise = 0.3 * torch.randn(batch["completion_ids"].shape, generator=g)  # [B, T]
    batch["old_per_token_logps"] = batch["old_per_token_logps"] + noise * batch["completion_mask"]
    return batch


def test_loss_equals_trl_builtin_vespo(trained):
    trainer, _ = trained
    batch = _batch(trainer)
    assert batch["old_per_token_logps"] is not None
    param = next(trainer.model.parameters())
    ours = trainer._compute_loss(trainer.model, batch)
    builtin = GRPOTrainer._compute_loss(trainer, trainer.model, batch)
    assert torch.isfinite(ours) and ours.abs() > 0
    torch.testing.assert_close(ours, builtin, rtol=1e-5, atol=1e-7)
    g_ours = torch.autograd.grad(ours, param)[0]
    g_builtin = torch.autograd.grad(GRPOTrainer._compute_loss(trainer, trainer.model, batch), param)[0]
    torch.testing.assert_close(g_ours, g_builtin, rtol=1e-4, atol=1e-7)


def test_every_logged_metric_is_the_optimizer_steps_whatever_the_micro_batching(trained, monkeypatch):
    """One optimizer step's 4 rows in one call, or in 4 micro-batch calls (gradient accumulation 4): the same
    value of every vespo metric TRL logs, to float rounding (is/ess, quantiles, phi_neg_min of an A < 0 row
    that only one micro-batch has, counts...)."""
    trainer, _ = trained
    batch = _batch(trainer)
    batch["advantages"] = torch.tensor([1.0, -0.5, 0.25, 0.5])  # one A < 0 row: the others' micro-batches have none
    trainer.model.train()
    trainer.log({})  # what earlier calls left is logged and gone
    logged = []
    for parts in (1, 4):
        monkeypatch.setattr(trainer, "current_gradient_accumulation_steps", parts, raising=False)
        monkeypatch.setattr(trainer.args, "steps_per_generation", parts)  # the same tokens per optimizer step
        for rows in torch.arange(4).chunk(parts):
            trainer._compute_loss(trainer.model, {k: v[rows] if torch.is_tensor(v) and v.dim() and len(v) == 4 else v
                                                  for k, v in batch.items()})
        logs: dict = {}
        trainer.log(logs)
        logged.append(logs)
    whole, split = logged
    keys = [k for k in whole if k.startswith(("is/", "kl/", "loss/", "vespo/")) or k == "entropy"]
    assert {"is/ess", "is/log_w_p90", "vespo/phi_neg_min", "vespo/n_neg", "entropy"} <= set(keys)
    assert whole["vespo/n_neg"] == 1.0 and whole["is/log_w_max"] != 0.0
    for key in keys:
        assert split[key] == pytest.approx(whole[key], rel=1e-5, abs=1e-7), key


def test_length_norm_ablation_changes_the_loss(trained):
    trainer, _ = trained
    batch = _batch(trainer)
    base = trainer._compute_loss(trainer.model, batch)
    trainer.vespo_config = get_loss("vespo").config_cls(length_norm="linear")
    try:
        ablated = trainer._compute_loss(trainer.model, batch)
    finally:
        trainer.vespo_config = get_loss("vespo").config_cls()
    assert not torch.allclose(base, ablated)


def test_rejects_options_the_hook_does_not_apply(tmp_path):
    args = GRPOConfig(output_dir=str(tmp_path), top_entropy_quantile=0.5, use_cpu=True, report_to="none")
    with pytest.raises(ValueError, match="GRPOConfig.top_entropy_quantile"):
        _check_supported(args)
    with pytest.raises(TypeError, match="loss_config for loss 'vespo' must be a VespoConfig"):
        make_trainer(tmp_path, loss_config=get_loss("grpo").config_cls())


# ---- TRL's vLLM importance-sampling correction -------------------------------------------------------

IS_MODES = ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
CLIP_MAX = 2.0  # low enough that truncation and masking bind on this batch


def trl_is_ratio(old_logp, sampling_logp, mask, mode, clip_max):
    """TRL 1.16's importance_sampling_ratio: exp((old - sampling) * mask), NaN -> ratio 1, per token or
    summed per sequence, then clipped above at clip_max (truncate) or zeroed above it (mask)."""
    diff = torch.nan_to_num((old_logp - sampling_logp) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, max=clip_max)
    return ratio.masked_fill(ratio > clip_max, 0.0)


def vllm_batch(trainer, mode):
    """A real batch in float64 with sampler log-probs differing from the trainer's, and TRL's ratio for ``mode``."""
    batch = _batch(trainer)
    batch["advantages"] = torch.tensor([0.7, -1.2, 0.4, -0.3])  # every sequence carries gradient
    g = torch.Generator().manual_seed(4)
    mask = batch["completion_mask"].float()
    noise = 0.5 * torch.randn(mask.shape, generator=g)  # [B, T]
    noise[1] = 0.0
    noise[1, 0] = -1.5  # sequence 1: pi_old / pi_sampler = e^1.5 > CLIP_MAX on its first token and as a whole
    sampling = batch["old_per_token_logps"] + noise * mask
    sampling[0, 0] = math.nan  # a log-prob vLLM did not return: TRL counts its ratio as 1
    batch["sampling_per_token_logps"] = sampling
    batch["importance_sampling_ratio"] = trl_is_ratio(batch["old_per_token_logps"], sampling, mask, mode, CLIP_MAX)
    return batch


@pytest.fixture
def vllm_on(trained, monkeypatch):
    """The trained trainer with TRL's vLLM IS correction switched on; returns its model."""
    trainer, _ = trained
    monkeypatch.setattr(trainer, "use_vllm", True)
    monkeypatch.setattr(trainer, "vllm_importance_sampling_correction", True)
    monkeypatch.setattr(trainer, "vllm_importance_sampling_clip_max", CLIP_MAX)
    monkeypatch.setattr(trainer, "vllm_importance_sampling_clip_min", None)
    return trainer.model


# (TRL loss_type, vespo loss, vespo options, TRL attributes): the same loss on both sides.
# TRL's CISPO bound is epsilon_high itself; its SAPO temperatures are float32, so 1.0625 stands for 1.05.
PAIRS = {
    "vespo": ("vespo", "vespo", {}, {}),
    "dapo": ("dapo", "grpo", {"dual_clip_c": None}, {}),
    "cispo": ("cispo", "cispo", {}, {"epsilon_high": 5.0}),
    "sapo": ("sapo", "sapo", {"tau_neg": 1.0625}, {"args.sapo_temperature_neg": 1.0625}),
}


@pytest.mark.parametrize("mode,pair", [(mode, pair) for pair in sorted(PAIRS) for mode in IS_MODES
                                       if pair != "vespo" or mode.startswith("token")])
def test_vllm_is_correction_matches_trl_builtin(trained, vllm_on, monkeypatch, mode, pair):
    """With TRL's IS correction on and sampler log-probs that differ from the trainer's, the adapter's loss
    and gradient equal TRL's built-in loss to 1e-6: VESPO folds log ratio into log W, the others multiply."""
    trainer, _ = trained
    model = vllm_on
    trl_type, name, options, trl_attrs = PAIRS[pair]
    monkeypatch.setattr(trainer, "vllm_importance_sampling_mode", mode)
    monkeypatch.setattr(trainer, "loss_type", trl_type)
    for attr, value in trl_attrs.items():
        owner, attr = (trainer.args, attr[5:]) if attr.startswith("args.") else (trainer, attr)
        monkeypatch.setattr(owner, attr, value)
    monkeypatch.setattr(trainer, "vespo_spec", get_loss(name))
    monkeypatch.setattr(trainer, "vespo_config", get_loss(name).config_cls(**options))
    batch = vllm_batch(trainer, mode)
    ratio = batch["importance_sampling_ratio"]
    assert ((ratio != 1.0) & (ratio > 0)).any() and (ratio == (CLIP_MAX if mode.endswith("truncate") else 0.0)).any()
    params = [p for p in model.parameters() if p.requires_grad]
    ours = trainer._compute_loss(model, batch)
    builtin = GRPOTrainer._compute_loss(trainer, model, batch)
    torch.testing.assert_close(ours, builtin, rtol=1e-6, atol=0)
    g_ours = torch.autograd.grad(ours, params)
    g_builtin = torch.autograd.grad(GRPOTrainer._compute_loss(trainer, model, batch), params)
    for a, b in zip(g_ours, g_builtin):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()  # float32 backward through the model
    loss64, grad64, ref64, ref_grad64 = float64_losses(trainer, model, batch, mode, monkeypatch)
    torch.testing.assert_close(loss64, ref64, rtol=1e-9, atol=0)
    torch.testing.assert_close(grad64, ref_grad64, rtol=1e-9, atol=1e-15)
    assert grad64.abs().max() > 0
    monkeypatch.setattr(trainer, "use_vllm", False)  # the same batch without the correction: another loss
    uncorrected = trainer._compute_loss(model, batch)
    assert not torch.allclose(uncorrected, ours, rtol=1e-4)


def float64_losses(trainer, model, batch, mode, monkeypatch):
    """Both losses and their gradients dL/dlogp [B, T] on the model's log-probs cast to a float64 leaf
    (and TRL's ratio formed again in float64)."""
    with torch.no_grad():
        logp = trainer._policy_logps(model, batch)[0].double()  # [B, T]
    batch = {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in batch.items()}
    batch["importance_sampling_ratio"] = trl_is_ratio(batch["old_per_token_logps"], batch["sampling_per_token_logps"],
                                                      batch["completion_mask"].double(), mode, CLIP_MAX)
    out = []
    for compute in (trainer._compute_loss, lambda m, b: GRPOTrainer._compute_loss(trainer, m, b)):
        leaf = logp.clone().requires_grad_(True)
        monkeypatch.setattr(trainer, "_get_per_token_logps_and_entropies",
                            lambda *a, leaf=leaf, **k: (leaf, torch.zeros_like(leaf), None))
        loss = compute(model, batch)
        out += [loss, torch.autograd.grad(loss, leaf)[0]]
    monkeypatch.delattr(trainer, "_get_per_token_logps_and_entropies")
    return out


def test_vllm_correction_settings_map_and_conflicts_fail(trained, vllm_on, monkeypatch):
    trainer, _ = trained
    expected = {"token_truncate": "tis_token", "token_mask": "mis_token", "sequence_truncate": "tis_seq",
                "sequence_mask": "mis_seq"}
    monkeypatch.setattr(trainer, "vespo_spec", get_loss("grpo"))
    for mode, ours in expected.items():
        monkeypatch.setattr(trainer, "vllm_importance_sampling_mode", mode)
        correction = trl_rollout_correction(trainer)
        assert (correction.mode, correction.threshold) == (ours, CLIP_MAX)
    monkeypatch.setattr(trainer, "vespo_spec", get_loss("vespo"))
    monkeypatch.setattr(trainer, "vllm_importance_sampling_mode", "token_mask")
    batch = vllm_batch(trainer, "token_mask")
    monkeypatch.setattr(trainer, "vespo_config", get_loss("vespo").config_cls(rollout_correction={"mode": "tis_seq"}))
    with pytest.raises(ValueError, match="would correct a second time"):
        trainer._compute_loss(vllm_on, batch)
    monkeypatch.setattr(trainer, "vespo_config", get_loss("vespo").config_cls())
    monkeypatch.setattr(trainer, "vllm_importance_sampling_clip_min", 0.5)
    with pytest.raises(ValueError, match="GRPOConfig.vllm_importance_sampling_clip_min=0.5 is not supported"):
        trainer._compute_loss(vllm_on, batch)
    monkeypatch.setattr(trainer, "vllm_importance_sampling_clip_min", None)
    del batch["sampling_per_token_logps"]
    with pytest.raises(ValueError, match="has no sampling_per_token_logps"):
        trainer._compute_loss(vllm_on, batch)


def test_sampler_gap_reported_without_trl_correction(trained, vllm_on, monkeypatch):
    """With TRL's correction off the sampler log-probs still reach the loss: rollout/k1 measures the gap."""
    trainer, _ = trained
    monkeypatch.setattr(trainer, "vllm_importance_sampling_correction", False)
    batch = vllm_batch(trainer, "token_truncate")
    trainer.model.train()
    trainer.log({})
    trainer._compute_loss(vllm_on, batch)
    logs: dict = {}
    trainer.log(logs)
    mask = batch["completion_mask"].bool()
    d = torch.nan_to_num(batch["sampling_per_token_logps"] - batch["old_per_token_logps"], nan=0.0)[mask]
    assert logs["rollout/k1"] == pytest.approx(d.mean().item(), rel=1e-6)


def test_adaptive_vespo_runs_in_trl(trained, vllm_on, monkeypatch):
    """vespo_adaptive through the hook: with its ESS target at 0 it is VESPO, so it equals TRL's built-in vespo."""
    trainer, _ = trained
    monkeypatch.setattr(trainer, "vllm_importance_sampling_mode", "token_mask")
    monkeypatch.setattr(trainer, "loss_type", "vespo")
    batch = vllm_batch(trainer, "token_mask")
    spec = get_loss("vespo_adaptive")
    monkeypatch.setattr(trainer, "vespo_spec", spec)
    monkeypatch.setattr(trainer, "vespo_config", spec.config_cls(rule="ess", ess_target=0.0))
    ours, builtin = trainer._compute_loss(vllm_on, batch), GRPOTrainer._compute_loss(trainer, vllm_on, batch)
    torch.testing.assert_close(ours, builtin, rtol=1e-6, atol=0)
    monkeypatch.setattr(trainer, "vespo_config", spec.config_cls())  # the budget rule: a loss of its own
    trainer.model.train()
    assert torch.isfinite(trainer._compute_loss(vllm_on, batch))
    logs: dict = {}
    trainer.log(logs)
    assert "vespo/lambda_pos" in logs


def test_adaptive_vespo_takes_trl_kernel_arguments(tmp_path):
    trainer = make_trainer(tmp_path, loss_name="vespo_adaptive")
    assert type(trainer.vespo_config).__name__ == "VespoAdaptiveConfig"
    assert (trainer.vespo_config.k_pos, trainer.vespo_config.lambda_neg) == (trainer.args.vespo_k_pos,
                                                                             trainer.args.vespo_lambda_neg)



@pytest.mark.parametrize("loss", ["vespo", "vespo_adaptive"])
@pytest.mark.parametrize("mode", ["sequence_mask", "sequence_truncate"])
def test_vespo_rejects_the_sequence_level_modes_as_trl_does(tmp_path, trained, vllm_on, monkeypatch, loss, mode):
    """TRL 1.16's loss_type="vespo" refuses the sequence-level vLLM correction when the trainer is built
    (TRL's default mode is one of them); the hook refuses it for vespo's VESPO losses too, at construction
    (both before vLLM is needed) and at every step, naming the field; the other losses accept it."""
    config = {"use_vllm": True, "vllm_importance_sampling_mode": mode}
    with pytest.raises(ValueError, match="VESPO loss requires `vllm_importance_sampling_mode`"):
        make_trainer(tmp_path, cls=GRPOTrainer, config=config)
    message = f"GRPOConfig.vllm_importance_sampling_mode='{mode}' is not supported with loss '{loss}'"
    config["loss_type"] = "dapo"  # TRL's own check stays out of the way
    with pytest.raises(ValueError, match=message):
        make_trainer(tmp_path, config=config, loss_name=loss)
    with pytest.raises(ImportError, match="vLLM is not available"):  # grpo passes the check; TRL then needs vLLM
        make_trainer(tmp_path, config=config, loss_name="grpo")
    trainer, _ = trained
    monkeypatch.setattr(trainer, "vespo_spec", get_loss(loss))
    monkeypatch.setattr(trainer, "vespo_config", get_loss(loss).config_cls())
    monkeypatch.setattr(trainer, "vllm_importance_sampling_mode", mode)
    with pytest.raises(ValueError, match=message):
        trainer._compute_loss(vllm_on, vllm_batch(trainer, mode))


@pytest.mark.parametrize("field,value", [("top_p", 0.9), ("top_k", 20), ("min_p", 0.05),
                                         ("repetition_penalty", 1.1)])
def test_truncated_vllm_sampling_refuses_trls_correction(trained, vllm_on, monkeypatch, field, value):
    """vLLM's log-probs are of the truncated distribution, TRL 1.16's π_old of the full one: the ratio would
    carry the kept mass, so the correction is refused, naming the field; without it the loss runs."""
    trainer, _ = trained
    monkeypatch.setattr(trainer, "vllm_importance_sampling_mode", "token_mask")
    monkeypatch.setattr(trainer, field, value)
    batch = vllm_batch(trainer, "token_mask")
    with pytest.raises(ValueError, match=f"GRPOConfig.{field}={value!r} with vllm_importance_sampling_correction"):
        trainer._compute_loss(vllm_on, batch)
    monkeypatch.setattr(trainer, "vllm_importance_sampling_correction", False)
    assert torch.isfinite(trainer._compute_loss(vllm_on, batch))


def test_other_trl_versions_are_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(trl, "__version__", "1.17.0")
    with pytest.raises(RuntimeError, match=r"supports TRL 1\.16\.x; TRL 1\.17\.0 is installed"):
        make_trainer(tmp_path)
    check_trl_version("1.16.2")
    with pytest.raises(RuntimeError, match="TRL 1.15.0 is installed"):
        check_trl_version("1.15.0")
