"""`vespo sweep --from-archive`: a sweep resumed in another session from the archive an earlier one
committed. The finished runs come back as run directories that planning skips and the report reads
exactly as it read the archive; an archive of another sweep, a run outside the grid, other overrides
or another resolved config are refused by name. Uses the fully-async sweep's committed archive and
its real sweep file."""

import gzip
import json
from pathlib import Path

import pytest

from vespo.lab import report
from vespo.lab import cli as report_cli
from vespo.lab.grid import SweepError, load_sweep
from vespo.lab.runs import ARCHIVE, read_lab
from vespo.sweep import plan
from vespo.sweep import cli as sweep_cli

ROOT = Path(__file__).resolve().parents[2]
SWEEP = ROOT / "configs" / "lab" / "async.yaml"
ARCHIVED = ROOT / "docs" / "results" / "async" / ARCHIVE


def _body():
    """The committed archive cut to its first two seeds (18 runs), to keep the tests quick."""
    body = json.loads(gzip.decompress(ARCHIVED.read_bytes()))
    body["runs"] = [r for r in body["runs"] if r["lab"]["labels"]["seed"] in ("0", "1")]
    return body


def _write(body, path):
    path.write_bytes(gzip.compress(json.dumps(body).encode()))
    return path


def test_the_archived_runs_come_back_skipped_and_read_as_before(tmp_path, capsys):
    out = tmp_path / "async"
    body = _body()
    finished = [r["name"] for r in body["runs"] if (r["summary"] or {}).get("status") == "done"]
    assert len(finished) == 18
    # one run of the archive had not finished: it is left out and planned again
    body["runs"][3]["summary"] = None
    archive = _write(body, tmp_path / ARCHIVE)
    assert sweep_cli.main([str(SWEEP), "--out", str(out), "--from-archive", str(archive), "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert "17 finished runs written back" in printed
    jobs = plan.plan(load_sweep(SWEEP), out, only={"seed": {"0", "1"}})
    assert [j.point.name for j in jobs if j.action != "skip"] == [body["runs"][3]["name"]]
    assert jobs[3].action == "start"
    # the archive's sessions come with its runs, once however often it is restored
    sessions = (out / "sessions.jsonl").read_text().splitlines()
    assert len(sessions) == len(body["record"]["sessions"]) > 0
    assert plan.restore(archive, load_sweep(SWEEP), out) == 0
    assert (out / "sessions.jsonl").read_text().splitlines() == sessions

    # every statistic and collapse verdict is what the archive itself gives
    from_dir = read_lab([out])[1].drop(columns="record").set_index("run")
    from_archive = read_lab([archive])[1].drop(columns="record").set_index("run")
    assert len(from_dir) == 17
    assert from_dir.equals(from_archive.loc[from_dir.index])


def test_the_report_of_a_restored_sweep_writes_the_archive_it_came_from(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the sweep file named as the committed sweep named it
    archive = _write(_body(), tmp_path / ARCHIVE)
    assert report_cli.main([str(archive), "--out", str(tmp_path / "a")]) == 0  # the archive as a report writes it
    out = tmp_path / "async"
    assert plan.restore(archive, load_sweep("configs/lab/async.yaml"), out) == 18
    assert report_cli.main([str(out), "--out", str(tmp_path / "b")]) == 0
    assert (tmp_path / "b" / ARCHIVE).read_bytes() == (tmp_path / "a" / ARCHIVE).read_bytes()
    def lines(folder):  # the report less the lines naming where it was read from
        return [x for x in (folder / "report.md").read_text().splitlines() if str(tmp_path) not in x]

    assert lines(tmp_path / "b") == lines(tmp_path / "a") and len(lines(tmp_path / "a")) > 20


def test_a_local_run_is_not_overwritten(tmp_path):
    out = tmp_path / "async"
    archive = _write(_body(), tmp_path / ARCHIVE)
    name = _body()["runs"][0]["name"]
    plan.write_record(load_sweep(SWEEP), out)
    local = load_sweep(SWEEP).points()[0]
    assert local.name == name
    (out / name).mkdir()
    (out / name / "lab.json").write_text(json.dumps({"labels": local.labels, "overrides": local.overrides,
                                                     "status": "running"}))
    assert plan.restore(archive, load_sweep(SWEEP), out) == 17
    assert not (out / name / "metrics.jsonl").exists()


@pytest.mark.parametrize("change, message", [
    (lambda b: b["record"].update(name="staleness"), "is the archive of sweep 'staleness', not 'async'"),
    (lambda b: b["runs"][0].update(name="seed=11,loss=vespo"), "run seed=11,loss=vespo is not a point of the grid"),
    (lambda b: b["runs"][1]["lab"]["overrides"].append("optim.lr=0.5"), "run seed=0,loss=grpo was made with overrides"),
    (lambda b: b["runs"][2]["config"]["optim"].update(lr=0.5),
     "run seed=0,loss=dppo_tv ran with optim.lr = 0.5, the grid of"),
])
def test_an_archive_of_another_condition_is_refused_by_name(tmp_path, capsys, change, message):
    body = _body()
    change(body)
    archive = _write(body, tmp_path / ARCHIVE)
    with pytest.raises(SweepError, match=message.replace("(", r"\(").replace(")", r"\)")):
        plan.restore(archive, load_sweep(SWEEP), tmp_path / "async")
    assert sweep_cli.main([str(SWEEP), "--out", str(tmp_path / "async"), "--from-archive", str(archive),
                       "--dry-run"]) == 2
    assert message in capsys.readouterr().err
