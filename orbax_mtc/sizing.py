"""RAM-disk sizing for GKE multi-tier checkpointing, and the `orbax-mtc size` command.

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

`--render` fills the templates under `configs/gke/<accelerator>/` (placeholders `${NAME}`) and
writes them with an `env.sh` the set-up scripts read. This module never imports JAX unless it
reads an orbax-mtc step.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import shlex
import sys
from collections.abc import Mapping, Sequence
from fractions import Fraction
from pathlib import Path

import yaml

GIB = 1 << 30
HEADROOM = Fraction(11, 10)
RESIDENT_STEPS = 2
ACCELERATORS = ("tpu", "gpu")
# Peers holding different bytes: TPU peers are twins in other slices; GPU jobs have no replicas.
DEFAULT_PEERS = {"tpu": 0, "gpu": 1}
CSI_DRIVER = "multitier-checkpoint.csi.storage.gke.io"
# Installed from a wheel, the templates are package data (orbax_mtc/configs); in a checkout
# (also an editable install) they are the checkout's configs/.
_INSTALLED_TEMPLATES = Path(__file__).resolve().parent / "configs"
TEMPLATES = _INSTALLED_TEMPLATES if _INSTALLED_TEMPLATES.is_dir() else \
    Path(__file__).resolve().parents[1] / "configs"
MANIFEST_FILES = ("checkpoint-configuration.yaml", "jobset-maxtext.yaml")
PLACEHOLDER = re.compile(r"\$\{([A-Z][A-Z0-9_]*)\}")
# What --render fills, per accelerator (the templates may use no other placeholder).
RENDERED_KEYS = {
    "tpu": ("BUCKET", "JOB_NAME", "MACHINE_TYPE", "IN_MEMORY_VOLUME_SIZE", "LOCAL_DIR", "NODES",
            "SLICES", "IMAGE", "BACKUP_MINUTES", "TPU_ACCELERATOR", "TPU_TOPOLOGY",
            "CHIPS_PER_NODE"),
    "gpu": ("BUCKET", "JOB_NAME", "MACHINE_TYPE", "IN_MEMORY_VOLUME_SIZE", "LOCAL_DIR", "NODES",
            "IMAGE", "BACKUP_MINUTES", "PEERS", "GPUS_PER_NODE"),
}

_UNITS = {"": 1, "b": 1}
for _i, _p in enumerate("kmgtp", start=1):
  _UNITS.update({_p: 1000**_i, _p + "b": 1000**_i, _p + "i": 1024**_i, _p + "ib": 1024**_i})
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")
_STEP_NAME = re.compile(r"^(\d+|checkpoint_\d+)$")
# GKE's TPU node labels per machine-type family, and whether the slice topology is 3-D.
# GKE's --accelerator type per GPU machine-type family, for the node pool (env.sh GPU_TYPE).
_GPU_TYPES = {
    "a2-highgpu-": "nvidia-tesla-a100",
    "a2-ultragpu-": "nvidia-a100-80gb",
    "a3-highgpu-": "nvidia-h100-80gb",
    "a3-megagpu-": "nvidia-h100-mega-80gb",
    "a3-ultragpu-": "nvidia-h200-141gb",
    "a4-highgpu-": "nvidia-b200",
}
_TPU_FAMILIES = {
    "ct4p-": ("tpu-v4-podslice", 3),
    "ct5p-": ("tpu-v5p-slice", 3),
    "ct5lp-": ("tpu-v5-lite-podslice", 2),
    "ct6e-": ("tpu-v6e-slice", 2),
}


class SizingError(ValueError):
  """Bad input to the sizing or rendering; the message says what to pass instead."""


# ----------------------------------------------------------------------------- sizes


def parse_size(text: str | int) -> int:
  """Bytes in `text`: plain bytes, or a number with a unit (8GiB, 512MiB, 1.5TiB, 800GB)."""
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
  return f"{float(Fraction(nbytes) / GIB):.2f} GiB"


def _format_number(value: Fraction) -> str:
  return f"{float(value):g}"


@dataclasses.dataclass(frozen=True)
class LocalCheckpoint:
  """One node's bytes per step, and how they were found (one line)."""
  nbytes: int
  how: str


def step_folder_bytes(step_dir: str | Path) -> tuple[int, bool]:
  """(bytes, per_node) of a saved step: an orbax-mtc RAM-tier step (one node's shards, read
  from its manifest) or a standard Orbax step (the whole state: the sum of its file sizes)."""
  if str(step_dir).startswith("gs://"):
    raise SizingError(
        f"--from-step reads a local folder, not {step_dir}: run `gcloud storage du -s "
        f"{step_dir}` and pass the total as --state-size with --nodes")
  path = Path(step_dir)
  if not path.exists():
    raise SizingError(f"{path} does not exist: give a saved step folder, e.g. /local/1200")
  if not path.is_dir():
    raise SizingError(f"{path} is a file: give the step folder that holds it")
  if (path / "manifest.json").is_file():
    from orbax_mtc import local_tier  # imports JAX: only when an orbax-mtc step is read

    try:
      manifest = local_tier.read_manifest(path)
    except local_tier.LocalTierError as e:
      raise SizingError(f"{e}; give a committed step (orbax-mtc status DIR lists them)") from e
    return manifest.data_size + (path / local_tier.MANIFEST).stat().st_size, True
  if path.name.startswith("."):
    raise SizingError(f"{path} is a step still being written: give a committed step folder")
  steps = sorted((entry.name for entry in path.iterdir()
                  if entry.is_dir() and _STEP_NAME.match(entry.name)),
                 key=lambda name: int(name.rsplit("_", 1)[-1]))
  if steps:
    raise SizingError(
        f"{path} holds steps ({', '.join(steps[-3:])}{', ...' if len(steps) > 3 else ''}), "
        f"not one step: pass one of them, e.g. {path / steps[-1]}")
  total = sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())
  if total == 0:
    raise SizingError(f"{path} holds no data files: not a saved step")
  return total, False


def local_checkpoint(*, state_size: str | int | None = None,
                     from_step: str | Path | None = None, nodes: int = 1) -> LocalCheckpoint:
  """One node's local checkpoint size from a state size or a saved step (exactly one).

  nodes: the nodes that share one copy of the state (hosts per TPU slice; all nodes of an
    FSDP GPU job); a state size and a standard Orbax step are divided by it.
  """
  if (state_size is None) == (from_step is None):
    raise SizingError("give exactly one of --state-size SIZE or --from-step DIR")
  if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
    raise SizingError(f"--nodes must be a whole number >= 1, got {nodes!r}")
  if state_size is not None:
    total, per_node, what = parse_size(state_size), False, "state"
  else:
    total, per_node = step_folder_bytes(from_step)
    what = f"Orbax step {from_step}"
    if per_node:
      return LocalCheckpoint(total, f"orbax-mtc step {from_step} (one node's shards + manifest)")
  if nodes == 1:
    return LocalCheckpoint(total, f"{format_gib(total)} {what} held by one node")
  return LocalCheckpoint(math.ceil(total / nodes),
                         f"{format_gib(total)} {what} / {nodes} nodes holding one copy")


def local_checkpoint_bytes(*, state_size: str | int | None = None,
                           from_step: str | Path | None = None, nodes: int = 1) -> int:
  """One node's bytes per step; see `local_checkpoint`."""
  return local_checkpoint(state_size=state_size, from_step=from_step, nodes=nodes).nbytes


# ----------------------------------------------------------------------------- the formula


def _check_accelerator(accelerator: str) -> None:
  if accelerator not in ACCELERATORS:
    raise SizingError(f"--accelerator must be one of {', '.join(ACCELERATORS)}, "
                      f"got {accelerator!r}")


def resolve_peers(accelerator: str, peers: int | None) -> int:
  _check_accelerator(accelerator)
  if peers is None:
    return DEFAULT_PEERS[accelerator]
  if isinstance(peers, bool) or not isinstance(peers, int) or peers < 0:
    raise SizingError(f"--peers must be a whole number >= 0, got {peers!r}")
  return peers


def ramdisk_factor(accelerator: str, peers: int | None = None) -> Fraction:
  """H x S x (1 + 2P): 2.2 on TPU (P = 0), 6.6 on GPU with one peer."""
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
         from_step: str | Path | None = None, nodes: int = 1,
         peers: int | None = None) -> Sizing:
  """The RAM disk to request per node for this state, accelerator and peer count."""
  peers = resolve_peers(accelerator, peers)
  local = local_checkpoint(state_size=state_size, from_step=from_step, nodes=nodes)
  return Sizing(local, accelerator, peers, ramdisk_factor(accelerator, peers))


# ----------------------------------------------------------------------------- rendering


def tpu_labels(machine_type: str, nodes: int, *, accelerator_label: str | None = None,
               topology: str | None = None) -> tuple[str, str, int]:
  """(gke-tpu-accelerator label, topology, chips per node) for a slice of `nodes` hosts.

  The topology is inferred for power-of-two chip counts (2-D for v5e/v6e, 3-D for v4/v5p);
  it must equal the node pool's `--tpu-topology`.
  """
  match = re.search(r"-(\d+)t$", machine_type)
  if not machine_type.startswith("ct") or match is None:
    raise SizingError(f"{machine_type!r} is not a TPU machine type (e.g. ct6e-standard-4t, "
                      "ct5p-hightpu-4t); for GPUs pass --accelerator gpu")
  chips = int(match.group(1))
  family = next((v for k, v in _TPU_FAMILIES.items() if machine_type.startswith(k)), None)
  if accelerator_label is None:
    if family is None:
      raise SizingError(f"no known GKE TPU label for {machine_type!r}: pass "
                        "--tpu-accelerator (e.g. tpu-v6e-slice) and --tpu-topology")
    accelerator_label = family[0]
  if topology is None:
    total = chips * nodes
    exponent = total.bit_length() - 1
    if family is None or total != 1 << exponent or total < 4:
      raise SizingError(f"cannot infer the topology of {nodes} x {machine_type} "
                        f"({total} chips): pass --tpu-topology as in the node pool (e.g. 4x4)")
    if family[1] == 2:
      dims = [1 << (exponent // 2), 1 << (exponent - exponent // 2)]
    elif exponent == 2:
      dims = [2, 2, 1]  # one v4/v5p host: GKE spells it 2x2x1
    else:
      base, extra = divmod(exponent, 3)
      dims = sorted(1 << (base + (i >= 3 - extra)) for i in range(3))
    topology = "x".join(str(d) for d in dims)
  if not re.fullmatch(r"\d+(x\d+){1,2}", topology):
    raise SizingError(f"--tpu-topology must look like 4x4 or 2x2x4, got {topology!r}")
  slice_chips = math.prod(int(d) for d in topology.split("x"))
  if slice_chips != chips * nodes:
    raise SizingError(f"--tpu-topology {topology} has {slice_chips} chips, but {nodes} x "
                      f"{machine_type} have {chips * nodes}: fix --nodes or --tpu-topology")
  return accelerator_label, topology, chips


def _gpus_per_node(machine_type: str) -> int:
  match = re.search(r"-(\d+)g$", machine_type)
  if match is None:
    raise SizingError(f"{machine_type!r} is not a GPU machine type (e.g. a3-megagpu-8g, "
                      "a3-ultragpu-8g); for TPUs pass --accelerator tpu")
  return int(match.group(1))


def _check_name(flag: str, value: str, pattern: str, example: str) -> None:
  if not re.fullmatch(pattern, value):
    raise SizingError(f"{flag} {value!r} is not valid: use {example}")


def render_values(sizing: Sizing, *, bucket: str, machine_type: str, job_name: str,
                  nodes: int = 1, slices: int | None = None, local_dir: str = "/local",
                  image: str = "maxtext-orbax-mtc:latest", backup_minutes: int = 30,
                  tpu_accelerator: str | None = None,
                  tpu_topology: str | None = None) -> dict[str, str]:
  """The placeholder values for one accelerator's templates (RENDERED_KEYS[accelerator])."""
  bucket = bucket.removeprefix("gs://").rstrip("/")
  _check_name("--bucket", bucket, r"[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]",
              "a bucket name such as my-ckpt-bucket (no path)")
  # JobSet pod names add -<job>-<index>-<index>-<hash> to it: keep room under 63 characters.
  _check_name("--job-name", job_name, r"[a-z]([-a-z0-9]{0,38}[a-z0-9])?",
              "lowercase letters, digits and '-', starting with a letter, at most 40 characters")
  _check_name("--machine-type", machine_type, r"[a-z0-9][a-z0-9-]*", "e.g. ct6e-standard-4t")
  _check_name("--local-dir", local_dir, r"/[A-Za-z0-9._/-]*", "an absolute path such as /local")
  _check_name("--image", image, r"[A-Za-z0-9][A-Za-z0-9._/:@-]*",
              "an image reference such as us-docker.pkg.dev/PROJECT/REPO/maxtext:latest")
  if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
    raise SizingError(f"--nodes must be a whole number >= 1, got {nodes!r}")
  if isinstance(backup_minutes, bool) or not isinstance(backup_minutes, int) \
      or backup_minutes < 1:
    raise SizingError(f"--backup-minutes must be a whole number >= 1, got {backup_minutes!r}")
  values = {"BUCKET": bucket, "JOB_NAME": job_name, "MACHINE_TYPE": machine_type,
            "IN_MEMORY_VOLUME_SIZE": sizing.quantity, "LOCAL_DIR": local_dir,
            "NODES": str(nodes), "IMAGE": image, "BACKUP_MINUTES": str(backup_minutes)}
  if sizing.accelerator == "tpu":
    slices = 2 if slices is None else slices
    if isinstance(slices, bool) or not isinstance(slices, int) or slices < 1:
      raise SizingError(f"--slices must be a whole number >= 1, got {slices!r}")
    # The JobSet lets the manager pick peers: twins in other slices, or one peer per node in
    # a single slice. The sizing must assume the same.
    expected = 0 if slices >= 2 else 1
    if sizing.peers != expected:
      why = ("data-parallel twins hold the same bytes" if expected == 0
             else "no twin in another slice")
      raise SizingError(
          f"a TPU job of {slices} slice(s) keeps {expected} peer copy(ies) of other nodes' "
          f"bytes per node ({why}), but the size was computed with --peers {sizing.peers}: "
          f"pass --peers {expected}")
    label, topology, chips = tpu_labels(machine_type, nodes, accelerator_label=tpu_accelerator,
                                        topology=tpu_topology)
    values.update({"SLICES": str(slices), "TPU_ACCELERATOR": label, "TPU_TOPOLOGY": topology,
                   "CHIPS_PER_NODE": str(chips)})
  else:
    if slices not in (None, 1):
      raise SizingError("--slices applies to TPU jobs; a GPU JobSet is one group of --nodes")
    if tpu_accelerator is not None or tpu_topology is not None:
      raise SizingError("--tpu-accelerator/--tpu-topology apply to --accelerator tpu only")
    values.update({"PEERS": str(sizing.peers), "GPUS_PER_NODE": str(_gpus_per_node(machine_type))})
  return values


def fill(text: str, values: Mapping[str, str], *, where: str = "template") -> str:
  """`text` with every `${NAME}` replaced; SizingError naming any NAME without a value."""
  missing = sorted(set(PLACEHOLDER.findall(text)) - set(values))
  if missing:
    raise SizingError(f"{where} uses placeholders that --render does not fill: "
                      f"{', '.join(missing)}")
  return PLACEHOLDER.sub(lambda m: values[m.group(1)], text)


def render(outdir: str | Path, sizing: Sizing, *, templates: str | Path | None = None,
           **options) -> list[Path]:
  """Writes the filled-in CheckpointConfiguration and JobSet for `sizing.accelerator`, and an
  `env.sh` for the set-up scripts, into `outdir`. Returns the paths written."""
  values = render_values(sizing, **options)
  source = Path(templates) if templates is not None else TEMPLATES
  source = source / "gke" / sizing.accelerator
  if not all((source / name).is_file() for name in MANIFEST_FILES):
    raise SizingError(
        f"templates not found in {source}: reinstall orbax-mtc (its wheel carries them) or "
        "pass --templates path/to/configs")
  outdir = Path(outdir)
  outdir.mkdir(parents=True, exist_ok=True)
  written = []
  for name in MANIFEST_FILES:
    text = fill((source / name).read_text(), values, where=str(source / name))
    try:
      docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as e:
      raise SizingError(f"{source / name} does not parse once filled in: {e}") from e
    if not docs or not all(isinstance(d, dict) and "kind" in d for d in docs):
      raise SizingError(f"{source / name} holds no Kubernetes object once filled in")
    (outdir / name).write_text(text)
    written.append(outdir / name)
  env = {"ACCELERATOR": sizing.accelerator, **values, "RENDERED": str(outdir.resolve())}
  gpu_type = next((v for k, v in _GPU_TYPES.items() if values["MACHINE_TYPE"].startswith(k)),
                  None)
  if sizing.accelerator == "gpu" and gpu_type is not None:
    env["GPU_TYPE"] = gpu_type  # cluster-setup.sh's node pool; not in the manifests
  env_lines = ["# Written by `orbax-mtc size --render`: source it before the set-up scripts."]
  env_lines += [f"export {key}={shlex.quote(value)}" for key, value in env.items()]
  (outdir / "env.sh").write_text("\n".join(env_lines) + "\n")
  written.append(outdir / "env.sh")
  return written


# ----------------------------------------------------------------------------- command line

_RENDER_REQUIRED = ("bucket", "machine_type", "job_name")
_RENDER_ONLY = ("bucket", "machine_type", "job_name", "slices", "local_dir", "image",
                "backup_minutes", "tpu_accelerator", "tpu_topology", "templates")


def _parser() -> argparse.ArgumentParser:
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
  parser.add_argument("--accelerator", required=True, choices=ACCELERATORS,
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


def document(sizing: Sizing, nodes: int, rendered: Sequence[Path] | None) -> dict:
  """The --json document of `size` (docs/cli.md: orbax-mtc/size/1)."""
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


def main(argv: Sequence[str] | None = None) -> int:
  """`orbax-mtc size ...`: prints the sizing (--json: one document); with --render writes the
  manifests. Exit code: 0, or 2 on bad input (the message on stderr)."""
  parser = _parser()
  args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
  try:
    if args.render is None:
      given = [name for name in _RENDER_ONLY if getattr(args, name) is not None]
      if given:
        raise SizingError(f"{', '.join('--' + n.replace('_', '-') for n in given)} "
                          "only apply with --render OUTDIR")
    else:
      missing = [name for name in _RENDER_REQUIRED if getattr(args, name) is None]
      if missing:
        flags = ", ".join("--" + name.replace("_", "-") for name in missing)
        raise SizingError(f"--render needs {flags}")
    peers = args.peers
    if peers is None and args.render is not None and args.accelerator == "tpu" \
        and args.slices == 1:
      peers = 1  # one slice has no twin: the manager keeps one peer copy per node
    sizing = size(accelerator=args.accelerator, state_size=args.state_size,
                  from_step=args.from_step, nodes=args.nodes, peers=peers)
    if not args.json:
      print(sizing.explain())
    written = None
    if args.render is not None:
      options = {name: getattr(args, name) for name in _RENDER_ONLY
                 if name != "templates" and getattr(args, name) is not None}
      written = render(args.render, sizing, templates=args.templates, nodes=args.nodes,
                       **options)
      if not args.json:
        print(f"wrote {', '.join(str(p) for p in written)}")
    if args.json:
      from orbax_mtc import cli

      cli.print_json(document(sizing, args.nodes, written))
  except SizingError as e:
    print(f"orbax-mtc size: error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
