"""The asynchronous rollout worker: a Ray actor that generates mini-batches with the newest
weights it has, in chunks, and scores them.

Two concurrency groups keep weight delivery apart from generation:

    set_weights(state_dict, version, skipped)   group "weights": stores the newest weights, returns at once
    rollout(ticket, prompts, seed)               group "rollout": one at a time, in the order submitted
    complete(prompt_ids, n, sampling, seed, v)   group "rollout": text completions once weights >= v are
                                                 loaded (held-out evaluation in async mode)

``rollout`` first waits for admission (``StalenessBound.admits``: the ticket may not be more than
``max_staleness`` versions ahead of the weights it would start with), then decodes
``chunk_tokens`` tokens at a time, loading newer weights between chunks when they have arrived
(partial rollouts: the engine re-prefills its cache, ``token_versions`` records which version
sampled each token), then scores the finished responses. Only the rollout thread touches the engine.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import ray
import torch

from vespo.buffer import StalenessBound
from vespo.config import from_dict
from vespo.rollout.text import decode_responses
from vespo.trainer.producer import PromptBatch, RolloutScorer
from vespo.types import TrainBatch


class RolloutWorker:
    """One rollout process: its own engine (weights arrive by ``set_weights``) and reward function."""

    def __init__(self, cfg_dict: dict, sampling: Any, index: int, base: dict | None = None):
        """``base``: with LoRA, the frozen base's weights (vespo.models.lora.base_state), sent once; every weight push
        then carries the adapters alone."""
        from vespo.allocator import return_freed_memory

        return_freed_memory()  # its decode loop re-allocates KV caches every token (vespo.allocator)
        torch.set_num_threads(1)
        from vespo.models.lora import load_base
        from vespo.trainer.run import attach_run_lora, build_policy, build_scorer, build_task, make_engine

        cfg = from_dict(cfg_dict)
        self.index = index
        self.chunk_tokens = cfg.async_.chunk_tokens
        self.bound = StalenessBound(cfg.async_.max_staleness)
        policy, tok = build_policy(cfg)  # the architecture; its weights are replaced before any rollout
        attach_run_lora(cfg, policy)
        if base is not None:
            load_base(policy, base)
        self.engine = make_engine(cfg, policy, tok)  # the engine rollout.* asks for, as in sync mode
        del policy
        self.tokenizer = tok
        self.scorer = build_scorer(cfg, build_task(cfg))
        self.rollout_scorer = RolloutScorer(tok, lambda c, p: self.scorer.score_problems(c, p).rewards,
                                            cfg.rollout.group_size, cfg.advantage)
        self.sampling = sampling
        self._cv = threading.Condition()
        self._pending: tuple[dict, int, int] | None = None  # newest undelivered (weights, version, skipped)
        self.version = -1  # weights version loaded in the engine; -1 = none yet
        self.skipped = 0

    # ------------------------------------------------------------ weights (group "weights")

    @ray.method(concurrency_group="weights")
    def set_weights(self, state_dict: dict, version: int, skipped: int) -> int:
        """Keep the newest weights; the rollout thread loads them at its next chunk boundary."""
        with self._cv:
            if self._pending is None or version >= self._pending[1]:
                self._pending = (state_dict, int(version), int(skipped))
            self._cv.notify_all()
        return os.getpid()

    @ray.method(concurrency_group="weights")
    def pid(self) -> int:
        return os.getpid()

    # ------------------------------------------------------------ generation (group "rollout")

    @ray.method(concurrency_group="rollout")
    def rollout(self, ticket: int, prompts: PromptBatch, seed: int) -> tuple[int, TrainBatch, dict, dict[str, float]]:
        """Admit, generate in chunks across weight updates, score. Returns (ticket, batch, rollout rows, perf)."""
        t0 = time.perf_counter()
        self._admit(ticket)
        t1 = time.perf_counter()
        state = self.engine.start(prompts.prompt_ids, self.sampling, seed=seed)
        reloads = 0
        while not self.engine.advance(state, self.chunk_tokens):
            reloads += self._load_pending()
        rollout = self.engine.finish(state)
        gen_s = time.perf_counter() - t1
        batch, rows, info = self.rollout_scorer.score(prompts, rollout)
        tokens = float(rollout.response_mask.sum())
        perf = {**info, "perf/rollout_s": gen_s, "perf/rollout_tokens_per_s": tokens / max(gen_s, 1e-9),
                "perf/admission_wait_s": t1 - t0, "async/reloads_mid_rollout": float(reloads)}
        return ticket, batch, rows, perf

    @ray.method(concurrency_group="rollout")
    def complete(self, prompt_ids: list[list[int]], n: int, sampling: Any, seed: int, version: int) -> list[list[str]]:
        """n completions per prompt as text, with weights of ``version`` or newer (evaluation)."""
        while self.version < version:
            self._load_pending()
            with self._cv:
                if self._pending is None and self.version < version:
                    self._cv.wait(timeout=1.0)
        rows = [ids for ids in prompt_ids for _ in range(n)]
        texts = decode_responses(self.tokenizer, self.engine.generate(rows, sampling, seed=seed))
        return [texts[i * n : (i + 1) * n] for i in range(len(prompt_ids))]

    def _admit(self, ticket: int) -> None:
        """Block until weights are loaded that may start ``ticket`` within the staleness bound."""
        while True:
            self._load_pending()
            if self.version >= 0 and self.bound.admits(ticket, self.version, self.skipped):
                return
            with self._cv:
                if self._pending is None:
                    self._cv.wait(timeout=1.0)

    def _load_pending(self) -> int:
        """Load weights that arrived since the last check; 1 if it did, else 0."""
        with self._cv:
            pending, self._pending = self._pending, None
        if pending is None or pending[1] <= self.version:
            return 0
        state_dict, version, skipped = pending
        self.engine.load_weights(state_dict, version)
        self.version, self.skipped = version, skipped
        return 1


def remote_worker_class():
    """``RolloutWorker`` as a Ray actor class with its two concurrency groups."""
    return ray.remote(concurrency_groups={"weights": 1, "rollout": 1})(RolloutWorker)
