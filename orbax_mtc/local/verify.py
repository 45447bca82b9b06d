"""Checksum checks of a step's bytes against its manifest (`verify_buffer`, `verify_step`)."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np

from orbax_mtc.local import checksum
from orbax_mtc.local.format import (
    DATA,
    CorruptStepError,
    LeafRecord,
    LocalTierError,
    ShardRecord,
    StepManifest,
)
from orbax_mtc.local.store import open_regular_file, read_manifest


def manifest_entries(manifest: StepManifest) -> list[tuple[str, LeafRecord, ShardRecord]]:
  """Every shard of a manifest as (item, leaf, shard), in manifest order (its ordinal)."""
  return [(name, leaf, shard) for name, item in manifest.items.items() for leaf in item.leaves
          for shard in leaf.shards]


def shard_crc(data: np.ndarray, offset: int, nbytes: int) -> int:
  """The CRC32C of the `nbytes` of `data` (uint8) at `offset`."""
  return checksum.crc_ranges(data, [(offset, nbytes)])[0]


def known_or_computed_crc(data: np.ndarray, offset: int, nbytes: int,
                          crcs: dict[tuple[int, int], int] | None) -> int:
  """The checksum `read_data` computed for these bytes, else computed now."""
  known = (crcs or {}).get((offset, nbytes))
  return known if known is not None else shard_crc(data, offset, nbytes)


def verify_buffer(data: np.ndarray, manifest: StepManifest, where: str,
                  crcs: dict[tuple[int, int], int] | None = None) -> None:
  """Checks every shard of `data` against its checksum.

  Args:
    data: the step's bytes, laid out as `manifest` says.
    manifest: the step's manifest.
    where: names the source in error messages.
    crcs: checksums already computed from these bytes (`read_data`).

  Raises:
    CorruptStepError: `data` is short, or a shard does not match its checksum.
  """
  if data.nbytes < manifest.data_size:
    raise CorruptStepError(f"{where}: {data.nbytes} bytes, manifest says {manifest.data_size}")
  for item_name, leaf, shard in manifest_entries(manifest):
    got = known_or_computed_crc(data, shard.offset, shard.nbytes, crcs)
    if got != shard.crc32c:
      raise CorruptStepError(
          f"{where}: leaf {item_name}{leaf.path} shard {shard.index}: checksum mismatch "
          f"(crc32c {got:#010x}, manifest {shard.crc32c:#010x})")


def verify_step(step_dir: Path) -> StepManifest:
  """Re-checks every checksum of a committed step.

  Args:
    step_dir: the committed step folder.

  Returns:
    Its manifest.

  Raises:
    LocalTierError: on any problem (CorruptStepError for bytes that do not match).
  """
  manifest = read_manifest(step_dir)
  data_path = step_dir / DATA
  try:
    fd = open_regular_file(step_dir, DATA)
  except OSError as e:
    raise LocalTierError(f"{data_path}: {e}") from e
  try:
    size = os.fstat(fd).st_size
    if size != manifest.data_size:
      raise CorruptStepError(f"{data_path}: {size} bytes, manifest says {manifest.data_size}")
    # Unmapped when the last view goes (a mapping outlives its descriptor).
    data = (np.frombuffer(mmap.mmap(fd, size, prot=mmap.PROT_READ), dtype=np.uint8) if size
            else np.empty(0, np.uint8))
  finally:
    os.close(fd)
  for item_name, item in manifest.items.items():
    for leaf in item.leaves:
      for shard in leaf.shards:
        got = checksum.crc_ranges(data, [(shard.offset, shard.nbytes)])[0]
        if got != shard.crc32c:
          raise CorruptStepError(
              f"{step_dir}: leaf {item_name}{leaf.path} shard {shard.index}: checksum "
              f"mismatch (crc32c {got:#010x}, manifest {shard.crc32c:#010x})")
  return manifest
