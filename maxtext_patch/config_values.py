"""Typed readers for MaxText config values (booleans, integers, numbers, text), no I/O.

Shared by `config` (the keys and their meaning) and `modes` (the mode flags and MaxText's
legacy replicator keys); values from a command line arrive as strings and are accepted.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

_TRUE, _FALSE, _NONE = ("true", "1", "yes"), ("false", "0", "no"), ("none", "null", "")


class MaxTextConfigError(ValueError):
  """A MaxText or orbax-mtc config key has a value orbax-mtc cannot use."""


def read_key(config: Any, key: str, default: Any) -> Any:
  """One key of a MaxText config: HyperParameters (`config.key`) or a mapping (`config[key]`),
  else `default`."""
  if isinstance(config, Mapping):
    return config.get(key, default)
  try:
    return getattr(config, key)
  except (AttributeError, KeyError):
    return default


def as_bool(key: str, value: Any) -> bool:
  """Reads a boolean key; strings true/1/yes and false/0/no are accepted.

  Args:
    key: The key, named in the error.
    value: Its value.

  Returns:
    The boolean.

  Raises:
    MaxTextConfigError: If `value` is neither a bool nor such a string.
  """
  if isinstance(value, bool):
    return value
  if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
    return value.strip().lower() in _TRUE
  raise MaxTextConfigError(f"{key} must be true or false, got {value!r}.")


def as_int(key: str, value: Any, *, minimum: int, optional: bool = False) -> int | None:
  """An integer key >= `minimum` (`_` separators accepted); None/none/null/"" give None when
  `optional`. Raises MaxTextConfigError otherwise."""
  if optional and (value is None or (isinstance(value, str) and value.strip().lower() in _NONE)):
    return None
  if isinstance(value, str):
    try:
      value = int(value.strip().replace("_", ""))
    except ValueError:
      pass
  if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
    also = " or None" if optional else ""
    raise MaxTextConfigError(f"{key} must be an integer >= {minimum}{also}, got {value!r}.")
  return value


def as_number(key: str, value: Any, *, positive: bool, optional: bool = False) -> float | None:
  """A finite number key, > 0 when `positive` else >= 0; None/none/null/"" give None when
  `optional`. Raises MaxTextConfigError otherwise."""
  if optional and (value is None or (isinstance(value, str) and value.strip().lower() in _NONE)):
    return None
  if isinstance(value, str):
    try:
      value = float(value)
    except ValueError:
      pass
  ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
  if not ok or (value <= 0 if positive else value < 0):
    bound = "> 0" if positive else ">= 0"
    raise MaxTextConfigError(f"{key} must be a finite number {bound}, got {value!r}.")
  return float(value)


def as_text(key: str, value: Any) -> str:
  """A string key, stripped; None gives "". Raises MaxTextConfigError for a non-string."""
  if value is None:
    return ""
  if not isinstance(value, str):
    raise MaxTextConfigError(f"{key} must be a string, got {value!r}.")
  return value.strip()
