#!/usr/bin/env bash
# A GKE cluster (or an existing one) with multi-tier checkpointing for a TPU multislice job.
#
#   orbax-mtc size --state-size 768GiB --nodes 4 --accelerator tpu --render rendered \
#     --bucket my-ckpt-bucket --machine-type ct6e-standard-4t --job-name my-job
#   source rendered/env.sh
#   PROJECT_ID=my-project REGION=us-east5 ZONE=us-east5-b \
#     bash configs/gke/tpu/cluster-setup.sh create     # or: update (existing cluster)
#   ... cluster-setup.sh upgrade     # delete and recreate the CheckpointConfiguration
#   ... cluster-setup.sh uninstall   # delete it and disable the add-on
#   kubectl apply -f rendered/jobset-maxtext.yaml
#
# Every setting is an environment variable with a default; DRY_RUN=1 prints the commands.
set -euo pipefail

MODE="${1:-create}"

PROJECT_ID="${PROJECT_ID:-my-project}"
REGION="${REGION:-us-east5}"              # the cluster's location
ZONE="${ZONE:-us-east5-b}"                # where the TPU capacity is
CLUSTER_NAME="${CLUSTER_NAME:-mtc-cluster}"
# The guide's minimum for multi-tier checkpointing on new clusters.
CLUSTER_VERSION="${CLUSTER_VERSION:-1.32.4-gke.1415000}"
# Runs the JobSet controller and the add-on's controller (our choice of size).
CPU_MACHINE_TYPE="${CPU_MACHINE_TYPE:-e2-standard-8}"
BUCKET="${BUCKET:-my-ckpt-bucket}"
MACHINE_TYPE="${MACHINE_TYPE:-ct6e-standard-4t}"
TPU_TOPOLOGY="${TPU_TOPOLOGY:-4x4}"       # must equal the JobSet's gke-tpu-topology
NODES="${NODES:-4}"                       # hosts per slice
SLICES="${SLICES:-2}"                     # one node pool per slice
JOBSET_VERSION="${JOBSET_VERSION:-v0.8.0}"
WORKLOAD_NAMESPACE="${WORKLOAD_NAMESPACE:-default}"
WORKLOAD_KSA="${WORKLOAD_KSA:-default}"
RENDERED="${RENDERED:-rendered}"          # the --render folder of `orbax-mtc size`
SPOT="${SPOT:-0}"                         # 1: Spot TPU node pools
RESERVATION="${RESERVATION:-}"            # a TPU reservation for the node pools

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
    for ((slice = 0; slice < SLICES; slice++)); do
      run gcloud container node-pools create "${CLUSTER_NAME}-tpu-${slice}" \
        --project="${PROJECT_ID}" --cluster="${CLUSTER_NAME}" --location="${REGION}" \
        --node-locations="${ZONE}" --machine-type="${MACHINE_TYPE}" \
        --tpu-topology="${TPU_TOPOLOGY}" --num-nodes="${NODES}" \
        ${CAPACITY_FLAGS[@]+"${CAPACITY_FLAGS[@]}"}
    done
    grant_bucket_access
    apply_manifests
    ;;
esac
