"""configs/tpu-vm/ scripts: queued-resource and VM creation issue the gcloud commands the guide
gives (DRY_RUN=1), the launchers run the patched trainers on every worker, and supervise.sh
restarts the job (under systemd or nohup) until it finishes; gcloud, sudo, systemctl and python
are stand-ins."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess

from configs_support import (
  CONFIGS,
  _args,
  _bash,
  _dry_run_lines,
  _remote_commands,
  _supervised,
)


def test_tpu_vm_creation_enables_autocheckpoint():
  for name in ("create-queued-resource.sh", "create-single-vm.sh"):
    assert "--autocheckpoint-enabled" in (CONFIGS / "tpu-vm" / name).read_text()
  env = {"JOB_NAME": "llm-run", "PROJECT_ID": "p", "ZONE": "us-east5-b"}
  script = CONFIGS / "tpu-vm" / "create-queued-resource.sh"
  # The flag exists only in gcloud's alpha track, so Autocheckpoint (the default) needs it.
  (one,) = _dry_run_lines(_bash(script, env={**env, "SLICES": "1"}).stdout)
  assert one[:6] == ["gcloud", "alpha", "compute", "tpus", "queued-resources", "create"]
  assert "--autocheckpoint-enabled" in one and "--node-id=llm-run" in one
  (multi,) = _dry_run_lines(_bash(script, env={**env, "SLICES": "3",
                                                "EXTRA_ARGS": "--spot"}).stdout)
  assert {"--autocheckpoint-enabled", "--node-prefix=llm-run", "--node-count=3",
          "--spot"} <= set(multi)
  (vm,) = _dry_run_lines(_bash(CONFIGS / "tpu-vm" / "create-single-vm.sh", env=env).stdout)
  assert vm[:6] == ["gcloud", "alpha", "compute", "tpus", "tpu-vm", "create"]
  assert vm[6] == "llm-run" and "--autocheckpoint-enabled" in vm


def test_tpu_vm_scripts_use_ga_gcloud_where_the_guide_does():
  env = {"JOB_NAME": "llm-run", "PROJECT_ID": "p", "ZONE": "us-east5-b", "SLICES": "2"}
  ran = _bash(CONFIGS / "tpu-vm" / "create-queued-resource.sh",
              env={**env, "AUTOCHECKPOINT": "0"})
  (ga,) = _dry_run_lines(ran.stdout)
  assert ga[:5] == ["gcloud", "compute", "tpus", "queued-resources", "create"]
  assert "--autocheckpoint-enabled" not in ga
  assert {"--node-prefix=llm-run", "--node-count=2", "--runtime-version=v2-alpha-tpuv5-lite",
          "--accelerator-type=v5litepod-16"} <= set(ga)
  # What to run next is GA in both cases.
  for autocheckpoint in ("0", "1"):
    out = _bash(CONFIGS / "tpu-vm" / "create-queued-resource.sh",
                env={**env, "AUTOCHECKPOINT": autocheckpoint}).stdout
    (hint,) = [line for line in out.splitlines() if line.startswith("wait for ACTIVE:")]
    assert "gcloud compute tpus queued-resources describe llm-run" in hint
  (vm,) = _dry_run_lines(_bash(CONFIGS / "tpu-vm" / "create-single-vm.sh",
                               env={**env, "AUTOCHECKPOINT": "0"}).stdout)
  assert vm[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "create"]
  assert "--autocheckpoint-enabled" not in vm
  # No beta track anywhere; alpha only on the line that passes --autocheckpoint-enabled.
  for path in (CONFIGS / "tpu-vm").glob("*.sh"):
    code = [line for line in path.read_text().splitlines()
            if not line.lstrip().startswith("#")]
    assert not [line for line in code if re.search(r"\b(alpha|beta) compute\b", line)], path
  for path in (CONFIGS / "tpu-vm").glob("*.sh"):
    if path.name == "supervise.sh":
      continue  # runs on the workers, calls no gcloud
    for line in _dry_run_lines(_bash(path, env={**env, "BUCKET": "b", "EXP": "e"}).stdout):
      assert line[1] != "alpha" or "--autocheckpoint-enabled" in line, line


def _fake_job(tmp_path, statuses, name="job", ready=False):
  """A stand-in for python: records its arguments, ends with the next of `statuses`; with
  `ready`, the last run first opens the FIFO `<name>.ready` for writing, so a test that opens
  it for reading knows the restart loop is on its last run."""
  fifo = tmp_path / f"{name}.ready"
  signal = ""
  if ready:
    os.mkfifo(fifo)
    signal = f"if ((n >= ${{#statuses[@]}})); then exec 3>{fifo}; fi\n"
  runs = tmp_path / f"{name}.runs"
  script = tmp_path / name
  script.write_text(
      "#!/usr/bin/env bash\n"
      f"echo \"$*\" >> {runs}\n"
      f"n=$(wc -l < {runs}); statuses=({' '.join(map(str, statuses))})\n"
      f"{signal}exit ${{statuses[$((n - 1))]:-0}}\n")
  script.chmod(0o755)
  return script, runs, fifo


def _worker(tmp_path):
  """A worker's home (supervise.sh where the launcher's scp puts it) and a PATH whose sudo
  runs its command and whose systemctl records its arguments."""
  home = tmp_path / "home"
  home.mkdir()
  shutil.copy(CONFIGS / "tpu-vm" / "supervise.sh", home / "orbax-mtc-supervise.sh")
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  (bin_dir / "sudo").write_text('#!/usr/bin/env bash\nexec "$@"\n')
  (bin_dir / "systemctl").write_text(f'#!/usr/bin/env bash\necho "$*" >> {tmp_path}/systemctl\n')
  for tool in ("sudo", "systemctl"):
    (bin_dir / tool).chmod(0o755)
  return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(home),
          "UNIT_DIR": str(tmp_path)}


def _wait_for_loop(ready, state):
  """Returns once the restart loop is on its last run (the fake job opened `ready`) and has
  ended (its lock is free)."""
  with open(ready) as f:
    f.read()
  subprocess.run(["flock", str(state / "lock"), "true"], check=True, timeout=60)


def test_launch_maxtext_runs_the_patch_on_every_node_with_its_flags(tmp_path):
  env = {"JOB_NAME": "llm-run", "SLICES": "2", "BUCKET": "my-ckpt-bucket", "PROJECT_ID": "p"}
  lines = _dry_run_lines(_bash(CONFIGS / "tpu-vm" / "launch-maxtext.sh", env=env).stdout)
  # supervise.sh goes to every worker first (scp), then each worker starts it (ssh).
  copies = [line for line in lines if line[4] == "scp"]
  assert lines[:2] == copies and {c[6] for c in copies} == {"llm-run-0:orbax-mtc-supervise.sh",
                                                            "llm-run-1:orbax-mtc-supervise.sh"}
  assert all(c[5].endswith("configs/tpu-vm/supervise.sh") and "--worker=all" in c
             for c in copies)
  commands = _remote_commands("launch-maxtext.sh", env)
  assert set(commands) == {"llm-run-0", "llm-run-1"}  # create-queued-resource's node names
  head, job = _supervised(commands["llm-run-0"])
  assert head[-6:-3] == ["SUPERVISOR=systemd", "RESTART_DELAY_S=30", "bash"]
  assert head[-2:] == ["start", "llm-run"]
  words = shlex.split(job.split(" && cd ", 1)[1])
  at = words.index("maxtext_patch.train")
  assert words[at - 1] == "-m" and words[at + 1] == "src/maxtext/configs/base.yml"
  args = _args(words[at + 2:])
  assert args == {**args, "run_name": "llm-run", "base_output_directory": "gs://my-ckpt-bucket",
                  "enable_emergency_checkpoint": "true",
                  "local_checkpoint_directory": "/dev/shm/ckpt", "local_checkpoint_period": "20",
                  "checkpoint_period": "200", "mtc_peers_per_node": "1",
                  "enable_autocheckpoint": "true", "mtc_preemption_exit_code": "75"}

  # The remote command on a worker: checks the RAM disk, starts the job detached and returns;
  # the job (python -> a stand-in) stops at a preemption step (status 75), is started again,
  # and finishes (status 0).
  python, runs, ready = _fake_job(tmp_path, [75, 0], ready=True)
  local = tmp_path / "ram"
  env = {**env, "SLICES": "1", "LOCAL_DIR": str(local), "PYTHON": str(python),
         "MAXTEXT_DIR": str(tmp_path), "SUPERVISOR": "nohup", "RESTART_DELAY_S": "0"}
  worker = _worker(tmp_path)
  command = _remote_commands("launch-maxtext.sh", {**env, "RAMDISK_GI": "0"})["llm-run"]
  ran = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=60,
                       env=worker)
  assert ran.returncode == 0 and "llm-run: started under nohup" in ran.stdout, ran.stderr
  state = tmp_path / "home" / ".orbax-mtc" / "llm-run"
  _wait_for_loop(ready, state)
  started = runs.read_text().splitlines()
  assert len(started) == 2 and all("-m maxtext_patch.train" in run for run in started)
  assert (state / "done").exists() and local.is_dir()
  assert "status 75; restarting in 0s" in (state / "log").read_text()

  command = _remote_commands("launch-maxtext.sh", {**env, "RAMDISK_GI": "999999999"})["llm-run"]
  shutil.rmtree(state)
  ran = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=60,
                       env=worker)
  assert ran.returncode == 1 and "orbax-mtc size asks for 999999999G" in ran.stderr
  assert "started" not in ran.stdout and not state.exists()  # nothing left restarting


def test_launch_pax_runs_the_patch_with_its_flags():
  env = {"JOB_NAME": "llm-run", "BUCKET": "my-ckpt-bucket", "EXP": "my.Exp", "PROJECT_ID": "p"}
  (command,) = _remote_commands("launch-pax.sh", env).values()
  head, job = _supervised(command)
  assert head[-2:] == ["start", "llm-run"]
  words = shlex.split(job.split(" && python3 ", 1)[1])
  assert words[:2] == ["-m", "pax_patch.main"]
  assert set(words[2:]) == {
      "--exp=my.Exp", "--job_log_dir=gs://my-ckpt-bucket/llm-run",
      "--jax_fully_async_checkpoint=1", "--exit_after_ondemand_checkpoint=1",
      "--mtc_local_checkpoint_dir=/dev/shm/ckpt", "--mtc_local_save_interval_steps=100",
      "--mtc_peers_per_node=1"}
  for action in ("stop", "status"):
    (command,) = _remote_commands("launch-pax.sh", {**env, "ACTION": action}).values()
    assert shlex.split(command)[-3:] == ["${HOME}/orbax-mtc-supervise.sh", action, "llm-run"]
  bad = _bash(CONFIGS / "tpu-vm" / "launch-pax.sh", env={**env, "ACTION": "restart"},
              check=False)
  assert bad.returncode == 2 and "use start, stop or status" in bad.stderr


def test_supervise_installs_a_unit_that_starts_at_boot_and_restarts_until_the_job_finishes(
    tmp_path):
  worker = _worker(tmp_path)
  job, runs, ready = _fake_job(tmp_path, [75, 1, 0])
  script = str(tmp_path / "home" / "orbax-mtc-supervise.sh")
  env = {**worker, "RESTART_DELAY_S": "0", "ORBAX_MTC_STATE": str(tmp_path / "state")}
  ran = subprocess.run(["bash", script, "start", "job1", f"{job} --flag"], env=env,
                       capture_output=True, text=True, timeout=60)
  assert ran.returncode == 0 and "job1: started under systemd" in ran.stdout, ran.stderr
  assert (tmp_path / "systemctl").read_text().splitlines() == [
      "daemon-reload", "enable orbax-mtc-job1.service", "restart orbax-mtc-job1.service"]
  unit = (tmp_path / "orbax-mtc-job1.service").read_text()
  fields = dict(line.split("=", 1) for line in unit.splitlines() if "=" in line)
  state = tmp_path / "state" / "job1"
  assert fields["ExecStart"] == f"/bin/bash {state}/supervise.sh loop job1"
  assert fields["WantedBy"] == "multi-user.target"  # enabled: started at boot too
  assert fields["Restart"] == "no" and int(fields["TimeoutStopSec"]) >= 300  # on-demand save
  assert f'"HOME={worker["HOME"]}"' in unit and f'"PATH={worker["PATH"]}"' in unit
  # What systemd runs, now and after a reboot: the job until it exits 0.
  unit_env = dict(re.findall(r'"(\w+)=([^"]*)"', unit))
  loop = subprocess.run(shlex.split(fields["ExecStart"]), env=unit_env, capture_output=True,
                        text=True, timeout=120)
  assert loop.returncode == 0, loop.stderr
  assert runs.read_text().splitlines() == ["--flag"] * 3
  log = (state / "log").read_text()
  assert "status 75; restarting" in log and "status 1; restarting" in log
  assert "finished (status 0)" in log and (state / "done").exists()
  again = subprocess.run(shlex.split(fields["ExecStart"]), env=unit_env, timeout=60)
  assert again.returncode == 0 and len(runs.read_text().splitlines()) == 3  # not run again
  stop = subprocess.run(["bash", script, "stop", "job1"], env=env, capture_output=True,
                        text=True, timeout=60)
  assert stop.returncode == 0
  assert (tmp_path / "systemctl").read_text().splitlines()[-1] == \
      "disable --now orbax-mtc-job1.service"
  for bad in (["start", "job1"], ["start", "a/b", "true"], ["restart", "job1"]):
    assert subprocess.run(["bash", script, *bad], env=env, capture_output=True,
                          timeout=60).returncode == 2


def test_supervise_nohup_runs_one_loop_per_job_and_stop_ends_it(tmp_path):
  worker = _worker(tmp_path)
  ready, hold = tmp_path / "ready", tmp_path / "hold"
  os.mkfifo(ready)
  os.mkfifo(hold)
  script = str(tmp_path / "home" / "orbax-mtc-supervise.sh")
  env = {**worker, "SUPERVISOR": "nohup", "ORBAX_MTC_STATE": str(tmp_path / "state")}
  state = tmp_path / "state" / "job2"
  # The job signals that it runs, then waits for a writer to `hold` that never comes.
  ran = subprocess.run(["bash", script, "start", "job2", f"exec 3>{ready}; cat {hold}"],
                       env=env, capture_output=True, text=True, timeout=60)
  assert ran.returncode == 0, ran.stderr
  try:
    with open(ready) as f:  # returns once the job runs, inside the loop that holds the lock
      second = subprocess.run(["bash", script, "start", "job2", "true"], env=env,
                              capture_output=True, text=True, timeout=60)
      assert second.returncode == 1 and "already running" in second.stderr
      status = subprocess.run(["bash", script, "status", "job2"], env=env,
                              capture_output=True, text=True, timeout=60)
      assert status.stdout.splitlines()[0] == "active"
      stop = subprocess.run(["bash", script, "stop", "job2"], env=env, capture_output=True,
                            text=True, timeout=60)
      assert stop.returncode == 0 and "job2: stopped" in stop.stdout
      assert f.read() == ""  # the job is gone: its end of the FIFO closed
  finally:
    if (state / "pid").exists():
      subprocess.run(["kill", "-TERM", "--", f"-{(state / 'pid').read_text().strip()}"],
                     capture_output=True)
  subprocess.run(["flock", str(state / "lock"), "true"], check=True, timeout=60)
  status = subprocess.run(["bash", script, "status", "job2"], env=env, capture_output=True,
                          text=True, timeout=60)
  assert status.stdout.splitlines()[0] == "inactive" and not (state / "done").exists()
