"""One rollout step of vespo's trainer as the benches drive it, for this code and for an older
checkout (before the trainer became one loop fed by a sample source: ``vespo.trainer.setup`` and
``vespo.trainer.sync``), so a bench can time both with the same script.

    s = stepper(cfg)                  # builds the run (this code: run, learner, LocalSource, Loop)
    s = stepper(cfg, own_engine=True) # the engine with its own copy of the weights, as `vespo train` builds it
    tokens = s.step(k)                # rollout step k: rollout, rewards, μ, N updates; completion tokens
    s.engine, s.producer, s.learner   # the parts a profiler wraps (producer: the scorer of rewards and
                                      # advantages; an older checkout's RolloutProducer)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass
class Stepper:
    engine: Any
    producer: Any
    learner: Any
    step: Callable[[int], float]  # rollout step index -> completion tokens sampled in it


def stepper(cfg, own_engine: bool = False) -> Stepper:
    """``own_engine``: the rollout engine gets its own copy of the policy (weights pushed each rollout step), as
    ``vespo train`` builds it in sync mode; else it runs the learner's module where it can (one copy fewer)."""
    try:
        from vespo.trainer.loop import Loop
    except ImportError:  # an older checkout: setup.build + sync.train_step
        from vespo.trainer.setup import build
        from vespo.trainer.sync import train_step

        parts = build(cfg)
        return Stepper(parts.engine, parts.producer, parts.learner,
                       lambda k: train_step(parts, k)["rollout/tokens"])
    try:
        from vespo.trainer.remote import make_learner  # a checkout whose Learner took the Config unpacked
    except ImportError:
        from vespo.trainer.learner import Learner

        def make_learner(cfg, policy):
            return Learner(policy, cfg)
    from vespo.trainer.run import build_run
    from vespo.trainer.sources import LocalSource

    run = build_run(cfg, log=lambda *a: None)
    learner = make_learner(cfg, run.policy)
    source = LocalSource(run, learner, engine=run.make_engine(run.policy) if own_engine else None)
    loop = Loop(run, learner, source)
    source.start(0)
    if hasattr(source, "producer"):  # an older checkout: train_one() returns (item, metrics)

        def step(k: int) -> float:
            return sum(loop.train_one()[1].get("rollout/n_tokens", 0.0) for _ in range(loop.n))

        return Stepper(source.engine, source.producer, learner, step)
    from vespo.trainer.loop import StepWindow  # this code: a step's updates fill a window
    # this code: the run's one schedule; an older checkout: the loop's N and the source's largest lag
    n, max_lag = (loop.schedule.n, loop.schedule.max_lag) if hasattr(loop, "schedule") else (loop.n, source.max_lag)

    def step(k: int) -> float:
        window = StepWindow()
        for _ in range(n):
            loop.train_one(window)
        return window.metrics(max_lag).get("rollout/n_tokens", 0.0)

    return Stepper(source.engine, source.scorer, learner, step)


def build_only(cfg) -> None:
    """Build a run (the warm start included), for this code or an older one."""
    try:
        from vespo.trainer.run import build_run
    except ImportError:
        from vespo.trainer.setup import build

        build(cfg)
        return
    build_run(cfg, log=lambda *a: None).close()
