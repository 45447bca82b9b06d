"""Each process claims its local directory: a second claimant fails at once, naming the holder."""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from orbax_mtc.local.lock import (
  LocalDirectoryInUseError,
  LocalDirectoryLock,
  LockHolder,
  read_holder,
)

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 60

# Claims the directory in argv[1] as process argv[2], says so, then holds it until stdin closes.
_HOLD = """
import sys
from orbax_mtc.local.lock import LocalDirectoryLock
lock = LocalDirectoryLock.claim(sys.argv[1], job_name="holder-job", process_index=int(sys.argv[2]))
print("CLAIMED", lock.holder.pid, flush=True)
sys.stdin.read()
"""

# Tries to claim the directory in argv[1]; prints the outcome.
_TRY = """
import sys
from orbax_mtc.local.lock import LocalDirectoryInUseError, LocalDirectoryLock
try:
  LocalDirectoryLock.claim(sys.argv[1], job_name="second-job", process_index=9)
except LocalDirectoryInUseError as e:
  print("REFUSED", e, flush=True)
else:
  print("CLAIMED", flush=True)
"""


def _env() -> dict[str, str]:
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
  return env


def _start_holder(directory: Path, process_index: int) -> tuple[subprocess.Popen, int]:
  proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(directory), str(process_index)],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_env())
  try:
    line = _readline(proc)
  except BaseException:
    _kill(proc)
    raise
  assert line.startswith("CLAIMED "), line
  return proc, int(line.split()[1])


def _readline(proc: subprocess.Popen) -> str:
  """The holder's first line, or an error after TIMEOUT_S (a hung child must not hang us)."""
  import selectors

  with selectors.DefaultSelector() as sel:
    sel.register(proc.stdout, selectors.EVENT_READ)
    if not sel.select(TIMEOUT_S):
      raise TimeoutError(f"the holder printed nothing in {TIMEOUT_S}s")
  return proc.stdout.readline().strip()


def _kill(proc: subprocess.Popen) -> None:
  if proc.poll() is None:
    proc.kill()
  proc.wait(TIMEOUT_S)


def _try_in_subprocess(directory: Path) -> str:
  done = subprocess.run([sys.executable, "-c", _TRY, str(directory)], capture_output=True,
                        text=True, env=_env(), timeout=TIMEOUT_S)
  assert done.returncode == 0, done.stderr
  return done.stdout.strip()


def test_claim_creates_the_directory_and_writes_the_holder(tmp_path):
  local = tmp_path / "a" / "b" / "local"
  lock = LocalDirectoryLock.claim(local, job_name="run1", process_index=3)
  try:
    expected = LockHolder(job_name="run1", process_index=3, host=socket.gethostname(),
                          pid=os.getpid())
    assert lock.holder == expected and lock.held
    assert read_holder(local) == expected
    assert stat.S_IMODE((local / ".lock").stat().st_mode) == 0o600
    assert stat.S_IMODE(local.stat().st_mode) == 0o700
  finally:
    lock.release()
  assert not lock.held
  assert read_holder(local) is None  # a released claim names no holder
  lock.release()  # idempotent


def test_a_second_process_is_refused_with_the_holders_name(tmp_path):
  local = tmp_path / "local"
  proc, pid = _start_holder(local, process_index=5)
  try:
    out = _try_in_subprocess(local)
    assert out.startswith("REFUSED"), out
    assert f"pid {pid}" in out and "process 5 of job 'holder-job'" in out
    assert str(local) in out and "every process needs its own local directory" in out
    # And here, in this process, with the holder as an attribute.
    with pytest.raises(LocalDirectoryInUseError) as info:
      LocalDirectoryLock.claim(local, job_name="mine", process_index=0)
    assert info.value.holder == LockHolder("holder-job", 5, socket.gethostname(), pid)
    assert info.value.directory == local
  finally:
    _kill(proc)


def test_a_second_claim_in_the_same_process_takes_over_and_other_processes_stay_refused(
    tmp_path):
  local = tmp_path / "local"
  calls = []
  first = LocalDirectoryLock.claim(local, job_name="run1", process_index=0,
                                   on_takeover=lambda: calls.append(first.held))
  second = LocalDirectoryLock.claim(local, job_name="run2", process_index=0)
  try:
    # The first holder was told while it still held the folder, then lost it.
    assert calls == [True]
    assert first.taken_over and not first.held
    assert second.held and not second.taken_over
    assert read_holder(local) == second.holder
    # The claim never left the process: another process is still refused.
    assert _try_in_subprocess(local).startswith("REFUSED")
    first.release()  # a taken-over claim releases nothing
    assert _try_in_subprocess(local).startswith("REFUSED")
  finally:
    second.release()
  assert _try_in_subprocess(local) == "CLAIMED"


def test_a_failing_takeover_callback_does_not_refuse_the_newer_claim(tmp_path):
  local = tmp_path / "local"

  def broken():
    raise OSError("the old writer failed")

  first = LocalDirectoryLock.claim(local, job_name="run1", process_index=0, on_takeover=broken)
  with LocalDirectoryLock.claim(local, job_name="run2", process_index=0) as second:
    assert second.held and first.taken_over
  assert _try_in_subprocess(local) == "CLAIMED"


def test_claim_after_release(tmp_path):
  local = tmp_path / "local"
  with LocalDirectoryLock.claim(local, job_name="run1", process_index=0):
    pass
  again = LocalDirectoryLock.claim(local, job_name="run2", process_index=1)
  try:
    assert read_holder(local).job_name == "run2"
  finally:
    again.release()


def test_claim_after_the_holder_was_killed(tmp_path):
  local = tmp_path / "local"
  proc, pid = _start_holder(local, process_index=2)
  try:
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(TIMEOUT_S) == -signal.SIGKILL
  finally:
    _kill(proc)
  # The dead holder's JSON is still there, but no one holds the lock: it is taken over.
  assert read_holder(local).pid == pid
  lock = LocalDirectoryLock.claim(local, job_name="restarted", process_index=2)
  try:
    assert read_holder(local) == lock.holder
    assert lock.holder.pid == os.getpid()
  finally:
    lock.release()


def test_stale_or_malformed_lock_file_is_taken_over(tmp_path):
  local = tmp_path / "local"
  local.mkdir()
  (local / ".lock").write_text("{not json")
  os.chmod(local / ".lock", 0o644)
  assert read_holder(local) is None
  lock = LocalDirectoryLock.claim(local, job_name="run1", process_index=0)
  try:
    assert read_holder(local) == lock.holder
    assert stat.S_IMODE((local / ".lock").stat().st_mode) == 0o600
  finally:
    lock.release()


def test_read_holder_of_a_missing_directory_or_junk(tmp_path):
  assert read_holder(tmp_path / "missing") is None
  (tmp_path / ".lock").write_text('{"job": "j", "process_index": true, "host": "h", "pid": 1}')
  assert read_holder(tmp_path) is None
  (tmp_path / ".lock").write_text("[1, 2]")
  assert read_holder(tmp_path) is None


def test_a_lock_symlink_is_not_followed(tmp_path):
  local = tmp_path / "local"
  local.mkdir()
  victim = tmp_path / "victim.txt"
  victim.write_text("keep me")
  os.symlink(victim, local / ".lock")
  with pytest.raises(OSError):
    LocalDirectoryLock.claim(local, job_name="run1", process_index=0)
  assert victim.read_text() == "keep me"
