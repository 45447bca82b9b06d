"""The parent-style form (Orbax's own manager with a RAM tier) over the RAM folders of an
earlier run: a new run (a fresh persistent folder, another state) restores nothing and saves
step numbers the old run's RAM steps and peer copies still hold. Nothing of the old run may
ever be restored into the new one. Real 2-process jobs (`mp_worker parent-resume`, no data
replicas: each node's copy is on the next node)."""

from __future__ import annotations

import shutil

import pytest
from mp_helpers import assert_ok, assert_results, run_job, tail

pytestmark = pytest.mark.timeout(300)

ARGS = ["--replicas", "1", "--rows", "64"]


def test_a_step_the_old_run_holds_in_ram_is_written_again(shm_root, tmp_path):
  """Run A (seed 1) left RAM steps 5 and 6. Run B (seed 2) starts at step 5 and saves it:
  the RAM tier kept run A's step 5 (a step number it held already was not written again),
  so B's restore of its step 5 came back with A's state."""
  old, new = tmp_path / "a", tmp_path / "b"
  result, out = run_job(["parent-resume", "--steps", "7", "--seed", "1",
                         "--persistent-dir", str(old), *ARGS], 2, shm_root)
  assert_ok(result, out)
  assert [sorted(p.name for p in (shm_root / f"node{n}").glob("[0-9]*")) for n in (0, 1)] \
      == [["5", "6"], ["5", "6"]]
  result, out = run_job(["parent-resume", "--steps", "6", "--seed", "2", "--start", "5",
                         "--persistent-dir", str(new), *ARGS], 2, shm_root)
  assert_ok(result, out)
  result, out = run_job(["parent-resume", "--steps", "6", "--seed", "2", "--persistent-dir",
                         str(new), *ARGS], 2, shm_root)
  assert_ok(result, out)
  assert_results(out, 2, step=5, tier="local")


def test_a_parent_style_save_over_a_leftover_drops_its_old_peer_copy(shm_root, tmp_path):
  """Run A (seed 1) saved steps 0-6 with peer copies (no replicas: node 1 holds node 0's).
  Run B (seed 2, a new persistent folder: nothing restored) saves 0-6 and is killed once
  step 6 is committed, before its copies start (at the next save). Node 0 is replaced: the
  restore of B's step 6 must not take node 0's shards from node 1's copy of run A's step 6
  (it did, beside node 1's own shards of run B's: a state of two timelines, every checksum
  valid)."""
  old, new = tmp_path / "a", tmp_path / "b"
  result, out = run_job(["parent-resume", "--steps", "7", "--seed", "1",
                         "--persistent-dir", str(old), *ARGS], 2, shm_root)
  assert_ok(result, out)
  assert (shm_root / "node1" / "peers" / "0" / "6" / "manifest.json").is_file()
  crash, out = run_job(["parent-resume", "--steps", "8", "--seed", "2", "--die-after", "6",
                        "--persistent-dir", str(new), *ARGS], 2, shm_root)
  assert crash.returncodes == [137, 137], (crash, tail(out))
  shutil.rmtree(shm_root / "node0")
  result, out = run_job(["parent-resume", "--steps", "7", "--seed", "2", "--persistent-dir",
                         str(new), *ARGS], 2, shm_root)
  assert_ok(result, out)
  assert_results(out, 2, step=6, tier="persistent")
