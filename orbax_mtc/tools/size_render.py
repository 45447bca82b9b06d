"""The file side of `orbax-mtc size`: saved steps measured, GKE manifests rendered.

`--from-step` measures a saved step folder (`saved_step`); `--render` fills the templates under
`configs/gke/<accelerator>/` (placeholders `${NAME}`) and writes them with an `env.sh` the
set-up scripts read (`render`). The arithmetic is `orbax_mtc.tools.size`, which does no I/O.
This module never imports JAX unless it reads an orbax-mtc step.
"""

from __future__ import annotations

import math
import re
import shlex
from collections.abc import Mapping
from pathlib import Path

import yaml

from orbax_mtc.local import format as local_format
from orbax_mtc.local import store as local_store
from orbax_mtc.tools import size as sizemath
from orbax_mtc.tools.size import Sizing, SizingError

CSI_DRIVER = "multitier-checkpoint.csi.storage.gke.io"
# Installed from a wheel, the templates are package data (orbax_mtc/configs); in a checkout
# (also an editable install) they are the checkout's configs/.
_INSTALLED_TEMPLATES = Path(__file__).resolve().parents[1] / "configs"
TEMPLATES = _INSTALLED_TEMPLATES if _INSTALLED_TEMPLATES.is_dir() else \
    Path(__file__).resolve().parents[2] / "configs"
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


# ----------------------------------------------------------------------------- saved steps


def step_folder_bytes(step_dir: str | Path) -> tuple[int, bool]:
  """The bytes of a saved step folder.

  Args:
    step_dir: an orbax-mtc RAM-tier step (one node's shards, read from its manifest) or a
      standard Orbax step (the whole state: the sum of its file sizes).

  Returns:
    (bytes, per_node): per_node is True for an orbax-mtc step.

  Raises:
    SizingError: not a local folder, not one committed step, or no data in it; the message
      names the folder to pass instead.
  """
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

    try:
      manifest = local_store.read_manifest(path)
    except local_format.LocalTierError as e:
      raise SizingError(f"{e}; give a committed step (orbax-mtc status DIR lists them)") from e
    return manifest.data_size + (path / local_format.MANIFEST).stat().st_size, True
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


def saved_step(step_dir: str | Path) -> sizemath.SavedStep:
  """`step_folder_bytes` of `step_dir` as the `size.SavedStep` the arithmetic takes.

  Raises:
    SizingError: as `step_folder_bytes`.
  """
  nbytes, per_node = step_folder_bytes(step_dir)
  return sizemath.SavedStep(str(step_dir), nbytes, per_node)


def local_checkpoint(*, state_size: str | int | None = None,
                     from_step: str | Path | None = None,
                     nodes: int = 1) -> sizemath.LocalCheckpoint:
  """`size.local_checkpoint`, measuring the step folder `from_step` when given.

  Args:
    state_size: the whole training state, one copy; or
    from_step: a saved step folder (exactly one of the two).
    nodes: the nodes that share one copy of the state.

  Returns:
    One node's bytes per step, with how they were found.

  Raises:
    SizingError: bad input, checked before the folder is read.
  """
  sizemath.check_source(state_size_given=state_size is not None,
                        step_given=from_step is not None, nodes=nodes)
  step = None if from_step is None else saved_step(from_step)
  return sizemath.local_checkpoint(state_size=state_size, step=step, nodes=nodes)


def size_from(*, accelerator: str, state_size: str | int | None = None,
              from_step: str | Path | None = None, nodes: int = 1,
              peers: int | None = None) -> Sizing:
  """`size.size`, measuring the step folder `from_step` when given (`orbax-mtc size`).

  Args:
    accelerator: "tpu" or "gpu".
    state_size: the whole training state, one copy; or
    from_step: a saved step folder (exactly one of the two).
    nodes: the nodes that share one copy of the state.
    peers: peers per node holding other bytes than the node; None: the accelerator's default.

  Returns:
    The sizing.

  Raises:
    SizingError: bad input; the accelerator and peers are checked first, the folder last.
  """
  peers = sizemath.resolve_peers(accelerator, peers)  # checked before the folder is read
  local = local_checkpoint(state_size=state_size, from_step=from_step, nodes=nodes)
  return Sizing(local, accelerator, peers, sizemath.ramdisk_factor(accelerator, peers))


# ----------------------------------------------------------------------------- rendering


def tpu_labels(machine_type: str, nodes: int, *, accelerator_label: str | None = None,
               topology: str | None = None) -> tuple[str, str, int]:
  """(gke-tpu-accelerator label, topology, chips per node) for a slice of `nodes` hosts.

  The topology is inferred for power-of-two chip counts (2-D for v5e/v6e, 3-D for v4/v5p);
  it must equal the node pool's `--tpu-topology`.

  Args:
    machine_type: a TPU machine type, e.g. ct6e-standard-4t.
    nodes: hosts in the slice.
    accelerator_label: the gke-tpu-accelerator label; None: from the machine-type family.
    topology: the slice topology (4x4, 2x2x4); None: inferred.

  Returns:
    (label, topology, chips per node).

  Raises:
    SizingError: not a TPU machine type, an unknown family without a label, or a topology
      that cannot be inferred or does not match the chips.
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
  """The placeholder values for one accelerator's templates (RENDERED_KEYS[accelerator]).

  Args:
    sizing: the sizing whose quantity and peers the manifests carry.
    bucket, machine_type, job_name, nodes, slices, local_dir, image, backup_minutes,
      tpu_accelerator, tpu_topology: the --render options of the same names.

  Returns:
    Placeholder name -> value.

  Raises:
    SizingError: a bad value, or options that do not fit the accelerator or the sizing.
  """
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
  """`text` with every `${NAME}` replaced.

  Args:
    text: a template.
    values: placeholder name -> value.
    where: what the template is called in the error message.

  Returns:
    The filled-in text.

  Raises:
    SizingError: naming every placeholder without a value.
  """
  missing = sorted(set(PLACEHOLDER.findall(text)) - set(values))
  if missing:
    raise SizingError(f"{where} uses placeholders that --render does not fill: "
                      f"{', '.join(missing)}")
  return PLACEHOLDER.sub(lambda m: values[m.group(1)], text)


def render(outdir: str | Path, sizing: Sizing, *, templates: str | Path | None = None,
           **options) -> list[Path]:
  """Writes the filled-in CheckpointConfiguration and JobSet for `sizing.accelerator`, and an
  `env.sh` for the set-up scripts, into `outdir`.

  Args:
    outdir: the folder to write to (created when missing).
    sizing: the sizing the manifests carry.
    templates: the configs/ folder; None: TEMPLATES (the installed package's, or the
      checkout's).
    **options: the keyword arguments of `render_values` but `sizing`.

  Returns:
    The paths written.

  Raises:
    SizingError: bad options, templates not found, or a template that does not fill in to
      Kubernetes objects; nothing is written for a bad option or missing templates.
  """
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

