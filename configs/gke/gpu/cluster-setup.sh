#!/usr/bin/env bash
# A GKE cluster (or an existing one) with multi-tier checkpointing for a GPU node pool.
#
#   orbax-mtc size --state-size 64GiB --nodes 8 --accelerator gpu --peers 1 --render rendered \
#     --bucket my-ckpt-bucket --machine-type a3-megagpu-8g --job-name my-job
#   source rendered/env.sh
#   PROJECT_ID=my-project REGION=us-central1 ZONE=us-central1-a \
#     bash configs/gke/gpu/cluster-setup.sh create     # or: update (existing cluster)
#   ... cluster-setup.sh upgrade     # delete and recreate the CheckpointConfiguration
#   ... cluster-setup.sh uninstall   # delete it and disable the add-on
#   kubectl apply -f rendered/jobset-maxtext.yaml
#
# Every setting is an environment variable with a default; DRY_RUN=1 prints the commands.
# The node pool here has only what multi-tier checkpointing needs: add your GPU networking
# (GPUDirect, placement policy) flags as for any pool of this machine type.
set -euo pipefail

MODE="${1:-create}"

PROJECT_ID="${PROJECT_ID:-my-project}"
REGION="${REGION:-us-central1}"
ZONE="${ZONE:-us-central1-a}"
CLUSTER_NAME="${CLUSTER_NAME:-mtc-cluster}"
CLUSTER_VERSION="${CLUSTER_VERSION:-1.32.4-gke.1415000}"
CPU_MACHINE_TYPE="${CPU_MACHINE_TYPE:-e2-standard-8}"
BUCKET="${BUCKET:-my-ckpt-bucket}"
MACHINE_TYPE="${MACHINE_TYPE:-a3-megagpu-8g}"
GPU_TYPE="${GPU_TYPE:-nvidia-h100-mega-80gb}"   # the accelerator of MACHINE_TYPE
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
NODES="${NODES:-8}"
JOBSET_VERSION="${JOBSET_VERSION:-v0.8.0}"
WORKLOAD_NAMESPACE="${WORKLOAD_NAMESPACE:-default}"
WORKLOAD_KSA="${WORKLOAD_KSA:-default}"
RENDERED="${RENDERED:-rendered}"
SPOT="${SPOT:-0}"                         # 1: a Spot GPU node pool
RESERVATION="${RESERVATION:-}"            # a GPU reservation for the node pool

# shellcheck source=../lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
check_mode

case "${MODE}" in
  upgrade) recreate_checkpoint_configuration ;;
  uninstall) uninstall_multi_tier_checkpointing ;;
  *)
    capacity_flags
    create_bucket
    create_or_update_cluster
    run gcloud container node-pools create "${CLUSTER_NAME}-gpu" \
      --project="${PROJECT_ID}" --cluster="${CLUSTER_NAME}" --location="${REGION}" \
      --node-locations="${ZONE}" --machine-type="${MACHINE_TYPE}" \
      --accelerator="type=${GPU_TYPE},count=${GPUS_PER_NODE},gpu-driver-version=latest" \
      --num-nodes="${NODES}" ${CAPACITY_FLAGS[@]+"${CAPACITY_FLAGS[@]}"}
    grant_bucket_access
    apply_manifests
    ;;
esac
