"""The real MaxText 0.2.5 on orbax-mtc: switching managers, load_parameters_path, failed saves, two processes, the grain iterator."""

from __future__ import annotations

import re
import shutil
import signal

import pytest
from maxtext_real_support import (
  _TIER,
  MAXTEXT_TRAIN,
  MODEL,
  PATCHED_TRAIN,
  RUN_TIMEOUT_S,
  _committed_ram_steps,
  _emergency,
  _env,
  _finished,
  _iterator_file,
  _persistent_steps,
  _same_losses,
  _tmp_leftovers,
  train,
)

pytestmark = pytest.mark.timeout(600)


def test_switch_between_maxtexts_own_emergency_manager_and_orbax_mtc(runs, venv_python,
                                                                     base_yml, baseline, run_dirs):
  """Same output and local directories: MaxText's own emergency manager, then orbax-mtc, then
  MaxText's own again; each resumes from the newest step, with the losses of one run."""
  out, local = run_dirs
  schedule = _emergency(local, "local_checkpoint_period=2", "checkpoint_period=3")
  own = _finished(train(runs, venv_python, base_yml, out, "steps=4", *schedule,
                        module=MAXTEXT_TRAIN))
  _same_losses(own, baseline, range(4))
  ours = _finished(train(runs, venv_python, base_yml, out, "steps=7", *schedule))
  assert ours.restored_step() == 3 and ours.tiers() == {3: "persistent"}, ours.tail()
  _same_losses(ours, baseline, range(4, 7))
  back = _finished(train(runs, venv_python, base_yml, out, "steps=10", *schedule,
                         module=MAXTEXT_TRAIN))
  assert back.restored_step() == 6, back.tail()
  _same_losses(back, baseline, range(7, 10))


def test_load_parameters_path_reads_an_orbax_mtc_backup(runs, venv_python, base_yml, baseline,
                                                        run_dirs, tmp_path):
  out, local = run_dirs
  _finished(train(runs, venv_python, base_yml, out, "steps=4",
                  *_emergency(local, "local_checkpoint_period=2", "checkpoint_period=3")))
  warm = _finished(train(runs, venv_python, base_yml, tmp_path / "warm", "steps=1",
                         f"load_parameters_path={out / 't' / 'checkpoints' / '3' / 'state'}"))
  # Step 3's weights with a fresh optimizer: the first loss is the one after step 3.
  assert warm.losses() == {0: baseline[4]}, warm.tail()


def test_a_failed_save_fails_the_job(runs, venv_python, base_yml, run_dirs):
  out, local = run_dirs
  # Every RAM save is a backup too: the failing save leaves one in flight.
  job = train(runs, venv_python, base_yml, out, "steps=1000",
              *_emergency(local, "local_checkpoint_period=2", "checkpoint_period=2"))
  job.wait_for(r"completed step: 3,")
  # Moved away in one rename (deleting it would race the writer still filling it), and a
  # file put in its place: the RAM disk can no longer take a step.
  local.rename(local.with_name(local.name + ".gone"))
  local.write_text("not a folder any more\n")
  status = job.finish()
  assert status not in (0, -signal.SIGKILL), job.tail()
  job.wait_for(r"RuntimeError: Checkpointing failed\. .*" + re.escape(str(local)))
  assert _tmp_leftovers(out) == []  # the backup in flight was finished, not abandoned


def test_two_processes_under_orbax_mtc_launch_node_restores_from_its_peer(
    runs, venv_python, base_yml, baseline, run_dirs):
  out, local = run_dirs
  node = f"{local}/node{{process_index}}"
  schedule = ["enable_emergency_checkpoint=true", f"local_checkpoint_directory={node}",
              "local_checkpoint_period=2", "checkpoint_period=1000"]
  launch = [venv_python, "-m", "orbax_mtc", "launch", "--nprocs", "2",
            "--devices-per-process", "1", "--local-root", str(local / "launcher"),
            "--timeout", str(RUN_TIMEOUT_S), "--", venv_python, "-m", PATCHED_TRAIN]
  args = [base_yml, f"base_output_directory={out}", *MODEL]
  first = runs([*launch, *args, "steps=5", *schedule], _env(), exact=False)
  assert first.finish() == 0, first.tail()
  # Newest first; the step every node held at that save stays too (the agreed floor).
  assert _committed_ram_steps(local / "node0")[-1] == _committed_ram_steps(local / "node1")[-1] \
      == 4
  shutil.rmtree(local / "node1")  # node 1 is replaced: its RAM disk is empty
  second = runs([*launch, *args, "steps=7", *schedule], _env(), exact=False)
  assert second.finish() == 0, second.tail()
  tiers = [m.groups() for m in map(_TIER.search, second.lines) if m]
  assert sorted(tiers) == [("4", "local"), ("4", "peer")], second.tail()
  assert second.wait_for(r"\[node 1\].*restoring from this run's directory step 4")
  assert _committed_ram_steps(local / "node1")[-1] == 6


def test_grain_iterator_resumes_where_it_was_from_ram_and_persistent(
    runs, venv_python, base_yml, grain_model, grain_baseline, run_dirs):
  """dataset_type=grain: every step holds the iterator as MaxText's item `iter` (RAM entry,
  Grain's file in the backup); a restart from RAM, then from the persistent tier with the RAM
  disk wiped, trains on the batches an uninterrupted run reads next, not the first ones."""
  from orbax_mtc.local.store import read_manifest

  out, local = run_dirs
  schedule = _emergency(local, "local_checkpoint_period=2", "checkpoint_period=3")
  first = _finished(train(runs, venv_python, base_yml, out, "steps=5", *schedule,
                          model=grain_model))
  assert first.restored_step() is None
  _same_losses(first, grain_baseline, range(5))
  assert _committed_ram_steps(local) == [4]
  manifest = read_manifest(local / "4")
  assert set(manifest.items) == {"state", "iter"}, sorted(manifest.items)
  assert manifest.items["iter"].kind == "process"
  assert _persistent_steps(out) == [0, 3]
  # Batches 0..3 read at step 3: Grain's own state, as its Orbax handler writes it.
  assert _iterator_file(out, 3) == {"next_index": 4}

  resumed = _finished(train(runs, venv_python, base_yml, out, "steps=8", *schedule,
                            model=grain_model))
  assert resumed.restored_step() == 4 and resumed.tiers() == {4: "local"}, resumed.tail()
  _same_losses(resumed, grain_baseline, range(5, 8))  # batches 5, 6, 7: not 0, 1, 2
  assert _persistent_steps(out) == [0, 3, 6, 7]

  shutil.rmtree(local)  # a new VM: the iterator comes back from Grain's file of step 7
  wiped = _finished(train(runs, venv_python, base_yml, out, "steps=10", *schedule,
                          model=grain_model))
  assert wiped.restored_step() == 7 and wiped.tiers() == {7: "persistent"}, wiped.tail()
  _same_losses(wiped, grain_baseline, range(8, 10))
  assert "holds no data iterator position" not in wiped.text()
  assert _tmp_leftovers(out) == []
