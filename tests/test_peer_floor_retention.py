"""`PeerCopies.apply_retention`: at a local save, the copies kept only as the previous floor
go once the save's census agreed the new one, on a real peer store (a fake mesh of two
processes, as tests/test_part_peer_copies.py builds one), so that the next copy received
is written into a retired copy's data file rather than never-touched pages."""

from __future__ import annotations

import types

import numpy as np
import pytest

import orbax_mtc as mtc
from orbax_mtc.local.format import DATA, MANIFEST, SPARE_PREFIX
from orbax_mtc.peers import copy_store as peer_store
from orbax_mtc.peers.copies import PeerCopies

pytestmark = pytest.mark.timeout(60)


class _Device:
  def __init__(self, process_index: int):
    self.process_index = process_index


def _mesh(count: int):
  devices = np.empty((1, count), dtype=object)
  for i in range(count):
    devices[0, i] = _Device(i)
  return types.SimpleNamespace(devices=devices, axis_names=("data", "model"),
                               shape={"data": 1, "model": count})


def _committed_copy(store: peer_store.PeerStore, source: int, step: int) -> None:
  """A committed copy folder as retention sees it (its contents are not read here)."""
  folder = store.make_source_dir(source) / str(step)
  folder.mkdir()
  for name in (DATA, MANIFEST, peer_store.COPY_META):  # what a listing asks of a copy
    (folder / name).write_bytes(bytes(8192) if name == DATA else b"{}")


def _peers(tmp_path, count: int, floor: int | None):
  store = peer_store.PeerStore(tmp_path / "local", max_to_keep=1)
  local = types.SimpleNamespace(keep_floor=floor, spares=1)
  writer = types.SimpleNamespace(executor=None, reader=None)
  peers = PeerCopies(mtc.CheckpointManagerOptions(), 0, count, local=local, store=store,
                     writer=writer, send=True, optional=False)
  peers.set_mesh(_mesh(count))
  return peers, store, local


def test_copies_kept_only_as_the_old_floor_become_the_spare_at_the_next_save(tmp_path):
  peers, store, local = _peers(tmp_path, 2, floor=1)
  assert peers.replicator is not None  # process 1 sends to 0
  for step in (1, 5):
    _committed_copy(store, 1, step)
  inode = (store.source_dir(1) / "1" / DATA).stat().st_ino
  peers.apply_retention()  # the floor is still step 1: both kept (max_to_keep 1 + floor)
  assert store.copies() == [(1, 1), (1, 5)]
  local.keep_floor = 5  # the next save's census: every node holds step 5
  peers.apply_retention()
  assert store.copies() == [(1, 5)]
  (spare,) = [p for p in store.source_dir(1).iterdir() if p.name.startswith(SPARE_PREFIX)]
  incoming = store.begin(1, 10, 4096)  # the next copy takes the spare's data file
  assert (incoming.tmp / DATA).stat().st_ino == inode and not spare.exists()
  incoming.abort()


def test_nothing_is_retired_without_a_replicator(tmp_path):
  peers, store, _ = _peers(tmp_path, 1, floor=5)  # one process: no copies of its own
  assert peers.replicator is None
  for step in (1, 5):
    _committed_copy(store, 1, step)
  peers.apply_retention()
  assert store.copies() == [(1, 1), (1, 5)]


def test_an_error_listing_the_copies_is_logged_not_raised(tmp_path, monkeypatch, caplog):
  peers, store, _ = _peers(tmp_path, 2, floor=5)

  def unreadable():
    raise PermissionError("peers folder unreadable")
  monkeypatch.setattr(store, "copies", unreadable)
  peers.apply_retention()  # a save goes on: the other processes are in its collectives
  assert "peers folder unreadable" in caplog.text
