"""The seams of the restore path (issue 39): each case is a step that exists in RAM, bit-exact,
on enough nodes to rebuild it, and that a restart must neither roll back nor delete.

Real JAX processes (`tests/mp_worker`), each with its RAM folder `<root>/node<i>`; every
restore is checked bit for bit on every process (RESULT ok=1). The jobs save steps 0..9 with
a RAM save every step (keep 3: RAM holds 7, 8, 9) and, unless said otherwise, a persistent
save every 4 steps (persistent holds 0, 4, 8): a restore of step 9 can only come from RAM,
and a restore of 8 from the persistent tier is the rollback the issue describes.

  1. process ids permuted at restart (the two node folders swapped);
  2. a crash the instant an elastic restore returns;
  3. a step folder without its manifest;
  4. an elastic restore of some items only;
  5. a transient (non-damage) error while building the arrays;
  6. a per-process item (a data iterator's position) after a twin-sourced recovery, and
     `restore(latest_step())` with such an item.
"""

from __future__ import annotations

import json
import pathlib
import re
import shutil

import mp_helpers
import pytest
from mp_helpers import assert_ok, mp_events, tail

from orbax_mtc.local import format as local_format
from orbax_mtc.local import store as local_store
from orbax_mtc.peers import copy_store as peer_store

pytestmark = pytest.mark.timeout(600)  # above four jobs' TIMEOUT_S
TIMEOUT_S = 120
NEWEST = 9  # the newest step every save job below leaves in RAM
RAM = ["--local-interval", "1", "--local-keep", "3"]
BASE = [*RAM, "--persistent-interval", "4"]
RESHAPE = ["--shape-axes", "2,2"]  # the state's shapes whatever the mesh (elastic restores)


def _job(command: list[str], root: pathlib.Path, *, procs: int = 2, devices: int = 2):
  return mp_helpers.run_job(command, procs, root, devices=devices, timeout_s=TIMEOUT_S)


def _committed(root: pathlib.Path, node: int) -> list[int]:
  return local_store.committed_steps(root / f"node{node}")


def _results(out, procs: int) -> dict[int, dict[str, str]]:
  results = mp_events.parse_results(out.lines)
  assert sorted(results) == list(range(procs)), f"missing RESULT lines:\n{tail(out)}"
  return results


def _restored_from_ram(out, procs: int, step: int = NEWEST, tier: str | None = None) -> None:
  """Every process restored `step` bit for bit from RAM (any RAM tier, or exactly `tier`)."""
  for node, fields in sorted(_results(out, procs).items()):
    assert fields["ok"] == "1", f"node {node}: restored data differs: {fields['detail']}"
    assert fields["step"] == str(step) and fields["tier"] not in ("persistent", "none"), (
        f"node {node} restored step {fields['step']} from the {fields['tier']} tier, not step "
        f"{step} from RAM\n{tail(out)}")
    if tier is not None:
      assert fields["tier"] == tier, f"node {node}: {fields}\n{tail(out)}"


def _save(root: pathlib.Path, persistent: pathlib.Path, *extra: str, procs: int = 2,
          devices: int = 2, command: str = "save") -> None:
  result, out = _job([command, "--steps", str(NEWEST + 1), "--persistent-dir", str(persistent),
                      *extra], root, procs=procs, devices=devices)
  assert_ok(result, out)
  for node in range(procs):
    assert NEWEST in _committed(root, node), tail(out)


def _restore(root: pathlib.Path, persistent: pathlib.Path, *extra: str, procs: int = 2,
             devices: int = 2):
  return _job(["restore", "--explicit-args", "--persistent-dir", str(persistent), *extra], root,
              procs=procs, devices=devices)


# ----------------------------------------------------------------------------- 1


@pytest.mark.parametrize("interval", [4, 100], ids=["persistent-0-4-8", "persistent-0-only"])
def test_swapped_node_folders_restore_the_newest_ram_step_and_delete_nothing(
    shm_root, tmp_path, interval):
  """Case 1: the process indices are permuted at restart (each host's folder now belongs to
  the other process index, as after a Slurm or TPU-VM renumbering). Each process held a whole
  replica (data=2, model=2), so every folder still serves whichever process needs it."""
  persistent = tmp_path / "persistent"
  flags = [*RAM, "--persistent-interval", str(interval), "--replicas", "2"]
  _save(shm_root, persistent, *flags)
  held = {node: _committed(shm_root, node) for node in range(2)}
  assert held == {0: [7, 8, 9], 1: [7, 8, 9]}, held
  (shm_root / "node0").rename(shm_root / "swap")
  (shm_root / "node1").rename(shm_root / "node0")
  (shm_root / "swap").rename(shm_root / "node1")

  result, out = _restore(shm_root, persistent, *flags)
  assert_ok(result, out)
  _restored_from_ram(out, 2)
  for node in range(2):
    # Nothing deleted: step 9 still in RAM on every node, and the older RAM steps too.
    assert {7, 8, 9} <= set(_committed(shm_root, node)), (node, _committed(shm_root, node),
                                                           tail(out))
  # And a second restart restores step 9 from RAM again.
  result, out = _restore(shm_root, persistent, *flags)
  assert_ok(result, out)
  _restored_from_ram(out, 2)


# ----------------------------------------------------------------------------- 2


def test_a_crash_right_after_an_elastic_restore_keeps_the_newest_step(shm_root, tmp_path):
  """Case 2: saved on (data=2, model=2); restarted on (data=1, model=4), whose restore of step
  9 rebuilds it elastically, and every process dies the instant restore() returns, or as its
  first RAM write (the write-back) starts, whichever comes first. The next restart (same new
  mesh) must still find step 9 in RAM: at every instant the newest step is restorable from
  RAM."""
  persistent = tmp_path / "persistent"
  flags = [*BASE, *RESHAPE]
  _save(shm_root, persistent, *flags, "--replicas", "2")
  result, out = _job(["restore-exit", "--persistent-dir", str(persistent), *flags,
                      "--replicas", "1"], shm_root)
  assert not result.timed_out, tail(out)
  restored = dict(mp_events.events(out.lines, "RESTORED"))
  died = dict(mp_events.events(out.lines, "WRITE-EXIT"))
  assert set(restored) | set(died) == {0, 1}, f"a process did not die as planned\n{tail(out)}"
  for node, fields in restored.items():
    assert fields["step"] == str(NEWEST) and fields["tier"] != "persistent", (node, fields)

  result, out = _restore(shm_root, persistent, *flags, "--replicas", "1")
  assert_ok(result, out)
  _restored_from_ram(out, 2)


# ----------------------------------------------------------------------------- 3


# name -> (processes, devices each, flags): twins (each process a whole replica), or FSDP
# only (no twins: node 1's shards exist only in its folder and in one peer's copy of it).
MANIFEST_LAYOUTS = {
    "twins": (2, 2, ["--replicas", "2"]),
    "fsdp": (4, 1, ["--replicas", "1", "--peers-per-node", "1"]),
}


@pytest.mark.parametrize("layout", list(MANIFEST_LAYOUTS))
def test_a_step_folder_without_its_manifest_does_not_block_the_job(shm_root, tmp_path, layout):
  """Case 3: node 1's `9/manifest.json` is gone. The restore gets step 9 from elsewhere, the
  damaged folder is moved aside (never blocks the write-back), close() does not raise, and
  the next restart restores step 9 from every node's own folder."""
  procs, devices, flags = MANIFEST_LAYOUTS[layout]
  persistent = tmp_path / "persistent"
  flags = [*BASE, *flags]
  _save(shm_root, persistent, *flags, procs=procs, devices=devices)
  (shm_root / "node1" / str(NEWEST) / local_format.MANIFEST).unlink()

  result, out = _restore(shm_root, persistent, *flags, procs=procs, devices=devices)
  assert_ok(result, out)  # close() raised nothing on any process
  _restored_from_ram(out, procs)
  assert "FileExistsError" not in out.text(), tail(out)
  # Node 1 holds a committed, valid step 9 of its own again (the damaged folder was moved
  # aside, as `.damaged-9-<id>`, or already removed).
  node1 = shm_root / "node1"
  assert NEWEST in _committed(shm_root, 1), (sorted(p.name for p in node1.iterdir()),
                                             tail(out))
  manifest = json.loads((node1 / str(NEWEST) / local_format.MANIFEST).read_text())
  assert (manifest["step"], manifest["process_index"]) == (NEWEST, 1), manifest

  result, out = _restore(shm_root, persistent, *flags, procs=procs, devices=devices)
  assert_ok(result, out)
  _restored_from_ram(out, procs, tier="local")


# ----------------------------------------------------------------------------- 4


def test_an_elastic_restore_of_some_items_keeps_the_others(shm_root, tmp_path):
  """Case 4: steps saved with two items, `params` and `opt`, on (data=2, model=2); a restart
  on (data=1, model=4) restores `params` only (its write-back must not drop `opt`); the next
  restart restores both items of step 9 from RAM."""
  persistent = tmp_path / "persistent"
  flags = ["--persistent-dir", str(persistent), *BASE, *RESHAPE]
  _save(shm_root, persistent, *BASE, *RESHAPE, "--replicas", "2", command="items")

  result, out = _job(["items", "--restore-items", "params", *flags, "--replicas", "1"],
                     shm_root)
  assert_ok(result, out)
  _restored_from_ram(out, 2, tier="elastic")

  result, out = _job(["items", "--restore-items", "params,opt", *flags, "--replicas", "1"],
                     shm_root)
  assert "MissingItemError" not in out.text(), (
      f"the partial restore's write-back dropped an item of step {NEWEST}\n{tail(out)}")
  assert_ok(result, out)
  _restored_from_ram(out, 2)


# ----------------------------------------------------------------------------- 5


def test_a_transient_error_while_building_is_raised_everywhere_and_deletes_nothing(
    shm_root, tmp_path):
  """Case 5: process 1's `jax.device_put` fails with RESOURCE_EXHAUSTED while the restore
  builds its arrays (a transient device error; every byte on disk is fine). Only errors that
  prove damage may exclude a source: this one is agreed and raised on every process, nothing
  is deleted, and a clean restart then restores step 9 from RAM."""
  persistent = tmp_path / "persistent"
  flags = [*BASE, "--replicas", "2"]
  _save(shm_root, persistent, *flags)

  result, out = _job(["restore-transient", "--fault-process", "1", "--persistent-dir",
                      str(persistent), *flags], shm_root)
  assert not result.timed_out, tail(out)
  injected = dict(mp_events.events(out.lines, "INJECTED"))
  assert int(injected.get(1, {}).get("calls", 0)) > 0, f"the fault never fired\n{tail(out)}"
  results = mp_events.parse_results(out.lines)
  assert not results, f"a process restored despite the error: {results}\n{tail(out)}"
  errors = dict(mp_events.events(out.lines, "RAISED"))
  assert sorted(errors) == [0, 1], f"not raised on every process: {errors}\n{tail(out)}"
  for node, fields in errors.items():
    assert "RESOURCE_EXHAUSTED" in fields["detail"], (node, fields)
  for node in range(2):
    assert {7, 8, 9} <= set(_committed(shm_root, node)), (node, _committed(shm_root, node),
                                                           tail(out))

  result, out = _restore(shm_root, persistent, *flags)
  assert_ok(result, out)
  _restored_from_ram(out, 2, tier="local")


# ----------------------------------------------------------------------------- 6


# Pure data parallelism: the two processes are twins (same shards), so a node's per-process
# item `pos` can only come from its own folder or a peer's copy of it, never from its twin.
POS = ["--layout", "dp", *BASE]


def _pos(root: pathlib.Path, persistent: pathlib.Path, restore: str):
  return _job(["pos", "--restore", restore, "--persistent-dir", str(persistent), *POS], root)


def _copy_dir(root: pathlib.Path, holder: int, source: int, step: int) -> pathlib.Path:
  return peer_store.PeerStore(root / f"node{holder}", max_to_keep=None).source_dir(source) / str(
      step)


def _items(folder: pathlib.Path) -> set[str]:
  """The items a step folder's manifest lists (none when it has no readable manifest)."""
  try:
    return set(json.loads((folder / local_format.MANIFEST).read_text())["items"])
  except (OSError, ValueError, KeyError):
    return set()


def test_a_twin_recovery_never_replaces_the_richer_copy_of_a_per_process_item(
    shm_root, tmp_path):
  """Case 6: node 1 lost its step 9; node 0 holds node 1's step 9 as a peer copy, `pos`
  included. A restore of the state alone gives node 1 its twin's folder, less the twin's
  `pos` (by design); the copies sent again afterwards must not replace node 0's richer copy.
  Then `restore(latest_step())` and `restore(None)` with `pos` both give step 9, each process
  its own `pos`."""
  persistent = tmp_path / "persistent"
  _save(shm_root, persistent, *POS, command="pos")
  copy = _copy_dir(shm_root, 0, 1, NEWEST)
  assert "pos" in _items(copy), sorted(_items(copy))
  shutil.rmtree(shm_root / "node1" / str(NEWEST))

  result, out = _pos(shm_root, persistent, "state")
  assert_ok(result, out)
  _restored_from_ram(out, 2)
  holding = [folder for folder in (shm_root / "node1" / str(NEWEST), copy)
             if "pos" in _items(folder)]
  assert holding, (f"node 1's `pos` of step {NEWEST} is gone from its folder and from node "
                   f"0's copy: {_items(shm_root / 'node1' / str(NEWEST))}, {_items(copy)}\n"
                   f"{tail(out)}")

  result, out = _pos(shm_root, persistent, "latest-pos")
  listed = dict(mp_events.events(out.lines, "STEPS"))
  assert all(f["latest"] == str(NEWEST) for f in listed.values()), (listed, tail(out))
  assert_ok(result, out)
  _restored_from_ram(out, 2)
  result, out = _pos(shm_root, persistent, "none-pos")
  assert_ok(result, out)
  _restored_from_ram(out, 2)


def test_restore_latest_step_with_a_per_process_item_agrees_with_restore_none(
    shm_root, tmp_path):
  """Case 6, listing: node 1's step 9 is gone with every copy of it, so only its twin can give
  back the state of step 9, and nobody its `pos`. `restore(latest_step())` with `pos` in the
  args either restores the step it names, or raises an error that names the missing item
  (not FileNotFoundError: the step is listed); `restore(None)` agrees with it."""
  persistent = tmp_path / "persistent"
  _save(shm_root, persistent, *POS, command="pos")
  shutil.rmtree(shm_root / "node1" / str(NEWEST))
  shutil.rmtree(_copy_dir(shm_root, 0, 1, NEWEST))

  result, out = _pos(shm_root, persistent, "latest-pos")
  assert not result.timed_out, tail(out)
  listed = dict(mp_events.events(out.lines, "STEPS"))
  assert sorted(listed) == [0, 1] and len({f["latest"] for f in listed.values()}) == 1, (
      listed, tail(out))
  latest = listed[0]["latest"]
  errors = dict(mp_events.events(out.lines, "RAISED"))
  if errors:
    assert sorted(errors) == [0, 1], f"raised on some processes only: {errors}\n{tail(out)}"
    for node, fields in errors.items():
      assert fields["type"] != "FileNotFoundError", (
          f"node {node}: restore(latest_step()={latest}) says the listed step does not exist: "
          f"{fields['detail']}")
      assert re.search(r"\bpos\b", fields["detail"]), f"node {node}: names no item: {fields}"
    assert not mp_events.parse_results(out.lines), tail(out)
  else:
    assert_ok(result, out)
    _restored_from_ram(out, 2, step=int(latest))

  result, out = _pos(shm_root, persistent, "none-pos")
  assert_ok(result, out)
  results = _results(out, 2)
  assert all(f["ok"] == "1" for f in results.values()), tail(out)
  steps = {f["step"] for f in results.values()}
  assert len(steps) == 1, results
  if not errors:
    # restore(latest_step()) worked: restore(None) restores the same step.
    assert steps == {latest}, (latest, results)
