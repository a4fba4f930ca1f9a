"""Log-probs of the truncated (top-k / top-p), renormalised distribution on the trainer's side:
a hand-worked row, a float64 oracle of values and gradients, and μ's recompute equal to the
update's forward bit for bit, so log W is exactly 0 at N = 1 under top-p."""

from __future__ import annotations

import math

import pytest
import torch

from vespo.models import build_char_tokenizer, response_logprobs, tiny_model
from vespo.models.truncation import outside_support, truncated_logprobs
from vespo.rollout import HFEngine, SamplingParams


def test_hand_worked_four_token_row():
    # logits [2, 1, 0, -1] (hidden = the logits, weight = identity), temperature 1, top_p 0.7:
    # softmax = [7.389, 2.718, 1.000, 0.368] / 11.475 = [0.6439, 0.2369, 0.0871, 0.0321];
    # probability of the strictly more likely tokens: [0, 0.6439, 0.8808, 0.9679] -> keep {0, 1}.
    # Target 1: p = 2.718 / (7.389 + 2.718) = 0.26894, log = -1.31326.
    # Target 2 lies outside, and the scored token always stays: support {0, 1, 2},
    # p = 1 / (7.389 + 2.718 + 1) = 0.090031, log = -2.40760.
    # Entropy over {0, 1}: 0.73106 * 0.31326 + 0.26894 * 1.31326 = 0.58220;
    # over {0, 1, 2}: p = [0.66524, 0.24473, 0.09003] -> 0.27116 + 0.34448 + 0.21676 = 0.83240.
    hidden = torch.tensor([[2.0, 1.0, 0.0, -1.0]] * 2, dtype=torch.float64)
    weight = torch.eye(4, dtype=torch.float64)
    logp, entropy = truncated_logprobs(hidden, weight, None, torch.tensor([1, 2]), 1.0, top_k=0, top_p=0.7)
    torch.testing.assert_close(logp, torch.tensor([-1.31326, -2.40760], dtype=torch.float64), atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy, torch.tensor([0.58220, 0.83240], dtype=torch.float64), atol=1e-5, rtol=0)


def reference_logprob(z: list[float], target: int, top_k: int, top_p: float) -> tuple[float, list[int], bool]:
    """Float64, token by token: top-k, then the top-p nucleus of what is left, then the target added
    back if it fell out; log of the target's renormalised probability, the support, and whether
    the target was added back."""
    order = sorted(range(len(z)), key=lambda i: -z[i])
    kept = [i for i in order if top_k == 0 or z[i] >= z[order[top_k - 1]]]
    m = max(z[i] for i in kept)
    total = sum(math.exp(z[i] - m) for i in kept)
    support = [i for i in kept if sum(math.exp(z[j] - m) for j in kept if z[j] > z[i]) / total < top_p]
    added = target not in support
    if added:
        support.append(target)
    norm = sum(math.exp(z[i] - m) for i in support)
    return z[target] - m - math.log(norm), support, added


def naive_truncated(hidden, weight, bias, targets, temperature, supports):
    """The same log-probs as plain float64 autograd over the oracle's supports: z_t - logsumexp(z_support)."""
    z = (hidden @ weight.T + bias) / temperature  # [N, V]
    return torch.stack([z[n, t] - torch.logsumexp(z[n, s], dim=0) for n, (t, s) in enumerate(zip(targets, supports))])


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 0.8), (0.7, 5, 1.0), (1.3, 9, 0.9)])
@pytest.mark.parametrize("chunk_size", [None, 3])
def test_float64_oracle_values_and_gradients(temperature, top_k, top_p, chunk_size):
    g = torch.Generator().manual_seed(top_k)
    N, H, V = 12, 6, 23
    hidden = (torch.randn(N, H, generator=g, dtype=torch.float64) * 2).requires_grad_(True)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64).requires_grad_(True)
    bias = torch.randn(V, generator=g, dtype=torch.float64).requires_grad_(True)
    z = ((hidden @ weight.T + bias) / temperature).detach()  # [N, V]
    targets = torch.randint(V, (N,), generator=g)  # mostly outside the support
    targets[::2] = z[::2].argmax(dim=1)  # inside
    expected, supports, added = zip(*(reference_logprob(z[n].tolist(), int(targets[n]), top_k, top_p)
                                      for n in range(N)))
    assert all(len(s) < V for s in supports) and any(added) and not all(added)  # the truncation binds

    logp, _ = truncated_logprobs(hidden, weight, bias, targets, temperature, top_k, top_p, chunk_size)
    torch.testing.assert_close(logp, torch.tensor(expected, dtype=torch.float64), atol=1e-12, rtol=0)
    upstream = torch.randn(N, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad((logp * upstream).sum(), (hidden, weight, bias))
    ref = naive_truncated(hidden, weight, bias, targets.tolist(), temperature, supports)
    ref_grads = torch.autograd.grad((ref * upstream).sum(), (hidden, weight, bias))
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)


def test_gradcheck_float64():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(5, 4, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(9, 4, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([0, 3, 8, 2, 5])
    assert torch.autograd.gradcheck(
        lambda h, w: truncated_logprobs(h, w, None, targets, 0.9, top_k=6, top_p=0.85, chunk_size=2)[0],
        (hidden, weight))


def test_no_tokens_and_autocast():
    """No tokens: empty log-probs and a zero weight gradient. Under bfloat16 autocast the logits stay
    float32: the same numbers as without it."""
    weight = torch.randn(9, 4, requires_grad=True)
    logp, entropy = truncated_logprobs(torch.randn(0, 4), weight, None, torch.zeros(0, dtype=torch.long), 1.0, 3, 0.9)
    logp.sum().backward()
    assert logp.shape == entropy.shape == (0,) and torch.equal(weight.grad, torch.zeros_like(weight))
    hidden, targets = torch.randn(5, 4), torch.tensor([0, 1, 2, 3, 4])
    plain, _ = truncated_logprobs(hidden, weight, None, targets, 1.0, 3, 0.9)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast, _ = truncated_logprobs(hidden, weight, None, targets, 1.0, 3, 0.9)
    assert autocast.dtype == torch.float32 and torch.equal(autocast, plain)


def test_outside_support_keeps_ties_together():
    # logits [1, 1, 0], top_p 0.3: softmax [0.4223, 0.4223, 0.1554]. Neither tied token has a strictly
    # more likely one (mass 0 < 0.3): both stay, whichever one a sort puts first. Token 2 has 0.8446
    # before it: out. (Reading the mass sorted before each token would drop one of the tied pair.)
    for logits in ([1.0, 1.0, 0.0], [0.0, 1.0, 1.0]):
        assert outside_support(torch.tensor([logits]), 0, 0.3).tolist() == [[x < 1.0 for x in logits]]


def test_outside_support_bounds():
    # the most likely token always stays; top-k keeps at most k (no ties in random logits)
    logits = torch.randn(6, 30, generator=torch.Generator().manual_seed(2)) * 3
    for top_k, top_p in [(0, 0.05), (4, 1.0), (8, 0.6)]:
        out = outside_support(logits, top_k, top_p)
        assert not out.gather(1, logits.argmax(1, keepdim=True)).any()
        assert (~out).sum(1).le(top_k if top_k else 30).all() and out.any()


@pytest.fixture(scope="module")
def rollout_and_model():
    tok = build_char_tokenizer()
    model = tiny_model("qwen3", "nano", tokenizer=tok, seed=0)
    prompts = [tok.encode(p) for p in ["12+3=", "7*8=", "9="]]
    params = SamplingParams(temperature=0.9, top_p=0.8, top_k=7, max_new_tokens=10)
    rollout = HFEngine(model, tok).generate([p for p in prompts for _ in range(2)], params, seed=0)
    return model, rollout, params


def logprobs(model, rollout, params, **kwargs):
    return response_logprobs(model, rollout.prompt_ids, rollout.prompt_mask, rollout.response_ids,
                             rollout.response_mask, temperature=params.temperature, share_prompts=True, **kwargs)


def test_recompute_equals_update_forward_bit_for_bit_so_log_w_is_zero(rollout_and_model):
    """At N = 1 with μ recomputed, μ (no grad, eval) and the update's π (grad, train) are the same
    numbers under the same truncation: log W = Σ_t (log π - log μ) is 0 exactly."""
    model, rollout, params = rollout_and_model
    truncation = {"top_k": params.top_k, "top_p": params.top_p}
    model.eval()
    with torch.no_grad():
        mu, _ = logprobs(model, rollout, params, **truncation)  # [B, T]
    model.train()
    pi, entropy = logprobs(model, rollout, params, **truncation)
    mask = rollout.response_mask
    log_w = ((pi.detach() - mu) * mask).sum(dim=-1)  # [B]
    assert torch.equal(log_w, torch.zeros_like(log_w))
    (pi * mask).sum().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads) and any(g.abs().max() > 0 for g in grads)
    assert (entropy[mask > 0] >= 0).all()
    model.zero_grad(set_to_none=True)
    with torch.no_grad():  # μ recomputed over the full softmax against π on the truncated one: log W = log S < 0
        full, _ = logprobs(model, rollout, params)
    assert ((full - mu) * mask).sum(-1).max() < -1e-3


def test_truncation_arguments_are_checked(rollout_and_model):
    model, rollout, params = rollout_and_model
    with pytest.raises(ValueError, match="top_k must be an int >= 0"):
        logprobs(model, rollout, params, top_k=-1)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        logprobs(model, rollout, params, top_p=0.0)
