#!/usr/bin/env bash
# A short real run on a CUDA GPU, for a person who has one: the trainer on the GPU with the HF
# rollout engine, the sharded learner (FSDP2 over NCCL, one rank per GPU found), then the vLLM
# engine on the policy the first run wrote (a small local checkpoint, no downloads). Prints reward,
# engine-vs-trainer mismatch and tokens/s of each, and the sharded learner's bench figures.
#
# Usage: bash scripts/gpu_check.sh [OUT_DIR]        (default runs/gpu_check; needs torch with CUDA;
#        the vLLM part runs only where `import vllm` works: pip install 'vespo[vllm]')
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/gpu_check}
PY=${PYTHON:-python}
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print('GPU:', torch.cuda.get_device_name(0))"
rm -rf "$OUT"
COMMON=(task.name=addition "task.options={digits: 2}" rollout.prompts_per_step=64 rollout.group_size=8
        staleness.n=4 optim.lr=1e-4 run.progress=false "run.loggers=[jsonl]" run.checkpoint_every=0
        warmstart.cache_dir="$OUT/warmstart" model.device=cuda rollout.device=cuda)

report() {  # reward, mismatch and throughput of one run directory
  "$PY" - "$1" <<'PY'
import json, sys
from pathlib import Path
run = Path(sys.argv[1])
summary = json.loads((run / "summary.json").read_text())
rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
mean = lambda key: sum(r[key] for r in rows if key in r) / max(1, sum(key in r for r in rows))
print(f"{run.name}: reward {summary['train_reward_first']:.3f} -> {summary['train_reward_final']:.3f} (training), "
      f"held-out greedy {summary['eval_before'].get('reward_greedy', float('nan')):.3f} -> "
      f"{summary['eval_after'].get('reward_greedy', float('nan')):.3f}; mismatch k1 {mean('mismatch/k1'):.2e} "
      f"k3 {mean('mismatch/k3'):.2e} max|d| {max(r.get('mismatch/abs_diff_max', 0) for r in rows):.2e}; "
      f"{mean('perf/tokens_per_s'):.0f} completion tokens/s, {summary['seconds']:.0f} s")
PY
}

echo "== HF engine, bf16 rollout vs fp32 learner, tiny Qwen3 (size m) on the GPU"
"$PY" -m vespo.cli train "${COMMON[@]}" model.size=m rollout.engine_dtype=bfloat16 run.steps=30 \
  run.out_dir="$OUT/hf"
report "$OUT/hf"

echo "== HF engine, MoE with rollout routing replay (r3)"
"$PY" -m vespo.cli train "${COMMON[@]}" model.arch=qwen3_moe model.size=s rollout.engine_dtype=bfloat16 \
  rollout.router_replay=r3 run.steps=10 run.out_dir="$OUT/hf_moe_r3"
report "$OUT/hf_moe_r3"

GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())")
echo "== the learner on FSDP2 over NCCL: $GPUS rank(s), one per GPU (vespo train --nproc)"
"$PY" -m vespo.cli train --nproc "$GPUS" "${COMMON[@]}" model.size=m rollout.engine_dtype=bfloat16 \
  rollout.prompts_per_step=$((16 * GPUS)) run.steps=10 run.out_dir="$OUT/fsdp"
report "$OUT/fsdp"
echo "== bench/distributed.py on the GPU(s): per-rank bytes, updates/s, collective share"
"$PY" bench/distributed.py --device cuda --size m --repeats 1 --updates 10

if "$PY" -c "import vllm" 2>/dev/null; then
  echo "== vLLM engine on the policy the first run wrote ($OUT/hf/policy)"
  "$PY" -m vespo.cli train "${COMMON[@]}" model.path="$OUT/hf/policy" warmstart.enabled=false rollout.engine=vllm \
    staleness.behavior=rollout run.steps=10 run.out_dir="$OUT/vllm"
  report "$OUT/vllm"
else
  echo "== vLLM not installed: skipped (pip install 'vespo[vllm]')"
fi
