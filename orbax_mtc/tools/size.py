"""RAM-disk sizing for GKE multi-tier checkpointing: the arithmetic of `orbax-mtc size`.

GKE's multi-tier checkpointing guide publishes two numbers for a CheckpointConfiguration's
`inMemoryVolumeSize`: 2.2 x the local checkpoint size on TPU, 6.6 x with one peer on GPU. The
"local checkpoint size" is what one node writes per step: its own shards of the state. We use

  RAM disk = H x S x (1 + 2P) x local checkpoint size

  H = 1.1  headroom: manifests, filesystem metadata, a state that grows a little
  S = 2    resident steps: the newest committed step stays until the next one is committed
           (atomic commit never leaves a node with less than one whole step)
  P        peers that hold *different* bytes from this node, per node. Each costs two more
           step-sized regions per resident step: the copy kept for that peer, and room for the
           copy in flight while the replicator replaces it (or pulls a lost node's shards back).

On TPU the replicator's peers are the data-parallel twins in other slices, which already hold
the same bytes, so P = 0 and the factor is 2.2. A GPU job without replicas has P = 1: 6.6. The
guide gives only the two values; the reading of the terms and the linear growth in P are ours,
chosen to reproduce both. Sizes are rounded up to whole GiB, as a Kubernetes quantity (`106Gi`).

The local checkpoint size comes from a state size divided by the nodes that share one copy of
the state (hosts per TPU slice; all nodes of an FSDP GPU job), or from a saved step: an
orbax-mtc RAM-tier step holds one node's shards (its manifest's data size), a standard Orbax
step holds the whole state (the sum of its file sizes, divided by those nodes).

Pure: no file I/O and no command line. A saved step is measured by
`orbax_mtc.tools.size_render.saved_step`, the manifests are written by
`orbax_mtc.tools.size_render.render`, and the `size` verb is wired in `orbax_mtc.tools.cli`.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from fractions import Fraction
from pathlib import Path

GIB = 1 << 30
HEADROOM = Fraction(11, 10)
RESIDENT_STEPS = 2
ACCELERATORS = ("tpu", "gpu")
# Peers holding different bytes: TPU peers are twins in other slices; GPU jobs have no replicas.
DEFAULT_PEERS = {"tpu": 0, "gpu": 1}

_UNITS = {"": 1, "b": 1}
for _i, _p in enumerate("kmgtp", start=1):
  _UNITS.update({_p: 1000**_i, _p + "b": 1000**_i, _p + "i": 1024**_i, _p + "ib": 1024**_i})
# A sign is read so that a negative size is refused for what it is, not as unreadable.
_SIZE = re.compile(r"^\s*([-+]?\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


class SizingError(ValueError):
  """Bad input to the sizing or rendering; the message says what to pass instead."""


# ----------------------------------------------------------------------------- sizes


def parse_size(text: str | int) -> int:
  """Bytes in `text`: plain bytes, or a number with a unit (8GiB, 512MiB, 1.5TiB, 800GB).

  Args:
    text: a size as text, or a whole number of bytes.

  Returns:
    The size in bytes (rounded up to a whole byte).

  Raises:
    SizingError: `text` is not a size, has an unknown unit, or is not more than 0 bytes.
  """
  if isinstance(text, int) and not isinstance(text, bool):
    nbytes = text
  else:
    match = _SIZE.match(str(text))
    if match is None:
      raise SizingError(
          f"cannot read {text!r} as a size: give bytes (8589934592) or a number and a unit "
          "(8GiB, 512MiB, 1.5TiB, 800GB)")
    unit = match.group(2).lower()
    if unit not in _UNITS:
      raise SizingError(
          f"unknown unit {match.group(2)!r} in {text!r}: use B, KiB, MiB, GiB, TiB (powers of "
          "1024) or KB, MB, GB, TB (powers of 1000)")
    nbytes = math.ceil(Fraction(match.group(1)) * _UNITS[unit])
  if nbytes <= 0:
    raise SizingError(f"a checkpoint size must be more than 0 bytes, got {text!r}")
  return nbytes


def format_gib(nbytes: int | Fraction) -> str:
  """`nbytes` as GiB with two decimals, e.g. "48.00 GiB"."""
  return f"{float(Fraction(nbytes) / GIB):.2f} GiB"


def _format_number(value: Fraction) -> str:
  return f"{float(value):g}"


@dataclasses.dataclass(frozen=True)
class LocalCheckpoint:
  """One node's bytes per step, and how they were found (one line)."""
  nbytes: int
  how: str


@dataclasses.dataclass(frozen=True)
class SavedStep:
  """The measured size of a saved step folder (`size_render.saved_step` reads one).

  Attributes:
    path: the step folder as given (--from-step).
    nbytes: its bytes: one node's shards and manifest for an orbax-mtc RAM-tier step, the sum
      of its file sizes (the whole state) for a standard Orbax step.
    per_node: True for an orbax-mtc RAM-tier step, whose bytes are one node's already.
  """
  path: str
  nbytes: int
  per_node: bool


def check_source(*, state_size_given: bool, step_given: bool, nodes: int) -> None:
  """Checks that exactly one size source is given and that `nodes` is a whole number >= 1.

  Args:
    state_size_given: whether a state size (--state-size) is given.
    step_given: whether a saved step (--from-step) is given.
    nodes: the nodes that share one copy of the state.

  Raises:
    SizingError: both sources or none, or a bad `nodes`.
  """
  if state_size_given == step_given:
    raise SizingError("give exactly one of --state-size SIZE or --from-step DIR")
  if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
    raise SizingError(f"--nodes must be a whole number >= 1, got {nodes!r}")


def local_checkpoint(*, state_size: str | int | None = None, step: SavedStep | None = None,
                     nodes: int = 1) -> LocalCheckpoint:
  """One node's local checkpoint size from a state size or a measured saved step.

  Args:
    state_size: the whole training state, one copy (text such as "8GiB", or bytes).
    step: a saved step, measured by `size_render.saved_step`. Exactly one of the two.
    nodes: the nodes that share one copy of the state (hosts per TPU slice; all nodes of an
      FSDP GPU job); a state size and a standard Orbax step are divided by it.

  Returns:
    The bytes per node, with how they were found.

  Raises:
    SizingError: not exactly one source, a bad `nodes` or an unreadable size.
  """
  check_source(state_size_given=state_size is not None, step_given=step is not None,
               nodes=nodes)
  if state_size is not None:
    total, what = parse_size(state_size), "state"
  else:
    total, what = step.nbytes, f"Orbax step {step.path}"
    if step.per_node:
      return LocalCheckpoint(total, f"orbax-mtc step {step.path} (one node's shards + manifest)")
  if nodes == 1:
    return LocalCheckpoint(total, f"{format_gib(total)} {what} held by one node")
  return LocalCheckpoint(math.ceil(total / nodes),
                         f"{format_gib(total)} {what} / {nodes} nodes holding one copy")


def local_checkpoint_bytes(*, state_size: str | int | None = None,
                           step: SavedStep | None = None, nodes: int = 1) -> int:
  """One node's bytes per step; see `local_checkpoint` (same arguments and errors)."""
  return local_checkpoint(state_size=state_size, step=step, nodes=nodes).nbytes


# ----------------------------------------------------------------------------- the formula


def _check_accelerator(accelerator: str) -> None:
  if accelerator not in ACCELERATORS:
    raise SizingError(f"--accelerator must be one of {', '.join(ACCELERATORS)}, "
                      f"got {accelerator!r}")


def resolve_peers(accelerator: str, peers: int | None) -> int:
  """The peer count P: `peers`, or the accelerator's default (DEFAULT_PEERS) when None.

  Raises:
    SizingError: an unknown accelerator, or `peers` not a whole number >= 0.
  """
  _check_accelerator(accelerator)
  if peers is None:
    return DEFAULT_PEERS[accelerator]
  if isinstance(peers, bool) or not isinstance(peers, int) or peers < 0:
    raise SizingError(f"--peers must be a whole number >= 0, got {peers!r}")
  return peers


def ramdisk_factor(accelerator: str, peers: int | None = None) -> Fraction:
  """H x S x (1 + 2P): 2.2 on TPU (P = 0), 6.6 on GPU with one peer.

  Raises:
    SizingError: as `resolve_peers`.
  """
  return HEADROOM * RESIDENT_STEPS * (1 + 2 * resolve_peers(accelerator, peers))


@dataclasses.dataclass(frozen=True)
class Sizing:
  """The RAM disk one node needs, with the numbers that produced it."""
  local: LocalCheckpoint
  accelerator: str
  peers: int
  factor: Fraction

  @property
  def ramdisk_bytes(self) -> Fraction:
    return self.factor * self.local.nbytes

  @property
  def gib(self) -> int:
    return max(1, math.ceil(self.ramdisk_bytes / GIB))

  @property
  def quantity(self) -> str:
    """The Kubernetes quantity for `inMemoryVolumeSize`."""
    return f"{self.gib}Gi"

  def explain(self) -> str:
    local = format_gib(self.local.nbytes)
    if self.peers == 0:
      peer_note = ("TPU: the peers are data-parallel twins in other slices, which hold the "
                   "same bytes" if self.accelerator == "tpu"
                   else "no peer copies: a lost node restores from Cloud Storage")
    else:
      peer_note = f"{self.peers} other node(s) keep a copy of each node's shards"
    return "\n".join([
        f"local checkpoint per node: {local} ({self.local.nbytes} bytes) = {self.local.how}",
        f"RAM disk per node = 1.1 x 2 x (1 + 2 x {self.peers}) x local"
        f" = {_format_number(self.factor)} x {local} = {format_gib(self.ramdisk_bytes)}",
        "  1.1            headroom: manifests, filesystem metadata, a state that grows a little",
        "  2              resident steps: the newest committed step stays until the next commits",
        "  1 + 2 x peers  own shards; per peer holding other bytes: its kept copy + one in flight",
        f"  peers = {self.peers:<6d} {peer_note}",
        "  (GKE's guide: 2.2 x on TPU, 6.6 x on GPU with one peer; this formula gives both)",
        f"inMemoryVolumeSize: {self.quantity}   (rounded up to a whole GiB)",
    ])


def size(*, accelerator: str, state_size: str | int | None = None,
         step: SavedStep | None = None, nodes: int = 1, peers: int | None = None) -> Sizing:
  """The RAM disk to request per node for this state, accelerator and peer count.

  Args:
    accelerator: "tpu" or "gpu".
    state_size: the whole training state, one copy; or
    step: a saved step measured by `size_render.saved_step` (exactly one of the two).
    nodes: the nodes that share one copy of the state.
    peers: peers per node holding other bytes than the node; None: the accelerator's default.

  Returns:
    The sizing, with the numbers that produced it.

  Raises:
    SizingError: bad input (the accelerator and peers are checked first, then the source).
  """
  peers = resolve_peers(accelerator, peers)
  local = local_checkpoint(state_size=state_size, step=step, nodes=nodes)
  return Sizing(local, accelerator, peers, ramdisk_factor(accelerator, peers))


def document(sizing: Sizing, nodes: int, rendered: Sequence[Path] | None) -> dict:
  """The --json document of `size` (docs/cli.md: orbax-mtc/size/1).

  Args:
    sizing: the result of `size`.
    nodes: the --nodes given.
    rendered: the paths written by --render, or None without it.

  Returns:
    The document, ready for json.dumps.
  """
  return {
      "schema": "orbax-mtc/size/1",
      "accelerator": sizing.accelerator,
      "nodes": nodes,
      "peers": sizing.peers,
      "local_checkpoint_bytes": sizing.local.nbytes,
      "local_checkpoint_source": sizing.local.how,
      "headroom": float(HEADROOM),
      "resident_steps": RESIDENT_STEPS,
      "factor": float(sizing.factor),
      "ramdisk_bytes": math.ceil(sizing.ramdisk_bytes),
      "in_memory_volume_size_gib": sizing.gib,
      "in_memory_volume_size": sizing.quantity,
      "rendered": None if rendered is None else [str(p) for p in rendered],
  }

