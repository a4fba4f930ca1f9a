"""The Hugging Face rollout engine: batched sampling with a KV cache and its own decode loop.

The engine owns a private copy of the policy (optionally in bfloat16 or with another attention
implementation, which is how train–inference mismatch is produced on purpose), or, with
``share_weights``, runs the trainer's own module (in eval mode while it samples; sync mode, where
nothing trains meanwhile: no second copy of the weights, nothing to push). Each step it
samples from ``sampling_logprobs`` and records the exact log-prob of the sampled token, the
policy version that sampled it and, with ``record_routing`` on a MoE model, the experts routed
at every position it runs, prompt included (rollout routing replay, R3; docs/router_replay.md).
Generation can be split: ``start`` → ``advance`` (repeatedly) → ``finish``; when ``load_weights``
runs between two ``advance`` calls, the KV cache is rebuilt from the tokens so far under the new
weights before decoding continues. That re-prefill also re-records the routing of every position
it runs: the routing kept is the newest weights', the one the rebuilt cache was computed with.

On a policy with LoRA adapters (vespo.models.lora), an engine with its own copy generates with the adapters merged
into its weights (W + (alpha / r) B A, formed in float32 from the frozen W, which it keeps by reference to the
policy's own tensor where they share a device, so no second copy in one process): a decode step runs the plain
model's matmuls, not peft's adapter path beside each of them. Its adapters stay in float32 and every push merges
again from W. An engine sharing the trainer's module runs the adapters unmerged (merging would write the trainer's
frozen weights).

Two shortcuts that change nothing but speed (tests/rollout/test_hf_fast.py): the first prefill
runs each distinct prompt once and copies its cache to the G rows of its group, and rows that
produced EOS leave the decode batch (they still draw their random numbers, so every row samples
what it would have sampled in the full batch).
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from vespo.models.kv_cache import run_with_cache
from vespo.models.loading import resolve_dtype
from vespo.models.logprobs import distinct_rows, positions_from_mask
from vespo.models.lora import adapter_state, frozen_bases, has_lora, is_adapter_key, lora_layers, merge_adapters
from vespo.models.moe import is_moe, moe_routers, record_routing, stack_routing
from vespo.rollout.base import SamplingParams, sample_tokens, sampling_logprobs
from vespo.types import Rollout

DROP_FRACTION = 8  # finished rows leave the decode batch once they are >= 1/8 of it


@dataclass
class GenerationState:
    """A batch mid-generation. Column t of the response lists is the t-th sampled token."""

    prompt_ids: Tensor  # [B, P] int64, left-padded
    prompt_mask: Tensor  # [B, P] int64
    sampling: SamplingParams
    generator: torch.Generator
    tokens: list[Tensor] = field(default_factory=list)  # T x [B] int64 (pad after a row ended)
    logprobs: list[Tensor] = field(default_factory=list)  # T x [B] float32
    versions: list[Tensor] = field(default_factory=list)  # T x [B] int64
    routing: list[Tensor] = field(default_factory=list)  # [B, S_i, L, K] int64 per forward since the last prefill
    alive: Tensor | None = None  # [B] bool, row has not produced EOS
    cache: DynamicCache | None = None
    rows: Tensor | None = None  # [b] int64: the batch rows the cache holds, in cache order
    cache_version: int = -1  # engine version the cache was built with
    next_logits: Tensor | None = None  # [B, V] float32, predicting the next token; None = decode due

    @property
    def n_generated(self) -> int:
        return len(self.tokens)

    @property
    def done(self) -> bool:
        return not bool(self.alive.any()) or self.n_generated >= self.sampling.max_new_tokens


class HFEngine:
    """Rollout engine on a Hugging Face causal LM; implements ``RolloutEngine``."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        dtype: str | torch.dtype = "float32",
        attn_implementation: str | None = None,
        record_routing: bool = False,
        device: torch.device | str = "cpu",
        share_weights: bool = False,
    ) -> None:
        if tokenizer.pad_token_id is None or tokenizer.eos_token_id is None:
            raise ValueError("HFEngine needs a tokenizer with both pad_token_id and eos_token_id set")
        self.device = torch.device(device)
        self.shares_weights = share_weights
        if share_weights:  # the trainer's own module: its weights are current whenever nothing trains
            if (attn_implementation is not None or resolve_dtype(dtype) != model.dtype
                    or model.device.type != self.device.type):
                raise ValueError(f"HFEngine(share_weights=True) runs the model as it is ({model.dtype} on "
                                 f"{model.device}); it cannot change its dtype, device or attention kernel")
            self.model = model
        else:
            self.model = copy.deepcopy(model).to(self.device, resolve_dtype(dtype)).eval()  # the engine's own weights
            self.model.requires_grad_(False)
            if attn_implementation is not None:
                self.model.set_attn_implementation(attn_implementation)
        # LoRA on an own copy: each adapted module's frozen W (the policy's tensor where it is on this device), the
        # adapters in float32 (the learner's values exactly), merged into the weights the engine decodes with
        self.bases: dict[str, Tensor] | None = None
        if has_lora(model) and not share_weights:
            self.bases = {name: w.to(self.device) for name, w in frozen_bases(model).items()}
            for layer in lora_layers(self.model).values():
                layer.lora_A.float()
                layer.lora_B.float()
            self.model.load_state_dict(adapter_state(model), strict=False)
            merge_adapters(self.model, self.bases)
        self.pad_id = int(tokenizer.pad_token_id)
        self.eos_id = int(tokenizer.eos_token_id)
        self.record_routing = record_routing and is_moe(self.model)
        if self.record_routing:
            moe_routers(self.model)  # an MoE family router replay does not know stops here, named
        self._version = 0

    @property
    def version(self) -> int:
        return self._version

    def load_weights(self, state_dict: dict[str, Tensor], version: int) -> None:
        """Copy trainer weights in (cast to the engine dtype); every key must match, or, on a model with LoRA
        adapters (vespo.models.lora), a state dict of adapter keys only replaces all the adapters and keeps the
        frozen base. An engine sharing the trainer's module given that module's own tensors has nothing to copy."""
        if version < self._version:
            raise ValueError(f"load_weights version {version} is older than the engine's {self._version}")
        if self.shares_weights and _is_own_state(self.model, state_dict):
            self._version = int(version)
            return
        result = self.model.load_state_dict(state_dict, strict=False)
        adapters_only = bool(state_dict) and all(map(is_adapter_key, state_dict))
        frozen = {k for k in result.missing_keys if not is_adapter_key(k)} if adapters_only else set()
        missing = [k for k in result.missing_keys if k not in _tied_keys(self.model) and k not in frozen]
        if missing or result.unexpected_keys:
            raise KeyError(f"load_weights: missing keys {missing[:5]}, unexpected keys {result.unexpected_keys[:5]}")
        if self.bases is not None:  # a new base replaces the kept W (by reference); then merge again from W
            for name in self.bases:
                key = f"{name}.base_layer.weight"
                if key in state_dict:
                    self.bases[name] = state_dict[key].detach().to(self.device)
            merge_adapters(self.model, self.bases)
        self._version = int(version)

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingParams, seed: int | None = None) -> Rollout:
        state = self.start(prompt_ids, sampling, seed)
        while not self.advance(state, sampling.max_new_tokens):
            pass
        return self.finish(state)

    def start(self, prompt_ids: list[list[int]], sampling: SamplingParams, seed: int | None = None) -> GenerationState:
        ids, mask = self._left_pad(prompt_ids)  # [B, P], [B, P]
        generator = torch.Generator(device=ids.device)
        generator.manual_seed(seed if seed is not None else int(torch.randint(2**62, ()).item()))
        alive = torch.ones(ids.shape[0], dtype=torch.bool, device=ids.device)  # [B]
        return GenerationState(prompt_ids=ids, prompt_mask=mask, sampling=sampling, generator=generator, alive=alive)

    @torch.inference_mode()  # lighter than no_grad per op; finish() turns the state into normal tensors
    def advance(self, state: GenerationState, n_tokens: int) -> bool:
        with _eval_mode(self.model):  # a shared trainer module may be in training mode
            for _ in range(n_tokens):
                if state.done:
                    break
                self._sample_step(state, self._next_logits(state))
        return state.done

    def finish(self, state: GenerationState) -> Rollout:
        B = state.prompt_ids.shape[0]
        if state.n_generated == 0:
            raise ValueError("finish() before any token was generated; call advance() first")
        response_ids = torch.stack(state.tokens, dim=1)  # [B, T]
        ended = response_ids == self.eos_id
        # a row's mask covers its tokens up to and including its first EOS
        response_mask = (ended.long().cumsum(1) - ended.long() == 0).float()  # [B, T]
        real = torch.cat([state.prompt_mask > 0, response_mask > 0], dim=1)  # [B, P+T]
        routed = _routing_of_positions(state.routing, real)  # [B, P+T, L, K] or None
        cpu = lambda t: None if t is None else t.cpu()  # noqa: E731  (a Rollout always lives on the CPU)
        return Rollout(
            prompt_ids=cpu(state.prompt_ids),
            prompt_mask=cpu(state.prompt_mask),
            response_ids=cpu(response_ids.masked_fill(response_mask == 0, self.pad_id)),
            response_mask=cpu(response_mask),
            logprobs=cpu(torch.stack(state.logprobs, dim=1) * response_mask),  # [B, T]
            truncated=cpu(state.alive.clone().reshape(B)),
            version=self._version,
            token_versions=cpu(torch.stack(state.versions, dim=1) * response_mask.long()),  # [B, T]
            routed_experts=cpu(routed),
        )

    # -- decoding ---------------------------------------------------------------------------

    def _next_logits(self, state: GenerationState) -> Tensor:
        """Logits [B, V] for the next token: re-prefill after a weight update, else decode."""
        if state.cache_version != self._version:
            self._prefill(state)
        elif state.next_logits is None:
            self._decode(state)
        return state.next_logits

    def _prefill(self, state: GenerationState) -> None:
        """Run prompt + tokens so far through the current weights, building a fresh cache of every row.

        The first prefill runs each distinct prompt once (a group's G copies share it) and copies
        its cache rows; a re-prefill after a weight update runs every row's own tokens.
        """
        ids, mask = state.prompt_ids, state.prompt_mask
        if state.tokens:
            ids = torch.cat([ids, torch.stack(state.tokens, dim=1)], dim=1)  # [B, P+t]
            mask = torch.cat([mask, torch.ones_like(ids[:, mask.shape[1]:])], dim=1)
            distinct, copies = None, None
        else:
            distinct, copies = distinct_rows(torch.cat([ids, mask], dim=1))  # [U], [B]
        state.cache = DynamicCache(config=self.model.config)
        if distinct is None:
            routing = self._forward(state, ids, mask, positions_from_mask(mask))
        else:
            routing = self._forward(state, ids[distinct], mask[distinct], positions_from_mask(mask[distinct]))
            state.cache.batch_select_indices(copies)
            state.next_logits = state.next_logits[copies]
            routing = None if routing is None else routing[copies]
        if routing is not None:
            state.routing = [routing]  # every position so far, re-recorded under the current weights
        state.rows = torch.arange(ids.shape[0])
        state.cache_version = self._version

    def _decode(self, state: GenerationState) -> None:
        """One cached step on the last sampled token of every row the cache holds."""
        self._drop_finished_rows(state)
        B, P, rows = state.prompt_ids.shape[0], state.prompt_mask.shape[1], state.rows
        last = state.tokens[-1][rows, None]  # [b, 1]
        mask = torch.ones(len(rows), P + state.n_generated, dtype=torch.long, device=last.device)  # [b, P+t]
        mask[:, :P] = state.prompt_mask[rows]
        position = state.prompt_mask[rows].sum(1, keepdim=True) + state.n_generated - 1  # [b, 1]
        routing = self._forward(state, last, mask, position)
        if len(rows) < B:  # rows that left the batch get logits 0: sampled from, then discarded as padding
            state.next_logits = state.next_logits.new_zeros(B, state.next_logits.shape[1]).index_copy_(
                0, rows, state.next_logits)
        if routing is not None:
            state.routing.append(routing)

    def _drop_finished_rows(self, state: GenerationState) -> None:
        """Shrink the decode batch to the rows still generating once enough of them have finished.

        Copying the cache costs about one decode step's cache append, so rows are dropped only when
        at least 1/DROP_FRACTION of the batch has finished. While routing is recorded every row stays,
        so the record covers every real token, a row's EOS included.
        """
        if self.record_routing:
            return
        alive = state.alive[state.rows]  # [b]
        n_alive = int(alive.sum())
        if len(state.rows) - n_alive >= max(1, len(state.rows) // DROP_FRACTION):
            keep = alive.nonzero().squeeze(1)  # [b'] positions in the cache
            state.cache.batch_select_indices(keep)
            state.rows = state.rows[keep]

    def _forward(self, state: GenerationState, ids: Tensor, mask: Tensor, positions: Tensor) -> Tensor | None:
        """Run the engine model and store last-position logits on the state.

        Returns the experts routed at the S positions run, [B, S, L, K], when recording routing.
        """
        routing = None
        if self.record_routing:
            with record_routing(self.model) as records:
                out = self._call_model(state, ids, mask, positions)
            routing = stack_routing(records, ids.shape[0], ids.shape[1])  # [B, S, L, K]
        else:
            out = self._call_model(state, ids, mask, positions)
        state.next_logits = out.float()  # [B, V]
        return routing

    def _call_model(self, state: GenerationState, ids: Tensor, mask: Tensor, positions: Tensor) -> Tensor:
        """Logits [B, V] of the last position: the decoder, then the LM head on a [B, H] matrix.

        The head takes the last hidden state as one contiguous 2-D matrix: handed a 3-D view (what the
        causal LM's own forward slices with logits_to_keep), CPU matmul in bfloat16 runs a batched product
        that copies the head's weight once per row (B x 56 MB for SmolLM2: 14 GB and 3/4 of the time of a
        256-row prefill, measured)."""
        body = getattr(self.model, self.model.base_model_prefix)
        out = run_with_cache(body, state.cache, ids.shape[1], input_ids=ids, attention_mask=mask,
                             position_ids=positions, use_cache=True)
        return self.model.get_output_embeddings()(out.last_hidden_state[:, -1].contiguous())

    def _sample_step(self, state: GenerationState, logits: Tensor) -> None:
        """Sample one token per row from the processed distribution; record its log-prob."""
        logp_all = sampling_logprobs(logits, state.sampling)  # [B, V]
        token = sample_tokens(logp_all, state.generator)  # [B]
        token = torch.where(state.alive, token, self.pad_id)
        logp = logp_all.gather(1, token[:, None]).squeeze(1)  # [B]
        state.tokens.append(token)
        state.logprobs.append(torch.where(state.alive, logp, 0.0))
        state.versions.append(torch.full_like(token, self._version))
        state.alive = state.alive & (token != self.eos_id)
        state.next_logits = None

    def _left_pad(self, prompt_ids: list[list[int]]) -> tuple[Tensor, Tensor]:
        """Validate prompts and left-pad them: ids [B, P], mask [B, P]."""
        if not prompt_ids:
            raise ValueError("prompt_ids is empty: give at least one prompt")
        vocab = self.model.config.vocab_size
        for i, row in enumerate(prompt_ids):
            if len(row) == 0:
                raise ValueError(f"prompt_ids[{i}] is empty")
            if min(row) < 0 or max(row) >= vocab:
                raise ValueError(f"prompt_ids[{i}] has a token id outside [0, {vocab})")
        P = max(len(row) for row in prompt_ids)
        ids = torch.full((len(prompt_ids), P), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompt_ids), P), dtype=torch.long)
        for i, row in enumerate(prompt_ids):
            ids[i, P - len(row):] = torch.tensor(row, dtype=torch.long)
            mask[i, P - len(row):] = 1
        return ids.to(self.device), mask.to(self.device)


def _routing_of_positions(chunks: list[Tensor], real: Tensor) -> Tensor | None:
    """The recorded routing of every position of cat(prompt, response): [B, P+T, L, K].

    real [B, P+T] bool marks real tokens. Padding and positions the engine never ran (it never
    feeds back a batch's last sampled token) read -1, no record: a replaying forward lets the live
    router choose there, and no log-prob depends on them.
    """
    if not chunks:
        return None
    routed = torch.cat(chunks, dim=1)  # [B, S, L, K], S <= P+T
    missing = routed.new_full((routed.shape[0], real.shape[1] - routed.shape[1], *routed.shape[2:]), -1)
    return torch.cat([routed, missing], dim=1).masked_fill(~real[:, :, None, None], -1)


@contextmanager
def _eval_mode(model: PreTrainedModel):
    training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(training)


def _is_own_state(model: PreTrainedModel, state_dict: dict[str, Tensor]) -> bool:
    """Whether every tensor of ``state_dict`` is ``model``'s own (the same storage), keys and all."""
    own = model.state_dict()
    return own.keys() == state_dict.keys() and all(
        state_dict[k].data_ptr() == v.data_ptr() and state_dict[k].shape == v.shape for k, v in own.items())


def _tied_keys(model: PreTrainedModel) -> set[str]:
    """Parameter names that alias another parameter (tied embeddings) and may be absent."""
    seen: dict[int, str] = {}
    tied: set[str] = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            tied.add(name)
        seen.setdefault(id(p), name)
    return tied | {"lm_head.weight"} if model.config.tie_word_embeddings else tied
