"""Benchmark: chunked vs naive response log-probs (peak memory, time), and HF engine tokens/s.

Log-probs: a bare LM head (hidden 1024, no bias, temperature 1) on random hidden states,
forward + backward of sum(logp), on CPU. Each case runs in a fresh subprocess, repeated
--repeats times; time is the best repeat. Memory is the process's peak RSS (ru_maxrss):
  total  - the whole process at its peak (interpreter, torch, inputs included);
  extra  - peak growth over the RSS once the inputs (hidden [T, H], weight [V, H]) exist;
  beyond - extra minus the gradients every path must hold (weight grad V x H, hidden grad T x H,
           float32): what the log-prob method itself costs.
Cases: naive (whole [T, V] log-softmax kept for backward; logp only), chunked at the default
chunk shape (``chunk_shape``: [min(T, 4096), 2^25 // that] logits per block) with and without entropy, and chunked at fixed sizes.
"default+ent" is what ``response_logprobs`` does by default; it is compared with naive logp only,
so it is charged for the entropy naive does not compute.
Generation: HFEngine on the tiny dense and MoE models (size xs), batch 16, 64 new tokens.

    OMP_NUM_THREADS=1 python bench/logprobs.py              # everything (~20 min; T=4k, V=151k needs 8.5 GB)
    OMP_NUM_THREADS=1 python bench/logprobs.py --quick      # V=32k only, small generation
    OMP_NUM_THREADS=1 python bench/logprobs.py --vocabs 151936 --tokens 1024 --no-generation
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import time

HIDDEN = 1024
GB = 1e9


def rss_bytes() -> int:
    """Current resident set size of this process."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def run_case(method: str, vocab: int, tokens: int, chunk_size: int, entropy: bool, repeats: int) -> dict:
    """Forward + backward of a bare LM head, `repeats` times; best time and peak memory."""
    import torch

    from vespo.models.chunked import chunk_shape, chunked_logprobs

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, HIDDEN, generator=g).requires_grad_()  # [T, H]
    weight = (torch.randn(vocab, HIDDEN, generator=g) * 0.02).requires_grad_()  # [V, H]
    targets = torch.randint(vocab, (tokens,), generator=g)  # [T]
    chunk = chunk_shape(tokens, vocab, chunk_size or None)  # (tokens, vocab entries) per block
    base = rss_bytes()
    times = []
    for _ in range(repeats):
        hidden.grad = weight.grad = None
        gc.collect()
        start = time.perf_counter()
        if method == "naive":
            logsm = torch.log_softmax(hidden @ weight.T, dim=-1)  # [T, V] float32, held for backward
            logp = logsm.gather(-1, targets[:, None]).squeeze(-1)  # [T]
            del logsm
        else:
            logp, _ = chunked_logprobs(hidden, weight, None, targets, 1.0, chunk_size or None, entropy)  # [T]
        logp.sum().backward()
        times.append(time.perf_counter() - start)
        del logp
    extra = max(peak_rss_bytes() - base, 0)
    must_hold = (vocab * HIDDEN + tokens * HIDDEN) * 4  # weight grad + hidden grad, float32
    return {"seconds": min(times), "all_seconds": times, "block": list(chunk) if method != "naive" else None,
            "total_gb": peak_rss_bytes() / GB, "extra_gb": extra / GB, "beyond_gb": (extra - must_hold) / GB,
            "threads": torch.get_num_threads()}


def case_list(chunk_sizes: list[int]) -> list[tuple[str, str, int, bool]]:
    """(label, method, chunk (0 = default), entropy) for one (V, T)."""
    return ([("naive", "naive", 0, False), ("default", "chunked", 0, False), ("default+ent", "chunked", 0, True)]
            + [(f"chunk {c}", "chunked", c, False) for c in chunk_sizes])


def logprob_table(vocabs: list[int], token_counts: list[int], chunk_sizes: list[int], repeats: int) -> list[dict]:
    """Every case in its own subprocess, so peaks do not mix."""
    rows = []
    for vocab in vocabs:
        for tokens in token_counts:
            for label, method, chunk, entropy in case_list(chunk_sizes):
                load = os.getloadavg()[0]
                args = [sys.executable, __file__, "--case", method, str(vocab), str(tokens), str(chunk),
                        str(int(entropy)), str(repeats)]
                done = subprocess.run(args, capture_output=True, text=True)
                if done.returncode:
                    raise RuntimeError(f"case {label} V={vocab} T={tokens} failed:\n{done.stderr}")
                out = done.stdout
                rows.append({"V": vocab, "T": tokens, "label": label, "load": load, **json.loads(out)})
                print(_format(rows[-1], rows), flush=True)
    return rows


def _format(row: dict, rows: list[dict]) -> str:
    naive = next(r for r in rows if r["V"] == row["V"] and r["T"] == row["T"] and r["label"] == "naive")
    label = row["label"] + (" [{}x{}]".format(*row["block"]) if row["block"] else "")
    times = "/".join(f"{t:.1f}" for t in row["all_seconds"])
    return (f"V={row['V']:>6} T={row['T']:>5} {label:>26}  total {row['total_gb']:5.2f} GB  "
            f"extra {row['extra_gb']:5.2f} GB ({row['extra_gb'] / max(naive['extra_gb'], 1e-9):4.2f}x)  "
            f"beyond {row['beyond_gb']:5.2f} GB ({row['beyond_gb'] / max(naive['beyond_gb'], 1e-9):4.2f}x)  "
            f"best {row['seconds']:6.2f} s ({row['seconds'] / naive['seconds']:4.2f}x) [{times}]  "
            f"threads {row['threads']} load {row['load']:.2f}")


def generation_throughput(batch: int, new_tokens: int) -> None:
    """Tokens/s of HFEngine.generate on the tiny dense and MoE models."""
    import torch

    from vespo.models import build_char_tokenizer, tiny_model
    from vespo.rollout import HFEngine, SamplingParams

    tok = build_char_tokenizer()
    prompts = [tok.encode(f"{i}+{2 * i}=") for i in range(batch)]
    params = SamplingParams(max_new_tokens=new_tokens)
    for arch in ("qwen3", "qwen3_moe"):
        for dtype in ("float32", "bfloat16"):
            engine = HFEngine(tiny_model(arch, "xs", tokenizer=tok), tok, dtype=dtype, record_routing=True)
            engine.generate(prompts[:2], SamplingParams(max_new_tokens=2), seed=0)  # warm-up
            start = time.perf_counter()
            rollout = engine.generate(prompts, params, seed=0)
            seconds = time.perf_counter() - start
            n = int(rollout.response_mask.sum())
            print(f"HFEngine {arch:>9} xs {dtype:>8}: {n} tokens in {seconds:5.2f} s = {n / seconds:7.1f} tokens/s "
                  f"(batch {batch}, threads {torch.get_num_threads()})", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="V=32k only and a short generation run")
    parser.add_argument("--vocabs", type=int, nargs="+", help="vocab sizes (default 32000 151936)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096], help="token counts")
    parser.add_argument("--chunks", type=int, nargs="*", default=[1024], help="fixed chunk sizes to add")
    parser.add_argument("--repeats", type=int, default=2, help="runs per case; the best time is reported")
    parser.add_argument("--no-generation", action="store_true", help="skip the HFEngine throughput")
    parser.add_argument("--case", nargs=6, metavar=("METHOD", "V", "T", "CHUNK", "ENTROPY", "REPEATS"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.case:
        method, vocab, tokens, chunk, entropy, repeats = args.case
        print(json.dumps(run_case(method, int(vocab), int(tokens), int(chunk), bool(int(entropy)), int(repeats))))
        return 0
    vocabs = args.vocabs or ([32_000] if args.quick else [32_000, 151_936])
    print(f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, {os.cpu_count()} CPUs, "
          f"uptime: {_uptime()}", flush=True)
    logprob_table(vocabs, args.tokens, args.chunks, args.repeats)
    print(f"uptime: {_uptime()}", flush=True)
    if not args.no_generation:
        generation_throughput(batch=16, new_tokens=16 if args.quick else 64)
    return 0


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


if __name__ == "__main__":
    raise SystemExit(main())
