"""The MoE families router replay supports, each with its own gate rule.

A family names the router classes its models are built from, where the replay hooks in (the
router's output) and how its gate weights follow from the live router logits once the experts
are given. Replay keeps the router's discrete choice out of the forward pass but recomputes
the weights from the logits, so the router still gets its gradient; replaying a forward's own
choices gives the weights that forward computed, bit for bit, because each rule repeats the
family's own arithmetic (transformers' modeling code) on the same tensors.

    family        router class              gate weights of experts S (logits z [N, E], top-k K)
    Qwen2-MoE     Qwen2MoeTopKRouter        softmax(z)[S], / its sum over S if norm_topk_prob
    Qwen3-MoE     Qwen3MoeTopKRouter          (the same)
    Qwen3-Next    Qwen3NextTopKRouter         (the same)
    OLMoE         OlmoeTopKRouter             (the same)
    FlexOlmo      FlexOlmoTopKRouter          (the same)
    Mixtral       MixtralTopKRouter         softmax(z)[S] / its sum over S (always)
    Qwen3.5-MoE   Qwen3_5MoeTopKRouter        (the same)
    GPT-OSS       GptOssTopKRouter          softmax(z[S]) (over the K chosen logits only)
    DeepSeek-V2   DeepseekV2TopkRouter      softmax(z)[S] x routed_scaling_factor
    DeepSeek-V3   DeepseekV3TopkRouter      sigmoid(z)[S], / (sum + 1e-20) if norm_topk_prob,
    GLM4-MoE      Glm4MoeTopkRouter           x routed_scaling_factor
    GLM4-MoE-Lite Glm4MoeLiteTopkRouter       (the same)
    dots.llm1     Dots1TopkRouter             (the same)

Selection is what replay replaces: top-k of the weights above over all experts, except
DeepSeek-V2 (group-limited greedy: top-k within the topk_group groups of highest max score),
the sigmoid families (top-k of sigmoid(z) + e_score_correction_bias within the topk_group groups
of highest top-2 sum) and GPT-OSS (top-k of z). The bias and the group limit only choose; the weights do not
contain them, so a forced expert outside the chosen groups gets its rule's weight all the same.

Every family here hooks into its router, whose forward returns (logits [N, E], weights [N, K],
indices [N, K]) over the N = B*S flattened tokens (``ROUTER_TRIPLE``). A family whose router
returns something else states its own ``RouterOutput``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class RouterOutput:
    """How a family's router output is read and rewritten by the replay hooks."""

    logits: Callable[[tuple], Tensor]  # output -> router logits [N, E]
    indices: Callable[[tuple], Tensor]  # output -> chosen experts [N, K]
    replaced: Callable[[tuple, Tensor, Tensor], tuple]  # (output, weights [N, K], experts [N, K]) -> output


ROUTER_TRIPLE = RouterOutput(
    logits=lambda out: out[0],
    indices=lambda out: out[2],
    replaced=lambda out, weights, experts: (out[0], weights.to(out[1].dtype), experts),
)

GateWeights = Callable[[nn.Module, Tensor, Tensor], Tensor]  # (router, logits [N, E], experts [N, K]) -> [N, K]


@dataclass(frozen=True)
class MoEFamily:
    name: str
    routers: tuple[str, ...]  # router class names, as transformers spells them
    rule: str  # the gate rule in words, for errors and docs
    gate_weights: GateWeights
    output: RouterOutput = ROUTER_TRIPLE


def softmax_topk(router: nn.Module, logits: Tensor, experts: Tensor) -> Tensor:
    """Qwen2/3-MoE, Qwen3-Next, OLMoE, FlexOlmo: softmax over all experts, renormalised over the chosen
    ones if norm_topk_prob."""
    probs = torch.nn.functional.softmax(logits, dtype=torch.float, dim=-1)  # [N, E]
    weights = probs.gather(-1, experts)  # [N, K]
    if router.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights


def softmax_topk_renormalised(router: nn.Module, logits: Tensor, experts: Tensor) -> Tensor:
    """Mixtral, Qwen3.5-MoE: softmax over all experts, always renormalised over the chosen ones."""
    probs = torch.nn.functional.softmax(logits.float(), dim=-1)  # [N, E]
    weights = probs.gather(-1, experts)  # [N, K]
    return weights / weights.sum(dim=-1, keepdim=True)


def softmax_of_chosen(router: nn.Module, logits: Tensor, experts: Tensor) -> Tensor:
    """GPT-OSS: softmax over the chosen experts' logits only."""
    chosen = logits.gather(-1, experts)  # [N, K]
    return torch.nn.functional.softmax(chosen, dim=1, dtype=chosen.dtype)


def softmax_scaled(router: nn.Module, logits: Tensor, experts: Tensor) -> Tensor:
    """DeepSeek-V2: softmax over all experts, times routed_scaling_factor, never renormalised."""
    probs = logits.softmax(dim=-1, dtype=torch.float32)  # [N, E]
    return probs.gather(-1, experts) * router.routed_scaling_factor  # [N, K]


def sigmoid_scaled(router: nn.Module, logits: Tensor, experts: Tensor) -> Tensor:
    """DeepSeek-V3, GLM4-MoE(-Lite), dots.llm1: sigmoid scores, renormalised if norm_topk_prob, times
    routed_scaling_factor."""
    weights = logits.sigmoid().gather(1, experts)  # [N, K]
    if router.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * router.routed_scaling_factor


SOFTMAX = "softmax over all experts, renormalised if norm_topk_prob"
SOFTMAX_RENORMALISED = "softmax over all experts, renormalised over the top-k"
SIGMOID = "sigmoid, renormalised if norm_topk_prob, x routed_scaling_factor (bias-corrected, group-limited selection)"

FAMILIES: tuple[MoEFamily, ...] = (
    MoEFamily("Qwen2-MoE", ("Qwen2MoeTopKRouter",), SOFTMAX, softmax_topk),
    MoEFamily("Qwen3-MoE", ("Qwen3MoeTopKRouter",), SOFTMAX, softmax_topk),
    MoEFamily("Qwen3-Next", ("Qwen3NextTopKRouter",), SOFTMAX, softmax_topk),
    MoEFamily("OLMoE", ("OlmoeTopKRouter",), SOFTMAX, softmax_topk),
    MoEFamily("FlexOlmo", ("FlexOlmoTopKRouter",), SOFTMAX, softmax_topk),
    MoEFamily("Mixtral", ("MixtralTopKRouter",), SOFTMAX_RENORMALISED, softmax_topk_renormalised),
    MoEFamily("Qwen3.5-MoE", ("Qwen3_5MoeTopKRouter",), SOFTMAX_RENORMALISED, softmax_topk_renormalised),
    MoEFamily("GPT-OSS", ("GptOssTopKRouter",), "softmax over the top-k logits only", softmax_of_chosen),
    MoEFamily("DeepSeek-V2", ("DeepseekV2TopkRouter",), "softmax over all experts x routed_scaling_factor",
              softmax_scaled),
    MoEFamily("DeepSeek-V3", ("DeepseekV3TopkRouter",), SIGMOID, sigmoid_scaled),
    MoEFamily("GLM4-MoE", ("Glm4MoeTopkRouter",), SIGMOID, sigmoid_scaled),
    MoEFamily("GLM4-MoE-Lite", ("Glm4MoeLiteTopkRouter",), SIGMOID, sigmoid_scaled),
    MoEFamily("dots.llm1", ("Dots1TopkRouter",), SIGMOID, sigmoid_scaled),
)

BY_ROUTER: dict[str, MoEFamily] = {cls: family for family in FAMILIES for cls in family.routers}


def family_of(module: nn.Module) -> MoEFamily | None:
    """The family whose router ``module`` is, or None."""
    return BY_ROUTER.get(type(module).__name__)


def looks_like_moe(module: nn.Module) -> bool:
    """A router (its class name says so) or an MoE block (it holds ``experts``), known or not."""
    return "router" in type(module).__name__.lower() or isinstance(getattr(module, "experts", None), nn.Module)
