# Shared by configs/gke/lib.sh and configs/tpu-vm/common.sh (sourced, not run).
# run CMD ARGS...: runs the command, or with DRY_RUN=1 prints it instead.

run() {
  if [[ -n "${DRY_RUN:-}" ]]; then
    # One write per command line, so lines of commands run at once never interleave.
    local arg line="+"
    for arg in "$@"; do
      if [[ "${arg}" =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then
        line+=" ${arg}"
      else
        line+=" '${arg//\'/\'\\\'\'}'"
      fi
    done
    printf '%s\n' "${line}"
  else
    "$@"
  fi
}
