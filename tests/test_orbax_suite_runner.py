"""tools/orbax_suites: the runner that reproduces docs/orbax-conformance.md from a clone.

The upstream test files are fetched, never committed, and these tests reach no network: the
runner runs a small stand-in suite of our own (a module that builds Orbax's CheckpointManager
under the name the runner rebinds) in one real JAX process, and the fetch step is checked
against files served from a local folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import subprocess
import sys

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
SUITES = REPO_ROOT / "tools" / "orbax_suites"
RUNNER = SUITES / "run_suite.py"

STAND_IN_SUITE = '''
"""Stand-in for Orbax's checkpoint_manager_test.py (the runner rebinds the names below)."""
import numpy as np
import orbax.checkpoint as ocp
import pytest
from orbax.checkpoint import checkpoint_manager

CheckpointManager = checkpoint_manager.CheckpointManager
CheckpointManagerOptions = checkpoint_manager.CheckpointManagerOptions


def test_save_and_restore(tmp_path):
  with CheckpointManager(tmp_path / "ckpt") as mgr:
    mgr.save(1, args=ocp.args.StandardSave({"a": np.arange(6)}))
    mgr.wait_until_finished()
    out = mgr.restore(1, args=ocp.args.StandardRestore({"a": np.arange(6)}))
  np.testing.assert_array_equal(out["a"], np.arange(6))


def test_class_under_test_is_rebound():
  assert CheckpointManager.__module__.split(".")[0] == "orbax_mtc"
  assert issubclass(CheckpointManager, checkpoint_manager.CheckpointManager)


def test_alias_is_rebound():
  assert CheckpointManagerOptions.__module__.split(".")[0] == "orbax_mtc"


def test_fails_on_purpose():
  assert False, "stand-in failure"


def test_skipped_on_purpose():
  pytest.skip("stand-in skip")
'''


def _stand_in_suite_dir(root: pathlib.Path) -> pathlib.Path:
  suite = root / "suite"
  (suite / "orbax/checkpoint/_src/testing/oss").mkdir(parents=True)
  (suite / "checkpoint_manager_test.py").write_text(STAND_IN_SUITE)
  for rel in ("orbax/checkpoint/_src/testing/multiprocess_test.py",
              "orbax/checkpoint/_src/testing/oss/multiprocess_test.py"):
    (suite / rel).write_text('"""Stand-in for an upstream helper the runner imports."""\n')
  return suite


def _run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
  env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "JAX_PLATFORMS": "cpu"}
  return subprocess.run([sys.executable, str(RUNNER), *args], env=env, capture_output=True,
                        text=True, timeout=timeout, start_new_session=True)


@pytest.mark.timeout(300)
def test_runner_runs_a_suite_with_our_class_swapped_in_and_merges_outcomes(tmp_path):
  suite = _stand_in_suite_dir(tmp_path)
  out = tmp_path / "run"
  done = _run("--suite-dir", str(suite), "--num-processes", "1", "--cm",
              "orbax_mtc:CheckpointManager", "--alias",
              "CheckpointManagerOptions=orbax_mtc:CheckpointManagerOptions",
              "--count-constructions", "--out", str(out))
  text = done.stdout + done.stderr
  # One test fails on purpose: the runner says so in its last line and its exit status.
  assert done.returncode == 1, text[-3000:]
  assert done.stdout.strip().splitlines()[-1] == "3 passed, 1 failed, 1 skipped", text[-3000:]
  summary = json.loads((out / "summary.json").read_text())
  tests = {nodeid.split("::")[-1]: v for nodeid, v in summary["tests"].items()}
  assert tests["test_save_and_restore"]["outcome"] == "passed"
  # The manager the stand-in built was ours (the runner's construction counter).
  assert tests["test_save_and_restore"]["constructed"] == {"under_test": 1, "other": 0}
  assert tests["test_class_under_test_is_rebound"]["outcome"] == "passed"
  assert tests["test_alias_is_rebound"]["outcome"] == "passed"
  assert "stand-in failure" in tests["test_fails_on_purpose"]["reason"]
  assert tests["test_skipped_on_purpose"]["outcome"] == "skipped"
  assert summary["num_processes"] == 1 and summary["cm"] == "orbax_mtc:CheckpointManager"


def test_runner_without_the_upstream_files_says_to_fetch_them(tmp_path):
  done = _run("--suite-dir", str(tmp_path / "empty"), "--num-processes", "1", timeout=60)
  assert done.returncode == 2
  assert "lacks checkpoint_manager_test.py" in done.stderr and "--fetch" in done.stderr


def test_runner_fetch_refuses_bytes_that_are_not_the_pinned_files(tmp_path):
  # A "mirror" whose files exist but are not google/orbax's at the pinned commit.
  mirror = tmp_path / "mirror"
  for rel in ("checkpoint/orbax/checkpoint/checkpoint_manager_test.py",):
    (mirror / rel).parent.mkdir(parents=True)
    (mirror / rel).write_text("not the upstream file\n")
  suite = tmp_path / "suite"
  done = _run("--fetch", "--base-url", mirror.as_uri() + "/", "--suite-dir", str(suite),
              timeout=60)
  assert done.returncode == 2
  assert "not the pinned" in done.stderr and "SHA-256" in done.stderr
  assert not (suite / "checkpoint_manager_test.py").exists()


def test_fetch_puts_each_file_in_place_checked_and_keeps_what_is_there(tmp_path):
  sys.path.insert(0, str(SUITES))
  try:
    import fetch_upstream
  finally:
    sys.path.remove(str(SUITES))
  mirror = tmp_path / "mirror"
  files = []
  for i, (rel, place) in enumerate((("a/one.py", "one.py"), ("b/c/two.py", "pkg/two.py"))):
    data = f"# file {i}\n".encode()
    (mirror / rel).parent.mkdir(parents=True, exist_ok=True)
    (mirror / rel).write_bytes(data)
    files.append(fetch_upstream.UpstreamFile(rel, place, hashlib.sha256(data).hexdigest()))
  suite = tmp_path / "suite"
  assert fetch_upstream.missing(suite, files) == ["one.py", "pkg/two.py"]
  base = mirror.as_uri() + "/"
  assert fetch_upstream.fetch(suite, base_url=base, files=files) == ["one.py", "pkg/two.py"]
  assert (suite / "pkg/two.py").read_bytes() == b"# file 1\n"
  assert fetch_upstream.missing(suite, files) == []
  # Already there with the pinned hash: not downloaded again (the mirror is gone).
  (mirror / "a/one.py").unlink()
  assert fetch_upstream.fetch(suite, base_url=base, files=files) == []
  # Changed locally: downloaded again, and a mirror without it is a clear error.
  (suite / "one.py").write_text("edited\n")
  with pytest.raises(fetch_upstream.FetchError, match="could not download .*a/one.py"):
    fetch_upstream.fetch(suite, base_url=base, files=files)
  # The pinned list names the four upstream files the runner and its docs need.
  assert [f.place_at for f in fetch_upstream.FILES] == [
      "checkpoint_manager_test.py", "emergency_checkpoint_manager_test.py",
      "orbax/checkpoint/_src/testing/multiprocess_test.py",
      "orbax/checkpoint/_src/testing/oss/multiprocess_test.py"]
  assert all(len(f.sha256) == 64 for f in fetch_upstream.FILES)
