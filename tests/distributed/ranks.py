"""What the distributed tests run on each rank, under torchrun (``torchrun --nproc-per-node P ranks.py WORK OUT``).

WORK (a torch.save file) holds recorded mini-batches, the losses to train them with, and the path of a
checkpoint to load. For each loss, the ranks take K updates on their shares of the mini-batches;
then they write a checkpoint of the last learner, and load the given checkpoint into a fresh one.
Rank 0 writes OUT: per loss the metrics and the full state after the updates, and the state loaded.
"""

import sys

import torch

from vespo.config import load_config
from vespo.models import build_char_tokenizer, tiny_model
from vespo.trainer.distributed import Dist, init_distributed, shutdown
from vespo.trainer.learner import Learner
from vespo.trainer.protocols import TrainItem
from vespo.types import TrainBatch

MICRO = 2  # rows per micro-batch on every rank: data-parallel micro-batching


def make_learner(dist: Dist, loss: str = "vespo", total: int = 3) -> Learner:
    model = tiny_model("qwen3", "nano", tokenizer=build_char_tokenizer(), seed=0)
    cfg = load_config(None, ["model.device=cpu", f"loss.name={loss}", "optim.lr=3e-3", "optim.grad_clip=1.0",
                             f"optim.micro_batch_size={MICRO}", "staleness.behavior=rollout", f"run.steps={total}",
                             "staleness.n=1"])
    return Learner(model, cfg, dist)


def shard(batch: TrainBatch, rank: int, world: int) -> TrainBatch:
    return batch.select(torch.tensor_split(torch.arange(len(batch)), world)[rank])


def run_updates(dist: Dist, minibatches: list[TrainBatch], loss: str) -> tuple[Learner, dict]:
    """Update on each mini-batch in turn (this rank's rows of it); the learner, its metrics and full state."""
    learner = make_learner(dist, loss, total=len(minibatches))
    metrics = []
    for index, mb in enumerate(minibatches):
        item = TrainItem(index, shard(mb, dist.rank, dist.world), sampled_version=None)
        learner.prepare([item])
        metrics.append(learner.update(item).metrics)
    return learner, {"metrics": metrics, **full_state(learner)}


def full_state(learner: Learner) -> dict:
    """The learner's full weights and AdamW moments by parameter name (gathered from every rank)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    optim = get_optimizer_state_dict(learner.module, learner.optimizer, options=StateDictOptions(full_state_dict=True))
    moments = {name: {k: v.detach().cpu().clone() for k, v in state.items() if k != "step"}
               for name, state in optim["state"].items()}
    return {"weights": learner.weights(), "moments": moments, "version": learner.version}


def checkpoint(learner: Learner, run_dir: str) -> str:
    extra = {"step": 1, "updates": learner.version, "source": {}}
    return str(learner.save_checkpoint(run_dir, 1, extra, {}))


def main(work_file: str, out: str) -> None:
    dist = init_distributed(torch.device("cpu"))
    work = torch.load(work_file, weights_only=True)
    minibatches = [TrainBatch(**mb) for mb in work["minibatches"]]
    result: dict = {"updates": {}}
    for loss in work["losses"]:
        learner, result["updates"][loss] = run_updates(dist, minibatches, loss)
    result["checkpoint"] = checkpoint(learner, work["run_dir"])
    fresh = make_learner(dist)
    fresh.load_checkpoint(work["load"])
    result["loaded"] = full_state(fresh)
    if dist.is_main:
        torch.save(result, out)
    shutdown(dist)


if __name__ == "__main__":
    main(*sys.argv[1:3])
