"""The mesh orbax-mtc's own collectives run on: peer-copy chunks and agreements.

The processes in order along `AXIS`; along `LOCAL`, each process's lowest-id device, or on
CPU, when every process has two or more, its two lowest-id devices.

Why two on CPU (rule 2): JAX's CPU client orders a computation over one local device only
behind that device's other one-device computations, and a computation over several local
devices (a "collective launch") only behind the previous collective launch, one at a time.
A training step over every local device and a one-device chunk left moving were thus
unordered: one process could start the step first on a device and the other the chunk, and
each then waited for the other for good (traced: `tests/repro_cpu_chunk_deadlock.py`). Over
two local devices ours are collective launches too, started in the order they were
dispatched, which is the same on every process. Accelerators run each device's work in
stream order: one device per process there.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

AXIS = "mtc_nodes"
LOCAL = "mtc_local"
# A collective over two local devices is enough to make it a collective launch.
_CPU_LOCAL_DEVICES = 2


def outside_user_mesh(fn: Callable[..., Any]) -> Callable[..., Any]:
  """`fn` (a jitted shard_map over `node_mesh()`) called with no mesh in context: a mesh the
  user set (`jax.set_mesh`, also as a global setter) must match a shard_map's own, and
  JAX raised ValueError at the manager's first collective."""
  @functools.wraps(fn)
  def call(*args: Any) -> Any:
    with jax.set_mesh(None):
      return fn(*args)
  return call


@functools.cache
def node_mesh() -> jax.sharding.Mesh:
  """(processes, devices per process): rows ordered by process index, each row the
  process's lowest-id devices."""
  by_process: dict[int, list[jax.Device]] = {}
  for device in sorted(jax.devices(), key=lambda d: d.id):
    by_process.setdefault(device.process_index, []).append(device)
  rows = [by_process[p] for p in sorted(by_process)]
  cpu = rows[0][0].platform == "cpu"
  per_process = _CPU_LOCAL_DEVICES if cpu and min(map(len, rows)) >= _CPU_LOCAL_DEVICES else 1
  return jax.sharding.Mesh(np.array([row[:per_process] for row in rows]), (AXIS, LOCAL))


def devices_of(rank: int) -> list[jax.Device]:
  """Process `rank`'s devices in the mesh, in order."""
  return list(node_mesh().devices[rank])


def parts(nbytes: int) -> int:
  """How many equal parts a `nbytes` chunk is split into (one per local device)."""
  per_process = node_mesh().devices.shape[1]
  if nbytes % per_process:
    raise ValueError(f"a chunk of {nbytes} bytes does not split into {per_process} parts")
  return per_process


def split_input(placed: list[jax.Array]) -> jax.Array:
  """One process's chunk, placed in equal parts on its devices (in order), as its share of
  a collective's global input split over both axes."""
  mesh = node_mesh()
  return jax.make_array_from_single_device_arrays(
      (placed[0].size * mesh.size,), NamedSharding(mesh, PartitionSpec((AXIS, LOCAL))), placed)


def replicated_input(row: np.ndarray, rank: int) -> jax.Array:
  """One process's `row`, the same on each of its devices, as its share of a collective's
  global input split over the processes only."""
  mesh = node_mesh()
  placed = [jax.device_put(row, device) for device in devices_of(rank)]
  return jax.make_array_from_single_device_arrays(
      (row.size * mesh.devices.shape[0],), NamedSharding(mesh, PartitionSpec(AXIS)), placed)


def local_parts(out: jax.Array, rank: int) -> list[jax.Array]:
  """Process `rank`'s shards of a collective's output, in its devices' order."""
  by_device = {shard.device: shard.data for shard in out.addressable_shards}
  return [by_device[device] for device in devices_of(rank)]
