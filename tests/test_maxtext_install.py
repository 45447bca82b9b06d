"""maxtext_patch.install on a stand-in MaxText: the supported range, the rebinding of MaxText's checkpointing, and whole jobs (resume after SIGKILL, node loss, SIGTERM)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from maxtext_patch_support import (
  _FAKE_EMERGENCY_MODULE,
  HELD,
  HOLD_STEP,
  JOB_TIMEOUT_S,
  _batches,
  _check_restored,
  _clone,
  _events,
  _grain_dataset,
  _grain_keys,
  _HostIterator,
  _job,
  _loop_args,
  _persistent_steps,
  _run,
  _single_env,
  _small_state,
  _wait,
)
from mp_helpers import tail

import maxtext_patch
from maxtext_patch import checkpointing
from maxtext_patch import config as mtc_config
from orbax_mtc.local.read import verify_step
from orbax_mtc.local.store import committed_steps, read_manifest

pytestmark = pytest.mark.timeout(240)


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
