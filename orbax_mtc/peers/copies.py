"""Peer copies driven from the manager's collective points (save, restore, waits).

`PeerCopies` is what the manager holds of replication. From the global mesh it names the
replica axis and builds the topology (replicas, twins, which peers hold whose copies; pure,
in topology.py), then the `Replicator` that moves the copies (None in a single process, in
managed mode where GKE's replicator copies, or on a mesh that names no replicas). It also
keeps the shard sets of the job's shardings, which say which processes are twins.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from absl import logging

from orbax_mtc import reduction, topology
from orbax_mtc.agreement import Status
from orbax_mtc.local import store as local_store
from orbax_mtc.local.writer import RamWriter
from orbax_mtc.options import CheckpointManagerOptions
from orbax_mtc.peers import copy_store as peer_store
from orbax_mtc.peers import replication, shards, spread


class PeerCopies:
  """The save side of replication, and the twin groups restore plans with.

  Args:
    options: the manager's options (replica axis, peers, chunking).
    process_index: this process.
    process_count: processes in the job.
    local: this node's RAM tier (the steps sent).
    store: the copies this node holds for others.
    writer: the RAM tier's writer (copies are committed on its thread).
    send: this manager sends copies itself (False in managed mode).
    optional: a mesh that names no replicas means no copies, with a warning, instead of an
      error (the parent-style form when nobody asked for peers).
    allreduce: the collective all-reduce of replication's agreements (`send_census`).
  """

  def __init__(self, options: CheckpointManagerOptions, process_index: int, process_count: int,
               *, local: local_store.LocalTier, store: peer_store.PeerStore, writer: RamWriter,
               send: bool, optional: bool,
               allreduce: Callable[[reduction.Parts], reduction.Parts] | None = None):
    self._options = options
    self._process_index = process_index
    self._process_count = process_count
    self._local = local
    self._store = store
    self._writer = writer
    self._allreduce = allreduce
    self._send = send
    self._optional = optional
    self.mesh: jax.sharding.Mesh | None = None
    self.replica_axis: str | None = None
    self.topology: topology.Topology | None = None
    self.replicator: replication.Replicator | None = None
    self._sets_cache: tuple[Any, list] | None = None
    self._listing_cache: dict[int, list[int] | None] = {}
    self._stale_sources = False  # copies of nodes no longer held: dropped after the first copy
    self._calls_since_schedule = 0  # non-blocking progress calls since the last local save
    self._ready_call: int | None = None  # the first of them that found its write done
    # Over how many local intervals a step's copies are spread (agreed: peers/spread.py).
    self.stretch = spread.Stretch()
    self._clock_ms: int | None = None  # process 0's clock at the last local save's census
    self._waited_seconds = 0.0  # the replicator's waits up to the last census
    # The newest step saved without copies of its own (its save carried an older step's) and
    # its shard sets: `finish` sends them, unless a later save's copies replaced them.
    self._unsent: tuple[int, list] | None = None


  @property
  def in_primary_slice(self) -> bool:
    """Orbax's emergency-manager `in_primary_slice`: this process is in the first replica
    along the replica axis (always, with one replica or one process)."""
    topo = self.topology
    return topo is None or len(topo.replicas) == 1 or topo.replica_of[self._process_index] == 0

  def set_mesh(self, mesh: jax.sharding.Mesh) -> None:
    """Replica axis, topology and replicator from the job's global mesh.

    Raises:
      ValueError: the mesh names no replica axis the options accept (unless optional), or
        the topology does not fit it.
    """
    options = self._options
    try:
      replica_axis = topology.replica_axis_name(options, mesh.axis_names,
                                                multi_process=self._process_count > 1,
                                                axis_sizes=dict(mesh.shape))
    except ValueError as e:
      if not self._optional:
        raise
      logging.warning("orbax-mtc: RAM tier without peer copies: %s", e)
      self.mesh = mesh
      return
    topo = None
    if self._process_count > 1:
      topo = topology.build_topology(
          topology.process_grid(mesh), mesh.axis_names, replica_axis,
          num_processes=self._process_count,
          peers_per_node=options.replication.peers_per_node,
          peer_ranks=options.replication.peer_ranks)
    # Only a mesh that fits is kept: after a refused one, the next call checks again.
    self.mesh, self.replica_axis, self.topology = mesh, replica_axis, topo
    if topo is None or not self._send or not topo.edges:
      return
    if options.replication.max_spread_intervals > 1:
      # A step whose copies span intervals retires a save after the others, and the one
      # landed before it goes when they land: two at once. Both files are kept for the next
      # writes (fresh pages cost several times a reused file's: docs/benchmarks.md).
      self._local.spares = 2
    self.replicator = replication.Replicator(
        self.topology, self._process_index, self._local, self._store, self._writer.executor,
        chunk_bytes=options.replication.chunk_bytes,
        window=options.replication.chunks_in_flight,
        in_flight_bytes=options.replication.in_flight_mib << 20, allreduce=self._allreduce,
        reader=self._writer.reader)
    # Copies of nodes this node no longer holds copies for are dropped at the first copy
    # sent, not now: after a change of mesh or process count, an elastic restore reads them.
    self._stale_sources = True

  @property
  def enabled(self) -> bool:
    """This manager sends copies of its steps to peers."""
    return self.replicator is not None

  @property
  def last_bytes_sent(self) -> int:
    """Bytes this process sent for the newest replicated step."""
    return 0 if self.replicator is None else self.replicator.last_bytes_sent

  @property
  def pending_step(self) -> int | None:
    """The step whose copies are still going out."""
    return self.replicator.pending_step if self.replicator is not None else None

  @property
  def busy(self) -> bool:
    """The newest step's copies are not all out yet: chunks still to issue, or issued and
    still moving (this process's view)."""
    replicator = self.replicator
    return replicator is not None and (replicator.unissued_step is not None or
                                       replicator.moving)

  @property
  def moving(self) -> bool:
    """The previous step's copies are still on their way (this process's view)."""
    return self.replicator is not None and self.replicator.moving

  def shard_sets(self, trees: dict[str, Any]) -> list:
    """Which shards every process holds under the shardings of `trees` (cached)."""
    key = tuple((name, tuple((leaf.sharding, tuple(leaf.shape))
                             for leaf in jax.tree_util.tree_leaves(tree)
                             if getattr(leaf, "sharding", None) is not None),
                 jax.tree_util.tree_structure(tree))
                for name, tree in trees.items())
    if self._sets_cache is None or self._sets_cache[0] != key:
      self._sets_cache = (key, shards.shard_sets(trees, self._process_count))
    return self._sets_cache[1]

  def listing_groups(self, abstract_state: Any, is_array_target: Any) -> list[int] | None:
    """Twin groups for listing steps before any restore target is known: from
    `abstract_state` when it has shardings; else None (own folders and peer copies only,
    which never lists a step the cluster cannot assemble)."""
    if self.topology is None or abstract_state is None:
      return None
    key = id(abstract_state)
    if key not in self._listing_cache:
      leaves = jax.tree_util.tree_leaves(abstract_state)
      if not leaves or not all(is_array_target(leaf) for leaf in leaves):
        groups = None
      else:
        # Not through shard_sets, whose one-entry cache serves the saves.
        groups = shards.shard_groups(
            shards.shard_sets({"state": abstract_state}, self._process_count))
      self._listing_cache = {key: groups}
    return self._listing_cache[key]

  def _drop_stale_sources(self, *, wait: bool = False) -> None:
    """Once the first step's copies of this layout are out (rule 10: never before), the
    copies an earlier layout left here (nodes no longer held, another process count) go,
    after the copies just received are committed: at once when the writer thread has
    nothing left to run (or with `wait`, once it has), else at a later call (a `save()`
    must not wait for a step's write just to tidy up)."""
    if not self._stale_sources or self.topology is None:
      return
    if wait:
      self._writer.drain()
    elif self._writer.busy:
      return
    self._stale_sources = False
    self._store.drop_sources(self.topology.held_by(self._process_index))
    self._store.drop_other_counts(self._process_count)

  @property
  def ready_call(self) -> int:
    """The first non-blocking call since the last local save that found its write done here
    (the calls since plus one while none has). The save's census carries the most any
    process took; the step it saves starts its copies at that call (`schedule`), where each
    process then waits for its own write, briefly, instead of a round."""
    if self._ready_call is not None:
      return self._ready_call
    return self._calls_since_schedule + 1

  @property
  def calls_since_schedule(self) -> int:
    """Non-blocking calls since the last local save (the same on every process)."""
    return self._calls_since_schedule

  def take_wait_ms(self) -> int:
    """Milliseconds this process's calls waited for the copies' chunks since the last call
    of this (for the save's census: `SaveRecord.copies_wait_ms`)."""
    if self.replicator is None:
      return 0
    total = self.replicator.waited_seconds
    waited, self._waited_seconds = total - self._waited_seconds, total
    return max(0, round(waited * 1000))

  def adapt(self, waited_ms: int, clock_ms: int) -> None:
    """After a local save's census: the spread of the next step's copies, from the most any
    process waited for them since the previous local save and the agreed clock (rule 8)."""
    if self._clock_ms is not None:
      self.stretch = spread.next_stretch(self.stretch, waited_ms, clock_ms - self._clock_ms,
                                         self._options.replication.max_spread_intervals)
    self._clock_ms = clock_ms

  @property
  def carries_on(self) -> bool:
    """At a local save: the previous step's copies still have chunks to issue while their
    link is known to lag (spread over several intervals), so they go on over the next
    interval instead of this step's (the same answer on every process)."""
    return self.replicator is not None and self.replicator.unissued_step is not None and \
        self.stretch.intervals > 1

  def carry(self, step: int, trees: dict[str, Any]) -> None:
    """At a local save whose step sends no copies (`carries_on`): the previous step's go on
    over the calls before the next local save. `step` (its arrays `trees`) is the save's
    own, left without copies unless `finish` comes before the next step's are scheduled."""
    self._unsent = (step, self.shard_sets(trees))
    calls = self._new_interval()
    carried = None if self.replicator is None else self.replicator.unissued_step
    if carried is not None:  # its write was waited for at the start of the save
      self.replicator.carry(calls or None, Status.COMMITTED if carried in self._local.steps()
                            else Status.FAILED)

  def _new_interval(self) -> int:
    """Starts counting the calls of a new local interval; returns the last one's."""
    calls, self._calls_since_schedule = self._calls_since_schedule, 0
    self._ready_call = None
    return calls

  def schedule(self, step: int, trees: dict[str, Any], start_call: int = 1) -> None:
    """Queues the copies of a step just saved (sent by the next `progress` calls, from
    `start_call` on when no round sizes them, and spread so that they are out before the
    next local save, or over `stretch` intervals: peers/spread.py)."""
    calls = self._new_interval()
    self._unsent = None
    if self.replicator is not None:
      self.replicator.schedule(step, self.shard_sets(trees),
                               calls_between_saves=spread.budget(calls or None, self.stretch),
                               start_call=start_call)

  def schedule_recovery(self, step: int, sets: list, recovered: Sequence[int]) -> None:
    """Queues the copies that involve nodes which got `step` back from elsewhere."""
    if self.replicator is None or self.topology is None:
      return
    recovered = set(recovered)
    edges = [e for e in self.topology.edges if e[0] in recovered or e[1] in recovered]
    self.replicator.schedule(step, sets, edges)

  def progress(self, *, block: bool) -> None:
    """Moves pending copies forward (collectives: every process calls this in step)."""
    if not block:
      self._calls_since_schedule += 1  # one per save() call: the local interval, in calls
    replicator = self.replicator
    if replicator is None:
      return
    if not block and self._ready_call is None and not self._writer.writing:
      self._ready_call = self._calls_since_schedule
    if replicator.pending_step is not None:
      if block:
        self._writer.wait()
      elif replicator.starts_without_round:
        # No round asks whether every node has committed the step: each waits for its own
        # write, at most the agreement timeout (one still running is sent as failed).
        self._writer.wait(self._options.agreement_timeout_seconds)
      replicator.progress(self._status(replicator), block=block)
    if replicator.finished_steps:
      self._drop_stale_sources(wait=block)

  def drop_step(self, step: int) -> None:
    """At a local save of `step`, before its write: removes the copies of it held here,
    which are of a timeline the job left (a leftover the save replaces)."""
    try:
      self._store.delete_step(step)
    except OSError as e:  # this process's alone: a restore still verifies what it reads
      logging.warning("orbax-mtc: removing the old copies of step %d: %s", step, e)

  def retire_landing(self) -> bool | None:
    """At a local save, before its agreement: hands the last chunks of the copies issued
    earlier to the writer; whether they failed here (None: none landing), for the census."""
    return None if self.replicator is None else self.replicator.retire_landing()

  def settle(self, failed: reduction.Who | None = None) -> None:
    """At a local save, after its agreement: the outcome of the copies issued earlier
    (collective unless `failed`, the census's answer, is given; their chunks have had a
    training step to arrive)."""
    replicator = self.replicator
    if replicator is not None:
      replicator.settle(failed)
      if replicator.finished_steps:
        self._drop_stale_sources()

  def apply_retention(self) -> None:
    """At a local save, once its census agreed the floor (`LocalTier.keep_floor`): the copies
    kept only as the previous floor go now, as the RAM tier's own steps do there, so that the
    next copy received takes a retired one's file. (Left to the next copy's commit, the third
    copy of a run found the first two both kept and was written into never-touched pages,
    several times slower here: docs/benchmarks.md.)"""
    if self.replicator is None:
      return
    try:
      for source in sorted({source for source, _ in self._store.copies()}):
        self._store.apply_retention(source, self._local.keep_floor)
    except OSError as e:  # this process's alone, between collectives: the next commit retries
      logging.warning("orbax-mtc: retiring peer copies kept for the previous floor: %s", e)

  def issue(self) -> None:
    """At a local save, after its collectives and the new step's write was issued: every
    chunk of the previous step's copies, left moving (their outcome: at the next call).

    The previous step's write was waited for at the start of the save; its folder outlives
    the reads, as the newest step every node holds (`LocalTier.keep_floor`)."""
    replicator = self.replicator
    step = None if replicator is None else replicator.unissued_step
    if step is None:
      return
    replicator.issue(Status.COMMITTED if step in self._local.steps() else Status.FAILED)

  def _status(self, replicator: replication.Replicator) -> int:
    """Where this node is with the step whose chunks are still to issue (any, if none)."""
    step = replicator.unissued_step
    return self._writer.status_of(step) if step is not None else Status.COMMITTED

  def finish(self) -> None:
    """Sends the pending copies now, then the newest step's when its save carried an older
    step's instead (a wait leaves the newest saved step on its peers too), and returns once
    received copies are committed."""
    self.progress(block=True)
    unsent, self._unsent = self._unsent, None
    replicator = self.replicator
    if replicator is None:
      return
    if unsent is not None and replicator.pending_step is None:  # the same on every process
      replicator.schedule(*unsent)
      self.progress(block=True)  # a node without the step says so: dropped everywhere
    self._writer.drain()
