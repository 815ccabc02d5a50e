#!/usr/bin/env bash
# Train on all devices of this machine through torchrun.
#   launch/run_single_node.sh CONFIG [key.sub=value ...] [--run-dir DIR]
# NPROC_PER_NODE: processes (one per device); default: the visible GPUs, else 2 CPU workers.
# MAX_RESTARTS: torchrun restarts all workers this often after a failure (default 0); a
# restarted worker continues from the run's latest checkpoint by itself.
# DRY_RUN=1 prints the command instead of running it.
set -euo pipefail
if [ $# -lt 1 ]; then
  echo "usage: $0 CONFIG [key.sub=value ...]" >&2
  exit 2
fi
if [ -z "${NPROC_PER_NODE:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    NPROC_PER_NODE=$(nvidia-smi -L | wc -l)
  else
    NPROC_PER_NODE=2
  fi
fi
cmd=(torchrun --standalone --nnodes 1 --nproc-per-node "$NPROC_PER_NODE"
     --max-restarts "${MAX_RESTARTS:-0}"
     -m pipetransformer train "$@")
if [ "${DRY_RUN:-0}" = "1" ]; then
  printf '%q ' "${cmd[@]}"; echo
else
  exec "${cmd[@]}"
fi
