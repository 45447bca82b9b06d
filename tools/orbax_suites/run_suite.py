#!/usr/bin/env python3
"""Run one of Orbax's manager test suites against a chosen class.

Own code (not copied from Orbax). The recipe (upstream files, venv) is in README.md beside
this file and in docs/orbax-conformance.md. `--fetch` downloads the pinned upstream files
(fetch_upstream.py) into the suite dir first; by default the suite dir is a cache folder
outside the repository. By default it runs `checkpoint_manager_test.py`; `--test-file` (or
ORBAX_SUITE_TEST_FILE) names another test file of the suite dir (Orbax's emergency-manager
suite), and `--alias Name=module:attr` (repeatable; or ORBAX_SUITE_EXTRA_ALIASES,
'Name=module:attr,...') rebinds more module-level names of it (e.g. the emergency suite's
option classes).

The launcher starts N worker processes (N=1 or N=4 is what we use). Each
worker joins a jax.distributed group on localhost, makes the two upstream
`multiprocess_test` helper modules importable under their original package
names, optionally rebinds `checkpoint_manager_test.CheckpointManager` to the
class named by --cm, and runs the test module with pytest.  Every worker
records per-test outcomes to a JSONL file; the launcher merges them (a test
passes only if it passed on every process) and prints, as its last line:

    N passed, N failed, N skipped

Usage:
  python run_suite.py [--fetch] [--suite-dir DIR] [--num-processes N]
      [--devices-per-process D] [--cm module:Class | --cm @trivial]
      [--test-file FILE] [--alias Name=module:attr ...]
      [--count-constructions] [--out DIR] [-k EXPR] [--pytest-arg ARG ...]

--suite-dir (default: fetch_upstream.default_suite_dir()) must contain the test file and:
  orbax/checkpoint/_src/testing/multiprocess_test.py
  orbax/checkpoint/_src/testing/oss/multiprocess_test.py
"""

import argparse
import collections
import datetime
import importlib
import importlib.abc
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import fetch_upstream  # beside this script
from construction_counter import ConstructionCounter  # beside this script
from suite_report import summarize  # beside this script

# Modules the test needs that the PyPI wheel does not ship, mapped to their
# path relative to --suite-dir.
OVERLAY_MODULES = {
    'orbax.checkpoint._src.testing.multiprocess_test': (
        'orbax/checkpoint/_src/testing/multiprocess_test.py'
    ),
    'orbax.checkpoint._src.testing.oss.multiprocess_test': (
        'orbax/checkpoint/_src/testing/oss/multiprocess_test.py'
    ),
}
TEST_MODULE_ATTR = 'CheckpointManager'


# --------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------
def parse_args(argv):
  p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  p.add_argument('--suite-dir', default=None,
                 help='directory holding the upstream test files (default: '
                 f'{fetch_upstream.default_suite_dir()})')
  p.add_argument('--fetch', action='store_true',
                 help='first download the pinned upstream files into the suite dir '
                 '(fetch_upstream.py; files already there with the pinned hash are kept)')
  p.add_argument('--base-url', default=fetch_upstream.BASE_URL,
                 help='with --fetch: where google/orbax at the pinned commit is read from, '
                 'e.g. a mirror or file:///path/to/orbax/ (default: %(default)s)')
  p.add_argument('--test-file',
                 default=os.environ.get('ORBAX_SUITE_TEST_FILE', 'checkpoint_manager_test.py'),
                 help='test file of the suite dir to run (default: %(default)s)')
  p.add_argument('--alias', action='append',
                 default=[a for a in os.environ.get('ORBAX_SUITE_EXTRA_ALIASES', '').split(',')
                          if a.strip()],
                 help='Name=module:attr: a further module-level name of the test module to '
                 'rebind with --cm (repeatable), e.g. the emergency suite\'s option classes')
  p.add_argument('--num-processes', type=int, default=1)
  p.add_argument('--devices-per-process', type=int, default=None,
                 help='fake CPU devices per process (default: 8 for N=1, '
                 'else 2)')
  p.add_argument('--cm', default=None,
                 help='class under test as module:Class, or @trivial for a '
                 'pass-only subclass of orbax.checkpoint.CheckpointManager; '
                 'default: leave the test module untouched')
  p.add_argument('--count-constructions', action='store_true',
                 help='wrap CheckpointManager.__init__ to count, per test, '
                 'constructions of the class under test vs other classes')
  p.add_argument('--out', default=None,
                 help='run directory (default: <suite-dir>/runs/<timestamp>)')
  p.add_argument('-k', dest='keyword', default=None,
                 help='pytest -k expression to select tests')
  p.add_argument('--pytest-arg', action='append', default=[],
                 help='extra argument passed to pytest (repeatable)')
  p.add_argument('--keep-tmp', action='store_true',
                 help='keep the per-run TEST_TMPDIR (checkpoints) afterwards')
  p.add_argument('--worker-rank', type=int, default=None,
                 help=argparse.SUPPRESS)
  p.add_argument('--coordinator', default=None, help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  args.suite_dir = os.path.abspath(args.suite_dir or fetch_upstream.default_suite_dir())
  for pair in args.alias:
    name, eq, target = pair.partition('=')
    if not eq or ':' not in target or not name.strip():
      p.error(f'--alias must look like Name=module:attr, got {pair!r}')
  if args.devices_per_process is None:
    args.devices_per_process = 8 if args.num_processes == 1 else 2
  return args


# --------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------
class _OverlayFinder(importlib.abc.MetaPathFinder):
  """Serves a fixed set of module names from files under the suite dir."""

  def __init__(self, mapping):
    self._mapping = mapping

  def find_spec(self, fullname, path=None, target=None):
    del path, target
    filename = self._mapping.get(fullname)
    if filename is None:
      return None
    return importlib.util.spec_from_file_location(fullname, filename)


def _resolve_class(spec):
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  if spec == '@trivial':

    class TrivialSubclass(ocp.CheckpointManager):
      pass

    return TrivialSubclass
  if ':' not in spec:
    raise SystemExit(f'--cm must look like module:Class, got {spec!r}')
  mod_name, _, qualname = spec.partition(':')
  obj = importlib.import_module(mod_name)
  for part in qualname.split('.'):
    obj = getattr(obj, part)
  if not (isinstance(obj, type) and issubclass(obj, ocp.CheckpointManager)):
    raise SystemExit(f'{spec} is not a subclass of '
                     'orbax.checkpoint.CheckpointManager')
  return obj


class _Recorder:
  """pytest plugin: rebinds the class under test and records outcomes."""

  def __init__(self, rank, out_dir, cls, counter, aliases=()):
    self.rank = rank
    self.aliases = aliases
    self.cls = cls
    self.counter = counter
    self.results_path = os.path.join(out_dir, f'rank{rank}.jsonl')
    self.collected_path = os.path.join(out_dir, f'rank{rank}.collected.json')
    self._reports = collections.defaultdict(dict)
    self._fh = open(self.results_path, 'w', buffering=1)
    self.rebound_modules = []

  # Collection: rebind the alias in every collected test module.
  def pytest_collection_modifyitems(self, session, config, items):
    del session, config
    seen = set()
    for item in items:
      mod = getattr(item, 'module', None)
      if mod is None or id(mod) in seen:
        continue
      seen.add(id(mod))
      if self.cls is not None:
        if not hasattr(mod, TEST_MODULE_ATTR):
          raise RuntimeError(f'{mod.__name__} has no {TEST_MODULE_ATTR}')
        setattr(mod, TEST_MODULE_ATTR, self.cls)
        for pair in self.aliases:
          name, _, target = pair.partition('=')
          tmod, _, attr = target.partition(':')
          setattr(mod, name.strip(), getattr(importlib.import_module(tmod), attr))
        self.rebound_modules.append(mod.__name__)

  def pytest_collection_finish(self, session):
    # Runs after -k / deselection, so this is the list that will run.
    with open(self.collected_path, 'w') as f:
      json.dump([it.nodeid for it in session.items], f)

  def pytest_runtest_logstart(self, nodeid, location):
    del location
    if self.counter is not None:
      self.counter.reset()

  def pytest_runtest_logreport(self, report):
    phases = self._reports[report.nodeid]
    # A test with subtests reports 'call' once per subtest and once for itself: a failed
    # subtest fails the test (the test's own later 'call' must not hide it).
    if report.when not in phases or not phases[report.when].failed:
      phases[report.when] = report

  def pytest_runtest_logfinish(self, nodeid, location):
    del location
    phases = self._reports.pop(nodeid, {})
    outcome, reason = 'passed', ''
    for when in ('setup', 'call', 'teardown'):
      rep = phases.get(when)
      if rep is None:
        continue
      if rep.failed:
        outcome = 'failed' if when == 'call' else 'error'
        reason = _short_reason(rep)
        break
      if rep.skipped and outcome == 'passed':
        outcome = 'skipped'
        reason = _short_reason(rep)
    duration = sum(r.duration for r in phases.values())
    rec = {'nodeid': nodeid, 'outcome': outcome, 'reason': reason,
           'duration': round(duration, 3)}
    if self.counter is not None:
      rec['constructed'] = self.counter.snapshot()
    self._fh.write(json.dumps(rec) + '\n')

  def pytest_sessionfinish(self, session, exitstatus):
    del session, exitstatus
    self._fh.close()


def _short_reason(rep):
  lr = rep.longrepr
  if lr is None:
    return ''
  if isinstance(lr, tuple) and len(lr) == 3:  # skip: (file, line, msg)
    return str(lr[2])
  crash = getattr(getattr(lr, 'reprcrash', None), 'message', None)
  text = crash if crash else str(lr)
  lines = [ln for ln in text.strip().splitlines() if ln.strip()]
  return (lines[0] if lines else '')[:400]


def worker_main(args):
  rank, n = args.worker_rank, args.num_processes
  out_dir = args.out
  sys.meta_path.insert(0, _OverlayFinder({
      name: os.path.join(args.suite_dir, rel)
      for name, rel in OVERLAY_MODULES.items()
  }))

  import jax  # pylint: disable=g-import-not-at-top
  jax.distributed.initialize(
      coordinator_address=args.coordinator, num_processes=n, process_id=rank)
  print(f'[rank {rank}] process {jax.process_index()}/{jax.process_count()}, '
        f'{jax.local_device_count()} local / {jax.device_count()} global '
        f'devices ({jax.default_backend()})', flush=True)

  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  import pytest  # pylint: disable=g-import-not-at-top
  from absl import flags  # pylint: disable=g-import-not-at-top

  cls = _resolve_class(args.cm) if args.cm else None
  counter = None
  if args.count_constructions:
    counter = ConstructionCounter(ocp.CheckpointManager,
                                   cls or ocp.CheckpointManager)
  for name in OVERLAY_MODULES:
    mod = importlib.import_module(name)
    print(f'[rank {rank}] {name} <- {mod.__file__}', flush=True)
  # absltest reads flags (e.g. --test_tmpdir) that nobody parses under pytest.
  flags.FLAGS.mark_as_parsed()

  recorder = _Recorder(rank, out_dir, cls, counter, args.alias)
  pytest_args = [
      os.path.join(args.suite_dir, args.test_file),
      '--rootdir', args.suite_dir,
      '-p', 'no:cacheprovider',
      '-q', '-rfE', '--tb=short',
  ]
  if args.keyword:
    pytest_args += ['-k', args.keyword]
  pytest_args += args.pytest_arg
  t0 = time.time()
  rc = pytest.main(pytest_args, plugins=[recorder])
  if cls is not None:
    mod = sys.modules.get(os.path.splitext(os.path.basename(args.test_file))[0])
    bound = getattr(mod, TEST_MODULE_ATTR, None) if mod else None
    print(f'[rank {rank}] rebound in {recorder.rebound_modules}; '
          f'alias now {bound!r}', flush=True)
  print(f'[rank {rank}] pytest exit {int(rc)} after {time.time()-t0:.0f}s',
        flush=True)
  sys.stdout.flush()
  sys.stderr.flush()
  if n > 1:
    # Leave together, so that rank 0 (which hosts the coordination service)
    # does not vanish while a peer is still finishing.
    try:
      from orbax.checkpoint._src.multihost import multihost  # pylint: disable=g-import-not-at-top
      multihost.get_jax_distributed_client().wait_at_barrier(
          'suite_runner_done', 60_000)
    except Exception as e:  # pylint: disable=broad-exception-caught
      print(f'[rank {rank}] final barrier failed: {e}', flush=True)
    if rank == 0:
      time.sleep(2)
  # Skip interpreter teardown (jax.distributed shutdown barriers, pending
  # threads) once results are on disk; a crashed peer would make it hang.
  os._exit(0 if int(rc) in (0, 1, 5) else int(rc))


# --------------------------------------------------------------------------
# Launcher side
# --------------------------------------------------------------------------
def _free_port():
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def _prepare_suite_dir(args):
  """Fetches the pinned files if asked; returns why the suite dir cannot run, or None."""
  if args.fetch:
    try:
      fetch_upstream.fetch(fetch_upstream.Path(args.suite_dir), base_url=args.base_url)
    except fetch_upstream.FetchError as e:
      return str(e)
  needed = [args.test_file] + list(OVERLAY_MODULES.values())
  absent = [rel for rel in needed
            if not os.path.isfile(os.path.join(args.suite_dir, rel))]
  if absent:
    return (f'{args.suite_dir} lacks {", ".join(absent)}; run again with --fetch to download '
            f'the pinned upstream files (google/orbax at {fetch_upstream.UPSTREAM_COMMIT}) '
            'there, or pass --suite-dir')
  return None


def launcher_main(args, argv):
  n = args.num_processes
  why = _prepare_suite_dir(args)
  if why is not None:
    print(f'run_suite: {why}', file=sys.stderr, flush=True)
    return 2
  # Workers read the files the launcher just checked; they never fetch.
  argv = [a for a in argv if a != '--fetch']
  stamp = datetime.datetime.now().strftime('%Y%m%d-%H%M%S')
  out = os.path.abspath(args.out or os.path.join(args.suite_dir, 'runs', stamp))
  os.makedirs(out, exist_ok=True)
  tmpdir = os.path.join(out, 'test_tmpdir')
  if os.path.exists(tmpdir):
    shutil.rmtree(tmpdir)
  os.makedirs(tmpdir)
  coordinator = f'127.0.0.1:{_free_port()}'

  env = dict(os.environ)
  env['JAX_PLATFORMS'] = 'cpu'
  env['TEST_TMPDIR'] = tmpdir
  xla = env.get('XLA_FLAGS', '')
  xla = ' '.join(f for f in xla.split()
                 if not f.startswith('--xla_force_host_platform_device_count'))
  env['XLA_FLAGS'] = (xla + ' --xla_force_host_platform_device_count='
                      f'{args.devices_per_process}').strip()
  env.setdefault('PYTHONUNBUFFERED', '1')

  print(f'run dir: {out}', flush=True)
  print(f'{n} process(es) x {args.devices_per_process} CPU devices; '
        f'class: {args.cm or "(unchanged)"}', flush=True)
  procs = []
  t0 = time.time()
  for rank in range(n):
    cmd = [sys.executable, os.path.abspath(__file__)] + argv + [
        '--worker-rank', str(rank), '--coordinator', coordinator,
        '--out', out]
    log = open(os.path.join(out, f'rank{rank}.log'), 'wb')
    procs.append((subprocess.Popen(cmd, env=env, stdout=log,
                                   stderr=subprocess.STDOUT), log))

  stop = {'sig': None}

  def on_signal(signum, frame):
    del frame
    stop['sig'] = signum

  signal.signal(signal.SIGTERM, on_signal)
  signal.signal(signal.SIGINT, on_signal)
  while stop['sig'] is None and any(p.poll() is None for p, _ in procs):
    time.sleep(0.5)
  # If one worker has died, the others will stall at the next barrier; give
  # them a grace period, then end them by PID.
  if stop['sig'] is not None:
    print(f'caught signal {stop["sig"]}; stopping workers', flush=True)
  for p, _ in procs:
    if p.poll() is None:
      try:
        p.wait(timeout=5 if stop['sig'] else 60)
      except subprocess.TimeoutExpired:
        p.terminate()
  for p, log in procs:
    try:
      p.wait(timeout=10)
    except subprocess.TimeoutExpired:
      p.kill()
      p.wait()
    log.close()
  wall = time.time() - t0
  return summarize(args, out, tmpdir, [p.returncode for p, _ in procs], wall)


def main():
  argv = sys.argv[1:]
  args = parse_args(argv)
  if args.worker_rank is not None:
    worker_main(args)
  else:
    sys.exit(launcher_main(args, argv))


if __name__ == '__main__':
  main()
