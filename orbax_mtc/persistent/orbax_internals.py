"""Orbax's internals, read in one place: what the public API cannot tell.

The persistent tier must know whether Orbax still writes on this process (its commit thread,
its step metadata writes) and must consume the errors those writes left, so that no process
raises one alone between two of Orbax's barriers. orbax-checkpoint 0.12 exposes neither;
another version without these attributes falls back to "not running" and "no errors".
"""

from __future__ import annotations

from typing import Any


def orbax_writes_running(checkpointer: Any) -> bool:
  """Whether Orbax's checkpointer still works on an earlier save on this process.

  That is: its commit thread runs, or a step metadata file is still being written.
  `AsyncCheckpointer.save()` first waits for both, the metadata write with no timeout
  (orbax-checkpoint 0.12), and raises what they left behind on this process alone, between
  two of its barriers. Reads Orbax internals; a version without them answers False.

  Args:
    checkpointer: The persistent tier's Orbax checkpointer.

  Returns:
    True if an earlier save is still being written on this process.
  """
  commit = getattr(getattr(checkpointer, "_async_manager", None), "_thread", None)
  if commit is not None and commit.is_alive():
    return True
  store = getattr(checkpointer, "_metadata_store", None)
  lock = getattr(store, "_write_lock", None)
  futures = getattr(store, "_write_futures", None)
  if lock is None or futures is None:
    return False
  if not lock.acquire(blocking=False):
    return True  # another thread holds it while it waits for a write
  try:
    return any(not future.done() for future in futures)
  finally:
    lock.release()


def collect_orbax_errors(checkpointer: Any) -> list[BaseException]:
  """Waits for Orbax's checkpointer to finish its earlier saves and consumes their errors.

  Each error is raised once, so that the next `save()` raises none of them on one process
  only. Does not block when `orbax_writes_running` is False.

  Args:
    checkpointer: The persistent tier's Orbax checkpointer.

  Returns:
    The errors the earlier saves left behind (empty if none, or if the checkpointer has no
    `wait_until_finished`).
  """
  wait = getattr(checkpointer, "wait_until_finished", None)
  if wait is None:
    return []
  errors: list[BaseException] = []
  store = getattr(checkpointer, "_metadata_store", None)
  # Each failing call consumes one error: the commit thread's, or one metadata write's.
  for _ in range(2 + len(getattr(store, "_write_futures", None) or ())):
    try:
      wait()
      break
    except Exception as e:  # noqa: BLE001 - reported by the caller
      errors.append(e)
  return errors
