"""The learner on two processes (gloo on the CPU, FSDP2): the same numbers as one process, checkpoints that
load on another number of ranks, a resume that is bit for bit, and a killed rank that stops the job cleanly
and leaves a run that resumes and learns.

Every multi-process part runs under torchrun (the real launcher) on the tiny nano policy."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import ranks
from vespo.metrics import read_jsonl
from vespo.models import build_char_tokenizer, tiny_model
from vespo.rollout import HFEngine, SamplingParams
from vespo.trainer.checkpoint import latest_checkpoint
from vespo.trainer.distributed import Dist
from vespo.types import TrainBatch

HERE = Path(__file__).parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(HERE.parents[1] / "src"),
                                                                           os.environ.get("PYTHONPATH", "")])}
LOSSES = ("vespo", "grpo")


def recorded_minibatches(n: int = 3, rows: int = 8) -> list[dict]:
    """n mini-batches sampled by the HF engine in bfloat16 from the nano policy (so μ = the engine's log-probs is
    off the trainer's policy: W != 1), with random advantages."""
    tok = build_char_tokenizer()
    engine = HFEngine(tiny_model("qwen3", "nano", tokenizer=tok, seed=0), tok, dtype="bfloat16")
    prompts = [tok.encode(f"{a}+{b}=") for a in range(n) for b in range(rows)]
    rollout = engine.generate(prompts, SamplingParams(max_new_tokens=6), seed=0)
    gen = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        sel = slice(i * rows, (i + 1) * rows)
        adv = torch.randn(rows, generator=gen)
        zeros = torch.zeros(rows, dtype=torch.long)
        out.append({"prompt_ids": rollout.prompt_ids[sel], "prompt_mask": rollout.prompt_mask[sel],
                    "response_ids": rollout.response_ids[sel], "response_mask": rollout.response_mask[sel],
                    "rollout_logp": rollout.logprobs[sel], "rewards": adv, "advantages": adv,
                    "group_ids": torch.arange(rows) // 4, "versions": zeros, "versions_max": zeros,
                    "token_versions": torch.zeros_like(rollout.response_ids[sel]), "truncated": rollout.truncated[sel]})
    return out


@pytest.fixture(scope="module")
def ranks_and_one(tmp_path_factory):
    """The same work on one process (here) and on two ranks (torchrun): updates per loss, a checkpoint each."""
    root = tmp_path_factory.mktemp("fsdp")
    minibatches = recorded_minibatches()
    one, learners = {}, {}
    for loss in LOSSES:
        learners[loss], one[loss] = ranks.run_updates(Dist.single(), [TrainBatch(**mb) for mb in minibatches], loss)
    one_ckpt = ranks.checkpoint(learners[LOSSES[-1]], str(root / "one"))
    torch.save({"minibatches": minibatches, "losses": list(LOSSES), "run_dir": str(root / "two"), "load": one_ckpt},
               root / "work.pt")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(HERE / "ranks.py"), str(root / "work.pt"), str(root / "two.pt")]
    proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return one, torch.load(root / "two.pt", weights_only=True)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||: the difference relative to the tensor's size (float rounding of another summation order)."""
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


@pytest.mark.parametrize("loss", LOSSES)
def test_two_ranks_take_the_one_process_updates_and_log_the_same_diagnostics(ranks_and_one, loss):
    """K = 3 updates on one recorded batch (same samples, same μ): weights and AdamW moments at P = 2 equal
    P = 1's to 1e-5 relative, with micro-batches of 2 rows on each rank, and every diagnostic is the same."""
    one, two = ranks_and_one[0][loss], ranks_and_one[1]["updates"][loss]
    assert one["version"] == two["version"] == 3
    start = ranks.make_learner(Dist.single()).weights()
    assert max(relative(w, start[k]) for k, w in one["weights"].items()) > 1e-3  # the updates moved the weights
    for name, w in one["weights"].items():
        assert relative(two["weights"][name], w) < 1e-5, name
    for name, state in one["moments"].items():
        for key, value in state.items():
            assert relative(two["moments"][name][key], value) < 1e-5, (name, key)
    for a, b in zip(one["metrics"], two["metrics"]):
        assert a["is/log_w_max"] != 0.0 and set(a) == set(b)  # off policy: W != 1, the check is not vacuous
        for key in a:  # abs: about 2 float32 ulps of a log-prob near -4 (a log-ratio near 0 keeps their rounding)
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), key


def test_checkpoints_load_on_another_number_of_ranks(ranks_and_one):
    """2 -> 1: one process loads the two ranks' shards; 1 -> 2: two ranks load one process's checkpoint. The
    weights and optimizer state after loading are the ones saved, exactly."""
    one, two = ranks_and_one
    single = ranks.make_learner(Dist.single())
    single.load_checkpoint(two["checkpoint"])
    for saved, loaded in ((two["updates"][LOSSES[-1]], ranks.full_state(single)), (one[LOSSES[-1]], two["loaded"])):
        assert saved["version"] == loaded["version"] == 3
        for name, w in saved["weights"].items():
            assert torch.equal(loaded["weights"][name], w), name
        for name, state in saved["moments"].items():
            for key, value in state.items():
                assert torch.equal(loaded["moments"][name][key], value), (name, key)


def small_run(out: Path, *extra: str) -> list[str]:
    """The one-process learning test's setting (tests/trainer/test_learning.py) on two ranks."""
    return ["model.size=nano", "task.name=addition", "task.options={digits: 1}", "task.train_size=2000",
            "task.eval_size=64", "rollout.prompts_per_step=16", "rollout.group_size=8", "staleness.n=2",
            "warmstart.steps=60", "warmstart.lr=3e-3", "warmstart.batch_size=64",
            f"warmstart.cache_dir={out.parent / 'warm'}", "optim.lr=3e-4", "optim.micro_batch_size=8",
            "run.progress=false", "run.loggers=[jsonl]", "run.threads=1", f"run.out_dir={out}", *extra]


def vespo_train(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "vespo.cli", "train", *args], env=ENV, capture_output=True,
                          text=True, timeout=timeout)
    out_dir = next(a.split("=", 1)[1] for a in args if a.startswith("run.out_dir="))
    with open(Path(out_dir).parent / "train.stderr", "a") as f:  # the whole of it, for a failure's record
        f.write(proc.stderr)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


@pytest.mark.slow  # ~2 min on a 2-core CI machine (three 2-rank jobs of 40 steps); two-rank parity and checkpoints
# across rank counts are in the default run
def test_a_killed_rank_stops_the_job_and_the_run_resumes_learns_and_resumes_bit_for_bit(tmp_path):
    run = tmp_path / "killed"
    args = ["--nproc", "2", *small_run(run, "run.steps=40", "run.checkpoint_every=2")]
    job = subprocess.Popen([sys.executable, "-m", "vespo.cli", "train", *args], env=ENV, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 900
    while latest_checkpoint(run) is None and time.monotonic() < deadline and job.poll() is None:
        time.sleep(0.2)
    rank1 = [pid for pid in _descendants(job.pid) if _env_of(pid).get("RANK") == "1"]
    assert rank1, "rank 1 not found"
    os.kill(rank1[0], signal.SIGKILL)
    _, err = job.communicate(timeout=600)  # no hang: torchrun stops the other rank
    assert job.returncode != 0
    assert "the 2-process job stopped" in err and "--resume" in err
    assert latest_checkpoint(run) is not None  # what the job left to resume from
    vespo_train(args[0], args[1], "--resume", *args[2:])
    rows = read_jsonl(run / "metrics.jsonl")
    summary = json.loads((run / "summary.json").read_text())
    assert [r["step"] for r in rows] == list(range(1, 41)) and summary["policy_version"] == 80
    assert all(r["dist/world_size"] == 2.0 for r in rows)
    # it learns: the one-process test's margin on the training reward
    rewards = [r["reward/mean"] for r in rows]
    first, last = sum(rewards[:8]) / 8, sum(rewards[-8:]) / 8
    assert last > first + 0.05, (first, last)
    # resuming from the checkpoint before the last one replays the last two steps bit for bit (same P)
    checkpoints = sorted(p for p in (run / "checkpoints").glob("step-*"))
    (run / "checkpoints" / "latest").write_text(checkpoints[-2].name)
    vespo_train(args[0], args[1], "--resume", *args[2:])
    again = read_jsonl(run / "metrics.jsonl")
    assert comparable(again) == comparable(rows)


def test_a_rank_count_that_does_not_divide_the_batch_is_a_one_line_config_error(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "vespo.cli", "train", "--nproc", "3",
                           *small_run(tmp_path / "bad", "run.steps=1")], env=ENV, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "3 processes must divide the 8 prompts of a mini-batch" in lines[0], proc.stderr
    assert not (tmp_path / "bad").exists()  # refused before anything started
    proc = subprocess.run([sys.executable, "-m", "vespo.cli", "train", "--nproc", "2", "--mode", "async",
                           *small_run(tmp_path / "bad", "run.steps=1")], env=ENV, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 2 and "async.learner_workers" in proc.stderr, proc.stderr


def comparable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]


def _descendants(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True).stdout.split("\n")
    children: dict[int, list[int]] = {}
    for line in out:
        if line.strip():
            child, parent = map(int, line.split())
            children.setdefault(parent, []).append(child)
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _env_of(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return {}
    return dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)
