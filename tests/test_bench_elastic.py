"""`orbax-mtc bench elastic-scale`: the simulated inventory plans the newest step, and a small
run through the real command writes its table, JSON and plot. Nothing here asserts a speed."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from orbax_mtc import agreement, save_census
from orbax_mtc.restore import census, outcome
from orbax_mtc.restore import plan as elastic_plan
from orbax_mtc.tools.bench import agreement_scale, elastic_scale


def test_the_simulated_layout_is_one_saved_sharding_per_kind():
  hosts = 8
  layouts = elastic_scale._layouts(hosts)
  fsdp = hosts * elastic_scale.DEVICES_PER_HOST // elastic_scale.REPLICAS
  for layout in layouts:
    index = elastic_plan.TileIndex(box for box, _ in layout.tiles)
    whole = tuple((0, n) for n in layout.shape)
    # The tiles cover the array exactly once, and every tile has one holder per replica
    # (a replicated leaf: every host).
    assert sum(elastic_plan.volume(box) for _, box in elastic_plan.pieces(whole, index)) == \
        elastic_plan.volume(whole)
    for _, holders in layout.tiles:
      assert list(holders) == sorted(set(holders))
      assert len(holders) == (hosts if layout.sharded_dim is None else elastic_scale.REPLICAS)
    # The survivors' new cuts cover the array exactly once too.
    if layout.sharded_dim is not None:
      cuts = [layout.targets(fsdp - 4, p) for p in range(fsdp - 4)]
      assert sum(elastic_plan.volume(b) for b in cuts) == elastic_plan.volume(whole)


@pytest.mark.parametrize("hosts", [4, 40, 200])
def test_measure_plans_the_newest_step_from_own_folders_and_copies(hosts):
  row = elastic_scale.measure(hosts, leaves=40, reps=1, seed=3)
  assert row["survivors"] == hosts - row["lost"] and row["lost"] == max(1, hosts // 100)
  # Every saved rank is served: the lost hosts' folders from their successors' peer copies
  # (unless the successor was lost too, which one lost host in 200 cannot be).
  assert row["servers"] == hosts and row["copies_serving"] == row["lost"]
  assert row["report_bytes_max"] <= agreement.ELASTIC_REPORT_BYTES
  assert row["pieces_per_process"] >= 40


@pytest.mark.parametrize("hosts", [8, 200, 1000])
def test_the_save_agreement_bytes_per_process_follow_the_census_formula(hosts):
  # The rounds are simulated process by process and their answer checked against the
  # all-gather's (agreement_scale.save_agreement raises otherwise).
  lost = list(range(0, hosts, 100))
  row = agreement_scale.save_agreement(hosts, lost)
  slots = 4  # 3 RAM steps and the step saved; the persistent step is one of them
  assert row["save_before_bytes"] == 2_424 * (hosts - 1)
  assert (row["save_steady_rounds"], row["save_lost_rounds"]) == (1, 2)
  assert row["save_steady_bytes"] == save_census.bytes_per_process(hosts, slots)
  assert row["save_lost_bytes"] == save_census.bytes_per_process(hosts, slots, lacking=3)


@pytest.mark.parametrize("hosts", [8, 200, 1000])
def test_the_restore_agreement_bytes_per_process_follow_the_census_and_planning_formulas(hosts):
  # Simulated process by process, the plan checked against the all-gather's (the bench raises
  # otherwise). The census has 3 slots (the RAM steps; the persistent step is one of them).
  row = elastic_scale.measure(hosts, leaves=8, reps=1, seed=3)
  survivors, lost = row["survivors"], row["lost"]
  assert row["restore_elastic_bytes"] == save_census.bytes_per_process(
      survivors, 3) + census.planning_bytes(hosts, survivors, row["restore_elastic_coded"])
  # Replaced hosts: the census's coverage round for the 3 steps they lack, and only the lost
  # ranks' servers (copies on other processes) travel as indices.
  assert row["restore_replaced_coded"] == lost
  assert row["restore_replaced_bytes"] == save_census.bytes_per_process(
      hosts, 3, lacking=3) + census.planning_bytes(hosts, hosts, lost)
  assert row["restore_elastic_before_bytes"] == (3384 + 16) * (survivors - 1)
  # The build's outcome: one statuses round when all went well.
  assert row["outcome_after_bytes"] == outcome.outcome_bytes(survivors)
  # The exchange: the status round, then the stream counts, destinations and each round's
  # largest (test_restore_outcome checks the rounds' real sizes against this formula).
  assert row["serve_after_bytes"] == outcome.exchange_bytes(
      survivors, row["streams"], row["streams_most"], row["exchange_rounds"])


@pytest.mark.parametrize("hosts, streams, received_bytes", [
    (1_000, 1_272, 4_573), (10_000, 16_209, 67_043), (100_000, 183_159, 877_833)])
def test_the_exchange_agreement_stays_under_a_mebibyte_at_100000_hosts(
    hosts, streams, received_bytes):
  # The streams of `orbax-mtc bench elastic-scale` at these host counts (1% lost, 2,000
  # leaves, at most 4 streams from one process, 4 transfer rounds;
  # benchmarks/results/elastic-scale.md): bit_length(P - 1) bits a stream's destination,
  # where a slot of 8 bytes a stream brought 3.0 MiB at 100,000 hosts.
  survivors = hosts - hosts // 100
  assert outcome.exchange_bytes(survivors, streams, 4, 4) == received_bytes
  assert received_bytes < 2 ** 20


def test_measure_refuses_an_odd_host_count():
  with pytest.raises(ValueError, match="even"):
    elastic_scale.measure(7, leaves=4, reps=1)


def test_the_command_writes_its_table_json_and_plot(tmp_path):
  out = tmp_path / "out"
  result = subprocess.run(
      [sys.executable, "-m", "orbax_mtc", "bench", "elastic-scale", "--hosts", "8", "64",
       "--leaves", "30", "--reps", "2", "--out", str(out), "--json"],
      capture_output=True, text=True, timeout=300, check=False)
  assert result.returncode == 0, result.stderr
  # --json: stdout is the document the file holds and nothing else; the table is on stderr.
  assert json.loads(result.stdout) == json.loads((out / "elastic-scale.json").read_text())
  assert json.loads(result.stdout)["schema"] == "orbax-mtc/bench-elastic-scale/1"
  assert "| 8 | 1 |" in result.stderr
  table = (out / "elastic-scale.md").read_text()
  assert "| 8 | 1 |" in table and "| 64 | 1 |" in table
  assert "| 64 | 149.1 KiB | 922 B (1) | 1.3 KiB (2) |" in table
  assert "| 64 | 205.9 KiB | 2.3 KiB (5) | 209.2 KiB | 2.6 KiB (6) |" in table
  document = json.loads((out / "elastic-scale.json").read_text())
  assert [r["hosts"] for r in document["rows"]] == [8, 64]
  assert all(len(r["plan_s_all"]) == 2 for r in document["rows"])
  png = out / "elastic-scale.png"
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_command_refuses_bad_arguments():
  result = subprocess.run(
      [sys.executable, "-m", "orbax_mtc", "bench", "elastic-scale", "--hosts", "7"],
      capture_output=True, text=True, timeout=120, check=False)
  assert result.returncode != 0 and "even" in result.stderr
