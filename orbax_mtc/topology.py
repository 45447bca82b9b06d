"""Replicas, twins and peers of a multi-process JAX job, derived from the mesh (pure functions).

A node is one JAX process. A replica is the slice of the global device mesh at one index of the
named replica axis; it must consist of whole processes, and every replica must hold the same
number of them. A node's position is its index inside its replica (ranks ordered by their first
device in the replica's sub-grid, C order); its twins are the nodes at the same position in the
other replicas; its peers are the nodes that hold copies of its RAM checkpoint.

Only `process_grid` touches a JAX object (it reads `.process_index` of each device), so
everything else can be tested exhaustively without JAX or I/O.
"""

from __future__ import annotations

import dataclasses
import difflib
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from orbax_mtc.option_checks import warn_once
from orbax_mtc.options import CheckpointManagerOptions


class TopologyError(ValueError):
  """A mesh, replica axis or peer choice that cannot give a valid topology."""


@dataclasses.dataclass(frozen=True)
class Topology:
  """Who is in which replica, and who holds copies of whose checkpoint.

  Built by `build_topology`; every per-rank tuple is indexed by process rank.

  Attributes:
    num_processes: Number of JAX processes (nodes) in the job.
    replica_axis: Name of the mesh axis whose indices are the replicas.
    replicas: `replicas[r]` is the ranks of replica r, ordered by position.
    replica_of: Per rank, the index of its replica.
    position_of: Per rank, its index inside its replica.
    twins: Per rank, the ranks at the same position in every other replica.
    peers: Per rank, the ranks that hold copies of its checkpoint, in preference order.
  """

  num_processes: int
  replica_axis: str
  replicas: tuple[tuple[int, ...], ...]  # replicas[r] = ranks of replica r, ordered by position
  replica_of: tuple[int, ...]  # per rank
  position_of: tuple[int, ...]  # per rank: its index inside its replica
  twins: tuple[tuple[int, ...], ...]  # per rank: same position in every other replica
  peers: tuple[tuple[int, ...], ...]  # per rank: holders of its checkpoint, in preference order

  def held_by(self, rank: int) -> tuple[int, ...]:
    """Ranks whose copies `rank` holds.

    Args:
      rank: A process rank in `0..num_processes - 1`.

    Returns:
      The sorted ranks that list `rank` among their peers.

    Raises:
      TopologyError: If `rank` is not a valid process rank.
    """
    _check_rank(rank, self.num_processes, "held_by")
    return tuple(src for src, holders in enumerate(self.peers) if rank in holders)

  @property
  def edges(self) -> tuple[tuple[int, int], ...]:
    """Every (source, holder) copy edge, sorted."""
    return tuple(sorted((src, dst) for src, holders in enumerate(self.peers) for dst in holders))


def process_grid(mesh: Any) -> np.ndarray:
  """Maps each device of a mesh to the process that owns it.

  Args:
    mesh: A `jax.sharding.Mesh` (anything with a `.devices` array of objects that have a
      `.process_index`).

  Returns:
    An int64 array shaped like `mesh.devices`: the `process_index` of each device.
  """
  devices = np.asarray(mesh.devices, dtype=object)
  grid = np.empty(devices.shape, dtype=np.int64)
  for idx, device in np.ndenumerate(devices):
    grid[idx] = int(device.process_index)
  return grid


def build_topology(grid: np.ndarray, axis_names: Sequence[str], replica_axis: str, *,
                   num_processes: int, peers_per_node: int | None = None,
                   peer_ranks: Sequence[Sequence[int]] | None = None) -> Topology:
  """Derives replicas, positions, twins and peers from a process grid and the replica axis.

  `grid[idx]` is the rank of the process that owns the mesh device at `idx`. Peers are either
  `peers_per_node` (default 1; 0 for a single process) chosen by `default_peers`, or explicit
  `peer_ranks` (one list per rank, used as given); never both.

  Args:
    grid: Integer array of process ranks, one per mesh device (see `process_grid`).
    axis_names: The mesh's axis names, one per axis of `grid` (`mesh.axis_names`).
    replica_axis: Name of the axis whose indices are the replicas.
    num_processes: Number of processes in the job (`jax.process_count()`).
    peers_per_node: How many peers hold a copy of each node's checkpoint; None for the
      default (1, or 0 for a single process).
    peer_ranks: Explicit peers, one sequence of ranks per rank.

  Returns:
    The `Topology` of the job.

  Raises:
    TopologyError: If `num_processes`, `grid` or `axis_names` are invalid; `replica_axis` is
      not a mesh axis; a replica would split a process's devices; a process owns no device;
      replicas hold different numbers of processes; both or invalid peer arguments are given.
  """
  if not _is_int(num_processes) or num_processes < 1:
    raise TopologyError(
        f"num_processes must be a positive int, got {num_processes!r}; pass "
        "jax.process_count().")
  num_processes = int(num_processes)
  grid = _check_grid(grid, axis_names, num_processes)
  names = tuple(axis_names)
  if replica_axis not in names:
    raise TopologyError(
        f"replica axis {replica_axis!r} is not an axis of the mesh; mesh axes are "
        f"{list(names)}. Name the data-parallel axis, e.g. replica_axis="
        f"{_suggest_axis(replica_axis, names, grid.shape)!r}.")
  axis = names.index(replica_axis)

  replicas: list[tuple[int, ...]] = []
  replicas_of_rank: dict[int, list[int]] = {}
  for r in range(grid.shape[axis]):
    # dict keeps first-appearance order: a rank's position is where its first device sits.
    ranks = tuple(dict.fromkeys(int(x) for x in np.take(grid, r, axis=axis).ravel()))
    replicas.append(ranks)
    for rank in ranks:
      replicas_of_rank.setdefault(rank, []).append(r)

  split = {rank: rs for rank, rs in sorted(replicas_of_rank.items()) if len(rs) > 1}
  if split:
    rank, rs = next(iter(split.items()))
    others = f" (and {len(split) - 1} more processes)" if len(split) > 1 else ""
    raise TopologyError(
        f"the replica axis {replica_axis!r} splits process {rank}'s devices across replicas "
        f"{rs}{others}; a replica must consist of whole processes. Put each process's devices on "
        f"a non-replica axis (e.g. mesh (data=num_hosts, fsdp=devices_per_host) with "
        f"replica_axis='data') or name another replica_axis (mesh axes: {list(names)}).")

  missing = sorted(set(range(num_processes)) - set(replicas_of_rank))
  if missing:
    raise TopologyError(
        f"processes {_short(missing)} own no device of the mesh (num_processes="
        f"{num_processes}); the mesh must cover every process: build it from jax.devices() and "
        "pass num_processes=jax.process_count().")

  sizes = [len(ranks) for ranks in replicas]
  if len(set(sizes)) > 1:
    raise TopologyError(
        f"topology does not divide: replica axis {replica_axis!r} gives replicas with "
        f"{_short(sizes)} processes; every replica must hold the same number of processes. "
        f"Make the size of axis {replica_axis!r} divide the {num_processes} processes evenly "
        "(each replica the same whole hosts) or name another replica_axis.")

  if peers_per_node is not None and peer_ranks is not None:
    raise TopologyError(
        "peers_per_node and peer_ranks are mutually exclusive (as in replicator.yaml); "
        "pass one of them.")
  if peer_ranks is not None:
    peers = _check_peer_ranks(peer_ranks, num_processes)
  else:
    if peers_per_node is None:
      peers_per_node = 1 if num_processes > 1 else 0
    peers = default_peers(replicas, peers_per_node)

  replica_of = [0] * num_processes
  position_of = [0] * num_processes
  for r, ranks in enumerate(replicas):
    for i, rank in enumerate(ranks):
      replica_of[rank] = r
      position_of[rank] = i
  twins = tuple(
      tuple(replicas[other][position_of[rank]]
            for other in range(len(replicas)) if other != replica_of[rank])
      for rank in range(num_processes))
  return Topology(
      num_processes=num_processes,
      replica_axis=replica_axis,
      replicas=tuple(replicas),
      replica_of=tuple(replica_of),
      position_of=tuple(position_of),
      twins=twins,
      peers=peers)


def default_peers(replicas: Sequence[Sequence[int]],
                  peers_per_node: int) -> tuple[tuple[int, ...], ...]:
  """Chooses the peers of every rank by fixed offsets in (replica, position).

  With R replicas of n nodes, peer j of the node at (replica r, position i) is the node at
  ((r + dr) % R, (i + di) % n) for the j-th offset (dr, di): first other replicas, twin first
  (di = 0: for replicated arrays the twin already holds the same shards, and the copy survives
  the loss of a whole replica), then the same replica. Every offset is a bijection on nodes, so
  each node holds exactly as many copies as it gives.

  Args:
    replicas: Ranks of each replica, ordered by position; together every rank exactly once.
    peers_per_node: How many peers hold a copy of each node's checkpoint.

  Returns:
    Peers per rank (index = rank), in preference order.

  Raises:
    TopologyError: If the replicas are empty, of unequal size or do not hold every rank
      exactly once, or `peers_per_node` is negative, not an int, or more than the number of
      other nodes.
  """
  reps = [tuple(int(x) for x in ranks) for ranks in replicas]
  if not reps or any(len(ranks) != len(reps[0]) for ranks in reps) or not reps[0]:
    raise TopologyError(
        f"topology does not divide: replicas have {[len(ranks) for ranks in reps]} processes; "
        "every replica must hold the same (non-zero) number of processes.")
  num_replicas, n = len(reps), len(reps[0])
  num_nodes = num_replicas * n
  if sorted(rank for ranks in reps for rank in ranks) != list(range(num_nodes)):
    raise TopologyError(
        f"replicas {reps} must hold every rank 0..{num_nodes - 1} exactly once; derive them "
        "with build_topology.")
  if not _is_int(peers_per_node) or peers_per_node < 0:
    raise TopologyError(
        f"peers_per_node must be an int >= 0, got {peers_per_node!r}.")
  if peers_per_node > num_nodes - 1:
    raise TopologyError(
        f"more peers than nodes: peers_per_node={peers_per_node} but there are only "
        f"{num_nodes} nodes, so at most {num_nodes - 1} other nodes can hold a copy; lower "
        "peers_per_node.")
  offsets = [(dr, di) for di in range(n) for dr in range(1, num_replicas)]
  offsets += [(0, di) for di in range(1, n)]
  peers: list[tuple[int, ...]] = [()] * num_nodes
  for r, ranks in enumerate(reps):
    for i, rank in enumerate(ranks):
      peers[rank] = tuple(reps[(r + dr) % num_replicas][(i + di) % n]
                          for dr, di in offsets[:int(peers_per_node)])
  return tuple(peers)


def transfer_rounds(edges: Sequence[tuple[int, int]]) -> list[tuple[tuple[int, int], ...]]:
  """Splits (src, dst) edges into rounds in which every rank sends and receives at most once.

  Deterministic (edges are sorted first), every edge exactly once, each round sorted. Uses the
  fewest rounds possible: the largest number of edges any rank sends or receives (Konig's
  theorem; colours are fixed by swapping alternating paths, as in greedy bipartite edge
  colouring). Self-edges and duplicates raise.

  Args:
    edges: (source rank, destination rank) pairs, e.g. `Topology.edges`.

  Returns:
    The rounds, each a sorted tuple of edges.

  Raises:
    TopologyError: If an edge is not a pair of ints >= 0, is a self-edge, or appears more
      than once.
  """
  clean: list[tuple[int, int]] = []
  for edge in edges:
    try:
      src, dst = edge
    except (TypeError, ValueError):
      raise TopologyError(f"edge {edge!r} is not a (source, destination) pair.") from None
    if not (_is_int(src) and _is_int(dst)) or src < 0 or dst < 0:
      raise TopologyError(f"edge {edge!r}: ranks must be ints >= 0.")
    if src == dst:
      raise TopologyError(f"edge {edge!r} sends rank {src} to itself; drop self-edges.")
    clean.append((int(src), int(dst)))
  clean.sort()
  for a, b in zip(clean, clean[1:], strict=False):
    if a == b:
      raise TopologyError(f"edge {a} appears more than once; pass each edge once.")

  # Bipartite multigraph: ("s", rank) sends, ("r", rank) receives. colour_at[v][c] = the other
  # end of v's edge of colour c. Both ends of every edge are recorded.
  colour_at: dict[tuple[str, int], dict[int, tuple[str, int]]] = {}

  def free(v: tuple[str, int]) -> int:
    used = colour_at.get(v, {})
    c = 0
    while c in used:
      c += 1
    return c

  for src, dst in clean:
    u, v = ("s", src), ("r", dst)
    a, b = free(u), free(v)
    if a not in colour_at.get(v, {}):
      b = a
    elif b not in colour_at.get(u, {}):
      a = b
    else:
      # Flip the a/b alternating path from v; it cannot reach u (bipartite), so afterwards a is
      # free at both ends.
      path = [v]
      c, x = a, v
      while c in colour_at.get(x, {}):
        x = colour_at[x][c]
        path.append(x)
        c = b if c == a else a
      hops = [(path[k], path[k + 1], a if k % 2 == 0 else b) for k in range(len(path) - 1)]
      for p, q, old in hops:
        del colour_at[p][old], colour_at[q][old]
      for p, q, old in hops:
        new = b if old == a else a
        colour_at[p][new] = q
        colour_at[q][new] = p
      b = a
    colour_at.setdefault(u, {})[a] = v
    colour_at.setdefault(v, {})[a] = u

  rounds: dict[int, list[tuple[int, int]]] = {}
  for (side, rank), by_colour in colour_at.items():
    if side == "s":
      for c, (_, dst) in by_colour.items():
        rounds.setdefault(c, []).append((rank, dst))
  return [tuple(sorted(rounds[c])) for c in sorted(rounds)]


def _is_int(x: object) -> bool:
  return isinstance(x, numbers.Integral) and not isinstance(x, bool | np.bool_)


def _check_rank(rank: object, num_processes: int, what: str) -> None:
  if not _is_int(rank) or not 0 <= rank < num_processes:
    raise TopologyError(
        f"{what}: rank {rank!r} is not a process rank; ranks are 0..{num_processes - 1}.")


def _short(values: Sequence[Any], limit: int = 16) -> str:
  """Lists values, cut after `limit` so a 4,096-host error stays readable."""
  values = list(values)
  if len(values) <= limit:
    return str(values)
  return f"[{', '.join(map(str, values[:limit]))}, ... ({len(values)} in all)]"


def _suggest_axis(wrong: str, names: Sequence[str], shape: Sequence[int]) -> str:
  close = difflib.get_close_matches(wrong, names, n=1)
  if close:
    return close[0]
  for name in ("data", "replica", "dcn_data", "diloco"):
    if name in names:
      return name
  # Otherwise the first axis with more than one index (a size-1 axis gives a single replica).
  return next((n for n, s in zip(names, shape, strict=True) if s > 1), names[0])


def _check_grid(grid: Any, axis_names: Sequence[str], num_processes: int) -> np.ndarray:
  if isinstance(axis_names, str):
    raise TopologyError(
        f"axis_names must be a sequence of axis names, got the string {axis_names!r}; pass "
        "mesh.axis_names.")
  names = tuple(axis_names)
  arr = np.asarray(grid)
  if arr.dtype.kind not in "iu":
    raise TopologyError(
        f"grid must be an integer array of process ranks, got dtype {arr.dtype}; build it with "
        "process_grid(mesh).")
  if arr.ndim != len(names):
    raise TopologyError(
        f"grid has {arr.ndim} axes {arr.shape} but axis_names names {len(names)}: {list(names)}; "
        "pass mesh.axis_names for the same mesh.")
  if len(set(names)) != len(names):
    raise TopologyError(f"axis_names {list(names)} repeat a name; mesh axis names are unique.")
  if arr.size == 0:
    raise TopologyError(f"grid {arr.shape} has no devices; build it from a non-empty mesh.")
  bad = sorted({int(x) for x in arr.ravel() if not 0 <= x < num_processes})
  if bad:
    raise TopologyError(
        f"grid holds ranks {_short(bad)} outside range(num_processes={num_processes}); pass "
        "num_processes=jax.process_count() and the process_grid of the same mesh.")
  return arr.astype(np.int64, copy=False)


def _check_peer_ranks(peer_ranks: Sequence[Sequence[int]],
                      num_processes: int) -> tuple[tuple[int, ...], ...]:
  lists = list(peer_ranks)
  if len(lists) != num_processes:
    raise TopologyError(
        f"peer_ranks has {len(lists)} lists but there are {num_processes} nodes; give one list "
        "of peer ranks per node (index = node rank).")
  out = []
  for node, ranks in enumerate(lists):
    if isinstance(ranks, str) or not isinstance(ranks, Sequence | np.ndarray):
      raise TopologyError(
          f"peer_ranks[{node}] = {ranks!r} is not a list of ranks; give node {node} a list.")
    seen: list[int] = []
    for peer in ranks:
      if not _is_int(peer) or not 0 <= peer < num_processes:
        raise TopologyError(
            f"peer_ranks[{node}]: node {node} has peer {peer!r}, which is not a rank in "
            f"0..{num_processes - 1}; fix or drop it.")
      if peer == node:
        raise TopologyError(
            f"peer_ranks[{node}]: node {node} lists itself as a peer; a copy must live on "
            "another node, drop it.")
      if peer in seen:
        raise TopologyError(
            f"peer_ranks[{node}]: node {node} lists peer {peer} more than once; list each peer "
            "once.")
      seen.append(int(peer))
    out.append(tuple(seen))
  return tuple(out)


def replica_axis_name(options: CheckpointManagerOptions, mesh_axis_names: Sequence[str], *,
                      multi_process: bool = True,
                      axis_sizes: Mapping[str, int] | None = None) -> str:
  """The mesh axis that indexes data-parallel replicas, with a clear error when unknown.

  Order: `replication.replica_axis`, then `replica_axis_index` (Orbax's default 0), then (index
  None) an axis named "data". In a single process replicas do not matter, so the first axis
  is accepted there. `axis_sizes` (the mesh's shape) lets an index that picks a size-1 axis
  beside a larger "data" axis warn (MaxText puts a "diloco" axis first).

  Args:
    options: The manager's options.
    mesh_axis_names: The global mesh's axis names.
    multi_process: Whether the job has more than one process.
    axis_sizes: Axis name -> size of the mesh, for the warning above; None skips it.

  Returns:
    The name of the replica axis.

  Raises:
    ValueError: If `replication.replica_axis` is not a mesh axis, `replica_axis_index` is out
      of range, or (index None, multi-process) the mesh has no axis named "data".
  """
  names = tuple(mesh_axis_names)
  axis = options.replication.replica_axis
  if axis is not None:
    if axis not in names:
      raise ValueError(
          f"ReplicationOptions.replica_axis={axis!r} is not an axis of the global mesh "
          f"(axes: {names}). Name the data-parallel axis of your mesh, e.g. "
          f"ReplicationOptions(replica_axis={names[0]!r}).")
    return axis
  if options.replica_axis_index is not None:
    index = options.replica_axis_index
    if index >= len(names):
      raise ValueError(
          f"CheckpointManagerOptions.replica_axis_index={index} is out of range for a mesh "
          f"with axes {names}. Prefer naming the axis: ReplicationOptions(replica_axis=...).")
    sizes = dict(axis_sizes or {})
    if multi_process and names[index] != "data" and sizes.get(names[index]) == 1 and \
        sizes.get("data", 1) > 1:
      warn_once("replica_axis_index",
                "orbax-mtc: replica_axis_index=%d picks mesh axis %r of size 1 (one replica), "
                "while axis 'data' has %d: data-parallel twins are not used. Name the axis: "
                "CheckpointManagerOptions(replication=ReplicationOptions(replica_axis='data')).",
                index, names[index], sizes["data"])
    return names[index]
  if "data" in names or not multi_process:
    return "data" if "data" in names else names[0]
  raise ValueError(
      f"The global mesh has no axis named 'data' (axes: {names}) and no replica axis was "
      "given. Name the data-parallel axis: CheckpointManagerOptions(replication="
      f"ReplicationOptions(replica_axis={names[0]!r})); with no data parallelism, name any "
      "axis of size 1 or the outermost axis.")
