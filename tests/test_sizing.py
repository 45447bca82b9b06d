"""`orbax-mtc size`: the RAM-disk formula, sizes from text and saved steps, the command line,
and rendering the GKE manifests."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
import zipfile
from fractions import Fraction
from pathlib import Path

import pytest
import yaml

from orbax_mtc.tools import cli, size, size_render
from orbax_mtc.tools.size import GIB, SizingError

# ----------------------------------------------------------------------------- parse_size


@pytest.mark.parametrize("text, want", [
    ("8GiB", 8 * GIB), ("8 GiB", 8 * GIB), ("8gib", 8 * GIB), ("8Gi", 8 * GIB),
    ("512MiB", 512 << 20), ("1.5TiB", 3 << 39), ("800GB", 800 * 10**9), ("800G", 800 * 10**9),
    ("4096", 4096), ("4096B", 4096), (4096, 4096), ("0.5KiB", 512), ("1.0001KB", 1001),
])
def test_parse_size(text, want):
  assert size.parse_size(text) == want


@pytest.mark.parametrize("text, fragment", [
    ("", "cannot read"), ("GiB", "cannot read"), ("-1GiB", "more than 0 bytes, got '-1GiB'"),
    ("8 XB", "unknown unit 'XB'"), ("0", "more than 0"), ("0GiB", "more than 0"),
    ("1e9", "cannot read"), (0, "more than 0"),
])
def test_parse_size_rejects_with_the_fix(text, fragment):
  with pytest.raises(SizingError, match=fragment):
    size.parse_size(text)


# ----------------------------------------------------------------------------- the formula


def test_factor_matches_both_published_anchors_exactly():
  assert size.ramdisk_factor("tpu") == Fraction(22, 10)
  assert size.ramdisk_factor("gpu") == Fraction(66, 10)
  assert size.ramdisk_factor("gpu", 1) == Fraction(66, 10)


def test_factor_is_linear_in_peers_and_only_peers_matter():
  for accelerator in ("tpu", "gpu"):
    steps = [size.ramdisk_factor(accelerator, p) for p in range(5)]
    assert [b - a for a, b in zip(steps, steps[1:], strict=False)] == [Fraction(44, 10)] * 4
  assert size.ramdisk_factor("tpu", 1) == size.ramdisk_factor("gpu", 1)
  assert size.ramdisk_factor("gpu", 0) == size.ramdisk_factor("tpu", 0)
  assert size.ramdisk_factor("gpu", 2) == 11


@pytest.mark.parametrize("accelerator, peers, fragment", [
    ("cpu", None, "--accelerator must be one of tpu, gpu"),
    ("tpu", -1, "--peers must be a whole number >= 0"),
    ("gpu", 1.5, "--peers must be a whole number >= 0"),
    ("gpu", True, "--peers must be a whole number >= 0"),
])
def test_factor_rejects_bad_input(accelerator, peers, fragment):
  with pytest.raises(SizingError, match=fragment):
    size.ramdisk_factor(accelerator, peers)


@pytest.mark.parametrize("state, nodes, accelerator, peers, want", [
    ("10GiB", 1, "tpu", None, "22Gi"),    # 22 exactly: float 2.2 * 10 would round up to 23
    ("8GiB", 1, "gpu", None, "53Gi"),     # 52.8
    ("768GiB", 16, "tpu", None, "106Gi"),  # 48 GiB a node -> 105.6
    ("64GiB", 8, "gpu", 2, "88Gi"),       # 8 GiB x 11
    ("1", 1, "tpu", None, "1Gi"),         # never 0Gi
    ("5GiB", 1, "tpu", None, "11Gi"),
])
def test_quantity_rounds_up_to_whole_gib(state, nodes, accelerator, peers, want):
  result = size.size(state_size=state, nodes=nodes, accelerator=accelerator, peers=peers)
  assert result.quantity == want
  assert result.gib * GIB >= result.factor * result.local.nbytes > (result.gib - 1) * GIB \
      or result.gib == 1


def test_state_size_is_divided_by_the_nodes_holding_one_copy():
  assert size.local_checkpoint_bytes(state_size="768GiB", nodes=16) == 48 * GIB
  assert size.local_checkpoint_bytes(state_size="10", nodes=3) == 4  # rounded up
  local = size.local_checkpoint(state_size="1GiB", nodes=4)
  assert "/ 4 nodes" in local.how


@pytest.mark.parametrize("kwargs, fragment", [
    ({}, "exactly one of --state-size SIZE or --from-step DIR"),
    ({"state_size": "1GiB", "from_step": "/x"}, "exactly one of"),
    ({"state_size": "1GiB", "nodes": 0}, "--nodes must be a whole number >= 1"),
])
def test_local_checkpoint_rejects_bad_input(kwargs, fragment):
  with pytest.raises(SizingError, match=fragment):
    size_render.local_checkpoint(**kwargs)


def test_pure_local_checkpoint_takes_a_measured_step():
  orbax_step = size.SavedStep("/run/3", 1000, per_node=False)
  assert size.local_checkpoint_bytes(step=orbax_step, nodes=4) == 250
  assert "Orbax step /run/3 / 4 nodes" in size.local_checkpoint(step=orbax_step, nodes=4).how
  mtc_step = size.SavedStep("/local/3", 1000, per_node=True)
  assert size.local_checkpoint_bytes(step=mtc_step, nodes=4) == 1000  # one node's already
  with pytest.raises(SizingError, match="exactly one of"):
    size.local_checkpoint(state_size="1GiB", step=mtc_step)
  assert size.size(step=mtc_step, accelerator="gpu").quantity == "1Gi"


def test_explanation_fills_in_the_numbers():
  text = size.size(state_size="768GiB", nodes=16, accelerator="tpu").explain()
  assert "48.00 GiB" in text
  assert "1.1 x 2 x (1 + 2 x 0) x local = 2.2 x 48.00 GiB = 105.60 GiB" in text
  assert "twins" in text
  assert text.splitlines()[-1].startswith("inMemoryVolumeSize: 106Gi")
  gpu = size.size(state_size="8GiB", accelerator="gpu").explain()
  assert "1.1 x 2 x (1 + 2 x 1) x local = 6.6 x 8.00 GiB = 52.80 GiB" in gpu


# ----------------------------------------------------------------------------- saved steps


def test_from_step_reads_orbax_mtc_and_orbax_steps(shm_dir, mesh):
  import orbax.checkpoint as ocp
  from conftest import abstract_of, make_state

  import orbax_mtc as mtc
  from orbax_mtc.local.format import MANIFEST
  from orbax_mtc.local.store import read_manifest

  state = make_state(mesh, scale=64)
  options = mtc.CheckpointManagerOptions(
      local=mtc.LocalCheckpointOptions(save_interval_steps=1, max_to_keep=1),
      persistent=mtc.PersistentCheckpointOptions(save_interval_steps=1),
      replication=mtc.ReplicationOptions(replica_axis="data"))
  local_dir, persistent_dir = shm_dir / "local", shm_dir / "persistent"
  with mtc.CheckpointManager(local_dir, persistent_dir, mesh, abstract_of(state),
                             options=options) as mgr:
    mgr.save(3, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state)))
    mgr.wait_until_finished()

  local_step = next(p for p in local_dir.rglob("3") if (p / MANIFEST).is_file())
  manifest = read_manifest(local_step)
  array_bytes = sum(x.nbytes for x in [state["params"]["w"], state["ids"]])
  assert manifest.data_size >= array_bytes
  want = manifest.data_size + (local_step / MANIFEST).stat().st_size
  assert size_render.local_checkpoint(from_step=local_step).nbytes == want
  # One node's shards already: --nodes does not divide them.
  assert size_render.local_checkpoint(from_step=local_step, nodes=8).nbytes == want

  orbax_step = persistent_dir / "3"
  total = sum(f.stat().st_size for f in orbax_step.rglob("*") if f.is_file())
  assert total >= array_bytes
  assert size_render.local_checkpoint(from_step=orbax_step).nbytes == total
  assert size_render.local_checkpoint(from_step=orbax_step, nodes=2).nbytes == \
      math.ceil(total / 2)

  with pytest.raises(SizingError, match=rf"pass one of them, e\.g\. {persistent_dir / '3'}"):
    size_render.local_checkpoint(from_step=persistent_dir)

  (local_step / MANIFEST).write_text("{not json")
  with pytest.raises(SizingError, match="give a committed step"):
    size_render.local_checkpoint(from_step=local_step)


def test_from_step_plain_folder_and_its_errors(tmp_path):
  step = tmp_path / "run" / "1200"
  (step / "state" / "d").mkdir(parents=True)
  (step / "state" / "d" / "a").write_bytes(b"x" * 1000)
  (step / "_CHECKPOINT_METADATA").write_bytes(b"y" * 24)
  (step / "link").symlink_to(step / "state" / "d" / "a")  # not counted twice
  assert size_render.step_folder_bytes(step) == (1024, False)

  (tmp_path / "run" / "800").mkdir()
  with pytest.raises(SizingError, match=r"holds steps \(800, 1200\).*e\.g\. .*run/1200"):
    size_render.step_folder_bytes(tmp_path / "run")
  pax = tmp_path / "pax"
  (pax / "checkpoint_00000100").mkdir(parents=True)
  with pytest.raises(SizingError, match="checkpoint_00000100"):
    size_render.step_folder_bytes(pax)
  (tmp_path / "empty").mkdir()
  with pytest.raises(SizingError, match="holds no data files"):
    size_render.step_folder_bytes(tmp_path / "empty")
  with pytest.raises(SizingError, match="does not exist"):
    size_render.step_folder_bytes(tmp_path / "missing")
  with pytest.raises(SizingError, match="is a file"):
    size_render.step_folder_bytes(step / "_CHECKPOINT_METADATA")
  (tmp_path / ".tmp-5-abc").mkdir()
  (tmp_path / ".tmp-5-abc" / "data.bin").write_bytes(b"z")
  with pytest.raises(SizingError, match="still being written"):
    size_render.step_folder_bytes(tmp_path / ".tmp-5-abc")
  with pytest.raises(SizingError, match="gcloud storage du -s gs://b/run/1200"):
    size_render.step_folder_bytes("gs://b/run/1200")


# ----------------------------------------------------------------------------- command line


def test_cli_prints_size_and_formula(capsys):
  assert cli.main(["size", "--state-size", "768GiB", "--nodes", "16",
                   "--accelerator", "tpu"]) == 0
  out = capsys.readouterr().out
  assert "inMemoryVolumeSize: 106Gi" in out
  assert "2.2 x 48.00 GiB = 105.60 GiB" in out
  assert cli.size_main(["--state-size", "8GiB", "--accelerator", "gpu", "--peers", "2"]) == 0
  out = capsys.readouterr().out
  assert "1 + 2 x 2" in out and "inMemoryVolumeSize: 88Gi" in out


@pytest.mark.parametrize("argv, fragment", [
    (["--state-size", "8 parsecs", "--accelerator", "tpu"], "unknown unit 'parsecs'"),
    (["--state-size", "8GiB", "--accelerator", "tpu", "--bucket", "b"],
     "--bucket only apply with --render OUTDIR"),
    (["--state-size", "8GiB", "--accelerator", "tpu", "--render", "out", "--bucket", "b"],
     "--render needs --machine-type, --job-name"),
    (["--state-size", "8GiB", "--accelerator", "gpu", "--peers", "-2"], "--peers must be"),
    (["--from-step", "/no/such/step", "--accelerator", "gpu"], "does not exist"),
])
def test_cli_errors_name_the_fix(argv, fragment, capsys):
  assert cli.size_main(argv) == 2
  err = capsys.readouterr().err
  assert err.startswith("orbax-mtc size: error: ")
  assert fragment in err


def test_cli_argument_errors_exit_2(capsys):
  with pytest.raises(SystemExit) as info:
    cli.size_main(["--state-size", "8GiB"])
  assert info.value.code == 2
  assert "--accelerator" in capsys.readouterr().err
  with pytest.raises(SystemExit) as info:
    cli.size_main(["--state-size", "8GiB", "--from-step", "x", "--accelerator", "tpu"])
  assert info.value.code == 2


# ----------------------------------------------------------------------------- rendering


def _render_args(outdir: Path, accelerator: str, machine_type: str, *extra: str) -> list[str]:
  return ["--state-size", "64GiB", "--nodes", "4", "--accelerator", accelerator,
          "--render", str(outdir), "--bucket", "gs://ckpt-bucket/", "--machine-type",
          machine_type, "--job-name", "run-1", *extra]


def _docs(path: Path) -> list[dict]:
  return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def test_render_tpu_writes_filled_manifests_and_env(tmp_path, capsys):
  out = tmp_path / "tpu"
  assert cli.size_main(_render_args(out, "tpu", "ct6e-standard-4t")) == 0
  assert "wrote" in capsys.readouterr().out
  for name in ("checkpoint-configuration.yaml", "jobset-maxtext.yaml"):
    text = (out / name).read_text()
    assert "${" not in text
  (cpc,) = _docs(out / "checkpoint-configuration.yaml")
  (jobset,) = _docs(out / "jobset-maxtext.yaml")
  assert cpc["spec"]["cloudStorageBucketName"] == "ckpt-bucket"
  assert cpc["spec"]["inMemoryVolumeSize"] == "36Gi"  # 16 GiB x 2.2 = 35.2
  pod = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
  assert pod["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == "4x4"
  assert pod["nodeSelector"]["cloud.google.com/gke-tpu-accelerator"] == "tpu-v6e-slice"
  assert pod["containers"][0]["resources"]["limits"]["google.com/tpu"] == 4
  assert jobset["spec"]["replicatedJobs"][0]["replicas"] == 2
  env = (out / "env.sh").read_text()
  assert "export IN_MEMORY_VOLUME_SIZE=36Gi" in env
  assert f"export RENDERED={out.resolve()}" in env
  assert "export TPU_TOPOLOGY=4x4" in env


def test_render_gpu_passes_the_sized_peers_to_the_job(tmp_path):
  out = tmp_path / "gpu"
  assert cli.size_main(_render_args(out, "gpu", "a3-megagpu-8g", "--peers", "2",
                                    "--local-dir", "/mtc")) == 0
  (cpc,) = _docs(out / "checkpoint-configuration.yaml")
  (jobset,) = _docs(out / "jobset-maxtext.yaml")
  assert cpc["spec"]["inMemoryVolumeSize"] == "176Gi"  # 16 GiB x 11
  command = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"][
      "containers"][0]["command"]
  assert "mtc_peers_per_node=2" in command
  assert "local_checkpoint_directory=/mtc" in command
  assert "export GPU_TYPE=nvidia-h100-mega-80gb" in (out / "env.sh").read_text()


def test_render_single_tpu_slice_sizes_for_one_peer(tmp_path, capsys):
  out = tmp_path / "one"
  assert cli.size_main(_render_args(out, "tpu", "ct6e-standard-4t", "--slices", "1")) == 0
  assert "6.6 x 16.00 GiB" in capsys.readouterr().out
  (cpc,) = _docs(out / "checkpoint-configuration.yaml")
  assert cpc["spec"]["inMemoryVolumeSize"] == "106Gi"


@pytest.mark.parametrize("extra, machine_type, accelerator, fragment", [
    (["--peers", "1"], "ct6e-standard-4t", "tpu", "pass --peers 0"),
    (["--slices", "1", "--peers", "0"], "ct6e-standard-4t", "tpu", "pass --peers 1"),
    ([], "a3-megagpu-8g", "tpu", "not a TPU machine type"),
    ([], "ct6e-standard-4t", "gpu", "not a GPU machine type"),
    (["--job-name", "Run_1"], "ct6e-standard-4t", "tpu", "--job-name 'Run_1' is not valid"),
    (["--bucket", "gs://b/some/path"], "ct6e-standard-4t", "tpu", "--bucket"),
    (["--local-dir", "local"], "ct6e-standard-4t", "tpu", "an absolute path"),
    (["--nodes", "3"], "ct6e-standard-4t", "tpu", "pass --tpu-topology"),
    (["--tpu-topology", "4-4"], "ct6e-standard-4t", "tpu", "must look like 4x4"),
    (["--tpu-topology", "4x8"], "ct6e-standard-4t", "tpu", "has 32 chips, but 4 x "),
    (["--slices", "2"], "a3-megagpu-8g", "gpu", "--slices applies to TPU jobs"),
    (["--templates", "/nonexistent"], "ct6e-standard-4t", "tpu", "templates not found"),
])
def test_render_rejects_inconsistent_input(tmp_path, capsys, extra, machine_type, accelerator,
                                           fragment):
  argv = _render_args(tmp_path / "out", accelerator, machine_type) + extra
  assert cli.size_main(argv) == 2
  assert fragment in capsys.readouterr().err
  assert not (tmp_path / "out" / "jobset-maxtext.yaml").exists()


@pytest.mark.parametrize("machine_type, nodes, want", [
    ("ct6e-standard-4t", 1, ("tpu-v6e-slice", "2x2", 4)),
    ("ct6e-standard-4t", 8, ("tpu-v6e-slice", "4x8", 4)),
    ("ct5lp-hightpu-4t", 64, ("tpu-v5-lite-podslice", "16x16", 4)),
    ("ct5p-hightpu-4t", 1, ("tpu-v5p-slice", "2x2x1", 4)),
    ("ct5p-hightpu-4t", 4, ("tpu-v5p-slice", "2x2x4", 4)),
    ("ct5p-hightpu-4t", 8, ("tpu-v5p-slice", "2x4x4", 4)),
    ("ct5p-hightpu-4t", 16, ("tpu-v5p-slice", "4x4x4", 4)),
    ("ct4p-hightpu-4t", 32, ("tpu-v4-podslice", "4x4x8", 4)),
])
def test_tpu_topology_inference(machine_type, nodes, want):
  label, topology, chips = size_render.tpu_labels(machine_type, nodes)
  assert (label, topology, chips) == want
  assert math.prod(int(d) for d in topology.split("x")) == nodes * chips


def test_tpu_labels_overrides_and_unknown_families():
  assert size_render.tpu_labels("ct9z-new-4t", 2, accelerator_label="tpu-v9-slice",
                                topology="2x4") == ("tpu-v9-slice", "2x4", 4)
  with pytest.raises(SizingError, match="pass --tpu-accelerator"):
    size_render.tpu_labels("ct9z-new-4t", 2)


def test_fill_names_unknown_placeholders():
  assert size_render.fill("a: ${BUCKET}", {"BUCKET": "b"}) == "a: b"
  assert size_render.fill("no placeholders, $HOME stays", {}) == "no placeholders, $HOME stays"
  with pytest.raises(SizingError, match="does not fill: NOPE, ZED"):
    size_render.fill("${ZED} ${NOPE} ${BUCKET}", {"BUCKET": "b"}, where="t.yaml")


def test_render_refuses_a_template_that_does_not_parse(tmp_path):
  templates = tmp_path / "configs"
  (templates / "gke" / "gpu").mkdir(parents=True)
  (templates / "gke" / "gpu" / "checkpoint-configuration.yaml").write_text("a: [${BUCKET}\n")
  (templates / "gke" / "gpu" / "jobset-maxtext.yaml").write_text("kind: JobSet\n")
  result = size.size(state_size="1GiB", accelerator="gpu")
  with pytest.raises(SizingError, match="does not parse once filled in"):
    size_render.render(tmp_path / "out", result, templates=templates, bucket="bkt",
                       machine_type="a3-highgpu-8g", job_name="j")


@pytest.mark.timeout(300)
def test_the_wheel_carries_the_templates_and_renders_from_them(tmp_path):
  # A user who installs the wheel has no checkout: the templates must come with the package.
  repo = Path(__file__).resolve().parents[1]
  source = tmp_path / "src"  # built from a copy: the build leaves nothing in the checkout
  source.mkdir()
  for name in ("pyproject.toml", "README.md"):
    shutil.copy(repo / name, source / name)
  tops = [d for d in sorted(repo.iterdir()) if (d / "__init__.py").is_file()]
  packages = [p.parent.relative_to(repo) for top in tops for p in sorted(top.rglob("__init__.py"))]
  for top in [d.name for d in tops] + ["configs"]:
    shutil.copytree(repo / top, source / top, ignore=shutil.ignore_patterns("__pycache__"))
  built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w",
                          str(tmp_path / "dist"), str(source)],
                         capture_output=True, text=True, timeout=280)
  assert built.returncode == 0, built.stdout + built.stderr
  (wheel,) = (tmp_path / "dist").glob("orbax_mtc-*.whl")
  site = tmp_path / "site"
  with zipfile.ZipFile(wheel) as archive:
    names = set(archive.namelist())
    archive.extractall(site)
  for package in packages:  # every package of the checkout is in the wheel
    assert f"{package.as_posix()}/__init__.py" in names, package
  templates = {p.relative_to(repo / "configs").as_posix() for p in (repo / "configs").rglob("*")
               if p.is_file()}
  assert {f"orbax_mtc/configs/{t}" for t in templates} <= names

  out = tmp_path / "rendered"
  env = {**os.environ, "PYTHONPATH": str(site)}
  where = subprocess.run([sys.executable, "-c", "from orbax_mtc.tools import size_render; "
                          "print(size_render.__file__); print(size_render.TEMPLATES)"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
  assert where.stdout.split() == [str(site / "orbax_mtc" / "tools" / "size_render.py"),
                                  str(site / "orbax_mtc" / "configs")], where.stderr
  done = subprocess.run([sys.executable, "-m", "orbax_mtc", "size",
                         *_render_args(out, "tpu", "ct6e-standard-4t")],
                        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
  assert done.returncode == 0, done.stdout + done.stderr
  (cpc,) = _docs(out / "checkpoint-configuration.yaml")
  assert cpc["spec"]["inMemoryVolumeSize"] == "36Gi"
