"""`orbax-mtc demo`, the README's main command, end to end (4 real processes, SIGKILL, SIGTERM)."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import uuid

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.timeout(300)
def test_demo_recovers_from_sigkill_and_sigterm(tmp_path):
  shm = pathlib.Path("/dev/shm")
  base = shm if shm.is_dir() and os.access(shm, os.W_OK) else tmp_path
  local_root = base / f"orbax-mtc-demo-test-{uuid.uuid4().hex[:8]}"
  env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
  done = subprocess.run(
      [sys.executable, "-m", "orbax_mtc", "demo", "--local-root", str(local_root),
       "--persistent-dir", str(tmp_path / "persistent")],
      env=env, capture_output=True, text=True, timeout=280, start_new_session=True)
  out = done.stdout + done.stderr
  assert done.returncode == 0, out[-4000:]
  assert re.search(r"restored from\s+local tier, step 35", out), out[-2000:]
  match = re.search(r"every process saved step (\d+) on demand", out)
  assert match and int(match.group(1)) >= 50, out[-2000:]
  assert re.search(rf"restored after it\s+local tier, step {match.group(1)}", out)
  assert re.search(r"final step / loss\s+80 /", out)
  assert not local_root.exists()  # the demo cleans up after itself
