"""Tiny, randomly initialised causal LMs built from configs, fully offline.

Dense (Qwen3, Llama) and mixture-of-experts models at a few preset sizes, in float32, for
tests, demos and the lab. The MoE architectures are one per family router replay supports
(``vespo.models.moe_families``): qwen3_moe (the lab's), qwen2_moe, qwen3_next, qwen3_5_moe,
olmoe, flex_olmo, mixtral, gpt_oss, deepseek_v2, deepseek_v3, glm4_moe, glm4_moe_lite, dots1,
each with 8 experts, top-2, and its family's typical gate options (``MOE_FIELDS``); the hybrid
ones (qwen3_next, qwen3_5_moe) alternate gated delta-net and full attention layers. Parameter counts with the 57-token character vocabulary:

    size   hidden  layers  heads/kv  head_dim  intermediate   dense params   moe (8 experts, top-2)
    nano       64       2      4/2        16           128          ~0.08M   ~0.2M
    xs        128       2      4/2        32           256          ~0.3M    ~0.9M   (the lab default)
    s         256       4      8/4        32           768          ~3.2M    ~10M
    m         512       6      8/4        64          1536          ~19M     ~61M

Embeddings are tied. MoE experts use half the dense intermediate size each; the MoE column is
Qwen3-MoE's (families with shared experts or a dense first layer differ a little).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers import (
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    Dots1Config,
    Dots1ForCausalLM,
    FlexOlmoConfig,
    FlexOlmoForCausalLM,
    Glm4MoeConfig,
    Glm4MoeForCausalLM,
    Glm4MoeLiteConfig,
    Glm4MoeLiteForCausalLM,
    GptOssConfig,
    GptOssForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeTextConfig,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

SIZES: dict[str, dict[str, int]] = {
    "nano": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, intermediate_size=128),
    "xs": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               head_dim=32, intermediate_size=256),
    "s": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
              head_dim=32, intermediate_size=768),
    "m": dict(hidden_size=512, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4,
              head_dim=64, intermediate_size=1536),
}

ARCHS: dict[str, tuple[type[PretrainedConfig], type[PreTrainedModel]]] = {
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
    "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM),
    "mixtral": (MixtralConfig, MixtralForCausalLM),
    "olmoe": (OlmoeConfig, OlmoeForCausalLM),
    "gpt_oss": (GptOssConfig, GptOssForCausalLM),
    "deepseek_v2": (DeepseekV2Config, DeepseekV2ForCausalLM),
    "deepseek_v3": (DeepseekV3Config, DeepseekV3ForCausalLM),
    "glm4_moe": (Glm4MoeConfig, Glm4MoeForCausalLM),
    "qwen3_next": (Qwen3NextConfig, Qwen3NextForCausalLM),
    "qwen3_5_moe": (Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM),
    "flex_olmo": (FlexOlmoConfig, FlexOlmoForCausalLM),
    "glm4_moe_lite": (Glm4MoeLiteConfig, Glm4MoeLiteForCausalLM),
    "dots1": (Dots1Config, Dots1ForCausalLM),
}

MOE_DEFAULTS = dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1)


def _mla(f: dict[str, Any]) -> dict[str, Any]:
    """Multi-head latent attention (DeepSeek-V2/V3) at the preset's head size: one kv head per query head."""
    d = f["head_dim"]
    return dict(num_key_value_heads=f["num_attention_heads"], kv_lora_rank=2 * d, q_lora_rank=None,
                qk_nope_head_dim=d // 2, qk_rope_head_dim=d // 2, head_dim=d // 2, v_head_dim=d,
                rope_parameters=dict(rope_type="default", rope_theta=10000.0))


def _alternating(f: dict[str, Any], first: str) -> list[str]:
    """Layer types alternating ``first`` and full attention, one per layer."""
    return [first if i % 2 == 0 else "full_attention" for i in range(f["num_hidden_layers"])]


def _linear_attention(f: dict[str, Any]) -> dict[str, Any]:
    """Gated delta-net layers (Qwen3-Next, Qwen3.5) alternating with full attention, at the preset's head size."""
    d, heads, kv = f["head_dim"], f["num_attention_heads"], f["num_key_value_heads"]
    return dict(layer_types=_alternating(f, "linear_attention"), linear_num_value_heads=heads,
                linear_num_key_heads=kv, linear_key_head_dim=d, linear_value_head_dim=d)


MOE_FIELDS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {  # arch: preset fields -> its MoE fields
    "qwen3_moe": lambda f: dict(MOE_DEFAULTS, moe_intermediate_size=f["intermediate_size"] // 2),
    "qwen2_moe": lambda f: dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
                                moe_intermediate_size=f["intermediate_size"] // 2,
                                shared_expert_intermediate_size=f["intermediate_size"]),
    "mixtral": lambda f: dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=f["intermediate_size"] // 2),
    "olmoe": lambda f: dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
                            intermediate_size=f["intermediate_size"] // 2),
    "gpt_oss": lambda f: dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=f["intermediate_size"] // 2,
                              sliding_window=8, rope_parameters=dict(rope_type="default", rope_theta=150000.0)),
    "deepseek_v2": lambda f: dict(_mla(f), n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                                  moe_intermediate_size=f["intermediate_size"] // 2, first_k_dense_replace=0,
                                  topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                  routed_scaling_factor=1.5),
    "deepseek_v3": lambda f: dict(_mla(f), n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                                  moe_intermediate_size=f["intermediate_size"] // 2, first_k_dense_replace=0,
                                  n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5),
    "glm4_moe": lambda f: dict(n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                               moe_intermediate_size=f["intermediate_size"] // 2, first_k_dense_replace=1,
                               n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5),
    "qwen3_next": lambda f: dict(_linear_attention(f), num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                                 moe_intermediate_size=f["intermediate_size"] // 2,
                                 shared_expert_intermediate_size=f["intermediate_size"] // 2),
    "qwen3_5_moe": lambda f: dict(_linear_attention(f), num_experts=8, num_experts_per_tok=2,
                                  moe_intermediate_size=f["intermediate_size"] // 2,
                                  shared_expert_intermediate_size=f["intermediate_size"] // 2),
    "flex_olmo": lambda f: dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
                                intermediate_size=f["intermediate_size"] // 2),
    "glm4_moe_lite": lambda f: dict(_mla(f), n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                                    moe_intermediate_size=f["intermediate_size"] // 2, first_k_dense_replace=0,
                                    n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.8),
    "dots1": lambda f: dict(n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                            moe_intermediate_size=f["intermediate_size"] // 2, first_k_dense_replace=1,
                            n_group=2, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5),
}


def tiny_config(
    arch: str = "qwen3",
    size: str = "xs",
    vocab_size: int | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    **overrides: Any,
) -> PretrainedConfig:
    """The config of a tiny model; ``overrides`` replace any preset or config field."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of: {', '.join(sorted(ARCHS))}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of: {', '.join(SIZES)}")
    if vocab_size is None:
        if tokenizer is None:
            raise ValueError("tiny_config needs vocab_size or tokenizer")
        vocab_size = len(tokenizer)
    fields: dict[str, Any] = dict(SIZES[size], vocab_size=vocab_size, tie_word_embeddings=True,
                                  max_position_embeddings=4096, rms_norm_eps=1e-6)
    if arch in MOE_FIELDS:
        fields.update(MOE_FIELDS[arch](fields))
    if tokenizer is not None:
        fields.update(_special_ids(tokenizer))
    fields.update(overrides)
    config_cls, _ = ARCHS[arch]
    return config_cls(**fields)


def tiny_model(
    arch: str = "qwen3",
    size: str = "xs",
    vocab_size: int | None = None,
    seed: int = 0,
    tokenizer: PreTrainedTokenizerBase | None = None,
    **overrides: Any,
) -> PreTrainedModel:
    """A randomly initialised float32 causal LM; the same ``seed`` gives the same weights."""
    config = tiny_config(arch, size, vocab_size, tokenizer, **overrides)
    _, model_cls = ARCHS[arch]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    return model.to(torch.float32).eval()


def _special_ids(tokenizer: PreTrainedTokenizerBase) -> dict[str, int | None]:
    """pad/eos/bos ids for the model config, from the tokenizer."""
    return dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                bos_token_id=tokenizer.bos_token_id)
