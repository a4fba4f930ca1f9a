"""VespoAsyncGRPOTrainer: TRL 1.16's AsyncGRPOTrainer trained on a tiny model on the CPU with vespo's loss.

What the async trainer needs on a GPU machine, and what stands in for it here (nothing else is changed):

- Attention: it loads the policy with `attn_implementation="tree_fa3"`, whose kernel is FlashAttention-3's
  `flash_attn_varlen_func`, fetched from the Hub (CUDA/ROCm only). `cpu_flash_attn_varlen` below computes the
  same variable-length causal attention in plain torch (each query segment attends to its key path, aligned
  bottom-right as FlashAttention aligns it); TRL's `tree_attention` calls it in place of the kernel
  (`packing._flash_attn`). `test_tree_attention_on_cpu_equals_the_plain_forward` checks it: the packed forward's
  log-probs equal the ordinary eager forward's per sample.
- Generation: its rollout worker asks a vLLM server (`/v1/completions`, logprobs=0) for completions and their
  sampled log-probs, and its weights reach the server over NCCL. vLLM does not run here, so the trainer gets, through
  its own `rollout_worker` and `weight_transfer` arguments (TRL's RolloutWorkerProtocol / WeightTransferProtocol),
  `LocalEngine`: a second copy of the policy that samples in a background thread, reports each sampled token's
  log-prob under the distribution it sampled from (temperature 1, no truncation: what vLLM reports), scores the
  group and forms TRL's advantages, and receives the trainer's weights at every sync. Generation runs ahead of
  training, so the behaviour policy lags the learner (max_staleness) and the importance weights are not 1.

The loss is then compared, on micro-batches the trainer trained on, with vespo's own loss computed from the
rollout samples themselves (log-probs from an eager copy of the trained model, sequence by sequence), and vespo's
`grpo` with TRL's own PPO-clip `compute_loss` on the same packed batch.
"""

from __future__ import annotations

import copy
import queue
import threading
import time

import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from transformers import AutoModelForCausalLM  # noqa: E402
from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer, async_grpo_trainer, packing  # noqa: E402
from trl.experimental.async_grpo.async_rollout_worker import RolloutSample  # noqa: E402

from vespo.integrations.trl_async import VespoAsyncGRPOTrainer, unpack  # noqa: E402
from vespo.losses import get_loss, prepare_inputs  # noqa: E402
from vespo.models import build_char_tokenizer, tiny_model  # noqa: E402

PROMPTS = ["12+3=", "ab", "sort 312:", "x"]
GENERATIONS = 4
MAX_NEW = 6


# ---- what the trainer needs on a CPU ---------------------------------------------------------------------------


def cpu_flash_attn_varlen(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=True, window_size=(-1, -1),
                          **kwargs):
    """FlashAttention's `flash_attn_varlen_func` in plain torch: segment i's queries q[cu_q[i]:cu_q[i+1]] [Lq, H, D]
    attend to its keys k[cu_k[i]:cu_k[i+1]] [Lk, Hkv, D] (Hkv divides H), causal aligned bottom-right (query j sees
    keys up to Lk - Lq + j). Returns [total_q, H, D]."""
    assert causal and tuple(window_size) == (-1, -1) and not kwargs, (window_size, kwargs)
    out = torch.empty_like(q)
    for i in range(len(cu_q) - 1):
        qs, ks, vs = q[cu_q[i]:cu_q[i + 1]], k[cu_k[i]:cu_k[i + 1]], v[cu_k[i]:cu_k[i + 1]]
        lq, lk = len(qs), len(ks)
        groups = qs.shape[1] // ks.shape[1]
        ks, vs = ks.repeat_interleave(groups, dim=1), vs.repeat_interleave(groups, dim=1)  # [Lk, H, D]
        allowed = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)  # [Lq, Lk]
        attn = torch.nn.functional.scaled_dot_product_attention(
            qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1), attn_mask=allowed, scale=softmax_scale)
        out[cu_q[i]:cu_q[i + 1]] = attn.transpose(0, 1)  # [Lq, H, D]
    return out


class _CpuKernel:
    flash_attn_varlen_func = staticmethod(cpu_flash_attn_varlen)


@pytest.fixture(scope="module", autouse=True)
def on_cpu():
    """TRL's tree attention with the CPU kernel in place of FlashAttention-3, and no peak-FLOPs lookup (it asks
    torch.cuda for the device name; None is its own answer for an unknown device: MFU metrics off). Module-wide."""
    patch = pytest.MonkeyPatch()
    patch.setattr(packing, "_flash_attn", lambda: _CpuKernel)
    patch.setattr(async_grpo_trainer, "get_peak_flops_per_device", lambda accelerator, dtype: None)
    yield
    patch.undo()


def distinct_chars(completions, **kwargs) -> list[float]:
    """Reward: the share of distinct characters in the completion (0 for an empty one)."""
    return [len(set(c)) / max(len(c), 1) for c in completions]


class LocalEngine:
    """The generation side on the CPU: a copy of the policy that samples groups in a background thread
    (TRL's RolloutWorkerProtocol) and takes the trainer's weights at each sync (its WeightTransferProtocol)."""

    def __init__(self, model_dir, tokenizer, seed: int = 0):
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
        self.tokenizer = tokenizer
        self.rollout_buffer: queue.Queue = queue.Queue(maxsize=4 * GENERATIONS)
        self.metrics_queue: queue.Queue = queue.Queue()
        self.version = 0
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.generator = torch.Generator().manual_seed(seed)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True, name="local-engine")

    # -- WeightTransferProtocol
    def init_weight_transfer(self) -> None:
        pass

    def pause(self) -> None:
        self.lock.acquire()

    def send_weights(self, iterator) -> None:
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, tensor in iterator:
                params[name].copy_(tensor)
        self.version += 1

    def resume(self) -> None:
        self.lock.release()

    def destroy(self) -> None:
        pass

    # -- RolloutWorkerProtocol
    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(timeout=30)

    def update_model_version(self, model_version: int) -> None:
        assert model_version == self.version, (model_version, self.version)

    def check_health(self, stale_after_s: float) -> None:
        if self.error is not None:
            raise RuntimeError("local engine failed") from self.error

    def _run(self) -> None:
        try:
            group_id = 0
            while not self.stopped.is_set():
                for sample in self._group(PROMPTS[group_id % len(PROMPTS)], group_id):
                    while not self.stopped.is_set():
                        try:
                            self.rollout_buffer.put(sample, timeout=0.2)
                            break
                        except queue.Full:
                            pass
                group_id += 1
        except BaseException as error:  # surfaced to the trainer by check_health
            self.error = error

    def _group(self, prompt: str, group_id: int) -> list[RolloutSample]:
        """GENERATIONS completions of `prompt` with their sampled log-probs, scored and given TRL's advantages."""
        prompt_ids = self.tokenizer(prompt)["input_ids"]
        with self.lock:
            version = self.version
            ids, logps = sample(self.model, prompt_ids, self.tokenizer.eos_token_id, self.generator)
        texts = [self.tokenizer.decode(c, skip_special_tokens=True) for c in ids]
        rewards = torch.tensor(distinct_chars(texts), dtype=torch.float64)
        advantages = (rewards - rewards.mean()) / (rewards.std(unbiased=False) + 1e-8)  # as TRL's _score_group
        out = []
        for completion, logp, advantage in zip(ids, logps, advantages.tolist()):
            out.append(RolloutSample(
                prompt=[{"role": "user", "content": prompt}], completion=[{"role": "assistant", "content": ""}],
                input_ids=torch.tensor(prompt_ids + completion).numpy(),
                completion_mask=torch.tensor([0] * len(prompt_ids) + [1] * len(completion)).numpy(),
                old_log_probs=torch.tensor([0.0] * len(prompt_ids) + logp, dtype=torch.float32).numpy(),
                advantage=advantage, model_version=version, group_id=group_id,
                metrics={"reward": float(rewards.mean()), "reward_std": float(rewards.std(unbiased=False))},
                enqueued_at=time.time()))
        return out


@torch.no_grad()
def sample(model, prompt_ids, eos_id, generator):
    """GENERATIONS completions (≤ MAX_NEW tokens, ending at eos) sampled at temperature 1 from the full softmax,
    and each sampled token's log-prob under it."""
    ids = torch.tensor([prompt_ids] * GENERATIONS)  # [G, P]
    done = torch.zeros(GENERATIONS, dtype=torch.bool)
    tokens, logps = [], []
    for _ in range(MAX_NEW):
        logp = torch.log_softmax(model(input_ids=ids).logits[:, -1].float(), dim=-1)  # [G, V]
        token = torch.multinomial(logp.exp(), 1, generator=generator)[:, 0]  # [G]
        tokens.append(token), logps.append(logp.gather(1, token[:, None])[:, 0])
        ids = torch.cat([ids, token[:, None]], dim=1)
        done |= token == eos_id
        if done.all():
            break
    completions, completion_logps = [], []
    for g in range(GENERATIONS):
        row = [int(t[g]) for t in tokens]
        n = row.index(eos_id) + 1 if eos_id in row else len(row)
        completions.append(row[:n]), completion_logps.append([float(lp[g]) for lp in logps[:n]])
    return completions, completion_logps


# ---- the trainer -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("policy")
    tokenizer = build_char_tokenizer()
    tiny_model("qwen3", "nano", tokenizer=tokenizer, seed=0).save_pretrained(path)
    return str(path)


def make_trainer(tmp_path, model_dir, **kwargs):
    tokenizer = build_char_tokenizer()
    engine = LocalEngine(model_dir, tokenizer)
    args = AsyncGRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=GENERATIONS, num_generations=GENERATIONS,
        gradient_accumulation_steps=2, max_completion_length=MAX_NEW, max_steps=3, learning_rate=5e-3,
        token_budget=0, max_staleness=2, weight_sync_steps=1, use_cpu=True, bf16=False, report_to="none",
        logging_steps=1, save_strategy="no", seed=0)
    data = datasets.Dataset.from_dict({"prompt": PROMPTS})
    return VespoAsyncGRPOTrainer(model=model_dir, reward_funcs=distinct_chars, args=args, train_dataset=data,
                                 processing_class=tokenizer, rollout_worker=engine, weight_transfer=engine, **kwargs)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, model_dir):
    """The trainer after 3 optimizer steps, and every micro-batch it trained on: (samples, packed inputs)."""
    seen = []
    patch = pytest.MonkeyPatch()
    original = VespoAsyncGRPOTrainer.compute_loss

    def recording(self, model, inputs, *args, **kwargs):
        seen.append({k: v.clone() if torch.is_tensor(v) else v for k, v in inputs.items()})
        return original(self, model, inputs, *args, **kwargs)

    packed_samples = []
    pack = packing.TreeRow.pack

    def recording_pack(row):
        packed_samples.append(list(row.samples))
        return pack(row)

    patch.setattr(VespoAsyncGRPOTrainer, "compute_loss", recording)
    patch.setattr(packing.TreeRow, "pack", recording_pack)
    try:
        trainer = make_trainer(tmp_path_factory.mktemp("async"), model_dir)
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        trainer.train()
    finally:
        patch.undo()
    assert trainer.rollout_worker.error is None, trainer.rollout_worker.error
    assert len(seen) == 6  # 3 steps x 2 accumulated micro-batches, one packed row each
    assert len(packed_samples) >= 6  # the dataloader packs ahead: the first 6 are the trained ones, in order
    return trainer, before, list(zip(packed_samples, seen))


def test_three_async_steps_train_and_log_vespo_metrics(trained):
    trainer, before, batches = trained
    assert trainer.state.global_step == 3
    changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert changed, "no parameter changed in 3 optimizer steps"
    logged = {key for entry in trainer.state.log_history for key in entry}
    assert {"is/ess", "vespo/phi_pos_mean", "kl/k1", "entropy", "sample/staleness_mean"} <= logged, sorted(logged)
    assert trainer.model_version == trainer.rollout_worker.version == 4  # the initial sync and one per step


def reference_logps(trainer, samples):
    """log π_θ [S, T] of each sample's completion tokens, from an eager copy of the trained model, sample by sample;
    the samples' own sampler log-probs [S, T], advantages [S] and mask [S, T]."""
    config = copy.deepcopy(trainer.model.config)  # from_config sets the attention on the config it is given
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    model.load_state_dict(trainer.model.state_dict())
    rows = []
    for s in samples:
        ids = torch.as_tensor(s["input_ids"])
        keep = torch.as_tensor(s["completion_mask"])[1:].bool()  # [L-1] positions whose next token is trained
        logits = model(input_ids=ids[None]).logits[0, :-1]  # [L-1, V]
        logp = torch.log_softmax(logits.float(), -1).gather(1, ids[1:, None])[:, 0]  # [L-1]
        rows.append((logp[keep], torch.as_tensor(s["old_log_probs"])[1:][keep]))
    T = max(len(r[0]) for r in rows)
    logp = torch.stack([torch.nn.functional.pad(r[0], (0, T - len(r[0]))) for r in rows])  # [S, T]
    old = torch.stack([torch.nn.functional.pad(r[1], (0, T - len(r[1]))) for r in rows])  # [S, T]
    mask = torch.stack([torch.arange(T) < len(r[0]) for r in rows])  # [S, T]
    advantages = torch.tensor([s["advantage"] for s in samples], dtype=torch.float32)  # [S]
    return model, logp, old, advantages, mask


def use_loss(trainer, name, **options):
    """Switch the trained trainer's loss (the rows kept for the step's metrics are dropped: another loss's)."""
    trainer.vespo_spec, trainer.vespo_config = get_loss(name), get_loss(name).config_cls(**options)
    trainer.__dict__.pop("_vespo_pending", None)


@pytest.mark.parametrize("loss", ["vespo", "grpo"])
def test_loss_and_gradient_equal_vespos_own_on_the_samples(trained, loss):
    """On each micro-batch the trainer trained on: the plug-in's loss (packed forward, tokens unpacked, the sampler's
    log-probs as μ) equals vespo's own loss on the rollout samples as the engine produced them (eager forward per
    sample), with the trainer's normalizer (micro-batch tokens x accumulation steps); the gradients too."""
    trainer, _, batches = trained
    spec = get_loss(loss)
    use_loss(trainer, loss)
    try:
        stale = 0.0
        for samples, inputs in batches:
            model, logp, old, advantages, mask = reference_logps(trainer, samples)
            x = prepare_inputs(logp, old, advantages, mask, bypass=True)
            ref = spec.fn(x, spec.config_cls(), normalizer=float(mask.sum()) * 2).loss
            ours = trainer.compute_loss(trainer.model, inputs)
            torch.testing.assert_close(ours, ref, rtol=2e-5, atol=1e-7)
            g_ours = torch.autograd.grad(ours, list(trainer.model.parameters()))
            g_ref = torch.autograd.grad(ref, list(model.parameters()))
            for a, b in zip(g_ours, g_ref):
                assert (a - b).abs().max() <= 1e-4 * b.abs().max() + 1e-9
            stale = max(stale, float(((logp.detach() - old).abs() * mask).max()))
        assert stale > 1e-2  # off-policy batches: W differs from 1
    finally:
        use_loss(trainer, "vespo")


def test_grpo_equals_trls_own_ppo_clip_on_the_packed_batch(trained):
    """vespo's grpo (no dual clip, ε = TRL's 0.2) through the plug-in equals AsyncGRPOTrainer's own compute_loss on the
    same packed micro-batches: the unpacking, μ and the normalizer are TRL's."""
    trainer, _, batches = trained
    use_loss(trainer, "grpo", dual_clip_c=None)
    try:
        for _, inputs in batches:
            ours = trainer.compute_loss(trainer.model, inputs)
            theirs = AsyncGRPOTrainer.compute_loss(trainer, trainer.model, inputs)
            torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-8)
    finally:
        use_loss(trainer, "vespo")


def test_tree_attention_on_cpu_equals_the_plain_forward(trained):
    """The CPU kernel standing in for FlashAttention-3: TRL's packed tree forward (two samples sharing a prompt) gives
    each trained token the log-prob the eager forward of its own sample gives."""
    trainer, _, batches = trained
    samples, inputs = batches[0]
    with torch.no_grad():
        packed, _, _ = trainer._trained_token_logps(trainer.model, inputs)
        segment = inputs["segment_id"][inputs["token_index"] >= 0]
        packed, mask = unpack(segment, packed)
        _, eager, _, _, ref_mask = reference_logps(trainer, samples)
    assert torch.equal(mask, ref_mask)
    assert len({tuple(torch.as_tensor(s["input_ids"])[:3].tolist()) for s in samples}) < len(samples)  # shared prefix
    torch.testing.assert_close(packed, eager, rtol=0, atol=2e-5)


def test_unpack_lays_out_samples_in_order():
    segment = torch.tensor([0, 0, 0, 1, 2, 2])
    values = torch.arange(6.0, requires_grad=True)
    rows, mask = unpack(segment, values)
    assert rows.tolist() == [[0, 1, 2], [3, 0, 0], [4, 5, 0]]
    assert mask.tolist() == [[True] * 3, [True, False, False], [True, True, False]]
    rows.sum().backward()
    assert values.grad.tolist() == [1.0] * 6


def test_truncating_rollout_correction_is_refused(tmp_path, model_dir):
    """μ is the sampler's log-probs, so a truncating correction (tis_*) has nothing to correct, and IcePop's
    π_old/π_rollout has no π_old: both refused when built."""
    config = get_loss("vespo").config_cls(rollout_correction={"mode": "tis_token", "threshold": 2.0})
    with pytest.raises(ValueError, match="loss_config: .*tis_token"):
        make_trainer(tmp_path, model_dir, loss_config=config)
    config = get_loss("vespo").config_cls(rollout_correction={"mode": "icepop"})
    with pytest.raises(ValueError, match="loss_config: .*rollout_correction.mode=icepop cannot act"):
        make_trainer(tmp_path, model_dir, loss_config=config)
    with pytest.raises(TypeError, match="loss_config for loss 'vespo' must be a VespoConfig"):
        make_trainer(tmp_path, model_dir, loss_config=get_loss("grpo").config_cls())
