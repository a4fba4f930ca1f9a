"""verl 0.9.1's real actor update with vespo's loss, on the CPU, against vespo's own loss (run in .venv-verl).

    .venv-verl/bin/python tests/integrations/verl_actor_check.py      # prints one JSON line of results

The path is the one verl's PPO trainer drives (`RayPPOTrainer._update_actor`): a padded batch is made a TensorDict
without padding (`left_right_2_no_padding`), given the trainer's batch settings, and sent to
`ActorRolloutRefWorker.update_actor` → `TrainingWorker.train_mini_batch` → `train_batch` → the FSDP2 engine's
`train_batch` (4 micro-batches of 2, gradient accumulation) → `ppo_loss` → `get_policy_loss_fn("vespo")`, i.e.
vespo's plug-in, configured by the documented Hydra overrides. The gradient is read just before the optimizer step
(an optimizer step pre-hook), the loss from the worker's returned metrics.

What verl 0.9.1 needs on a CPU, all here; nothing of verl's update path is replaced:
- a CPU platform registered through verl's PlatformRegistry (verl knows CUDA, NPU and ROCm, and falls back to CUDA);
  its device module answers verl's accelerator memory statistics with 0;
- a one-process gloo process group (verl's own init would also ask for the platform's collective backend);
- verl's FSDP engine registered for device "cpu" (verl registers it for cuda and npu only);
- eager attention (`model.override_config.attn_implementation`; verl asks for FlashAttention-2);
- float32 throughout (`fsdp_config.mixed_precision` fp32; verl's default is bf16 parameters under autocast, which
  computes the bf16 model's loss), and `optim.clip_grad` out of reach so the gradient read is unclipped.

The reference: the same tiny model (same weights, same attention implementation) forwarded on the same batch in one
piece, its response log-probs given to vespo.losses' VESPO with the same options, token-mean over the batch.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import torch

OPTIONS = {"k_pos": 1.5, "lambda_pos": 2.5, "k_neg": 3.5, "lambda_neg": 1.5}
B, P, R, N = 8, 4, 6, 4  # sequences, prompt length, response length, rollout.n (mini-batch = B prompts' groups)


def init_cpu_process_group() -> None:
    """World size 1 over gloo, rendezvous through a file (no port to race for), before verl's worker would
    initialise its own; the rank variables are the ones verl's Worker reads."""
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT="29500")  # recorded by verl's Worker, never bound: the group meets through a file
    store = tempfile.mkdtemp(prefix="verl-gloo-")
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}/rendezvous", rank=0, world_size=1)


class CpuDevice:
    """The device module verl's CPU platform hands out (verl calls torch.cuda's names on it): torch.cpu's where it
    has them, no-ops for the cache and device selection, 0 for the accelerator memory statistics verl logs."""

    def __getattr__(self, name):
        if name in ("empty_cache", "set_device", "reset_peak_memory_stats", "synchronize"):
            return lambda *args, **kwargs: None
        if name in ("max_memory_allocated", "max_memory_reserved", "memory_allocated", "memory_reserved"):
            return lambda *args, **kwargs: 0
        if name == "get_device_name":
            return lambda *args, **kwargs: "CPU"  # verl's flops table has none: MFU against an infinite peak
        if name == "mem_get_info":
            return lambda *args, **kwargs: (0, 0)
        if name in ("manual_seed", "manual_seed_all"):
            return torch.manual_seed
        if name in ("get_rng_state", "set_rng_state"):
            return getattr(torch, name)
        return getattr(torch.cpu, name)


def use_cpu_platform() -> None:
    """verl 0.9.1 knows CUDA, NPU and ROCm platforms only (and falls back to CUDA): register a CPU one through its
    platform registry, before anything asks for the platform."""
    from verl.plugin.platform.platform_cuda import PlatformCUDA
    from verl.plugin.platform.platform_manager import PlatformRegistry, set_platform

    class PlatformCPU(PlatformCUDA):
        device_name = property(lambda self: "cpu")
        vendor_name = property(lambda self: "cpu")
        device_module = property(lambda self: CpuDevice())

        def is_available(self) -> bool:
            return True

        def current_device(self):
            return "cpu"  # verl moves tensors with .to(current_device())

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index) -> None:
            pass

        def synchronize(self, device_index=None) -> None:
            pass

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def empty_cache(self) -> None:
            pass

        def communication_backend_name(self) -> str:
            return "gloo"

    PlatformRegistry.register("cpu")(PlatformCPU)
    set_platform(PlatformCPU())


def register_fsdp_engine_for_cpu() -> None:
    from verl.workers.engine import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    EngineRegistry.register(model_type="language_model", backend=["fsdp", "fsdp2"], device="cpu")(FSDPEngineWithLMHead)


def save_tiny_model(path: str) -> None:
    from vespo.models import build_char_tokenizer, tiny_model

    tokenizer = build_char_tokenizer()
    tiny_model("qwen3", "nano", tokenizer=tokenizer, seed=0).save_pretrained(path)
    tokenizer.save_pretrained(path)


def actor_config(model_dir: str):
    """verl's ppo_trainer config with the documented vespo overrides, on the tiny model, fp32, CPU-sized."""
    import verl
    from hydra import compose, initialize_config_dir

    overrides = [
        f"actor_rollout_ref.model.path={model_dir}",
        "actor_rollout_ref.model.use_remove_padding=False",
        "+actor_rollout_ref.model.override_config.attn_implementation=eager",  # FlashAttention-2 is CUDA-only
        "actor_rollout_ref.actor.strategy=fsdp2",
        "actor_rollout_ref.actor.policy_loss.loss_mode=vespo",
        "actor_rollout_ref.actor.policy_loss._target_=vespo.integrations.verl.VespoPolicyLossConfig",
        *[f"+actor_rollout_ref.actor.policy_loss.vespo.{k}={v}" for k, v in OPTIONS.items()],
        "actor_rollout_ref.actor.loss_agg_mode=token-mean",
        "+actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp32",
        "+actor_rollout_ref.actor.fsdp_config.mixed_precision.reduce_dtype=fp32",
        "+actor_rollout_ref.actor.fsdp_config.mixed_precision.buffer_dtype=fp32",
        "actor_rollout_ref.actor.fsdp_config.model_dtype=fp32",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={B // N}",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.actor.ppo_epochs=1",
        "actor_rollout_ref.actor.shuffle=False",
        "actor_rollout_ref.actor.entropy_coeff=0.0",
        "actor_rollout_ref.actor.use_kl_loss=False",
        "actor_rollout_ref.actor.optim.clip_grad=1e9",  # the gradient read before the step is then unscaled
        "actor_rollout_ref.actor.optim.lr=1e-3",
        f"actor_rollout_ref.rollout.n={N}",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
    ]
    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose("ppo_trainer", overrides=overrides)


def make_batch(vocab: int):
    """A PPO batch as verl's trainer holds it: left-padded prompts, right-padded responses, behaviour log-probs
    (set after the model's forward, below) and sequence advantages broadcast over the response tokens."""
    g = torch.Generator().manual_seed(0)
    prompt_len = torch.randint(1, P + 1, (B,), generator=g)
    response_len = torch.randint(1, R + 1, (B,), generator=g)
    prompt_mask = torch.arange(P)[None, :] >= P - prompt_len[:, None]  # [B, P] left padding
    response_mask = torch.arange(R)[None, :] < response_len[:, None]  # [B, R] right padding
    prompts = torch.randint(2, vocab, (B, P), generator=g) * prompt_mask
    responses = torch.randint(2, vocab, (B, R), generator=g) * response_mask
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1).long()  # [B, P + R]
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # [B, P + R]
    advantages = torch.randn(B, 1, generator=g).expand(B, R) * response_mask  # [B, R]
    return {"prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": attention_mask, "position_ids": position_ids,
            "response_mask": response_mask.long(), "advantages": advantages.contiguous()}


def response_logp(model, batch) -> torch.Tensor:
    """log π_θ [B, R] of each response token, the whole batch in one forward."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=batch["position_ids"], use_cache=False).logits.float()  # [B, P + R, V]
    logp = torch.log_softmax(logits[:, P - 1:-1], dim=-1)  # [B, R, V] predictions of the response tokens
    return logp.gather(-1, batch["responses"][..., None])[..., 0]  # [B, R]


def vespo_reference(model_dir: str, attn: str, batch):
    """vespo's VESPO loss and its gradient per parameter name on the batch, from vespo.losses directly."""
    from transformers import AutoModelForCausalLM

    from vespo.losses import get_loss, prepare_inputs

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32, attn_implementation=attn)
    mask = batch["response_mask"].bool()
    x = prepare_inputs(response_logp(model, batch), batch["old_log_probs"], batch["advantages"][:, 0], mask)
    loss = get_loss("vespo").fn(x, get_loss("vespo").config_cls(**OPTIONS)).loss
    loss.backward()
    return loss.item(), {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def run_verl_update(config, batch):
    """verl's update_actor on the batch, as RayPPOTrainer._update_actor sends it; returns its metrics and the
    gradient per parameter name just before the optimizer step."""
    from verl import DataProto
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine_workers import ActorRolloutRefWorker
    from verl.workers.utils.padding import left_right_2_no_padding

    worker = ActorRolloutRefWorker(config=config.actor_rollout_ref, role="actor")
    worker.init_model()
    engine = worker.actor.engine
    grads: dict[str, torch.Tensor] = {}

    def read_grads(optimizer, args, kwargs):
        for name, p in engine.module.named_parameters():
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            grads[name.removeprefix("_fsdp_wrapped_module.")] = g.detach().clone()

    engine.optimizer.register_step_pre_hook(read_grads)
    data = DataProto.from_single_dict({k: v for k, v in batch.items()})
    data.meta_info.update(multi_turn=False, temperature=1.0)
    td = left_right_2_no_padding(data.to_tensordict())
    mini = config.actor_rollout_ref.actor.ppo_mini_batch_size * config.actor_rollout_ref.rollout.n
    tu.assign_non_tensor(td, calculate_entropy=False, distillation_use_topk=False, distillation_only=False,
                         global_batch_size=mini, mini_batch_size=mini, epochs=1, seed=0,
                         dataloader_kwargs={"shuffle": False}, compute_loss=True)
    output = worker.update_actor(td)
    return tu.get(output, "metrics"), grads, engine


def main() -> None:
    use_cpu_platform()
    init_cpu_process_group()
    register_fsdp_engine_for_cpu()
    model_dir = tempfile.mkdtemp(prefix="verl-actor-")
    save_tiny_model(model_dir)
    config = actor_config(model_dir)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    batch = make_batch(model.config.vocab_size)
    with torch.no_grad():  # behaviour log-probs: the model's own, moved so that W differs from 1
        noise = 0.3 * torch.randn(B, R, generator=torch.Generator().manual_seed(1))
        batch["old_log_probs"] = (response_logp(model, batch) + noise) * batch["response_mask"]
    metrics, grads, engine = run_verl_update(config, batch)
    attn = engine.module.config._attn_implementation
    ref_loss, ref_grads = vespo_reference(model_dir, attn, batch)
    missing = sorted(set(ref_grads) - set(grads))
    grad_diff = max(float((grads[n] - g).abs().max()) for n, g in ref_grads.items() if n in grads)
    grad_scale = max(float(g.abs().max()) for g in ref_grads.values())
    flat = {k: (v[0] if isinstance(v, list) and len(v) == 1 else v) for k, v in metrics.items()}
    verl_loss = float(sum(metrics["loss"]) if isinstance(metrics["loss"], list) else metrics["loss"])
    print(json.dumps({
        "attn_implementation": attn,
        "autocast_dtype": str(getattr(engine, "_autocast_dtype", None)),
        "param_dtype": str(next(engine.module.parameters()).dtype),
        "verl_loss": verl_loss,
        "vespo_loss": ref_loss,
        "loss_diff": abs(verl_loss - ref_loss),
        "grad_diff": grad_diff,
        "grad_scale": grad_scale,
        "grad_names_missing": missing,
        "grad_params": len(grads),
        "metric_keys": sorted(flat),
        "is_ess": flat.get("actor/is/ess"),
    }, default=str))


if __name__ == "__main__":
    sys.exit(main())
