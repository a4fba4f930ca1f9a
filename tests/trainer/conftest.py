"""A tiny, fast training setup shared by the trainer tests: the nano Qwen3 policy on 1-digit
addition, warm-started once per test session."""

import pytest

from vespo.config import load_config


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
