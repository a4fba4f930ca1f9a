"""The report's sizing table (a sweep file's `sizing`): per comparison with the reference, the shared seeds, the
mean paired difference, the paired SD and the seeds a paired t-test needs to detect |difference| = delta, on a
hand-made sweep worked by hand, on the real-model sweep's committed archive (SmolLM2, 5 seeds) against numbers
computed from the archive's raw JSON, and on the real_stability pilot's archive restored with its shipped sweep
file (one seed: no SD yet), the key carried through sweep.json and the report's own archive."""

import gzip
import json
import math
import statistics
from pathlib import Path

from vespo.lab import report
from vespo.lab import cli as report_cli
from vespo.lab.runs import ARCHIVE, read_lab, read_sweep
from vespo.sweep import cli as sweep_cli

from markdown_table import cells
from power_reference import detectable_reference, seeds_reference

ROOT = Path(__file__).resolve().parents[2]
SIZING = {"delta": 0.05, "power": 0.8, "alpha": 0.05}
HEAD = ["shared seeds", "mean Δ held-out sampled", "paired SD", "seeds needed (normal approximation)",
        "seeds needed (exact, noncentral t)", "resolves on these seeds"]
FEW = "needs >= 2 shared seeds"


def _table(text: str) -> list[list[str]]:
    return cells(text.split("Seeds to run, sized by the seeds run so far")[1].split("\n\n")[1])


def test_the_table_by_hand(synthetic, tmp_path):
    sw = synthetic("st", {"loss": ["vespo", "grpo", "dppo_tv"], "seed": ["0", "1", "2"]}, reference={"loss": "vespo"})
    (sw.dir / "sweep.json").write_text(json.dumps({**sw.record, "sizing": SIZING}))
    # grpo - vespo = -0.09, -0.05, -0.01: mean -0.05, SD sqrt((0.04^2 + 0 + 0.04^2) / 2) = 0.04 -> n =
    # (2.801585 x 0.04 / 0.05)^2 = 5.02 -> 6 by the normal approximation, 8 exactly (tests/lab/test_stats.py)
    for seed, v, g in (("0", 0.30, 0.21), ("1", 0.40, 0.35), ("2", 0.50, 0.49)):
        sw.run({"loss": "vespo", "seed": seed}, [0.3, 0.4], eval_sampled=v)
        sw.run({"loss": "grpo", "seed": seed}, [0.3, 0.4], eval_sampled=g)
    sw.run({"loss": "dppo_tv", "seed": "0"}, [0.3, 0.4], eval_sampled=0.2)  # one shared seed: no SD
    sw.run({"loss": "dppo_tv", "seed": "1"}, [0.3], status="running")
    out = tmp_path / "report"
    assert report_cli.main([str(sw.dir), "--out", str(out)]) == 0
    text = (out / "report.md").read_text()
    # 3 seeds at SD 0.04 resolve detectable_reference(3, 0.04, 0.8, 0.05) = 0.131: above the 0.05 asked for
    assert _table(text) == [["loss", *HEAD], ["grpo", "3", "-0.050", "0.040", "6", "8", "0.131"],
                            ["dppo_tv", "1", "-0.100", "–", FEW, FEW, FEW]]
    assert "Delta = 0.05 is the smallest |difference| in held-out sampled accuracy" in text
    assert "with power 0.8" in text and "at alpha = 0.05" in text
    assert "one final evaluation on" not in text  # the hand-made runs name no task.eval_size
    # a sweep without the key has no such table
    (sw.dir / "sweep.json").write_text(json.dumps(sw.record))
    sweeps, runs = read_lab([sw.dir])
    assert "Seeds to run" not in report.sweep_tables(sweeps["st"], runs)


def test_the_real_model_sweeps_archive_against_its_raw_json(tmp_path):
    """real_staleness (SmolLM2-135M, 5 seeds, 256 held-out problems), sized with delta 0.05."""
    body = json.loads(gzip.decompress((ROOT / "docs" / "results" / "real_staleness" / ARCHIVE).read_bytes()))
    body["record"]["sizing"] = SIZING
    archive = tmp_path / "real_staleness" / ARCHIVE
    archive.parent.mkdir()
    archive.write_bytes(gzip.compress(json.dumps(body).encode()))
    sweeps, runs = read_lab([archive])
    text = report.sweep_tables(sweeps["real_staleness"], runs)
    head, *rows = _table(text)
    assert head == ["N", "loss", *HEAD]
    final = {(r["lab"]["labels"]["N"], r["lab"]["labels"]["loss"], r["lab"]["labels"]["seed"]):
             r["summary"]["eval_after"]["reward_sampled"] for r in body["runs"] if r["summary"]["status"] == "done"}
    expected = []
    for n, loss in dict.fromkeys((n, loss) for n, loss, _ in final if loss != "vespo"):
        d = [final[(n, loss, s)] - final[(n, "vespo", s)] for m, l, s in final if (m, l) == (n, loss)
             and (n, "vespo", s) in final]
        sd = statistics.stdev(d)
        expected.append([n, loss, str(len(d)), f"{statistics.fmean(d):+.3f}", f"{sd:.3f}",
                         *map(str, seeds_reference(sd, 0.05, 0.8, 0.05)),
                         f"{detectable_reference(len(d), sd, 0.8, 0.05):.3f}"])
    assert rows == expected and len(rows) == 2 and all(r[2] == "5" for r in rows)
    p = statistics.fmean(final.values())
    assert (f"one final evaluation on 256 problems at this sweep's mean accuracy {p:.2f} has a standard error of "
            f"{math.sqrt(p * (1 - p) / 256):.3f}") in text


def test_the_real_stability_pilot_from_its_archive_and_shipped_sweep_file(tmp_path, capsys):
    """What a session does: restore the committed archive with the shipped sweep file (its `sizing` reaches
    sweep.json), report, and the report's archive carries the key so that it regenerates alone."""
    out, first, again = tmp_path / "real_stability", tmp_path / "report", tmp_path / "again"
    archive = ROOT / "docs" / "results" / "in_progress" / "real_stability" / ARCHIVE
    assert sweep_cli.main([str(ROOT / "configs" / "lab" / "real_stability.yaml"), "--out", str(out),
                           "--from-archive", str(archive), "--dry-run"]) == 0
    assert json.loads((out / "sweep.json").read_text())["sizing"] == SIZING
    sweeps, runs = read_lab([out])
    report.write_sweep(sweeps["real_stability"], runs, first, draw=False)
    text = (first / "report.md").read_text()
    # the pilot's figures, from the restored runs' own summaries: per loss at N = 16, its held-out sampled minus
    # VESPO's on each seed both ran, their mean and SD
    final = {tuple(d.name.split(",")): json.loads((d / "summary.json").read_text())["eval_after"]["reward_sampled"]
             for d in out.iterdir() if (d / "summary.json").is_file()}
    seeds = sorted({k[0] for k in final})
    table = _table(text)
    assert table[0] == ["N", "loss", *HEAD] and [r[:2] for r in table[1:]] == [["16", "grpo"], ["16", "dppo_tv"]]
    for row in table[1:]:
        diffs = [final[(s, "N=16", f"loss={row[1]}")] - final[(s, "N=16", "loss=vespo")] for s in seeds
                 if (s, "N=16", f"loss={row[1]}") in final and (s, "N=16", "loss=vespo") in final]
        assert row[2:4] == [str(len(diffs)), f"{statistics.mean(diffs):+.3f}"]
        if len(diffs) < 2:
            assert row[4:] == ["–", FEW, FEW, FEW]
        else:
            normal, exact = seeds_reference(statistics.stdev(diffs), SIZING["delta"], SIZING["power"], SIZING["alpha"])
            assert row[4:7] == [f"{statistics.stdev(diffs):.3f}", str(normal), str(exact)]
    assert "one final evaluation on 256 problems" in text
    assert read_sweep(first / ARCHIVE)[0].sizing.delta == 0.05
    sweeps, runs = read_lab([first / ARCHIVE])
    report.write_sweep(sweeps["real_stability"], runs, again, draw=False)
    assert (again / "report.md").read_text() == text
