"""`orbax-mtc bench suite`: planning and ratio arithmetic (pure), and a small real run.

The smoke run checks that the three outputs exist and are well formed and that every planned
(processes, size) pair was measured by every contender; it asserts nothing about speed.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import uuid

import pytest

from orbax_mtc.tools.bench import limits, suite

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_plan_runs_skips_what_does_not_fit_and_says_why():
  runs, skipped = suite.plan_runs([1, 2, 4], [64, 1024, 2048, 4096],
                                  available_bytes=20 * 2**30)
  # One process needs 9x its state plus 0.5 GiB (1 x 2048 MiB: 18.5 GiB); with peers 10x
  # (2 x 1024 MiB: 21 GiB).
  assert runs == {1: [64, 1024, 2048], 2: [64], 4: [64]}
  assert {(s["procs"], s["mib"]) for s in skipped} == {
      (1, 4096), (2, 1024), (2, 2048), (2, 4096), (4, 1024), (4, 2048), (4, 4096)}
  assert all("GiB" in s["why"] and "available" in s["why"] for s in skipped)
  assert next(s for s in skipped if s["procs"] == 1)["why"].startswith(
      "needs about 36.5 GiB of memory and RAM disk (9x the state")


def _record(**extra):
  mib = 2**20
  seconds = {
      "memcpy_s": [0.010, 0.012, 0.011], "raw_write_new_s": [0.050, 0.060],
      "raw_write_overwrite_s": [0.020], "raw_read_s": [0.010], "raw_ppermute_s": [0.1],
      "mtc_save_s": [0.040], "mtc_blocking_s": [0.011], "mtc_restore_s": [0.020],
      "orbax_save_s": [0.4], "orbax_blocking_s": [0.1], "orbax_restore_s": [0.1],
      "mtc_replication_ring_s": [0.2], "mtc_replication_ring_bytes": [50.0 * mib],
      "mtc_local_restore_ring_s": [0.1], "mtc_recovery_ring_s": [0.3],
      "loop_plain_s": [10.0], "loop_local_s": [10.2], **extra}
  return {"procs": 2, "mib": 100, "bytes_per_process": 100 * mib, "replicas": 1,
          "seconds": seconds, "notes": {}}


def test_summarize_computes_ratios_against_limits_and_orbax():
  row = suite.summarize(_record(), [{"sigterm_to_durable_s": 2.0, "notice_s": 0.5,
                                     "agreement_s": 0.1, "local_s": 0.2, "peers_s": 0.3,
                                     "persistent_s": 0.4}])
  r = row["ratios"]
  assert r["local save / raw write"] == pytest.approx(0.020 / 0.040)  # vs the faster write
  assert r["restore / raw read"] == pytest.approx(0.5)
  assert r["save blocking / memcpy"] == pytest.approx(1.0)
  assert r["recovery / local restore (ring)"] == pytest.approx(3.0)
  assert r["replication / raw ppermute"] == pytest.approx((50 / 0.2) / (100 / 0.1))
  assert r["loop overhead, local save every 10 steps"] == pytest.approx(0.02)
  assert r["mtc_save / orbax_save"] == pytest.approx(10.0)
  assert r["orbax_blocking / mtc_blocking"] == pytest.approx(0.1 / 0.011)
  t = row["targets"]
  assert t["local save / raw write"]["met"] is False
  assert t["save blocking / memcpy"]["met"] is True
  assert t["recovery / local restore (ring)"]["met"] is False
  assert t["loop overhead, local save every 10 steps"]["met"] is True
  assert row["ondemand_s"] == 2.0 and row["spread"]["memcpy_s"] == {"min": 0.010,
                                                                    "max": 0.012, "n": 3}
  text = suite.markdown([row], [{"procs": 4, "mib": 4096, "why": "needs 96 GiB"}], "cmd")
  assert "| 2 | 100 | 0.50x ✗ | 0.50x ✗ | 1.00x ✓ | 3.00x ✗, - |" in text
  assert "10.00x" in text and "4 x 4096 MiB (needs 96 GiB)" in text


def test_summarize_sets_orbax_p2p_manager_beside_ours():
  row = suite.summarize(_record(p2p_save_s=[0.2], p2p_blocking_s=[0.055], p2p_restore_s=[0.08],
                                p2p_recovery_s=[0.9], p2p_recovery_build_s=[0.3],
                                mtc_recovery_twin_s=[0.3], mtc_local_restore_twin_s=[0.2],
                                mtc_replication_twin_s=[0.01],
                                mtc_replication_twin_bytes=[1.0]),
                        [])
  r = row["ratios"]
  assert r["mtc_save / p2p_save"] == pytest.approx(0.2 / 0.040)
  assert r["mtc_restore / p2p_restore"] == pytest.approx(0.08 / 0.020)
  assert r["p2p_blocking / mtc_blocking"] == pytest.approx(0.055 / 0.011)
  assert r["p2p_recovery / mtc_recovery (twin)"] == pytest.approx(3.0)
  text = suite.markdown([{**row, "notes": {"p2p": "saves its own shards"}}], [], "cmd")
  assert "| 2 | 100 | 5.00x | 4.00x | 5.0x | 3.00x | 0.52 / 1.31 | 0.90 s (0.30 s) |" in text
  assert "Notes: Orbax P2P: saves its own shards." in text


def test_orbax_p2p_runs_in_a_job_of_its_own_and_its_figures_join_the_others():
  assert suite.job_plan(["limits", "orbax", "emergency", "p2p", "mtc", "loop"]) == [
      ["limits", "orbax", "emergency", "mtc", "loop"], ["p2p"]]
  assert suite.job_plan(["p2p"]) == [["p2p"]]
  assert suite.job_plan(["mtc"]) == [["mtc"]]
  main_job = {**_record(), "notes": {"emergency": "e"}}
  p2p_job = {"procs": 2, "mib": 100, "bytes_per_process": 100 * 2**20, "replicas": 1,
             "seconds": {"p2p_save_s": [0.2]}, "notes": {"p2p": "p"}}
  other_size = {**p2p_job, "mib": 8}
  merged = suite.merge_records([main_job, p2p_job, other_size])
  assert [(r["procs"], r["mib"]) for r in merged] == [(2, 100), (2, 8)]
  assert merged[0]["seconds"]["p2p_save_s"] == [0.2]
  assert merged[0]["seconds"]["mtc_save_s"] == [0.040]
  assert merged[0]["notes"] == {"emergency": "e", "p2p": "p"}
  assert "p2p_save_s" not in main_job["seconds"]  # the inputs are left as they were
  row = suite.summarize(merged[0])
  assert row["ratios"]["mtc_save / p2p_save"] == pytest.approx(5.0)


def test_summarize_pairs_each_figure_with_the_limit_taken_beside_it():
  # Repetition 2 ran while the machine was slow for both: paired, it is a 1.0x repetition;
  # the medians of the two series would make it 2.0x.
  row = suite.summarize(_record(
      mtc_blocking_s=[0.010, 0.030, 0.020], paired_memcpy_s=[0.010, 0.030, 0.010],
      mtc_save_s=[0.040, 0.080, 0.040], paired_raw_write_s=[0.020, 0.060, 0.030],
      mtc_restore_s=[0.020, 0.020], paired_raw_read_s=[0.010, 0.010, 0.010],
      mtc_local_restore_ring_s=[0.1, 0.4, 0.1], mtc_recovery_ring_s=[0.1, 0.4, 0.3]))
  r = row["ratios"]
  assert r["save blocking / memcpy"] == pytest.approx(1.0)  # per repetition: 1, 1, 2
  assert r["local save / raw write"] == pytest.approx(0.75)  # 0.5, 0.75, 0.75
  assert r["recovery / local restore (ring)"] == pytest.approx(1.0)  # 1, 1, 3
  # Series of different lengths are not pairs: the medians of the phases are compared.
  assert r["restore / raw read"] == pytest.approx(0.5)
  assert row["paired_memcpy_gbps"] == pytest.approx(100 * 2**20 / 0.010 / 1e9)


def test_on_an_accelerator_blocking_is_held_to_the_device_to_host_copy():
  # --fresh-state (the default off CPU): the paired limit of the blocking time is the
  # device-to-host copy of the state, not a host memcpy.
  record = _record(mtc_blocking_s=[0.010, 0.012], paired_memcpy_s=[0.001, 0.001],
                   paired_d2h_s=[0.010, 0.008], d2h_s=[0.009])
  row = suite.summarize({**record, "backend": "gpu", "device_kind": "NVIDIA H100"}, [])
  row_cpu = suite.summarize(_record(mtc_blocking_s=[0.010, 0.012],
                                    paired_memcpy_s=[0.001, 0.001]), [])
  assert row["blocking_limit"] == "device-to-host copy"
  assert row["ratios"]["save blocking / memcpy"] == pytest.approx((1.0 + 1.5) / 2)
  assert row["targets"]["save blocking / memcpy"]["met"] is True
  assert row["d2h_gbps"] == pytest.approx(100 * 2**20 / 0.009 / 1e9)
  assert row_cpu["blocking_limit"] == "memcpy"
  assert row_cpu["ratios"]["save blocking / memcpy"] == pytest.approx(11.0)
  text = suite.markdown([row], [], "cmd")
  assert "blocking / device-to-host copy (≤1.25)" in text and "fresh device copy" in text
  assert "| memcpy / device-to-host |" in text and "Arrays on: gpu (NVIDIA H100)." in text
  assert "blocking / memcpy (≤1.25)" in suite.markdown([row_cpu], [], "cmd")


def test_device_to_host_copies_every_distinct_shard():
  import jax.numpy as jnp

  tree = {"a": jnp.arange(12, dtype=jnp.float32).reshape(3, 4), "b": limits.np.ones(5)}
  parts = limits.device_to_host(tree)
  assert [p.shape for p in parts] == [(3, 4), (5,)]
  assert limits.np.array_equal(parts[0], limits.np.arange(12).reshape(3, 4))
  assert all(isinstance(p, limits.np.ndarray) for p in parts)
  assert limits.local_nbytes(tree) == sum(p.nbytes for p in parts)


def test_summarize_leaves_unmeasured_contenders_out():
  row = suite.summarize({"procs": 1, "mib": 8, "bytes_per_process": 8 * 2**20, "replicas": 1,
                         "seconds": {"memcpy_s": [0.01], "mtc_blocking_s": [0.02]}})
  assert set(row["ratios"]) == {"local save / raw write", "restore / raw read",
                                "save blocking / memcpy"}
  assert row["ratios"]["local save / raw write"] != row["ratios"]["local save / raw write"]
  assert "recovery / local restore (ring)" not in row["targets"]


def test_limits_raw_write_and_read_round_trip(tmp_path):
  data = (limits.np.arange(3 * 2**20 + 7) % 251).astype(limits.np.uint8)
  path = str(tmp_path / "raw.bin")
  limits.raw_write(path, data, overwrite=False)
  limits.raw_write(path, data, overwrite=True)
  assert limits.np.array_equal(limits.raw_read(path), data)
  assert limits.spread([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}


def _run_suite(tmp_path: pathlib.Path, *args: str) -> tuple[dict, str]:
  """Runs `orbax-mtc bench suite ARGS` in a fresh RAM-disk scratch folder; (suite.json, .md)."""
  shm = pathlib.Path("/dev/shm")
  base = shm if shm.is_dir() and os.access(shm, os.W_OK) else tmp_path
  scratch = base / f"orbax-mtc-suite-test-{uuid.uuid4().hex[:8]}"
  scratch.mkdir()
  out = tmp_path / "out"
  env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
  try:
    done = subprocess.run(
        [sys.executable, "-m", "orbax_mtc", "bench", "suite", *args, "--out", str(out),
         "--scratch", str(scratch), "--quiet"],
        env=env, capture_output=True, text=True, timeout=480, start_new_session=True)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert list(scratch.iterdir()) == []
  finally:
    subprocess.run(["rm", "-rf", str(scratch)], check=False)

  def no_nan(token):
    raise AssertionError(f"non-JSON number {token} in suite.json")

  raw = json.loads((out / "suite.json").read_text(), parse_constant=no_nan)
  assert (out / "suite.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  return raw, (out / "suite.md").read_text()


@pytest.mark.timeout(500)
def test_suite_smoke_run(tmp_path):
  raw, table = _run_suite(tmp_path, "--sizes", "1", "3", "--procs", "1", "2", "--reps", "1",
                          "--loop-steps", "4", "--save-every", "2", "--step-ms", "5")
  assert raw["environment"]["jax"] and raw["environment"]["orbax_checkpoint"]
  assert {(r["procs"], r["mib"]) for r in raw["summary"]} == {(1, 1), (1, 3), (2, 1), (2, 3)}
  assert len(raw["ondemand"]) == 4
  for run in raw["runs"]:
    seconds = run["seconds"]
    expected = {"memcpy_s", "raw_write_new_s", "raw_read_s", "orbax_save_s", "mtc_save_s",
                "mtc_blocking_s", "mtc_restore_s", "loop_plain_s", "loop_local_s",
                "paired_memcpy_s", "paired_raw_write_s", "paired_raw_read_s"}
    # Orbax's P2P manager, in the same job at the same sizes; its restores were checked
    # bit for bit by the worker (a mismatch fails the job).
    expected |= {"p2p_save_s", "p2p_blocking_s", "p2p_restore_s"}
    if run["procs"] == 2:
      expected |= {"raw_ppermute_s", "raw_broadcast_s", "emergency_save_s",
                   "emergency_restore_s", "mtc_replication_ring_s", "mtc_recovery_ring_s",
                   "mtc_recovery_twin_s", "loop_peers_s", "p2p_recovery_s",
                   "p2p_recovery_build_s"}
    assert "nothing is copied to peers at save time" in run["notes"]["p2p"]
    assert expected <= set(seconds), expected - set(seconds)
    assert all(len(v) >= 1 and all(x > 0 for x in v) for v in seconds.values())
    for ours, limit in (("mtc_blocking_s", "paired_memcpy_s"), ("mtc_save_s",
                        "paired_raw_write_s"), ("mtc_restore_s", "paired_raw_read_s")):
      assert len(seconds[ours]) == len(seconds[limit])  # one pair per repetition
  for row in raw["summary"]:
    assert row["mtc_save_gbps"] > 0 and row["ondemand_s"] > 0
    assert row["p2p_save_gbps"] > 0 and row["ratios"]["mtc_restore / p2p_restore"] > 0
    if row["procs"] == 2:
      assert row["ratios"]["p2p_recovery / mtc_recovery (twin)"] > 0
  assert table.count("\n| 1 | ") == 8 and table.count("\n| 2 | ") == 8  # 2 sizes x 4 tables
  assert "orbax-mtc against Orbax's P2P manager" in table and "Notes: " in table
  assert all(run["backend"] == "cpu" and run["fresh_state"] is False for run in raw["runs"])
  assert "blocking / memcpy (≤1.25)" in table and "Arrays on: cpu." in table


@pytest.mark.timeout(300)
def test_suite_fresh_state_run_holds_blocking_to_the_device_to_host_copy(tmp_path):
  # The path an accelerator takes (--fresh-state auto turns it on off CPU), run on CPU: every
  # save gets a fresh device copy, and the limits include the device-to-host copy.
  raw, table = _run_suite(tmp_path, "--sizes", "1", "--procs", "1", "--reps", "2",
                          "--contenders", "limits", "orbax", "mtc", "loop", "--loop-steps",
                          "4", "--save-every", "2", "--step-ms", "5", "--ondemand-reps", "0",
                          "--fresh-state", "on")
  (run,) = raw["runs"]
  seconds = run["seconds"]
  assert run["fresh_state"] is True
  assert len(seconds["d2h_s"]) == 2
  assert len(seconds["paired_d2h_s"]) == len(seconds["mtc_blocking_s"]) == 2
  assert {"orbax_save_s", "mtc_save_s", "mtc_restore_s", "loop_local_s"} <= set(seconds)
  (row,) = raw["summary"]
  assert row["blocking_limit"] == "device-to-host copy"
  assert row["targets"]["save blocking / memcpy"]["value"] > 0
  assert "blocking / device-to-host copy (≤1.25)" in table
