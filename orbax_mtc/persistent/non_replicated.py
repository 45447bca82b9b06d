"""Orbax's `persistent_non_replicated_directory`: the `dataset` item, per process, persistent.

Orbax's emergency manager takes a `dataset` item out of each save and restore and hands it to a
plain Orbax manager on that folder (every process writes its own part, e.g. its data iterator's
position; the persistent tier's schedule and retention). Code written for that manager runs
unchanged: the same item name, the same folder layout, Orbax's own manager doing the writing.
Without the folder, a `dataset` item is an ordinary item of ours, kept in every tier
(docs/iterators.md).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import orbax.checkpoint as ocp
from etils import epath

from orbax_mtc import item_args
from orbax_mtc.persistent.tier import AgreedPreemptionManager

DATASET_ITEM = "dataset"  # Orbax's emergency manager's name for the item


class NonReplicatedItems:
  """The `dataset` item's own Orbax manager, or nothing when no folder was given.

  Args:
    directory: `persistent_non_replicated_directory`, or None.
    options: the persistent tier's Orbax options (schedule, retention, async).
    metadata, item_handlers, handler_registry: as given to our manager (as Orbax passes them).
  """

  def __init__(self, directory: epath.PathLike | None,
               options: ocp.CheckpointManagerOptions | None = None, *,
               metadata: Any = None, item_handlers: Any = None, handler_registry: Any = None):
    self.manager: AgreedPreemptionManager | None = None
    if directory is not None:
      # Process 0 writes the shared metadata, as Orbax's emergency manager configures it.
      multiprocessing = ocp.options.MultiprocessingOptions(
          primary_host=0, barrier_sync_key_prefix="non_replicated")
      # Told the agreed preemption step: a plain Orbax manager would ask JAX's sync point
      # itself with the user's step, and that call moves the counter our ids feed.
      self.manager = AgreedPreemptionManager(
          directory, options=dataclasses.replace(options, multiprocessing_options=multiprocessing),
          metadata=metadata, item_handlers=item_handlers, handler_registry=handler_registry)

  def _split(self, args: Any) -> tuple[Any, Any]:
    """(args without the `dataset` item, that item's args or None)."""
    if self.manager is None or not isinstance(args, ocp.args.Composite) \
        or DATASET_ITEM not in args.keys():
      return args, None
    rest = {name: item for name, item in args.items() if name != DATASET_ITEM}
    return ocp.args.Composite(**rest), args[DATASET_ITEM]

  def save(self, step: int, args: Any, *, force: bool, custom_metadata: Any) -> Any:
    """Saves the `dataset` item (on Orbax's schedule for the persistent tier); returns the
    other items' args."""
    rest, dataset = self._split(args)
    if dataset is not None:
      self.manager.save(step, args=dataset, force=force, custom_metadata=custom_metadata)
    return rest

  def restore(self, step: int | None, args: Any, tiers: Any, abstract_state: Any) -> Any:
    """The other items from our tiers (`tiers.restore`), then the `dataset` item of the step
    they came from. Args naming `dataset` alone restore the state from `abstract_state`
    beside it, as Orbax's emergency manager always does."""
    rest, dataset = self._split(args)
    if dataset is not None and not rest.keys():
      rest = None
    restored = tiers.restore(step, *item_args.restore_targets(rest, abstract_state))
    if dataset is None or restored is None:
      return restored
    items = dict(restored.items()) if isinstance(restored, ocp.args.Composite) else {}
    items[DATASET_ITEM] = self.manager.restore(tiers.last.step, args=dataset)
    return ocp.args.Composite(**items)

  def note_preemption(self, step: int) -> None:
    """The agreed preemption step: Orbax's manager saves the item on demand at it."""
    if self.manager is not None:
      self.manager.preemption_step = step

  def wait_until_finished(self) -> None:
    if self.manager is not None:
      self.manager.wait_until_finished()

  def check_for_errors(self) -> None:
    if self.manager is not None:
      self.manager.check_for_errors()

  def close(self) -> None:
    if self.manager is not None:
      self.manager.close()


NONE = NonReplicatedItems(None)
