"""The sharded learner against one process: per-rank memory, updates per second, and the share of a step
spent in FSDP's collectives.

    python bench/distributed.py                       # P = 2 x 1 thread against P = 1 x 2 threads, xs Qwen3
    python bench/distributed.py --size s --updates 20 --repeats 3
    python bench/distributed.py --device cuda         # on a GPU machine (NCCL), P = 1 and P = number of GPUs

Every measurement runs the learner alone (no rollout) on the same kind of mini-batch: 16 prompts x
G = 8 responses of 24 tokens, split over the ranks, micro-batches of 32 rows per rank, VESPO, AdamW.
One process runs each distinct prompt once per micro-batch (the shared-prompt path); several ranks
run one forward per micro-batch (vespo.trainer.distributed), so the ratio includes that difference. Each configuration runs in its own torchrun job; rank 0 reports:

    param / optim bytes per rank     the local shards of parameters and AdamW state (after one update)
    updates/s                        timed updates after one warm-up update (median of the repeats)
    collective share                 CPU time inside all-gather / reduce-scatter / all-reduce ops over the
                                     CPU time of the timed updates (torch.profiler, one profiled run)

Printed as ratios P = 2 over P = 1 in the same run: memory (goal <= 0.55) and throughput.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROWS, T = 16 * 8, 24


def measure(args: argparse.Namespace) -> dict:
    """One configuration, on every rank of this torchrun job; rank 0 returns the figures."""
    import torch

    from vespo.config import load_config
    from vespo.models import build_char_tokenizer, tiny_model
    from vespo.trainer.distributed import init_distributed, local_device, shutdown
    from vespo.trainer.learner import Learner
    from vespo.trainer.protocols import TrainItem
    from vespo.types import TrainBatch

    torch.set_num_threads(args.threads)
    device = local_device(torch.device(args.device))
    dist = init_distributed(device)
    tok = build_char_tokenizer()
    model = tiny_model("qwen3", args.size, tokenizer=tok, seed=0)
    cfg = load_config(None, [f"model.device={args.device}", "optim.lr=1e-4", "optim.micro_batch_size=32",
                             "staleness.behavior=rollout", f"run.steps={args.updates + 1}", "staleness.n=1"])
    learner = Learner(model, cfg, dist)
    gen = torch.Generator().manual_seed(0)
    rows = ROWS // dist.world

    def item(index: int) -> TrainItem:
        zeros = torch.zeros(rows, dtype=torch.long)
        prompts = torch.randint(4, len(tok), (rows // 8, 8), generator=gen).repeat_interleave(8, dim=0)  # groups of 8
        batch = TrainBatch(
            prompt_ids=prompts, prompt_mask=torch.ones(rows, 8, dtype=torch.long),
            response_ids=torch.randint(4, len(tok), (rows, T), generator=gen), response_mask=torch.ones(rows, T),
            rollout_logp=-torch.rand(rows, T, generator=gen) * 3, rewards=torch.randn(rows, generator=gen),
            advantages=torch.randn(rows, generator=gen), group_ids=torch.arange(rows) // 8, versions=zeros,
            versions_max=zeros, token_versions=torch.zeros(rows, T, dtype=torch.long),
            truncated=torch.zeros(rows, dtype=torch.bool))
        return TrainItem(index, batch, sampled_version=None)

    def update(index: int) -> None:
        it = item(index)
        learner.prepare([it])
        learner.update(it)

    update(0)  # warm-up: allocates AdamW's state
    memory = learner.memory()
    dist.barrier()
    t0 = time.perf_counter()
    for i in range(args.updates):
        update(i + 1)
    dist.barrier()
    seconds = time.perf_counter() - t0
    share = collective_share(update, args.updates) if dist.active else 0.0
    shutdown(dist)
    return {"world": dist.world, "updates_per_s": args.updates / seconds, "collective_share": share, **memory}


def collective_share(update, n: int) -> float:
    """CPU time in collective ops over the CPU time of ``n`` profiled updates."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(n):
            update(1000 + i)
    events = prof.key_averages()
    names = ("all_gather", "reduce_scatter", "all_reduce", "allgather", "reducescatter", "allreduce")
    comm = sum(e.self_cpu_time_total for e in events if any(k in e.key.lower() for k in names))
    total = sum(e.self_cpu_time_total for e in events)
    return comm / max(total, 1)


def run(world: int, threads: int, args: argparse.Namespace) -> dict:
    """One torchrun job of ``world`` ranks with ``threads`` torch threads each; rank 0's figures."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "VESPO_BENCH_OUT": str(out)}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
               __file__, "--child", "--threads", str(threads), "--size", args.size, "--updates", str(args.updates),
               "--device", args.device]
        subprocess.run(cmd, env=env, check=True, capture_output=True)
        return json.loads(out.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="xs")
    p.add_argument("--updates", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--child", action="store_true")
    args = p.parse_args()
    if args.child:
        result = measure(args)
        if int(os.environ.get("RANK", "0")) == 0:
            Path(os.environ["VESPO_BENCH_OUT"]).write_text(json.dumps(result))
        return
    cores = os.cpu_count() or 2
    many = 2 if args.device == "cpu" else int(__import__("torch").cuda.device_count())
    configs = [(1, min(2, cores)), (many, 1)] if args.device == "cpu" else [(1, 1), (many, 1)]
    results: dict = {c: [] for c in configs}
    for _ in range(args.repeats):  # interleaved, so a slow phase of a busy machine hits both
        for world, threads in configs:
            results[(world, threads)].append(run(world, threads, args))
    one, two = (results[c] for c in configs)
    med = lambda rs, k: statistics.median(r[k] for r in rs)  # noqa: E731
    print(f"{args.size} Qwen3 on {args.device}, {ROWS} rows x {T} tokens per mini-batch, {args.updates} updates, "
          f"median of {args.repeats}; load average {os.getloadavg()[0]:.1f}")
    print(f"{'':<34}{f'P={configs[0][0]} x {configs[0][1]} thr':>16}{f'P={configs[1][0]} x {configs[1][1]} thr':>16}"
          f"{'ratio':>10}")
    for key in ("mem/param_bytes_per_rank", "mem/optim_bytes_per_rank", "updates_per_s"):
        a, b = med(one, key), med(two, key)
        print(f"{key:<34}{a:>16.4g}{b:>16.4g}{b / a:>10.3f}")
    mem_ratio = (med(two, "mem/param_bytes_per_rank") + med(two, "mem/optim_bytes_per_rank")) / (
        med(one, "mem/param_bytes_per_rank") + med(one, "mem/optim_bytes_per_rank"))
    print(f"{'param + optim bytes per rank':<34}{'':>32}{mem_ratio:>10.3f}   (goal <= 0.55)")
    print(f"{'collective share of a step':<34}{'':>16}{med(two, 'collective_share'):>16.3f}")


if __name__ == "__main__":
    main()
