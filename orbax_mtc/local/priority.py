"""The RAM tier's background threads at a lower CPU priority than the training loop.

A save's background work (the write, its checksums, the peer copies' reads and writes) runs
while the loop goes on. On a host whose cores the training step also uses (a CPU step, an
input pipeline, several processes per host), both compete for the cores when they overlap,
and the step is what the user waits for. Linux gives each thread its own nice value, so the
writer's threads yield the cores to the step when both want them and use them whole when the
step is idle. Elsewhere (or where the kernel refuses) the threads keep the process's priority.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from collections.abc import Callable

from absl import logging

MAX_NICE = 19  # the lowest priority Linux has


def lower_this_thread(increment: int) -> int | None:
  """Sets the calling thread's nice value to the process's plus `increment` (at most
  MAX_NICE; never higher than it is: a thread inherits its creator's, which may be lowered
  already).

  Returns the thread's nice value, or None where nothing changed (not Linux, increment 0, or
  the kernel refused; a lower priority needs no privilege, so that is rare and only logged).
  """
  if increment <= 0 or not sys.platform.startswith("linux"):
    return None
  thread_id = threading.get_native_id()
  try:
    # The process's: its main thread's (its id is the process id).
    target = min(MAX_NICE, os.getpriority(os.PRIO_PROCESS, os.getpid()) + increment)
    if os.getpriority(os.PRIO_PROCESS, thread_id) < target:
      os.setpriority(os.PRIO_PROCESS, thread_id, target)  # Linux: this thread only
    return os.getpriority(os.PRIO_PROCESS, thread_id)
  except OSError as e:
    logging.warning("orbax-mtc: could not lower the priority of thread %s: %s", thread_id, e)
    return None


def initializer(increment: int) -> Callable[[], None] | None:
  """A `ThreadPoolExecutor` initializer that lowers each of its threads by `increment` (None
  for 0: nothing to do). It never raises: an initializer that raises breaks its pool."""
  if increment <= 0:
    return None
  return functools.partial(lower_this_thread, increment)
