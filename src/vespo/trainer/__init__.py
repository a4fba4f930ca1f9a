"""The trainer: one loop fed by a sample source (local in sync mode, Ray workers in async mode).

    from vespo.config import load_config
    from vespo.trainer import train
    summary = train(load_config("configs/demo.yaml", ["staleness.n=8"]))

    run.py          build a run's parts from its config (policy, data, reward, sampling, engines)
    loop.py         the training loop: resume, evaluate, update/log/checkpoint, policy directory, summary
    protocols.py    the seams: TrainItem, UpdateResult, the SampleSource and Learner protocols
    sources.py      the local source (sync mode)
    ray_source.py   the Ray source (async mode); workers.py its rollout actors
    learner.py      μ, one optimizer step per mini-batch, the non-finite guard; remote.py as a Ray actor
    producer.py     prompts -> engine samples -> rewards -> group advantages -> TrainBatch
    checkpoint.py   the training state (atomic, resharding); safe_load.py its safe readers;
                    policy_dir.py RUN_DIR/policy and what `vespo eval --model` opens
    runlog.py       the run directory's record: metric sinks, metrics.jsonl, summary
    distributed.py warmstart.py cli.py
"""

from __future__ import annotations


def train(cfg, resume: bool = False, on_update=None, until=None) -> dict:
    """Run (or resume) a training run, sync or async as cfg.run.mode says; returns the run summary. ``until(row)``,
    asked of each metrics row with a held-out evaluation, ends the run early when it is true."""
    from vespo.trainer.loop import train as train_loop

    return train_loop(cfg, resume=resume, on_update=on_update, until=until)
