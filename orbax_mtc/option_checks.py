"""Checks shared by the option dataclasses: clear errors naming the option and the fix.

Also `warn_once` (an option that is accepted but not applied is said once per process) and
`ram_keep_from_policy` (an Orbax preservation policy read as the RAM tier's retention).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from absl import logging
from orbax.checkpoint import checkpoint_managers as policies

from orbax_mtc.local.priority import MAX_NICE

_warned: set[str] = set()  # keys warned about in this process


def warn_once(key: str, message: str, *args: Any) -> None:
  """Logs an absl warning once per `key` per process (an option we accept but do not apply).

  Args:
    key: What the warning is about; later calls with the same key log nothing.
    message: The %-style format of the warning.
    *args: Its arguments.
  """
  if key not in _warned:
    _warned.add(key)
    logging.warning(message, *args)


def check_bool(owner: str, name: str, value: Any) -> None:
  if not isinstance(value, bool):
    raise TypeError(f"{owner}.{name} must be a bool, got {value!r}.")


def ram_keep_from_policy(owner: str, policy: Any) -> int | None:
  """How many steps the RAM tier keeps for an Orbax `PreservationPolicy`.

  `LatestN(n)` keeps n; any other policy decides step by step (`retention.RamRetention`):
  None.

  Args:
    owner: The options class the policy belongs to, named in messages.
    policy: The Orbax `PreservationPolicy`.

  Returns:
    The number of RAM steps to keep, >= 1, or None.

  Raises:
    ValueError: If the policy is `LatestN` with an `n` that is not an int >= 1.
  """
  n = policy.n if isinstance(policy, policies.LatestN) else None
  if n is not None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
      raise ValueError(f"{owner}.preservation_policy=LatestN(n={n!r}): the RAM tier keeps "
                       "n >= 1 steps (the newest committed step is always kept).")
    return n
  return None


def check_interval(owner: str, name: str, value: int | None, *, allow_none: bool) -> None:
  if value is None:
    if allow_none:
      return
    raise ValueError(f"{owner}.{name} must be a positive integer, got None.")
  if isinstance(value, bool) or not isinstance(value, int):
    raise TypeError(
        f"{owner}.{name} must be an int, got {type(value).__name__} ({value!r})."
    )
  if value <= 0:
    raise ValueError(
        f"{owner}.{name} must be a positive number of steps, got {value}. "
        "Use a value >= 1 (1 saves every step)."
    )


def check_max_to_keep(owner: str, value: int | None) -> None:
  if value is None:
    return
  if isinstance(value, bool) or not isinstance(value, int):
    raise TypeError(f"{owner}.max_to_keep must be an int or None, got {value!r}.")
  if value < 1:
    raise ValueError(
        f"{owner}.max_to_keep must be >= 1 (or None to keep every step), got {value}: "
        "the newest committed step is always kept."
    )


def check_modes(owner: str, directory_mode: Any, file_mode: Any) -> None:
  """Permission bits that give the owner rwx on folders and rw on files."""
  for name, mode in (("directory_mode", directory_mode), ("file_mode", file_mode)):
    if isinstance(mode, bool) or not isinstance(mode, int) or not 0 <= mode <= 0o777:
      raise ValueError(f"{owner}.{name} must be permission bits such as 0o700, got {mode!r}.")
  if not directory_mode & 0o700 == 0o700 or not file_mode & 0o600 == 0o600:
    raise ValueError(f"{owner}: the owner needs rwx on folders (directory_mode & 0o700) and rw "
                     f"on files (file_mode & 0o600); got {oct(directory_mode)} and "
                     f"{oct(file_mode)}.")


def check_nice(owner: str, name: str, value: Any) -> None:
  """A nice increment: an int in 0-MAX_NICE."""
  if isinstance(value, bool) or not isinstance(value, int):
    raise TypeError(f"{owner}.{name} must be an int (0-{MAX_NICE}, as `nice -n`), got "
                    f"{value!r}.")
  if not 0 <= value <= MAX_NICE:
    raise ValueError(f"{owner}.{name} must be in 0-{MAX_NICE} (as `nice -n`; 0 keeps the "
                     f"process's priority), got {value!r}.")


def check_fraction(owner: str, name: str, value: Any) -> None:
  """None, or a fraction in (0, 1]."""
  if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                            or not 0 < value <= 1):
    raise ValueError(f"{owner}.{name} must be a fraction in (0, 1] of the loop's time (e.g. "
                     f"0.02), or None; got {value!r}.")


def checked_peer_ranks(peer_ranks: Any) -> tuple[tuple[int, ...], ...]:
  """`ReplicationOptions.peer_ranks` checked, as a tuple of tuples."""
  if isinstance(peer_ranks, (str, bytes)) or not isinstance(peer_ranks, Sequence):
    raise ValueError("ReplicationOptions.peer_ranks must be one list of ranks per node, "
                     f"e.g. [[1], [0]]; got {peer_ranks!r}.")
  for node, ranks in enumerate(peer_ranks):
    if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Sequence) or any(
        isinstance(r, bool) or not isinstance(r, int) for r in ranks):
      raise ValueError(f"ReplicationOptions.peer_ranks[{node}] must be a list of int ranks, "
                       f"got {ranks!r}.")
    if node in ranks:
      raise ValueError(f"ReplicationOptions.peer_ranks[{node}] names node {node} as its own "
                       "peer: a copy on the same node dies with it. Choose other nodes.")
  return tuple(tuple(r) for r in peer_ranks)


def check_timeout(name: str, value: Any) -> None:
  if isinstance(value, bool) or not isinstance(value, (int, float)) or \
      not 0 < value < float("inf"):
    raise ValueError(
        f"{name} must be a finite number of seconds > 0, got {value!r}. It bounds how long "
        "processes wait for each other at each save and restore; use at least the longest gap "
        "between processes reaching a save (e.g. 600).")
