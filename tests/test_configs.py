"""configs/: every template parses, carries the keys GKE needs, and agrees with the others and
with `orbax-mtc size`; the shell scripts pass `bash -n` and, run with DRY_RUN=1, issue the
commands and flags the set-up needs."""

from __future__ import annotations

import math
import re
from fractions import Fraction

import pytest
from configs_support import (
  CONFIGS,
  CPC_FIELDS,
  CPC_REQUIRED,
  GUIDE_FUSE_OPTIONS,
  KINDS,
  README,
  YAMLS,
  _args,
  _docs,
  _option,
  _pod,
  _render_example,
)

from orbax_mtc.tools import size, size_render


def test_configs_hold_what_the_issue_asks_for():
  names = {str(p.relative_to(CONFIGS)) for p in CONFIGS.rglob("*") if p.is_file()}
  for accelerator in ("tpu", "gpu"):
    for name in ("checkpoint-configuration.yaml", "jobset-maxtext.yaml", "cluster-setup.sh"):
      assert f"gke/{accelerator}/{name}" in names
  for name in ("create-queued-resource.sh", "create-single-vm.sh", "launch-maxtext.sh",
               "launch-pax.sh"):
    assert f"tpu-vm/{name}" in names
  assert {"Dockerfile", "k8s/fill.sh", "k8s/gpu/indexed-job-emptydir.yaml",
          "k8s/gpu/indexed-job-gcsfuse.yaml"} <= names
  readme = README.read_text()
  for name in names - {"README.md"}:
    assert name in readme, f"configs/README.md does not list {name}"


@pytest.mark.parametrize("path", YAMLS, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_every_yaml_parses_with_kubernetes_keys(path):
  docs = _docs(path.read_text())
  assert docs, f"{path} holds no document"
  for doc in docs:
    assert {"apiVersion", "kind", "metadata", "spec"} <= set(doc), sorted(doc)
    assert doc["metadata"]["name"]
    assert (doc["apiVersion"], doc["kind"]) in KINDS


@pytest.mark.parametrize("accelerator", ["tpu", "gpu"])
def test_checkpoint_configuration_fields(accelerator):
  (cpc,) = _docs((CONFIGS / "gke" / accelerator / "checkpoint-configuration.yaml").read_text())
  spec = cpc["spec"]
  assert CPC_REQUIRED <= set(spec) <= CPC_FIELDS, sorted(set(spec) ^ CPC_FIELDS)
  assert spec["inMemoryVolumeSize"] == "${IN_MEMORY_VOLUME_SIZE}"
  assert spec["cloudStorageBucketName"] == "${BUCKET}"
  assert spec["nodeSelector"] == {"node.kubernetes.io/instance-type": "${MACHINE_TYPE}"}
  for toleration in spec["tolerations"]:
    assert set(toleration) == {"key", "operator", "effect"}
    assert toleration["operator"] == "Exists" and toleration["effect"] == "NoSchedule"
  assert spec["tolerations"][0]["key"] == {"tpu": "google.com/tpu",
                                           "gpu": "nvidia.com/gpu"}[accelerator]
  options = spec["gcsFuseMountOptions"]
  assert all(isinstance(o, str) and " " not in o for o in options)
  # All eleven of the guide, none twice, nothing else, in the guide's order.
  assert options == GUIDE_FUSE_OPTIONS
  assert len(set(options)) == 11


@pytest.mark.parametrize("accelerator", ["tpu", "gpu"])
def test_every_placeholder_is_one_render_fills(accelerator):
  used = set()
  for path in (CONFIGS / "gke" / accelerator).glob("*.yaml"):
    found = set(size_render.PLACEHOLDER.findall(path.read_text()))
    unknown = found - set(size_render.RENDERED_KEYS[accelerator])
    assert not unknown, f"{path} uses {sorted(unknown)}, which --render does not fill"
    used |= found
  # And every value render computes lands somewhere (no stale keys).
  assert used == set(size_render.RENDERED_KEYS[accelerator])


def test_documented_example_gets_the_size_orbax_mtc_size_computes(rendered):
  argv = rendered["argv"]
  expected = size.size(accelerator=_option(argv, "--accelerator"),
                         state_size=_option(argv, "--state-size"),
                         nodes=int(_option(argv, "--nodes", "1")),
                         peers=None if "--peers" not in argv else int(_option(argv, "--peers")))
  got = rendered["cpc"]["spec"]["inMemoryVolumeSize"]
  assert got == rendered["quantity"] == expected.quantity
  gib = int(re.fullmatch(r"(\d+)Gi", got).group(1))
  assert gib * size.GIB >= expected.factor * expected.local.nbytes
  assert (gib - 1) * size.GIB < expected.factor * expected.local.nbytes
  anchor = {"tpu": Fraction(22, 10), "gpu": Fraction(66, 10)}
  assert expected.factor == anchor[rendered["accelerator"]]
  assert rendered["env"]["IN_MEMORY_VOLUME_SIZE"] == got


def test_rendered_manifests_have_no_placeholder_left(rendered):
  for name in ("checkpoint-configuration.yaml", "jobset-maxtext.yaml"):
    text = (rendered["dir"] / name).read_text()
    assert not size_render.PLACEHOLDER.search(text) and "${" not in text, name


def test_jobset_mounts_the_csi_volume_at_the_local_checkpoint_dir(rendered):
  jobset, cpc = rendered["jobset"], rendered["cpc"]
  assert jobset["apiVersion"] == "jobset.x-k8s.io/v1alpha2" and jobset["kind"] == "JobSet"
  pod = _pod(jobset)
  csi = [v for v in pod["volumes"] if "csi" in v]
  assert len(csi) == 1 and csi[0]["csi"] == {"driver": size_render.CSI_DRIVER}
  (container,) = pod["containers"]
  mounts = [m for m in container["volumeMounts"] if m["name"] == csi[0]["name"]]
  assert len(mounts) == 1
  args = _args(container["command"])
  assert mounts[0]["mountPath"] == args["local_checkpoint_directory"] \
      == rendered["env"]["LOCAL_DIR"] == _option(rendered["argv"], "--local-dir", "/local")
  # The RAM disk exists only on the nodes the CheckpointConfiguration selects.
  assert cpc["spec"]["nodeSelector"].items() <= pod["nodeSelector"].items()
  assert {t["key"] for t in cpc["spec"]["tolerations"]} <= {t["key"] for t in pod["tolerations"]}


def test_jobset_runs_maxtext_on_orbax_mtc_in_managed_mode(rendered):
  jobset, cpc, argv = rendered["jobset"], rendered["cpc"], rendered["argv"]
  (container,) = _pod(jobset)["containers"]
  command = container["command"]
  assert command[:4] == ["python", "-m", "maxtext_patch.train", "src/maxtext/configs/base.yml"]
  args = _args(command)
  assert args["enable_multi_tier_checkpointing"] == "true"
  assert args["local_checkpoint_period"] == "20"
  assert args["multi_tier_checkpointing_backup_interval_minutes"] == "30"
  assert args["run_name"] == jobset["metadata"]["name"] == _option(argv, "--job-name")
  assert args["base_output_directory"] == f"gs://{cpc['spec']['cloudStorageBucketName']}"
  assert cpc["spec"]["cloudStorageBucketName"] == _option(argv, "--bucket").removeprefix("gs://")
  job = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
  assert job["parallelism"] == job["completions"] == int(_option(argv, "--nodes", "1"))
  assert _pod(jobset)["terminationGracePeriodSeconds"] >= 270  # orbax-mtc's on-demand budget


def test_tpu_jobset_is_a_multislice_job_matching_its_node_pools(tmp_path):
  rendered = _render_example("tpu", tmp_path)
  jobset, env = rendered["jobset"], rendered["env"]
  pod = _pod(jobset)
  replicated = jobset["spec"]["replicatedJobs"][0]
  assert replicated["replicas"] == int(env["SLICES"]) >= 2  # twins: the sized peers = 0
  assert jobset["metadata"]["annotations"][
      "alpha.jobset.sigs.k8s.io/exclusive-topology"] == "cloud.google.com/gke-nodepool"
  chips = pod["containers"][0]["resources"]["limits"]["google.com/tpu"]
  topology = pod["nodeSelector"]["cloud.google.com/gke-tpu-topology"]
  assert math.prod(int(d) for d in topology.split("x")) == chips * replicated["template"][
      "spec"]["parallelism"]
  assert topology == env["TPU_TOPOLOGY"]
  assert "mtc_peers_per_node" not in _args(pod["containers"][0]["command"])


@pytest.mark.parametrize("overrides", [(), ("--nodes", "2", "--peers", "2")])
def test_gpu_jobset_asks_for_the_peers_it_was_sized_for(tmp_path, overrides):
  rendered = _render_example("gpu", tmp_path, *overrides)
  jobset, argv = rendered["jobset"], rendered["argv"]
  if overrides:
    assert rendered["cpc"]["spec"]["inMemoryVolumeSize"] == "352Gi"  # 32 GiB x 11
  pod = _pod(jobset)
  (container,) = pod["containers"]
  args = _args(container["command"])
  peers = size.resolve_peers("gpu", int(_option(argv, "--peers")) if "--peers" in argv
                               else None)
  assert args["mtc_peers_per_node"] == str(peers)
  assert args["hardware"] == "gpu"
  env = {e["name"]: e for e in container["env"]}
  name = jobset["metadata"]["name"]
  rjob = jobset["spec"]["replicatedJobs"][0]
  assert env["JAX_COORDINATOR_IP"]["value"] == f"{name}-{rjob['name']}-0-0.{name}"
  assert env["NNODES"]["value"] == str(rjob["template"]["spec"]["parallelism"])
  assert "job-completion-index" in env["NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"]
  assert container["resources"]["limits"]["nvidia.com/gpu"] == 8


def test_gpu_jobset_puts_one_pod_per_node_as_the_add_ons_tests_do(tmp_path):
  # The add-on's tests label the job's pods and forbid two of them on one node (required pod
  # anti-affinity on kubernetes.io/hostname): each pod has its node's RAM disk to itself.
  jobset = _render_example("gpu", tmp_path)["jobset"]
  template = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
  labels = template["metadata"]["labels"]
  (term,) = template["spec"]["affinity"]["podAntiAffinity"][
      "requiredDuringSchedulingIgnoredDuringExecution"]
  assert term["topologyKey"] == "kubernetes.io/hostname"
  selector = term["labelSelector"]["matchLabels"]
  assert selector and selector.items() <= labels.items()  # matches the job's own pods
  assert jobset["metadata"]["name"] in selector.values()  # and no other job's
