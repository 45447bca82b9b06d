"""The RAM tier's writer thread: one local write in flight, errors kept for the agreement.

Everything that touches the RAM disk in the background runs on this one thread, in order:
the step writes, the read-back of a step chosen for backup, the peer copies' chunks and
their commits; only the chunks of a step being sent are read ahead on a thread of their own
(`reader`), after this thread committed that step. Steps therefore commit in the order they
were saved, and a read-back reads a step before any later write can reuse its files. One
exception: within a save (`RamWriter.first`), the step's write goes ahead of the work the
save itself handed over before it (a peer's landed chunks, their commit). The thread does
file I/O only (rule 2).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import threading
from collections.abc import Callable, Iterator
from typing import Any

from absl import logging

from orbax_mtc.agreement import Status
from orbax_mtc.local import priority
from orbax_mtc.local import staging as local_staging
from orbax_mtc.local import store as local_store


def _run_into(future: concurrent.futures.Future, fn: Callable[..., Any], args: tuple,
              kwargs: dict) -> None:
  """Runs held work, its outcome into the future `submit` handed out for it."""
  if not future.set_running_or_notify_cancel():
    return  # cancelled while held
  try:
    future.set_result(fn(*args, **kwargs))
  except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
    future.set_exception(e)


class _HeldFuture(concurrent.futures.Future):
  """The future of held work: waiting on it lets the held work go first (no deadlock)."""

  def __init__(self, release: Callable[[], None]):
    super().__init__()
    self._release = release

  def result(self, timeout: float | None = None) -> Any:
    self._release()
    return super().result(timeout)

  def exception(self, timeout: float | None = None) -> BaseException | None:
    self._release()
    return super().exception(timeout)


class _Thread(concurrent.futures.ThreadPoolExecutor):
  """The one writer thread, which knows whether it still has work (`busy`)."""

  def __init__(self, nice_increment: int = 0) -> None:
    super().__init__(1, thread_name_prefix="mtc-local-write",
                     initializer=priority.initializer(nice_increment))
    # The main thread and the thread itself (a copy's read-ahead) both hand it work: the
    # queue and the held list must see one order.
    self._submitting = threading.Lock()
    # Work handed in while a save holds the queue (`hold`), in order; None: not held.
    self._held: list[tuple[concurrent.futures.Future, Callable[..., Any], tuple, dict]] | None \
        = None
    # Work handed out, pruned as it finishes (not just the newest future: a read cancelled
    # before it ran, newest or not, must not hide the work still queued).
    self._outstanding: list[concurrent.futures.Future] = []
    self._counting = threading.Lock()

  def _counted(self, future: concurrent.futures.Future) -> concurrent.futures.Future:
    with self._counting:  # pruned here too: a finished future holds its result (a chunk)
      self._outstanding = [f for f in self._outstanding if not f.done()]
      self._outstanding.append(future)
    return future

  def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any
             ) -> concurrent.futures.Future:
    with self._submitting:
      if self._held is not None:
        future = self._counted(_HeldFuture(self.release))
        self._held.append((future, fn, args, kwargs))
        return future
      return self._counted(super().submit(fn, *args, **kwargs))

  def submit_first(self, fn: Callable[..., Any], /, *args: Any) -> concurrent.futures.Future:
    """Queues `fn` ahead of the work held since `hold` (after everything queued before)."""
    with self._submitting:
      return self._counted(super().submit(fn, *args))

  def hold(self) -> None:
    """Work submitted from now on waits (in order) until `release`."""
    with self._submitting:
      if self._held is None:
        self._held = []

  def release(self) -> None:
    """Queues the held work, in the order it came."""
    with self._submitting:
      held, self._held = self._held, None
      for future, fn, args, kwargs in held or ():
        super().submit(_run_into, future, fn, args, kwargs)

  def shutdown(self, wait: bool = True, **kwargs: Any) -> None:
    self.release()
    super().shutdown(wait, **kwargs)

  @property
  def busy(self) -> bool:
    with self._counting:
      self._outstanding = [f for f in self._outstanding if not f.done()]
      return bool(self._outstanding)


class RamWriter:
  """Writes staged steps into the RAM tier, one at a time.

  Args:
    local: this node's RAM tier.
    process_index: this process.
    process_count: processes in the job.
    asynchronous: write on the thread (else in the caller, before `write` returns).
    on_error: receives a failed write's error, once the write is waited for; it returns
      False when an earlier error is still unreported (this one is then only logged).
    nice_increment: how much lower the thread's CPU priority is than the process's
      (`LocalCheckpointOptions.background_nice`; priority.py).
  """

  def __init__(self, local: local_store.LocalTier, process_index: int, process_count: int, *,
               asynchronous: bool, on_error: Callable[[BaseException], bool],
               nice_increment: int = 0):
    self._local = local
    self._process_index = process_index
    self._process_count = process_count
    self._asynchronous = asynchronous
    self._on_error = on_error
    self.executor = _Thread(nice_increment)
    # Reads a step's chunks ahead of sending its peer copies (peers/replication.py): queued
    # behind the next step's write on the writer thread they came too late, and the saves'
    # calls read them instead. The step being sent is not retired meanwhile (keep_sending).
    self.reader = concurrent.futures.ThreadPoolExecutor(
        1, thread_name_prefix="mtc-read", initializer=priority.initializer(nice_increment))
    self._in_flight: concurrent.futures.Future | None = None
    self._retired: Exception | None = None

  @property
  def in_flight(self) -> bool:
    """A write was issued and not yet waited for."""
    return self._in_flight is not None

  @property
  def writing(self) -> bool:
    """A write is still running."""
    return self._in_flight is not None and not self._in_flight.done()

  @property
  def busy(self) -> bool:
    """The thread still has work: a write, a copy's read-ahead, a received copy's commit
    (peers/replication hands the thread its work directly)."""
    return self.executor.busy or self.writing

  def status_of(self, step: int) -> Status:
    """WRITING, COMMITTED or FAILED: where this node is with `step` (for peer copies)."""
    if self.writing:
      return Status.WRITING
    return Status.COMMITTED if step in self._local.steps() else Status.FAILED

  def write(self, staged: local_staging.StagedStep, *, background: bool | None = None,
            replace: str | None = None) -> None:
    """Issues the write of `staged`; the caller waits for the previous one first.

    Args:
      staged: the step's bytes on the host.
      background: write on the thread; default: as the manager's async option says. A
        synchronous write is waited for (its error kept for the next agreement).
      replace: how a committed folder of the step is set aside (`LocalTier.write`).
    """
    self._refuse_if_retired()
    if background if background is not None else self._asynchronous:
      # Ahead of work a save holds back (`first`): a peer's chunks wait, the step does not.
      self._in_flight = self.executor.submit_first(self._write, staged, replace)
      return
    self._in_flight = concurrent.futures.Future()
    try:
      self._write(staged, replace)
      self._in_flight.set_result(None)
    except Exception as e:  # noqa: BLE001 - raised on every process by the next agreement
      self._in_flight.set_exception(e)
    self.wait()

  def wait(self, timeout_s: float | None = None) -> bool:
    """Waits for the write in flight, at most `timeout_s` (None: for as long as it runs).
    Its error is kept for the next agreement, which raises it on every process alike
    (raised here, on one process, it would leave the others waiting in their next
    collective). Returns False when the timeout passed first (the write still runs)."""
    in_flight = self._in_flight
    if in_flight is None:
      return True
    try:
      error = in_flight.exception(timeout_s)
    except concurrent.futures.TimeoutError:
      return False
    except concurrent.futures.CancelledError as e:  # the thread was shut down first
      error = e
    self._in_flight = None
    if error is not None and not self._on_error(error):
      logging.error("orbax-mtc: a further local write failed before the first error was "
                    "reported: %s: %s", type(error).__name__, error)
    return True

  def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
    """Runs `fn(*args)` on the writer thread, after everything issued before it."""
    self._refuse_if_retired()
    return self.executor.submit(fn, *args)

  def drain(self) -> None:
    """Returns once everything issued so far has run (received copies are committed)."""
    self.executor.release()
    self.executor.submit(lambda: None).result()

  @contextlib.contextmanager
  def first(self) -> Iterator[None]:
    """Within the block, work handed to the thread (a peer's landed chunks and their commit)
    waits until the block ends, except the step's write (`write`), which goes ahead of it:
    the newest step commits, and its copies can start, without waiting behind a peer's
    copy (at 1 GiB, 0.3 s of received chunks landed at each save)."""
    self.executor.hold()
    try:
      yield
    finally:
      self.executor.release()

  def shutdown(self) -> None:
    self.executor.shutdown(wait=True)
    self.reader.shutdown(wait=True, cancel_futures=True)  # reads nobody will take

  def retire(self, error: Exception) -> None:
    """Runs everything issued so far, then refuses any further work with `error` (the
    folder now belongs to another writer)."""
    self._retired = error
    self.shutdown()

  def _refuse_if_retired(self) -> None:
    if self._retired is not None:
      raise self._retired

  def _write(self, staged: local_staging.StagedStep, replace: str | None = None) -> None:
    try:
      extra = {} if replace is None else {"replace": replace}
      self._local.write(staged, self._process_index, self._process_count, **extra)
    except OSError as e:
      # Say what happened; the advice about a full RAM disk only where it is full.
      hint = (" If the RAM disk is full, lower LocalCheckpointOptions.max_to_keep or enlarge "
              "the RAM disk (GKE sizing: 2.2x the per-node checkpoint on TPU)."
              if e.errno == errno.ENOSPC else "")
      raise type(e)(
          e.errno, f"orbax-mtc: local save of step {staged.step} to {self._local.directory} "
          f"failed: {str(e.strerror or e).rstrip('.')}. Committed steps are untouched.{hint}"
      ) from e
