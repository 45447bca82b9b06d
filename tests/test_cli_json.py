"""The command line for scripts and people: --version, --json documents (docs/cli.md), errors
on stderr with non-zero exits, progress bars on terminals only, help text with defaults."""

from __future__ import annotations

import fcntl
import io
import json
import os
import pathlib
import pty
import re
import shutil
import struct
import subprocess
import sys
import termios
import threading
import uuid
from importlib import metadata

import orbax.checkpoint as ocp
import pytest
from conftest import flip_byte

from orbax_mtc.local.format import DATA
from orbax_mtc.local.store import read_manifest
from orbax_mtc.tools import cli, console, inspection, size
from orbax_mtc.tools import gc as persistent_gc

pytestmark = pytest.mark.timeout(180)

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


# ----------------------------------------------------------------------------- --version


def test_version_prints_the_installed_version():
  result = _run_cli("--version")
  try:
    installed = metadata.version("orbax-mtc")
  except metadata.PackageNotFoundError:
    assert result.returncode == 1 and result.stdout == ""
    assert "not installed" in result.stderr or "no installed" in result.stderr
    return
  assert result.returncode == 0, result.stderr
  assert result.stdout == f"orbax-mtc {installed}\n"
  assert "--version" in _run_cli("--help").stdout


def test_version_without_an_installed_package_is_an_error(monkeypatch, capsys):
  def missing(name):
    raise metadata.PackageNotFoundError(name)

  monkeypatch.setattr(metadata, "version", missing)
  assert cli.main(["--version"]) == 1
  out, err = capsys.readouterr()
  assert out == "" and err.startswith("orbax-mtc: error: ") and "pip install" in err


# ----------------------------------------------------------------------------- status / verify


def test_status_json_local(saved):
  local, _ = saved
  result = _run_cli("status", local, "--json")
  assert result.returncode == 0, result.stderr
  doc = _document(result.stdout, "orbax-mtc/status/1")
  assert doc["directory"] == str(local) and doc["tier"] == "local"
  assert [(s["step"], s["name"], s["state"]) for s in doc["steps"]] == [
      (4, "4", "unchecked"), (6, "6", "unchecked")]
  assert all(s["size_bytes"] > 0 and s["detail"] is None for s in doc["steps"])
  assert [(e["name"], e["step"]) for e in doc["lkg"]] == [("orbax-s6-n0-w0.restore", 6)]
  assert doc["lkg_error"] is None
  assert doc["skipped_backups"] == []
  assert "ok" not in doc  # verify's summary fields are verify's only


def test_verify_json_local_clean_and_corrupt(saved):
  local, _ = saved
  result = _run_cli("verify", local, "--json")
  assert result.returncode == 0, result.stderr
  doc = _document(result.stdout, "orbax-mtc/verify/1")
  assert (doc["ok"], doc["verified"], doc["corrupt"], doc["partial"]) == (True, 2, 0, 0)
  assert {s["state"] for s in doc["steps"]} == {"ok"}

  _flip_first_shard(local / "6")
  shutil.copytree(local / "4", local / ".tmp-8-0123abcd")
  result = _run_cli("verify", local, "--json")
  assert result.returncode == 1, result.stdout + result.stderr
  doc = _document(result.stdout, "orbax-mtc/verify/1")
  assert (doc["ok"], doc["verified"], doc["corrupt"], doc["partial"]) == (False, 1, 1, 1)
  by_name = {s["name"]: s for s in doc["steps"]}
  assert by_name["6"]["state"] == "corrupt" and "checksum mismatch" in by_name["6"]["detail"]
  assert by_name[".tmp-8-0123abcd"]["step"] is None
  assert by_name[".tmp-8-0123abcd"]["state"] == "partial"
  assert "2 corrupt or partial entries" in result.stderr


def test_verify_json_persistent(saved, capsys):
  _, persistent = saved
  assert cli.main(["verify", str(persistent), "--json"]) == 0
  out, _ = capsys.readouterr()
  doc = _document(out, "orbax-mtc/verify/1")
  assert doc["tier"] == "persistent" and doc["lkg"] == [] and doc["ok"] is True
  assert [(s["step"], s["state"]) for s in doc["steps"]] == [(0, "ok"), (4, "ok")]
  assert cli.main(["status", str(persistent), "--json"]) == 0
  doc = _document(capsys.readouterr().out, "orbax-mtc/status/1")
  assert [(s["step"], s["state"]) for s in doc["steps"]] == [(0, "unchecked"), (4, "unchecked")]


@pytest.mark.parametrize("as_json", [False, True])
def test_missing_directory_is_an_error_on_stderr(shm_dir, as_json):
  flag = ["--json"] if as_json else []
  for verb in ("status", "verify"):
    result = _run_cli(verb, shm_dir / "missing", *flag)
    assert result.returncode == 2, (verb, result.stdout, result.stderr)
    assert result.stdout == ""
    assert result.stderr.startswith(f"orbax-mtc {verb}: error: ")
    assert "no such directory" in result.stderr
  afile = shm_dir / "afile"
  afile.write_text("x")
  result = _run_cli("verify", afile, *flag)
  assert (result.returncode, result.stdout) == (2, "")
  assert "not a directory" in result.stderr


def test_verify_with_nothing_to_verify_fails(shm_dir, capsys):
  assert cli.main(["verify", str(shm_dir)]) == 2
  out, err = capsys.readouterr()
  assert out == "" and "nothing to verify" in err
  assert cli.main(["verify", str(shm_dir), "--json"]) == 2
  out, err = capsys.readouterr()
  assert out == "" and "nothing to verify" in err
  # Listing an empty directory is not an error.
  assert cli.main(["status", str(shm_dir), "--json"]) == 0
  assert _document(capsys.readouterr().out, "orbax-mtc/status/1")["steps"] == []


# ----------------------------------------------------------------------------- gc


def test_gc_json_dry_run_then_delete(orbax_dir):
  argv = ["gc", orbax_dir, "--keep-latest", "2", "--now", "2030-01-01T00:00:00+00:00",
          "--json"]
  result = _run_cli(*argv)
  assert result.returncode == 0, result.stderr
  doc = _document(result.stdout, "orbax-mtc/gc/1")
  assert doc["dry_run"] is True and doc["error"] is None
  assert doc["now"] == "2030-01-01T00:00:00+00:00"
  assert doc["policy"] == {"keep_latest": 2, "keep_every": None, "hourly": 0, "daily": 0,
                           "weekly": 0}
  assert doc["keep"] == [300, 400, 500] and doc["delete"] == [0, 100, 200]
  assert doc["deleted"] == []
  steps = {s["step"]: s for s in doc["steps"]}
  assert [s["step"] for s in doc["steps"]] == [0, 100, 200, 300, 400, 500]
  assert steps[500]["complete"] is False and steps[500]["reasons"] == ["being written"]
  assert steps[400]["reasons"] == ["newest", "latest 2"] and steps[400]["action"] == "keep"
  assert steps[0]["action"] == "delete" and steps[0]["reasons"] == []
  assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?\+00:00", steps[0]["time"])
  assert _steps(orbax_dir) == [0, 100, 200, 300, 400]

  result = _run_cli(*argv, "--delete")
  assert result.returncode == 0, result.stderr
  doc = _document(result.stdout, "orbax-mtc/gc/1")
  assert doc["dry_run"] is False and doc["deleted"] == [0, 100, 200]
  assert [s["step"] for s in doc["steps"] if s["deleted"]] == [0, 100, 200]
  assert _steps(orbax_dir) == [300, 400]


def test_gc_errors_go_to_stderr(orbax_dir, shm_dir, capsys):
  cases = [
      (["gc", str(orbax_dir), "--json"], "no retention rule given"),
      (["gc", str(shm_dir / "missing"), "--keep-latest", "1", "--json"], "is not a directory"),
      (["gc", str(orbax_dir), "--keep-every", "0", "--delete"], "keep_every must be an int"),
  ]
  for argv, fragment in cases:
    assert cli.main(argv) == 2, argv
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("orbax-mtc gc: error: ") and fragment in err, argv
  assert _steps(orbax_dir) == [0, 100, 200, 300, 400]


def test_gc_reports_a_failed_deletion(orbax_dir, monkeypatch, capsys):
  real = persistent_gc.delete_step

  def fail_on_100(path):
    if path.name == "100":
      raise PermissionError("no delete permission")
    real(path)

  monkeypatch.setattr(persistent_gc, "delete_step", fail_on_100)
  assert cli.main(["gc", str(orbax_dir), "--keep-latest", "1", "--delete", "--json"]) == 1
  out, err = capsys.readouterr()
  doc = _document(out, "orbax-mtc/gc/1")
  assert doc["deleted"] == [0] and "no delete permission" in doc["error"]
  assert "1 of 4 step(s) deleted" in err and "step 100" in err
  assert _steps(orbax_dir) == [100, 200, 300, 400]


# ----------------------------------------------------------------------------- size


def test_size_json(tmp_path, capsys):
  assert cli.main(["size", "--state-size", "768GiB", "--nodes", "16", "--accelerator", "tpu",
                   "--json"]) == 0
  doc = _document(capsys.readouterr().out, "orbax-mtc/size/1")
  assert doc == {
      "schema": "orbax-mtc/size/1", "accelerator": "tpu", "nodes": 16, "peers": 0,
      "local_checkpoint_bytes": 48 * size.GIB,
      "local_checkpoint_source": "768.00 GiB state / 16 nodes holding one copy",
      "headroom": 1.1, "resident_steps": 2, "factor": 2.2,
      "ramdisk_bytes": -(-(48 * size.GIB * 22) // 10), "in_memory_volume_size_gib": 106,
      "in_memory_volume_size": "106Gi", "rendered": None}
  out_dir = tmp_path / "out"
  assert cli.size_main(["--state-size", "64GiB", "--nodes", "4", "--accelerator", "gpu",
                        "--render", str(out_dir), "--bucket", "ckpt", "--machine-type",
                        "a3-megagpu-8g", "--job-name", "run-1", "--json"]) == 0
  doc = _document(capsys.readouterr().out, "orbax-mtc/size/1")
  assert doc["peers"] == 1 and doc["in_memory_volume_size"] == "106Gi"
  assert doc["rendered"] == [str(out_dir / name) for name in
                             ("checkpoint-configuration.yaml", "jobset-maxtext.yaml", "env.sh")]
  assert all(pathlib.Path(p).is_file() for p in doc["rendered"])


def test_size_json_error_leaves_stdout_empty():
  result = _run_cli("size", "--state-size", "8 parsecs", "--accelerator", "tpu", "--json")
  assert result.returncode == 2 and result.stdout == ""
  assert result.stderr.startswith("orbax-mtc size: error: ")


# ----------------------------------------------------------------------------- progress bars


class _Terminal(io.StringIO):
  def isatty(self) -> bool:
    return True


def test_progress_draws_on_a_terminal_only_and_never_when_disabled():
  for stream, enabled, drawn in ((_Terminal(), True, True), (io.StringIO(), True, False),
                                 (_Terminal(), False, False)):
    with console.progress(total=3, desc="work", unit="step", enabled=enabled, file=stream,
                      delay=0, mininterval=0) as bar:
      for _ in range(3):
        bar.update(1)
    assert ("work" in stream.getvalue()) == drawn, (enabled, stream.getvalue())
    if drawn:
      assert "3/3" in stream.getvalue()


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


def test_verify_advances_a_bar_over_the_bytes_and_none_in_json_mode(saved, monkeypatch,
                                                                     capsys):
  local, persistent = saved
  recorder = _Recorder()
  monkeypatch.setattr(console, "progress", recorder)
  for directory in (local, persistent):
    assert cli.main(["verify", str(directory)]) == 0
    bar = recorder.bars[-1]
    sizes = [r.size_bytes for r in inspection.reports_for(str(directory), check=False)[1]]
    assert bar.enabled and bar.total == sum(sizes) > 0 and bar.n == bar.total
  assert cli.main(["verify", str(local), "--json"]) == 0
  assert recorder.bars[-1].enabled is False
  capsys.readouterr()


def test_gc_delete_advances_a_bar_per_step_and_none_in_json_mode(orbax_dir, monkeypatch,
                                                                 capsys):
  recorder = _Recorder()
  monkeypatch.setattr(console, "progress", recorder)
  assert cli.main(["gc", str(orbax_dir), "--keep-latest", "4", "--delete"]) == 0
  (bar,) = recorder.bars
  assert (bar.enabled, bar.total, bar.n, bar.desc) == (True, 1, 1, "gc: deleting")
  assert "deleted step 0" in capsys.readouterr().out
  assert cli.main(["gc", str(orbax_dir), "--keep-latest", "3", "--delete", "--json"]) == 0
  assert recorder.bars[-1].enabled is False and recorder.bars[-1].n == 1
  _document(capsys.readouterr().out, "orbax-mtc/gc/1")
  assert cli.main(["gc", str(orbax_dir), "--keep-latest", "3"]) == 0
  assert len(recorder.bars) == 2  # a dry run deletes nothing: no bar
  capsys.readouterr()


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


@pytest.mark.timeout(300)
def test_bench_suite_draws_a_bar_on_a_terminal_and_keeps_stdout_clean(tmp_path):
  argv = [sys.executable, "-m", "orbax_mtc", "bench", "suite", "--sizes", "1", "--procs", "1",
          "--reps", "1", "--contenders", "limits", "--ondemand-reps", "0", "--scratch",
          str(tmp_path), "--out", str(tmp_path / "out")]
  code, out, terminal = _run_with_terminal_stderr(argv)
  assert code == 0, out + terminal
  assert re.search(r"bench suite: +100%.*1/1", terminal), terminal
  assert "\r" not in out and "bench suite:" not in out
  assert "measured 1 MiB" in out and "Targets" in out
  code, out, terminal = _run_with_terminal_stderr([*argv, "--quiet"])
  assert code == 0, out + terminal
  assert "bench suite:" not in terminal and "measured 1 MiB" not in out


# ----------------------------------------------------------------------------- help text


def _options(parser):
  return [a for a in parser._actions
          if a.option_strings and a.help != "==SUPPRESS==" and a.dest != "help"]


@pytest.mark.parametrize("module", ["orbax_mtc.tools.demo", "orbax_mtc.tools.bench.suite",
                                    "orbax_mtc.tools.bench.goodput"])
def test_every_demo_and_bench_option_has_help_with_its_default(module):
  import importlib

  parser = importlib.import_module(module)._parser()
  options = _options(parser)
  assert len(options) >= 10
  for action in options:
    assert action.help and "default" in action.help, (action.option_strings, action.help)
    if "%(default)s" in action.help:
      assert action.default is not None, action.option_strings
  text = " ".join(parser.format_help().split())
  assert "%(" not in text and "(default: None)" not in text


def test_bench_ondemand_help_shows_defaults():
  result = _run_cli("bench", "ondemand", "--help")
  assert result.returncode == 0
  text = " ".join(result.stdout.split())
  for fragment in ("(default: 64 512)", "(default: 2)", "(default: 3)", "(default: none)"):
    assert fragment in text, fragment
  assert "--worker" not in text


def test_launch_help_says_it_is_a_single_host_launcher():
  result = _run_cli("launch", "--help")
  assert result.returncode == 0
  text = " ".join(result.stdout.split())
  assert "single-host launcher for tests and demos" in text
  assert "mtc.distributed.initialize()" in text and "own launcher" in text


def test_bench_without_a_benchmark_is_a_usage_error(capsys):
  assert cli.main(["bench"]) == 2
  out, err = capsys.readouterr()
  assert out == "" and "usage: orbax-mtc bench" in err
  assert cli.main(["bench", "--help"]) == 0
  out, err = capsys.readouterr()
  assert "usage: orbax-mtc bench" in out and err == ""


# ----------------------------------------------------------------------------- gc on gs://


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


def test_gc_on_gs_deletes_through_orbax_and_cleans_hns_folders(gcs):
  from gcs_server import BUCKET

  env = _env(**gcs.env())
  for hns in (False, True):
    run = f"gc-{uuid.uuid4().hex[:8]}"
    directory = f"gs://{BUCKET}/{run}"
    saved = subprocess.run([sys.executable, "-c", _SAVE_STEPS, directory], env=env,
                           capture_output=True, text=True, timeout=120, check=False)
    assert saved.returncode == 0, saved.stderr[-3000:]
    assert _gs_steps(gcs, run) == ([0, 100, 200, 300], ["0", "100", "200", "300"])
    argv = ["gc", directory, "--keep-latest", "1", "--delete", "--json"]
    if hns:
      result = subprocess.run([sys.executable, "-c", _GC_AS_HNS, *argv], env=env,
                              capture_output=True, text=True, timeout=120, check=False)
    else:
      result = _run_cli(*argv, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    doc = _document(result.stdout, "orbax-mtc/gc/1")
    assert doc["deleted"] == [0, 100, 200] and doc["keep"] == [300]
    assert _gs_steps(gcs, run) == ([300], ["300"])  # every object of a deleted step is gone
    if hns:
      (line,) = [ln for ln in result.stderr.splitlines() if ln.startswith("HNS ")]
      assert json.loads(line[4:]) == [f"{directory}/{step}" for step in (0, 100, 200)]
  status = _run_cli("status", directory, "--json", env=env)
  assert status.returncode == 0, status.stderr[-3000:]
  doc = _document(status.stdout, "orbax-mtc/status/1")
  assert [(s["step"], s["state"]) for s in doc["steps"]] == [(300, "unchecked")]
