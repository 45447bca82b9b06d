"""The `orbax-mtc` command: launch, demo, bench, status, verify, gc, size.

`launch` and `demo` take the rest of the command line as their own arguments; their modules
(and JAX) are imported only when the verb is used, so `orbax-mtc --help` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

# Verbs whose arguments are parsed by their own module.
_PASSTHROUGH = ("launch", "demo", "bench", "gc", "size")


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="orbax-mtc",
      description="Multi-tier checkpointing for JAX: tools.",
  )
  verbs = parser.add_subparsers(dest="verb", metavar="VERB", required=True)
  verbs.add_parser(
      "launch", add_help=False,
      help="run a command as N local processes of one jax.distributed job "
      "(orbax-mtc launch --help)",
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
  status = verbs.add_parser("status", help="show the checkpoints held in a directory")
  status.add_argument("directory", help="a local (RAM-disk) or persistent checkpoint directory")
  verify = verbs.add_parser(
      "verify", help="check every checkpoint in a directory against its manifest"
  )
  verify.add_argument("directory", help="a local (RAM-disk) or persistent checkpoint directory")
  return parser


_BENCHMARKS = {
    "suite": "orbax-mtc beside the machine's limits and Orbax, every size and process count",
    "goodput": "one training job under seeded failures: orbax-mtc vs plain Orbax",
    "ondemand": "time from SIGTERM to a durable on-demand checkpoint",
}


def _bench(argv: list[str]) -> int:
  if not argv or argv[0] in ("-h", "--help"):
    print("usage: orbax-mtc bench {" + ",".join(_BENCHMARKS) + "} [--help | options]\n")
    for name, what in _BENCHMARKS.items():
      print(f"  {name:10s} {what}")
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

  args = _parser().parse_args(argv)
  from orbax_mtc import inspection

  if args.verb == "status":
    return int(inspection.status_main(args.directory))
  if args.verb == "verify":
    return int(inspection.verify_main(args.directory))
  raise AssertionError(f"unhandled verb {args.verb!r}")  # argparse rejects unknown verbs


if __name__ == "__main__":
  sys.exit(main())
