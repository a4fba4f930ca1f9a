"""A sweep on a real model, reported part-way (a resumable sweep stopped before its grid is done): the
shipped real_staleness sweep file (base ../smollm2_chain_sum.yaml), some runs finished, one still running,
some never started, one condition not started at all. From its in-progress archive the tables list every
condition of the grid with how many of its runs finished, comparisons use only the seeds both sides have,
and the recommendation picks nothing while a loss of the grid has too few finished runs."""

import json
import re
from pathlib import Path

import yaml

from vespo.config import load_config, to_dict
from vespo.lab import report
from vespo.lab.grid import load_sweep
from vespo.lab.runs import ARCHIVE, read_lab
from vespo.sweep.plan import run_overrides, write_record

from markdown_table import cells

SWEEP = Path(__file__).resolve().parents[2] / "configs" / "lab" / "real_staleness.yaml"
# (seed, N, loss) -> final held-out accuracy; None: started, not finished. DPPO-TV never ran.
FINALS = {("0", "1", "vespo"): 0.40, ("1", "1", "vespo"): 0.44, ("2", "1", "vespo"): 0.42, ("3", "1", "vespo"): 0.46,
          ("0", "16", "vespo"): 0.45, ("1", "16", "vespo"): 0.47, ("2", "16", "vespo"): 0.48,
          ("0", "16", "grpo"): 0.38, ("1", "16", "grpo"): 0.41, ("3", "16", "grpo"): 0.50, ("2", "16", "grpo"): None}


def _in_progress(root: Path, finals: dict = FINALS) -> Path:
    """The sweep directory `vespo sweep` leaves when stopped part-way, with real resolved configs."""
    sweep, out = load_sweep(SWEEP), root / "real_staleness"
    write_record(sweep, out)
    for point in sweep.points():
        final = finals.get(key := (point.labels["seed"], point.labels["N"], point.labels["loss"]), "absent")
        if final == "absent":
            continue
        run = out / point.name
        run.mkdir()
        cfg = load_config(out / "base.yaml", run_overrides(point, run))
        (run / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        n, done = cfg.staleness.n, final is not None
        rows = [{"step": k, "reward/mean": 0.1 + 0.3 * k * n / 32, "rollout/eos_rate": 1.0, "optim/n_skipped": 0.0,
                 "kl/k3": 1e-3, "optim/grad_norm_max": 1.0,
                 **({"eval/reward_sampled": 0.06 + 0.35 * k * n / 32} if k * n % 16 == 0 else {})}
                for k in range(1, (cfg.steps if done else 1) + 1)]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        if done:
            (run / "summary.json").write_text(json.dumps({
                "status": "done", "seconds": 2400.0, "eval_before": {"reward_sampled": 0.06},
                "eval_after": {"reward_sampled": final, "reward_greedy": final + 0.2}}))
        (run / "lab.json").write_text(json.dumps({"labels": point.labels, "overrides": point.overrides,
                                                  "status": "finished" if done else "running", "returncode": 0}))
        assert cfg.model.path == "offline:smollm2-135m-instruct" and cfg.task.eval_size == 256, key
    return out


def test_a_real_model_sweep_stopped_part_way_is_reported_as_far_as_it_ran(tmp_path):
    archive = tmp_path / "docs" / "results" / "in_progress" / "real_staleness"  # what a session commits
    sweeps, runs = read_lab([_in_progress(tmp_path)])
    report.write_sweep(sweeps["real_staleness"], runs, archive, draw=False)  # `vespo report DIR --out`, no figures
    claims = tmp_path / "claims.yaml"
    claims.write_text(yaml.safe_dump({"recommend": [{"setting": "a real model", "sweep": "real_staleness",
                                                     "among": "loss", "over": "N"}], "claims": [
        {"paper": "p", "sweep": "real_staleness", "expect": "greater",
         "across": {"a": {"loss": "vespo"}, "b": [{"loss": "grpo"}, {"loss": "dppo_tv"}], "over": "N", "at": ["16"]}}]}))
    page = tmp_path / "docs" / "results.md"
    text = report.write_page([archive / ARCHIVE], page, claims, None, "vespo report", draw=False).read_text()
    conditions, paired = re.findall(r"((?:^\|.*\n)+)", text.split("### `real_staleness`")[1], flags=re.M)[:2]
    head, *rows = cells(conditions)
    runs = {tuple(r[:2]): r[head.index("runs")] for r in rows}
    # every condition of the grid, with how many of its runs finished
    assert runs == {("1", "vespo"): "4 of 5", ("16", "vespo"): "3 of 5", ("16", "grpo"): "3 of 5 (1 not finished)",
                    ("16", "dppo_tv"): "0 of 5"}
    assert next(r for r in rows if r[1] == "dppo_tv")[head.index("held-out sampled")] == "–"
    # grpo - vespo at N = 16 on the seeds both finished (0 and 1), not over the seeds each has
    head, *rows = cells(paired)
    (grpo,) = [r for r in rows if r[1] == "grpo"]
    assert grpo[head.index("Δ held-out sampled")].startswith("-0.065 [") and grpo[head.index("seeds")] == "2"
    assert grpo[head.index("higher in")] == "0/2"
    assert "N=16 vs loss=grpo: +0.065 [" in text and "2 seeds, higher in 2" in text  # the claim's vespo - grpo
    assert "N=16 vs loss=dppo_tv: no common seeds" in text
    # nothing picked at N = 1, where only VESPO runs, nor at N = 16 while DPPO-TV has not run
    lines = [x for x in text.split("## Recommendation")[1].splitlines() if x.startswith("- ")]
    assert lines[0] == "- N = 1, held-out sampled accuracy after 32 updates: the evidence picks none; only VESPO ran"
    assert lines[1].startswith("- N = 16, held-out sampled accuracy after 32 updates: the evidence picks none")
    assert "use **" not in lines[1] and lines[1].endswith("too few finished runs to compare: DPPO-TV (0)")
    assert re.search(r"\| `real_staleness` +\| [^|]+ \| 10 / 20 ", text)  # finished / in the grid


def test_a_sweep_whose_first_runs_are_still_running_draws_its_report(tmp_path):
    """The first session's state: two runs started, none finished. The report and its figures are written
    (the headline's log-N axes once failed with nothing to draw), every condition reading 0 of 5."""
    out = _in_progress(tmp_path, {("0", "1", "vespo"): None, ("0", "16", "vespo"): None})
    sweeps, runs = read_lab([out])
    report.write_sweep(sweeps["real_staleness"], runs, tmp_path / "report", draw=True)
    text = (tmp_path / "report" / "report.md").read_text()
    assert "0 of 5 (1 not finished)" in text and (tmp_path / "report" / "headline.png").stat().st_size > 0
