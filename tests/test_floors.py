"""The declared dependency floors hold: a fresh venv with exactly the lower bounds of
pyproject.toml's jax, jaxlib, flax, optax, orbax-checkpoint, chex, numpy and scipy runs
the tiny default experiment and the two determinism checks that older releases broke
(a SIGKILLed run resumes bit-identical; rounds_per_call > 1 gives the same rounds).
Slow: it installs from PyPI (a minute or two with a warm pip cache)."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PINNED = ('jax', 'flax', 'optax', 'orbax-checkpoint', 'chex', 'numpy', 'scipy')


def floors() -> dict:
  """{package: its declared lower bound} of ``PINNED`` (jaxlib: jax's)."""
  with open(os.path.join(ROOT, 'pyproject.toml')) as f:
    text = f.read()
  found = dict(re.findall(r'"([a-z-]+)>=([0-9.]+)"', text.split('[project.optional')[0]))
  out = {name: found[name] for name in PINNED}
  out['jaxlib'] = out['jax']
  return out


def test_the_floors_are_read_from_pyproject():
  assert floors()['jax'] == floors()['jaxlib'] and set(floors()) == set(PINNED) | {'jaxlib'}


@pytest.mark.slow
def test_the_declared_floors_run_the_tiny_experiment_and_resume_exactly(tmp_path):
  constraints = tmp_path / 'floors.txt'
  constraints.write_text(''.join(f'{name}=={version}\n' for name, version in floors().items()))
  venv = tmp_path / 'venv'
  python = str(venv / 'bin' / 'python')

  def run(*args, **kwargs):
    done = subprocess.run(list(args), capture_output=True, text=True, cwd=ROOT, **kwargs)
    assert done.returncode == 0, (args, done.stdout[-2000:], done.stderr[-3000:])
    return done
  run(sys.executable, '-m', 'venv', str(venv))
  run(python, '-m', 'pip', 'install', '-q', '-r', str(constraints), '-c', str(constraints))
  run(python, '-m', 'pip', 'install', '-q', '-e', '.[dev]', '-c', str(constraints))
  versions = run(python, '-c', 'import jax, flax, optax; print(jax.__version__, '
                 'flax.__version__, optax.__version__)').stdout.split()
  assert versions == [floors()[n] for n in ('jax', 'flax', 'optax')]
  run(python, 'launch/train.py', '--config=configs/default.py:tiny',
      f'--workdir={tmp_path / "tiny"}', '--compilation_cache=')
  run(python, '-m', 'pytest', '-q', '-p', 'no:cacheprovider',
      'tests/test_reliability.py::test_kill_corrupt_resume_matches_an_uninterrupted_run[4-9]',
      'tests/test_experiment.py::test_rounds_per_call_gives_the_same_rounds')
