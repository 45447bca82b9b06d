"""`LocalCheckpointOptions.background_nice`: the RAM tier's background threads run at a lower
CPU priority than the training loop (Linux: each thread has its own nice value)."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import orbax_mtc as mtc
from orbax_mtc import arrays
from orbax_mtc.local import priority
from orbax_mtc.local.store import LocalTier
from orbax_mtc.local.writer import RamWriter

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="per-thread nice values are Linux's")


def _nice_of(thread_id: int) -> int:
  return os.getpriority(os.PRIO_PROCESS, thread_id)


def _base() -> int:
  base = _nice_of(threading.get_native_id())
  if base + 5 > priority.MAX_NICE:  # the largest increment the tests ask for
    pytest.skip(f"this process already runs at nice {base}: nothing lower to test")
  return base


def _task_nices() -> dict[int, int]:
  """Every thread of this process and its nice value (field 19 of /proc/self/task/*/stat)."""
  nices = {}
  for task in Path("/proc/self/task").iterdir():
    try:
      stat = (task / "stat").read_text()
    except OSError:  # the thread ended meanwhile
      continue
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
    nices[int(task.name)] = int(fields[16])  # nice: field 19, the 17th after the comm
  return nices


@linux_only
def test_a_lowered_thread_runs_lower_and_the_caller_keeps_its_priority():
  base = _base()
  seen: list[int | None] = []
  thread = threading.Thread(
      target=lambda: seen.extend([priority.lower_this_thread(3),
                                  _nice_of(threading.get_native_id())]))
  thread.start()
  thread.join(timeout=60)
  assert seen == [base + 3, base + 3]
  assert _nice_of(threading.get_native_id()) == base


@linux_only
def test_the_increment_stops_at_the_lowest_priority():
  seen: list[int | None] = []
  thread = threading.Thread(target=lambda: seen.append(priority.lower_this_thread(100)))
  thread.start()
  thread.join(timeout=60)
  assert seen == [priority.MAX_NICE]


@linux_only
def test_a_thread_started_by_a_lowered_thread_is_not_lowered_twice():
  """Threads inherit their creator's nice value (the checksum pool's thread is started by the
  writer thread): the increment counts from the process's priority, not the creator's."""
  base = _base()
  seen: list[int | None] = []

  def inner() -> None:
    seen.append(priority.lower_this_thread(3))

  def outer() -> None:
    seen.append(priority.lower_this_thread(3))
    child = threading.Thread(target=inner)
    child.start()
    child.join(timeout=60)
  thread = threading.Thread(target=outer)
  thread.start()
  thread.join(timeout=60)
  assert seen == [base + 3, base + 3]


def test_zero_changes_nothing():
  assert priority.lower_this_thread(0) is None
  assert priority.initializer(0) is None


@linux_only
def test_the_writer_and_checksum_threads_run_lower(tmp_path):
  base = _base()
  local = LocalTier(tmp_path / "local", max_to_keep=2, nice_increment=3)
  writer = RamWriter(local, 0, 1, asynchronous=True, on_error=lambda e: True,
                     nice_increment=3)

  def nice_here() -> int:
    return _nice_of(threading.get_native_id())
  try:
    assert writer.executor.submit(nice_here).result(timeout=60) == base + 3
    assert local._crc_pool.submit(nice_here).result(timeout=60) == base + 3
  finally:
    writer.shutdown()
    local.close()


@linux_only
@pytest.mark.parametrize("increment", [5, 0])
def test_a_managers_background_threads_run_lower_than_its_loop(mesh, shm_dir, increment):
  """End to end: after a save, the threads at the lowered priority are the manager's (its
  writer and checksum threads at least); the training thread keeps its own."""
  base = _base()
  before = set(_task_nices())
  sharding = NamedSharding(mesh, P("data", "model"))
  state = {"w": jax.device_put(jnp.arange(64 * 64, dtype=jnp.float32).reshape(64, 64),
                               sharding)}
  expected = np.asarray(state["w"])
  abstract = arrays.abstract_tree(state)
  options = mtc.CheckpointManagerOptions(
      local=mtc.LocalCheckpointOptions(save_interval_steps=1, background_nice=increment),
      persistent=mtc.PersistentCheckpointOptions(save_interval_steps=10**6))
  with mtc.CheckpointManager(shm_dir / "local", shm_dir / "persistent", mesh, abstract,
                             options=options) as mgr:
    assert mgr.save(1, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state)))
    mgr.wait_until_finished()
    lowered = {tid for tid, nice in _task_nices().items()
               if tid not in before and nice == base + increment}
    others = {nice for tid, nice in _task_nices().items() if tid not in before} - {base}
    assert _nice_of(threading.get_native_id()) == base
    restored = mgr.restore(1, args=ocp.args.Composite(
        state=ocp.args.PyTreeRestore(item=abstract))).state
  assert np.array_equal(np.asarray(restored["w"]), expected)
  if increment:
    assert len(lowered) >= 2, _task_nices()  # the writer thread and the checksum thread
    assert others == {base + increment}, _task_nices()
  else:
    assert not others, _task_nices()


def test_the_option_is_checked():
  assert mtc.LocalCheckpointOptions().background_nice == 10
  assert mtc.LocalCheckpointOptions(background_nice=0).background_nice == 0
  for bad in (-1, 20):
    with pytest.raises(ValueError, match="background_nice must be in 0-19"):
      mtc.LocalCheckpointOptions(background_nice=bad)
  for bad in (True, "10", 2.0):
    with pytest.raises(TypeError, match="background_nice must be an int"):
      mtc.LocalCheckpointOptions(background_nice=bad)
