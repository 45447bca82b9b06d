"""The machine's limits for moving a state's bytes, and small timing helpers.

Each function does the plainest thing that moves the same bytes a checkpointing system moves:
copy them in memory, write them to a file on the RAM disk, read them back, send them to
another process with one collective. Benchmarks report orbax-mtc as a ratio of these.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Sequence
from typing import Any

import numpy as np

_WRITE_PIECE = 64 << 20


def spread(samples: Sequence[float]) -> dict[str, float]:
  """Median, min, max and count of repeated measurements."""
  values = [float(v) for v in samples]
  if not values:
    return {"median": float("nan"), "min": float("nan"), "max": float("nan"), "n": 0}
  return {"median": statistics.median(values), "min": min(values), "max": max(values),
          "n": len(values)}


def _distinct_local_parts(tree: Any) -> list[Any]:
  """This process's distinct shards of every array in `tree` (host leaves as they are)."""
  import jax

  parts = []
  for leaf in jax.tree.leaves(tree):
    if not hasattr(leaf, "addressable_shards"):
      parts.append(np.asarray(leaf))
      continue
    seen = set()
    for shard in leaf.addressable_shards:
      index = str(shard.index)
      if index not in seen:
        seen.add(index)
        parts.append(shard.data)
  return parts


def host_bytes(tree: Any) -> np.ndarray:
  """This process's distinct shards of every array in `tree`, as one uint8 buffer."""
  parts = [np.asarray(p).reshape(-1).view(np.uint8) for p in _distinct_local_parts(tree)]
  return np.concatenate(parts) if parts else np.empty(0, np.uint8)


def local_nbytes(tree: Any) -> int:
  """`host_bytes(tree).nbytes`, without copying anything."""
  return sum(int(p.nbytes) for p in _distinct_local_parts(tree))


def warm_memory(nbytes: int) -> None:
  """Touches `nbytes` of fresh memory and frees it, so that the next allocation of that size
  gets pages the system has just handed out. On a VM that reports free pages to its host
  (this one does, after about 2 s), memory freed earlier costs seconds per GiB to touch again;
  measuring a read after this puts every contender on the same footing."""
  if nbytes > 0:
    buffer = np.ones(nbytes, dtype=np.uint8)
    del buffer


def memcpy(dst: np.ndarray, src: np.ndarray) -> None:
  np.copyto(dst, src)


def device_to_host(tree: Any) -> list[np.ndarray]:
  """This process's distinct shards of `tree` in host memory, every copy started before any
  is awaited: on an accelerator, what a save must wait for before training may change the
  arrays. Meaningful on arrays whose host copy JAX has not cached yet (`np.asarray` keeps it)."""
  parts = _distinct_local_parts(tree)
  for part in parts:
    if hasattr(part, "copy_to_host_async"):
      part.copy_to_host_async()
  return [np.asarray(part) for part in parts]


def raw_write(path: str, data: np.ndarray, *, overwrite: bool) -> None:
  """Writes `data` to `path` and fsyncs it; without `overwrite` the file is new."""
  if not overwrite and os.path.exists(path):
    os.unlink(path)
  fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
  try:
    view = memoryview(data).cast("B")
    done = 0
    while done < data.nbytes:
      done += os.pwrite(fd, view[done:done + _WRITE_PIECE], done)
    os.fsync(fd)
  finally:
    os.close(fd)


def raw_read(path: str) -> np.ndarray:
  """Reads the whole file into a new buffer."""
  out = np.empty(os.path.getsize(path), np.uint8)
  with open(path, "rb", buffering=0) as f:
    view = memoryview(out)
    done = 0
    while done < out.nbytes:
      got = f.readinto(view[done:])
      if not got:
        raise OSError(f"{path}: short read at {done} of {out.nbytes} bytes")
      done += got
  return out


class RingPermute:
  """One jitted `ppermute` of `nbytes` per process to the next process (one device each)."""

  def __init__(self, nbytes: int):
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    first = {}
    for d in devices:
      first.setdefault(d.process_index, d)
    node_devices = [first[p] for p in sorted(first)]
    n = len(node_devices)
    mesh = jax.sharding.Mesh(np.array(node_devices), ("p",))
    perm = tuple((i, (i + 1) % n) for i in range(n))
    self._fn = jax.jit(jax.shard_map(lambda x: jax.lax.ppermute(x, "p", perm), mesh=mesh,
                                     in_specs=P("p"), out_specs=P("p")))
    mine = first[jax.process_index()]
    self._x = jax.make_array_from_single_device_arrays(
        (nbytes * n,), NamedSharding(mesh, P("p")),
        [jax.device_put(np.ones((nbytes,), np.uint8), mine)])
    self._fn(self._x).block_until_ready()  # compile outside the timed runs

  def __call__(self) -> None:
    self._fn(self._x).block_until_ready()


def broadcast(data: np.ndarray) -> None:
  """`broadcast_one_to_all` of `data` from process 0 to every process."""
  from jax.experimental import multihost_utils

  multihost_utils.broadcast_one_to_all(data)
