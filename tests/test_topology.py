"""Topology: replicas, positions, twins and peers from a process grid (pure, no JAX needed)."""

from __future__ import annotations

import numpy as np
import pytest
from topology_support import build, check_invariants

from orbax_mtc.topology import TopologyError

pytestmark = pytest.mark.timeout(60)


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
