"""The training loop, the same in sync and async mode: only the sample source differs.

    build  → resume → evaluate → for each mini-batch from the source: update, log, checkpoint
           → evaluate → policy directory → summary

    source   LocalSource (sync: one rollout batch becomes N mini-batches at one policy version) or
             RaySource (async: rollout workers, admission control, weight pushes every K updates)
    learner  a Learner in this process, or the same behind a Ray actor (async.learner=actor); the one
             owner of μ: the loop hands it each batch of items (``prepare``) before training them

A *rollout step* is N = staleness.n updates: one metrics row, the unit of run.steps, checkpoints,
evaluation and sample logs. Scheduled checkpoints fall between rollout steps; resuming one continues
bit for bit in sync mode. A run stopped by an error or an abort checkpoints where its source can
describe it (``SampleSource.checkpointable()``): the local source between rollout steps only, the Ray
source after any update (by its tickets), so a failed async run's checkpoint may fall inside a step. A step's row holds the
rollout and engine-mismatch statistics of all its samples (formed from their rows), the loss
diagnostics of each update combined by name (vespo.metrics.reduction), the lag histogram
of every row trained in it and the lag of its tokens (vespo.buffer.token_lag_stats).

    from vespo.config import load_config
    from vespo.trainer import train
    summary = train(load_config("configs/demo.yaml", ["staleness.n=8"]))
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from vespo.buffer import lag_stats, token_lag_rows, token_lag_stats
from vespo.config import Config, check_rules, to_dict
from vespo.errors import DiskFullError
from vespo.evaluation import heldout_rewards
from vespo.losses import concat_rows
from vespo.metrics import reduce_metrics, summarize_behavior, summarize_rollout
from vespo.rundir import CHECKPOINTS, EVAL_BEFORE, METRICS, POLICY, SAMPLES, TB, Stop, write_atomic
from vespo.trainer.checkpoint import check_resume_config, resume_point
from vespo.trainer.distributed import Dist
from vespo.trainer.learner import NonFiniteError
from vespo.trainer.protocols import Learner, Rows, SampleSource, TrainItem, UpdateResult
from vespo.trainer.remote import build_learner
from vespo.trainer.run import Run, build_run, check_installed
from vespo.trainer.runlog import (GracefulInterrupt, RunLog, check_new_run_dir, console, hold_run_dir, plain_every,
                                  progress_bar, step_line)
from vespo.trainer.sources import LocalSource
from vespo.trainer.warmstart import applies, check_start, on_policy_config, warmstart_cache_path

UpdateHook = Callable[["Loop"], None]
StopRule = Callable[[dict], bool]  # a metrics row with a held-out evaluation -> stop the run here


def train(cfg: Config, resume: bool = False, on_update: UpdateHook | None = None,
          until: StopRule | None = None) -> dict:
    """Run (or resume) a training run in the mode the config asks for; returns the run summary.

    Under torchrun (``vespo train --nproc P``) every rank runs this: the learner is sharded over the
    P processes and each rolls out its share of every rollout batch (vespo.trainer.distributed).
    ``on_update(loop)`` is called after every update (tests use it to kill a worker or send Ctrl-C);
    ``until(row)``, asked of every metrics row with a held-out evaluation, ends the run early when true."""
    from vespo.models.device import resolve_device
    from vespo.trainer.distributed import init_distributed, local_device, shutdown

    dist = init_distributed(local_device(resolve_device(cfg.model.device)))
    check_installed(cfg)
    if not resume:
        check_new_run_dir(cfg)  # before the model is built and warm-started
    if dist.active:
        check_rules(cfg, dist.world, torchrun=True)
    with ExitStack() as stack:
        if dist.is_main:  # one run per directory: a second process on it stops here, having changed nothing
            stack.enter_context(hold_run_dir(cfg.run.out_dir))
        checkpoint = resume_checkpoint(cfg, dist) if resume else None  # refused here, before anything is built
        if applies(cfg) and cfg.warmstart.kind == "on_policy":
            make_on_policy_start(cfg)
            check_start(cfg)  # not from a start on the floor (warmstart.min_accuracy)
        stack.push(lambda exc_type, exc, tb: shutdown(dist, clean=exc_type is None))
        run = stack.enter_context(build_run_in_turn(cfg, dist))
        if cfg.run.mode == "async":
            from vespo.trainer.ray_source import ray_session

            stack.enter_context(ray_session(cfg.async_))
        engine = run.make_engine(run.policy) if cfg.run.mode == "sync" else None  # its copy, before sharding
        learner = build_learner(run, dist)
        stack.callback(learner.close)
        source = build_source(run, learner, dist, engine)
        stack.callback(source.close)
        return Loop(run, learner, source, on_update, dist, until).fit(resume, checkpoint)


def resume_checkpoint(cfg: Config, dist: Dist) -> Path | None:
    """The checkpoint --resume continues from (None: the directory holds no run yet, which starts afresh); a run
    with no checkpoint that verifies, or a config that trains something else, is refused."""
    say = console.print if dist.is_main else _quiet
    path, note = resume_point(cfg.run.out_dir)
    if note:
        say(note, markup=False)
    if path is None:
        say(f"--resume: no checkpoint in {cfg.run.out_dir}/checkpoints yet; starting the run from the beginning")
        return None
    check_resume_config(path, to_dict(cfg))
    return path


def make_on_policy_start(cfg: Config) -> None:
    """The seed's on-policy start (vespo.trainer.warmstart), trained once as a run of its own into the cache; a
    second process wanting the same start waits for the first (a file lock), then reads it."""
    import fcntl
    import shutil

    marker = warmstart_cache_path(cfg)
    if marker.is_file():
        return
    marker.parent.mkdir(parents=True, exist_ok=True)
    with open(marker.parent / "start.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or when this process dies
        if marker.is_file():
            return
        sub, target = on_policy_config(cfg), cfg.warmstart.target_accuracy
        shutil.rmtree(sub.run.out_dir, ignore_errors=True)  # a start killed part-way runs again
        console.print(f"on-policy start of seed {cfg.run.seed}: up to {sub.total_updates} updates of VESPO at N = 1"
                      + (f" until held-out sampled accuracy >= {target:g}" if target > 0 else "")
                      + f", cached in {marker.parent}")
        summary = train(sub, until=(lambda row: row["eval/reward_sampled"] >= target) if target > 0 else None)
        shutil.rmtree(Path(sub.run.out_dir) / CHECKPOINTS, ignore_errors=True)  # the policy/ directory is kept
        record = {"updates": summary["updates_done"], "eval": summary["eval_after"],
                  "target_reached": bool(summary.get("target_reached", target == 0)), "seconds": summary["seconds"]}
        write_atomic(marker, json.dumps(record, indent=2))


def build_run_in_turn(cfg: Config, dist: Dist) -> Run:
    """The run's parts on every rank; rank 0 first, so the others load its cached warm start."""
    if not dist.is_main:
        dist.barrier()
    run = build_run(cfg, log=console.print if dist.is_main else _quiet)
    if dist.is_main:
        dist.barrier()
    return run


def _quiet(*args, **kwargs) -> None:
    pass


def build_source(run: Run, learner: Learner, dist: Dist | None = None, engine=None) -> SampleSource:
    """The sample source of run.mode: LocalSource (sync; with ``engine``, else one built from run.policy) or
    RaySource (async; Ray must be running)."""
    if run.cfg.run.mode == "async":
        from vespo.trainer.ray_source import RaySource

        return RaySource(run, learner)
    return LocalSource(run, learner, dist, engine)


@dataclass
class StepWindow:
    """What the updates of one rollout step produced, reduced into its metrics row at the step's end."""

    updates: list[dict[str, float]] = field(default_factory=list)  # each update's metrics and timings
    rollout: list[Rows] = field(default_factory=list)  # rollout rows of the samples drawn in the step
    behavior: list[Rows] = field(default_factory=list)  # engine-vs-trainer rows of its behaviour passes
    lags: list[torch.Tensor] = field(default_factory=list)  # [b] per update
    spans: list[torch.Tensor] = field(default_factory=list)  # [b] per update: versions one response spans
    tokens: list[Rows] = field(default_factory=list)  # per update: token_lag_rows of its rows
    last: tuple[TrainItem, UpdateResult] | None = None

    def add_items(self, items: list[TrainItem], behavior: Rows) -> None:
        self.rollout += [item.rollout_rows for item in items]
        self.updates += [item.perf for item in items if item.perf]
        self.behavior.append(behavior)

    def add_update(self, item: TrainItem, result: UpdateResult, seconds: float) -> None:
        self.updates.append({**result.metrics, "perf/update_s_sum": seconds})
        self.behavior.append(result.behavior_rows)
        self.lags.append(result.lags)
        self.spans.append(item.batch.versions_max - item.batch.versions)
        self.tokens.append(token_lag_rows(item.batch, result.lags))
        self.last = (item, result)

    def metrics(self, max_lag: int, dist: Dist | None = None) -> dict[str, float]:
        """The step's row: per-update metrics combined by name, and the rollout, behaviour and lag statistics
        of every row of the step (gathered from every rank)."""
        dist = dist or Dist.single()
        lags = dist.gather_rows({"lag": torch.cat(self.lags), "span": torch.cat(self.spans)})
        return {**reduce_metrics(self.updates), **summarize_rollout(dist.gather_rows(concat_rows(self.rollout))),
                **summarize_behavior(dist.gather_rows(concat_rows(self.behavior))),
                **lag_stats(lags["lag"], lags["span"], max_lag),
                **token_lag_stats(dist.gather_rows(concat_rows(self.tokens)))}


class Loop:
    def __init__(self, run: Run, learner: Learner, source: SampleSource, on_update: UpdateHook | None = None,
                 dist: Dist | None = None, until: StopRule | None = None):
        self.run, self.cfg, self.learner, self.source = run, run.cfg, learner, source
        self.on_update, self.until = on_update, until
        self.target_reached = False
        self.dist = dist or Dist.single()
        self.schedule = run.schedule
        self.updates_done = 0
        self.checkpointed_at = -1  # updates done at the last checkpoint
        self.pending: list[TrainItem] = []  # items handed over by the source and not yet trained
        self.history: list[dict[str, float]] = []
        self.seconds_before = 0.0  # training wall seconds of the processes before a resume, to their checkpoint
        self.t_start = time.perf_counter()

    # ------------------------------------------------------------ the run

    @property
    def step(self) -> int:
        """Rollout steps done: every N = staleness.n updates are one (a metrics row, the unit of run.steps)."""
        return self.schedule.step(self.updates_done)

    @property
    def at_step_end(self) -> bool:
        """The updates done end a rollout step (its row is due)."""
        return self.schedule.ends_step(self.updates_done)

    def fit(self, resume: bool, checkpoint: Path | None = None) -> dict:
        """Train the run (from ``checkpoint`` when given; ``resume`` without one: a run directory that holds no
        run yet) to its end, or until Ctrl-C or ``until`` stops it."""
        first = self._resume(checkpoint) if checkpoint is not None else 0
        runlog = RunLog(self.cfg, resume_step=self.schedule.step(first) if resume else None, writes=self.dist.is_main)
        self.updates_done = first
        self.source.start(first)
        before = self._eval_before(runlog, first)
        self._say(f"run directory {runlog.dir}: {METRICS}, {SAMPLES}"
                  + (f" (every {self.cfg.run.log_samples_every} steps)" if self.cfg.run.log_samples_every else "")
                  + f", {TB}/, {CHECKPOINTS}/, {POLICY}/ at the end"
                  + (f"; {self.dist.world} ranks" if self.dist.active else ""))
        self.t_start = time.perf_counter()
        try:
            status = self.train_steps(runlog)
        except KeyboardInterrupt:  # a second Ctrl-C: no evaluation, the summary says where the run stopped
            self._checkpoint_safely()
            self._stopped(runlog, before, Stop.INTERRUPTED)
            raise
        except DiskFullError:  # a checkpoint or a metrics row found no room: the last checkpoint stands, none is tried
            runlog.close()
            raise
        except NonFiniteError:  # the learner's guard: the summary says why the run stopped
            self._checkpoint_safely()
            self._stopped(runlog, before, Stop.NON_FINITE)
            raise
        except BaseException:
            self._checkpoint_safely()
            runlog.close()
            raise
        after = self.evaluate(label="after RL")
        self.learner.save_policy(runlog.dir, self.run.tokenizer, to_dict(self.cfg))
        summary = self.summary(before, after, status)
        runlog.write_summary(summary)
        runlog.close()
        if self.dist.is_main:
            print_summary(summary)
        return summary

    def _stopped(self, runlog: RunLog, before: dict, status: str) -> None:
        """The summary of a run an exception stops (no evaluation after it), and the sinks closed."""
        with contextlib.suppress(Exception):  # the summary is a courtesy: the exception stays in front
            runlog.write_summary(self.summary(before, {}, status))
        runlog.close()

    def _say(self, text: str) -> None:
        if self.dist.is_main:
            console.print(text)

    def train_steps(self, runlog: RunLog) -> str:
        """Updates until the run is done (Stop.DONE) or Ctrl-C stops it at a rollout step (Stop.INTERRUPTED)."""
        shown = self.cfg.run.progress and self.dist.is_main
        plain = shown and not console.is_terminal  # a log file: plain lines instead of a bar
        with GracefulInterrupt() as stop, progress_bar(shown and not plain) as bar:
            task = bar.add_task(self.cfg.loss.name, total=self.schedule.steps, completed=self.step, status="")
            window, t_step = StepWindow(), time.perf_counter()
            while self.updates_done < self.schedule.total:
                self.train_one(window)
                if not self.at_step_end:
                    continue
                row = self.end_step(runlog, window, time.perf_counter() - t_step)
                bar.update(task, advance=1, status=f"reward {row.get('reward/mean', float('nan')):.3f}")
                step = self.step
                steps = self.schedule.steps
                if plain and (step % plain_every(steps) == 0 or step == steps):
                    console.print(step_line(step, steps, row), markup=False, highlight=False)
                window, t_step = StepWindow(), time.perf_counter()
                if self.until is not None and "eval/reward_sampled" in row and self.until(row):
                    self.target_reached = True
                    return Stop.DONE
                if self.dist.any(stop.requested):  # every rank stops at the same step
                    if self.checkpointed_at != self.updates_done:
                        self.checkpoint()
                    return Stop.INTERRUPTED
        return Stop.DONE

    def train_one(self, window: StepWindow) -> None:
        """One update on the next item (asking the source for more, and the learner to prepare them, first)."""
        t0 = time.perf_counter()
        if not self.pending:
            self.pending = self.source.next()
            window.add_items(self.pending, self.learner.prepare(self.pending))
        item = self.pending.pop(0)
        result = self.learner.update(item)
        self.updates_done += 1
        self.source.after_update(self.learner.version)
        window.add_update(item, result, time.perf_counter() - t0)
        if self.on_update is not None:
            self.on_update(self)

    def end_step(self, runlog: RunLog, window: StepWindow, seconds: float) -> dict:
        """Reduce the step's metrics once, log them (and samples), evaluate and checkpoint on schedule."""
        step = self.step
        row = window.metrics(self.schedule.max_lag, self.dist)
        tokens = row.get("rollout/n_tokens", 0.0)
        row.update({"policy/version": float(self.learner.version), "perf/step_s": seconds,
                    "perf/tokens_per_s": tokens / max(seconds, 1e-9)})
        if "perf/learner_idle_s_sum" in row:
            row["perf/learner_idle_frac"] = row["perf/learner_idle_s_sum"] / max(seconds, 1e-9)
        row.update(self.source.step_metrics())
        row["dist/world_size"] = float(self.learner.world_size)
        if step == 1:  # once, when the optimizer state exists: what one rank holds
            row.update(self.learner.memory())
        run = self.cfg.run
        if (run.eval_every and step % run.eval_every == 0) or (
                run.eval_every_updates and self.updates_done % run.eval_every_updates == 0):
            row.update({f"eval/{k}": v for k, v in self.evaluate(run.eval_every_size).items()})
        runlog.log(step, row)
        if run.log_samples_every and step % run.log_samples_every == 0 and window.last is not None:
            runlog.log_samples(step, sample_rows(self.run, *window.last, run.samples_per_log))
        self.history.append(row)
        if (run.checkpoint_every and step % run.checkpoint_every == 0) or self.updates_done == self.schedule.total:
            self.checkpoint()
        if run.save_policy_every and step % run.save_policy_every == 0:
            self.learner.save_policy(runlog.dir, self.run.tokenizer, to_dict(self.cfg))
        return row

    # ------------------------------------------------------------ evaluation, checkpoints

    def evaluate(self, size: int = 0, label: str = "") -> dict[str, float]:
        """Held-out reward with the newest weights: one sample per problem, and greedy, on the first ``size``
        held-out problems (0: all). Each rank evaluates its share; every rank gets the mean over all of them.
        With a ``label`` (before RL, after RL) it says so when it starts and what it found."""
        problems = self.run.eval_problems[:size] if size else self.run.eval_problems
        if label:
            self._say(f"held-out evaluation {label}: {len(problems)} problems, one sample and greedy ...")
        t0 = time.perf_counter()
        mine = problems[self.dist.rank::self.dist.world]
        means = heldout_rewards(self.source.generate, mine, self.run.scorer, self.run.sampling)
        parts = [(m, n) for m, n in self.dist.gather_object((means, len(mine))) if n]
        total = sum(n for _, n in parts)
        result = {key: sum(m[key] * n for m, n in parts) / total for key in (parts[0][0] if parts else {})}
        if label and result:
            self._say(f"held-out evaluation {label}: sampled {result['reward_sampled']:.3f}, greedy "
                      f"{result['reward_greedy']:.3f} ({time.perf_counter() - t0:.0f}s)")
        return result

    def _eval_before(self, runlog: RunLog, first: int) -> dict:
        path = runlog.dir / EVAL_BEFORE
        if first == 0 or not path.exists():
            # a shared on-policy start's evaluation is of these weights on these problems: not made again
            before = (self.run.start_eval or self.evaluate(label="before RL")) if first == 0 else {}
            if self.dist.is_main:
                write_atomic(path, json.dumps(before))
            return before
        return json.loads(path.read_text())

    def checkpoint(self) -> Path:
        extra = {"step": self.step, "updates": self.updates_done,
                 "source": self.source.state_dict(), "seconds": self.seconds()}
        path = self.learner.save_checkpoint(self.cfg.run.out_dir, self.step, extra,
                                            to_dict(self.cfg))
        self.checkpointed_at = self.updates_done
        return path

    def _checkpoint_safely(self) -> None:
        """On an error or abort: a checkpoint, where the source can describe the run (the local source
        between rollout steps; the Ray source after any update, by its tickets)."""
        if (self.pending and not self.source.checkpointable()) or self.checkpointed_at == self.updates_done:
            return
        try:
            path = self.checkpoint()
            self._say(f"[yellow]run stopped; checkpoint written to {path}")
        except Exception as e:  # keep the original error in front
            self._say(f"[red]run stopped and its checkpoint failed too: {e}")

    def _resume(self, path: Path) -> int:
        state = self.learner.load_checkpoint(path)
        self.source.load_state_dict(state["source"])
        updates = int(state["updates"])
        self.seconds_before = float(state.get("seconds", 0.0))  # absent in checkpoints written before it was kept
        self._say(f"resumed from {path} ({updates} updates, policy version {self.learner.version})")
        return updates

    def seconds(self) -> float:
        """Training wall seconds of the run so far: this process's, and those of the processes it resumed
        from, each up to the checkpoint the next one resumed from."""
        return self.seconds_before + time.perf_counter() - self.t_start

    def summary(self, before: dict, after: dict, status: str) -> dict:
        rewards = [h["reward/mean"] for h in self.history if "reward/mean" in h]
        tail = rewards[-max(1, len(rewards) // 5):] if rewards else []
        cfg = self.cfg
        return {
            "status": status,
            "mode": cfg.run.mode,
            "run_dir": str(Path(cfg.run.out_dir).resolve()),
            "loss": cfg.loss.name,
            "staleness_n": self.schedule.n,
            "steps_done": self.step,
            "updates_done": self.updates_done,
            "policy_version": self.learner.version,
            "eval_before": before,
            "eval_after": after,
            "train_reward_first": rewards[0] if rewards else None,
            "train_reward_final": sum(tail) / len(tail) if tail else None,
            "skipped_updates": self.learner.nonfinite_total,
            "warmstart": self.run.warmstart,
            "seconds": self.seconds(),
            "seconds_before_resume": self.seconds_before,
            **self.source.summary(),
            **({"target_reached": self.target_reached} if self.until is not None else {}),
        }


def sample_rows(run: Run, item: TrainItem, result: UpdateResult, n: int) -> list[dict]:
    """A few rows of one mini-batch as a user reads them: prompt, completion, reward, advantage, lag, log W,
    and the loss's weight on the row (VESPO: phi(W); None where the advantage is 0)."""
    from vespo.rollout.text import decode_responses

    b = item.batch
    rows = []
    texts = decode_responses(run.tokenizer, b)
    for i in range(min(n, len(b))):
        prompt_ids = b.prompt_ids[i][b.prompt_mask[i] > 0].tolist()
        rows.append({
            "prompt": run.tokenizer.decode(prompt_ids, skip_special_tokens=True),
            "completion": texts[i],
            "reward": float(b.rewards[i]),
            "advantage": float(b.advantages[i]),
            "lag": int(result.lags[i]),
            "log_w": float(result.log_w[i]),
            "weight": _finite_or_none(float(result.weight[i])),
            "truncated": bool(b.truncated[i]),
        })
    return rows


def _finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None


def print_summary(summary: dict) -> None:
    from rich.table import Table

    table = Table(title=f"vespo run: {summary['loss']}, N = {summary['staleness_n']} ({summary['status']})")
    table.add_column("")
    table.add_column("before RL", justify="right")
    table.add_column("after RL", justify="right")
    for key in ("reward_sampled", "reward_greedy"):
        b, a = summary["eval_before"].get(key), summary["eval_after"].get(key)
        table.add_row(f"held-out {key.replace('_', ' ')}", _fmt(b), _fmt(a))
    table.add_row("training reward (first / last 20%)", _fmt(summary["train_reward_first"]),
                  _fmt(summary["train_reward_final"]))
    console.print(table)
    console.print(f"{summary['steps_done']} steps, {summary['policy_version']} updates, "
                  f"{summary['skipped_updates']} skipped, {summary['seconds']:.0f}s; run directory: {summary['run_dir']}"
                  f"; trained policy: {Path(summary['run_dir']) / POLICY}")


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.3f}"
