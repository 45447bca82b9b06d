"""Option dataclasses for the multi-tier CheckpointManager, validated on construction.

Names mirror `orbax.checkpoint.experimental.emergency` so that switching from Orbax's emergency
managers is a change of import: every Orbax field is accepted, first, in Orbax's order and with
Orbax's default (tests/test_orbax_parity.py checks it against the installed Orbax). Fields we
add (naming the replica axis, peers, the job name for LKG links, managed mode) come after.
Orbax's own option objects are taken too, converted field for field (orbax_options.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from orbax.checkpoint import checkpoint_manager as ocp_manager
from orbax.checkpoint import checkpoint_managers as policies
from orbax.checkpoint import options as ocp_options
from orbax.checkpoint import path as ocp_path

from orbax_mtc.option_checks import (
  check_bool,
  check_fraction,
  check_interval,
  check_max_to_keep,
  check_modes,
  check_nice,
  check_timeout,
  checked_peer_ranks,
  ram_keep_from_policy,
)
from orbax_mtc.orbax_options import as_ours

_JOB_NAME_FORBIDDEN = ("/", "\0")
_DEFAULT_AGREEMENT_TIMEOUT_SECONDS = 600.0
_PERSISTENT_DEFAULT_INTERVAL = 1000  # Orbax's PersistentCheckpointOptions.save_interval_steps


@dataclasses.dataclass
class LocalCheckpointOptions:
  """When to save to the RAM-disk tier and how many steps to keep there.

  Attributes:
    save_interval_steps: Save every N steps (Orbax default: 10).
    max_to_keep: Committed steps kept per node (default 1, as in Orbax's emergency manager);
      the step being written is extra, so at most `max_to_keep + 1` step folders exist at
      once.
    read_only: Never save locally (restore still reads the RAM tier).
    should_save_fn: `fn(step, last_saved_step) -> bool`; overrides `save_interval_steps`.
    save_decision_policy: An Orbax `SaveDecisionPolicy`; overrides everything above.
    preservation_policy: As in Orbax, instead of `max_to_keep`: `LatestN(n)` keeps n RAM
      steps; any other policy decides which RAM steps each node keeps, asked with each step's
      save time and metrics (the newest step, and the newest one every node holds, are
      always kept).
    debug_use_full_global_mesh: Orbax's debug switch for barriers over all processes; ours
      always span every process, so it changes nothing.
    directory_mode: Permissions of the RAM tier's folders (model weights are private: 0o700
      by default). Widen them only for a helper that runs as another user, such as a
      replicator that must read the steps.
    file_mode: Permissions of the RAM tier's files (0o600 by default); as `directory_mode`.
    device_copy: On accelerators, `save()` does not wait for the device-to-host transfer:
      on GPUs it starts it into pinned host memory (as Orbax does), elsewhere it copies the
      shards on the device; either holds one more state-sized buffer while a save runs.
      False: `save()` waits for the transfer itself. On CPU the writer copies the arrays'
      buffers into one reused host buffer first (False: it writes from them directly).
    save_overhead_budget: The fraction of the loop's time RAM saves may cost it (e.g.
      0.02). After each RAM save the RAM policy is not asked again until the steps since
      span the previous save's cost (the time its calls took inside `save()` above a call
      with nothing of a save to do, and how much the loop's steps between them were slowed
      beside its background work; the most any process spent) over this fraction: with
      Orbax's `ContinuousCheckpointingPolicy` the interval then grows where the tier or the
      link is slow, instead of the loop stalling. None (the default): the policy decides.
    background_nice: How much lower (0-19, as `nice -n`) the RAM tier's background threads
      (writes, checksums, peer copies) run than the process, on Linux: they yield the cores
      to the training step when both want them. 0: the process's priority.

  Raises:
    ValueError: If `save_interval_steps` is not positive, `max_to_keep` is < 1, both
      `preservation_policy` and a different `max_to_keep` are set, a `LatestN` policy has a
      bad `n`, the modes are not permission bits giving the owner rwx / rw, or
      `save_overhead_budget` is not in (0, 1], or `background_nice` not in 0-19.
    TypeError: If `save_interval_steps`, `max_to_keep` or `background_nice` is not an int,
      `debug_use_full_global_mesh` is not a bool, or `should_save_fn` is not callable.
  """

  save_interval_steps: int = 10
  max_to_keep: int | None = None
  read_only: bool = False
  should_save_fn: Callable[[int, int | None], bool] | None = None
  save_decision_policy: policies.SaveDecisionPolicy | None = None
  preservation_policy: policies.PreservationPolicy | None = None
  debug_use_full_global_mesh: bool = False
  directory_mode: int = 0o700
  file_mode: int = 0o600
  device_copy: bool = True
  save_overhead_budget: float | None = None
  background_nice: int = 10

  def __post_init__(self):
    check_interval("LocalCheckpointOptions", "save_interval_steps", self.save_interval_steps,
                    allow_none=False)
    check_fraction("LocalCheckpointOptions", "save_overhead_budget", self.save_overhead_budget)
    check_max_to_keep("LocalCheckpointOptions", self.max_to_keep)
    check_bool("LocalCheckpointOptions", "debug_use_full_global_mesh",
                self.debug_use_full_global_mesh)
    check_bool("LocalCheckpointOptions", "device_copy", self.device_copy)
    check_nice("LocalCheckpointOptions", "background_nice", self.background_nice)
    if self.preservation_policy is not None:
      keep = ram_keep_from_policy("LocalCheckpointOptions", self.preservation_policy)
      # The value stored here for the policy is accepted again, so dataclasses.replace works.
      if self.max_to_keep is not None and self.max_to_keep != keep:
        raise ValueError(
            "LocalCheckpointOptions: set either `preservation_policy` or `max_to_keep`, not "
            f"both (got max_to_keep={self.max_to_keep!r} and preservation_policy="
            f"{self.preservation_policy!r}).")
      self.max_to_keep = keep
    elif self.max_to_keep is None:
      self.max_to_keep = 1
    if self.should_save_fn is not None and not callable(self.should_save_fn):
      raise TypeError("LocalCheckpointOptions.should_save_fn must be callable.")
    check_modes("LocalCheckpointOptions", self.directory_mode, self.file_mode)


@dataclasses.dataclass
class PersistentCheckpointOptions:
  """When to back up to the persistent tier (a standard Orbax checkpoint) and what to keep.

  Attributes:
    save_interval_steps: Back up every N steps (default 1000, as Orbax).
    max_to_keep: Persistent steps kept; None keeps all.
    keep_period: Also keep every step that is a multiple of this.
    should_save_fn: As in Orbax; overrides the simpler options above.
    save_decision_policy: As in Orbax; overrides the simpler options above.
    preservation_policy: As in Orbax; overrides the simpler options above (`max_to_keep` and
      `keep_period` must then be None).
    backup_interval_minutes: Instead of steps, back up the step being saved to RAM once this
      many minutes have passed since the last backup attempt (the GKE replicator's
      `backup-interval-minutes`). `save_interval_steps` must then stay at its default (it is
      set to None). Backups are of steps committed in RAM and run in the background; a failed
      one is retried at the next scheduled backup.
    best_fn: Ranks checkpoints by the `metrics` passed to `save` (Orbax semantics).
    best_mode: "max" or "min": which end of `best_fn` is best.
    skip_backups_when_busy: False (default): every due step is backed up; when one backup is
      still being written and another waits behind it, a save that makes a third due waits
      for the first, as Orbax's own save does (`backup_waits` counts it), at most Orbax's
      async timeout: a write hanging longer is a storage fault, and the waiting step is then
      skipped with a warning. True: the waiting one is skipped at once instead. Skipped
      steps are warned about and listed in `orbax-mtc status`.

  Raises:
    ValueError: If `backup_interval_minutes` is combined with a step interval,
      `should_save_fn` or `save_decision_policy`, or is not a positive finite number; an
      interval or `max_to_keep` is not positive; `preservation_policy` is combined with
      `max_to_keep`/`keep_period`; or `best_mode` is not "max" or "min".
    TypeError: If `save_interval_steps`, `max_to_keep` or `keep_period` is not an int, or
      `skip_backups_when_busy` not a bool.
  """

  save_interval_steps: int | None = _PERSISTENT_DEFAULT_INTERVAL
  max_to_keep: int | None = None
  keep_period: int | None = None
  should_save_fn: Callable[[int, int | None], bool] | None = None
  save_decision_policy: policies.SaveDecisionPolicy | None = None
  preservation_policy: policies.PreservationPolicy | None = None
  backup_interval_minutes: float | None = None
  best_fn: Callable[[Any], float] | None = None
  best_mode: str = "max"
  skip_backups_when_busy: bool = False

  def __post_init__(self):
    if not isinstance(self.skip_backups_when_busy, bool):
      raise TypeError("PersistentCheckpointOptions.skip_backups_when_busy must be True or "
                      f"False, got {self.skip_backups_when_busy!r}.")
    minutes = self.backup_interval_minutes
    if minutes is not None:
      # The default step interval gives way to minutes (both cannot be told apart from here).
      if self.save_interval_steps == _PERSISTENT_DEFAULT_INTERVAL:
        self.save_interval_steps = None
      if self.save_interval_steps is not None:
        raise ValueError(
            "PersistentCheckpointOptions: set either `save_interval_steps` (back up every N "
            f"steps) or `backup_interval_minutes` (every N minutes), not both; got "
            f"save_interval_steps={self.save_interval_steps!r} and "
            f"backup_interval_minutes={minutes!r}.")
      if self.should_save_fn is not None or self.save_decision_policy is not None:
        raise ValueError(
            "PersistentCheckpointOptions: `backup_interval_minutes` is a schedule of its own; "
            "drop `should_save_fn` / `save_decision_policy`, or drop the minutes.")
      if isinstance(minutes, bool) or not isinstance(minutes, (int, float)) \
          or not 0 < minutes < float("inf"):
        raise ValueError(
            "PersistentCheckpointOptions.backup_interval_minutes must be a positive number of "
            f"minutes, got {minutes!r} (GKE's default is 30).")
    else:
      if self.save_interval_steps is None:
        self.save_interval_steps = _PERSISTENT_DEFAULT_INTERVAL
      check_interval("PersistentCheckpointOptions", "save_interval_steps",
                      self.save_interval_steps, allow_none=False)
    check_max_to_keep("PersistentCheckpointOptions", self.max_to_keep)
    check_interval("PersistentCheckpointOptions", "keep_period", self.keep_period,
                    allow_none=True)
    if self.preservation_policy is not None and (
        self.max_to_keep is not None or self.keep_period is not None):
      raise ValueError(
          "PersistentCheckpointOptions: set either `preservation_policy` or "
          "`max_to_keep`/`keep_period`, not both (the policy decides alone)."
      )
    if self.best_mode not in ("max", "min"):
      raise ValueError(f"PersistentCheckpointOptions.best_mode must be 'max' or 'min', "
                       f"got {self.best_mode!r}.")


@dataclasses.dataclass
class ReplicationOptions:
  """Where the data-parallel replicas are, and which nodes hold copies of each node's RAM step.

  Attributes:
    replica_axis: Name of the mesh axis along which the model is replicated (e.g. "data").
      Named, never guessed: MaxText meshes may put another axis first. None: the axis given by
      `CheckpointManagerOptions.replica_axis_index`, else the axis called "data".
    peers_per_node: How many other nodes hold a copy of each node's RAM checkpoint (default
      1; 0 turns replication off). The first copy goes to the twin in the next replica (or,
      with one replica, to the next node), spread so that every node holds as many copies as
      it gives.
    peer_ranks: The explicit list of holders per node (one list per process), instead of
      `peers_per_node`; mutually exclusive, as in the GKE replicator's replicator.yaml.
      Stored as a tuple of tuples.
    chunk_mib: Transfers move in chunks of this many MiB (docs/benchmarks.md: 16 on CPU).
    chunks_in_flight: Chunks in flight at once while a call waits for a step's copies.
    in_flight_mib: MiB of chunks a `save()` may leave in flight when it returns, so copies
      move while training goes on (each chunk holds a send and a receive buffer), and MiB of
      a step's copies the writer thread reads ahead of sending them.
    max_spread_intervals: The most local intervals a step's copies are spread over when the
      link lags them (their calls waited over 5% of an interval and 20 ms); the local saves
      between send no copies of their own instead of waiting. 1: each step's copies go out
      before the next local save, which waits for what is left.

  Raises:
    ValueError: If `replica_axis` is empty or not a string, both `peers_per_node` and
      `peer_ranks` are set, `peers_per_node` is not an int >= 0, `peer_ranks` is not one list
      of int ranks per node or names a node as its own peer, or `chunk_mib`,
      `chunks_in_flight`, `in_flight_mib` or `max_spread_intervals` is not positive.
    TypeError: If one of them is not an int.
  """

  replica_axis: str | None = None
  peers_per_node: int | None = None
  peer_ranks: Sequence[Sequence[int]] | None = None
  chunk_mib: int = 16
  chunks_in_flight: int = 2
  in_flight_mib: int = 256
  max_spread_intervals: int = 8

  def __post_init__(self):
    if self.replica_axis is not None and (
        not isinstance(self.replica_axis, str) or not self.replica_axis):
      raise ValueError(
          f"ReplicationOptions.replica_axis must be a mesh axis name, got {self.replica_axis!r}.")
    if self.peers_per_node is not None and self.peer_ranks is not None:
      raise ValueError(
          "ReplicationOptions: set either `peers_per_node` or `peer_ranks`, not both "
          "(the GKE replicator accepts only one of them too).")
    if self.peers_per_node is not None:
      if isinstance(self.peers_per_node, bool) or not isinstance(self.peers_per_node, int) \
          or self.peers_per_node < 0:
        raise ValueError(
            f"ReplicationOptions.peers_per_node must be an int >= 0, got {self.peers_per_node!r}.")
    if self.peer_ranks is not None:
      self.peer_ranks = checked_peer_ranks(self.peer_ranks)
    for name in ("chunk_mib", "chunks_in_flight", "in_flight_mib", "max_spread_intervals"):
      check_interval("ReplicationOptions", name, getattr(self, name), allow_none=False)

  @property
  def chunk_bytes(self) -> int:
    """`chunk_mib` in bytes."""
    return self.chunk_mib << 20


MODES = ("standalone", "managed")


@dataclasses.dataclass
class ManagedOptions:
  """Managed mode (`CheckpointManagerOptions(mode="managed")`): what `replicator.yaml` says.

  The backup interval is the persistent tier's schedule: `backup_interval_minutes` if set,
  else `save_interval_steps` (GKE's default is `backup_interval_minutes=30`).

  Attributes:
    peers_per_node: Write `peers-per-node: N` (the replicator picks the peers). None: with
      data-parallel replicas, `peer-ranks:` the twins (same position in every other replica,
      as Orbax writes); without, `peers-per-node:` ReplicationOptions.peers_per_node.
    data_parallelism: `assume-data-parallelism`; None: the number of replicas of the mesh.
    timeout_seconds: How long to wait for the replicator at each handshake stage.
    poll_seconds: How often to look at the volume's files meanwhile.

  Raises:
    ValueError: If `peers_per_node` is not an int >= 0 or None, `data_parallelism` is not an
      int >= 1 or None, or `timeout_seconds` / `poll_seconds` is not a number > 0.
  """

  peers_per_node: int | None = None
  data_parallelism: int | None = None
  timeout_seconds: float = 300.0
  poll_seconds: float = 0.1

  def __post_init__(self):
    for name in ("peers_per_node", "data_parallelism"):
      value = getattr(self, name)
      minimum = 0 if name == "peers_per_node" else 1
      if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                or value < minimum):
        raise ValueError(f"ManagedOptions.{name} must be an int >= {minimum} or None, got "
                         f"{value!r}.")
    for name in ("timeout_seconds", "poll_seconds"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"ManagedOptions.{name} must be a number of seconds > 0, got "
                         f"{value!r}.")


@dataclasses.dataclass
class MultiprocessingOptions:
  """Orbax's emergency `MultiprocessingOptions`.

  Attributes:
    coordination_timeout_secs: How long processes may be out of step at a save or restore; it
      becomes `CheckpointManagerOptions.agreement_timeout_seconds`.

  Raises:
    ValueError: If `coordination_timeout_secs` is not a finite number > 0.
  """

  coordination_timeout_secs: int = 120

  def __post_init__(self):
    check_timeout("MultiprocessingOptions.coordination_timeout_secs",
                   self.coordination_timeout_secs)


@dataclasses.dataclass
class CheckpointManagerOptions:
  """Options of `orbax_mtc.CheckpointManager`.

  Orbax's fields come first, in Orbax's order and with Orbax's defaults (docs/api.md says
  where a meaning differs); ours follow, from `replication` on.

  Attributes:
    local: `LocalCheckpointOptions`, the RAM tier's options.
    persistent: `PersistentCheckpointOptions`, the persistent tier's options.
    replica_axis_index: Orbax's way to say where replicas are (default 0, the first mesh
      axis); `replication.replica_axis` (a name) wins over it; None: the axis named "data".
    step_name_format: Persistent-tier step folder naming (Orbax `NameFormat`).
    cleanup_tmp_directories: Remove leftovers of interrupted persistent saves when the manager
      starts (the RAM tier always removes its own).
    enable_async_checkpointing: Local writes and persistent backups run in the background.
    async_options: Orbax `AsyncOptions` for the persistent tier.
    multiprocessing_options: `MultiprocessingOptions` (ours or Orbax's emergency one): its
      `coordination_timeout_secs` is the agreement timeout (see `agreement_timeout_seconds`).
    single_host_load_and_broadcast: Accepted; every process lists the persistent steps and
      one agreement (a census) agrees them, whatever the value.
    replication: `ReplicationOptions` (peers, the named replica axis).
    job_name: First part of the `<job>-s<step>-n<rank>-w<worker>.restore` LKG links.
    worker_index: This process's index inside its host; None reads it from the environment.
    exit_after_ondemand_checkpoint: After the on-demand checkpoint that a preemption notice
      (SIGTERM) triggers is durable, `save()` waits for everything, closes the manager and
      ends the process with exit status 0 (as Pax's `--exit_after_ondemand_checkpoint` means;
      Pax's own executor exits 1 there, which `pax_patch` keeps by leaving the exit to Pax).
    ondemand_grace_seconds: Time budget from the SIGTERM to a durable on-demand checkpoint.
      The RAM tier and peers come first; the persistent backup starts only while budget is
      left (default 270 s: a 30 s margin inside the 5 minutes Cloud TPU maintenance gives).
      0 never backs up on demand.
    agreement_timeout_seconds: How long a process waits at an agreement (each local save,
      restore, start-up, `wait_until_finished`) for the others. When a process failed, hangs
      or was killed before it, the others raise an error naming the missing processes after
      this long instead of waiting forever (default 600 s; `multiprocessing_options`, when
      given, sets it).
    mode: "standalone" (the manager copies to peers and backs up itself) or "managed" (GKE's
      multi-tier checkpointing replicator does both: the manager speaks its file protocol,
      writes RAM steps and restores from the replicator's `.restore` entries; see `managed`).
    managed: `ManagedOptions` for managed mode.

  Raises:
    ValueError: If `mode`, `job_name`, `replica_axis_index`, `worker_index`,
      `ondemand_grace_seconds` or a timeout is invalid, or `agreement_timeout_seconds` and
      `multiprocessing_options.coordination_timeout_secs` are both set and differ.
    TypeError: If `local`, `persistent`, `replication`, `managed` or
      `multiprocessing_options` has the wrong type (Orbax's own `LocalCheckpointOptions` and
      `PersistentCheckpointOptions` are converted), or a bool field is not a bool.
  """

  local: LocalCheckpointOptions = dataclasses.field(default_factory=LocalCheckpointOptions)
  persistent: PersistentCheckpointOptions = dataclasses.field(
      default_factory=PersistentCheckpointOptions)
  replica_axis_index: int | None = 0
  step_name_format: ocp_path.step.NameFormat | None = ocp_path.step.standard_name_format()
  cleanup_tmp_directories: bool = False
  enable_async_checkpointing: bool = True
  async_options: ocp_manager.AsyncOptions | None = None
  multiprocessing_options: MultiprocessingOptions | None = None  # or Orbax's emergency one
  single_host_load_and_broadcast: bool = True
  replication: ReplicationOptions = dataclasses.field(default_factory=ReplicationOptions)
  job_name: str = "orbax"
  worker_index: int | None = None
  exit_after_ondemand_checkpoint: bool = False
  ondemand_grace_seconds: float = 270.0
  agreement_timeout_seconds: float = _DEFAULT_AGREEMENT_TIMEOUT_SECONDS
  mode: str = "standalone"
  managed: ManagedOptions = dataclasses.field(default_factory=ManagedOptions)

  def __post_init__(self):
    if self.mode not in MODES:
      raise ValueError(f"CheckpointManagerOptions.mode must be one of {MODES}, got "
                       f"{self.mode!r}.")
    if not isinstance(self.managed, ManagedOptions):
      raise TypeError("CheckpointManagerOptions.managed must be an orbax_mtc.ManagedOptions, "
                      f"got {type(self.managed).__name__}.")
    for name, cls in (("local", LocalCheckpointOptions),
                      ("persistent", PersistentCheckpointOptions),
                      ("replication", ReplicationOptions)):  # Orbax's own objects converted
      setattr(self, name, as_ours(getattr(self, name), cls, f"CheckpointManagerOptions.{name}"))
    if not isinstance(self.job_name, str) or not self.job_name or any(
        c in self.job_name for c in _JOB_NAME_FORBIDDEN):
      raise ValueError(
          f"CheckpointManagerOptions.job_name must be a non-empty name without '/', "
          f"got {self.job_name!r}.")
    if self.replica_axis_index is not None and (
        isinstance(self.replica_axis_index, bool) or not isinstance(self.replica_axis_index, int)
        or self.replica_axis_index < 0):
      raise ValueError(
          "CheckpointManagerOptions.replica_axis_index must be an int >= 0, got "
          f"{self.replica_axis_index!r}.")
    if self.worker_index is not None and (
        isinstance(self.worker_index, bool) or not isinstance(self.worker_index, int)
        or self.worker_index < 0):
      raise ValueError(
          f"CheckpointManagerOptions.worker_index must be an int >= 0, got {self.worker_index!r}.")
    if not isinstance(self.exit_after_ondemand_checkpoint, bool):
      raise TypeError("CheckpointManagerOptions.exit_after_ondemand_checkpoint must be a bool, "
                      f"got {self.exit_after_ondemand_checkpoint!r}.")
    for name in ("cleanup_tmp_directories", "single_host_load_and_broadcast"):
      check_bool("CheckpointManagerOptions", name, getattr(self, name))
    grace = self.ondemand_grace_seconds
    if isinstance(grace, bool) or not isinstance(grace, (int, float)) or not grace >= 0 \
        or grace == float("inf"):
      raise ValueError(
          "CheckpointManagerOptions.ondemand_grace_seconds must be a finite number of seconds "
          f">= 0, got {grace!r}. Use the grace period your platform gives after SIGTERM minus "
          "a margin (Cloud TPU maintenance: 300 s, so e.g. 270).")
    check_timeout("CheckpointManagerOptions.agreement_timeout_seconds",
                   self.agreement_timeout_seconds)
    self._apply_multiprocessing_options()

  def _apply_multiprocessing_options(self) -> None:
    """Orbax's coordination timeout is our agreement timeout: the same bound, by name."""
    mp = self.multiprocessing_options
    if mp is None:
      return
    timeout = getattr(mp, "coordination_timeout_secs", None)
    if timeout is None:
      raise TypeError(
          "CheckpointManagerOptions.multiprocessing_options must be an orbax_mtc."
          "MultiprocessingOptions (or Orbax's emergency MultiprocessingOptions) with "
          f"coordination_timeout_secs, got {type(mp).__module__}.{type(mp).__name__}.")
    check_timeout("CheckpointManagerOptions.multiprocessing_options.coordination_timeout_secs",
                   timeout)
    if self.agreement_timeout_seconds == _DEFAULT_AGREEMENT_TIMEOUT_SECONDS:
      self.agreement_timeout_seconds = float(timeout)
    elif self.agreement_timeout_seconds != timeout:
      raise ValueError(
          "CheckpointManagerOptions: multiprocessing_options.coordination_timeout_secs="
          f"{timeout!r} and agreement_timeout_seconds={self.agreement_timeout_seconds!r} are "
          "the same bound; set one of them.")

  def persistent_manager_options(self) -> ocp_manager.CheckpointManagerOptions:
    """The plain Orbax `CheckpointManagerOptions` the persistent tier is run with: from
    `persistent` and the shared fields (async, clean-up, step naming)."""
    persistent = self.persistent
    kwargs: dict[str, Any] = dict(
        # Minutes: the manager decides (BackupIntervalPolicy); the parent only writes.
        save_interval_steps=persistent.save_interval_steps or 1,
        max_to_keep=persistent.max_to_keep,
        keep_period=persistent.keep_period,
        should_save_fn=persistent.should_save_fn,
        save_decision_policy=persistent.save_decision_policy,
        preservation_policy=persistent.preservation_policy,
        best_fn=persistent.best_fn,
        best_mode=persistent.best_mode,
        enable_async_checkpointing=self.enable_async_checkpointing,
        async_options=self.async_options,
        cleanup_tmp_directories=self.cleanup_tmp_directories,
        # The manager never backs up a step the persistent tier has, so Orbax's synchronous
        # existence checks (storage round trips on the training thread, which hang while the
        # store is down) are not needed.
        file_options=ocp_options.FileOptions(skip_sync_file_validations=True),
        create=True,
    )
    if self.step_name_format is not None:
      kwargs["step_name_format"] = self.step_name_format
    return ocp_manager.CheckpointManagerOptions(**kwargs)
