#!/usr/bin/env bash
# rl_jax on a Cloud TPU pod slice: the same command on every worker VM through
# `gcloud compute tpus tpu-vm ssh --worker=all`; JAX detects the pod (RL_JAX_DISTRIBUTED=auto).
#
# Usage (arguments after the script go to `python -m rl_jax.main`):
#   TPU_NAME=my-v5p-64 ZONE=us-east5-a launch/tpu_pod.sh \
#     --config=configs/qwen3_30b_a3b_minirl.py:n4 --workdir=gs://my-bucket/runs/minirl_n4 \
#     --config.warm_start.path=/mnt/disks/ckpt/Qwen3-30B-A3B --config.mesh.data=1
#   DRY_RUN=1 TPU_NAME=x ZONE=y launch/tpu_pod.sh ...      # print the gcloud command only
#   RL_JAX_MODULE=rl_jax.distributed TPU_NAME=x ZONE=y launch/tpu_pod.sh   # set-up check
#
# Environment: TPU_NAME, ZONE (required); PROJECT (optional, gcloud's default otherwise);
# REPO_DIR on the workers (default ~/rl_jax; the code and a Python env with rl_jax
# installed must already be there on every worker, e.g. via `--worker=all --command="git pull"`);
# VENV (optional, activated first). The mesh sizes of the GPU configs assume 8 devices per
# host: on TPU set --config.mesh.* to the slice (e.g. v5p-64 = 32 chips).
set -euo pipefail

: "${TPU_NAME:?set TPU_NAME}"
: "${ZONE:?set ZONE}"
REPO_DIR="${REPO_DIR:-~/rl_jax}"
MODULE="${RL_JAX_MODULE:-rl_jax.main}"

args=""
for a in "$@"; do args+=" $(printf '%q' "$a")"; done
remote="cd ${REPO_DIR}"
[[ -n "${VENV:-}" ]] && remote+=" && source ${VENV}/bin/activate"
remote+=" && set -o pipefail && RL_JAX_DISTRIBUTED=auto python -m ${MODULE}${args} 2>&1 | tee -a /tmp/rl_jax_\$(hostname).log"

cmd=(gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE" --worker=all --command="$remote")
[[ -n "${PROJECT:-}" ]] && cmd+=(--project="$PROJECT")
if [[ -n "${DRY_RUN:-}" ]]; then
  printf '%q ' "${cmd[@]}"; echo
  exit 0
fi
exec "${cmd[@]}"
