"""The supervised warm start records only what it measured: without an accuracy target it reports
no accuracy (no NaN in its cache file or its message); with one it reports the accuracy it stopped at."""

import json
import math

from vespo.trainer.run import build_data, build_policy, build_sampling
from vespo.trainer.warmstart import warm_start, warmstart_cache_path


def _warm(cfg):
    model, tokenizer = build_policy(cfg)
    task, _, _ = build_data(cfg)
    lines = []
    stats = warm_start(model, tokenizer, task, cfg, build_sampling(cfg, task), log=lines.append)
    return stats, lines[-1]


def test_no_target_reports_no_accuracy(make_cfg, tmp_path):
    cfg = make_cfg("warmstart.steps=3", "warmstart.target_accuracy=0", f"warmstart.cache_dir={tmp_path / 'ws'}")
    stats, line = _warm(cfg)
    assert set(stats) == {"warmstart/final_loss", "warmstart/steps"} and stats["warmstart/steps"] == 3
    message = line.split(" -> ")[0]  # the cache path after it holds this test's name
    assert "accuracy" not in message and "nan" not in message.lower()
    stored = warmstart_cache_path(cfg).with_suffix(".json").read_text()
    assert json.loads(stored, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c))) == stats


def test_a_target_reports_the_accuracy_it_stopped_at(make_cfg, tmp_path):
    cfg = make_cfg("warmstart.steps=4", "warmstart.target_accuracy=0.99", "warmstart.check_every=2",
                   f"warmstart.cache_dir={tmp_path / 'ws'}")
    stats, line = _warm(cfg)
    accuracy = stats["warmstart/sampled_accuracy"]
    assert math.isfinite(accuracy) and 0.0 <= accuracy <= 1.0 and f"sampled accuracy {accuracy:.3f}" in line
