"""Tests of the local launcher, the distributed-join helper and the CLI, with real processes."""

from __future__ import annotations

import io
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

from orbax_mtc import distributed
from orbax_mtc.tools import launch

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
# Launcher's own limit, below the per-test pytest timeout so a hang shows as a failed launch.
LAUNCH_TIMEOUT_S = 60


def _child_env() -> dict[str, str]:
  """Lets children import orbax_mtc from this checkout, installed or not."""
  path = os.environ.get("PYTHONPATH")
  return {"PYTHONPATH": f"{REPO_ROOT}{os.pathsep}{path}" if path else str(REPO_ROOT)}


def _alive(pid: int) -> bool:
  """Whether `pid` is a running (not zombie) process."""
  try:
    stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
  except FileNotFoundError:
    return False
  except OSError:  # no /proc: fall back to signal 0, which also counts zombies
    try:
      os.kill(pid, 0)
    except ProcessLookupError:
      return False
    return True
  return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _wait_dead(pids: list[int], timeout_s: float = 5.0) -> list[int]:
  """Pids still alive after `timeout_s` (orphans are reaped by init, not by us)."""
  deadline = time.monotonic() + timeout_s
  while (alive := [pid for pid in pids if _alive(pid)]) and time.monotonic() < deadline:
    time.sleep(0.05)
  return alive


def _script(tmp_path: pathlib.Path, body: str) -> list[str]:
  path = tmp_path / "child.py"
  path.write_text(textwrap.dedent(body))
  return [sys.executable, str(path)]


@pytest.fixture
def local_root(tmp_path: pathlib.Path):
  """A RAM-disk root unique to the test, removed afterwards even when the test fails."""
  base = pathlib.Path("/dev/shm") if os.path.isdir("/dev/shm") else tmp_path
  root = base / f"orbax-mtc-test-{tmp_path.name}-{uuid.uuid4().hex[:8]}"
  yield root
  shutil.rmtree(root, ignore_errors=True)


# -- multi-process jobs with jax.distributed ----------------------------------------------------

_ALLGATHER_CHILD = """
import os, sys
from orbax_mtc import distributed
info = distributed.initialize(timeout_s=60)
import jax
import numpy as np
from jax.experimental import multihost_utils

assert info.num_processes == 2 and info.coordinator, info
assert info.process_id == int(os.environ["ORBAX_MTC_PROCESS_ID"]) == jax.process_index(), info
assert info.local_directory == os.environ["ORBAX_MTC_LOCAL_DIR"], info
assert os.path.isdir(info.local_directory), info
assert os.path.basename(info.local_directory) == f"node{info.process_id}", info
assert info.worker_index == 0 and distributed.is_initialized()
gathered = multihost_utils.process_allgather(np.int32(info.process_id))
assert list(np.asarray(gathered)) == [0, 1], gathered
want = int(sys.argv[1]) if len(sys.argv) > 1 else None
if want is not None:
  assert jax.local_device_count() == want, jax.local_devices()
  assert jax.device_count() == 2 * want, jax.devices()
  assert "--xla_backend_optimization_level=2" in os.environ["XLA_FLAGS"]
open(os.path.join(info.local_directory, "ok"), "w").write(str(jax.local_device_count()))
# One write of the whole line: print() writes the text and its newline separately on an
# unbuffered stream, and gloo's own stderr lines can land between them.
sys.stdout.write(f"gathered {np.asarray(gathered).tolist()}\\n")
sys.stdout.flush()
"""


@pytest.mark.timeout(90)
def test_two_processes_allgather(tmp_path, local_root):
  out = io.StringIO()
  result = launch.run_processes(
      _script(tmp_path, _ALLGATHER_CHILD), 2, local_root=local_root,
      env={**_child_env(), "JAX_PLATFORMS": "cpu"}, output=out, timeout_s=LAUNCH_TIMEOUT_S,
  )
  assert result.returncode == 0, out.getvalue()
  assert result.returncodes == [0, 0] and result.failed_process is None
  lines = out.getvalue().splitlines()
  for i in range(2):
    # gloo writes its own stderr lines in pieces, so ours may share a line with one of them.
    assert any(line.startswith(f"[node {i}] ") and "gathered [0, 1]" in line
               for line in lines), out.getvalue()
    # The RAM tier outlives the job.
    assert (local_root / f"node{i}" / "ok").is_file()


@pytest.mark.timeout(90)
def test_devices_per_process(tmp_path, local_root):
  out = io.StringIO()
  env = {
      **_child_env(),
      # Another flag is kept; an existing device count is replaced.
      "XLA_FLAGS": "--xla_backend_optimization_level=2 --xla_force_host_platform_device_count=7",
  }
  result = launch.run_processes(
      [*_script(tmp_path, _ALLGATHER_CHILD), "2"], 2, devices_per_process=2,
      local_root=local_root, env=env, output=out, timeout_s=LAUNCH_TIMEOUT_S,
  )
  assert result.returncode == 0, out.getvalue()
  for i in range(2):
    assert (local_root / f"node{i}" / "ok").read_text() == "2"


# A program can end while a collective it no longer waits for still runs: process_allgather,
# for one, returns once the first local device has its copy. JAX's exit hook then shuts
# jax.distributed down (process 0 stops the coordination service), and a process whose
# collective still needed the service or a peer that has left hung for good in the CPU client's
# destructor. Here every local device but the first holds its part of an all-reduce until exit
# starts: `gate.set` is registered last, so it runs first, then orbax-mtc's exit hook (registered
# by initialize()), then `report` (registered before initialize()), and JAX's own hook last. So
# `report` sees what JAX's shutdown would have stranded; nothing is timed.
_TAIL_CHILD = """
import atexit, os, sys, threading
from orbax_mtc import distributed
import jax
done = set()
def report():
  finished = sorted(done)  # first, before any I/O lets another thread run
  with open(os.path.join(os.environ["ORBAX_MTC_LOCAL_DIR"], "tails"), "w") as f:
    f.write(repr(finished))
atexit.register(report)
info = distributed.initialize(timeout_s=60)
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import io_callback
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
gate = threading.Event()
def hold(i):
  if int(i) != 0:
    gate.wait()
  return np.int32(0)
def mark(i, total):
  done.add(int(i))
  return np.int32(0)
procs, per = jax.process_count(), jax.local_device_count()
mesh = Mesh(np.array(jax.devices()).reshape(procs, per), ("p", "l"))
def body(x):
  i = lax.axis_index("l")
  x = x + io_callback(hold, jax.ShapeDtypeStruct((), jnp.int32), i)
  total = lax.psum(x, "p")  # across processes, one collective per local device
  return total + io_callback(mark, jax.ShapeDtypeStruct((), jnp.int32), i, total)
x = jax.make_array_from_callback(
    (procs, per), NamedSharding(mesh, P("p", "l")), lambda index: np.ones((1, 1), np.int32))
out = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("p", "l"), out_specs=P(None, "l")))(x)
first = next(s for s in out.addressable_shards if s.device == mesh.devices[info.process_id, 0])
assert np.asarray(first.data).tolist() == [[procs]], first.data
atexit.register(gate.set)
sys.stdout.write(f"first device done: {sorted(done)}\\n")
"""


@pytest.mark.timeout(90)
def test_exit_waits_for_collectives_in_flight(tmp_path, local_root):
  out = io.StringIO()
  result = launch.run_processes(
      _script(tmp_path, _TAIL_CHILD), 2, devices_per_process=4, local_root=local_root,
      env=_child_env(), output=out, timeout_s=LAUNCH_TIMEOUT_S,
  )
  assert result.returncode == 0, out.getvalue()
  for i in range(2):
    # Every local device's part had finished before jax.distributed shut down.
    assert (local_root / f"node{i}" / "tails").read_text() == "[0, 1, 2, 3]", out.getvalue()


# -- failure propagation (no JAX in the children: it is not what is being tested) ---------------

_BLOCKED_SIBLING = """
import os, signal, subprocess, sys, time
node = int(os.environ["ORBAX_MTC_PROCESS_ID"])
local = os.environ["ORBAX_MTC_LOCAL_DIR"]
if node == 0:
  while not os.path.exists(os.path.join(local, "..", "node1", "pids")):
    time.sleep(0.02)
  print("node 0 failing", flush=True)
  {fail}
else:
  # Like a JAX process after jax.distributed.initialize: SIGTERM does not stop it.
  signal.signal(signal.SIGTERM, signal.SIG_IGN)
  grandchild = subprocess.Popen(["sleep", "600"])
  with open(os.path.join(local, "pids.tmp"), "w") as f:
    f.write(f"{{os.getpid()}} {{grandchild.pid}}")
  os.rename(os.path.join(local, "pids.tmp"), os.path.join(local, "pids"))
  time.sleep(600)
"""


def _run_blocked_sibling(tmp_path, local_root, fail: str) -> tuple[launch.LaunchResult, str]:
  out = io.StringIO()
  result = launch.run_processes(
      _script(tmp_path, _BLOCKED_SIBLING.format(fail=fail)), 2, local_root=local_root,
      output=out, timeout_s=LAUNCH_TIMEOUT_S,
  )
  pids = [int(p) for p in (local_root / "node1" / "pids").read_text().split()]
  assert pids[0] == result.pids[1]
  assert not _wait_dead([*result.pids, *pids]), "a process of the job survived the launch"
  return result, out.getvalue()


@pytest.mark.timeout(60)
def test_failing_child_kills_sibling(tmp_path, local_root):
  result, out = _run_blocked_sibling(tmp_path, local_root, "sys.exit(3)")
  assert result.returncode == 3, out
  assert result.failed_process == 0 and not result.timed_out
  assert result.returncodes == [3, 128 + signal.SIGKILL]
  assert "[node 0] node 0 failing" in out.splitlines()


@pytest.mark.timeout(60)
def test_sigkilled_child_gives_137(tmp_path, local_root):
  result, out = _run_blocked_sibling(
      tmp_path, local_root, "os.kill(os.getpid(), signal.SIGKILL)"
  )
  assert result.returncode == 137, out
  assert result.failed_process == 0


@pytest.mark.timeout(60)
def test_timeout_kills_everything(tmp_path, local_root):
  result = launch.run_processes(
      _script(tmp_path, "import time\ntime.sleep(600)\n"), 2, local_root=local_root,
      output=io.StringIO(), timeout_s=1.0,
  )
  assert result.timed_out and result.returncode == launch.TIMEOUT_RETURNCODE
  assert result.failed_process is None
  assert not _wait_dead(result.pids)


@pytest.mark.timeout(60)
def test_success_reaps_background_processes(tmp_path, local_root):
  # The grandchild inherits the output pipe: the launcher must neither hang on it nor leave it.
  body = """
  import os, subprocess
  p = subprocess.Popen(["sleep", "600"])
  open(os.path.join(os.environ["ORBAX_MTC_LOCAL_DIR"], "pid"), "w").write(str(p.pid))
  print("done")
  """
  out = io.StringIO()
  result = launch.run_processes(
      _script(tmp_path, body), 2, local_root=local_root, output=out, timeout_s=LAUNCH_TIMEOUT_S,
  )
  assert result.returncode == 0 and result.returncodes == [0, 0], out.getvalue()
  grandchildren = [int((local_root / f"node{i}" / "pid").read_text()) for i in range(2)]
  assert not _wait_dead(grandchildren)
  assert sorted(out.getvalue().splitlines()) == ["[node 0] done", "[node 1] done"]


def test_merge_xla_flags():
  assert launch.merge_xla_flags(None, 4) == "--xla_force_host_platform_device_count=4"
  assert launch.merge_xla_flags(
      "--xla_a=1 --xla_force_host_platform_device_count=8 --xla_b", 2
  ) == "--xla_a=1 --xla_b --xla_force_host_platform_device_count=2"


def test_bad_arguments(local_root):
  with pytest.raises(ValueError, match="nprocs"):
    launch.run_processes(["true"], 0, local_root=local_root)
  with pytest.raises(ValueError, match="devices_per_process"):
    launch.run_processes(["true"], 1, devices_per_process=0, local_root=local_root)
  with pytest.raises(TypeError, match="sequence"):
    launch.run_processes("python train.py", 1, local_root=local_root)  # type: ignore[arg-type]


# -- the command line --------------------------------------------------------------------------


# A test run started in the background of a non-interactive shell (`pytest ... &`) inherits
# SIGINT ignored, and Python keeps an ignored SIGINT ignored: the launcher gets the default, as
# from a terminal, so that the Ctrl-C test tests the launcher. Set in a small Python that then
# execs the CLI in its place (same pid; no preexec_fn, unsafe in this threaded process).
_WITH_DEFAULT_SIGINT = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "os.execv(sys.executable, [sys.executable, '-m', 'orbax_mtc', *sys.argv[1:]])")


def _cli(*args: str, **kwargs) -> subprocess.Popen[str]:
  env = {**os.environ, **_child_env()}
  return subprocess.Popen(
      [sys.executable, "-c", _WITH_DEFAULT_SIGINT, *args], env=env, text=True,
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **kwargs,
  )


@pytest.mark.timeout(60)
def test_cli_returns_failed_exit_code(local_root):
  proc = _cli(
      "launch", "--nprocs", "2", "--local-root", str(local_root), "--timeout", "30", "--",
      sys.executable, "-c",
      "import os, sys; print('hi'); sys.exit(5 * int(os.environ['ORBAX_MTC_PROCESS_ID']))",
  )
  out, _ = proc.communicate(timeout=50)
  assert proc.returncode == 5, out
  assert "[node 0] hi" in out.splitlines() and "[node 1] hi" in out.splitlines()


_TERM_CHILD = """
import os, signal, sys, time
local = os.environ["ORBAX_MTC_LOCAL_DIR"]
graceful = sys.argv[1] == "graceful"
def on_term(signum, frame):
  if graceful:
    open(os.path.join(local, "terminated"), "w").close()
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
with open(os.path.join(local, "ready.tmp"), "w") as f:
  f.write(str(os.getpid()))
os.rename(os.path.join(local, "ready.tmp"), os.path.join(local, "ready"))
time.sleep(600)
"""


def _signal_launcher(tmp_path, local_root, mode: str, sig: int) -> tuple[int, str, list[int]]:
  """Runs a 2-node CLI job, sends `sig` to the launcher once both nodes are up."""
  proc = _cli(
      "launch", "--nprocs", "2", "--local-root", str(local_root), "--timeout", "40",
      "--sigterm-grace", "1", "--", *_script(tmp_path, _TERM_CHILD), mode,
  )
  try:
    ready = [local_root / f"node{i}" / "ready" for i in range(2)]
    deadline = time.monotonic() + 30
    while not all(p.exists() for p in ready) and time.monotonic() < deadline:
      time.sleep(0.05)
    assert all(p.exists() for p in ready)
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=30)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
  return proc.returncode, out, [int(p.read_text()) for p in ready]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["graceful", "stuck"])
def test_cli_forwards_sigterm(tmp_path, local_root, mode):
  returncode, out, pids = _signal_launcher(tmp_path, local_root, mode, signal.SIGTERM)
  if mode == "graceful":
    assert returncode == 0, out
    assert all((local_root / f"node{i}" / "terminated").exists() for i in range(2))
  else:
    assert returncode == 128 + signal.SIGTERM, out
  assert not _wait_dead(pids)


@pytest.mark.timeout(60)
def test_cli_ctrl_c_kills_every_node(tmp_path, local_root):
  returncode, out, pids = _signal_launcher(tmp_path, local_root, "stuck", signal.SIGINT)
  assert returncode == 128 + signal.SIGINT, out
  assert not _wait_dead(pids)


def test_cli_launch_usage_errors():
  assert _cli("launch", "--nprocs", "2").wait(timeout=30) == 2
  proc = _cli("launch", "--help")
  out, _ = proc.communicate(timeout=30)
  assert proc.returncode == 0 and "--devices-per-process" in out


# -- orbax_mtc.distributed in this process (jax.distributed is never started here) -------------


@pytest.fixture
def clean_env(monkeypatch):
  for name in (
      distributed.ORBAX_MTC_COORDINATOR, distributed.ORBAX_MTC_NUM_PROCESSES,
      distributed.ORBAX_MTC_PROCESS_ID, distributed.ORBAX_MTC_LOCAL_DIR,
      distributed.ORBAX_MTC_WORKER_INDEX, "TPU_WORKER_ID", "LOCAL_RANK",
  ):
    monkeypatch.delenv(name, raising=False)
  return monkeypatch


@pytest.mark.parametrize(
    ("variables", "message"),
    [
        ({"ORBAX_MTC_COORDINATOR": "127.0.0.1:1234"}, "missing"),
        ({"ORBAX_MTC_COORDINATOR": "nohost", "ORBAX_MTC_NUM_PROCESSES": "2",
          "ORBAX_MTC_PROCESS_ID": "0"}, "HOST:PORT"),
        ({"ORBAX_MTC_COORDINATOR": "127.0.0.1:1234", "ORBAX_MTC_NUM_PROCESSES": "two",
          "ORBAX_MTC_PROCESS_ID": "0"}, "not an integer"),
        ({"ORBAX_MTC_COORDINATOR": "127.0.0.1:1234", "ORBAX_MTC_NUM_PROCESSES": "2",
          "ORBAX_MTC_PROCESS_ID": "2"}, "out of range"),
        ({"ORBAX_MTC_COORDINATOR": "127.0.0.1:1234", "ORBAX_MTC_NUM_PROCESSES": "0",
          "ORBAX_MTC_PROCESS_ID": "0"}, ">= 1"),
        ({"ORBAX_MTC_LOCAL_DIR": "relative/dir"}, "absolute"),
        ({"ORBAX_MTC_WORKER_INDEX": "-1"}, ">= 0"),
    ],
)
def test_initialize_rejects_bad_environment(clean_env, variables, message):
  for name, value in variables.items():
    clean_env.setenv(name, value)
  with pytest.raises(ValueError, match=message):
    distributed.initialize()
  assert not distributed.is_initialized()


def test_initialize_single_process(clean_env):
  if distributed.detected_cluster() is not None:
    pytest.skip("running inside a cluster environment JAX detects")
  clean_env.setenv(distributed.ORBAX_MTC_LOCAL_DIR, "/dev/shm/x")
  info = distributed.initialize()
  assert info == distributed.DistributedInfo(0, 1, None, "/dev/shm/x", 0)
  assert not distributed.is_initialized()


def test_worker_index_and_local_directory(clean_env):
  assert distributed.worker_index() == 0
  clean_env.setenv("LOCAL_RANK", "3")
  assert distributed.worker_index() == 3
  clean_env.setenv("TPU_WORKER_ID", "2")
  assert distributed.worker_index() == 2
  clean_env.setenv(distributed.ORBAX_MTC_WORKER_INDEX, "1")
  assert distributed.worker_index() == 1
  assert distributed.local_directory() is None
  assert distributed.local_directory("/tmp/d") == "/tmp/d"
  clean_env.setenv(distributed.ORBAX_MTC_LOCAL_DIR, "/dev/shm/n0")
  assert distributed.local_directory("/tmp/d") == "/dev/shm/n0"


def test_finish_collectives_without_jax_distributed():
  # What the exit hook does in a single process: nothing (no barrier, no backend started).
  assert not distributed.is_initialized()
  assert distributed.finish_collectives() is False
