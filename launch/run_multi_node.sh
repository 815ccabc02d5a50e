#!/usr/bin/env bash
# Train across nodes through torchrun; run the same command on every node.
#   launch/run_multi_node.sh CONFIG [key.sub=value ...] [--run-dir DIR | --resume DIR]
# From the environment (cluster schedulers set these): NNODES, NODE_RANK, MASTER_ADDR,
# MASTER_PORT (default 29500), NPROC_PER_NODE (default: visible GPUs),
# RDZV_ID (names the run on every node; default: SLURM_JOB_ID, else "pipetransformer"),
# MAX_RESTARTS (torchrun restarts all workers this often after a failure; default 0: a
# restarted worker continues from the run's latest checkpoint by itself).
# Rendezvous is torchrun's c10d store on MASTER_ADDR:MASTER_PORT. Pipelines never span
# nodes; the run directory must be on a file system every node shares (each rank writes its
# share of every checkpoint there). Without --run-dir it is runs/<config>-<RDZV_ID>.
# GLOO_SOCKET_IFNAME (the control group's interface; default below), NCCL_SOCKET_IFNAME.
# DRY_RUN=1 prints the command instead of running it.
set -euo pipefail
if [ $# -lt 1 ]; then
  echo "usage: $0 CONFIG [key.sub=value ...]" >&2
  exit 2
fi
: "${NNODES:?set NNODES (number of nodes)}"
: "${NODE_RANK:?set NODE_RANK (index of this node, 0..NNODES-1)}"
: "${MASTER_ADDR:?set MASTER_ADDR (host name or address of node 0)}"
MASTER_PORT=${MASTER_PORT:-29500}
RDZV_ID=${RDZV_ID:-${SLURM_JOB_ID:-pipetransformer}}
MAX_RESTARTS=${MAX_RESTARTS:-0}
# The GPUs this process can use, as torch counts them: CUDA_VISIBLE_DEVICES subsets and MIG
# instances included (`nvidia-smi -L` lists every GPU of the machine and a line per MIG
# instance besides). PYTHON: the interpreter that runs the trainer (default python).
visible_gpus() {
  "${PYTHON:-python}" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null || echo 0
}
if [ -z "${NPROC_PER_NODE:-}" ]; then
  NPROC_PER_NODE=$(visible_gpus)
  if [ "$NPROC_PER_NODE" -lt 1 ]; then
    echo "set NPROC_PER_NODE (no GPUs visible)" >&2
    exit 2
  fi
fi
# The control group is gloo whatever the training backend: without GLOO_SOCKET_IFNAME gloo
# binds the interface the host name resolves to, often not the cluster network (or a
# loopback address on some images). gloo takes exact interface names; NCCL_SOCKET_IFNAME is
# a list of prefixes ("eth", "ib"), exact names after "=" ("=eth0"), or exclusions after "^"
# ("^docker0,lo"), so it is not copied. Default: NCCL's interface when it names exactly one,
# else the interface the route to MASTER_ADDR leaves through if NCCL_SOCKET_IFNAME (if set)
# admits it, else the first interface of the host (loopback aside) it admits; none: gloo
# picks. SYSFS_NET (default /sys/class/net) is where the host's interfaces are listed.
nccl_admits() {  # $1: an interface name; NCCL's rule for NCCL_SOCKET_IFNAME
  local spec=$NCCL_SOCKET_IFNAME excluding=1 exact=0 name names
  if [ "${spec#^}" != "$spec" ]; then excluding=0; spec=${spec#^}; fi
  if [ "${spec#=}" != "$spec" ]; then exact=1; spec=${spec#=}; fi
  IFS=',' read -ra names <<< "$spec"
  for name in "${names[@]}"; do
    if [ "$1" = "$name" ] || { [ $exact = 0 ] && [ -n "$name" ] && [ "${1#"$name"}" != "$1" ]; }; then
      return $((1 - excluding))
    fi
  done
  return $excluding
}
if [ -z "${GLOO_SOCKET_IFNAME:-}" ]; then
  routed=""
  if command -v ip >/dev/null 2>&1; then
    routed=$( (ip -o route get "$MASTER_ADDR" 2>/dev/null || true) | sed -n 's/.* dev \([^ ]*\).*/\1/p')
  fi
  if [ -z "${NCCL_SOCKET_IFNAME:-}" ]; then
    GLOO_SOCKET_IFNAME=$routed
  elif [[ "$NCCL_SOCKET_IFNAME" =~ ^=[^,^=]+$ ]]; then
    GLOO_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME#=}
  else
    for candidate in $routed $(ls "${SYSFS_NET:-/sys/class/net}" 2>/dev/null | grep -vx lo); do
      if nccl_admits "$candidate"; then GLOO_SOCKET_IFNAME=$candidate; break; fi
    done
    if [ -z "${GLOO_SOCKET_IFNAME:-}" ]; then
      echo "NCCL_SOCKET_IFNAME=$NCCL_SOCKET_IFNAME admits no interface here: gloo picks its own (set GLOO_SOCKET_IFNAME)" >&2
    fi
  fi
  if [ -n "${GLOO_SOCKET_IFNAME:-}" ]; then export GLOO_SOCKET_IFNAME; fi
fi
# Each rendezvous round gets a fresh store for the workers. torchrun's default shares one
# store (on node 0's agent) across rounds, and the agents' restart counts can differ (a node
# whose own workers did not fail restarts without counting), so a restarted round could find
# the dead round's addresses under its keys and hang in gloo's connectFullMesh.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}
cmd=(torchrun --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$NPROC_PER_NODE"
     --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$RDZV_ID"
     --max-restarts "$MAX_RESTARTS"
     -m pipetransformer train "$@")
if [ "${DRY_RUN:-0}" = "1" ]; then
  echo "GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-}"
  printf '%q ' "${cmd[@]}"; echo
else
  exec "${cmd[@]}"
fi
