"""Managed mode: the file protocol of GKE's multi-tier checkpointing replicator.

The replicator daemon on each node and the job talk through files in the node's RAM-disk
volume (the local directory):

  jax-init-info.txt   written by GKE: line 1 process id, line 2 coordinator address
  replicator.yaml     written by the job (via replicator.yaml.tmp + rename), deleted by the
                      replicator once it has taken the configuration
  replicator.errors   written by the replicator: recoverable errors (logged, then deleted)
  replicator.failed   written by the replicator: fatal (the job stops with a clear error)
  <job>-s<step>-n<node>-w<worker>.restore
                      written by the replicator after the handshake: a symlink to the step
                      folder this worker restores, or a zero-size file with step 0 ("nothing")

A restore entry is checked before its folder is moved to `<local>/<step>`: the link must
resolve (through any chain of links) to a folder directly in the local directory, or directly
in a replicator staging folder (`STAGING_FOLDERS`), whose name does not start with '.' (this
library's `.tmp-*` and `.spare-*` folders are never a step to restore) and which is not under
`peers/` (copies this node holds for other nodes); and a `manifest.json` in it must name the
entry's step and this process. Any other entry is ignored with a logged reason.

`ReplicatorConfig` and `choose_entry` are pure; the rest is file I/O with bounded polling
(the daemon gives no other notice than files appearing and disappearing).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml
from absl import logging

from orbax_mtc import files

# Re-exported: this error lived here before errors.py; other modules name it through this one.
from orbax_mtc.errors import ReplicatorError as ReplicatorError
from orbax_mtc.local import aside
from orbax_mtc.local import format as local_format
from orbax_mtc.local import restore_links as lkg
from orbax_mtc.local import store as local_store

REPLICATOR_FILE = "replicator.yaml"
REPLICATOR_TMP_FILE = REPLICATOR_FILE + ".tmp"
ERRORS_FILE = "replicator.errors"
FAILED_FILE = "replicator.failed"
JAX_INIT_INFO_FILE = "jax-init-info.txt"
# Where a replicator stages a step it copied in from a peer or a backup, relative to the local
# directory: a restore entry may point at a folder directly in one of these. This is the test
# simulator's choice; GKE's daemon does not document its own.
STAGING_FOLDERS = (".replicator/restore",)
# The names of local.format.MANIFEST and peers.copy_store.PEERS, not imported: those modules pull in
# jax and numpy, and this file protocol needs neither.
_MANIFEST = "manifest.json"
_PEERS = "peers"

_KEYS = ("job-name", "framework", "assume-data-parallelism", "node-rank", "nodes",
         "peer-ranks", "peers-per-node", "backup-interval-minutes", "backup-interval-steps")


def _is_int(value: Any) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class ReplicatorConfig:
  """The content of `replicator.yaml` (validated on construction)."""

  job_name: str
  node_rank: int
  nodes: int
  data_parallelism: int
  peer_ranks: tuple[int, ...] | None = None
  peers_per_node: int | None = None
  backup_interval_minutes: int | float | None = None
  backup_interval_steps: int | None = None
  framework: str = "orbax"

  def __post_init__(self):
    where = "replicator.yaml"
    name = self.job_name
    if not isinstance(name, str) or not name or any(c.isspace() or c in ":/#" for c in name):
      raise ValueError(f"{where}: job-name must be a non-empty name without spaces, ':', '/' "
                       f"or '#', got {name!r}.")
    if self.framework != "orbax":
      raise ValueError(f"{where}: framework must be 'orbax', got {self.framework!r}.")
    if not _is_int(self.nodes) or self.nodes < 1:
      raise ValueError(f"{where}: nodes must be an int >= 1, got {self.nodes!r}.")
    if not _is_int(self.node_rank) or not 0 <= self.node_rank < self.nodes:
      raise ValueError(f"{where}: node-rank must be an int in [0, {self.nodes}), got "
                       f"{self.node_rank!r}.")
    dp = self.data_parallelism
    if not _is_int(dp) or dp < 1 or self.nodes % dp:
      raise ValueError(f"{where}: assume-data-parallelism must be an int >= 1 that divides "
                       f"nodes={self.nodes}, got {dp!r}.")
    if (self.peer_ranks is None) == (self.peers_per_node is None):
      raise ValueError(f"{where}: give exactly one of peer-ranks (a list of node ranks) and "
                       f"peers-per-node (a count); got peer-ranks={self.peer_ranks!r}, "
                       f"peers-per-node={self.peers_per_node!r}.")
    if self.peer_ranks is not None:
      ranks = self.peer_ranks
      if not isinstance(ranks, tuple) or not all(_is_int(r) for r in ranks):
        raise ValueError(f"{where}: peer-ranks must be a list of ints, got {ranks!r}.")
      bad = [r for r in ranks if not 0 <= r < self.nodes or r == self.node_rank]
      if bad or len(set(ranks)) != len(ranks):
        raise ValueError(f"{where}: peer-ranks must be distinct ranks in [0, {self.nodes}) "
                         f"other than node-rank {self.node_rank}; got {list(ranks)}.")
    else:
      n = self.peers_per_node
      if not _is_int(n) or not 0 <= n < self.nodes:
        raise ValueError(f"{where}: peers-per-node must be an int in [0, {self.nodes}) "
                         f"(fewer than nodes), got {n!r}.")
    minutes, steps = self.backup_interval_minutes, self.backup_interval_steps
    if (minutes is None) == (steps is None):
      raise ValueError(f"{where}: give exactly one of backup-interval-minutes and "
                       f"backup-interval-steps; got {minutes!r} and {steps!r}.")
    if minutes is not None and (isinstance(minutes, bool) or not isinstance(minutes, (int, float))
                                or not 0 < minutes < float("inf")):
      raise ValueError(f"{where}: backup-interval-minutes must be > 0, got {minutes!r}.")
    if steps is not None and (not _is_int(steps) or steps < 1):
      raise ValueError(f"{where}: backup-interval-steps must be an int >= 1, got {steps!r}.")

  def to_yaml(self) -> str:
    fields: dict[str, Any] = {
        "job-name": self.job_name, "framework": self.framework,
        "assume-data-parallelism": self.data_parallelism, "node-rank": self.node_rank,
        "nodes": self.nodes}
    if self.peer_ranks is not None:
      fields["peer-ranks"] = list(self.peer_ranks)
    else:
      fields["peers-per-node"] = self.peers_per_node
    if self.backup_interval_minutes is not None:
      fields["backup-interval-minutes"] = self.backup_interval_minutes
    else:
      fields["backup-interval-steps"] = self.backup_interval_steps
    return yaml.safe_dump(fields, sort_keys=False, default_flow_style=None)

  @classmethod
  def from_yaml(cls, text: str) -> ReplicatorConfig:
    """Parses and validates; raises ValueError naming what is wrong."""
    try:
      fields = yaml.safe_load(text)
    except yaml.YAMLError as e:
      raise ValueError(f"replicator.yaml is not valid YAML: {e}") from e
    if not isinstance(fields, dict):
      raise ValueError(f"replicator.yaml must be a mapping of keys, got {type(fields).__name__}.")
    unknown = sorted(str(k) for k in fields if k not in _KEYS)
    if unknown:
      raise ValueError(f"replicator.yaml: unknown key(s) {unknown}; known: {list(_KEYS)}.")
    missing = [k for k in ("job-name", "framework", "assume-data-parallelism", "node-rank",
                           "nodes") if k not in fields]
    if missing:
      raise ValueError(f"replicator.yaml: missing key(s) {missing}.")
    peers = fields.get("peer-ranks")
    if isinstance(peers, list):
      peers = tuple(peers)
    return cls(job_name=fields["job-name"], framework=fields["framework"],
               data_parallelism=fields["assume-data-parallelism"],
               node_rank=fields["node-rank"], nodes=fields["nodes"], peer_ranks=peers,
               peers_per_node=fields.get("peers-per-node"),
               backup_interval_minutes=fields.get("backup-interval-minutes"),
               backup_interval_steps=fields.get("backup-interval-steps"))


# ----------------------------------------------------------------------------- polling


def _poll(ready: Callable[[], Any], timeout_s: float, poll_s: float, what: str) -> Any:
  """Calls `ready` until it returns a truthy value; TimeoutError naming `what` after
  `timeout_s` seconds."""
  deadline = time.monotonic() + timeout_s
  while True:
    value = ready()
    if value:
      return value
    if time.monotonic() >= deadline:
      raise TimeoutError(f"Timed out after {timeout_s:.0f}s waiting for {what}.")
    time.sleep(poll_s)  # the replicator announces nothing but files: poll them


def read_jax_init_info(local_directory: Path, *, timeout_s: float = 900.0,
                       poll_s: float = 1.0) -> tuple[int, str]:
  """(process id, coordinator address) from `<local>/jax-init-info.txt`, waiting for GKE to
  write it (it does once process 0's node is known)."""
  path = Path(local_directory) / JAX_INIT_INFO_FILE
  _poll(path.exists, timeout_s, poll_s, f"{path} (GKE writes it when the job's process 0 is "
        "known; check that the volume of the multi-tier checkpointing driver is mounted here)")
  lines = [line.strip() for line in path.read_text().splitlines()]
  if len(lines) < 2 or not lines[0].isdigit() or not lines[1]:
    raise ValueError(f"{path} must hold the process id on line 1 and the coordinator address "
                     f"(host:port) on line 2; it holds {lines[:3]!r}.")
  return int(lines[0]), lines[1]


def check_errors(local_directory: Path) -> None:
  """Logs and removes `replicator.errors`; raises ReplicatorError for `replicator.failed`."""
  local_directory = Path(local_directory)
  errors = local_directory / ERRORS_FILE
  if errors.exists():
    text = _read_and_remove(errors)
    logging.error("orbax-mtc: the replicator reported errors (%s):\n%s", errors, text)
  failed = local_directory / FAILED_FILE
  if failed.exists():
    text = _read_and_remove(failed)
    raise ReplicatorError(
        f"The multi-tier checkpointing replicator failed on this node ({failed}):\n{text}\n"
        "Fix the cause it names (often replicator.yaml: job name, ranks, backup interval; or "
        "the node's volume), then restart the job.")


def _read_and_remove(path: Path) -> str:
  try:
    text = path.read_text(errors="replace").strip()
  except OSError as e:
    text = f"(unreadable: {e})"
  path.unlink(missing_ok=True)
  return text


def handshake(local_directory: Path, config: ReplicatorConfig, *, timeout_s: float = 300.0,
              poll_s: float = 0.1) -> None:
  """Writes `replicator.yaml` once the previous one is gone, and waits for the replicator to
  take it (delete it); raises ReplicatorError if it reports a fatal error."""
  local_directory = Path(local_directory)
  path = local_directory / REPLICATOR_FILE
  # An older file may still be waiting for the replicator (not ours): its errors are not ours.
  _poll(lambda: not path.exists(), timeout_s, poll_s,
        f"the replicator to take the previous {path} (is the replicator running on this node?)")
  for name in (ERRORS_FILE, FAILED_FILE):
    stale = local_directory / name
    if stale.exists():  # the answer to an earlier replicator.yaml, not to ours
      logging.warning("orbax-mtc: removing %s left from an earlier run:\n%s", stale,
                      _read_and_remove(stale))
  files.write_atomic(path, config.to_yaml(), mode=0o600, tmp_name=REPLICATOR_TMP_FILE)
  logging.info("orbax-mtc: wrote %s:\n%s", path, config.to_yaml())

  def taken() -> bool:
    if path.exists():
      if (local_directory / FAILED_FILE).exists():
        check_errors(local_directory)
      return False
    return True

  _poll(taken, timeout_s, poll_s,
        f"the replicator to take {path} (is the replicator running on this node?)")
  check_errors(local_directory)


# ----------------------------------------------------------------------------- restore entries


@dataclasses.dataclass(frozen=True)
class RestoreChoice:
  """What this worker's `.restore` entries say: `step` 0 means nothing to restore, None means
  no usable entry; `target` is the step folder (inside the local directory) to restore."""

  step: int | None
  target: Path | None
  ignored: tuple[str, ...] = ()  # entry names passed over, with the reason


def entries_present(local_directory: Path) -> bool:
  return any(p.name.endswith(lkg.RESTORE_SUFFIX) for p in Path(local_directory).iterdir())


def _refuse_target(root: Path, target: Path,
                   staging: Sequence[str] = STAGING_FOLDERS) -> str | None:
  """Why `target` (resolved) is no step folder a restore entry may name; None if it may be."""
  try:
    parts = target.relative_to(root).parts
  except ValueError:
    return f"points to {target}, outside {root}"
  if not parts:
    return f"points to the local directory {root} itself"
  if parts[0] == _PEERS:
    return (f"points to {target}, under {_PEERS}/ (a copy this node holds for another node, "
            "not this node's step)")
  if parts[-1].startswith("."):
    return (f"points to {target}, a hidden folder (a step being written or retired, or "
            "another program's), not a step to restore")
  if len(parts) > 1 and parts[:-1] not in {Path(f).parts for f in staging}:
    return (f"points to {target}, which is neither directly in {root} nor directly in a "
            f"replicator staging folder {list(staging)}")
  if not target.is_dir():
    return f"points to {target}, which is not a folder"
  return None


def _refuse_manifest(target: Path, step: int, process_index: int) -> str | None:
  """Why the manifest in `target` does not fit the entry, or the folder is no whole step
  (`_refuse_incomplete`); None if it fits."""
  path = target / _MANIFEST
  if not (path.exists() or path.is_symlink()):
    return _refuse_incomplete(target)
  try:
    raw = json.loads(path.read_bytes())
  except (OSError, ValueError, RecursionError) as e:  # ValueError: bad JSON or bad UTF-8
    return f"its folder's {path} cannot be read as JSON ({type(e).__name__}: {e})"
  if not isinstance(raw, dict):
    return f"its folder's {path} is not a JSON object"
  for key, expected in (("step", step), ("process_index", process_index)):
    value = raw.get(key)
    if not _is_int(value):
      return f"its folder's {path} has no integer {key!r} (got {value!r})"
    if value != expected:
      return (f"its folder's {path} says {key} {value}, not {expected} "
              f"({'the entry names step' if key == 'step' else 'this process is'} {expected})")
  return _refuse_incomplete(target)


def _refuse_incomplete(target: Path) -> str | None:
  """Why `target` is no whole step folder (no manifest, one that fails its checks, a data
  file shorter than it says); None if it is one (the RAM tier verifies every checksum of the
  data when it restores)."""
  path = target / _MANIFEST
  if not path.is_file():
    return f"its folder has no {_MANIFEST}: no complete step folder"
  try:
    manifest = local_format.StepManifest.from_json(path.read_bytes(), where=str(path))
    size = os.stat(target / local_format.DATA, follow_symlinks=False).st_size
  except (OSError, local_format.LocalTierError) as e:
    return f"its folder is no valid step ({type(e).__name__}: {e})"
  if size < manifest.data_size:
    return (f"its folder's {local_format.DATA} holds {size} bytes, fewer than the "
            f"{manifest.data_size} its manifest says")
  return None


def choose_entry(local_directory: Path, node_rank: int, worker_index: int,
                 job_name: str | None = None, *, process_index: int | None = None,
                 staging: Sequence[str] = STAGING_FOLDERS) -> RestoreChoice:
  """Reads this worker's `.restore` entries without following any blindly.

  Ignored with a reason: names that do not parse, entries of other workers (or, given
  `job_name`, of other jobs), a symlink whose target is outside the local directory, hidden,
  under `peers/`, deeper than a direct child of the local directory or of a `staging` folder,
  or not a folder; a target whose `manifest.json` is malformed or names another step or another
  process than `process_index` (default `node_rank`: in managed mode a node is one process);
  a non-empty regular file, a zero-size file with a step other than 0. Two usable entries for
  different steps: error.
  """
  if process_index is None:
    process_index = node_rank
  root = Path(local_directory).resolve()
  usable: dict[int, Path | None] = {}
  ignored: list[str] = []
  for path in sorted(Path(local_directory).iterdir()):
    if not path.name.endswith(lkg.RESTORE_SUFFIX):
      continue
    try:
      entry = lkg.parse_link_name(path.name)
    except ValueError as e:
      ignored.append(f"{path.name}: {e}")
      continue
    if job_name is not None and entry.job_name != job_name:
      ignored.append(f"{path.name}: for job {entry.job_name!r}, not {job_name!r}")
      continue
    if (entry.node_rank, entry.worker_index) != (node_rank, worker_index):
      ignored.append(f"{path.name}: for node {entry.node_rank} worker {entry.worker_index}, "
                     f"not this one (node {node_rank} worker {worker_index})")
      continue
    if path.is_symlink() or path.is_dir():
      try:
        target = path.resolve(strict=True)
      except (OSError, RuntimeError) as e:  # dangling link, or a loop (RuntimeError < 3.13)
        ignored.append(f"{path.name}: its link cannot be followed ({type(e).__name__}: {e})")
        continue
      reason = _refuse_target(root, target, staging)
      if reason is None and entry.step == 0:
        reason = "a step folder for step 0 (0 means nothing to restore)"
      if reason is None:
        reason = _refuse_manifest(target, entry.step, process_index)
      if reason is not None:
        ignored.append(f"{path.name}: {reason}")
        continue
      usable[entry.step] = target
    elif path.is_file():
      if path.stat().st_size or entry.step != 0:
        ignored.append(f"{path.name}: a regular file; only a zero-size file with step 0 "
                       "(nothing to restore) is meaningful")
        continue
      usable.setdefault(0, None)
    else:
      ignored.append(f"{path.name}: neither a symlink, a folder nor a file")
  steps = sorted(s for s in usable if s)
  if len(steps) > 1:
    raise ReplicatorError(
        f"{local_directory} holds restore entries for different steps {steps} for node "
        f"{node_rank} worker {worker_index}; the replicator writes one. Remove the stale ones "
        "(or the whole folder's *.restore entries to restore from the persistent tier).")
  if steps:
    return RestoreChoice(steps[0], usable[steps[0]], tuple(ignored))
  return RestoreChoice(0 if 0 in usable else None, None, tuple(ignored))


def wait_for_entries(local_directory: Path, *, timeout_s: float = 300.0,
                     poll_s: float = 0.1) -> None:
  """Waits until the replicator has written this node's `.restore` entries."""
  def ready() -> bool:
    check_errors(local_directory)
    return entries_present(local_directory)

  _poll(ready, timeout_s, poll_s, f"the replicator's *.restore entries in {local_directory}")


def take_entry(local_directory: Path, choice: RestoreChoice, *,
               staging: Sequence[str] = STAGING_FOLDERS) -> int | None:
  """Moves the chosen step folder to `<local>/<step>` (where the RAM tier reads it) and removes
  every `.restore` entry; returns the step (None when there is nothing to restore).

  Nothing is deleted first (rule 10): the target is checked before anything moves, and a
  folder already at `<local>/<step>` is set aside (`local.aside`: a valid one as replaced,
  still serving the restore if the entry's copy turns out bad; another as damaged), never
  removed.

  Raises ReplicatorError, moving nothing, for a target `choose_entry` would have refused.
  """
  local_directory = Path(local_directory)
  step = choice.step
  if step and choice.target is not None:
    # choose_entry checked it; a hand-made choice must not move a peer copy or a .tmp- folder.
    target = Path(choice.target).resolve()
    reason = _refuse_target(local_directory.resolve(), target, staging)
    if reason is None:
      reason = _refuse_incomplete(target)
    if reason is not None:
      raise ReplicatorError(f"Refusing to restore step {step}: the chosen folder {reason}.")
    final = local_directory / str(step)
    if final.resolve() != target:
      if final.is_symlink():
        final.unlink()  # a link is never a step of ours (local/store.py), and holds nothing
      elif final.exists():
        aside.clear_way(local_directory, step, aside.REPLACED, 0o700,
                        check=local_store.read_manifest)
      os.rename(target, final)
      files.fsync_dir(local_directory)
  for path in local_directory.iterdir():
    if path.name.endswith(lkg.RESTORE_SUFFIX):
      if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
      else:
        path.unlink(missing_ok=True)
  return step or None


def agree(steps: Sequence[int]) -> int | None:
  """The step every process restores from its entry (0: all say nothing to restore), or None
  when they differ (the caller falls back and says why)."""
  distinct = set(steps)
  return distinct.pop() if len(distinct) == 1 else None


# ----------------------------------------------------------------------------- set-up


# Local directories whose handshake this process already made (initialize_multi_tier_...),
# with what their entries said, so a manager built afterwards does not repeat it.
_done: dict[Path, int | None] = {}


def record_handshake(local_directory: Path, step: int | None) -> None:
  _done[Path(local_directory).resolve()] = step


def handshake_result(local_directory: Path) -> tuple[bool, int | None]:
  key = Path(local_directory).resolve()
  return key in _done, _done.get(key)


def connect(local_directory: Path, config: ReplicatorConfig, worker_index: int, *,
            timeout_s: float = 300.0, poll_s: float = 0.1,
            staging: Sequence[str] = STAGING_FOLDERS) -> int | None:
  """Handshake, then this worker's restore entry checked (see `choose_entry`) and taken into
  `<local>/<step>`; returns its step (None: nothing to restore, or no usable entry)."""
  handshake(local_directory, config, timeout_s=timeout_s, poll_s=poll_s)
  wait_for_entries(local_directory, timeout_s=timeout_s, poll_s=poll_s)
  choice = choose_entry(local_directory, config.node_rank, worker_index, config.job_name,
                        staging=staging)
  for reason in choice.ignored:
    logging.warning("orbax-mtc: ignoring restore entry %s", reason)
  step = take_entry(local_directory, choice, staging=staging)
  if choice.step is None:
    logging.warning("orbax-mtc: no usable restore entry for node %d worker %d in %s; nothing "
                    "is restored from the local tier", config.node_rank, worker_index,
                    local_directory)
  else:
    logging.info("orbax-mtc: the replicator's restore entry for node %d worker %d: %s",
                 config.node_rank, worker_index,
                 f"step {step}" if step else "nothing to restore")
  record_handshake(local_directory, step)
  return step
