"""The asynchronous sample source: rollout workers on Ray generate while the learner trains.

    loop + learner (driver, or a Ray actor)            rollout workers (Ray actors, vespo.trainer.workers)
    ---------------------------------------            ---------------------------------------------------
    next(): the mini-batch of ticket t          <----   wait for admission (staleness bound)
    after_update(): every K = sync_every               generate chunk_tokens at a time, loading newer
      updates, weights -> object store -> workers ---->  weights between chunks (partial rollouts)
                                                       score, advantage -> TrainBatch

Each mini-batch (``prompts_per_step / staleness.n`` prompts x G responses) has a *ticket*: the
index of the learner update it is destined for. The source draws its prompts from the prompt
stream and hands it to the least busy worker; workers may finish out of order, the loop gets
tickets strictly in order (``buffer.TicketQueue``). A worker starts ticket t only with weights
recent enough that every row's lag (learner version at train time - oldest token version) stays
<= ``async.max_staleness`` (``buffer.StalenessBound``): staleness is bounded by making rollout
wait, never by discarding samples. The learner takes μ from the engine's own log-probs
(staleness.behavior=rollout), so the importance weight carries staleness and engine mismatch together.

With LoRA (model.lora) each worker is built once with the frozen base and every push carries the adapters alone.
A crashed worker is restarted by Ray (``async.max_restarts``); the source sends it the newest
weights and resubmits its unfinished tickets. RUN_DIR/versions.jsonl records, per update, the
learner version and each row's token versions (the staleness bound can be checked row by row).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import ray
import torch
from ray.exceptions import RayActorError, RayTaskError

from vespo.buffer import StalenessBound, TicketQueue
from vespo.config import AsyncConfig, to_dict
from vespo.errors import UserError
from vespo.data import PromptStream
from vespo.models.lora import base_state, has_lora
from vespo.rollout.base import SamplingParams
from vespo.rundir import VERSIONS
from vespo.trainer.producer import PromptBatch, PromptSampler
from vespo.trainer.protocols import Learner, TrainItem
from vespo.trainer.run import Run
from vespo.trainer.runlog import append_rows
from vespo.trainer.sources import step_seed
from vespo.trainer.workers import remote_worker_class
from vespo.types import Problem

PREFETCH = 2  # rollout calls queued per worker, so it never idles between two mini-batches


class WorkerError(RuntimeError):
    """A rollout worker raised, or crashed more often than ``async.max_restarts`` allows."""


@dataclass
class Ticket:
    index: int  # the learner update this mini-batch is destined for
    prompts: PromptBatch
    seed: int
    worker: int = -1


@contextmanager
def ray_session(a: AsyncConfig) -> Iterator[None]:
    """Join the cluster at ``a.ray_address``, or start a local Ray on loopback, and shut down what
    was started here on exit; a Ray the caller already initialized is used and left running."""
    if ray.is_initialized():
        yield
        return
    if a.ray_address:
        ray.init(address=a.ray_address, log_to_driver=True)
    else:
        cpus = a.workers + (math.ceil(a.learner_num_cpus) * a.learner_workers if a.learner == "actor" else 0)
        ray.init(include_dashboard=False, _node_ip_address="127.0.0.1", num_cpus=cpus, log_to_driver=True)
    try:
        yield
    finally:
        ray.shutdown()


class RaySource:
    """Async mode's sample source (see the module docstring)."""

    def __init__(self, run: Run, learner: Learner):
        self.run, self.cfg, self.learner = run, run.cfg, learner
        self.a = run.cfg.async_
        self.bound = StalenessBound(run.schedule.max_lag)
        self.total = run.schedule.total
        self.stream = PromptStream(run.train_problems, seed=run.cfg.run.seed)
        self.prompts = PromptSampler(run.tokenizer, self.stream, run.cfg.rollout.group_size)
        self.queue = TicketQueue()
        self.workers: list = []
        self.inflight: dict[ray.ObjectRef, Ticket] = {}
        self.next_issue = 0
        self.stream_states: dict[int, dict] = {}  # ticket -> prompt-stream state before its prompts were drawn
        self.weights_ref = None
        self.base_ref = None  # with LoRA: the frozen base, sent to each worker once (pushes carry the adapters)
        self.pushed = (-1, 0)  # (version, skipped) of the last weight push
        self.pushes = 0
        self.restarts: list[int] = []
        self.versions_file = None

    # ------------------------------------------------------------ the protocol

    def start(self, first_update: int) -> None:
        self.queue, self.next_issue = TicketQueue(first_update), first_update
        self.stream_states = {}
        self._open_versions_log(first_update)
        self.start_workers()

    def next(self) -> list[TrainItem]:
        """Wait for the next ticket; its mini-batch (rows may span policy versions)."""
        self.fill()
        idle = self.wait_for_next()
        depth = self.queue.depth - 1  # finished mini-batches waiting behind this one
        ticket, (batch, rows, perf) = self.queue.pop()
        self._record_versions(ticket, batch)
        perf = {**perf, "perf/learner_idle_s_sum": idle, "perf/queue_depth_max": float(depth)}
        return [TrainItem(ticket, batch, sampled_version=None, rollout_rows=rows, perf=perf)]

    def after_update(self, version: int) -> None:
        if version % self.a.sync_every == 0 and version > self.pushed[0]:
            self.push_weights()

    def generate(self, problems: list[Problem], n: int, sampling: SamplingParams, seed: int) -> list[list[str]]:
        """Completions from rollout worker 0 once it holds the learner's newest weights."""
        if self.pushed[0] < self.learner.version or not self.workers:
            if not self.workers:
                self.start_workers()
            else:
                self.push_weights()
        ids = self.prompts.encode_all(problems)
        ref = self.workers[0].complete.remote(ids, n, sampling, seed, self.pushed[0])
        return ray.get(ref, timeout=max(self.a.stall_timeout_s, 60.0))

    def checkpointable(self) -> bool:
        return True

    def state_dict(self) -> dict:
        """The prompt-stream state of the first untrained ticket, so a resume redraws exactly the
        prompts that were in flight."""
        t = self.queue.next_ticket
        stream = self.stream_states.get(t) if t < self.next_issue else self.stream.state_dict()
        self.stream_states = {k: v for k, v in self.stream_states.items() if k >= t}
        return {"stream": stream, "tickets": t}

    def load_state_dict(self, state: dict) -> None:
        self.stream.load_state_dict(state["stream"])

    def summary(self) -> dict:
        return {"weight_pushes": self.pushes, "worker_restarts": sum(self.restarts)}

    def step_metrics(self) -> dict[str, float]:
        return {"async/weight_pushes": float(self.pushes), "async/worker_restarts": float(sum(self.restarts))}

    def close(self) -> None:
        self.stop_workers()
        if self.versions_file is not None:
            self.versions_file.close()
            self.versions_file = None

    # ------------------------------------------------------------ workers and weights

    def start_workers(self) -> None:
        actor = remote_worker_class().options(max_restarts=self.a.max_restarts, max_task_retries=0, num_cpus=1)
        cfg_dict = to_dict(self.cfg)
        if has_lora(self.run.policy) and self.base_ref is None:  # the learner never changes it
            self.base_ref = ray.put(base_state(self.run.policy))
        self.workers = [actor.remote(cfg_dict, self.run.sampling, i, self.base_ref) for i in range(self.a.workers)]
        self.restarts = [0] * self.a.workers
        self.push_weights()
        try:  # every worker built and holding weights
            ray.get([w.pid.remote() for w in self.workers], timeout=self.a.stall_timeout_s)
        except ray.exceptions.GetTimeoutError as e:
            raise WorkerError(f"rollout workers did not start within {self.a.stall_timeout_s:.0f}s "
                              "(async.stall_timeout_s); is the Ray cluster alive and does it have free CPUs?") from e

    def push_weights(self) -> None:
        """Put the learner's weights in the object store once; every worker fetches them."""
        self.weights_ref = self.learner.shared_weights()
        version = self.learner.version
        self.pushed = (version, self.queue.next_ticket - version)
        for w in self.workers:
            w.set_weights.remote(self.weights_ref, *self.pushed)
        self.pushes += 1

    def fill(self) -> None:
        """Issue tickets (in order) to the least busy workers until each has PREFETCH queued."""
        while self.next_issue < self.total:
            load = [sum(t.worker == i for t in self.inflight.values()) for i in range(len(self.workers))]
            worker = min(range(len(load)), key=load.__getitem__)
            if load[worker] >= PREFETCH:
                return
            self.submit(self.new_ticket(), worker)

    def new_ticket(self) -> Ticket:
        i, per_mb = self.next_issue, self.cfg.prompts_per_minibatch
        self.stream_states[i] = self.stream.state_dict()
        prompts = self.prompts.sample(per_mb, first_group_id=i * per_mb)
        self.next_issue += 1
        return Ticket(i, prompts, step_seed(self.cfg, i, 1))

    def submit(self, ticket: Ticket, worker: int) -> None:
        ticket.worker = worker
        ref = self.workers[worker].rollout.remote(ticket.index, ticket.prompts, ticket.seed)
        self.inflight[ref] = ticket

    def wait_for_next(self) -> float:
        """Collect finished rollouts until the next ticket is there; returns the seconds waited."""
        t0 = last = time.perf_counter()
        while not self.queue.ready():
            self.keep_admissible()
            done, _ = ray.wait(list(self.inflight), num_returns=1, timeout=1.0)
            for ref in done:
                self.collect(ref)
                last = time.perf_counter()
            if time.perf_counter() - last > self.a.stall_timeout_s:
                raise WorkerError(f"no rollout arrived for {self.a.stall_timeout_s:.0f}s while waiting for "
                                  f"ticket {self.queue.next_ticket} ({len(self.inflight)} in flight); "
                                  "is the Ray cluster alive? (async.stall_timeout_s)")
        return time.perf_counter() - t0

    def keep_admissible(self) -> None:
        """Push early when the next ticket could not be admitted with the pushed weights
        (only happens when max_staleness < sync_every - 1: without it the run would deadlock)."""
        t = self.queue.next_ticket
        needed = self.bound.needed_version(t, t - self.learner.version)
        if self.pushed[0] < needed and self.learner.version > self.pushed[0]:
            self.push_weights()

    def collect(self, ref: ray.ObjectRef) -> None:
        ticket = self.inflight.pop(ref)
        try:
            index, batch, rows, perf = ray.get(ref)
        except RayActorError as e:
            self.restart(ticket, e)
            return
        except RayTaskError as e:
            if isinstance(e.cause, UserError):  # e.g. a reward function that cannot be used: the user's one line
                raise e.cause from None
            raise WorkerError(f"rollout worker {ticket.worker} failed on ticket {ticket.index}: {e}") from e
        self.queue.put(index, (batch, rows, perf))

    def restart(self, failed: Ticket, error: Exception) -> None:
        """A worker process died: wait for Ray to restart it, send it weights, resubmit its tickets."""
        from vespo.trainer.runlog import console

        i = failed.worker
        self.restarts[i] += 1
        if self.restarts[i] > self.a.max_restarts:
            raise WorkerError(f"rollout worker {i} crashed {self.restarts[i]} times (async.max_restarts="
                              f"{self.a.max_restarts}): {error}") from error
        lost = [failed] + [t for t in self.inflight.values() if t.worker == i]
        self.inflight = {r: t for r, t in self.inflight.items() if t.worker != i}
        console.print(f"[yellow]rollout worker {i} crashed; restarting it and resubmitting tickets "
                      f"{sorted(t.index for t in lost)}")
        pid = self._await_alive(i)
        self.workers[i].set_weights.remote(self.weights_ref, *self.pushed)
        for t in sorted(lost, key=lambda t: t.index):
            self.submit(t, i)
        console.print(f"rollout worker {i} is back (pid {pid})")

    def _await_alive(self, i: int, timeout_s: float = 120.0) -> int:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return ray.get(self.workers[i].pid.remote(), timeout=30)
            except (RayActorError, ray.exceptions.GetTimeoutError) as e:
                if time.monotonic() > deadline:
                    raise WorkerError(f"rollout worker {i} did not come back within {timeout_s:.0f}s") from e
                time.sleep(0.5)

    def stop_workers(self) -> None:
        from vespo.trainer.runlog import console

        for w in self.workers:
            try:
                ray.kill(w, no_restart=True)
            except Exception as e:  # already gone, or Ray itself is going down
                console.print(f"could not kill a rollout worker: {e}")
        self.workers = []
        self.inflight = {}

    # ------------------------------------------------------------ versions.jsonl

    def _open_versions_log(self, first: int) -> None:
        """RUN_DIR/versions.jsonl: per update, the learner version and each row's token versions."""
        path = Path(self.cfg.run.out_dir) / VERSIONS
        path.parent.mkdir(parents=True, exist_ok=True)
        rows = []
        if first > 0 and path.exists():
            rows = [line for line in _complete_lines(path) if json.loads(line)["ticket"] < first]
        path.write_text("".join(r + "\n" for r in rows))
        self.versions_file = path.open("ab", buffering=0)  # whole rows only, synced: append_rows

    def _record_versions(self, ticket: int, batch) -> None:
        row = {"ticket": ticket, "learner_version": self.learner.version, "versions": batch.versions.tolist(),
               "versions_max": batch.versions_max.tolist(), "token_versions": _version_runs(batch)}
        append_rows(self.versions_file, self.versions_file.name, ticket + 1, json.dumps(row) + "\n", unit="update")


def _version_runs(batch) -> list[list[list[int]]]:
    """Each row's token versions in response order as runs [[version, tokens], ...] (valid tokens only)."""
    out = []
    for versions, valid in zip(batch.token_versions, batch.response_mask > 0):
        values, counts = torch.unique_consecutive(versions[valid], return_counts=True)
        out.append([[v, n] for v, n in zip(values.tolist(), counts.tolist())])
    return out


def _complete_lines(path: Path) -> list[str]:
    """The lines of a file that end with a newline (a process killed mid-write leaves a torn last line)."""
    text = path.read_text()
    return text.split("\n")[:-1] if text else []
