"""Score batches of completions with a reward function: in worker processes with a time limit,
or in process for cheap pure-Python rewards.

    scorer = RewardScorer(math_verify_reward, timeout_s=10.0, num_workers=4)
    result = scorer.score(completions, ground_truths)    # ScoreResult(rewards, errors)
    scorer.close()                                       # or use it as a context manager

    RewardScorer(task.reward, num_workers=0)             # in process: no pool, no time limit

What a failed call becomes (never a silent reward):
- timeout: the worker is killed and replaced; the sample's reward is 0.0 (a verifier that cannot
  decide in time did not verify the answer) and a ScoreError(kind="timeout") is reported.
- exception, a value that is not a number, a non-finite value, or a worker that dies: the
  sample's reward is NaN and a ScoreError is reported; `ScoreResult.valid` is False there, and
  the caller must drop the sample (a NaN reward poisons any mean it enters).
- `max_errors=N`: if more than N samples of one batch fail (timeouts excluded), `score` raises
  RewardError listing them instead of returning.
"""

from __future__ import annotations

import logging
import math
import multiprocessing as mp
import pickle
import time
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from vespo.errors import RewardFnError

log = logging.getLogger(__name__)

RewardFn = Callable[[str, Any], float]
EXCERPT_CHARS = 80
STARTUP_TIMEOUT_S = 120.0  # a worker that cannot import the reward function in this long is an error


@dataclass
class ScoreError:
    """One sample whose reward could not be computed."""

    index: int  # position in the batch given to `score`
    kind: str  # "timeout" | "exception" | "non_numeric" | "non_finite" | "crash"
    message: str
    completion_excerpt: str  # the first EXCERPT_CHARS characters of the completion
    reward: float  # what the sample was given: 0.0 for a timeout, NaN otherwise


@dataclass
class ScoreResult:
    """Rewards of a batch, in order, and the samples that failed."""

    rewards: list[float]
    errors: list[ScoreError] = field(default_factory=list)

    @property
    def valid(self) -> list[bool]:
        """False where the reward is NaN (a failed call the caller must drop)."""
        return [not math.isnan(r) for r in self.rewards]


class RewardError(RuntimeError):
    """Too many samples of one batch failed to score."""


def excerpt(completion: str) -> str:
    text = completion if len(completion) <= EXCERPT_CHARS else completion[:EXCERPT_CHARS] + "..."
    return repr(text)


def check_reward_value(value: Any) -> tuple[float | None, str, str]:
    """(reward, kind, message): the value as a float, or None with why it is not a reward."""
    try:
        reward = float(value)
    except (TypeError, ValueError):
        return None, "non_numeric", f"returned {type(value).__name__} {value!r:.60}, not a number"
    if not math.isfinite(reward):
        return None, "non_finite", f"returned the non-finite value {reward}"
    return reward, "ok", ""


def _call(fn: RewardFn, completion: str, truth: Any) -> tuple[float | None, str, str]:
    try:
        return check_reward_value(fn(completion, truth))
    except Exception as exc:  # reported with the sample, never turned into a reward
        return None, "exception", f"{type(exc).__name__}: {exc}"


def _worker_main(fn_bytes: bytes, conn: Connection) -> None:
    """Worker loop: load the function, say ready, then answer (index, completion, truth) jobs."""
    try:
        fn = pickle.loads(fn_bytes)
    except Exception:
        conn.send(("startup_error", traceback.format_exc()))
        return
    conn.send(("ready", None))
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        if job is None:
            return
        index, completion, truth = job
        conn.send(("result", (index, *_call(fn, completion, truth))))


class _Worker:
    """One worker process, its pipe, and the job it is running (if any)."""

    def __init__(self, ctx: Any, fn_bytes: bytes):
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker_main, args=(fn_bytes, child), daemon=True)
        self.process.start()
        child.close()
        self.ready, self.job, self.since = False, None, time.monotonic()

    def submit(self, index: int, completion: str, truth: Any) -> None:
        self.conn.send((index, completion, truth))
        self.job, self.since = index, time.monotonic()

    def kill(self) -> None:
        self.process.kill()
        self.process.join()
        self.conn.close()


class RewardScorer:
    """Scores batches with `fn(completion, ground_truth) -> float`.

    num_workers=0 runs `fn` in this process (fast path for cheap exact task rewards; no time
    limit). num_workers>0 runs it in that many worker processes, each call limited to
    `timeout_s` seconds; `fn` must be picklable (a module-level function, or a method of a
    picklable object such as a built-in task).
    """

    def __init__(self, fn: RewardFn, timeout_s: float = 10.0, num_workers: int = 2,
                 max_errors: int | None = None, start_method: str = "spawn"):
        if not callable(fn):
            raise ValueError(f"fn must be callable, got {type(fn).__name__}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        if not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"num_workers must be an integer >= 0, got {num_workers!r}")
        if max_errors is not None and max_errors < 0:
            raise ValueError(f"max_errors must be >= 0 or None, got {max_errors!r}")
        self.fn, self.timeout_s, self.num_workers, self.max_errors = fn, timeout_s, num_workers, max_errors
        self.num_timeouts = 0  # over the scorer's life, for metrics
        self._ctx = mp.get_context(start_method)
        self._fn_bytes = self._pickle(fn) if num_workers else b""
        self._workers: list[_Worker] = [self._spawn() for _ in range(num_workers)]

    @staticmethod
    def _pickle(fn: RewardFn) -> bytes:
        try:
            return pickle.dumps(fn)
        except Exception as exc:
            raise RewardFnError(f"reward function {fn!r} cannot be sent to worker processes ({exc}); use a "
                                "module-level function, or num_workers=0 to score in process") from exc

    def _spawn(self) -> _Worker:
        return _Worker(self._ctx, self._fn_bytes)

    def score(self, completions: Sequence[str], ground_truths: Sequence[Any]) -> ScoreResult:
        """Rewards for each (completion, ground truth) pair, in order, with the failures."""
        if len(completions) != len(ground_truths):
            raise ValueError(f"completions has {len(completions)} items but ground_truths has {len(ground_truths)}")
        if self.num_workers == 0:
            outcomes = [_call(self.fn, c, t) for c, t in zip(completions, ground_truths)]
        else:
            outcomes = self._score_in_workers(list(completions), list(ground_truths))
        return self._collect(completions, outcomes)

    def _collect(self, completions: Sequence[str], outcomes: list[tuple[float | None, str, str]]) -> ScoreResult:
        rewards, errors = [], []
        for index, (reward, kind, message) in enumerate(outcomes):
            if reward is None:
                reward = 0.0 if kind == "timeout" else math.nan
                errors.append(ScoreError(index, kind, message, excerpt(completions[index]), reward))
                log.warning("reward of sample %d failed (%s): %s; completion %s", index, kind, message,
                            errors[-1].completion_excerpt)
            rewards.append(reward)
        self.num_timeouts += sum(e.kind == "timeout" for e in errors)
        failed = [e for e in errors if e.kind != "timeout"]
        if self.max_errors is not None and len(failed) > self.max_errors:
            lines = "\n".join(f"  sample {e.index} ({e.kind}): {e.message}; completion {e.completion_excerpt}"
                              for e in failed[:5])
            raise RewardError(f"{len(failed)} of {len(outcomes)} samples failed to score "
                              f"(max_errors={self.max_errors}):\n{lines}")
        return ScoreResult(rewards, errors)

    def _score_in_workers(self, completions: list[str], truths: list[Any]) -> list[tuple[float | None, str, str]]:
        outcomes: list[Any] = [None] * len(completions)
        pending = deque(range(len(completions)))
        while pending or any(w.job is not None for w in self._workers):
            for w in self._workers:
                if w.ready and w.job is None and pending:
                    i = pending.popleft()
                    w.submit(i, completions[i], truths[i])
            self._wait_and_receive(outcomes)
            self._replace_overdue(outcomes)
        return outcomes

    def _wait_and_receive(self, outcomes: list[Any]) -> None:
        by_conn = {w.conn: w for w in self._workers}
        for conn in wait(list(by_conn), timeout=self._next_deadline()):
            worker = by_conn[conn]
            try:
                kind, payload = conn.recv()
            except (EOFError, OSError):
                self._on_crash(worker, outcomes)
                continue
            if kind == "startup_error":
                raise RuntimeError(f"reward worker could not load the reward function:\n{payload}")
            if kind == "ready":
                worker.ready = True
            else:
                index, reward, status, message = payload
                outcomes[index] = (reward, status, message)
                worker.job = None

    def _next_deadline(self) -> float:
        now = time.monotonic()
        limits = [w.since + (self.timeout_s if w.ready else STARTUP_TIMEOUT_S) - now for w in self._workers]
        return max(0.0, min(limits))

    def _replace_overdue(self, outcomes: list[Any]) -> None:
        now = time.monotonic()
        for k, w in enumerate(self._workers):
            if not w.ready and now - w.since > STARTUP_TIMEOUT_S:
                raise RuntimeError(f"reward worker did not start within {STARTUP_TIMEOUT_S:.0f}s")
            if w.job is not None and now - w.since > self.timeout_s:
                outcomes[w.job] = (None, "timeout", f"no answer within {self.timeout_s:g}s; worker killed")
                w.kill()
                self._workers[k] = self._spawn()

    def _on_crash(self, worker: _Worker, outcomes: list[Any]) -> None:
        worker.kill()
        code = worker.process.exitcode
        if not worker.ready:
            raise RuntimeError(f"reward worker exited while starting (exit code {code})")
        if worker.job is not None:
            outcomes[worker.job] = (None, "crash", f"worker process died (exit code {code})")
        self._workers[self._workers.index(worker)] = self._spawn()

    def close(self) -> None:
        """Stop the worker processes."""
        for w in self._workers:
            try:
                w.conn.send(None)
            except OSError:
                pass
            w.process.join(timeout=1.0)
            if w.process.is_alive():
                w.process.kill()
                w.process.join()
            w.conn.close()
        self._workers = []

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_workers", None):
            try:
                self.close()
            except Exception:  # interpreter shutdown: the workers are daemons and die with us
                pass
