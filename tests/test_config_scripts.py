"""configs/ shell scripts: they pass bash -n and, run with DRY_RUN=1, issue the commands the guides
give (GKE cluster setup, k8s recipes, the Dockerfile; the Cloud TPU VM scripts are in
test_config_tpu_vm.py)."""

from __future__ import annotations

import inspect
import json
import os
import re
import stat
import subprocess

import pytest
import yaml
from configs_support import (
  CONFIGS,
  DOCKERFILE,
  FILL,
  K8S_RECIPES,
  LIBRARIES,
  README,
  REPO,
  SCRIPTS,
  YAMLS,
  _args,
  _bash,
  _dockerfile_tag,
  _docs,
  _dry_run_lines,
  _fill,
  _option,
  _pod,
  _render_example,
)

from orbax_mtc.tools import size_render


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_shell_scripts_pass_bash_n(path):
  result = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
  assert result.returncode == 0, result.stderr
  text = path.read_text()
  if path in LIBRARIES:
    assert not text.startswith("#!"), "a sourced library is not run on its own"
  else:
    assert text.startswith("#!/usr/bin/env bash\n")
    assert "set -euo pipefail" in text
    assert path.stat().st_mode & stat.S_IXUSR, f"{path} is not executable"


def test_cluster_setup_enables_the_add_on_and_applies_the_rendered_manifests(rendered):
  accelerator, env = rendered["accelerator"], rendered["env"]
  script = CONFIGS / "gke" / accelerator / "cluster-setup.sh"
  result = _bash("-c", f"source {rendered['dir'] / 'env.sh'} && "
                 f"PROJECT_ID=proj bash {script} create")
  lines = _dry_run_lines(result.stdout)
  flat = [" ".join(line) for line in lines]
  bucket = env["BUCKET"]
  assert any(f"buckets create gs://{bucket}" in c and "--enable-hierarchical-namespace" in c
             for c in flat)
  (create,) = [line for line in lines if line[:4] == ["gcloud", "container", "clusters",
                                                       "create"]]
  assert "--addons=HighScaleCheckpointing,GcsFuseCsiDriver" in create
  assert "--workload-pool=proj.svc.id.goog" in create
  members = [a for c in lines for a in c if a.startswith("--member=")]
  assert any(m.endswith("/ns/gke-managed-checkpointing/sa/gke-checkpointing-multitier-node")
             for m in members)
  assert all("workloadIdentityPools/proj.svc.id.goog" in m for m in members) and len(members) == 2
  assert all("--role=roles/storage.objectUser" in c for c in flat if "iam-policy" in c)
  pools = [line for line in lines if line[:4] == ["gcloud", "container", "node-pools", "create"]]
  assert all(f"--machine-type={env['MACHINE_TYPE']}" in p for p in pools)
  assert all(f"--num-nodes={env['NODES']}" in p for p in pools)
  if accelerator == "tpu":
    assert len(pools) == int(env["SLICES"])
    assert all(f"--tpu-topology={env['TPU_TOPOLOGY']}" in p for p in pools)
  else:
    (pool,) = pools
    assert f"--accelerator=type={env['GPU_TYPE']},count={env['GPUS_PER_NODE']}," \
        "gpu-driver-version=latest" in pool
  apply_cpc = ["kubectl", "apply", "-f", f"{env['RENDERED']}/checkpoint-configuration.yaml"]
  assert apply_cpc in lines
  assert f"next: kubectl apply -f {env['RENDERED']}/jobset-maxtext.yaml" in result.stdout
  # The JobSet controller: installed, then its resources raised (the guide's patch), then the
  # CheckpointConfiguration once its CRD is there.
  (jobset,) = [i for i, line in enumerate(lines)
               if line[:3] == ["kubectl", "apply", "--server-side"]]
  (patch,) = [i for i, line in enumerate(lines) if line[:2] == ["kubectl", "patch"]]
  (wait,) = [i for i, line in enumerate(lines) if line[:2] == ["kubectl", "wait"]]
  assert jobset < patch < wait < lines.index(apply_cpc)
  assert lines[patch][:8] == ["kubectl", "patch", "-n", "jobset-system", "deploy",
                              "jobset-controller-manager", "--type", "json"]
  (op,) = json.loads(_option(lines[patch], "--patch"))
  assert op["op"] == "add" and op["path"] == "/spec/template/spec/containers/0/resources"
  assert op["value"] == {"limits": {"memory": "2Gi"}, "requests": {"cpu": "1", "memory": "1Gi"}}
  assert "crd/checkpointconfigurations.checkpointing.gke.io" in lines[wait]
  assert "--for" in lines[wait] and "condition=established" in lines[wait]
  assert not any("objectViewer" in c for c in flat)  # optional, off by default

  update = _dry_run_lines(_bash(script, "update", env={"PROJECT_ID": "proj"}).stdout)
  assert not any(line[:4] == ["gcloud", "container", "clusters", "create"] for line in update)
  assert any("--update-addons=HighScaleCheckpointing=ENABLED,GcsFuseCsiDriver=ENABLED" in line
             for line in update)
  bad = _bash(script, "delete", check=False)
  assert bad.returncode == 2 and "usage" in bad.stderr


@pytest.mark.parametrize("accelerator", ["tpu", "gpu"])
def test_cluster_setup_optional_grant_and_jobset_patch_settings(accelerator):
  script = CONFIGS / "gke" / accelerator / "cluster-setup.sh"
  member = "serviceAccount:123-compute@developer.gserviceaccount.com"
  lines = _dry_run_lines(_bash(script, "update", env={
      "PROJECT_ID": "proj", "READER_MEMBER": member, "JOBSET_MEMORY_LIMIT": "8Gi"}).stdout)
  grants = [line for line in lines if "add-iam-policy-binding" in line]
  viewer = [g for g in grants if "--role=roles/storage.objectViewer" in g]
  assert viewer == [["gcloud", "storage", "buckets", "add-iam-policy-binding",
                     "gs://my-ckpt-bucket", f"--member={member}",
                     "--role=roles/storage.objectViewer"]]
  assert len(grants) == 3
  (patch,) = [line for line in lines if line[:2] == ["kubectl", "patch"]]
  (op,) = json.loads(_option(patch, "--patch"))
  assert op["value"]["limits"] == {"memory": "8Gi"}
  skipped = _dry_run_lines(_bash(script, "update", env={"PROJECT_ID": "proj",
                                                          "JOBSET_PATCH": "0"}).stdout)
  assert not any(line[:2] == ["kubectl", "patch"] for line in skipped)


@pytest.mark.parametrize("accelerator", ["tpu", "gpu"])
def test_cluster_setup_upgrade_recreates_and_uninstall_removes(accelerator):
  script = CONFIGS / "gke" / accelerator / "cluster-setup.sh"
  cpc = "rendered/checkpoint-configuration.yaml"
  upgrade = _dry_run_lines(_bash(script, "upgrade", env={"PROJECT_ID": "proj"}).stdout)
  assert upgrade[0][:4] == ["gcloud", "container", "clusters", "get-credentials"]
  kubectl = [line for line in upgrade if line[0] == "kubectl"]
  # Delete, wait for the kind, create again: nothing else (no cluster, pool, bucket, grant).
  assert kubectl[0][:3] == ["kubectl", "delete", "-f"] and kubectl[0][3] == cpc
  assert "--ignore-not-found" in kubectl[0]
  assert kubectl[1][:2] == ["kubectl", "wait"]
  assert kubectl[2] == ["kubectl", "apply", "-f", cpc]
  assert [line for line in upgrade if line[0] == "gcloud"] == upgrade[:1]

  uninstall = _dry_run_lines(_bash(script, "uninstall", env={"PROJECT_ID": "proj"}).stdout)
  (delete,) = [line for line in uninstall if line[:2] == ["kubectl", "delete"]]
  assert delete[2] == "checkpointconfigurations.checkpointing.gke.io" and "--all" in delete
  (disable,) = [line for line in uninstall if line[:4] == ["gcloud", "container", "clusters",
                                                          "update"]]
  assert "--update-addons=HighScaleCheckpointing=DISABLED" in disable
  assert uninstall.index(delete) < uninstall.index(disable)
  flat = " ".join(" ".join(line) for line in uninstall)
  assert "kubectl apply" not in flat and "buckets delete" not in flat \
      and "clusters delete" not in flat


@pytest.mark.parametrize("mode", ["create", "update", "upgrade"])
def test_cluster_setup_stops_before_creating_anything_without_a_render(tmp_path, mode):
  # Real run (no DRY_RUN) with gcloud and kubectl stubs that record every call.
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  calls = tmp_path / "calls"
  for tool in ("gcloud", "kubectl"):
    stub = bin_dir / tool
    stub.write_text(f'#!/usr/bin/env bash\necho "{tool} $*" >> {calls}\nexit 1\n')
    stub.chmod(0o755)
  env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(tmp_path),
         "RENDERED": str(tmp_path / "missing"), "PROJECT_ID": "proj"}
  ran = subprocess.run(["bash", str(CONFIGS / "gke" / "tpu" / "cluster-setup.sh"), mode],
                       env=env, capture_output=True, text=True, timeout=60)
  assert ran.returncode == 1 and "orbax-mtc size ... --render" in ran.stderr
  assert not calls.exists(), calls.read_text()


def test_k8s_templates_use_only_what_the_gpu_render_writes():
  assert K8S_RECIPES, "configs/k8s/ holds no manifest"
  for path in K8S_RECIPES:
    found = set(size_render.PLACEHOLDER.findall(path.read_text()))
    assert found and found <= set(size_render.RENDERED_KEYS["gpu"]), sorted(found)


def test_fill_substitutes_like_render_and_refuses_missing_values(gpu_render, tmp_path):
  for path in K8S_RECIPES:
    filled = _fill(path, gpu_render).stdout
    assert filled == size_render.fill(path.read_text(), gpu_render["env"]).rstrip("\n") + "\n"
    assert "${" not in filled
  template = tmp_path / "t.yaml"
  template.write_text("a: ${JOB_NAME}\nb: ${NOT_SET_ANYWHERE} $HOME ${lower}\n")
  missing = _fill(template, gpu_render, check=False)
  assert missing.returncode == 1 and missing.stdout == ""
  assert "needs NOT_SET_ANYWHERE: source the env.sh" in missing.stderr
  assert "JOB_NAME" not in missing.stderr
  template.write_text("a: ${JOB_NAME}-${JOB_NAME}\nb: $HOME ${lower}\n")
  assert _fill(template, gpu_render).stdout == "a: llm-run-gpu-llm-run-gpu\nb: $HOME ${lower}\n"
  usage = _bash(FILL, check=False)
  assert usage.returncode == 2 and "usage" in usage.stderr


@pytest.mark.parametrize("path", K8S_RECIPES, ids=lambda p: p.name)
def test_k8s_recipe_keeps_the_ram_tier_in_an_emptydir_in_standalone_mode(path, gpu_render):
  from maxtext_patch import config as mtc_config

  env = gpu_render["env"]
  service, job = _docs(_fill(path, gpu_render).stdout)
  name = env["JOB_NAME"]
  # A headless Service naming every pod of the Indexed Job: pod i is <job>-i.<service>.
  assert service["kind"] == "Service" and service["metadata"]["name"] == name
  assert service["spec"]["clusterIP"] == "None"
  assert service["spec"]["selector"] == {"batch.kubernetes.io/job-name": job["metadata"]["name"]}
  assert job["kind"] == "Job" and job["apiVersion"] == "batch/v1"
  spec = job["spec"]
  assert spec["completionMode"] == "Indexed"
  assert spec["completions"] == spec["parallelism"] == int(env["NODES"])
  pod = spec["template"]["spec"]
  assert pod["subdomain"] == service["metadata"]["name"]
  # Container restarts stay in the pod, and so does its emptyDir (the RAM tier).
  assert pod["restartPolicy"] == "OnFailure"
  assert pod["terminationGracePeriodSeconds"] >= 270
  (ram,) = [v for v in pod["volumes"] if v.get("emptyDir", {}).get("sizeLimit")]
  assert ram["emptyDir"] == {"medium": "Memory", "sizeLimit": env["IN_MEMORY_VOLUME_SIZE"]}
  assert env["IN_MEMORY_VOLUME_SIZE"] == gpu_render["quantity"]  # sized with the GPU peers
  assert not any(v.get("csi", {}).get("driver") == size_render.CSI_DRIVER for v in pod["volumes"])
  (container,) = pod["containers"]
  (mount,) = [m for m in container["volumeMounts"] if m["name"] == ram["name"]]
  command = container["command"]
  assert command[:4] == ["python", "-m", "maxtext_patch.train", "src/maxtext/configs/base.yml"]
  args = _args(command)
  assert mount["mountPath"] == args["local_checkpoint_directory"] == env["LOCAL_DIR"]
  assert args["enable_emergency_checkpoint"] == "true"
  assert "enable_multi_tier_checkpointing" not in args
  assert args["run_name"] == name and args["hardware"] == "gpu"
  envs = {e["name"]: e for e in container["env"]}
  assert envs["JAX_COORDINATOR_IP"]["value"] == f"{name}-0.{service['metadata']['name']}"
  assert envs["NNODES"]["value"] == str(spec["parallelism"])
  assert envs["NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == \
      "metadata.annotations['batch.kubernetes.io/job-completion-index']"
  assert container["resources"]["limits"]["nvidia.com/gpu"] == int(env["GPUS_PER_NODE"])
  # maxtext_patch reads these arguments as a valid standalone job with peers on.
  maxtext_args, ours = mtc_config.split_argv(command[4:])
  config = _args(maxtext_args)
  config["checkpoint_dir"] = f"{config['base_output_directory']}/{name}/checkpoints"
  settings = mtc_config.read_settings(config, extra=ours)
  assert settings.mode == mtc_config.STANDALONE
  assert settings.peers_per_node == int(env["PEERS"]) >= 1
  assert settings.backup_interval_minutes == float(env["BACKUP_MINUTES"])
  assert settings.local_directory == env["LOCAL_DIR"]
  if path.name == "indexed-job-emptydir.yaml":
    assert args["base_output_directory"] == f"gs://{env['BUCKET']}"
    assert not any("csi" in v for v in pod["volumes"])


def test_gcsfuse_recipe_puts_the_persistent_tier_on_the_mounted_bucket(gpu_render):
  env = gpu_render["env"]
  _, job = _docs(_fill(CONFIGS / "k8s" / "gpu" / "indexed-job-gcsfuse.yaml", gpu_render).stdout)
  template = job["spec"]["template"]
  assert template["metadata"]["annotations"]["gke-gcsfuse/volumes"] == "true"
  pod = template["spec"]
  (fuse,) = [v for v in pod["volumes"] if "csi" in v]
  assert fuse["csi"]["driver"] == "gcsfuse.csi.storage.gke.io"
  attributes = fuse["csi"]["volumeAttributes"]
  assert attributes["bucketName"] == env["BUCKET"]
  options = attributes["mountOptions"].split(",")
  assert "metadata-cache:negative-ttl-secs:0" in options
  assert "write:enable-streaming-writes:true" in options
  # No non-atomic folder renames on flat buckets: the recipe relies on hierarchical namespace.
  assert not any(o.startswith("file-system:rename-dir-limit") for o in options)
  (container,) = pod["containers"]
  (mount,) = [m for m in container["volumeMounts"] if m["name"] == fuse["name"]]
  base = _args(container["command"])["base_output_directory"]
  assert base == mount["mountPath"] and base.startswith("/") and not base.startswith("gs:")
  ram = {m["mountPath"] for m in container["volumeMounts"] if m["name"] == "mtc-local"}
  assert not any(base.startswith(p) or p.startswith(base) for p in ram)


def test_every_image_in_configs_is_the_dockerfile_tag(tmp_path):
  tag = _dockerfile_tag()
  default = inspect.signature(size_render.render_values).parameters["image"].default
  assert tag == default  # what `orbax-mtc size --render` writes without --image
  images = []
  for path in YAMLS:
    for doc in _docs(path.read_text()):
      images += re.findall(r"^\s*image: (.*)$", yaml.safe_dump(doc), re.M)
  assert images and set(images) == {"${IMAGE}"}
  for accelerator in ("tpu", "gpu"):
    (container,) = _pod(_render_example(accelerator, tmp_path)["jobset"])["containers"]
    assert container["image"] == tag
  # Every registry copy named in the docs is that repository and tag.
  repository, _, version = tag.partition(":")
  for doc in (README, REPO / "docs" / "gke.md"):
    named = re.findall(r"[\w.-]+(?:/[\w.-]+)+/" + re.escape(repository) + r":(\S+?)[\s`]",
                       doc.read_text())
    assert named and set(named) == {version}, (doc, named)


def test_dockerfile_installs_the_tested_maxtext_and_this_orbax_mtc():
  text = DOCKERFILE.read_text()
  args = dict(re.findall(r"^ARG (\w+)=(\S+)$", text, re.M))
  pins = dict(re.findall(r"^([\w.-]+)==(\S+)$",
                         (REPO / "tests" / "requirements-maxtext.txt").read_text(), re.M))
  assert args["MAXTEXT_VERSION"] == pins["maxtext"] == "0.2.5"
  assert args["JAX_VERSION"] == pins["jax"]
  assert args["ACCELERATOR"] == "tpu"
  assert re.fullmatch(r"python:3\.12(-\S+)?", args["PYTHON_IMAGE"])  # MaxText needs 3.12
  assert re.search(r"^FROM \$\{PYTHON_IMAGE\}$", text, re.M)
  # orbax-mtc's own range admits the JAX pinned here.
  project = (REPO / "pyproject.toml").read_text()
  low, high = re.search(r'"jax>=([\d.]+),<([\d.]+)"', project).groups()
  version = tuple(int(x) for x in args["JAX_VERSION"].split("."))
  assert tuple(int(x) for x in low.split(".")) <= version < tuple(
      int(x) for x in high.split("."))
  install = re.search(r"^RUN pip install (.*?)(?<!\\)$", text, re.M | re.S).group(1)
  assert '"maxtext[${ACCELERATOR}]==${MAXTEXT_VERSION}"' in install
  assert '"jax[${ACCELERATOR}]==${JAX_VERSION}"' in install and '".[gcs]"' in install
  # Everything the wheel is built from is copied in.
  copied = set(re.findall(r"^COPY (\S+) \./", text, re.M))
  packages = re.search(r"^packages = \[(.*)\]$", project, re.M).group(1)
  tops = {p.strip(' "').split(".")[0] for p in packages.split(",")} | {"configs"}
  assert tops <= copied, tops - copied
  assert "COPY pyproject.toml README.md ./" in text
  # The manifests' workingDir and config path exist in the image.
  assert re.search(r"ln -s .*\n\s+/deps/src/maxtext", text)
  assert "test -f /deps/src/maxtext/configs/base.yml" in text
  assert text.rstrip().endswith("WORKDIR /deps")
  for path in YAMLS:
    for doc in _docs(path.read_text()):
      for container in re.findall(r"workingDir: (\S+)", yaml.safe_dump(doc)):
        assert container == "/deps", path


def test_capacity_options_for_queued_resources_and_node_pools():
  env = {"JOB_NAME": "llm-run", "PROJECT_ID": "p", "SLICES": "2"}
  queued = CONFIGS / "tpu-vm" / "create-queued-resource.sh"

  def request(**settings):
    (line,) = _dry_run_lines(_bash(queued, env={**env, **settings}).stdout)
    return line

  assert not {"--spot", "--reserved"} & set(request())  # on-demand by default
  assert "--spot" in request(SPOT="1")
  ga = request(RESERVED="1", AUTOCHECKPOINT="0")
  assert ga[:2] == ["gcloud", "compute"] and "--reserved" in ga
  # A named reservation is a flag of the alpha track only.
  named = request(RESERVATION="my-res", AUTOCHECKPOINT="0")
  assert named[:2] == ["gcloud", "alpha"] and "--reservation=my-res" in named
  assert "--reserved" not in named and "--autocheckpoint-enabled" not in named
  both = _bash(queued, env={**env, "SPOT": "1", "RESERVED": "1"}, check=False)
  assert both.returncode == 2 and "exclude each other" in both.stderr and not both.stdout

  for accelerator in ("tpu", "gpu"):
    script = CONFIGS / "gke" / accelerator / "cluster-setup.sh"

    def pools(script=script, **settings):
      lines = _dry_run_lines(_bash(script, "update", env={"PROJECT_ID": "p",
                                                          **settings}).stdout)
      found = [line for line in lines if line[:4] == ["gcloud", "container", "node-pools",
                                                       "create"]]
      assert found
      return found

    assert not any("--spot" in p or any(a.startswith("--reservation") for a in p)
                   for p in pools())
    assert all("--spot" in p for p in pools(SPOT="1"))
    assert all({"--reservation-affinity=specific", "--reservation=my-res"} <= set(p)
               for p in pools(RESERVATION="my-res"))
    both = _bash(script, "update", env={"PROJECT_ID": "p", "SPOT": "1",
                                        "RESERVATION": "my-res"}, check=False)
    assert both.returncode == 2 and "exclude each other" in both.stderr
    assert not _dry_run_lines(both.stdout)  # before anything is created


def _cloud_stubs(tmp_path, hns: str) -> dict[str, str]:
  """gcloud and kubectl that record their calls; `gcloud storage buckets describe` finds the
  bucket and prints `hns` as its hierarchicalNamespace.enabled."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir(exist_ok=True)
  calls = tmp_path / "calls"
  (bin_dir / "gcloud").write_text(
      f'#!/usr/bin/env bash\necho "gcloud $*" >> {calls}\n'
      f'if [[ "$*" == "storage buckets describe"* ]]; then echo {hns}; fi\n')
  (bin_dir / "kubectl").write_text(f'#!/usr/bin/env bash\necho "kubectl $*" >> {calls}\n')
  for tool in ("gcloud", "kubectl"):
    (bin_dir / tool).chmod(0o755)
  return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(tmp_path),
          "PROJECT_ID": "proj"}


@pytest.mark.parametrize("accelerator", ["tpu", "gpu"])
def test_cluster_setup_checks_an_existing_bucket_and_the_image(tmp_path, accelerator):
  script = CONFIGS / "gke" / accelerator / "cluster-setup.sh"
  rendered = _render_example(accelerator, tmp_path)  # the default image: a local tag
  env = {**_cloud_stubs(tmp_path, "False"), "RENDERED": str(rendered["dir"]),
         "BUCKET": "old-bucket"}
  ran = subprocess.run(["bash", str(script), "update"], env=env, capture_output=True,
                       text=True, timeout=60)
  assert ran.returncode == 1 and "gs://old-bucket exists without hierarchical namespace" \
      in ran.stderr
  calls = (tmp_path / "calls").read_text().splitlines()
  (describe,) = calls  # nothing else ran
  assert "--raw" in describe and "value(hierarchicalNamespace.enabled)" in describe

  (tmp_path / "calls").unlink()
  env = {**_cloud_stubs(tmp_path, "True"), "RENDERED": str(rendered["dir"]),
         "BUCKET": "hns-bucket"}
  ran = subprocess.run(["bash", str(script), "update"], env=env, capture_output=True,
                       text=True, timeout=60)
  assert ran.returncode == 0, ran.stderr
  assert "gs://hns-bucket exists, with hierarchical namespace" in ran.stdout
  calls = (tmp_path / "calls").read_text()
  assert "buckets create" not in calls and "node-pools create" in calls
  assert "warning: the JobSet's image maxtext-orbax-mtc:latest names no registry" in ran.stderr

  pushed = _render_example(accelerator, tmp_path, "--image",
                           "us-docker.pkg.dev/p/images/maxtext-orbax-mtc:latest")
  ran = subprocess.run(["bash", str(script), "update"], env={**env, "RENDERED": str(
      pushed["dir"])}, capture_output=True, text=True, timeout=60)
  assert ran.returncode == 0 and "warning" not in ran.stderr
