"""Pax (paxml) on orbax-mtc: RAM tier, peer copies and Pax's persistent checkpoints.

  import pax_patch
  pax_patch.install(pax_patch.MtcConfig(local_directory="/dev/shm/pax", peers_per_node=1))
  # ... then run Pax as usual: its training checkpointer is now PaxTrainingCheckpointer.

or, from the command line, `python -m pax_patch.main <Pax flags> --mtc_local_checkpoint_dir=...`
(see docs/pax.md). `install()` rebinds the function Pax's trainer creates its training
checkpointer with (`paxml.checkpoint_creators._create_checkpointer`, also bound as
`paxml.train._create_checkpointer`); `uninstall()` puts Pax's back.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import re
import threading
from typing import Any

from pax_patch.checkpoint_manager import PaxCheckpointManager, pax_metadata, step_name_format
from pax_patch.checkpointer import (
  PAX_ONDEMAND_EXIT_STATUS,
  MtcConfig,
  PaxTrainingCheckpointer,
  create_checkpointer,
)

# First paxml release with checkpoint_creators._create_checkpointer (and train's alias of it):
# 1.1.0. Checked against every release up to 1.4.0 and the repository head.
MIN_PAXML = (1, 1, 0)
MAX_PAXML_EXCLUSIVE = (2, 0, 0)
SUPPORTED_PAXML = ">=1.1.0,<2"

__all__ = [
    "MIN_PAXML",
    "PAX_ONDEMAND_EXIT_STATUS",
    "SUPPORTED_PAXML",
    "MtcConfig",
    "PaxCheckpointManager",
    "PaxTrainingCheckpointer",
    "PaxmlUnavailableError",
    "create_checkpointer",
    "install",
    "installed",
    "pax_metadata",
    "step_name_format",
    "uninstall",
]


class PaxmlUnavailableError(ImportError):
  """paxml is missing, cannot be imported, or is outside the supported versions."""


_LOCK = threading.Lock()
_ORIGINALS: dict[str, Any] = {}  # "module.attr" -> Pax's own function, while installed


def _installed_paxml_version() -> str | None:
  """The installed distribution's version, None when paxml has no metadata (a checkout)."""
  try:
    return importlib.metadata.version("paxml")
  except importlib.metadata.PackageNotFoundError:
    return None


def _version_tuple(text: str) -> tuple[int, ...]:
  return tuple(int(p) for p in re.findall(r"\d+", text)[:3])


def _unavailable(reason: str) -> PaxmlUnavailableError:
  return PaxmlUnavailableError(
      f"pax_patch.install() needs paxml {SUPPORTED_PAXML} (the releases whose trainer builds "
      f"its checkpointer with checkpoint_creators._create_checkpointer): {reason}. Install "
      f"it with `pip install 'paxml{SUPPORTED_PAXML}'` in an environment whose JAX it "
      "supports (paxml pins old JAX releases), or drive PaxTrainingCheckpointer from your own "
      "loop (see pax_patch/example_executor.py).")


def _pax_modules() -> tuple[Any, Any]:
  version = _installed_paxml_version()
  if version is not None:
    parsed = _version_tuple(version)
    if not MIN_PAXML <= parsed < MAX_PAXML_EXCLUSIVE:
      raise _unavailable(f"paxml {version} is installed")
  try:
    creators = importlib.import_module("paxml.checkpoint_creators")
    train = importlib.import_module("paxml.train")
  except ImportError as e:
    if version is None and getattr(e, "name", None) in ("paxml", "paxml.checkpoint_creators"):
      raise _unavailable("paxml is not installed") from e
    raise _unavailable(f"importing paxml failed ({type(e).__name__}: {e})") from e
  for module in (creators, train):
    if not callable(getattr(module, "_create_checkpointer", None)):
      raise _unavailable(f"{module.__name__} has no _create_checkpointer (paxml "
                         f"{version or 'of unknown version'} is too old)")
  return creators, train


def _external_restore_fn(creators: Any, task_p: Any) -> Any:
  """Pax's restore from `task.train.external_checkpoint_path`, used when no tier has a step."""
  train_p = task_p.train
  path = getattr(train_p, "external_checkpoint_path", None)
  restore = getattr(creators, "_restore_from_external_checkpoint", None)
  if not path or restore is None:
    return None

  def restore_external(metadata, partitioner, train_input_pipeline):
    return restore(path, getattr(train_p, "external_checkpoint_handler", None), metadata,
                   partitioner, train_input_pipeline=train_input_pipeline)

  return restore_external


def install(config: MtcConfig | None = None) -> None:
  """Makes Pax's trainer build `PaxTrainingCheckpointer` (orbax-mtc) instead of its own.

  Calling it again replaces the config.

  Args:
    config: orbax-mtc's settings for the checkpointers Pax creates; None for `MtcConfig()`.

  Raises:
    PaxmlUnavailableError: If paxml is missing, fails to import, or is outside the supported
      versions (the message names them).
  """
  config = config or MtcConfig()
  creators, train = _pax_modules()

  @functools.wraps(create_checkpointer)
  def pax_create_checkpointer(task_p, job_log_dir, checkpoint_type, *args, **kwargs):
    return create_checkpointer(task_p, job_log_dir, checkpoint_type, *args, config=config,
                               external_restore_fn=_external_restore_fn(creators, task_p),
                               **kwargs)

  pax_create_checkpointer.pax_patch_config = config  # type: ignore[attr-defined]
  with _LOCK:
    for module in (creators, train):
      key = f"{module.__name__}._create_checkpointer"
      _ORIGINALS.setdefault(key, module._create_checkpointer)
      module._create_checkpointer = pax_create_checkpointer
  checkpoints = getattr(creators, "checkpoints", None)
  base = getattr(checkpoints, "TrainingCheckpointer", None)
  if base is not None and hasattr(base, "register"):
    base.register(PaxTrainingCheckpointer)  # an ABC: isinstance checks see ours as Pax's


def uninstall() -> None:
  """Puts Pax's own checkpointer creation back (does nothing when not installed)."""
  with _LOCK:
    for key, original in list(_ORIGINALS.items()):
      module_name, _, attr = key.rpartition(".")
      module = importlib.import_module(module_name)
      setattr(module, attr, original)
      del _ORIGINALS[key]


def installed() -> bool:
  """Whether `install()` is in effect (and not undone by `uninstall()`)."""
  with _LOCK:
    return bool(_ORIGINALS)
