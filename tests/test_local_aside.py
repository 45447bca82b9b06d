"""Step folders set aside, never deleted first (orbax_mtc/local/aside.py): a commit over a
damaged folder, a replacement that keeps the old layout while its step is kept, a
replacement cut between its two renames, and a removal cut halfway."""

from __future__ import annotations

import os
import pathlib
import shutil

import pytest
from conftest import make_state

from orbax_mtc.local import aside
from orbax_mtc.local.format import MANIFEST
from orbax_mtc.local.read import verify_step
from orbax_mtc.local.staging import stage
from orbax_mtc.local.store import LocalTier, committed_steps, read_manifest

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def tier(shm_dir):
  tier = LocalTier(shm_dir / "local", max_to_keep=2)
  tier.prepare()
  yield tier
  tier.close()


def _write(tier, mesh, step, *, seed=None, replace=None):
  staged = stage(step, {"state": make_state(mesh, seed=step if seed is None else seed)}, {},
                 default_item=False)
  extra = {} if replace is None else {"replace": replace}
  return tier.write(staged, process_index=0, process_count=1, **extra)


def _aside(tier) -> list[tuple[str, int]]:
  return sorted(parsed for e in tier.directory.iterdir()
                if (parsed := aside.parse(e.name)) is not None)


@pytest.mark.parametrize("damage", ["no-manifest", "garbled-manifest", "short-data"])
def test_a_damaged_folder_is_moved_aside_and_never_blocks_a_commit(tier, mesh, damage):
  folder = _write(tier, mesh, 3)
  if damage == "no-manifest":
    (folder / MANIFEST).unlink()
  elif damage == "garbled-manifest":
    (folder / MANIFEST).write_text("{not json")
  else:
    os.truncate(folder / "data.bin", 10)
  _write(tier, mesh, 3)  # with no replace given: damage is never "already committed"
  assert read_manifest(tier.directory / "3").step == 3
  assert _aside(tier) == [(aside.DAMAGED, 3)]


def test_a_committed_step_is_kept_unless_a_replacement_is_asked_for(tier, mesh):
  _write(tier, mesh, 3, seed=1)
  before = read_manifest(tier.directory / "3")
  with pytest.raises(FileExistsError, match="already committed"):
    _write(tier, mesh, 3, seed=2)
  assert read_manifest(tier.directory / "3") == before and _aside(tier) == []


def test_a_replaced_layout_stays_readable_while_its_step_is_kept(tier, mesh):
  _write(tier, mesh, 3, seed=1)
  old = read_manifest(tier.directory / "3")
  _write(tier, mesh, 3, seed=2, replace=aside.REPLACED)
  ((step, folder),) = aside.replaced_folders(tier.directory)
  assert step == 3 and read_manifest(folder) == old  # still a valid step folder
  assert read_manifest(tier.directory / "3") != old
  _write(tier, mesh, 4)
  assert aside.replaced_folders(tier.directory)  # step 3 is still kept (max_to_keep=2)
  _write(tier, mesh, 5)  # retention retires step 3: its replaced layout goes with it
  assert committed_steps(tier.directory) == [4, 5]
  assert aside.replaced_folders(tier.directory) == [] and _aside(tier) == []


def test_a_replacement_cut_between_its_renames_gets_the_old_folder_back(tier, mesh):
  _write(tier, mesh, 3)
  old = read_manifest(tier.directory / "3")
  moved = aside.move_aside(tier.directory, 3, aside.REPLACED, 0o700)  # then: killed
  assert 3 not in committed_steps(tier.directory) and moved.is_dir()
  restarted = LocalTier(tier.directory, max_to_keep=2)
  restarted.prepare()
  try:
    assert read_manifest(tier.directory / "3") == old
    assert _aside(restarted) == []
  finally:
    restarted.close()


def test_deleting_a_step_removes_its_folders_set_aside(tier, mesh):
  _write(tier, mesh, 3, seed=1)
  _write(tier, mesh, 3, seed=2, replace=aside.REPLACED)
  tier.delete(3)
  assert committed_steps(tier.directory) == [] and _aside(tier) == []


def test_a_removal_cut_halfway_leaves_no_half_deleted_layout_listed(tier, mesh, monkeypatch):
  # Retention retires step 3, first removing its replaced layout; the process is killed
  # once that layout's data file is gone, its manifest not yet. After a restart step 3 is
  # still whole, and no set-aside folder is listed that does not read as a step.
  _write(tier, mesh, 3, seed=1)
  _write(tier, mesh, 3, seed=2, replace=aside.REPLACED)
  current = read_manifest(tier.directory / "3")
  _write(tier, mesh, 4)
  real_rmtree = shutil.rmtree

  def killed_halfway(path, ignore_errors=False):
    for data in pathlib.Path(path).rglob("data.bin"):
      data.unlink()
    raise SystemExit("killed")  # the rest of the folder stays

  monkeypatch.setattr(shutil, "rmtree", killed_halfway)
  with pytest.raises(SystemExit):
    _write(tier, mesh, 5)
  monkeypatch.setattr(shutil, "rmtree", real_rmtree)
  restarted = LocalTier(tier.directory, max_to_keep=2)
  restarted.prepare()
  try:
    assert committed_steps(tier.directory) == [3, 4, 5]
    assert verify_step(tier.directory / "3") == current
    for _, folder in aside.replaced_folders(tier.directory):
      read_manifest(folder)  # LocalTierError: a half-deleted folder listed as a layout
    assert not [e for e in tier.directory.iterdir() if e.name.startswith(".tmp-")]
  finally:
    restarted.close()
