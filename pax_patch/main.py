"""`python -m pax_patch.main <Pax flags> --mtc_local_checkpoint_dir=...`: Pax's main on orbax-mtc.

Installs `pax_patch` (Pax's trainer then builds the orbax-mtc training checkpointer) and runs
`paxml.main` as `python paxml/main.py` would, with every Pax flag passed through unchanged.
Added flags, read and removed before Pax parses the rest:

  --mtc_local_checkpoint_dir       this host's RAM-disk folder (default: $ORBAX_MTC_LOCAL_DIR,
                                   which `orbax-mtc launch` sets); absolute, outside
                                   <job_log_dir>/checkpoints
  --mtc_local_save_interval_steps  save to RAM every N steps (default 100)
  --mtc_peers_per_node             nodes holding a copy of each node's RAM step (default 1)
  --mtc_replica_axis               the data-parallel mesh axis (default: "data")

The persistent tier is Pax's own: `<job_log_dir>/checkpoints`, on the task's
`save_interval_steps` / `save_max_to_keep`. Pax's `--jax_fully_async_checkpoint` makes Pax join
`jax.distributed` (needed for every host to agree on the on-demand step) and saves in the
background; with `--exit_after_ondemand_checkpoint` Pax's executor closes the checkpointer and
exits with status 1 once the on-demand checkpoint taken after a SIGTERM is durable.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Sequence

from absl import logging

MTC_FLAGS = ("mtc_local_checkpoint_dir", "mtc_local_save_interval_steps", "mtc_peers_per_node",
             "mtc_replica_axis")
PAX_BOOL_FLAGS = ("exit_after_ondemand_checkpoint", "jax_fully_async_checkpoint")
_TRUE = ("1", "true", "t", "yes", "y")
_FALSE = ("0", "false", "f", "no", "n")
USAGE_EXIT_STATUS = 2


class FlagError(ValueError):
  """A `--mtc_*` flag (or its combination with Pax's flags) is invalid."""


@dataclasses.dataclass(frozen=True)
class ParsedFlags:
  """The orbax-mtc settings, the Pax flags we read, and the argv Pax gets.

  Attributes:
    local_checkpoint_dir: This host's RAM-disk folder (absolute).
    local_save_interval_steps: Save to RAM every N steps.
    peers_per_node: Nodes holding a copy of each node's RAM step.
    replica_axis: The data-parallel mesh axis, or None for "data".
    exit_after_ondemand_checkpoint: Pax's flag of that name.
    jax_fully_async_checkpoint: Pax's flag of that name.
    job_log_dir: Pax's `--job_log_dir`, or None if not given.
    pax_argv: The arguments for Pax: every Pax flag, no `--mtc_*` one.
  """

  local_checkpoint_dir: str | None
  local_save_interval_steps: int
  peers_per_node: int
  replica_axis: str | None
  exit_after_ondemand_checkpoint: bool
  jax_fully_async_checkpoint: bool
  job_log_dir: str | None
  pax_argv: list[str]

  def config(self):
    """The `MtcConfig` these flags ask for.

    Returns:
      The `pax_patch.MtcConfig`.

    Raises:
      ValueError: If a value is invalid for `MtcConfig`.
    """
    from pax_patch.checkpointer import MtcConfig

    return MtcConfig(local_directory=self.local_checkpoint_dir,
                     local_save_interval_steps=self.local_save_interval_steps,
                     peers_per_node=self.peers_per_node, replica_axis=self.replica_axis)


def _split(token: str) -> tuple[str, str | None] | None:
  """('name', value or None) of a `--name[=value]` / `-name[=value]` token, else None."""
  if not token.startswith("-") or token in ("-", "--"):
    return None
  body = token[2:] if token.startswith("--") else token[1:]
  name, eq, value = body.partition("=")
  return name, (value if eq else None)


def _int(name: str, text: str, minimum: int, meaning: str) -> int:
  try:
    value = int(text)
  except ValueError:
    raise FlagError(f"--{name}={text!r} is not an integer; it is {meaning}.") from None
  if value < minimum:
    raise FlagError(f"--{name}={value} must be >= {minimum}: it is {meaning}.")
  return value


def _bool(name: str, text: str) -> bool:
  lowered = text.lower()
  if lowered in _TRUE:
    return True
  if lowered in _FALSE:
    return False
  raise FlagError(f"--{name}={text!r} is not a boolean (use 1/0 or true/false).")


def _inside(path: str, folder: str) -> bool:
  path, folder = os.path.normpath(path), os.path.normpath(folder)
  return path == folder or path.startswith(folder + os.sep)


def parse_flags(argv: Sequence[str], environ: dict[str, str] | None = None) -> ParsedFlags:
  """Reads the `--mtc_*` flags (and the Pax flags they depend on) from `argv`.

  Args:
    argv: The command line without the program name.
    environ: The environment to read ORBAX_MTC_LOCAL_DIR from; None for `os.environ`.

  Returns:
    The `ParsedFlags`, with the argv for Pax, which keeps every Pax flag.

  Raises:
    FlagError: If an `--mtc_*` flag is unknown, lacks a value or is malformed, no RAM-disk
      folder is given, or it is not absolute or lies inside Pax's checkpoint folder.
  """
  environ = dict(os.environ if environ is None else environ)
  raw: dict[str, str] = {}
  pax_bools = dict.fromkeys(PAX_BOOL_FLAGS, False)
  job_log_dir: str | None = None
  pax_argv: list[str] = []
  tokens = list(argv)
  i = 0
  while i < len(tokens):
    token = tokens[i]
    i += 1
    if token == "--":  # everything after is positional, for Pax
      pax_argv.extend(tokens[i - 1:])
      break
    parsed = _split(token)
    if parsed is None:
      pax_argv.append(token)
      continue
    name, value = parsed
    if name.startswith("mtc_"):
      if name not in MTC_FLAGS:
        raise FlagError(f"Unknown flag --{name}; pax_patch adds "
                        f"{', '.join('--' + f for f in MTC_FLAGS)}.")
      if value is None:
        if i >= len(tokens):
          raise FlagError(f"--{name} needs a value (--{name}=VALUE).")
        value = tokens[i]
        i += 1
      raw[name] = value
      continue  # ours only: Pax never sees it
    pax_argv.append(token)
    if name in PAX_BOOL_FLAGS:
      pax_bools[name] = True if value is None else _bool(name, value)
    elif name.startswith("no") and name[2:] in PAX_BOOL_FLAGS and value is None:
      pax_bools[name[2:]] = False
    elif name == "job_log_dir":
      if value is None and i < len(tokens):
        value = tokens[i]
        pax_argv.append(value)
        i += 1
      job_log_dir = value

  local_dir = raw.get("mtc_local_checkpoint_dir") or environ.get("ORBAX_MTC_LOCAL_DIR")
  if not local_dir:
    raise FlagError("--mtc_local_checkpoint_dir is required: this host's RAM-disk folder for "
                    "the local tier, e.g. --mtc_local_checkpoint_dir=/dev/shm/pax-ckpt (or run "
                    "under `orbax-mtc launch`, which sets ORBAX_MTC_LOCAL_DIR).")
  if not os.path.isabs(local_dir):
    raise FlagError(f"--mtc_local_checkpoint_dir={local_dir!r} must be an absolute path (a "
                    "folder on the host's RAM disk, e.g. /dev/shm/pax-ckpt).")
  if job_log_dir and "://" not in job_log_dir and _inside(
      local_dir, os.path.join(job_log_dir, "checkpoints")):
    raise FlagError(f"--mtc_local_checkpoint_dir={local_dir!r} lies inside Pax's checkpoint "
                    f"folder {os.path.join(job_log_dir, 'checkpoints')} (the persistent tier): "
                    "use a RAM-disk folder of its own, e.g. /dev/shm/pax-ckpt.")
  interval = _int("mtc_local_save_interval_steps",
                  raw.get("mtc_local_save_interval_steps", "100"), 1,
                  "the number of steps between two saves to the RAM tier")
  peers = _int("mtc_peers_per_node", raw.get("mtc_peers_per_node", "1"), 0,
               "how many other nodes keep a copy of each node's RAM checkpoint (0: none)")
  axis = raw.get("mtc_replica_axis")
  if axis is not None and not axis.strip():
    raise FlagError("--mtc_replica_axis must name a mesh axis (e.g. data), or be left out.")
  if pax_bools["exit_after_ondemand_checkpoint"] and not pax_bools["jax_fully_async_checkpoint"]:
    logging.warning(
        "pax_patch: --exit_after_ondemand_checkpoint without --jax_fully_async_checkpoint: Pax "
        "then does not join jax.distributed, so several hosts cannot agree on an on-demand "
        "step (one host alone still can).")
  return ParsedFlags(local_checkpoint_dir=local_dir, local_save_interval_steps=interval,
                     peers_per_node=peers, replica_axis=axis,
                     exit_after_ondemand_checkpoint=pax_bools["exit_after_ondemand_checkpoint"],
                     jax_fully_async_checkpoint=pax_bools["jax_fully_async_checkpoint"],
                     job_log_dir=job_log_dir, pax_argv=pax_argv)


def run_pax(program: str, pax_argv: list[str]) -> None:
  """Runs paxml's main as its `__main__` block does (flags, required job_log_dir, app.run).

  `app.run` ends the process with Pax's exit status.

  Args:
    program: The program name for Pax's argv.
    pax_argv: Pax's arguments.
  """
  import jax
  from absl import app, flags
  from paxml import main as pax_main  # type: ignore[import-not-found]

  try:
    from fiddle import absl_flags  # type: ignore[import-not-found]
    flags_parser = absl_flags.flags_parser
  except ImportError:  # older paxml releases parse with absl alone
    flags_parser = None
  jax.config.config_with_absl()
  flags.mark_flag_as_required("job_log_dir")
  kwargs = {"flags_parser": flags_parser} if flags_parser is not None else {}
  app.run(pax_main.main, argv=[program, *pax_argv], **kwargs)


def main(argv: Sequence[str] | None = None) -> int:
  """Parses the `--mtc_*` flags, installs `pax_patch` and runs Pax's main.

  Args:
    argv: The full command line, program name first; None for `sys.argv`.

  Returns:
    `USAGE_EXIT_STATUS` (2) when a flag is invalid or paxml is unavailable (the reason goes
    to stderr); otherwise Pax's `app.run` ends the process itself.
  """
  argv = list(sys.argv if argv is None else argv)
  program = argv[0] if argv else "pax_patch.main"
  try:
    parsed = parse_flags(argv[1:])
    config = parsed.config()
  except (FlagError, ValueError) as e:
    print(f"pax_patch.main: error: {e}", file=sys.stderr)
    return USAGE_EXIT_STATUS
  import pax_patch

  try:
    pax_patch.install(config)
  except pax_patch.PaxmlUnavailableError as e:
    print(f"pax_patch.main: error: {e}", file=sys.stderr)
    return USAGE_EXIT_STATUS
  run_pax(program, parsed.pax_argv)  # app.run ends the process with Pax's status
  return 0


if __name__ == "__main__":
  sys.exit(main())
