"""A protocol-faithful simulator of GKE's multi-tier checkpointing replicator, one per node.

Run as its own process beside a job process (the real one is a DaemonSet pod on the node):

  python tests/replicator_sim.py --volume ROOT/node1 --volume-pattern 'ROOT/node{rank}'
      --backup BACKUP_DIR [--errors TEXT] [--fail TEXT]

What it does, as the real daemon does with the node's RAM-disk volume:
- `replicator.yaml`: validated with its own rules (not orbax_mtc's code, so the manager's
  writer is checked against an independent reader); a bad file -> `replicator.failed` with the
  reason; a good one -> deleted (the job waits for that), then the `.restore` entries: for
  the newest step it can assemble for every node (from the node's own volume, the copies it
  keeps in peers' volumes, or its backups) a symlink `<job>-s<step>-n<rank>-w0.restore` to
  that step's folder in this volume (copied in first when the volume lacks it), or a
  zero-size `<job>-s0-n<rank>-w0.restore` when there is none.
- New committed step folders (`<volume>/<step>`, which appear by atomic rename) are copied
  to each peer's volume under `.replicator/n<rank>/<step>` (keeping the newest 2), and backed
  up to `BACKUP_DIR/<job>/n<rank>/<step>` on the yaml's schedule.
- `--errors TEXT` writes `replicator.errors` after taking the yaml; `--fail TEXT` answers the
  yaml with `replicator.failed` instead.
Each action prints one `@@sim` line; `IDLE` when it has caught up, with the committed steps
it has handled (printed once after each burst of work). It polls the volume (the protocol has no other notice).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import stat
import sys
import time
import uuid

import yaml

KEEP_COPIES = 2
_REQUIRED = {"job-name": str, "framework": str, "assume-data-parallelism": int,
             "node-rank": int, "nodes": int}
_OPTIONAL = {"peer-ranks": list, "peers-per-node": int, "backup-interval-minutes": (int, float),
             "backup-interval-steps": int}


class BadConfig(ValueError):
  pass


def say(line: str) -> None:
  print(f"@@sim {line}", flush=True)


def validate(text: str) -> dict:
  """The daemon's reading of replicator.yaml: every key known, typed, consistent."""
  try:
    fields = yaml.safe_load(text)
  except yaml.YAMLError as e:
    raise BadConfig(f"not YAML: {e}") from e
  if not isinstance(fields, dict):
    raise BadConfig("not a mapping")
  for key in fields:
    if key not in _REQUIRED and key not in _OPTIONAL:
      raise BadConfig(f"unknown key {key!r}")
  for key, kind in {**_REQUIRED, **_OPTIONAL}.items():
    if key in _REQUIRED and key not in fields:
      raise BadConfig(f"missing key {key!r}")
    if key in fields and (not isinstance(fields[key], kind) or isinstance(fields[key], bool)):
      raise BadConfig(f"{key}: {fields[key]!r} is not a {kind}")
  if fields["framework"] != "orbax":
    raise BadConfig(f"framework {fields['framework']!r} is not supported")
  nodes, rank = fields["nodes"], fields["node-rank"]
  if nodes < 1 or not 0 <= rank < nodes:
    raise BadConfig(f"node-rank {rank} out of range for {nodes} nodes")
  if fields["assume-data-parallelism"] < 1 or nodes % fields["assume-data-parallelism"]:
    raise BadConfig("assume-data-parallelism must divide nodes")
  if ("peer-ranks" in fields) == ("peers-per-node" in fields):
    raise BadConfig("exactly one of peer-ranks and peers-per-node")
  if "peer-ranks" in fields:
    peers = fields["peer-ranks"]
    if any(not isinstance(p, int) or not 0 <= p < nodes or p == rank for p in peers) or \
        len(set(peers)) != len(peers):
      raise BadConfig(f"bad peer-ranks {peers}")
  elif not 0 <= fields["peers-per-node"] < nodes:
    raise BadConfig(f"bad peers-per-node {fields['peers-per-node']}")
  if ("backup-interval-minutes" in fields) == ("backup-interval-steps" in fields):
    raise BadConfig("exactly one of backup-interval-minutes and backup-interval-steps")
  interval = fields.get("backup-interval-minutes", fields.get("backup-interval-steps"))
  if interval <= 0:
    raise BadConfig(f"backup interval {interval} must be > 0")
  return fields


def committed(folder: pathlib.Path) -> list[int]:
  """Step folders of a volume (digits only: they appear by atomic rename)."""
  if not folder.is_dir():
    return []
  return sorted(int(p.name) for p in folder.iterdir()
                if p.name.isdigit() and not p.is_symlink() and p.is_dir())


def copy_atomic(src: pathlib.Path, dst: pathlib.Path) -> bool:
  """Copies a folder to `dst` via a temporary name; False if the source vanished meanwhile
  (the job's retention removed it)."""
  tmp = dst.parent / f".tmp-{dst.name}-{uuid.uuid4().hex[:8]}"
  dst.parent.mkdir(parents=True, exist_ok=True)
  try:
    shutil.copytree(src, tmp)
  except (FileNotFoundError, shutil.Error):
    shutil.rmtree(tmp, ignore_errors=True)
    return False
  if dst.exists():
    shutil.rmtree(dst)
  os.rename(tmp, dst)
  return True


class Simulator:
  def __init__(self, args):
    self.volume = pathlib.Path(args.volume)
    self.pattern = args.volume_pattern
    self.backup = pathlib.Path(args.backup)
    self.errors, self.fail = args.errors, args.fail
    self.config: dict | None = None
    self.replicated: set[int] = set()
    self.last_backup: tuple[int, float] | None = None

  def volume_of(self, rank: int) -> pathlib.Path:
    return pathlib.Path(self.pattern.format(rank=rank))

  @property
  def rank(self) -> int:
    return self.config["node-rank"]

  def peers(self) -> list[int]:
    cfg = self.config
    if "peer-ranks" in cfg:
      return list(cfg["peer-ranks"])
    return [(self.rank + i) % cfg["nodes"] for i in range(1, cfg["peers-per-node"] + 1)]

  def sources(self, rank: int, job: str) -> dict[int, pathlib.Path]:
    """Every step this simulator's cluster can give node `rank`, with a folder holding it."""
    found: dict[int, pathlib.Path] = {}
    for step in (s for s in committed(self.backup / job / f"n{rank}")):
      found[step] = self.backup / job / f"n{rank}" / str(step)
    for peer in range(self.config["nodes"]):
      holder = self.volume_of(peer) / ".replicator" / f"n{rank}"
      for step in committed(holder):
        found[step] = holder / str(step)
    own = self.volume_of(rank)
    for step in committed(own):
      found[step] = own / str(step)
    return found

  def write_restore_entries(self) -> None:
    job, rank, nodes = self.config["job-name"], self.rank, self.config["nodes"]
    per_node = [self.sources(r, job) for r in range(nodes)]
    common = set(per_node[0]).intersection(*per_node[1:])
    step = max(common) if common else 0
    if not step:
      (self.volume / f"{job}-s0-n{rank}-w0.restore").touch()
      say(f"RESTORE rank={rank} step=0 source=none")
      return
    src = per_node[rank][step]
    if src.parent == self.volume:
      target, source = str(step), "own"
    else:
      staged = self.volume / ".replicator" / "restore" / str(step)
      copy_atomic(src, staged)
      target = f".replicator/restore/{step}"
      source = "backup" if self.backup in src.parents else "peer"
    link = self.volume / f"{job}-s{step}-n{rank}-w0.restore"
    tmp = self.volume / f".{link.name}.tmp"
    os.symlink(target, tmp)
    os.replace(tmp, link)
    say(f"RESTORE rank={rank} step={step} source={source}")

  def take_config(self) -> None:
    path = self.volume / "replicator.yaml"
    say(f"YAML_MODE rank={self.volume.name} mode={stat.S_IMODE(os.lstat(path).st_mode):o}")
    text = path.read_text()
    try:
      if self.fail:
        raise BadConfig(self.fail)
      config = validate(text)
      expected = self.volume_of(config["node-rank"]).resolve()
      if expected != self.volume.resolve():
        raise BadConfig(f"node-rank {config['node-rank']} is not this node ({self.volume})")
    except BadConfig as e:
      (self.volume / "replicator.failed").write_text(f"invalid replicator.yaml: {e}\n")
      path.unlink()
      say(f"FAILED reason={str(e).replace(' ', '_')}")
      return
    for entry in self.volume.glob("*.restore"):  # answers to an earlier configuration
      entry.unlink()
    path.unlink()
    self.config = config
    peers = config.get("peer-ranks", config.get("peers-per-node"))
    say(f"CONFIG job={config['job-name']} rank={config['node-rank']} nodes={config['nodes']} "
        f"dp={config['assume-data-parallelism']} peers={str(peers).replace(' ', '')} "
        f"interval={config.get('backup-interval-steps', config.get('backup-interval-minutes'))}")
    if self.errors:
      (self.volume / "replicator.errors").write_text(self.errors + "\n")
    # Steps already here were replicated before (or come back from the restore).
    self.replicated = set(committed(self.volume))
    self.write_restore_entries()

  def replicate(self) -> list[int] | None:
    """Copies (and backs up) the committed steps not handled yet; None if there were any,
    else the committed steps (all handled before)."""
    handled = False
    steps = committed(self.volume)
    for step in steps:
      if step in self.replicated:
        continue
      handled = True
      self.replicated.add(step)
      src = self.volume / str(step)
      for peer in self.peers():
        holder = self.volume_of(peer) / ".replicator" / f"n{self.rank}"
        if copy_atomic(src, holder / str(step)):
          say(f"REPLICATED rank={self.rank} step={step} to={peer}")
        for old in committed(holder)[:-KEEP_COPIES]:
          shutil.rmtree(holder / str(old), ignore_errors=True)
      self.maybe_back_up(step, src)
    return None if handled else steps

  def maybe_back_up(self, step: int, src: pathlib.Path) -> None:
    cfg, now = self.config, time.time()
    if self.last_backup is not None:
      last_step, last_time = self.last_backup
      if "backup-interval-steps" in cfg and step - last_step < cfg["backup-interval-steps"]:
        return
      if "backup-interval-minutes" in cfg and \
          now - last_time < 60 * cfg["backup-interval-minutes"]:
        return
    if copy_atomic(src, self.backup / cfg["job-name"] / f"n{self.rank}" / str(step)):
      self.last_backup = (step, now)
      say(f"BACKUP rank={self.rank} step={step}")

  def run(self, poll_s: float) -> None:
    self.volume.mkdir(parents=True, exist_ok=True)
    say(f"READY volume={self.volume}")
    busy = False
    while True:
      if (self.volume / "replicator.yaml").exists():
        self.take_config()
        busy = True
      if self.config is not None:
        steps = self.replicate()
        if steps is None:
          busy = True
        elif busy:  # caught up: every committed step listed was handled
          say(f"IDLE rank={self.rank} steps={','.join(map(str, steps)) or '-'}")
          busy = False
      time.sleep(poll_s)  # a daemon watching a folder


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--volume", required=True)
  parser.add_argument("--volume-pattern", required=True, help="e.g. /dev/shm/x/node{rank}")
  parser.add_argument("--backup", required=True)
  parser.add_argument("--errors", default=None)
  parser.add_argument("--fail", default=None)
  parser.add_argument("--poll", type=float, default=0.02)
  args = parser.parse_args(argv)
  Simulator(args).run(args.poll)
  return 0


if __name__ == "__main__":
  sys.exit(main())
