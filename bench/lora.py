"""LoRA against full weights on the real model: step time (rollout / updates), peak memory, what a weight push
carries, and (with ``--recipe``) the real-model recipe's held-out accuracy before and after.

    python bench/lora.py                     # full vs LoRA, 2 timed rollout steps each after a warm-up (~15 min)
    python bench/lora.py --steps 1           # a quick look
    python bench/lora.py --bf16              # the recipe's precision: bf16 autocast learner, bf16 engine copy
    python bench/lora.py --src OLD/src       # the same on another checkout's code (a before / after of a change)
    python bench/lora.py --recipe            # also configs/smollm2_chain_sum.yaml both ways (hours on a CPU)

The step is bench/real_model.py's (SmolLM2-135M-Instruct, rg:chain_sum, 8 prompts x 8 samples, up to 48 new
tokens, N = 2, VESPO, float32 on ``--threads`` threads), measured by its ``vespo_run`` in a fresh process per system,
the systems interleaved over ``--repeats``. The engine holds its own copy of the policy, as ``vespo train`` builds it
in sync mode (``--engine shared``: it runs the learner's module, as bench/real_model.py measures). LoRA:
``model.lora.rank`` (default 16), alpha 2 x rank, the seven projections of every decoder layer. Reported per system:
s / rollout step and CPU s, the rollout's and the updates' (with the μ pass) wall and CPU seconds, peak RSS
(``ru_maxrss``) and the peak while generating and while updating, trained parameters, the bytes of AdamW's state, and
the bytes one weight push sends to an engine (the full weights, or the adapters alone).

``--recipe`` trains the recipe (32 updates at N = 16 from SmolLM2's own weights, an evaluation of 256 held-out
problems before and after) once with full weights and once with LoRA at ``--lora-lr``, and reports each run's
held-out sampled and greedy accuracy before and after and its wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import real_model  # noqa: E402
from real_model import BF16, MODEL, load_average, vespo_run  # noqa: E402  the same step, measured the same way

SYSTEMS = ("full", "lora")
RECIPE = "configs/smollm2_chain_sum.yaml"


def lora_overrides(rank: int) -> list[str]:
    return [f"model.lora.rank={rank}", f"model.lora.alpha={2 * rank}"]


def sizes(extra: list[str]) -> dict:
    """Trained parameters and the bytes of one weight push, of the policy a run with ``extra`` trains."""
    from vespo.config import load_config
    from vespo.models import build_model
    from vespo.models.lora import adapter_state, attach_lora, lora_on

    cfg = load_config(None, [f"model.path={MODEL}", *extra])
    model, _ = build_model(cfg.model, seed=0)
    if lora_on(cfg.model.lora):
        attach_lora(model, cfg.model.lora)
        pushed = adapter_state(model)
    else:
        pushed = model.state_dict()
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"trained_params": trained, "optim_bytes": 2.0 * trained * 4,  # AdamW's two float32 moments
            "push_bytes": float(sum(v.numel() * v.element_size() for v in pushed.values()))}


def child(system: str, args) -> None:
    real_model.THREADS = args.threads  # run.threads of the step
    extra = (lora_overrides(args.rank) if system == "lora" else []) + (BF16 if args.bf16 else [])
    r = vespo_run(args.steps, extra, bf16=args.bf16, own_engine=args.engine == "own")
    r = {k: v for k, v in r.items() if k not in ("rollouts", "arch")}
    r.update(sizes(extra))
    out = args.out
    with open(out, "wb") as f:
        pickle.dump(r, f)


def measure(system: str, args) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
    if args.src:  # the children import vespo from that checkout
        env["PYTHONPATH"] = os.pathsep.join([os.path.abspath(args.src), env.get("PYTHONPATH", "")])
    with tempfile.NamedTemporaryFile(suffix=".pkl") as out:
        cmd = [sys.executable, os.path.abspath(__file__), "--child", system, "--steps", str(args.steps), "--rank",
               str(args.rank), "--threads", str(args.threads), "--engine", args.engine, "--out", out.name,
               *(["--bf16"] if args.bf16 else [])]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3 * 3600)
        if proc.returncode != 0:
            raise RuntimeError(f"{system}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
        with open(out.name, "rb") as f:
            return pickle.load(f)


def recipe(system: str, rank: int, lr: float, out_dir: Path) -> dict:
    """The recipe trained once (full weights or LoRA); its summary's held-out accuracy before and after."""
    extra = [*lora_overrides(rank), f"optim.lr={lr}"] if system == "lora" else []
    run_dir = out_dir / system
    cmd = [sys.executable, "-m", "vespo.cli", "train", "--config", RECIPE, f"run.out_dir={run_dir}",
           "run.progress=false", *extra]
    subprocess.run(cmd, check=True, timeout=24 * 3600)
    s = json.loads((run_dir / "summary.json").read_text())
    return {"before": s["eval_before"], "after": s["eval_after"], "seconds": s["seconds"]}


def table(runs: dict[str, list[dict]]) -> str:
    def med(system: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[system])

    rows = [("s / rollout step", "step_s", "{:.1f}"), ("CPU s / rollout step", "step_cpu_s", "{:.1f}"),
            ("rollout s / step", "rollout_s", "{:.1f}"), ("rollout CPU s / step", "rollout_cpu_s", "{:.1f}"),
            ("updates + mu s / step", "update_s", "{:.1f}"), ("updates + mu CPU s / step", "update_cpu_s", "{:.1f}"),
            ("completion tokens / step", "tokens_per_step", "{:.0f}"),
            ("completion tokens / s", "tokens_per_s", "{:.1f}"), ("peak RSS, GiB", "peak_rss", "gib"),
            ("peak RSS while generating, GiB", "rollout_peak_rss", "gib"),
            ("peak RSS while updating, GiB", "update_peak_rss", "gib"), ("trained parameters", "trained_params", "{:,.0f}"),
            ("AdamW state, MiB", "optim_bytes", "mib"), ("one weight push, MiB", "push_bytes", "mib")]
    systems = [s for s in SYSTEMS if runs.get(s)]
    lines = ["| measure (median of repeats) | " + " | ".join(systems) + " | lora / full |", "|---" * (len(systems) + 2) + "|"]
    for name, key, fmt in rows:
        cells = []
        for s in systems:
            v = med(s, key)
            cells.append(f"{v / 2**30:.2f}" if fmt == "gib" else f"{v / 2**20:.2f}" if fmt == "mib" else fmt.format(v))
        ratio = f"x{med('lora', key) / med('full', key):.3f}" if len(systems) == 2 and med("full", key) else ""
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {ratio} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2, help="timed rollout steps per run (after one warm-up step)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--rank", type=int, default=16, help="model.lora.rank (alpha = 2 x rank)")
    ap.add_argument("--threads", type=int, default=real_model.THREADS, help="torch threads of every run")
    ap.add_argument("--engine", choices=("own", "shared"), default="own",
                    help="own: the engine holds its own copy (vespo train's sync mode); shared: the learner's module")
    ap.add_argument("--bf16", action="store_true", help="the recipe's precision: " + " ".join(BF16))
    ap.add_argument("--src", help="run the children on this checkout's src directory (default: the installed vespo)")
    ap.add_argument("--recipe", action="store_true", help="also train the recipe both ways (hours on a CPU)")
    ap.add_argument("--lora-lr", type=float, default=3e-4, help="optim.lr of the LoRA recipe run (the recipe's: 3e-5)")
    ap.add_argument("--save", default="runs/bench/lora.pkl", help="every finished measurement, rewritten after each")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child, args)
    print(f"{MODEL}: full weights vs LoRA rank {args.rank}, {args.threads} threads on {os.cpu_count()} cores, "
          f"{'bf16-mixed' if args.bf16 else 'float32'}, {args.engine} engine, code {args.src or 'the vespo on sys.path'}; "
          f"load average {load_average()}", flush=True)
    runs: dict = {s: [] for s in SYSTEMS}
    Path(args.save).parent.mkdir(parents=True, exist_ok=True)
    for rep in range(args.repeats):
        for system in SYSTEMS:
            r = measure(system, args)
            r["load_average"] = os.getloadavg()
            runs[system].append(r)
            Path(args.save).write_bytes(pickle.dumps(runs))
            print(f"  repeat {rep + 1} {system}: {r['step_s']:.1f} s/step ({r['step_cpu_s']:.1f} CPU s), peak RSS "
                  f"{r['peak_rss'] / 2**30:.2f} GiB (load {load_average()})", flush=True)
    print(f"\nload average at the end {load_average()}\n\n{table(runs)}")
    if args.recipe:
        out = Path(args.save).parent / "lora_recipe"
        results = {s: recipe(s, args.rank, args.lora_lr, out) for s in SYSTEMS}
        runs["recipe"] = results
        Path(args.save).write_bytes(pickle.dumps(runs))
        print("\n| recipe | held-out sampled before -> after | greedy before -> after | wall s |\n|---|---|---|---|")
        for s, r in results.items():
            b, a = r["before"], r["after"]
            print(f"| {s} | {b['reward_sampled']:.3f} -> {a['reward_sampled']:.3f} | "
                  f"{b['reward_greedy']:.3f} -> {a['reward_greedy']:.3f} | {r['seconds']:.0f} |")


if __name__ == "__main__":
    main()
