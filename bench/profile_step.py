"""Where the time of one synchronous RL step goes: CPU seconds per stage, and host-sync counts.

    OMP_NUM_THREADS=1 python bench/profile_step.py                          # xs Qwen3, 16 new tokens
    OMP_NUM_THREADS=1 python bench/profile_step.py --arch qwen3_moe --max-new 64
    OMP_NUM_THREADS=1 python bench/profile_step.py --lab                    # the lab's N = 32 setting
    OMP_NUM_THREADS=1 python bench/profile_step.py run.compile=false        # any config override
    OMP_NUM_THREADS=1 python bench/profile_step.py --ops 15                 # and the 15 costliest torch operators

The bench setting is bench/train_step.py's (P = 16 prompts x G = 8, N = 4, untrained model, 2-digit
addition); --lab is bench/lab_runs.py's (reverse 16 letters, 2048 responses per rollout batch, N = 32
mini-batches of 64; no warm start, so answers run to the cap of 18 tokens). After --warmup steps
(they pay compilation), --steps steps are timed. Each stage is timed by wrapping the function that
does it; times are exclusive (a stage nested in another is not counted twice) and in CPU seconds
of this process (time.process_time), so a busy machine slows the wall clock but barely these
figures; --wall times them by the wall clock instead (for several threads). "host syncs" counts tensor-to-Python conversions (.item(), .tolist(), float(), int(),
bool() of a tensor) per step; on CPU each is one more small operation, not a device wait.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections import defaultdict
from contextlib import contextmanager

import torch

BENCH = ["model.size=xs", "warmstart.enabled=false", "rollout.prompts_per_step=16", "rollout.group_size=8",
         "staleness.n=4", "run.progress=false", "task.train_size=2000", "task.eval_size=0"]
LAB = ["model.size=xs", "warmstart.enabled=false", "task.name=reverse", "task.options={length: 16}",
       "staleness.minibatch_prompts=8", "rollout.group_size=8", "staleness.n=32", "run.progress=false",
       "task.train_size=5000", "task.eval_size=0"]


class StageTimer:
    """Exclusive time per stage (CPU or wall clock): entering a stage pauses the one it is nested in."""

    def __init__(self, clock=time.process_time) -> None:
        self.clock = clock
        self.totals: dict[str, float] = defaultdict(float)
        self.stack: list[list] = []  # [name, start]

    @contextmanager
    def stage(self, name: str):
        now = self.clock()
        if self.stack:
            outer = self.stack[-1]
            self.totals[outer[0]] += now - outer[1]
        self.stack.append([name, now])
        try:
            yield
        finally:
            done = self.stack.pop()
            now = self.clock()
            self.totals[done[0]] += now - done[1]
            if self.stack:
                self.stack[-1][1] = now

    def timed(self, fn, name: str, unless_inside: str | None = None):
        def timed(*a, **k):
            if unless_inside and self.stack and self.stack[-1][0] == unless_inside:
                return fn(*a, **k)
            with self.stage(name):
                return fn(*a, **k)

        return timed

    def wrap(self, owner, attr: str, name: str, unless_inside: str | None = None) -> None:
        fn = getattr(owner, attr, None)
        if fn is not None:
            setattr(owner, attr, self.timed(fn, name, unless_inside))


def count_host_syncs(counter: dict) -> None:
    for attr in ("item", "tolist", "__float__", "__int__", "__bool__"):
        orig = getattr(torch.Tensor, attr)

        def counted(self, *a, _orig=orig, **k):
            counter["host syncs"] += 1
            return _orig(self, *a, **k)

        setattr(torch.Tensor, attr, counted)


def instrument(parts, timer: StageTimer) -> None:
    import importlib

    import vespo.metrics as metrics
    import vespo.models.forward as forward

    learner = parts.learner
    timer.wrap(parts.engine, "generate", "rollout: generate")
    timer.wrap(parts.producer, "reward_fn", "rollout: reward")
    timer.wrap(parts.producer, "decode", "rollout: detokenize")
    timer.wrap(parts.producer, "score", "rollout: advantages, batch")
    timer.wrap(learner, "behavior_pass", "mu recompute")
    timer.wrap(forward, "response_logprobs", "update: forward", unless_inside="mu recompute")
    learner.spec = dataclasses.replace(learner.spec, fn=timer.timed(learner.spec.fn, "update: loss"))
    timer.wrap(torch.Tensor, "backward", "update: backward")
    timer.wrap(torch.nn.utils, "clip_grad_norm_", "update: optimizer")
    timer.wrap(learner.optimizer, "step", "update: optimizer")
    timer.wrap(learner.optimizer, "zero_grad", "update: optimizer")
    timer.wrap(learner.scheduler, "step", "update: optimizer")
    for module in ("vespo.trainer.sync", "vespo.trainer.loop", "vespo.trainer.learner"):  # older / this code
        try:
            owner = importlib.import_module(module)
        except ImportError:
            continue
        for name in ("to_floats", "mean_of", "reduce_metrics", "mismatch_metrics", "masked_mean", "lag_stats"):
            timer.wrap(owner, name, "metrics")
    for name in ("to_floats", "mean_of", "reduce_metrics", "mismatch_metrics", "masked_mean"):
        timer.wrap(metrics, name, "metrics")
    timer.wrap(parts.engine, "load_weights", "weight push")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="qwen3")
    ap.add_argument("--max-new", type=int, default=16)
    ap.add_argument("--lab", action="store_true", help="the lab setting of bench/lab_runs.py instead")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--wall", action="store_true", help="time stages by the wall clock instead of CPU time "
                    "(with several threads, CPU time counts every thread, spinning included)")
    ap.add_argument("--ops", type=int, default=0, metavar="K", help="after the timed steps, one more step under "
                    "torch.profiler: its K operators with the most self CPU time")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    from steps import stepper

    from vespo.config import load_config

    base = LAB if args.lab else BENCH + [f"rollout.max_new_tokens={args.max_new}"]
    cfg = load_config(None, [f"model.arch={args.arch}", *base, *args.overrides])
    parts = stepper(cfg)
    for step in range(args.warmup):
        parts.step(step)
    timer, counter = StageTimer(time.perf_counter if args.wall else time.process_time), defaultdict(int)
    instrument(parts, timer)
    count_host_syncs(counter)
    tokens, wall = 0.0, time.perf_counter()
    with timer.stage("other"):
        for step in range(args.warmup, args.warmup + args.steps):
            tokens += parts.step(step)
    wall = time.perf_counter() - wall
    total = sum(timer.totals.values())
    print(f"{cfg.model.arch}, {len(parts.learner.params)} parameter tensors, {torch.get_num_threads()} threads; "
          f"{tokens / args.steps:.0f} completion tokens per step")
    unit = "wall s/step" if args.wall else "CPU s/step"
    print(f"{'stage':<28}{unit:>11}{'share':>8}")
    for name, t in sorted(timer.totals.items(), key=lambda kv: -kv[1]):
        print(f"{name:<28}{t / args.steps:11.4f}{t / total:8.1%}")
    print(f"{'total':<28}{total / args.steps:11.4f}   ({wall / args.steps:.4f} s/step wall, "
          f"{tokens / total:.0f} tokens per {'s' if args.wall else 'CPU-s'})")
    print(f"{'host syncs':<28}{counter['host syncs'] / args.steps:11.0f} per step")
    if args.ops:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            parts.step(args.warmup + args.steps)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.ops))


if __name__ == "__main__":
    main()
