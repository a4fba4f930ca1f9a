"""Ctrl-C during `vespo train` finishes the step, writes a checkpoint, and the run resumes from it."""

import json
import signal
import subprocess
import sys
import time

from vespo.config import load_config
from vespo.metrics import read_jsonl
from vespo.trainer.checkpoint import latest_checkpoint
from vespo.trainer import train

OVERRIDES = ["model.size=nano", "task.name=addition", "task.options={digits: 1}", "task.train_size=2000",
             "task.eval_size=8", "rollout.prompts_per_step=8", "rollout.group_size=4", "staleness.n=2",
             "warmstart.steps=10", "warmstart.batch_size=32", "run.steps=500", "run.checkpoint_every=0",
             "run.progress=false", "run.loggers=[jsonl]", "run.threads=1"]


def test_ctrl_c_checkpoints_and_resume_continues(tmp_path):
    out = tmp_path / "run"
    args = OVERRIDES + [f"run.out_dir={out}", f"warmstart.cache_dir={tmp_path / 'ws'}"]
    proc = subprocess.Popen([sys.executable, "-m", "vespo.cli", "train", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output
    ckpt = latest_checkpoint(out)
    assert ckpt is not None, output
    rows = read_jsonl(metrics)
    step = rows[-1]["step"]
    assert ckpt.name == f"step-{step:06d}" and step < 500
    assert json.loads((out / "summary.json").read_text())["status"] == "interrupted"

    cfg = load_config(None, OVERRIDES + [f"run.out_dir={out}", f"warmstart.cache_dir={tmp_path / 'ws'}",
                                         f"run.steps={step + 2}"])
    summary = train(cfg, resume=True)
    assert summary["status"] == "done" and summary["policy_version"] == (step + 2) * 2
    assert [r["step"] for r in read_jsonl(metrics)] == list(range(1, step + 3))
