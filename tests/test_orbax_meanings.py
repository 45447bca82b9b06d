"""Parity with Orbax's experimental.emergency API: the same arguments mean the same things, and the replicator manager behaves as Orbax's."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
from mp_helpers import mp_events, tail
from orbax_parity_support import JOB_NAME, _orbax, _replicated, _results, _run, _warnings


def test_orbax_defaults():
  import orbax_mtc as mtc

  options = mtc.CheckpointManagerOptions()
  assert (options.replica_axis_index, options.cleanup_tmp_directories,
          options.single_host_load_and_broadcast, options.multiprocessing_options) == \
      (0, False, True, None)
  assert options.persistent.save_interval_steps == 1000
  assert options.persistent_manager_options().cleanup_tmp_directories is False
  assert options.local.save_interval_steps == 10 and options.local.max_to_keep == 1
  # Minutes replace the default step interval; an explicit other interval conflicts.
  assert mtc.PersistentCheckpointOptions(backup_interval_minutes=30).save_interval_steps is None
  with pytest.raises(ValueError, match="not both"):
    mtc.PersistentCheckpointOptions(save_interval_steps=100, backup_interval_minutes=30)


def test_orbax_positional_arguments_mean_the_same():
  import orbax_mtc as mtc

  persistent = mtc.PersistentCheckpointOptions(50, 3, 100)
  assert (persistent.save_interval_steps, persistent.max_to_keep, persistent.keep_period) == \
      (50, 3, 100)
  local = mtc.LocalCheckpointOptions(5, 2, False)
  assert (local.save_interval_steps, local.max_to_keep, local.read_only) == (5, 2, False)


def test_local_preservation_policy_latest_n_is_max_to_keep(warnings_reset):
  import orbax.checkpoint as ocp

  import orbax_mtc as mtc

  policy = ocp.checkpoint_managers.LatestN(3)
  local = mtc.LocalCheckpointOptions(preservation_policy=policy)
  assert local.max_to_keep == 3
  assert dataclasses.replace(local, save_interval_steps=4).max_to_keep == 3
  with pytest.raises(ValueError, match="preservation_policy.*max_to_keep|max_to_keep.*"
                                       "preservation_policy"):
    mtc.LocalCheckpointOptions(max_to_keep=2, preservation_policy=policy)
  with pytest.raises(ValueError, match="LatestN"):
    mtc.LocalCheckpointOptions(preservation_policy=ocp.checkpoint_managers.LatestN(0))
  assert _warnings(warnings_reset, "not applied") == 0
  # Another policy decides step by step (retention.RamRetention): no count, no warning.
  other = mtc.LocalCheckpointOptions(preservation_policy=ocp.checkpoint_managers.EveryNSteps(5))
  assert other.max_to_keep is None
  assert dataclasses.replace(other, save_interval_steps=4).max_to_keep is None
  with pytest.raises(ValueError, match="preservation_policy.*max_to_keep|max_to_keep.*"
                                       "preservation_policy"):
    mtc.LocalCheckpointOptions(max_to_keep=2,
                               preservation_policy=ocp.checkpoint_managers.EveryNSteps(5))
  assert _warnings(warnings_reset, "LocalCheckpointOptions.preservation_policy") == 0


def test_persistent_preservation_policy_goes_to_orbax():
  import orbax.checkpoint as ocp

  import orbax_mtc as mtc

  policy = ocp.checkpoint_managers.EveryNSteps(5)
  options = mtc.CheckpointManagerOptions(
      persistent=mtc.PersistentCheckpointOptions(preservation_policy=policy))
  assert options.persistent_manager_options().preservation_policy is policy
  with pytest.raises(ValueError, match="preservation_policy"):
    mtc.PersistentCheckpointOptions(preservation_policy=policy, keep_period=10)


def test_debug_use_full_global_mesh_is_accepted_without_a_warning(warnings_reset):
  import orbax_mtc as mtc

  assert mtc.LocalCheckpointOptions(debug_use_full_global_mesh=True).debug_use_full_global_mesh
  assert _warnings(warnings_reset, "orbax-mtc") == 0
  with pytest.raises(TypeError, match="debug_use_full_global_mesh"):
    mtc.LocalCheckpointOptions(debug_use_full_global_mesh="yes")


def test_multiprocessing_options_set_the_agreement_timeout():
  import orbax.checkpoint as ocp

  import orbax_mtc as mtc

  emergency, _ = _orbax()
  for mp in (mtc.MultiprocessingOptions(45), emergency.MultiprocessingOptions(45)):
    options = mtc.CheckpointManagerOptions(multiprocessing_options=mp)
    assert options.agreement_timeout_seconds == 45
    assert dataclasses.replace(options, job_name="x").agreement_timeout_seconds == 45
  assert mtc.CheckpointManagerOptions(
      multiprocessing_options=mtc.MultiprocessingOptions(45),
      agreement_timeout_seconds=45).agreement_timeout_seconds == 45
  with pytest.raises(ValueError, match="same bound"):
    mtc.CheckpointManagerOptions(multiprocessing_options=mtc.MultiprocessingOptions(45),
                                 agreement_timeout_seconds=90)
  with pytest.raises(TypeError, match="coordination_timeout_secs"):
    mtc.CheckpointManagerOptions(multiprocessing_options=ocp.options.MultiprocessingOptions())
  with pytest.raises(ValueError, match="coordination_timeout_secs"):
    mtc.MultiprocessingOptions(0)


def test_bool_fields_are_checked():
  import orbax_mtc as mtc

  for name in ("cleanup_tmp_directories", "single_host_load_and_broadcast"):
    with pytest.raises(TypeError, match=name):
      mtc.CheckpointManagerOptions(**{name: 1})
  mtc.CheckpointManagerOptions(single_host_load_and_broadcast=False)


def test_replica_axis_index_default_and_the_size_one_warning(warnings_reset):
  import orbax_mtc as mtc
  from orbax_mtc.topology import replica_axis_name

  default = mtc.CheckpointManagerOptions()
  sizes = {"diloco": 1, "data": 2, "fsdp": 4}
  names = tuple(sizes)
  assert replica_axis_name(default, names, axis_sizes=sizes) == "diloco"  # Orbax's axis 0
  assert _warnings(warnings_reset, "replica_axis_index=0 picks mesh axis 'diloco'") == 1
  named = mtc.CheckpointManagerOptions(replication=mtc.ReplicationOptions(replica_axis="data"))
  assert replica_axis_name(named, names, axis_sizes=sizes) == "data"
  by_name = mtc.CheckpointManagerOptions(replica_axis_index=None)
  assert replica_axis_name(by_name, names, axis_sizes=sizes) == "data"
  assert replica_axis_name(default, names, axis_sizes=sizes, multi_process=False) == "diloco"
  assert _warnings(warnings_reset, "picks mesh axis") == 1


def test_replicator_options_unused_fields_warn_once(warnings_reset):
  import orbax_mtc as mtc
  from orbax_mtc.options import ocp_path

  for _ in range(2):
    mtc.ReplicatorCheckpointManagerOptions(save_concurrent_gb=4, restore_concurrent_gb=8)
    mtc.ReplicatorCheckpointManagerOptions(
        step_name_format=ocp_path.step.standard_name_format(step_prefix="ckpt"))
  assert _warnings(warnings_reset, "save_concurrent_gb=4 is not applied") == 1
  assert _warnings(warnings_reset, "restore_concurrent_gb=8 is not applied") == 1
  assert _warnings(warnings_reset, "step_name_format names the steps") == 1
  mtc.ReplicatorCheckpointManagerOptions(
      step_name_format=ocp_path.step.standard_name_format())
  assert _warnings(warnings_reset, "step_name_format names the steps") == 1
  with pytest.raises(ValueError, match="save_interval_steps"):
    mtc.ReplicatorCheckpointManagerOptions(save_interval_steps=0)


def test_replicator_manager_refuses_colocated_python_and_wrong_options(mesh, tmp_path):
  import orbax.checkpoint as ocp

  import orbax_mtc as mtc

  with pytest.raises(ValueError, match="Pathways"):
    mtc.ReplicatorCheckpointManager(
        tmp_path / "local",
        options=mtc.ReplicatorCheckpointManagerOptions(use_colocated_python=True),
        global_mesh=mesh)
  with pytest.raises(TypeError, match="ReplicatorCheckpointManagerOptions"):
    mtc.ReplicatorCheckpointManager(tmp_path / "local", options=ocp.CheckpointManagerOptions(),
                                    global_mesh=mesh)
  assert not (tmp_path / "local").exists()


def test_replicator_manager_args_are_checked_as_orbax_checks_them():
  import numpy as np
  import orbax.checkpoint as ocp

  from orbax_mtc import replicator_manager

  state = ocp.args.PyTreeSave({"x": np.zeros(2)})
  with pytest.raises(ValueError, match="must be a Composite"):
    replicator_manager.checked_items(state)
  with pytest.raises(ValueError, match="state is a required key"):
    replicator_manager.checked_items(ocp.args.Composite(other=state))
  with pytest.raises(ValueError, match="process_metadata is a reserved key"):
    replicator_manager.checked_items(ocp.args.Composite(state=state, process_metadata=state))
  assert set(replicator_manager.checked_items(ocp.args.Composite(
      state=state, dataset=ocp.args.JsonSave({})))) == {"state", "dataset"}
  with pytest.raises(ValueError, match="does not infer restore targets"):
    replicator_manager.ram_restore_item(ocp.args.PyTreeRestore())
  json = ocp.args.JsonRestore()
  assert replicator_manager.ram_restore_item(json) is json


def test_restore_args_without_item_become_saved_leaf_targets(mesh):
  import orbax.checkpoint as ocp
  from jax.sharding import NamedSharding, PartitionSpec

  from orbax_mtc import replicator_manager
  from orbax_mtc.local.read import SavedLeaf

  sharding = NamedSharding(mesh, PartitionSpec("data"))
  item = replicator_manager.ram_restore_item(ocp.args.PyTreeRestore(restore_args={
      "a": ocp.ArrayRestoreArgs(sharding=sharding),
      "b": ocp.ArrayRestoreArgs(mesh=mesh, mesh_axes=PartitionSpec("model"))}))
  assert item.item == {"a": SavedLeaf(sharding),
                       "b": SavedLeaf(NamedSharding(mesh, PartitionSpec("model")))}
  with pytest.raises(ValueError, match="has no sharding"):
    replicator_manager.ram_restore_item(
        ocp.args.PyTreeRestore(restore_args={"a": ocp.ArrayRestoreArgs()}))


def test_replicator_manager_options_map_onto_managed_mode(mesh, monkeypatch, warnings_reset):
  import orbax.checkpoint as ocp

  import orbax_mtc as mtc
  from orbax_mtc.replicator_manager import _manager_options

  monkeypatch.setenv("JOBSET_NAME", "js")
  fn = lambda step, last: step % 3 == 0  # noqa: E731
  options = _manager_options(
      mtc.ReplicatorCheckpointManagerOptions(
          save_interval_steps=4, should_save_fn=fn, enable_async_checkpointing=False,
          preservation_policy=ocp.checkpoint_managers.LatestN(2)), None, mesh)
  assert (options.mode, options.job_name, options.enable_async_checkpointing) == \
      ("managed", "js", False)
  assert (options.local.save_interval_steps, options.local.should_save_fn,
          options.local.max_to_keep) == (4, fn, 2)
  assert options.persistent.backup_interval_minutes == 30  # Orbax's initialize default
  assert options.replication.replica_axis == "data"
  mine = mtc.CheckpointManagerOptions(job_name="mine", managed=mtc.ManagedOptions(
      timeout_seconds=5), replication=mtc.ReplicationOptions(replica_axis="model"))
  options = _manager_options(mtc.ReplicatorCheckpointManagerOptions(), mine, mesh)
  assert (options.mode, options.job_name, options.managed.timeout_seconds,
          options.replication.replica_axis, options.local.save_interval_steps,
          options.local.max_to_keep) == ("managed", "mine", 5, "model", 1, 1)
  with pytest.raises(ValueError, match="leave mtc_options.local at its default"):
    _manager_options(mtc.ReplicatorCheckpointManagerOptions(),
                     mtc.CheckpointManagerOptions(local=mtc.LocalCheckpointOptions(2)), mesh)
  with pytest.raises(TypeError, match="mtc_options"):
    _manager_options(mtc.ReplicatorCheckpointManagerOptions(), mtc.ManagedOptions(), mesh)
  assert _warnings(warnings_reset, "orbax-mtc") == 0
  other = ocp.checkpoint_managers.EveryNSteps(5)
  options = _manager_options(mtc.ReplicatorCheckpointManagerOptions(preservation_policy=other),
                             None, mesh)
  # Applied to the RAM steps as it is (ram_retention), not warned about and dropped.
  assert options.local.preservation_policy is other and options.local.max_to_keep is None
  assert _warnings(warnings_reset, "ReplicatorCheckpointManagerOptions.preservation_policy") == 0


@pytest.mark.timeout(400)
def test_maxtext_style_replicator_manager_saves_and_restores_bit_exactly(tmp_path, shm_root):
  from test_managed import simulators

  with simulators(shm_root, tmp_path / "backup", 2) as sims:
    out = _run(["save", "--steps", "7"], shm_root)
    saved = [(node, f["step"]) for node, f in mp_events.events(out.lines, "SAVED")
             if f["saved"] == "1"]
    assert sorted(saved) == [(n, s) for n in (0, 1) for s in ("0", "2", "4", "6")], tail(out)
    for rank, sim in enumerate(sims):
      # What the manager wrote: twins across the 2 data replicas, Orbax's 30 minutes.
      assert sim.events("CONFIG") == [{"job": JOB_NAME, "rank": str(rank), "nodes": "2",
                                       "dp": "2", "peers": f"[{1 - rank}]",
                                       "interval": "30"}], sim.text()
      assert _replicated(sim, 6), sim.text()
    assert (shm_root / "node0" / "6" / "manifest.json").is_file()  # the replicator's layout

    out = _run(["restore"], shm_root)
  results = _results(out)
  assert {n: (f["step"], f["latest"]) for n, f in results.items()} == \
      {0: ("6", "6"), 1: ("6", "6")}, tail(out)


@pytest.mark.timeout(400)
def test_node_replaced_restores_state_from_its_peer_and_dataset_from_persistent(
    tmp_path, shm_root):
  from test_managed import SimNode, simulators

  dataset = tmp_path / "dataset"
  with simulators(shm_root, tmp_path / "backup", 2) as sims:
    _run(["save", "--steps", "5", "--dataset", str(dataset)], shm_root)
    assert sorted(p.name for p in dataset.iterdir() if p.name.isdigit()) == ["0", "2", "4"]
    for sim in sims:
      assert _replicated(sim, 4), sim.text()
    # Node 1 is replaced: its daemon and its whole RAM volume are gone; a new daemon starts.
    sims[1].kill()
    shutil.rmtree(shm_root / "node1")
    sims[1] = SimNode(shm_root, 1, tmp_path / "backup")
    out = _run(["restore", "--restore-none", "--dataset", str(dataset)], shm_root)
    assert sims[1].events("RESTORE") == [{"rank": "1", "step": "4", "source": "peer"}]
  results = _results(out)
  assert {n: (f["step"], f["tier"], f["dataset"]) for n, f in results.items()} == \
      {0: ("4", "replicator", "40"), 1: ("4", "replicator", "40")}, tail(out)


# ----------------------------------------------------------------------------- Orbax's objects


def _orbax_emergency_options():
  """Orbax's own emergency options, every field away from its default."""
  import orbax.checkpoint as ocp

  emergency, _ = _orbax()
  fn = lambda step, last: step % 3 == 0  # noqa: E731
  return emergency.CheckpointManagerOptions(
      local=emergency.LocalCheckpointOptions(
          save_interval_steps=3, max_to_keep=2, read_only=True, should_save_fn=fn,
          debug_use_full_global_mesh=True),
      persistent=emergency.PersistentCheckpointOptions(
          save_interval_steps=7, max_to_keep=4, keep_period=14,
          save_decision_policy=ocp.checkpoint_managers.FixedIntervalPolicy(7)),
      replica_axis_index=1,
      step_name_format=ocp.step.standard_name_format(step_prefix="ckpt"),
      cleanup_tmp_directories=True, enable_async_checkpointing=False,
      async_options=ocp.AsyncOptions(timeout_secs=50),
      multiprocessing_options=emergency.MultiprocessingOptions(45),
      single_host_load_and_broadcast=False)


def _assert_same_fields(ours, theirs):
  for field in dataclasses.fields(theirs):
    value = getattr(theirs, field.name)
    if dataclasses.is_dataclass(value) and field.name != "multiprocessing_options":
      _assert_same_fields(getattr(ours, field.name), value)
    else:
      assert getattr(ours, field.name) == value, field.name


def test_orbax_own_emergency_options_are_taken_field_for_field(shm_dir, mesh, warnings_reset):
  """Issue 44: Orbax's `CheckpointManagerOptions` (and its local/persistent options) given to
  the manager, or nested in ours, are converted field for field, without a warning."""
  from conftest import abstract_of, make_state

  import orbax_mtc as mtc

  emergency, _ = _orbax()
  theirs = _orbax_emergency_options()
  with mtc.CheckpointManager(shm_dir / "local", shm_dir / "persistent", mesh,
                             abstract_of(make_state(mesh)), options=theirs) as mgr:
    assert type(mgr.options) is mtc.CheckpointManagerOptions
    assert type(mgr.options.local) is mtc.LocalCheckpointOptions
    _assert_same_fields(mgr.options, theirs)
    assert mgr.options.agreement_timeout_seconds == 45  # coordination_timeout_secs
    assert mgr.replica_axis == "model"  # replica_axis_index=1
  nested = mtc.CheckpointManagerOptions(local=emergency.LocalCheckpointOptions(4),
                                        persistent=emergency.PersistentCheckpointOptions(8))
  assert (type(nested.local), nested.local.save_interval_steps, nested.local.max_to_keep) == \
      (mtc.LocalCheckpointOptions, 4, 1)
  assert nested.persistent.save_interval_steps == 8
  assert _warnings(warnings_reset, "orbax-mtc") == 0
  with pytest.raises(TypeError, match="CheckpointManagerOptions.replication must be an "
                                      "orbax_mtc.ReplicationOptions"):
    mtc.CheckpointManagerOptions(replication=emergency.LocalCheckpointOptions())


def test_orbax_fields_we_lack_are_warned_about_once(warnings_reset):
  """A field of Orbax's class that ours lacks (one a newer Orbax adds) is dropped, with one
  warning per process when it is set."""
  import orbax_mtc as mtc
  from orbax_mtc.orbax_options import as_ours

  emergency, _ = _orbax()

  @dataclasses.dataclass
  class NewerLocal(emergency.LocalCheckpointOptions):
    future_knob: int = 0

  NewerLocal.__name__ = "LocalCheckpointOptions"
  assert as_ours(NewerLocal(5), mtc.LocalCheckpointOptions, "local").save_interval_steps == 5
  assert _warnings(warnings_reset, "future_knob") == 0  # at its default: nothing to say
  for _ in range(2):
    converted = as_ours(NewerLocal(5, future_knob=3), mtc.LocalCheckpointOptions, "local")
    assert converted == mtc.LocalCheckpointOptions(5)
  assert _warnings(warnings_reset, "LocalCheckpointOptions.future_knob=3 has no counterpart") == 1


def test_orbax_own_replicator_options_are_taken(mesh, tmp_path, warnings_reset):
  """Orbax's `ReplicatorCheckpointManagerOptions` are converted too: the Pathways check (which
  comes after the conversion) answers, where a TypeError did."""
  import orbax_mtc as mtc
  from orbax_mtc.orbax_options import as_ours

  _, replicator = _orbax()
  theirs = replicator.ReplicatorCheckpointManagerOptions(save_interval_steps=5,
                                                         enable_async_checkpointing=False)
  ours = as_ours(theirs, mtc.ReplicatorCheckpointManagerOptions, "options")
  assert (type(ours), ours.save_interval_steps, ours.enable_async_checkpointing) == \
      (mtc.ReplicatorCheckpointManagerOptions, 5, False)
  with pytest.raises(ValueError, match="Pathways"):
    mtc.ReplicatorCheckpointManager(
        tmp_path / "local",
        options=replicator.ReplicatorCheckpointManagerOptions(use_colocated_python=True),
        global_mesh=mesh)


def test_each_constructor_form_has_a_typed_signature():
  """Issue 44: `CheckpointManager.__init__` has one typed overload per documented form (the
  signatures the call is bound to), and `help()` shows both."""
  import inspect
  import pydoc
  import typing

  import orbax_mtc as mtc
  from orbax_mtc.forms import arguments

  overloads = typing.get_overloads(mtc.CheckpointManager.__init__)
  assert len(overloads) == 2
  for overload, bound in zip(overloads, (arguments.MULTI_TIER_SIGNATURE,
                                         arguments.PARENT_STYLE_SIGNATURE), strict=True):
    params = list(inspect.signature(overload).parameters.values())[1:]  # without self
    assert [(p.name, p.kind, p.default, p.annotation) for p in params] == \
        [(p.name, p.kind, p.default, p.annotation) for p in bound.parameters.values()]
    assert all(p.annotation is not inspect.Parameter.empty for p in params)
  text = pydoc.render_doc(mtc.CheckpointManager, renderer=pydoc.plaintext)
  for fragment in ("local_directory: epath.PathLike,", "global_mesh: jax.sharding.Mesh,",
                   "persistent_non_replicated_directory: epath.PathLike | None = None",
                   "options: ocp.CheckpointManagerOptions | None = None",
                   "local_options: LocalCheckpointOptions | None = None"):
    assert fragment in text, fragment


def test_the_public_api_is_typed():
  """Every public function, method and property of what `orbax_mtc` exports has its
  parameters and its return annotated (IDEs, type checkers and `help()` show them)."""
  import inspect

  import orbax_mtc as mtc

  functions = []
  for name in mtc.__all__:
    exported = getattr(mtc, name)
    if inspect.isclass(exported):
      functions += [(f"{name}.{attr}", member.fget if isinstance(member, property) else member)
                    for attr, member in vars(exported).items()
                    if (attr == "__init__" or not attr.startswith("_"))
                    and (isinstance(member, property) or inspect.isfunction(member))]
    elif inspect.ismodule(exported):
      functions += [(f"{name}.{attr}", member) for attr, member in vars(exported).items()
                    if not attr.startswith("_") and inspect.isfunction(member)
                    and member.__module__ == exported.__name__]
    elif inspect.isfunction(exported):
      functions.append((name, exported))
  assert "CheckpointManager.restore" in dict(functions)
  untyped = []
  for name, function in functions:
    signature = inspect.signature(function)
    params = [p for p in signature.parameters.values() if p.name not in ("self", "cls")
              and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if signature.return_annotation is inspect.Signature.empty or any(
        p.annotation is inspect.Parameter.empty for p in params):
      untyped.append(name)
  assert not untyped, untyped
