"""`orbax-mtc status DIR` / `orbax-mtc verify DIR` on local (RAM) and persistent folders."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from orbax_mtc.local.format import DATA
from orbax_mtc.local.store import read_manifest
from orbax_mtc.tools import cli, inspection

pytestmark = pytest.mark.timeout(120)

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run_cli(*args):
  env = dict(os.environ)
  path = env.get("PYTHONPATH")
  env["PYTHONPATH"] = f"{REPO_ROOT}{os.pathsep}{path}" if path else str(REPO_ROOT)
  env["JAX_PLATFORMS"] = "cpu"
  return subprocess.run([sys.executable, "-m", "orbax_mtc", *map(str, args)], env=env,
                        capture_output=True, text=True, timeout=90, check=False)


def _flip_first_shard(step_dir):
  manifest = read_manifest(step_dir)
  shard = manifest.items["state"].leaves[0].shards[0]
  with open(step_dir / DATA, "r+b") as f:
    f.seek(shard.offset + shard.nbytes - 1)
    byte = f.read(1)
    f.seek(shard.offset + shard.nbytes - 1)
    f.write(bytes([byte[0] ^ 0x80]))


def _lines_for(output, name):
  return [line for line in output.splitlines() if line.rstrip().endswith(f"  {name}")
          or f"  {name}  " in line]


def test_status_lists_local_steps_and_lkg(saved):
  local, _ = saved
  result = _run_cli("status", local)
  assert result.returncode == 0, result.stderr
  assert "local tier" in result.stdout
  assert _lines_for(result.stdout, "4") and _lines_for(result.stdout, "6")
  assert "orbax-s6-n0-w0.restore -> step 6" in result.stdout


def test_verify_clean_local_exits_0(saved):
  local, _ = saved
  result = _run_cli("verify", local)
  assert result.returncode == 0, result.stdout + result.stderr
  for step in ("4", "6"):
    (line,) = _lines_for(result.stdout, step)
    assert " ok " in line


def test_verify_corrupt_local_step_exits_1_and_names_it(saved):
  local, _ = saved
  _flip_first_shard(local / "6")
  result = _run_cli("verify", local)
  assert result.returncode == 1, result.stdout + result.stderr
  (line,) = _lines_for(result.stdout, "6")
  assert "corrupt" in line and "checksum mismatch" in line
  (line,) = _lines_for(result.stdout, "4")
  assert " ok " in line
  assert "1 corrupt or partial" in result.stderr


def test_verify_reports_leftover_tmp_as_partial(saved, capsys):
  local, _ = saved
  shutil.copytree(local / "6", local / ".tmp-8-0123abcd")
  assert inspection.verify_main(str(local)) == 1
  out = capsys.readouterr().out
  (line,) = _lines_for(out, ".tmp-8-0123abcd")
  assert "partial" in line
  assert cli.main(["status", str(local)]) == 0  # status only lists


def test_verify_truncated_and_missing_data(saved, capsys):
  local, _ = saved
  os.truncate(local / "6" / DATA, 10)
  (local / "4" / DATA).unlink()
  assert cli.main(["verify", str(local)]) == 1
  out = capsys.readouterr().out
  assert "corrupt" in _lines_for(out, "6")[0]
  assert "corrupt" in _lines_for(out, "4")[0]


def test_status_and_verify_persistent(saved, capsys):
  _, persistent = saved
  assert cli.main(["status", str(persistent)]) == 0
  out = capsys.readouterr().out
  assert "persistent tier" in out
  assert _lines_for(out, "0") and _lines_for(out, "4")
  assert cli.main(["verify", str(persistent)]) == 0
  out = capsys.readouterr().out
  assert " ok " in _lines_for(out, "4")[0] and " ok " in _lines_for(out, "0")[0]


def test_verify_persistent_unfinished_and_damaged(saved, capsys):
  _, persistent = saved
  (persistent / "8.orbax-checkpoint-tmp-1234").mkdir()
  shutil.copytree(persistent / "0", persistent / "12")
  (persistent / "12" / "_CHECKPOINT_METADATA").unlink()
  assert cli.main(["verify", str(persistent)]) == 1
  out = capsys.readouterr().out
  assert "partial" in _lines_for(out, "8.orbax-checkpoint-tmp-1234")[0]
  assert "partial" in _lines_for(out, "12")[0]
  shutil.rmtree(persistent / "8.orbax-checkpoint-tmp-1234")
  shutil.rmtree(persistent / "12")
  # Damage the array data of step 4.
  for data in (persistent / "4").rglob("d/*"):
    data.unlink()
  assert cli.main(["verify", str(persistent)]) == 1
  out = capsys.readouterr().out
  assert "corrupt" in _lines_for(out, "4")[0]
  assert " ok " in _lines_for(out, "0")[0]


def test_not_a_directory(shm_dir, capsys):
  path = shm_dir / "afile"
  path.write_text("x")
  assert cli.main(["verify", str(path)]) == 2
  out, err = capsys.readouterr()
  assert out == "" and "not a directory" in err
  assert cli.main(["status", str(shm_dir / "missing")]) == 2
  out, err = capsys.readouterr()
  assert out == "" and "no such directory" in err


def test_empty_directory(shm_dir, capsys):
  # Nothing to verify is not a success: a mistyped path must not pass for a verified one.
  assert cli.main(["verify", str(shm_dir)]) == 2
  out, err = capsys.readouterr()
  assert out == "" and "nothing to verify" in err
  assert cli.main(["status", str(shm_dir)]) == 0
  assert "no steps" in capsys.readouterr().out
