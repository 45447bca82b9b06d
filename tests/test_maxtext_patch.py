"""maxtext_patch: MaxText's config keys and checkpointing calls on orbax-mtc.

MaxText needs Python >= 3.12 and does not install here, so the jobs run our MaxText-shaped loop
(`maxtext_patch/example_train.py`: MaxText's key names, `maybe_save_checkpoint` after every
step, `StopTraining` on preemption) as 2 real `jax.distributed` processes x 2 CPU devices:
  held run   FSDP-only mesh (data=1, fsdp=4: one replica, so peers form a ring), RAM every 2
             steps (keep 2), persistent every 1000 (so it holds only step 0); the job prints
             HOLDING once step 6 is in RAM and at its peer on both nodes, and is SIGKILLed.
  resume     all folders kept: both nodes restore step 6 from their own RAM, bit for bit.
  node loss  node 1's folder deleted: node 1 restores step 6 from node 0's copy ("peer").
  SIGTERM    (data=2, fsdp=2) mesh; `kill -TERM` to one process: both agree on a step S off
             every schedule, save it (RAM, peer, persistent), raise StopTraining, exit 0.
Plus pure tests of the config keys and of `install()` (no MaxText; a stand-in package shaped
like MaxText's modules). Wall time here: about 60 s.
"""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
from maxtext_patch_support import (
  JOB_TIMEOUT_S,
  LOOP,
  _Adam,
  _batches,
  _grain_dataset,
  _grain_keys,
  _grain_manager,
  _HostIterator,
  _keys,
  _resume,
  _single_env,
  _small_state,
  _State,
)

from maxtext_patch import checkpointing
from maxtext_patch import config as mtc_config
from orbax_mtc.local.store import committed_steps

pytestmark = pytest.mark.timeout(240)


def test_maxtext_keys_become_orbax_mtc_options():
  settings = mtc_config.read_settings(
      _keys(max_num_checkpoints_to_keep="3", async_checkpointing=False),
      {"mtc_peers_per_node": "2", "mtc_replica_axis": "fsdp", "mtc_local_max_to_keep": 2})
  assert (settings.mode, settings.local_interval, settings.persistent_interval_steps) == (
      mtc_config.STANDALONE, 20, 1000)
  options = mtc_config.manager_options(settings)
  assert options.local.save_interval_steps == 20 and options.local.max_to_keep == 2
  assert options.persistent.save_interval_steps == 1000
  assert options.persistent.max_to_keep == 3
  assert options.persistent.backup_interval_minutes is None
  assert (options.replication.peers_per_node, options.replication.replica_axis) == (2, "fsdp")
  assert options.job_name == "run1" and options.enable_async_checkpointing is False
  # The backup keys replace checkpoint_period as the persistent schedule.
  minutes = mtc_config.read_settings(
      _keys(multi_tier_checkpointing_backup_interval_minutes=15))
  assert (minutes.backup_interval_minutes, minutes.persistent_interval_steps) == (15.0, None)
  steps = mtc_config.read_settings(_keys(multi_tier_checkpointing_backup_interval_steps=100))
  assert steps.persistent_interval_steps == 100
  # 0 and null are "not set", as MaxText reads them: checkpoint_period stays the schedule.
  for unset in (0, "0", None, "null"):
    default = mtc_config.read_settings(_keys(
        multi_tier_checkpointing_backup_interval_minutes=unset,
        multi_tier_checkpointing_backup_interval_steps=unset))
    assert (default.backup_interval_minutes, default.persistent_interval_steps) == (None, 1000)
  # Neither flag: MaxText's own checkpointing.
  assert mtc_config.read_settings(_keys(enable_emergency_checkpoint=False)) is None
  assert mtc_config.read_settings({}) is None


@pytest.mark.parametrize("keys, extra, message", [
    (dict(local_checkpoint_directory=""), {}, "needs local_checkpoint_directory"),
    (dict(local_checkpoint_period=0), {}, "local_checkpoint_period > 0"),
    (dict(local_checkpoint_period="ten"), {}, "local_checkpoint_period must be an integer"),
    (dict(checkpoint_dir=""), {}, "set base_output_directory and run_name"),
    (dict(checkpoint_dir="/dev/shm/ckpt"), {}, "same folder"),
    (dict(multi_tier_checkpointing_backup_interval_minutes=5,
          multi_tier_checkpointing_backup_interval_steps=100), {}, "not both"),
    (dict(multi_tier_checkpointing_backup_interval_minutes=-1), {}, "must be a finite number"),
    (dict(enable_emergency_checkpoint=False, enable_multi_tier_checkpointing=True,
          multi_tier_checkpointing_backup_interval_steps=5), {}, "shorter than"),
    (dict(enable_emergency_checkpoint=False, enable_multi_tier_checkpointing=True,
          local_checkpoint_directory="/local/{process_index}"), {}, "cannot be used"),
    (dict(enable_single_controller=True), {}, "Pathways"),
    (dict(enable_emergency_checkpoint="maybe"), {}, "true or false"),
    (dict(max_num_checkpoints_to_keep=0), {}, "max_num_checkpoints_to_keep must be"),
    ({}, dict(mtc_peers_per_node=-1), "mtc_peers_per_node must be an integer >= 0"),
    ({}, dict(mtc_peers_per_node="two"), "mtc_peers_per_node must be an integer >= 0"),
    ({}, dict(mtc_replica_axis="data axis"), "mtc_replica_axis must name a mesh axis"),
    ({}, dict(mtc_local_max_to_keep=0), "mtc_local_max_to_keep must be"),
    ({}, dict(mtc_job_name="a/b"), "cannot contain '/'"),
    ({}, dict(mtc_ondemand_grace_seconds="soon"), "mtc_ondemand_grace_seconds must be"),
    ({}, dict(mtc_peer_per_node=1), "did you mean 'mtc_peers_per_node'"),
])
def test_bad_keys_are_clear_errors(keys, extra, message):
  with pytest.raises(mtc_config.MaxTextConfigError, match=message.replace("(", r"\(")):
    mtc_config.read_settings(_keys(**keys), extra)


def test_both_flags_run_managed_as_maxtext_does():
  # MaxText's create_checkpoint_manager and start-up test enable_multi_tier_checkpointing first.
  both = _keys(enable_multi_tier_checkpointing=True,
               multi_tier_checkpointing_backup_interval_minutes=20)
  assert mtc_config.enabled_mode(both) == mtc_config.MANAGED
  settings = mtc_config.read_settings(both)
  assert (settings.mode, settings.backup_interval_minutes) == (mtc_config.MANAGED, 20.0)
  assert mtc_config.enabled_mode(_keys(enable_multi_tier_checkpointing="false")) == \
      mtc_config.STANDALONE


@pytest.mark.parametrize("keys, message", [
    # The old spelling of managed mode: MaxText >= 0.1 ignores it and runs standalone.
    (dict(use_replicator_service=True, replicator_backup_interval_minutes=15),
     "set enable_multi_tier_checkpointing=true "
     "multi_tier_checkpointing_backup_interval_minutes=15 in place of"),
    (dict(use_replicator_service="true"), "set enable_multi_tier_checkpointing=true in place"),
    # The old name of the backup interval, in either mode, when it is not the schedule run.
    (dict(replicator_backup_interval_minutes=15),
     "set multi_tier_checkpointing_backup_interval_minutes=15 instead"),
    (dict(enable_emergency_checkpoint=False, enable_multi_tier_checkpointing=True,
          use_replicator_service=True, replicator_backup_interval_minutes="10",
          multi_tier_checkpointing_backup_interval_minutes=30),
     "set multi_tier_checkpointing_backup_interval_minutes=10 instead"),
    (dict(use_replicator_service="maybe"), "use_replicator_service must be true or false"),
])
def test_legacy_replicator_keys_are_refused_with_what_to_set(keys, message):
  with pytest.raises(mtc_config.MaxTextConfigError, match=message):
    mtc_config.read_settings(_keys(**keys))


def test_maxtexts_standalone_factory_refuses_use_replicator_service():
  # MaxText 0.2.5 calls this factory for enable_emergency_checkpoint=true, whatever
  # use_replicator_service says; its config is read by attribute.
  import types

  config = types.SimpleNamespace(**_keys(use_replicator_service=True))
  with checkpointing.using_config(config), pytest.raises(
      mtc_config.MaxTextConfigError, match="enable_multi_tier_checkpointing=true in place"):
    checkpointing.create_orbax_emergency_checkpoint_manager(
        "/dev/shm/ckpt", "/mnt/out/run1/checkpoints", None, None, 20, 1000)


def test_legacy_replicator_keys_that_change_nothing_are_accepted():
  # MaxText's defaults for them, and values that agree with the keys that replaced them.
  assert mtc_config.read_settings(_keys(use_replicator_service=False,
                                        replicator_backup_interval_minutes=0)).mode == \
      mtc_config.STANDALONE
  managed = mtc_config.read_settings(_keys(
      enable_emergency_checkpoint=False, enable_multi_tier_checkpointing=True,
      use_replicator_service=True, replicator_backup_interval_minutes=15,
      multi_tier_checkpointing_backup_interval_minutes=15))
  assert (managed.mode, managed.backup_interval_minutes) == (mtc_config.MANAGED, 15.0)
  # Neither flag: MaxText's own checkpointing, which ignores them too.
  assert mtc_config.read_settings(_keys(enable_emergency_checkpoint=False,
                                        use_replicator_service=True)) is None


def test_command_line_split_and_mesh_and_folder_rules():
  rest, ours = mtc_config.split_argv(["base.yml", "run_name=x", "mtc_peers_per_node=2",
                                      "mtc_data_parallelism=2", "mtc_replica_axis=fsdp"])
  # mtc_data_parallelism is MaxText's own key and stays with MaxText.
  assert rest == ["base.yml", "run_name=x", "mtc_data_parallelism=2"]
  assert ours == {"mtc_peers_per_node": "2", "mtc_replica_axis": "fsdp"}
  with pytest.raises(mtc_config.MaxTextConfigError, match="did you mean 'mtc_replica_axis'"):
    mtc_config.split_argv(["mtc_replica_axes=data"])
  settings = mtc_config.read_settings(_keys(), {"mtc_replica_axis": "stage"})
  with pytest.raises(mtc_config.MaxTextConfigError, match="not an axis of the mesh"):
    mtc_config.check_mesh(settings, ("diloco", "data", "fsdp"))
  mtc_config.check_mesh(settings, ("data", "stage"))
  assert mtc_config.local_directory_for("/r/node{process_index}", 3, "cpu") == "/r/node3"
  assert mtc_config.local_directory_for("/local", 3, "tpu") == "/local"
  assert mtc_config.local_directory_for("/local/", 3, "gpu") == "/local/3"  # MaxText's layout


def test_state_layout_round_trips_dataclasses_and_namedtuples():
  import jax

  jax.tree_util.register_dataclass(_State, data_fields=["step", "params", "opt_state"],
                                   meta_fields=[])
  state = _State(step=1, params={"w": 2, "layers": [3, 4]}, opt_state=(_Adam(5, {"w": 6}),))
  tree = checkpointing._checkpoint_tree(state)
  # What Orbax writes for such nodes (field names), so every tier holds the same tree.
  assert tree == {"step": 1, "params": {"w": 2, "layers": {"0": 3, "1": 4}},
                  "opt_state": {"0": {"count": 5, "mu": {"w": 6}}}}
  back = checkpointing._from_checkpoint_tree(tree, state)
  assert back == state and isinstance(back.opt_state[0], _Adam)


def test_example_loop_reports_config_errors():
  result = subprocess.run(
      [*LOOP, "enable_emergency_checkpoint=true", "base_output_directory=/tmp/x"],
      env=_single_env(), capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
  assert result.returncode != 0
  assert "needs local_checkpoint_directory" in result.stderr, result.stderr[-2000:]
  result = subprocess.run([*LOOP, "local_checkpoint_perid=3"], env=_single_env(),
                          capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
  assert result.returncode != 0 and "Unknown config key 'local_checkpoint_perid'" in \
      result.stderr, result.stderr[-2000:]


def test_grain_iterator_round_trips_through_ram_and_persistent(mesh, shm_dir, tmp_path):
  """MaxText 0.2.0-0.2.3 (and a loop of one's own): maybe_save_checkpoint saves the host's
  grain iterator as item `iter`; load_state_if_possible puts a fresh one where it was."""
  state = _small_state(mesh)
  keys = _grain_keys(shm_dir, tmp_path)
  want = _batches(8)
  host = _HostIterator(_grain_dataset())
  manager = _grain_manager(keys, mesh, state)
  try:
    for step in range(5):  # step s reads batch s, then saves (RAM 0, 2, 4; persistent 0, 4)
      assert host.batch() == want[step]
      checkpointing.maybe_save_checkpoint(manager, state, keys, host, step)
    manager.wait_until_finished()
  finally:
    manager.close()
  assert committed_steps(shm_dir) == [4]
  saved = tmp_path / "out" / "4" / "iter" / "process_0-of-1.json"  # Grain's own file
  assert json.loads(saved.read_text()) == host.local_iterator.get_state()

  resumed, step, tier = _resume(keys, mesh, state)
  assert (step, tier) == (4, "local")
  assert [resumed.batch(), resumed.batch()] == want[5:7]
  for entry in shm_dir.iterdir():  # a new VM: the RAM disk is empty
    shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
  resumed, step, tier = _resume(keys, mesh, state)
  assert (step, tier) == (4, "persistent")
  assert resumed.batch() == want[5]
  # Other dataset types keep MaxText's emergency behaviour: the iterator is left alone.
  untouched, _, _ = _resume(keys, mesh, state, dataset_type="synthetic")
  assert untouched.batch() == want[0]


def test_a_step_saved_without_the_iterator_restores_the_state_alone(mesh, shm_dir, tmp_path,
                                                                     caplog):
  """A step from before dataset_type=grain (or from MaxText's own emergency manager) holds
  no item `iter`: the state comes back and the iterator starts at its beginning."""
  state = _small_state(mesh)
  keys = _grain_keys(shm_dir, tmp_path)
  manager = _grain_manager(keys, mesh, state)
  try:
    for step in range(5):
      checkpointing.maybe_save_checkpoint(manager, state, dict(keys, dataset_type="synthetic"),
                                          _HostIterator(_grain_dataset()), step)
    manager.wait_until_finished()
  finally:
    manager.close()
  first = _batches(1)[0]
  for tier in ("local", "persistent"):
    caplog.clear()
    with caplog.at_level("WARNING"):
      host, step, restored_tier = _resume(keys, mesh, state)
    assert (step, restored_tier) == (4, tier)
    assert host.batch() == first
    assert "holds no data iterator position" in caplog.text
    if tier == "local":
      shutil.rmtree(shm_dir / "4")  # next: from the backup


def test_grain_elastic_iterator_is_saved_as_its_json_state(mesh, shm_dir, tmp_path):
  """grain's ElasticIterator (MaxText's grain_use_elastic_iterator) is no DatasetIterator:
  its state dict is the process's JSON item `iter`, set back with set_state."""
  import grain
  from conftest import abstract_of
  from grain import experimental as grain_experimental

  def elastic():
    return grain_experimental.ElasticIterator(
        grain.MapDataset.range(64).shuffle(seed=0), global_batch_size=2,
        shard_options=grain.sharding.ShardOptions(0, 1))

  state = _small_state(mesh)
  keys = _grain_keys(shm_dir, tmp_path)
  host = _HostIterator([])
  host.local_iterator = elastic()
  for _ in range(3):
    next(host.local_iterator)
  manager = _grain_manager(keys, mesh, state)
  try:
    assert checkpointing.save_checkpoint(manager, 2, state, keys, host, force=True)
    manager.wait_until_finished()
    following = [int(x) for x in next(host.local_iterator)]
    fresh = _HostIterator([])
    fresh.local_iterator = elastic()
    checkpointing.load_state_if_possible(manager, fresh, "", "", 96, abstract_of(state),
                                         dataset_type="grain", step=2)
    assert fresh.local_iterator.get_state() == {"global_next_index": 6}
    assert [int(x) for x in next(fresh.local_iterator)] == following
  finally:
    manager.close()


@pytest.mark.parametrize("factor, ok", [(-1, True), (-1.0, True), (1, True), (2, False),
                                        (0.5, False)])
def test_scaled_grain_loading_is_refused_before_training(mesh, shm_dir, tmp_path, factor, ok):
  state = _small_state(mesh)
  keys = _grain_keys(shm_dir, tmp_path, expansion_factor_real_data=factor)
  if ok:
    _grain_manager(keys, mesh, state).close()
    return
  with pytest.raises(mtc_config.MaxTextConfigError, match="expansion_factor_real_data"):
    _grain_manager(keys, mesh, state)
  # Other dataset types keep MaxText's behaviour (the iterator is not checkpointed there).
  _grain_manager(dict(keys, dataset_type="tfds"), mesh, state).close()


def test_which_iterator_is_checkpointed():
  host = _HostIterator(_grain_dataset())
  assert checkpointing.checkpointed_iterator("grain", host) is host.local_iterator
  assert checkpointing.checkpointed_iterator("grain", host.local_iterator) is \
      host.local_iterator
  for dataset_type in ("synthetic", "tfds", "hf", None):
    assert checkpointing.checkpointed_iterator(dataset_type, host) is None
  assert checkpointing.checkpointed_iterator("grain", None) is None
  placeholder = type("PlaceHolderDataIterator", (), {})()  # a host loading no real data
  assert checkpointing.checkpointed_iterator("grain", placeholder) is None
  with pytest.raises(mtc_config.MaxTextConfigError, match="list of 2 data iterators"):
    checkpointing.checkpointed_iterator("grain", [host, host])
  with pytest.raises(mtc_config.MaxTextConfigError, match="expansion_factor_real_data=4"):
    checkpointing.checkpointed_iterator("grain", host, 4)
  remote = type("RemoteIteratorWrapper", (), {"local_iterator": host.local_iterator})()
  with pytest.raises(mtc_config.MaxTextConfigError, match="colocated_python_data_input"):
    checkpointing.checkpointed_iterator("grain", remote)
  with pytest.raises(TypeError, match="no get_state/set_state"):
    checkpointing.checkpointed_iterator("grain", iter([1, 2]))


def test_preemption_exit_code_tells_a_preempted_run_from_a_finished_one(
    monkeypatch, shm_dir, mesh):
  # MaxText ends with status 0 both ways; a restart loop (configs/tpu-vm/supervise.sh) restarts
  # only on another status, so `mtc_preemption_exit_code` marks the preempted end.
  import os
  import signal

  import orbax.checkpoint as ocp
  from conftest import abstract_of, make_state

  from maxtext_patch import managers
  from maxtext_patch import train as mtc_train
  from orbax_mtc.save import preemption

  monkeypatch.setattr(preemption, "_STATE", preemption._ProcessState())
  monkeypatch.setattr(managers, "_last_built", None)
  before = signal.getsignal(signal.SIGTERM)
  keys = {"mtc_preemption_exit_code": "75"}
  assert mtc_train.exit_status(keys) == 0  # no manager built
  state = make_state(mesh)
  config = _keys(local_checkpoint_directory=str(shm_dir / "local"),
                 checkpoint_dir=str(shm_dir / "persistent"), local_checkpoint_period=10)
  with checkpointing.using_config(config):
    manager = checkpointing.create_orbax_emergency_checkpoint_manager(
        str(shm_dir / "local"), str(shm_dir / "persistent"), mesh, abstract_of(state), 10, 1000)
  try:
    assert not manager.reached_preemption(1)
    assert mtc_train.exit_status(keys) == 0  # finished: MaxText's 0
    os.kill(os.getpid(), signal.SIGTERM)
    assert manager.reached_preemption(2)
    assert manager.save(2, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state)))
    assert mtc_train.exit_status(keys) == 75
    assert mtc_train.exit_status({}) == 0  # MaxText's status unless asked
  finally:
    manager.close()
    signal.signal(signal.SIGTERM, before)
  with pytest.raises(mtc_config.MaxTextConfigError, match="0 to 255"):
    mtc_train.exit_status({"mtc_preemption_exit_code": "300"})
