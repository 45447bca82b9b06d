"""`orbax-mtc gc DIR`: apply a retention policy to a persistent (standard Orbax) directory.

Steps and their commit times are read with Orbax's own step-name handling, so any folder an
`ocp.CheckpointManager` wrote works, on a local path or (with `orbax-mtc[gcs]`) on gs://.
Without `--delete` it only prints the plan.
"""

from __future__ import annotations

import argparse
import datetime as dt
import re
import uuid
from collections.abc import Sequence

from etils import epath
from orbax.checkpoint import path as ocp_path

from orbax_mtc import retention


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
  stores (no atomic rename) the commit marker goes first."""
  if str(path).startswith("gs://"):
    marker = path / ocp_path.atomicity.COMMIT_SUCCESS_FILE
    if marker.exists():
      marker.unlink()
  else:
    doomed = path.parent / f".{path.name}.mtc-gc-{uuid.uuid4().hex[:8]}"
    path.rename(doomed)
    path = doomed
  path.rmtree()


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="orbax-mtc gc",
      description="Delete persistent checkpoints that a retention policy does not keep. "
      "Rules compose (a step is kept if any rule keeps it); the newest complete step and "
      "steps still being written are always kept. Shows the plan; deletes only with --delete.")
  parser.add_argument("directory", help="a persistent Orbax checkpoint directory (path or gs://)")
  parser.add_argument("--keep-latest", type=int, default=None, metavar="N",
                      help="keep the N newest steps")
  parser.add_argument("--keep-every", type=int, default=None, metavar="K",
                      help="keep every step that is a multiple of K")
  parser.add_argument("--hourly", type=int, default=0, metavar="H",
                      help="keep the newest step of each of the last H hours (UTC)")
  parser.add_argument("--daily", type=int, default=0, metavar="D",
                      help="keep the newest step of each of the last D days (UTC)")
  parser.add_argument("--weekly", type=int, default=0, metavar="W",
                      help="keep the newest step of each of the last W ISO weeks")
  parser.add_argument("--delete", action="store_true",
                      help="delete what the plan says (default: only show it)")
  parser.add_argument("--now", default=None, help=argparse.SUPPRESS)  # tests: a fixed clock
  return parser


def main(argv: Sequence[str]) -> int:
  args = _parser().parse_args(list(argv))
  try:
    policy = retention.RetentionPolicy(keep_latest=args.keep_latest, keep_every=args.keep_every,
                                       hourly=args.hourly, daily=args.daily,
                                       weekly=args.weekly)
  except ValueError as e:
    print(f"orbax-mtc gc: {e}")
    return 2
  if policy.is_empty:
    print("orbax-mtc gc: no retention rule given; name at least one of --keep-latest, "
          "--keep-every, --hourly, --daily, --weekly.")
    return 2
  directory = epath.Path(args.directory)
  if not directory.is_dir():
    print(f"orbax-mtc gc: {args.directory} is not a directory.")
    return 2
  now = (dt.datetime.fromisoformat(args.now) if args.now
         else dt.datetime.now(tz=dt.UTC))
  records, paths = step_records(directory)
  decision = retention.decide(records, policy, now)
  for line in retention.describe(decision, records):
    print(line)
  print(f"{len(decision.keep)} kept, {len(decision.delete)} to delete"
        + ("" if args.delete else " (dry run: add --delete to delete them)"))
  if args.delete:
    for step in decision.delete:
      delete_step(paths[step])
      print(f"deleted step {step}")
  return 0
