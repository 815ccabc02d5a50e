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
# The GPUs this process can use, as torch counts them: CUDA_VISIBLE_DEVICES subsets and MIG
# instances included (`nvidia-smi -L` lists every GPU of the machine and a line per MIG
# instance besides). PYTHON: the interpreter that runs the trainer (default python).
visible_gpus() {
  "${PYTHON:-python}" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null || echo 0
}
if [ -z "${NPROC_PER_NODE:-}" ]; then
  NPROC_PER_NODE=$(visible_gpus)
  if [ "$NPROC_PER_NODE" -lt 1 ]; then
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
