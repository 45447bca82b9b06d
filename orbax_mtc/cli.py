"""The `orbax-mtc` command: launch, demo, bench, status, verify, gc, size.

`launch` and `demo` take the rest of the command line as their own arguments; their modules
(and JAX) are imported only when the verb is used, so `orbax-mtc --help` stays fast.

Conventions every verb keeps (docs/cli.md): results on stdout, errors and progress bars on
stderr; with `--json` (status, verify, gc, size) stdout holds one JSON document and nothing
else, and no progress bar is drawn.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

# Verbs whose arguments are parsed by their own module.
_PASSTHROUGH = ("launch", "demo", "bench", "gc", "size")
# Seconds of work before a progress bar is drawn, so that quick runs draw none (a line
# printed above a bar with bar.write draws it at once).
PROGRESS_DELAY_S = 1.0


def version() -> str | None:
  """The installed orbax-mtc version, or None when the package is not installed."""
  from importlib import metadata

  try:
    return metadata.version("orbax-mtc")
  except metadata.PackageNotFoundError:
    return None


def progress(*, total: float | None, desc: str, unit: str = "it", enabled: bool = True,
             file=None, delay: float = PROGRESS_DELAY_S, **kwargs):
  """A tqdm progress bar on stderr (or `file`).

  Off when `enabled` is false (--json, --quiet); silent when the stream is not a terminal
  (tqdm's disable=None), so logs and pipes never get bar characters.
  """
  from tqdm import tqdm  # only verbs that draw a bar pay for the import

  return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr if file is None else file,
              disable=None if enabled else True, delay=delay, leave=False,
              dynamic_ncols=True, **kwargs)


def print_json(document: dict[str, Any]) -> None:
  """Writes one JSON document (a --json result) to stdout."""
  sys.stdout.write(json.dumps(document, indent=2, allow_nan=False) + "\n")
  sys.stdout.flush()


def error(prog: str, message: str) -> None:
  """Prints `prog: error: message` to stderr, as argparse does for usage errors."""
  print(f"{prog}: error: {message}", file=sys.stderr)


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="orbax-mtc",
      description="Multi-tier checkpointing for JAX: tools. Errors go to stderr; with --json, "
      "stdout holds one JSON document (schemas: docs/cli.md).",
  )
  parser.add_argument("--version", action="store_true",
                      help="print the installed orbax-mtc version and exit")
  verbs = parser.add_subparsers(dest="verb", metavar="VERB", required=True)
  verbs.add_parser(
      "launch", add_help=False,
      help="single-host launcher for tests and demos: a command as N local processes of one "
      "jax.distributed job (orbax-mtc launch --help)",
  )
  verbs.add_parser(
      "demo", add_help=False, help="run the end-to-end demonstration (orbax-mtc demo --help)"
  )
  verbs.add_parser(
      "bench", add_help=False,
      help="benchmarks: suite, goodput, ondemand (orbax-mtc bench --help)")
  verbs.add_parser(
      "gc", add_help=False,
      help="apply a retention policy to a persistent directory (orbax-mtc gc --help)")
  verbs.add_parser(
      "size", add_help=False,
      help="RAM disk to request per node on GKE, and the filled-in manifests "
      "(orbax-mtc size --help)")
  status = verbs.add_parser(
      "status", help="show the checkpoints held in a directory",
      description="List the steps of a local (RAM-disk) or persistent checkpoint directory "
      "with their sizes. Exit 0; 2 when the directory cannot be read.")
  status.add_argument("directory", help="a local (RAM-disk) or persistent checkpoint directory")
  status.add_argument("--json", action="store_true",
                      help="print one JSON document (schema orbax-mtc/status/1) instead")
  verify = verbs.add_parser(
      "verify", help="check every checkpoint in a directory against its manifest",
      description="Re-read every step of a local (RAM-disk) or persistent checkpoint "
      "directory. Exit 0: every step verified; 1: a corrupt or partial entry; 2: nothing "
      "verified (no such directory, no access, or no step in it).")
  verify.add_argument("directory", help="a local (RAM-disk) or persistent checkpoint directory")
  verify.add_argument("--json", action="store_true",
                      help="print one JSON document (schema orbax-mtc/verify/1) instead")
  return parser


_BENCHMARKS = {
    "suite": "orbax-mtc beside the machine's limits and Orbax, every size and process count",
    "goodput": "one training job under seeded failures: orbax-mtc vs plain Orbax",
    "ondemand": "time from SIGTERM to a durable on-demand checkpoint",
}


def _bench(argv: list[str]) -> int:
  if not argv or argv[0] in ("-h", "--help"):
    # Asked for: stdout, exit 0. Missing the benchmark: a usage error, stderr and exit 2.
    out = sys.stdout if argv else sys.stderr
    print("usage: orbax-mtc bench {" + ",".join(_BENCHMARKS) + "} [--help | options]\n",
          file=out)
    for name, what in _BENCHMARKS.items():
      print(f"  {name:10s} {what}", file=out)
    return 0 if argv else 2
  if argv[0] not in _BENCHMARKS:
    print(f"orbax-mtc bench: unknown benchmark {argv[0]!r}; available: "
          f"{', '.join(_BENCHMARKS)}", file=sys.stderr)
    return 2
  if argv[0] == "suite":
    from orbax_mtc.bench import suite as module
  elif argv[0] == "goodput":
    from orbax_mtc.bench import goodput as module
  else:
    from orbax_mtc.bench import ondemand as module
  return int(module.main(argv[1:]) or 0)


def main(argv: Sequence[str] | None = None) -> int:
  """Runs one `orbax-mtc` verb and returns its exit code."""
  argv = list(sys.argv[1:] if argv is None else argv)
  if argv and argv[0] in _PASSTHROUGH:
    verb, rest = argv[0], argv[1:]
    if verb == "launch":
      from orbax_mtc import launch

      return launch.main(rest)
    if verb == "bench":
      return _bench(rest)
    if verb == "gc":
      from orbax_mtc import persistent_gc

      return persistent_gc.main(rest)
    if verb == "size":
      from orbax_mtc import sizing

      return sizing.main(rest)
    from orbax_mtc import demo

    return int(demo.main(rest) or 0)

  if argv[:1] == ["--version"]:
    installed = version()
    if installed is None:
      error("orbax-mtc", "no installed orbax-mtc package to read a version from "
            "(pip install orbax-mtc, or pip install -e . in a checkout)")
      return 1
    print(f"orbax-mtc {installed}")
    return 0
  args = _parser().parse_args(argv)
  if args.version:  # --version after other arguments: argparse needs a verb first
    return main(["--version"])
  from orbax_mtc import inspection

  if args.verb == "status":
    return int(inspection.status_main(args.directory, as_json=args.json))
  if args.verb == "verify":
    return int(inspection.verify_main(args.directory, as_json=args.json))
  raise AssertionError(f"unhandled verb {args.verb!r}")  # argparse rejects unknown verbs


if __name__ == "__main__":
  sys.exit(main())
