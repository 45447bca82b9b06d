"""Helpers and fixtures shared by test_cli_json.py and test_cli_progress.py."""

from __future__ import annotations

import fcntl
import io
import json
import os
import pathlib
import pty
import struct
import subprocess
import sys
import termios
import threading

import orbax.checkpoint as ocp
import pytest
from conftest import flip_byte

from orbax_mtc.local.format import DATA
from orbax_mtc.local.store import read_manifest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]


def _env(**extra: str) -> dict[str, str]:
  env = dict(os.environ)
  path = env.get("PYTHONPATH")
  env["PYTHONPATH"] = f"{REPO_ROOT}{os.pathsep}{path}" if path else str(REPO_ROOT)
  env["JAX_PLATFORMS"] = "cpu"
  env.update(extra)
  return env


def _run_cli(*args, env=None, timeout: float = 120):
  return subprocess.run([sys.executable, "-m", "orbax_mtc", *map(str, args)],
                        env=env or _env(), capture_output=True, text=True, timeout=timeout,
                        stdin=subprocess.DEVNULL, check=False)


def _document(stdout: str, schema: str) -> dict:
  """The one JSON document stdout must hold, nothing before or after it."""
  doc = json.loads(stdout)  # raises on any other text on stdout
  assert isinstance(doc, dict) and doc["schema"] == schema, doc
  return doc


@pytest.fixture
def orbax_dir(shm_dir):
  """Five steps written by plain Orbax, plus a step still being written."""
  import numpy as np

  directory = shm_dir / "persistent"
  with ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(
      enable_async_checkpointing=False)) as mgr:
    for step in range(0, 500, 100):
      mgr.save(step, args=ocp.args.PyTreeSave({"x": np.arange(4) + step}))
  (directory / "500.orbax-checkpoint-tmp-123").mkdir()
  return directory


def _flip_first_shard(step_dir):
  shard = read_manifest(step_dir).items["state"].leaves[0].shards[0]
  flip_byte(step_dir / DATA, shard.offset, 0x01)


def _steps(directory):
  return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


class _Terminal(io.StringIO):
  def isatty(self) -> bool:
    return True


class _Recorder:
  """Stands in for console.progress: records how each bar was made and advanced."""

  def __init__(self):
    self.bars = []

  def __call__(self, *, total, desc, enabled=True, **kwargs):
    bar = _RecordedBar(total, desc, enabled)
    self.bars.append(bar)
    return bar


class _RecordedBar:
  def __init__(self, total, desc, enabled):
    self.total, self.desc, self.enabled, self.n = total, desc, enabled, 0

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    return False

  def reset(self, total=None):
    self.n, self.total = 0, total

  def update(self, n=1):
    self.n += n

  @staticmethod
  def write(line, file=None):
    print(line, file=file)


def _run_with_terminal_stderr(argv, timeout: float = 300):
  """Runs argv with stderr on a pseudo-terminal (80 columns) and stdout on a pipe; returns
  (exit code, stdout, what the terminal received)."""
  master, slave = pty.openpty()
  fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
  chunks = []

  def drain():
    while True:
      try:
        data = os.read(master, 65536)
      except OSError:  # EIO: every writer closed the terminal
        return
      if not data:
        return
      chunks.append(data)

  reader = threading.Thread(target=drain, daemon=True)
  reader.start()
  try:
    proc = subprocess.run(argv, env=_env(TF_CPP_MIN_LOG_LEVEL="2"), stdout=subprocess.PIPE,
                          stderr=slave, stdin=subprocess.DEVNULL, text=True, timeout=timeout,
                          check=False)
  finally:
    os.close(slave)
    reader.join(timeout=10)
    os.close(master)
  return proc.returncode, proc.stdout, b"".join(chunks).decode(errors="replace")


def _options(parser):
  return [a for a in parser._actions
          if a.option_strings and a.help != "==SUPPRESS==" and a.dest != "help"]


_SAVE_STEPS = """
import sys
import numpy as np
import orbax.checkpoint as ocp
with ocp.CheckpointManager(sys.argv[1], options=ocp.CheckpointManagerOptions(
    enable_async_checkpointing=False)) as mgr:
  for step in range(0, 400, 100):
    mgr.save(step, args=ocp.args.PyTreeSave({"x": np.arange(1024) + step}))
"""


# gc with the bucket reported as hierarchical-namespace: the folder clean-up is recorded (the
# loopback server has no folders API).
_GC_AS_HNS = """
import json
import sys
from orbax.checkpoint._src.path import gcs_utils
from orbax_mtc.tools import cli
cleaned = []
gcs_utils.is_hierarchical_namespace_enabled = lambda path: True
gcs_utils.cleanup_hns_folders = lambda path: cleaned.append(str(path))
code = cli.main(sys.argv[1:])
print("HNS " + json.dumps(cleaned), file=sys.stderr)
sys.exit(code)
"""


def _gs_steps(server, run):
  from test_gcs import bucket_objects, committed_steps

  objects = bucket_objects(server, f"{run}/")
  return committed_steps(objects, run), sorted({name.split("/")[1] for name in objects})
