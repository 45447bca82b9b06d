"""Managed mode against the replicator simulator (tests/replicator_sim.py), one simulator
process per node beside real `jax.distributed` job processes."""

from __future__ import annotations

import pathlib
import shlex
import shutil
import sys

import pytest
import yaml
from mp_helpers import (
  assert_ok,
  assert_private,
  assert_results,
  child_env,
  mp_events,
  run_job,
  started_job,
  tail,
)
from sim_nodes import SimNode, simulators

pytestmark = pytest.mark.timeout(300)

def _common(tmp_path, *more: str) -> list[str]:
  return ["--mode", "managed", "--persistent-dir", str(tmp_path / "persistent"),
          "--job-name", "mtcjob", "--local-interval", "2", "--persistent-interval", "4",
          *more]


def _entries(root: pathlib.Path) -> list[str]:
  return sorted(p.name for p in root.glob("node*/*")
                if p.name.endswith(".restore") or p.name.startswith("replicator."))


def test_fresh_start_copies_and_backups_then_restart_with_a_stale_yaml_restores(
    tmp_path, shm_root):
  backup = tmp_path / "backup"
  with simulators(shm_root, backup, 2) as sims:
    # The RAM tier keeps all 5 steps here: with the default 2, a step may be retired before a
    # simulator slowed by a busy host polls it (the protocol has no hold), and CI saw one so.
    result, out = run_job(["save", *_common(tmp_path), "--steps", "9", "--restore-first",
                           "--expect-tier", "none", "--local-keep", "5"], 2, shm_root,
                          timeout_s=120)
    assert_ok(result, out)
    assert_results(out, 2, step=None, tier="none")
    for rank, sim in enumerate(sims):
      (config,) = sim.events("CONFIG")
      # What the manager wrote, as the simulator read it: twins across the 2 replicas.
      assert config == {"job": "mtcjob", "rank": str(rank), "nodes": "2", "dp": "2",
                        "peers": f"[{1 - rank}]", "interval": "4"}, sim.text()
      assert sim.events("RESTORE") == [{"rank": str(rank), "step": "0", "source": "none"}]
      assert sim.wait_for("REPLICATED", 5), sim.text()  # steps 0, 2, 4, 6, 8
      assert [e["step"] for e in sim.events("REPLICATED")] == ["0", "2", "4", "6", "8"]
      assert [e["step"] for e in sim.events("BACKUP")] == ["0", "4", "8"]
      peer_copy = shm_root / f"node{1 - rank}" / ".replicator" / f"n{rank}" / "8"
      assert (peer_copy / "manifest.json").is_file()
    committed = dict(mp_events.events(out.lines, "COMMITTED"))
    # The manager made no backup and no peer copy of its own: the replicator does both.
    assert {n: c["persistent"] for n, c in committed.items()} == {0: "-", 1: "-"}
    assert not list(shm_root.glob("node*/peers*")), sorted(shm_root.glob("node*/*"))
    assert _entries(shm_root) == []  # entries taken, yaml taken, no LKG links of ours
    for rank, sim in enumerate(sims):  # what the manager wrote is private, the yaml too
      assert {e["mode"] for e in sim.events("YAML_MODE")} == {"600"}, sim.text()
      # (The volume itself and .replicator/ are the replicator's.)
      assert assert_private(shm_root / f"node{rank}", skip=(".replicator",),
                            include_root=False) > 5

    # Restart. The daemon of node 0 restarts too, and the previous run's replicator.yaml is
    # still in its volume: the job must wait for the daemon to take it, never overwrite it.
    sims[0].kill()
    stale = {"job-name": "stale-run", "framework": "orbax", "assume-data-parallelism": 2,
             "node-rank": 0, "nodes": 2, "peer-ranks": [1], "backup-interval-steps": 4}
    (shm_root / "node0" / "replicator.yaml").write_text(yaml.safe_dump(stale))
    with started_job(["restore", *_common(tmp_path), "--expect-step", "8", "--expect-tier",
                      "replicator"], 2, shm_root) as (job, out):
      assert sims[1].wait_for("CONFIG", 2), sims[1].text()  # node 1's job is at the handshake
      sims[0] = SimNode(shm_root, 0, backup)
      result = job.wait(120)
    assert_ok(result, out)
    assert_results(out, 2, step=8, tier="replicator")
    assert [c["job"] for c in sims[0].events("CONFIG")] == ["stale-run", "mtcjob"], \
        sims[0].text()
    assert sims[1].events("RESTORE")[-1] == {"rank": "1", "step": "8", "source": "own"}
    assert _entries(shm_root) == []


def test_node_replaced_restores_from_its_peer_copy_four_processes(tmp_path, shm_root):
  backup = tmp_path / "backup"
  common = _common(tmp_path, "--replicas", "2")
  with simulators(shm_root, backup, 4) as sims:
    result, out = run_job(["save", *common, "--steps", "9", "--local-keep", "5"], 4, shm_root,
                          devices=1, timeout_s=180)  # all 5 steps kept: see the test above
    assert_ok(result, out)
    peers = {int(s.events("CONFIG")[0]["rank"]): s.events("CONFIG")[0]["peers"] for s in sims}
    assert peers == {0: "[2]", 1: "[3]", 2: "[0]", 3: "[1]"}  # twins across 2 replicas
    for sim in sims:
      assert sim.wait_for("REPLICATED", 5), sim.text()

    # Node 1 is replaced: its daemon and its whole volume are gone; a new daemon starts.
    sims[1].kill()
    shutil.rmtree(shm_root / "node1")
    sims[1] = SimNode(shm_root, 1, backup)
    result, out = run_job(["restore", *common, "--expect-step", "8", "--expect-tier",
                           "replicator"], 4, shm_root, devices=1, timeout_s=180)
    assert_ok(result, out)
    assert_results(out, 4, step=8, tier="replicator")
    assert sims[1].events("RESTORE") == [{"rank": "1", "step": "8", "source": "peer"}]
    assert [s.events("RESTORE")[-1]["source"] for s in (sims[0], sims[2], sims[3])] == \
        ["own"] * 3
    assert (shm_root / "node1" / "8" / "manifest.json").is_file()


def test_replicator_errors_are_logged_and_removed(tmp_path, shm_root):
  backup = tmp_path / "backup"
  with simulators(shm_root, backup, 2, {0: ("--errors", "backup bucket quota low")}) as sims:
    result, out = run_job(["save", *_common(tmp_path), "--steps", "3"], 2, shm_root,
                          timeout_s=120)
    assert_ok(result, out)
    assert sims[0].events("CONFIG") and sims[1].events("CONFIG")
  node0 = [line for line in out.lines if line.startswith("[node 0]")]
  assert any("replicator reported errors" in line for line in node0), tail(out)
  assert any("backup bucket quota low" in line for line in node0), tail(out)
  assert not (shm_root / "node0" / "replicator.errors").exists()


def test_replicator_failed_stops_the_job_with_its_reason(tmp_path, shm_root):
  backup = tmp_path / "backup"
  with simulators(shm_root, backup, 2, {1: ("--fail", "job-name is taken")}) as sims:
    result, out = run_job(["save", *_common(tmp_path, "--managed-timeout", "30"), "--steps",
                           "3"], 2, shm_root, timeout_s=120)
    assert sims[1].events("FAILED"), sims[1].text()
  # Both processes stop (the other one learns of it at once, instead of hanging in the next
  # collective), each with a reason.
  assert all(code not in (0, None, 124) for code in result.returncodes), result
  assert not result.timed_out, result
  node0 = "\n".join(line for line in out.lines if line.startswith("[node 0]"))
  node1 = "\n".join(line for line in out.lines if line.startswith("[node 1]"))
  assert "replicator failed on this node" in node1 and "job-name is taken" in node1, tail(out)
  assert "handshake failed on process(es) [1]" in node0, tail(out)
  assert not (shm_root / "node1" / "replicator.failed").exists()


def test_jax_joins_from_jax_init_info_written_after_the_job_started(tmp_path, shm_root):
  """As on GKE: the processes wait for jax-init-info.txt, join the coordinator it names,
  then make the handshake through initialize_multi_tier_checkpointing."""
  backup = tmp_path / "backup"
  with simulators(shm_root, backup, 2) as sims:
    with started_job(["managed-init", *_common(tmp_path), "--steps", "5", "--expect-tier",
                      "none"], 2, shm_root) as (job, out):
      # GKE writes it once process 0's node is known. The coordinator must be the address
      # the launcher lets process 0 bind (JAX_COORDINATOR_BIND_ADDRESS).
      for rank in range(2):
        info = shm_root / f"node{rank}" / "jax-init-info.txt"
        info.write_text(f"{rank}\n{job.coordinator}\n")
      result = job.wait(120)
    assert_ok(result, out)
    inits = dict(mp_events.events(out.lines, "INIT"))
    assert {n: (f["coordinator"], f["entry"]) for n, f in inits.items()} == {
        0: (job.coordinator, "None"), 1: (job.coordinator, "None")}, tail(out)
    assert [len(sim.events("CONFIG")) for sim in sims] == [1, 1]  # one handshake each
    assert_results(out, 2, step=None, tier="none")


def _loop(persistent: pathlib.Path, steps: int) -> list[str]:
  # As on GKE, each host names its own mounted volume (here the launcher's per-process folder).
  return ["sh", "-c", f"exec {shlex.quote(sys.executable)} -m maxtext_patch.example_train "
          f"run_name=mtx base_output_directory={shlex.quote(str(persistent))} "
          "enable_multi_tier_checkpointing=true "
          'local_checkpoint_directory="$ORBAX_MTC_LOCAL_DIR" local_checkpoint_period=2 '
          "multi_tier_checkpointing_backup_interval_steps=4 ici_data_parallelism=2 "
          f"ici_fsdp_parallelism=-1 steps={steps}"]


def test_maxtext_enable_multi_tier_checkpointing_runs_managed(tmp_path, shm_root):
  """MaxText's key switches the MaxText-shaped loop to managed mode: the replicator gets the
  yaml, copies the RAM steps, and a restart resumes from its entry bit for bit."""
  from orbax_mtc.tools import launch

  def run(steps: int):
    out = mp_events.LineCollector()
    with launch.Job(_loop(tmp_path / "out", steps), 2, devices_per_process=2,
                    local_root=shm_root, env=child_env(), output=out) as job:
      job.start()
      result = job.wait(120)
    assert_ok(result, out)
    return out

  with simulators(shm_root, tmp_path / "backup", 2) as sims:
    first = run(7)
    assert [c["job"] for c in sims[0].events("CONFIG")] == ["mtx"]
    assert sims[0].events("CONFIG")[0]["peers"] == "[1]"  # twins across ici_data=2
    newest = max(int(s) for s in (local.name for local in (shm_root / "node0").iterdir())
                 if s.isdigit())
    digests = {(n, int(f["step"])): f["digest"] for n, f in mp_events.events(first.lines,
                                                                             "STEP")}
    second = run(newest + 3)
  restored = dict(mp_events.events(second.lines, "RESTORED"))
  assert {n: (f["step"], f["tier"]) for n, f in restored.items()} == {
      0: (str(newest), "replicator"), 1: (str(newest), "replicator")}, tail(second)
  for node in (0, 1):
    assert restored[node]["digest"] == digests[(node, newest)]


def test_nothing_to_restore_from_the_replicator_falls_back_to_the_persistent_tier(
    tmp_path, shm_root):
  """A standalone run left a standard Orbax checkpoint; the RAM disks are new and the
  replicator has nothing: the managed job restores the newest persistent step."""
  persistent = ["--persistent-dir", str(tmp_path / "persistent"), "--persistent-interval", "4"]
  result, out = run_job(["save", *persistent, "--steps", "9"], 2, shm_root)
  assert_ok(result, out)
  shutil.rmtree(shm_root)
  with simulators(shm_root, tmp_path / "backup", 2) as sims:
    result, out = run_job(["restore", *_common(tmp_path), "--expect-step", "8",
                           "--expect-tier", "persistent"], 2, shm_root, timeout_s=120)
    assert [s.events("RESTORE") for s in sims] == [
        [{"rank": "0", "step": "0", "source": "none"}],
        [{"rank": "1", "step": "0", "source": "none"}]]
  assert_ok(result, out)
  assert_results(out, 2, step=8, tier="persistent")


def test_a_restart_from_an_older_entry_drops_the_abandoned_newer_step(tmp_path, shm_root):
  """Node 0 committed step 5 and node 1 died before committing it: the replicator names step
  4, the newest step it can give every node. The job restores 4 and must save 5 again: node
  0's step 5 belongs to the timeline the job abandoned and must not stop that save (Orbax
  never replaces a step: it raised StepAlreadyExistsError, at every restart)."""
  backup = tmp_path / "backup"
  common = [*_common(tmp_path), "--local-interval", "1", "--local-keep", "3"]
  with simulators(shm_root, backup, 2) as sims:
    crash, out = run_job(["save", *common, "--steps", "9", "--die-at-step", "5",
                          "--die-process", "1"], 2, shm_root, timeout_s=120)
    assert crash.returncodes[1] == 137, (crash, tail(out))
    assert max(int(p.name) for p in (shm_root / "node0").iterdir() if p.name.isdigit()) == 5
    assert max(int(p.name) for p in (shm_root / "node1").iterdir() if p.name.isdigit()) == 4
    result, out = run_job(["save", *common, "--restore-first", "--steps", "8",
                           "--expect-step", "4", "--expect-tier", "replicator"], 2, shm_root,
                          timeout_s=120)
    assert_ok(result, out)
    assert [s.events("RESTORE")[-1]["step"] for s in sims] == ["4", "4"]
  with simulators(shm_root, backup, 2):  # steps 5-7 saved again on both nodes
    result, out = run_job(["restore", *common, "--expect-step", "7",
                           "--expect-tier", "replicator"], 2, shm_root, timeout_s=120)
  assert_ok(result, out)
  assert_results(out, 2, step=7, tier="replicator")


@pytest.mark.parametrize("first", ["resume-by-number", "no-restore"])
def test_a_later_restore_never_goes_back_to_the_replicators_entry(first, tmp_path, shm_root):
  """The replicator names step 8. The job either resumes by `restore(latest_step())`
  (MaxText's idiom) or trains on without restoring, saves 9-11, then calls restore(None): it
  must restore 11. The entry stayed pending: restore(None) took the job back to step 8 and
  deleted 9-11, which it had saved since."""
  backup = tmp_path / "backup"
  common = [*_common(tmp_path), "--local-interval", "1", "--local-keep", "5"]
  with simulators(shm_root, backup, 2):
    result, out = run_job(["save", *common, "--steps", "9"], 2, shm_root, timeout_s=120)
    assert_ok(result, out)
  with simulators(shm_root, backup, 2) as sims:
    how = (["--restore-first", "--resume-latest", "--expect-step", "8"]
           if first == "resume-by-number" else ["--start", "9"])
    result, out = run_job(["save", *common, *how, "--steps", "12", "--restore-after"], 2,
                          shm_root, timeout_s=120)
    assert_ok(result, out)
    assert [s.events("RESTORE")[-1]["step"] for s in sims] == ["8", "8"]
  again = mp_events.events(out.lines, "AGAIN")
  assert sorted(n for n, _ in again) == [0, 1], tail(out)
  for _, fields in again:
    assert (fields["step"], fields["ok"]) == ("11", "1"), tail(out)
    assert fields["all"].split(",")[-3:] == ["9", "10", "11"], tail(out)



def test_a_step_0_every_node_holds_is_restored_though_no_entry_can_name_it(tmp_path, shm_root):
  """The job saved step 0 only: the replicator's entries cannot name it (step 0 means
  "nothing to restore"), but every node holds it, `latest_step()` lists it and MaxText's
  resume by number restores it. restore(None) must restore it too: it started from scratch
  and deleted it."""
  backup = tmp_path / "backup"
  with simulators(shm_root, backup, 2):
    result, out = run_job(["save", *_common(tmp_path), "--steps", "1"], 2, shm_root,
                          timeout_s=120)
    assert_ok(result, out)
  with simulators(shm_root, backup, 2) as sims:
    result, out = run_job(["restore", *_common(tmp_path), "--expect-step", "0"], 2, shm_root,
                          timeout_s=120)
    assert [s.events("RESTORE")[-1]["step"] for s in sims] == ["0", "0"]
  assert_ok(result, out)
  assert_results(out, 2, step=0, tier="local")
  for node, fields in mp_events.parse_results(out.lines).items():
    assert (fields["listed"], fields["after"]) == ("0", "0"), (node, tail(out))
  assert [(shm_root / f"node{n}" / "0" / "manifest.json").is_file() for n in (0, 1)] == \
      [True, True]
