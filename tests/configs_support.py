"""Helpers and fixtures shared by test_configs.py, test_config_scripts.py and
test_config_tpu_vm.py."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

from orbax_mtc.tools import cli

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


README = CONFIGS / "README.md"


YAMLS = sorted(CONFIGS.rglob("*.yaml"))


SCRIPTS = sorted(CONFIGS.rglob("*.sh"))


LIBRARIES = {CONFIGS / "run.sh", CONFIGS / "gke" / "lib.sh", CONFIGS / "tpu-vm" / "common.sh"}


# spec fields of checkpointing.gke.io/v1 CheckpointConfiguration (the public CRD).
CPC_FIELDS = {"cloudStorageBucketName", "enableExternalJaxProcessIds", "nodeSelector",
              "tolerations", "inMemoryVolumeSize", "csiEphemeralLimit", "replicationOptions",
              "gcsFuseMountOptions"}


CPC_REQUIRED = {"cloudStorageBucketName", "nodeSelector", "tolerations", "inMemoryVolumeSize"}


# GKE's multi-tier checkpointing guide lists these Cloud Storage FUSE options for the
# CheckpointConfiguration, in this order (the add-on's README gives the same eleven).
GUIDE_FUSE_OPTIONS = [
    "implicit-dirs",
    "metadata-cache:negative-ttl-secs:0",
    "metadata-cache:ttl-secs:-1",
    "metadata-cache:stat-cache-max-size-mb:-1",
    "metadata-cache:type-cache-max-size-mb:-1",
    "file-cache:max-size-mb:-1",
    "file-cache:cache-file-for-range-read:true",
    "file-system:kernel-list-cache-ttl-secs:0",
    "file-cache:enable-parallel-downloads:true",
    "read_ahead_kb=1024",
    "write:enable-streaming-writes:true",
]


KINDS = {("checkpointing.gke.io/v1", "CheckpointConfiguration"),
         ("jobset.x-k8s.io/v1alpha2", "JobSet"), ("v1", "Service"), ("batch/v1", "Job")}


K8S_RECIPES = sorted((CONFIGS / "k8s").rglob("*.yaml"))


FILL = CONFIGS / "k8s" / "fill.sh"


DOCKERFILE = CONFIGS / "Dockerfile"


REPO = CONFIGS.parent


def _docs(text: str) -> list[dict]:
  return [d for d in yaml.safe_load_all(text) if d is not None]


def _pod(jobset: dict) -> dict:
  return jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]


def _args(command: list[str]) -> dict[str, str]:
  return dict(item.split("=", 1) for item in command if "=" in item)


def _bash(script: Path | str, *args: str, env: dict[str, str] | None = None,
          check: bool = True) -> subprocess.CompletedProcess:
  base = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), "DRY_RUN": "1"}
  return subprocess.run(["bash", str(script), *args], env={**base, **(env or {})},
                        capture_output=True, text=True, check=check, timeout=60)


def _dry_run_lines(output: str) -> list[list[str]]:
  return [shlex.split(line[2:]) for line in output.splitlines() if line.startswith("+ ")]


def _documented_example(accelerator: str) -> tuple[list[str], str]:
  """The README's `orbax-mtc size` arguments for one accelerator, and the quantity it says."""
  text = README.read_text()
  marker = f"<!-- size-example-{accelerator} -->"
  assert marker in text, f"README lost its {marker} example"
  after = text.split(marker, 1)[1]
  block = after.split("```bash\n", 1)[1].split("```", 1)[0]
  words = shlex.split(block.replace("\\\n", " "))
  assert words[:2] == ["orbax-mtc", "size"], words
  quantity = re.search(r"inMemoryVolumeSize: (\d+Gi)", after)
  assert quantity, f"README does not say which inMemoryVolumeSize its {accelerator} example gets"
  return words[2:], quantity.group(1)


def _option(argv: list[str], flag: str, default: str | None = None) -> str | None:
  """The value of `flag` as argparse sees it (the last one given)."""
  return argv[len(argv) - argv[::-1].index(flag)] if flag in argv else default


def _render_example(accelerator: str, tmp_path: Path, *overrides: str) -> dict:
  """The README's example (argv then `overrides`) rendered into tmp_path: argv, the quantity
  the README states, CPC, JobSet, env."""
  argv, quantity = _documented_example(accelerator)
  argv += overrides
  out = tmp_path / f"rendered-{accelerator}-{len(overrides)}"
  argv[argv.index("--render") + 1] = str(out)
  assert cli.size_main(argv) == 0
  (cpc,) = _docs((out / "checkpoint-configuration.yaml").read_text())
  (jobset,) = _docs((out / "jobset-maxtext.yaml").read_text())
  env = dict(re.findall(r"^export (\w+)=(\S+)$", (out / "env.sh").read_text(), re.M))
  return {"accelerator": accelerator, "argv": argv, "quantity": quantity, "cpc": cpc,
          "jobset": jobset, "env": env, "dir": out}


@pytest.fixture(params=["tpu", "gpu"])
def rendered(request, tmp_path):
  return _render_example(request.param, tmp_path)


def _remote_commands(script: str, env: dict[str, str]) -> dict[str, str]:
  """node -> the command `gcloud compute tpus tpu-vm ssh --worker=all` would run (after the
  `scp` of supervise.sh to every worker, which `_copies` checks)."""
  lines = _dry_run_lines(_bash(CONFIGS / "tpu-vm" / script, env=env).stdout)
  commands = {}
  for line in lines:
    if line[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "scp"]:
      continue
    assert line[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh"]
    assert "--worker=all" in line
    (command,) = [a.removeprefix("--command=") for a in line if a.startswith("--command=")]
    commands[line[5]] = command
  return commands


def _supervised(command: str) -> tuple[list[str], str]:
  """A launcher's remote command -> (`supervise.sh start NAME` and what precedes it, as words;
  the job's own command line, unquoted)."""
  words = shlex.split(command)
  at = words.index("${HOME}/orbax-mtc-supervise.sh")
  assert words[at - 1] == "bash" and words[at + 1] == "start" and len(words) == at + 4
  return words[:at + 3], words[at + 3]


def _fill(template: Path, rendered: dict, check: bool = True) -> subprocess.CompletedProcess:
  """configs/k8s/fill.sh on `template`, with the environment of the rendered env.sh."""
  return _bash("-c", f"source {rendered['dir'] / 'env.sh'} && bash {FILL} {template}",
               check=check)


@pytest.fixture
def gpu_render(tmp_path):
  return _render_example("gpu", tmp_path)


def _dockerfile_tag() -> str:
  text = DOCKERFILE.read_text()
  (tag,) = set(re.findall(r"^# Tag: (\S+)", text, re.M))
  builds = re.findall(r"^#\s+docker build -f configs/Dockerfile -t (\S+) \.$", text, re.M)
  assert builds == [tag], builds
  return tag
