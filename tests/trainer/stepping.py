"""The sync training loop's parts, built for stepping by hand in the trainer tests."""

from contextlib import contextmanager


@contextmanager
def sync_loop(cfg):
    """The training loop of a sync run, built but not started: step it with ``rollout_step``."""
    from vespo.trainer.loop import Loop
    from vespo.trainer.learner import Learner
    from vespo.trainer.run import build_run
    from vespo.trainer.sources import LocalSource

    with build_run(cfg, log=lambda *a: None) as run:
        learner = Learner(run.policy, cfg)
        source = LocalSource(run, learner)
        source.start(0)
        yield Loop(run, learner, source)


def rollout_step(loop) -> dict:
    """One rollout step (N updates) of a loop; its metrics reduced as the loop logs them."""
    from vespo.trainer.loop import StepWindow

    window = StepWindow()
    for _ in range(loop.schedule.n):
        loop.train_one(window)
    return window.metrics(loop.schedule.max_lag)
