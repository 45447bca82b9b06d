"""pax_patch: Pax's checkpointer interface on orbax-mtc, `--exit_after_ondemand_checkpoint`.

paxml cannot be installed beside current JAX, so the multi-process tests run
`pax_patch/example_executor.py`, a loop that makes Pax's executor calls in Pax's order, as 2
processes joined by `jax.distributed` (`orbax_mtc.tools.launch.Job`). A test sends a real SIGTERM to
one process once both have trained a step (READY lines); every process must save the same step
on demand inside `save_if_needed`, then either exit with Pax's status (1) or keep training.
The folders are checked directly: Pax's `checkpoint_%08d` names, plain Orbax reads the step.
A restart restores the step bit for bit (against the digest printed when it was saved, and
against the closed-form state). install() and flag parsing run in this process.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import types

import pytest
import warm_start
from mp_helpers import REPO_ROOT, child_env, mp_events, tail

import pax_patch
from orbax_mtc.local.store import committed_steps
from orbax_mtc.peers import copy_store as peer_store
from pax_patch import example_executor
from pax_patch import main as pax_main

JOB_S = 75  # each job's own bound: a hang fails the test well before pytest-timeout
WAIT_S = 60
pytestmark = pytest.mark.timeout(240)
STEP_DIR = re.compile(r"^checkpoint_(\d{8})$")


def loop_args(job_log_dir, steps: int, *extra: str) -> list[str]:
  """Pax-style flags: RAM every 4 steps with one peer, Pax's persistent interval 1000 (so a
  persistent step other than 0 and the final one can only come from an on-demand save)."""
  return ["--job_log_dir", str(job_log_dir), f"--num_train_steps={steps}",
          "--save_interval_steps=1000", "--jax_fully_async_checkpoint=1",
          "--mtc_local_save_interval_steps=4", "--mtc_peers_per_node=1", "--step_ms=20", *extra]


@contextlib.contextmanager
def pax_job(args: list[str], root):
  """2 processes of the example executor; every process is SIGKILLed on leaving the block."""
  out = mp_events.LineCollector()
  command = [sys.executable, "-m", "pax_patch.example_executor", *args]
  with warm_start.WarmJob(command, 2, devices_per_process=1, local_root=root,
                          env=child_env(), output=out) as job:
    job.start()
    yield job, out


def wait_exits(job, out) -> list[int]:
  """Every process's exit status. Not `job.wait`: the launcher kills the other processes as
  soon as one exits non-zero, and Pax's on-demand exit status is 1."""
  deadline = time.monotonic() + JOB_S
  codes = []
  for node, proc in enumerate(job.procs):
    try:
      codes.append(proc.wait(timeout=max(0.1, deadline - time.monotonic())))
    except subprocess.TimeoutExpired:
      pytest.fail(f"node {node} still running {JOB_S} s later\n{tail(out)}")
  return codes


def events(out, kind: str) -> dict[int, dict[str, str]]:
  found = {}
  for node, fields in mp_events.events(out.lines, kind):
    assert node not in found, f"two {kind} lines from node {node}\n{tail(out)}"
    found[node] = fields
  return found


def wait_ready(out) -> None:
  if not out.wait_for(lambda lines: {n for n, _ in mp_events.events(lines, "READY")} == {0, 1},
                      WAIT_S):
    pytest.fail(f"no READY line from both nodes within {WAIT_S} s\n{tail(out)}")


def ondemand_step(out) -> int:
  saved = events(out, "ONDEMAND")
  assert sorted(saved) == [0, 1], f"ONDEMAND missing on some node\n{tail(out)}"
  steps = {int(f["step"]) for f in saved.values()}
  assert len(steps) == 1, f"nodes saved different on-demand steps: {saved}"
  assert all(f["persistent"] == "1" for f in saved.values()), saved
  return steps.pop()


def persistent_steps(checkpoints) -> list[int]:
  """Steps in Pax's folder; every step folder must be named checkpoint_%08d."""
  steps = []
  for entry in sorted(os.listdir(checkpoints)):
    match = STEP_DIR.match(entry)
    if match:
      steps.append(int(match.group(1)))
    else:  # no other step-like folder (nor a leftover temporary one)
      assert not any(c.isdigit() for c in entry), f"{entry} in {checkpoints}"
  return steps


def plain_orbax_reads(checkpoints, step: int) -> None:
  """A plain `ocp.CheckpointManager` (this process, no jax.distributed) reads the step, in
  Pax's items, bit for bit equal to the closed-form state."""
  import jax
  import numpy as np
  import orbax.checkpoint as ocp

  expected = example_executor.global_state_numpy(step, data=2, model=1)
  options = ocp.CheckpointManagerOptions(step_name_format=pax_patch.step_name_format())
  with ocp.CheckpointManager(checkpoints, options=options) as mgr:
    assert step in mgr.all_steps(), mgr.all_steps()
    restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), expected)
    restored = mgr.restore(step, args=ocp.args.Composite(
        state=ocp.args.PyTreeRestore(restore_args=restore_args),
        metadata=ocp.args.JsonRestore()))
  assert restored.metadata["version"] == 1.2, restored.metadata
  assert set(restored.metadata["train_state_metadata"]["mdl_vars"]) == {"w", "b"}
  got = jax.tree_util.tree_flatten_with_path(restored.state)[0]
  want = jax.tree_util.tree_flatten_with_path(expected)[0]
  assert [p for p, _ in got] == [p for p, _ in want]
  for (path, g), (_, w) in zip(got, want, strict=True):
    assert g.dtype == w.dtype and g.tobytes() == w.tobytes(), jax.tree_util.keystr(path)


# ----------------------------------------------------------------------------- 2 processes


def test_sigterm_saves_one_step_everywhere_exits_with_pax_status_then_restores(shm_root,
                                                                                tmp_path):
  job_log_dir = tmp_path / "job"
  checkpoints = job_log_dir / "checkpoints"
  with pax_job(loop_args(job_log_dir, 100000, "--exit_after_ondemand_checkpoint=1"),
               shm_root) as (job, out):
    wait_ready(out)
    os.kill(job.pids[1], signal.SIGTERM)
    codes = wait_exits(job, out)
  assert codes == [pax_patch.PAX_ONDEMAND_EXIT_STATUS] * 2, f"{codes}\n{tail(out)}"
  step = ondemand_step(out)
  exits = events(out, "EXIT")
  assert {n: f["step"] for n, f in exits.items()} == {0: str(step), 1: str(step)}, tail(out)
  assert not events(out, "DONE"), tail(out)
  saved_digest = {n: f["digest"] for n, f in events(out, "ONDEMAND").items()}

  # Every tier holds the step, nothing newer: RAM on both nodes, the peer's copy, Pax's folder.
  for node in range(2):
    steps = committed_steps(shm_root / f"node{node}")
    assert steps and max(steps) == step, f"node {node} holds {steps}, on-demand step {step}"
    copies = peer_store.PeerStore(shm_root / f"node{node}", max_to_keep=None).copies()
    assert (1 - node, step) in copies, f"node {node} holds no copy of step {step}: {copies}"
  backups = persistent_steps(checkpoints)
  assert backups == [0, step], backups
  assert (checkpoints / f"checkpoint_{step:08d}" / "state").is_dir()
  assert (checkpoints / f"checkpoint_{step:08d}" / "metadata").is_dir()
  plain_orbax_reads(checkpoints, step)

  # A restart restores the step from RAM, bit for bit, and trains no further (num_train_steps).
  with pax_job(loop_args(job_log_dir, step), shm_root) as (job, out):
    codes = wait_exits(job, out)
  assert codes == [0, 0], f"{codes}\n{tail(out)}"
  started = events(out, "START")
  assert sorted(started) == [0, 1], tail(out)
  for node, fields in started.items():
    assert (fields["step"], fields["tier"], fields["match"]) == (str(step), "local", "1"), \
        f"node {node}: {fields}\n{tail(out)}"
    assert fields["digest"] == saved_digest[node], (node, fields, saved_digest)
  assert {n: f["step"] for n, f in events(out, "DONE").items()} == {0: str(step), 1: str(step)}


def test_without_exit_flag_training_continues_after_the_ondemand_save(shm_root, tmp_path):
  job_log_dir = tmp_path / "job"
  steps = 150
  with pax_job(loop_args(job_log_dir, steps), shm_root) as (job, out):
    wait_ready(out)
    os.kill(job.pids[0], signal.SIGTERM)
    codes = wait_exits(job, out)
  assert codes == [0, 0], f"{codes}\n{tail(out)}"
  step = ondemand_step(out)
  assert 0 < step < steps, step
  assert not events(out, "EXIT"), tail(out)
  done = events(out, "DONE")
  assert {n: f["step"] for n, f in done.items()} == {0: str(steps), 1: str(steps)}, tail(out)
  # The on-demand step and the final step (save_final) are both in Pax's folder.
  assert persistent_steps(job_log_dir / "checkpoints") == [0, step, steps]


# ----------------------------------------------------------------------------- one process


def test_manager_takes_pax_save_and_restore_calls(mesh, shm_dir, tmp_path):
  """Pax's manager calls in one process: schedules of both tiers, restore of an explicit step
  from targets without shardings plus Pax's restore_kwargs (specs, mesh), clear refusals."""
  import orbax.checkpoint as ocp

  partitioner = example_executor.ExamplePartitioner(mesh)
  metadata = partitioner.get_train_state_metadata()
  manager = pax_patch.PaxCheckpointManager(
      tmp_path / "checkpoints", local_directory=shm_dir,
      options=ocp.CheckpointManagerOptions(save_interval_steps=4), local_save_interval_steps=2,
      peers_per_node=0, enable_async_checkpointing=False)
  try:
    saved = []
    for step in range(6):
      if manager.should_save(step):
        assert manager.save(step, partitioner.state_at(step), metadata.unpadded_global_shapes)
        saved.append(step)
    assert saved == [0, 2, 4], saved
    assert manager.all_steps() == [0, 4]  # RAM keeps the newest; Pax's folder 0 and 4
    assert not manager.should_save(4)  # as Pax: a saved step is not saved again
    pax_kwargs = {"specs": metadata.partition_specs, "mesh": mesh, "transforms": None}
    for step, tier in ((4, "local"), (0, "persistent")):
      restored = manager.restore(step, metadata.padded_global_shapes,
                                 metadata.unpadded_global_shapes, restore_kwargs=pax_kwargs)
      assert manager.last_restore.tier == tier
      assert example_executor.matches(restored, partitioner.state_at(step)), step
    with pytest.raises(ValueError, match="restore_transformations"):
      manager.restore(4, metadata.padded_global_shapes,
                      restore_kwargs={**pax_kwargs, "transforms": {"w": "x"}})
    with pytest.raises(ValueError, match="input pipeline"):
      manager.save(6, partitioner.state_at(6), train_input_pipeline=object())
  finally:
    manager.close()
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["checkpoint_00000000",
                                                          "checkpoint_00000004"]


def test_failed_backup_does_not_stop_training_but_a_failed_ram_write_does():
  """save_if_needed logs a persistent-tier failure (the step is in RAM, the next backup
  retries) where Pax's own checkpointer would stop; any other error still stops it."""
  import orbax_mtc

  class Manager:
    mtc_manager = object()
    error: Exception | None = None

    def all_steps(self):
      return []

    def should_save(self, step):
      return True

    def save(self, *args, **kwargs):
      return True

    def check_for_errors(self):
      if self.error is not None:
        raise self.error

  manager = Manager()
  checkpointer = pax_patch.PaxTrainingCheckpointer(manager, "GDA")
  manager.error = orbax_mtc.BackupError(8, OSError("bucket unreachable"))
  checkpointer.save_if_needed(8, {})
  manager.error = OSError("RAM disk full")
  with pytest.raises(OSError, match="RAM disk full"):
    checkpointer.save_if_needed(9, {})


# ----------------------------------------------------------------------------- install()


def test_install_without_paxml_names_the_supported_versions():
  import importlib.util

  if importlib.util.find_spec("paxml") is not None:
    pytest.skip("paxml is installed here")
  with pytest.raises(pax_patch.PaxmlUnavailableError) as e:
    pax_patch.install()
  message = str(e.value)
  assert "paxml >=1.1.0,<2" in message and "not installed" in message, message
  assert not pax_patch.installed()


def _fake_paxml(monkeypatch, *, with_creator: bool = True):
  """paxml modules in sys.modules with the names install() rebinds."""
  import abc

  def pax_create(*args, **kwargs):
    raise AssertionError("Pax's own creator must not run once installed")

  class TrainingCheckpointer(abc.ABC):  # stands for paxml.checkpoints.TrainingCheckpointer
    @abc.abstractmethod
    def close(self):
      """Pax's checkpointers close."""

  paxml = types.ModuleType("paxml")
  checkpoints = types.ModuleType("paxml.checkpoints")
  checkpoints.TrainingCheckpointer = TrainingCheckpointer
  creators = types.ModuleType("paxml.checkpoint_creators")
  creators.checkpoints = checkpoints
  train = types.ModuleType("paxml.train")
  if with_creator:
    creators._create_checkpointer = pax_create
    train._create_checkpointer = pax_create
  for name, module in (("paxml", paxml), ("paxml.checkpoints", checkpoints),
                       ("paxml.checkpoint_creators", creators), ("paxml.train", train)):
    monkeypatch.setitem(sys.modules, name, module)
  return creators, train, pax_create, TrainingCheckpointer


def test_install_rejects_too_old_paxml(monkeypatch):
  monkeypatch.setattr(pax_patch, "_installed_paxml_version", lambda: "1.0.0")
  with pytest.raises(pax_patch.PaxmlUnavailableError, match=r"paxml 1\.0\.0 is installed.*"
                     r"pip install 'paxml>=1\.1\.0,<2'"):
    pax_patch.install()
  # A checkout without metadata, from before checkpoint_creators._create_checkpointer.
  monkeypatch.setattr(pax_patch, "_installed_paxml_version", lambda: None)
  _fake_paxml(monkeypatch, with_creator=False)
  with pytest.raises(pax_patch.PaxmlUnavailableError, match=r">=1\.1\.0,<2.*too old"):
    pax_patch.install()
  assert not pax_patch.installed()


def _task(**train):
  defaults = dict(save_interval_steps=50, save_max_to_keep=3, save_keep_interval_duration="2h",
                  enable_input_checkpointing=False, restore_transformations=None)
  return types.SimpleNamespace(model=types.SimpleNamespace(ici_mesh_shape=[1, 2, 1]),
                               train=types.SimpleNamespace(**{**defaults, **train}))


def test_install_rebinds_pax_checkpointer_creation(monkeypatch, tmp_path, shm_dir):
  monkeypatch.setattr(pax_patch, "_installed_paxml_version", lambda: "1.4.0")
  creators, train, pax_create, base = _fake_paxml(monkeypatch)
  config = pax_patch.MtcConfig(local_directory=str(shm_dir), local_save_interval_steps=7,
                               peers_per_node=0)
  pax_patch.install(config)
  try:
    assert pax_patch.installed()
    assert creators._create_checkpointer is train._create_checkpointer is not pax_create
    # Called as Pax's trainer calls it (paxml/train.py).
    checkpointer = train._create_checkpointer(_task(), tmp_path / "job", "GDA", None,
                                              enable_async_checkpointing=False)
    assert isinstance(checkpointer, pax_patch.PaxTrainingCheckpointer)
    assert isinstance(checkpointer, base)
    assert checkpointer.step_to_restore is None
    manager = checkpointer.checkpoint_manager
    assert manager.directory == tmp_path / "job" / "checkpoints"
    assert str(manager.local_directory) == str(shm_dir)
    options = manager.mtc_options
    assert options.local.save_interval_steps == 7
    assert options.persistent.save_interval_steps == 50
    assert options.persistent.preservation_policy is not None  # latest 3, plus one per 2 h
    assert not options.exit_after_ondemand_checkpoint  # Pax's executor exits itself
    assert options.step_name_format.build_name(42) == "checkpoint_00000042"
    for bad, message in (({"enable_input_checkpointing": True}, "input pipeline"),
                         ({"restore_transformations": {"x": 1}}, "restore_transformations")):
      with pytest.raises(ValueError, match=message):
        train._create_checkpointer(_task(**bad), tmp_path / "job", "GDA", None)
    pmap_task = _task()
    pmap_task.model.ici_mesh_shape = None
    with pytest.raises(ValueError, match="pjit"):
      train._create_checkpointer(pmap_task, tmp_path / "job", "GDA", None)
  finally:
    pax_patch.uninstall()
  assert creators._create_checkpointer is pax_create and train._create_checkpointer is pax_create
  assert not pax_patch.installed()


# ----------------------------------------------------------------------------- flags


def test_flags_are_split_between_orbax_mtc_and_pax():
  argv = ["--exp", "tasks.lm.params.c4.C4Spmd1BAdam4Replicas", "--job_log_dir", "gs://b/run",
          "--mtc_local_checkpoint_dir=/dev/shm/pax", "--mtc_local_save_interval_steps", "25",
          "--jax_fully_async_checkpoint=1", "--exit_after_ondemand_checkpoint",
          "--mtc_peers_per_node=2", "--mtc_replica_axis=replica", "--tensorstore_use_ocdbt=1"]
  flags = pax_main.parse_flags(argv, environ={})
  assert flags.pax_argv == ["--exp", "tasks.lm.params.c4.C4Spmd1BAdam4Replicas",
                            "--job_log_dir", "gs://b/run", "--jax_fully_async_checkpoint=1",
                            "--exit_after_ondemand_checkpoint", "--tensorstore_use_ocdbt=1"]
  assert (flags.local_checkpoint_dir, flags.local_save_interval_steps, flags.peers_per_node,
          flags.replica_axis) == ("/dev/shm/pax", 25, 2, "replica")
  assert flags.exit_after_ondemand_checkpoint and flags.jax_fully_async_checkpoint
  assert flags.job_log_dir == "gs://b/run"
  config = flags.config()
  assert (config.local_directory, config.peers_per_node) == ("/dev/shm/pax", 2)
  off = pax_main.parse_flags(["--noexit_after_ondemand_checkpoint"],
                             environ={"ORBAX_MTC_LOCAL_DIR": "/dev/shm/node0"})
  assert not off.exit_after_ondemand_checkpoint
  assert off.local_checkpoint_dir == "/dev/shm/node0"  # from `orbax-mtc launch`


@pytest.mark.parametrize("argv, message", [
    (["--mtc_local_save_interval_steps=0"], r"--mtc_local_save_interval_steps=0 must be >= 1"),
    (["--mtc_peers_per_node=-1"], r"--mtc_peers_per_node=-1 must be >= 0"),
    (["--mtc_peers_per_node=two"], r"'two' is not an integer"),
    (["--mtc_local_checkpoint_dir=ckpt"], r"must be an absolute path"),
    (["--mtc_peers_per_node"], r"needs a value"),
    (["--mtc_local_save_interval=5"], r"Unknown flag --mtc_local_save_interval; pax_patch adds"),
    (["--job_log_dir=/tmp/run", "--mtc_local_checkpoint_dir=/tmp/run/checkpoints/ram"],
     r"inside Pax's checkpoint folder /tmp/run/checkpoints"),
    (["--exit_after_ondemand_checkpoint=maybe"], r"not a boolean"),
])
def test_flag_errors_are_clear(argv, message):
  with pytest.raises(pax_main.FlagError, match=message):
    pax_main.parse_flags(["--mtc_local_checkpoint_dir=/dev/shm/pax", *argv], environ={})


def test_missing_local_directory_is_a_clear_error():
  with pytest.raises(pax_main.FlagError, match=r"--mtc_local_checkpoint_dir is required"):
    pax_main.parse_flags(["--job_log_dir=/tmp/run"], environ={})


def test_main_command_line_errors(tmp_path):
  """`python -m pax_patch.main`: a bad flag, then good flags without paxml; both exit 2 with
  the reason on stderr, before Pax would start."""
  env = {k: v for k, v in os.environ.items() if not k.startswith("ORBAX_MTC_")}
  env.update(child_env(), JAX_PLATFORMS="cpu")
  base = [sys.executable, "-m", "pax_patch.main", f"--job_log_dir={tmp_path}",
          "--exp=tasks.lm.params.lm_cloud.LmCloudSpmd2B"]
  bad = subprocess.run([*base, "--mtc_local_checkpoint_dir=/dev/shm/x",
                        "--mtc_local_save_interval_steps=-3"], env=env, cwd=REPO_ROOT,
                       capture_output=True, text=True, timeout=60)
  assert bad.returncode == pax_main.USAGE_EXIT_STATUS, bad.stderr
  assert "--mtc_local_save_interval_steps=-3 must be >= 1" in bad.stderr, bad.stderr
  import importlib.util

  if importlib.util.find_spec("paxml") is not None:
    return
  good = subprocess.run([*base, "--mtc_local_checkpoint_dir=/dev/shm/x"], env=env,
                        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
  assert good.returncode == pax_main.USAGE_EXIT_STATUS, good.stderr
  assert "needs paxml >=1.1.0,<2" in good.stderr and "not installed" in good.stderr, good.stderr
