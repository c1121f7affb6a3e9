"""Test options, and the numerics the suite runs under.

On an accelerator two calls of the same computation (vmapped over clients, or one
client at a time) may pick different algorithms and reduction orders; XLA's
deterministic GPU ops and full-precision matmuls (no TF32) are set here, before jax
starts, so exactness claims mean the same on every backend (no effect on CPU).
"""
import os

os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                           ' --xla_gpu_deterministic_ops=true').strip()

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
