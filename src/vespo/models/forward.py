"""The policy's response log-probs as one module call: what the learner runs, and FSDP shards.

``response_logprobs`` runs the policy's body and then its LM head on the final hidden states in
vocab chunks. Sharded with FSDP2, the root unit (embeddings, final norm, LM head) is gathered only
inside its module's forward, so the whole computation has to be that forward: this module's.

    module = LogprobModule(policy)
    logp, entropy = module(prompt_ids, prompt_mask, response_ids, response_mask, temperature=1.0)
"""

from __future__ import annotations

from torch import Tensor, nn

from vespo.models.logprobs import response_logprobs


class LogprobModule(nn.Module):
    """``response_logprobs(policy, ...)`` as a module; its parameters are the policy's (``policy.*``)."""

    def __init__(self, policy: nn.Module):
        super().__init__()
        self.policy = policy

    def forward(self, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor, response_mask: Tensor,
                **options) -> tuple[Tensor, Tensor | None]:
        return response_logprobs(self.policy, prompt_ids, prompt_mask, response_ids, response_mask, **options)


def policy_keys(state: dict) -> dict:
    """A LogprobModule state dict with the policy's own keys (``policy.`` dropped)."""
    return {k.removeprefix("policy."): v for k, v in state.items()}
