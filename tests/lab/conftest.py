"""Synthetic sweep directories for the lab's tests: real files in the layout `vespo sweep` and
`vespo train` write (sweep.json, sessions.jsonl, and per run lab.json, config.yaml, metrics.jsonl,
summary.json), with curves and evaluations chosen by the test; and `shipped`, every grid point of the
shipped sweep files resolved (or waiting for a method not yet registered)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from vespo.config import ConfigError, load_config
from vespo.lab.grid import load_sweep

LAB = Path(__file__).resolve().parents[2] / "configs" / "lab"


class SyntheticSweep:
    def __init__(self, root: Path, name: str, axes: dict[str, list[str]], reference: dict | None = None):
        self.dir = root / name
        self.dir.mkdir(parents=True)
        record = {"name": name, "source": f"configs/lab/{name}.yaml",
                  "axes": [{"label": k, "values": [str(x) for x in v]} for k, v in axes.items()],
                  "reference": reference or {}}
        (self.dir / "sweep.json").write_text(json.dumps(record))
        self.record = record

    def run(self, labels: dict[str, str], rewards: list[float], n: int = 1, eval_sampled: float | None = None,
            eval_greedy: float | None = None, status: str = "done", lr: float = 1e-4, returncode: int = 0,
            stopped_nonfinite: bool = False, seconds: float = 10.0, steps: int | None = None,
            grad_norm: float = 2.0, kl: float = 0.01, evals: list[float] | None = None,
            before: float | None = None, step_s: float = 1.0, start: tuple[int, float] | None = None,
            eval_size: int | None = None) -> Path:
        """One run directory: row k (1-based) has reward rewards[k-1] and was trained after (k-1) x n updates.
        Each row also holds a held-out evaluation after its updates (eval/reward_sampled, as with
        run.eval_every_updates = n): evals[k-1], by default the row's reward; evals=[] writes none.
        ``before`` is the held-out accuracy before training (summary eval_before); ``start`` (updates, sampled
        accuracy) the shared on-policy start's record (summary warmstart); ``eval_size`` the held-out problems (task)."""
        name = ",".join(f"{k}={v}" for k, v in labels.items())
        d = self.dir / name
        d.mkdir()
        (d / "lab.json").write_text(json.dumps({"labels": {k: str(v) for k, v in labels.items()},
                                                "returncode": returncode, "stopped_nonfinite": stopped_nonfinite}))
        (d / "config.yaml").write_text(yaml.safe_dump({"staleness": {"n": n}, "optim": {"lr": lr},
                                                       "run": {"steps": steps or len(rewards)},
                                                       **({"task": {"eval_size": eval_size}} if eval_size else {})}))
        evals = rewards if evals is None else evals
        rows = [{"step": i + 1, "reward/mean": r, "kl/k3": kl * (i + 1), "mismatch/k3": 1e-12,
                 "optim/grad_norm_max": grad_norm * (i + 1), "is/ess": 0.5, "is/log_w_min": -1.0 - i,
                 "is/log_w_max": 0.5, "rollout/eos_rate": 1.0, "optim/n_skipped": 0.0, "policy/version": (i + 1) * n,
                 "perf/step_s": step_s, **({"eval/reward_sampled": evals[i]} if i < len(evals) else {})}
                for i, r in enumerate(rewards)]
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        if status in ("done", "interrupted"):
            after = {} if eval_sampled is None else {"reward_sampled": eval_sampled,
                                                     "reward_greedy": eval_greedy if eval_greedy is not None
                                                     else eval_sampled}
            (d / "summary.json").write_text(json.dumps({"status": status, "eval_after": after, "seconds": seconds,
                                                        "staleness_n": n, "eval_before": {} if before is None else
                                                        {"reward_sampled": before},
                                                        **({"warmstart": {"warmstart/updates": float(start[0]),
                                                                          "warmstart/sampled_accuracy": start[1],
                                                                          "warmstart/target_reached": 1.0}}
                                                           if start else {})}))
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


# ---------------------------------------------------------------- the shipped sweep files


STEMS = sorted(f.stem for f in LAB.glob("*.yaml") if f.name != "claims.yaml")
# Methods the sweep files name before they are registered in this code: the text a config error
# gives for each. A grid point that fails with one of these waits for that method; any other error
# fails the test. Once a method lands, its points must validate like every other.
PENDING = {
    "loss dppo": "unknown loss 'dppo'",
    "loss m2po": "unknown loss 'm2po'",
    "rollout correction geo_mask": "got 'geo_mask'",
    "optim.ess_scaled_lr": "unknown field 'optim.ess_scaled_lr'",
}


@pytest.fixture(scope="session")
def shipped(tmp_path_factory):
    """{file stem: ([(point name, resolved config)], [(point name, pending method)], [(point name, error)])}."""
    tmp_path = tmp_path_factory.mktemp("bases")
    out = {}
    for stem in STEMS:
        sweep = load_sweep(LAB / f"{stem}.yaml")
        base = tmp_path / f"{stem}.yaml"
        base.write_text(yaml.safe_dump(sweep.base))
        ok, pending, errors = [], [], []
        for point in sweep.points():
            try:
                ok.append((point.name, load_config(base, point.overrides)))
            except ConfigError as e:
                waits = [name for name, text in PENDING.items() if text in str(e)]
                (pending if waits else errors).append((point.name, waits[0] if waits else str(e)))
        out[stem] = ok, pending, errors
    return out
