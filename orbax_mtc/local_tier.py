"""The RAM-disk tier: this node's step folders, written raw and committed atomically.

Layout of one node's local directory::

  <local>/<step>/data.bin        the node's shard bytes, back to back
  <local>/<step>/manifest.json   every leaf: global shape, dtype, and per shard its index,
                                 offset, length and CRC32C
  <local>/.tmp-<step>-<id>/      a step being written (never read)
  <local>/.spare-<id>/           a retired step whose data file the next save overwrites

A step folder only ever appears by renaming a complete temporary folder, so a process killed
at any instant leaves either the whole step or nothing restore would pick. Files of the step
that retention retires are overwritten in place by the next save: on tmpfs overwriting pages
that already exist is about twice as fast as writing a new file.

This module does file I/O only. It never issues a collective, so its writer runs safely in a
background thread.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import dataclasses
import functools
import json
import math
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import crc32c
import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from orbax.checkpoint import args as ocp_args

FORMAT = "orbax-mtc/local/1"
MANIFEST = "manifest.json"
DATA = "data.bin"
TMP_PREFIX = ".tmp-"
SPARE_PREFIX = ".spare-"
_ALIGN = 64
_WRITE_CHUNK = 64 << 20
_IOV_MAX = 1024  # Linux: views per pwritev call
_CRC_CHUNK = 16 << 20
_PIPELINE_PIECE = 4 << 20  # read, then checksum, this much at a time: it stays in cache

Index = tuple[tuple[int, int], ...]


class LocalTierError(RuntimeError):
  """A local step cannot be used (missing, partial, corrupt): restore falls back."""


class CorruptStepError(LocalTierError):
  """Bytes on the RAM disk do not match their checksum."""


class AbstractStateMismatchError(ValueError):
  """The target tree does not match what was saved (names the leaf and both specs)."""


# ----------------------------------------------------------------------------- manifest


@dataclasses.dataclass(frozen=True)
class ShardRecord:
  index: Index
  offset: int
  nbytes: int
  crc32c: int

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(stop - start for start, stop in self.index)


@dataclasses.dataclass(frozen=True)
class LeafRecord:
  path: str
  kind: str  # "array": a jax.Array (sharded); "host": a numpy array or Python scalar
  shape: tuple[int, ...]
  dtype: str
  shards: tuple[ShardRecord, ...]
  python_type: str | None = None  # "int"/"float"/"bool" for Python scalars
  keys: tuple[tuple[str, Any], ...] = ()  # the key path, for metadata without a target tree


@dataclasses.dataclass(frozen=True)
class ItemRecord:
  kind: str  # "pytree" or "json"
  leaves: tuple[LeafRecord, ...] = ()
  value: Any = None  # the JSON value of a "json" item


@dataclasses.dataclass(frozen=True)
class StepManifest:
  step: int
  process_index: int
  process_count: int
  items: dict[str, ItemRecord]
  data_size: int
  created_at: float
  default_item: bool  # saved from a single (non-Composite) argument

  def to_json(self) -> str:
    def leaf(r: LeafRecord) -> dict[str, Any]:
      return {"path": r.path, "kind": r.kind, "shape": list(r.shape), "dtype": r.dtype,
              "python_type": r.python_type, "keys": [list(k) for k in r.keys],
              "shards": [[[list(d) for d in s.index], s.offset, s.nbytes, s.crc32c]
                         for s in r.shards]}
    items = {name: {"kind": it.kind, "leaves": [leaf(x) for x in it.leaves], "value": it.value}
             for name, it in self.items.items()}
    return json.dumps({"format": FORMAT, "step": self.step, "process_index": self.process_index,
                       "process_count": self.process_count, "data_size": self.data_size,
                       "created_at": self.created_at, "default_item": self.default_item,
                       "items": items})

  @classmethod
  def from_json(cls, text: str) -> StepManifest:
    raw = json.loads(text)
    if raw.get("format") != FORMAT:
      raise LocalTierError(f"unknown manifest format {raw.get('format')!r}, expected {FORMAT!r}")

    def leaf(d: dict[str, Any]) -> LeafRecord:
      shards = tuple(ShardRecord(index=tuple((int(a), int(b)) for a, b in idx), offset=int(off),
                                 nbytes=int(n), crc32c=int(c))
                     for idx, off, n, c in d["shards"])
      return LeafRecord(path=d["path"], kind=d["kind"], shape=tuple(d["shape"]),
                        dtype=d["dtype"], shards=shards, python_type=d.get("python_type"),
                        keys=tuple((k, v) for k, v in d.get("keys", ())))
    items = {name: ItemRecord(kind=it["kind"], leaves=tuple(leaf(x) for x in it["leaves"]),
                              value=it.get("value"))
             for name, it in raw["items"].items()}
    return cls(step=int(raw["step"]), process_index=int(raw["process_index"]),
               process_count=int(raw["process_count"]), items=items,
               data_size=int(raw["data_size"]), created_at=float(raw["created_at"]),
               default_item=bool(raw["default_item"]))


# ----------------------------------------------------------------------------- staging


def normalize_index(index: Sequence[slice], shape: Sequence[int]) -> Index:
  """A shard's global index as ((start, stop), ...) with no None bounds."""
  out = []
  for sl, dim in zip(index, shape, strict=True):
    start, stop, step = sl.indices(dim)
    if step != 1:
      raise ValueError(f"strided shard index {sl} is not supported")
    out.append((start, stop))
  return tuple(out)


@dataclasses.dataclass
class _PendingShard:
  source: Any  # jax array of one device's shard, or a numpy array
  offset: int
  nbytes: int
  index: Index
  dtype: np.dtype
  shape: tuple[int, ...]


@dataclasses.dataclass
class StagedStep:
  """This node's part of one step in host memory, ready for the background writer."""

  step: int
  # (offset in data.bin, its bytes as uint8), ascending and disjoint; nothing may change these
  # bytes until the writer is done with them (see `stage`).
  pieces: list[tuple[int, np.ndarray]]
  size: int
  items: dict[str, ItemRecord]  # leaves with crc32c still 0: the writer fills them in
  default_item: bool

  @classmethod
  def from_buffer(cls, step: int, buffer: np.ndarray, size: int, items: dict[str, ItemRecord],
                  default_item: bool) -> StagedStep:
    """A step already laid out as one buffer (a copy received from a peer)."""
    return cls(step=step, pieces=[(0, buffer[:size])], size=size, items=items,
               default_item=default_item)

  def bytes_at(self, offset: int, nbytes: int) -> np.ndarray:
    """The `nbytes` staged at `offset` (one shard's range lies within one piece)."""
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


def _is_array_leaf(x: Any) -> bool:
  return isinstance(x, jax.Array)


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


def _encode_key_path(key_path: Sequence[Any]) -> tuple[tuple[str, Any], ...]:
  out = []
  for key in key_path:
    if isinstance(key, jax.tree_util.DictKey):
      out.append(("dict", key.key if isinstance(key.key, (str, int)) else str(key.key)))
    elif isinstance(key, jax.tree_util.SequenceKey):
      out.append(("seq", key.idx))
    elif isinstance(key, jax.tree_util.GetAttrKey):
      out.append(("attr", key.name))
    else:
      out.append(("flat", getattr(key, "key", str(key))))
  return tuple(out)


def item_metadata(manifest: StepManifest) -> Any:
  """Nested dicts/lists of jax.ShapeDtypeStruct rebuilt from a manifest (no target needed).

  Attribute and custom-node keys become dict keys; JSON items give their value.
  """
  result: dict[str, Any] = {}
  for name, item in manifest.items.items():
    if item.kind == "json":
      result[name] = item.value
      continue
    root: Any = None
    for leaf in item.leaves:
      spec = jax.ShapeDtypeStruct(tuple(leaf.shape), jnp.dtype(leaf.dtype))
      if not leaf.keys:
        root = spec
        continue
      if root is None:
        root = {}
      node = root
      for i, (_, key) in enumerate(leaf.keys):
        last = i == len(leaf.keys) - 1
        if last:
          node[key] = spec
        else:
          node = node.setdefault(key, {})
    result[name] = _lists_from_int_keys(root)
  if manifest.default_item and list(result) == ["default"]:
    return result["default"]
  return ocp_args.Composite(**result)


def _lists_from_int_keys(node: Any) -> Any:
  if isinstance(node, dict):
    node = {k: _lists_from_int_keys(v) for k, v in node.items()}
    if node and all(isinstance(k, int) for k in node) and sorted(node) == list(range(len(node))):
      return [node[i] for i in range(len(node))]
  return node


def stage(step: int, pytree_items: dict[str, Any], json_items: dict[str, Any], *,
          default_item: bool) -> StagedStep:
  """This node's unique shards in host memory (the blocking part of a save).

  A jax array's shard is its host value: on accelerators a device-to-host copy; on CPU a
  read-only view of the array's own buffer, which JAX neither frees nor donates to another
  computation while the view is alive, so no copy is needed there. Host leaves (numpy arrays,
  scalars) are copied: the caller may change them once `save` returns. Each distinct shard
  index this process holds is staged once: the copy that restores this node's devices without
  any transfer. Data-parallel twins on other nodes write the same shard, which is what makes
  them free copies of each other.
  """
  pending: list[_PendingShard] = []
  items: dict[str, ItemRecord] = {}
  offset = 0
  for item_name, tree in pytree_items.items():
    leaves_with_path = jax.tree_util.tree_flatten_with_path(tree)[0]
    records = []
    for key_path, leaf in leaves_with_path:
      path = jax.tree_util.keystr(key_path)
      if _is_array_leaf(leaf):
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
      shards = []
      for index, source in sources:
        shard_shape = tuple(b - a for a, b in index)
        nbytes = math.prod(shard_shape) * dtype.itemsize
        pending.append(_PendingShard(source, offset, nbytes, index, dtype, shard_shape))
        shards.append(ShardRecord(index=index, offset=offset, nbytes=nbytes, crc32c=0))
        offset += -(-nbytes // _ALIGN) * _ALIGN
      records.append(LeafRecord(path=path, kind=kind, shape=shape, dtype=dtype.name,
                                shards=tuple(shards), python_type=python_type,
                                keys=_encode_key_path(key_path)))
    items[item_name] = ItemRecord(kind="pytree", leaves=tuple(records))
  for item_name, value in json_items.items():
    try:
      json.dumps(value)
    except TypeError as e:
      raise TypeError(f"Item {item_name!r} is not JSON-serialisable: {e}") from e
    items[item_name] = ItemRecord(kind="json", value=value)

  # Start every device->host transfer before waiting on any (no-op on CPU).
  for p in pending:
    if isinstance(p.source, jax.Array):
      p.source.copy_to_host_async()
  pieces = [(p.offset, _host_bytes(p)) for p in pending]
  return StagedStep(step=step, pieces=pieces, size=offset, items=items,
                    default_item=default_item)


def _host_bytes(shard: _PendingShard) -> np.ndarray:
  """One staged shard as C-ordered uint8 that nothing changes until the write is done."""
  if isinstance(shard.source, jax.Array):
    host = np.asarray(shard.source)
  else:
    host = np.array(shard.source, copy=True, order="C")  # one copy, already C-ordered
  if host.dtype != shard.dtype or host.shape != shard.shape:
    raise TypeError(f"a shard of dtype {host.dtype} shape {host.shape} was staged as "
                    f"{shard.dtype} {shard.shape}")
  return np.ascontiguousarray(host).reshape(-1).view(np.uint8)


# ----------------------------------------------------------------------------- directory


def is_step_name(name: str) -> bool:
  return name.isdigit()


def read_manifest(step_dir: Path) -> StepManifest:
  try:
    raw = (step_dir / MANIFEST).read_bytes()
  except FileNotFoundError as e:
    raise LocalTierError(f"{step_dir} has no {MANIFEST}: not a committed step") from e
  try:
    return StepManifest.from_json(raw.decode())  # a flipped bit may break UTF-8 too
  except (ValueError, KeyError, TypeError) as e:
    raise LocalTierError(f"{step_dir / MANIFEST} is unreadable: {e}") from e


def committed_steps(root: Path) -> list[int]:
  """Steps with a committed folder (manifest present and parseable), oldest first."""
  if not root.is_dir():
    return []
  steps = []
  for entry in root.iterdir():
    if is_step_name(entry.name) and (entry / MANIFEST).is_file():
      steps.append(int(entry.name))
  return sorted(steps)


def fsync_dir(path: Path) -> None:
  fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def _crc(data: np.ndarray) -> int:
  value = 0
  for start in range(0, data.nbytes, _CRC_CHUNK):
    value = crc32c.crc32c(data[start:start + _CRC_CHUNK], value)
  return value


def _crc_ranges(buffer: np.ndarray, ranges: Sequence[tuple[int, int]]) -> list[int]:
  return [_crc(buffer[offset:offset + nbytes]) for offset, nbytes in ranges]


def _crc_staged(staged: StagedStep, ranges: Sequence[tuple[int, int]]) -> list[int]:
  return [_crc(staged.bytes_at(offset, nbytes)) for offset, nbytes in ranges]


def _write_views(fd: int, views: Sequence[memoryview]) -> None:
  """Writes `views` back to back from offset 0: gathered into calls of up to _WRITE_CHUNK
  bytes and _IOV_MAX views (many small leaves cost few system calls), short writes resumed."""
  batch: list[memoryview] = []
  batch_bytes = offset = 0

  def flush() -> None:
    nonlocal batch_bytes, offset
    done = os.pwritev(fd, batch, offset)
    at = offset + done
    for view in batch:  # resumes a short write (rare): the rest one view at a time
      if done >= view.nbytes:
        done -= view.nbytes
        continue
      rest, done = view[done:], 0
      while rest.nbytes:
        n = os.pwrite(fd, rest, at)
        rest, at = rest[n:], at + n
    offset += batch_bytes
    batch.clear()
    batch_bytes = 0

  for view in views:
    for start in range(0, view.nbytes, _WRITE_CHUNK):
      part = view[start:start + _WRITE_CHUNK]
      if batch and (batch_bytes + part.nbytes > _WRITE_CHUNK or len(batch) >= _IOV_MAX):
        flush()
      batch.append(part)
      batch_bytes += part.nbytes
  if batch:
    flush()


class LocalTier:
  """This node's RAM-disk step folders: write, commit, list, read, verify, retire."""

  def __init__(self, directory: Path, *, max_to_keep: int | None,
               on_commit: Callable[[int], None] | None = None, reuse_files: bool = True):
    self.directory = Path(directory)
    self.max_to_keep = max_to_keep
    self._on_commit = on_commit
    # False when another program (GKE's replicator) may still be copying a retired step:
    # its files must then never be overwritten in place.
    self.reuse_files = reuse_files
    # Newest step that every process had committed at the last save: kept even beyond
    # max_to_keep, so a crash between two nodes' commits still leaves a common RAM step.
    self.keep_floor: int | None = None
    self._lock = threading.Lock()  # guards folder renames between writer and main thread
    self._crc_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mtc-crc")

  # -- set-up

  def prepare(self) -> None:
    """Creates the directory (clear errors when it cannot be used) and drops leftovers."""
    root = self.directory
    if root.exists() and not root.is_dir():
      raise ValueError(
          f"local_directory {root} exists and is not a directory. Point local_directory at a "
          "folder on the RAM disk (e.g. /dev/shm/ckpt) or remove the file.")
    try:
      root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
      raise ValueError(f"Cannot create local_directory {root}: {e.strerror}. Choose a writable "
                       "folder on the RAM disk (e.g. /dev/shm/ckpt).") from e
    if not os.access(root, os.W_OK | os.X_OK):
      raise ValueError(f"local_directory {root} is not writable by this process (uid "
                       f"{os.getuid()}). Fix its permissions or choose another folder.")
    spares = []
    for entry in root.iterdir():
      if entry.name.startswith(TMP_PREFIX):
        logging.info("orbax-mtc: removing interrupted local save %s", entry)
        shutil.rmtree(entry, ignore_errors=True)
      elif entry.name.startswith(SPARE_PREFIX):
        spares.append(entry)
    for extra in spares[1:]:
      shutil.rmtree(extra, ignore_errors=True)

  # -- writing (background thread: file I/O only)

  def write(self, staged: StagedStep, process_index: int, process_count: int) -> Path:
    """Writes and commits one staged step; returns the committed folder."""
    root = self.directory
    final = root / str(staged.step)
    tmp = root / f"{TMP_PREFIX}{staged.step}-{uuid.uuid4().hex}"
    spare = self._take_spare()
    if spare is not None:
      os.rename(spare, tmp)
      for extra in tmp.iterdir():
        if extra.name != DATA:
          extra.unlink()
    else:
      tmp.mkdir()
    ranges = [(s.offset, s.nbytes) for it in staged.items.values() for leaf in it.leaves
              for s in leaf.shards]
    crcs = self._crc_pool.submit(_crc_staged, staged, ranges)
    data_path = tmp / DATA
    try:
      fd = os.open(data_path, os.O_WRONLY | os.O_CREAT, 0o644)
      try:
        _write_views(fd, staged.views())
        os.ftruncate(fd, staged.size)
        os.fsync(fd)
      finally:
        os.close(fd)
      crc_values = iter(crcs.result())

      def checked(item: str, leaf: LeafRecord, shard: ShardRecord) -> ShardRecord:
        value = next(crc_values)
        # A step written back after a recovery carries its checksums: they must still hold.
        if shard.crc32c and shard.crc32c != value:
          raise CorruptStepError(f"step {staged.step}: leaf {item}{leaf.path} changed while "
                                 "being written (checksum mismatch); not committed")
        return dataclasses.replace(shard, crc32c=value)

      items = {}
      for name, it in staged.items.items():
        leaves = tuple(dataclasses.replace(
            leaf, shards=tuple(checked(name, leaf, s) for s in leaf.shards))
            for leaf in it.leaves)
        items[name] = dataclasses.replace(it, leaves=leaves)
      manifest = StepManifest(step=staged.step, process_index=process_index,
                              process_count=process_count, items=items, data_size=staged.size,
                              created_at=time.time(), default_item=staged.default_item)
      manifest_tmp = tmp / (MANIFEST + ".tmp")
      with open(manifest_tmp, "w") as f:
        f.write(manifest.to_json())
        f.flush()
        os.fsync(f.fileno())
      os.rename(manifest_tmp, tmp / MANIFEST)
      fsync_dir(tmp)
      with self._lock:
        if final.exists():
          raise FileExistsError(f"local step {final} already exists")
        os.rename(tmp, final)  # the commit point
        fsync_dir(root)
    except BaseException:
      shutil.rmtree(tmp, ignore_errors=True)
      raise
    if self._on_commit is not None:
      self._on_commit(staged.step)
    self.apply_retention()
    return final

  def _take_spare(self) -> Path | None:
    with self._lock:
      for entry in self.directory.iterdir():
        if entry.name.startswith(SPARE_PREFIX):
          return entry
    return None

  def apply_retention(self) -> list[int]:
    """Retires committed steps beyond `max_to_keep`, never the newest; returns them."""
    if self.max_to_keep is None:
      return []
    steps = committed_steps(self.directory)
    victims = [s for s in steps[: max(0, len(steps) - self.max_to_keep)] if s != self.keep_floor]
    for step in victims:
      self.retire(step)
    return victims

  def retire(self, step: int) -> None:
    """Un-commits a step (atomic rename) and keeps its files for reuse by the next save."""
    src = self.directory / str(step)
    with self._lock:
      have_spare = not self.reuse_files or any(
          e.name.startswith(SPARE_PREFIX) for e in self.directory.iterdir())
      target = self.directory / (f"{TMP_PREFIX}del-{uuid.uuid4().hex}" if have_spare
                                 else f"{SPARE_PREFIX}{uuid.uuid4().hex}")
      try:
        os.rename(src, target)
      except FileNotFoundError:
        return
    if have_spare:
      shutil.rmtree(target, ignore_errors=True)

  def delete(self, step: int) -> None:
    src = self.directory / str(step)
    if not src.exists():
      return
    target = self.directory / f"{TMP_PREFIX}del-{uuid.uuid4().hex}"
    with self._lock:
      os.rename(src, target)
    shutil.rmtree(target, ignore_errors=True)

  def steps(self) -> list[int]:
    return committed_steps(self.directory)

  def manifest(self, step: int) -> StepManifest:
    return read_manifest(self.directory / str(step))

  def close(self) -> None:
    self._crc_pool.shutdown(wait=True)


# ----------------------------------------------------------------------------- reading


def _check_leaf(item: str, path: str, record: LeafRecord, shape: tuple[int, ...],
                dtype: np.dtype) -> None:
  if tuple(record.shape) != tuple(shape) or np.dtype(jnp.dtype(record.dtype)) != dtype:
    raise AbstractStateMismatchError(
        f"Leaf {item}{path}: the checkpoint holds shape {tuple(record.shape)} dtype "
        f"{record.dtype}, but the target (abstract_state / restore args) asks for shape "
        f"{tuple(shape)} dtype {dtype.name}. Pass an abstract state that matches the saved "
        "one (jax.eval_shape of your init function with the same config).")


@dataclasses.dataclass(frozen=True)
class SavedLeaf:
  """A restore target leaf: the saved shape and dtype, placed with `sharding` (what Orbax's
  `ArrayRestoreArgs(sharding=...)` asks for without a target array)."""

  sharding: jax.sharding.Sharding


def _target_spec(leaf: Any, saved: LeafRecord) -> tuple[tuple[int, ...], np.dtype, Any]:
  if isinstance(leaf, SavedLeaf):
    return tuple(saved.shape), np.dtype(saved.dtype), leaf.sharding
  shape = tuple(getattr(leaf, "shape", ()))
  dtype = np.dtype(getattr(leaf, "dtype", np.asarray(leaf).dtype))
  sharding = getattr(leaf, "sharding", None)
  return shape, dtype, sharding


def aligned_empty(nbytes: int, align: int = _ALIGN) -> np.ndarray:
  """A fresh uint8 buffer whose start is `align`-byte aligned.

  JAX's CPU client adopts aligned host buffers without a copy, so the restored arrays live in
  the very buffer the file was read into: one copy from the RAM disk, none after.
  """
  raw = np.empty(nbytes + align, dtype=np.uint8)
  start = (-raw.ctypes.data) % align
  return raw[start:start + nbytes]


def _verified_view(data: np.ndarray, record: ShardRecord, dtype: np.dtype, where: str,
                   crcs: dict[tuple[int, int], int] | None = None) -> np.ndarray:
  if record.offset + record.nbytes > data.nbytes:
    raise CorruptStepError(f"{where}: data file is shorter than its manifest says")
  raw = data[record.offset:record.offset + record.nbytes]
  value = _known_or_computed_crc(data, record.offset, record.nbytes, crcs)
  if value != record.crc32c:
    raise CorruptStepError(
        f"{where}: checksum mismatch (crc32c {value:#010x}, manifest {record.crc32c:#010x})")
  return raw.view(dtype).reshape(record.shape)


def read_data(step_dir: Path, manifest: StepManifest,
              crcs: dict[tuple[int, int], int] | None = None) -> np.ndarray:
  """The step's data file in a fresh aligned buffer.

  The checksum of every shard in the manifest is computed while the file is read (a second
  thread follows the reader, on bytes still in cache); pass `crcs` to receive them, keyed by
  (offset, nbytes), for `arrays_from_buffer` and `verify_buffer` to compare against instead of
  reading the buffer again. Comparing is still the consumer's job.
  """
  data_path = step_dir / DATA
  data = aligned_empty(manifest.data_size)
  ranges = [(shard.offset, shard.nbytes) for _, _, shard in manifest_entries(manifest)]
  try:
    computed = _read_checksumming(data_path, data, ranges)
  except FileNotFoundError as e:
    raise LocalTierError(f"{data_path}: {e}") from e
  if crcs is not None:
    crcs.update(computed)
  return data


def _read_checksumming(path: Path, buffer: np.ndarray,
                       ranges: Sequence[tuple[int, int]]) -> dict[tuple[int, int], int]:
  """Reads the file into `buffer` sequentially (one reader: parallel readers faulting in fresh
  pages contend) while a second thread computes the CRC32C of each (offset, nbytes) range as
  soon as its bytes are in: the restore costs about the longer of the two, not their sum."""
  size = buffer.nbytes
  ready = 0  # bytes of `buffer` filled so far
  failed = False
  progress = threading.Condition()
  out: dict[tuple[int, int], int] = {}

  def follow() -> None:
    for offset, nbytes in sorted(set(ranges)):
      value, start, stop = 0, offset, offset + nbytes
      while start < stop:
        piece = min(stop, start + _PIPELINE_PIECE)
        with progress:
          progress.wait_for(lambda p=piece: failed or ready >= min(p, size))
          if failed:
            return
        value = crc32c.crc32c(buffer[start:piece], value)  # releases the GIL
        start = piece
      out[(offset, nbytes)] = value

  fd = os.open(path, os.O_RDONLY)
  follower = threading.Thread(target=follow, name="mtc-crc-follow", daemon=True)
  follower.start()
  try:
    if os.fstat(fd).st_size < size:
      raise CorruptStepError(f"{path}: shorter than its manifest says ({size} bytes)")
    view = memoryview(buffer)
    done = 0
    while done < size:
      n = os.preadv(fd, [view[done:min(size, done + _PIPELINE_PIECE)]], done)
      if n <= 0:
        raise CorruptStepError(f"{path}: unexpected end of file at byte {done}")
      done += n
      with progress:
        ready = done
        progress.notify()
  except BaseException:
    with progress:
      failed = True
      progress.notify()
    raise
  finally:
    follower.join()
    os.close(fd)
  return out


def read_step(step_dir: Path, manifest: StepManifest, targets: dict[str, Any],
              crc_threads: int = 2) -> dict[str, Any]:
  """Reads items of a committed step onto the target shardings, verifying every checksum.

  `targets` maps item name to a pytree of jax.ShapeDtypeStruct / jax.Array (with shardings)
  or numpy / scalar leaves; JSON items take any value (ignored). Raises
  AbstractStateMismatchError for a target that does not match, LocalTierError when this node
  cannot serve the step (corrupt bytes, a shard it does not hold).
  """
  crcs: dict[tuple[int, int], int] = {}
  data = read_data(step_dir, manifest, crcs)
  return arrays_from_buffer(data, manifest, targets, str(step_dir), crc_threads=crc_threads,
                            crcs=crcs)


def arrays_from_buffer(data: np.ndarray, manifest: StepManifest, targets: dict[str, Any],
                       where_prefix: str, crc_threads: int = 2,
                       crcs: dict[tuple[int, int], int] | None = None,
                       memory_kind: str | None = None) -> dict[str, Any]:
  """Builds the target items from a step's data buffer laid out as `manifest` says.

  Every shard is checked against its checksum first. On CPU the arrays adopt the (aligned)
  buffer without a copy. `memory_kind` (e.g. "pinned_host") places the arrays in that memory
  of their devices instead of the default one.
  """
  jobs: list[tuple[Any, ShardRecord, np.dtype, str]] = []
  plans: dict[str, Any] = {}
  for item_name, target in targets.items():
    record = manifest.items.get(item_name)
    if record is None:
      raise AbstractStateMismatchError(
          f"Item {item_name!r} is not in local step {manifest.step} (it holds "
          f"{sorted(manifest.items)}).")
    if record.kind == "json":
      plans[item_name] = ("json", record.value)
      continue
    by_path = {leaf.path: leaf for leaf in record.leaves}
    flat, treedef = jax.tree_util.tree_flatten_with_path(target)
    want_paths = [jax.tree_util.keystr(p) for p, _ in flat]
    missing = sorted(set(want_paths) - set(by_path))
    extra = sorted(set(by_path) - set(want_paths))
    if missing or extra:
      raise AbstractStateMismatchError(
          f"Item {item_name!r}: the target tree does not match the saved tree. Leaves only in "
          f"the target: {missing[:5]}; leaves only in the checkpoint: {extra[:5]}.")
    leaf_plans = []
    for (_, leaf), path in zip(flat, want_paths, strict=True):
      rec = by_path[path]
      shape, dtype, sharding = _target_spec(leaf, rec)
      _check_leaf(item_name, path, rec, shape, dtype)
      where = f"{where_prefix}: leaf {item_name}{path}"
      if sharding is None:
        if rec.kind != "host":
          full = tuple((0, d) for d in rec.shape)
          if not any(s.index == full for s in rec.shards):
            raise LocalTierError(f"{where}: target has no sharding and this node does not "
                                 "hold the whole array")
        full_rec = next(s for s in rec.shards if s.index == tuple((0, d) for d in rec.shape))
        slot = [None]
        jobs.append((slot, full_rec, dtype, where))
        leaf_plans.append(("host", slot, rec.python_type, leaf))
      else:
        by_index = {s.index: s for s in rec.shards}
        device_slots = []
        for device, index in sharding.addressable_devices_indices_map(shape).items():
          norm = normalize_index(index, shape)
          shard_rec = by_index.get(norm)
          if shard_rec is None:
            raise LocalTierError(f"{where}: this node holds no shard {norm} for {device}; the "
                                 "target sharding differs from the saved one")
          slot = [None]
          jobs.append((slot, shard_rec, dtype, where))
          device_slots.append((device, slot))
        leaf_plans.append(("array", device_slots, sharding, shape))
    plans[item_name] = ("pytree", treedef, leaf_plans)

  def run(job):
    slot, rec, dtype, where = job
    slot[0] = _verified_view(data, rec, dtype, where, crcs)

  with concurrent.futures.ThreadPoolExecutor(crc_threads, thread_name_prefix="mtc-crc") as ex:
    list(ex.map(run, jobs))

  restored: dict[str, Any] = {}
  for item_name, plan in plans.items():
    if plan[0] == "json":
      restored[item_name] = plan[1]
      continue
    _, treedef, leaf_plans = plan
    leaves = []
    for leaf_plan in leaf_plans:
      if leaf_plan[0] == "host":
        _, slot, python_type, target_leaf = leaf_plan
        value = slot[0]
        if python_type is not None and not isinstance(target_leaf, (np.ndarray, jax.Array)):
          value = {"int": int, "float": float, "bool": bool}[python_type](value)
        leaves.append(value)
      else:
        _, device_slots, sharding, shape = leaf_plan
        if memory_kind is None:
          arrays = [jax.device_put(slot[0], device) for device, slot in device_slots]
        else:
          sharding = sharding.with_memory_kind(memory_kind)
          arrays = [jax.device_put(slot[0], jax.sharding.SingleDeviceSharding(
              device, memory_kind=memory_kind)) for device, slot in device_slots]
        leaves.append(jax.make_array_from_single_device_arrays(shape, sharding, arrays))
    restored[item_name] = jax.tree_util.tree_unflatten(treedef, leaves)
  return restored


def manifest_entries(manifest: StepManifest) -> list[tuple[str, LeafRecord, ShardRecord]]:
  """Every shard of a manifest as (item, leaf, shard), in manifest order (its ordinal)."""
  return [(name, leaf, shard) for name, item in manifest.items.items() for leaf in item.leaves
          for shard in leaf.shards]


def shard_crc(data: np.ndarray, offset: int, nbytes: int) -> int:
  return _crc_ranges(data, [(offset, nbytes)])[0]


def _known_or_computed_crc(data: np.ndarray, offset: int, nbytes: int,
                           crcs: dict[tuple[int, int], int] | None) -> int:
  """The checksum `read_data` computed for these bytes, else computed now."""
  known = (crcs or {}).get((offset, nbytes))
  return known if known is not None else shard_crc(data, offset, nbytes)


def verify_buffer(data: np.ndarray, manifest: StepManifest, where: str,
                  crcs: dict[tuple[int, int], int] | None = None) -> None:
  """Checks every shard of `data` (laid out as `manifest` says); CorruptStepError if not.
  `crcs`: checksums already computed from these bytes (`read_data`)."""
  if data.nbytes < manifest.data_size:
    raise CorruptStepError(f"{where}: {data.nbytes} bytes, manifest says {manifest.data_size}")
  for item_name, leaf, shard in manifest_entries(manifest):
    got = _known_or_computed_crc(data, shard.offset, shard.nbytes, crcs)
    if got != shard.crc32c:
      raise CorruptStepError(
          f"{where}: leaf {item_name}{leaf.path} shard {shard.index}: checksum mismatch "
          f"(crc32c {got:#010x}, manifest {shard.crc32c:#010x})")


def verify_step(step_dir: Path) -> StepManifest:
  """Re-checks every checksum of a committed step; raises LocalTierError on any problem."""
  manifest = read_manifest(step_dir)
  data_path = step_dir / DATA
  size = data_path.stat().st_size if data_path.exists() else -1
  if size != manifest.data_size:
    raise CorruptStepError(f"{data_path}: {size} bytes, manifest says {manifest.data_size}")
  data = np.memmap(data_path, dtype=np.uint8, mode="r") if size else np.empty(0, np.uint8)
  for item_name, item in manifest.items.items():
    for leaf in item.leaves:
      for shard in leaf.shards:
        got = _crc_ranges(data, [(shard.offset, shard.nbytes)])[0]
        if got != shard.crc32c:
          raise CorruptStepError(
              f"{step_dir}: leaf {item_name}{leaf.path} shard {shard.index}: checksum "
              f"mismatch (crc32c {got:#010x}, manifest {shard.crc32c:#010x})")
  return manifest
