"""Completion tokens/s of a full RL step in vespo, next to TRL's GRPOTrainer on the same configuration.

    python bench/train_step.py                                  # dense + MoE, 16 and 64 new tokens, 3 repeats
    python bench/train_step.py --archs qwen3 --lengths 16 --repeats 1       # one quick cell
    python bench/train_step.py --base-src /path/to/older/checkout/src       # adds that vespo as a column
    python bench/train_step.py --threads 1                                  # one torch thread each

One step is what a user waits for: rollout (P prompts x G responses), rewards, advantages, μ
recompute, then N optimizer steps on the N mini-batches. Both trainers get the same tiny model
(xs Qwen3 or Qwen3-MoE, same config and seed, untrained, so responses run to the cap unless the
model happens to sample EOS), the same prompts (2-digit addition), the same batch (P = 16 prompts x
G = 8 responses, N = 4), temperature 1, no KL, float32 on CPU. Tokens are completion tokens actually
sampled (EOS included), summed over the timed steps and divided by their wall time; the first step
of each run is a warm-up (it pays one-time costs such as compilation) and is not timed. Every
measurement runs in its own process; a repeat measures every (model, length) cell for vespo, then
for TRL, so slow phases of a busy machine hit both. The table shows the median of the repeats and
the ratio of medians vespo / TRL (> 1: vespo is faster), first in wall-clock tokens/s, then in
tokens per CPU-second of the measuring process (steadier on a busy machine, and with --threads 1
the same as wall-clock on an idle one). The load average is printed next to every measurement.

vespo runs with its default configuration plus ``--vespo-args`` (e.g. ``run.compile=false`` to see
the eager path). ``--base-src`` runs a second vespo from another source tree (e.g. a checkout of
an older commit) in the same interleaved order, to compare two versions of vespo.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

P, G, N = 16, 8, 4


# ---------------------------------------------------------------- one measurement (in a child process)


def vespo_tokens_per_s(arch: str, size: str, max_new: int, steps: int, extra: list[str]) -> dict:
    from steps import stepper

    from vespo.config import load_config

    cfg = load_config(None, [f"model.arch={arch}", f"model.size={size}", "warmstart.enabled=false",
                             f"rollout.prompts_per_step={P}", f"rollout.group_size={G}", f"staleness.n={N}",
                             f"rollout.max_new_tokens={max_new}", "run.progress=false", "task.train_size=2000",
                             "task.eval_size=0", *extra])
    s = stepper(cfg)
    t0 = time.perf_counter()
    s.step(0)  # warm-up
    warmup = time.perf_counter() - t0
    tokens, t0, c0 = 0.0, time.perf_counter(), time.process_time()
    for step in range(1, steps + 1):
        tokens += s.step(step)
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"tokens_per_s": tokens / elapsed, "tokens_per_cpu_s": tokens / cpu, "warmup_s": warmup,
            "step_s": elapsed / steps, "tokens_per_step": tokens / steps}


def trl_tokens_per_s(arch: str, size: str, max_new: int, steps: int) -> dict:
    import datasets
    import torch
    from trl import GRPOConfig, GRPOTrainer

    from vespo.models import build_char_tokenizer, tiny_model
    from vespo.tasks import get_task

    task = get_task("addition", digits=2)
    problems = task.generate(P * (steps + 1) * 2, seed=0)
    data = datasets.Dataset.from_dict({"prompt": [p.prompt for p in problems],
                                       "ground_truth": [p.ground_truth for p in problems]})

    def reward(completions, ground_truth, **kw):
        return [task.reward(c, t) for c, t in zip(completions, ground_truth)]

    tok = build_char_tokenizer()
    torch.manual_seed(0)
    model = tiny_model(arch, size, tokenizer=tok, seed=0)
    lengths: list[float] = []

    class Timed(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            lengths.append(float(out["completion_mask"].sum()))
            return out

    args = GRPOConfig(output_dir="/tmp/vespo-bench-trl", per_device_train_batch_size=P * G // N,
                      num_generations=G, steps_per_generation=N, max_completion_length=max_new,
                      max_steps=N * (steps + 1), learning_rate=1e-4, loss_type="grpo", beta=0.0, temperature=1.0,
                      top_k=0, bf16=False, use_cpu=True, report_to="none", logging_steps=1000, save_strategy="no",
                      seed=0, dataloader_num_workers=0, disable_tqdm=True)
    trainer = Timed(model=model, reward_funcs=reward, args=args, train_dataset=data, processing_class=tok)
    times: list[float] = []
    cpu_times: list[float] = []
    orig = trainer.training_step

    def timed_step(*a, **k):
        t, c = time.perf_counter(), time.process_time()
        r = orig(*a, **k)
        times.append(time.perf_counter() - t)
        cpu_times.append(time.process_time() - c)
        return r

    trainer.training_step = timed_step
    trainer.train()
    # the first generation batch and its N training steps are the warm-up
    tokens = sum(lengths[1:])
    return {"tokens_per_s": tokens / sum(times[N:]), "tokens_per_cpu_s": tokens / sum(cpu_times[N:]),
            "warmup_s": sum(times[:N]), "step_s": sum(times[N:]) / steps, "tokens_per_step": tokens / steps}


def child(args) -> None:
    if args.system == "trl":
        out = trl_tokens_per_s(args.arch, args.size, args.max_new, args.steps)
    else:
        out = vespo_tokens_per_s(args.arch, args.size, args.max_new, args.steps, args.vespo_args)
    print("RESULT " + json.dumps(out), flush=True)


# ---------------------------------------------------------------- the interleaved driver


def measure(system: str, src: str | None, arch: str, max_new: int, args) -> dict:
    env = dict(os.environ)
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    if src:
        env["PYTHONPATH"] = os.path.abspath(src) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--system", system, "--arch", arch,
           "--size", args.size, "--max-new", str(max_new), "--steps", str(args.steps)]
    if system != "trl":
        cmd += ["--vespo-args", *args.vespo_args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{system} {arch} {max_new}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--archs", default="qwen3,qwen3_moe")
    ap.add_argument("--lengths", default="16,64", help="max new tokens, comma-separated")
    ap.add_argument("--size", default="xs")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per measurement (after one warm-up step)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--base-src", help="another vespo source tree to measure as 'base' (its src/ folder)")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads per measurement (OMP_NUM_THREADS); 0: torch's default")
    ap.add_argument("--vespo-args", nargs="*", default=[], help="config overrides for vespo, e.g. run.compile=false")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--system", help=argparse.SUPPRESS)
    ap.add_argument("--arch", help=argparse.SUPPRESS)
    ap.add_argument("--max-new", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    systems = [("vespo", None)] + ([("base", args.base_src)] if args.base_src else []) + [("trl", None)]
    cells = [(a, int(n)) for a in args.archs.split(",") for n in args.lengths.split(",")]
    results: dict[tuple, list[dict]] = {}
    print(f"batch: {P} prompts x {G} responses, N = {N} updates per rollout; vespo args: {args.vespo_args}; "
          f"{args.threads or 'default'} threads, {os.cpu_count()} cores; load average {load_average()}", flush=True)
    for rep in range(args.repeats):
        for name, src in systems:
            for arch, max_new in cells:
                r = measure("trl" if name == "trl" else "vespo", src, arch, max_new, args)
                results.setdefault((name, arch, max_new), []).append(r)
                print(f"  repeat {rep + 1} {name:<6} {arch:<10} {max_new:>3} new: {r['tokens_per_s']:7.0f} tok/s "
                      f"({r['tokens_per_cpu_s']:.0f} per CPU-s), "
                      f"step {r['step_s']:.3f} s, {r['tokens_per_step']:.0f} tok/step, warm-up {r['warmup_s']:.1f} s "
                      f"(load {load_average()})", flush=True)
    print_table(results, systems, cells, args.size)


def print_table(results: dict, systems: list, cells: list, size: str) -> None:
    """Medians and ratios of wall-clock tokens/s, then of tokens per CPU-second (steadier on a busy machine)."""
    names = [n for n, _ in systems]
    print(f"\nmedian of {len(next(iter(results.values())))} repeats; load average {load_average()}")
    for key, unit in (("tokens_per_s", "tok/s"), ("tokens_per_cpu_s", "tok/CPU-s")):
        med = {k: statistics.median(r[key] for r in v) for k, v in results.items()}
        head = "".join(f"{n + ' ' + unit:>16}" for n in names)
        extra = "".join(f"{n + ' / trl':>13}" for n in names if n != "trl")
        print(f"{'model':<18}{'new tok':>8}{head}{extra}")
        for arch, max_new in cells:
            row = "".join(f"{med[(n, arch, max_new)]:16.0f}" for n in names)
            ratios = "".join(f"{med[(n, arch, max_new)] / med[('trl', arch, max_new)]:13.2f}"
                             for n in names if n != "trl")
            print(f"{arch + '-' + size:<18}{max_new:>8}{row}{ratios}")
        print()


if __name__ == "__main__":
    main()
