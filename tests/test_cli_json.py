"""The command line for scripts and people: --version, --json documents (docs/cli.md), errors
on stderr with non-zero exits, progress bars on terminals only, help text with defaults."""

from __future__ import annotations

import pathlib
import re
import shutil
from importlib import metadata

import pytest
from cli_support import _document, _flip_first_shard, _run_cli, _steps

from orbax_mtc.tools import cli, size
from orbax_mtc.tools import gc as persistent_gc

pytestmark = pytest.mark.timeout(180)


def test_version_prints_the_package_version():
  import orbax_mtc

  result = _run_cli("--version")
  assert result.returncode == 0, result.stderr
  assert result.stdout == f"orbax-mtc {orbax_mtc.__version__}\n"
  assert "--version" in _run_cli("--help").stdout


def test_version_needs_no_installed_distribution(monkeypatch, capsys):
  # A source checkout on PYTHONPATH, never pip-installed, still says what it is.
  import orbax_mtc

  def missing(name):
    raise metadata.PackageNotFoundError(name)

  monkeypatch.setattr(metadata, "version", missing)
  assert cli.main(["--version"]) == 0
  assert capsys.readouterr() == (f"orbax-mtc {orbax_mtc.__version__}\n", "")


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
  ]
  for argv, fragment in cases:
    assert cli.main(argv) == 2, argv
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("orbax-mtc gc: error: ") and fragment in err, argv
  with pytest.raises(SystemExit) as exit_info:  # a usage error: argparse names the flag
    cli.main(["gc", str(orbax_dir), "--keep-every", "0", "--delete", "--json"])
  out, err = capsys.readouterr()
  assert exit_info.value.code == 2 and out == ""
  assert err.splitlines()[-1] == ("orbax-mtc gc: error: argument --keep-every: must be a whole "
                                  "number >= 1, got 0")
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
