"""Which orbax-mtc mode MaxText's flags choose, and MaxText's legacy replicator keys.

  enable_emergency_checkpoint=true      standalone mode: RAM tier + peers + persistent tier
  enable_multi_tier_checkpointing=true  managed mode: GKE's replicator; it wins when both are
                                        set, as in MaxText

MaxText's replicator keys from before `enable_multi_tier_checkpointing` (`LEGACY_KEYS`), which
every released MaxText (0.1.0 on) accepts and ignores, are refused where they would change what
the job does, with the keys to set instead (`check_legacy_keys`).
"""

from __future__ import annotations

from typing import Any

from maxtext_patch.config_values import MaxTextConfigError, as_bool, as_int, read_key

STANDALONE = "standalone"
MANAGED = "managed"

# The two flags, false by default in MaxText's configs/base.yml.
EMERGENCY_FLAG = "enable_emergency_checkpoint"
MULTI_TIER_FLAG = "enable_multi_tier_checkpointing"

# MaxText's replicator keys before enable_multi_tier_checkpointing replaced them (MaxText
# commit 16bcaebe, August 2025): `enable_emergency_checkpoint=true use_replicator_service=true
# replicator_backup_interval_minutes=N` meant what `enable_multi_tier_checkpointing=true
# multi_tier_checkpointing_backup_interval_minutes=N` means now. MaxText 0.1.0 to 0.2.5 still
# define them (defaults below) and read neither.
LEGACY_KEYS: dict[str, Any] = {
    "use_replicator_service": False,
    "replicator_backup_interval_minutes": 0,
}


def enabled_mode(config: Any) -> str | None:
  """Which orbax-mtc mode a config enables.

  As MaxText's `create_checkpoint_manager` and start-up choose: multi-tier checkpointing
  first, so with both flags set the job runs managed.

  Args:
    config: A MaxText config (HyperParameters or a mapping).

  Returns:
    MANAGED (enable_multi_tier_checkpointing, whatever enable_emergency_checkpoint says),
    STANDALONE (enable_emergency_checkpoint alone), or None when neither flag is set.

  Raises:
    MaxTextConfigError: If a flag is not a boolean.
  """
  emergency = as_bool(EMERGENCY_FLAG, read_key(config, EMERGENCY_FLAG, False))
  managed = as_bool(MULTI_TIER_FLAG, read_key(config, MULTI_TIER_FLAG, False))
  if managed:
    return MANAGED
  return STANDALONE if emergency else None


def check_legacy_keys(mode: str, use_replicator_service: Any,
                      replicator_backup_interval_minutes: Any,
                      backup_interval_minutes: float | None) -> None:
  """Refuses MaxText's pre-0.1 replicator keys where MaxText would silently ignore them.

  Args:
    mode: STANDALONE or MANAGED, as `enabled_mode` chose.
    use_replicator_service: The key's value.
    replicator_backup_interval_minutes: The key's value.
    backup_interval_minutes: multi_tier_checkpointing_backup_interval_minutes as set (None:
      not set).

  Raises:
    MaxTextConfigError: If use_replicator_service=true asks for the replicator in standalone
      mode, or replicator_backup_interval_minutes asks for another backup schedule than the
      one the job would run; the message names the keys to set instead.
  """
  use_replicator = as_bool("use_replicator_service", use_replicator_service)
  legacy_minutes = as_int("replicator_backup_interval_minutes",
                          replicator_backup_interval_minutes, minimum=0, optional=True) or None
  if mode == STANDALONE and use_replicator:
    minutes = legacy_minutes or backup_interval_minutes
    interval = f" multi_tier_checkpointing_backup_interval_minutes={minutes:g}" if minutes \
        else ""
    raise MaxTextConfigError(
        "use_replicator_service=true is MaxText's old switch for GKE's multi-tier "
        "checkpointing replicator; MaxText 0.1.0 and later ignore it, so this job would run "
        "standalone, without the replicator. For the replicator set "
        f"enable_multi_tier_checkpointing=true{interval} in place of "
        "enable_emergency_checkpoint, use_replicator_service and "
        "replicator_backup_interval_minutes; to run standalone, remove "
        "use_replicator_service.")
  if legacy_minutes is not None and legacy_minutes != backup_interval_minutes:
    raise MaxTextConfigError(
        f"replicator_backup_interval_minutes={legacy_minutes} is MaxText's old name for "
        "multi_tier_checkpointing_backup_interval_minutes, and MaxText 0.1.0 and later ignore "
        f"it: set multi_tier_checkpointing_backup_interval_minutes={legacy_minutes} instead "
        "(or remove replicator_backup_interval_minutes).")
