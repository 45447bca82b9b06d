# Shared by gke/tpu/cluster-setup.sh and gke/gpu/cluster-setup.sh (sourced, not run).
# DRY_RUN=1 prints every command instead of running it.

# shellcheck source=../run.sh
source "$(dirname "${BASH_SOURCE[0]}")/../run.sh"

# The bucket holds the replicator's backups; without hierarchical namespace they fail.
create_bucket() {
  if [[ -z "${DRY_RUN:-}" ]] && gcloud storage buckets describe "gs://${BUCKET}" \
      --project="${PROJECT_ID}" >/dev/null 2>&1; then
    echo "bucket gs://${BUCKET} exists (it must have hierarchical namespace enabled)"
    return
  fi
  run gcloud storage buckets create "gs://${BUCKET}" --project="${PROJECT_ID}" \
    --location="${REGION}" --uniform-bucket-level-access --enable-hierarchical-namespace
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
}

# JobSet controller, then the CheckpointConfiguration rendered by `orbax-mtc size --render`.
apply_manifests() {
  run gcloud container clusters get-credentials "${CLUSTER_NAME}" \
    --project="${PROJECT_ID}" --location="${REGION}"
  run kubectl apply --server-side -f \
    "https://github.com/kubernetes-sigs/jobset/releases/download/${JOBSET_VERSION}/manifests.yaml"
  if [[ -z "${DRY_RUN:-}" && ! -f "${RENDERED}/checkpoint-configuration.yaml" ]]; then
    echo "no ${RENDERED}/checkpoint-configuration.yaml: run \`orbax-mtc size ... --render" \
      "${RENDERED}\` first (and source ${RENDERED}/env.sh)" >&2
    exit 1
  fi
  run kubectl apply -f "${RENDERED}/checkpoint-configuration.yaml"
  # The driver and replicator pods of the add-on appear here once the nodes are selected.
  run kubectl get pods -n gke-managed-checkpointing
  echo "next: kubectl apply -f ${RENDERED}/jobset-maxtext.yaml"
}
