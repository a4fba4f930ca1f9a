"""The run directory's records: written and read back whole, a summary's status one of the stop reasons, and
a run recorded before summaries gave the reason still read as its sweep recorded it."""

import pytest

from vespo.rundir import (METRICS, STOPS, SUMMARY, RunFiles, Stop, read_run_files, read_summary, started,
                          stopped_nonfinite, write_run_files, write_summary)


def test_run_files_round_trip_and_absent_files_read_empty(tmp_path):
    assert read_run_files(tmp_path) == RunFiles({}, {}, {}, None) and not started(tmp_path)
    files = RunFiles({"staleness": {"n": 4}}, {"status": "done"}, {"reward_sampled": 0.5}, [{"step": 1, "x": 2.0}])
    write_run_files(files, tmp_path)
    assert read_run_files(tmp_path) == files and files.n == 4 and started(tmp_path)
    assert RunFiles({}, {"staleness_n": 8}, {}, None).n == 8 and RunFiles({}, {}, {}, None).n == 1
    assert (tmp_path / METRICS).read_text() == '{"step": 1, "x": 2.0}\n'


def test_a_summary_names_why_the_run_stopped(tmp_path):
    assert STOPS == ("done", "interrupted", "non_finite")
    write_summary(tmp_path, {"status": Stop.NON_FINITE, "updates_done": 3})
    assert read_summary(tmp_path) == {"status": "non_finite", "updates_done": 3}
    assert stopped_nonfinite(read_summary(tmp_path))
    with pytest.raises(ValueError, match="one of done, interrupted, non_finite, not 'crashed'"):
        write_summary(tmp_path, {"status": "crashed"})
    assert not (tmp_path / (SUMMARY + ".tmp")).exists()


def test_a_run_recorded_before_summaries_gave_the_reason_reads_its_sweeps_record():
    assert stopped_nonfinite({}, {"stopped_nonfinite": True})
    assert not stopped_nonfinite({"status": "interrupted"}, {"stopped_nonfinite": False})
    assert not stopped_nonfinite({})
