"""The tiles of a restore: a step's saved layout, what each process sends, and each target
shard assembled from the saved tiles that cover it (no collectives; `executor` moves the
streams and agrees on the outcome).

Whole saved tiles travel (not sub-ranges): the receiver then checks each against the checksum
written at save time, end to end, at the cost of extra bytes where a new shard needs part of
a saved one.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
from pathlib import Path
from typing import Any

import google_crc32c
import jax
import numpy as np

from orbax_mtc import item_args, process_state
from orbax_mtc.local import cast as local_cast
from orbax_mtc.local import checksum
from orbax_mtc.local import format as local_format
from orbax_mtc.local import read as local_read
from orbax_mtc.local.format import LeafRecord, StepManifest
from orbax_mtc.local.specs import normalize_index, whole_index
from orbax_mtc.peers import stream as peer_stream
from orbax_mtc.restore import plan as elastic_plan
from orbax_mtc.restore.plan import Box


def leaf_tiles(leaf: LeafRecord, count: int) -> tuple[tuple[Box, tuple[int, ...]], ...] | None:
  """A leaf's tiles and their holders; a host value is one whole tile every rank holds."""
  if leaf.kind == "host":
    return ((whole_index(leaf.shape), tuple(range(count))),)
  return leaf.tiles


def digest(manifest: StepManifest) -> int | None:
  """32-bit digest of a step's global layout (the process count, and per leaf its spec and
  tiles); None when an array leaf was saved without tiles (no elastic restore)."""
  parts: list[Any] = [manifest.process_count, manifest.default_item]
  for name in sorted(manifest.items):
    item = manifest.items[name]
    parts.append([name, item.kind])
    if item.kind == "process":
      continue  # each rank's own value: its size differs between ranks of one save
    for leaf in item.leaves:
      tiles = leaf_tiles(leaf, manifest.process_count)
      if tiles is None:
        return None
      parts.append([leaf.path, leaf.kind, list(leaf.shape), leaf.dtype, leaf.key_impl,
                    leaf.python_type, [[list(map(list, i)), list(h)] for i, h in tiles]])
  return google_crc32c.value(json.dumps(parts, separators=(",", ":")).encode())


def holder_sets(manifest: StepManifest) -> set[tuple[int, ...]]:
  """The distinct holder sets of a step's tiles (see `elastic_plan.holder_sets`)."""
  layouts = []
  for item in manifest.items.values():
    if item.kind == "process":
      continue  # held by its rank alone, and never rebuilt on another layout
    for leaf in item.leaves:
      tiles = leaf_tiles(leaf, manifest.process_count)
      if tiles is not None:
        layouts.append(tiles)
  return elastic_plan.holder_sets(layouts)


def target_boxes(key_dims: tuple[int, ...], shape: tuple[int, ...], sharding: Any,
                 process: int | None) -> list[tuple[Any, Box]]:
  """(device, global box of its shard) of a target leaf, for one process or (None) all;
  a target without sharding (a host value) is the whole array, device None."""
  if sharding is None:
    return [(None, whole_index(shape) + whole_index(key_dims))]
  out = []
  for device, index in sharding.devices_indices_map(shape).items():
    if process is None or device.process_index == process:
      out.append((device, normalize_index(index, shape) + whole_index(key_dims)))
  return out


class BadTile(local_format.CorruptStepError):
  def __init__(self, message: str, process: int, rank: int):
    super().__init__(message)
    self.process, self.rank = process, rank


@dataclasses.dataclass
class Folder:
  """A saved rank's folder this process serves: its manifest and verified bytes."""

  manifest: StepManifest
  data: np.ndarray
  where: str
  primary: bool = False  # the serving process's own current `<step>` folder


@dataclasses.dataclass(frozen=True)
class Located:
  """A served folder's shards where they lie in files, for sending without reading them
  here first (the receiver checks every tile against its checksum)."""

  manifest: StepManifest
  where: str
  places: dict[int, tuple[Path, int]]  # shard offset in the saved data -> (file, offset in it)


def target_leaves(layout: StepManifest, targets: dict[str, Any], single: bool | None
                   ) -> list[tuple[str, str, LeafRecord, Any, tuple, Any, tuple]]:
  """(item, path, saved leaf, target leaf, shape, sharding, key dims) of every target
  leaf, checked against the saved tree; AbstractStateMismatchError if it does not match."""
  if single is None:
    targets = item_args.as_saved(targets, layout.default_item)
  out = []
  for item_name, target in targets.items():
    record = layout.items.get(item_name)
    if record is None:
      raise local_format.MissingItemError(
          f"Item {item_name!r} is not in step {layout.step} (it holds {sorted(layout.items)}).",
          item_name)
    if isinstance(target, process_state.ProcessTarget) or record.kind == "process":
      # Travels by its own saved rank; the same errors as a read of one folder.
      local_read.process_shard(item_name, record, target, layout.step)
      continue
    if record.kind == "json":
      continue  # its value travels in the manifest
    by_path = {leaf.path: leaf for leaf in record.leaves}
    flat = jax.tree_util.tree_flatten_with_path(target)[0]
    paths = [jax.tree_util.keystr(p) for p, _ in flat]
    if sorted(paths) != sorted(by_path):
      raise local_format.AbstractStateMismatchError(
          f"Item {item_name!r}: the target tree does not match the saved tree. Leaves only "
          f"in the target: {sorted(set(paths) - set(by_path))[:5]}; leaves only in the "
          f"checkpoint: {sorted(set(by_path) - set(paths))[:5]}.")
    for (_, leaf), path in zip(flat, paths, strict=True):
      rec = by_path[path]
      shape, dtype, sharding = local_read.target_spec(leaf, rec)
      key_dims = local_read.check_leaf(item_name, path, rec, shape, dtype,
                                       cast=not isinstance(leaf, local_read.UncastLeaf))
      out.append((item_name, path, rec, leaf, shape, sharding, key_dims))
  return out

@dataclasses.dataclass
class Routes:
  """What one process does with the folders it serves, decided from their manifests alone.

  Attributes:
    sends: destination -> {(item, path, tile index): (saved rank, shard)} it sends there.
    manifest_to: destinations that serve nothing and get the step's manifest from here.
    needed: the served saved ranks whose bytes this process's own shards are built from.
    receives: whether this process needs bytes from another process.
    exchange: whether any process does (the same answer on every process): then every
      process builds after the transfer, and sends straight from its files.
  """

  sends: dict[int, dict[tuple, tuple[int, local_format.ShardRecord]]]
  manifest_to: list[int]
  needed: set[int]
  receives: bool
  exchange: bool

  @property
  def sent(self) -> set[int]:
    """The served saved ranks whose tiles go to other processes."""
    return {rank for tiles in self.sends.values() for rank, _ in tiles.values()}


def routes(me: int, count: int, plan: elastic_plan.ElasticPlan,
           manifests: dict[int, StepManifest], layout: StepManifest | None,
           targets: dict[str, Any], single: bool | None) -> Routes:
  """Where every tile this process provides goes, and which of its folders it must read.

  Every process computes the same choices (`plan.provider`, preferring a rank served from an
  own folder over a copy, so a lost node's tiles come from its twin's folder, read once).
  """
  served = {p: set(plan.served_by(p)) for p in range(count)}
  if layout is None:  # serves nothing: everything comes from elsewhere
    return Routes({}, [], set(), True, True)
  servers = plan.server_of()
  available = set(servers)
  preferred = {rank for rank, _, kind in plan.servers if kind != elastic_plan.COPY}
  sends: dict[int, dict[tuple, tuple[int, local_format.ShardRecord]]] = {}
  needed: set[int] = set()
  receives = False
  # A process serving nothing gets at least the manifest.
  exchange = any(not served[p] for p in range(count))
  mine = served[me]
  for item_name, path, rec, _, shape, sharding, key_dims in target_leaves(
      layout, targets, single):
    tiles = leaf_tiles(rec, plan.count) or ()
    boxes = elastic_plan.TileIndex(index for index, _ in tiles)  # many targets
    wanted: dict[int, list[Box]] = {}  # process -> boxes of its new shards
    if sharding is None:  # a host value: every process gets the whole array
      wanted = {p: [box] for p in range(count)
                for _, box in target_boxes(key_dims, shape, None, None)}
    else:
      for device, box in target_boxes(key_dims, shape, sharding, None):
        wanted.setdefault(device.process_index, []).append(box)
    for dest in range(count):
      for box in dict.fromkeys(wanted.get(dest, ())):
        for i, _ in elastic_plan.pieces(box, boxes):
          index, holders = tiles[i]
          exchange = exchange or not any(elastic_plan.holds(holders, r) for r in served[dest])
          if dest == me:
            local = [r for r in mine if elastic_plan.holds(holders, r)]
            if local:  # read here: from an own folder when one holds it
              needed.add(min(local, key=lambda r: (r not in preferred, r)))
            else:
              receives = True
            continue
          rank = elastic_plan.provider(holders, served[dest], available, dest, preferred)
          if rank is None or servers[rank] != me:
            continue
          key = (item_name, path, index)
          if key not in sends.setdefault(dest, {}):
            sends[dest][key] = (rank, _shard(manifests[rank], item_name, path, index))
  # A per-process item goes to the process of its saved rank, from whoever serves that rank.
  for item_name in process_names(targets):
    for dest in range(count):
      exchange = exchange or servers.get(dest) != dest
      if servers.get(dest) != me:
        receives = receives or (dest == me)
        continue
      if dest == me:
        needed.add(dest)
      else:
        shard = manifests[dest].items[item_name].leaves[0].shards[0]
        sends.setdefault(dest, {})[(item_name, "", shard.index)] = (dest, shard)
  lowest = plan.servers[0][1]  # the process serving the lowest rank sends the manifest
  manifest_to = [p for p in range(count) if p != me and me == lowest and not served[p]]
  return Routes({d: t for d, t in sends.items() if t}, manifest_to, needed, receives, exchange)


def streams(plan: elastic_plan.ElasticPlan, routes_here: Routes, folders: dict[int, Folder],
            located: dict[int, Located], layout: StepManifest
            ) -> dict[int, peer_stream.OutgoingStream]:
  """The streams this process sends: the tiles it provides to each destination (and, to a
  process serving nothing, the step's manifest), from the folders read here for its own
  shards, else from their files as the transfer goes. A tile that cannot be read goes as
  zeros and is named in the stream's `failures`."""
  out: dict[int, peer_stream.OutgoingStream] = {}
  for dest in sorted(set(routes_here.sends) | set(routes_here.manifest_to)):
    entries, pieces, offset = [], [], 0
    for (item_name, path, index), (rank, shard) in routes_here.sends.get(dest, {}).items():
      entries.append([item_name, path, [list(d) for d in index], rank, offset, shard.nbytes,
                      shard.crc32c])
      pieces.append((offset, rank, shard))
      offset = -(-(offset + shard.nbytes) // 64) * 64
    header = {"kind": "tiles", "step": plan.step, "tiles": entries,
              "manifest": layout.to_json() if dest in routes_here.manifest_to else None}
    framed, data_start = peer_stream.stream_header(header)
    segments = [peer_stream.Segment(0, framed.nbytes, buffer=framed)]
    for rel, rank, shard in pieces:
      if rank in folders:  # read (and checked) already
        data = folders[rank].data
        segments.append(peer_stream.Segment(
            data_start + rel, shard.nbytes, buffer=data[shard.offset:shard.offset + shard.nbytes],
            tag=rank))
        continue
      file, at = located[rank].places[shard.offset]
      segments.append(peer_stream.Segment(data_start + rel, shard.nbytes, path=file,
                                          file_offset=at, tag=rank))
    out[dest] = peer_stream.OutgoingStream(nbytes=data_start + offset, segments=segments,
                                           failures=[])
  return out


def _shard(manifest: StepManifest, item: str, path: str, index: Box) -> local_format.ShardRecord:
  leaf = next(x for x in manifest.items[item].leaves if x.path == path)
  return next(s for s in leaf.shards if s.index == index)

def received_manifest(buffers: dict[int, np.ndarray]) -> StepManifest:
  for buffer in buffers.values():
    header, _ = peer_stream.parse_stream_header(buffer)
    if header.get("manifest"):
      return StepManifest.from_json(peer_stream.header_text(header, "manifest"),
                                    where="manifest of an elastic restore stream")
  raise local_format.CorruptStepError("no process sent the step's manifest")


def process_names(targets: dict[str, Any]) -> list[str]:
  """The per-process items among restore targets, sorted."""
  return sorted(item_args.process_targets(targets))


@dataclasses.dataclass
class BuiltStep:
  """This process's part of a restored step."""

  restored: dict[str, Any]  # item name -> restored item
  default_item: bool
  json_names: set[str]
  process_raw: dict[str, tuple[str, bytes]]  # per-process item -> (format, saved bytes)
  complete: bool  # every item of the save but per-process ones was restored
  moved: bool  # some shard here is not a tile its own saved rank held (another layout)
  cast: bool = False  # some leaf was cast to the target's dtype: not the bytes as saved


def build(me: int, count: int, plan: elastic_plan.ElasticPlan, folders: dict[int, Folder],
          buffers: dict[int, np.ndarray], layout: StepManifest, targets: dict[str, Any],
          single: bool | None) -> BuiltStep:
  """This process's target items from the tiles of the folders it serves and those it
  received (each received tile checked against the checksum written at save time)."""
  # (item, path) -> {tile index: uint8 bytes}: the tiles of the folders served here...
  have: dict[tuple[str, str], dict[Box, np.ndarray]] = {}
  mine: dict[str, np.ndarray] = {}  # per-process items of this process's saved rank
  for rank, folder in folders.items():
    for item_name, leaf, shard in local_read.manifest_entries(folder.manifest):
      raw = folder.data[shard.offset:shard.offset + shard.nbytes]
      if leaf.kind == "host" and folder.manifest.items[item_name].kind == "process":
        if rank == me:
          mine[item_name] = raw
        continue
      have.setdefault((item_name, leaf.path), {}).setdefault(shard.index, raw)
  # ... and those received, each checked against the checksum written at save time.
  wanted_process = set(process_names(targets))
  received = []
  for source, buffer in sorted(buffers.items()):
    header, data_start = peer_stream.parse_stream_header(buffer)
    for entry in header.get("tiles") or []:
      if not (isinstance(entry, list) and len(entry) == 7 and
              all(type(x) is int for x in (entry[3], entry[4], entry[5], entry[6]))):
        raise local_format.CorruptStepError(f"a malformed tile entry from process {source}")
      received.append((source, entry, buffer[data_start + entry[4]:
                                             data_start + entry[4] + entry[5]]))
  # Two threads, as a read of one's own folder checks its shards (the C library releases
  # the GIL).
  with concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="mtc-crc") as pool:
    sums = list(pool.map(lambda got: checksum.crc(got[2]), received))
  for (source, entry, raw), value in zip(received, sums, strict=True):
    item_name, path, index, rank, _, nbytes, crc = entry
    if raw.nbytes != nbytes or value != crc:
      raise BadTile(f"tile {item_name}{path} {index} of saved rank {rank} from process "
                     f"{source}: checksum mismatch", source, rank)
    if item_name in wanted_process and rank == me:
      mine[item_name] = raw
    else:
      have.setdefault((item_name, path), {})[tuple(tuple(d) for d in index)] = raw
  if single is None:
    targets = item_args.as_saved(targets, layout.default_item)
  moved = plan.count != count
  cast = False
  leaves_by_item: dict[str, list[Any]] = {}
  for item_name, path, rec, leaf, shape, sharding, key_dims in target_leaves(
      layout, targets, single):
    tiles = have.get((item_name, path), {})
    holders = dict(leaf_tiles(rec, plan.count) or ())
    dtype = local_format.np_dtype(rec.dtype)
    boxes = list(tiles)
    shards = []
    for device, box in target_boxes(key_dims, shape, sharding, me):
      dims = [hi - lo for lo, hi in box]
      try:
        parts = elastic_plan.pieces(box, boxes)
      except ValueError as e:
        raise local_format.CorruptStepError(f"leaf {item_name}{path}: {e}") from e
      exact = len(parts) == 1 and boxes[parts[0][0]] == box
      moved = moved or not exact or me not in holders.get(box, ())
      if exact:
        # The saved tile is the new shard: its (aligned, verified) bytes, no copy.
        shards.append((device, tiles[box].view(dtype).reshape(dims)))
        continue
      # Aligned, so that JAX's CPU client adopts the buffer instead of copying it.
      out = local_read.aligned_empty(
          max(1, int(np.prod(dims, dtype=np.int64))) * dtype.itemsize)
      out = out[:int(np.prod(dims, dtype=np.int64)) * dtype.itemsize].view(dtype).reshape(dims)
      for i, part in parts:
        index = boxes[i]
        tile = tiles[index].view(dtype).reshape([hi - lo for lo, hi in index])
        out[elastic_plan.relative(part, box)] = tile[elastic_plan.relative(part, index)]
      shards.append((device, out))
    cast_to = local_read.cast_of(leaf, rec)
    if cast_to is not None:  # on the host, as Orbax casts while it reads
      shards = [(device, local_cast.cast(x, cast_to)) for device, x in shards]
      cast = True
    leaves_by_item.setdefault(item_name, []).append(
        as_leaf(rec, leaf, shape, sharding, shards))
  restored: dict[str, Any] = {}
  process_raw: dict[str, tuple[str, bytes]] = {}
  for item_name, target in targets.items():
    record = layout.items[item_name]
    if record.kind == "json":
      restored[item_name] = record.value
    elif item_name in wanted_process:
      raw = mine.get(item_name)
      if raw is None:
        raise local_format.CorruptStepError(f"item {item_name!r} of saved rank {me} never came")
      restored[item_name] = process_state.decode(target, raw)
      process_raw[item_name] = (record.value.get("format"), bytes(raw))
    else:
      treedef = jax.tree_util.tree_structure(target)
      restored[item_name] = jax.tree_util.tree_unflatten(treedef, leaves_by_item[item_name])
  json_names = {name for name in restored if layout.items[name].kind == "json"}
  complete = {name for name, item in layout.items.items() if item.kind != "process"
              } <= set(restored)
  return BuiltStep(restored, layout.default_item, json_names, process_raw, complete, moved,
                   cast)


def as_leaf(rec: LeafRecord, target_leaf: Any, shape: tuple, sharding: Any,
             shards: list[tuple[Any, np.ndarray]]) -> Any:
  """The restored leaf from its per-device host shards."""
  if sharding is None:
    value = shards[0][1]
    if rec.key_impl is not None:
      return jax.random.wrap_key_data(value, impl=rec.key_impl)
    if rec.python_type is not None and not isinstance(target_leaf, (np.ndarray, jax.Array)):
      return {"int": int, "float": float, "bool": bool}[rec.python_type](value)
    return value
  if rec.key_impl is not None:
    arrays = [jax.random.wrap_key_data(jax.device_put(x, d), impl=rec.key_impl)
              for d, x in shards]
  else:
    arrays = [jax.device_put(x, d) for d, x in shards]
  return jax.make_array_from_single_device_arrays(shape, sharding, arrays)
