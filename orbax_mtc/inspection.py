"""`orbax-mtc status DIR` and `orbax-mtc verify DIR` for local (RAM) and persistent folders.

A local folder holds step folders with our manifest; a persistent folder is a standard Orbax
checkpoint root. Both report committed steps with sizes; `verify` re-reads every byte of a
local step against its CRC32C and checks that every persistent step is finalized and readable.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

from etils import epath
from orbax.checkpoint import path as ocp_path

from orbax_mtc import lkg, local_tier

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
  return any((p / local_tier.MANIFEST).is_file() for p in root.iterdir()
             if local_tier.is_step_name(p.name)) or any(
                 p.name.startswith(local_tier.TMP_PREFIX) or p.name.endswith(lkg.RESTORE_SUFFIX)
                 for p in root.iterdir())


def local_reports(root: Path, *, check: bool) -> list[StepReport]:
  reports = []
  for entry in sorted(root.iterdir(), key=lambda p: p.name):
    if local_tier.is_step_name(entry.name) and entry.is_dir():
      size = _tree_size(entry)
      if not check:
        try:
          local_tier.read_manifest(entry)
          reports.append(StepReport(int(entry.name), entry.name, size, "unchecked"))
        except local_tier.LocalTierError as e:
          reports.append(StepReport(int(entry.name), entry.name, size, "corrupt", str(e)))
        continue
      try:
        local_tier.verify_step(entry)
        reports.append(StepReport(int(entry.name), entry.name, size, "ok"))
      except (local_tier.LocalTierError, OSError, ValueError) as e:
        reports.append(StepReport(int(entry.name), entry.name, size, "corrupt", str(e)))
    elif entry.name.startswith(local_tier.TMP_PREFIX):
      reports.append(StepReport(None, entry.name, _tree_size(entry), "partial",
                                "interrupted or in-progress save (never restored)"))
  return reports


def _persistent_size(path: epath.Path) -> int:
  if not path.is_dir():
    return path.stat().length
  return sum(_persistent_size(child) for child in path.iterdir())


def persistent_reports(root: epath.Path, *, check: bool) -> list[StepReport]:
  """Steps of an Orbax directory (a path or gs://), found the way Orbax finds them: a step
  is complete once finalized (renamed in place, or its commit marker written on gs://);
  anything else that names a step is reported as partial."""
  reports = []
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
    if not check:
      reports.append(StepReport(step, entry.name, size, "unchecked"))
      continue
    try:
      _check_persistent_step(entry)
    except Exception as e:  # noqa: BLE001 - any failure to read is what verify reports
      reports.append(StepReport(step, entry.name, size, "corrupt", f"{type(e).__name__}: {e}"))
      continue
    reports.append(StepReport(step, entry.name, size, "ok"))
  return reports


def _check_persistent_step(step_dir: epath.Path) -> None:
  """Reads every array of every PyTree item of an Orbax step with plain Orbax."""
  import orbax.checkpoint as ocp

  for item_dir in step_dir.iterdir():
    if not item_dir.is_dir() or not (item_dir / "_METADATA").exists():
      continue
    with ocp.PyTreeCheckpointer() as checkpointer:
      metadata = checkpointer.metadata(item_dir)
      tree = metadata.item_metadata.tree if hasattr(metadata, "item_metadata") else metadata
      import jax
      import numpy as np

      restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
      checkpointer.restore(item_dir, args=ocp.args.PyTreeRestore(restore_args=restore_args))


def reports_for(directory: str, *, check: bool) -> tuple[str, list[StepReport]]:
  if "://" in directory:  # an object store: only ever a persistent directory
    try:
      root = epath.Path(directory)
      exists = root.is_dir()
    except ImportError as e:
      raise SystemExit(f"{directory}: reading it needs the GCS extra: pip install "
                       f"'orbax-mtc[gcs]' ({e}).") from e
    if not exists:
      raise SystemExit(f"{directory}: no such directory (or no access to it).")
    return "persistent", persistent_reports(root, check=check)
  root = Path(directory)
  if not root.is_dir():
    raise SystemExit(f"{directory}: not a directory.")
  if is_local_directory(root):
    return "local", local_reports(root, check=check)
  return "persistent", persistent_reports(epath.Path(root), check=check)


def _print(kind: str, directory: str, reports: list[StepReport]) -> None:
  print(f"{directory} ({kind} tier)")
  if not reports:
    print("  no steps")
  for r in reports:
    step = "-" if r.step is None else str(r.step)
    line = f"  {step:>10}  {r.state:<9}  {_human(r.size_bytes):>10}  {r.name}"
    print(line + (f"  {r.detail}" if r.detail else ""))
  if kind == "local":
    try:
      entries = lkg.list_entries(Path(directory))
    except ValueError as e:
      print(f"  LKG: {e}")
    else:
      for e in entries:
        print(f"  LKG {e.name} -> step {e.step}")


def status_main(directory: str) -> int:
  kind, reports = reports_for(directory, check=False)
  _print(kind, directory, reports)
  return 0


def verify_main(directory: str) -> int:
  kind, reports = reports_for(directory, check=True)
  _print(kind, directory, reports)
  bad = [r for r in reports if r.state in ("corrupt", "partial")]
  if bad:
    print(f"{len(bad)} corrupt or partial entr{'y' if len(bad) == 1 else 'ies'}", file=sys.stderr)
    return 1
  print(f"all {len(reports)} step(s) verified")
  return 0
