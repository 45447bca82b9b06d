"""The RAM tier keeps model weights private: folder and file modes, the owner of the local
directory, and step-named symbolic links that are never followed."""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
from pathlib import Path

import numpy as np
import pytest
from conftest import make_state

from orbax_mtc.local.format import DATA, MANIFEST, LocalTierError
from orbax_mtc.local.read import aligned_empty, read_data, verify_step
from orbax_mtc.local.staging import stage
from orbax_mtc.local.store import LocalTier, committed_steps, read_manifest
from orbax_mtc.peers import copy_store as peer_store
from orbax_mtc.peers import stream as peer_stream

pytestmark = pytest.mark.timeout(120)


def mode(path: Path) -> int:
  return stat.S_IMODE(os.lstat(path).st_mode)


@contextlib.contextmanager
def umask(value: int):
  old = os.umask(value)
  try:
    yield
  finally:
    os.umask(old)


def write(tier: LocalTier, mesh, step: int) -> Path:
  staged = stage(step, {"state": make_state(mesh, seed=step)}, {"meta": {"step": step}},
                 default_item=False)
  return tier.write(staged, process_index=0, process_count=1)


def copy_into(store: peer_store.PeerStore, step_dir: Path, source: int = 0) -> Path:
  """Delivers a copy of a committed step to `store`, as a peer's stream would."""
  manifest = read_manifest(step_dir)
  stream = peer_stream.copy_stream(step_dir, manifest, source, set())
  buffer = aligned_empty(stream.nbytes)
  buffer[:] = 0
  stream.read(0, buffer)
  incoming = store.begin(source, manifest.step, stream.nbytes)
  incoming.write(0, buffer)
  folder = incoming.commit(None)
  assert folder is not None
  return folder


# ----------------------------------------------------------------------------- modes


@pytest.mark.parametrize("mask", [0o000, 0o022])
def test_default_modes_are_private_whatever_the_umask(shm_dir, mesh, mask):
  local = shm_dir / "local"
  with umask(mask):
    tier = LocalTier(local, max_to_keep=1)
    tier.prepare()
    try:
      for step in (1, 2, 3):  # later steps reuse the spare's data file
        step_dir = write(tier, mesh, step)
        assert mode(step_dir) == 0o700
        assert mode(step_dir / DATA) == 0o600
        assert mode(step_dir / MANIFEST) == 0o600
      assert mode(local) == 0o700
      store = peer_store.PeerStore(local, max_to_keep=None)
      folder = copy_into(store, step_dir)
      for path in (store.root, store.source_dir(0), folder):
        assert mode(path) == 0o700, path
      for name in (DATA, MANIFEST, peer_store.COPY_META):
        assert mode(folder / name) == 0o600, name
    finally:
      tier.close()


def test_configured_modes_are_respected(shm_dir, mesh):
  local = shm_dir / "local"
  with umask(0o077):  # narrower than asked: the modes are set explicitly
    tier = LocalTier(local, max_to_keep=2, dir_mode=0o750, file_mode=0o640)
    tier.prepare()
    try:
      step_dir = write(tier, mesh, 4)
      assert mode(local) == 0o750 and mode(step_dir) == 0o750
      assert mode(step_dir / DATA) == 0o640 and mode(step_dir / MANIFEST) == 0o640
      store = peer_store.PeerStore(local, max_to_keep=None, dir_mode=0o710, file_mode=0o604)
      folder = copy_into(store, step_dir)
      assert mode(store.root) == mode(store.source_dir(0)) == mode(folder) == 0o710
      assert {mode(p) for p in folder.iterdir()} == {0o604}
    finally:
      tier.close()


def test_existing_local_directory_keeps_its_mode(shm_dir):
  local = shm_dir / "local"
  local.mkdir()
  local.chmod(0o755)
  tier = LocalTier(local, max_to_keep=1)
  tier.prepare()  # warns, but a folder the user made is theirs to set
  assert mode(local) == 0o755
  tier.close()


# ----------------------------------------------------------------------------- owner


def test_local_directory_owned_by_another_user_is_refused(shm_dir):
  local = shm_dir / "theirs"
  local.mkdir(mode=0o700)
  (local / ".tmp-1-abc").mkdir()  # nothing is removed from a folder that is not ours
  try:
    os.chown(local, 65534, 65534)
  except PermissionError:
    pytest.skip("cannot chown a folder to another user here (not root)")
  tier = LocalTier(local, max_to_keep=1)
  with pytest.raises(ValueError, match="owned by uid 65534") as info:
    tier.prepare()
  assert f"chown {os.geteuid()}" in str(info.value)
  assert (local / ".tmp-1-abc").is_dir()
  tier.close()


# ----------------------------------------------------------------------------- links


@pytest.fixture
def outside(shm_dir, mesh):
  """A committed step 7 in a folder outside the local directory."""
  tier = LocalTier(shm_dir / "elsewhere", max_to_keep=None)
  tier.prepare()
  step_dir = write(tier, mesh, 7)
  tier.close()
  return step_dir


@pytest.fixture
def tier(shm_dir):
  tier = LocalTier(shm_dir / "local", max_to_keep=2)
  tier.prepare()
  yield tier
  tier.close()


def test_step_named_link_is_neither_listed_nor_read(tier, mesh, outside):
  write(tier, mesh, 5)
  link = tier.directory / "7"
  os.symlink(outside, link)
  before = sorted(p.name for p in outside.iterdir())
  assert committed_steps(tier.directory) == [5] == tier.steps()
  for read in (lambda: tier.manifest(7), lambda: read_manifest(link),
               lambda: verify_step(link),
               lambda: read_data(link, read_manifest(outside))):
    with pytest.raises(LocalTierError, match="symbolic link"):
      read()
  # Retention and new saves leave the link's target alone; deleting the step drops the link.
  for step in (8, 9):
    write(tier, mesh, step)
  assert tier.steps() == [8, 9]
  tier.delete(7)
  assert not os.path.lexists(link)
  assert sorted(p.name for p in outside.iterdir()) == before
  verify_step(outside)


def test_linked_files_inside_a_step_are_refused(tier, mesh, outside):
  step_dir = write(tier, mesh, 5)
  manifest = read_manifest(step_dir)
  (step_dir / DATA).unlink()
  os.symlink(outside / DATA, step_dir / DATA)
  with pytest.raises(LocalTierError, match="symbolic link"):
    read_manifest(step_dir)
  with pytest.raises(LocalTierError, match="symbolic link"):
    read_data(step_dir, manifest)
  with pytest.raises(LocalTierError, match="symbolic link"):
    verify_step(step_dir)
  (step_dir / MANIFEST).unlink()
  os.symlink(outside / MANIFEST, step_dir / MANIFEST)
  assert committed_steps(tier.directory) == []  # a linked manifest commits nothing
  with pytest.raises(LocalTierError, match="symbolic link"):
    read_manifest(step_dir)


def test_leftover_links_are_removed_not_followed(shm_dir, mesh, outside):
  local = shm_dir / "local"
  local.mkdir(mode=0o700)
  os.symlink(outside, local / ".tmp-3-abc")
  os.symlink(outside, local / ".spare-abc")
  before = sorted(p.name for p in outside.iterdir())
  tier = LocalTier(local, max_to_keep=1)
  tier.prepare()
  assert not os.path.lexists(local / ".tmp-3-abc") and not os.path.lexists(local / ".spare-abc")
  os.symlink(outside, local / ".spare-def")  # appears later: never taken as a spare
  try:
    for step in (1, 2):
      write(tier, mesh, step)
  finally:
    tier.close()
  assert sorted(p.name for p in outside.iterdir()) == before
  verify_step(outside)


def test_peer_copy_links_are_neither_listed_nor_read(shm_dir, mesh, outside):
  local = shm_dir / "local"
  tier = LocalTier(local, max_to_keep=None)
  tier.prepare()
  store = peer_store.PeerStore(local, max_to_keep=None)
  try:
    own = write(tier, mesh, 7)
    elsewhere = peer_store.PeerStore(shm_dir / "elsewhere", max_to_keep=None)
    real_copy = copy_into(elsewhere, outside)  # a complete copy of step 7, outside
    copy_into(store, own)  # this node's own copy folder for source 0
    link = store.source_dir(0) / "9"
    os.symlink(real_copy, link)
    assert store.copies() == [(0, 7)]
    with pytest.raises(LocalTierError, match="symbolic link"):
      store.read(0, 9, local / "9")
    with pytest.raises(LocalTierError, match="symbolic link"):
      store.meta(0, 9)
    # A whole source folder that is a link is skipped too, and replaced when a copy arrives.
    os.symlink(elsewhere.source_dir(0), store.root / "3")
    assert store.copies() == [(0, 7)]
    store.prepare()
    assert store.make_source_dir(3).is_dir() and not (store.root / "3").is_symlink()
    store.drop_newer(-1)
    store.drop_sources([])
    assert store.copies() == []
    assert sorted(p.name for p in real_copy.iterdir()) == sorted(
        [DATA, MANIFEST, peer_store.COPY_META])
    manifest, data = elsewhere.read(0, 7, outside)
    assert manifest.step == 7 and np.asarray(data).nbytes == manifest.data_size
  finally:
    tier.close()
    shutil.rmtree(local, ignore_errors=True)
