"""Device-to-host staging: the blocking part of a save.

`stage` copies this node's unique shards (and its host values) into host memory and lays
them out as data.bin will hold them; the background writer (`store.LocalTier.write`) then
writes, checksums and commits them without touching the devices again. With `device_copy`,
the save does not wait for shards on an accelerator: on a GPU their transfer into pinned host
memory starts (the copy engine moves pinned memory at PCIe speed, pageable memory several
times slower) and the writer reads the pinned buffers in place; elsewhere they are copied on
the device and reach host memory on the writer thread (`StagedStep.to_host`). A typed PRNG
key leaf is staged as its key data (see `format`).
"""

from __future__ import annotations

import bisect
import ctypes
import dataclasses
import functools
import json
import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from orbax_mtc.local.format import (
    KEY_IMPL_NAME,
    Index,
    ItemRecord,
    LeafRecord,
    ShardRecord,
    align,
    aligned_empty,
)
from orbax_mtc.local.specs import (
    describe_sharding,
    encode_key_path,
    global_tiles,
    is_key_dtype,
    key_spec,
    normalize_index,
)

# Bytes copied at a time into a data file's mapping (`StagedStep.copy_into`). Not less: on the
# 2-core VM copies of 16-128 MiB ran 1.6x slower than one of 256 MiB or more (0.165 against
# 0.10 s a GiB; the C library streams only large copies past the caches).
COPY_CHUNK = 256 << 20


@dataclasses.dataclass
class _PendingShard:
  source: Any  # jax array of one device's shard, or a numpy array
  offset: int
  nbytes: int
  index: Index
  dtype: np.dtype
  shape: tuple[int, ...]
  pinned: bool = False  # `source` is a copy in pinned host memory, in flight until ready


@dataclasses.dataclass
class StagedStep:
  """This node's part of one step in host memory, ready for the background writer."""

  step: int
  # (offset in data.bin, its bytes as uint8), ascending and disjoint; nothing may change these
  # bytes until the writer is done with them (see `stage`). A piece still on a device (a
  # device-side copy, `stage(device_copy=True)`) is a _PendingShard until `to_host`.
  pieces: list[tuple[int, np.ndarray | _PendingShard]]
  size: int
  items: dict[str, ItemRecord]  # leaves with crc32c still 0: the writer fills them in
  default_item: bool
  # Offsets of pieces that are views of a CPU jax array's own buffer, to be copied out and let
  # go of before the write (`release`), so that a training step donating the state can reuse
  # its buffers; empty when the writer may hold them (`stage(device_copy=False)`).
  borrowed: frozenset[int] = frozenset()

  def release(self, pool: np.ndarray) -> None:
    """Copies the borrowed pieces into `pool` (at their own offsets; at least `size` bytes,
    reused from save to save, so its pages are not new) and drops the views of the arrays'
    buffers: JAX does not donate a buffer while a numpy view of it lives."""
    if not self.borrowed:
      return
    pieces = []
    for start, piece in self.pieces:
      if start in self.borrowed:
        target = pool[start:start + piece.nbytes]
        np.copyto(target, piece)
        piece = target
      pieces.append((start, piece))
    self.pieces, self.borrowed = pieces, frozenset()

  def copy_into(self, target: np.ndarray, copied: Callable[[int], None],
                chunk_bytes: int = COPY_CHUNK) -> None:
    """Copies data.bin's bytes into `target` (uint8, `size` of them: the file's mapping), the
    alignment gaps as zeros, calling `copied(end)` whenever the bytes up to `end` are in
    (every `chunk_bytes`), then lets go of every piece: borrowed views of the arrays' buffers
    go as with `release`, and the step is then only in `target`."""
    at = 0
    for start, piece in self.pieces:
      target[at:start] = 0
      for lo in range(0, piece.nbytes, chunk_bytes):
        hi = min(piece.nbytes, lo + chunk_bytes)
        target[start + lo:start + hi] = piece[lo:hi]
        copied(start + hi)
      at = start + piece.nbytes
    target[at:self.size] = 0
    copied(self.size)
    self.pieces, self.borrowed = [], frozenset()

  def to_host(self) -> None:
    """Moves the pieces still on a device to host memory (the writer thread calls this
    first; it waits for the device-to-host transfers `stage` started)."""
    on_device = [piece for _, piece in self.pieces if isinstance(piece, _PendingShard)]
    if not on_device:
      return
    for piece in on_device:  # every transfer started before any is awaited
      if not piece.pinned:
        piece.source.copy_to_host_async()
    self.pieces = [(start, _host_bytes(piece) if isinstance(piece, _PendingShard) else piece)
                   for start, piece in self.pieces]

  @classmethod
  def from_buffer(cls, step: int, buffer: np.ndarray, size: int, items: dict[str, ItemRecord],
                  default_item: bool) -> StagedStep:
    """A step already laid out as one buffer (a copy received from a peer)."""
    return cls(step=step, pieces=[(0, buffer[:size])], size=size, items=items,
               default_item=default_item)

  def bytes_at(self, offset: int, nbytes: int) -> np.ndarray:
    """The `nbytes` staged at `offset` (one shard's range lies within one piece; `to_host`
    first)."""
    i = bisect.bisect_right(self._starts, offset) - 1
    if i < 0 or offset + nbytes > self.pieces[i][0] + self.pieces[i][1].nbytes:
      raise ValueError(f"step {self.step}: bytes {offset}+{nbytes} are not staged")
    start, piece = self.pieces[i]
    return piece[offset - start:offset - start + nbytes]

  @functools.cached_property
  def _starts(self) -> list[int]:
    return [start for start, _ in self.pieces]

  def views(self) -> list[memoryview]:
    """data.bin from offset 0 to `size` as consecutive views: the pieces, with zero bytes
    for the alignment gaps between them."""
    out, at = [], 0
    for start, piece in self.pieces:
      if start > at:
        out.append(memoryview(np.zeros(start - at, np.uint8)))
      out.append(memoryview(piece).cast("B"))
      at = start + piece.nbytes
    if self.size > at:
      out.append(memoryview(np.zeros(self.size - at, np.uint8)))
    return out


class HostPool:
  """One host buffer, kept and reused by every write of a RAM tier (its writer thread: one
  write at a time), so that copying a step into it touches no new pages (fresh pages cost
  more than the copy on some hosts)."""

  def __init__(self) -> None:
    self._buffer: np.ndarray | None = None

  def get(self, nbytes: int) -> np.ndarray:
    """The buffer, of at least `nbytes` (a larger one replaces it when needed)."""
    if self._buffer is None or self._buffer.nbytes < nbytes:
      self._buffer = None  # the old one goes before the larger one is allocated
      self._buffer = aligned_empty(nbytes)
    return self._buffer


def _is_array_leaf(x: Any) -> bool:
  return isinstance(x, jax.Array)


def _key_impl_of(path: str, leaf: jax.Array) -> str:
  """The name of a PRNG key leaf's implementation, checked to name it again on restore."""
  if not is_key_dtype(leaf.dtype):
    raise TypeError(f"Leaf {path} has the extended dtype {leaf.dtype}, which the RAM tier "
                    "cannot store (of extended dtypes it stores typed PRNG keys only).")
  impl = str(jax.random.key_impl(leaf))
  try:
    if not KEY_IMPL_NAME.fullmatch(impl) or key_spec(impl)[0].name != leaf.dtype.name:
      raise ValueError(f"the name {impl!r} does not name it")
  except ValueError as e:
    raise TypeError(f"Leaf {path} holds PRNG keys ({leaf.dtype}) of an implementation the RAM "
                    f"tier cannot name for restore: {e}. Use a registered implementation "
                    "(e.g. jax.random.key(seed, impl='threefry2x32')).") from e
  return impl


def _host_value(path: str, leaf: Any) -> tuple[np.ndarray, str | None]:
  if isinstance(leaf, bool):
    return np.asarray(leaf), "bool"
  if isinstance(leaf, int):
    return np.asarray(leaf, dtype=np.int64), "int"
  if isinstance(leaf, float):
    return np.asarray(leaf, dtype=np.float64), "float"
  if isinstance(leaf, (np.ndarray, np.generic)):
    if leaf.dtype == object:
      raise TypeError(f"Leaf {path} is a numpy object array; the RAM tier stores numeric arrays.")
    return np.asarray(leaf), None
  raise TypeError(
      f"Leaf {path} has type {type(leaf).__name__}, which the RAM tier cannot store. Use "
      "jax/numpy arrays or Python scalars in the state, or save this value as a separate "
      "ocp.args.JsonSave item.")



def stage(step: int, pytree_items: dict[str, Any], json_items: dict[str, Any], *,
          default_item: bool,
          process_items: dict[str, tuple[str, bytes]] | None = None,
          device_copy: bool = False) -> StagedStep:
  """This node's unique shards in host memory (the blocking part of a save).

  A jax array's shard is its host value: on accelerators a device-to-host copy; on CPU a
  read-only view of the array's own buffer, which JAX neither frees nor donates to another
  computation while the view is alive, so no copy is needed there. Host leaves (numpy arrays,
  scalars) are copied: the caller may change them once `save` returns. Each distinct shard
  index this process holds is staged once: the copy that restores this node's devices without
  any transfer. Data-parallel twins on other nodes write the same shard, which is what makes
  them free copies of each other.

  Args:
    step: the step number.
    pytree_items: item name -> pytree of jax arrays, numpy arrays and Python scalars.
    json_items: item name -> JSON-serialisable value.
    default_item: whether the step was saved from a single (non-Composite) argument.
    process_items: item name -> (format, this process's bytes) of per-process items
      (`process_state`): one checksummed entry each, like a host leaf.
    device_copy: copy shards on an accelerator on the device and leave their transfer to
      host memory to the writer (`StagedStep.to_host`): the caller may change or donate the
      arrays as soon as this returns, and has not waited for the transfer.

  Returns:
    The staged step, its shards' checksums still 0 (the writer computes them).

  Raises:
    TypeError: a leaf the RAM tier cannot store, or a JSON item that is not serialisable.
  """
  pending: list[_PendingShard] = []
  items: dict[str, ItemRecord] = {}
  offset = 0
  for item_name, tree in pytree_items.items():
    leaves_with_path = jax.tree_util.tree_flatten_with_path(tree)[0]
    records = []
    for key_path, leaf in leaves_with_path:
      path = jax.tree_util.keystr(key_path)
      key_impl = None
      if _is_array_leaf(leaf):
        sharding = describe_sharding(leaf.sharding)
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.extended):
          key_impl = _key_impl_of(path, leaf)
          leaf = jax.random.key_data(leaf)  # its shards: uint32, indexed over the data's dims
        try:
          tiles = global_tiles(leaf.sharding, tuple(leaf.shape))
        except TypeError:  # an unhashable custom sharding: no layout, no elastic restore
          tiles = None
        chosen: dict[Index, Any] = {}
        for shard in sorted(leaf.addressable_shards, key=lambda s: (s.replica_id, s.device.id)):
          index = normalize_index(shard.index, leaf.shape)
          chosen.setdefault(index, shard.data)
        dtype = np.dtype(leaf.dtype)
        kind, python_type, sources = "array", None, list(chosen.items())
        shape = tuple(leaf.shape)
      else:
        host, python_type = _host_value(path, leaf)
        dtype, kind, shape = host.dtype, "host", tuple(host.shape)
        sources = [(tuple((0, d) for d in host.shape), host)]
        sharding = tiles = None
      shards = []
      for index, source in sources:
        shard_shape = tuple(b - a for a, b in index)
        nbytes = math.prod(shard_shape) * dtype.itemsize
        pending.append(_PendingShard(source, offset, nbytes, index, dtype, shard_shape))
        shards.append(ShardRecord(index=index, offset=offset, nbytes=nbytes, crc32c=0))
        offset += align(nbytes)
      records.append(LeafRecord(path=path, kind=kind, shape=shape, dtype=dtype.name,
                                shards=tuple(shards), python_type=python_type,
                                keys=encode_key_path(key_path), sharding=sharding,
                                key_impl=key_impl, tiles=tiles))
    items[item_name] = ItemRecord(kind="pytree", leaves=tuple(records))
  for item_name, value in json_items.items():
    try:
      json.dumps(value)
    except TypeError as e:
      raise TypeError(f"Item {item_name!r} is not JSON-serialisable: {e}") from e
    items[item_name] = ItemRecord(kind="json", value=value)
  for item_name, (fmt, data) in (process_items or {}).items():
    host = np.frombuffer(data, dtype=np.uint8)
    index = ((0, host.size),)
    pending.append(_PendingShard(host, offset, host.size, index, host.dtype, host.shape))
    leaf = LeafRecord(path="", kind="host", shape=host.shape, dtype="uint8", shards=(
        ShardRecord(index=index, offset=offset, nbytes=host.size, crc32c=0),))
    items[item_name] = ItemRecord(kind="process", leaves=(leaf,), value={"format": fmt})
    offset += align(host.size)

  deferred: set[int] = set()  # ids of the pending shards left on a device
  for p in pending:
    if isinstance(p.source, jax.Array):
      if device_copy and _copied_on_device(p.source):
        # A new buffer, ordered on the device before anything later done to the original
        # (a donating training step included): its bytes are the state as saved.
        pinned = _pinned_host(p.source)
        if pinned is not None:  # the transfer starts now and runs beside the next step
          p.source, p.pinned = jax.device_put(p.source, pinned), True
        else:  # its transfer starts on the writer thread: it can block (CUDA)
          p.source = jax.device_put(p.source, p.source.sharding, may_alias=False)
        deferred.add(id(p))
      else:
        # Start every device->host transfer before waiting on any (no-op on CPU).
        p.source.copy_to_host_async()
  pieces = [(p.offset, p if id(p) in deferred else _host_bytes(p)) for p in pending]
  # On CPU the pieces of jax arrays are views of the arrays' own buffers (no copy on the
  # training thread); with device_copy the writer copies them out before writing (`release`).
  borrowed = frozenset(p.offset for p in pending if device_copy and id(p) not in deferred
                       and isinstance(p.source, jax.Array))
  return StagedStep(step=step, pieces=pieces, size=offset, items=items,
                    default_item=default_item, borrowed=borrowed)


# Tests set these to exercise the device-copy and pinned-host paths with CPU devices.
COPY_ON_CPU = False
PIN_ON_CPU = False
# Where a save stages through pinned host memory, as Orbax does (`enable_pinned_host_transfer`
# defaults to GPUs only): a TPU's host transfers are fast from device memory already.
_PINNED_PLATFORMS = ("gpu", "cuda", "rocm")
_PINNED = "pinned_host"


def _pinned_host(array: jax.Array) -> jax.sharding.Sharding | None:
  """Pinned host memory of the one device holding `array`, where saves stage through it."""
  (device,) = array.devices()
  if not (PIN_ON_CPU or device.platform in _PINNED_PLATFORMS):
    return None
  if not any(m.kind == _PINNED for m in device.addressable_memories()):
    return None
  return jax.sharding.SingleDeviceSharding(device, memory_kind=_PINNED)


def _copied_on_device(array: jax.Array) -> bool:
  """Whether `stage(device_copy=True)` copies this shard on its device: on accelerators (a
  CPU shard is read in place, without a copy)."""
  return COPY_ON_CPU or any(d.platform != "cpu" for d in array.devices())


def _host_bytes(shard: _PendingShard) -> np.ndarray:
  """One staged shard as C-ordered uint8 that nothing changes until the write is done."""
  if shard.pinned:
    view = _pinned_view(shard.source, shard.nbytes)
    if view is not None:
      return view
  if isinstance(shard.source, jax.Array):
    host = np.asarray(shard.source)
  else:
    host = np.array(shard.source, copy=True, order="C")  # one copy, already C-ordered
  if host.dtype != shard.dtype or host.shape != shard.shape:
    raise TypeError(f"a shard of dtype {host.dtype} shape {host.shape} was staged as "
                    f"{shard.dtype} {shard.shape}")
  return np.ascontiguousarray(host).reshape(-1).view(np.uint8)


def _pinned_view(array: jax.Array, nbytes: int) -> np.ndarray | None:
  """The bytes of a pinned-host copy, read in place once its transfer is done (np.asarray
  would copy them again into fresh, never-touched pages: the slow part on a GPU host).

  The view is valid while `array` lives: the staged step keeps it through the write, via the
  view's base. None where the buffer is not plain row-major bytes of the expected size (a
  tiled host layout): the caller then copies."""
  array.block_until_ready()
  try:
    layout = array.format.layout
    row_major = tuple(layout.major_to_minor) == tuple(range(array.ndim))
    if not row_major or getattr(layout, "tiling", None) or nbytes != array.nbytes:
      return None
    address = array.unsafe_buffer_pointer()
  except (AttributeError, NotImplementedError, TypeError, ValueError, RuntimeError):
    return None
  if nbytes == 0:
    return np.zeros(0, np.uint8)
  buffer = (ctypes.c_uint8 * nbytes).from_address(address)
  buffer.owner = array  # the view's base holds the array, so its memory outlives the view
  view = np.frombuffer(buffer, dtype=np.uint8)
  view.flags.writeable = False
  return view
