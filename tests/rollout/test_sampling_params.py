"""SamplingParams validation and the processed sampling distribution (temperature, top-k, top-p)."""

import math

import pytest
import torch

from vespo.rollout import SamplingParams, sampling_logprobs
from vespo.rollout.base import sample_tokens


@pytest.mark.parametrize("field,value", [("temperature", 0.0), ("top_p", 0.0), ("top_p", 1.5),
                                         ("top_k", -1), ("max_new_tokens", 0)])
def test_invalid_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**{field: value})


def test_top_p_hand_worked():
    # probs [0.5, 0.3, 0.15, 0.05]; mass of strictly more likely tokens: [0, 0.5, 0.8, 0.95]
    # top_p 0.7 keeps tokens 0, 1 (0.8 >= 0.7 drops token 2): renormalised [0.5/0.8, 0.3/0.8] = [0.625, 0.375]
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    probs = sampling_logprobs(logits, SamplingParams(top_p=0.7)).exp()
    assert torch.allclose(probs, torch.tensor([[0.625, 0.375, 0.0, 0.0]]), atol=1e-6)
    # top_p 0.85 keeps three tokens: [0.5, 0.3, 0.15] / 0.95
    probs = sampling_logprobs(logits, SamplingParams(top_p=0.85)).exp()
    assert torch.allclose(probs, torch.tensor([[0.5, 0.3, 0.15, 0.0]]) / 0.95, atol=1e-6)


def test_top_k_and_temperature_hand_worked():
    # logits [2, 1, 0, -1] at temperature 2 -> [1, 0.5, 0, -0.5]; top_k 2 keeps [1, 0.5]
    # p0 = e^1 / (e^1 + e^0.5) = 2.7183 / 4.3670 = 0.62246
    probs = sampling_logprobs(torch.tensor([[2.0, 1.0, 0.0, -1.0]]), SamplingParams(temperature=2.0, top_k=2)).exp()
    assert torch.allclose(probs, torch.tensor([[0.622459, 0.377541, 0.0, 0.0]]), atol=1e-6)


def reference_processed(logits_row: list[float], temperature: float, top_k: int, top_p: float) -> list[float]:
    """Float64, token by token: temperature, then top-k, then the top-p nucleus, then renormalise."""
    z = [x / temperature for x in logits_row]
    order = sorted(range(len(z)), key=lambda i: -z[i])
    kept = order[:top_k] if top_k > 0 else order
    m = max(z[i] for i in kept)
    mass = {i: math.exp(z[i] - m) for i in kept}
    total = sum(mass.values())
    nucleus, before = [], 0.0
    for i in kept:
        if before >= top_p:
            break
        nucleus.append(i)
        before += mass[i] / total
    norm = sum(mass[i] for i in nucleus)
    return [math.log(mass[i] / norm) if i in nucleus else -math.inf for i in range(len(z))]


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 0.9), (0.7, 0, 0.5), (1.3, 10, 0.95), (1.0, 5, 1.0)])
def test_processed_logprobs_match_float64_reference(temperature, top_k, top_p):
    logits = torch.randn(4, 40, generator=torch.Generator().manual_seed(top_k)) * 2
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    got = sampling_logprobs(logits, params)
    for row in range(4):
        ref = torch.tensor(reference_processed(logits[row].double().tolist(), temperature, top_k, top_p),
                           dtype=torch.float64)
        finite = torch.isfinite(ref)
        assert torch.equal(torch.isfinite(got[row]), finite)
        assert torch.allclose(got[row][finite].double(), ref[finite], atol=1e-5)


def test_sample_tokens_inverts_the_cdf_hand_worked():
    # probs [0.1, 0.0, 0.6, 0.3]: CDF [0.1, 0.1, 0.7, 1.0]; the token is the first whose CDF exceeds u:
    # u < 0.1 -> 0; 0.1 <= u < 0.7 -> 2 (token 1 has no mass); u >= 0.7 -> 3
    logp = torch.tensor([[0.1, 0.0, 0.6, 0.3]]).log().expand(64, 4)
    u = torch.rand(64, 1, generator=torch.Generator().manual_seed(3), dtype=torch.float64).squeeze(1).tolist()
    expected = [0 if x < 0.1 else 2 if x < 0.7 else 3 for x in u]
    assert sample_tokens(logp, torch.Generator().manual_seed(3)).tolist() == expected
    assert set(expected) == {0, 2, 3}  # the draws reach every branch


def test_sample_tokens_draws_the_distribution_and_never_a_token_without_mass():
    # 200k draws from 3 rows over 50 tokens (some truncated to probability 0): every empirical frequency
    # within 5 standard errors of its probability (a chance failure needs a 5-sigma event), none outside
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=g) * 2
    logp = sampling_logprobs(logits, SamplingParams(top_k=20))
    n = 200_000
    counts = torch.zeros(3, 50)
    for _ in range(20):
        tokens = sample_tokens(logp.repeat_interleave(n // 60, dim=0), g).view(3, -1)
        counts += torch.nn.functional.one_hot(tokens, 50).sum(1)
    total = counts.sum(1, keepdim=True)
    p = logp.exp()
    assert (counts[p == 0] == 0).all()
    stderr = (p * (1 - p) / total).sqrt()
    assert ((counts / total - p).abs() <= 5 * stderr + 1e-9).all()
