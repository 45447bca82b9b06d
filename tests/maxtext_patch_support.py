"""Helpers and fixtures shared by test_maxtext_patch.py and test_maxtext_install.py."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import shutil
import sys
import textwrap
from typing import NamedTuple

import pytest
import warm_start
from mp_helpers import child_env, mp_events, new_root, tail

import maxtext_patch
from maxtext_patch import checkpointing
from orbax_mtc.local.store import committed_steps
from orbax_mtc.tools import launch

JOB_TIMEOUT_S = 90  # a hang shows as a failed job ...


WAIT_S = 60  # ... or a missing line, well before pytest-timeout


HOLD_STEP = 6


LOOP = [sys.executable, "-m", "maxtext_patch.example_train"]


def _keys(**overrides):
  keys = {"enable_emergency_checkpoint": True, "local_checkpoint_directory": "/dev/shm/ckpt",
          "local_checkpoint_period": 20, "checkpoint_dir": "/mnt/out/run1/checkpoints",
          "checkpoint_period": 1000, "run_name": "run1"}
  keys.update(overrides)
  return keys


class _Adam(NamedTuple):
  count: int
  mu: dict


@dataclasses.dataclass
class _State:
  step: int
  params: dict
  opt_state: tuple


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
  job = warm_start.WarmJob(command, 2, devices_per_process=2, local_root=root,
                           env=child_env(), output=out)
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
