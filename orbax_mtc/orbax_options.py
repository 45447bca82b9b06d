"""Orbax's own option objects taken as ours, field for field (no I/O).

Code written for Orbax's emergency managers builds
`orbax.checkpoint.experimental.emergency.checkpoint_manager.CheckpointManagerOptions` (with its
`LocalCheckpointOptions`, `PersistentCheckpointOptions` and `MultiprocessingOptions`), or the
replicator manager's `ReplicatorCheckpointManagerOptions`. Each of our option classes carries
every field of Orbax's class of the same name, with Orbax's meaning and default
(tests/test_orbax_parity.py), so an Orbax instance converts field for field. A field ours lacks
(one a newer Orbax adds) is dropped, with a warning once per process when it is set to other
than Orbax's default.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

from orbax.checkpoint.experimental.emergency import checkpoint_manager as emergency
from orbax.checkpoint.experimental.emergency import replicator_checkpoint_manager as replicator

from orbax_mtc.option_checks import warn_once

T = TypeVar("T")

_ORBAX_MODULES = (emergency, replicator)


def counterpart(cls: type) -> type | None:
  """Orbax's option class of the same name as our `cls`, or None when Orbax has none."""
  for module in _ORBAX_MODULES:
    theirs = getattr(module, cls.__name__, None)
    if isinstance(theirs, type) and dataclasses.is_dataclass(theirs):
      return theirs
  return None


def is_orbax(value: Any, cls: type) -> bool:
  """Whether `value` is an instance of Orbax's counterpart of our option class `cls`."""
  theirs = counterpart(cls)
  return theirs is not None and isinstance(value, theirs) and not isinstance(value, cls)


def _set(field: dataclasses.Field, value: Any) -> bool:
  """Whether `value` differs from the field's default (a value that cannot say: it does)."""
  if field.default is not dataclasses.MISSING:
    default = field.default
  elif field.default_factory is not dataclasses.MISSING:
    default = field.default_factory()
  else:
    return True
  try:
    return bool(value != default)
  except Exception:  # noqa: BLE001 - an object whose comparison is not a bool
    return True


def as_ours(value: T | Any, cls: type[T], owner: str) -> T:
  """`value` as an instance of our option class `cls`.

  Args:
    value: an instance of `cls`, or of Orbax's class of the same name (converted field for
      field; a nested Orbax option object is converted by our class's own checks).
    cls: our option class.
    owner: how the value is named in messages (e.g. "CheckpointManagerOptions.local").

  Returns:
    `value` itself, or a new instance of `cls` with the Orbax instance's fields.

  Raises:
    TypeError: `value` is neither; ValueError and TypeError from `cls`'s checks.
  """
  if isinstance(value, cls):
    return value
  theirs = counterpart(cls)
  if not is_orbax(value, cls):
    also = f" (or Orbax's {theirs.__module__}.{theirs.__name__})" if theirs else ""
    raise TypeError(f"{owner} must be an orbax_mtc.{cls.__name__}{also}, got "
                    f"{type(value).__module__}.{type(value).__name__}.")
  ours = {field.name for field in dataclasses.fields(cls)}
  kwargs = {}
  for field in dataclasses.fields(value):
    item = getattr(value, field.name)
    if field.name in ours:
      kwargs[field.name] = item
    elif _set(field, item):
      warn_once(f"orbax-field:{theirs.__name__}.{field.name}",
                "orbax-mtc: Orbax's %s.%s=%r has no counterpart in orbax_mtc.%s and is not "
                "applied.", theirs.__name__, field.name, item, cls.__name__)
  return cls(**kwargs)
