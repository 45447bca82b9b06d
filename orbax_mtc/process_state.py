"""Per-process items: state each process holds for itself, such as a data iterator's position.

Global arrays are one value sharded over processes; a data iterator's position is one value
per process (each reads its own shard of the data). Such an item is saved in every tier beside
the arrays, one value per process:

* `ProcessJsonSave(value)` / `ProcessJsonRestore()`: any JSON value, for iterators of one's
  own (`{"epoch": 3, "index": 1024}`);
* Grain's `grain.checkpoint.CheckpointSave(iterator)` / `CheckpointRestore(iterator)`: the
  iterator's `get_state()`, restored with `set_state()` into the iterator passed (Grain's own
  semantics).

In the RAM tier the value is a checksummed entry of the process's step folder, so peers copy
it with the node's shards. The persistent tier holds each process's value as
`<item>/process_<index>-of-<count>.json`, the file Grain's own Orbax handler writes and reads,
so plain Orbax restores it (with Grain's args, or with `ProcessJsonRestore`). A value belongs
to the process index that saved it: restoring on another process count is refused with a
clear error, as Grain's handler does.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

JSON = "json"  # a ProcessJsonSave item
GRAIN = "grain"  # a Grain iterator (the manifest's item value names these two)


def file_name(index: int, count: int) -> str:
  """The persistent tier's file of one process (Grain's name)."""
  return f"process_{index}-of-{count}.json"


class ProcessJsonHandler(ocp.CheckpointHandler):
  """Orbax handler of per-process JSON items: each process writes and reads its own
  `process_<index>-of-<count>.json` in the item's folder."""

  def save(self, directory: epath.Path, *args: Any, **kwargs: Any) -> None:
    save_args = kwargs.get("args", args[0] if args else None)
    text = encode(JSON, save_args.item).decode()
    path = epath.Path(directory) / file_name(jax.process_index(), jax.process_count())
    path.write_text(text)

  def restore(self, directory: epath.Path, *args: Any, **kwargs: Any) -> Any:
    del args, kwargs
    directory = epath.Path(directory)
    index, count = jax.process_index(), jax.process_count()
    path = directory / file_name(index, count)
    if not path.exists():
      raise FileNotFoundError(missing_message(directory, index, count))
    return json.loads(path.read_text())

  def metadata(self, directory: epath.Path) -> None:
    del directory
    return None

  def structure(self, directory: epath.Path) -> None:
    del directory
    return None


@ocp.args.register_with_handler(ProcessJsonHandler, for_save=True)
@dataclasses.dataclass
class ProcessJsonSave(ocp.args.CheckpointArgs):
  """Saves one JSON value per process (e.g. a data iterator's position).

  Attributes:
    item: This process's value: JSON-serialisable (dicts, lists, str, numbers, bool, None).
  """

  item: Any


@ocp.args.register_with_handler(ProcessJsonHandler, for_restore=True)
@dataclasses.dataclass
class ProcessJsonRestore(ocp.args.CheckpointArgs):
  """Restores this process's value of a `ProcessJsonSave` item.

  Attributes:
    item: Unused (for symmetry with Orbax's args).
  """

  item: Any = None


def missing_message(directory: Any, index: int, count: int) -> str:
  """The error for a process whose file is not in a persistent item."""
  try:
    present = sorted(p.name for p in epath.Path(directory).iterdir())
  except OSError:
    present = []
  return (f"{directory} has no {file_name(index, count)}: this per-process item was saved by "
          f"another number of processes ({', '.join(present[:4]) or 'no process files'}). A "
          "data iterator's position belongs to the process that saved it: restart with the "
          "process count that saved it, or restore without this item and start the iterators "
          "afresh.")


@functools.cache
def _grain() -> Any:
  """Grain, with `grain.checkpoint` loaded (its args register with Orbax on import); None
  where Grain is not installed."""
  try:
    import grain
    import grain.checkpoint  # noqa: F401
  except ImportError:
    return None
  return grain


def _is_grain(args: Any, names: tuple[str, ...]) -> bool:
  if not type(args).__module__.startswith("grain"):
    return False  # not Grain's: no import of grain
  grain = _grain()
  return grain is not None and isinstance(
      args, tuple(getattr(grain.checkpoint, n) for n in names))


def save_format(args: Any) -> str | None:
  """JSON or GRAIN for the save args of a per-process item; None for other args."""
  if isinstance(args, ProcessJsonSave):
    return JSON
  return GRAIN if _is_grain(args, ("CheckpointSave",)) else None


def restore_format(args: Any) -> str | None:
  """JSON or GRAIN for the restore args of a per-process item; None for other args."""
  if isinstance(args, ProcessJsonRestore):
    return JSON
  return GRAIN if _is_grain(args, ("CheckpointRestore",)) else None


def encode(fmt: str, item: Any) -> bytes:
  """This process's value as the bytes its persistent file holds.

  Args:
    fmt: JSON or GRAIN.
    item: the JSON value (bytes: JSON text already encoded); or the Grain iterator.

  Raises:
    TypeError: a value that is not JSON-serialisable, or not a Grain iterator.
  """
  if fmt == JSON:
    if isinstance(item, bytes):
      return item
    try:
      return json.dumps(item).encode()
    except (TypeError, ValueError) as e:
      raise TypeError(f"a ProcessJsonSave item must be JSON-serialisable: {e}") from e
  get_state = getattr(item, "get_state", None)
  if get_state is None:
    raise TypeError(f"Grain's CheckpointSave needs a Grain iterator (with get_state()), got "
                    f"{type(item).__name__}.")
  state = get_state()
  # As Grain's handler writes it: a DataLoaderIterator's state is JSON bytes already, a
  # DatasetIterator's a JSON-serialisable dict.
  return state if isinstance(state, bytes) else json.dumps(state, indent=4).encode()


@dataclasses.dataclass(frozen=True)
class ProcessTarget:
  """What a restore builds for a per-process item.

  Attributes:
    format: JSON or GRAIN.
    iterator: the Grain iterator to set the state into (GRAIN), else None.
    raw: return the saved bytes as they are (the persistent backup's read-back).
  """

  format: str
  iterator: Any = None
  raw: bool = False


@dataclasses.dataclass(frozen=True)
class PendingIteratorState:
  """A Grain iterator's saved state, read and verified but not yet set into the iterator:
  that waits until every process has built the step (`settle`), so that a restore that ends
  elsewhere (another step, the persistent tier, nothing) leaves the iterator as it finds it."""

  target: ProcessTarget
  data: bytes


def decode(target: ProcessTarget, data: bytes) -> Any:
  """The restored value from this process's saved bytes (checksum already verified); for a
  Grain iterator, a `PendingIteratorState`.

  Raises:
    ValueError: the bytes are not what the item's format holds.
  """
  if target.raw:
    return bytes(data)
  if target.format == JSON:
    return json.loads(bytes(data).decode())
  return PendingIteratorState(target, bytes(data))


def settle(items: dict[str, Any]) -> dict[str, Any]:
  """The restored items with each pending iterator state set into its iterator (once the
  restore has succeeded on every process)."""
  return {name: _set_state(v.target, v.data) if isinstance(v, PendingIteratorState) else v
          for name, v in items.items()}


def _set_state(target: ProcessTarget, data: bytes) -> Any:
  text = data.decode()
  iterator = target.iterator
  grain = _grain()
  if grain is not None and isinstance(iterator, grain.DatasetIterator):
    iterator.set_state(json.loads(text))
  else:
    iterator.set_state(text.encode())
  start = getattr(iterator, "start_prefetch", None)
  if start is not None:
    start()  # as Grain's own handler does after set_state
  return iterator


@dataclasses.dataclass(frozen=True)
class SavedGrainState:
  """A Grain iterator's state as saved, for Grain's handler to write unchanged (the
  persistent backup writes the RAM step's state, not the live iterator's)."""

  data: bytes

  def get_state(self) -> bytes:
    return self.data


def backup_args(fmt: str, data: bytes) -> Any:
  """Save args that make Orbax write `data` as this process's file of the item."""
  if fmt == JSON:
    return ProcessJsonSave(data)
  return _grain().checkpoint.CheckpointSave(SavedGrainState(data))


def restore_args(target: ProcessTarget) -> Any:
  """Orbax restore args of a per-process item (the persistent tier)."""
  if target.format == JSON:
    return ProcessJsonRestore()
  return _grain().checkpoint.CheckpointRestore(target.iterator)
