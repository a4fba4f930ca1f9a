"""A tiny, fast training setup shared by the trainer tests: the nano Qwen3 policy on 1-digit
addition, warm-started once per test session; and the sync loop's parts, for stepping it by hand."""

from contextlib import contextmanager

import pytest

from vespo.config import load_config
from vespo.metrics import reduce_metrics


@pytest.fixture(scope="session")
def warm_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("warmstart"))


@pytest.fixture
def make_cfg(tmp_path, warm_cache):
    def make(*overrides, out="run"):
        base = [
            "model.size=nano", "task.name=addition", "task.options={digits: 1}", "task.train_size=2000",
            "task.eval_size=32", "rollout.prompts_per_step=8", "rollout.group_size=4", "staleness.n=2",
            "warmstart.steps=40", "warmstart.batch_size=64", f"warmstart.cache_dir={warm_cache}",
            "optim.lr=1e-3", "run.steps=3", "run.progress=false", "run.loggers=[jsonl]", "run.threads=1",
            f"run.out_dir={tmp_path / out}",
        ]
        return load_config(None, base + list(overrides))

    return make


@contextmanager
def sync_loop(cfg):
    """The training loop of a sync run, built but not started: step it with ``rollout_step``."""
    from vespo.trainer.loop import Loop
    from vespo.trainer.remote import make_learner
    from vespo.trainer.run import build_run
    from vespo.trainer.sources import LocalSource

    with build_run(cfg, log=lambda *a: None) as run:
        learner = make_learner(cfg, run.policy)
        source = LocalSource(run, learner)
        source.start(0)
        yield Loop(run, learner, source)


def rollout_step(loop) -> dict:
    """One rollout step (N updates) of a loop; its metrics reduced as the loop logs them."""
    return reduce_metrics([loop.train_one()[1] for _ in range(loop.n)])
