"""Benchmark: chunked vs naive response log-probs (peak memory, time), and HF engine tokens/s.

Log-probs: a bare LM head (hidden 1024) on random hidden states, forward + backward, on CPU.
Each case runs in a fresh subprocess; peak memory is the growth of the process's peak RSS
(ru_maxrss) over its RSS once the inputs exist, so it counts only what the computation adds.
Generation: HFEngine on the tiny dense and MoE models (size xs), batch 16, 64 new tokens.

    OMP_NUM_THREADS=1 python bench/logprobs.py              # everything (a few minutes)
    OMP_NUM_THREADS=1 python bench/logprobs.py --quick      # V=32k only, small generation
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

HIDDEN = 1024


def rss_bytes() -> int:
    """Current resident set size of this process."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def run_case(method: str, vocab: int, tokens: int, chunk_size: int) -> dict:
    """One forward + backward of a bare LM head; returns time and peak extra memory."""
    import torch

    from vespo.models import chunked_logprobs

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, HIDDEN, generator=g).requires_grad_()  # [T, H]
    weight = (torch.randn(vocab, HIDDEN, generator=g) * 0.02).requires_grad_()  # [V, H]
    targets = torch.randint(vocab, (tokens,), generator=g)  # [T]
    base = rss_bytes()
    start = time.perf_counter()
    if method == "naive":
        logsm = torch.log_softmax(hidden @ weight.T, dim=-1)  # [T, V] float32, held for backward
        logp = logsm.gather(-1, targets[:, None]).squeeze(-1)
    else:
        logp, _ = chunked_logprobs(hidden, weight, None, targets, 1.0, chunk_size)
    logp.sum().backward()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    return {"seconds": seconds, "peak_extra_gb": max(peak - base, 0) / 1e9}


def logprob_table(vocabs: list[int], token_counts: list[int], chunk_sizes: list[int]) -> list[dict]:
    """Every case in its own subprocess, so peaks do not mix."""
    rows = []
    for vocab in vocabs:
        for tokens in token_counts:
            for method, chunk in [("naive", 0)] + [("chunked", c) for c in chunk_sizes]:
                args = [sys.executable, __file__, "--case", method, str(vocab), str(tokens), str(chunk)]
                out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
                rows.append({"V": vocab, "T": tokens, "method": method, "chunk": chunk, **json.loads(out)})
                print(_format(rows[-1], rows), flush=True)
    return rows


def _format(row: dict, rows: list[dict]) -> str:
    naive = next(r for r in rows if r["V"] == row["V"] and r["T"] == row["T"] and r["method"] == "naive")
    label = "naive" if row["method"] == "naive" else f"chunked/{row['chunk']}"
    return (f"V={row['V']:>6} T={row['T']:>5} {label:>13}  peak +{row['peak_extra_gb']:6.2f} GB "
            f"({row['peak_extra_gb'] / max(naive['peak_extra_gb'], 1e-9):4.2f}x naive)  "
            f"{row['seconds']:6.2f} s ({row['seconds'] / naive['seconds']:4.2f}x naive)")


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
    parser.add_argument("--case", nargs=4, metavar=("METHOD", "V", "T", "CHUNK"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.case:
        method, vocab, tokens, chunk = args.case
        print(json.dumps(run_case(method, int(vocab), int(tokens), int(chunk))))
        return 0
    vocabs = [32_000] if args.quick else [32_000, 151_936]
    logprob_table(vocabs, [1024, 4096], [1024, 256])
    generation_throughput(batch=16, new_tokens=16 if args.quick else 64)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
