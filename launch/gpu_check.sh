#!/usr/bin/env bash
# Accelerator checks for anyone with a CUDA machine: the test suite, the cohort sweep of
# the compiled round against PyTorch peers, and the paper-model tables, as stages that
# each take under 10 minutes.
#
#   launch/gpu_check.sh wheels [OUTDIR]     where PyPI is reachable: the packages a bare
#                                           CUDA image with jax, flax, optax, orbax, chex,
#                                           torch and pytest-xdist lacks, as cp312 wheels
#                                           in .whl/ (git-ignored), for a machine offline
#   launch/gpu_check.sh suite OUTDIR        on the GPU: the whole test suite, pytest -n 8
#   launch/gpu_check.sh bench OUTDIR        on the GPU: the ATP-CNN cohort sweep 60/240/1000
#                                           × lax/patches with (c) and (e), each (a) traced
#                                           (its device kernels listed by time)
#   launch/gpu_check.sh engine OUTDIR       on the GPU: (d), the papers' loop, at 60/240; the
#                                           round with deterministic ops; the rounds_per_call
#                                           and vmap_seeds cases; the population to 100,000
#                                           clients at cohort 1,000 (host store)
#   launch/gpu_check.sh atp OUTDIR [--config.X=..]
#                                           on the GPU: configs/atp.py:digits,cnn (extra
#                                           arguments go to train.py, e.g. one seed at a time
#                                           with --config.seeds='(0,)')
#   launch/gpu_check.sh fmnist_data         here: Debian's Fashion-MNIST (apt-get install
#                                           dataset-fashion-mnist) copied to .data/ (git-
#                                           ignored, 30 MB) to carry to a machine without it
#   launch/gpu_check.sh fmnist OUTDIR [--config.X=..]
#                                           on the GPU: FedTTA Table 1's Fashion-MNIST column
#                                           (configs/fedtta.py:fashion_mnist: LeNet, 300
#                                           rounds, seeds 0-2 in lockstep), rows FedAvg,
#                                           FedTTA, FedTTA-Prox, FedTTA++ and TENT, and the
#                                           table with the paper's numbers (workdirs
#                                           /tmp/gpu_fmnist*); a CPU dry run: FMNIST_SEEDS='(0,)'
#                                           launch/gpu_check.sh fmnist /tmp/x --config.rounds=2
#                                           --config.data.num_clients=12 --config.cohort_size=6
#                                           --config.data.max_examples=8400
#                                           --config.engine.vmap_seeds=False (CPU: loop backend)
#   launch/gpu_check.sh fedevolve OUTDIR [--config.X=..]
#                                           on the GPU: FedEvolve Table 1's RMNIST grid with
#                                           the paper's CNN (3 Dirichlet levels × 3 methods)
#
# Logs and tables land in OUTDIR (default /tmp/gpu_check), at most 8 files, flat.
# STAGE_TIMEOUT (seconds, default 560) bounds each stage; SUITE_WORKERS (default 8) sets
# the suite's pytest-xdist workers, whose log names every test as it finishes, so a
# stage stopped by its timeout still says what passed and failed. BENCH_CLIENTS and
# TORCH_LOOP_CLIENTS shrink the bench and engine stages (e.g. =2 for a dry run on a CPU).
set -uo pipefail
stage=${1:?usage: launch/gpu_check.sh wheels|fmnist_data|suite|bench|engine|atp|fmnist|fedevolve [OUTDIR]}
outdir=${2:-/tmp/gpu_check}
extra=("${@:3}")   # train.py overrides for the atp and fedevolve stages
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here" || exit 1
mkdir -p "$outdir"
limit=${STAGE_TIMEOUT:-560}
BENCH_CLIENTS=${BENCH_CLIENTS:-60,240,1000}        # cohort sizes of the sweep
TORCH_LOOP_CLIENTS=${TORCH_LOOP_CLIENTS:-60,240}   # (d), the papers' loop: slow at 1,000

# Packages of pyproject.toml (and their needs) that such an image does not hold, at the
# versions pip resolved for `pip install -e '.[dev]'` on 2026-11-24, for Python 3.12.
WHEELS="ml-collections==1.1.0 mlxtend==0.25.0 tensorflow-datasets==4.9.10 array-record==0.8.6
dm-tree==0.1.10 immutabledict==4.3.1 simple-parsing==0.1.9 docstring-parser==0.18.0
tensorflow-metadata==1.21.0 termcolor==3.3.0 toml==0.10.2 googleapis-common-protos==1.76.0"

case $stage in
  wheels|fmnist_data|suite|bench|engine|atp|fmnist|fedevolve) ;;
  *) echo "unknown stage '$stage': wheels | fmnist_data | suite | bench | engine | atp |" \
          "fmnist | fedevolve" >&2
     exit 2 ;;
esac

if [ "$stage" = wheels ]; then
  mkdir -p .whl
  # shellcheck disable=SC2086
  python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 --platform any -d .whl $WHEELS || exit
  # tensorflow-datasets imports promise, which PyPI has as a source archive only: build
  # its pure-Python wheel here.
  python3 -m pip wheel --quiet --no-deps -w .whl promise==2.3 || exit
  ls -l .whl
  du -sh .whl
  exit 0
fi

FMNIST_DEBIAN=/usr/share/datasets/fashion-mnist
if [ "$stage" = fmnist_data ]; then
  [ -d "$FMNIST_DEBIAN" ] || { echo "no $FMNIST_DEBIAN: apt-get install dataset-fashion-mnist" >&2; exit 1; }
  mkdir -p .data/fashion-mnist && cp "$FMNIST_DEBIAN"/*-ubyte.gz .data/fashion-mnist/ || exit
  du -sh .data/fashion-mnist
  exit 0
fi

# On the GPU machine: the carried wheels, then one line of what this machine is.
if ! python3 -c 'import ml_collections, mlxtend, tensorflow_datasets' 2>/dev/null; then
  [ -d .whl ] || { echo "no .whl/: run 'launch/gpu_check.sh wheels' here and carry .whl" >&2; exit 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit
  export PYTHONPATH=/tmp/site:$here
else
  export PYTHONPATH=$here${PYTHONPATH:+:$PYTHONPATH}
fi
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jax_cache}
python3 -c 'import jax, torch; print("jax", jax.__version__, jax.devices(), "torch",
torch.__version__, torch.cuda.is_available())' 2>&1 | tee "$outdir/machine.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
  >> "$outdir/machine.txt" 2>&1

case $stage in
  suite)
    # The conftest turns on XLA's deterministic GPU ops and highest matmul precision.
    timeout "$limit" python3 -m pytest -v --tb=short -rfE -n "${SUITE_WORKERS:-8}" \
      -p no:cacheprovider --durations=15 \
      2>&1 | tee "$outdir/suite.log" | tail -n 60
    ;;
  bench)
    timeout "$limit" python3 launch/benchmark.py --model=atp_cnn --clients="$BENCH_CLIENTS" \
      --conv=lax,patches --cases=round,fused,torch_vmap --populations= --repeats=3 \
      --trace=/tmp/gpu_trace --out="$outdir/bench_sweep.md" > "$outdir/bench_sweep.log" 2>&1
    tail -n 12 "$outdir/bench_sweep.md"
    ;;
  engine)
    timeout 120 python3 launch/benchmark.py --model=atp_cnn --clients="$TORCH_LOOP_CLIENTS" \
      --cases=torch --populations= --repeats=3 --out="$outdir/bench_torch_loop.md" \
      >> "$outdir/engine.log" 2>&1
    tail -n 6 "$outdir/bench_torch_loop.md"
    # What XLA's deterministic GPU ops (config.engine.deterministic) cost on the round.
    XLA_FLAGS=--xla_gpu_deterministic_ops=true timeout 80 python3 launch/benchmark.py \
      --model=atp_cnn --clients="${BENCH_CLIENTS##*,}" --conv=patches --cases=round \
      --populations= --repeats=3 --out="$outdir/bench_deterministic.md" \
      >> "$outdir/engine.log" 2>&1
    tail -n 3 "$outdir/bench_deterministic.md"
    timeout 120 python3 launch/benchmark.py --model=mlp --clients=60 \
      --cases=rounds_calls,rounds_scan,seeds_vmap,seeds_loop --populations= \
      --out="$outdir/bench_engine.md" >> "$outdir/engine.log" 2>&1
    tail -n 8 "$outdir/bench_engine.md"
    # A hyperparameter sweep as one program (target: the grid in <= 3x one run).
    timeout 150 python3 launch/benchmark.py --model=mlp --clients=20 --examples=200 \
      --batch_size=32 --cases=round,grid_vmap,grid_loop --populations= --repeats=3 \
      --out="$outdir/bench_grid.md" >> "$outdir/engine.log" 2>&1
    tail -n 6 "$outdir/bench_grid.md"
    timeout 400 python3 launch/benchmark.py --model=mlp --clients="${POPULATION_COHORT:-1000}" \
      --cases=round --populations="${POPULATIONS:-1000,10000,100000}" --placements=host,device \
      --out="$outdir/bench_population.md" >> "$outdir/engine.log" 2>&1
    tail -n 9 "$outdir/bench_population.md"
    # FedEvolve's round against FedAvg's on its Table 7 network.
    timeout 150 python3 launch/benchmark.py --model=domainbed64 --clients=20 --examples=200 \
      --batch_size=32 --cases=round,fedevolve --populations= --repeats=3 \
      --out="$outdir/bench_fedevolve.md" >> "$outdir/engine.log" 2>&1
    tail -n 4 "$outdir/bench_fedevolve.md"
    ;;
  atp)
    timeout "$limit" python3 launch/train.py --config=configs/atp.py:digits,cnn \
      --workdir=/tmp/gpu_atp --compilation_cache="$JAX_COMPILATION_CACHE_DIR" \
      "${extra[@]}" > "$outdir/atp.log" 2>&1
    cp /tmp/gpu_atp/results.md "$outdir/atp_results.md" && cat "$outdir/atp_results.md"
    ;;
  fmnist)
    # The Debian package where the machine has it, else the folder fmnist_data made.
    data=$FMNIST_DEBIAN
    [ -d "$data" ] || data=$here/.data/fashion-mnist
    common=(--config.data.data_dir="$data" --config.seeds="${FMNIST_SEEDS:-(0,1,2)}"
            --config.engine.vmap_seeds=True
            --compilation_cache="$JAX_COMPILATION_CACHE_DIR")
    start=$(date +%s)
    timeout "$((limit * 3 / 4))" python3 launch/train.py --config=configs/fedtta.py:fashion_mnist \
      --workdir=/tmp/gpu_fmnist --config.algorithms="('fedavg','fedtta','fedtta_prox')" \
      "${common[@]}" "${extra[@]}" > "$outdir/fmnist.log" 2>&1
    left=$((limit - $(date +%s) + start))
    timeout "$((left > 30 ? left : 30))" python3 launch/train.py \
      --config=configs/fedtta.py:fashion_mnist,tent --workdir=/tmp/gpu_fmnist_tent \
      "${common[@]}" "${extra[@]}" > "$outdir/fmnist_tent.log" 2>&1
    python3 launch/report.py --kind=fedtta --workdirs=/tmp/gpu_fmnist,/tmp/gpu_fmnist_tent \
      > "$outdir/fmnist_table.md" 2>> "$outdir/fmnist.log"
    tail -n 40 "$outdir/fmnist_table.md"
    ;;
  fedevolve)
    MAX_PARALLEL=${MAX_PARALLEL:-9} RUN_TIMEOUT=$((limit - 40)) \
      bash fedjax_shift/papers/fedevolve/sweep.sh /tmp/gpu_fedevolve \
      "rmnist_dirinf rmnist_dir1.0 rmnist_dir0.1" "fedavg fedevolve fedevp" "${extra[@]}" \
      > "$outdir/fedevolve.log" 2>&1
    tail -n 80 "$outdir/fedevolve.log"
    ;;
esac
