"""The training loop, the same in sync and async mode: only the sample source differs.

    build  → resume → evaluate → for each mini-batch from the source: update, log, checkpoint
           → evaluate → policy directory → summary

    source   LocalSource (sync: one rollout batch becomes N mini-batches at one policy version) or
             RaySource (async: rollout workers, admission control, weight pushes every K updates)
    learner  a Learner in this process, or the same behind a Ray actor (async.learner=actor)

A *rollout step* is N = staleness.n updates: one metrics row, the unit of run.steps, checkpoints,
evaluation and sample logs. Checkpoints fall between rollout steps (a sync source has sampled
nothing untrained there); resuming one continues bit for bit in sync mode.

    from vespo.config import load_config
    from vespo.trainer import train
    summary = train(load_config("configs/demo.yaml", ["staleness.n=8"]))
"""

from __future__ import annotations

import json
import math
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Callable


from vespo.buffer import lag_stats
from vespo.config import Config, to_dict
from vespo.evaluation import heldout_rewards
from vespo.metrics import reduce_metrics
from vespo.trainer.checkpoint import latest_checkpoint
from vespo.trainer.runlog import GracefulInterrupt, RunLog, check_new_run_dir, console, progress_bar, write_atomic
from vespo.trainer.run import Run, build_run
from vespo.trainer.remote import build_learner
from vespo.trainer.sources import SampleSource, TrainItem, build_source

UpdateHook = Callable[["Loop"], None]


def train(cfg: Config, resume: bool = False, on_update: UpdateHook | None = None) -> dict:
    """Run (or resume) a training run in the mode the config asks for; returns the run summary.

    ``on_update(loop)`` is called after every update (tests use it to kill a worker or send Ctrl-C)."""
    if not resume:
        check_new_run_dir(cfg)  # before the model is built and warm-started
    with ExitStack() as stack:
        run = stack.enter_context(build_run(cfg, log=console.print))
        if cfg.run.mode == "async":
            from vespo.trainer.ray_source import ray_session

            stack.enter_context(ray_session(cfg.async_))
        learner = build_learner(run)
        stack.callback(learner.close)
        source = build_source(run, learner)
        stack.callback(source.close)
        return Loop(run, learner, source, on_update).fit(resume)


class Loop:
    def __init__(self, run: Run, learner, source: SampleSource, on_update: UpdateHook | None = None):
        self.run, self.cfg, self.learner, self.source = run, run.cfg, learner, source
        self.on_update = on_update
        self.n = self.cfg.staleness.n
        self.total = self.cfg.total_updates
        self.updates_done = 0
        self.checkpointed_at = -1  # updates done at the last checkpoint
        self.history: list[dict[str, float]] = []

    # ------------------------------------------------------------ the run

    def fit(self, resume: bool) -> dict:
        first = self._resume() if resume else 0
        runlog = RunLog(self.cfg, resume_step=first // self.n if resume else None)
        self.updates_done = first
        self.source.start(first)
        before = self._eval_before(runlog, first)
        console.print(f"run directory {runlog.dir}: metrics.jsonl, samples.jsonl"
                      + (f" (every {self.cfg.run.log_samples_every} steps)" if self.cfg.run.log_samples_every else "")
                      + ", tb/, checkpoints/, policy/ at the end")
        t_start = time.perf_counter()
        try:
            status = self.train_steps(runlog)
        except BaseException:
            self._checkpoint_safely()
            runlog.close()
            raise
        after = self.evaluate()
        self.learner.save_policy(runlog.dir, self.run.tokenizer, to_dict(self.cfg))
        summary = self.summary(before, after, status, time.perf_counter() - t_start)
        runlog.write_summary(summary)
        runlog.close()
        print_summary(summary)
        return summary

    def train_steps(self, runlog: RunLog) -> str:
        """Updates until the run is done ("done") or Ctrl-C stops it at a rollout step ("interrupted")."""
        with GracefulInterrupt() as stop, progress_bar(self.cfg.run.progress) as bar:
            task = bar.add_task(self.cfg.loss.name, total=self.cfg.run.steps, completed=self.updates_done // self.n,
                                status="")
            window, t_step = [], time.perf_counter()
            while self.updates_done < self.total:
                item, metrics = self.train_one()
                window.append(metrics)
                if self.updates_done % self.n:
                    continue
                row = self.end_step(runlog, window, item, time.perf_counter() - t_step)
                bar.update(task, advance=1, status=f"reward {row.get('reward/mean', float('nan')):.3f}")
                window, t_step = [], time.perf_counter()
                if stop.requested:
                    if self.checkpointed_at != self.updates_done:
                        self.checkpoint()
                    return "interrupted"
        return "done"

    def train_one(self) -> tuple[TrainItem, dict[str, float]]:
        """One mini-batch from the source, one update; that update's metrics."""
        t0 = time.perf_counter()
        item = self.source.next()
        batch = item.batch
        lags = self.learner.version - batch.versions  # [b] versions the policy moved since the oldest token
        spans = batch.versions_max - batch.versions  # [b] versions one response spans (partial rollouts)
        result = self.learner.update(batch, behavior_pass=item.behavior_pass)
        self.updates_done += 1
        self.source.after_update(self.learner.version)
        item.lags, item.log_w, item.weight = lags, result.log_w, result.weight
        metrics = {**item.metrics, **result.metrics, **lag_stats(lags, spans, self.source.max_lag),
                   "perf/update_s_sum": time.perf_counter() - t0}
        if self.on_update is not None:
            self.on_update(self)
        return item, metrics

    def end_step(self, runlog: RunLog, window: list[dict[str, float]], last: TrainItem, seconds: float) -> dict:
        """Reduce the step's metrics once, log them (and samples), evaluate and checkpoint on schedule."""
        step = self.updates_done // self.n
        row = reduce_metrics(window)
        tokens = row.get("rollout/n_tokens", 0.0)
        row.update({"policy/version": float(self.learner.version), "perf/step_s": seconds,
                    "perf/tokens_per_s": tokens / max(seconds, 1e-9)})
        if "perf/learner_idle_s_sum" in row:
            row["perf/learner_idle_frac"] = row["perf/learner_idle_s_sum"] / max(seconds, 1e-9)
        row.update(getattr(self.source, "step_metrics", dict)())
        run = self.cfg.run
        if (run.eval_every and step % run.eval_every == 0) or (
                run.eval_every_updates and self.updates_done % run.eval_every_updates == 0):
            row.update({f"eval/{k}": v for k, v in self.evaluate(run.eval_every_size).items()})
        runlog.log(step, row)
        if run.log_samples_every and step % run.log_samples_every == 0:
            runlog.log_samples(step, sample_rows(self.run, last, run.samples_per_log))
        self.history.append(row)
        if (run.checkpoint_every and step % run.checkpoint_every == 0) or self.updates_done == self.total:
            self.checkpoint()
        if run.save_policy_every and step % run.save_policy_every == 0:
            self.learner.save_policy(runlog.dir, self.run.tokenizer, to_dict(self.cfg))
        return row

    # ------------------------------------------------------------ evaluation, checkpoints

    def evaluate(self, size: int = 0) -> dict[str, float]:
        """Held-out reward with the newest weights: one sample per problem, and greedy (on the first
        ``size`` held-out problems; 0: all)."""
        problems = self.run.eval_problems[:size] if size else self.run.eval_problems
        return heldout_rewards(self.source.generate, problems, self.run.scorer, self.run.sampling)

    def _eval_before(self, runlog: RunLog, first: int) -> dict:
        path = runlog.dir / "eval_before.json"
        if first == 0 or not path.exists():
            before = self.evaluate() if first == 0 else {}
            write_atomic(path, json.dumps(before))
            return before
        return json.loads(path.read_text())

    def checkpoint(self) -> Path:
        extra = {"step": self.updates_done // self.n, "updates": self.updates_done,
                 "source": self.source.state_dict()}
        path = self.learner.save_checkpoint(self.cfg.run.out_dir, self.updates_done // self.n, extra,
                                            to_dict(self.cfg))
        self.checkpointed_at = self.updates_done
        return path

    def _checkpoint_safely(self) -> None:
        """On an error or abort: a checkpoint, where the source can describe the run (the local source
        between rollout steps; the Ray source after any update, by its tickets)."""
        if not self.source.checkpointable() or self.checkpointed_at == self.updates_done:
            return
        try:
            path = self.checkpoint()
            console.print(f"[yellow]run stopped; checkpoint written to {path}")
        except Exception as e:  # keep the original error in front
            console.print(f"[red]run stopped and its checkpoint failed too: {e}")

    def _resume(self) -> int:
        path = latest_checkpoint(self.cfg.run.out_dir)
        if path is None:
            console.print(f"--resume: no checkpoint in {self.cfg.run.out_dir}/checkpoints yet; "
                          "starting the run from the beginning")
            return 0
        state = self.learner.load_checkpoint(path)
        self.source.load_state_dict(state["source"])
        updates = int(state["updates"])
        console.print(f"resumed from {path} ({updates} updates, policy version {self.learner.version})")
        return updates

    def summary(self, before: dict, after: dict, status: str, seconds: float) -> dict:
        rewards = [h["reward/mean"] for h in self.history if "reward/mean" in h]
        tail = rewards[-max(1, len(rewards) // 5):] if rewards else []
        cfg = self.cfg
        return {
            "status": status,
            "mode": cfg.run.mode,
            "run_dir": str(Path(cfg.run.out_dir).resolve()),
            "loss": cfg.loss.name,
            "staleness_n": cfg.staleness.n,
            "steps_done": self.updates_done // self.n,
            "updates_done": self.updates_done,
            "policy_version": self.learner.version,
            "eval_before": before,
            "eval_after": after,
            "train_reward_first": rewards[0] if rewards else None,
            "train_reward_final": sum(tail) / len(tail) if tail else None,
            "skipped_updates": self.learner.nonfinite_total,
            "warmstart": self.run.warmstart,
            "seconds": seconds,
            **self.source.summary(),
        }


def sample_rows(run: Run, item: TrainItem, n: int) -> list[dict]:
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
            "lag": int(item.lags[i]),
            "log_w": float(item.log_w[i]),
            "weight": _finite_or_none(float(item.weight[i])),
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
                  f"; trained policy: {Path(summary['run_dir']) / 'policy'}")


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.3f}"
