"""The real MaxText 0.2.5, trained on CPU, with its checkpointing on orbax-mtc.

MaxText needs Python >= 3.12: it runs in the venv `maxtext_env.py` builds once and caches
(`tests/requirements-maxtext.txt`), with this checkout first on PYTHONPATH. Without a Python
3.12 the module is skipped, saying so. Each run trains MaxText's own decoder, tiny (2 layers,
width 128, vocabulary 256, sequence 128), on synthetic data, one CPU device per process;
every assertion reads MaxText's own log lines ("completed step: N ... loss: X", "restoring from
this run's directory step N") and the files it leaves. Losses are compared as MaxText prints
them against one run with MaxText's own checkpointing, step for step. The grain case trains on
an ArrayRecord file of pre-tokenized records the module writes, against a grain run of its own.
"""

from __future__ import annotations

import shutil
import signal

import pytest
from maxtext_real_support import (
  BASELINE_STEPS,
  _check_plain_orbax_reads,
  _committed_ram_steps,
  _emergency,
  _finished,
  _persistent_steps,
  _same_losses,
  _tmp_leftovers,
  train,
)

pytestmark = pytest.mark.timeout(600)


def test_ram_tier_resume_wipe_and_plain_orbax(runs, venv_python, base_yml, baseline, run_dirs):
  """RAM steps and backups as MaxText's emergency manager lays them out; a restart resumes
  from RAM; with the RAM disk wiped, from the persistent tier; plain Orbax reads a backup."""
  out, local = run_dirs
  schedule = ["local_checkpoint_period=2", "checkpoint_period=3"]
  first = _finished(train(runs, venv_python, base_yml, out, "steps=7",
                          *_emergency(local, *schedule)))
  _same_losses(first, baseline, range(7))
  assert first.restored_step() is None
  assert _committed_ram_steps(local) == [6]  # every 2 steps, keeping the newest
  assert _persistent_steps(out) == [0, 3, 6], "\n".join(
      line for line in first.lines if "orbax-mtc" in line)[-6000:]
  _check_plain_orbax_reads(out / "t" / "checkpoints", 6, local)

  resumed = _finished(train(runs, venv_python, base_yml, out, "steps=10",
                            *_emergency(local, *schedule)))
  assert resumed.restored_step() == 6 and resumed.tiers() == {6: "local"}, resumed.tail()
  _same_losses(resumed, baseline, range(7, 10))
  assert _persistent_steps(out) == [0, 3, 6, 9]

  shutil.rmtree(local)  # the host's RAM disk is gone (a new VM)
  wiped = _finished(train(runs, venv_python, base_yml, out, "steps=12",
                          *_emergency(local, *schedule)))
  assert wiped.restored_step() == 9 and wiped.tiers() == {9: "persistent"}, wiped.tail()
  _same_losses(wiped, baseline, range(10, 12))
  assert _tmp_leftovers(out) == []


def test_kill_9_mid_run_resumes_from_the_newest_ram_step(runs, venv_python, base_yml, baseline,
                                                          run_dirs):
  out, local = run_dirs
  schedule = _emergency(local, "local_checkpoint_period=2", "checkpoint_period=1000")
  doomed = train(runs, venv_python, base_yml, out, "steps=1000", *schedule)
  doomed.wait_for(r"completed step: 8,")
  doomed.kill(signal.SIGKILL)
  assert doomed.finish() == -signal.SIGKILL
  newest = _committed_ram_steps(local)[-1]
  # Step 6 was committed before step 8 was saved; 8's write may have been cut short.
  assert 6 <= newest < BASELINE_STEPS - 3, newest
  resumed = _finished(train(runs, venv_python, base_yml, out, f"steps={newest + 3}", *schedule))
  assert resumed.restored_step() == newest and resumed.tiers() == {newest: "local"}
  _same_losses(resumed, baseline, range(newest + 1, newest + 3))


def test_sigterm_saves_on_demand_ends_with_the_preemption_status_and_resumes_there(
    runs, venv_python, base_yml, baseline, run_dirs):
  out, local = run_dirs
  schedule = _emergency(local, "local_checkpoint_period=1000", "checkpoint_period=1000",
                        "enable_autocheckpoint=true", "save_checkpoint_on_start=false")
  # MaxText ends with 0 here; configs/tpu-vm's restart loop asks for 75 to restart the job.
  job = train(runs, venv_python, base_yml, out, "steps=1000", "mtc_preemption_exit_code=75",
              *schedule)
  job.wait_for(r"completed step: 5,")
  job.kill(signal.SIGTERM)
  assert job.finish() == 75, job.tail()
  job.wait_for(r"Training stopped: Job received termination signal")
  saved = _committed_ram_steps(local)
  assert len(saved) == 1 and 5 <= saved[0] < BASELINE_STEPS - 3, saved  # the on-demand step
  assert _persistent_steps(out) == saved  # within the grace budget, backed up too
  on_demand = saved[0]
  resumed = _finished(train(runs, venv_python, base_yml, out, f"steps={on_demand + 3}",
                            *schedule))
  assert resumed.restored_step() == on_demand and resumed.tiers() == {on_demand: "local"}
  _same_losses(resumed, baseline, range(on_demand + 1, on_demand + 3))
