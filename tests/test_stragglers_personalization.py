"""Stragglers (system heterogeneity) and FedLap personalisation, unit and end to end."""

import json
import os

import numpy as np
import pytest

from fltff.errors import ConfigError
from fltff.personalization import mix_layers
from fltff.personalization import mixing_coefficients
from fltff.personalization import layer_dissimilarities
from fltff.simulation import sampling
from helpers import read_csv
from helpers import run_and_resume
from helpers import run_pipeline_here

BASE = ['--gin_file=gin_configs/fedlap/offline_mnist1003_fedlap.gin',
        '--gin_bindings=experiment.rounds = 3', '--gin_bindings=experiment.local_epochs = 3',
        '--gin_bindings=experiment.checkpoint_every = 1']


# --- straggler plan -------------------------------------------------------------------------
def test_straggler_plan_partial_is_seeded_and_in_range():
  clients = np.arange(20)
  epochs, dropped = sampling.straggler_plan(clients, 10, 0.5, 'partial', seed=3, round_num=7)
  again, _ = sampling.straggler_plan(clients, 10, 0.5, 'partial', seed=3, round_num=7)
  assert epochs == again and not dropped
  reduced = [k for k, e in epochs.items() if e < 10]
  assert 1 <= len(reduced) <= 10 and all(1 <= e <= 10 for e in epochs.values())
  other, _ = sampling.straggler_plan(clients, 10, 0.5, 'partial', seed=3, round_num=8)
  assert other != epochs
  assert sampling.straggler_plan(clients, 10, 0.0, 'partial', 3, 7) == (
      {k: 10 for k in range(20)}, set())


def test_straggler_plan_drop_keeps_one_participant():
  epochs, dropped = sampling.straggler_plan(np.arange(10), 5, 0.9, 'drop', 0, 1)
  assert len(dropped) == 9 and set(epochs.values()) == {5}
  _, dropped = sampling.straggler_plan(np.arange(2), 5, 1.0, 'drop', 0, 1)
  assert len(dropped) == 1


@pytest.mark.parametrize('fraction,mode', [(-0.1, 'partial'), (1.5, 'drop'), (0.5, 'slow')])
def test_straggler_plan_rejects_bad_settings(fraction, mode):
  with pytest.raises(ConfigError):
    sampling.straggler_plan(np.arange(3), 2, fraction, mode, 0, 1)


# --- personalisation mixing ----------------------------------------------------------------
def test_mixing_fixed_and_by_dissimilarity():
  rng = np.random.default_rng(0)
  glob = [rng.normal(size=(4, 3)).astype(np.float32), rng.normal(size=3).astype(np.float32),
          rng.normal(size=(3, 2)).astype(np.float32), rng.normal(size=2).astype(np.float32)]
  local = [glob[0] + 1.0, glob[1], -glob[2], glob[3] * 2]
  layers = [[0, 1], [2, 3]]
  d = layer_dissimilarities(local, glob, layers)
  rows = lambda w: w.reshape(1, -1) if w.ndim == 1 else w
  for l, group in enumerate(layers):
    lam = np.concatenate([1 - (rows(local[i]) * rows(glob[i])).sum(1) /
                          (np.linalg.norm(rows(local[i]), axis=1) *
                           np.linalg.norm(rows(glob[i]), axis=1)) for i in group])
    assert d[l] == pytest.approx(lam.mean() / 2, abs=1e-5)
  assert d[1] > d[0]  # The negated layer is the dissimilar one.
  np.testing.assert_allclose(mixing_coefficients(d, 0.4, 'fixed'), [0.4, 0.4])
  betas = mixing_coefficients(d, 0.4, 'dissimilarity')
  np.testing.assert_allclose(betas, np.clip(0.4 * d / d.mean(), 0, 1))
  assert betas[1] > betas[0]
  mixed = mix_layers(local, glob, layers, betas)
  for l, group in enumerate(layers):
    for i in group:
      np.testing.assert_allclose(mixed[i], betas[l] * local[i] + (1 - betas[l]) * glob[i],
                                 rtol=1e-6)


# --- end to end ---------------------------------------------------------------------------
@pytest.fixture(scope='module')
def straggler_run(tmp_path_factory):
  out = str(tmp_path_factory.mktemp('stragglers'))
  result = run_pipeline_here(*BASE, '--gin_bindings=experiment.straggler_fraction = 0.5',
                        f'--output_dir={out}')
  assert result.returncode == 0, result.stderr[-3000:]
  return out


def test_partial_stragglers_process_their_epochs(straggler_run):
  """Examples per round = Σ_k epochs_k · n_k for the seeded participants and straggler plan."""
  partition = json.load(open(os.path.join(straggler_run, 'partition.json')))
  sizes = partition['train_sizes']
  config = open(os.path.join(straggler_run, 'config.gin')).read()
  assert 'experiment.straggler_fraction = 0.5' in config
  rows = read_csv(os.path.join(straggler_run, 'metrics.csv'))
  saw_stragglers = False
  for row in rows:
    r = int(row['round'])
    clients = sampling.sample_clients(len(sizes), int(row['clients']), 0, r)
    epochs, _ = sampling.straggler_plan(clients, 3, 0.5, 'partial', 0, r)
    assert int(row['examples']) == sum(epochs[int(k)] * sizes[int(k)] for k in clients)
    assert int(row['stragglers']) == sum(1 for e in epochs.values() if e < 3)
    saw_stragglers |= int(row['stragglers']) > 0
  assert saw_stragglers


def test_dropped_stragglers_leave_the_round(tmp_path):
  result = run_pipeline_here(*BASE, '--gin_bindings=experiment.straggler_fraction = 0.5',
                        "--gin_bindings=experiment.straggler_mode = 'drop'",
                        '--gin_bindings=experiment.rounds = 2', f'--output_dir={tmp_path}')
  assert result.returncode == 0, result.stderr[-3000:]
  for row in read_csv(os.path.join(tmp_path, 'metrics.csv')):
    assert int(row['dropped']) > 0
    assert int(row['clients']) + int(row['dropped']) == 5


def test_personalization_reports_and_resumes_exactly(tmp_path):
  args = ['--gin_file=gin_configs/fedlap/offline_mnist1003_fedlap_personalized.gin',
          '--gin_bindings=experiment.local_epochs = 2',
          '--gin_bindings=experiment.checkpoint_every = 1']
  # Local models live in the checkpoint: resumed after round 2, the same metrics.
  rows, resumed, stdout = run_and_resume(
      [*args, '--gin_bindings=experiment.rounds = 3'], tmp_path, stop_round=2)
  # The default executor vectorises the method's clients and the local models' training.
  assert 'runs on the in-process executor, vectorised clients.' in stdout
  for row in rows:
    assert 0.0 <= float(row['personalized_accuracy']) <= 1.0
    assert 0.0 <= float(row['global_model_local_accuracy']) <= 1.0
    assert 0.0 <= float(row['client_work/regularizer/lambda_mean/latent']) <= 2.0
  assert len(resumed) == len(rows) == 3
  for a, b in zip(resumed, rows):
    for key in ('test_accuracy', 'personalized_accuracy', 'global_model_local_accuracy',
                'train_loss'):
      assert float(a[key]) == pytest.approx(float(b[key]), rel=1e-5, abs=1e-6), key
