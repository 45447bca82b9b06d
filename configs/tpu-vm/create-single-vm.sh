#!/usr/bin/env bash
# Creates one Cloud TPU VM (one slice) directly, with Autocheckpoint enabled: Cloud TPU sends
# SIGTERM before a maintenance event and waits for the on-demand checkpoint.
#
#   PROJECT_ID=my-project ZONE=us-central2-b JOB_NAME=my-job ACCELERATOR_TYPE=v4-32 \
#     bash configs/tpu-vm/create-single-vm.sh
#
# Every setting is an environment variable with a default; DRY_RUN=1 prints the command.
set -euo pipefail

PROJECT_ID="${PROJECT_ID:-my-project}"
ZONE="${ZONE:-us-central2-b}"
JOB_NAME="${JOB_NAME:-mtc-job}"                 # the TPU VM's name
ACCELERATOR_TYPE="${ACCELERATOR_TYPE:-v4-8}"
RUNTIME_VERSION="${RUNTIME_VERSION:-tpu-ubuntu2204-base}"
# 1: --autocheckpoint-enabled, which gcloud has only in its alpha track; 0: the GA
# `gcloud compute tpus tpu-vm create` without it.
AUTOCHECKPOINT="${AUTOCHECKPOINT:-1}"
EXTRA_ARGS="${EXTRA_ARGS:-}"                    # e.g. --spot

source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

gcloud_track=(gcloud)
flags=()
if [[ "${AUTOCHECKPOINT}" == "1" ]]; then
  gcloud_track+=(alpha)
  flags+=(--autocheckpoint-enabled)
fi
# shellcheck disable=SC2086  # EXTRA_ARGS holds several flags
run "${gcloud_track[@]}" compute tpus tpu-vm create "${JOB_NAME}" \
  --project="${PROJECT_ID}" --zone="${ZONE}" \
  --accelerator-type="${ACCELERATOR_TYPE}" --version="${RUNTIME_VERSION}" \
  ${flags[@]+"${flags[@]}"} ${EXTRA_ARGS}
