"""`orbax-mtc status DIR` and `orbax-mtc verify DIR` for local (RAM) and persistent folders.

A local folder holds step folders with our manifest; a persistent folder is a standard Orbax
checkpoint root. Both report committed steps with sizes; `verify` re-reads every byte of a
local step against its CRC32C and checks that every persistent step is finalized and readable. `--json` prints one document
instead (schemas in docs/cli.md).
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path
from typing import Any

from etils import epath
from orbax.checkpoint import path as ocp_path

from orbax_mtc.local import format as local_format
from orbax_mtc.local import read as local_read
from orbax_mtc.local import restore_links as lkg
from orbax_mtc.local import store as local_store
from orbax_mtc.save import backup
from orbax_mtc.tools import console, reach

_STEP_METADATA = "_CHECKPOINT_METADATA"  # Orbax writes it when it finalizes a step


@dataclasses.dataclass
class StepReport:
  step: int | None
  name: str
  size_bytes: int
  state: str  # "ok", "corrupt", "partial", "unchecked"
  detail: str = ""


def _tree_size(path: Path) -> int:
  if path.is_file():
    return path.stat().st_size
  return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def _human(n: int) -> str:
  size = float(n)
  for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
    if size < 1024 or unit == "TiB":
      return f"{size:.1f} {unit}" if unit != "B" else f"{int(size)} B"
    size /= 1024
  return f"{n} B"


def is_local_directory(root: Path) -> bool:
  return any((p / local_format.MANIFEST).is_file() for p in root.iterdir()
             if local_store.is_step_name(p.name)) or any(
                 p.name.startswith(local_format.TMP_PREFIX) or p.name.endswith(lkg.RESTORE_SUFFIX)
                 for p in root.iterdir())


def local_reports(root: Path, *, check: bool, bar: Any = None) -> list[StepReport]:
  """Steps and leftover temporary folders of a local directory, by name; with `check`, every
  step's bytes re-read against its manifest, advancing `bar` (a tqdm) by each step's size."""
  reports, steps = [], []
  for entry in sorted(root.iterdir(), key=lambda p: p.name):
    if local_store.is_step_name(entry.name) and entry.is_dir():
      steps.append((entry, _tree_size(entry)))
    elif entry.name.startswith(local_format.TMP_PREFIX):
      reports.append(StepReport(None, entry.name, _tree_size(entry), "partial",
                                "interrupted or in-progress save (never restored)"))
  if check and bar is not None:
    bar.reset(total=sum(size for _, size in steps))
  for entry, size in steps:
    if not check:
      try:
        local_store.read_manifest(entry)
        reports.append(StepReport(int(entry.name), entry.name, size, "unchecked"))
      except local_format.LocalTierError as e:
        reports.append(StepReport(int(entry.name), entry.name, size, "corrupt", str(e)))
      continue
    try:
      local_read.verify_step(entry)
      reports.append(StepReport(int(entry.name), entry.name, size, "ok"))
    except (local_format.LocalTierError, OSError, ValueError) as e:
      reports.append(StepReport(int(entry.name), entry.name, size, "corrupt", str(e)))
    if bar is not None:
      bar.update(size)
  return sorted(reports, key=lambda r: r.name)


def _persistent_size(path: epath.Path) -> int:
  if not path.is_dir():
    return path.stat().length
  return sum(_persistent_size(child) for child in path.iterdir())


def persistent_reports(root: epath.Path, *, check: bool, bar: Any = None) -> list[StepReport]:
  """Steps of an Orbax directory (a path or gs://), found the way Orbax finds them: a step
  is complete once finalized (renamed in place, or its commit marker written on gs://);
  anything else that names a step is reported as partial. With `check`, every array of every
  complete step is read back, advancing `bar` (a tqdm) by each step's size."""
  reports, complete = [], []
  with console.no_missing_metadata_warnings():
    finalized = {meta.path.name: meta.step
                 for meta in ocp_path.step.standard_name_format().find_all(root)}
  for entry in sorted(root.iterdir(), key=lambda p: p.name):
    if not entry.is_dir():
      continue
    tmp = re.match(ocp_path.step.TMP_DIR_STEP_PATTERN, entry.name)
    if tmp:
      reports.append(StepReport(int(tmp.group(1)), entry.name, _persistent_size(entry),
                                "partial", "unfinished Orbax save (never restored)"))
      continue
    if entry.name not in finalized:
      if entry.name.isdigit():
        reports.append(StepReport(int(entry.name), entry.name, _persistent_size(entry),
                                  "partial", "not finalized: an interrupted or failed save "
                                  "(never restored)"))
      continue
    step, size = finalized[entry.name], _persistent_size(entry)
    if not (entry / _STEP_METADATA).exists():
      reports.append(StepReport(step, entry.name, size, "partial",
                                f"no {_STEP_METADATA}: the save was never finalized"))
      continue
    complete.append((entry, step, size))
  if check and bar is not None:
    bar.reset(total=sum(size for _, _, size in complete))
  for entry, step, size in complete:
    if not check:
      reports.append(StepReport(step, entry.name, size, "unchecked"))
      continue
    try:
      _check_persistent_step(entry)
    except Exception as e:  # noqa: BLE001 - any failure to read is what verify reports
      reports.append(StepReport(step, entry.name, size, "corrupt", f"{type(e).__name__}: {e}"))
    else:
      reports.append(StepReport(step, entry.name, size, "ok"))
    if bar is not None:
      bar.update(size)
  return sorted(reports, key=lambda r: r.name)


def _check_persistent_step(step_dir: epath.Path) -> None:
  """Reads every array of every PyTree item of an Orbax step with plain Orbax."""
  import jax
  import numpy as np
  import orbax.checkpoint as ocp

  for item_dir in step_dir.iterdir():
    if not item_dir.is_dir() or not (item_dir / "_METADATA").exists():
      continue
    with ocp.PyTreeCheckpointer() as checkpointer:
      # metadata() also looks for a step's metadata file inside the item's folder, where
      # Orbax never writes one, and would log that for every healthy step.
      with console.no_missing_metadata_warnings():
        metadata = checkpointer.metadata(item_dir)
      tree = metadata.item_metadata.tree if hasattr(metadata, "item_metadata") else metadata
      restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
      checkpointer.restore(item_dir, args=ocp.args.PyTreeRestore(restore_args=restore_args))


class InspectionError(Exception):
  """The directory cannot be inspected (missing, no access, no GCS extra); the message says
  which."""


def reports_for(directory: str, *, check: bool,
                bar: Any = None) -> tuple[str, list[StepReport]]:
  """("local" or "persistent", the reports) for `directory`; InspectionError when it cannot
  be read."""
  try:
    if "://" in directory:  # an object store: only ever a persistent directory
      try:
        reach.check(directory)
      except reach.UnreachableError as e:
        raise InspectionError(str(e)) from None
      try:
        root = epath.Path(directory)
        exists = root.is_dir()
      except ImportError as e:
        raise InspectionError(f"{directory}: reading it needs the GCS extra: pip install "
                              f"'orbax-mtc[gcs]' ({e})") from e
      if not exists:
        raise InspectionError(f"{directory}: no such directory (or no access to it)")
      return "persistent", persistent_reports(root, check=check, bar=bar)
    root = Path(directory)
    if not root.exists():
      raise InspectionError(f"{directory}: no such directory")
    if not root.is_dir():
      raise InspectionError(f"{directory}: not a directory")
    if is_local_directory(root):
      return "local", local_reports(root, check=check, bar=bar)
    return "persistent", persistent_reports(epath.Path(root), check=check, bar=bar)
  except OSError as e:  # e.g. no permission to list it
    raise InspectionError(f"{directory}: cannot read it: {e}") from e


def _lkg(kind: str, directory: str) -> tuple[list[lkg.LkgEntry], str | None]:
  """The last-known-good entries of a local directory, and why they cannot be read."""
  if kind != "local":
    return [], None
  try:
    return lkg.list_entries(Path(directory)), None
  except ValueError as e:
    return [], str(e)


def _print(kind: str, directory: str, reports: list[StepReport]) -> None:
  print(f"{directory} ({kind} tier)")
  if not reports:
    print("  no steps")
  for r in reports:
    step = "-" if r.step is None else str(r.step)
    line = f"  {step:>10}  {r.state:<9}  {_human(r.size_bytes):>10}  {r.name}"
    print(line + (f"  {r.detail}" if r.detail else ""))
  entries, lkg_error = _lkg(kind, directory)
  if lkg_error is not None:
    print(f"  LKG: {lkg_error}")
  for e in entries:
    print(f"  LKG {e.name} -> step {e.step}")
  skipped = _skipped(kind, directory)
  if skipped:
    print(f"  backups skipped (skip_backups_when_busy): steps {skipped}")


def document(verb: str, kind: str, directory: str,
             reports: list[StepReport]) -> dict[str, Any]:
  """The --json document of `status` or `verify` (docs/cli.md: orbax-mtc/<verb>/1)."""
  entries, lkg_error = _lkg(kind, directory)
  doc: dict[str, Any] = {
      "schema": f"orbax-mtc/{verb}/1",
      "directory": directory,
      "tier": kind,
      "steps": [{"step": r.step, "name": r.name, "state": r.state, "size_bytes": r.size_bytes,
                 "detail": r.detail or None} for r in reports],
      "lkg": [dataclasses.asdict(e) for e in entries],
      "lkg_error": lkg_error,
      "skipped_backups": _skipped(kind, directory),
  }
  if verb == "verify":
    counts = {state: sum(r.state == state for r in reports)
              for state in ("ok", "corrupt", "partial")}
    doc.update(ok=bool(reports) and counts["ok"] == len(reports), verified=counts["ok"],
               corrupt=counts["corrupt"], partial=counts["partial"])
  return doc


def _skipped(kind: str, directory: str) -> list[int]:
  """Due steps a manager on this RAM-disk folder did not back up (`skip_backups_when_busy`)."""
  return backup.read_skips(Path(directory)) if kind == "local" else []


def status_main(directory: str, *, as_json: bool = False) -> int:
  """`orbax-mtc status`: 0, or 2 when the directory cannot be read."""
  try:
    kind, reports = reports_for(directory, check=False)
  except InspectionError as e:
    console.error("orbax-mtc status", str(e))
    return 2
  if as_json:
    console.print_json(document("status", kind, directory, reports))
  else:
    _print(kind, directory, reports)
  return 0


def verify_main(directory: str, *, as_json: bool = False) -> int:
  """`orbax-mtc verify`: 0 when every step verified, 1 on a corrupt or partial entry, 2 when
  nothing was verified (the directory cannot be read or holds no step)."""
  try:
    with console.progress(total=None, desc="verify", unit="B", unit_scale=True,
                      unit_divisor=1024, enabled=not as_json) as bar:
      kind, reports = reports_for(directory, check=True, bar=bar)
  except InspectionError as e:
    console.error("orbax-mtc verify", str(e))
    return 2
  if not reports:  # an empty or mistyped directory must not pass for a verified one
    console.error("orbax-mtc verify", f"nothing to verify: {directory} holds no checkpoint step")
    return 2
  if as_json:
    console.print_json(document("verify", kind, directory, reports))
  else:
    _print(kind, directory, reports)
  bad = [r for r in reports if r.state in ("corrupt", "partial")]
  if bad:
    print(f"{len(bad)} corrupt or partial entr{'y' if len(bad) == 1 else 'ies'}", file=sys.stderr)
    return 1
  if not as_json:
    print(f"all {len(reports)} step(s) verified")
  return 0
