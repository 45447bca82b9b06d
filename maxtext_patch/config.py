"""MaxText config keys -> orbax-mtc settings and options: reading and validation, no I/O.

MaxText's own keys keep their meaning (names and defaults as in MaxText's `configs/base.yml`):

  enable_emergency_checkpoint=true      standalone mode: RAM tier + peers + persistent tier
  enable_multi_tier_checkpointing=true  managed mode: GKE's replicator (replicator.yaml); it
                                        wins when both are set, as in MaxText
  local_checkpoint_directory            this host's RAM disk (`{process_index}` is replaced)
  local_checkpoint_period               RAM-tier save interval in steps (> 0)
  checkpoint_dir                        persistent tier (MaxText derives it from
                                        base_output_directory and run_name)
  checkpoint_period                     standalone: persistent backup every N steps ...
  multi_tier_checkpointing_backup_interval_minutes|steps   ... or this schedule instead
  mtc_data_parallelism                  managed: replicator's assume-data-parallelism (0: auto)
  enable_autocheckpoint                 save the step all processes agree on after SIGTERM
  async_checkpointing                   background RAM writes and backups
  max_num_checkpoints_to_keep           persistent steps kept (None: all)

The two mode flags and MaxText's legacy replicator keys are read in `modes`; the typed value
readers live in `config_values`. Both are re-exported here.

MaxText's config rejects keys it does not know, so ours (`NEW_KEYS`) travel beside it:
`python -m maxtext_patch.train` takes them out of the command line, `install(**keys)` takes
them as arguments, and the example loop's config holds them directly.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping, Sequence
from typing import Any

from maxtext_patch.config_values import (
    MaxTextConfigError,
    as_bool,
    as_int,
    as_number,
    as_text,
    read_key,
)
from maxtext_patch.modes import (
    LEGACY_KEYS,
    MANAGED,
    STANDALONE,
    check_legacy_keys,
    enabled_mode,
)

# MaxText's keys read here, with MaxText's defaults.
MAXTEXT_DEFAULTS: dict[str, Any] = {
    "enable_checkpointing": True,
    "enable_emergency_checkpoint": False,
    "enable_multi_tier_checkpointing": False,
    "local_checkpoint_directory": "",
    "local_checkpoint_period": 0,
    "checkpoint_dir": "",
    "checkpoint_period": 10_000,
    "multi_tier_checkpointing_backup_interval_minutes": None,
    "multi_tier_checkpointing_backup_interval_steps": None,
    "mtc_data_parallelism": 0,
    "enable_autocheckpoint": False,
    "async_checkpointing": True,
    "max_num_checkpoints_to_keep": None,
    "save_checkpoint_on_start": True,
    "run_name": "",
    "enable_single_controller": False,
    "colocated_python_checkpointing": False,
}
MAXTEXT_DEFAULTS.update(LEGACY_KEYS)  # MaxText defines them; see `modes`

# Keys orbax-mtc adds, with their defaults and one line each (docs/maxtext.md lists them).
NEW_KEYS: dict[str, Any] = {
    "mtc_peers_per_node": None,
    "mtc_replica_axis": "data",
    "mtc_local_max_to_keep": 1,
    "mtc_job_name": None,
    "mtc_ondemand_grace_seconds": 270.0,
    "mtc_preemption_exit_code": 0,
}
NEW_KEY_HELP: dict[str, str] = {
    "mtc_peers_per_node": "other hosts holding a copy of each host's RAM step (default 1; 0: off)",
    "mtc_replica_axis": "mesh axis along which the model is replicated (default: data)",
    "mtc_local_max_to_keep": "RAM steps kept per host (default 1)",
    "mtc_job_name": "first part of the <job>-s<step>-n<rank>-w<worker>.restore links "
                    "(default: run_name)",
    "mtc_ondemand_grace_seconds": "budget from SIGTERM to a durable on-demand step (default 270)",
    "mtc_preemption_exit_code": "exit status of `python -m maxtext_patch.train` when training "
                                "stopped at the preemption step (default 0, as MaxText; a "
                                "restart loop sets another, to tell it from a finished run)",
}

PROCESS_INDEX_FIELD = "{process_index}"


@dataclasses.dataclass(frozen=True)
class MtcSettings:
  """What the MaxText keys ask of orbax-mtc, validated (built by `read_settings`).

  Attributes:
    mode: STANDALONE or MANAGED.
    local_directory: This host's RAM disk; may hold {process_index} (see
      `local_directory_for`).
    persistent_directory: The persistent tier's directory (`checkpoint_dir`).
    local_interval: RAM-tier save interval in steps.
    persistent_interval_steps: Persistent backup interval in steps; None when backups go by
      minutes.
    backup_interval_minutes: Persistent backup interval in minutes, or None.
    persistent_max_to_keep: Persistent steps kept; None keeps all.
    local_max_to_keep: RAM steps kept per host.
    peers_per_node: Hosts holding a copy of each host's RAM step; None for the default.
    replica_axis: The mesh axis along which the model is replicated.
    job_name: First part of the .restore links.
    data_parallelism: Managed mode's assume-data-parallelism; None: auto.
    enable_async: Background RAM writes and backups.
    autocheckpoint: Save the agreed step after SIGTERM.
    save_on_start: Save at step 0.
    checkpoint_period: MaxText's `checkpoint_period`.
    ondemand_grace_seconds: Budget from SIGTERM to a durable on-demand step.
  """

  mode: str  # STANDALONE or MANAGED
  local_directory: str  # may hold {process_index}; see `local_directory_for`
  persistent_directory: str
  local_interval: int
  persistent_interval_steps: int | None
  backup_interval_minutes: float | None
  persistent_max_to_keep: int | None
  local_max_to_keep: int
  peers_per_node: int | None
  replica_axis: str
  job_name: str
  data_parallelism: int | None
  enable_async: bool
  autocheckpoint: bool
  save_on_start: bool
  checkpoint_period: int
  ondemand_grace_seconds: float


def value_of(config: Any, key: str) -> Any:
  """Reads one key of a MaxText config.

  Args:
    config: MaxText's HyperParameters (read as `config.key`) or a mapping (`config[key]`).
    key: The key.

  Returns:
    The key's value, else MaxText's default (or orbax-mtc's for `NEW_KEYS`), else None.
  """
  return read_key(config, key, MAXTEXT_DEFAULTS.get(key, NEW_KEYS.get(key)))


def _new_key_value(key: str, value: Any) -> Any:
  """One orbax-mtc key's value, typed and checked (strings from a command line accepted)."""
  if key == "mtc_peers_per_node":
    return as_int(key, value, minimum=0, optional=True)
  if key == "mtc_local_max_to_keep":
    return as_int(key, value, minimum=1)
  if key == "mtc_ondemand_grace_seconds":
    return as_number(key, value, positive=False)
  if key == "mtc_preemption_exit_code":
    code = as_int(key, value, minimum=0)
    if code > 255:
      raise MaxTextConfigError(f"{key} must be an exit status, 0 to 255, got {value!r}.")
    return code
  text = as_text(key, value)
  if key == "mtc_replica_axis" and not text.isidentifier():
    raise MaxTextConfigError(f"{key} must name a mesh axis (e.g. data), got {value!r}.")
  if key == "mtc_job_name" and "/" in text:
    raise MaxTextConfigError(
        f"{key}={text!r} names .restore links in the local directory and cannot contain '/'.")
  return text or None


def check_new_keys(keys: Mapping[str, Any]) -> dict[str, Any]:
  """Types and checks the orbax-mtc keys given outside MaxText's config.

  Args:
    keys: orbax-mtc key -> value (strings from a command line accepted).

  Returns:
    Key -> typed value.

  Raises:
    MaxTextConfigError: If a key is not in `NEW_KEYS` or its value is malformed.
  """
  unknown = [k for k in keys if k not in NEW_KEYS]
  if unknown:
    hints = []
    for key in unknown:
      close = difflib.get_close_matches(key, list(NEW_KEYS), n=1)
      hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    raise MaxTextConfigError(
        f"Unknown orbax-mtc key(s) {', '.join(hints)}; the keys are {', '.join(NEW_KEYS)}.")
  return {key: _new_key_value(key, value) for key, value in keys.items()}


def split_argv(argv: Sequence[str]) -> tuple[list[str], dict[str, str]]:
  """MaxText's command line -> (what MaxText gets, orbax-mtc's own `key=value` pairs).

  Our keys are taken out (MaxText would reject them); a key that looks like a misspelt one of
  ours is an error here rather than MaxText's longer one.

  Args:
    argv: MaxText's command-line arguments (config file and `key=value` overrides).

  Returns:
    (the arguments for MaxText, orbax-mtc key -> value as text).

  Raises:
    MaxTextConfigError: If an `mtc_` key unknown to MaxText is close to one of ours.
  """
  rest: list[str] = []
  ours: dict[str, str] = {}
  for arg in argv:
    key, sep, value = arg.partition("=")
    key = key.strip()
    if sep and key in NEW_KEYS:
      ours[key] = value
      continue
    if sep and key.startswith("mtc_") and key not in MAXTEXT_DEFAULTS:
      close = difflib.get_close_matches(key, list(NEW_KEYS), n=1, cutoff=0.8)
      if close:
        raise MaxTextConfigError(f"Unknown key {key!r}: did you mean {close[0]!r}?")
    rest.append(arg)
  return rest, ours


def read_settings(config: Any, extra: Mapping[str, Any] | None = None,
                  overrides: Mapping[str, Any] | None = None) -> MtcSettings | None:
  """Validated settings from a MaxText config.

  Args:
    config: A MaxText config (HyperParameters or a mapping).
    extra: orbax-mtc keys given outside the config (they win over the config's).
    overrides: MaxText keys whose values the caller already has (a factory's arguments); they
      win over both.

  Returns:
    The `MtcSettings`, or None when neither enable_emergency_checkpoint nor
    enable_multi_tier_checkpointing is set.

  Raises:
    MaxTextConfigError: If a key is unknown or malformed, a required one (local directory,
      local period, persistent directory) is missing, Pathways is asked for, keys conflict, or
      a legacy replicator key would be ignored (`check_legacy_keys`).
  """
  extra = check_new_keys(extra or {})
  overrides = dict(overrides or {})

  def get(key: str) -> Any:
    if key in overrides:
      return overrides[key]
    if key in extra:
      return extra[key]
    return value_of(config, key)

  mode = enabled_mode({k: get(k) for k in ("enable_emergency_checkpoint",
                                           "enable_multi_tier_checkpointing")})
  if mode is None:
    return None
  flag = "enable_emergency_checkpoint" if mode == STANDALONE else \
      "enable_multi_tier_checkpointing"
  if as_bool("enable_single_controller", get("enable_single_controller")) or \
      as_bool("colocated_python_checkpointing", get("colocated_python_checkpointing")):
    raise MaxTextConfigError(
        f"{flag}=true with orbax-mtc needs one JAX process per host (multi-controller); "
        "Pathways (enable_single_controller / colocated_python_checkpointing) is not "
        "supported. Turn those off or use MaxText's own checkpointing.")

  local_directory = as_text("local_checkpoint_directory", get("local_checkpoint_directory"))
  if not local_directory:
    raise MaxTextConfigError(
        f"{flag}=true needs local_checkpoint_directory: this host's RAM disk, e.g. "
        "local_checkpoint_directory=/local (a tmpfs or GKE's multi-tier checkpointing volume).")
  if mode == MANAGED and PROCESS_INDEX_FIELD in local_directory:
    raise MaxTextConfigError(
        f"local_checkpoint_directory={local_directory!r}: {PROCESS_INDEX_FIELD} cannot be used "
        "with enable_multi_tier_checkpointing (the replicator handshake runs before process "
        "indices are known); GKE mounts one volume per host, so name it as mounted.")
  local_interval = as_int("local_checkpoint_period", get("local_checkpoint_period"), minimum=0)
  if local_interval == 0:
    raise MaxTextConfigError(
        f"{flag}=true needs local_checkpoint_period > 0: how often, in steps, each host saves "
        "to its RAM disk (e.g. local_checkpoint_period=20).")

  # 0 is "not set", as MaxText reads these keys (some of its configs default them to 0).
  minutes = as_number("multi_tier_checkpointing_backup_interval_minutes",
                      get("multi_tier_checkpointing_backup_interval_minutes"), positive=False,
                      optional=True) or None
  backup_steps = as_int("multi_tier_checkpointing_backup_interval_steps",
                        get("multi_tier_checkpointing_backup_interval_steps"), minimum=0,
                        optional=True) or None
  if minutes is not None and backup_steps is not None:
    raise MaxTextConfigError(
        "Set one of multi_tier_checkpointing_backup_interval_minutes and "
        "multi_tier_checkpointing_backup_interval_steps, not both (got "
        f"{minutes:g} minutes and {backup_steps} steps).")
  check_legacy_keys(mode, get("use_replicator_service"),
                    get("replicator_backup_interval_minutes"), minutes)
  if mode == MANAGED and backup_steps is not None and backup_steps < local_interval:
    raise MaxTextConfigError(
        f"multi_tier_checkpointing_backup_interval_steps ({backup_steps}) is shorter than "
        f"local_checkpoint_period ({local_interval}): backups are taken from RAM steps, so "
        "back up at most as often as the RAM tier saves.")
  checkpoint_period = as_int("checkpoint_period", get("checkpoint_period"), minimum=1)
  if mode == MANAGED and minutes is None and backup_steps is None:
    minutes = 30.0  # GKE's and Orbax's default

  persistent_directory = as_text("checkpoint_dir", get("checkpoint_dir"))
  if not persistent_directory:
    raise MaxTextConfigError(
        f"{flag}=true needs a persistent directory: set base_output_directory and run_name "
        "(MaxText puts checkpoints under <base_output_directory>/<run_name>/checkpoints), or "
        "checkpoint_dir.")
  if persistent_directory.rstrip("/") == local_directory.rstrip("/"):
    raise MaxTextConfigError(
        f"local_checkpoint_directory and the persistent checkpoint_dir are the same folder "
        f"({local_directory!r}): the RAM tier needs a folder of its own.")

  data_parallelism = as_int("mtc_data_parallelism", get("mtc_data_parallelism"), minimum=0)
  peers = _new_key_value("mtc_peers_per_node", get("mtc_peers_per_node"))
  replica_axis = _new_key_value("mtc_replica_axis", get("mtc_replica_axis")) or "data"
  job_name = _new_key_value("mtc_job_name", get("mtc_job_name")) or \
      as_text("run_name", get("run_name")) or "maxtext"
  if "/" in job_name:
    raise MaxTextConfigError(
        f"The job name {job_name!r} (mtc_job_name, else run_name) names .restore links in "
        "the local directory and cannot contain '/'; set mtc_job_name.")
  return MtcSettings(
      mode=mode, local_directory=local_directory, persistent_directory=persistent_directory,
      local_interval=local_interval,
      persistent_interval_steps=None if minutes is not None else (
          backup_steps if backup_steps is not None else checkpoint_period),
      backup_interval_minutes=minutes,
      persistent_max_to_keep=as_int("max_num_checkpoints_to_keep",
                                    get("max_num_checkpoints_to_keep"), minimum=1,
                                    optional=True),
      local_max_to_keep=_new_key_value("mtc_local_max_to_keep", get("mtc_local_max_to_keep")),
      peers_per_node=peers, replica_axis=replica_axis, job_name=job_name,
      data_parallelism=data_parallelism or None,
      enable_async=as_bool("async_checkpointing", get("async_checkpointing")),
      autocheckpoint=as_bool("enable_autocheckpoint", get("enable_autocheckpoint")),
      save_on_start=as_bool("save_checkpoint_on_start", get("save_checkpoint_on_start")),
      checkpoint_period=checkpoint_period,
      ondemand_grace_seconds=_new_key_value("mtc_ondemand_grace_seconds",
                                            get("mtc_ondemand_grace_seconds")),
  )


def local_directory_for(template: str, process_index: int, platform: str) -> str:
  """This process's RAM-tier folder.

  Args:
    template: `local_checkpoint_directory`, possibly holding `{process_index}`.
    process_index: This process's index.
    platform: The devices' platform ("cpu", "gpu", "tpu").

  Returns:
    `template` with `{process_index}` filled in; on GPU without the field,
    `<dir>/<process_index>` (MaxText's layout there: several processes share a host); else
    `template` as it is.
  """
  if PROCESS_INDEX_FIELD in template:
    return template.replace(PROCESS_INDEX_FIELD, str(process_index))
  if platform == "gpu":
    return f"{template.rstrip('/')}/{process_index}"
  return template


def check_mesh(settings: MtcSettings, axis_names: Sequence[str]) -> None:
  """Checks that mtc_replica_axis is an axis of the mesh the job trains on.

  Args:
    settings: The settings.
    axis_names: The mesh's axis names.

  Raises:
    MaxTextConfigError: If the replica axis is not among `axis_names`.
  """
  names = tuple(axis_names)
  if settings.replica_axis not in names:
    raise MaxTextConfigError(
        f"mtc_replica_axis={settings.replica_axis!r} is not an axis of the mesh (axes: "
        f"{', '.join(names)}). Name the data-parallel axis, e.g. mtc_replica_axis={names[0]}; "
        "an FSDP-only job may name any axis of size 1.")


def manager_options(settings: MtcSettings) -> Any:
  """The `orbax_mtc.CheckpointManagerOptions` the settings ask for.

  Args:
    settings: The settings.

  Returns:
    The manager's options.

  Raises:
    MaxTextConfigError: If managed mode is asked for and this orbax-mtc has no
      `ManagedOptions`.
  """
  import orbax_mtc as mtc

  persistent = mtc.PersistentCheckpointOptions(
      save_interval_steps=settings.persistent_interval_steps,
      backup_interval_minutes=settings.backup_interval_minutes,
      max_to_keep=settings.persistent_max_to_keep)
  kwargs: dict[str, Any] = dict(
      local=mtc.LocalCheckpointOptions(save_interval_steps=settings.local_interval,
                                       max_to_keep=settings.local_max_to_keep),
      persistent=persistent,
      replication=mtc.ReplicationOptions(replica_axis=settings.replica_axis,
                                         peers_per_node=settings.peers_per_node),
      job_name=settings.job_name,
      enable_async_checkpointing=settings.enable_async,
      ondemand_grace_seconds=settings.ondemand_grace_seconds,
  )
  if settings.mode == MANAGED:
    managed_options = getattr(mtc, "ManagedOptions", None)
    if managed_options is None:
      raise MaxTextConfigError(
          "enable_multi_tier_checkpointing=true needs orbax-mtc's managed mode "
          "(orbax_mtc.ManagedOptions), which this orbax-mtc does not have; upgrade it, or use "
          "enable_emergency_checkpoint=true (standalone).")
    kwargs.update(mode=MANAGED, managed=managed_options(
        peers_per_node=settings.peers_per_node, data_parallelism=settings.data_parallelism))
  return mtc.CheckpointManagerOptions(**kwargs)
