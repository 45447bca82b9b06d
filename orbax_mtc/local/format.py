"""The RAM-disk tier's on-disk format: a step folder's layout, its manifest and its errors.

Layout of one node's local directory::

  <local>/<step>/data.bin        the node's shard bytes, back to back
  <local>/<step>/manifest.json   every leaf: global shape, dtype, saved sharding, and per shard
                                 its index, offset, length and CRC32C; signed with the CRC32C
                                 of its own canonical JSON and checked field by field on reading
  <local>/.tmp-<step>-<id>/      a step being written (never read)
  <local>/.spare-<id>/           a retired step whose data file the next save overwrites

A save lays the shards out in manifest order, each at a multiple of `ALIGN` bytes, with zero
bytes in the gaps; a reader requires only that no two shards share a byte and that data.bin be
no larger than that layout. How a step folder comes to exist and goes away is `store`'s part.

A typed PRNG key array (dtype key<fry>, key<urbg>...: a JAX extended dtype) is stored as
Orbax stores it: its key data (uint32, the key array's shape plus the implementation's key
shape; shard indices span both), with the implementation's name in the leaf's `key_impl`. A
restore rebuilds each device's shard with `jax.random.wrap_key_data` of that implementation.
The leaf's `sharding` describes the key array's own sharding, which a restore target carries.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import re
import reprlib
from typing import Any

import google_crc32c
import jax.numpy as jnp
import numpy as np

# Re-exported: these errors lived here before errors.py, and other modules name them
# through this one.
from orbax_mtc.errors import AbstractStateMismatchError as AbstractStateMismatchError
from orbax_mtc.errors import CorruptStepError as CorruptStepError
from orbax_mtc.errors import LocalTierError as LocalTierError
from orbax_mtc.errors import ManifestError as ManifestError
from orbax_mtc.errors import MissingItemError as MissingItemError

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
ALIGN = 64  # every shard starts at a multiple of this offset in data.bin
KEY_IMPL_NAME = re.compile(r"[A-Za-z0-9_]{1,64}")  # a PRNG implementation's name
_MAX_STEP = (1 << 63) - 1  # steps travel as int64 in collectives
_MAX_PROCESSES = 1 << 24
_MAX_LEAF_BYTES = 1 << 62

Index = tuple[tuple[int, int], ...]


def agreed_mismatch(process: int, message: str, step: int) -> AbstractStateMismatchError:
  """The error every process raises for one process's mismatch, from its agreed message: a
  `MissingItemError` again when that is what it was (its message names the item first)."""
  text = f"process {process}: {message} (step {step} is kept in every tier)."
  match = re.match(r"Item '([^']*)' is not in ", message)
  return MissingItemError(text, match.group(1)) if match else AbstractStateMismatchError(text)


def align(n: int) -> int:
  """`n` rounded up to a multiple of `ALIGN`: where the shard after `n` bytes starts."""
  return -(-n // ALIGN) * ALIGN


def aligned_empty(nbytes: int, align: int = ALIGN) -> np.ndarray:
  """A fresh uint8 buffer whose start is `align`-byte aligned.

  JAX's CPU client adopts aligned host buffers without a copy, so the restored arrays live in
  the very buffer the file was read into: one copy from the RAM disk, none after.
  """
  raw = np.empty(nbytes + align, dtype=np.uint8)
  start = (-raw.ctypes.data) % align
  return raw[start:start + nbytes]


# ----------------------------------------------------------------------------- manifest


@dataclasses.dataclass(frozen=True)
class ShardRecord:
  """One shard of a leaf: its global index and where its bytes lie in data.bin."""

  index: Index
  offset: int
  nbytes: int
  crc32c: int

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(stop - start for start, stop in self.index)


@dataclasses.dataclass(frozen=True)
class LeafRecord:
  """One leaf of a pytree item: its global spec and the shards this node saved."""

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
  # The step's global layout of an array leaf: every distinct shard index of the saved
  # sharding and the saved ranks (process indices) holding it. What an elastic restore reads
  # instead of the old mesh; None in manifests of leaves saved without it.
  tiles: tuple[tuple[Index, tuple[int, ...]], ...] | None = None


@dataclasses.dataclass(frozen=True)
class ItemRecord:
  """One item of a step: a pytree of leaves, or a JSON value."""

  # "pytree"; "json"; "process": one value per process (`process_state`), its bytes one
  # checksummed host leaf (path "", uint8) and `value` {"format": "json" or "grain"}
  kind: str
  leaves: tuple[LeafRecord, ...] = ()
  value: Any = None  # the JSON value of a "json" item


def manifest_checksum(fields: dict[str, Any]) -> int:
  """The checksum a manifest is signed with.

  Args:
    fields: the parsed manifest less MANIFEST_CRC_KEY.

  Returns:
    The CRC32C of their canonical JSON (sorted keys, compact separators).
  """
  return google_crc32c.value(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode())


@dataclasses.dataclass(frozen=True)
class StepManifest:
  """What one node saved of one step: the contents of its manifest.json."""

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
      if r.tiles is not None:
        out["tiles"] = [[[list(d) for d in index], list(holders)] for index, holders in r.tiles]
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

    Args:
      text: the manifest's JSON.
      where: the file, for error messages.

    Returns:
      The manifest.

    Raises:
      ManifestError: naming `where` and the problem, never anything else.
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


def np_dtype(name: str) -> np.dtype:
  """The numpy dtype a manifest's dtype name stands for (bfloat16 and friends included)."""
  return np.dtype(jnp.dtype(name))


def _checked_dtype(name: Any) -> np.dtype | None:
  """The dtype for a manifest dtype name, or None when the name is not one stage() writes."""
  if not isinstance(name, str):
    return None
  try:
    dtype = np_dtype(name)
  except (TypeError, ValueError, KeyError, AttributeError, SyntaxError):
    return None
  # The name must be numpy's own (no byte order or alias lost), of plain fixed-size elements.
  if (dtype.name != name or dtype.itemsize <= 0 or dtype.hasobject or dtype.fields is not None
      or dtype.subdtype is not None or dtype.kind in "OSUMm"):
    return None
  return dtype


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
    for name, it in items.items():
      for leaf in it.leaves:
        if leaf.tiles is not None and any(h >= count for _, hs in leaf.tiles for h in hs):
          raise ManifestError(f"{self.where}: item {name!r} leaf {leaf.path!r}: a tile's holder "
                              f"is not a process index below 'process_count' {count}")
    return StepManifest(step=step, process_index=index, process_count=count, items=items,
                        data_size=data_size, created_at=float(created_at),
                        default_item=default_item)

  def item(self, name: str, it: Any, data_size: int) -> ItemRecord:
    what = f"item {name!r}"
    if not isinstance(it, dict):
      raise self.fail(what, it, "an object")
    kind = self.field(it, "kind", what)
    if kind not in ("pytree", "json", "process"):
      raise self.fail(f"{what} 'kind'", kind, "'pytree', 'json' or 'process'")
    leaves_raw = self.sequence(self.field(it, "leaves", what), f"{what} 'leaves'")
    if kind == "json" and leaves_raw:
      raise self.fail(f"{what} 'leaves'", leaves_raw, "no leaves in a JSON item")
    leaves = tuple(self.leaf(what, i, d, data_size) for i, d in enumerate(leaves_raw))
    paths = [leaf.path for leaf in leaves]
    if len(set(paths)) != len(paths):
      raise ManifestError(f"{self.where}: {what} lists a leaf path twice")
    value = it.get("value")
    if kind == "process":
      if len(leaves) != 1 or leaves[0].kind != "host" or leaves[0].dtype != "uint8" \
          or len(leaves[0].shape) != 1:
        raise self.fail(f"{what} 'leaves'", leaves_raw, "one host leaf of uint8 bytes")
      if not isinstance(value, dict) or value.get("format") not in ("json", "grain"):
        raise self.fail(f"{what} 'value'", value, '{"format": "json"} or {"format": "grain"}')
    return ItemRecord(kind=kind, leaves=leaves, value=value)

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
                            or not KEY_IMPL_NAME.fullmatch(key_impl)):
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
    tiles = None
    if "tiles" in d:
      if kind != "array":
        raise self.fail(f"{what} 'tiles'", d["tiles"], "absent for a host value")
      tiles = tuple(self.tile(f"{what} tile {i}", t, shape)
                    for i, t in enumerate(self.sequence(d["tiles"], f"{what} 'tiles'")))
      if len({index for index, _ in tiles}) != len(tiles):
        raise ManifestError(f"{self.where}: {what} lists a tile twice")
      missing = {s.index for s in shards} - {index for index, _ in tiles}
      if missing:
        raise ManifestError(f"{self.where}: {what} holds shard {sorted(missing)[0]}, which its "
                            "'tiles' do not list")
    return LeafRecord(path=path, kind=kind, shape=shape, dtype=dtype_name, shards=shards,
                      python_type=python_type, keys=tuple(keys), sharding=sharding,
                      key_impl=key_impl, tiles=tiles)

  def index(self, what: str, raw: Any, shape: tuple[int, ...]) -> Index:
    index = []
    for dim, bounds in zip(shape, self.sequence(raw, f"{what} index", len(shape)), strict=True):
      start, stop = self.sequence(bounds, f"{what} index", 2)
      start = self.integer(start, f"{what} index start", 0, dim)
      stop = self.integer(stop, f"{what} index stop", start, dim)
      index.append((start, stop))
    return tuple(index)

  def tile(self, what: str, t: Any, shape: tuple[int, ...]) -> tuple[Index, tuple[int, ...]]:
    index_raw, holders_raw = self.sequence(t, what, 2)
    holders = tuple(self.integer(h, f"{what} holder", 0, _MAX_PROCESSES - 1)
                    for h in self.sequence(holders_raw, f"{what} holders"))
    if not holders or list(holders) != sorted(set(holders)):
      raise self.fail(f"{what} holders", holders_raw, "ascending distinct process indices")
    return self.index(what, index_raw, shape), holders

  def shard(self, what: str, s: Any, shape: tuple[int, ...], dtype: np.dtype,
            data_size: int) -> ShardRecord:
    index_raw, offset, nbytes, crc = self.sequence(s, what, 4)
    index = self.index(what, index_raw, shape)
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
    packed = sum(align(n) for _, n, _ in ranges)
    if data_size > packed:
      raise ManifestError(f"{self.where}: 'data_size' {data_size} exceeds the {packed} bytes "
                          "its shards take")


def validate_for(manifest: StepManifest, *, where: str = "manifest", step: int | None = None,
                 process_index: int | None = None, process_count: int | None = None,
                 data_file_size: int | None = None) -> None:
  """Checks a parsed manifest against where it was found and who reads it.

  Each check is skipped when its argument is None.

  Args:
    manifest: the parsed manifest.
    where: the file, for error messages.
    step: the folder's step.
    process_index: the reading process's index.
    process_count: the reading job's process count.
    data_file_size: the size of the data file beside the manifest.

  Raises:
    ManifestError: a field does not match.
    CorruptStepError: the data file is shorter than the manifest says.
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
