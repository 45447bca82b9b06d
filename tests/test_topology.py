"""Topology: replicas, positions, twins and peers from a process grid (pure, no JAX needed)."""

from __future__ import annotations

import types
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orbax_mtc import topology as tp
from orbax_mtc.topology import TopologyError

pytestmark = pytest.mark.timeout(60)


def build(grid, names, axis="data", num_processes=None, **kw):
  grid = np.asarray(grid)
  if num_processes is None:
    num_processes = int(grid.max()) + 1
  return tp.build_topology(grid, names, axis, num_processes=num_processes, **kw)


def check_invariants(topo: tp.Topology) -> None:
  """Properties every valid topology has, whatever the mesh."""
  n = topo.num_processes
  assert sorted(r for ranks in topo.replicas for r in ranks) == list(range(n))
  assert len({len(ranks) for ranks in topo.replicas}) == 1
  for rank in range(n):
    assert topo.replicas[topo.replica_of[rank]][topo.position_of[rank]] == rank
    assert len(topo.twins[rank]) == len(topo.replicas) - 1
    for twin in topo.twins[rank]:
      assert topo.position_of[twin] == topo.position_of[rank]
      assert topo.replica_of[twin] != topo.replica_of[rank]
    assert [topo.replica_of[t] for t in topo.twins[rank]] == sorted(
        topo.replica_of[t] for t in topo.twins[rank])
    assert rank not in topo.peers[rank]
    assert len(set(topo.peers[rank])) == len(topo.peers[rank])
  assert topo.edges == tuple(sorted(topo.edges))
  assert len(topo.edges) == sum(len(p) for p in topo.peers)
  for rank in range(n):
    assert topo.held_by(rank) == tuple(s for s, h in topo.edges if h == rank)


# --- concrete meshes ---------------------------------------------------------------------------


def test_data2_fsdp2_one_device_per_process():
  topo = build([[0, 1], [2, 3]], ("data", "fsdp"))
  check_invariants(topo)
  assert topo.num_processes == 4
  assert topo.replica_axis == "data"
  assert topo.replicas == ((0, 1), (2, 3))
  assert topo.replica_of == (0, 0, 1, 1)
  assert topo.position_of == (0, 1, 0, 1)
  assert topo.twins == ((2,), (3,), (0,), (1,))
  # Default: one peer, the twin in the next replica.
  assert topo.peers == ((2,), (3,), (0,), (1,))
  assert topo.held_by(0) == (2,)
  assert topo.held_by(3) == (1,)
  assert topo.edges == ((0, 2), (1, 3), (2, 0), (3, 1))


def test_data2_fsdp2_all_peers_in_preference_order():
  topo = build([[0, 1], [2, 3]], ("data", "fsdp"), peers_per_node=3)
  check_invariants(topo)
  # Twin first, then the other position of the other replica, then the same replica.
  assert topo.peers == ((2, 3, 1), (3, 2, 0), (0, 1, 3), (1, 0, 2))
  assert topo.held_by(0) == (1, 2, 3)


def test_data2_fsdp2_two_devices_per_process():
  grid = [[0, 0, 1, 1], [2, 2, 3, 3]]
  topo = build(grid, ("data", "fsdp"))
  check_invariants(topo)
  assert topo.replicas == ((0, 1), (2, 3))
  assert topo.position_of == (0, 1, 0, 1)
  assert topo.twins == ((2,), (3,), (0,), (1,))
  assert topo.peers == ((2,), (3,), (0,), (1,))


def test_interleaved_devices_inside_a_replica_are_fine():
  # A process may own non-adjacent cells as long as they are all in one replica.
  topo = build([[0, 1, 0, 1], [2, 3, 2, 3]], ("data", "fsdp"))
  assert topo.replicas == ((0, 1), (2, 3))


def test_ranks_laid_out_across_the_replica_axis():
  # Processes numbered along fsdp: replicas are columns of the rank numbering.
  topo = build([[0, 2], [1, 3]], ("data", "fsdp"))
  check_invariants(topo)
  assert topo.replicas == ((0, 2), (1, 3))
  assert topo.twins == ((1,), (0,), (3,), (2,))
  assert topo.peers == ((1,), (0,), (3,), (2,))


def test_replica_axis_second_axis():
  topo = build([[0, 1], [2, 3]], ("fsdp", "data"))
  check_invariants(topo)
  assert topo.replicas == ((0, 2), (1, 3))
  assert topo.replica_of == (0, 1, 0, 1)
  assert topo.twins == ((1,), (0,), (3,), (2,))


def test_diloco_first_data_second():
  # MaxText puts a diloco axis first; the replica axis is "data", not axis 0.
  topo = build([[0, 1, 2, 3]], ("diloco", "data"))
  check_invariants(topo)
  assert topo.replicas == ((0,), (1,), (2,), (3,))
  assert topo.replica_of == (0, 1, 2, 3)
  assert topo.position_of == (0, 0, 0, 0)
  assert topo.twins == ((1, 2, 3), (0, 2, 3), (0, 1, 3), (0, 1, 2))
  assert topo.peers == ((1,), (2,), (3,), (0,))
  two = build([[0, 1, 2, 3]], ("diloco", "data"), peers_per_node=2)
  assert two.peers == ((1, 2), (2, 3), (3, 0), (0, 1))
  assert two.held_by(0) == (2, 3)


def test_diloco_as_replica_axis_gives_one_replica():
  topo = build([[0, 1, 2, 3]], ("diloco", "data"), axis="diloco")
  assert topo.replicas == ((0, 1, 2, 3),)
  assert topo.twins == ((), (), (), ())
  assert topo.peers == ((1,), (2,), (3,), (0,))


def test_pure_fsdp_single_replica_ring():
  topo = build([[0, 1, 2, 3]], ("data", "fsdp"))
  check_invariants(topo)
  assert topo.replicas == ((0, 1, 2, 3),)
  assert topo.replica_of == (0, 0, 0, 0)
  assert topo.position_of == (0, 1, 2, 3)
  assert topo.twins == ((), (), (), ())
  assert topo.peers == ((1,), (2,), (3,), (0,))
  assert topo.held_by(0) == (3,)
  assert topo.edges == ((0, 1), (1, 2), (2, 3), (3, 0))
  two = build([[0, 1, 2, 3]], ("data", "fsdp"), peers_per_node=2)
  assert two.peers == ((1, 2), (2, 3), (3, 0), (0, 1))
  assert two.held_by(0) == (2, 3)


def test_two_slices_two_hosts_four_chips():
  # data = slice axis; each host owns 4 adjacent fsdp cells.
  grid = np.array([[s * 2 + f // 4 for f in range(8)] for s in range(2)])
  topo = build(grid, ("data", "fsdp"))
  check_invariants(topo)
  assert topo.replicas == ((0, 1), (2, 3))
  assert topo.twins == ((2,), (3,), (0,), (1,))
  assert topo.peers == ((2,), (3,), (0,), (1,))


def test_three_axes_replica_axis_in_the_middle():
  # (stage=2, data=2, fsdp=4); each process owns both stages of 2 fsdp cells. In replica 1 the
  # processes appear in the order 3, 2: positions follow first appearance, not rank order.
  grid = np.empty((2, 2, 4), dtype=int)
  for stage in range(2):
    grid[stage, 0] = [0, 0, 1, 1]
    grid[stage, 1] = [3, 3, 2, 2]
  topo = build(grid, ("stage", "data", "fsdp"))
  check_invariants(topo)
  assert topo.replicas == ((0, 1), (3, 2))
  assert topo.position_of == (0, 1, 1, 0)
  assert topo.twins == ((3,), (2,), (1,), (0,))
  assert topo.peers == ((3,), (2,), (1,), (0,))


def test_position_uses_first_appearance_in_c_order():
  # Sub-grid of replica 0 (stage x fsdp) in C order: 5, 4, 4, 5 -> positions 5:0, 4:1.
  grid = np.array([[[5, 4], [0, 1], [2, 3]], [[4, 5], [1, 0], [3, 2]]])  # (stage, data, fsdp)
  topo = build(grid, ("stage", "data", "fsdp"))
  assert topo.replicas == ((5, 4), (0, 1), (2, 3))
  assert topo.twins[5] == (0, 2)
  assert topo.twins[4] == (1, 3)


def test_maxtext_like_mesh():
  axes = ("diloco", "data", "stage", "fsdp", "tensor")
  grid = np.empty((1, 2, 1, 2, 4), dtype=int)
  for d in range(2):
    for f in range(2):
      grid[0, d, 0, f, :] = d * 2 + f
  topo = build(grid, axes)
  check_invariants(topo)
  assert topo.replicas == ((0, 1), (2, 3))
  assert topo.twins == ((2,), (3,), (0,), (1,))
  assert topo.peers == ((2,), (3,), (0,), (1,))
  # Hosts hold whole fsdp slices too, so fsdp is a valid (if odd) replica axis; tensor is not.
  assert build(grid, axes, axis="fsdp").replicas == ((0, 2), (1, 3))
  with pytest.raises(TopologyError, match="splits process 0's devices across replicas"):
    build(grid, axes, axis="tensor")


def test_three_replicas_prefer_twins_then_other_positions():
  topo = build([[0, 1], [2, 3], [4, 5]], ("data", "fsdp"), peers_per_node=5)
  check_invariants(topo)
  assert topo.twins[0] == (2, 4)
  assert topo.twins[2] == (0, 4)
  # (1,0) (2,0) (1,1) (2,1) (0,1)
  assert topo.peers[0] == (2, 4, 3, 5, 1)
  assert topo.peers[3] == (5, 1, 4, 0, 2)


def test_single_process():
  topo = build([[0, 0]], ("data", "fsdp"))
  assert topo.replicas == ((0,),)
  assert topo.twins == ((),)
  assert topo.peers == ((),)
  assert topo.edges == ()
  assert topo.held_by(0) == ()
  assert build([[0]], ("data", "fsdp"), peers_per_node=0).peers == ((),)


def test_peers_per_node_zero():
  topo = build([[0, 1], [2, 3]], ("data", "fsdp"), peers_per_node=0)
  assert topo.peers == ((), (), (), ())
  assert topo.edges == ()


def test_explicit_peer_ranks_used_as_given():
  peer_ranks = [[3, 1], [], [0], [2, 0, 1]]
  topo = build([[0, 1], [2, 3]], ("data", "fsdp"), peer_ranks=peer_ranks)
  assert topo.peers == ((3, 1), (), (0,), (2, 0, 1))
  assert topo.held_by(0) == (2, 3)
  assert topo.held_by(1) == (0, 3)
  assert topo.edges == ((0, 1), (0, 3), (2, 0), (3, 0), (3, 1), (3, 2))
  # Like Orbax's replicator handshake: the twins as peers.
  twins = build([[0, 1], [2, 3]], ("data", "fsdp"))
  assert build([[0, 1], [2, 3]], ("data", "fsdp"), peer_ranks=twins.twins).peers == twins.twins
  # numpy ints are ranks too.
  assert build([[0, 1]], ("data", "fsdp"), peer_ranks=np.array([[1], [0]])).peers == ((1,), (0,))


def test_topology_is_hashable_and_comparable():
  a = build([[0, 1], [2, 3]], ("data", "fsdp"))
  b = build(np.array([[0, 0, 1, 1], [2, 2, 3, 3]]), ["data", "fsdp"])
  assert a == b
  assert hash(a) == hash(b)


# --- process_grid ------------------------------------------------------------------------------


def test_process_grid_reads_process_index():
  dev = [types.SimpleNamespace(process_index=p) for p in (0, 0, 1, 1, 2, 2, 3, 3)]
  mesh = types.SimpleNamespace(devices=np.array(dev, dtype=object).reshape(2, 4))
  grid = tp.process_grid(mesh)
  assert grid.shape == (2, 4)
  assert grid.dtype.kind == "i"
  np.testing.assert_array_equal(grid, [[0, 0, 1, 1], [2, 2, 3, 3]])
  topo = tp.build_topology(grid, ("data", "fsdp"), "data", num_processes=4)
  assert topo.replicas == ((0, 1), (2, 3))


def test_process_grid_real_jax_mesh():
  import jax
  from jax.sharding import Mesh

  devices = np.array(jax.devices()).reshape(1, -1)
  mesh = Mesh(devices, ("data", "fsdp"))
  grid = tp.process_grid(mesh)
  assert grid.shape == devices.shape
  assert (grid == jax.process_index()).all()
  topo = tp.build_topology(grid, mesh.axis_names, "data", num_processes=jax.process_count())
  assert topo.replicas == ((0,),)
  assert topo.peers == ((),)


# --- errors ------------------------------------------------------------------------------------


def test_unknown_replica_axis_names_axis_and_suggests():
  with pytest.raises(TopologyError, match=r"'dat' is not an axis.*\['data', 'fsdp'\].*'data'"):
    build([[0, 1], [2, 3]], ("data", "fsdp"), axis="dat")
  with pytest.raises(TopologyError, match=r"'replica'.*replica_axis='data'"):
    build([[0, 1, 2, 3]], ("diloco", "data"), axis="replica")
  with pytest.raises(TopologyError, match=r"replica_axis='x'"):
    build([[0], [1]], ("x", "y"), axis="zzz")


def test_replica_axis_splits_a_process():
  with pytest.raises(TopologyError,
                     match=r"splits process 0's devices across replicas \[0, 1\].*whole "
                           r"processes.*non-replica axis"):
    build([[0, 1], [0, 1]], ("data", "fsdp"))
  # One process with two data-parallel device groups: still a fraction of a process per replica.
  with pytest.raises(TopologyError, match="splits process 0"):
    build([[0], [0]], ("data", "fsdp"))
  # Process 1 straddles replicas 0 and 1.
  with pytest.raises(TopologyError, match=r"splits process 1's devices across replicas \[0, 1\]"):
    build([[0, 0, 1], [1, 2, 2]], ("data", "fsdp"))
  with pytest.raises(TopologyError, match=r"and 1 more processes"):
    build([[0, 1], [1, 0]], ("data", "fsdp"))


def test_rank_missing_from_grid():
  with pytest.raises(TopologyError, match=r"processes \[3\] own no device"):
    build([[0, 1], [2, 2]], ("data", "fsdp"), num_processes=4)


def test_rank_out_of_range():
  with pytest.raises(TopologyError, match=r"ranks \[4\] outside range\(num_processes=4\)"):
    build([[0, 1], [2, 4]], ("data", "fsdp"), num_processes=4)
  with pytest.raises(TopologyError, match=r"ranks \[-1\] outside"):
    build([[0, 1], [2, -1]], ("data", "fsdp"), num_processes=4)


def test_topology_does_not_divide():
  with pytest.raises(TopologyError, match=r"does not divide.*\[2, 1\] processes"):
    build([[0, 0, 1], [2, 2, 2]], ("data", "fsdp"), num_processes=3)


def test_bad_grid_or_names():
  with pytest.raises(TopologyError, match="integer array"):
    build(np.array([[0.0, 1.0]]), ("data", "fsdp"), num_processes=2)
  with pytest.raises(TopologyError, match=r"grid has 2 axes .* names 1"):
    build([[0, 1]], ("data",))
  with pytest.raises(TopologyError, match="repeat a name"):
    build([[0, 1]], ("data", "data"))
  with pytest.raises(TopologyError, match="sequence of axis names"):
    build([[0, 1]], "data")
  with pytest.raises(TopologyError, match="no devices"):
    build(np.zeros((0, 2), dtype=int), ("data", "fsdp"), num_processes=1)
  with pytest.raises(TopologyError, match="num_processes must be a positive int"):
    build([[0]], ("data", "fsdp"), num_processes=0)


def test_peer_options_mutually_exclusive():
  with pytest.raises(TopologyError, match="mutually exclusive"):
    build([[0, 1]], ("data", "fsdp"), peers_per_node=1, peer_ranks=[[1], [0]])


def test_more_peers_than_nodes():
  with pytest.raises(TopologyError, match=r"more peers than nodes.*peers_per_node=4.*4 nodes"):
    build([[0, 1], [2, 3]], ("data", "fsdp"), peers_per_node=4)
  with pytest.raises(TopologyError, match="more peers than nodes"):
    build([[0]], ("data", "fsdp"), peers_per_node=1)


@pytest.mark.parametrize("bad", [-1, 1.0, True, "1"])
def test_peers_per_node_must_be_int(bad):
  with pytest.raises(TopologyError, match="peers_per_node must be an int"):
    build([[0, 1], [2, 3]], ("data", "fsdp"), peers_per_node=bad)


@pytest.mark.parametrize(("peer_ranks", "pattern"), [
    ([[1], [0], [0]], r"3 lists but there are 2 nodes"),
    ([[1]], r"1 lists but there are 2 nodes"),
    ([[2], [0]], r"node 0 has peer 2, which is not a rank in 0..1"),
    ([[1], [-1]], r"node 1 has peer -1"),
    ([[1], ["0"]], r"node 1 has peer '0'"),
    ([[1], [True]], r"node 1 has peer True"),
    ([[0], [0]], r"node 0 lists itself"),
    ([[1, 1], [0]], r"node 0 lists peer 1 more than once"),
    ([1, [0]], r"peer_ranks\[0\] = 1 is not a list"),
])
def test_bad_peer_ranks(peer_ranks, pattern):
  with pytest.raises(TopologyError, match=pattern):
    build([[0, 1]], ("data", "fsdp"), peer_ranks=peer_ranks)


def test_held_by_out_of_range():
  topo = build([[0, 1]], ("data", "fsdp"))
  with pytest.raises(TopologyError, match="rank 2 is not a process rank"):
    topo.held_by(2)


def test_default_peers_rejects_bad_replicas():
  with pytest.raises(TopologyError, match="does not divide"):
    tp.default_peers([(0, 1), (2,)], 1)
  with pytest.raises(TopologyError, match="does not divide"):
    tp.default_peers([], 1)
  with pytest.raises(TopologyError, match="exactly once"):
    tp.default_peers([(0, 1), (1, 3)], 1)


def test_errors_are_value_errors():
  assert issubclass(TopologyError, ValueError)


# --- property tests: build_topology ------------------------------------------------------------


@st.composite
def layouts(draw):
  """A mesh of R replicas x n processes x d devices each, in random axis order and numbering."""
  num_replicas = draw(st.integers(1, 5))
  n = draw(st.integers(1, 5))
  d = draw(st.integers(1, 3))
  perm = draw(st.permutations(range(num_replicas * n)))
  replicas = tuple(tuple(perm[r * n:(r + 1) * n]) for r in range(num_replicas))
  grid = np.array([[replicas[r][c // d] for c in range(n * d)] for r in range(num_replicas)])
  names = ["data", "fsdp"]
  if draw(st.booleans()):  # host devices on an axis of their own
    grid = grid.reshape(num_replicas, n, d)
    names = ["data", "fsdp", "tensor"]
  for j in range(draw(st.integers(0, 2))):  # size-1 axes (diloco, stage, ...)
    grid = grid[np.newaxis]
    names.insert(0, f"extra{j}")
  pos = draw(st.integers(0, grid.ndim - 1))
  grid = np.moveaxis(grid, names.index("data"), pos)
  names.remove("data")
  names.insert(pos, "data")
  return grid, tuple(names), replicas


@settings(max_examples=200, deadline=None)
@given(layout=layouts(), data=st.data())
def test_property_build_topology(layout, data):
  grid, names, replicas = layout
  num_replicas, n = len(replicas), len(replicas[0])
  num = num_replicas * n
  k = data.draw(st.integers(0, num - 1), label="peers_per_node")
  topo = tp.build_topology(grid, names, "data", num_processes=num, peers_per_node=k)
  check_invariants(topo)
  assert topo.replicas == replicas
  assert topo.peers == tp.default_peers(replicas, k)
  for r, ranks in enumerate(replicas):
    for i, rank in enumerate(ranks):
      assert topo.replica_of[rank] == r
      assert topo.position_of[rank] == i
      assert topo.twins[rank] == tuple(replicas[o][i] for o in range(num_replicas) if o != r)
  gives = Counter(s for s, _ in topo.edges)
  holds = Counter(h for _, h in topo.edges)
  for rank in range(num):
    assert len(topo.peers[rank]) == k
    assert gives[rank] == k
    assert holds[rank] == k
    assert len(topo.held_by(rank)) == k
    if k >= 1 and num_replicas > 1:
      first = topo.peers[rank][0]
      assert topo.replica_of[first] != topo.replica_of[rank]
      assert first in topo.twins[rank]
      assert first == replicas[(topo.replica_of[rank] + 1) % num_replicas][topo.position_of[rank]]
    if k >= num_replicas - 1:
      assert set(topo.peers[rank][:num_replicas - 1]) == set(topo.twins[rank])
  if k == num - 1:
    assert all(set(p) | {r} == set(range(num)) for r, p in enumerate(topo.peers))
  rounds = tp.transfer_rounds(topo.edges)
  assert len(rounds) == k


@settings(max_examples=100, deadline=None)
@given(layout=layouts())
def test_property_default_is_one_peer(layout):
  grid, names, replicas = layout
  num = sum(len(r) for r in replicas)
  topo = tp.build_topology(grid, names, "data", num_processes=num)
  assert all(len(p) == (1 if num > 1 else 0) for p in topo.peers)


@settings(max_examples=100, deadline=None)
@given(num_replicas=st.integers(1, 6), n=st.integers(1, 6), data=st.data())
def test_property_default_peers(num_replicas, n, data):
  num = num_replicas * n
  perm = data.draw(st.permutations(range(num)), label="numbering")
  replicas = [perm[r * n:(r + 1) * n] for r in range(num_replicas)]
  k = data.draw(st.integers(0, num - 1), label="k")
  peers = tp.default_peers(replicas, k)
  assert len(peers) == num
  held = Counter(h for p in peers for h in p)
  for rank, p in enumerate(peers):
    assert len(p) == k
    assert rank not in p
    assert len(set(p)) == k
    assert held[rank] == k
  # Preference order is a prefix: k peers are the first k of k + 1.
  if k < num - 1:
    more = tp.default_peers(replicas, k + 1)
    assert all(m[:k] == p for m, p in zip(more, peers, strict=True))
  with pytest.raises(TopologyError, match="more peers than nodes"):
    tp.default_peers(replicas, num)


@settings(max_examples=100, deadline=None)
@given(num=st.integers(1, 8), data=st.data())
def test_property_explicit_peer_ranks(num, data):
  peer_ranks = [
      data.draw(st.lists(st.sampled_from([r for r in range(num) if r != node] or [0]),
                         unique=True, max_size=num - 1), label=f"peers of {node}")
      for node in range(num)
  ]
  grid = np.arange(num).reshape(1, num)
  topo = tp.build_topology(grid, ("data", "fsdp"), "data", num_processes=num,
                           peer_ranks=peer_ranks)
  assert topo.peers == tuple(tuple(p) for p in peer_ranks)
  check_invariants(topo)


# --- transfer_rounds ---------------------------------------------------------------------------


def max_degree(edges) -> int:
  return max([*Counter(s for s, _ in edges).values(), *Counter(d for _, d in edges).values()],
             default=0)


def check_rounds(edges, rounds) -> None:
  flat = [e for r in rounds for e in r]
  assert sorted(flat) == sorted(edges)  # every edge exactly once
  for r in rounds:
    assert r  # no empty rounds
    assert r == tuple(sorted(r))
    assert len({s for s, _ in r}) == len(r)  # each rank sends at most once
    assert len({d for _, d in r}) == len(r)  # each rank receives at most once


edge_sets = st.sets(
    st.tuples(st.integers(0, 9), st.integers(0, 9)).filter(lambda e: e[0] != e[1]), max_size=45)


@settings(max_examples=300, deadline=None)
@given(edges=edge_sets, data=st.data())
def test_property_transfer_rounds(edges, data):
  edges = sorted(edges)
  rounds = tp.transfer_rounds(edges)
  check_rounds(edges, rounds)
  assert len(rounds) <= 2 * max_degree(edges)  # greedy bound
  assert len(rounds) == max_degree(edges)  # in fact optimal (bipartite edge colouring)
  shuffled = data.draw(st.permutations(edges), label="shuffled")
  assert tp.transfer_rounds(shuffled) == rounds
  assert tp.transfer_rounds(tuple(shuffled)) == rounds


@settings(max_examples=100, deadline=None)
@given(num_replicas=st.integers(1, 6), n=st.integers(1, 6), data=st.data())
def test_property_default_peer_edges_take_k_rounds(num_replicas, n, data):
  num = num_replicas * n
  k = data.draw(st.integers(0, num - 1), label="k")
  replicas = [range(r * n, (r + 1) * n) for r in range(num_replicas)]
  edges = [(s, h) for s, p in enumerate(tp.default_peers(replicas, k)) for h in p]
  rounds = tp.transfer_rounds(edges)
  check_rounds(edges, rounds)
  assert len(rounds) == k


def test_transfer_rounds_examples():
  assert tp.transfer_rounds([]) == []
  assert tp.transfer_rounds([(0, 1)]) == [((0, 1),)]
  # A ring is one round: everyone sends once and receives once.
  assert tp.transfer_rounds([(3, 0), (0, 1), (2, 3), (1, 2)]) == [((0, 1), (1, 2), (2, 3), (3, 0))]
  # A fan-out from one rank takes one round per destination.
  assert tp.transfer_rounds([(0, 3), (0, 1), (0, 2)]) == [((0, 1),), ((0, 2),), ((0, 3),)]
  # A rank may send and receive in the same round.
  assert tp.transfer_rounds([(0, 1), (1, 0)]) == [((0, 1), (1, 0))]
  # numpy ints come back as ints.
  out = tp.transfer_rounds(np.array([[0, 1], [1, 2]]).tolist())
  assert out == [((0, 1), (1, 2))]
  out = tp.transfer_rounds([(np.int64(0), np.int32(1))])
  assert out == [((0, 1),)] and type(out[0][0][0]) is int


def test_transfer_rounds_needs_path_swap():
  # Greedy first-fit colouring would need 3 rounds here; max degree is 2.
  edges = [(1, 2), (0, 2), (1, 0), (0, 1)]
  rounds = tp.transfer_rounds(edges)
  check_rounds(edges, rounds)
  assert len(rounds) == 2


def test_transfer_rounds_errors():
  with pytest.raises(TopologyError, match="to itself"):
    tp.transfer_rounds([(0, 1), (2, 2)])
  with pytest.raises(ValueError, match="more than once"):
    tp.transfer_rounds([(0, 1), (1, 2), (0, 1)])
  with pytest.raises(ValueError, match="not a .source, destination. pair"):
    tp.transfer_rounds([(0, 1, 2)])
  with pytest.raises(ValueError, match="ints >= 0"):
    tp.transfer_rounds([(0, -1)])
  with pytest.raises(ValueError, match="ints >= 0"):
    tp.transfer_rounds([(0, 1.5)])
