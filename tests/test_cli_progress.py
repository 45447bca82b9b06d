"""The command line's progress bars (terminals only, never in --json mode) and help text (every option with its default)."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import uuid

import pytest
from cli_support import (
  _GC_AS_HNS,
  _SAVE_STEPS,
  _document,
  _env,
  _gs_steps,
  _options,
  _Recorder,
  _run_cli,
  _run_with_terminal_stderr,
  _Terminal,
)

from orbax_mtc.tools import cli, console, inspection

pytestmark = pytest.mark.timeout(180)


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


@pytest.mark.parametrize("module", ["orbax_mtc.tools.demo", "orbax_mtc.tools.bench.suite",
                                    "orbax_mtc.tools.bench.goodput",
                                    "orbax_mtc.tools.bench.every_step"])
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
