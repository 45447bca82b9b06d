"""A randomized fault campaign on restore: single faults on fresh multi-process jobs.

One job of 2 real JAX processes (mesh data=2 x model=2: each process holds a whole replica,
its twin the other) saves steps 0..9 to RAM every step (3 kept) and to the persistent tier
every 4 steps, so the newest step, 9, is in RAM only. Each round starts from a fresh copy of
its RAM folders, applies one fault drawn at random, restarts, and then restarts once more:
both restarts must restore step 9 on every process, bit for bit (the worker compares each
process's shards with the state recomputed for that step), `latest_step()` must name
it before and after (so Orbax's resume by number finds the same step), and no process may be left
waiting (every job has a bounded timeout). Faults: a wiped node, a flipped byte, a truncated
data file, a removed or garbled manifest, the two nodes' folders swapped (process ids
permuted), a restart on another mesh (data=1 x model=4), a kill -9 during the restore, and an
exit the instant restore() returns (before its write-back).

ORBAX_MTC_CAMPAIGN_ROUNDS (default 10; every fault at least once when >= the number of
faults) and ORBAX_MTC_CAMPAIGN_SEED choose the rounds; a failure names its seed and round.
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import shutil

import mp_helpers
import pytest
from mp_helpers import assert_ok, mp_events, new_root, tail

from orbax_mtc.local.format import DATA, MANIFEST

ROUNDS = int(os.environ.get("ORBAX_MTC_CAMPAIGN_ROUNDS", "10"))
SEED = int(os.environ.get("ORBAX_MTC_CAMPAIGN_SEED", "39"))
NEWEST = 9
TIMEOUT_S = 120
pytestmark = pytest.mark.timeout(60 + ROUNDS * 90)

SAVE = ["--local-interval", "1", "--local-keep", "3", "--persistent-interval", "4",
        "--shape-axes", "2,2", "--explicit-args"]
TWO_REPLICAS = ["--replicas", "2"]
ONE_REPLICA = ["--replicas", "1"]  # the other mesh: data=1 x model=4

FAULTS = ("wipe", "flip", "truncate", "no-manifest", "garbled-manifest", "swap", "mesh",
          "kill-during-restore", "exit-after-restore")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  root = new_root("campaign-saved")
  persistent = tmp_path_factory.mktemp("campaign") / "ckpt"
  result, out = mp_helpers.run_job(["save", "--steps", str(NEWEST + 1), "--persistent-dir",
                                    str(persistent), *TWO_REPLICAS, *SAVE], 2, root,
                                   timeout_s=TIMEOUT_S)
  try:
    assert_ok(result, out)
    yield root, persistent
  finally:
    shutil.rmtree(root, ignore_errors=True)


def _rounds() -> list[str]:
  rng = random.Random(SEED)
  picks = list(FAULTS) if ROUNDS >= len(FAULTS) else []
  picks += [rng.choice(FAULTS) for _ in range(ROUNDS - len(picks))]
  rng.shuffle(picks)
  return picks


def _step_folder(root: pathlib.Path, node: int) -> pathlib.Path:
  return root / f"node{node}" / str(NEWEST)


def _apply(fault: str, root: pathlib.Path, rng: random.Random) -> None:
  """One file-level fault on a random node (the process faults are applied by the job)."""
  node = rng.randrange(2)
  folder = _step_folder(root, node)
  if fault == "wipe":
    shutil.rmtree(root / f"node{node}")
  elif fault == "flip":
    manifest = json.loads((folder / MANIFEST).read_text())
    shards = [s for leaf in manifest["items"]["state"]["leaves"] for s in leaf["shards"]
              if s[2]]
    index, offset, length = rng.choice(shards)[:3]
    raw = bytearray((folder / DATA).read_bytes())
    raw[offset + rng.randrange(length)] ^= 1 << rng.randrange(8)
    (folder / DATA).write_bytes(bytes(raw))
  elif fault == "truncate":
    size = (folder / DATA).stat().st_size
    os.truncate(folder / DATA, rng.randrange(size))
  elif fault == "no-manifest":
    (folder / MANIFEST).unlink()
  elif fault == "garbled-manifest":
    text = (folder / MANIFEST).read_text()
    at = rng.randrange(len(text))
    (folder / MANIFEST).write_text(text[:at] + "\x00garbled" + text[at + 1:])
  elif fault == "swap":
    (root / "node0").rename(root / "node-swap")
    (root / "node1").rename(root / "node0")
    (root / "node-swap").rename(root / "node1")


def _restored(out) -> dict[int, dict[str, str]]:
  return mp_events.parse_results(out.lines)


def _restart(root: pathlib.Path, persistent: pathlib.Path, mesh: list[str], label: str) -> None:
  """restore(None) on every process: step NEWEST, bit for bit, from RAM, with no hang."""
  result, out = mp_helpers.run_job(["restore", "--persistent-dir", str(persistent), *mesh,
                                    *SAVE], 2, root, timeout_s=TIMEOUT_S)
  assert not result.timed_out, f"{label}: a process was left waiting\n{tail(out)}"
  assert_ok(result, out)
  got = _restored(out)
  assert sorted(got) == [0, 1], f"{label}\n{tail(out)}"
  for node, fields in got.items():
    assert (fields["step"], fields["ok"]) == (str(NEWEST), "1"), (
        f"{label}: node {node} restored step {fields['step']} from {fields['tier']} "
        f"(ok={fields['ok']}: {fields['detail']})\n{tail(out)}")
    assert fields["tier"] != "persistent", f"{label}: node {node}\n{tail(out)}"
    assert (fields["listed"], fields["after"]) == (str(NEWEST),) * 2, (
        f"{label}: node {node}: latest_step() was {fields['listed']} before the restore, "
        f"{fields['after']} after\n{tail(out)}")


def test_every_restart_restores_the_newest_step_bit_exact_after_any_single_fault(
    saved, tmp_path):
  saved_root, saved_persistent = saved
  held = 0
  plan = _rounds()
  for number, fault in enumerate(plan):
    label = f"seed {SEED} round {number} fault {fault}"
    rng = random.Random(SEED * 1000 + number)
    root = new_root(f"campaign-{number}")
    persistent = tmp_path / f"persistent-{number}"
    try:
      for node in range(2):
        shutil.copytree(saved_root / f"node{node}", root / f"node{node}", symlinks=True)
      shutil.copytree(saved_persistent, persistent, symlinks=True)
      mesh = ONE_REPLICA if fault == "mesh" else TWO_REPLICAS
      _apply(fault, root, rng)
      if fault in ("kill-during-restore", "exit-after-restore"):
        command = ["restore-exit"] if fault == "exit-after-restore" else [
            "restore-die", "--die-process", str(rng.randrange(2))]
        if fault == "exit-after-restore":
          mesh = ONE_REPLICA  # an elastic restore: its write-back is what the exit cuts
        result, out = mp_helpers.run_job([*command, "--persistent-dir", str(persistent),
                                          *mesh, *SAVE], 2, root, timeout_s=TIMEOUT_S)
        assert not result.timed_out, f"{label}: a process was left waiting\n{tail(out)}"
      _restart(root, persistent, mesh, f"{label}, first restart")
      _restart(root, persistent, mesh, f"{label}, second restart")
      held += 1
    finally:
      shutil.rmtree(root, ignore_errors=True)
  assert held == len(plan)
  print(f"campaign: {len(plan)} rounds, {len(set(plan))} kinds of fault, {held} held")
