"""Counts the CheckpointManagers a test builds, split by class under test (run_suite.py's
`--count-constructions`)."""

import functools
import threading


class ConstructionCounter:
  """Counts CheckpointManager constructions, split by class under test.

  A class under test that composes a manager of `base` (rather than running `base.__init__`
  on itself) builds that one inside its own `__init__`: it is part of the manager under test,
  not another manager the test built, so it is not counted.
  """

  def __init__(self, base, cls):
    self.base, self.cls = base, cls
    self._lock = threading.Lock()
    self._inside = threading.local()
    self.reset()
    orig = base.__init__

    def count(mgr):
      # Count only the outermost __init__ of each object.
      if not getattr(mgr, '_suite_runner_counted', False):
        object.__setattr__(mgr, '_suite_runner_counted', True)
        with self._lock:
          key = 'under_test' if isinstance(mgr, cls) else 'other'
          self._counts[key] += 1

    @functools.wraps(orig)
    def counting_init(mgr, *a, **kw):
      if not getattr(self._inside, 'depth', 0):
        count(mgr)
      return orig(mgr, *a, **kw)

    base.__init__ = counting_init
    own = cls.__dict__.get('__init__') if cls is not base else None
    if own is not None:
      @functools.wraps(own)
      def counting_own_init(mgr, *a, **kw):
        count(mgr)
        self._inside.depth = getattr(self._inside, 'depth', 0) + 1
        try:
          return own(mgr, *a, **kw)
        finally:
          self._inside.depth -= 1

      cls.__init__ = counting_own_init

  def reset(self):
    self._counts = {'under_test': 0, 'other': 0}

  def snapshot(self):
    return dict(self._counts)
