"""Paired seeds, checked on the trainer's own code paths with the shipped sweep files: for one seed,
every condition of every lab experiment on the dense model starts from the same warm-start file
(the cache key has no field that differs between conditions) and draws the same prompts in the
same order, whatever N, loss, learning rate or mode."""

import pytest

from vespo.data import PromptStream
from vespo.trainer.run import build_data
from vespo.trainer.warmstart import warmstart_cache_path

DENSE = ("staleness", "length_norm", "asymmetry", "async", "lr_range", "lr_range_async", "mismatch_dense",
         "endpoint")


@pytest.fixture(scope="module")
def configs(shipped):
    """{sweep: [config of every grid point that validates on this code]} for the dense lab sweeps."""
    return {stem: [cfg for _, cfg in shipped[stem][0]] for stem in DENSE}


def test_one_seed_has_one_warm_start_across_every_dense_experiment(configs):
    paths = {}
    for cfgs in configs.values():
        for cfg in cfgs:
            paths.setdefault(cfg.run.seed, set()).add(warmstart_cache_path(cfg))
    assert sorted(paths) == list(range(10))  # the headline sweeps have 10 seeds
    assert all(len(p) == 1 for p in paths.values()), paths  # one file per seed, shared by all conditions
    assert len(set.union(*paths.values())) == 10  # and a different one per seed


def _drawn(cfg, train):
    """The prompt ids the trainer draws in a whole run: run.steps rollout batches (sync) or
    run.updates mini-batches (async), from PromptStream(train, seed)."""
    stream = PromptStream(train, seed=cfg.run.seed)
    if cfg.run.mode == "async":
        return [p.id for _ in range(cfg.run.updates) for p in stream.next_batch(cfg.prompts_per_minibatch)]
    return [p.id for _ in range(cfg.steps) for p in stream.next_batch(cfg.prompts_per_step)]


def test_one_seed_draws_the_same_prompt_order_in_every_condition(configs):
    seed0 = [c for stem in ("staleness", "async") for c in configs[stem] if c.run.seed == 0
             and (c.loss.name == "grpo" or c.staleness.n == 64 or c.run.mode == "async")]  # every N, loss, mode
    seed0 += [c for c in configs["lr_range"] if c.run.seed == 0 and c.loss.name == "grpo" and c.optim.lr < 1e-4]
    assert {c.staleness.n for c in seed0} >= {1, 4, 8, 32, 64} and {c.run.mode for c in seed0} == {"sync", "async"}
    _, train, held_out = build_data(seed0[0])
    reference = _drawn(seed0[0], train)
    assert len(reference) == 512 * 8  # every run sees 512 mini-batches of 8 prompts
    for cfg in seed0[1:]:
        _, train_c, held_c = build_data(cfg)
        assert [p.id for p in held_c] == [p.id for p in held_out]  # the same held-out problems
        drawn = _drawn(cfg, train_c)  # a shorter run (the lr range's 256 updates) draws the same first prompts
        assert len(drawn) >= 256 * 8 and drawn == reference[:len(drawn)], (cfg.staleness.n, cfg.loss.name, cfg.run.mode)
    other = next(c for c in configs["staleness"] if c.run.seed == 1)
    assert _drawn(other, build_data(other)[1]) != reference
