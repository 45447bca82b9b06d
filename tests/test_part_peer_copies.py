"""`peers/copies.PeerCopies` on its own: its decisions, with fakes for the writer, the
all-gather and (for more than one process) the mesh.

One process cannot run a real multi-process job, but `PeerCopies` takes the process index and
count as arguments and reads only `axis_names`, `shape` and each device's `process_index` of
the mesh: a fake mesh whose devices name processes 0..3 reaches the topology and the
`Replicator`. The all-gather is a fake that stacks one row per process (every process says
what this one says, or rows the test chose); the writer is a fake that records its calls.
"""

from __future__ import annotations

import concurrent.futures
import pathlib
import types

import jax
import numpy as np
import pytest

import orbax_mtc as mtc
from orbax_mtc import reduction, topology
from orbax_mtc.agreement import Status
from orbax_mtc.local import store as local_store
from orbax_mtc.peers import copy_store as peer_store
from orbax_mtc.peers import send_census
from orbax_mtc.peers.copies import PeerCopies

pytestmark = pytest.mark.timeout(60)


def apply_retention() -> list[int]:
  """The local tier's retention, as the fakes below hand it to the writer."""
  return []


class FakeWriter:
  """The RAM writer as PeerCopies and Replicator use it; records every call."""

  def __init__(self, status: Status = Status.WRITING):
    self.status = status
    self.calls: list[tuple] = []
    self.prepared: list[int] = []  # steps whose streams were queued for reading ahead
    self.executor = types.SimpleNamespace(submit=self._submit)
    self.reader = self.executor  # the read-ahead of chunks: never queued in these tests

  def _submit(self, fn, *args, **kwargs):
    if fn is apply_retention:  # after a step's copies landed
      self.calls.append(("retention",))
      return concurrent.futures.Future()
    if getattr(fn, "__name__", "") == "_outgoing":
      # The read-ahead of a scheduled step's streams: left pending (never run), so the
      # sender reads them itself when the copies start.
      self.prepared.append(args[0].step)
      return concurrent.futures.Future()
    self.calls.append(("submit", fn))
    raise AssertionError("nothing else is handed to the writer thread in these tests")

  busy = False  # nothing it is handed runs
  writing = False  # no local write runs (the step's status says where it is)

  def wait(self, timeout_s=None) -> bool:
    self.calls.append(("wait",) if timeout_s is None else ("wait", timeout_s))
    return True

  def drain(self) -> None:
    self.calls.append(("drain",))

  def status_of(self, step: int) -> Status:
    self.calls.append(("status_of", step))
    return self.status


class FakeAllreduce:
  """The reduction of `count` processes: each says what this one says, except in the status
  round, where process p's state is `states[p]` when given (its sizes all 0)."""

  def __init__(self, count: int, states=None):
    self.count, self.states = count, states
    self.seen: list[reduction.Parts] = []

  def __call__(self, parts: reduction.Parts) -> reduction.Parts:
    self.seen.append(parts)
    add, top, flags = parts.shape
    if (top, flags) == (1, 0) and add >= 2 and add % 2 == 0:  # the status round, with sizes
      if self.states is None:
        return reduction.combine([parts] * self.count)
      edges = [(-1, -1)] * ((add - 2) // 2)
      return reduction.combine(send_census.status_with_sizes(s, p, edges, np.zeros(len(edges)))
                               for p, s in enumerate(self.states))
    return parts


class FakeStore:
  """The peer store's calls PeerCopies makes once a step's copies are out."""

  def __init__(self):
    self.calls: list[tuple] = []

  def drop_sources(self, keep):
    self.calls.append(("drop_sources", tuple(keep)))

  def drop_other_counts(self, count):
    self.calls.append(("drop_other_counts", count))


class FakeDevice:
  """A device of process `process_index` (hashable, as sharding maps need)."""

  def __init__(self, process_index: int):
    self.process_index = process_index


def fake_mesh(grid, axis_names=("data", "model")):
  """A mesh whose device at `grid[idx]` belongs to process `grid[idx]`."""
  grid = np.asarray(grid)
  devices = np.empty(grid.shape, dtype=object)
  for idx, rank in np.ndenumerate(grid):
    devices[idx] = FakeDevice(int(rank))
  return types.SimpleNamespace(devices=devices, axis_names=tuple(axis_names),
                               shape=dict(zip(axis_names, grid.shape, strict=True)))


GRID_2X2 = [[0, 1], [2, 3]]  # replicas (0, 1) and (2, 3) along "data"


def make(options=None, *, index=0, count=1, local=None, store=None, writer=None,
         send=True, optional=False, allreduce=None):
  writer = writer or FakeWriter()
  allreduce = allreduce or FakeAllreduce(count)
  if local is None:  # the tests that leave it out never read a step: retention's marks only
    local = types.SimpleNamespace(keep_sending=None, keep_replicated=None)
  peers = PeerCopies(options or mtc.CheckpointManagerOptions(), index, count,
                     local=local, store=store, writer=writer, send=send, optional=optional,
                     allreduce=allreduce)
  return peers, writer, allreduce


@pytest.fixture
def tiers(tmp_path):
  local = local_store.LocalTier(tmp_path / "local", max_to_keep=1)
  local.prepare()
  yield local, peer_store.PeerStore(tmp_path / "local", max_to_keep=1)
  local.close()


# ------------------------------------------------------------------ one process, real mesh


def test_before_set_mesh_nothing_is_known(tiers):
  peers, writer, allreduce = make(local=tiers[0], store=tiers[1])
  assert (peers.mesh, peers.replica_axis, peers.topology, peers.replicator) == (None,) * 4
  assert not peers.enabled and peers.in_primary_slice
  assert peers.pending_step is None and peers.last_bytes_sent == 0
  assert writer.calls == [] and allreduce.seen == []


def test_single_process_names_the_axis_but_sends_nothing(mesh, tiers):
  peers, writer, allreduce = make(local=tiers[0], store=tiers[1])
  peers.set_mesh(mesh)
  assert peers.mesh is mesh
  assert peers.replica_axis == "data"  # replica_axis_index 0: the first axis
  assert peers.topology is None and peers.replicator is None
  assert not peers.enabled and peers.in_primary_slice
  state = {"w": jax.device_put(np.arange(8.0), jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec("data")))}
  peers.schedule(3, {"state": state})
  peers.progress(block=False)
  peers.progress(block=True)
  peers.schedule_recovery(3, [frozenset()], [0])
  peers.finish()
  assert peers.pending_step is None and peers.last_bytes_sent == 0
  assert peers.listing_groups({"w": state["w"]}, lambda leaf: True) is None
  # With no peers, nothing waits for, drains or asks the writer; nothing is gathered.
  assert writer.calls == [] and allreduce.seen == []


@pytest.mark.parametrize("replication, index, want", [
    (mtc.ReplicationOptions(replica_axis="model"), 0, "model"),
    (mtc.ReplicationOptions(), 1, "model"),
    (mtc.ReplicationOptions(), None, "data"),
])
def test_single_process_replica_axis_choice(mesh, replication, index, want):
  options = mtc.CheckpointManagerOptions(replication=replication, replica_axis_index=index)
  peers, _, _ = make(options)
  peers.set_mesh(mesh)
  assert peers.replica_axis == want and not peers.enabled


def test_single_process_accepts_a_mesh_without_data_axis(mesh):
  other = jax.make_mesh((2, 2), ("fsdp", "model"), devices=jax.devices()[:4])
  peers, _, _ = make(mtc.CheckpointManagerOptions(replica_axis_index=None))
  peers.set_mesh(other)
  assert peers.replica_axis == "fsdp" and peers.topology is None


def test_unknown_replica_axis_raises_unless_optional(mesh):
  options = mtc.CheckpointManagerOptions(
      replication=mtc.ReplicationOptions(replica_axis="nope"))
  peers, _, _ = make(options)
  with pytest.raises(ValueError, match="'nope' is not an axis"):
    peers.set_mesh(mesh)
  optional, _, _ = make(options, optional=True)
  optional.set_mesh(mesh)  # a warning, no copies
  assert optional.mesh is mesh and optional.replica_axis is None
  assert optional.topology is None and not optional.enabled and optional.in_primary_slice


def test_a_topology_that_does_not_fit_raises_even_when_optional(mesh):
  # Every device of the real mesh is process 0's, in both replicas, and process 1 of 2 owns
  # none. `optional` only forgives a mesh that names no replicas, not one that cannot fit.
  peers, _, _ = make(index=0, count=2, optional=True)
  with pytest.raises(topology.TopologyError, match="splits process 0's devices"):
    peers.set_mesh(mesh)
  assert peers.topology is None and not peers.enabled


def test_shard_sets_are_cached_per_sharding(mesh):
  peers, _, _ = make()
  spec = jax.sharding.PartitionSpec
  by_data = {"w": jax.device_put(np.arange(8.0), jax.sharding.NamedSharding(mesh, spec("data")))}
  sets = peers.shard_sets({"state": by_data})
  assert len(sets) == 1 and len(sets[0]) == 2  # one process holds both halves
  same = {"w": jax.device_put(np.ones(8), jax.sharding.NamedSharding(mesh, spec("data")))}
  assert peers.shard_sets({"state": same}) is sets  # other values, same shardings
  by_model = {"w": jax.device_put(np.arange(8.0),
                                  jax.sharding.NamedSharding(mesh, spec("model")))}
  assert peers.shard_sets({"state": by_model}) is not sets


# ------------------------------------------------------------------ four processes, fake mesh


@pytest.mark.parametrize("index, primary", [(0, True), (1, True), (2, False), (3, False)])
def test_two_replicas_topology_and_replicator(index, primary):
  options = mtc.CheckpointManagerOptions(
      replication=mtc.ReplicationOptions(chunk_mib=2, chunks_in_flight=3))
  peers, writer, allreduce = make(options, index=index, count=4)
  peers.set_mesh(fake_mesh(GRID_2X2))
  topo = peers.topology
  assert peers.replica_axis == "data"
  assert topo.replicas == ((0, 1), (2, 3)) and topo.twins[index] == ((index + 2) % 4,)
  assert topo.peers == ((2,), (3,), (0,), (1,))  # the twin in the next replica
  assert peers.in_primary_slice is primary and peers.enabled
  replicator = peers.replicator
  assert replicator.topology is topo and replicator.me == index
  assert replicator._allreduce is allreduce and replicator._writer is writer.executor
  assert (replicator._chunk_bytes, replicator._window) == (2 << 20, 3)
  assert peers.pending_step is None and peers.last_bytes_sent == 0
  assert writer.calls == [] and allreduce.seen == []  # set_mesh moves nothing


def test_one_replica_is_the_primary_slice_everywhere():
  peers, _, _ = make(index=3, count=4)
  peers.set_mesh(fake_mesh([[0, 1, 2, 3]]))
  assert peers.topology.replicas == ((0, 1, 2, 3),) and peers.in_primary_slice
  assert peers.topology.peers[3] == (0,)  # a ring


def test_managed_mode_builds_the_topology_but_sends_nothing():
  peers, writer, allreduce = make(index=2, count=4, send=False)
  peers.set_mesh(fake_mesh(GRID_2X2))
  assert peers.topology.replicas == ((0, 1), (2, 3)) and not peers.in_primary_slice
  assert peers.replicator is None and not peers.enabled
  peers.schedule(5, {})
  peers.finish()
  assert peers.pending_step is None and peers.last_bytes_sent == 0
  assert writer.calls == [] and allreduce.seen == []


def test_no_peers_per_node_means_no_replicator():
  options = mtc.CheckpointManagerOptions(replication=mtc.ReplicationOptions(peers_per_node=0))
  peers, _, _ = make(options, index=0, count=4)
  peers.set_mesh(fake_mesh(GRID_2X2))
  assert peers.topology.edges == () and not peers.enabled


def test_multi_process_mesh_without_data_axis():
  options = mtc.CheckpointManagerOptions(replica_axis_index=None)
  mesh = fake_mesh(GRID_2X2, ("fsdp", "model"))
  strict, _, _ = make(options, index=0, count=4)
  with pytest.raises(ValueError, match="no axis named 'data'"):
    strict.set_mesh(mesh)
  optional, _, _ = make(options, index=0, count=4, optional=True)
  optional.set_mesh(mesh)
  assert optional.replica_axis is None and optional.topology is None
  assert not optional.enabled and optional.in_primary_slice


class FakeLeaf:
  """An abstract leaf whose shards sit on processes: `where[p]` is process p's index."""

  def __init__(self, shape, where):
    self.shape, self.dtype = shape, np.float32
    devices = {FakeDevice(p): index for p, index in enumerate(where)}
    self.sharding = types.SimpleNamespace(devices_indices_map=lambda shape: devices)


def test_listing_groups_are_twin_groups_cached_per_state():
  peers, _, _ = make(index=0, count=4)
  assert peers.listing_groups({"w": 1}, lambda leaf: True) is None  # no topology yet
  peers.set_mesh(fake_mesh(GRID_2X2))
  assert peers.listing_groups(None, lambda leaf: True) is None
  low, high = (slice(0, 2),), (slice(2, 4),)
  state = {"w": FakeLeaf((4,), [low, high, low, high])}  # sharded over "model" only
  asked = []

  def is_array(leaf):
    asked.append(leaf)
    return isinstance(leaf, FakeLeaf)

  groups = peers.listing_groups(state, is_array)
  assert groups == [0, 1, 0, 1]  # 0 and 2 are twins, 1 and 3
  assert peers.listing_groups(state, is_array) is groups and len(asked) == 1  # cached
  other = {"w": FakeLeaf((4,), [low, high, high, low])}
  assert peers.listing_groups(other, is_array) == [0, 1, 1, 0]
  assert peers.listing_groups({"w": 1, "v": state["w"]}, is_array) is None  # not all arrays
  assert peers.listing_groups({}, is_array) is None  # no leaves


def scheduled(statuses):
  """Process 0 of 4, step 7 scheduled; the other processes' states are `statuses[1:]`."""
  writer, allreduce, store = FakeWriter(), FakeAllreduce(4, statuses), FakeStore()
  peers, _, _ = make(index=0, count=4, writer=writer, allreduce=allreduce, store=store)
  peers.set_mesh(fake_mesh(GRID_2X2))
  peers.schedule(7, {})
  assert peers.pending_step == 7 and writer.calls == [] and allreduce.seen == []
  return peers, writer, allreduce, store


def test_progress_waits_while_a_process_still_writes():
  peers, writer, allreduce, store = scheduled([Status.WRITING, Status.COMMITTED,
                                               Status.COMMITTED, Status.COMMITTED])
  peers.progress(block=False)
  assert writer.calls == [("status_of", 7)]  # no wait for the local write
  # Only the status round while a process writes: failed 0, writing 1; no size sent.
  assert len(allreduce.seen) == 1
  assert allreduce.seen[0].add[:2].tolist() == [0, 1] and not allreduce.seen[0].add[2:].any()
  assert peers.pending_step == 7 and peers.last_bytes_sent == 0
  with pytest.raises(RuntimeError, match="still pending"):
    peers.schedule(8, {})
  peers.progress(block=True)
  assert writer.calls[1:] == [("wait",), ("status_of", 7)]  # the local write first
  assert peers.pending_step == 7 and store.calls == []


def test_progress_drops_the_step_when_a_process_failed():
  peers, writer, _, store = scheduled([Status.WRITING, Status.FAILED,
                                       Status.COMMITTED, Status.COMMITTED])
  peers.progress(block=False)
  assert peers.pending_step is None and peers.replicator.finished_steps == 0
  assert store.calls == []  # stale copies stay until a step's copies are out (rule 10)
  peers.finish()  # nothing pending: the received copies are only drained
  assert writer.calls[-1] == ("drain",) and ("wait",) not in writer.calls


def test_stale_sources_dropped_once_after_the_first_copies_are_out():
  # Explicit peers where process 0 sends nothing and process 1 sends it 0 bytes: every
  # stream is empty, so the exchange finishes without moving a chunk.
  options = mtc.CheckpointManagerOptions(
      replication=mtc.ReplicationOptions(peer_ranks=((), (0,), (3,), (2,))))
  writer, store = FakeWriter(Status.COMMITTED), FakeStore()
  # The local tier as the sender reads it: never read here, as process 0 sends nothing.
  local = types.SimpleNamespace(directory=pathlib.Path("unused"), manifest=lambda step: None,
                                keep_floor=None, apply_retention=apply_retention)
  peers, _, _ = make(options, index=0, count=4, local=local, store=store,
                             writer=writer)
  peers.set_mesh(fake_mesh(GRID_2X2))
  assert peers.topology.held_by(0) == (1,)
  for step in (4, 6):
    peers.schedule(step, {})
    peers.finish()
    assert peers.pending_step is None and peers.last_bytes_sent == 0
  assert peers.replicator.finished_steps == 2
  assert store.calls == [("drop_sources", (1,)), ("drop_other_counts", 4)]
  first_drop = writer.calls.index(("drain",))
  # The copies committed first, then the RAM step they spared may go.
  assert writer.calls[:first_drop] == [("wait",), ("status_of", 4), ("retention",)]
  assert not any(call[0] == "submit" for call in writer.calls)


def test_recovery_copies_only_the_edges_of_recovered_nodes():
  for recovered, edges in (([1], 2), ([0, 1], 4), ([], None)):
    allreduce = FakeAllreduce(4, [Status.WRITING] * 4)
    peers, _, _ = make(index=0, count=4, allreduce=allreduce, store=FakeStore())
    peers.set_mesh(fake_mesh(GRID_2X2))
    peers.schedule_recovery(9, [frozenset()] * 4, recovered)
    peers.progress(block=False)
    if edges is None:  # no edge touches a recovered node: nothing is scheduled
      assert peers.pending_step is None and allreduce.seen == []
    else:  # [1]: edges (1, 3) and (3, 1) only; [0, 1]: all four
      assert peers.pending_step == 9 and len(peers.replicator._job.edges) == edges


def committed_ring():
  """Process 0 of 4 whose copies' streams are empty (a twin holds them: nothing to send),
  every process committed: (peers, writer, store, allreduce)."""
  options = mtc.CheckpointManagerOptions(
      replication=mtc.ReplicationOptions(peer_ranks=((), (0,), (3,), (2,))))
  writer, store = FakeWriter(Status.COMMITTED), FakeStore()
  local = types.SimpleNamespace(directory=pathlib.Path("unused"), manifest=lambda step: None,
                                keep_floor=None, steps=lambda: [4],
                                apply_retention=apply_retention)
  allreduce = FakeAllreduce(4, [Status.COMMITTED] * 4)
  peers, _, _ = make(options, index=0, count=4, local=local, store=store, writer=writer,
                     allreduce=allreduce)
  peers.set_mesh(fake_mesh(GRID_2X2))
  return peers, writer, store, allreduce


def test_a_local_save_leaves_the_previous_copies_moving_and_agrees_them_at_the_next():
  """`issue` (at the end of a local save) sends every chunk and returns: the step is still
  pending, nothing is agreed about its outcome yet; `settle` (at the next save) agrees it."""
  peers, writer, store, allreduce = committed_ring()
  assert not peers.busy
  peers.schedule(4, {})
  assert writer.prepared == [4]  # its streams are read ahead behind its write
  assert peers.busy  # a continuous policy waits: the step's copies are not out
  peers.issue()
  replicator = peers.replicator
  assert replicator.pending_step == 4 and replicator.unissued_step is None
  rounds = len(allreduce.seen)  # the status round, sizes in it: no outcome agreed yet
  assert rounds == 1
  assert replicator.finished_steps == 0 and store.calls == []
  assert ("wait",) not in writer.calls  # the new step's write goes on meanwhile
  assert not peers.moving and not peers.busy  # empty streams: nothing is on its way
  peers.schedule(6, {})  # the next step may be scheduled while 4 lands
  peers.settle()
  assert len(allreduce.seen) == rounds + 1 and replicator.finished_steps == 1
  assert replicator.pending_step == 6 and replicator.unissued_step == 6
  assert store.calls == [("drop_sources", (1,)), ("drop_other_counts", 4)]


@pytest.mark.parametrize("failed", [reduction.Who(), reduction.Who(1, 2)])
def test_an_outcome_the_save_census_agreed_takes_no_round_of_its_own(failed):
  """At a local save the landed step's chunks are retired before the census, which carries
  whether they failed here (`retire_landing`); `settle` then applies the census's answer:
  committed everywhere, or dropped everywhere when any process failed."""
  peers, _, _, allreduce = committed_ring()
  assert peers.retire_landing() is None  # nothing landing: nothing for the census to carry
  peers.schedule(4, {})
  peers.issue()
  rounds = len(allreduce.seen)
  assert peers.retire_landing() is False  # nothing failed here
  peers.settle(failed)
  replicator = peers.replicator
  # The census said it: no outcome round (on a failure, the failed process's words only).
  assert len(allreduce.seen) == rounds + (1 if failed else 0)
  assert replicator.pending_step is None and peers.retire_landing() is None
  assert (replicator.finished_steps, replicator.failed_steps) == \
      ((1, 0) if not failed else (0, 1))
  assert replicator.landed_step == (4 if not failed else None)


def test_stale_copies_wait_for_an_idle_writer_instead_of_draining_it():
  """The copies an earlier layout left go once the first step's copies are out, after the
  received copies committed: not by waiting for the writer thread inside a `save()` (it may
  be writing a whole new step), but at the first call that finds it idle."""
  peers, writer, store, _ = committed_ring()
  peers.schedule(4, {})
  peers.issue()
  writer.busy = True  # the next step's write runs
  peers.settle()
  assert peers.replicator.finished_steps == 1
  assert store.calls == [] and ("drain",) not in writer.calls
  peers.progress(block=False)  # still busy: later
  assert store.calls == []
  writer.busy = False
  peers.progress(block=False)
  assert store.calls == [("drop_sources", (1,)), ("drop_other_counts", 4)]
  peers.progress(block=False)  # once
  assert len(store.calls) == 2 and ("drain",) not in writer.calls


def test_the_calls_between_local_saves_size_the_next_copies():
  peers, _, _, _ = scheduled([Status.WRITING] * 4)  # step 7: no call seen before it
  assert peers.replicator._job.calls_between_saves is None
  peers.replicator._job = None  # as if its copies were out
  for _ in range(5):
    peers.progress(block=False)  # one per save() call; nothing pending: no collective
  peers.progress(block=True)  # the local save's own flush is not a call of the loop
  peers.schedule(8, {})
  assert peers.replicator._job.calls_between_saves == 5
  peers.replicator._job = None
  peers.schedule(9, {})  # no call in between: the floor again
  assert peers.replicator._job.calls_between_saves is None

