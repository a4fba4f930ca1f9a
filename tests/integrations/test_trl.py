"""VespoGRPOTrainer: a real TRL GRPOTrainer run on a tiny model, and its loss against TRL's own `vespo`.

The model (Qwen3 "nano") and the character tokenizer are built from configs, no hub access. One
generation batch of 8 completions is split into 2 optimizer steps (steps_per_generation=2), so
TRL computes old log-probs and the second step is off-policy.
"""

from __future__ import annotations

import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from vespo.integrations.trl import VespoGRPOTrainer, _check_supported  # noqa: E402
from vespo.losses import get_loss  # noqa: E402
from vespo.models import build_char_tokenizer, tiny_model  # noqa: E402


def distinct_chars(completions, **kwargs) -> list[float]:
    """Reward: the share of distinct characters in the completion (0 for an empty one)."""
    return [len(set(c)) / max(len(c), 1) for c in completions]


def make_trainer(tmp_path, cls=VespoGRPOTrainer, **kwargs):
    torch.manual_seed(0)
    tokenizer = build_char_tokenizer()
    model = tiny_model("qwen3", "nano", tokenizer=tokenizer, seed=0)
    args = GRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=4,
        steps_per_generation=2,
        max_completion_length=6,
        max_steps=3,
        learning_rate=5e-3,
        loss_type="vespo",
        beta=0.0,
        bf16=False,
        use_cpu=True,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        seed=0,
        dataloader_num_workers=0,
    )
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
