#!/usr/bin/env bash
# Runs configs/fedevolve.py variants as parallel launch/train.py processes sharing one
# accelerator (each allocates GPU memory on demand), one process per variant training
# the given algorithms in turn, then prints the paper-layout table of each variant.
#
#   fedjax_shift/papers/fedevolve/sweep.sh OUTDIR "rmnist_dirinf rmnist_dir1.0 rmnist_dir0.1" \
#       "fedavg fedevolve fedevp" [--config.seeds='(0,1,2)' ...]
#
# Results: OUTDIR/<variant, commas as underscores>/<algorithm>/seed_<s>/results.json, logs
# in OUTDIR/logs/<variant>.log. A workdir takes one process at a time, so the variants
# run side by side and each variant's algorithms one after another. Re-running resumes
# from the checkpoints. MAX_PARALLEL (default: number of CPU cores) bounds the processes
# at once; RUN_TIMEOUT (seconds, default none) stops each process after that long.
# Exits non-zero, naming the variant and its log, when any process failed.
set -u
out=$1; variants=$2; algorithms=$3; shift 3
here=$(cd "$(dirname "$0")/../../.." && pwd)
mkdir -p "$out/logs"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$out/jax_cache}
max=${MAX_PARALLEL:-$(nproc)}
names=""
for algorithm in $algorithms; do names="$names'$algorithm',"; done
pids=(); started=()
for variant in $variants; do
  while [ "$(jobs -rp | wc -l)" -ge "$max" ]; do sleep 1; done
  ${RUN_TIMEOUT:+timeout $RUN_TIMEOUT} python "$here/launch/train.py" \
    --config="$here/configs/fedevolve.py:$variant" --workdir="$out/${variant//,/_}" \
    --config.algorithms="($names)" "$@" > "$out/logs/$variant.log" 2>&1 &
  pids+=($!); started+=("$variant")
done
failed=0
for i in "${!pids[@]}"; do
  if ! wait "${pids[$i]}"; then
    echo "FAILED: ${started[$i]} (log: $out/logs/${started[$i]}.log)" >&2
    tail -n 5 "$out/logs/${started[$i]}.log" >&2
    failed=1
  fi
done
for variant in $variants; do
  echo "== $variant"
  python "$here/launch/report.py" --kind=fedevolve --workdirs="$out/${variant//,/_}" \
    --labels="${variant//,/+}" 2>&1 | tail -n 20
done
exit $failed
