"""What the multi-process tests share: the worker, launching it, reading its event lines."""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import shutil
import stat
import sys
import uuid

import warm_start
from mp_worker import events as mp_events

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
WORKER = REPO_ROOT / "tests" / "mp_worker"  # run as `python tests/mp_worker <sub-command>`

# mp_events: the worker's event lines (LineCollector, events, parse_results); imports no JAX.


# A worker still running this long prints every thread's stack to its stderr (once), so that
# a job the harness kills at its usual 90 s timeout shows where each process waited.
STACKS_AFTER_S = 80


def child_env() -> dict[str, str]:
  """Children import orbax_mtc from this checkout, installed or not, and log XLA's INFO
  lines too (the preemption protocol's steps; `tail` leaves out the routine ones)."""
  path = os.environ.get("PYTHONPATH")
  return {"PYTHONPATH": f"{REPO_ROOT}{os.pathsep}{path}" if path else str(REPO_ROOT),
          "MTC_TEST_STACKS_AFTER_S": str(STACKS_AFTER_S),
          "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "0")}


def shm_base() -> pathlib.Path:
  shm = pathlib.Path("/dev/shm")
  return shm if shm.is_dir() and os.access(shm, os.W_OK) else pathlib.Path("/tmp")


def new_root(tag: str) -> pathlib.Path:
  """A unique, not yet existing folder on the RAM disk (the caller removes it)."""
  tag = tag[:40].replace("[", "-").replace("]", "").replace("/", "-")
  return shm_base() / f"orbax-mtc-test-{tag}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


@contextlib.contextmanager
def started_job(command: list[str], nprocs: int, root: pathlib.Path, *, devices: int = 2,
                env: dict[str, str] | None = None):
  """A running launcher job of mp_worker; every process is SIGKILLed on leaving the block."""
  out = mp_events.LineCollector()
  with warm_start.WarmJob([sys.executable, str(WORKER), *command], nprocs,
                          devices_per_process=devices, local_root=root,
                          env={**child_env(), **(env or {})}, output=out) as job:
    job.start()
    yield job, out


def run_job(command: list[str], nprocs: int, root: pathlib.Path, *, devices: int = 2,
            timeout_s: float = 90, env: dict[str, str] | None = None):
  """Runs one launcher job of mp_worker; returns (LaunchResult, LineCollector)."""
  with started_job(command, nprocs, root, devices=devices, env=env) as (job, out):
    result = job.wait(timeout_s)
  return result, out


_STACK_HEAD = re.compile(r"^\[node \d+\] (Thread 0x|Current thread 0x|Timeout \()")
_STACK_LINE = re.compile(r"^\[node \d+\] ?( {2}File |$)")
# Routine lines (connections, devices, barriers passed) that would crowd out the others.
_ROUTINE = re.compile(r"\[Gloo\] Rank|has passed with status: OK|grpc_credentials\.cc|"
                      r"pjrt_client\.cc|connected to coordination service")
# Frames of a pool thread waiting for work: such stacks say nothing about a hang.
_IDLE_FRAME = re.compile(r"(threading|concurrent/futures/thread|queue)\.py\"")


def _busy(block: list[str] | None) -> bool:
  """Whether a dumped thread's stack has a frame outside an idle pool's wait."""
  return bool(block) and not all(_IDLE_FRAME.search(f) for f in block[1:] if "File" in f)


def _stacks_apart(lines: list[str]) -> tuple[list[str], list[str]]:
  """(the output without the stack dumps, the dumped stacks of threads that were not idle).

  A node's dump runs from a thread's head line to its next one: another thread's line
  printed in the middle (its own or another node's) goes with the output and cuts nothing.
  """
  others: list[str] = []
  kept: list[str] = []
  blocks: dict[str, list[str]] = {}  # node -> the stack its dump is in
  for line in lines:
    node = line.split("]", 1)[0]
    if _STACK_HEAD.match(line):
      kept.extend(blocks[node] if _busy(blocks.get(node)) else [])
      blocks[node] = [line]
    elif node in blocks and _STACK_LINE.match(line):
      if line.split("]", 1)[-1].strip():
        blocks[node].append(line)
    else:
      others.append(line)
  for block in blocks.values():
    kept.extend(block if _busy(block) else [])
  return others, kept


def tail(out, n: int = 60) -> str:
  """The last `n` lines of a job's output, then the stacks it dumped (idle threads left out),
  so that a hang shows both what was printed last and where each process waited."""
  others, stacks = _stacks_apart(out.text().splitlines())
  text = "\n".join([line for line in others if not _ROUTINE.search(line)][-n:])
  return f"{text}\n--- stacks ---\n" + "\n".join(stacks) if stacks else text


def keep_output(out) -> None:
  """Writes a failed job's whole output under $MTC_TEST_OUTPUT_DIR when set (a failure message
  shows only its tail)."""
  folder = os.environ.get("MTC_TEST_OUTPUT_DIR")
  if folder:
    test = os.environ.get("PYTEST_CURRENT_TEST", "job").split(" ")[0]
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in test)
    path = pathlib.Path(folder) / f"{name}-{uuid.uuid4().hex[:6]}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(out.text())


def assert_ok(result, out) -> None:
  if result.returncode != 0 or result.timed_out:
    keep_output(out)
  assert result.returncode == 0 and not result.timed_out, f"job failed: {result}\n{tail(out)}"


def assert_results(out, nprocs: int, *, step: int, tier: str) -> None:
  """Every process restored `step` from `tier` and its shards matched bit for bit."""
  results = mp_events.parse_results(out.lines)
  assert sorted(results) == list(range(nprocs)), f"missing RESULT lines:\n{tail(out)}"
  for node, fields in sorted(results.items()):
    assert fields["ok"] == "1", f"node {node}: restored data differs: {fields['detail']}"
    assert (fields["step"], fields["tier"]) == (str(step), tier), (
        f"node {node} restored step {fields['step']} from {fields['tier']}, expected step "
        f"{step} from {tier}\n{tail(out)}")
    assert fields["process"] == str(node)


def assert_private(root: pathlib.Path, *, skip: tuple[str, ...] = (),
                   include_root: bool = True) -> int:
  """Every folder under `root` (with `include_root`, itself too) is 0700 and every regular
  file 0600: what the manager writes holds model weights or describes them. Links are not
  judged (their mode means nothing), nor the top-level entries named in `skip` (another
  program's). Returns how many entries were checked."""
  checked = 0
  for path in [root, *root.rglob("*")] if include_root else root.rglob("*"):
    if path != root and path.relative_to(root).parts[0] in skip:
      continue
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
      continue
    want = 0o700 if stat.S_ISDIR(info.st_mode) else 0o600
    assert stat.S_IMODE(info.st_mode) == want, (
        f"{path} has mode {stat.S_IMODE(info.st_mode):o}, expected {want:o}")
    checked += 1
  return checked


def saved_run(request, tmp_path_factory, tag: str, save_args: list[str]
              ) -> tuple[pathlib.Path, pathlib.Path]:
  """A finished 2-process `save` job over steps 0-10 (its folders removed with the fixture
  that asked for it): (root of its RAM folders, its persistent directory)."""
  src = new_root(tag)
  request.addfinalizer(lambda: shutil.rmtree(src, ignore_errors=True))
  persistent = tmp_path_factory.mktemp(f"{tag}-persistent") / "ckpt"
  result, out = run_job(["save", "--steps", "11", "--persistent-dir", str(persistent),
                         *save_args], 2, src)
  assert_ok(result, out)
  return src, persistent


def clone_run(run: tuple[pathlib.Path, pathlib.Path], root: pathlib.Path,
              tmp_path: pathlib.Path) -> pathlib.Path:
  """A copy of a `saved_run` at `root` (links kept as links); returns its persistent copy."""
  src, src_persistent = run
  shutil.copytree(src, root, symlinks=True)
  persistent = tmp_path / "persistent"
  shutil.copytree(src_persistent, persistent, symlinks=True)
  return persistent
