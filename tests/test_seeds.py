"""One run seed (`experiment.seed`) changes every random choice of a run — initial weights,
partition, local test splits, participants — unless a binding fixes one on its own."""

import json
import os

import gin
import numpy as np
import pytest

from fltff.errors import ConfigError
from fltff.simulation import run_experiment
from helpers import REPO

BASE = f"""
federated_data.source = @npz_source
npz_source.path = '{os.path.join(REPO, 'fltff', 'data', 'samples', 'mnist_first1003.npz')}'
federated_data.partitioner = @dirichlet_partition
dirichlet_partition.alpha = 0.5
federated_data.num_clients = 4
federated_data.local_test_examples = 5
experiment.method = @fedavg
experiment.model = 'logistic'
experiment.rounds = 1
experiment.clients_per_round = 2
"""


def _run(tmp_path, name, *bindings):
  gin.clear_config()
  try:
    gin.parse_config(BASE + '\n'.join(bindings))
    out = str(tmp_path / name)
    run_experiment(output_dir=out, progress=lambda _: None)
  finally:
    gin.clear_config()
  with open(os.path.join(out, 'summary.json')) as f:
    summary = json.load(f)
  with open(os.path.join(out, 'partition.json')) as f:
    partition = json.load(f)
  weights = np.load(os.path.join(out, 'checkpoints', 'round_00001.npz'))
  return summary, partition, {k: weights[k] for k in weights.files}


def _same_arrays(a, b):
  return sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)


def test_the_run_seed_changes_everything_and_a_binding_fixes_its_part(tmp_path):
  s0, p0, w0 = _run(tmp_path, 's0', 'experiment.seed = 0')
  s1, p1, w1 = _run(tmp_path, 's1', 'experiment.seed = 1')
  assert s0['seeds'] == {'run': 0, 'model': 0, 'data': 0}
  assert s1['seeds'] == {'run': 1, 'model': 1, 'data': 1}
  assert p0 != p1  # Another Dirichlet draw.
  assert not _same_arrays(w0, w1)
  # Seed 1 with the model and the data seeds bound to 0: seed 0's partition, another round.
  s2, p2, _ = _run(tmp_path, 's2', 'experiment.seed = 1', 'experiment.model_seed = 0',
                   'federated_data.seed = 0')
  assert s2['seeds'] == {'run': 1, 'model': 0, 'data': 0}
  assert p2 == p0


@pytest.mark.parametrize('binding, fragment', [
    ('experiment.seed = -1', r'experiment.seed must be in \[0, 4294967295\]'),
    ('federated_data.seed = -3', r'federated_data.seed must be in \[0, 4294967295\]'),
    ("experiment.model_seed = 'a'", 'experiment.model_seed must be an integer'),
])
def test_bad_seeds_get_one_clear_error(tmp_path, binding, fragment):
  with pytest.raises(ConfigError, match=fragment):
    _run(tmp_path, 'bad', binding)


SYNTHETIC = """
federated_data.source = @synthetic_source
synthetic_source.alpha = 1.0
synthetic_source.beta = 1.0
synthetic_source.num_clients = 4
synthetic_source.max_samples = 60
federated_data.partitioner = @natural_partition
federated_data.num_clients = 4
experiment.channel = @channel_model
"""


def test_the_run_seed_draws_the_sources_data_and_the_channel_unless_bound(tmp_path):
  def run(name, *bindings):
    gin.clear_config()
    try:
      gin.parse_config(BASE + SYNTHETIC + '\n'.join(bindings))
      out = str(tmp_path / name)
      run_experiment(output_dir=out, progress=lambda _: None)
    finally:
      gin.clear_config()
    with open(os.path.join(out, 'summary.json')) as f:
      return json.load(f)['seeds'], json.load(open(os.path.join(out, 'partition.json')))

  seeds0, part0 = run('s0', 'experiment.seed = 0')
  seeds1, part1 = run('s1', 'experiment.seed = 1')
  assert seeds0 == {'run': 0, 'model': 0, 'data': 0, 'source': 0, 'channel': 0}
  assert seeds1 == {'run': 1, 'model': 1, 'data': 1, 'source': 1, 'channel': 1}
  assert part0 != part1  # Other clients' data drawn.
  seeds2, part2 = run('s2', 'experiment.seed = 1', 'synthetic_source.seed = 0',
                      'channel_model.seed = 0')
  assert seeds2 == {'run': 1, 'model': 1, 'data': 1, 'source': 0, 'channel': 0}
  assert part2['train_sizes'] == part0['train_sizes']  # Seed 0's data, again.
