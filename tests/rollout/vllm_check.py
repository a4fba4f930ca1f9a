"""Checks of vespo's vLLM engine on the CPU, run inside the vLLM virtualenv (.venv-vllm) by test_vllm_engine.py.

    .venv-vllm/bin/python tests/rollout/vllm_check.py engine sync   # modes in turn; one JSON line {mode: result}

    engine   the engine on a tiny model: log-probs, pushes, restore, partial rollouts
    sync     a short sync training run with rollout.engine=vllm
    async    the same in async mode (a Ray rollout worker)
    real_engine, real_sync, real_async    the same on SmolLM2-135M-Instruct (float32 engine; slow)

Each mode loads vLLM once (a load compiles the model: about a minute on a loaded 2-core machine). The tiny model
is the xs Qwen3 (head_dim 32: vLLM's CPU attention has no kernel for the nano size's 16) with tied embeddings.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from vespo.models import build_char_tokenizer, response_logprobs, tiny_model  # noqa: E402
from vespo.rollout import SamplingParams, VLLMEngine  # noqa: E402


def recompute(model, rollout, sampling: SamplingParams) -> torch.Tensor:
    """vespo's log-probs [B, T] of the rollout's tokens under ``model`` and ``sampling``'s truncation."""
    with torch.no_grad():
        logp, _ = response_logprobs(model, rollout.prompt_ids, rollout.prompt_mask, rollout.response_ids,
                                    rollout.response_mask, temperature=sampling.temperature, top_k=sampling.top_k,
                                    top_p=sampling.top_p, with_entropy=False)
    return logp


def gap(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    """Largest |a - b| over the masked tokens."""
    return float(((a - b).abs() * mask).max())


def perturbed(model, generator: torch.Generator, names: list[str] | None = None, scale: float = 0.5):
    """A copy of ``model`` whose named tensors (all when None) moved by noise of ``scale`` x their own spread."""
    out = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in out.named_parameters():
            if names is None or name in names:
                spread = p.std() if p.numel() > 1 and float(p.std()) > 0 else p.abs().mean() + 1.0
                p.add_(torch.randn(p.shape, generator=generator) * scale * spread)
    return out


def engine_check() -> dict:
    tok = build_char_tokenizer()
    model = tiny_model("qwen3", "xs", tokenizer=tok)
    t0 = time.perf_counter()
    engine = VLLMEngine(model, tok, dtype="float32")
    out: dict = {"load_s": time.perf_counter() - t0, "tied": bool(model.config.tie_word_embeddings),
                 "model_copy_left": Path(engine.llm.model_config.model).exists()}  # the directory vLLM loaded
    prompts = [tok.encode(p) for p in ("12+3=", "7+45=", "9+9=", "30+1=")] * 2
    plain = SamplingParams(max_new_tokens=12)
    truncated = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, max_new_tokens=12)

    # 1. generation: the engine's processed log-probs against vespo's recompute, plain and truncated sampling
    first = engine.generate(prompts, plain, seed=0)
    out["tokens"] = int(first.response_mask.sum())
    out["gen_gap"] = gap(first.logprobs, recompute(model, first, plain), first.response_mask)
    trunc = engine.generate(prompts, truncated, seed=1)
    out["trunc_gap"] = gap(trunc.logprobs, recompute(model, trunc, truncated), trunc.response_mask)
    out["trunc_gap_untruncated"] = gap(trunc.logprobs, recompute(model, trunc, SamplingParams(temperature=0.7)),
                                       trunc.response_mask)  # the truncation did act on these tokens

    # 2. a push of every tensor at once, timed; the tied head follows the embeddings
    g = torch.Generator().manual_seed(0)
    new = perturbed(model, g)
    state = {k: v.detach().clone() for k, v in new.state_dict().items()}
    t0 = time.perf_counter()
    engine.load_weights(state, 1)
    out["push_s"] = time.perf_counter() - t0
    after = engine.generate(prompts, plain, seed=0)
    out["push_gap_new"] = gap(after.logprobs, recompute(new, after, plain), after.response_mask)
    out["push_gap_old"] = gap(after.logprobs, recompute(model, after, plain), after.response_mask)
    stale_head = copy.deepcopy(new)
    stale_head.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())  # new body, old head
    out["push_gap_stale_head"] = gap(after.logprobs, recompute(stale_head, after, plain), after.response_mask)

    # 3. one tensor at a time: each push moves exactly that tensor, and the engine follows it
    per_tensor, current, version = {}, new, 1
    for name, _ in new.named_parameters():
        moved = perturbed(current, g, [name])
        version += 1
        engine.load_weights({k: v.detach().clone() for k, v in moved.state_dict().items()}, version)
        r = engine.generate(prompts[:4], SamplingParams(max_new_tokens=4), seed=version)
        per_tensor[name] = {"gap_new": gap(r.logprobs, recompute(moved, r, plain), r.response_mask),
                            "gap_before": gap(r.logprobs, recompute(current, r, plain), r.response_mask)}
        current = moved
    out["per_tensor"] = per_tensor

    # 4. the old weights pushed back restore the samples
    version += 1
    engine.load_weights({k: v.detach().clone() for k, v in model.state_dict().items()}, version)
    back = engine.generate(prompts, plain, seed=0)
    out["restored_tokens_equal"] = bool(torch.equal(back.response_ids, first.response_ids))
    out["restored_logprob_gap"] = gap(back.logprobs, first.logprobs, first.response_mask)

    # 5. a partial rollout continues under the weights pushed mid-way
    state = engine.start(prompts, plain, seed=3)
    engine.advance(state, 5)
    version += 1
    engine.load_weights({k: v.detach().clone() for k, v in new.state_dict().items()}, version)
    engine.advance(state, plain.max_new_tokens)
    part = engine.finish(state)
    early = part.response_mask * (part.token_versions == version - 1)
    late = part.response_mask * (part.token_versions == version)
    out["partial"] = {"early_tokens": int(early.sum()), "late_tokens": int(late.sum()),
                      "early_gap_old": gap(part.logprobs, recompute(model, part, plain), early),
                      "late_gap_new": gap(part.logprobs, recompute(new, part, plain), late),
                      "late_gap_old": gap(part.logprobs, recompute(model, part, plain), late)}

    # 6. a seeded batch whose prompts exceed vLLM's CPU default token budget per step (4096): 160 x 40 tokens
    version += 1
    engine.load_weights({k: v.detach().clone() for k, v in model.state_dict().items()}, version)
    big = [tok.encode(f"{i:02d}" + "1234567890+" * 3 + "12345=") for i in range(80)] * 2
    wide = engine.generate(big, SamplingParams(max_new_tokens=4), seed=5)
    out["big_batch"] = {"rows": len(big), "prompt_tokens": sum(map(len, big)), "tokens": int(wide.response_mask.sum()),
                        "gap": gap(wide.logprobs, recompute(model, wide, plain), wide.response_mask)}
    return out


SMOL = "offline:smollm2-135m-instruct"
# the real model's short run (tests/trainer/test_real_model.py's), float32 engine so the mismatch is rounding alone
REAL_RUN = [f"model.path={SMOL}", "task.name=rg:chain_sum",
            "task.options={min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1}", "task.train_size=64",
            "task.eval_size=2", "rollout.group_size=4", "rollout.max_new_tokens=16", "staleness.n=2",
            "staleness.minibatch_prompts=1", "warmstart.enabled=false", "optim.lr=1e-5", "run.progress=false",
            "run.loggers=[jsonl]", "run.threads=1", "run.checkpoint_every=1", "run.updates=2",
            "rollout.engine=vllm", "rollout.engine_dtype=float32"]


def real_engine_check() -> dict:
    """The engine on SmolLM2-135M-Instruct in float32: log-probs, a push of every tensor (timed), the tied head."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vespo.models.sources import offline_model_dir

    path = offline_model_dir(SMOL.split(":", 1)[1])
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    t0 = time.perf_counter()
    engine = VLLMEngine(path, tok, dtype="float32")
    out: dict = {"load_s": time.perf_counter() - t0, "tied": bool(model.config.tie_word_embeddings)}
    messages = [[{"role": "user", "content": f"What is {a} + {b}? Put the final answer in \\boxed{{}}."}]
                for a, b in ((2, 3), (14, 7), (30, 12), (5, 9))]
    prompts = [list(tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
               for m in messages] * 2
    plain = SamplingParams(max_new_tokens=16)
    first = engine.generate(prompts, plain, seed=0)
    out["tokens"] = int(first.response_mask.sum())
    out["gen_gap"] = gap(first.logprobs, recompute(model, first, plain), first.response_mask)
    new = perturbed(model, torch.Generator().manual_seed(0), scale=0.05)
    state = {k: v.detach().clone() for k, v in new.state_dict().items()}
    pushes = []
    for version in (1, 2, 3):
        t0 = time.perf_counter()
        engine.load_weights(state, version)
        pushes.append(time.perf_counter() - t0)
    out["push_s"] = sorted(pushes)[1]
    after = engine.generate(prompts, plain, seed=0)
    out["push_gap_new"] = gap(after.logprobs, recompute(new, after, plain), after.response_mask)
    out["push_gap_old"] = gap(after.logprobs, recompute(model, after, plain), after.response_mask)
    stale_head = copy.deepcopy(new)
    stale_head.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    out["push_gap_stale_head"] = gap(after.logprobs, recompute(stale_head, after, plain), after.response_mask)
    engine.load_weights({k: v.detach().clone() for k, v in model.state_dict().items()}, 4)
    back = engine.generate(prompts, plain, seed=0)
    out["restored_tokens_equal"] = bool(torch.equal(back.response_ids, first.response_ids))
    out["restored_logprob_gap"] = gap(back.logprobs, first.logprobs, first.response_mask)
    return out


def digit_share(completion: str, ground_truth: str) -> float:
    """The share of digits in a completion: a reward a random tiny model already varies in (a group's responses
    differ, so its advantages are not 0 and the learner moves the weights the engine then has to follow)."""
    return sum(c.isdigit() for c in completion) / max(1, len(completion))


def run_check(mode: str) -> dict:
    """A short training run with rollout.engine=vllm on the xs Qwen3 (1-digit addition prompts, no warm start), or on
    SmolLM2-135M-Instruct for the real_ modes; its run directory is removed once read."""
    with tempfile.TemporaryDirectory(prefix=f"vespo-vllm-{mode}-") as tmp:
        return _short_run(mode, Path(tmp))


def _short_run(mode: str, out_dir: Path) -> dict:
    from safetensors.torch import load_file

    from vespo.config import load_config
    from vespo.metrics import read_jsonl
    from vespo.rundir import VERSIONS
    from vespo.trainer import train

    real = mode.startswith("real_")
    mode = mode.removeprefix("real_")
    tiny = ["model.size=xs", "task.name=addition", "task.options={digits: 1}", "task.train_size=200",
            "task.eval_size=8", "task.reward=vllm_check:digit_share", "rollout.prompts_per_step=4",
            "rollout.group_size=4", "staleness.n=2", "rollout.engine=vllm", "rollout.engine_dtype=float32",
            "warmstart.enabled=false", "optim.lr=1e-2", "run.updates=4", "run.progress=false", "run.loggers=[jsonl]",
            "run.threads=1", "run.checkpoint_every=1"]
    overrides = (REAL_RUN if real else tiny) + [f"run.out_dir={out_dir}", f"run.mode={mode}"]
    if mode == "async":
        # every update pushed and no row sampled ahead of the learner: each mini-batch's behaviour log-probs are the
        # pushed weights' own, so the mismatch against the learner's recompute is rounding alone
        overrides += ["async.chunk_tokens=2", "async.sync_every=1", "async.max_staleness=0",
                      "async.stall_timeout_s=300"]
    t0 = time.perf_counter()
    summary = train(load_config(None, overrides))
    rows = list(read_jsonl(out_dir / "metrics.jsonl"))
    if real:
        from vespo.models.sources import offline_model_dir

        start = load_file(offline_model_dir(SMOL.split(":", 1)[1]) / "model.safetensors")
    else:
        start = tiny_model("qwen3", "xs", tokenizer=build_char_tokenizer(), seed=0).state_dict()
    trained = load_file(out_dir / "policy" / "model.safetensors")
    moved = max(float((trained[k] - v).abs().max()) for k, v in start.items() if k in trained)
    out = {"run_s": time.perf_counter() - t0, "status": summary.get("status"),
           "version": summary.get("policy_version"),
           "mismatch_max": [r["mismatch/abs_diff_max"] for r in rows if "mismatch/abs_diff_max" in r],
           "checkpoints": sorted(p.name for p in (out_dir / "checkpoints").iterdir())
           if (out_dir / "checkpoints").exists() else [],
           "weights_moved": moved}
    if mode == "async":
        # per mini-batch (ticket): the learner's version when it trained on it, and the versions the worker's
        # engine stamped on its tokens (the version of the weights it last loaded)
        tickets = list(read_jsonl(out_dir / VERSIONS))
        out["weight_pushes"] = summary.get("weight_pushes")
        out["tickets"] = [{"ticket": t["ticket"], "learner_version": t["learner_version"],
                           "token_version_min": min(t["versions"]), "token_version_max": max(t["versions_max"])}
                          for t in tickets]
    return out


if __name__ == "__main__":
    results = {}
    for mode in sys.argv[1:]:  # several modes run one after the other in this process
        t0 = time.perf_counter()
        checks = {"engine": engine_check, "real_engine": real_engine_check}
        results[mode] = checks[mode]() if mode in checks else run_check(mode)
        results[mode]["wall_s"] = time.perf_counter() - t0
    print(json.dumps(results))
