"""Synthetic sweep directories for the lab's tests: real files in the layout `vespo sweep` and
`vespo train` write (sweep.json, sessions.jsonl, and per run lab.json, config.yaml, metrics.jsonl,
summary.json), with curves and evaluations chosen by the test."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml


class SyntheticSweep:
    def __init__(self, root: Path, name: str, axes: dict[str, list[str]], reference: dict | None = None):
        self.dir = root / name
        self.dir.mkdir(parents=True)
        record = {"name": name, "source": f"configs/lab/{name}.yaml",
                  "axes": [{"label": k, "values": [str(x) for x in v]} for k, v in axes.items()],
                  "reference": reference or {}}
        (self.dir / "sweep.json").write_text(json.dumps(record))

    def run(self, labels: dict[str, str], rewards: list[float], n: int = 1, eval_sampled: float | None = None,
            eval_greedy: float | None = None, status: str = "done", lr: float = 1e-4, returncode: int = 0,
            stopped_nonfinite: bool = False, seconds: float = 10.0, steps: int | None = None,
            grad_norm: float = 2.0, kl: float = 0.01) -> Path:
        """One run directory: row k (1-based) has reward rewards[k-1] and was trained after (k-1) x n updates."""
        name = ",".join(f"{k}={v}" for k, v in labels.items())
        d = self.dir / name
        d.mkdir()
        (d / "lab.json").write_text(json.dumps({"labels": {k: str(v) for k, v in labels.items()},
                                                "returncode": returncode, "stopped_nonfinite": stopped_nonfinite}))
        (d / "config.yaml").write_text(yaml.safe_dump({"staleness": {"n": n}, "optim": {"lr": lr},
                                                       "run": {"steps": steps or len(rewards)}}))
        rows = [{"step": i + 1, "reward/mean": r, "kl/k3": kl * (i + 1), "mismatch/k3": 1e-12,
                 "optim/grad_norm_max": grad_norm * (i + 1), "is/ess": 0.5, "is/log_w_min": -1.0 - i,
                 "is/log_w_max": 0.5, "rollout/eos_rate": 1.0, "optim/n_skipped": 0.0, "policy/version": (i + 1) * n}
                for i, r in enumerate(rewards)]
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        if status in ("done", "interrupted"):
            after = {} if eval_sampled is None else {"reward_sampled": eval_sampled,
                                                     "reward_greedy": eval_greedy if eval_greedy is not None
                                                     else eval_sampled}
            (d / "summary.json").write_text(json.dumps({"status": status, "eval_after": after, "seconds": seconds,
                                                        "staleness_n": n}))
        return d

    def session(self, command: str, seconds: float, commit: str = "abc1234def", dirty: bool = False,
                start: str = "2026-01-01T10:00:00+00:00", end: str = "2026-01-01T11:00:00+00:00") -> None:
        with open(self.dir / "sessions.jsonl", "a") as f:
            f.write(json.dumps({"command": command, "seconds": seconds, "commit": commit, "dirty": dirty,
                                "start": start, "end": end, "jobs": 2,
                                "machine": {"node": "box", "cpus": 2, "torch": "2.x"}}) + "\n")


@pytest.fixture
def synthetic(tmp_path):
    """synthetic(name, axes, reference=None, root=tmp_path) -> SyntheticSweep under root."""
    return lambda name, axes, reference=None, root=tmp_path: SyntheticSweep(root, name, axes, reference)
