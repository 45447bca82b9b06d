"""Persistent backups taken from the RAM tier: the schedule (pure) and the bookkeeping.

A backup is of a step already committed in this node's RAM folder. After the local write of a
step chosen for backup commits, a background thread reads the step back from the RAM disk
(checking every shard's CRC32C) into host arrays with the shardings it was saved with. When
every process has its copy and no earlier backup is still being written, the main thread hands
those arrays to the parent's save, i.e. Orbax writes a standard checkpoint (through TensorStore,
to a path or gs://) in the background. Training is never blocked by a second device->host copy,
and Orbax's replica selection writes each shard once (no duplicate uploads from data-parallel
twins).

Failures (the store down, 5xx, timeouts) are Orbax's async errors: the manager logs each once
with its step, keeps training, and tries again at the next scheduled backup; Orbax's commit
protocol (atomic rename, or `commit_success.txt` on object stores) keeps the partial step
invisible.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as policies

from orbax_mtc import files, process_state
from orbax_mtc.agreement import Status

# Re-exported: this error lived here before errors.py; other modules name it through this one.
from orbax_mtc.errors import BackupError as BackupError

_DEFAULT_ITEM = "default"


@dataclasses.dataclass(frozen=True)
class BackupIntervalPolicy:
  """Backs up when `minutes` have passed since the last backup attempt.

  This is the GKE replicator's `backup-interval-minutes`; it never backs up while an earlier
  backup is still being written.

  An Orbax `SaveDecisionPolicy`: pure, so it composes with Orbax's policies. Unlike Orbax's
  ContinuousCheckpointingPolicy it does not broadcast: the manager evaluates it on process 0
  and shares the answer in the agreement every local save already makes. `previous_steps`
  are the attempts, failed ones included, so a failure waits for the next interval.

  Attributes:
    minutes: The interval in minutes.

  Raises:
    ValueError: If `minutes` is not a positive finite number.
  """

  minutes: float

  def __post_init__(self):
    if isinstance(self.minutes, bool) or not isinstance(self.minutes, (int, float)) \
        or not 0 < self.minutes < float("inf"):
      raise ValueError(f"backup interval must be a positive number of minutes, got "
                       f"{self.minutes!r}.")

  def should_save(self, step: policies.PolicyCheckpointInfo,
                  previous_steps: Sequence[policies.PolicyCheckpointInfo], *,
                  context: policies.DecisionContext) -> bool:
    """Decides whether `step` is backed up (Orbax's `SaveDecisionPolicy.should_save`).

    Args:
      step: The step asked about, with its time.
      previous_steps: Earlier backup attempts, oldest first.
      context: Orbax's decision context; a save in progress means no.

    Returns:
      True if no save is in progress and no attempt was made yet or the last one is at least
      `minutes` older than `step`.
    """
    if context.is_saving_in_progress:
      return False
    if not previous_steps:
      return True
    return step.time - previous_steps[-1].time >= dt.timedelta(minutes=self.minutes)


@dataclasses.dataclass(frozen=True)
class _Attempt:
  """A PolicyCheckpointInfo for a backup attempt."""

  step: int
  time: dt.datetime
  metrics: dict[str, Any] | None = None


def interval_due(policy: BackupIntervalPolicy, step: int, now: float,
                 last_attempt: tuple[int, float] | None, saving: bool) -> bool:
  """Asks `policy` with plain numbers (seconds since the epoch).

  Args:
    policy: The interval policy.
    step: The step asked about.
    now: The current time, in seconds since the epoch.
    last_attempt: (step, time in seconds since the epoch) of the last backup attempt, or None.
    saving: Whether a backup is still being written.

  Returns:
    Whether the policy backs up `step` now.
  """
  def at(seconds: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(seconds, tz=dt.UTC)

  previous = [] if last_attempt is None else [_Attempt(last_attempt[0], at(last_attempt[1]))]
  context = policies.DecisionContext(
      is_saving_in_progress=saving, reached_preemption=False,
      multiprocessing_options=ocp.options.MultiprocessingOptions())
  return policy.should_save(_Attempt(step, at(now)), previous, context=context)


def templates(args: Any) -> tuple[dict[str, Any], bool]:
  """The save args of each item with the data left out.

  They are kept until the backup starts without holding on to the device arrays (`JsonSave`
  args are small and kept whole).

  Args:
    args: The Orbax save args of a save: a `Composite` or a single item's args.

  Returns:
    (item name -> args without data, whether it was a single-item save).
  """
  if isinstance(args, ocp.args.Composite):
    return {name: _template(item) for name, item in args.items()}, False
  return {_DEFAULT_ITEM: _template(args)}, True


def process_targets(item_templates: Mapping[str, Any]) -> dict[str, Any]:
  """Read-back targets of the per-process items: their saved bytes, as they are."""
  out = {}
  for name, template in item_templates.items():
    fmt = process_state.save_format(template)
    if fmt is not None:
      out[name] = process_state.ProcessTarget(fmt, raw=True)
  return out


def _template(item: Any) -> Any:
  if isinstance(item, ocp.args.JsonSave):
    return item  # small: kept whole
  return dataclasses.replace(item, item=None)


def host_targets(trees: Mapping[str, Any]) -> dict[str, Any]:
  """Restore targets that rebuild each array leaf with its own sharding.

  Args:
    trees: Item name -> the pytree that was saved.

  Returns:
    Item name -> the same pytree with every jax.Array replaced by its `jax.ShapeDtypeStruct`
    (other leaves as they are).
  """
  def target(leaf: Any) -> Any:
    if isinstance(leaf, jax.Array):
      return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding)
    return leaf

  return {name: jax.tree.map(target, tree) for name, tree in trees.items()}


def backup_args(item_templates: Mapping[str, Any], single: bool,
                values: Mapping[str, Any]) -> Any:
  """Orbax save args of the same kinds as the original save, holding `values`.

  Args:
    item_templates: What `templates` returned for the original save.
    single: Whether it was a single-item save.
    values: Item name -> the value to save (not needed for `JsonSave` items; a per-process
      item's saved bytes).

  Returns:
    The single item's args, or an `ocp.args.Composite` of every item.
  """
  def filled(name: str) -> Any:
    template = item_templates[name]
    if isinstance(template, ocp.args.JsonSave):
      return template
    fmt = process_state.save_format(template)
    if fmt is not None:  # the state as the RAM step holds it, not the live iterator's
      return process_state.backup_args(fmt, values[name])
    return dataclasses.replace(template, item=values[name])

  if single:
    return filled(_DEFAULT_ITEM)
  return ocp.args.Composite(**{name: filled(name) for name in item_templates})


def host_memory_kind(trees: Mapping[str, Any]) -> str | None:
  """Where rebuilt arrays live.

  On accelerators, their pinned host memory (no device memory is taken and Orbax's transfer to
  host is a host copy); on CPU the default memory, which is host memory already.

  Args:
    trees: Item name -> a pytree; its first jax.Array decides.

  Returns:
    "pinned_host" when the first array's device offers it, else None (the default memory).
  """
  for tree in trees.values():
    for leaf in jax.tree_util.tree_leaves(tree):
      if isinstance(leaf, jax.Array):
        device = next(iter(leaf.sharding.device_set))
        if device.platform == "cpu":
          return None
        kinds = {m.kind for m in device.addressable_memories()}
        return "pinned_host" if "pinned_host" in kinds else None
  return None


@dataclasses.dataclass
class PendingBackup:
  """A step chosen for backup, from the local save until Orbax takes it.

  Attributes:
    step: The step.
    templates: Item name -> save args without data (see `templates`).
    single: Whether it was a single-item save.
    targets: Item name -> restore target for the read-back (see `host_targets`).
    memory_kind: Memory the rebuilt arrays live in (see `host_memory_kind`).
    metrics: The metrics passed to `save`.
    custom_metadata: The custom metadata passed to `save`, or None.
    read: A `concurrent.futures.Future` of {item: value} read back from RAM; None until the
      read-back starts.
  """

  step: int
  templates: dict[str, Any]
  single: bool
  targets: dict[str, Any]
  memory_kind: str | None
  metrics: Any
  custom_metadata: dict[str, Any] | None
  read: Any = None  # concurrent.futures.Future of {item: value} read back from RAM

  def state(self) -> Status:
    """Where the read-back is, for the next agreement.

    Returns:
      READING while it has not finished (or not started), FAILED if it raised, else READY.
    """
    if self.read is None or not self.read.done():
      return Status.READING
    return Status.FAILED if self.read.exception() is not None else Status.READY



@dataclasses.dataclass(frozen=True)
class BackupInfo:
  """The newest backup attempt.

  Attributes:
    step: The step backed up.
    state: "uploading", "done", "failed", or "skipped" (`skip_backups_when_busy`).
    started_at: When the attempt started, in seconds since the epoch.
    error: The error of a failed attempt, as text; None otherwise.
  """

  step: int
  state: str
  started_at: float
  error: str | None = None


@dataclasses.dataclass(frozen=True)
class BackupWaits:
  """Time saves spent waiting for room in the backup queue (as Orbax's save waits for the
  previous one), and the due steps skipped instead (`skip_backups_when_busy`).

  Attributes:
    count: Saves that waited.
    seconds: Their total wait.
    skipped: Due steps not backed up, oldest first.
  """

  count: int = 0
  seconds: float = 0.0
  skipped: tuple[int, ...] = ()


SKIPS_FILE = "backup-skips.json"  # in the local directory: due steps skipped (orbax-mtc status)


def record_skips(local_directory: Path, skipped: Sequence[int]) -> None:
  """Keeps the due steps skipped by `skip_backups_when_busy` where `orbax-mtc status` reads
  them (atomically, owner-only)."""
  files.write_atomic(Path(local_directory) / SKIPS_FILE,
                     json.dumps({"skipped_backups": list(skipped)}), mode=0o600)


def read_skips(local_directory: Path) -> list[int]:
  """The steps `record_skips` kept ([] when none or unreadable)."""
  try:
    value = json.loads((Path(local_directory) / SKIPS_FILE).read_text())["skipped_backups"]
  except (OSError, ValueError, KeyError, TypeError):
    return []
  return [int(s) for s in value if isinstance(s, int)] if isinstance(value, list) else []
