"""The one run loop (pipelines/loop.py) with a toy trainer: runs in lockstep along a
leading run axis, per-run records, checkpoints and evaluation rounds, divergence of one
run while the others go on, and no training once every run has diverged."""
import os

import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_shift.checkpoint import Checkpointer
from fedjax_shift.metrics import MetricsWriter, read_metrics
from fedjax_shift.pipelines import loop


def toy_runs(tmp_path, count):
  runs = []
  for i in range(count):
    run_dir = str(tmp_path / f'run_{i}')
    os.makedirs(run_dir)
    runs.append(loop.Run(f'toy {i}', run_dir, Checkpointer(os.path.join(run_dir, 'ckpt'), 2, 5),
                         MetricsWriter(run_dir, None), 0, 0.0,
                         lambda state: {'model/test/accuracy': float(state[0])}))
  return runs


def toy_trainer(bad_round=None, bad_run=None, calls=None):
  """State [R] counters; round r adds r to each; run ``bad_run`` gets a NaN loss in
  ``bad_round``."""
  def advance(state, start, stop):
    calls.append((start, stop)) if calls is not None else None
    (counters,) = state
    rounds = np.arange(start + 1, stop + 1, dtype=np.float32)
    counters = counters + rounds.sum()
    loss = np.tile((1.0 / rounds)[:, None], (1, counters.shape[0]))
    if bad_round is not None and start < bad_round <= stop:
      loss[bad_round - start - 1, bad_run] = np.nan
    return (counters,), {'loss': loss, 'num_steps': np.ones_like(loss)}
  return loop.Trainer(advance, lambda state, i: (state[0][i], ()), rounds_per_call=1)


def test_runs_in_lockstep_write_their_own_records_and_checkpoints(tmp_path):
  runs = toy_runs(tmp_path, 2)
  outcomes = loop.train(runs, (jnp.zeros(2),), toy_trainer(),
                        loop.Cadence(rounds=5, eval_every=2, checkpoint_every=2, progress=False))
  for run, outcome in zip(runs, outcomes):
    # 1 + 2 + 3 + 4 + 5 = 15; the last evaluation is the final state's.
    assert outcome.summary == {'model/test/accuracy': 15.0} and outcome.diverged is None
    records = read_metrics(os.path.join(run.run_dir, 'metrics.jsonl'))
    assert [r['round'] for r in records] == [1, 2, 3, 4, 5]
    assert [r['loss'] for r in records] == pytest.approx([1, 1 / 2, 1 / 3, 1 / 4, 1 / 5])
    # Evaluated every 2 rounds and at the last: counters 3 (round 2), 10 (4), 15 (5).
    assert [r.get('model/test/accuracy') for r in records] == [None, 3.0, None, 10.0, 15.0]
    assert run.checkpointer.rounds() == (2, 4, 5)


def test_one_run_diverges_the_others_go_on_and_all_diverged_stops(tmp_path):
  runs = toy_runs(tmp_path, 2)
  outcomes = loop.train(runs, (jnp.zeros(2),), toy_trainer(bad_round=3, bad_run=1),
                        loop.Cadence(rounds=5, eval_every=5, checkpoint_every=2,
                                     keep_going=True, progress=False))
  assert outcomes[0].diverged is None and outcomes[0].summary['model/test/accuracy'] == 15.0
  assert 'toy 1: non-finite training loss (nan) in round 3; the last good checkpoint ' \
         '(round 2)' in str(outcomes[1].diverged)
  assert [r['round'] for r in read_metrics(os.path.join(runs[1].run_dir, 'metrics.jsonl'))] \
      == [1, 2]
  with pytest.raises(loop.DivergenceError, match='toy 1: non-finite'):
    loop.train(toy_runs(tmp_path / 'stop', 2), (jnp.zeros(2),),
               toy_trainer(bad_round=3, bad_run=1),
               loop.Cadence(rounds=5, eval_every=5, checkpoint_every=2, progress=False))
  calls = []
  single = toy_runs(tmp_path / 'single', 1)
  loop.train(single, (jnp.zeros(1),), toy_trainer(bad_round=2, bad_run=0, calls=calls),
             loop.Cadence(rounds=50, eval_every=5, checkpoint_every=2, keep_going=True,
                          progress=False))
  assert calls == [(0, 1), (1, 2)]   # nothing trained after its only run diverged


def test_runs_must_start_at_one_round(tmp_path):
  first, second = toy_runs(tmp_path, 2)
  with pytest.raises(ValueError, match='must start at one round'):
    loop.train([first, second._replace(start_round=1)], (jnp.zeros(2),), toy_trainer(),
               loop.Cadence(3, 1, 1, progress=False))


def test_call_end_stops_at_evaluation_and_last_rounds():
  assert loop.call_end(0, 10, 1, 5) == 1
  assert [loop.call_end(s, 10, 4, 5) for s in (0, 4, 5, 8)] == [4, 5, 8, 10]
