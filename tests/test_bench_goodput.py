"""`orbax-mtc bench goodput`: the schedule and the arithmetic (pure), and a small real run.

The smoke run checks that the outputs exist and are well formed and that every scheduled
failure was injected and recovered from; it asserts nothing about speed.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import uuid

import pytest

from orbax_mtc.tools.bench import goodput

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_schedule_is_seeded_and_spread_over_the_run():
  a = goodput.make_schedule(7, 1000, 4)
  assert a == goodput.make_schedule(7, 1000, 4)
  assert a != goodput.make_schedule(8, 1000, 4)
  assert sorted(f.kind for f in a) == sorted(goodput.FAILURE_KINDS)
  steps = [f.at_step for f in a]
  assert steps == sorted(steps) and len(set(steps)) == len(steps)
  assert all(150 <= s < 600 for s in steps)
  assert all(0 <= f.node < 4 for f in a)


def _step(run, step, t, compute=0.1, save=0.0):
  return {"event": "step", "run": run, "step": step, "t": t, "compute_s": compute,
          "save_s": save}


def test_summarize_counts_recomputed_steps_and_losses():
  events = [{"event": "start", "run": 1, "t": 0.0, "restored": 0, "tier": "none",
             "restore_s": 0.0}]
  events += [_step(1, s, s * 0.1, save=0.5 if s % 2 == 0 else 0.0) for s in range(1, 6)]
  events += [{"event": "start", "run": 2, "t": 2.0, "restored": 4, "tier": "local",
              "restore_s": 0.25}]
  events += [_step(2, s, 2.0 + s * 0.1) for s in range(5, 9)]
  events += [{"event": "done", "run": 2, "t": 3.0, "step": 8, "wait_s": 0.5}]
  failure = goodput.Failure(kind="sigkill", at_step=5, node=1, injected_at=1.0, run=1)
  out = goodput.summarize(events, [failure], steps=8, wall_s=4.0)
  assert out["steps_executed"] == 9 and out["steps_recomputed"] == 1
  assert out["productive_s"] == pytest.approx(0.8)
  assert out["goodput"] == pytest.approx(0.2)
  assert out["saving_s"] == pytest.approx(1.0 + 0.5)
  assert out["restoring_s"] == pytest.approx(0.25)
  (lost,) = out["failures"]
  assert lost["steps_lost"] == 1 and lost["restored_tier"] == "local"
  assert lost["recovery_s"] == pytest.approx(2.5 - 1.0)


def test_across_seeds_gives_median_and_range():
  runs = [{"seed": s, "mtc": {"goodput": m}, "orbax": {"goodput": o}}
          for s, m, o in [(0, 0.96, 0.80), (1, 0.94, 0.50), (2, 0.90, 0.75)]]
  out = goodput.across_seeds(runs, ["mtc", "orbax"])
  assert out["seeds"] == [0, 1, 2]
  assert out["mtc"] == {"median": 0.94, "min": 0.90, "max": 0.96}
  assert out["ratio"]["median"] == pytest.approx(1.2)
  assert out["ratio"]["max"] == pytest.approx(1.88)


@pytest.mark.timeout(400)
def test_goodput_smoke_run(tmp_path):
  shm = pathlib.Path("/dev/shm")
  base = shm if shm.is_dir() and os.access(shm, os.W_OK) else tmp_path
  scratch = base / f"orbax-mtc-goodput-test-{uuid.uuid4().hex[:8]}"
  out = tmp_path / "out"
  env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
  done = subprocess.run(
      [sys.executable, "-m", "orbax_mtc", "bench", "goodput", "--steps", "100", "--work", "1",
       "--min-step-ms", "40", "--mib", "1", "--local-every", "5", "--persistent-every", "20",
       "--out", str(out),
       "--scratch", str(scratch), "--json"],
      env=env, capture_output=True, text=True, timeout=380, start_new_session=True)
  assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
  assert not scratch.exists()
  raw = json.loads((out / "goodput.json").read_text())
  # --json: stdout is that document and nothing else; the progress lines went to stderr.
  assert json.loads(done.stdout) == raw and raw["schema"] == "orbax-mtc/bench-goodput/1"
  assert "== seed 0, mtc" in done.stderr
  table = (out / "goodput.md").read_text()
  assert "| 0 | mtc |" in table and "| 0 | orbax |" in table and "median" in table
  assert raw["environment"]["jax"] and len(raw["runs"]) == 1
  run = raw["runs"][0]
  assert run["seed"] == 0 and len(run["schedule"]) == 3
  assert raw["summary"]["ratio"]["per_seed"] == [
      run["mtc"]["goodput"] / run["orbax"]["goodput"]]
  for system in ("mtc", "orbax"):
    result = run[system]
    assert 0 < result["goodput"] <= 1
    assert result["steps_executed"] >= 100 and result["runs"] == 4  # three failures, restarts
    assert {f["kind"] for f in result["failures"]} == set(goodput.FAILURE_KINDS)
    for failure in result["failures"]:
      assert failure["restored_step"] is not None and failure["steps_lost"] >= 0
  # orbax-mtc comes back from RAM (own folder or, for the wiped node, a peer's copy).
  tiers = {f["kind"]: f["restored_tier"] for f in run["mtc"]["failures"]}
  assert tiers["sigkill"] == "local" and tiers["wipe"] in ("local", "peer")
  assert tiers["sigterm"] == "local"
