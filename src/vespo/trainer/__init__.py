"""The trainer: synchronous stale-update loop, asynchronous Ray workers, checkpoints.

    from vespo.config import load_config
    from vespo.trainer import train
    summary = train(load_config("configs/demo.yaml", ["staleness.n=8"]))
"""

from __future__ import annotations


def train(cfg, resume: bool = False) -> dict:
    """Run the mode the config asks for (sync or async); returns the run summary."""
    if cfg.run.mode == "async":
        from vespo.trainer.async_ray import train_async

        return train_async(cfg, resume=resume)
    from vespo.trainer.sync import train as train_sync

    return train_sync(cfg, resume=resume)
