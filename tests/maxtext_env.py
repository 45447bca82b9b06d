"""The Python 3.12 environment the real-MaxText tests run MaxText in, built once and cached.

MaxText 0.2.5 needs Python >= 3.12; the project's own environment is 3.11. The venv holds
exactly `tests/requirements-maxtext.txt` (installed with --no-deps: the list is complete) and
lives under `~/.cache/orbax-mtc/maxtext-<python>-<hash of that file>`, so a changed pin builds a
new one and an unchanged one is reused across clones. orbax-mtc is not installed into it: the
tests put the checkout under test first on PYTHONPATH, so a cached venv serves every checkout.

  python tests/maxtext_env.py          # build (if needed) and print the venv's python
"""

from __future__ import annotations

import fcntl
import glob
import hashlib
import os
import pathlib
import shutil
import subprocess
import sys

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
REQUIREMENTS = REPO_ROOT / "tests" / "requirements-maxtext.txt"
CACHE_ROOT = pathlib.Path(os.environ.get("XDG_CACHE_HOME", pathlib.Path.home() / ".cache")) \
    / "orbax-mtc"
BUILD_TIMEOUT_S = 1800


class NoPython312Error(RuntimeError):
  """No Python 3.12 interpreter on this machine (pyenv or PATH)."""


def find_python312() -> str:
  """A Python 3.12 interpreter: $MAXTEXT_PYTHON, pyenv's 3.12.x, else python3.12 on PATH."""
  candidates = [os.environ.get("MAXTEXT_PYTHON", "")]
  pyenv_root = os.environ.get("PYENV_ROOT") or str(pathlib.Path.home() / ".pyenv")
  candidates += sorted(glob.glob(f"{pyenv_root}/versions/3.12.*/bin/python3.12"), reverse=True)
  candidates.append(shutil.which("python3.12") or "")
  for candidate in candidates:
    if candidate and os.access(candidate, os.X_OK):
      return candidate
  raise NoPython312Error(
      "no Python 3.12 found (looked at $MAXTEXT_PYTHON, pyenv's versions/3.12.*, python3.12 on "
      "PATH); MaxText 0.2.5 needs Python >= 3.12")


def venv_dir(python: str) -> pathlib.Path:
  version = subprocess.run([python, "-c", "import sys; print(sys.version.split()[0])"],
                           capture_output=True, text=True, check=True).stdout.strip()
  digest = hashlib.sha256(REQUIREMENTS.read_bytes()).hexdigest()[:12]
  return CACHE_ROOT / f"maxtext-{version}-{digest}"


def _run(command: list[str]) -> None:
  result = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
  if result.returncode != 0:
    tail = "\n".join((result.stdout + result.stderr).splitlines()[-30:])
    raise RuntimeError(f"{' '.join(command)} failed with status {result.returncode}:\n{tail}")


def ensure_venv(log=sys.stderr) -> pathlib.Path:
  """The venv's python, building the venv first if this requirements file has none yet.

  Built in a temporary folder and renamed into place, under a lock, so a build that was
  interrupted or runs twice at once never leaves a half-installed venv behind.
  """
  python = find_python312()
  target = venv_dir(python)
  if (target / "bin" / "python").exists():
    return target / "bin" / "python"
  CACHE_ROOT.mkdir(parents=True, exist_ok=True)
  with open(CACHE_ROOT / ".build.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if (target / "bin" / "python").exists():
      return target / "bin" / "python"
    building = target.with_name(target.name + ".building")
    shutil.rmtree(building, ignore_errors=True)
    print(f"maxtext_env: building {target} from {REQUIREMENTS} (a few minutes, once)",
          file=log, flush=True)
    _run([python, "-m", "venv", str(building)])
    pip = [str(building / "bin" / "python"), "-m", "pip"]
    _run([*pip, "install", "--quiet", "--upgrade", "pip"])
    _run([*pip, "install", "--quiet", "--no-deps", "-r", str(REQUIREMENTS)])
    # Renaming keeps `bin/python -m ...` working (the venv finds itself from pyvenv.cfg
    # beside its interpreter); only console scripts' shebangs name the old folder, and the
    # tests run everything with -m.
    building.rename(target)
  return target / "bin" / "python"


if __name__ == "__main__":
  try:
    print(ensure_venv())
  except NoPython312Error as e:
    print(f"maxtext_env: {e}", file=sys.stderr)
    sys.exit(3)
