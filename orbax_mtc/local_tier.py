"""The RAM-disk tier: this node's step folders, written raw and committed atomically.

Layout of one node's local directory::

  <local>/<step>/data.bin        the node's shard bytes, back to back
  <local>/<step>/manifest.json   every leaf: global shape, dtype, saved sharding, and per shard
                                 its index, offset, length and CRC32C; signed with the CRC32C
                                 of its own canonical JSON and checked field by field on reading
  <local>/.tmp-<step>-<id>/      a step being written (never read)
  <local>/.spare-<id>/           a retired step whose data file the next save overwrites

A step folder only ever appears by renaming a complete temporary folder, so a process killed
at any instant leaves either the whole step or nothing restore would pick. Files of the step
that retention retires are overwritten in place by the next save: on tmpfs overwriting pages
that already exist is about twice as fast as writing a new file. The weights are private:
folders are created 0700 and files 0600 (by default), and a step-named symbolic link is never
followed.

A typed PRNG key array (dtype key<fry>, key<urbg>...: a JAX extended dtype) is stored as
Orbax stores it: its key data (uint32, the key array's shape plus the implementation's key
shape; shard indices span both), with the implementation's name in the leaf's `key_impl`. A
restore rebuilds each device's shard with `jax.random.wrap_key_data` of that implementation.
The leaf's `sharding` describes the key array's own sharding, which a restore target carries.

This module does file I/O only. It never issues a collective, so its writer runs safely in a
background thread.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import ctypes
import dataclasses
import errno
import functools
import itertools
import json
import math
import mmap
import os
import re
import reprlib
import shutil
import stat
import sys
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import google_crc32c
import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from orbax.checkpoint import args as ocp_args

from orbax_mtc.files import (  # noqa: F401  (re-exported for the tiers that use them)
  check_owner,
  fsync_dir,
  make_private_dir,
  write_private_file,
)

FORMAT = "orbax-mtc/local/2"
MANIFEST_CRC_KEY = "manifest_crc32c"
MANIFEST = "manifest.json"
DATA = "data.bin"
# A peer copy's folder (peer_store) holds this too: its data file is the received stream, not
# the manifest's layout, so its size is checked against copy.json instead.
PEER_COPY_META = "copy.json"
TMP_PREFIX = ".tmp-"
SPARE_PREFIX = ".spare-"
# Far above one node's RAM, far below sizes that break int64 arithmetic in numpy or the OS.
MAX_DATA_SIZE = 1 << 50
_MAX_STEP = (1 << 63) - 1  # steps travel as int64 in collectives
_MAX_PROCESSES = 1 << 24
_MAX_LEAF_BYTES = 1 << 62
_MAX_DESCRIPTION = 1000  # characters of a sharding description kept in the manifest
_ALIGN = 64
_WRITE_CHUNK = 64 << 20
_IOV_MAX = 1024  # Linux: views per pwritev call
_CRC_CHUNK = 16 << 20
_CRC_NOGIL_MIN = 64 << 10  # below this a call is shorter than handing the GIL over
_PIPELINE_PIECE = 4 << 20  # read, then checksum, this much at a time: it stays in cache
_KEY_IMPL_NAME = re.compile(r"[A-Za-z0-9_]{1,64}")  # a PRNG implementation's name

Index = tuple[tuple[int, int], ...]


def _require_crc32c_extension(implementation: str) -> None:
  """ImportError unless google-crc32c runs its C extension. Where it cannot import it, it falls
  back to pure Python with only a warning: about 3 MiB/s, so a save would seem to hang."""
  if implementation != "c":
    raise ImportError(
        "google-crc32c is using its pure-Python implementation (about 3 MiB/s: minutes per GiB "
        "of checkpoint) because its C extension could not be imported. Install a "
        "google-crc32c wheel for this platform, or build it where a C compiler is available.")


def _crc32c_extend_nogil() -> Callable[[int, int, int], int] | None:
  """`crc32c_extend(crc, address, length)` of the C library inside google-crc32c, called through
  ctypes, which releases the GIL for the call. google_crc32c.extend keeps the GIL for anything
  but `bytes`, so checksum threads would stall the writer, the reader and the training loop.
  None where the extension's handle does not resolve the symbol (Windows, other builds)."""
  try:
    function = ctypes.CDLL(sys.modules[google_crc32c.extend.__module__].__file__).crc32c_extend
  except (AttributeError, KeyError, OSError, TypeError):
    return None
  function.restype = ctypes.c_uint32
  function.argtypes = (ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t)
  probe = bytes(range(256)) * 3
  if function(0x1234, probe, len(probe)) != google_crc32c.extend(0x1234, probe):
    return None
  return function


_require_crc32c_extension(google_crc32c.implementation)
_CRC32C_EXTEND_NOGIL = _crc32c_extend_nogil()
if _CRC32C_EXTEND_NOGIL is None:
  warnings.warn("orbax-mtc: google-crc32c's crc32c_extend is not reachable through ctypes; "
                "checksums hold the GIL (correct, but they stall other Python threads)",
                RuntimeWarning, stacklevel=1)


def _crc_extend(value: int, data: np.ndarray) -> int:
  """CRC32C of `data` (C-contiguous) continuing `value`; large data without holding the GIL."""
  if data.nbytes < _CRC_NOGIL_MIN or _CRC32C_EXTEND_NOGIL is None:
    return google_crc32c.extend(value, data)
  if not data.flags.c_contiguous:  # the address alone would checksum other bytes
    raise ValueError("CRC32C of an array that is not C-contiguous")
  return _CRC32C_EXTEND_NOGIL(value, data.ctypes.data, data.nbytes)


class LocalTierError(RuntimeError):
  """A local step cannot be used (missing, partial, corrupt): restore falls back."""


class CorruptStepError(LocalTierError):
  """Bytes on the RAM disk do not match their checksum."""


class ManifestError(LocalTierError):
  """A manifest is unreadable, inconsistent, or does not belong where it was found."""


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
  sharding: str | None = None  # the saved sharding, described (`describe_sharding`)
  # A typed PRNG key leaf: its implementation ("threefry2x32", "unsafe_rbg"...); `shape` and
  # `dtype` are then those of its key data (the key array's shape + the key shape, uint32).
  key_impl: str | None = None


@dataclasses.dataclass(frozen=True)
class ItemRecord:
  kind: str  # "pytree" or "json"
  leaves: tuple[LeafRecord, ...] = ()
  value: Any = None  # the JSON value of a "json" item


def manifest_checksum(fields: dict[str, Any]) -> int:
  """The manifest checksum of `fields` (the parsed manifest less MANIFEST_CRC_KEY): CRC32C
  of their canonical JSON (sorted keys, compact separators)."""
  return google_crc32c.value(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode())


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
    """The manifest as JSON, signed with the CRC32C of its canonical form."""
    def leaf(r: LeafRecord) -> dict[str, Any]:
      out = {"path": r.path, "kind": r.kind, "shape": list(r.shape), "dtype": r.dtype,
             "python_type": r.python_type, "keys": [list(k) for k in r.keys],
             "sharding": r.sharding,
             "shards": [[[list(d) for d in s.index], s.offset, s.nbytes, s.crc32c]
                        for s in r.shards]}
      if r.key_impl is not None:  # only then: manifests of other leaves read as before
        out["key_impl"] = r.key_impl
      return out
    items = {name: {"kind": it.kind, "leaves": [leaf(x) for x in it.leaves], "value": it.value}
             for name, it in self.items.items()}
    fields = {"format": FORMAT, "step": self.step, "process_index": self.process_index,
              "process_count": self.process_count, "data_size": self.data_size,
              "created_at": self.created_at, "default_item": self.default_item,
              "items": items}
    # Signed as a reader will see it: JSON turns tuples into lists and dict keys into strings.
    fields = json.loads(json.dumps(fields))
    fields[MANIFEST_CRC_KEY] = manifest_checksum(fields)
    return json.dumps(fields)

  @classmethod
  def from_json(cls, text: str | bytes, where: str = "manifest") -> StepManifest:
    """Parses and checks a manifest: its checksum, then every field's type and range.

    Raises ManifestError naming `where` (the file) and the problem, never anything else.
    """
    if not isinstance(text, (str, bytes, bytearray)):
      raise ManifestError(f"{where}: expected JSON text, got {type(text).__name__}")
    try:
      raw = json.loads(text)  # a flipped bit may break UTF-8 too: a ValueError
    except (ValueError, RecursionError) as e:
      raise ManifestError(f"{where} is unreadable: {e}") from e
    if not isinstance(raw, dict):
      raise ManifestError(f"{where}: expected a JSON object, got {_json_type(raw)}")
    fmt = raw.get("format")
    if fmt != FORMAT:
      if isinstance(fmt, str) and fmt.startswith("orbax-mtc/local/"):
        raise ManifestError(f"{where}: manifest format {fmt!r} is from another version of "
                            f"orbax-mtc; this version reads {FORMAT!r} only")
      raise ManifestError(f"{where}: unknown manifest format {_show(fmt)}, expected {FORMAT!r}")
    stored = raw.pop(MANIFEST_CRC_KEY, None)
    if type(stored) is not int or not 0 <= stored < 1 << 32:
      raise ManifestError(f"{where}: field {MANIFEST_CRC_KEY!r} holds {_show(stored)}, expected "
                          "a CRC32C (an integer in 0..2**32-1)")
    try:
      computed = manifest_checksum(raw)
    except (ValueError, TypeError, RecursionError) as e:
      raise ManifestError(f"{where} is unreadable: {e}") from e
    if computed != stored:
      raise ManifestError(f"{where}: manifest checksum mismatch (crc32c {computed:#010x}, "
                          f"stored {stored:#010x}): the file was changed or damaged")
    return _ManifestParser(where).manifest(raw)


def _json_type(value: Any) -> str:
  names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
           int: "an integer", float: "a number", type(None): "null"}
  return names.get(type(value), type(value).__name__)


def _show(value: Any) -> str:
  return reprlib.repr(value)


def _np_dtype(name: str) -> np.dtype:
  """The numpy dtype a manifest's dtype name stands for (bfloat16 and friends included)."""
  return np.dtype(jnp.dtype(name))


def _checked_dtype(name: Any) -> np.dtype | None:
  """The dtype for a manifest dtype name, or None when the name is not one stage() writes."""
  if not isinstance(name, str):
    return None
  try:
    dtype = _np_dtype(name)
  except (TypeError, ValueError, KeyError, AttributeError, SyntaxError):
    return None
  # The name must be numpy's own (no byte order or alias lost), of plain fixed-size elements.
  if (dtype.name != name or dtype.itemsize <= 0 or dtype.hasobject or dtype.fields is not None
      or dtype.subdtype is not None or dtype.kind in "OSUMm"):
    return None
  return dtype


def _align(n: int) -> int:
  return -(-n // _ALIGN) * _ALIGN


class _ManifestParser:
  """Turns the parsed JSON of a manifest into a StepManifest, checking every field."""

  def __init__(self, where: str):
    self.where = where

  def fail(self, what: str, value: Any, expected: str) -> ManifestError:
    return ManifestError(f"{self.where}: {what} holds {_show(value)}, expected {expected}")

  def field(self, d: dict[str, Any], key: str, what: str) -> Any:
    if key not in d:
      raise ManifestError(f"{self.where}: {what} has no field {key!r}")
    return d[key]

  def integer(self, value: Any, what: str, lo: int, hi: int) -> int:
    # JSON true/false are bools, which Python counts as ints: not here.
    if type(value) is not int or not lo <= value <= hi:
      raise self.fail(what, value, f"an integer in {lo}..{hi}")
    return value

  def sequence(self, value: Any, what: str, length: int | None = None) -> list[Any]:
    if not isinstance(value, list) or (length is not None and len(value) != length):
      raise self.fail(what, value, "a list" if length is None else f"a list of {length}")
    return value

  def manifest(self, raw: dict[str, Any]) -> StepManifest:
    top = "the manifest"
    step = self.integer(self.field(raw, "step", top), "'step'", 0, _MAX_STEP)
    count = self.integer(self.field(raw, "process_count", top), "'process_count'", 1,
                         _MAX_PROCESSES)
    index = self.integer(self.field(raw, "process_index", top), "'process_index'", 0, count - 1)
    data_size = self.integer(self.field(raw, "data_size", top), "'data_size'", 0, MAX_DATA_SIZE)
    created_at = self.field(raw, "created_at", top)
    if type(created_at) not in (int, float) or not math.isfinite(created_at):
      raise self.fail("'created_at'", created_at, "a finite number (seconds since the epoch)")
    default_item = self.field(raw, "default_item", top)
    if not isinstance(default_item, bool):
      raise self.fail("'default_item'", default_item, "true or false")
    items_raw = self.field(raw, "items", top)
    if not isinstance(items_raw, dict):
      raise self.fail("'items'", items_raw, "an object of item name -> item")
    items = {name: self.item(name, it, data_size) for name, it in items_raw.items()}
    self.check_layout(items, data_size)
    return StepManifest(step=step, process_index=index, process_count=count, items=items,
                        data_size=data_size, created_at=float(created_at),
                        default_item=default_item)

  def item(self, name: str, it: Any, data_size: int) -> ItemRecord:
    what = f"item {name!r}"
    if not isinstance(it, dict):
      raise self.fail(what, it, "an object")
    kind = self.field(it, "kind", what)
    if kind not in ("pytree", "json"):
      raise self.fail(f"{what} 'kind'", kind, "'pytree' or 'json'")
    leaves_raw = self.sequence(self.field(it, "leaves", what), f"{what} 'leaves'")
    if kind == "json" and leaves_raw:
      raise self.fail(f"{what} 'leaves'", leaves_raw, "no leaves in a JSON item")
    leaves = tuple(self.leaf(what, i, d, data_size) for i, d in enumerate(leaves_raw))
    paths = [leaf.path for leaf in leaves]
    if len(set(paths)) != len(paths):
      raise ManifestError(f"{self.where}: {what} lists a leaf path twice")
    return ItemRecord(kind=kind, leaves=leaves, value=it.get("value"))

  def leaf(self, item: str, i: int, d: Any, data_size: int) -> LeafRecord:
    what = f"{item} leaf {i}"
    if not isinstance(d, dict):
      raise self.fail(what, d, "an object")
    path = self.field(d, "path", what)
    if not isinstance(path, str):
      raise self.fail(f"{what} 'path'", path, "a string")
    what = f"{item} leaf {path!r}"
    kind = self.field(d, "kind", what)
    if kind not in ("array", "host"):
      raise self.fail(f"{what} 'kind'", kind, "'array' or 'host'")
    shape = tuple(self.integer(x, f"{what} 'shape'", 0, _MAX_LEAF_BYTES)
                  for x in self.sequence(self.field(d, "shape", what), f"{what} 'shape'"))
    dtype_name = self.field(d, "dtype", what)
    dtype = _checked_dtype(dtype_name)
    if dtype is None:
      raise self.fail(f"{what} 'dtype'", dtype_name, "the name of a numeric dtype")
    if math.prod(shape) * dtype.itemsize > _MAX_LEAF_BYTES:
      raise self.fail(f"{what} 'shape'", list(shape), f"at most {_MAX_LEAF_BYTES} bytes")
    python_type = d.get("python_type")
    if python_type not in (None, "int", "float", "bool") or (
        python_type is not None and (kind != "host" or shape != ())):
      raise self.fail(f"{what} 'python_type'", python_type,
                      "null, or 'int'/'float'/'bool' for a scalar host leaf")
    keys = []
    for key in self.sequence(d.get("keys", []), f"{what} 'keys'"):
      pair = self.sequence(key, f"{what} key", 2)
      if not isinstance(pair[0], str) or not isinstance(pair[1], (str, int, float, type(None))):
        raise self.fail(f"{what} key", key, "a [kind, key] pair of a string and a scalar")
      keys.append((pair[0], pair[1]))
    sharding = d.get("sharding")
    if sharding is not None and not isinstance(sharding, str):
      raise self.fail(f"{what} 'sharding'", sharding, "a string or null")
    key_impl = d.get("key_impl")
    if "key_impl" in d and (not isinstance(key_impl, str) or kind != "array"
                            or not _KEY_IMPL_NAME.fullmatch(key_impl)):
      raise self.fail(f"{what} 'key_impl'", key_impl, "absent, or for an array leaf the name of "
                      "a PRNG implementation (1 to 64 of A-Z a-z 0-9 _)")
    shards_raw = self.sequence(self.field(d, "shards", what), f"{what} 'shards'")
    shards = tuple(self.shard(f"{what} shard {i}", s, shape, dtype, data_size)
                   for i, s in enumerate(shards_raw))
    if len({s.index for s in shards}) != len(shards):
      raise ManifestError(f"{self.where}: {what} lists a shard index twice")
    if kind == "host" and [s.index for s in shards] != [tuple((0, n) for n in shape)]:
      raise ManifestError(f"{self.where}: {what} is a host value but its shards are not the "
                          "whole array")
    return LeafRecord(path=path, kind=kind, shape=shape, dtype=dtype_name, shards=shards,
                      python_type=python_type, keys=tuple(keys), sharding=sharding,
                      key_impl=key_impl)

  def shard(self, what: str, s: Any, shape: tuple[int, ...], dtype: np.dtype,
            data_size: int) -> ShardRecord:
    index_raw, offset, nbytes, crc = self.sequence(s, what, 4)
    index = []
    for dim, bounds in zip(shape, self.sequence(index_raw, f"{what} index", len(shape)),
                           strict=True):
      start, stop = self.sequence(bounds, f"{what} index", 2)
      start = self.integer(start, f"{what} index start", 0, dim)
      stop = self.integer(stop, f"{what} index stop", start, dim)
      index.append((start, stop))
    offset = self.integer(offset, f"{what} offset", 0, data_size)
    want = math.prod(b - a for a, b in index) * dtype.itemsize
    if type(nbytes) is not int or nbytes != want:
      raise self.fail(f"{what} nbytes", nbytes, f"{want} (its index's size times the itemsize)")
    if offset + nbytes > data_size:
      raise ManifestError(f"{self.where}: {what} ends at byte {offset + nbytes}, beyond "
                          f"'data_size' {data_size}")
    crc = self.integer(crc, f"{what} crc32c", 0, (1 << 32) - 1)
    return ShardRecord(index=tuple(index), offset=offset, nbytes=nbytes, crc32c=crc)

  def check_layout(self, items: dict[str, ItemRecord], data_size: int) -> None:
    """Shards never share bytes, and data.bin is no larger than its shards laid out back to
    back (64-byte aligned, as `stage` writes them): a size no shard backs is refused."""
    ranges = sorted((s.offset, s.nbytes, f"{name}{leaf.path} {s.index}")
                    for name, it in items.items() for leaf in it.leaves for s in leaf.shards
                    if s.nbytes)
    for (a_off, a_len, a), (b_off, _, b) in itertools.pairwise(ranges):
      if a_off + a_len > b_off:
        raise ManifestError(f"{self.where}: shards {a} and {b} overlap in {DATA}")
    packed = sum(_align(n) for _, n, _ in ranges)
    if data_size > packed:
      raise ManifestError(f"{self.where}: 'data_size' {data_size} exceeds the {packed} bytes "
                          "its shards take")


def validate_for(manifest: StepManifest, *, where: str = "manifest", step: int | None = None,
                 process_index: int | None = None, process_count: int | None = None,
                 data_file_size: int | None = None) -> None:
  """Checks a parsed manifest against where it was found and who reads it.

  `step`: the folder's step; `process_index`/`process_count`: the reading process's;
  `data_file_size`: the size of the data file beside it. ManifestError on a mismatch,
  CorruptStepError when the data file is shorter than the manifest says.
  """
  for name, expected, why in (("step", step, "the folder's name"),
                              ("process_index", process_index, "this process's index"),
                              ("process_count", process_count, "this job's process count")):
    held = getattr(manifest, name)
    if expected is not None and held != expected:
      raise ManifestError(f"{where}: field {name!r} holds {held}, expected {expected} ({why})")
  if data_file_size is not None and data_file_size < manifest.data_size:
    raise CorruptStepError(f"{where}: {DATA} holds {data_file_size} bytes, shorter than the "
                           f"{manifest.data_size} its manifest says")


# ----------------------------------------------------------------------------- PRNG keys


def is_key_dtype(dtype: Any) -> bool:
  """Whether `dtype` is a typed PRNG key dtype (key<fry>, key<urbg>...)."""
  try:
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
  except TypeError:
    return False


@functools.lru_cache(maxsize=64)
def key_spec(impl: str) -> tuple[Any, tuple[int, ...], np.dtype]:
  """(key dtype, key data shape, key data dtype) of one key of PRNG implementation `impl`
  (named as `str(jax.random.key_impl(key))` names it); ValueError when this JAX lacks it."""
  try:
    key = jax.eval_shape(functools.partial(jax.random.key, 0, impl=impl))
  except (ValueError, TypeError, KeyError) as e:
    raise ValueError(f"PRNG implementation {impl!r} is unknown to this JAX ({jax.__version__})"
                     f": {e}") from e
  data = jax.eval_shape(jax.random.key_data, key)
  return key.dtype, tuple(data.shape), np.dtype(data.dtype)


@functools.lru_cache(maxsize=64)
def key_data_dims(dtype: Any) -> tuple[int, ...]:
  """The dimensions a key dtype's data adds after the key array's own; () for other dtypes."""
  if not is_key_dtype(dtype):
    return ()
  return tuple(jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct((), dtype)).shape)


def stored_spec(shape: Sequence[int], dtype: Any) -> tuple[tuple[int, ...], np.dtype]:
  """The shape and dtype a leaf of `shape` and `dtype` is stored as (here and by Orbax): a
  PRNG key leaf as its key data, other leaves as they are."""
  if is_key_dtype(dtype):
    data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(tuple(shape), dtype))
    return tuple(data.shape), np.dtype(data.dtype)
  return tuple(shape), np.dtype(dtype)


def saved_spec(record: LeafRecord) -> tuple[tuple[int, ...], Any, tuple[int, ...]]:
  """(shape, dtype, key data dims) of a saved leaf as a restore target states it: for a PRNG
  key leaf the key array's shape and key dtype, and the dims its data adds; for others the
  stored shape and dtype, and (). ValueError when this JAX lacks the key implementation or
  the stored data is not the key data of that implementation."""
  if record.key_impl is None:
    return tuple(record.shape), _np_dtype(record.dtype), ()
  key_dtype, data_dims, data_dtype = key_spec(record.key_impl)
  n = len(record.shape) - len(data_dims)
  if n < 0 or tuple(record.shape[n:]) != data_dims or _np_dtype(record.dtype) != data_dtype:
    raise ValueError(f"its data, shape {tuple(record.shape)} dtype {record.dtype}, is not "
                     f"{record.key_impl!r} key data (shape (...) + {data_dims}, dtype "
                     f"{data_dtype.name})")
  return tuple(record.shape[:n]), key_dtype, data_dims


def _whole(dims: Sequence[int]) -> Index:
  return tuple((0, n) for n in dims)


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


def _key_impl_of(path: str, leaf: jax.Array) -> str:
  """The name of a PRNG key leaf's implementation, checked to name it again on restore."""
  if not is_key_dtype(leaf.dtype):
    raise TypeError(f"Leaf {path} has the extended dtype {leaf.dtype}, which the RAM tier "
                    "cannot store (of extended dtypes it stores typed PRNG keys only).")
  impl = str(jax.random.key_impl(leaf))
  try:
    if not _KEY_IMPL_NAME.fullmatch(impl) or key_spec(impl)[0].name != leaf.dtype.name:
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


def describe_sharding(sharding: Any) -> str:
  """A readable description of a sharding, for the manifest and for error messages."""
  if isinstance(sharding, jax.sharding.NamedSharding):
    # The device order too: the same axes over devices in another order place other shards
    # on each process (another mesh layout), which the axes alone would not tell.
    devices = [int(d.id) for d in sharding.mesh.devices.flat]
    text = (f"NamedSharding(mesh={dict(sharding.mesh.shape)!r}, spec={sharding.spec!r}, "
            f"devices={devices})")
  else:
    text = repr(sharding)
  return text if len(text) <= _MAX_DESCRIPTION else text[:_MAX_DESCRIPTION - 3] + "..."


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

  Attribute and custom-node keys become dict keys; JSON items give their value; PRNG key
  leaves have their key shape and key dtype. Raises ManifestError when the leaves' key paths
  contradict each other, or for PRNG keys of an implementation this JAX lacks.
  """
  result: dict[str, Any] = {}
  for name, item in manifest.items.items():
    if item.kind == "json":
      result[name] = item.value
      continue
    root: Any = None
    for leaf in item.leaves:
      try:
        shape, dtype, _ = saved_spec(leaf)
      except ValueError as e:
        raise ManifestError(f"item {name!r}: leaf {leaf.path!r} holds PRNG keys: {e}") from e
      spec = jax.ShapeDtypeStruct(shape, dtype)
      if not leaf.keys:
        if root is not None:
          raise ManifestError(f"item {name!r}: leaf {leaf.path!r} has no key path but the item "
                              "has other leaves")
        root = spec
        continue
      if root is None:
        root = {}
      node = root
      for i, (_, key) in enumerate(leaf.keys):
        if not isinstance(node, dict):
          raise ManifestError(f"item {name!r}: the key path of leaf {leaf.path!r} runs "
                              "through another leaf")
        if i == len(leaf.keys) - 1:
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
      key_impl = None
      if _is_array_leaf(leaf):
        sharding = describe_sharding(leaf.sharding)
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.extended):
          key_impl = _key_impl_of(path, leaf)
          leaf = jax.random.key_data(leaf)  # its shards: uint32, indexed over the data's dims
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
        sharding = None
      shards = []
      for index, source in sources:
        shard_shape = tuple(b - a for a, b in index)
        nbytes = math.prod(shard_shape) * dtype.itemsize
        pending.append(_PendingShard(source, offset, nbytes, index, dtype, shard_shape))
        shards.append(ShardRecord(index=index, offset=offset, nbytes=nbytes, crc32c=0))
        offset += -(-nbytes // _ALIGN) * _ALIGN
      records.append(LeafRecord(path=path, kind=kind, shape=shape, dtype=dtype.name,
                                shards=tuple(shards), python_type=python_type,
                                keys=_encode_key_path(key_path), sharding=sharding,
                                key_impl=key_impl))
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
  """A committed step folder's name: ASCII decimal digits only (not "²" or "٣")."""
  return name.isascii() and name.isdigit()


_warned_links: set[str] = set()


def warn_link_skipped(path: str) -> None:
  """Logs, once per path, that a step-named symbolic link was skipped."""
  if path not in _warned_links:
    _warned_links.add(path)
    logging.warning("orbax-mtc: ignoring %s: a step-named symbolic link (step folders are "
                    "never followed out of the local directory)", path)


def open_step_file(step_dir: Path, name: str, flags: int = os.O_RDONLY, mode: int = 0o600) -> int:
  """A file descriptor for `step_dir/name`, following no symbolic link on the way.

  LocalTierError when the step folder is a link or not a folder; OSError (FileNotFoundError,
  or ELOOP for a linked file) from opening the file.
  """
  if os.path.islink(step_dir):
    raise LocalTierError(f"{step_dir} is a symbolic link: step folders are never followed")
  try:
    dir_fd = os.open(step_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
  except FileNotFoundError as e:
    raise LocalTierError(f"{step_dir} does not exist: not a committed step") from e
  except NotADirectoryError as e:
    raise LocalTierError(f"{step_dir} is not a folder") from e
  except OSError as e:
    if e.errno == errno.ELOOP:  # became a link since the check above
      raise LocalTierError(f"{step_dir} is a symbolic link: step folders are never followed") \
          from e
    raise
  try:
    return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)
  finally:
    os.close(dir_fd)


def _open_regular(step_dir: Path, name: str) -> int:
  """`open_step_file` for reading a regular file; LocalTierError for a link or a folder."""
  try:
    fd = open_step_file(step_dir, name)
  except OSError as e:
    if e.errno == errno.ELOOP:
      raise LocalTierError(f"{step_dir / name} is a symbolic link: refused") from e
    raise
  if not stat.S_ISREG(os.fstat(fd).st_mode):
    os.close(fd)
    raise LocalTierError(f"{step_dir / name} is not a regular file")
  return fd


def read_step_file(step_dir: Path, name: str) -> bytes:
  """The bytes of a small file of a step folder (manifest, copy record), links refused."""
  fd = _open_regular(step_dir, name)
  try:
    with os.fdopen(fd, "rb", closefd=False) as f:
      return f.read()
  finally:
    os.close(fd)


def read_manifest(step_dir: Path, *, process_index: int | None = None,
                  process_count: int | None = None) -> StepManifest:
  """The manifest of a committed step folder, checked against the folder.

  Beyond the checks of `StepManifest.from_json`: the folder is no symbolic link, its name is
  the manifest's step, its data file holds at least `data_size` bytes (a peer copy's data
  file, a stream, is checked by peer_store instead) and, when given, the process index and
  count match. Raises LocalTierError (ManifestError, CorruptStepError) on any problem.
  """
  step_dir = Path(step_dir)
  path = step_dir / MANIFEST
  if not is_step_name(step_dir.name):
    raise ManifestError(f"{path}: folder name {step_dir.name!r} is not a step number")
  try:
    raw = read_step_file(step_dir, MANIFEST)
  except FileNotFoundError as e:
    raise LocalTierError(f"{step_dir} has no {MANIFEST}: not a committed step") from e
  except OSError as e:
    raise LocalTierError(f"{path}: {e}") from e
  manifest = StepManifest.from_json(raw, where=str(path))
  data_size = None
  if not os.path.lexists(step_dir / PEER_COPY_META):
    try:
      fd = _open_regular(step_dir, DATA)
    except FileNotFoundError as e:
      raise LocalTierError(f"{step_dir} has no {DATA}: not a committed step") from e
    except OSError as e:
      raise LocalTierError(f"{step_dir / DATA}: {e}") from e
    try:
      data_size = os.fstat(fd).st_size
    finally:
      os.close(fd)
  validate_for(manifest, where=str(path), step=int(step_dir.name), process_index=process_index,
               process_count=process_count, data_file_size=data_size)
  return manifest


def committed_steps(root: Path) -> list[int]:
  """Steps with a committed folder (a real folder, not a link, with a manifest), oldest
  first."""
  if not root.is_dir():
    return []
  steps = []
  with os.scandir(root) as entries:
    for entry in entries:
      if not is_step_name(entry.name):
        continue
      if entry.is_symlink():
        warn_link_skipped(entry.path)
        continue
      try:
        is_committed = entry.is_dir(follow_symlinks=False) and stat.S_ISREG(
            os.lstat(os.path.join(entry.path, MANIFEST)).st_mode)
      except OSError:  # no manifest, or the folder went away meanwhile
        continue
      if is_committed:
        steps.append(int(entry.name))
  return sorted(steps)


def _crc(data: np.ndarray) -> int:
  value = 0
  for start in range(0, data.nbytes, _CRC_CHUNK):
    value = _crc_extend(value, data[start:start + _CRC_CHUNK])
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
  """This node's RAM-disk step folders: write, commit, list, read, verify, retire.

  Model weights are private: folders are created with `dir_mode`, files with `file_mode`
  (whatever the umask), and a local directory owned by another user is refused. When
  `process_index` / `process_count` are given, `manifest` checks them too.
  """

  def __init__(self, directory: Path, *, max_to_keep: int | None,
               on_commit: Callable[[int], None] | None = None, reuse_files: bool = True,
               process_index: int | None = None, process_count: int | None = None,
               dir_mode: int = 0o700, file_mode: int = 0o600):
    self.directory = Path(directory)
    self.max_to_keep = max_to_keep
    self._on_commit = on_commit
    # False when another program (GKE's replicator) may still be copying a retired step:
    # its files must then never be overwritten in place.
    self.reuse_files = reuse_files
    self.process_index = process_index
    self.process_count = process_count
    self.dir_mode = dir_mode
    self.file_mode = file_mode
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
      root.parent.mkdir(parents=True, exist_ok=True)
      created = make_private_dir(root, self.dir_mode)
    except OSError as e:
      raise ValueError(f"Cannot create local_directory {root}: {e.strerror}. Choose a writable "
                       "folder on the RAM disk (e.g. /dev/shm/ckpt).") from e
    check_owner(root, "local_directory")
    if not os.access(root, os.W_OK | os.X_OK):
      raise ValueError(f"local_directory {root} is not writable by this process (uid "
                       f"{os.getuid()}). Fix its permissions or choose another folder.")
    mode = stat.S_IMODE(os.stat(root).st_mode)
    if not created and mode & ~self.dir_mode & 0o077:
      logging.warning("orbax-mtc: local_directory %s has mode %o: other users may read the "
                      "saved weights (chmod %o %s to prevent it)", root, mode, self.dir_mode,
                      root)
    spares = []
    for entry in root.iterdir():
      if entry.name.startswith((TMP_PREFIX, SPARE_PREFIX)) and entry.is_symlink():
        entry.unlink()  # never ours: removing the link touches nothing it points to
      elif entry.name.startswith(TMP_PREFIX):
        logging.info("orbax-mtc: removing interrupted local save %s", entry)
        shutil.rmtree(entry, ignore_errors=True)
      elif entry.name.startswith(SPARE_PREFIX):
        spares.append(entry)
    for extra in spares[1:]:
      shutil.rmtree(extra, ignore_errors=True)

  # -- writing (background thread: file I/O only)

  def write(self, staged: StagedStep, process_index: int, process_count: int) -> Path:
    """Writes and commits one staged step, applies retention, then calls `on_commit` with
    the newest committed step; returns the committed folder.

    `on_commit` gets the newest step, not necessarily `staged.step`: a forced save of a step
    older than those kept is retired again at once, and whatever `on_commit` points at it
    (the LKG link) must not dangle.
    """
    root = self.directory
    final = root / str(staged.step)
    tmp = root / f"{TMP_PREFIX}{staged.step}-{uuid.uuid4().hex}"
    spare = self._take_spare()
    if spare is not None:
      os.rename(spare, tmp)
      os.chmod(tmp, self.dir_mode)
      for extra in tmp.iterdir():
        if extra.name != DATA or not stat.S_ISREG(extra.lstat().st_mode):
          if extra.is_dir() and not extra.is_symlink():
            shutil.rmtree(extra)
          else:
            extra.unlink()
    else:
      make_private_dir(tmp, self.dir_mode, exist_ok=False)
    ranges = [(s.offset, s.nbytes) for it in staged.items.values() for leaf in it.leaves
              for s in leaf.shards]
    crcs = self._crc_pool.submit(_crc_staged, staged, ranges)
    data_path = tmp / DATA
    try:
      fd = os.open(data_path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                   self.file_mode)
      try:
        os.fchmod(fd, self.file_mode)  # the umask, or a reused spare's old mode
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
      write_private_file(manifest_tmp, manifest.to_json().encode(), self.file_mode)
      os.rename(manifest_tmp, tmp / MANIFEST)
      fsync_dir(tmp)
      with self._lock:
        if final.exists() or final.is_symlink():
          raise FileExistsError(f"local step {final} already exists")
        os.rename(tmp, final)  # the commit point
        fsync_dir(root)
    except BaseException:
      shutil.rmtree(tmp, ignore_errors=True)
      raise
    try:
      self.apply_retention()
    finally:
      if self._on_commit is not None:
        steps = self.steps()
        if steps:
          self._on_commit(steps[-1])
    return final

  def _take_spare(self) -> Path | None:
    with self._lock:
      for entry in self.directory.iterdir():
        if entry.name.startswith(SPARE_PREFIX) and not entry.is_symlink():
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
    if src.is_symlink():  # never a step of ours: drop the link, not what it points to
      src.unlink()
      return
    if not src.exists():
      return
    target = self.directory / f"{TMP_PREFIX}del-{uuid.uuid4().hex}"
    with self._lock:
      os.rename(src, target)
    shutil.rmtree(target, ignore_errors=True)

  def steps(self) -> list[int]:
    return committed_steps(self.directory)

  def manifest(self, step: int) -> StepManifest:
    """The checked manifest of a committed step (see `read_manifest`)."""
    return read_manifest(self.directory / str(step), process_index=self.process_index,
                         process_count=self.process_count)

  def close(self) -> None:
    self._crc_pool.shutdown(wait=True)


# ----------------------------------------------------------------------------- reading


def _check_leaf(item: str, path: str, record: LeafRecord, shape: tuple[int, ...],
                dtype: Any) -> tuple[int, ...]:
  """AbstractStateMismatchError unless a target of `shape` and `dtype` (numpy's or a PRNG key
  dtype) is what `record` holds; returns the dims a key leaf's data adds (() for others)."""
  try:
    saved_shape, saved_dtype, key_dims = saved_spec(record)
  except ValueError as e:
    raise AbstractStateMismatchError(
        f"Leaf {item}{path} holds PRNG keys this process cannot rebuild: {e}") from e
  is_key = is_key_dtype(dtype)
  if is_key != (record.key_impl is not None):
    same_dtype = False
  else:  # key dtypes compare by name: one name per implementation
    same_dtype = dtype.name == saved_dtype.name if is_key else saved_dtype == dtype
  if saved_shape != tuple(shape) or not same_dtype:
    keys = f" (PRNG keys, {record.key_impl!r})" if record.key_impl is not None else ""
    raise AbstractStateMismatchError(
        f"Leaf {item}{path}: the checkpoint holds shape {saved_shape} dtype "
        f"{saved_dtype.name}{keys}, but the target (abstract_state / restore args) asks for "
        f"shape {tuple(shape)} dtype {dtype.name}. Pass an abstract state that matches the "
        "saved one (jax.eval_shape of your init function with the same config).")
  return key_dims


@dataclasses.dataclass(frozen=True)
class SavedLeaf:
  """A restore target leaf: the saved shape and dtype, placed with `sharding` (what Orbax's
  `ArrayRestoreArgs(sharding=...)` asks for without a target array). A PRNG key leaf comes
  back as keys: `sharding` is then the key array's."""

  sharding: jax.sharding.Sharding


def _target_spec(leaf: Any, saved: LeafRecord) -> tuple[tuple[int, ...], Any, Any]:
  """(shape, dtype, sharding) a target leaf asks for; the dtype may be a PRNG key dtype."""
  if isinstance(leaf, SavedLeaf):
    try:
      shape, dtype, _ = saved_spec(saved)
    except ValueError:  # _check_leaf says why
      shape, dtype = tuple(saved.shape), _np_dtype(saved.dtype)
    return shape, dtype, leaf.sharding
  shape = tuple(getattr(leaf, "shape", ()))
  dtype = getattr(leaf, "dtype", None)
  if dtype is None:
    dtype = np.asarray(leaf).dtype
  elif not is_key_dtype(dtype):
    dtype = np.dtype(dtype)
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
  try:
    fd = _open_regular(step_dir, DATA)
  except OSError as e:
    raise LocalTierError(f"{data_path}: {e}") from e
  try:
    size = os.fstat(fd).st_size
    if size < manifest.data_size:  # checked before the buffer is allocated
      raise CorruptStepError(f"{data_path}: {size} bytes, shorter than the "
                             f"{manifest.data_size} its manifest says")
    data = aligned_empty(manifest.data_size)
    ranges = [(shard.offset, shard.nbytes) for _, _, shard in manifest_entries(manifest)]
    computed = _read_checksumming(fd, data_path, data, ranges)
  finally:
    os.close(fd)
  if crcs is not None:
    crcs.update(computed)
  return data


def _read_checksumming(fd: int, path: Path, buffer: np.ndarray,
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
        value = _crc_extend(value, buffer[start:piece])  # releases the GIL
        start = piece
      out[(offset, nbytes)] = value

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
  return out


def read_step(step_dir: Path, manifest: StepManifest, targets: dict[str, Any],
              crc_threads: int = 2) -> dict[str, Any]:
  """Reads items of a committed step onto the target shardings, verifying every checksum.

  `targets` maps item name to a pytree of jax.ShapeDtypeStruct / jax.Array (with shardings)
  or numpy / scalar leaves; JSON items take any value (ignored). Raises
  AbstractStateMismatchError for a target that does not match (tree, shape, dtype, or a
  sharding under which this node would need shards it did not save), LocalTierError when this
  node cannot serve the step (corrupt bytes, a missing or short data file).
  """
  crcs: dict[tuple[int, int], int] = {}
  data = read_data(step_dir, manifest, crcs)
  return arrays_from_buffer(data, manifest, targets, str(step_dir), crc_threads=crc_threads,
                            crcs=crcs)


def _sharding_mismatch(where: str, rec: LeafRecord, sharding: Any, index: Index,
                       device: Any) -> Exception:
  """The error for a target shard this node did not save.

  A target sharding other than the saved one is the caller's mistake: AbstractStateMismatchError,
  which no other copy of the step fixes. The same sharding with other shards here means this
  process's devices changed since the save: LocalTierError, so restore tries another source.
  """
  target = describe_sharding(sharding)
  if rec.sharding is not None and rec.sharding == target:
    return LocalTierError(
        f"{where}: this node holds no shard {index} for {device}, although the target sharding "
        f"{target} is the saved one: this process's devices differ from those at save time")
  return AbstractStateMismatchError(
      f"{where}: the target sharding differs from the saved one: target {target}, saved "
      f"{rec.sharding or 'unknown (the manifest does not record it)'}; this node holds no "
      f"shard {index} for {device}. Restore with the sharding the step was saved with.")


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
      key_dims = _check_leaf(item_name, path, rec, shape, dtype)
      if rec.key_impl is not None:
        dtype = _np_dtype(rec.dtype)  # the shards hold key data
      where = f"{where_prefix}: leaf {item_name}{path}"
      if sharding is None:
        full = _whole(rec.shape)
        full_rec = next((s for s in rec.shards if s.index == full), None)
        if full_rec is None:
          raise AbstractStateMismatchError(
              f"{where}: the target has no sharding (a host value), but this node does not "
              f"hold the whole array (saved with sharding {rec.sharding or 'unknown'}). Give "
              "the target leaf a sharding (e.g. jax.ShapeDtypeStruct(shape, dtype, "
              "sharding=...)).")
        slot = [None]
        jobs.append((slot, full_rec, dtype, where))
        leaf_plans.append(("host", slot, rec.python_type, leaf, rec.key_impl))
      else:
        by_index = {s.index: s for s in rec.shards}
        device_slots = []
        for device, index in sharding.addressable_devices_indices_map(shape).items():
          norm = normalize_index(index, shape) + _whole(key_dims)
          shard_rec = by_index.get(norm)
          if shard_rec is None:
            raise _sharding_mismatch(where, rec, sharding, norm, device)
          slot = [None]
          jobs.append((slot, shard_rec, dtype, where))
          device_slots.append((device, slot))
        leaf_plans.append(("array", device_slots, sharding, shape, rec.key_impl))
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
        _, slot, python_type, target_leaf, key_impl = leaf_plan
        value = slot[0]
        if key_impl is not None:  # keys are jax arrays: on the default device
          value = jax.random.wrap_key_data(value, impl=key_impl)
        elif python_type is not None and not isinstance(target_leaf, (np.ndarray, jax.Array)):
          value = {"int": int, "float": float, "bool": bool}[python_type](value)
        leaves.append(value)
      else:
        _, device_slots, sharding, shape, key_impl = leaf_plan
        if key_impl is not None:
          # Each device's keys from its data. In the default memory even when `memory_kind`
          # asks for another: keys are small, and wrap_key_data computes on the device.
          arrays = [jax.random.wrap_key_data(jax.device_put(slot[0], device), impl=key_impl)
                    for device, slot in device_slots]
        elif memory_kind is None:
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
  try:
    fd = _open_regular(step_dir, DATA)
  except OSError as e:
    raise LocalTierError(f"{data_path}: {e}") from e
  try:
    size = os.fstat(fd).st_size
    if size != manifest.data_size:
      raise CorruptStepError(f"{data_path}: {size} bytes, manifest says {manifest.data_size}")
    # Unmapped when the last view goes (a mapping outlives its descriptor).
    data = (np.frombuffer(mmap.mmap(fd, size, prot=mmap.PROT_READ), dtype=np.uint8) if size
            else np.empty(0, np.uint8))
  finally:
    os.close(fd)
  for item_name, item in manifest.items.items():
    for leaf in item.leaves:
      for shard in leaf.shards:
        got = _crc_ranges(data, [(shard.offset, shard.nbytes)])[0]
        if got != shard.crc32c:
          raise CorruptStepError(
              f"{step_dir}: leaf {item_name}{leaf.path} shard {shard.index}: checksum "
              f"mismatch (crc32c {got:#010x}, manifest {shard.crc32c:#010x})")
  return manifest
