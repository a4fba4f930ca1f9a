"""Each response token's policy version (TrainBatch.token_versions) and its lag: recorded by the engine across a
weight reload mid-generation, kept through scoring, select / concat / pickling (Ray's transport), with each row's
versions / versions_max its min / max; then a real asynchronous run with partial rollouts on the nano policy, in
which rows span versions and staleness/token_lag_mean and staleness/token_newer_frac are what versions.jsonl says."""

import pickle

import pytest
import torch

from vespo.buffer import token_lag_rows, token_lag_stats, token_lags
from vespo.config import AdvantageConfig
from vespo.metrics import read_jsonl
from vespo.models import build_char_tokenizer, tiny_model
from vespo.rollout import HFEngine, SamplingParams
from vespo.trainer import train
from vespo.trainer.producer import PromptBatch, RolloutScorer
from vespo.types import Problem, TrainBatch

PROMPTS = ["12+3=", "7*8=", "(1+2)*3=", "9="]


def check_row_versions(batch: TrainBatch) -> None:
    """The invariant: a row's versions / versions_max are the min / max of its valid tokens' versions."""
    valid = batch.response_mask > 0
    for i in range(len(batch)):
        if valid[i].any():
            tokens = batch.token_versions[i][valid[i]]
            assert int(tokens.min()) == int(batch.versions[i]) and int(tokens.max()) == int(batch.versions_max[i])
        assert (batch.token_versions[i][~valid[i]] == 0).all()  # 0 on padding


def scored_partial_rollout(tok, max_new_tokens: int, reload_after: int | None) -> TrainBatch:
    """4 prompts x 2 responses sampled by a tiny policy at version 3; with ``reload_after`` the engine loads other
    weights (version 4) after that many tokens and goes on (a partial rollout), then the batch is scored."""
    engine = HFEngine(tiny_model("qwen3", "xs", tokenizer=tok, seed=0), tok)
    engine.load_weights(tiny_model("qwen3", "xs", tokenizer=tok, seed=0).state_dict(), version=3)
    problems = [Problem(id=str(i), prompt=p, ground_truth="") for i, p in enumerate(PROMPTS)]
    ids = [tok.encode(p) for p in PROMPTS for _ in range(2)]
    state = engine.start(ids, SamplingParams(max_new_tokens=max_new_tokens), seed=0)
    if reload_after is not None:
        assert engine.advance(state, reload_after) is False
        engine.load_weights(tiny_model("qwen3", "xs", tokenizer=tok, seed=1).state_dict(), version=4)
    while not engine.advance(state, 4):
        pass
    rollout = engine.finish(state)
    prompts = PromptBatch(problems, ids, torch.arange(4).repeat_interleave(2))
    scorer = RolloutScorer(tok, lambda completions, probs: [float(len(c) % 3) for c in completions], 2,
                           AdvantageConfig())
    batch, _, _ = scorer.score(prompts, rollout)
    return batch


def test_token_versions_are_recorded_scored_and_kept_with_rows_at_their_min_and_max():
    tok = build_char_tokenizer()
    batch = scored_partial_rollout(tok, max_new_tokens=12, reload_after=5)
    valid = batch.response_mask > 0
    assert batch.token_versions.dtype == torch.int64 and batch.token_versions.shape == batch.response_ids.shape
    # tokens 0..4 were sampled by version 3, the rest by version 4
    assert torch.equal(batch.token_versions[:, :5], valid[:, :5].long() * 3)
    assert torch.equal(batch.token_versions[:, 5:], valid[:, 5:].long() * 4)
    assert bool((batch.versions_max > batch.versions).any())  # rows span two versions
    check_row_versions(batch)

    short = scored_partial_rollout(tok, max_new_tokens=4, reload_after=None)  # shorter responses, one version
    assert (short.versions == 3).all() and (short.versions_max == 3).all()
    for kept in (batch.select(torch.tensor([5, 0, 2])), batch.to("cpu"), pickle.loads(pickle.dumps(batch)),
                 TrainBatch.concat([short, batch.select(torch.tensor([1, 6]))], pad_id=tok.pad_token_id)):
        check_row_versions(kept)
    both = TrainBatch.concat([short, batch], pad_id=tok.pad_token_id)
    assert torch.equal(both.token_versions[len(short):], batch.token_versions)

    # the learner at version 6: each token's lag, and the step's token statistics worked from the tokens
    lag = token_lags(batch, 6)
    assert torch.equal(lag, torch.where(valid, 6 - batch.token_versions, 0))
    stats = token_lag_stats(token_lag_rows(batch, 6 - batch.versions))
    tokens = valid.sum().item()
    assert stats["staleness/token_lag_mean"] == pytest.approx(lag.sum().item() / tokens, rel=1e-12)
    newer = (valid & (batch.token_versions == 4) & (batch.versions[:, None] == 3)).sum().item()
    assert stats["staleness/token_newer_frac"] == pytest.approx(newer / tokens, rel=1e-12) and newer > 0


def test_an_async_run_with_partial_rollouts_logs_each_tokens_lag(make_cfg):
    """A real async run (nano policy, 1-digit addition, decoupled_ppo, weights pushed after every update, decoding
    one token per chunk). Once a worker has sampled a response's first token it waits (up to 300 s) for newer weights
    before going on, so responses really continue under new weights; everything else is the run as it is. The wait
    cannot deadlock: it is installed after update 1, and a ticket t >= 1 starts with weights w <= t - 1 (the learner
    has not trained ticket t - 1 when the worker finishes it), whose successor the learner pushes after training
    ticket w, which is already generated."""
    cfg = make_cfg("run.mode=async", "async.chunk_tokens=1", "async.stall_timeout_s=600", "async.sync_every=1",
                   "async.max_staleness=2", "async.workers=1", "loss.name=decoupled_ppo", "run.steps=3",
                   "staleness.n=2")

    def wait_for_weights_after_the_first_token(worker):  # runs inside the worker actor (pickled by value)
        advance, started = worker.engine.advance, []

        def advance_then_wait(state, n):
            done = advance(state, n)
            if not done and not any(s is state for s in started):
                started.append(state)
                with worker._cv:
                    worker._cv.wait_for(lambda: worker._pending is not None and worker._pending[1] > worker.version,
                                        timeout=300.0)
            return done

        worker.engine.advance = advance_then_wait

    def install(loop):
        if loop.updates_done == 1:
            import ray

            ray.get([w.__ray_call__.remote(wait_for_weights_after_the_first_token) for w in loop.source.workers])

    summary = train(cfg, on_update=install)
    assert summary["status"] == "done" and summary["updates_done"] == 6

    records = read_jsonl(f"{cfg.run.out_dir}/versions.jsonl")
    rows = read_jsonl(f"{cfg.run.out_dir}/metrics.jsonl")
    assert [r["ticket"] for r in records] == list(range(6)) and [r["step"] for r in rows] == [1, 2, 3]
    spanning_steps = set()
    for step, row in enumerate(rows):
        tokens = lag_sum = oldest_lag_sum = newer = 0
        for record in records[2 * step: 2 * step + 2]:
            u = record["learner_version"]
            for lo, hi, runs in zip(record["versions"], record["versions_max"], record["token_versions"]):
                versions = [v for v, _ in runs]
                assert versions == sorted(versions) and min(versions) == lo and max(versions) == hi
                if len(runs) > 1:
                    spanning_steps.add(step)
                for v, n in runs:
                    tokens, lag_sum, oldest_lag_sum = tokens + n, lag_sum + (u - v) * n, oldest_lag_sum + (u - lo) * n
                    newer += n if v > lo else 0
        assert row["staleness/token_lag_mean"] == pytest.approx(lag_sum / tokens, rel=1e-12)
        assert row["staleness/token_newer_frac"] == pytest.approx(newer / tokens, rel=1e-12)
        if step in spanning_steps:  # read at each token's own version, the lag is below the row's oldest one's
            assert row["staleness/token_newer_frac"] > 0 and row["staleness/token_lag_mean"] < oldest_lag_sum / tokens
    assert spanning_steps, records  # responses did continue under newer weights
