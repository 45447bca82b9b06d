"""`orbax-mtc bench every-step`: a tiny grid through the real command (real processes, one
and two) gives one JSON document with every variant, the saves each schedule asks for, and
finite overheads; the summary and table are checked on a fixed record. Also
benchmarks/replication_interval.py and benchmarks/collective_order.py, tiny. Nothing here
asserts a speed."""

from __future__ import annotations

import json
import math
import pathlib
import statistics
import subprocess
import sys

import pytest

from orbax_mtc.tools import cli
from orbax_mtc.tools.bench import every_step

STEPS = 8


def _figures(loop_s: float, saves: float | None, **more: float | None) -> dict:
  base = {f: None for f in ("save_p50_s", "save_p99_s", "save_max_s", "in_save_s",
                            "saving_p50_s", "interval_steps", "interval_s", "protected_s",
                            "protected_steps", "protected_count", "backups",
                            "update_p50_s", "update_sum_s", "sleep_sum_s")}
  return {**base, "loop_s": loop_s, "saves": saves, **more}


def test_summary_pairs_each_variant_with_the_baseline_of_its_repetition():
  record = {"procs": 2, "mib": 4, "backend": "cpu", "steps": 10, "runs": [
      {"rep": 0, "name": "every 1", "every": 1, "baseline": _figures(2.0, None),
       "variant": _figures(3.0, 10, in_save_s=0.5, save_p50_s=0.04, interval_steps=1,
                           interval_s=0.3, protected_s=0.2, protected_steps=1)},
      {"rep": 1, "name": "every 1", "every": 1, "baseline": _figures(4.0, None),
       "variant": _figures(4.4, 10, in_save_s=0.7, save_p50_s=0.06, interval_steps=1,
                           interval_s=0.3, protected_s=0.4, protected_steps=1)},
  ]}
  (row,) = every_step.summarize(record)
  # Per repetition: +50 % and +10 %; the median of those, not of the loop times.
  assert row["overhead_pct"] == pytest.approx(30.0)
  assert (row["overhead_pct_min"], row["overhead_pct_max"]) == pytest.approx((10.0, 50.0))
  assert row["save_p50_ms"] == pytest.approx(50.0)
  assert row["in_save_ms_per_step"] == pytest.approx(60.0)
  assert row["peer_copy_out_s"] == pytest.approx(0.3) and row["saves"] == 10
  assert row["save_p99_ms"] is None
  record["summary"] = [row]
  table = every_step.markdown([record], {"steps": 10, "idle_ms": 200.0, "reps": 2})
  assert "| 2 | 4 | cpu | every 1 | 3.70 s (3.00 s) | +30.0 % (+10.0..+50.0) |" in table
  assert row["update_extra_ms_per_step"] is None  # not measured in this record
  assert "0.30 s (1 step)" in table


def test_bench_lists_every_step(capsys):
  assert cli.main(["bench", "--help"]) == 0
  assert "every-step" in capsys.readouterr().out


@pytest.mark.timeout(240)
def test_a_tiny_grid_runs_every_variant_and_prints_one_document():
  result = subprocess.run(
      [sys.executable, "-m", "orbax_mtc", "bench", "every-step", "--mib", "4", "--procs", "1",
       "2", "--every", "1", "5", "--steps", str(STEPS), "--reps", "1", "--idle-ms", "20",
       "--budget", "0.5", "--warm-saves", "1", "--json"],
      capture_output=True, text=True, timeout=200, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  doc = json.loads(result.stdout)  # one document, nothing else
  assert doc["schema"] == every_step.SCHEMA
  assert doc["config"]["steps"] == STEPS and doc["config"]["every"] == [1, 5]
  assert doc["config"]["background_nice"] == 10  # the option's default
  assert doc["config"]["warm_saves"] == 1
  assert "| procs | MiB/proc |" in result.stderr  # the table went to stderr
  assert [(r["procs"], r["mib"]) for r in doc["results"]] == [(1, 4), (2, 4)]
  for record in doc["results"]:
    assert record["peers"] == (record["procs"] > 1)
    assert record["bytes_per_process"] == 4 * 2**20
    rows = {row["variant"]: row for row in record["summary"]}
    assert list(rows) == ["every 1", "every 5", "continuous", "continuous, budget 50 %"]
    assert len(record["runs"]) == 4
    for run in record["runs"]:
      assert run["baseline"]["saves"] is None and run["variant"]["backups"] == 0
      assert math.isfinite(run["variant"]["loop_s"]) and run["variant"]["loop_s"] > 0
    assert rows["every 1"]["saves"] == STEPS and rows["every 1"]["interval_steps"] == 1
    assert rows["every 5"]["saves"] == STEPS // 5
    for name in ("continuous", "continuous, budget 50 %"):
      continuous = rows[name]
      # With a budget the timed loop may be too short for a save after the warm-up's
      # (test_save_overhead_budget counts them on a fake clock).
      assert (1 if name == "continuous" else 0) <= continuous["saves"] <= STEPS
      assert continuous["interval_steps"] is None or continuous["interval_steps"] >= 1
    for row in rows.values():
      assert math.isfinite(row["overhead_pct"])
      assert math.isfinite(row["save_p50_ms"]) and row["save_p99_ms"] >= row["save_p50_ms"]
      # The peer copies are timed only where there is a peer.
      assert (row["peer_copy_out_s"] is not None) == (record["procs"] > 1) or \
          row["saves"] == 1
      # Updates behind moving chunks are counted only where chunks move.
      assert (row["updates_behind_chunks"] is not None) == (record["procs"] > 1)
      if record["procs"] > 1:
        assert 0 <= row["updates_behind_chunks"] <= STEPS
        assert row["behind_chunks_ms_per_step"] is not None


@pytest.mark.timeout(240)
def test_sync_step_runs_the_loop_with_a_cross_process_all_reduce_in_both_loops():
  result = subprocess.run(
      [sys.executable, "-m", "orbax_mtc", "bench", "every-step", "--mib", "4", "--procs", "2",
       "--every", "5", "--no-continuous", "--steps", "10", "--reps", "1", "--idle-ms", "20",
       "--sync-step", "--background-nice", "0", "--json", "--quiet"],
      capture_output=True, text=True, timeout=200, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  doc = json.loads(result.stdout)
  assert doc["config"]["sync_step"] is True and doc["config"]["background_nice"] == 0
  assert "background threads at nice +0" in result.stderr
  (record,) = doc["results"]
  assert record["sync"] is True and record["procs"] == 2
  assert "with a cross-process all-reduce" in result.stderr  # the table says which loop
  (row,) = record["summary"]
  assert row["variant"] == "every 5" and row["saves"] == 2
  assert math.isfinite(row["overhead_pct"])


@pytest.mark.parametrize(("flag", "message"), [
    (["--background-nice", "20"], "--background-nice must be in 0-19"),
    (["--warm-saves", "-1"], "--warm-saves must be >= 0")])
def test_an_option_out_of_range_is_refused(flag, message):
  result = subprocess.run(
      [sys.executable, "-m", "orbax_mtc", "bench", "every-step", *flag],
      capture_output=True, text=True, timeout=120, check=False)
  assert result.returncode == 2 and message in result.stderr


@pytest.mark.timeout(240)
def test_replication_interval_times_the_saving_calls_apart(tmp_path):
  """benchmarks/replication_interval.py under the launcher, tiny: per interval, the saving
  calls' quantiles apart from the calls between saves (a periodic flush shows in the
  first), and the spread after each local save."""
  record_path = tmp_path / "ri.json"
  script = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "replication_interval.py"
  result = subprocess.run(
      [sys.executable, "-m", "orbax_mtc", "launch", "--nprocs", "2", "--devices-per-process",
       "1", "--local-root", str(tmp_path / "ram"), "--", sys.executable, str(script), "--mib",
       "1", "--intervals", "1", "3", "--local-saves", "2", "--warm-saves", "1", "--step-ms",
       "1", "--persistent", str(tmp_path / "persistent"), "--json", str(record_path)],
      capture_output=True, text=True, timeout=200)
  assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
  record = json.loads(record_path.read_text())
  # The link alone, and a step's write, copy and the copy's write; their scratch files gone.
  assert record["ppermute_gbps"] > 0 and record["step_work_s"] > 0
  assert not list((tmp_path / "ram").rglob("bench-*-write"))
  by_interval = {r["interval"]: r for r in record["results"]}
  assert by_interval[1]["between_p50_s"] is None  # every call saves
  every_3 = by_interval[3]
  saving = [ms for i, ms in enumerate(every_3["per_call_ms"])
            if (every_3["first_step"] + i) % 3 == 0]
  assert len(saving) == 2
  assert len(every_3["spread_intervals"]) == 2 and min(every_3["spread_intervals"]) >= 1
  assert every_3["saving_p50_s"] * 1000 == pytest.approx(statistics.median(saving), abs=0.01)
  assert every_3["between_p50_s"] > 0
  assert "saving calls p50 / p99" in result.stdout


def test_collective_order_times_an_update_behind_a_late_chunk(tmp_path):
  """benchmarks/collective_order.py under the launcher, tiny: the update alone, behind a chunk
  every process joined at once, and behind one whose last process joined late."""
  record_path = tmp_path / "order.json"
  script = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "collective_order.py"
  result = subprocess.run(
      [sys.executable, "-m", "orbax_mtc", "launch", "--nprocs", "2", "--devices-per-process",
       "1", "--local-root", str(tmp_path / "ram"), "--", sys.executable, str(script), "--mib",
       "1", "--chunk-mib", "1", "--late-ms", "50", "--reps", "1", "--json", str(record_path)],
      capture_output=True, text=True, timeout=200)
  assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
  record = json.loads(record_path.read_text())
  assert record["processes"] == 2 and record["late_ms"] == 50
  medians = record["punctual_update_median_s"]
  assert sorted(medians) == ["after_joined_chunk_s", "after_late_chunk_s", "alone_s"]
  assert all(v > 0 for v in medians.values())
  assert "joined 50 ms late" in result.stdout
