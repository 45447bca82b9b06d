"""Elastic restore from RAM: real JAX processes restart on another process count, mesh or
device count and rebuild the newest RAM step from the surviving folders and peer copies.

Every job saves steps 0..10 (RAM every 2 steps, keep 2; persistent every 100 steps, so the
persistent tier holds only step 0): a restore of step 10 or 8 can only come from RAM. The
state's shapes follow a (data=2, model=2) mesh whatever the job's mesh (`--shape-axes`), so
every target below is the saved state on another layout. Each restore is checked bit for bit
on every process (`tests/mp_worker`), and each case is run again with one corrupt copy.
"""

from __future__ import annotations

import json
import pathlib
import shutil

import mp_helpers
import pytest
from mp_helpers import assert_ok, assert_results, mp_events, new_root, tail

from orbax_mtc.local.format import DATA, MANIFEST
from orbax_mtc.local.store import read_manifest
from orbax_mtc.peers import copy_store as peer_store

pytestmark = pytest.mark.timeout(400)
TIMEOUT_S = 150
SAVE_ARGS = ["--local-interval", "2", "--local-keep", "2", "--persistent-interval", "100",
             "--shape-axes", "2,2"]

# name -> (saved: processes, devices each, replicas; restored: processes, devices, replicas)
CASES = {
    "4to2": ((4, 1, 2), (2, 1, 2)),  # two hosts gone; their shards are peer copies here
    "2to4": ((2, 1, 2), (4, 1, 2)),  # two new hosts with empty RAM
    "mesh": ((4, 1, 2), (4, 1, 1)),  # (data=2, model=2) -> (data=1, model=4)
    "devices": ((2, 1, 2), (2, 2, 2)),  # one device per process -> two
}


def _job(command: list[str], procs: int, devices: int, root: pathlib.Path):
  return mp_helpers.run_job(command, procs, root, devices=devices, timeout_s=TIMEOUT_S)


@pytest.fixture(scope="module")
def saved(tmp_path_factory, request):
  """Per saved layout (processes, devices, replicas): (RAM root, persistent folder)."""
  runs: dict[tuple[int, int, int], tuple[pathlib.Path, pathlib.Path]] = {}

  def get(layout: tuple[int, int, int]):
    if layout not in runs:
      procs, devices, replicas = layout
      root = new_root(f"elastic-saved-{procs}x{devices}")
      request.addfinalizer(lambda: shutil.rmtree(root, ignore_errors=True))
      persistent = tmp_path_factory.mktemp(f"elastic-{procs}x{devices}") / "ckpt"
      result, out = _job(["save", "--steps", "11", "--persistent-dir", str(persistent),
                          "--replicas", str(replicas), *SAVE_ARGS], procs, devices, root)
      assert_ok(result, out)
      runs[layout] = (root, persistent)
    return runs[layout]
  return get


@pytest.fixture
def root(request):
  path = new_root(request.node.name)
  yield path
  shutil.rmtree(path, ignore_errors=True)


def _clone(run, root: pathlib.Path, tmp_path: pathlib.Path, procs: int) -> pathlib.Path:
  src_root, src_persistent = run
  for node in range(procs):
    src = src_root / f"node{node}"
    if src.exists():
      shutil.copytree(src, root / f"node{node}", symlinks=True)
  persistent = tmp_path / "persistent"
  shutil.copytree(src_persistent, persistent, symlinks=True)
  return persistent


def _corrupt(folder: pathlib.Path) -> None:
  """Flips a byte of every non-empty shard of a step folder (own or peer copy): a restore
  checks only the tiles it uses, so each must be bad for the folder to be unusable."""
  manifest = json.loads((folder / MANIFEST).read_text())
  data = folder / DATA
  raw = bytearray(data.read_bytes())
  if (folder / "copy.json").exists():
    places = [x for x in json.loads((folder / "copy.json").read_text())["layout"] if x >= 0]
  else:
    places = [shard[1] for item in manifest["items"].values() for leaf in item.get("leaves", [])
              for shard in leaf["shards"] if shard[2]]
  assert places, folder
  for at in places:
    raw[at] ^= 0xFF
  data.write_bytes(bytes(raw))


def _restore(case: str, saved, root, tmp_path, *, corrupt=None, expect_step=10):
  before, after = CASES[case]
  persistent = _clone(saved(before), root, tmp_path, before[0])
  if corrupt is not None:
    _corrupt(root / corrupt)
  procs, devices, replicas = after
  result, out = _job(["save", "--restore-first", "--explicit-args", "--start", "11",
                      "--steps", "13", "--persistent-dir", str(persistent), "--replicas",
                      str(replicas), *SAVE_ARGS], procs, devices, root)
  assert_ok(result, out)
  assert_results(out, procs, step=expect_step, tier="elastic")
  return persistent, out


def _new_layout_step(root: pathlib.Path, procs: int, step: int) -> None:
  """Every node holds `step` in its own folder, saved by this job's layout, and a peer holds
  a committed copy of it (the node is protected again)."""
  copies: dict[int, list[int]] = {}
  for node in range(procs):
    manifest = json.loads((root / f"node{node}" / str(step) / MANIFEST).read_text())
    assert (manifest["process_count"], manifest["process_index"]) == (procs, node)
    store = peer_store.PeerStore(root / f"node{node}", max_to_keep=None)
    for source, copied in store.copies():
      folder = store.source_dir(source) / str(copied)
      if copied == step and read_manifest(folder).process_count == procs:
        copies.setdefault(source, []).append(node)
  assert sorted(copies) == list(range(procs)), copies


@pytest.mark.parametrize("case", list(CASES))
def test_restart_on_another_layout_restores_the_newest_ram_step(case, saved, root, tmp_path):
  persistent, _ = _restore(case, saved, root, tmp_path)
  procs, devices, replicas = CASES[case][1]
  # The step is in RAM in the new layout, the next save (12) was an ordinary one, and a plain
  # restart on this layout restores it from RAM.
  _new_layout_step(root, procs, 10)
  _new_layout_step(root, procs, 12)
  result, out = _job(["restore", "--explicit-args", "--persistent-dir", str(persistent),
                      "--replicas", str(replicas), *SAVE_ARGS], procs, devices, root)
  assert_ok(result, out)
  assert_results(out, procs, step=12, tier="local")


# Which folder is corrupted, and the step that must then come back.
CORRUPT = {
    # The copy of saved rank 2 (on node 0) is its only copy, and rank 2's shards of
    # params/w and idx exist nowhere else: step 10 cannot be assembled, step 8 can.
    "4to2": ("node0/peers/2/10", 8),
    # Node 0's own step is bad; node 1 holds a copy of saved rank 0.
    "2to4": ("node0/10", 10),
    # Node 1's own step is bad; its copy on node 3 serves saved rank 1.
    "mesh": ("node1/10", 10),
    "devices": ("node1/10", 10),
}


@pytest.mark.parametrize("case", list(CASES))
def test_one_corrupt_copy_falls_back_to_another_copy_or_an_older_step(case, saved, root,
                                                                       tmp_path):
  corrupt, step = CORRUPT[case]
  _, out = _restore(case, saved, root, tmp_path, corrupt=corrupt, expect_step=step)
  assert "checksum mismatch" in out.text(), tail(out)


def test_a_target_of_another_shape_is_an_error_everywhere_and_keeps_every_step(
    saved, root, tmp_path):
  persistent = _clone(saved((4, 1, 2)), root, tmp_path, 4)
  before = sorted(p.name for p in (root / "node0").iterdir())
  result, out = _job(["restore", "--explicit-args", "--persistent-dir", str(persistent),
                      "--replicas", "2", *SAVE_ARGS[:-1], "4,2"], 2, 1, root)
  assert result.returncode != 0, tail(out)
  assert "AbstractStateMismatchError" in out.text() and "shape" in out.text(), tail(out)
  assert sorted(p.name for p in (root / "node0").iterdir()) == before


def test_latest_step_lists_the_step_an_elastic_restore_rebuilds(saved, root, tmp_path):
  """`restore(latest_step())`, Orbax's and MaxText's resume idiom, finds the same step as
  `restore(None)`: two new hosts with empty RAM do not hide step 10 behind the persistent
  step 0."""
  persistent = _clone(saved((2, 1, 2)), root, tmp_path, 2)
  result, out = _job(["steps", "--restore-steps", "latest", "--explicit-args",
                      "--persistent-dir", str(persistent), "--replicas", "2", *SAVE_ARGS],
                     4, 1, root)
  assert_ok(result, out)
  listed = mp_events.events(out.lines, "STEPS")
  assert sorted(node for node, _ in listed) == [0, 1, 2, 3], tail(out)
  for _, fields in listed:
    assert fields["latest"] == "10" and fields["all"] == "0,8,10", fields
  assert_results(out, 4, step=10, tier="elastic")


def test_latest_step_never_lists_a_step_only_part_of_an_old_layout_holds(root, tmp_path):
  """Two processes without copies saved steps 0-6, then node 1 was lost; a 1-process job
  (both devices) finds node 0's half of steps 5 and 6. `latest_step()` listed them as this
  node's own steps, and `restore(latest_step())` raised FileNotFoundError at every restart;
  it must list only what a restore can build: persistent steps 0 and 4."""
  persistent = tmp_path / "persistent"
  args = ["--persistent-dir", str(persistent), "--local-interval", "1", "--persistent-interval",
          "4", "--peers-per-node", "0", "--shape-axes", "2,2", "--explicit-args"]
  result, out = _job(["save", "--steps", "7", *args], 2, 1, root)
  assert_ok(result, out)
  shutil.rmtree(root / "node1")
  result, out = _job(["steps", "--restore-steps", "latest", *args], 1, 2, root)
  assert_ok(result, out)
  assert [fields["all"] for _, fields in mp_events.events(out.lines, "STEPS")] == ["0,4"]
  assert_results(out, 1, step=4, tier="persistent")


def test_latest_step_lists_a_step_only_a_set_aside_folder_of_this_count_covers(root, tmp_path):
  """A 1-process job (both devices) saved steps 0-6; a 2-process job rebuilt step 6 and wrote
  it anew (node 0's 1-process folder set aside), then node 1 was lost. Back on one process,
  node 0's new folder holds only its half, but the set-aside folder is a whole save of this
  process count: `restore(None)` rebuilds step 6 from it, so `latest_step()` must list it
  (it named persistent step 4, and `restore(latest_step())` rolled back past step 6)."""
  persistent = tmp_path / "persistent"
  args = ["--persistent-dir", str(persistent), "--local-interval", "1", "--persistent-interval",
          "4", "--peers-per-node", "0", "--shape-axes", "2,2", "--explicit-args"]
  result, out = _job(["save", "--steps", "7", *args], 1, 2, root)
  assert_ok(result, out)
  result, out = _job(["steps", "--restore-steps", "latest", *args], 2, 2, root)
  assert_ok(result, out)
  assert_results(out, 2, step=6, tier="elastic")
  node0 = sorted(p.name for p in (root / "node0").iterdir())
  assert any(name.startswith(".") and "-6-" in name for name in node0), node0
  shutil.rmtree(root / "node1")
  result, out = _job(["steps", "--restore-steps", "latest", *args], 1, 2, root)
  assert_ok(result, out)
  assert [fields["latest"] for _, fields in mp_events.events(out.lines, "STEPS")] == ["6"]
  # Served by node 0's own rank from the set-aside folder (not in place: "peer"), and still
  # listed after the restore, while its write-back commits.
  assert_results(out, 1, step=6, tier="peer")
  assert [fields["latest"] for _, fields in mp_events.events(out.lines, "STEPS-AFTER")] == ["6"]
