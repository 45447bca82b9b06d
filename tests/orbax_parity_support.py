"""Helpers and fixtures shared by test_orbax_parity.py and test_orbax_meanings.py."""

from __future__ import annotations

import dataclasses
import inspect
import pathlib
import sys
import time

import pytest
import warm_start
from mp_helpers import assert_ok, child_env, mp_events, tail

ROWS, SEED = 4, 7


JOB_NAME = "parity-job"


# (owner, name) -> (kind, reason). kind: "extra" (ours only), "absent" (Orbax's only),
# "default" (same field, another default). Every entry must still be a difference.
DIFFERENCES: dict[tuple[str, str], tuple[str, str]] = {
    ("LocalCheckpointOptions", "background_nice"): (
        "extra", "the RAM tier's background threads yield the cores to the training step"),
    ("LocalCheckpointOptions", "directory_mode"): (
        "extra", "permissions of the RAM tier's folders (weights are private by default)"),
    ("LocalCheckpointOptions", "device_copy"): (
        "extra", "save() blocks for a device-side copy, not the device-to-host transfer"),
    ("LocalCheckpointOptions", "file_mode"): (
        "extra", "permissions of the RAM tier's files"),
    ("LocalCheckpointOptions", "save_overhead_budget"): (
        "extra", "a continuous policy's saves cost the loop at most this fraction"),
    ("PersistentCheckpointOptions", "backup_interval_minutes"): (
        "extra", "back up by minutes, the GKE replicator's backup-interval-minutes"),
    ("PersistentCheckpointOptions", "best_fn"): (
        "extra", "best_step/metrics rank persistent steps, as ocp.CheckpointManagerOptions"),
    ("PersistentCheckpointOptions", "best_mode"): (
        "extra", "with best_fn, as ocp.CheckpointManagerOptions"),
    ("PersistentCheckpointOptions", "skip_backups_when_busy"): (
        "extra", "skip a due backup instead of waiting, as Orbax's save waits"),
    ("CheckpointManagerOptions", "replication"): (
        "extra", "peer copies and the replica axis by name"),
    ("CheckpointManagerOptions", "job_name"): ("extra", "names the .restore LKG links"),
    ("CheckpointManagerOptions", "worker_index"): (
        "extra", "the worker part of the .restore LKG links"),
    ("CheckpointManagerOptions", "exit_after_ondemand_checkpoint"): (
        "extra", "Pax's flag: exit after the SIGTERM checkpoint"),
    ("CheckpointManagerOptions", "ondemand_grace_seconds"): (
        "extra", "time budget of the SIGTERM checkpoint"),
    ("CheckpointManagerOptions", "agreement_timeout_seconds"): (
        "extra", "bound on every agreement (multiprocessing_options sets it too)"),
    ("CheckpointManagerOptions", "mode"): ("extra", "standalone or managed (GKE replicator)"),
    ("CheckpointManagerOptions", "managed"): ("extra", "managed mode's handshake options"),
    ("ReplicatorCheckpointManager.__init__", "mtc_options"): (
        "extra", "job name, replica axis and handshake options of the managed manager"),
    ("ReplicatorCheckpointManager.__init__", "_distributed_to_device_ids_fn"): (
        "absent", "Orbax-private hook for Pathways sidecars (Pathways is not supported)"),
    ("ReplicatorCheckpointManager.__init__", "_is_sidecar"): (
        "absent", "Orbax-private hook for Pathways sidecars (Pathways is not supported)"),
    ("ocp.CheckpointManager.__init__", "local_directory"): (
        "extra", "parent-style form: adds a RAM tier (keyword-only)"),
    ("ocp.CheckpointManager.__init__", "global_mesh"): ("extra", "with local_directory"),
    ("ocp.CheckpointManager.__init__", "abstract_state"): ("extra", "with local_directory"),
    ("ocp.CheckpointManager.__init__", "local_options"): ("extra", "with local_directory"),
    ("ocp.CheckpointManager.__init__", "replication_options"): (
        "extra", "with local_directory"),
    ("ocp.CheckpointManager.__init__", "job_name"): ("extra", "with local_directory"),
}


def _orbax():
  from orbax.checkpoint.experimental.emergency import checkpoint_manager as emergency
  from orbax.checkpoint.experimental.emergency import replicator_checkpoint_manager as replicator

  return emergency, replicator


def _option_pairs():
  import orbax_mtc as mtc

  emergency, replicator = _orbax()
  return [(mtc.LocalCheckpointOptions, emergency.LocalCheckpointOptions),
          (mtc.PersistentCheckpointOptions, emergency.PersistentCheckpointOptions),
          (mtc.CheckpointManagerOptions, emergency.CheckpointManagerOptions),
          (mtc.MultiprocessingOptions, emergency.MultiprocessingOptions),
          (mtc.ReplicatorCheckpointManagerOptions,
           replicator.ReplicatorCheckpointManagerOptions)]


def _default(field: dataclasses.Field):
  if field.default is not dataclasses.MISSING:
    return field.default
  if field.default_factory is not dataclasses.MISSING:
    return ("default_factory", field.default_factory.__name__)
  return "required"


def _differences(owner: str, ours: list[tuple[str, object]], theirs: list[tuple[str, object]]
                 ) -> dict[tuple[str, str], str]:
  """(owner, name) -> kind for every name or default that differs."""
  mine, orbax = dict(ours), dict(theirs)
  found = {(owner, n): "absent" for n in orbax if n not in mine}
  found.update({(owner, n): "extra" for n in mine if n not in orbax})
  found.update({(owner, n): "default" for n in orbax if n in mine and mine[n] != orbax[n]})
  return found


def _assert_positions_taken(found: dict[tuple[str, str], str], owners: set[str]) -> None:
  listed = {key: kind for key, (kind, _) in DIFFERENCES.items() if key[0] in owners}
  untaken = {key: kind for key, kind in found.items() if listed.get(key) != kind}
  assert not untaken, (
      f"differences from the installed Orbax without a position in DIFFERENCES (and "
      f"docs/api.md): {untaken}")
  stale = {key: kind for key, kind in listed.items() if found.get(key) != kind}
  assert not stale, f"DIFFERENCES entries that are no longer differences: {stale}"


def _params(signature: inspect.Signature) -> list[tuple[str, object]]:
  return [(p.name, (p.kind, p.default)) for p in signature.parameters.values()
          if p.name != "self"]


@pytest.fixture
def warnings_reset(monkeypatch, caplog):
  """A process that has warned about nothing yet; absl's warnings captured."""
  from orbax_mtc import option_checks

  monkeypatch.setattr(option_checks, "_warned", set())
  caplog.set_level("WARNING")
  return caplog


def _warnings(caplog, text: str) -> int:
  return sum(text in r.getMessage() for r in caplog.records)


def _run(command: list[str], root: pathlib.Path, timeout_s: float = 150):
  out = mp_events.LineCollector()
  env = {**child_env(), "JOBSET_NAME": JOB_NAME}
  with warm_start.WarmJob(
      [sys.executable, str(pathlib.Path(__file__).resolve()), "worker", *command],
      2, devices_per_process=2, local_root=root, env=env, output=out) as job:
    job.start()
    result = job.wait(timeout_s)
  assert_ok(result, out)
  return out


def _replicated(sim, step: int, timeout_s: float = 60) -> bool:
  """Whether the simulator copied `step` to the peer within the time (the RAM tier keeps one
  step, so a copy of an older one may lose the race with its retirement)."""
  deadline = time.monotonic() + timeout_s
  while time.monotonic() < deadline:
    if any(e["step"] == str(step) for e in sim.events("REPLICATED")):
      return True
    time.sleep(0.05)
  return False


def _results(out) -> dict[int, dict[str, str]]:
  results = mp_events.parse_results(out.lines)
  assert sorted(results) == [0, 1], tail(out)
  for node, fields in results.items():
    assert fields["ok"] == "1", f"node {node}: {fields['detail']}\n{tail(out)}"
  return results


def _worker(argv: list[str]) -> int:
  import argparse

  parser = argparse.ArgumentParser()
  parser.add_argument("phase", choices=["save", "restore"])
  parser.add_argument("--steps", type=int, default=0)
  parser.add_argument("--dataset", default=None)
  parser.add_argument("--restore-none", action="store_true")
  args = parser.parse_args(argv)

  import jax
  import orbax.checkpoint as ocp
  from etils import epath

  import orbax_mtc as mtc
  from orbax_mtc import distributed, testing

  distributed.initialize()
  mesh = testing.process_mesh()
  me = jax.process_index()
  extra = {} if args.dataset is None else {"persistent_directory": epath.Path(args.dataset)}
  # As MaxText's create_orbax_emergency_replicator_checkpoint_manager builds Orbax's.
  mgr = mtc.ReplicatorCheckpointManager(
      epath.Path(distributed.local_directory()),
      options=mtc.ReplicatorCheckpointManagerOptions(save_interval_steps=2,
                                                     use_colocated_python=False),
      global_mesh=mesh, **extra)
  with mgr:
    if args.phase == "save":
      for step in range(args.steps):
        items = {"state": ocp.args.PyTreeSave(testing.sharded_state(mesh, ROWS, SEED, step))}
        if args.dataset:
          items["dataset"] = ocp.args.JsonSave({"position": 10 * step})
        saved = mgr.save(step, args=ocp.args.Composite(**items))
        mp_events.emit(f"SAVED step={step} saved={int(saved)}")
      mgr.wait_until_finished()
    else:
      abstract = testing.abstract_sharded_state(mesh, ROWS)
      restore_args = jax.tree.map(lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding), abstract)
      items = {"state": ocp.args.PyTreeRestore(item=abstract, restore_args=restore_args)}
      if args.dataset:
        items["dataset"] = ocp.args.JsonRestore()
      latest = mgr.latest_step()
      restored = mgr.restore(None if args.restore_none else latest,
                             args=ocp.args.Composite(**items))
      info = mgr.manager.last_restore
      problems = testing.tree_differences(restored["state"],
                                          testing.sharded_state(mesh, ROWS, SEED, info.step))
      position = restored["dataset"]["position"] if args.dataset else "-"
      mp_events.emit(f"RESULT process={me} step={info.step} latest={latest} tier={info.tier} "
                     f"dataset={position} ok={int(not problems)} "
                     f"detail={'; '.join(problems) or '-'}")
  return 0


if __name__ == "__main__":
  if sys.argv[1:2] == ["worker"]:
    sys.exit(_worker(sys.argv[2:]))
  sys.exit("usage: test_orbax_parity.py worker save|restore [...]")
