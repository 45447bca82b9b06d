#!/usr/bin/env bash
# Prints a template of configs/ with every ${NAME} replaced by the environment variable NAME,
# and fails, printing nothing, if one of them is not set. For the manifests that
# `orbax-mtc size --render` does not write itself (configs/k8s/):
#
#   source rendered-gpu/env.sh     # written by `orbax-mtc size --render rendered-gpu ...`
#   bash configs/k8s/fill.sh configs/k8s/gpu/indexed-job-emptydir.yaml | kubectl apply -f -
#
# Only ${NAME} with NAME in capitals is replaced; any other $ is left as it is.
set -euo pipefail

if (($# != 1)) || [[ ! -f "$1" ]]; then
  echo "usage: $0 TEMPLATE.yaml   (with the values in the environment: source OUTDIR/env.sh)" >&2
  exit 2
fi

text="$(<"$1")"
missing=()
while read -r name; do
  [[ -n "${name}" ]] || continue
  if [[ -z "${!name+set}" ]]; then
    missing+=("${name}")
  fi
done < <(grep -o '\${[A-Z][A-Z0-9_]*}' "$1" | tr -d '${}' | sort -u)
if ((${#missing[@]})); then
  echo "$1 needs ${missing[*]}: source the env.sh of \`orbax-mtc size --render\`" \
    "(GPU values) or set them" >&2
  exit 1
fi

out="" rest="${text}"
pattern='\$\{([A-Z][A-Z0-9_]*)\}'
while [[ "${rest}" =~ ${pattern} ]]; do
  name="${BASH_REMATCH[1]}"
  out+="${rest%%"${BASH_REMATCH[0]}"*}${!name}"
  rest="${rest#*"${BASH_REMATCH[0]}"}"
done
printf '%s\n' "${out}${rest}"
