"""Helpers and fixtures shared by test_maxtext_real.py and test_maxtext_real_jobs.py."""

from __future__ import annotations

import contextlib
import io
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import threading
import uuid

import maxtext_env  # noqa: E402
import pytest
import warm_start

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))


REPO_ROOT = maxtext_env.REPO_ROOT


RUN_TIMEOUT_S = 240  # one MaxText run takes ~20 s here; a hang fails the test, never CI


BASELINE_STEPS = 40


MODEL = ["run_name=t", "dataset_type=synthetic", "per_device_batch_size=1",
         "max_target_length=128", "base_emb_dim=128", "base_num_query_heads=2",
         "base_num_kv_heads=2", "base_mlp_dim=256", "base_num_decoder_layers=2", "head_dim=64",
         "vocab_size=256", "hardware=cpu", "enable_tensorboard=false",
         "attention=dot_product", "learning_rate_schedule_steps=1000",
         "enable_checkpointing=true"]


MAXTEXT_TRAIN = "maxtext.trainers.pre_train.train"


PATCHED_TRAIN = "maxtext_patch.train"


# What a MaxText process imports before it trains (about 10 s of CPU here): the runs are
# forks of one interpreter that has (tests/warm_start.py).
MAXTEXT_PRELOAD = (MAXTEXT_TRAIN, PATCHED_TRAIN)


_LOSS = re.compile(r"completed step: (\d+), .*? loss: ([0-9.]+)")


_RESTORED = re.compile(r"restoring from this run's directory step (\d+)")


_TIER = re.compile(r"orbax-mtc: restored step (\d+) from the (\w+) tier")


@pytest.fixture(scope="module")
def venv_python() -> str:
  try:
    maxtext_env.find_python312()
  except maxtext_env.NoPython312Error as e:
    pytest.skip(f"real-MaxText tests need Python 3.12: {e}")
  return str(maxtext_env.ensure_venv())


@pytest.fixture(scope="module")
def base_yml(venv_python) -> str:
  out = subprocess.run(
      [venv_python, "-c", "import maxtext, os; print(os.path.dirname(maxtext.__file__))"],
      capture_output=True, text=True, check=True, env=_env())
  return str(pathlib.Path(out.stdout.strip()) / "configs" / "base.yml")


def _env(**extra: str) -> dict[str, str]:
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("ORBAX_MTC_", "JAX_", "XLA_", "PYTHON"))}
  env.update(PYTHONPATH=str(REPO_ROOT), JAX_PLATFORMS="cpu", **extra)
  return env


class Run:
  """One MaxText process (or one `orbax-mtc launch` job): its output lines as they come."""

  def __init__(self, command: list[str], env: dict[str, str],
               metrics: pathlib.Path | None = None):
    self.metrics = metrics
    self.lines: list[str] = []
    self._changed = threading.Condition()
    self.proc = warm_start.spawn(command[0], MAXTEXT_PRELOAD, _env(), command, env,
                                 str(REPO_ROOT))
    if self.proc is None:
      self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   env=env, start_new_session=True, cwd=REPO_ROOT)
    self._reader = threading.Thread(target=self._read, daemon=True)
    self._reader.start()

  def _read(self) -> None:
    for line in io.TextIOWrapper(self.proc.stdout, encoding="utf-8", errors="replace"):
      with self._changed:
        self.lines.append(line.rstrip("\n"))
        self._changed.notify_all()
    with self._changed:
      self._changed.notify_all()

  def wait_for(self, pattern: str, timeout: float = RUN_TIMEOUT_S) -> re.Match:
    """The first output line matching `pattern`; fails when the process ends without one."""
    regex = re.compile(pattern)
    seen = 0
    with self._changed:
      while True:
        for line in self.lines[seen:]:
          found = regex.search(line)
          if found:
            return found
        seen = len(self.lines)
        if not self._reader.is_alive():
          pytest.fail(f"no line matching {pattern!r}; the process ended "
                      f"(status {self.proc.poll()}):\n{self.tail()}")
        if not self._changed.wait(timeout):
          pytest.fail(f"no line matching {pattern!r} within {timeout}s:\n{self.tail()}")

  def finish(self, timeout: float = RUN_TIMEOUT_S) -> int:
    try:
      status = self.proc.wait(timeout)
    except subprocess.TimeoutExpired:
      self.kill()
      pytest.fail(f"MaxText did not finish within {timeout}s:\n{self.tail()}")
    self._reader.join(30)
    return status

  def kill(self, sig: int = signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError):
      os.killpg(self.proc.pid, sig)

  def text(self) -> str:
    return "\n".join(self.lines)

  def tail(self, n: int = 40) -> str:
    return "\n".join(self.lines[-n:])

  def losses(self) -> dict[int, str]:
    """Loss per step: exact (MaxText's metrics_file) where the run wrote one, else as the log
    prints it."""
    if self.metrics is None:
      return {int(m.group(1)): m.group(2) for m in map(_LOSS.search, self.lines) if m}
    if not self.metrics.exists():
      return {}
    rows = [json.loads(line) for line in self.metrics.read_text().splitlines() if line]
    return {int(row["step"]): repr(row["learning/loss"]) for row in rows}

  def restored_step(self) -> int | None:
    found = [int(m.group(1)) for m in map(_RESTORED.search, self.lines) if m]
    return found[-1] if found else None

  def tiers(self) -> dict[int, str]:
    return {int(m.group(1)): m.group(2) for m in map(_TIER.search, self.lines) if m}


@pytest.fixture
def runs(tmp_path):
  """Starts MaxText runs; every process still alive at the end is SIGKILLed."""
  started: list[Run] = []

  def start(command: list[str], env: dict[str, str], *, exact: bool = True) -> Run:
    metrics = None
    if exact:  # MaxText writes each step's metrics there at full precision
      metrics = tmp_path / f"metrics-{len(started)}.jsonl"
      command = [*command, f"metrics_file={metrics}"]
    run = Run(command, env, metrics)
    started.append(run)
    return run

  yield start
  for run in started:
    run.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
      run.proc.wait(30)


@pytest.fixture
def run_dirs(tmp_path):
  """(persistent output root, RAM-disk folder); the RAM folder is removed afterwards."""
  local = pathlib.Path("/dev/shm") / f"orbax-mtc-maxtext-{os.getpid()}-{uuid.uuid4().hex[:8]}"
  yield tmp_path / "out", local
  shutil.rmtree(local.with_name(local.name + ".gone"), ignore_errors=True)
  if local.is_dir() and not local.is_symlink():
    shutil.rmtree(local, ignore_errors=True)
  else:  # the failed-save test leaves a file in its place
    local.unlink(missing_ok=True)


def _args(base_yml: str, out: pathlib.Path, *extra: str, model=MODEL) -> list[str]:
  return [base_yml, f"base_output_directory={out}", "skip_jax_distributed_system=true",
          *model, *extra]


def _emergency(local: pathlib.Path, *extra: str) -> list[str]:
  return ["enable_emergency_checkpoint=true", f"local_checkpoint_directory={local}", *extra]


def train(start, venv_python, base_yml, out, *extra, module=PATCHED_TRAIN, env=None,
          model=MODEL) -> Run:
  return start([venv_python, "-m", module, *_args(base_yml, out, *extra, model=model)],
               env or _env())


def _finished(run: Run) -> Run:
  status = run.finish()
  assert status == 0, f"MaxText exited with status {status}:\n{run.tail()}"
  return run


@pytest.fixture(scope="module")
def baseline(venv_python, base_yml, tmp_path_factory) -> dict[int, str]:
  """Losses of an uninterrupted run with MaxText's own checkpointing."""
  out = tmp_path_factory.mktemp("baseline")
  metrics = out / "metrics.jsonl"
  run = Run([venv_python, "-m", MAXTEXT_TRAIN,
             *_args(base_yml, out, f"steps={BASELINE_STEPS}", "checkpoint_period=1000",
                    f"metrics_file={metrics}")], _env(), metrics)
  try:
    losses = _finished(run).losses()
  finally:
    run.kill()
  assert sorted(losses) == list(range(BASELINE_STEPS)), run.tail()
  return losses


def _same_losses(run: Run, baseline: dict[int, str], steps: range) -> None:
  losses = run.losses()
  assert sorted(losses) == list(steps), f"steps run: {sorted(losses)}\n{run.tail()}"
  assert {s: losses[s] for s in steps} == {s: baseline[s] for s in steps}


def _committed_ram_steps(local: pathlib.Path) -> list[int]:
  from orbax_mtc.local.store import committed_steps

  return committed_steps(local)


def _persistent_steps(out: pathlib.Path) -> list[int]:
  root = out / "t" / "checkpoints"
  return sorted(int(p.name) for p in root.iterdir() if p.name.isdigit()) if root.is_dir() else []


def _tmp_leftovers(out: pathlib.Path) -> list[str]:
  return sorted(str(p) for p in out.rglob("*orbax-checkpoint-tmp*"))


def _flat(tree) -> dict[str, object]:
  """Leaves by a path of plain names (dict keys and list indices alike), keys as key data."""
  import jax
  import numpy as np

  def name(entry) -> str:
    for attr in ("key", "idx", "name"):
      if hasattr(entry, attr):
        return str(getattr(entry, attr))
    return str(entry)

  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if jax.dtypes.issubdtype(getattr(leaf, "dtype", None), jax.dtypes.extended):
      leaf = jax.random.key_data(leaf)
    out["/".join(name(p) for p in path)] = np.asarray(leaf)
  return out


def _check_plain_orbax_reads(persistent: pathlib.Path, step: int, local: pathlib.Path) -> None:
  """Plain `ocp.CheckpointManager` restores the backup without a target, in MaxText's layout
  (item `state`: params, opt_state, step, nnx_aux), bit for bit what the RAM tier holds."""
  import jax
  import numpy as np
  import orbax.checkpoint as ocp

  from orbax_mtc.local.read import SavedLeaf, read_step
  from orbax_mtc.local.specs import item_metadata
  from orbax_mtc.local.store import read_manifest

  with ocp.CheckpointManager(persistent, item_names=("state",)) as manager:
    backup = manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore()))
  assert set(backup.state) == {"params", "opt_state", "step", "nnx_aux"}, sorted(backup.state)
  manifest = read_manifest(local / str(step))
  device = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
  targets = jax.tree.map(lambda _: SavedLeaf(device),
                         item_metadata(manifest)["state"])
  ram = read_step(local / str(step), manifest, {"state": targets})["state"]
  backup_leaves, ram_leaves = _flat(backup.state), _flat(ram)
  assert backup_leaves.keys() == ram_leaves.keys()
  assert any("rngs" in path for path in ram_leaves)  # the PRNG key leaves are there
  for path, value in ram_leaves.items():
    np.testing.assert_array_equal(value, backup_leaves[path], err_msg=path, strict=True)


GRAIN_BASELINE_STEPS = 10


GRAIN_RECORDS = 64  # one record per step (batch 1); an epoch outlasts every run here


# Written in the 3.12 venv: ArrayRecord records of MaxText's tf.train.Example proto, each a
# pre-tokenized "text" feature (ids 1..255 < vocab_size), as MaxText's pretraining pipeline
# reads them with grain_file_type=arrayrecord and tokenize_train_data=false.
_WRITE_RECORDS = """
import sys
import numpy as np
from array_record.python import array_record_module
from maxtext.input_pipeline.protos import example_pb2
path, count, length = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rng = np.random.default_rng(0)
writer = array_record_module.ArrayRecordWriter(path, "group_size:1")
for _ in range(count):
  example = example_pb2.Example()
  example.features.feature["text"].int64_list.value.extend(
      rng.integers(1, 256, size=length).tolist())
  writer.write(example.SerializeToString())
writer.close()
"""


@pytest.fixture(scope="module")
def grain_model(venv_python, base_yml, tmp_path_factory) -> list[str]:
  """MODEL on a generated ArrayRecord file through MaxText's grain pipeline (no worker
  processes, no packing, MaxText's own default SentencePiece tokenizer, only for its ids)."""
  data = tmp_path_factory.mktemp("grain") / "train.array_record"
  subprocess.run([venv_python, "-c", _WRITE_RECORDS, str(data), str(GRAIN_RECORDS), "100"],
                 check=True, env=_env(), timeout=RUN_TIMEOUT_S)
  tokenizer = pathlib.Path(base_yml).parents[1] / "assets" / "tokenizers" / "tokenizer.default"
  assert tokenizer.is_file(), tokenizer
  return [*(key for key in MODEL if not key.startswith("dataset_type=")),
          "dataset_type=grain", f"grain_train_files={data}", "grain_file_type=arrayrecord",
          "tokenize_train_data=false", f"tokenizer_path={tokenizer}", "grain_worker_count=0",
          "packing=false"]


@pytest.fixture(scope="module")
def grain_baseline(venv_python, base_yml, grain_model, tmp_path_factory) -> dict[int, str]:
  """Losses of an uninterrupted grain run with MaxText's own checkpointing: step s trains on
  record s of the shuffled file, so a resumed run that repeats or skips batches differs."""
  out = tmp_path_factory.mktemp("grain-baseline")
  metrics = out / "metrics.jsonl"
  run = Run([venv_python, "-m", MAXTEXT_TRAIN,
             *_args(base_yml, out, f"steps={GRAIN_BASELINE_STEPS}", "checkpoint_period=1000",
                    f"metrics_file={metrics}", model=grain_model)], _env(), metrics)
  try:
    losses = _finished(run).losses()
  finally:
    run.kill()
  assert sorted(losses) == list(range(GRAIN_BASELINE_STEPS)), run.tail()
  assert len(set(losses.values())) == GRAIN_BASELINE_STEPS, losses  # distinct batches
  return losses


def _iterator_file(out: pathlib.Path, step: int) -> dict:
  """Grain's own file of this (single) process's iterator in a persistent step."""
  folder = out / "t" / "checkpoints" / str(step) / "iter"
  assert sorted(p.name for p in folder.glob("process_*")) == ["process_0-of-1.json"]
  return json.loads((folder / "process_0-of-1.json").read_text())
