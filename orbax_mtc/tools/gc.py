"""`orbax-mtc gc DIR`: apply a retention policy to a persistent (standard Orbax) directory.

Steps and their commit times are read with Orbax's own step-name handling, so any folder an
`ocp.CheckpointManager` wrote works, on a local path or (with `orbax-mtc[gcs]`) on gs://.
Without `--delete` it only prints the plan; `--json` prints one document instead (schema in
docs/cli.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import re
import sys
import uuid
from collections.abc import Sequence
from typing import Any

from etils import epath
from orbax.checkpoint import path as ocp_path

from orbax_mtc.tools import console, reach, retention

_PROG = "orbax-mtc gc"


def step_records(directory: epath.Path) -> tuple[list[retention.StepRecord],
                                                 dict[int, epath.Path]]:
  """Complete and in-progress steps of an Orbax directory, with their folders."""
  records, paths = [], {}
  name_format = ocp_path.step.standard_name_format()
  for meta in name_format.find_all(directory):
    nsecs = meta.commit_timestamp_nsecs
    if nsecs is None:  # older checkpoints: the folder's own time
      nsecs = int(meta.path.stat().mtime * 1e9)
    when = dt.datetime.fromtimestamp(nsecs / 1e9, tz=dt.UTC)
    records.append(retention.StepRecord(meta.step, when, complete=True))
    paths[meta.step] = meta.path
  complete = set(paths)
  for entry in directory.iterdir():
    match = re.match(ocp_path.step.TMP_DIR_STEP_PATTERN, entry.name)
    if match and int(match.group(1)) not in complete:
      step = int(match.group(1))
      when = dt.datetime.fromtimestamp(entry.stat().mtime, tz=dt.UTC)
      records.append(retention.StepRecord(step, when, complete=False))
  return records, paths


def delete_step(path: epath.Path) -> None:
  """Removes one complete step so that an interrupted removal never leaves a folder that
  still looks complete: local folders are first renamed out of the step namespace; on object
  stores (no atomic rename) the commit marker goes first, then the rest with Orbax's own
  deleter, which also removes the folders of a hierarchical-namespace bucket (a plain
  recursive delete leaves them behind, empty, still listed under the directory)."""
  if str(path).startswith("gs://"):
    marker = path / ocp_path.atomicity.COMMIT_SUCCESS_FILE
    if marker.exists():
      marker.unlink()
    try:
      # The public way to Orbax's gcs_utils.rmtree (private in orbax-checkpoint 0.12): the
      # recursive delete, then the folder clean-up on a hierarchical-namespace bucket.
      ocp_path.deleter.PathDeleter(path.parent).delete(path)
    except FileNotFoundError:
      pass  # the marker was its only object (a flat bucket has no folder left)
    return
  doomed = path.parent / f".{path.name}.mtc-gc-{uuid.uuid4().hex[:8]}"
  path.rename(doomed)
  doomed.rmtree()


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="orbax-mtc gc",
      description="Delete persistent checkpoints that a retention policy does not keep. "
      "Rules compose (a step is kept if any rule keeps it); the newest complete step and "
      "steps still being written are always kept. Shows the plan; deletes only with --delete. "
      "Exit 0: done; 1: a deletion failed; 2: nothing done (bad arguments or directory).")
  parser.add_argument("directory", type=console.directory_arg,
                      help="a persistent Orbax checkpoint directory (path or gs://)")
  # Ranges checked here, so that an error names the flag (RetentionPolicy checks them again).
  parser.add_argument("--keep-latest", type=console.count_arg(0), default=None, metavar="N",
                      help="keep the N newest steps (default: no such rule)")
  parser.add_argument("--keep-every", type=console.count_arg(1), default=None, metavar="K",
                      help="keep every step that is a multiple of K (default: no such rule)")
  parser.add_argument("--hourly", type=console.count_arg(0), default=0, metavar="H",
                      help="keep the newest step of each of the last H hours (UTC) "
                      "(default: %(default)s)")
  parser.add_argument("--daily", type=console.count_arg(0), default=0, metavar="D",
                      help="keep the newest step of each of the last D days (UTC) "
                      "(default: %(default)s)")
  parser.add_argument("--weekly", type=console.count_arg(0), default=0, metavar="W",
                      help="keep the newest step of each of the last W ISO weeks "
                      "(default: %(default)s)")
  parser.add_argument("--delete", action="store_true",
                      help="delete what the plan says (default: only show it)")
  parser.add_argument("--json", action="store_true",
                      help="print one JSON document (schema orbax-mtc/gc/1) instead of the "
                      "plan; no progress bar")
  parser.add_argument("--now", default=None, help=argparse.SUPPRESS)  # tests: a fixed clock
  return parser


def document(directory: str, policy: retention.RetentionPolicy, now: dt.datetime,
             records: list[retention.StepRecord], decision: retention.RetentionDecision, *,
             dry_run: bool, deleted: list[int], error: str | None) -> dict[str, Any]:
  """The --json document of `gc` (docs/cli.md: orbax-mtc/gc/1)."""
  done = set(deleted)
  return {
      "schema": "orbax-mtc/gc/1",
      "directory": directory,
      "now": now.astimezone(dt.UTC).isoformat(),
      "policy": dataclasses.asdict(policy),
      "dry_run": dry_run,
      "steps": [{"step": r.step, "time": r.time.astimezone(dt.UTC).isoformat(),
                 "complete": r.complete,
                 "action": "keep" if r.step in decision.keep else "delete",
                 "reasons": list(decision.keep.get(r.step, ())),
                 "deleted": r.step in done}
                for r in sorted(records, key=lambda r: r.step)],
      "keep": sorted(decision.keep),
      "delete": list(decision.delete),
      "deleted": sorted(done),
      "error": error,
  }


def main(argv: Sequence[str]) -> int:
  """`orbax-mtc gc ...`: returns the exit code."""
  args = _parser().parse_args(list(argv))
  try:
    policy = retention.RetentionPolicy(keep_latest=args.keep_latest, keep_every=args.keep_every,
                                       hourly=args.hourly, daily=args.daily,
                                       weekly=args.weekly)
  except ValueError as e:
    console.error(_PROG, str(e))
    return 2
  if policy.is_empty:
    console.error(_PROG, "no retention rule given; name at least one of --keep-latest, "
              "--keep-every, --hourly, --daily, --weekly.")
    return 2
  try:
    reach.check(args.directory)
  except reach.UnreachableError as e:
    console.error(_PROG, str(e))
    return 2
  try:
    directory = epath.Path(args.directory)
    exists = directory.is_dir()
  except ImportError as e:
    console.error(_PROG, f"{args.directory}: reading it needs the GCS extra: pip install "
              f"'orbax-mtc[gcs]' ({e})")
    return 2
  if not exists:
    console.error(_PROG, f"{args.directory} is not a directory (or there is no access to it).")
    return 2
  now = (dt.datetime.fromisoformat(args.now) if args.now
         else dt.datetime.now(tz=dt.UTC))
  with console.no_missing_metadata_warnings():
    records, paths = step_records(directory)
  decision = retention.decide(records, policy, now)
  if not args.json:
    for line in retention.describe(decision, records):
      print(line)
    print(f"{len(decision.keep)} kept, {len(decision.delete)} to delete"
          + ("" if args.delete else " (dry run: add --delete to delete them)"), flush=True)
  deleted: list[int] = []
  failure = None
  if args.delete and decision.delete:
    # Each step on gs:// is one listing and a request per object: minutes for large steps.
    with console.progress(total=len(decision.delete), desc="gc: deleting", unit="step",
                      enabled=not args.json) as bar:
      for step in decision.delete:
        try:
          delete_step(paths[step])
        except Exception as e:  # noqa: BLE001 - reported with the steps deleted so far
          failure = f"deleting step {step} ({paths[step]}) failed: {type(e).__name__}: {e}"
          break
        deleted.append(step)
        bar.update(1)
        if not args.json:
          bar.write(f"deleted step {step}", file=sys.stdout)
  if args.json:
    console.print_json(document(args.directory, policy, now, records, decision,
                            dry_run=not args.delete, deleted=deleted, error=failure))
  if failure is not None:
    console.error(_PROG, f"{failure}; {len(deleted)} of {len(decision.delete)} step(s) deleted")
    return 1
  return 0
