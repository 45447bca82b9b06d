#!/usr/bin/env bash
# Requests Cloud TPU capacity as a queued resource with Autocheckpoint enabled: before a
# maintenance event Cloud TPU sends SIGTERM to the training processes and waits (up to about
# five minutes) for them to save. orbax-mtc turns that SIGTERM into one on-demand checkpoint
# of a step every process agrees on (RAM, peers, persistent tier), then the job stops.
#
#   PROJECT_ID=my-project ZONE=us-east5-b JOB_NAME=my-job SLICES=2 \
#     bash configs/tpu-vm/create-queued-resource.sh
#
# Cloud TPU's queued-resources guide uses the GA `gcloud compute tpus queued-resources`
# commands; this script does too, except for the create call with Autocheckpoint (below).
#
# Every setting is an environment variable with a default; DRY_RUN=1 prints the command.
set -euo pipefail

PROJECT_ID="${PROJECT_ID:-my-project}"
ZONE="${ZONE:-us-east5-b}"
JOB_NAME="${JOB_NAME:-mtc-job}"                 # node name (SLICES=1) or node prefix
QUEUED_RESOURCE_ID="${QUEUED_RESOURCE_ID:-${JOB_NAME}}"
ACCELERATOR_TYPE="${ACCELERATOR_TYPE:-v5litepod-16}"
RUNTIME_VERSION="${RUNTIME_VERSION:-v2-alpha-tpuv5-lite}"
SLICES="${SLICES:-1}"                           # > 1: a multislice job
# 1: --autocheckpoint-enabled. gcloud has that flag only in its alpha track, so the request
# then goes through `gcloud alpha`; 0: the GA `gcloud compute tpus queued-resources create`
# (no SIGTERM before maintenance: only the RAM steps, peers and backups protect the run).
AUTOCHECKPOINT="${AUTOCHECKPOINT:-1}"
# Capacity (default: on-demand). SPOT=1: Spot TPUs (--spot), preempted at any time; orbax-mtc
# and the launcher's restart loop resume the job. RESERVED=1: the project's reserved capacity
# (--reserved). RESERVATION=NAME: one named reservation (--reservation, alpha track only, so
# the request goes through `gcloud alpha` then too).
SPOT="${SPOT:-0}"
RESERVED="${RESERVED:-0}"
RESERVATION="${RESERVATION:-}"
# e.g. --valid-until-duration=6h (GA); --best-effort needs alpha
EXTRA_ARGS="${EXTRA_ARGS:-}"

source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

if ((SLICES == 1)); then
  nodes=(--node-id="${JOB_NAME}")
else
  nodes=(--node-prefix="${JOB_NAME}" --node-count="${SLICES}")
fi
if [[ "${SPOT}" == "1" && ( "${RESERVED}" == "1" || -n "${RESERVATION}" ) ]]; then
  echo "SPOT=1 and a reservation (RESERVED=1 or RESERVATION) exclude each other: choose one" >&2
  exit 2
fi
capacity=()
[[ "${SPOT}" == "1" ]] && capacity+=(--spot)
[[ "${RESERVED}" == "1" && -z "${RESERVATION}" ]] && capacity+=(--reserved)
[[ -n "${RESERVATION}" ]] && capacity+=(--reservation="${RESERVATION}")
gcloud_track=(gcloud)
if [[ "${AUTOCHECKPOINT}" == "1" || -n "${RESERVATION}" ]]; then
  gcloud_track+=(alpha)
fi
if [[ "${AUTOCHECKPOINT}" == "1" ]]; then
  nodes+=(--autocheckpoint-enabled)
fi
# shellcheck disable=SC2086  # EXTRA_ARGS holds several flags
run "${gcloud_track[@]}" compute tpus queued-resources create "${QUEUED_RESOURCE_ID}" \
  --project="${PROJECT_ID}" --zone="${ZONE}" \
  --accelerator-type="${ACCELERATOR_TYPE}" --runtime-version="${RUNTIME_VERSION}" \
  "${nodes[@]}" ${capacity[@]+"${capacity[@]}"} ${EXTRA_ARGS}
echo "wait for ACTIVE: gcloud compute tpus queued-resources describe" \
  "${QUEUED_RESOURCE_ID} --project=${PROJECT_ID} --zone=${ZONE}"
