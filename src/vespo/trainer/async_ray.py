"""Fully asynchronous training on Ray: rollout workers generate while the learner trains.

    driver (this process)                          rollout workers (Ray actors, vespo.trainer.workers)
    ---------------------                          ---------------------------------------------------
    learner: one optimizer step per mini-batch      wait for admission (staleness bound)
    tickets 0, 1, 2, ... trained in order   <----   generate chunk_tokens at a time, loading newer
    every K = sync_every updates:                   weights between chunks (partial rollouts)
      ray.put(state_dict) -> set_weights    ---->   score, advantage -> TrainBatch
    metrics, checkpoints, Ctrl-C, restarts

Each mini-batch (``prompts_per_step / staleness.n`` prompts x G responses) has a *ticket*: the
index of the learner update it is destined for. The driver draws its prompts from the prompt
stream and hands it to the least busy worker; workers may finish out of order, the learner trains
tickets strictly in order (``buffer.TicketQueue``). A worker starts ticket t only with weights
recent enough that every row's lag (learner version at train time - oldest token version) stays
<= ``async.max_staleness`` (``buffer.StalenessBound``): staleness is bounded by making rollout
wait, never by discarding samples. μ is the engine's own log-probs (behavior ``rollout``), so the
importance weight carries staleness and engine mismatch together.

The learner lives in the driver: it owns the optimizer, the metric sinks, the checkpoints and the
Ctrl-C handler, so nothing but the weights (once per K updates) and the mini-batches crosses a
process boundary. A crashed worker is restarted by Ray (``async.max_restarts``); the driver sends
it the newest weights and resubmits its unfinished tickets. An exception in a worker or in the
driver, or Ctrl-C, stops the run with a checkpoint written; the workers are killed and a Ray
started here is shut down.

    vespo train --mode async                              local Ray
    vespo train --mode async async.ray_address=auto      an existing Ray cluster
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import ray
import torch
from ray.exceptions import RayActorError, RayTaskError

from vespo.buffer import StalenessBound, TicketQueue, lag_stats
from vespo.config import AsyncConfig, Config, to_dict
from vespo.metrics import mean_of, to_floats
from vespo.trainer.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from vespo.trainer.producer import PromptBatch
from vespo.trainer.runlog import GracefulInterrupt, RunLog, console, progress_bar
from vespo.trainer.setup import Parts, build
from vespo.trainer.sync import evaluate, print_summary, run_summary, set_behavior, step_seed
from vespo.trainer.workers import remote_worker_class

PREFETCH = 2  # rollout calls queued per worker, so it never idles between two mini-batches


class WorkerError(RuntimeError):
    """A rollout worker raised, or crashed more often than ``async.max_restarts`` allows."""


@dataclass
class Ticket:
    index: int  # the learner update this mini-batch is destined for
    prompts: PromptBatch
    seed: int
    worker: int = -1


def train_async(cfg: Config, resume: bool = False, on_update: Callable[["AsyncTrainer"], None] | None = None) -> dict:
    """Run (or resume) an asynchronous run; returns the summary written to summary.json.

    ``on_update(trainer)`` is called after every learner update (tests use it to kill a worker or
    send Ctrl-C mid-run)."""
    cfg = _rollout_behavior(cfg)
    torch.set_num_threads(cfg.run.threads or 1)
    torch.manual_seed(cfg.run.seed)
    parts = build(cfg, log=console.print)
    started_ray = start_ray(cfg.async_)
    trainer = None
    try:
        trainer = AsyncTrainer(parts, on_update)
        return trainer.train(resume)
    finally:
        if trainer is not None:
            trainer.stop_workers()
        parts.close()
        if started_ray:
            ray.shutdown()


def _rollout_behavior(cfg: Config) -> Config:
    if cfg.staleness.behavior == "rollout":
        return cfg
    console.print("async mode: behavior policy mu = the engine's log-probs (staleness.behavior=rollout)")
    return replace(cfg, staleness=replace(cfg.staleness, behavior="rollout"))


def start_ray(a: AsyncConfig) -> bool:
    """Join the cluster at ``a.ray_address``, or start a local Ray on loopback; False if Ray was
    already initialized (then the caller's Ray is left running)."""
    if ray.is_initialized():
        return False
    if a.ray_address:
        ray.init(address=a.ray_address, log_to_driver=True)
    else:
        ray.init(include_dashboard=False, _node_ip_address="127.0.0.1", num_cpus=a.workers, log_to_driver=True)
    return True


class AsyncTrainer:
    def __init__(self, parts: Parts, on_update: Callable[["AsyncTrainer"], None] | None = None):
        self.parts, self.cfg, self.learner = parts, parts.cfg, parts.learner
        self.on_update = on_update
        self.bound = StalenessBound(self.cfg.async_.max_staleness)
        self.n = self.cfg.staleness.n  # updates per logged step
        self.total = self.cfg.run.steps * self.n  # learner updates (tickets) in the whole run
        self.queue = TicketQueue()
        self.workers: list = []
        self.inflight: dict[ray.ObjectRef, Ticket] = {}
        self.next_issue = 0
        self.stream_states: dict[int, dict] = {}  # ticket -> prompt-stream state before its prompts were drawn
        self.weights_ref = None
        self.pushed = (-1, 0)  # (version, skipped) of the last weight push
        self.pushes = 0
        self.restarts: list[int] = []
        self.versions_file = None

    # ------------------------------------------------------------ the run

    def train(self, resume: bool) -> dict:
        cfg, parts = self.cfg, self.parts
        first = self._resume() if resume else 0
        self.queue, self.next_issue = TicketQueue(first), first
        runlog = RunLog(cfg, resume_step=first // self.n if resume else None)
        self._open_versions_log(first, resume)
        before = self._eval_before(runlog.dir, first)
        self.start_workers()
        t_start, history, status = time.perf_counter(), [], "done"
        try:
            with GracefulInterrupt() as stop, progress_bar(cfg.run.progress) as bar:
                task = bar.add_task(f"{cfg.loss.name} async", total=self.total, completed=first, status="")
                window: list = []
                while self.queue.next_ticket < self.total:
                    window.append(self.train_one())
                    bar.update(task, advance=1)
                    if self.queue.next_ticket % self.n == 0 or self.queue.next_ticket == self.total:
                        history.append(self._log_step(runlog, window))
                        bar.update(task, status=f"reward {history[-1]['reward/mean']:.3f}")
                        window = []
                    if self.on_update is not None:
                        self.on_update(self)
                    if stop.requested:
                        status = "interrupted"
                        break
        except BaseException:
            self._checkpoint_safely()
            runlog.close()
            self.versions_file.close()
            raise
        self.checkpoint()
        self.versions_file.close()
        parts.engine.load_weights(parts.policy.state_dict(), self.learner.version)
        summary = run_summary(parts, before, evaluate(parts), history, status, time.perf_counter() - t_start)
        summary.update({"mode": "async", "updates_done": self.queue.next_ticket, "weight_pushes": self.pushes,
                        "worker_restarts": sum(self.restarts)})
        runlog.write_summary(summary)
        runlog.close()
        print_summary(summary)
        return summary

    def train_one(self) -> tuple[dict[str, float], torch.Tensor, torch.Tensor]:
        """Wait for the next ticket, make one update on it; (metrics, lags [b], spans [b])."""
        t0 = time.perf_counter()
        self.fill()
        idle = self.wait_for_next()
        depth = self.queue.depth - 1  # finished mini-batches waiting behind this one
        ticket, (batch, metrics) = self.queue.pop()
        metrics = dict(metrics)
        metrics.update(set_behavior(self.parts, [batch]))  # old_logp = the engine's log-probs
        lags = self.learner.version - batch.versions  # [b] versions the policy moved since the oldest token
        spans = batch.versions_max - batch.versions  # [b] versions one response spans (partial rollouts)
        self._record_versions(ticket, batch)
        result = self.learner.update(batch)
        if self.learner.version % self.cfg.async_.sync_every == 0 and self.learner.version > self.pushed[0]:
            self.push_weights()
        metrics.update(to_floats(result.metrics))
        metrics.update({"perf/learner_idle_s": idle, "perf/queue_depth": float(depth),
                        "perf/update_s": time.perf_counter() - t0})
        return metrics, lags, spans

    # ------------------------------------------------------------ workers and weights

    def start_workers(self) -> None:
        a = self.cfg.async_
        actor = remote_worker_class().options(max_restarts=a.max_restarts, max_task_retries=0, num_cpus=1)
        cfg_dict = to_dict(self.cfg)
        self.workers = [actor.remote(cfg_dict, self.parts.sampling, i) for i in range(a.workers)]
        self.restarts = [0] * a.workers
        self.push_weights()
        try:  # every worker built and holding weights
            ray.get([w.pid.remote() for w in self.workers], timeout=self.cfg.async_.stall_timeout_s)
        except ray.exceptions.GetTimeoutError as e:
            raise WorkerError(f"rollout workers did not start within {self.cfg.async_.stall_timeout_s:.0f}s "
                              "(async.stall_timeout_s); is the Ray cluster alive and does it have free CPUs?") from e

    def push_weights(self) -> None:
        """Put the learner's weights in the object store once; every worker fetches them."""
        state = {k: v.detach() for k, v in self.parts.policy.state_dict().items()}
        self.weights_ref = ray.put(state)
        self.pushed = (self.learner.version, self.queue.next_ticket - self.learner.version)
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
        self.stream_states[i] = self.parts.stream.state_dict()
        prompts = self.parts.producer.sample(per_mb, first_group_id=i * per_mb)
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
            if time.perf_counter() - last > self.cfg.async_.stall_timeout_s:
                raise WorkerError(f"no rollout arrived for {self.cfg.async_.stall_timeout_s:.0f}s while waiting for "
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
            index, batch, metrics = ray.get(ref)
        except RayActorError as e:
            self.restart(ticket, e)
            return
        except RayTaskError as e:
            raise WorkerError(f"rollout worker {ticket.worker} failed on ticket {ticket.index}: {e}") from e
        self.queue.put(index, (batch, metrics))

    def restart(self, failed: Ticket, error: Exception) -> None:
        """A worker process died: wait for Ray to restart it, send it weights, resubmit its tickets."""
        i = failed.worker
        self.restarts[i] += 1
        if self.restarts[i] > self.cfg.async_.max_restarts:
            raise WorkerError(f"rollout worker {i} crashed {self.restarts[i]} times (async.max_restarts="
                              f"{self.cfg.async_.max_restarts}): {error}") from error
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
        for w in self.workers:
            try:
                ray.kill(w, no_restart=True)
            except Exception as e:  # already gone, or Ray itself is going down
                console.print(f"could not kill a rollout worker: {e}")
        self.workers = []

    # ------------------------------------------------------------ metrics, records, checkpoints

    def _log_step(self, runlog: RunLog, window: list) -> dict[str, float]:
        """One metrics row per staleness.n updates, like a sync step."""
        rows = [m for m, _, _ in window]
        out = mean_of(rows)
        lags, spans = torch.cat([l for _, l, _ in window]), torch.cat([s for _, _, s in window])
        out.update(lag_stats(lags, spans, self.cfg.async_.max_staleness))
        wall = sum(m["perf/update_s"] for m in rows)
        out.update({
            "rollout/tokens": sum(m["rollout/tokens"] for m in rows),
            "optim/skipped": sum(m["optim/skipped"] for m in rows),
            "optim/grad_norm_max": max(m["optim/grad_norm"] for m in rows),
            "perf/step_s": wall,
            "perf/tokens_per_s": sum(m["rollout/tokens"] for m in rows) / max(wall, 1e-9),
            "perf/learner_idle_frac": sum(m["perf/learner_idle_s"] for m in rows) / max(wall, 1e-9),
            "perf/queue_depth_max": max(m["perf/queue_depth"] for m in rows),
            "policy/version": float(self.learner.version),
            "async/weight_pushes": float(self.pushes),
            "async/worker_restarts": float(sum(self.restarts)),
        })
        step = -(-self.queue.next_ticket // self.n)
        runlog.log(step, out)
        ce = self.cfg.run.checkpoint_every
        if ce and self.queue.next_ticket % (ce * self.n) == 0 and self.queue.next_ticket < self.total:
            self.checkpoint()
        return out

    def _open_versions_log(self, first: int, resume: bool) -> None:
        """RUN_DIR/versions.jsonl: per update, the learner version and each row's token versions."""
        path = Path(self.cfg.run.out_dir) / "versions.jsonl"
        rows = []
        if resume and path.exists():
            rows = [line for line in path.read_text().splitlines() if json.loads(line)["ticket"] < first]
        path.write_text("".join(r + "\n" for r in rows))
        self.versions_file = path.open("a")

    def _record_versions(self, ticket: int, batch) -> None:
        row = {"ticket": ticket, "learner_version": self.learner.version, "versions": batch.versions.tolist(),
               "versions_max": batch.versions_max.tolist()}
        self.versions_file.write(json.dumps(row) + "\n")
        self.versions_file.flush()

    def _eval_before(self, run_dir: Path, first: int) -> dict:
        parts = self.parts
        parts.engine.load_weights(parts.policy.state_dict(), self.learner.version)
        path = run_dir / "eval_before.json"
        if first == 0:
            before = evaluate(parts)
            path.write_text(json.dumps(before))
            return before
        return json.loads(path.read_text()) if path.exists() else {}

    def checkpoint(self) -> Path:
        """Weights, optimizer, and the prompt-stream state of the first untrained ticket, so a
        resume redraws exactly the prompts that were in flight."""
        t = self.queue.next_ticket
        stream = self.stream_states.get(t) if t < self.next_issue else self.parts.stream.state_dict()
        self.stream_states = {k: v for k, v in self.stream_states.items() if k >= t}
        state = {"step": t // self.n, "tickets": t, "learner": self.learner.state_dict(), "stream": stream}
        return save_checkpoint(self.cfg.run.out_dir, t // self.n, self.parts.policy, state, to_dict(self.cfg))

    def _checkpoint_safely(self) -> None:
        try:
            path = self.checkpoint()
            console.print(f"[yellow]run stopped; checkpoint written to {path}")
        except Exception as e:  # keep the original error in front
            console.print(f"[red]run stopped and its checkpoint failed too: {e}")

    def _resume(self) -> int:
        path = latest_checkpoint(self.cfg.run.out_dir)
        if path is None:
            raise FileNotFoundError(f"--resume: no checkpoint in {self.cfg.run.out_dir}/checkpoints")
        state = load_checkpoint(path, self.parts.policy)
        self.learner.load_state_dict(state["learner"])
        self.parts.stream.load_state_dict(state["stream"])
        tickets = int(state.get("tickets", state["step"] * self.n))
        console.print(f"resumed from {path} ({tickets} updates, policy version {self.learner.version})")
        return tickets
