#!/usr/bin/env python3
"""Downloads Orbax's manager test files at a pinned commit into a suite dir (never committed).

Own code. Each file is checked against its SHA-256 before it is put in place (written under a
temporary name, then renamed), so a suite dir holds either the pinned bytes or nothing; a file
already there with the right hash is kept. `run_suite.py --fetch` calls `fetch`.

Usage:
  python fetch_upstream.py [--suite-dir DIR] [--base-url URL]
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

UPSTREAM_REPO = 'google/orbax'
UPSTREAM_COMMIT = '3ff7b24aa0e23db4a575f7dc4bc6f815008ac6fd'
BASE_URL = f'https://raw.githubusercontent.com/{UPSTREAM_REPO}/{UPSTREAM_COMMIT}/'


@dataclasses.dataclass(frozen=True)
class UpstreamFile:
  """One upstream file: where it is in google/orbax, where it goes, its SHA-256."""

  upstream_path: str
  place_at: str
  sha256: str


FILES = (
    UpstreamFile('checkpoint/orbax/checkpoint/checkpoint_manager_test.py',
                 'checkpoint_manager_test.py',
                 '01adf846a66ab94699f2a8e96d35297281ae4097fe454e36a7103c88540940be'),
    UpstreamFile('checkpoint/orbax/checkpoint/experimental/emergency/checkpoint_manager_test.py',
                 'emergency_checkpoint_manager_test.py',
                 '2740c98432b1ddad16aa7f6713b754249b23e820880942fb0f7ab7a991aefa52'),
    UpstreamFile('checkpoint/orbax/checkpoint/_src/testing/multiprocess_test.py',
                 'orbax/checkpoint/_src/testing/multiprocess_test.py',
                 'd1a1b8f3fd0c1c81dff667cd3358a7b3078de9fdf94157d71ec9a5a3a13c3ab5'),
    UpstreamFile('checkpoint/orbax/checkpoint/_src/testing/oss/multiprocess_test.py',
                 'orbax/checkpoint/_src/testing/oss/multiprocess_test.py',
                 '3735ee5b03e2a8906cf8b6e67de06071310687d2403284cb76e8681bc4fd84b7'),
)


class FetchError(RuntimeError):
  """A file could not be downloaded, or its bytes are not the pinned ones."""


def default_suite_dir() -> Path:
  """The cache folder the pinned files go to unless told otherwise."""
  cache = os.environ.get('XDG_CACHE_HOME') or os.path.join(os.path.expanduser('~'), '.cache')
  return Path(cache) / 'orbax-mtc' / 'orbax-suites' / UPSTREAM_COMMIT[:12]


def _sha256(data: bytes) -> str:
  return hashlib.sha256(data).hexdigest()


def missing(suite_dir: Path, files: Sequence[UpstreamFile] = FILES) -> list[str]:
  """The files of `files` that `suite_dir` lacks or holds with other bytes."""
  out = []
  for f in files:
    path = suite_dir / f.place_at
    if not path.is_file() or _sha256(path.read_bytes()) != f.sha256:
      out.append(f.place_at)
  return out


def fetch(suite_dir: Path, *, base_url: str = BASE_URL,
          files: Sequence[UpstreamFile] = FILES, timeout_s: float = 60.0) -> list[str]:
  """Puts every file of `files` in `suite_dir`; returns the ones downloaded now.

  Raises FetchError naming the file and the fix when one cannot be downloaded or its SHA-256
  differs from the pinned one (nothing is left in place for that file).
  """
  suite_dir.mkdir(parents=True, exist_ok=True)
  done = []
  for f in files:
    path = suite_dir / f.place_at
    if path.is_file() and _sha256(path.read_bytes()) == f.sha256:
      continue
    url = base_url.rstrip('/') + '/' + f.upstream_path
    try:
      with urllib.request.urlopen(url, timeout=timeout_s) as response:
        data = response.read()
    except (urllib.error.URLError, OSError) as e:
      raise FetchError(
          f'could not download {url} ({e}); download it by hand to {path}, or pass '
          '--base-url for a mirror or a local checkout of google/orbax at commit '
          f'{UPSTREAM_COMMIT} (file:///path/to/orbax/)') from e
    got = _sha256(data)
    if got != f.sha256:
      raise FetchError(
          f'{url} has SHA-256 {got}, not the pinned {f.sha256}: it is not {f.upstream_path} '
          f'at google/orbax commit {UPSTREAM_COMMIT}; nothing was written to {path}')
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + '.part')
    tmp.write_bytes(data)
    os.replace(tmp, path)
    done.append(f.place_at)
  return done


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--suite-dir', type=Path, default=None,
                      help=f'where the files go (default: {default_suite_dir()})')
  parser.add_argument('--base-url', default=BASE_URL,
                      help='where google/orbax at the pinned commit is read from '
                      '(default: %(default)s)')
  args = parser.parse_args(argv)
  suite_dir = args.suite_dir or default_suite_dir()
  try:
    done = fetch(suite_dir, base_url=args.base_url)
  except FetchError as e:
    print(f'fetch_upstream: {e}', file=sys.stderr)
    return 1
  print(f'{suite_dir}: {len(done)} downloaded, {len(FILES) - len(done)} already there')
  return 0


if __name__ == '__main__':
  sys.exit(main())
