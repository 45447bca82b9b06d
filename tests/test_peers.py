"""Peer replication and recovery: 4 real JAX processes (1 CPU device each), own /dev/shm folders.

Three saved runs (steps 0..10, local every 2 steps keep 2, persistent every 100 steps, so the
persistent tier holds only step 0: a restore at step 10 or 8 can only come from RAM):
  mixed  mesh (data=2, model=2): replicas {0,1} {2,3}, twins 0-2 and 1-3; params/w and idx are
         sharded over "data" (twins differ), the rest only over "model" (twins identical).
  fsdp   mesh (data=1, model=4): one replica, every array sharded across all four processes;
         peers form a ring i -> i+1.
  dp     mesh (data=2, model=2) with every leaf replicated over "data": twins hold identical
         shards, so copies carry no shard bytes and a lost node is rebuilt from its twin.
Each test copies a run's folders, wipes or corrupts some, restarts all four processes and
checks that every process restored the expected step bit for bit (`tests/mp_worker`).
"""

from __future__ import annotations

import pathlib
import shutil

import mp_helpers
import numpy as np
import pytest
from mp_helpers import assert_ok, mp_events, new_root, tail

from orbax_mtc.local.format import DATA
from orbax_mtc.local.read import manifest_entries, verify_step
from orbax_mtc.local.store import committed_steps, read_manifest
from orbax_mtc.peers import copy_store as peer_store

LAUNCH_TIMEOUT_S = 120
NPROCS = 4
pytestmark = pytest.mark.timeout(300)

SAVE_ARGS = ["--local-interval", "2", "--local-keep", "2", "--persistent-interval", "100"]
LAYOUTS = {"mixed": ["--replicas", "2"], "fsdp": ["--replicas", "1"],
           "dp": ["--replicas", "2", "--layout", "dp"]}


def run_job(command: list[str], root: pathlib.Path):
  return mp_helpers.run_job(command, NPROCS, root, devices=1, timeout_s=LAUNCH_TIMEOUT_S)


def restored(out) -> dict[int, tuple[str, str]]:
  """node -> (step, tier); fails unless every node restored bit-exact data."""
  results = mp_events.parse_results(out.lines)
  assert sorted(results) == list(range(NPROCS)), f"missing RESULT lines:\n{tail(out)}"
  for node, fields in results.items():
    assert fields["ok"] == "1", f"node {node}: restored data differs: {fields['detail']}"
  return {node: (fields["step"], fields["tier"]) for node, fields in results.items()}


def expect(step: int, peer_nodes=(), tier_others: str = "local") -> dict[int, tuple[str, str]]:
  return {n: (str(step), "peer" if n in peer_nodes else tier_others) for n in range(NPROCS)}


def copy_dir(root: pathlib.Path, holder: int, source: int, step: int) -> pathlib.Path:
  return root / f"node{holder}" / peer_store.PEERS / str(source) / str(step)


def verify_copy(root: pathlib.Path, holder: int, source: int, step: int) -> None:
  """The copy of `source`'s step on `holder` rebuilds the source's bytes (checksums hold)."""
  store = peer_store.PeerStore(root / f"node{holder}", max_to_keep=None)
  manifest, _ = store.read(source, step, root / f"node{holder}" / str(step))
  assert (manifest.step, manifest.process_index) == (step, source)


def _saved(layout: str, tmp_path_factory, request):
  root = new_root(f"saved-{layout}")
  request.addfinalizer(lambda: shutil.rmtree(root, ignore_errors=True))
  persistent = tmp_path_factory.mktemp(f"peers-{layout}") / "ckpt"
  result, out = run_job(["save", "--steps", "11", "--persistent-dir", str(persistent),
                         *SAVE_ARGS, *LAYOUTS[layout]], root)
  assert_ok(result, out)
  return root, persistent, layout


@pytest.fixture(scope="module")
def mixed_run(tmp_path_factory, request):
  return _saved("mixed", tmp_path_factory, request)


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory, request):
  return _saved("fsdp", tmp_path_factory, request)


@pytest.fixture(scope="module")
def dp_run(tmp_path_factory, request):
  return _saved("dp", tmp_path_factory, request)


def clone(run, root: pathlib.Path, tmp_path: pathlib.Path, *, wipe=()) -> pathlib.Path:
  """Copies a saved run; nodes in `wipe` start with an empty folder (a replaced node)."""
  src_root, src_persistent, _ = run
  for node in range(NPROCS):
    dst = root / f"node{node}"
    if node in wipe:
      dst.mkdir(parents=True)
    else:
      shutil.copytree(src_root / f"node{node}", dst, symlinks=True)
  persistent = tmp_path / "persistent"
  shutil.copytree(src_persistent, persistent, symlinks=True)
  return persistent


def restore(run, root: pathlib.Path, persistent: pathlib.Path, *extra: str):
  result, out = run_job(["restore", "--persistent-dir", str(persistent), *SAVE_ARGS,
                         *LAYOUTS[run[2]], *extra], root)
  assert_ok(result, out)
  return out


# ----------------------------------------------------------------------------- the saved runs


@pytest.mark.parametrize("layout", ["mixed", "fsdp"])
def test_every_node_holds_a_verified_copy_for_its_peer(layout, mixed_run, fsdp_run):
  run = {"mixed": mixed_run, "fsdp": fsdp_run}[layout]
  root, persistent = run[0], run[1]
  assert sorted(int(p.name) for p in persistent.iterdir() if p.name.isdigit()) == [0]
  # Default peers: mixed -> the twin in the other replica; fsdp -> the next node (ring).
  holder_of = {"mixed": {0: 2, 1: 3, 2: 0, 3: 1}, "fsdp": {0: 1, 1: 2, 2: 3, 3: 0}}[layout]
  for source, holder in holder_of.items():
    assert committed_steps(root / f"node{holder}") == [8, 10]
    copies = peer_store.PeerStore(root / f"node{holder}", max_to_keep=None).copies()
    assert copies == [(source, 8), (source, 10)]  # same retention as the own folder
    for step in (8, 10):
      verify_copy(root, holder, source, step)


def test_twin_copies_skip_identical_shards(mixed_run, dp_run):
  # mixed: opt/mu, params/b and the scalars are identical on twins: not sent, read from the
  # holder's own folder; params/w and idx differ: sent.
  meta = peer_store.PeerStore(mixed_run[0] / "node2", max_to_keep=None).meta(0, 10)
  manifest = read_manifest(copy_dir(mixed_run[0], 2, 0, 10))
  sent = {leaf.path for (_, leaf, _), at in
          zip(manifest_entries(manifest), meta.layout, strict=True) if at >= 0}
  assert sent == {"['params']['w']", "['idx']"}
  # dp: every shard is identical on twins; the copy is a header only.
  meta = peer_store.PeerStore(dp_run[0] / "node2", max_to_keep=None).meta(0, 10)
  assert meta.layout and all(at < 0 for at in meta.layout)
  raw = (copy_dir(dp_run[0], 2, 0, 10) / DATA).read_bytes()
  header_bytes = peer_store.LEN_PREFIX.size + peer_store.LEN_PREFIX.unpack(raw[:8])[0]
  assert len(raw) == -(-header_bytes // 64) * 64  # no shard bytes after the header


# ----------------------------------------------------------------------------- node loss


def test_lost_node_recovers_from_ram_at_newest_step(mixed_run, shm_root, tmp_path):
  persistent = clone(mixed_run, shm_root, tmp_path, wipe=(1,))
  out = restore(mixed_run, shm_root, persistent)
  assert restored(out) == expect(10, peer_nodes=(1,))
  # The replaced node holds the step again, and the copies that involve it were re-sent.
  assert committed_steps(shm_root / "node1") == [10]
  verify_step(shm_root / "node1" / "10")
  verify_copy(shm_root, 1, 3, 10)  # node 1 again holds node 3's copy
  verify_copy(shm_root, 3, 1, 10)  # and node 3 a copy of node 1's rewritten step


def test_lost_node_restores_a_cast_target_from_its_peer(mixed_run, shm_root, tmp_path):
  """Issue 44: a target of another dtype (float32 leaves asked for as bfloat16) is cast from
  a twin's folder or a peer's copy too, as Orbax casts; a cast restore writes nothing back."""
  persistent = clone(mixed_run, shm_root, tmp_path, wipe=(1,))
  out = restore(mixed_run, shm_root, persistent, "--cast-to", "bfloat16")
  assert restored(out) == expect(10, peer_nodes=(1,))
  assert committed_steps(shm_root / "node1") == []


def test_whole_replica_lost_recovers_from_the_other_replica(mixed_run, shm_root, tmp_path):
  persistent = clone(mixed_run, shm_root, tmp_path, wipe=(0, 1))
  out = restore(mixed_run, shm_root, persistent)
  assert restored(out) == expect(10, peer_nodes=(0, 1))
  for node in (0, 1):
    verify_step(shm_root / f"node{node}" / "10")


@pytest.mark.parametrize("lost", [0, 3])
def test_single_replica_fsdp_any_lost_node_recovers(lost, fsdp_run, shm_root, tmp_path):
  persistent = clone(fsdp_run, shm_root, tmp_path, wipe=(lost,))
  out = restore(fsdp_run, shm_root, persistent)
  assert restored(out) == expect(10, peer_nodes=(lost,))
  verify_step(shm_root / f"node{lost}" / "10")


def test_pure_data_parallel_node_is_rebuilt_from_its_twin(dp_run, shm_root, tmp_path):
  persistent = clone(dp_run, shm_root, tmp_path, wipe=(2,))
  out = restore(dp_run, shm_root, persistent)
  assert restored(out) == expect(10, peer_nodes=(2,))
  verify_step(shm_root / "node2" / "10")


def test_node_and_its_only_peer_lost_falls_back_to_persistent(fsdp_run, shm_root, tmp_path):
  # Node 1's copies live on node 2 only: with both gone, no RAM step is complete.
  persistent = clone(fsdp_run, shm_root, tmp_path, wipe=(1, 2))
  out = restore(fsdp_run, shm_root, persistent)
  assert restored(out) == expect(0, tier_others="persistent")


def test_corrupt_peer_copy_is_skipped_for_an_older_complete_step(fsdp_run, shm_root, tmp_path):
  persistent = clone(fsdp_run, shm_root, tmp_path, wipe=(1,))
  meta = peer_store.PeerStore(shm_root / "node2", max_to_keep=None).meta(1, 10)
  data = copy_dir(shm_root, 2, 1, 10) / DATA
  raw = bytearray(data.read_bytes())
  raw[max(meta.layout)] ^= 0x40  # first byte of the last shard sent
  data.write_bytes(bytes(raw))
  out = restore(fsdp_run, shm_root, persistent)
  # Step 10 cannot be assembled without node 1's bad copy; step 8 can, from RAM.
  assert restored(out) == expect(8, peer_nodes=(1,))
  assert "checksum mismatch" in out.text()


def test_without_peers_a_lost_node_means_persistent(mixed_run, shm_root, tmp_path):
  persistent = clone(mixed_run, shm_root, tmp_path, wipe=(1,))
  out = restore(mixed_run, shm_root, persistent, "--peers-per-node", "0")
  assert restored(out) == expect(0, tier_others="persistent")


def test_incomplete_copy_is_never_committed(tmp_path):
  """A transfer cut short (the peer died mid-stream, a chunk failed) leaves a copy without
  its last bytes: commit must refuse it even though its header parses, and abort removes it."""
  store = peer_store.PeerStore(tmp_path, max_to_keep=None)
  incoming = store.begin(1, 3, 1 << 20)
  incoming.write(0, np.zeros(1 << 19, np.uint8))  # half of the stream arrived
  assert incoming.commit(None) is None
  assert store.copies() == []
  dropped = store.begin(1, 4, 1 << 20)
  dropped.write(0, np.zeros(1 << 19, np.uint8))
  dropped.abort()
  assert store.copies() == [] and not dropped.tmp.exists()
