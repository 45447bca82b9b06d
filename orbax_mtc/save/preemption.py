"""Which step every process saves on when one of them gets SIGTERM (a preemption notice).

With `jax.distributed` up, XLA's preemption notifier owns SIGTERM: the process that gets it
posts the notice to the coordination service, every process's sync manager reports the last id
it was asked about, and the sync point is max(ids) + 1. So the ids must grow by exactly one per
new step *on every process*: we feed the sync point a counter of our own instead of the user's
step, which may jump (resume, `step += k`). Asking again about a step already asked about
reuses its id and its answer (MaxText asks in `save` and again in its loop).

Without `jax.distributed` (one process) nobody catches SIGTERM, so this module installs a
handler that records the signal and chains any previous Python handler; the first new step
asked about after the signal is the sync point, as JAX would choose.

One state per process: a step id seen by two managers is one id. Only the thread that owns a
manager (the training loop) creates ids; other threads (Orbax's finalize thread) only look up
answers already given.
"""

from __future__ import annotations

import collections
import signal
import threading
import time
from datetime import datetime

from absl import logging
from jax.experimental import multihost_utils

from orbax_mtc import distributed

# Key under which XLA's preemption sync manager posts the notice (RFC 3339 time of the signal).
NOTICE_KEY = "RECEIVED_PREEMPTION_NOTICE"
_ANSWERS_KEPT = 64  # steps whose answers are remembered (a loop asks about the last few only)


def _jax_state():
  from jax._src import distributed as jax_distributed

  return jax_distributed.global_state


def jax_sync_available() -> bool:
  """Whether JAX's preemption sync manager runs in this process (it then owns SIGTERM)."""
  if not distributed.is_initialized():
    return False
  return getattr(_jax_state(), "preemption_sync_manager", None) is not None


class _SigtermRecorder:
  """Our SIGTERM handler for a process without `jax.distributed`: records, chains, never
  exits (the training loop decides when to stop)."""

  def __init__(self):
    self.first_at: float | None = None
    self.count = 0
    self._previous = None
    self._users = 0

  def acquire(self) -> bool:
    if self._users == 0:
      if threading.current_thread() is not threading.main_thread():
        logging.warning(
            "orbax-mtc: the manager was built outside the main thread, so no SIGTERM handler "
            "could be installed: preemption notices will not trigger on-demand saves.")
        return False
      self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
    self._users += 1
    return True

  def release(self) -> None:
    if self._users == 0:
      return
    self._users -= 1
    if self._users == 0 and threading.current_thread() is threading.main_thread():
      if signal.getsignal(signal.SIGTERM) == self._on_sigterm:
        signal.signal(signal.SIGTERM, self._previous or signal.SIG_DFL)

  def _on_sigterm(self, signum, frame) -> None:
    self.count += 1
    if self.first_at is None:
      self.first_at = time.time()
    logging.warning("orbax-mtc: SIGTERM received (%d): saving an on-demand checkpoint at the "
                    "next step.", self.count)
    previous = self._previous
    # A Python handler installed before us still runs; the default action (terminate) and
    # SIG_IGN are what we replace.
    if callable(previous) and previous not in (signal.SIG_DFL, signal.SIG_IGN):
      previous(signum, frame)


class _ProcessState:
  def __init__(self):
    self.lock = threading.Lock()
    self.next_id = 0
    self.answers: collections.OrderedDict[int, bool] = collections.OrderedDict()
    self.own_sync_id: int | None = None  # single-process sync point, once chosen
    self.recorder = _SigtermRecorder()
    self.warned_disabled = False


_STATE = _ProcessState()


def attach(process_count: int) -> bool:
  """Called by each manager at construction: installs our handler where JAX has none.

  Returns whether our handler is in use (so `detach` must be called on close).
  """
  if jax_sync_available():
    return False
  if process_count > 1:
    if not _STATE.warned_disabled:
      _STATE.warned_disabled = True
      logging.warning(
          "orbax-mtc: jax.distributed runs without its preemption service "
          "(jax_enable_preemption_service is off), so processes cannot agree on an on-demand "
          "step: SIGTERM will not trigger on-demand checkpoints.")
    return False
  return _STATE.recorder.acquire()


def detach() -> None:
  _STATE.recorder.release()


def _ask(step_id: int) -> bool:
  if jax_sync_available():
    try:
      return bool(multihost_utils.reached_preemption_sync_point(step_id))
    except RuntimeError:  # preemption service disabled
      return False
  if _STATE.recorder.first_at is None:
    return False
  if _STATE.own_sync_id is None:
    _STATE.own_sync_id = step_id
  return _STATE.own_sync_id == step_id


def reached(step: int) -> bool:
  """Whether `step` is the step every process saves on after a preemption notice.

  Every process must ask about the same steps in the same order (the training loop does).
  """
  with _STATE.lock:
    answer = _STATE.answers.get(step)
    if answer is None:
      _STATE.next_id += 1
      answer = _ask(_STATE.next_id)
      _STATE.answers[step] = answer
      while len(_STATE.answers) > _ANSWERS_KEPT:
        _STATE.answers.popitem(last=False)
    return answer


def known_answer(step: int) -> bool:
  """The answer already given for `step` (False if never asked): for threads that must not
  create ids."""
  with _STATE.lock:
    return bool(_STATE.answers.get(step, False))


def parse_notice(text: str) -> float:
  """Epoch seconds of an absl RFC 3339 time (nanosecond digits are truncated)."""
  return datetime.fromisoformat(text.strip()).timestamp()


def notice_time() -> float | None:
  """When the first SIGTERM of the job arrived (epoch seconds), or None if none has."""
  if jax_sync_available():
    try:
      text = _jax_state().client.key_value_try_get(NOTICE_KEY)
    except Exception:  # noqa: BLE001 - "not found" is an exception of the client
      return None
    try:
      return parse_notice(text)
    except ValueError:
      logging.warning("orbax-mtc: cannot parse the preemption notice time %r", text)
      return None
  return _STATE.recorder.first_at


def sigterm_count() -> int:
  """SIGTERMs our own handler has seen in this process (0 where JAX owns the signal)."""
  return _STATE.recorder.count


class SyncPoint:
  """One manager's view of the sync point: the answers per step, and the step it fired at.

  Args:
    owner: the thread that creates step ids (the training loop that built the manager);
      other threads only look up answers already given.
  """

  def __init__(self, owner: threading.Thread):
    self._owner = owner
    self.step: int | None = None  # the step every process saves on demand

  def reached(self, step: int) -> bool:
    """Whether `step` is the sync point (the same answer on every process, and when asked
    again)."""
    step = int(step)
    if threading.current_thread() is not self._owner:
      return known_answer(step)
    answer = reached(step)
    if answer and self.step is None:
      self.step = step
      logging.warning("orbax-mtc: preemption notice: every process saves step %d on demand",
                      step)
    return answer
