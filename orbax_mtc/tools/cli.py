"""The `orbax-mtc` command: launch, demo, bench, status, verify, gc, size.

`launch`, `demo`, `bench`, `gc` and `size` take the rest of the command line as their own
arguments; their modules (and JAX) are imported only when the verb is used, so `orbax-mtc
--help` stays fast. `status`, `verify` and `size` are wired here (`size`'s arithmetic is
`orbax_mtc.tools.size`, its files `orbax_mtc.tools.size_render`); the other verbs' parsers live
in their own modules.

Conventions every verb keeps (docs/cli.md): results on stdout, errors and progress bars on
stderr; with `--json` (status, verify, gc, size, and every bench verb but suite) stdout holds
one JSON document and nothing else, and no progress bar is drawn. Bad input is refused before
any result is printed, naming the flag; a `gs://` folder whose endpoint cannot be reached
fails within seconds (`reach`).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence

# The output helpers every verb shares (re-exported: `cli.progress` and the others).
from orbax_mtc.tools.console import (
    PROGRESS_DELAY_S,
    directory_arg,
    error,
    print_json,
    progress,
    version,
)

__all__ = ["PROGRESS_DELAY_S", "error", "main", "print_json", "progress", "size_main",
           "version"]

# Verbs whose arguments are parsed by their own module.
_PASSTHROUGH = ("launch", "demo", "bench", "gc", "size")
_VERSION_FLAGS = ("-V", "--version")

def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="orbax-mtc",
      description="Multi-tier checkpointing for JAX: tools. Errors go to stderr; with --json, "
      "stdout holds one JSON document (schemas: docs/cli.md).",
  )
  parser.add_argument("-V", "--version", action="store_true",
                      help="print the orbax-mtc version and exit")
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
      help="benchmarks: suite, goodput, failure-cost, ondemand, elastic-scale, every-step "
      "(orbax-mtc bench --help)")
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
  status.add_argument("directory", type=directory_arg,
                      help="a local (RAM-disk) or persistent checkpoint directory")
  status.add_argument("--json", action="store_true",
                      help="print one JSON document (schema orbax-mtc/status/1) instead")
  verify = verbs.add_parser(
      "verify", help="check every checkpoint in a directory against its manifest",
      description="Re-read every step of a local (RAM-disk) or persistent checkpoint "
      "directory. Exit 0: every step verified; 1: a corrupt or partial entry; 2: nothing "
      "verified (no such directory, no access, or no step in it).")
  verify.add_argument("directory", type=directory_arg,
                      help="a local (RAM-disk) or persistent checkpoint directory")
  verify.add_argument("--json", action="store_true",
                      help="print one JSON document (schema orbax-mtc/verify/1) instead")
  return parser


_BENCHMARKS = {
    "suite": "orbax-mtc beside the machine's limits and Orbax, every size and process count",
    "goodput": "one training job under seeded failures: orbax-mtc vs plain Orbax",
    "failure-cost": "work lost and time to recover per failure kind: orbax-mtc, Orbax's "
    "emergency manager, plain Orbax",
    "ondemand": "time from SIGTERM to a durable on-demand checkpoint",
    "elastic-scale": "elastic restore planning against host count (1k to 100k hosts)",
    "every-step": "training-loop overhead of RAM saves every N steps and continuously",
}


def _bench(argv: list[str]) -> int:
  if not argv or argv[0] in ("-h", "--help"):
    # Asked for: stdout, exit 0. Missing the benchmark: a usage error, stderr and exit 2.
    out = sys.stdout if argv else sys.stderr
    print("usage: orbax-mtc bench {" + ",".join(_BENCHMARKS) + "} [--help | options]\n",
          file=out)
    for name, what in _BENCHMARKS.items():
      print(f"  {name:13s} {what}", file=out)
    return 0 if argv else 2
  if argv[0] not in _BENCHMARKS:
    print(f"orbax-mtc bench: unknown benchmark {argv[0]!r}; available: "
          f"{', '.join(_BENCHMARKS)}", file=sys.stderr)
    return 2
  if argv[0] == "suite":
    from orbax_mtc.tools.bench import suite as module
  elif argv[0] == "goodput":
    from orbax_mtc.tools.bench import goodput as module
  elif argv[0] == "failure-cost":
    from orbax_mtc.tools.bench import failure_cost as module
  elif argv[0] == "elastic-scale":
    from orbax_mtc.tools.bench import elastic_scale as module
  elif argv[0] == "every-step":
    from orbax_mtc.tools.bench import every_step as module
  else:
    from orbax_mtc.tools.bench import ondemand as module
  return int(module.main(argv[1:]) or 0)


# ----------------------------------------------------------------------------- size

_SIZE_RENDER_REQUIRED = ("bucket", "machine_type", "job_name")
_SIZE_RENDER_ONLY = ("bucket", "machine_type", "job_name", "slices", "local_dir", "image",
                     "backup_minutes", "tpu_accelerator", "tpu_topology", "templates")


def _size_parser() -> argparse.ArgumentParser:
  from orbax_mtc.tools import size

  parser = argparse.ArgumentParser(
      prog="orbax-mtc size",
      description="RAM disk (GKE CheckpointConfiguration inMemoryVolumeSize) per node: "
      "1.1 x 2 x (1 + 2 x peers) x local checkpoint size, rounded up to whole GiB. "
      "With --render, also write the filled-in manifests.")
  source = parser.add_mutually_exclusive_group(required=True)
  source.add_argument("--state-size", metavar="SIZE",
                      help="size of the whole training state, one copy (8GiB, 512MiB, 800GB, "
                      "bytes); divided by --nodes")
  source.add_argument("--from-step", metavar="DIR",
                      help="a saved step: an orbax-mtc RAM-tier step (one node's bytes) or a "
                      "standard Orbax step (whole state; divided by --nodes)")
  parser.add_argument("--accelerator", required=True, choices=size.ACCELERATORS,
                      help="the nodes' accelerator; sets the default --peers and what "
                      "--render writes")
  parser.add_argument("--peers", type=int, default=None,
                      help="peers per node holding other bytes than the node (default: 0 on "
                      "TPU, whose peers are twins in other slices; 1 on GPU)")
  parser.add_argument("--nodes", type=int, default=1,
                      help="nodes sharing one copy of the state: hosts per TPU slice, all "
                      "nodes of an FSDP GPU job (default 1); the JobSet's nodes with --render")
  render_group = parser.add_argument_group("--render (all manifests for one job)")
  render_group.add_argument("--render", metavar="OUTDIR",
                            help="write checkpoint-configuration.yaml, jobset-maxtext.yaml "
                            "and env.sh here")
  render_group.add_argument("--bucket", help="Cloud Storage bucket (hierarchical namespace)")
  render_group.add_argument("--machine-type", help="node machine type, e.g. ct6e-standard-4t, "
                            "a3-megagpu-8g")
  render_group.add_argument("--job-name", help="JobSet name, also MaxText's run_name")
  render_group.add_argument("--slices", type=int, help="TPU slices (default 2)")
  render_group.add_argument("--local-dir", help="mount path of the RAM disk (default /local)")
  render_group.add_argument("--image", help="container image with MaxText and orbax-mtc")
  render_group.add_argument("--backup-minutes", type=int,
                            help="replicator backup interval to Cloud Storage (default 30)")
  render_group.add_argument("--tpu-accelerator", help="override the gke-tpu-accelerator label")
  render_group.add_argument("--tpu-topology", help="slice topology as in the node pool (default: "
                            "inferred from --nodes and the machine type)")
  render_group.add_argument("--templates", help="the configs/ folder (default: the installed package's)")
  parser.add_argument("--json", action="store_true",
                      help="print one JSON document (schema orbax-mtc/size/1) instead of the "
                      "explanation")
  return parser


def _attach_signed_values(argv: list[str], flags: Sequence[str]) -> list[str]:
  """`--state-size -5GiB` as `--state-size=-5GiB`.

  argparse takes a token that starts with '-' and is not a plain number for an option, and
  would answer "expected one argument"; attached, the value reaches the check that says what
  is wrong with it.
  """
  out: list[str] = []
  i = 0
  while i < len(argv):
    if argv[i] in flags and i + 1 < len(argv) and re.match(r"-[\d.]", argv[i + 1]):
      out.append(f"{argv[i]}={argv[i + 1]}")
      i += 2
    else:
      out.append(argv[i])
      i += 1
  return out


def size_main(argv: Sequence[str] | None = None) -> int:
  """`orbax-mtc size ...`: prints the sizing (--json: one document); with --render writes the
  manifests (`orbax_mtc.tools.size` does the arithmetic, `size_render` the files).

  Args:
    argv: the arguments after `size`; None: sys.argv[1:].

  Returns:
    The exit code: 0, or 2 on bad input (the message on stderr).

  Raises:
    SystemExit: from argparse, for a usage error (code 2) or --help (code 0).
  """
  from orbax_mtc.tools import size, size_render

  parser = _size_parser()
  args = parser.parse_args(_attach_signed_values(
      list(sys.argv[1:] if argv is None else argv), ("--state-size",)))
  try:
    if args.render is None:
      given = [name for name in _SIZE_RENDER_ONLY if getattr(args, name) is not None]
      if given:
        raise size.SizingError(f"{', '.join('--' + n.replace('_', '-') for n in given)} "
                               "only apply with --render OUTDIR")
    else:
      missing = [name for name in _SIZE_RENDER_REQUIRED if getattr(args, name) is None]
      if missing:
        flags = ", ".join("--" + name.replace("_", "-") for name in missing)
        raise size.SizingError(f"--render needs {flags}")
    peers = args.peers
    if peers is None and args.render is not None and args.accelerator == "tpu" \
        and args.slices == 1:
      peers = 1  # one slice has no twin: the manager keeps one peer copy per node
    if args.state_size is not None:
      try:
        size.parse_size(args.state_size)
      except size.SizingError as e:
        raise size.SizingError(f"--state-size: {e}") from None
    sizing = size_render.size_from(accelerator=args.accelerator, state_size=args.state_size,
                                   from_step=args.from_step, nodes=args.nodes, peers=peers)
    written = None
    if args.render is not None:
      # Before anything is printed: a bad --render option fails the run with stdout empty.
      options = {name: getattr(args, name) for name in _SIZE_RENDER_ONLY
                 if name != "templates" and getattr(args, name) is not None}
      written = size_render.render(args.render, sizing, templates=args.templates,
                                   nodes=args.nodes, **options)
    if args.json:
      print_json(size.document(sizing, args.nodes, written))
    else:
      print(sizing.explain())
      if written is not None:
        print(f"wrote {', '.join(str(p) for p in written)}")
  except size.SizingError as e:
    print(f"orbax-mtc size: error: {e}", file=sys.stderr)
    return 2
  return 0


def main(argv: Sequence[str] | None = None) -> int:
  """Runs one `orbax-mtc` verb (the console script and `python -m orbax_mtc`).

  Args:
    argv: the command line after `orbax-mtc`; None: sys.argv[1:].

  Returns:
    The verb's exit code.

  Raises:
    SystemExit: from argparse, for a usage error (code 2) or --help (code 0).
  """
  argv = list(sys.argv[1:] if argv is None else argv)
  if argv and argv[0] in _PASSTHROUGH:
    verb, rest = argv[0], argv[1:]
    if verb == "launch":
      from orbax_mtc.tools import launch

      return launch.main(rest)
    if verb == "bench":
      return _bench(rest)
    if verb == "gc":
      from orbax_mtc.tools import gc

      return gc.main(rest)
    if verb == "size":
      return size_main(rest)
    from orbax_mtc.tools import demo

    return int(demo.main(rest) or 0)

  if argv and argv[0] in _VERSION_FLAGS:
    # Before argparse, which asks for a VERB first (`orbax-mtc -V` would be a usage error).
    print(f"orbax-mtc {version()}")
    return 0
  args = _parser().parse_args(argv)
  if args.version:  # `orbax-mtc status DIR --version`: argparse needed the verb's arguments
    return main(["--version"])
  from orbax_mtc.tools import inspection

  if args.verb == "status":
    return int(inspection.status_main(args.directory, as_json=args.json))
  if args.verb == "verify":
    return int(inspection.verify_main(args.directory, as_json=args.json))
  raise AssertionError(f"unhandled verb {args.verb!r}")  # argparse rejects unknown verbs


if __name__ == "__main__":
  sys.exit(main())
