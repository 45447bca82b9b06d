# Shared by gke/tpu/cluster-setup.sh and gke/gpu/cluster-setup.sh (sourced, not run).
# DRY_RUN=1 prints every command instead of running it.

# shellcheck source=../run.sh
source "$(dirname "${BASH_SOURCE[0]}")/../run.sh"

# The bucket holds the replicator's backups; without hierarchical namespace they fail, and a
# bucket cannot be given it later: an existing bucket without it stops the set-up here.
create_bucket() {
  local hns
  if [[ -z "${DRY_RUN:-}" ]] && hns="$(gcloud storage buckets describe "gs://${BUCKET}" \
      --project="${PROJECT_ID}" --raw --format='value(hierarchicalNamespace.enabled)' \
      2>/dev/null)"; then
    if [[ "${hns,,}" != "true" ]]; then
      echo "bucket gs://${BUCKET} exists without hierarchical namespace, which multi-tier" \
        "checkpointing needs and an existing bucket cannot be given: choose another name" \
        "(BUCKET=... and orbax-mtc size --render ... --bucket ...) for a new bucket" >&2
      exit 1
    fi
    echo "bucket gs://${BUCKET} exists, with hierarchical namespace"
    return
  fi
  run gcloud storage buckets create "gs://${BUCKET}" --project="${PROJECT_ID}" \
    --location="${REGION}" --uniform-bucket-level-access --enable-hierarchical-namespace
}

# Capacity of the accelerator node pools (default: on-demand): SPOT=1 (--spot: Spot VMs,
# preempted at any time; JobSet restarts the job, which resumes from its checkpoint) or
# RESERVATION=NAME (--reservation-affinity=specific --reservation=NAME; a shared reservation
# of another project is projects/PROJECT/reservations/NAME). Sets CAPACITY_FLAGS.
capacity_flags() {
  CAPACITY_FLAGS=()
  if [[ "${SPOT:-0}" == "1" && -n "${RESERVATION:-}" ]]; then
    echo "SPOT=1 and RESERVATION=${RESERVATION} exclude each other: choose one" >&2
    exit 2
  fi
  if [[ "${SPOT:-0}" == "1" ]]; then
    CAPACITY_FLAGS+=(--spot)
  elif [[ -n "${RESERVATION:-}" ]]; then
    CAPACITY_FLAGS+=(--reservation-affinity=specific --reservation="${RESERVATION}")
  fi
}

# The JobSet's image must be one the nodes can pull. A name without a registry (the default
# maxtext-orbax-mtc:latest is the local tag of configs/Dockerfile) makes them ask Docker Hub,
# where no such image is: the pods stay in ErrImagePull.
warn_unpullable_image() {
  local jobset="${RENDERED}/jobset-maxtext.yaml" image repository
  [[ -f "${jobset}" ]] || return 0
  image="$(sed -n 's/^[[:space:]]*image:[[:space:]]*//p' "${jobset}" | head -n 1)"
  repository="${image%%@*}"
  repository="${repository%:*}"
  if [[ -n "${image}" && "${repository}" != */* ]]; then
    echo "warning: the JobSet's image ${image} names no registry, so the nodes would pull it" \
      "from Docker Hub and fail (ErrImagePull). Push the image built from configs/Dockerfile" \
      "to a registry they can read (Artifact Registry) and render again with" \
      "--image REGISTRY/PATH/${repository}:TAG (configs/README.md)." >&2
  fi
}

# The HighScaleCheckpointing add-on is multi-tier checkpointing; it needs the Cloud Storage
# FUSE CSI driver and Workload Identity Federation.
create_or_update_cluster() {
  if [[ "${MODE}" == "create" ]]; then
    run gcloud container clusters create "${CLUSTER_NAME}" --project="${PROJECT_ID}" \
      --location="${REGION}" --node-locations="${ZONE}" \
      --cluster-version="${CLUSTER_VERSION}" \
      --workload-pool="${PROJECT_ID}.svc.id.goog" \
      --addons=HighScaleCheckpointing,GcsFuseCsiDriver \
      --machine-type="${CPU_MACHINE_TYPE}" --num-nodes=1
  else
    # gcloud takes --workload-pool and --update-addons in separate calls.
    run gcloud container clusters update "${CLUSTER_NAME}" --project="${PROJECT_ID}" \
      --location="${REGION}" --workload-pool="${PROJECT_ID}.svc.id.goog"
    run gcloud container clusters update "${CLUSTER_NAME}" --project="${PROJECT_ID}" \
      --location="${REGION}" \
      --update-addons=HighScaleCheckpointing=ENABLED,GcsFuseCsiDriver=ENABLED
  fi
}

# The replicator runs as gke-managed-checkpointing/gke-checkpointing-multitier-node; the
# training pods (namespace/service account of the JobSet) read and write the same bucket.
grant_bucket_access() {
  local number principal
  if [[ -n "${DRY_RUN:-}" ]]; then
    number="PROJECT_NUMBER"
  else
    number="$(gcloud projects describe "${PROJECT_ID}" --format='value(projectNumber)')"
  fi
  principal="principal://iam.googleapis.com/projects/${number}/locations/global"
  principal+="/workloadIdentityPools/${PROJECT_ID}.svc.id.goog/subject/ns"
  run gcloud storage buckets add-iam-policy-binding "gs://${BUCKET}" \
    --member="${principal}/gke-managed-checkpointing/sa/gke-checkpointing-multitier-node" \
    --role=roles/storage.objectUser
  run gcloud storage buckets add-iam-policy-binding "gs://${BUCKET}" \
    --member="${principal}/${WORKLOAD_NAMESPACE}/sa/${WORKLOAD_KSA}" \
    --role=roles/storage.objectUser
  # Optional, as in the guide: read-only access for an identity that only reads the backups
  # (an evaluation job, the nodes' service account). READER_MEMBER is a full IAM member,
  # e.g. serviceAccount:NUMBER-compute@developer.gserviceaccount.com; empty: no grant.
  if [[ -n "${READER_MEMBER:-}" ]]; then
    run gcloud storage buckets add-iam-policy-binding "gs://${BUCKET}" \
      --member="${READER_MEMBER}" --role=roles/storage.objectViewer
  fi
}

# The CheckpointConfiguration's kind exists once the add-on has installed its CRD; applying
# earlier fails with `no matches for kind "CheckpointConfiguration"`.
CPC_CRD="crd/checkpointconfigurations.checkpointing.gke.io"

get_credentials() {
  run gcloud container clusters get-credentials "${CLUSTER_NAME}" \
    --project="${PROJECT_ID}" --location="${REGION}"
}

# Waits (up to WAIT_CRD_MINUTES, default 10) for the add-on to install that CRD.
wait_for_checkpoint_crd() {
  local minutes="${WAIT_CRD_MINUTES:-10}" i
  if [[ -z "${DRY_RUN:-}" ]]; then
    for ((i = 0; i < minutes * 6; i++)); do
      kubectl get "${CPC_CRD}" >/dev/null 2>&1 && break
      sleep 10
    done
    if ! kubectl get "${CPC_CRD}" >/dev/null 2>&1; then
      echo "no ${CPC_CRD#crd/} after ${minutes} min: is the add-on on? gcloud container" \
        "clusters describe ${CLUSTER_NAME} --location=${REGION}" \
        "--format='yaml(addonsConfig.highScaleCheckpointingConfig)'" >&2
      exit 1
    fi
  fi
  run kubectl wait --for condition=established --timeout="${minutes}m" "${CPC_CRD}"
}

need_rendered() {
  if [[ -z "${DRY_RUN:-}" && ! -f "${RENDERED}/checkpoint-configuration.yaml" ]]; then
    echo "no ${RENDERED}/checkpoint-configuration.yaml: run \`orbax-mtc size ... --render" \
      "${RENDERED}\` first (and source ${RENDERED}/env.sh)" >&2
    exit 1
  fi
}

# JobSet controller (its resources raised for large jobs, as the guide does), then the
# CheckpointConfiguration rendered by `orbax-mtc size --render`.
apply_manifests() {
  get_credentials
  run kubectl apply --server-side -f \
    "https://github.com/kubernetes-sigs/jobset/releases/download/${JOBSET_VERSION}/manifests.yaml"
  # The controller's default resources are too small for thousands of pods. JOBSET_PATCH=0
  # skips this; the sizes are environment variables (defaults: the add-on's public notes).
  if [[ "${JOBSET_PATCH:-1}" != "0" ]]; then
    local patch
    patch='[{"op": "add", "path": "/spec/template/spec/containers/0/resources", "value": '
    patch+="{\"limits\": {\"memory\": \"${JOBSET_MEMORY_LIMIT:-2Gi}\"}, \"requests\": "
    patch+="{\"cpu\": \"${JOBSET_CPU_REQUEST:-1}\", "
    patch+="\"memory\": \"${JOBSET_MEMORY_REQUEST:-1Gi}\"}}}]"
    run kubectl patch -n jobset-system deploy jobset-controller-manager --type json \
      --patch "${patch}"
  fi
  wait_for_checkpoint_crd
  run kubectl apply -f "${RENDERED}/checkpoint-configuration.yaml"
  # The driver and replicator pods of the add-on appear here once the nodes are selected.
  run kubectl get pods -n gke-managed-checkpointing
  warn_unpullable_image
  echo "next: kubectl apply -f ${RENDERED}/jobset-maxtext.yaml"
}

# `upgrade`: the guide's way to move to a changed CheckpointConfiguration (size, mount
# options, bucket) or a new add-on version is to delete the configuration and create it
# again. Stop the jobs on those nodes first: the RAM disks go with the driver pods (the
# backups in the bucket stay).
recreate_checkpoint_configuration() {
  get_credentials
  run kubectl delete -f "${RENDERED}/checkpoint-configuration.yaml" --ignore-not-found --wait
  wait_for_checkpoint_crd
  run kubectl apply -f "${RENDERED}/checkpoint-configuration.yaml"
  run kubectl get pods -n gke-managed-checkpointing
}

# `uninstall`: every CheckpointConfiguration first (their driver pods and RAM disks go), then
# the add-on. The cluster, node pools, JobSet controller and bucket are left as they are.
uninstall_multi_tier_checkpointing() {
  get_credentials
  run kubectl delete checkpointconfigurations.checkpointing.gke.io --all --ignore-not-found \
    --wait
  run gcloud container clusters update "${CLUSTER_NAME}" --project="${PROJECT_ID}" \
    --location="${REGION}" --update-addons=HighScaleCheckpointing=DISABLED
  echo "left in place: cluster ${CLUSTER_NAME}, its node pools, the JobSet controller and" \
    "gs://${BUCKET} (delete them with gcloud/kubectl when no longer needed)"
}

MODES="create|update|upgrade|uninstall"

check_mode() {
  if [[ ! "${MODE}" =~ ^(${MODES})$ ]]; then
    echo "usage: $0 [${MODES}]" >&2
    echo "  create: new cluster; update: an existing one (both add node pools, grant access," \
      "install JobSet, apply the configuration)" >&2
    echo "  upgrade: delete and recreate the CheckpointConfiguration; uninstall: remove it" \
      "and disable the add-on" >&2
    exit 2
  fi
  # Before anything is created: every mode but uninstall applies the rendered configuration.
  if [[ "${MODE}" != "uninstall" ]]; then
    need_rendered
  fi
}
