"""Test options, and the numerics the suite runs under.

On an accelerator two calls of the same computation (vmapped over clients, or one
client at a time) may pick different algorithms and reduction orders; XLA's
deterministic GPU ops and full-precision matmuls (no TF32) are set here, before jax
starts, so exactness claims mean the same on every backend (no effect on CPU).

On a machine without an accelerator plugin the suite also turns XLA's backend (LLVM)
optimisation off: its programs are tiny and compile-bound, and XLA:CPU's optimising
passes took most of their time (one pipeline test: 228 s at the default level, 100 s
at level 0, same results). Set ``--xla_backend_optimization_level`` in XLA_FLAGS
yourself to choose another level.
"""
import importlib.util
import os

ACCELERATOR_PLUGINS = ('jax_cuda12_plugin', 'jax_cuda13_plugin', 'jax_rocm60_plugin', 'libtpu')


def _xla_flags() -> str:
  flags = os.environ.get('XLA_FLAGS', '') + ' --xla_gpu_deterministic_ops=true'
  on_cpu_only = not any(importlib.util.find_spec(name) for name in ACCELERATOR_PLUGINS)
  if on_cpu_only and 'xla_backend_optimization_level' not in flags:
    flags += ' --xla_backend_optimization_level=0'
  return flags.strip()


os.environ['XLA_FLAGS'] = _xla_flags()

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update('jax_default_matmul_precision', 'highest')


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
