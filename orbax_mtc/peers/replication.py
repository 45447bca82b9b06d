"""Copies of each node's committed RAM step on its peers, moved with JAX collectives.

`Replicator` is a small state machine driven from the main thread at points every process
reaches in the same order (`save()`, `replicate_pending()`, `wait_until_finished()`):

1. `schedule(step, edges)` after a local save (or a recovery) was issued;
2. `progress()`: the first step, one tiny all-reduce of "is the step committed here"
   (`send_census`; with few edges it carries their sizes too) until every node has, and
   the bytes each sends on each edge fix the streams; later steps take those sizes, padded,
   with no round: each process waits for its own write (size_plan.py);
3. then each `progress()` hands the chunks that have arrived to the writer and issues its
   share (spread.py: over the calls before the next local save, or over several intervals
   when the link lags, the saves between `carry` it then instead of sending their own), so
   no save waits for a step's copies; an on-demand save issues what is left (`issue`).
   Chunks are dispatched asynchronously, up to `in_flight_mib` of them left running when a
   call returns: they move while training goes on, and the step's outcome is agreed at the
   next call (`settle`). The reader thread reads the chunks ahead (`read_ahead`);
4. received chunks are written to `<local>/peers/<source>/.tmp-*` by the writer thread, which
   commits the copy by renaming it once the last chunk is in.

Which shards each process holds, and so which it need not be sent: peers/shards.py.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from absl import logging

from orbax_mtc import reduction, transport
from orbax_mtc.agreement import Status
from orbax_mtc.local import store as local_store
from orbax_mtc.peers import copy_store as peer_store
from orbax_mtc.peers import exchange, send_census, size_plan, spread
from orbax_mtc.peers import stream as peer_stream
from orbax_mtc.peers.shards import ShardKey, skip_ordinals
from orbax_mtc.topology import Topology


def _done(value: Any) -> concurrent.futures.Future:
  """A future that holds `value` already."""
  future: concurrent.futures.Future = concurrent.futures.Future()
  future.set_result(value)
  return future


@dataclasses.dataclass
class _StepCopies:
  """The copies of one step being sent and received."""

  step: int
  edges: tuple[tuple[int, int], ...]
  receivers: dict[int, frozenset[ShardKey]]
  calls_between_saves: int | None = None  # the calls it is spread over (chunks_per_call)
  calls_seen: int = 0  # non-blocking progress calls since the step was scheduled
  start_call: int = 1  # the call copies planned without a round start at (`schedule`)
  transfer: transport.Transfer | None = None
  incoming: dict[int, peer_store.IncomingCopy] = dataclasses.field(default_factory=dict)
  sent_bytes: int = 0
  # The outgoing streams, made (and their chunks read ahead) on the writer thread.
  prepared: concurrent.futures.Future | None = None
  outgoing: dict[int, peer_stream.OutgoingStream] = dataclasses.field(default_factory=dict)


class Replicator:
  """Sends this node's committed steps to its peers and receives theirs (see module doc)."""

  def __init__(self, topo: Topology, me: int, local: local_store.LocalTier,
               store: peer_store.PeerStore, writer: concurrent.futures.Executor,
               *, chunk_bytes: int, window: int = 2, in_flight_bytes: int = 0,
               allreduce: Callable[[reduction.Parts], reduction.Parts] | None = None,
               reader: concurrent.futures.Executor | None = None):
    self.topology = topo
    self.me = me
    self._local = local
    self._store = store
    self._writer = writer
    # Reads the chunks ahead (default: the writer thread, behind the writes queued there).
    self._reader = writer if reader is None else reader
    self._allreduce = allreduce  # replication's own agreements (send_census)
    self._chunk_bytes = chunk_bytes
    self._window = window
    # Chunks issued per non-blocking call at least (at most `window` in flight at once):
    # about BYTES_PER_CALL; more for a step too big to be out within the interval.
    self._chunks_per_call = max(window, spread.BYTES_PER_CALL // max(1, chunk_bytes))
    self._overlap_window = max(window, in_flight_bytes // max(1, chunk_bytes))  # left moving
    self._in_flight_bytes = in_flight_bytes
    self._job: _StepCopies | None = None
    self._sizes = size_plan.SizePlan()  # the last agreed sizes: later copies take no round
    # A step whose chunks are all issued, some maybe still moving: agreed by the next save.
    self._landing: _StepCopies | None = None
    self._commits: list[tuple[int, int, concurrent.futures.Future]] = []
    self.last_bytes_sent = 0
    self.finished_steps = 0  # steps whose copies all went out
    self.landed_step: int | None = None  # the newest of them (the same on every process)
    self.failed_steps = 0  # steps whose copies were dropped by every process together
    self.waited_seconds = 0.0  # the calls' and saves' waits for chunks (this process)

  @property
  def pending_step(self) -> int | None:
    """The step whose copies are not all out yet (issued or not)."""
    if self._job is not None:
      return self._job.step
    return self._landing.step if self._landing is not None else None

  @property
  def moving(self) -> bool:
    """Chunks issued at an earlier save are still moving here (this process's view)."""
    transfer = self._landing.transfer if self._landing is not None else None
    return transfer is not None and not transfer.arrived

  @property
  def chunks_moving(self) -> int:
    """Chunks issued here, not complete yet (local view; a CPU device's next run waits)."""
    return sum(j.transfer.moving_chunks for j in (self._job, self._landing) if j and j.transfer)

  @property
  def unissued_step(self) -> int | None:
    """The step whose copies still have chunks to issue (their source folder is read)."""
    return self._job.step if self._job is not None else None

  def schedule(self, step: int, shard_sets_by_process: Sequence[frozenset[ShardKey]],
               edges: Sequence[tuple[int, int]] | None = None, *,
               calls_between_saves: int | None = None, start_call: int = 1) -> None:
    """Queues `step` for replication on `edges` (default: every copy edge of the topology);
    `calls_between_saves` sizes the non-blocking calls' shares (peers/spread.py); copies planned
    without a round start at non-blocking call `start_call` (the same on every process),
    so that each process's wait for its own write there is short."""
    self.reap_commits()
    chosen = tuple(sorted(self.topology.edges if edges is None else edges))
    if not chosen:
      return
    if self._job is not None:
      raise RuntimeError("replication of the previous step is still pending; finish it first")
    receivers = {dst: shard_sets_by_process[dst] for src, dst in chosen if src == self.me}
    self._job = job = _StepCopies(step, chosen, receivers, calls_between_saves,
                                  start_call=max(1, start_call))
    # Read until its copies land or are dropped: retention spares it (rule 10).
    self._local.keep_sending = step
    # Queued behind the step's write on the writer thread (one thread: in order).
    job.prepared = self._writer.submit(self._outgoing, job, read_ahead=True)

  def _outgoing(self, job: _StepCopies, *, read_ahead: bool = False
                ) -> dict[int, peer_stream.OutgoingStream]:
    """This node's stream to each receiver of the committed step (file I/O only); with
    `read_ahead`, their chunks are read on the reader thread, `in_flight_mib` of them ahead
    of the sending, so that sending does not read the RAM disk on the main thread."""
    step_dir = self._local.directory / str(job.step)
    manifest = self._local.manifest(job.step)
    outgoing = {dst: peer_stream.copy_stream(step_dir, manifest, self.me,
                                             skip_ordinals(manifest, job.receivers[dst]))
                for src, dst in job.edges if src == self.me}
    if read_ahead:
      budget = max(self._chunk_bytes, self._in_flight_bytes // max(1, len(outgoing)))
      placer = transport.background_placer(self.me)
      for stream in outgoing.values():
        stream.read_ahead(self._chunk_bytes, budget, self._reader.submit, place=placer)
    return outgoing

  def progress(self, status: int, *, block: bool) -> None:
    """Moves the pending replication forward; every process calls it at the same point.

    `status`: this node's step is WRITING, COMMITTED or FAILED. With `block`, the caller has
    waited for its local write; this returns with the copies handed to the writer thread.
    Without, it issues this call's share, left moving (a call that moves nothing leaves a
    landed step's outcome to the next save's census: no round).
    """
    job = self._job
    if job is not None and not block:
      job.calls_seen += 1
    if job is None or not block and job.transfer is None and \
        job.calls_seen < job.start_call and self._sizes.covers(job.edges):
      if block:  # else nothing moves: a landed step waits for the next save's census
        self.settle()
      return
    self.settle()
    if job.transfer is None and not self._start(job, status):
      return
    self._move(job, block=block)
    if block and self._landing is job:
      self.settle()

  def _move(self, job: _StepCopies, *, block: bool, everything: bool = False) -> None:
    """Issues the started job's share of this call (`everything`: all that is left), left
    moving; with `block`, all of it, and waits for it."""
    assert job.transfer is not None
    transfer = job.transfer
    waited = transfer.waited_seconds
    try:
      if block:
        transfer.run()
      else:
        transfer.retire_ready()
        transfer.advance(None if everything else spread.chunks_per_call(
            transfer.remaining_chunks, job.calls_between_saves, job.calls_seen,
            self._chunks_per_call, self._window), window=self._overlap_window)
        transfer.retire_ready()
        self.waited_seconds += transfer.waited_seconds - waited
    except BaseException:
      # Not a failure the transfer records (those are agreed after it): a collective itself
      # failed, so no other process completes it either. Drop this step's copies.
      self._abort(job)
      raise
    if transfer.issued:  # the same call on every process
      self._job = None
      self._landing = job

  def issue(self, status: int) -> None:
    """Issues every chunk of the pending step's copies (its local write is over: `status`
    says how), leaving up to `in_flight_mib` of them moving; the outcome is agreed at the
    next call. Every process calls it at the same point."""
    job = self._job
    if job is None:
      return
    self.settle()  # one step landing at a time
    if job.transfer is None and not self._start(job, status):
      return
    self._move(job, block=False, everything=True)

  def carry(self, calls_between_saves: int | None, status: int) -> None:
    """At a local save that carries the pending step's chunks on instead of sending its own
    step's copies, after its collectives: a step past its spread is spread again over the
    coming interval (`calls_between_saves`, the last one's calls), and this call issues its
    share too (with no call between local saves only saves move them), starting them if
    need be (the step's write is over: `status` says how). The same on every process."""
    job = self._job
    if job is None:
      return
    if calls_between_saves and (job.calls_between_saves or 0) <= job.calls_seen:
      job.calls_between_saves = job.calls_seen + calls_between_saves
    job.calls_seen += 1
    self.settle()  # one step landing at a time
    if job.transfer is None and not self._start(job, status):
      return
    self._move(job, block=False)

  def retire_landing(self) -> bool | None:
    """Hands the landed step's last chunks to the writer (waiting for those still moving;
    no collective) and says whether anything failed here; None when no step is landing (the
    same on every process). Its outcome is then agreed by `settle`."""
    job = self._landing
    if job is None:
      return None
    assert job.transfer is not None
    waited = job.transfer.waited_seconds
    try:
      job.transfer.retire_finished()
    except BaseException:
      self._landing = None
      self._abort(job)
      raise
    finally:
      self.waited_seconds += job.transfer.waited_seconds - waited
    return bool(job.transfer.failures)

  def settle(self, failed: reduction.Who | None = None) -> None:
    """Agrees the landed step's outcome (its chunks retired first); every process calls it
    at the same point. `failed`: the processes where it failed, agreed already (the save's
    census carries it: `retire_landing`), else one round here."""
    if self.retire_landing() is None:
      return
    job, self._landing = self._landing, None
    self._finish(job, failed)

  @staticmethod
  def _drop_reads(job: _StepCopies) -> None:
    for stream in job.outgoing.values():
      stream.cancel_read_ahead()

  def _release(self, job: _StepCopies) -> None:
    """The step's copies landed or were dropped: its folder is no longer read for them."""
    if self._local.keep_sending == job.step:
      self._local.keep_sending = None

  def _abort(self, job: _StepCopies) -> None:
    self._sizes.forget()  # the next step's copies take the round again
    self._drop_reads(job)
    self._release(job)
    for incoming in job.incoming.values():
      self._writer.submit(incoming.abort)
    if self._job is job:
      self._job = None

  def _start(self, job: _StepCopies, status: int) -> bool:
    """Plans the step's transfer: with the last agreed sizes when they cover its edges (no
    round: `_start_planned`), else once every process has committed the step and its
    copies' sizes are agreed. Returns whether it was planned."""
    if self._sizes.covers(job.edges):
      return self._start_planned(job, status)
    outgoing: dict[int, peer_stream.OutgoingStream] = {}
    if status == Status.COMMITTED:
      try:
        outgoing = self._take_outgoing(job)
      except Exception as e:  # noqa: BLE001 - agreed below: every process drops the step
        logging.warning("orbax-mtc: cannot send step %d to peers: %s: %s", job.step,
                        type(e).__name__, e)
        status = Status.FAILED

    # While some node still writes the step, each call makes only the status round (a few
    # counts, whatever the process count); the sizes round follows once all have committed.
    # With few streams their sizes ride in the status round: one round less per step.
    sizes = exchange.outgoing_sizes(job.edges, self.me, outgoing)
    agreed = None
    if len(job.edges) <= send_census.MERGED_STREAMS:
      votes, agreed = send_census.read_status_with_sizes(self._reduce(
          send_census.status_with_sizes(Status(status), self.me, job.edges, sizes)))
    else:
      votes = send_census.read_status(self._reduce(
          send_census.status(Status(status), self.me, sizes)))
    if votes.failed:
      logging.warning("orbax-mtc: step %d is not replicated: process(es) %s did not commit "
                      "it", job.step, votes.failed)
      self._drop_reads(job)
      self._release(job)
      self._job = None
      return False
    if votes.writing:
      return False
    if agreed is None:
      agreed = send_census.read_sizes(self._reduce(
          send_census.sizes(job.edges, self.me, sizes, votes.bits)), job.edges, votes.bits)
    if not self._plan(job, [int(n) for n in agreed],
                      lambda s: outgoing[s.destination].read,
                      lambda s: outgoing[s.destination].view):
      return False
    self._sizes.learn(job.edges, agreed)
    job.sent_bytes = sum(s.nbytes for s in outgoing.values())
    return True

  def _start_planned(self, job: _StepCopies, status: int) -> bool:
    """Plans the step's transfer with the last agreed sizes, padded (size_plan.py): no
    round. Each process has waited for its own write (`PeerCopies.progress`); one whose
    step is not committed, or whose stream outgrew the plan, sends zeros on it and says so
    after the transfer, where the outcome is agreed (rule 9). Returns whether it was
    planned."""
    planned = self._sizes.planned(job.edges)
    mine = {dst: n for (src, dst), n in zip(job.edges, planned, strict=True) if src == self.me}
    failures: list[str] = []
    outgoing: dict[int, peer_stream.OutgoingStream] = {}
    if status == Status.COMMITTED:
      try:
        outgoing = self._take_outgoing(job)
      except Exception as e:  # noqa: BLE001 - agreed after the transfer
        failures.append(f"cannot read step {job.step} to send it: {type(e).__name__}: {e}")
    else:  # as the round would: no copies of a step some node lacks
      failures.append(f"step {job.step} is not committed here ({Status(status).name.lower()})")
    failures += size_plan.outgrown({dst: s.nbytes for dst, s in outgoing.items()}, mine)
    fitting = {dst: s for dst, s in outgoing.items() if s.nbytes <= mine[dst]}

    def reader_for(stream: transport.Stream) -> transport.Reader:
      sent = fitting.get(stream.destination)
      return size_plan.zeros if sent is None else size_plan.padded_reader(sent.read,
                                                                          sent.nbytes)

    def viewer_for(stream: transport.Stream) -> transport.Viewer | None:
      sent = fitting.get(stream.destination)
      return None if sent is None else sent.view

    if not self._plan(job, planned, reader_for, viewer_for):
      return False
    assert job.transfer is not None
    for failure in failures:
      logging.warning("orbax-mtc: step %d's copies: %s", job.step, failure)
    job.transfer.failures.extend(failures)
    job.sent_bytes = sum(s.nbytes for s in fitting.values())
    return True

  @property
  def starts_without_round(self) -> bool:
    """The next non-blocking call plans the pending step's transfer without a round
    (`_start_planned`): each process waits for its own write first (the same answer on
    every process)."""
    job = self._job
    return job is not None and job.transfer is None and \
        job.calls_seen + 1 >= job.start_call and self._sizes.covers(job.edges)

  def _take_outgoing(self, job: _StepCopies) -> dict[int, peer_stream.OutgoingStream]:
    """This node's streams of the committed step, made on the writer thread when they
    were (`schedule`), else here."""
    prepared = job.prepared
    if prepared is not None and not prepared.cancel() and prepared.exception() is None:
      outgoing = prepared.result()  # done, or running (it reads only the manifest)
    else:  # not run yet, or it failed: here
      outgoing = self._outgoing(job, read_ahead=prepared is not None)
    job.prepared = None if prepared is None else _done(outgoing)
    job.outgoing = outgoing
    return outgoing

  def _plan(self, job: _StepCopies, counts: Sequence[int],
            reader_for: Callable[[transport.Stream], transport.Reader],
            viewer_for: Callable[[transport.Stream], transport.Viewer | None]) -> bool:
    """The step's transfer, its streams `counts` bytes long (in the order of its edges);
    False when it cannot start (agreed: every process drops the step)."""

    def sink_for(stream: transport.Stream) -> transport.Sink:
      incoming = self._store.begin(stream.source, job.step, stream.nbytes)
      job.incoming[stream.source] = incoming

      def sink(offset: int, data: np.ndarray) -> None:
        self._writer.submit(incoming.write, offset, data)
      return sink

    streams = [transport.Stream(src, dst, int(n))
               for (src, dst), n in zip(job.edges, counts, strict=True)]
    try:
      job.transfer = transport.Transfer(
          streams, me=self.me, reader_for=reader_for, sink_for=sink_for,
          chunk_limit=self._chunk_bytes, window=self._window,
          reduce=lambda rnd: self._reduce(rnd.parts()), viewer_for=viewer_for)
    except transport.TransferError as e:  # agreed: the same on every process
      logging.warning("orbax-mtc: step %d is not replicated: %s", job.step, e)
      self._abort(job)
      return False
    return True

  def _reduce(self, parts: reduction.Parts) -> reduction.Parts:
    if self._allreduce is None:
      raise RuntimeError("replication between processes needs the all-reduce")
    return self._allreduce(parts)

  def _finish(self, job: _StepCopies, failed: reduction.Who | None = None) -> None:
    """After the last chunk (collective): every copy is committed, or, when a read,
    placement or receive failed on any process (`failed`, agreed here unless given), every
    copy of the step is dropped together (the next save's copies go out as usual)."""
    self._drop_reads(job)  # a chunk the transfer read itself leaves its read-ahead behind
    failures = job.transfer.failures if job.transfer is not None else []
    if failed is None:
      failed = send_census.read_outcome(self._reduce(send_census.outcome(bool(failures),
                                                                         self.me)))
    if failed:
      # Only then the lowest failed process's words (one more round, agreed to run).
      words = send_census.read_message(self._reduce(send_census.message(
          failures[0] if failures else "", self.me, failed.lowest)))
      logging.warning("orbax-mtc: the peer copies of step %d are dropped on every process: "
                      "process(es) %s failed (process %d: %s)", job.step, failed,
                      failed.lowest, words)
      self._abort(job)
      self.failed_steps += 1
      return
    self.reap_commits()
    for source, incoming in job.incoming.items():
      future = self._writer.submit(incoming.commit, self._local.keep_floor)
      self._commits.append((source, job.step, future))
    self.last_bytes_sent = job.sent_bytes
    self.finished_steps += 1
    self.landed_step = job.step
    # Kept in RAM until a newer step's copies land (a replaced node restores it with its
    # peers' copies); the step it spared before may go now.
    self._local.keep_replicated = job.step
    self._release(job)
    self._writer.submit(self._local.apply_retention)

  def reap_commits(self) -> None:
    """Logs received copies whose commit failed on the writer thread (the copy is then
    simply not held: restore plans only from copies listed in an agreed inventory)."""
    waiting = []
    for source, step, future in self._commits:
      if not future.done():
        waiting.append((source, step, future))
      elif future.exception() is not None:
        error = future.exception()
        logging.warning("orbax-mtc: the copy of step %d from process %d was not kept: %s: %s",
                        step, source, type(error).__name__, error)
    self._commits = waiting
