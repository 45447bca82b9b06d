"""The two documented ways into `orbax_mtc.CheckpointManager`, told apart from the call (pure).

- multi-tier: `CheckpointManager(local_directory, persistent_directory, global_mesh,
  abstract_state, *, options=orbax_mtc.CheckpointManagerOptions(...), ...)`.
- parent-style: `ocp.CheckpointManager`'s own signature (`directory, checkpointers=None,
  options=None, metadata=None, item_names=None, item_handlers=None, logger=None,
  handler_registry=None`), plus keyword-only `local_directory=` and friends to add a RAM tier.

The parent's second positional parameter is `checkpointers` (a Checkpointer, a dict of them or
None), never a path, so a path in second place, or `persistent_directory=`, means multi-tier.
"""

from __future__ import annotations

import hashlib
import inspect
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orbax_mtc import orbax_options

if TYPE_CHECKING:
  import jax
  import orbax.checkpoint as ocp
  from etils import epath
  from orbax.checkpoint.experimental.emergency import checkpoint_manager as emergency

  from orbax_mtc.options import (
    CheckpointManagerOptions,
    LocalCheckpointOptions,
    ReplicationOptions,
  )

MULTI_TIER = "multi-tier"
PARENT_STYLE = "parent-style"

# Set by a test harness (e.g. Orbax's own CheckpointManager suite) to give every parent-style
# manager built without `local_directory` a RAM tier under this folder.
LOCAL_ROOT_ENV = "ORBAX_MTC_PARENT_STYLE_LOCAL_ROOT"


# The two forms' parameters, annotated. Never called: their signatures bind a call
# (`bind`), and `CheckpointManager.__init__`'s overloads repeat them for type checkers
# (tests/test_manager_edges.py keeps the two the same).


def multi_tier(
    local_directory: epath.PathLike,
    persistent_directory: epath.PathLike,
    global_mesh: jax.sharding.Mesh,
    abstract_state: Any,
    *,
    options: CheckpointManagerOptions | emergency.CheckpointManagerOptions | None
    = None,
    metadata: Mapping[str, Any] | None = None,
    logger: ocp.logging.AbstractLogger | None = None,
    item_handlers: ocp.CheckpointHandler | Mapping[str, ocp.CheckpointHandler] | None = None,
    handler_registry: ocp.handlers.CheckpointHandlerRegistry | None = None,
    persistent_non_replicated_directory: epath.PathLike | None = None,
) -> None:
  """Orbax's emergency `CheckpointManager` signature."""


def parent_style(
    directory: epath.PathLike,
    checkpointers: ocp.AbstractCheckpointer | Mapping[str, ocp.AbstractCheckpointer] | None
    = None,
    options: ocp.CheckpointManagerOptions | None = None,
    metadata: Mapping[str, Any] | None = None,
    item_names: Sequence[str] | None = None,
    item_handlers: ocp.CheckpointHandler | Mapping[str, ocp.CheckpointHandler] | None = None,
    logger: ocp.logging.AbstractLogger | None = None,
    handler_registry: ocp.handlers.CheckpointHandlerRegistry | None = None,
    *,
    local_directory: epath.PathLike | None = None,
    global_mesh: jax.sharding.Mesh | None = None,
    abstract_state: Any = None,
    local_options: LocalCheckpointOptions | None = None,
    replication_options: ReplicationOptions | None = None,
    job_name: str | None = None,
) -> None:
  """`ocp.CheckpointManager`'s signature, and the keyword-only parameters of a RAM tier."""


MULTI_TIER_SIGNATURE = inspect.signature(multi_tier)
PARENT_STYLE_SIGNATURE = inspect.signature(parent_style)


def describe(signature: inspect.Signature, indent: str = "") -> str:
  """`signature` as Python spells it, annotations unquoted, one parameter a line (each line
  after the first starts with `indent`, for a docstring)."""
  lines, star = [], False
  for param in signature.parameters.values():
    if param.kind == inspect.Parameter.KEYWORD_ONLY and not star:
      lines.append("*")
      star = True
    text = param.name
    if param.annotation is not inspect.Parameter.empty:
      text += f": {param.annotation}"
    if param.default is not inspect.Parameter.empty:
      text += f" = {param.default!r}"
    lines.append(text)
  sep = f"\n{indent}    "
  return "(" + sep + f",{sep}".join(lines) + ")"


def _names(signature: inspect.Signature) -> inspect.Signature:
  """`signature` without its annotations (short enough for an error message)."""
  empty = inspect.Parameter.empty
  return signature.replace(
      parameters=[p.replace(annotation=empty) for p in signature.parameters.values()],
      return_annotation=empty)


_PARENT_ONLY = ("directory", "checkpointers", "item_names")


def _is_path(value: Any) -> bool:
  return isinstance(value, (str, os.PathLike))


def choose_form(args: tuple[Any, ...], kwargs: dict[str, Any], mtc_options_type: type) -> str:
  """Tells which form of the constructor a call uses.

  Args:
    args: The call's positional arguments.
    kwargs: The call's keyword arguments.
    mtc_options_type: The multi-tier options class (`orbax_mtc.CheckpointManagerOptions`).

  Returns:
    `MULTI_TIER` or `PARENT_STYLE`.
  """
  if "persistent_directory" in kwargs or "persistent_non_replicated_directory" in kwargs:
    return MULTI_TIER
  if any(name in kwargs for name in _PARENT_ONLY):
    return PARENT_STYLE
  if len(args) >= 2 and _is_path(args[1]):
    return MULTI_TIER
  options = kwargs.get("options", args[2] if len(args) >= 3 else None)
  if isinstance(options, mtc_options_type) or orbax_options.is_orbax(options, mtc_options_type):
    return MULTI_TIER  # ours, or Orbax's emergency options (converted by check_multi_tier)
  if not args and "local_directory" in kwargs and "global_mesh" in kwargs:
    return MULTI_TIER  # all by keyword, persistent_directory forgotten: say so below
  return PARENT_STYLE


def bind(args: tuple[Any, ...], kwargs: dict[str, Any],
         mtc_options_type: type) -> tuple[str, dict[str, Any]]:
  """Binds a constructor call to the signature of its form.

  Args:
    args: The call's positional arguments.
    kwargs: The call's keyword arguments.
    mtc_options_type: The multi-tier options class (`orbax_mtc.CheckpointManagerOptions`).

  Returns:
    (form, every parameter of that form by name, defaults applied).

  Raises:
    TypeError: If the call does not fit the signature of its form; the message shows both.
  """
  form = choose_form(args, kwargs, mtc_options_type)
  signature = MULTI_TIER_SIGNATURE if form == MULTI_TIER else PARENT_STYLE_SIGNATURE
  try:
    bound = signature.bind(*args, **kwargs)
  except TypeError as e:
    raise TypeError(
        f"orbax_mtc.CheckpointManager: this call looks like the {form} form but {e}. The two "
        f"forms are:\n  multi-tier:   CheckpointManager{_names(MULTI_TIER_SIGNATURE)}\n"
        f"  parent-style: CheckpointManager{_names(PARENT_STYLE_SIGNATURE)}") from None
  bound.apply_defaults()
  return form, dict(bound.arguments)


def local_directory_from_env(directory: Any, process_index: int) -> Path | None:
  """The RAM-tier folder a harness asks for through LOCAL_ROOT_ENV.

  Same persistent `directory` -> same folder, so a manager re-created on a directory finds
  the RAM steps of the previous one; one folder per process, as on separate hosts.

  Args:
    directory: The manager's persistent directory.
    process_index: This process's index.

  Returns:
    The folder, or None when LOCAL_ROOT_ENV is unset or empty.
  """
  root = os.environ.get(LOCAL_ROOT_ENV)
  if not root:
    return None
  key = hashlib.sha1(os.path.abspath(str(directory)).encode()).hexdigest()[:16]
  return Path(root) / key / f"p{process_index}"


def check_multi_tier(local_directory: Any, persistent_directory: Any, global_mesh: Any,
                     options: Any, mtc_options_type: type) -> Any:
  """Checks the multi-tier form's arguments.

  Args:
    local_directory: the RAM-disk folder.
    persistent_directory: the persistent folder.
    global_mesh: the training mesh.
    options: orbax_mtc options (or Orbax's emergency ones, converted), or None for the
      defaults.
    mtc_options_type: `orbax_mtc.CheckpointManagerOptions`.

  Returns:
    The options (defaults when None).

  Raises:
    TypeError: options or mesh of another type.
    ValueError: a directory is missing.
  """
  import jax

  options = mtc_options_type() if options is None else options
  if orbax_options.is_orbax(options, mtc_options_type):  # Orbax's emergency options object
    options = orbax_options.as_ours(options, mtc_options_type, "options")
  if not isinstance(options, mtc_options_type):
    raise TypeError(
        "options must be an orbax_mtc.CheckpointManagerOptions, got "
        f"{type(options).__module__}.{type(options).__name__}. Build it with "
        "orbax_mtc.CheckpointManagerOptions(local=..., persistent=...), or use the "
        "parent-style form CheckpointManager(directory, options=ocp.CheckpointManagerOptions"
        "(...), local_directory=...).")
  if not isinstance(global_mesh, jax.sharding.Mesh):
    raise TypeError(f"global_mesh must be a jax.sharding.Mesh, got {type(global_mesh)}.")
  if local_directory is None or persistent_directory is None:
    raise ValueError("Both local_directory (RAM disk) and persistent_directory are required.")
  return options


def check_distinct(local_directory: Any, persistent_directory: Any) -> None:
  """Raises ValueError when the RAM tier's folder is the persistent one."""
  if str(Path(str(local_directory))) == str(persistent_directory):
    raise ValueError("local_directory and persistent_directory must be different folders.")
