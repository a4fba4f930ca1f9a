"""The HF engine's shortcuts change nothing but speed: shared prompt prefill and dropping finished rows.

A group's G copies of one prompt are prefilled once; rows that produced EOS leave the decode batch.
Both must give the same samples as the engine without them (the random draws do not depend on
the batch layout) and log-probs equal to the trainer's own recompute.
"""

import torch

from vespo.models import build_char_tokenizer, response_logprobs, tiny_model
from vespo.rollout import HFEngine, SamplingParams
from vespo.rollout import hf


class PlainEngine(HFEngine):
    """The engine with both shortcuts off: every row is prefilled and decoded to the end."""

    def _drop_finished_rows(self, state):
        pass


def plain_prefill(monkeypatch):
    monkeypatch.setattr(hf, "distinct_rows", lambda rows: (None, None))


def grouped_prompts(tok, n_prompts=6, group=8):
    texts = [f"{a}+{b}=" for a, b in zip(range(3, 3 + n_prompts), range(40, 40 + 7 * n_prompts, 7))]
    texts[1] = "9="  # a shorter prompt: left padding inside the shared prefill
    return [tok.encode(t) for t in texts for _ in range(group)]


def recompute(model, rollout):
    with torch.no_grad():
        logp, _ = response_logprobs(model, rollout.prompt_ids, rollout.prompt_mask, rollout.response_ids,
                                    rollout.response_mask)
    return logp


def test_shortcuts_sample_the_same_tokens_as_the_plain_engine(monkeypatch):
    # an untrained model samples EOS with p ~ 1/57 per step: over 40 steps most rows of 48 end at
    # different times, so the decode batch shrinks several times
    tok = build_char_tokenizer()
    model = tiny_model("qwen3", "xs", tokenizer=tok, seed=3)
    prompts, params = grouped_prompts(tok), SamplingParams(temperature=1.0, max_new_tokens=40)
    fast = HFEngine(model, tok)
    state = fast.start(prompts, params, seed=11)
    sizes = []
    while not fast.advance(state, 1):
        sizes.append(len(state.rows))
    ours = fast.finish(state)
    assert sizes[0] == len(prompts) and min(sizes) <= len(prompts) * 3 // 4  # rows really left the batch
    plain_prefill(monkeypatch)
    theirs = PlainEngine(model, tok).generate(prompts, params, seed=11)
    assert torch.equal(ours.response_ids, theirs.response_ids)
    assert torch.equal(ours.response_mask, theirs.response_mask)
    assert torch.equal(ours.truncated, theirs.truncated)
    assert torch.allclose(ours.logprobs, theirs.logprobs, atol=1e-5)


def test_shortcut_logprobs_equal_the_trainer_recompute():
    tok = build_char_tokenizer()
    for arch in ("qwen3", "qwen3_moe"):
        model = tiny_model(arch, "xs", tokenizer=tok, seed=0)
        rollout = HFEngine(model, tok).generate(grouped_prompts(tok, 4), SamplingParams(max_new_tokens=30), seed=2)
        assert (~rollout.truncated).sum() >= 4  # some rows ended early and left the batch
        assert torch.allclose(rollout.logprobs, recompute(model, rollout), atol=1e-5)


def test_distinct_prompts_prefill_every_row(monkeypatch):
    seen = []
    monkeypatch.setattr(hf, "distinct_rows", lambda rows: seen.append(rows.shape[0]) or (None, None))
    tok = build_char_tokenizer()
    model = tiny_model("qwen3", "nano", tokenizer=tok)
    HFEngine(model, tok).generate([tok.encode("1+2="), tok.encode("3+4=")], SamplingParams(max_new_tokens=2), seed=0)
    assert seen == [2]
