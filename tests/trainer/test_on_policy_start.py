"""The shared on-policy start (warmstart.kind=on_policy): the seed's first on-policy updates, run once and cached,
are the weights every condition of that seed starts from, and its held-out evaluation is their "before".

The policy is a nano Qwen3 that a supervised warm start taught 1-digit addition (a model directory, as a
pretrained model would be), so on-policy updates have non-zero advantages and move the weights.
"""

import json

import pytest
from safetensors.torch import load_file

from vespo.config import ConfigError, load_config, to_dict
from vespo.errors import StartError
from vespo.trainer import train
from vespo.trainer.warmstart import on_policy_config, on_policy_dir, start_policy_dir, warmstart_cache_path


BASE = ["model.size=nano", "task.name=addition", "task.options={digits: 1}", "task.train_size=2000",
        "task.eval_size=32", "rollout.group_size=4", "run.progress=false", "run.loggers=[jsonl]", "run.threads=1"]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A model directory: the nano policy after its supervised warm start and one RL step (its policy/)."""
    out = tmp_path_factory.mktemp("pretrained")
    train(load_config(None, BASE + ["rollout.prompts_per_step=4", "staleness.n=1", "warmstart.steps=60",
                                    "warmstart.batch_size=64", f"warmstart.cache_dir={out / 'ws'}", "optim.lr=1e-4",
                                    "run.steps=1", f"run.out_dir={out / 'run'}"]))
    return out / "run" / "policy"


@pytest.fixture
def make_cfg(tmp_path):
    def make(*overrides, out="run"):
        return load_config(None, BASE + ["staleness.minibatch_prompts=4", "staleness.n=2", "run.updates=4",
                                         "optim.lr=3e-4", f"run.out_dir={tmp_path / out}", *overrides])

    return make


def start_cfg(make_cfg, pretrained, tmp_path, *extra, out="run"):
    return make_cfg(f"model.path={pretrained}", "warmstart.kind=on_policy", "warmstart.steps=4",
                    f"warmstart.cache_dir={tmp_path / 'starts'}", *extra, out=out)


def test_the_start_is_the_seeds_own_first_on_policy_updates(make_cfg, pretrained, tmp_path):
    cfg = start_cfg(make_cfg, pretrained, tmp_path, "loss.name=grpo")
    sub = on_policy_config(cfg)
    assert (sub.staleness.n, sub.loss.name, sub.run.updates, sub.run.mode) == (1, "vespo", 4, "sync")
    assert sub.prompts_per_step == cfg.prompts_per_minibatch == 4  # the run's own mini-batch, on policy
    assert (sub.optim.lr, sub.run.seed, sub.model.path) == (cfg.optim.lr, cfg.run.seed, cfg.model.path)
    # shared by the conditions a comparison varies, not by what the start itself depends on
    same = [start_cfg(make_cfg, pretrained, tmp_path, *o) for o in (["loss.name=vespo"], ["staleness.n=4"])]
    assert {on_policy_dir(c) for c in same} == {on_policy_dir(cfg)}
    # mu = the engine's log-probs (bypass) or the recompute: the same start, its updates with mu recomputed
    bypass = [start_cfg(make_cfg, pretrained, tmp_path, "staleness.behavior=" + b) for b in ("rollout", "recompute")]
    assert on_policy_dir(bypass[0]) == on_policy_dir(bypass[1])
    assert on_policy_config(bypass[0]).staleness.behavior == "recompute"
    other = [start_cfg(make_cfg, pretrained, tmp_path, o) for o in ("run.seed=1", "optim.lr=1e-4",
                                                                     "rollout.temperature=0.8")]
    assert len({on_policy_dir(c) for c in other} | {on_policy_dir(cfg)}) == 4
    # a run that goes on at another step size from a start made at this one (warmstart.start_lr): the same start
    slower = start_cfg(make_cfg, pretrained, tmp_path, "optim.lr=1e-4", "warmstart.start_lr=3e-4")
    assert on_policy_dir(slower) == on_policy_dir(cfg) and on_policy_config(slower).optim.lr == 3e-4
    assert slower.optim.lr == 1e-4 and on_policy_dir(other[1]) != on_policy_dir(cfg)
    # start_lr only where it acts: at the start's own lr it is the same start as no start_lr
    same_lr = start_cfg(make_cfg, pretrained, tmp_path, "warmstart.start_lr=3e-4")
    assert on_policy_dir(same_lr) == on_policy_dir(cfg)


def test_two_conditions_of_a_seed_start_from_one_cached_start(make_cfg, pretrained, tmp_path):
    a = start_cfg(make_cfg, pretrained, tmp_path, "loss.name=vespo", out="a")
    b = start_cfg(make_cfg, pretrained, tmp_path, "loss.name=grpo", "loss.options.eps_high=0.28", out="b")
    first = train(a)
    record = json.loads(warmstart_cache_path(a).read_text())
    made = warmstart_cache_path(a).stat().st_mtime_ns
    second = train(b)
    assert warmstart_cache_path(b).stat().st_mtime_ns == made  # read, not made again
    # a run at another step size from the same start (warmstart.start_lr = the start's): read too, same "before"
    c = start_cfg(make_cfg, pretrained, tmp_path, "optim.lr=1e-4", "warmstart.start_lr=3e-4", out="c")
    third = train(c)
    assert warmstart_cache_path(c).stat().st_mtime_ns == made and third["eval_before"] == record["eval"]
    # a run's own config.yaml (every field written out) loads again as the same config
    for cfg in (a, c):
        assert to_dict(load_config(cfg.run.out_dir + "/config.yaml")) == to_dict(cfg)
    assert record["updates"] == 4 and record["target_reached"] is True  # no target: all its updates
    start_rows = (on_policy_dir(a) / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(start_rows) == 4  # four on-policy updates, one row each (N = 1)
    assert not (on_policy_dir(a) / "run" / "checkpoints").exists()
    # the conditions' "before" is the start's evaluation of the same weights on the same problems
    assert first["eval_before"] == second["eval_before"] == record["eval"]
    assert first["warmstart"]["warmstart/updates"] == second["warmstart"]["warmstart/updates"] == 4.0
    # the start moved the weights away from the model it began with
    start = load_file(str(start_policy_dir(a) / "model.safetensors"))
    base = load_file(str(pretrained / "model.safetensors"))
    assert max((start[k] - base[k]).abs().max().item() for k in base) > 1e-4


def test_no_run_trains_from_a_start_below_its_floor(make_cfg, pretrained, tmp_path):
    cfg = start_cfg(make_cfg, pretrained, tmp_path, out="a")
    first = train(cfg)  # the start is made (no floor), and a run trains from it
    accuracy = json.loads(warmstart_cache_path(cfg).read_text())["eval"]["reward_sampled"]
    assert first["eval_before"]["reward_sampled"] == accuracy
    # the floor judges the start, it does not make another one
    above = start_cfg(make_cfg, pretrained, tmp_path, f"warmstart.min_accuracy={min(1.0, accuracy + 0.01)}", out="b")
    assert on_policy_dir(above) == on_policy_dir(cfg)
    with pytest.raises(StartError, match=rf"start of seed 0 ended at held-out sampled accuracy {accuracy:.3f} after 4 "
                                         r"updates, below warmstart.min_accuracy=.*exclude: \[\{seed: \[\"0\"\]\}\]"):
        train(above)
    assert not (tmp_path / "b" / "metrics.jsonl").exists()  # nothing trained
    at = start_cfg(make_cfg, pretrained, tmp_path, f"warmstart.min_accuracy={accuracy}", out="c")
    assert train(at)["eval_before"] == first["eval_before"]  # at the floor it trains


def test_the_held_out_before_of_a_start_is_what_the_run_would_measure(make_cfg, pretrained, tmp_path):
    cfg = start_cfg(make_cfg, pretrained, tmp_path, out="a")
    train(cfg)
    record = json.loads(warmstart_cache_path(cfg).read_text())
    # the same weights as a plain model directory, evaluated by a run of its own before any update
    plain = make_cfg(f"model.path={start_policy_dir(cfg)}", "warmstart.enabled=false", out="plain")
    assert train(plain)["eval_before"] == record["eval"]


def test_a_target_ends_the_start_at_its_first_check_that_meets_it(make_cfg, pretrained, tmp_path):
    cfg = start_cfg(make_cfg, pretrained, tmp_path, "warmstart.steps=6", "warmstart.target_accuracy=0.01",
                    "warmstart.check_every=2", "run.eval_every_size=16")
    train(cfg)
    record = json.loads(warmstart_cache_path(cfg).read_text())
    rows = [json.loads(r) for r in (on_policy_dir(cfg) / "run" / "metrics.jsonl").read_text().splitlines()]
    checks = [r for r in rows if "eval/reward_sampled" in r]
    assert [r["step"] for r in checks] == list(range(2, 2 * len(checks) + 1, 2))  # every check_every updates
    met = [r["eval/reward_sampled"] >= 0.01 for r in checks]
    # it stops at the first check that meets the target, and only there
    assert met[-1] == record["target_reached"] and not any(met[:-1])
    assert record["updates"] == rows[-1]["step"] == (checks[-1]["step"] if met[-1] else 6)


def test_an_until_rule_stops_a_run_after_an_evaluation(make_cfg, tmp_path):
    cfg = make_cfg("warmstart.steps=20", f"warmstart.cache_dir={tmp_path / 'ws'}", "staleness.n=1", "run.updates=6",
                   "run.eval_every_updates=2", "run.eval_every_size=8")
    seen = []
    summary = train(cfg, until=lambda row: seen.append(row["policy/version"]) or row["policy/version"] >= 4)
    assert seen == [2, 4] and summary["updates_done"] == 4 and summary["target_reached"] is True


def test_supervised_settings_are_refused_with_an_on_policy_start(make_cfg):
    for given in ("warmstart.lr=3e-3", "warmstart.batch_size=64"):
        with pytest.raises(ConfigError, match=given.split("=")[0] + " applies to warmstart.kind=supervised"):
            make_cfg("warmstart.kind=on_policy", given)
    # the start's learning rate acts only where an on-policy start is made
    for other in (["warmstart.kind=supervised"], ["warmstart.kind=on_policy", "warmstart.enabled=false"],
                  ["warmstart.kind=on_policy", "warmstart.steps=0"]):
        with pytest.raises(ConfigError, match="warmstart.start_lr is the learning rate of an on-policy start"):
            make_cfg(*other, "warmstart.start_lr=1e-4")
        with pytest.raises(ConfigError, match="warmstart.min_accuracy judges an on-policy start"):
            make_cfg(*other, "warmstart.min_accuracy=0.05")
    cfg = make_cfg("warmstart.kind=on_policy")
    assert to_dict(cfg)["warmstart"]["kind"] == "on_policy"
