#!/usr/bin/env bash
# Runs a grid of configs/fedevolve.py variants × algorithms as parallel
# launch/train.py processes sharing one accelerator (each allocates GPU memory on
# demand), then prints the paper-layout table of each finished variant.
#
#   fedjax_shift/papers/fedevolve/sweep.sh OUTDIR "rmnist_dirinf rmnist_dir1.0 rmnist_dir0.1" \
#       "fedavg fedevolve fedevp" [--config.seeds='(0,1,2)' ...]
#
# Results: OUTDIR/<variant>/<algorithm>/seed_<s>/results.json, logs in
# OUTDIR/logs/<variant>.<algorithm>.log. Re-running resumes from the checkpoints.
# MAX_PARALLEL (default: number of CPU cores) bounds the processes at once;
# RUN_TIMEOUT (seconds, default none) stops each process after that long.
set -u
out=$1; variants=$2; algorithms=$3; shift 3
here=$(cd "$(dirname "$0")/../../.." && pwd)
mkdir -p "$out/logs"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$out/jax_cache}
max=${MAX_PARALLEL:-$(nproc)}
for variant in $variants; do
  for algorithm in $algorithms; do
    while [ "$(jobs -rp | wc -l)" -ge "$max" ]; do sleep 1; done
    ${RUN_TIMEOUT:+timeout $RUN_TIMEOUT} python "$here/launch/train.py" --config="$here/configs/fedevolve.py:$variant" \
      --workdir="$out/${variant//,/_}" --config.algorithms="('$algorithm',)" "$@" \
      > "$out/logs/$variant.$algorithm.log" 2>&1 &
  done
done
wait
for variant in $variants; do
  echo "== $variant"
  python "$here/launch/report.py" --kind=fedevolve --workdirs="$out/${variant//,/_}" \
    --labels="${variant//,/+}" 2>&1 | tail -n 20
done
