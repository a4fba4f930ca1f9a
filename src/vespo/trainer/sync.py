"""The synchronous trainer: each step samples one rollout batch and makes N stale updates on it.

    step k:  gbs prompts x G responses at policy version v      (rollout, reward, advantage)
             μ = the trainer's log-probs of the version-v weights (recompute), or the engine's (rollout)
             split into N mini-batches; mini-batch j is trained at version v + j  (lag j)
             push the new weights to the engine

Run it with `vespo train --config configs/demo.yaml` (see vespo.trainer.cli).
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import torch

from vespo.buffer import split_minibatches
from vespo.config import Config, to_dict
from vespo.metrics import masked_mean, mean_of, mismatch_metrics, to_floats
from vespo.trainer.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from vespo.trainer.runlog import GracefulInterrupt, RunLog, console, progress_bar
from vespo.trainer.setup import Parts, build
from vespo.types import TrainBatch


def train(cfg: Config, resume: bool = False) -> dict:
    """Run (or resume) a synchronous training run; returns the summary written to summary.json."""
    torch.manual_seed(cfg.run.seed)
    parts = build(cfg, log=console.print)
    try:
        return _train(parts, resume)
    finally:
        parts.close()


def _train(parts: Parts, resume: bool) -> dict:
    cfg, learner = parts.cfg, parts.learner
    start = _resume(parts) if resume else 0
    runlog = RunLog(cfg, resume_step=start if resume else None)
    parts.engine.load_weights(parts.policy.state_dict(), learner.version)
    before_path = runlog.dir / "eval_before.json"
    if start == 0:
        before = evaluate(parts)
        before_path.write_text(json.dumps(before))
    else:
        before = json.loads(before_path.read_text()) if before_path.exists() else {}
    t_start, history = time.perf_counter(), []
    status = "done"
    try:
        with GracefulInterrupt() as stop, progress_bar(cfg.run.progress) as bar:
            task_id = bar.add_task(cfg.loss.name, total=cfg.run.steps, completed=start, status="")
            for step in range(start, cfg.run.steps):
                metrics = train_step(parts, step)
                if cfg.run.eval_every and (step + 1) % cfg.run.eval_every == 0:
                    metrics.update({f"eval/{k}": v for k, v in evaluate(parts).items()})
                runlog.log(step + 1, metrics)
                history.append(metrics)
                bar.update(task_id, advance=1, status=f"reward {metrics['reward/mean']:.3f}")
                last = step + 1 == cfg.run.steps
                if stop.requested or last or (cfg.run.checkpoint_every and (step + 1) % cfg.run.checkpoint_every == 0):
                    checkpoint(parts, step + 1)
                if stop.requested:
                    status = "interrupted"
                    break
    except BaseException:
        runlog.close()
        raise
    after = evaluate(parts)
    summary = run_summary(parts, before, after, history, status, time.perf_counter() - t_start)
    runlog.write_summary(summary)
    runlog.close()
    print_summary(summary)
    return summary


# ---------------------------------------------------------------- one step


def train_step(parts: Parts, step: int) -> dict[str, float]:
    """Rollout, behavior log-probs, N stale updates, weight push. Returns the step's metrics."""
    cfg, learner = parts.cfg, parts.learner
    t0 = time.perf_counter()
    batch, metrics = parts.producer.produce(cfg.rollout.prompts_per_step, seed=step_seed(cfg, step, 1),
                                            first_group_id=step * cfg.rollout.prompts_per_step)
    gen = torch.Generator().manual_seed(step_seed(cfg, step, 2)) if cfg.staleness.shuffle else None
    minibatches = split_minibatches(batch, cfg.staleness.n, gen)
    # mini-batch 0 is trained at lag 0, on the weights μ is defined by: its update's forward is μ
    shared = learner.shares_behavior_forward(cfg.rollout.router_replay)
    behavior = behavior_per_minibatch(parts, minibatches[1:] if shared else minibatches)  # before any update
    updates = []
    for j, mb in enumerate(minibatches):
        lag = (learner.version - mb.versions).float()  # [b] versions the policy moved since sampling
        own = shared and j == 0
        if own and cfg.staleness.behavior == "rollout":
            mb.old_logp = mb.rollout_logp
        result = learner.update(mb, own_behavior=own and mb.old_logp is None, report_logp=own)
        if own:
            behavior.append(behavior_metrics(mb, result.logp, result.entropy))
        updates.append(to_floats({**result.metrics, "staleness/lag_mean": lag.mean(), "staleness/lag_max": lag.max()}))
    metrics.update(mean_of(behavior))
    metrics.update(mean_of(updates))
    metrics["staleness/lag_max"] = max(u["staleness/lag_max"] for u in updates)
    metrics["optim/skipped"] = sum(u["optim/skipped"] for u in updates)
    metrics["optim/grad_norm_max"] = max(u["optim/grad_norm"] for u in updates)
    metrics["policy/version"] = float(learner.version)
    parts.engine.load_weights(parts.policy.state_dict(), learner.version)
    elapsed = time.perf_counter() - t0
    metrics.update({"perf/step_s": elapsed, "perf/tokens_per_s": metrics["rollout/tokens"] / elapsed})
    return metrics


def set_behavior(parts: Parts, minibatches: list[TrainBatch]) -> dict[str, float]:
    """Set each mini-batch's old_logp (μ) and measure the engine-vs-trainer mismatch (mean over them)."""
    return mean_of(behavior_per_minibatch(parts, minibatches))


def behavior_per_minibatch(parts: Parts, minibatches: list[TrainBatch]) -> list[dict[str, float]]:
    """Set each mini-batch's old_logp (μ); returns each one's engine-vs-trainer mismatch metrics.

    The trainer's log-probs are computed on exactly the micro-batches the update will use, so
    with N = 1 the first update sees W == 1 bit for bit; router replay as rollout.router_replay says.
    """
    learner, behavior = parts.learner, parts.cfg.staleness.behavior
    stats = []
    for mb in minibatches:
        logp, ent = learner.behavior_logp(mb, parts.cfg.rollout.router_replay)  # [b, T] each
        mb.old_logp = logp if behavior == "recompute" else mb.rollout_logp
        stats.append(behavior_metrics(mb, logp, ent))
    return stats


def behavior_metrics(mb: TrainBatch, logp: torch.Tensor, entropy: torch.Tensor) -> dict[str, float]:
    """Engine-vs-trainer mismatch and the policy's entropy on one mini-batch's responses."""
    return to_floats({**mismatch_metrics(mb.rollout_logp, logp, mb.response_mask),
                      "rollout/entropy": masked_mean(entropy, mb.response_mask)})


def step_seed(cfg: Config, step: int, stream: int) -> int:
    return (cfg.run.seed * 1_000_003 + step * 7919 + stream) % (2**62)


# ---------------------------------------------------------------- evaluation, checkpoints, summary


@torch.no_grad()
def evaluate(parts: Parts) -> dict[str, float]:
    """Held-out reward: one sample per problem at the training temperature, and greedy accuracy."""
    if not parts.eval_problems:
        return {}
    out = {}
    for name, sampling in (("sampled", parts.sampling), ("greedy", replace(parts.sampling, top_k=1))):
        ids = [parts.producer.encode(p) for p in parts.eval_problems]
        rollout = parts.engine.generate(ids, sampling, seed=12345)
        completions = parts.producer.decode(rollout)
        rewards = parts.reward_fn(completions, [p.ground_truth for p in parts.eval_problems])
        finite = [r for r in rewards if r == r]
        out[f"reward_{name}"] = sum(finite) / max(len(finite), 1)
    return out


def checkpoint(parts: Parts, step: int) -> Path:
    state = {"step": step, "learner": parts.learner.state_dict(), "stream": parts.stream.state_dict()}
    return save_checkpoint(parts.cfg.run.out_dir, step, parts.policy, state, to_dict(parts.cfg))


def _resume(parts: Parts) -> int:
    path = latest_checkpoint(parts.cfg.run.out_dir)
    if path is None:
        raise FileNotFoundError(f"--resume: no checkpoint in {parts.cfg.run.out_dir}/checkpoints")
    state = load_checkpoint(path, parts.policy)
    parts.learner.load_state_dict(state["learner"])
    parts.stream.load_state_dict(state["stream"])
    console.print(f"resumed from {path} (step {state['step']}, policy version {parts.learner.version})")
    return int(state["step"])


def run_summary(parts: Parts, before: dict, after: dict, history: list[dict], status: str, seconds: float) -> dict:
    rewards = [h["reward/mean"] for h in history]
    tail = rewards[-max(1, len(rewards) // 5):] if rewards else []
    return {
        "status": status,
        "run_dir": str(Path(parts.cfg.run.out_dir).resolve()),
        "loss": parts.cfg.loss.name,
        "staleness_n": parts.cfg.staleness.n,
        "steps_done": len(history),
        "policy_version": parts.learner.version,
        "eval_before": before,
        "eval_after": after,
        "train_reward_first": rewards[0] if rewards else None,
        "train_reward_final": sum(tail) / len(tail) if tail else None,
        "skipped_updates": parts.learner.nonfinite_total,
        "warmstart": parts.warmstart,
        "seconds": seconds,
    }


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
                  f"{summary['skipped_updates']} skipped, {summary['seconds']:.0f}s; run directory: {summary['run_dir']}")


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.3f}"
