"""Test options, and the numerics the suite runs under.

On an accelerator two calls of the same computation (vmapped over clients, or one
client at a time) may pick different algorithms and reduction orders; XLA's
deterministic GPU ops and full-precision matmuls (no TF32) are set here, before jax
starts, so exactness claims mean the same on every backend (no effect on CPU).

On a machine without an accelerator plugin the suite also compiles with XLA:CPU's
compile-light options (``CPU_COMPILE_FLAGS``): its programs are tiny and compile-bound.
Backend (LLVM) optimisation off took one pipeline test from 228 s to 100 s; the legacy
elemental emitters and a single codegen unit on top of that took the whole suite from
1,219 s to 813 s on 2 cores, with the same results. A flag already in XLA_FLAGS is
left as you set it.

The suite's programs are also kept in a persistent compilation cache shared by the
xdist workers of one run (a fresh directory per run, removed at its end): tests that
build the same round from the same config shapes compile it once (measured on
test_experiment, test_vmap_seeds and test_sweep: 39 of 81 programs taking over a second
were cache hits, 63 s of 159 s of XLA compilation saved). Set
JAX_COMPILATION_CACHE_DIR to use a directory of your own instead.
"""
import importlib.util
import os
import shutil
import tempfile

ACCELERATOR_PLUGINS = ('jax_cuda12_plugin', 'jax_cuda13_plugin', 'jax_rocm60_plugin', 'libtpu')
# XLA:CPU options for compile-bound suites: no LLVM optimisation, the legacy elemental
# emitters instead of the MLIR fusion emitters, and one codegen unit instead of a split
# for parallel compilation (compiling one FedICON round: 3.8 s at level 0 alone, 1.7 s
# with all three).
CPU_COMPILE_FLAGS = {
    'xla_backend_optimization_level': 0,
    'xla_cpu_use_fusion_emitters': 'false',
    'xla_cpu_parallel_codegen_split_count': 1,
}


def _xla_flags() -> str:
  flags = os.environ.get('XLA_FLAGS', '') + ' --xla_gpu_deterministic_ops=true'
  on_cpu_only = not any(importlib.util.find_spec(name) for name in ACCELERATOR_PLUGINS)
  if on_cpu_only:
    for flag, value in CPU_COMPILE_FLAGS.items():
      if flag not in flags:
        flags += f' --{flag}={value}'
  return flags.strip()


os.environ['XLA_FLAGS'] = _xla_flags()

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update('jax_default_matmul_precision', 'highest')

# One cache directory per test run, named by the first process to load this file (the
# xdist controller, whose environment its workers inherit, or the only process).
OWN_CACHE = not os.environ.get('JAX_COMPILATION_CACHE_DIR')
RUN_CACHE = os.environ.setdefault('FEDJAX_SHIFT_TESTS_RUN_CACHE', os.path.join(
    tempfile.gettempdir(), f'fedjax_shift_tests_jax_cache_{os.getpid()}'))
if OWN_CACHE:
  jax.config.update('jax_compilation_cache_dir', RUN_CACHE)
  # every program, not only those over jax's default second of compilation: the suite
  # rebuilds many small identical scans (test_adapters, test_tta_baselines, test_engine:
  # 8-13 % less CPU time over four interleaved runs of each setting)
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)


def pytest_addoption(parser):
  parser.addoption('--runslow', action='store_true', default=False,
                   help='also run tests marked slow (full paper protocols, large runs)')


def pytest_collection_modifyitems(config, items):
  if config.getoption('--runslow'):
    return
  skip = pytest.mark.skip(reason='slow: run with --runslow')
  for item in items:
    if 'slow' in item.keywords:
      item.add_marker(skip)


def pytest_sessionfinish(session):
  """The run's cache directory is removed by the process that owns the run (the xdist
  controller, or the only process)."""
  if OWN_CACHE and not hasattr(session.config, 'workerinput'):
    shutil.rmtree(RUN_CACHE, ignore_errors=True)
