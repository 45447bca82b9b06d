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

import dataclasses
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import textwrap
from typing import NamedTuple

import pytest
from mp_helpers import child_env, mp_events, new_root, tail

import maxtext_patch
from maxtext_patch import checkpointing
from maxtext_patch import config as mtc_config
from orbax_mtc.local.read import verify_step
from orbax_mtc.local.store import committed_steps, read_manifest
from orbax_mtc.tools import launch

pytestmark = pytest.mark.timeout(240)
JOB_TIMEOUT_S = 90  # a hang shows as a failed job ...
WAIT_S = 60  # ... or a missing line, well before pytest-timeout
HOLD_STEP = 6
LOOP = [sys.executable, "-m", "maxtext_patch.example_train"]


# ----------------------------------------------------------------------------- config keys


def _keys(**overrides):
  keys = {"enable_emergency_checkpoint": True, "local_checkpoint_directory": "/dev/shm/ckpt",
          "local_checkpoint_period": 20, "checkpoint_dir": "/mnt/out/run1/checkpoints",
          "checkpoint_period": 1000, "run_name": "run1"}
  keys.update(overrides)
  return keys


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
    (dict(enable_multi_tier_checkpointing=True), {}, "choose one"),
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


class _Adam(NamedTuple):
  count: int
  mu: dict


@dataclasses.dataclass
class _State:
  step: int
  params: dict
  opt_state: tuple


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


# ----------------------------------------------------------------------------- grain iterator


class _HostIterator:
  """MaxText's MultiHostDataLoadIterator as checkpointing sees it: the grain iterator this host
  reads is `local_iterator`."""

  def __init__(self, dataset):
    self.local_iterator = iter(dataset)

  def batch(self) -> list[int]:
    return [int(x) for x in next(self.local_iterator)]


def _grain_dataset():
  import grain

  return grain.MapDataset.range(64).shuffle(seed=0).to_iter_dataset().batch(2)


def _batches(count: int) -> list[list[int]]:
  reader = _HostIterator(_grain_dataset())
  return [reader.batch() for _ in range(count)]


def _grain_keys(shm_dir, tmp_path, **overrides):
  return _keys(local_checkpoint_directory=str(shm_dir), checkpoint_dir=str(tmp_path / "out"),
               local_checkpoint_period=2, checkpoint_period=4, dataset_type="grain",
               **overrides)


def _small_state(mesh):
  from conftest import make_state

  full = make_state(mesh)
  return {"params": full["params"], "ids": full["ids"], "layers": full["layers"]}


def _grain_manager(keys, mesh, state):
  from conftest import abstract_of

  with checkpointing.using_config(keys):
    return checkpointing.create_orbax_emergency_checkpoint_manager(
        keys["local_checkpoint_directory"], keys["checkpoint_dir"], mesh, abstract_of(state),
        keys["local_checkpoint_period"], keys["checkpoint_period"])


def _resume(keys, mesh, state, *, dataset_type="grain"):
  """A restart: a new manager and a fresh iterator restored by load_state_if_possible."""
  from conftest import abstract_of, assert_trees_equal

  host = _HostIterator(_grain_dataset())
  manager = _grain_manager(keys, mesh, state)
  try:
    restored, params = checkpointing.load_state_if_possible(
        manager, host, "", "", 96, abstract_of(state), dataset_type=dataset_type)
    assert params is None
    assert_trees_equal(restored, state)
    return host, manager.last_restore.step, manager.last_restore.tier
  finally:
    manager.close()


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


# ----------------------------------------------------------------------------- install()


def test_install_without_maxtext_names_the_supported_range():
  try:
    import maxtext  # noqa: F401
  except ImportError:
    pass
  else:
    pytest.skip("MaxText is installed here")
  with pytest.raises(maxtext_patch.MaxTextNotAvailableError) as info:
    maxtext_patch.install()
  assert maxtext_patch.SUPPORTED_MAXTEXT == ">=0.2.0,<0.3"
  assert ">=0.2.0,<0.3" in str(info.value) and "Python >= 3.12" in str(info.value)
  result = subprocess.run([sys.executable, "-m", "maxtext_patch.train", "base.yml",
                           "mtc_peers_per_node=1"], env=_single_env(), capture_output=True,
                          text=True, timeout=JOB_TIMEOUT_S)
  assert result.returncode == 2 and ">=0.2.0,<0.3" in result.stderr, result.stderr


# A stand-in with the module layout and function names of MaxText 0.2.4, trivial bodies (it
# records calls); what install() rebinds is checked against it.
_FAKE = {
    "maxtext/__init__.py": "",
    "maxtext/version.py": "__version__ = '{version}'\n",
    "maxtext/common/__init__.py": "",
    "maxtext/utils/__init__.py": "",
    "maxtext/utils/exceptions.py": """
        class StopTraining(Exception):
          pass
        """,
    "maxtext/common/emergency_checkpointing.py": """
        def create_emergency_checkpoint_manager(*args):
          return "maxtext-emergency"
        def create_replicator_checkpoint_manager(*args):
          return "maxtext-replicator"
        """,
    "maxtext/common/checkpointing.py": """
        from maxtext.common import emergency_checkpointing
        calls = []
        create_orbax_emergency_checkpoint_manager = (
            emergency_checkpointing.create_emergency_checkpoint_manager)
        create_orbax_emergency_replicator_checkpoint_manager = (
            emergency_checkpointing.create_replicator_checkpoint_manager)
        def load_state_if_possible(checkpoint_manager, data_iterator, load_parameters_from_path,
                                   load_full_state_from_path, checkpoint_storage_concurrent_gb,
                                   abstract_unboxed_pre_state, step=-1):
          calls.append(("load", checkpoint_manager))
          return "maxtext-load", None
        def maybe_save_checkpoint(checkpoint_manager, state, config, data_iterator, step=None):
          calls.append(("maybe_save", checkpoint_manager))
        def save_checkpoint(checkpoint_manager, step, state, config=None, data_iterator=None,
                            force=False):
          calls.append(("save", checkpoint_manager))
        """,
    "maxtext/utils/train_utils.py": """
        from maxtext.common import emergency_checkpointing
        def create_checkpoint_manager(config, mesh, init_state_fn):
          if config.enable_emergency_checkpoint:
            return emergency_checkpointing.create_emergency_checkpoint_manager(
                config.local_checkpoint_directory, config.checkpoint_dir, mesh, init_state_fn(),
                config.local_checkpoint_period, config.checkpoint_period, None)
          return "maxtext-standard"
        """,
    "maxtext/utils/max_utils.py": """
        def initialize_multi_tier_checkpointing(local_checkpoint_directory, **kwargs):
          return "orbax"
        """,
}


# MaxText 0.2.5's shape (an emergency module with `save` and `restore`, which its functions
# call for emergency managers without the data iterator), over _FAKE.
_FAKE_EMERGENCY_MODULE = {
    "maxtext/common/train_state_nnx.py": """
        def to_checkpoint_dict(state):
          return state
        """,
    "maxtext/common/emergency_checkpointing.py": """
        import orbax.checkpoint as ocp
        def create_emergency_checkpoint_manager(*args):
          return "maxtext-emergency"
        def create_replicator_checkpoint_manager(*args):
          return "maxtext-replicator"
        def save(checkpoint_manager, step, state, config, force):
          return checkpoint_manager.save(
              step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state)), force=force)
        def restore(checkpoint_manager, step, abstract_unboxed_pre_state):
          return checkpoint_manager.restore(step, args=ocp.args.Composite(
              state=ocp.args.PyTreeRestore(item=abstract_unboxed_pre_state))).state
        """,
    "maxtext/common/checkpointing.py": """
        from maxtext.common import emergency_checkpointing
        create_orbax_emergency_checkpoint_manager = (
            emergency_checkpointing.create_emergency_checkpoint_manager)
        create_orbax_emergency_replicator_checkpoint_manager = (
            emergency_checkpointing.create_replicator_checkpoint_manager)
        def load_state_if_possible(checkpoint_manager, data_iterator, load_parameters_from_path,
                                   load_full_state_from_path, checkpoint_storage_concurrent_gb,
                                   abstract_unboxed_pre_state,
                                   enable_single_replica_ckpt_restoring=False,
                                   dataset_type="synthetic", step=-1,
                                   expansion_factor_real_data=-1):
          step = checkpoint_manager.latest_step() if step < 0 else step
          return emergency_checkpointing.restore(checkpoint_manager, step,
                                                 abstract_unboxed_pre_state), None
        def maybe_save_checkpoint(checkpoint_manager, state, config, data_iterator, step=None):
          save_checkpoint(checkpoint_manager, step, state, config, data_iterator)
        def save_checkpoint(checkpoint_manager, step, state, config=None, data_iterator=None,
                            force=False):
          return emergency_checkpointing.save(checkpoint_manager, step, state, config, force)
        """,
}


@pytest.fixture
def fake_maxtext(tmp_path, monkeypatch):
  def make(version: str, overrides: dict[str, str] | None = None):
    for name, text in {**_FAKE, **(overrides or {})}.items():
      path = tmp_path / version / name
      path.parent.mkdir(parents=True, exist_ok=True)
      path.write_text(textwrap.dedent(text).format(version=version))
    monkeypatch.syspath_prepend(str(tmp_path / version))

  saved = (checkpointing._stop_class, checkpointing.extra_keys(), checkpointing._fallback_loader,
           checkpointing._state_layout)
  yield make
  for name in [n for n in sys.modules if n == "maxtext" or n.startswith("maxtext.")]:
    del sys.modules[name]
  checkpointing._stop_class, keys, checkpointing._fallback_loader, layout = saved
  checkpointing.set_extra_keys(keys)
  checkpointing.set_state_layout(layout)
  maxtext_patch._installed = None


def test_install_outside_the_supported_range_fails(fake_maxtext):
  fake_maxtext("0.3.1")
  with pytest.raises(maxtext_patch.UnsupportedMaxTextError, match=r"0\.3\.1 .*>=0\.2\.0,<0\.3"):
    maxtext_patch.install()


def test_install_rebinds_maxtext_to_orbax_mtc(fake_maxtext, mesh, shm_dir, tmp_path):
  import importlib

  from conftest import abstract_of, make_state
  from orbax.checkpoint.experimental.emergency import checkpoint_manager as emergency

  import orbax_mtc as mtc

  fake_maxtext("0.2.4")
  with pytest.raises(mtc_config.MaxTextConfigError, match="mtc_peers_per_node must be"):
    maxtext_patch.install(mtc_peers_per_node="two")  # checked before MaxText is touched
  assert maxtext_patch.installed_version() is None
  assert maxtext_patch.install(mtc_peers_per_node=0, mtc_local_max_to_keep=3) == "0.2.4"
  ckpt = importlib.import_module("maxtext.common.checkpointing")
  train_utils = importlib.import_module("maxtext.utils.train_utils")
  max_utils = importlib.import_module("maxtext.utils.max_utils")
  exceptions = importlib.import_module("maxtext.utils.exceptions")
  assert ckpt.create_orbax_emergency_checkpoint_manager is \
      checkpointing.create_orbax_emergency_checkpoint_manager
  assert max_utils.initialize_multi_tier_checkpointing.__name__ == \
      "_initialize_multi_tier_checkpointing"
  full = make_state(mesh)
  state = {"params": full["params"], "ids": full["ids"], "layers": full["layers"]}

  class Config:  # attribute access, as MaxText's HyperParameters
    enable_emergency_checkpoint = True
    local_checkpoint_directory = str(shm_dir)
    local_checkpoint_period = 2
    checkpoint_dir = str(tmp_path / "persistent")
    checkpoint_period = 1000
    max_num_checkpoints_to_keep = 4
    run_name = "fake"
    enable_autocheckpoint = True

  # MaxText's factory, unchanged, now builds ours, with the rest of the config seen too.
  manager = train_utils.create_checkpoint_manager(Config, mesh, lambda: abstract_of(state))
  try:
    assert isinstance(manager, mtc.CheckpointManager)
    assert isinstance(manager, emergency.CheckpointManager)  # MaxText's setup takes it as is
    options = manager.options
    assert (options.local.max_to_keep, options.persistent.max_to_keep) == (3, 4)
    assert options.replication.peers_per_node == 0 and options.job_name == "fake"
    ckpt.maybe_save_checkpoint(manager, state, Config, None, 0)
    ckpt.maybe_save_checkpoint("plain", state, Config, None, 0)
    assert ckpt.calls == [("maybe_save", "plain")]  # only other managers reach MaxText's
    manager.wait_until_finished()
    assert committed_steps(shm_dir) == [0]
    restored, params = ckpt.load_state_if_possible(manager, None, "", "", 96, abstract_of(state))
    assert params is None and restored.keys() == state.keys()
    assert ckpt.load_state_if_possible("plain", None, "", "", 96, None) == ("maxtext-load", None)
    assert train_utils.create_checkpoint_manager(
        type("Off", (), {"enable_emergency_checkpoint": False}), mesh, None) == "maxtext-standard"
    # Preemption ends MaxText's loop through MaxText's own exception class.
    with pytest.raises(exceptions.StopTraining):
      raise checkpointing._stop("preempted")
    assert ckpt.save_checkpoint(manager, 2, state, Config) is True  # ours, through MaxText's
    manager.wait_until_finished()
    assert committed_steps(shm_dir) == [0, 2]
  finally:
    manager.close()


def test_install_carries_the_grain_iterator_to_maxtexts_emergency_save_and_restore(
    fake_maxtext, mesh, shm_dir, tmp_path, monkeypatch):
  """MaxText >= 0.2.4 saves and restores through its emergency module, which it calls without
  the data iterator: with dataset_type=grain, install() adds it there as item `iter`."""
  import importlib

  from conftest import abstract_of, assert_trees_equal

  fake_maxtext("0.2.5", _FAKE_EMERGENCY_MODULE)
  # MaxText's layout of a train state needs flax; this stand-in's is the state as it is.
  monkeypatch.setattr(maxtext_patch, "_maxtext_layout", lambda: lambda state: state)
  assert maxtext_patch.install(mtc_peers_per_node=0) == "0.2.5"
  ckpt = importlib.import_module("maxtext.common.checkpointing")
  train_utils = importlib.import_module("maxtext.utils.train_utils")
  state = _small_state(mesh)
  config = type("Config", (), _grain_keys(shm_dir, tmp_path))
  want = _batches(4)
  host = _HostIterator(_grain_dataset())
  manager = train_utils.create_checkpoint_manager(config, mesh, lambda: abstract_of(state))
  try:
    for step in range(3):
      assert host.batch() == want[step]
      ckpt.maybe_save_checkpoint(manager, state, config, host, step)
    manager.wait_until_finished()
    manifest = read_manifest(shm_dir / "2")
    assert set(manifest.items) == {"state", "iter"}
    fresh = _HostIterator(_grain_dataset())
    restored, _ = ckpt.load_state_if_possible(manager, fresh, "", "", 96, abstract_of(state),
                                              False, "grain")
    assert_trees_equal(restored, state)
    assert fresh.batch() == want[3]
    # Other dataset types: MaxText's emergency save and restore, unchanged.
    plain = dict(_grain_keys(shm_dir, tmp_path), dataset_type="synthetic")
    assert ckpt.save_checkpoint(manager, 4, state, type("Plain", (), plain), host)
    manager.wait_until_finished()
    assert set(read_manifest(shm_dir / "4").items) == {"state"}
    untouched = _HostIterator(_grain_dataset())
    ckpt.load_state_if_possible(manager, untouched, "", "", 96, abstract_of(state), False,
                                "synthetic")
    assert manager.last_restore.step == 4 and untouched.batch() == want[0]
  finally:
    manager.close()
  bad = type("Scaled", (), _grain_keys(shm_dir, tmp_path, expansion_factor_real_data=2))
  with pytest.raises(mtc_config.MaxTextConfigError, match="expansion_factor_real_data=2"):
    train_utils.create_checkpoint_manager(bad, mesh, lambda: abstract_of(state))


# ----------------------------------------------------------------------------- jobs


def _single_env() -> dict[str, str]:
  """One process without `jax.distributed`, 2 CPU devices."""
  base = {k: v for k, v in os.environ.items() if not k.startswith("ORBAX_MTC_")}
  return {**base, **child_env(), "JAX_PLATFORMS": "cpu",
          "XLA_FLAGS": launch.merge_xla_flags(base.get("XLA_FLAGS"), 2)}


def _loop_args(root: pathlib.Path, persistent: pathlib.Path, *extra: str) -> list[str]:
  return [*LOOP, "run_name=mt", f"base_output_directory={persistent}",
          "enable_emergency_checkpoint=true",
          f"local_checkpoint_directory={root}/node{{process_index}}", *extra]


def _job(command: list[str], root: pathlib.Path):
  out = mp_events.LineCollector()
  job = launch.Job(command, 2, devices_per_process=2, local_root=root, env=child_env(),
                   output=out)
  return job, out


def _events(out, kind: str) -> dict[int, list[dict[str, str]]]:
  found: dict[int, list[dict[str, str]]] = {}
  for node, fields in mp_events.events(out.lines, kind):
    found.setdefault(node, []).append(fields)
  return found


def _wait(out, kind: str, predicate=lambda fields: True) -> None:
  def ready(lines):
    hits = {n for n, f in mp_events.events(lines, kind) if predicate(f)}
    return hits >= {0, 1}

  if not out.wait_for(ready, WAIT_S):
    pytest.fail(f"no {kind} line from both nodes within {WAIT_S} s\n{tail(out)}")


def _run(command: list[str], root: pathlib.Path):
  job, out = _job(command, root)
  with job:
    job.start()
    result = job.wait(JOB_TIMEOUT_S)
  assert result.returncode == 0 and not result.timed_out, f"{result}\n{tail(out)}"
  return out


def _step_digests(out) -> dict[tuple[int, int], str]:
  return {(node, int(f["step"])): f["digest"] for node, f in mp_events.events(out.lines, "STEP")}


def _persistent_steps(persistent: pathlib.Path) -> list[int]:
  folder = persistent / "mt" / "checkpoints"
  return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit())


HELD = ["steps=12", "ici_data_parallelism=1", "ici_fsdp_parallelism=-1",
        "local_checkpoint_period=2", "mtc_local_max_to_keep=2", "checkpoint_period=1000"]


@pytest.fixture(scope="module")
def held_run(tmp_path_factory, request):
  """FSDP-only job SIGKILLed once step 6 is saved and copied on both nodes."""
  root = new_root("maxtext-held")
  request.addfinalizer(lambda: shutil.rmtree(root, ignore_errors=True))
  persistent = tmp_path_factory.mktemp("maxtext") / "out"
  job, out = _job(_loop_args(root, persistent, *HELD, f"example_hold_at_step={HOLD_STEP}"),
                  root)
  with job:  # leaving the block SIGKILLs every process
    job.start()
    _wait(out, "HOLDING")
  assert _persistent_steps(persistent) == [0]  # step 6 can only come back from RAM
  for node in (0, 1):
    assert committed_steps(root / f"node{node}") == [4, 6]
  return root, persistent, _step_digests(out)


def _clone(run, root: pathlib.Path, tmp_path: pathlib.Path, *, lost=()) -> pathlib.Path:
  src_root, src_persistent, _ = run
  for node in (0, 1):
    if node in lost:  # a replaced host: its RAM disk is empty
      (root / f"node{node}").mkdir(parents=True)
    else:
      shutil.copytree(src_root / f"node{node}", root / f"node{node}", symlinks=True)
  persistent = tmp_path / "out"
  shutil.copytree(src_persistent, persistent, symlinks=True)
  return persistent


def _check_restored(out, digests, tiers: dict[int, str]) -> None:
  restored = {node: fields[-1] for node, fields in _events(out, "RESTORED").items()}
  assert sorted(restored) == [0, 1], tail(out)
  for node, fields in restored.items():
    assert (fields["step"], fields["tier"]) == (str(HOLD_STEP), tiers[node]), tail(out)
    # Bit for bit what this node held after step 6 before the SIGKILL.
    assert fields["digest"] == digests[(node, HOLD_STEP)], f"node {node}\n{tail(out)}"
  done = _events(out, "DONE")
  assert {n: f[-1]["step"] for n, f in done.items()} == {0: "8", 1: "8"}, tail(out)
  # Training resumed after the restored step, not from scratch.
  assert min(int(f["step"]) for f in _events(out, "STEP")[0]) == HOLD_STEP + 1


def test_resume_after_sigkill_from_ram(held_run, shm_root, tmp_path):
  persistent = _clone(held_run, shm_root, tmp_path)
  out = _run(_loop_args(shm_root, persistent, *HELD, "steps=9"), shm_root)
  _check_restored(out, held_run[2], {0: "local", 1: "local"})


def test_node_loss_restores_from_a_peer(held_run, shm_root, tmp_path):
  persistent = _clone(held_run, shm_root, tmp_path, lost=(1,))
  out = _run(_loop_args(shm_root, persistent, *HELD, "steps=9"), shm_root)
  _check_restored(out, held_run[2], {0: "local", 1: "peer"})
  # The replaced node holds verified steps of its own again.
  steps = committed_steps(shm_root / "node1")
  assert HOLD_STEP in steps or 8 in steps, steps
  for step in steps:
    verify_step(shm_root / "node1" / str(step))


def test_sigterm_saves_the_agreed_step_and_stops_cleanly(shm_root, tmp_path):
  persistent = tmp_path / "out"
  job, out = _job(_loop_args(shm_root, persistent, "steps=1000000", "ici_data_parallelism=2",
                             "ici_fsdp_parallelism=2", "local_checkpoint_period=100000",
                             "checkpoint_period=100000", "mtc_local_max_to_keep=2",
                             "enable_autocheckpoint=true"), shm_root)
  with job:
    job.start()
    _wait(out, "STEP", lambda fields: int(fields["step"]) >= 3)
    os.killpg(job.procs[1].pid, signal.SIGTERM)  # a preemption notice to one host
    result = job.wait(JOB_TIMEOUT_S)
  assert result.returncode == 0 and not result.timed_out, f"{result}\n{tail(out)}"
  stopped = {node: fields[-1] for node, fields in _events(out, "STOPPED").items()}
  assert sorted(stopped) == [0, 1], tail(out)
  steps = {fields["step"] for fields in stopped.values()}
  assert len(steps) == 1, f"nodes stopped at different steps: {stopped}"
  agreed = int(steps.pop())
  assert all(f["ondemand"] == str(agreed) and "SIGTERM" in f["detail"]
             for f in stopped.values()), stopped
  # No node trained past the agreed step.
  assert max(int(f["step"]) for fs in _events(out, "STEP").values() for f in fs) == agreed
  assert agreed >= 3
  for node in (0, 1):
    node_dir = shm_root / f"node{node}"
    # Step 0 (MaxText saves the first step) and the on-demand step, which is on no schedule.
    assert committed_steps(node_dir) == [0, agreed]
    manifest = verify_step(node_dir / str(agreed))
    assert (manifest.step, manifest.process_index) == (agreed, node)
    assert (node_dir / str(agreed) / "ondemand.json").is_file()
  assert _persistent_steps(persistent) == [0, agreed]
