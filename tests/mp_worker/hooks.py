"""Every hook that injects timing or a fault into a running manager.

Timing and faults are injected here, never by sleeping in a test; the sub-commands call these
functions and nothing of the manager that is not public. Each hook replaces a public method
of one of the manager's composed parts, on its class (one manager per worker process), or
uses the manager's public API:

  diverge_and_die       LocalTier.write (replaced on the dying process); on the others the
                        manager's wait_until_local_finished()
  drop_local_step       the step's folder removed, as a node that lost it
  persistent_steps      Orbax's own listing of the persistent directory
  peer_copies           a PeerStore opened on the node's folder (read only)
  small_replication_calls
                        module orbax_mtc.peers.spread: BYTES_PER_CALL
  fixed_stretch         the module function orbax_mtc.peers.spread.next_stretch (replaced:
                        a fixed spread)
  count_rounds          the module function orbax_mtc.collectives.allreduce (wrapped: a
                        ROUND line per agreement round, naming what it agrees)
  install_write_hook    LocalTier.write (wrapped)
  install_restore_hook  StepAttempt.load (wrapped)
  install_fault         by --phase: kill: RamWriter.write (replaced); write, writeback:
                        LocalTier.write (replaced);
                        commit: LinkKeeper.committed (replaced); readback:
                        BackupScheduler.read_back (replaced); send: the module function
                        orbax_mtc.peers.stream.copy_stream (replaced); chunk-read: the
                        streams copy_stream returns (their read raises EIO); outgrown:
                        the streams copy_stream returns (1 MiB longer than the step's
                        planned size, as a grown per-process item would make them);
                        chunk-place: the module function orbax_mtc.transport.place
                        (replaced, failing while Replicator.progress or .issue moves the
                        fault step); receive:
                        orbax_mtc.peers.copy_store.IncomingCopy.write (replaced: writing a
                        received chunk fails, ENOSPC); persistent-read:
                        the module function orbax_mtc.restore.persistent.check_item
                        (replaced: reading the step's metadata fails); restore-plan: the
                        module function orbax_mtc.restore.tiles.routes (replaced: a
                        ValueError on a serving process); restore-read: the module
                        function orbax_mtc.local.read.read_data (replaced until the returned
                        undo is called)
  transient_device_put  jax.device_put (replaced until the returned undo is called)
  exit_at_first_write   LocalTier.write (replaced: the process ends as it starts)
  die_once_committed    the process SIGKILLs itself once a RAM step folder and a persistent
                        step are committed (bounded wait on their files)
  faster_gcsfs_retries  gcsfs.retry's asyncio.sleep (scaled: its backoff between retries
                        of a refused request)
"""

from __future__ import annotations

import errno
import os
import pathlib
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from orbax_mtc.local.store import LocalTier

from .events import emit

HOOK_WAIT_S = 60.0  # a hook waits at most this long for the notice or the go file
_POLL_S = 0.02

FAULT_PHASES = ("write", "commit", "readback", "send", "chunk-read", "chunk-place", "receive",
                "outgrown", "restore-plan", "restore-read", "persistent-read", "writeback",
                "kill")


# ----------------------------------------------------------------------------- save loop


def diverge_and_die(mgr, me: int, step: int, state: Any, *, dying: bool,
                    report: Callable[[], None]) -> None:
  """Deterministic divergence at `step`; never returns.

  Every process calls save(step), as a real job does, but the local write of the dying
  process never completes (its writer blocks, standing for a node killed mid-write); the
  others commit `step`. After a barrier every process calls `report` (COMMITTED), then the
  dying one prints DYING and SIGKILLs itself while the others wait (the launcher kills them).
  """
  import orbax.checkpoint as ocp
  from jax.experimental import multihost_utils

  if dying:
    LocalTier.write = lambda *a, **k: threading.Event().wait()
  mgr.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state)))
  if not dying:
    # This process's own work only: wait_until_finished() would also replicate, a
    # collective the blocked process never joins.
    mgr.wait_until_local_finished()
  multihost_utils.sync_global_devices(f"mp-worker-die-{step}")
  report()
  if dying:
    emit(f"DYING process={me} step={step}")
    os.kill(os.getpid(), signal.SIGKILL)
  threading.Event().wait()  # until the launcher kills us


def drop_local_step(mgr, step: int) -> None:
  """Deletes `step` from this node's RAM tier only (as after a failed write)."""
  import shutil

  mgr.wait_until_local_finished()
  shutil.rmtree(mgr.local_directory / str(step))


def persistent_steps(mgr) -> list[int]:
  """The steps in the manager's persistent tier, as Orbax lists them."""
  import orbax.checkpoint as ocp

  return sorted(ocp.utils.checkpoint_steps(mgr.directory))


def peer_copies(mgr) -> list[tuple[int, int]]:
  """(source, step) of the peer copies this node holds."""
  from orbax_mtc.peers.copy_store import PeerStore

  return list(PeerStore(mgr.local_directory, max_to_keep=None).copies())


def small_replication_calls(nbytes: int = 1 << 20) -> None:
  """One save() call moves `nbytes` of peer copies (not 128 MiB), so a step's copies are
  still on their way during the next saves, as a large model's are."""
  from orbax_mtc.peers import spread

  spread.BYTES_PER_CALL = nbytes


def fixed_stretch(intervals: int) -> None:
  """Every step's copies after the first save are spread over `intervals` local intervals
  (not adapted to their waits), as on a link slower than one interval's calls: the saves in
  between carry them on."""
  from orbax_mtc.peers import spread

  spread.next_stretch = lambda stretch, waited_ms, interval_ms, most: spread.Stretch(
      min(intervals, most))


def count_rounds() -> None:
  """Prints `ROUND what=<what>` (spaces as '_') for every agreement round, as it starts."""
  from orbax_mtc import collectives

  allreduce = collectives.allreduce

  def counted(parts, what, *rest, **kwargs):
    emit(f"ROUND what={what.replace(' ', '_')}")
    return allreduce(parts, what, *rest, **kwargs)
  collectives.allreduce = counted


# ----------------------------------------------------------------------------- preemption


def _wait_for_notice(timeout_s: float = HOOK_WAIT_S) -> float | None:
  """Polls `preemption.notice_time()` until the job's SIGTERM is known, at most `timeout_s`."""
  from orbax_mtc.save import preemption

  deadline = time.monotonic() + timeout_s
  while True:
    notice = preemption.notice_time()
    if notice is not None or time.monotonic() >= deadline:
      return notice
    time.sleep(_POLL_S)


def _wait_for_file(path: pathlib.Path, timeout_s: float = HOOK_WAIT_S) -> bool:
  deadline = time.monotonic() + timeout_s
  while not path.exists():
    if time.monotonic() >= deadline:
      return False
    time.sleep(_POLL_S)
  return True


def install_write_hook(args, mgr, me: int, ondemand_steps: set[int]) -> None:
  """Wraps this process's local writer (it runs on the manager's writer thread).

  write: the write of --hook-step first prints HOOK-WRITING and waits until the preemption
    notice is known (the test sends SIGTERM when it sees the line), so the notice lands while
    an ordinary save is being written.
  ondemand-write: the first write of a step whose `reached_preemption` was True prints
    HOOK-ONDEMAND and waits for `<marker-dir>/go`, so the test can signal again meanwhile.
  """
  real = LocalTier.write
  done: set[int] = set()

  def write(tier, staged, *rest, **kwargs):
    step = getattr(staged, "step", None)
    if step not in done:
      if args.hook == "write" and step == args.hook_step:
        done.add(step)
        emit(f"HOOK-WRITING process={me} step={step}")
        notice = _wait_for_notice()
        emit(f"HOOK-NOTICE process={me} step={step} known={int(notice is not None)}")
      elif args.hook == "ondemand-write" and step in ondemand_steps:
        done.add(step)
        emit(f"HOOK-ONDEMAND process={me} step={step}")
        found = _wait_for_file(pathlib.Path(args.marker_dir) / "go")
        emit(f"HOOK-GO process={me} step={step} found={int(found)}")
    return real(tier, staged, *rest, **kwargs)

  LocalTier.write = write


def install_restore_hook(mgr, me: int) -> None:
  """The first read of a RAM step inside restore() prints HOOK-RESTORING and waits until the
  preemption notice is known (the test sends SIGTERM when it sees the line)."""
  fired: list[bool] = []

  def hooked(fn):
    def wrapper(*a, **k):
      if not fired:
        fired.append(True)
        emit(f"HOOK-RESTORING process={me}")
        notice = _wait_for_notice()
        emit(f"HOOK-NOTICE process={me} known={int(notice is not None)}")
      return fn(*a, **k)
    return wrapper

  from orbax_mtc.restore.attempt import StepAttempt

  StepAttempt.load = hooked(StepAttempt.load)


# ----------------------------------------------------------------------------- faults


def install_fault(args, mgr, me: int) -> Callable[[], None]:
  """Makes --fault-process fail in --phase (at --fault-step where a step applies).

  Returns:
    What to call once the restore is over: it undoes a restore-read fault (the saves after
    it read nothing back); a no-op for the other phases.
  """
  from orbax_mtc.local.format import CorruptStepError
  from orbax_mtc.local.restore_links import LinkKeeper
  from orbax_mtc.peers import stream as peer_stream
  from orbax_mtc.save.backup_scheduler import BackupScheduler

  def nothing() -> None:
    pass

  if me != args.fault_process:
    return nothing
  phase, at = args.phase, args.fault_step
  if phase == "kill":
    from orbax_mtc.local.writer import RamWriter

    issue = RamWriter.write

    def dying_write(writer, staged, *rest, **kwargs):
      # Killed mid-save, on the main thread as the write is issued (after the save's
      # agreement): the step is never committed here, and this process enters no further
      # collective, so the others meet a barrier nobody else reaches. (Killed from the
      # writer thread instead, a loaded machine can let the main thread into the next
      # all-gather first, and the others then see gloo's connection reset.)
      if staged.step == at:
        emit(f"DYING process={me} step={at}")
        os.kill(os.getpid(), signal.SIGKILL)
      return issue(writer, staged, *rest, **kwargs)
    RamWriter.write = dying_write
  elif phase in ("write", "writeback"):
    write = LocalTier.write
    first = {"done": False}

    def failing_write(tier, staged, *rest, **kwargs):
      # writeback: the first write after the restore (the recovered step written back).
      if (phase == "write" and staged.step == at) or (phase == "writeback" and not first["done"]):
        first["done"] = True
        raise OSError(errno.ENOSPC, "No space left on device (injected)")
      first["done"] = True
      return write(tier, staged, *rest, **kwargs)
    LocalTier.write = failing_write
  elif phase == "commit":
    committed = LinkKeeper.committed

    def failing_commit(links, step):
      if step == at:
        raise PermissionError(errno.EACCES, "LKG link not writable (injected)")
      return committed(links, step)
    LinkKeeper.committed = failing_commit
  elif phase == "readback":
    read_back = BackupScheduler.read_back

    def failing_read(scheduler, pending):
      if pending.step == at:
        raise CorruptStepError("read-back failed (injected)")
      return read_back(scheduler, pending)
    BackupScheduler.read_back = failing_read
  elif phase == "send":
    copy_stream = peer_stream.copy_stream

    def failing_stream(step_dir, manifest, *rest, **kwargs):
      if manifest.step == at:
        raise RuntimeError("peer copy read failed (injected)")
      return copy_stream(step_dir, manifest, *rest, **kwargs)
    peer_stream.copy_stream = failing_stream
  elif phase == "chunk-read":
    copy_stream = peer_stream.copy_stream

    def unreadable_stream(step_dir, manifest, *rest, **kwargs):
      stream = copy_stream(step_dir, manifest, *rest, **kwargs)
      if manifest.step == at:
        def read(offset, out):  # the data file fails once the transfer runs
          raise OSError(errno.EIO, "Input/output error reading data.bin (injected)")
        stream.read = read
      return stream
    peer_stream.copy_stream = unreadable_stream
  elif phase == "outgrown":
    import numpy as np

    copy_stream = peer_stream.copy_stream

    def longer_stream(step_dir, manifest, *rest, **kwargs):
      stream = copy_stream(step_dir, manifest, *rest, **kwargs)
      if manifest.step == at:  # more than any planning margin (peers/size_plan.py)
        stream.segments.append(peer_stream.Segment(stream.nbytes, 1 << 20,
                                                   buffer=np.zeros(1 << 20, np.uint8)))
        stream.nbytes += 1 << 20
      return stream
    peer_stream.copy_stream = longer_stream
  elif phase == "chunk-place":
    from orbax_mtc import transport
    from orbax_mtc.peers.replication import Replicator

    place = transport.place
    armed = {"on": False}

    def failing_place(buffer, devices):
      if armed["on"]:
        raise RuntimeError("RESOURCE_EXHAUSTED: no device memory for a chunk (injected)")
      return place(buffer, devices)

    def arming(method):
      def moving(replicator, *a, **k):
        armed["on"] = replicator.pending_step == at
        try:
          return method(replicator, *a, **k)
        finally:
          armed["on"] = False
      return moving
    transport.place = failing_place
    # The fault step's chunks go out in the calls after its save, or, where a node still
    # wrote it at those calls (a busy host), all at the next save (`issue`).
    Replicator.progress = arming(Replicator.progress)
    Replicator.issue = arming(Replicator.issue)
  elif phase == "receive":
    from orbax_mtc.peers import copy_store as peer_store

    write_chunk = peer_store.IncomingCopy.write

    def failing_chunk(copy, offset, data):
      if copy.step == at:
        raise OSError(errno.ENOSPC, "No space left on device writing a copy (injected)")
      return write_chunk(copy, offset, data)
    peer_store.IncomingCopy.write = failing_chunk
  elif phase == "restore-plan":
    from orbax_mtc.restore import tiles

    def failing_routes(*a, **k):
      raise ValueError("planning the tiles this process sends failed (injected)")
    tiles.routes = failing_routes
  elif phase == "persistent-read":
    from orbax_mtc.restore import persistent as persistent_restore

    def failing_metadata(*a, **k):
      raise OSError(errno.EIO, "reading the persistent step's metadata failed (injected)")
    persistent_restore.check_item = failing_metadata
  elif phase == "restore-read":
    def failing_read_data(*a, **k):
      raise RuntimeError("restore read failed (injected)")
    return _replace_read_data(lambda read_data: failing_read_data)
  return nothing


def _replace_read_data(make: Callable[[Callable], Callable]) -> Callable[[], None]:
  """Sets `read_data = make(read_data)` in every module the library calls it through;
  returns what puts the originals back."""
  import importlib

  originals = []
  for name in ("orbax_mtc.local.read",):
    try:
      module = importlib.import_module(name)
    except ImportError:
      continue
    if hasattr(module, "read_data"):
      originals.append((module, module.read_data))
  for module, read_data in originals:
    module.read_data = make(read_data)

  def undo() -> None:
    for module, read_data in originals:
      module.read_data = read_data
  return undo


# ----------------------------------------------------------------------------- transient errors


TRANSIENT_MESSAGE = "RESOURCE_EXHAUSTED: out of device memory (injected, transient)"


def transient_device_put() -> Callable[[], int]:
  """Until the returned undo is called, `jax.device_put` called from the library (a module
  orbax_mtc.*, but not a stream transport or a collective, which move bytes between
  processes: the agreements' all-reduce places its few bytes with `jax.device_put` too, in
  node_mesh)
  raises RuntimeError(TRANSIENT_MESSAGE): a transient device error while building the
  restored arrays, not damage (the bytes on disk are fine). The undo returns how many calls
  raised."""
  import sys

  import jax

  real = jax.device_put
  fired = [0]

  def device_put(*a, **k):
    caller = sys._getframe(1).f_globals.get("__name__", "")
    if (caller.startswith("orbax_mtc.") and "transport" not in caller
        and caller not in ("orbax_mtc.testing", "orbax_mtc.collectives",
                           "orbax_mtc.node_mesh")):
      fired[0] += 1
      raise RuntimeError(TRANSIENT_MESSAGE)
    return real(*a, **k)

  jax.device_put = device_put

  def undo() -> int:
    jax.device_put = real
    return fired[0]
  return undo


def exit_at_first_write(me: int) -> None:
  """The first RAM write of this process (LocalTier.write, on whatever thread issues it)
  prints WRITE-EXIT and ends the process at once (`os._exit(0)`), before it writes a byte:
  a process killed as its write-back starts. Nothing is installed where LocalTier has no
  `write`."""
  if not hasattr(LocalTier, "write"):
    return

  def write(tier, staged, *rest, **kwargs):
    emit(f"WRITE-EXIT process={me} step={getattr(staged, 'step', None)}")
    os._exit(0)

  LocalTier.write = write


def die_at_first_read(me: int, signum: int) -> None:
  """The first read of a RAM step's data (own folder, twin or copy being served) prints
  DYING and kills this process with `signum`."""
  def dying(read_data):
    def read(*a, **k):
      emit(f"DYING process={me} at=restore-read")
      os.kill(os.getpid(), signum)
      return read_data(*a, **k)
    return read
  _replace_read_data(dying)


def faster_gcsfs_retries(scale: float) -> None:
  """Scales gcsfs's backoff between retries of a failed request (1 s, 2 s, ... 16 s: about
  31 s for a server that is gone): what the outage test waits for is our handling of the
  failure it ends in, not gcsfs's patience."""
  import asyncio
  import types

  from gcsfs import retry

  retry.asyncio = types.SimpleNamespace(
      sleep=lambda seconds, *a, **k: asyncio.sleep(seconds * scale, *a, **k))


def die_once_committed(ram_step: pathlib.Path, persistent_step: pathlib.Path,
                       timeout_s: float = 60.0) -> None:
  """SIGKILLs this process once `ram_step` holds its manifest and Orbax has committed
  `persistent_step` (its final name exists); raises TimeoutError after `timeout_s`."""
  deadline = time.monotonic() + timeout_s
  while not ((ram_step / "manifest.json").is_file() and persistent_step.is_dir()):
    if time.monotonic() > deadline:
      raise TimeoutError(f"{ram_step} or {persistent_step} not committed in {timeout_s} s")
    time.sleep(0.01)  # polls the files the background threads commit: they signal nothing
  emit(f"DYING process=self after={ram_step.name}")
  os.kill(os.getpid(), signal.SIGKILL)
