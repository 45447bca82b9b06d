"""The `orbax-mtc` command at its edges (issue 44, point 12): empty and unreachable folders,
bad numbers named by their flag, nothing on stdout before a refusal, -V, no Orbax warning per
healthy step, and `--json` one document on stdout for every bench verb."""

from __future__ import annotations

import importlib
import json
import logging
import pathlib
import re
import socket

import numpy as np
import orbax.checkpoint as ocp
import pytest

import orbax_mtc
from orbax_mtc.tools import cli

pytestmark = pytest.mark.timeout(120)

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs" / "cli.md"


def _usage_error(argv, capsys) -> str:
  """stderr of a command argparse refuses (exit 2, nothing on stdout)."""
  with pytest.raises(SystemExit) as exit_info:
    cli.main(argv)
  out, err = capsys.readouterr()
  assert exit_info.value.code == 2 and out == ""
  return err


@pytest.mark.parametrize("verb", [["status"], ["verify"], ["gc", "--keep-latest", "1"]])
def test_an_empty_directory_is_refused_not_read_as_the_current_one(verb, capsys):
  err = _usage_error([verb[0], "", *verb[1:]], capsys)
  assert "argument directory: '' is an empty path" in err and "write '.'" in err


@pytest.fixture
def closed_port(monkeypatch):
  """STORAGE_EMULATOR_HOST on a loopback port that refuses connections (bound, never
  listening): Cloud Storage without a network, within this machine."""
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{port}")
    yield port


@pytest.mark.parametrize("argv", [["status", "gs://mtc-test/run"],
                                  ["verify", "gs://mtc-test/run", "--json"],
                                  ["gc", "gs://mtc-test/run", "--keep-latest", "1"]])
def test_unreachable_cloud_storage_is_one_line_and_exit_2(argv, closed_port, capsys):
  assert cli.main(argv) == 2
  out, err = capsys.readouterr()
  assert out == ""
  (line,) = err.splitlines()  # no retries logged, no traceback
  assert line.startswith(f"orbax-mtc {argv[0]}: error: gs://mtc-test/run: cannot reach Cloud "
                         f"Storage at 127.0.0.1:{closed_port} (connection refused)")
  assert "STORAGE_EMULATOR_HOST" in line


def test_size_with_a_bad_render_option_prints_nothing_and_writes_nothing(tmp_path, capsys):
  outdir = tmp_path / "rendered"
  assert cli.main(["size", "--accelerator", "tpu", "--state-size", "8GiB", "--render",
                   str(outdir), "--bucket", "Not_A_Bucket", "--machine-type",
                   "ct6e-standard-4t", "--job-name", "run-1"]) == 2
  out, err = capsys.readouterr()
  assert out == "" and err.startswith("orbax-mtc size: error: --bucket 'Not_A_Bucket'")
  assert not outdir.exists()


@pytest.mark.parametrize("flag, value, rule", [
    ("--keep-latest", "-1", ">= 0"), ("--keep-every", "0", ">= 1"), ("--hourly", "-2", ">= 0"),
    ("--daily", "x", ">= 0"), ("--weekly", "-1", ">= 0")])
def test_gc_range_errors_name_the_flag(flag, value, rule, tmp_path, capsys):
  err = _usage_error(["gc", str(tmp_path), flag, value], capsys)
  assert f"argument {flag}: " in err and rule in err and value in err
  assert "RetentionPolicy" not in err


@pytest.mark.parametrize("argv", [["--state-size", "-5GiB"], ["--state-size=-5GiB"],
                                  ["--state-size", "-0.5TiB", "--json"]])
def test_a_negative_state_size_is_refused_for_what_it_is(argv, capsys):
  assert cli.main(["size", "--accelerator", "tpu", *argv]) == 2
  out, err = capsys.readouterr()
  assert out == ""
  assert re.fullmatch(r"orbax-mtc size: error: --state-size: a checkpoint size must be more "
                      r"than 0 bytes, got '-[\d.]+[GT]iB'\n", err), err


@pytest.mark.parametrize("flag", ["-V", "--version"])
def test_short_and_long_version_flags(flag, capsys):
  assert cli.main([flag]) == 0
  assert capsys.readouterr() == (f"orbax-mtc {orbax_mtc.__version__}\n", "")


@pytest.fixture
def healthy_orbax_dir(shm_dir):
  """Three steps written by plain Orbax (items "default"), every one finalized."""
  with ocp.CheckpointManager(shm_dir / "persistent", options=ocp.CheckpointManagerOptions(
      enable_async_checkpointing=False)) as mgr:
    for step in (0, 10, 20):
      mgr.save(step, args=ocp.args.StandardSave({"x": np.arange(4) + step}))
  return shm_dir / "persistent"


def _warnings(caplog) -> list[str]:
  return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_verify_reads_a_healthy_persistent_folder_without_a_warning(healthy_orbax_dir, caplog,
                                                                     capsys):
  with caplog.at_level(logging.WARNING):
    assert cli.main(["verify", str(healthy_orbax_dir)]) == 0
  assert "all 3 step(s) verified" in capsys.readouterr().out
  assert _warnings(caplog) == []


def test_gc_on_steps_of_an_older_orbax_logs_no_warning_per_step(healthy_orbax_dir, caplog,
                                                                capsys):
  # Older Orbax wrote no step metadata file: gc takes the folder's time, and says nothing.
  for step in (0, 10, 20):
    (healthy_orbax_dir / str(step) / "_CHECKPOINT_METADATA").unlink()
  with caplog.at_level(logging.WARNING):
    assert cli.main(["gc", str(healthy_orbax_dir), "--keep-latest", "1", "--json"]) == 0
  assert json.loads(capsys.readouterr().out)["delete"] == [0, 10]
  assert _warnings(caplog) == []


_JSON_VERBS = {"goodput": "goodput", "failure-cost": "failure_cost", "ondemand": "ondemand",
               "elastic-scale": "elastic_scale", "every-step": "every_step", "suite": "suite"}


@pytest.mark.parametrize("verb", sorted(_JSON_VERBS))
def test_every_bench_verb_takes_json_as_a_flag_with_a_documented_schema(verb):
  module = importlib.import_module(f"orbax_mtc.tools.bench.{_JSON_VERBS[verb]}")
  assert module._parser().parse_args(["--json"]).json is True
  assert module.SCHEMA == f"orbax-mtc/bench-{verb}/1"
  docs = DOCS.read_text()
  assert f"### `orbax-mtc bench {verb} --json`: `{module.SCHEMA}`" in docs


def test_docs_describe_every_bench_verb():
  docs = DOCS.read_text()
  for verb in cli._BENCHMARKS:
    assert f"\n- `bench {verb}` (defaults: " in docs, verb
    assert f"orbax-mtc bench {verb} [options]" in docs, verb


def test_bench_ondemand_json_is_one_document_on_stdout(capsys):
  from orbax_mtc.tools.bench import ondemand, output

  runs = [{"mib": 1, "step": 7, "sigterm_to_durable_s": s, "notice_s": 0.5,
           "agreement_s": 0.01, "local_s": 0.1, "peers_s": 0.2, "persistent_s": 0.3}
          for s in (1.0, 3.0, 2.0)]
  runs[0]["notice_s"] = float("nan")  # no notice recorded: null, not invalid JSON
  summary = ondemand.summarize(runs, [1])
  assert summary[0]["sigterm_to_durable_s"] == 2.0
  output.emit(True, ondemand.document(2, 3, runs, summary),
              ondemand.markdown(summary, 2, 3))
  out, err = capsys.readouterr()
  doc = json.loads(out)
  assert doc["schema"] == "orbax-mtc/bench-ondemand/1" and doc["runs"][0]["notice_s"] is None
  assert "| 1 MiB | 2.00 s | 0.7 % |" in err


def test_bench_ondemand_keeps_the_older_json_file_form():
  from orbax_mtc.tools.bench import ondemand

  args = ondemand._parser().parse_args(["--json", "out.json", "--mib", "1"])
  assert args.json == "out.json" and args.mib == [1]
  assert ondemand._parser().parse_args(["--json", "--mib", "1"]).json is True
  assert ondemand._parser().parse_args([]).json is False


@pytest.mark.parametrize("argv, message", [
    (["goodput", "--procs", "1"], "--procs must be >= 2"),
    (["failure-cost", "--procs", "3"], "--procs must be even and >= 2"),
    (["elastic-scale", "--hosts", "7"], "every --hosts value must be even")])
def test_bench_bad_arguments_are_usage_errors(argv, message, capsys):
  err = _usage_error(["bench", *argv], capsys)
  assert err.splitlines()[-1].startswith(f"orbax-mtc bench {argv[0]}: error: {message}")
