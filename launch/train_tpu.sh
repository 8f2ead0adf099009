#!/usr/bin/env bash
# Train an EAGLE-3 head on a Cloud TPU VM slice (single- or multi-host).
#
#   launch/train_tpu.sh --name eagle3-v5p --zone us-east5-a --accelerator v5p-32 \
#       [--project P] [--version tpu-ubuntu2204-base] [--spot] [--dry-run] [--skip-plan] \
#       -- --config configs/train-llama-3.1-8b-instruct.yaml target=/mnt/llama31 out_dir=/mnt/runs/llama31
#   launch/train_tpu.sh --name eagle3-v5p --zone us-east5-a --accelerator v5p-32 \
#       --exec "python -m eagle3_jax.bench speed --target /mnt/llama31 --draft /mnt/head"
#
# 0. plans first, on this machine: `python -m eagle3_jax.plan --config ... --topology
#    <accelerator>` compiles the training step for the slice (with libtpu installed here:
#    `pip install 'jax[tpu]'`; else an analytic estimate) and the script refuses a plan that does
#    not fit, before anything is created (--skip-plan skips it; PY names the python to use);
# 1. creates the TPU VM slice, or reuses it when it already exists;
# 2. copies this checkout (git archive of HEAD) to every worker and installs it into a venv
#    with jax[tpu] (`pip install -e '.[tpu]'`);
# 3. runs `python -m eagle3_jax.train --distributed auto ...` on all workers at once (or, with
#    --exec CMD, runs CMD on worker 0 alone in the checkout with its venv first on PATH: data
#    preparation and regeneration, export, decoding, `bench speed`): JAX finds
#    the coordinator itself, each host reads its own rows of every global batch, and process 0
#    writes metrics and plots. Orbax checkpoints are written by all hosts together, so on a
#    multi-host slice out_dir must be a filesystem every worker sees (a gcsfuse-mounted bucket or
#    Filestore). Re-running the script updates the code in place (nothing is deleted) and resumes
#    the run from its latest checkpoint. Every worker appends its output to its own log,
#    ~/eagle3_jax/logs/<train|exec>-<hostname>.log (read one with
#    `gcloud compute tpus tpu-vm ssh NAME --zone Z --worker=N --command 'tail -f ~/eagle3_jax/logs/*'`).
# Before anything: gcloud must be installed and logged in, and the checkout committed (the
# workers get HEAD). --dry-run prints every command instead of running it (and checks nothing).
set -euo pipefail

name="" zone="" accelerator="" project="" version="tpu-ubuntu2204-base" spot="" dry_run=0 plan=1
exec_cmd=""
train_args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --name) name="$2"; shift 2 ;;
    --zone) zone="$2"; shift 2 ;;
    --accelerator) accelerator="$2"; shift 2 ;;
    --project) project="$2"; shift 2 ;;
    --version) version="$2"; shift 2 ;;
    --spot) spot="--spot"; shift ;;
    --dry-run) dry_run=1; shift ;;
    --skip-plan) plan=0; shift ;;
    --exec) exec_cmd="$2"; shift 2 ;;
    --) shift; train_args=("$@"); break ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "error: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
for var in name zone accelerator; do
  if [[ -z "${!var}" ]]; then echo "error: --$var is required (see --help)" >&2; exit 2; fi
done
if [[ -n "$exec_cmd" ]]; then
  plan=0  # a single-host job, not a training run
  [[ ${#train_args[@]} -gt 0 ]] && { echo "error: give either --exec CMD or training arguments after --" >&2; exit 2; }
elif [[ ${#train_args[@]} -eq 0 ]]; then
  echo "error: give the training arguments after --, e.g. -- --config configs/train-llama-3.1-8b-instruct.yaml" >&2
  exit 2
fi

gcloud_tpu=(gcloud compute tpus tpu-vm)
where=(--zone "$zone")
[[ -n "$project" ]] && where+=(--project "$project")
repo_root="$(cd "$(dirname "$0")/.." && pwd)"
tarball="/tmp/eagle3_jax-$(cd "$repo_root" && git rev-parse --short HEAD).tar.gz"
remote_dir='~/eagle3_jax'

run() {  # print, then run unless --dry-run
  printf '+'; printf ' %q' "$@"; printf '\n'
  if [[ $dry_run -eq 0 ]]; then "$@"; fi
}

# The environment: gcloud logged in, and the code the workers get (HEAD) is what is checked out.
if [[ $dry_run -eq 0 ]]; then
  command -v gcloud >/dev/null || { echo "error: gcloud is not installed (https://cloud.google.com/sdk/docs/install)" >&2; exit 2; }
  [[ -n "$(gcloud auth list --filter=status:ACTIVE --format='value(account)' 2>/dev/null)" ]] || \
    { echo "error: gcloud has no active account; run: gcloud auth login" >&2; exit 2; }
  if [[ -n "$(git -C "$repo_root" status --porcelain --untracked-files=no)" ]]; then
    echo "error: uncommitted changes in $repo_root: the workers get HEAD; commit them first" >&2; exit 2
  fi
fi

# 0. The plan: does the step fit one chip's HBM on this slice? (Refused before any spending.)
if [[ $plan -eq 1 ]]; then
  config="" plan_args=()
  for ((i = 0; i < ${#train_args[@]}; i++)); do
    arg="${train_args[$i]}"
    case "$arg" in
      --config) config="${train_args[$((i + 1))]}"; i=$((i + 1)) ;;
      --config=*) config="${arg#--config=}" ;;
      target=*|out_dir=*|train_data=*|eval_data=*|draft_vocab=*|init_head=*) ;;  # paths on the workers
      *=*) plan_args+=("$arg") ;;
    esac
  done
  if [[ -z "$config" ]]; then echo "error: the training arguments need --config (see --help)" >&2; exit 2; fi
  py="${PY:-$repo_root/.venv/bin/python}"; [[ -x "$py" ]] || py=python3
  set +e
  (cd "$repo_root" && "$py" -m eagle3_jax.plan --config "$config" --topology "$accelerator" "${plan_args[@]}")
  code=$?
  set -e
  if [[ $code -eq 1 ]]; then
    echo "error: the plan does not fit $accelerator: choose a larger slice, or lower batch_size / max_len (--skip-plan to launch anyway)" >&2
    exit 1
  elif [[ $code -ne 0 ]]; then
    echo "error: planning failed (exit $code); fix the arguments or pass --skip-plan" >&2
    exit 2
  fi
fi

# 1. The slice.
if [[ $dry_run -eq 0 ]] && "${gcloud_tpu[@]}" describe "$name" "${where[@]}" >/dev/null 2>&1; then
  echo "reusing TPU VM $name"
else
  [[ $dry_run -eq 1 ]] && echo "# (creates $name unless '${gcloud_tpu[*]} describe' finds it)"
  run "${gcloud_tpu[@]}" create "$name" "${where[@]}" --accelerator-type "$accelerator" \
      --version "$version" ${spot:+"$spot"}
fi

# 2. The code, on every worker.
run git -C "$repo_root" archive --format=tar.gz --prefix=eagle3_jax/ -o "$tarball" HEAD
run "${gcloud_tpu[@]}" scp "$tarball" "$name:/tmp/eagle3_jax.tar.gz" "${where[@]}" --worker=all
run "${gcloud_tpu[@]}" ssh "$name" "${where[@]}" --worker=all --command \
    "tar -xzf /tmp/eagle3_jax.tar.gz -C ~ && cd $remote_dir && (test -x .venv/bin/python || python3 -m venv .venv) && .venv/bin/pip install -q -e '.[tpu]'"

# 3. Training on all workers (or the --exec job on worker 0), each worker logging to its own file.
if [[ -n "$exec_cmd" ]]; then
  run "${gcloud_tpu[@]}" ssh "$name" "${where[@]}" --worker=0 --command \
      "cd $remote_dir && set -o pipefail && mkdir -p logs && PATH=\$PWD/.venv/bin:\$PATH bash -c $(printf '%q' "$exec_cmd") 2>&1 | tee -a logs/exec-\$(hostname).log"
else
  printf -v quoted ' %q' "${train_args[@]}"
  run "${gcloud_tpu[@]}" ssh "$name" "${where[@]}" --worker=all --command \
      "cd $remote_dir && set -o pipefail && mkdir -p logs && .venv/bin/python -m eagle3_jax.train --distributed auto$quoted 2>&1 | tee -a logs/train-\$(hostname).log"
fi
