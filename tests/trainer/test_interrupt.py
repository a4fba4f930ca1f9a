"""Ctrl-C during `vespo train` finishes the step, writes a checkpoint, exits with status 130 (summary status
"interrupted"), and the run resumes from it; meanwhile a second `vespo train` on the same run directory is refused
in one line, and the run's log (no terminal) is one plain line per step with its paths whole."""

import json
import re
import signal
import subprocess
import sys
import time

from vespo.config import load_config
from vespo.metrics import read_jsonl
from vespo.trainer.checkpoint import latest_checkpoint
from vespo.trainer import train
from vespo.trainer.runlog import plain_every

OVERRIDES = ["model.size=nano", "task.name=addition", "task.options={digits: 1}", "task.train_size=2000",
             "task.eval_size=8", "rollout.prompts_per_step=8", "rollout.group_size=4", "staleness.n=2",
             "warmstart.steps=10", "warmstart.batch_size=32", "run.steps=500", "run.checkpoint_every=0",
             "run.progress=false", "run.loggers=[jsonl]", "run.threads=1"]
STEP_LINE = re.compile(r"^step (\d+)/500  reward \d\.\d{3}  loss \S+  ess \d\.\d{3}  \d+\.\d{2} s/step$")


def test_ctrl_c_checkpoints_exits_130_and_resume_continues(tmp_path):
    out = tmp_path / "a_run_directory_whose_path_is_longer_than_a_terminal_line_of_eighty_columns" / "run"
    assert len(str(out)) > 80
    args = OVERRIDES + [f"run.out_dir={out}", f"warmstart.cache_dir={tmp_path / 'ws'}", "run.progress=true"]
    proc = subprocess.Popen([sys.executable, "-m", "vespo.cli", "train", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 900
    while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.2)
    second = subprocess.run([sys.executable, "-m", "vespo.cli", "train", "--resume", *args], capture_output=True,
                            text=True, timeout=600)
    assert second.returncode == 2 and second.stderr.strip().splitlines() == [
        f"vespo train: error: run directory {out} is in use by another vespo process (pid {proc.pid}); wait for it "
        "to end, or stop it, before running this one"], second.stderr
    assert proc.poll() is None  # the first run went on
    proc.send_signal(signal.SIGINT)
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 130, output
    lines = output.splitlines()
    steps = [int(m.group(1)) for m in map(STEP_LINE.match, lines) if m]
    every = plain_every(500)  # 5: about 100 lines for the whole run
    assert steps == list(range(every, every * len(steps) + 1, every)) and steps, output
    assert f"run directory {out}: metrics.jsonl" in output  # the path whole, not broken at 80 columns
    for shown in ("warm start: up to 10 supervised steps", "warm start: step 5/10, loss ",  # progress of each phase
                  "held-out evaluation before RL: 8 problems", "held-out evaluation after RL: sampled "):
        assert shown in output, shown
    assert "vespo train: interrupted at step" in lines[-1] and "--resume" in lines[-1], lines[-1]
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
