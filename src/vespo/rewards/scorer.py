"""Score batches of completions with a reward function: in worker processes with a time limit,
or in process for cheap pure-Python rewards.

    scorer = RewardScorer(math_verify_reward, timeout_s=10.0, num_workers=4)
    result = scorer.score(completions, ground_truths)    # ScoreResult(rewards, errors)
    result = scorer.score_problems(completions, problems)  # the same, with each row's data_source, extra_info
    scorer.close()                                       # or use it as a context manager

    RewardScorer(task.reward, num_workers=0)             # in process: no pool, no time limit

Two signatures are accepted (``reward_call`` tells them apart by their parameter names, once):
- vespo's ``f(completion, ground_truth) -> float``, called positionally;
- verl's ``compute_score(data_source, solution_str, ground_truth, extra_info=None)``, called by
  keyword as verl's reward managers call it, with the row's data_source and a copy of its
  extra_info; it may return a float or, as in verl, a dict whose "score" is the reward.

What a failed call becomes (never a silent reward):
- timeout: the worker is killed and replaced; the sample's reward is 0.0 (a verifier that cannot
  decide in time did not verify the answer) and a ScoreError(kind="timeout") is reported.
- exception, a value that is not a number, a non-finite value, or a worker that dies: the
  sample's reward is NaN and a ScoreError is reported; `ScoreResult.valid` is False there, and
  the caller must drop the sample (a NaN reward poisons any mean it enters).
- `max_errors=N`: if more than N samples of one batch fail (timeouts excluded), `score` raises
  RewardError listing them instead of returning.
- every sample of a batch failing (timeouts excluded) means the function cannot score at all:
  `score` raises RewardsFailedError (a user error: one line naming the function, the exception
  and the signatures accepted).
"""

from __future__ import annotations

import inspect
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

RewardFn = Callable[[str, Any], float]  # (completion, ground_truth) -> reward; or verl's compute_score
SIGNATURES = (
    "f(completion, ground_truth) -> float",
    "verl's compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | {'score': float}",
)
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


class RewardsFailedError(RewardFnError):
    """Every sample of a batch failed to score: the reward function cannot be used as given."""


@dataclass(frozen=True)
class PlainReward:
    """vespo's signature: ``fn(completion, ground_truth)``."""

    fn: RewardFn

    def __call__(self, completion: str, ground_truth: Any, data_source: str, extra_info: dict) -> Any:
        return self.fn(completion, ground_truth)


@dataclass(frozen=True)
class VerlReward:
    """verl's signature, called by keyword as verl's reward managers call it; a dict's "score" is the reward."""

    fn: Callable[..., Any]
    takes_extra_info: bool

    def __call__(self, completion: str, ground_truth: Any, data_source: str, extra_info: dict) -> Any:
        kwargs = {"data_source": data_source, "solution_str": completion, "ground_truth": ground_truth}
        if self.takes_extra_info:
            kwargs["extra_info"] = dict(extra_info)  # a copy: the function may add keys, as verl's do
        score = self.fn(**kwargs)
        return score["score"] if isinstance(score, dict) and "score" in score else score


def reward_call(fn: Callable[..., Any]) -> PlainReward | VerlReward:
    """``fn`` wrapped to be called as (completion, ground_truth, data_source, extra_info).

    A function with a ``solution_str`` parameter is verl's; one callable with two positional
    arguments is vespo's; anything else raises RewardFnError naming both signatures.
    """
    if isinstance(fn, (PlainReward, VerlReward)):
        return fn
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: trust the documented one
        return PlainReward(fn)
    params = signature.parameters
    variadic = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    if "solution_str" in params:
        return VerlReward(fn, takes_extra_info="extra_info" in params or variadic)
    try:
        signature.bind("", None)
    except TypeError:
        raise RewardFnError(f"reward function {describe(fn)}{signature} matches neither accepted signature: "
                            f"{SIGNATURES[0]}, or {SIGNATURES[1]}") from None
    return PlainReward(fn)


def describe(fn: Any) -> str:
    """module:qualname of a function or bound method (the form task.reward takes), else its repr."""
    fn = getattr(fn, "fn", fn)
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    return f"{module}:{name}" if module and name else repr(fn)


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


def _call(fn: PlainReward | VerlReward, completion: str, truth: Any, source: str,
          extra: dict) -> tuple[float | None, str, str]:
    try:
        return check_reward_value(fn(completion, truth, source, extra))
    except Exception as exc:  # reported with the sample, never turned into a reward
        return None, "exception", f"{type(exc).__name__}: {exc}"


def _worker_main(fn_bytes: bytes, conn: Connection) -> None:
    """Worker loop: load the function, say ready, then answer (index, completion, truth, source, extra) jobs."""
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
        index, *sample = job
        conn.send(("result", (index, *_call(fn, *sample))))


class _Worker:
    """One worker process, its pipe, and the job it is running (if any)."""

    def __init__(self, ctx: Any, fn_bytes: bytes):
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker_main, args=(fn_bytes, child), daemon=True)
        self.process.start()
        child.close()
        self.ready, self.job, self.since = False, None, time.monotonic()

    def submit(self, index: int, completion: str, truth: Any, source: str, extra: dict) -> None:
        self.conn.send((index, completion, truth, source, extra))
        self.job, self.since = index, time.monotonic()

    def kill(self) -> None:
        self.process.kill()
        self.process.join()
        self.conn.close()


class RewardScorer:
    """Scores batches with `fn(completion, ground_truth) -> float` (or verl's compute_score; see the module).

    num_workers=0 runs `fn` in this process (fast path for cheap exact task rewards; no time
    limit). num_workers>0 runs it in that many worker processes, each call limited to
    `timeout_s` seconds; `fn` must be picklable (a module-level function, or a method of a
    picklable object such as a built-in task).
    """

    def __init__(self, fn: RewardFn, timeout_s: float = 10.0, num_workers: int = 2,
                 max_errors: int | None = None, start_method: str = "spawn"):
        if not callable(fn):
            raise ValueError(f"fn must be callable, got {type(fn).__name__}")
        fn = reward_call(fn)
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
    def _pickle(fn: PlainReward | VerlReward) -> bytes:
        try:
            return pickle.dumps(fn)
        except Exception as exc:
            raise RewardFnError(f"reward function {describe(fn)} cannot be sent to worker processes ({exc}); use a "
                                "module-level function, or num_workers=0 to score in process") from exc

    def _spawn(self) -> _Worker:
        return _Worker(self._ctx, self._fn_bytes)

    def score(self, completions: Sequence[str], ground_truths: Sequence[Any], data_sources: Sequence[str] | None = None,
              extra_infos: Sequence[dict] | None = None) -> ScoreResult:
        """Rewards for each (completion, ground truth) pair, in order, with the failures.

        data_sources / extra_infos: each row's, for verl-style functions ("unknown" / {} when None).
        """
        n = len(completions)
        for name, values in (("ground_truths", ground_truths), ("data_sources", data_sources),
                             ("extra_infos", extra_infos)):
            if values is not None and len(values) != n:
                raise ValueError(f"completions has {n} items but {name} has {len(values)}")
        samples = list(zip(completions, ground_truths, data_sources or ["unknown"] * n, extra_infos or [{}] * n))
        if self.num_workers == 0:
            outcomes = [_call(self.fn, *sample) for sample in samples]
        else:
            outcomes = self._score_in_workers(samples)
        return self._collect(completions, outcomes)

    def score_problems(self, completions: Sequence[str], problems: Sequence[Any]) -> ScoreResult:
        """``score`` of each completion against its Problem: ground_truth, data_source and extra_info."""
        return self.score(completions, [p.ground_truth for p in problems], [p.data_source for p in problems],
                          [p.extra_info for p in problems])

    def _collect(self, completions: Sequence[str], outcomes: list[tuple[float | None, str, str]]) -> ScoreResult:
        rewards, errors = [], []
        for index, (reward, kind, message) in enumerate(outcomes):
            if reward is None:
                reward = 0.0 if kind == "timeout" else math.nan
                errors.append(ScoreError(index, kind, message, excerpt(completions[index]), reward))
            rewards.append(reward)
        failed = [e for e in errors if e.kind != "timeout"]
        if failed and len(failed) == len(outcomes):
            raise RewardsFailedError(
                f"every reward of a batch of {len(outcomes)} failed: reward function {describe(self.fn)} gave "
                f"{failed[0].kind} {failed[0].message!r} (completion {failed[0].completion_excerpt}); a reward "
                f"function must be {SIGNATURES[0]}, or {SIGNATURES[1]}")
        for e in errors:
            log.warning("reward of sample %d failed (%s): %s; completion %s", e.index, e.kind, e.message,
                        e.completion_excerpt)
        self.num_timeouts += sum(e.kind == "timeout" for e in errors)
        if self.max_errors is not None and len(failed) > self.max_errors:
            lines = "\n".join(f"  sample {e.index} ({e.kind}): {e.message}; completion {e.completion_excerpt}"
                              for e in failed[:5])
            raise RewardError(f"{len(failed)} of {len(outcomes)} samples failed to score "
                              f"(max_errors={self.max_errors}):\n{lines}")
        return ScoreResult(rewards, errors)

    def _score_in_workers(self, samples: list[tuple[str, Any, str, dict]]) -> list[tuple[float | None, str, str]]:
        outcomes: list[Any] = [None] * len(samples)
        pending = deque(range(len(samples)))
        while pending or any(w.job is not None for w in self._workers):
            for w in self._workers:
                if w.ready and w.job is None and pending:
                    i = pending.popleft()
                    w.submit(i, *samples[i])
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
