"""The test harness's forked starts (`warm_start.WarmJob`): a forked process is what the
launcher's exec would have started (own session, environment, device count, arguments,
output, exit status), and a command a fork cannot stand for is exec'd as before."""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap

import pytest
import warm_start
from mp_helpers import child_env, mp_events

from orbax_mtc.tools import launch

_SCRIPT = textwrap.dedent("""
    import json, os, sys
    warm = "orbax_mtc" in sys.modules  # imported before this script ran: a fork
    import jax
    print("@@facts " + json.dumps({
        "warm": warm, "argv": sys.argv[1:], "path0": sys.path[0],
        "pid": os.getpid(), "sid": os.getsid(0), "stdin": os.read(0, 1).decode(),
        "only_here": os.environ.get("ONLY_HERE"),
        "process_id": os.environ["ORBAX_MTC_PROCESS_ID"],
        "devices": len(jax.devices())}), flush=True)
    code = int(sys.argv[1])
    if code < 0:
        os.kill(os.getpid(), -code)
    sys.exit(code)
""")


def _facts(out) -> dict[int, dict]:
  found = {}
  for line in out.lines:
    node, _, rest = line.partition("] ")
    if rest.startswith("@@facts "):
      found[int(node.removeprefix("[node "))] = json.loads(rest.removeprefix("@@facts "))
  return found


def _run(tmp_path, code: int, job_class=warm_start.WarmJob, **env: str):
  tmp_path.mkdir(exist_ok=True)
  script = tmp_path / "facts.py"
  script.write_text(_SCRIPT)
  out = mp_events.LineCollector()
  with job_class([sys.executable, str(script), str(code)], 2, devices_per_process=3,
                 local_root=tmp_path / "local", env={**child_env(), **env},
                 output=out) as job:
    job.start()
    result = job.wait(60)
  return result, _facts(out), script


def test_a_forked_process_is_what_exec_would_start(tmp_path):
  result, facts, script = _run(tmp_path, 0, ONLY_HERE="yes")
  assert result.returncode == 0 and result.returncodes == [0, 0], result
  assert sorted(facts) == [0, 1]
  for node, fact in facts.items():
    assert fact["warm"] is warm_start.enabled()
    assert fact["argv"] == ["0"] and fact["path0"] == str(script.parent)
    assert fact["sid"] == fact["pid"]  # a session of its own: killpg reaches its group
    assert fact["stdin"] == ""
    assert fact["only_here"] == "yes" and fact["process_id"] == str(node)
    assert fact["devices"] == 3  # XLA_FLAGS of this job, read when the fork made its backend
  assert facts[0]["pid"] != facts[1]["pid"]


@pytest.mark.parametrize("code, shell", [(5, 5), (-signal.SIGKILL, 128 + signal.SIGKILL)])
def test_exit_statuses_read_as_the_launchers_own_children(tmp_path, code, shell):
  result, facts, _ = _run(tmp_path, code)
  assert sorted(facts) == [0, 1]
  assert result.returncode == shell and shell in result.returncodes, result


def test_a_job_killed_from_outside_reads_137_and_leaves_nothing_running(tmp_path):
  script = tmp_path / "sleep.py"
  script.write_text("import sys, time\nprint('up', flush=True)\ntime.sleep(600)\n")
  out = mp_events.LineCollector()
  with warm_start.WarmJob([sys.executable, str(script)], 2, local_root=tmp_path / "local",
                          env=child_env(), output=out) as job:
    job.start()
    assert out.wait_for(lambda lines: sum("up" in line for line in lines) == 2, 60), out.lines
    pids = job.pids
    os.kill(pids[1], signal.SIGKILL)
    result = job.wait(60)
  assert result.returncodes[1] == 128 + signal.SIGKILL, result
  assert result.returncodes[0] == 128 + signal.SIGKILL  # killed by the launcher after it
  for pid in pids:
    with pytest.raises(ProcessLookupError):
      os.kill(pid, 0)  # reaped, not a zombie


def test_other_import_time_settings_are_exec_started(tmp_path):
  """A fork would carry the server's JAX flags read at import: such a job is exec'd."""
  result, facts, _ = _run(tmp_path, 0, JAX_ENABLE_X64="1")
  assert result.returncode == 0, result
  assert [fact["warm"] for fact in facts.values()] == [False, False]


def test_the_same_job_exec_started_gives_the_same_facts(tmp_path):
  warm = _run(tmp_path / "warm", 0)
  cold = _run(tmp_path / "cold", 0, job_class=launch.Job)
  assert warm[0].returncodes == cold[0].returncodes == [0, 0]
  for node in (0, 1):
    keep = ("argv", "stdin", "process_id", "devices")
    assert {k: warm[1][node][k] for k in keep} == {k: cold[1][node][k] for k in keep}
    assert cold[1][node]["warm"] is False


def test_a_module_run_with_dash_m_sees_what_python_dash_m_gives_it(tmp_path):
  """`python -m module` from `cwd`: the module runs as __main__ with its file as argv[0] and
  the working folder first on the import path; its output and status come back."""
  (tmp_path / "facts_mod.py").write_text(textwrap.dedent("""
      import json, os, sys
      print(json.dumps({"warm": "orbax_mtc" in sys.modules, "argv": sys.argv,
                        "path0": sys.path[0], "cwd": os.getcwd(), "name": __name__}))
      sys.exit(7)
  """))
  argv = [sys.executable, "-m", "facts_mod", "a", "b"]
  env = {**os.environ, **child_env(), "PYTHONUNBUFFERED": "1"}
  proc = warm_start.spawn(sys.executable, warm_start.MP_WORKER_PRELOAD,
                          warm_start.mp_server_env(), argv, env, str(tmp_path))
  if proc is None:
    assert not warm_start.enabled()
    return
  assert proc.wait(60) == 7
  facts = json.loads(proc.stdout.read())
  proc.stdout.close()
  assert facts == {"warm": True, "argv": [str(tmp_path / "facts_mod.py"), "a", "b"],
                   "path0": str(tmp_path), "cwd": str(tmp_path), "name": "__main__"}


def test_a_server_running_a_thread_after_its_imports_is_never_forked_from(tmp_path):
  """A thread started by an import would be missing in every fork: such a server is not used
  (the caller execs)."""
  (tmp_path / "starts_a_thread.py").write_text(
      "import threading, time\n"
      "threading.Thread(target=time.sleep, args=(600,), daemon=True).start()\n")
  script = tmp_path / "hello.py"
  script.write_text("print('hello')\n")
  env = warm_start.mp_server_env()
  env["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{env['PYTHONPATH']}"
  preload = ("starts_a_thread",)
  argv = [sys.executable, str(script)]
  assert warm_start.spawn(sys.executable, preload, env, argv, env, str(tmp_path)) is None
  if warm_start.enabled():
    assert warm_start.starter(sys.executable, preload, env).threads == 2
