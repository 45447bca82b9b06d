"""`forms/parts.build` on its own: the parts of one manager, wired around one RAM folder.

One process (`jax.process_count() == 1`), a real persistent tier (a plain Orbax manager on a
temporary folder) and the default options. Each test closes what it built as
`MultiTierForm.close` does: the writer shut down, the checksum thread stopped, the claim
released, the Orbax manager closed.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import orbax_mtc as mtc
from orbax_mtc import agreement
from orbax_mtc.forms import parts as parts_mod
from orbax_mtc.local import lock as local_lock
from orbax_mtc.local import restore_links
from orbax_mtc.local.staging import stage
from orbax_mtc.persistent.tier import PersistentTier
from orbax_mtc.save.retention import RamRetention

pytestmark = pytest.mark.timeout(60)


def close(built: parts_mod.Parts) -> None:
  built.writer.shutdown()
  built.local.close()
  if built.lock is not None:
    built.lock.release()


@contextlib.contextmanager
def persistent_tier(path: Path):
  tier = PersistentTier(ocp.CheckpointManager(path))
  try:
    yield tier
  finally:
    tier.close()


def build(local_directory: Path, persistent: PersistentTier, options=None) -> parts_mod.Parts:
  return parts_mod.build(
      options=options or mtc.CheckpointManagerOptions(), local_directory=local_directory,
      abstract_state=None, process_index=0, process_count=1, worker_index=0,
      persistent=persistent, backup_policy=None, peers_optional=False)


@contextlib.contextmanager
def built_parts(shm_dir: Path, tmp_path: Path, options=None):
  assert jax.process_count() == 1
  with persistent_tier(tmp_path / "persistent") as persistent:
    built = build(shm_dir / "local", persistent, options)
    try:
      yield built, persistent
    finally:
      close(built)


class Unstageable:
  """A staged step whose bytes cannot reach the host: the RAM write fails."""

  step = 5

  def to_host(self) -> None:
    raise RuntimeError("the staged bytes are gone")


def save(built: parts_mod.Parts, step: int) -> None:
  """One RAM step through the writer thread, waited for."""
  staged = stage(step, {"state": {"x": np.arange(16, dtype=np.float32) + step}}, {},
                 default_item=False)
  built.writer.write(staged)
  built.writer.wait()


def links(folder: Path) -> dict[str, str]:
  return {e.name: os.readlink(folder / e.name)
          for e in restore_links.list_entries(folder)}


def test_every_part_shares_one_local_tier_writer_and_ledger(shm_dir, tmp_path):
  with built_parts(shm_dir, tmp_path) as (built, persistent):
    local, store, writer, ledger = built.local, built.store, built.writer, built.ledger
    peers, backups, ram = built.peers, built.backups, built.ram
    assert local.directory == shm_dir / "local" and store.root == shm_dir / "local" / "peers"
    assert (local.process_index, local.process_count, local.reuse_files) == (0, 1, True)
    assert ledger.process_count == 1
    assert writer._local is local
    assert all(x is y for x, y in zip((peers._local, peers._store, peers._writer),
                                      (local, store, writer), strict=True))
    assert backups._persistent is persistent and backups._writer is writer
    assert backups._local is local and backups.policy is None
    for part, named in ((ram, dict(_local=local, _writer=writer, _ledger=ledger,
                                   _backups=backups, _peers=peers, _persistent=persistent)),
                        (built.ondemand, dict(_local=local, _writer=writer, _ram=ram,
                                              _peers=peers, _backups=backups,
                                              _persistent=persistent, _ledger=ledger)),
                        (built.tiers, dict(_ram=built.restorer, _persistent=persistent,
                                           _local=local, _store=store, _writer=writer,
                                           _ledger=ledger))):
      for name, want in named.items():
        assert getattr(part, name) is want, (type(part).__name__, name)
    assert built.restorer._ledger is ledger and built.restorer._peers is peers
    assert built.tiers._delete_local is built.delete_local
    # (The commit hook to `built.links` is checked by its effect: the tests that save.)
    # build does not read the mesh: no replica axis, no copies until set_mesh.
    assert peers.mesh is None and peers.replica_axis is None and not peers.enabled


def test_the_folder_is_claimed_for_this_process(shm_dir, tmp_path):
  with built_parts(shm_dir, tmp_path) as (built, _):
    lock = built.lock
    assert lock is not None and lock.held and not lock.taken_over
    assert lock.directory == shm_dir / "local"
    holder = local_lock.read_holder(shm_dir / "local")
    assert holder == lock.holder
    assert (holder.job_name, holder.process_index, holder.pid) == ("orbax", 0, os.getpid())
  assert local_lock.read_holder(shm_dir / "local") is None  # released: names no holder


def test_a_second_build_takes_the_folder_over(shm_dir, tmp_path):
  with persistent_tier(tmp_path / "persistent") as persistent:
    first = build(shm_dir / "local", persistent)
    second = None
    try:
      save(first, 1)
      second = build(shm_dir / "local", persistent)
      assert first.lock.taken_over and not first.lock.held
      assert second.lock.held and not second.lock.taken_over
      for steps in ([1], []):
        with pytest.raises(mtc.LocalDirectoryTakenOverError) as raised:
          first.delete_local(steps)
        assert raised.value.directory == shm_dir / "local"
      assert (shm_dir / "local" / "1").is_dir()  # the first set deleted nothing
      with pytest.raises(mtc.LocalDirectoryTakenOverError):
        first.writer.submit(lambda: None)  # its writer refuses work
      record = agreement.StartRecord()
      with pytest.raises(mtc.LocalDirectoryTakenOverError):
        first.ledger.summarize(record, "a save")  # it agrees nothing any more ...
      first.ledger.agree_steps("listing")  # ... but lists
      assert first.ledger.ram == (1,)
      assert not second.ledger.summarize(record, "a save").own_faults
      second.delete_local([1])  # the newer set owns the folder
      assert not (shm_dir / "local" / "1").exists()
    finally:
      close(first)
      if second is not None:
        close(second)


def test_one_retention_for_folders_copies_and_lists(shm_dir, tmp_path):
  with built_parts(shm_dir, tmp_path) as (built, _):
    keep = built.local.keep
    retention = keep.__self__
    assert isinstance(retention, RamRetention) and keep.__func__ is RamRetention.kept
    assert built.store.keep == keep and built.store.keep.__self__ is retention
    assert built.ledger._keep.__self__ is retention
    assert built.ram._retention is retention
    assert built.schedule._saved_at.__self__ is retention
    # The defaults: one RAM step kept, no preservation policy; the floor is kept too.
    assert (retention.max_to_keep, retention.policy) == (1, None)
    assert keep([2, 4, 6], None) == {6} and keep([2, 4, 6], 2) == {2, 6}


def test_a_latest_n_policy_is_max_to_keep(shm_dir, tmp_path):
  from orbax.checkpoint.checkpoint_managers import LatestN

  options = mtc.CheckpointManagerOptions(
      local=mtc.LocalCheckpointOptions(preservation_policy=LatestN(2)))
  with built_parts(shm_dir, tmp_path, options) as (built, _):
    retention = built.local.keep.__self__
    assert retention is built.store.keep.__self__
    assert (retention.max_to_keep, retention.policy) == (2, None)
    assert built.local.max_to_keep == built.store.max_to_keep == 2


def test_a_writer_error_reaches_the_next_take_fault(shm_dir, tmp_path):
  with built_parts(shm_dir, tmp_path) as (built, _):
    assert not built.ledger.take_fault().present
    built.writer.write(Unstageable())  # on the writer thread (async by default)
    assert built.writer.in_flight
    built.writer.wait()  # the error goes to on_error, not to the caller
    fault = built.ledger.take_fault()
    assert (fault.kind, fault.message) == ("RuntimeError", "the staged bytes are gone")
    assert not built.ledger.take_fault().present  # handed over once
    assert built.local.steps() == []
    # on_error is the ledger's slot: one error held at a time, the next only logged.
    on_error = built.writer._on_error
    assert on_error.__self__ is built.ledger._unreported
    assert on_error(OSError("first")) is True and on_error(OSError("second")) is False
    assert built.ledger.take_fault().message == "first"


def test_delete_local_removes_a_step_and_repoints_the_link(shm_dir, tmp_path):
  options = mtc.CheckpointManagerOptions(local=mtc.LocalCheckpointOptions(max_to_keep=2))
  folder = shm_dir / "local"
  with built_parts(shm_dir, tmp_path, options) as (built, _):
    save(built, 1)
    save(built, 2)
    assert built.local.steps() == [1, 2]
    assert links(folder) == {"orbax-s2-n0-w0.restore": "2/manifest.json"}
    built.delete_local([2])
    assert built.local.steps() == [1] and not (folder / "2").exists()
    assert links(folder) == {"orbax-s1-n0-w0.restore": "1/manifest.json"}
    assert (folder / "orbax-s1-n0-w0.restore").resolve() == (folder / "1" / "manifest.json")
    built.delete_local([])  # nothing to delete: the link stays
    assert links(folder) == {"orbax-s1-n0-w0.restore": "1/manifest.json"}
    built.delete_local([1])
    assert built.local.steps() == [] and links(folder) == {}


def test_default_options_keep_one_step_and_its_link(shm_dir, tmp_path):
  folder = shm_dir / "local"
  with built_parts(shm_dir, tmp_path) as (built, _):
    save(built, 3)
    save(built, 4)  # max_to_keep 1: step 3 retired at this commit
    assert built.local.steps() == [4]
    assert links(folder) == {"orbax-s4-n0-w0.restore": "4/manifest.json"}
    built.delete_local([4])
    assert built.local.steps() == [] and links(folder) == {}


def test_a_file_in_place_of_the_folder_is_refused(tmp_path):
  path = tmp_path / "not-a-folder"
  path.write_text("keep me")
  with persistent_tier(tmp_path / "persistent") as persistent:
    with pytest.raises(ValueError, match="exists and is not a directory"):
      build(path, persistent)
  assert path.read_text() == "keep me"
