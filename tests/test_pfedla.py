"""pFedLA: hypernetwork equations vs NumPy, the update vs finite differences, special cases, a run."""

import collections
import json
import os

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from fltff import learning
from fltff.errors import ConfigError
from helpers import run_and_resume
from test_kapc import SPEC
from test_kapc import Sim
from test_kapc import _datasets
from test_kapc import _sgd

from fltff.personalization import pfedla as pfedla_lib
from fltff.personalization import process as process_lib
from fltff.personalization.bls import BidirectionalSelection
LAYER_OF = [0, 0, 1, 1]


def _params(n=3, layers=2, d=4, h=5, seed=1):
  params = pfedla_lib.initial_hypernetworks(n, layers, d, h, seed=seed)
  rng = np.random.default_rng(seed)
  # Larger head weights than the near-uniform initialisation, so the test exercises the MLP.
  params['head'] = tf.constant(rng.normal(scale=0.5, size=params['head'].shape), tf.float32)
  return collections.OrderedDict((k, np.asarray(v, np.float64)) for k, v in params.items())


def _np_outputs(p, layers):
  relu = lambda x: np.maximum(x, 0)
  h = relu(np.einsum('pd,pdh->ph', p['embedding'], p['w1']) + p['b1'])
  h = relu(np.einsum('pd,pdh->ph', h, p['w2']) + p['b2'])
  out = relu(np.einsum('ph,pho->po', h, p['head']) + p['head_bias'])
  return out.reshape(out.shape[0], layers, -1)


def _np_weights(p, clients, layers):
  raw = _np_outputs(p, layers)[:, :, clients]
  total = raw.sum(-1, keepdims=True)
  return np.where(total > 0, raw / np.where(total > 0, total, 1), 1.0 / len(clients))


def _tf(params):
  return collections.OrderedDict((k, tf.constant(v, tf.float32)) for k, v in params.items())


def test_initialisation_gives_near_uniform_weights():
  params = pfedla_lib.initial_hypernetworks(10, 3, 100, 100, seed=0)
  alpha = pfedla_lib.layer_weights(params, tf.range(10), 3).numpy()
  assert alpha.shape == (10, 3, 10)
  np.testing.assert_allclose(alpha.sum(-1), 1.0, atol=1e-5)
  np.testing.assert_allclose(alpha, 0.1, atol=0.02)


def test_layer_weights_match_numpy_and_are_restricted_to_participants():
  params = _params()
  clients = np.array([2, 0], np.int32)
  rows = collections.OrderedDict((k, v[clients]) for k, v in params.items())
  got = pfedla_lib.layer_weights(_tf(rows), tf.constant(clients), 2).numpy()
  np.testing.assert_allclose(got, _np_weights(rows, clients, 2), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(got.sum(-1), 1.0, atol=1e-5)


def test_hypernetwork_step_matches_finite_differences():
  """φ⁺ − φ = η ∂/∂φ Σ_i ⟨θ̄_i(φ), Δθ_i⟩ (pFedLA eq. (7)), the gradient by central differences
  on a NumPy forward pass in float64."""
  rng = np.random.default_rng(3)
  params, clients, lr = _params(), np.array([0, 1, 2], np.int32), 0.01
  shapes = [np.shape(w) for w in SPEC.initial_weights().trainable]
  models = [rng.normal(size=(3, *s)) for s in shapes]
  deltas = [rng.normal(size=(3, *s)) for s in shapes]

  def objective(p):
    alpha = _np_weights(p, clients, 2)
    return sum(np.sum(np.einsum('pq,q...->p...', alpha[:, l], w) * d)
               for w, d, l in zip(models, deltas, LAYER_OF))

  new = pfedla_lib.update_hypernetworks(
      _tf(params), tf.constant(clients), [tf.constant(m, tf.float32) for m in models],
      [tf.constant(d, tf.float32) for d in deltas], LAYER_OF, 2, lr)
  eps = 1e-4
  for name in ('embedding', 'w1', 'head', 'head_bias'):
    for index in [tuple(rng.integers(0, n) for n in params[name].shape) for _ in range(4)]:
      up, down = ({k: v.copy() for k, v in params.items()} for _ in range(2))
      up[name][index] += eps
      down[name][index] -= eps
      numeric = (objective(up) - objective(down)) / (2 * eps)
      step = (np.asarray(new[name])[index] - params[name][index]) / lr
      assert step == pytest.approx(numeric, rel=1e-3, abs=1e-4), (name, index)


def test_uniform_weights_without_learning_equal_fedavg():
  """α ≡ 1/N (head weights 0, η_hn = 0), equal client sizes, all clients: each client starts
  from the plain mean of the stored models — FedAvg's global model."""
  algorithm = pfedla_lib.build_pfedla(SPEC, 3, client_optimizer=_sgd(), embedding_dim=4,
                                hidden_dim=5, learning_rate=0.0)
  sim = Sim(algorithm, 3)
  sim.state['hypernetwork']['head'] = np.zeros_like(sim.state['hypernetwork']['head'])
  avg = learning.build_fedavg(SPEC, client_optimizer=_sgd())
  state = avg.process.set_model_weights(avg.process.initialize(), SPEC.initial_weights())
  for r in range(2):
    sim.round([0, 1, 2], _datasets((8, 8, 8), seed=r))
    state = avg.process.next(state, [learning.client_input(d, k, 1) for k, d in
                                     enumerate(_datasets((8, 8, 8), seed=r))]).state
  mean = [np.mean([sim.copies(k)[t] for k in range(3)], axis=0) for t in range(4)]
  for a, b in zip(avg.process.get_model_weights(state).trainable, mean):
    np.testing.assert_allclose(a, b, atol=1e-5)


def test_hypernetworks_learn_only_for_participants():
  algorithm = pfedla_lib.build_pfedla(SPEC, 4, client_optimizer=_sgd(), embedding_dim=4,
                                hidden_dim=5, learning_rate=0.5)
  sim = Sim(algorithm, 4)
  # Round 1: every stored model is the initial one, so θ̄ does not depend on α (Σ_j α_ij = 1):
  # no hypernetwork moves.
  initial = {k: np.asarray(v).copy() for k, v in sim.state['hypernetwork'].items()}
  sim.round([0, 1, 2, 3], _datasets((8, 8, 8, 8), seed=0))
  for name, value in initial.items():
    np.testing.assert_allclose(np.asarray(sim.state['hypernetwork'][name]), value, atol=1e-7)
  before = {k: np.asarray(v).copy() for k, v in sim.state['hypernetwork'].items()}
  relation_before = np.asarray(sim.state['relation']).copy()
  out = sim.round([1, 3], _datasets((8, 8), seed=1))
  after = sim.state['hypernetwork']
  for name in ('embedding', 'head', 'head_bias'):
    np.testing.assert_array_equal(np.asarray(after[name])[[0, 2]], before[name][[0, 2]])
    assert np.abs(np.asarray(after[name])[[1, 3]] - before[name][[1, 3]]).max() > 1e-6
  relation = np.asarray(sim.state['relation'])
  np.testing.assert_allclose(relation.sum(-1), 1.0, atol=1e-5)
  np.testing.assert_array_equal(relation[[0, 2]], relation_before[[0, 2]])
  # The participants started from θ̄ built with their α: bytes are the whole model both ways.
  full = sum(algorithm.parts.layer_sizes_bytes)
  np.testing.assert_allclose(out.result['bytes_down'], [full, full])
  np.testing.assert_allclose(out.result['bytes_up'], [full, full])


@pytest.mark.parametrize('start_from,selection', [('own', process_lib.ALL_LAYERS),
                                                    ('server', BidirectionalSelection(0.5))])
def test_hypernetwork_rule_rejects_other_starts(start_from, selection):
  rule = pfedla_lib.HypernetworkRelation(start_from=start_from, layer_selection=selection)
  with pytest.raises(ConfigError, match="hypernetwork rule needs start_from='server'"):
    process_lib.build_personalized_process(SPEC, 3, _sgd(), rule)


def test_pfedla_compiles_to_mergeable_form():
  algorithm = pfedla_lib.build_pfedla(SPEC, 4, client_optimizer=_sgd(), embedding_dim=4,
                                hidden_dim=5)
  form = tff.backends.native.compile_to_mergeable_comp_form(algorithm.process.next)
  assert isinstance(form, tff.framework.MergeableCompForm)


def test_pfedla_pipeline_and_resume(tmp_path):
  args = ['--gin_file=gin_configs/kapc/offline_mnist1003_pfedla.gin',
          '--gin_bindings=experiment.rounds = 3',
          '--gin_bindings=experiment.local_epochs = 1',
          '--gin_bindings=experiment.clients_per_round = 4',
          '--gin_bindings=experiment.checkpoint_every = 1']
  rows, resumed, _ = run_and_resume(args, tmp_path, stop_round=2)
  full = tmp_path / 'full'
  assert [int(r['round']) for r in rows] == [1, 2, 3]
  assert all(float(r['personal_local_accuracy']) > 0.2 for r in rows)
  with open(os.path.join(full, 'summary.json')) as f:
    summary = json.load(f)
  assert summary['best_personal_local_accuracy'] > 0.2
  # Server memory: R, the ten hypernetworks (d = h = 100, L = 2 heads of N = 10 outputs) and
  # one mlp2 copy per client, float32.
  hypernetworks = 10 * (100 + 100 * 100 + 100 + 100 * 100 + 100 + 100 * 20 + 20)
  assert summary['server_memory_mb'] == pytest.approx(
      4 * (10 * 2 * 10 + hypernetworks + 10 * 159010) / 1e6)
  relation = np.load(full / 'relationship.npy')
  np.testing.assert_allclose(relation.sum(-1), 1.0, atol=1e-5)
  assert [r['round'] for r in resumed] == [r['round'] for r in rows]
  for a, b in zip(resumed, rows):
    assert abs(float(a['personal_local_accuracy']) - float(b['personal_local_accuracy'])) < 1e-6


def test_hypernetwork_initialisation_follows_the_run_seed():
  """`build_method` passes the run seed as `relationship_seed` (as KAPC's R): two seeds give
  different hypernetworks, the same seed the same; a gin binding wins over the run seed."""
  import gin  # pylint: disable=g-import-not-at-top
  import fltff  # pylint: disable=g-import-not-at-top
  from fltff import personalization  # pylint: disable=g-import-not-at-top
  from fltff.simulation import experiment  # pylint: disable=g-import-not-at-top

  def hypernetwork(seed, bindings=()):
    gin.clear_config()
    try:
      fltff.register_configurables()
      gin.parse_config(['client_optimizer.name = "sgd"', 'pfedla.embedding_dim = 4',
                        'pfedla.hidden_dim = 5', *bindings])
      algorithm = experiment.build_method(personalization.build_pfedla, SPEC, 3, seed)
      return {k: np.asarray(v) for k, v in algorithm.process.initialize()['hypernetwork'].items()}
    finally:
      gin.clear_config()

  first, again, second = hypernetwork(1), hypernetwork(1), hypernetwork(2)
  for key in ('embedding', 'w1', 'w2', 'head'):
    np.testing.assert_array_equal(first[key], again[key])
    assert not np.allclose(first[key], second[key]), key
  bound = hypernetwork(2, ['pfedla.relationship_seed = 1'])
  np.testing.assert_array_equal(bound['embedding'], first['embedding'])
  direct = pfedla_lib.initial_hypernetworks(3, len(SPEC.initial_weights().trainable) // 2, 4, 5,
                                            seed=2)
  np.testing.assert_array_equal(second['embedding'], np.asarray(direct['embedding']))
