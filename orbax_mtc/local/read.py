"""Reading committed steps back, with every checksum checked.

`read_data` reads a step's data file into one aligned buffer while a second thread follows
the reader and checksums each shard on bytes still in cache; `arrays_from_buffer` checks each
shard against the manifest and builds the target's arrays from that buffer (on CPU without a
copy). A target that does not match what was saved raises AbstractStateMismatchError, which
no other copy of the step fixes; anything wrong with this node's copy raises LocalTierError,
so a restore tries another source.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from orbax_mtc import process_state
from orbax_mtc.local import cast as local_cast
from orbax_mtc.local import checksum
from orbax_mtc.local.format import (
  DATA,
  AbstractStateMismatchError,
  CorruptStepError,
  Index,
  ItemRecord,
  LeafRecord,
  LocalTierError,
  MissingItemError,
  ShardRecord,
  StepManifest,
  aligned_empty,
  np_dtype,
)
from orbax_mtc.local.specs import (
  describe_sharding,
  is_key_dtype,
  normalize_index,
  saved_spec,
  whole_index,
)
from orbax_mtc.local.store import open_regular_file
from orbax_mtc.local.verify import known_or_computed_crc
from orbax_mtc.local.verify import manifest_entries as manifest_entries
from orbax_mtc.local.verify import shard_crc as shard_crc
from orbax_mtc.local.verify import verify_buffer as verify_buffer
from orbax_mtc.local.verify import verify_step as verify_step

_PIPELINE_PIECE = 4 << 20  # read, then checksum, this much at a time: it stays in cache


def check_leaf(item: str, path: str, record: LeafRecord, shape: tuple[int, ...],
                dtype: Any, *, cast: bool = True) -> tuple[int, ...]:
  """AbstractStateMismatchError unless a target of `shape` and `dtype` (numpy's or a PRNG key
  dtype) can be built from what `record` holds: the same shape, and the same dtype or (with
  `cast`, as Orbax) one the saved dtype converts to; returns the dims a key leaf's data adds
  (() for others)."""
  try:
    saved_shape, saved_dtype, key_dims = saved_spec(record)
  except ValueError as e:
    raise AbstractStateMismatchError(
        f"Leaf {item}{path} holds PRNG keys this process cannot rebuild: {e}") from e
  is_key = is_key_dtype(dtype)
  if is_key != (record.key_impl is not None):
    same_dtype = False
  elif is_key:  # key dtypes compare by name (one name per implementation); never cast
    same_dtype = dtype.name == saved_dtype.name
  else:
    same_dtype = saved_dtype == dtype or (cast and local_cast.castable(saved_dtype, dtype))
  if saved_shape != tuple(shape) or not same_dtype:
    keys = f" (PRNG keys, {record.key_impl!r})" if record.key_impl is not None else ""
    raise AbstractStateMismatchError(
        f"Leaf {item}{path}: the checkpoint holds shape {saved_shape} dtype "
        f"{saved_dtype.name}{keys}, but the target (abstract_state / restore args) asks for "
        f"shape {tuple(shape)} dtype {dtype.name}. Pass an abstract state that matches the "
        "saved one (jax.eval_shape of your init function with the same config).")
  return key_dims


def cast_of(leaf: Any, record: LeafRecord) -> np.dtype | None:
  """The dtype a target leaf is cast to on restore, or None (built as saved).

  Orbax casts a `jax.ShapeDtypeStruct`, `jax.Array` or numpy array target to its dtype; a
  Python scalar target comes back as saved, and PRNG keys are never cast.
  """
  if record.key_impl is not None or not isinstance(
      leaf, (jax.ShapeDtypeStruct, jax.Array, np.ndarray)) or is_key_dtype(leaf.dtype):
    return None
  dtype = np.dtype(leaf.dtype)
  return None if dtype == np_dtype(record.dtype) else dtype


class ReshardNeeded(AbstractStateMismatchError):
  """The target's shapes and dtypes are the saved ones but its shards lie elsewhere (another
  mesh, process count or device count): the step can be rebuilt by an elastic restore."""


@dataclasses.dataclass(frozen=True)
class SavedLeaf:
  """A restore target leaf: the saved shape and dtype, placed with `sharding` (what Orbax's
  `ArrayRestoreArgs(sharding=...)` asks for without a target array). A PRNG key leaf comes
  back as keys: `sharding` is then the key array's."""

  sharding: jax.sharding.Sharding


@dataclasses.dataclass(frozen=True)
class UncastLeaf:
  """A restore target leaf (`target`) that is built only in the saved dtype: Orbax's
  `PyTreeRestore(item=...)` without restore args does not cast, so a parent-style restore that
  asks for another dtype is a mismatch here and Orbax's restore serves it."""

  target: Any

  @property
  def sharding(self) -> Any:
    return getattr(self.target, "sharding", None)


def target_spec(leaf: Any, saved: LeafRecord) -> tuple[tuple[int, ...], Any, Any]:
  """(shape, dtype, sharding) a target leaf asks for; the dtype may be a PRNG key dtype."""
  if isinstance(leaf, UncastLeaf):
    leaf = leaf.target
  if isinstance(leaf, SavedLeaf):
    try:
      shape, dtype, _ = saved_spec(saved)
    except ValueError:  # check_leaf says why
      shape, dtype = tuple(saved.shape), np_dtype(saved.dtype)
    return shape, dtype, leaf.sharding
  shape = tuple(getattr(leaf, "shape", ()))
  dtype = getattr(leaf, "dtype", None)
  if dtype is None:
    dtype = np.asarray(leaf).dtype
  elif not is_key_dtype(dtype):
    dtype = np.dtype(dtype)
  sharding = getattr(leaf, "sharding", None)
  return shape, dtype, sharding


def _verified_view(data: np.ndarray, record: ShardRecord, dtype: np.dtype, where: str,
                   crcs: dict[tuple[int, int], int] | None = None) -> np.ndarray:
  if record.offset + record.nbytes > data.nbytes:
    raise CorruptStepError(f"{where}: data file is shorter than its manifest says")
  raw = data[record.offset:record.offset + record.nbytes]
  value = known_or_computed_crc(data, record.offset, record.nbytes, crcs)
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

  Args:
    step_dir: the committed step folder.
    manifest: its manifest (`store.read_manifest`).
    crcs: when given, receives the computed checksums.

  Returns:
    The first `manifest.data_size` bytes of the data file, as uint8.

  Raises:
    LocalTierError: the data file is missing, a link, or unreadable; CorruptStepError when it
      is shorter than the manifest says.
  """
  data_path = step_dir / DATA
  try:
    fd = open_regular_file(step_dir, DATA)
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
        value = checksum.crc_extend(value, buffer[start:piece])  # releases the GIL
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

  Args:
    step_dir: the committed step folder.
    manifest: its manifest (`store.read_manifest`).
    targets: item name -> a pytree of jax.ShapeDtypeStruct / jax.Array (with shardings),
      `SavedLeaf`, or numpy / scalar leaves; JSON items take any value (ignored).
    crc_threads: threads that check the shards' checksums.

  Returns:
    Item name -> the restored item.

  Raises:
    AbstractStateMismatchError: a target does not match (tree, shape, dtype, or a sharding
      under which this node would need shards it did not save).
    LocalTierError: this node cannot serve the step (corrupt bytes, a missing or short data
      file).
  """
  crcs: dict[tuple[int, int], int] = {}
  data = read_data(step_dir, manifest, crcs)
  return arrays_from_buffer(data, manifest, targets, str(step_dir), crc_threads=crc_threads,
                            crcs=crcs)


def _sharding_mismatch(where: str, rec: LeafRecord, sharding: Any, index: Index,
                       device: Any) -> Exception:
  """The error for a target shard this node did not save.

  When the manifest records the step's global layout (`tiles`), ReshardNeeded: an elastic
  restore rebuilds the step on the target's layout. Without it, a target sharding other than
  the saved one is the caller's mistake (AbstractStateMismatchError, which no other copy of
  the step fixes), and the same sharding with other shards here means this process's devices
  changed since the save (LocalTierError, so restore tries another source).
  """
  target = describe_sharding(sharding)
  same = rec.sharding is not None and rec.sharding == target
  if same:
    message = (f"{where}: this node holds no shard {index} for {device}, although the target "
               f"sharding {target} is the saved one: this process's devices differ from those "
               "at save time")
  else:
    message = (f"{where}: the target sharding differs from the saved one: target {target}, "
               f"saved {rec.sharding or 'unknown (the manifest does not record it)'}; this node "
               f"holds no shard {index} for {device}. Restore with the sharding the step was "
               "saved with.")
  if rec.tiles is not None:
    return ReshardNeeded(message)
  return LocalTierError(message) if same else AbstractStateMismatchError(message)


def arrays_from_buffer(data: np.ndarray, manifest: StepManifest, targets: dict[str, Any],
                       where_prefix: str, crc_threads: int = 2,
                       crcs: dict[tuple[int, int], int] | None = None,
                       memory_kind: str | None = None) -> dict[str, Any]:
  """Builds the target items from a step's data buffer laid out as `manifest` says.

  Every shard is checked against its checksum first. On CPU the arrays adopt the (aligned)
  buffer without a copy.

  Args:
    data: the step's bytes (`read_data`, or a copy received from a peer).
    manifest: the step's manifest.
    targets: as for `read_step`.
    where_prefix: names the source in error messages.
    crc_threads: threads that check the shards' checksums.
    crcs: checksums already computed from these bytes (`read_data`), keyed by (offset, nbytes).
    memory_kind: e.g. "pinned_host": places the arrays in that memory of their devices
      instead of the default one.

  Returns:
    Item name -> the restored item.

  Raises:
    AbstractStateMismatchError: as for `read_step`.
    LocalTierError: a shard does not match its checksum (CorruptStepError), or this node
      holds no shard for a device of the saved sharding (its devices changed).
  """
  jobs: list[tuple[Any, ShardRecord, np.dtype, str]] = []
  plans: dict[str, Any] = {}
  for item_name, target in targets.items():
    record = manifest.items.get(item_name)
    if record is None:
      raise MissingItemError(
          f"Item {item_name!r} is not in local step {manifest.step} (it holds "
          f"{sorted(manifest.items)}).", item_name)
    if isinstance(target, process_state.ProcessTarget) or record.kind == "process":
      shard = process_shard(item_name, record, target, manifest.step)
      slot = [None]
      jobs.append((slot, shard, np.dtype(np.uint8), f"{where_prefix}: item {item_name}"))
      plans[item_name] = ("process", target, slot)
      continue
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
      shape, dtype, sharding = target_spec(leaf, rec)
      key_dims = check_leaf(item_name, path, rec, shape, dtype,
                            cast=not isinstance(leaf, UncastLeaf))
      cast_to = cast_of(leaf, rec)
      dtype = np_dtype(rec.dtype)  # the shards hold the saved dtype (a key leaf: key data)
      where = f"{where_prefix}: leaf {item_name}{path}"
      if sharding is None:
        full = whole_index(rec.shape)
        full_rec = next((s for s in rec.shards if s.index == full), None)
        if full_rec is None:
          raise AbstractStateMismatchError(
              f"{where}: the target has no sharding (a host value), but this node does not "
              f"hold the whole array (saved with sharding {rec.sharding or 'unknown'}). Give "
              "the target leaf a sharding (e.g. jax.ShapeDtypeStruct(shape, dtype, "
              "sharding=...)).")
        slot = [None]
        jobs.append((slot, full_rec, dtype, where))
        leaf_plans.append(("host", slot, rec.python_type, leaf, rec.key_impl, cast_to))
      else:
        by_index = {s.index: s for s in rec.shards}
        device_slots = []
        for device, index in sharding.addressable_devices_indices_map(shape).items():
          norm = normalize_index(index, shape) + whole_index(key_dims)
          shard_rec = by_index.get(norm)
          if shard_rec is None:
            raise _sharding_mismatch(where, rec, sharding, norm, device)
          slot = [None]
          jobs.append((slot, shard_rec, dtype, where))
          device_slots.append((device, slot))
        leaf_plans.append(("array", device_slots, sharding, shape, rec.key_impl, cast_to))
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
    if plan[0] == "process":
      restored[item_name] = process_state.decode(plan[1], plan[2][0])
      continue
    _, treedef, leaf_plans = plan
    leaves = []
    for leaf_plan in leaf_plans:
      if leaf_plan[0] == "host":
        _, slot, python_type, target_leaf, key_impl, cast_to = leaf_plan
        value = slot[0] if cast_to is None else local_cast.cast(slot[0], cast_to)
        if key_impl is not None:  # keys are jax arrays: on the default device
          value = jax.random.wrap_key_data(value, impl=key_impl)
        elif python_type is not None and not isinstance(target_leaf, (np.ndarray, jax.Array)):
          value = {"int": int, "float": float, "bool": bool}[python_type](value)
        leaves.append(value)
      else:
        _, device_slots, sharding, shape, key_impl, cast_to = leaf_plan
        if cast_to is not None:  # on the host, as Orbax casts while it reads
          device_slots = [(device, [local_cast.cast(slot[0], cast_to)])
                          for device, slot in device_slots]
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


def process_shard(item_name: str, record: ItemRecord, target: Any, step: int) -> ShardRecord:
  """The one shard of a per-process item, once the target asks for what was saved."""
  asked = target.format if isinstance(target, process_state.ProcessTarget) else None
  saved = record.value.get("format") if record.kind == "process" else None
  if asked is None:
    raise AbstractStateMismatchError(
        f"Item {item_name!r} of step {step} holds per-process state ({saved}): restore it with "
        f"{_RESTORE_ARGS[saved]}, or leave it out of the restore args.")
  if saved != asked:
    what = f"per-process state ({saved})" if saved else f"a {record.kind} item"
    raise AbstractStateMismatchError(
        f"Item {item_name!r} of step {step} holds {what}, but the restore asks for "
        f"{_RESTORE_ARGS[asked]}. Restore it with the args its kind needs.")
  return record.leaves[0].shards[0]


_RESTORE_ARGS = {process_state.JSON: "orbax_mtc.ProcessJsonRestore()",
                 process_state.GRAIN: "grain.checkpoint.CheckpointRestore(iterator)"}
