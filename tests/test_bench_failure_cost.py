"""`orbax-mtc bench failure-cost`: the plan and the arithmetic (pure), and a small real run.

The real run checks that every planned failure was injected and recovered from, for all three
systems, and that the outputs are well formed; it asserts nothing about speed.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import uuid

import pytest

from orbax_mtc.tools.bench import failure_cost as fc
from orbax_mtc.tools.bench import goodput

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_plan_is_seeded_ordered_and_in_range():
  a = fc.make_plan(3, 600, 4)
  assert a == fc.make_plan(3, 600, 4) and a != fc.make_plan(4, 600, 4)
  assert [f.kind for f in a] == list(fc.KINDS)
  for f in a:
    assert 0 <= f.node < 4 and f.at_step == -1 and f.injected_at is None
    assert (5 <= f.offset < 25) if f.kind == "sigterm" else (1 <= f.offset < 600)
  # A subset keeps the same draws as the full plan.
  sub = fc.make_plan(3, 600, 4, ["wipe", "sigterm"])
  assert sub == [f for f in a if f.kind in ("wipe", "sigterm")]


def test_target_step_lands_past_a_ram_save():
  kill = fc.PlannedFailure(kind="sigkill", at_step=-1, node=0, offset=7)
  assert fc.target_step(kill, 0, 100) == 107  # past the first RAM save after step 0
  assert fc.target_step(kill, 100, 100) == 107
  assert fc.target_step(kill, 107, 100) == 207
  assert fc.target_step(kill, 150, 100) == 207
  term = fc.PlannedFailure(kind="sigterm", at_step=-1, node=0, offset=9)
  assert fc.target_step(term, 150, 100) == 159


def _step(run, step, t, compute=0.1):
  return {"event": "step", "run": run, "step": step, "t": t, "compute_s": compute,
          "save_s": 0.0}


def _start(run, restored, tier, t):
  return {"event": "start", "run": run, "t": t, "restored": restored, "tier": tier,
          "restore_s": 0.1}


def test_costs_give_seconds_lost_and_recovery():
  events = [_start(1, 0, "none", 0.0)] + [_step(1, s, s * 0.1) for s in range(1, 13)]
  events += [_start(2, 10, "local", 3.0)] + [_step(2, s, 3.0 + s * 0.1) for s in range(11, 14)]
  failure = goodput.Failure(kind="sigkill", at_step=12, node=1, injected_at=1.25, run=1)
  out = fc.costs(events, [failure])
  (f,) = out["failures"]
  assert f["steps_lost"] == 2 and f["restored_tier"] == "local"
  assert f["work_lost_s"] == pytest.approx(0.2)
  assert f["recovery_s"] == pytest.approx(4.1 - 1.25)


def _result(lost, back, tier):
  return {"failures": [{"kind": "sigkill", "work_lost_s": lost, "recovery_s": back,
                        "steps_lost": int(lost * 10), "restored_tier": tier}]}


def test_across_seeds_and_markdown():
  runs = [{"seed": s, "mtc": _result(m, 2.0 + s, "local"), "orbax": _result(o, 3.0, "persistent")}
          for s, m, o in [(0, 1.0, 90.0), (1, 3.0, 80.0), (2, 2.0, 100.0)]]
  summary = fc.across_seeds(runs, ["mtc", "orbax"], ["sigkill"])
  cell = summary["sigkill"]["mtc"]
  assert cell["work_lost_s"] == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
  assert cell["recovery_s"]["median"] == 3.0 and cell["tiers"] == ["local"]
  meta = {"procs": 4, "mib": 16, "step_s": 0.1, "ram_steps": 600, "ram_seconds": 60.0,
          "persistent_steps": 10_000, "seeds": [0, 1, 2]}
  table = fc.markdown(summary, meta, ["mtc", "orbax"], ["sigkill"])
  assert "| one process SIGKILLed | 2.0 (1.0-3.0) | 3.0 (2.0-4.0) | 90.0 (80.0-100.0) * | 3.0 |" \
      in table
  assert "500 s (computed, not measured)" in table


@pytest.mark.timeout(500)
def test_failure_cost_smoke_run(tmp_path):
  shm = pathlib.Path("/dev/shm")
  base = shm if shm.is_dir() and os.access(shm, os.W_OK) else tmp_path
  scratch = base / f"orbax-mtc-failure-cost-test-{uuid.uuid4().hex[:8]}"
  out = tmp_path / "out"
  env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
  done = subprocess.run(
      [sys.executable, "-m", "orbax_mtc", "bench", "failure-cost", "--procs", "2", "--mib", "1",
       "--min-step-ms", "40", "--ram-seconds", "0.8", "--calibration-steps", "10",
       "--after-steps", "2", "--seeds", "0", "--kinds", "wipe", "sigterm",
       "--out", str(out), "--scratch", str(scratch), "--json"],
      env=env, capture_output=True, text=True, timeout=480, start_new_session=True)
  assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
  assert not scratch.exists()
  raw = json.loads((out / "failure-cost.json").read_text())
  # --json: stdout is that document and nothing else; the progress lines went to stderr.
  assert json.loads(done.stdout) == raw and raw["schema"] == "orbax-mtc/bench-failure-cost/1"
  assert "== seed 0, mtc" in done.stderr
  table = (out / "failure-cost.md").read_text()
  assert "| one node's RAM lost |" in table and "| SIGTERM (maintenance) |" in table
  assert raw["environment"]["jax"] and raw["meta"]["ram_steps"] >= 2
  (run,) = raw["runs"]
  for system in fc.SYSTEMS:
    result = run[system]
    assert result["runs"] == 3  # two failures, a restart after each
    assert [f["kind"] for f in result["failures"]] == ["wipe", "sigterm"]
    for failure in result["failures"]:
      assert failure["restored_step"] is not None and failure["steps_lost"] >= 0
      assert failure["recovery_s"] > 0 and failure["work_lost_s"] >= 0
    assert result["failures"][1]["steps_lost"] == 0  # saved on demand
    assert all(p["injected_at"] is not None for p in result["plan"])
  # orbax-mtc gets the wiped node's step from its peer; plain Orbax from persistent storage.
  assert run["mtc"]["failures"][0]["restored_tier"] in ("local", "peer")
  assert run["orbax"]["failures"][0]["restored_tier"] == "persistent"
  assert set(raw["summary"]) == {"wipe", "sigterm"}


def test_a_restart_without_a_step_is_reported_as_hung():
  hung = {"failures": [{"kind": "wipe", "work_lost_s": 64.0, "recovery_s": None,
                        "steps_lost": 640, "restored_tier": "persistent", "hung": True}]}
  summary = fc.across_seeds([{"seed": 0, "emergency": hung}], ["emergency"], ["wipe"])
  assert summary["wipe"]["emergency"]["hung"] == 1
  meta = {"procs": 4, "mib": 16, "step_s": 0.1, "ram_steps": 600, "ram_seconds": 60.0,
          "persistent_steps": 10_000, "seeds": [0], "hang_seconds": 120.0}
  table = fc.markdown(summary, meta, ["emergency"], ["wipe"])
  assert "| one node's RAM lost | 64.0 * | no step (1 of 1) |" in table
  assert "within 120 s" in table
