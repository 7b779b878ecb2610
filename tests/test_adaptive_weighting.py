"""FedAdp / FedLayerWise: equations vs NumPy, a 3-client round by hand, TFF special cases."""

import collections
import re

import numpy as np
import pytest
import tensorflow_federated as tff

from fltff import aggregators
from fltff import learning
from fltff.errors import ConfigError
from fltff.learning import ModelSpec
from fltff.learning import optimizers
from helpers import random_client_datasets
from helpers import tiny_mlp

RNG = np.random.default_rng(0)


# --- NumPy references ----------------------------------------------------------------------
def np_angle(g, G):
  cos = g @ G / (np.linalg.norm(g) * np.linalg.norm(G))
  return np.arccos(np.clip(cos, -1, 1))


def np_gompertz(theta, alpha=5.0):
  return alpha * (1 - np.exp(-np.exp(-alpha * (theta - 1))))


def np_psi(f, n):
  e = n[:, None] * np.exp(f)
  return e / e.sum(axis=0, keepdims=True)


# --- pure functions -------------------------------------------------------------------------
def test_client_and_global_gradient():
  updates = RNG.normal(size=(4, 7)).astype(np.float32)
  n = np.array([5., 1., 3., 9.], np.float32)
  g = aggregators.client_gradients(updates, 0.5).numpy()
  np.testing.assert_allclose(g, updates / 0.5, rtol=1e-6)
  np.testing.assert_allclose(aggregators.global_gradient(g, n).numpy(),
                             (n[:, None] * g).sum(0) / n.sum(), rtol=1e-5)


def test_instantaneous_angles_match_numpy_and_handle_zero():
  g = RNG.normal(size=(5, 11)).astype(np.float32)
  G = RNG.normal(size=11).astype(np.float32)
  got = aggregators.instantaneous_angles(g, G).numpy()
  np.testing.assert_allclose(got, [np_angle(r, G) for r in g], atol=1e-5)
  # Parallel / antiparallel and a zero row: finite, in [0, π].
  special = np.stack([G, -2 * G, np.zeros_like(G)])
  np.testing.assert_allclose(aggregators.instantaneous_angles(special, G).numpy(),
                             [0.0, np.pi, 0.0], atol=2e-3)


def test_smoothed_angles_are_running_means():
  thetas = RNG.uniform(0, np.pi, size=6).astype(np.float32)
  smoothed = np.float32(123.0)  # Ignored at t = 1.
  for t, theta in enumerate(thetas, start=1):
    smoothed = aggregators.smoothed_angles(smoothed, theta, t).numpy()
    np.testing.assert_allclose(smoothed, thetas[:t].mean(), rtol=1e-5)


def test_gompertz_matches_numpy_and_decreases():
  theta = np.linspace(0, np.pi, 50).astype(np.float32)
  f = aggregators.gompertz(theta, 5.0).numpy()
  np.testing.assert_allclose(f, np_gompertz(theta), rtol=1e-5, atol=1e-6)
  assert np.all(np.diff(f) <= 0) and f[0] > 4.9 and f[-1] < 1e-3


def test_adaptive_weights_match_numpy():
  f = RNG.uniform(0, 5, size=(4, 3)).astype(np.float32)
  n = np.array([10., 600., 30., 1.], np.float32)
  psi = aggregators.adaptive_weights(f, n).numpy()
  np.testing.assert_allclose(psi, np_psi(f, n), rtol=1e-5)
  np.testing.assert_allclose(psi.sum(axis=0), 1.0, rtol=1e-6)


def test_weighted_layer_mean():
  values = RNG.normal(size=(3, 2, 4)).astype(np.float32)
  psi = np.array([0.2, 0.5, 0.3], np.float32)
  np.testing.assert_allclose(aggregators.weighted_layer_mean(values, psi).numpy(),
                             np.einsum('k,kij->ij', psi, values), rtol=1e-5)


# --- the factory, by hand -------------------------------------------------------------------
SHAPES = [(3, 2), (2,), (2, 4), (4,)]   # two layers: tensors {0, 1} and {2, 3}
LAYERS = [[0, 1], [2, 3]]


def _numpy_round(updates, n, cids, state_theta, state_t, layers, lr=0.1):
  """Eqs. (1)-(7) written out directly, with the per-client smoothing state."""
  k = len(updates)
  theta = np.zeros((k, len(layers)))
  for l, group in enumerate(layers):
    g = np.stack([np.concatenate([updates[c][i].ravel() for i in group]) for c in range(k)]) / lr
    G = (n[:, None] * g).sum(0) / n.sum()
    theta[:, l] = [np_angle(g[c], G) for c in range(k)]
  t = state_t[cids] + 1
  smoothed = (t[:, None] - 1) / t[:, None] * state_theta[cids] + theta / t[:, None]
  state_theta, state_t = state_theta.copy(), state_t.copy()
  state_theta[cids], state_t[cids] = smoothed, t
  psi = np_psi(np_gompertz(smoothed), n)
  aggregate = []
  for i in range(len(updates[0])):
    l = next(j for j, g in enumerate(layers) if i in g)
    aggregate.append(sum(psi[c, l] * updates[c][i] for c in range(k)))
  return aggregate, psi, state_theta, state_t


def _value_type():
  return tff.types.to_type([(np.float32, s) for s in SHAPES])


WEIGHT_TYPE = tff.types.to_type(
    collections.OrderedDict(num_examples=np.float32, client_index=np.int32))


def test_layerwise_factory_two_rounds_by_hand():
  # The reference divides by η = 0.1, the factory by 1: η cancels in the angles.
  process = aggregators.layerwise_adaptive_factory(LAYERS, num_clients=5).create(
      _value_type(), WEIGHT_TYPE)
  state = process.initialize()
  theta_np, t_np = np.zeros((5, 2)), np.zeros(5, np.int64)
  # Round 1: clients 4, 0, 2. Round 2: clients 2, 1, 4 (client 2 and 4 smooth over 2 rounds).
  for cids, n in [([4, 0, 2], [10., 20., 30.]), ([2, 1, 4], [30., 5., 10.])]:
    updates = [[RNG.normal(size=s).astype(np.float32) for s in SHAPES] for _ in cids]
    weights = [collections.OrderedDict(num_examples=np.float32(w), client_index=np.int32(c))
               for w, c in zip(n, cids)]
    out = process.next(state, updates, weights)
    state = out.state
    ref, psi, theta_np, t_np = _numpy_round(updates, np.array(n), np.array(cids), theta_np,
                                            t_np, LAYERS)
    for got, want in zip(out.result, ref):
      np.testing.assert_allclose(got, want, atol=1e-5)
    np.testing.assert_allclose(out.measurements['psi'], psi, atol=1e-5)
    np.testing.assert_array_equal(out.measurements['client_index'], cids)
  np.testing.assert_allclose(state['smoothed_angle'], theta_np, atol=1e-5)
  np.testing.assert_array_equal(state['participations'], [1, 1, 2, 0, 2])


def test_fedadp_factory_is_model_wise():
  process = aggregators.fedadp_factory(len(SHAPES), num_clients=3).create(_value_type(),
                                                                          WEIGHT_TYPE)
  updates = [[RNG.normal(size=s).astype(np.float32) for s in SHAPES] for _ in range(3)]
  weights = [collections.OrderedDict(num_examples=np.float32(w), client_index=np.int32(c))
             for c, w in enumerate([1., 2., 3.])]
  out = process.next(process.initialize(), updates, weights)
  ref, psi, _, _ = _numpy_round(updates, np.array([1., 2., 3.]), np.arange(3), np.zeros((3, 1)),
                                np.zeros(3, np.int64), [list(range(len(SHAPES)))], lr=1.0)
  assert out.measurements['psi'].shape == (3, 1)
  np.testing.assert_allclose(out.measurements['psi'], psi, atol=1e-5)
  for got, want in zip(out.result, ref):
    np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.parametrize('executor,cids', [('tff_cpp', [0, 1, 2]), ('in_process', [1, -1, 0])])
def test_a_client_index_outside_num_clients_is_one_clear_error(tff_runtime, executor, cids):
  # A GPU's gather would read zeros for it and its scatter drop it: a silent wrong result.
  from fltff.runtime.in_process import InProcessContext  # pylint: disable=g-import-not-at-top

  process = aggregators.fedadp_factory(len(SHAPES), num_clients=2).create(_value_type(),
                                                                          WEIGHT_TYPE)
  updates = [[RNG.normal(size=s).astype(np.float32) for s in SHAPES] for _ in cids]
  weights = [collections.OrderedDict(num_examples=np.float32(1), client_index=np.int32(c))
             for c in cids]
  tff.framework.set_default_context(
      tff_runtime.context if executor == 'tff_cpp' else InProcessContext())
  try:
    state = process.initialize()
    with pytest.raises(Exception, match=re.escape(
        'AdaptiveWeightingFactory(num_clients=2) got client indices outside [0, num_clients); '
        f'num_clients must count every client of the data:] [{" ".join(map(str, cids))}]')):
      process.next(state, updates, weights)
  finally:
    tff.framework.set_default_context(tff_runtime.context)


# --- inside learning processes --------------------------------------------------------------
DIM, CLASSES = 6, 3


def _mlp(seed=11):
  return tiny_mlp(DIM, CLASSES, seed)


def _data():
  return random_client_datasets((10, 20, 15), 5, DIM, CLASSES, batch=5)


def _run(algorithm, rounds=2):
  state = algorithm.process.initialize()
  state = algorithm.process.set_model_weights(state, algorithm.model_spec.initial_weights())
  for _ in range(rounds):
    inputs = [learning.client_input(ds, i, 1) for i, ds in enumerate(_data())]
    output = algorithm.process.next(state, inputs)
    state = output.state
  return algorithm.process.get_model_weights(state).trainable, output.metrics


def _max_diff(a, b):
  return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(a, b))


def test_alpha_zero_is_fedavg():
  """With α = 0, f ≡ 0 and ψ = n_k / n: FedLayerWise and FedAdp reduce to FedAvg."""
  spec = ModelSpec(_mlp, (DIM,), CLASSES)
  opt = optimizers.sgdm(learning_rate=0.1, momentum=0.9)
  avg, _ = _run(learning.build_fedavg(spec, client_optimizer=opt))
  flw, metrics = _run(learning.build_fedlayerwise(spec, num_clients=3, alpha=0.0, client_optimizer=opt))
  adp, _ = _run(learning.build_fedadp(spec, num_clients=3, alpha=0.0, client_optimizer=opt))
  assert _max_diff(flw, avg) <= 1e-5 and _max_diff(adp, avg) <= 1e-5
  psi = metrics['aggregator']['psi']
  assert psi.shape == (3, 2)  # 3 clients x 2 layers (Dense kernel+bias each)
  np.testing.assert_allclose(psi, np.tile([[10 / 45], [20 / 45], [15 / 45]], (1, 2)), atol=1e-6)


def test_layer_groups_follow_the_model():
  spec = ModelSpec(_mlp, (DIM,), CLASSES)
  assert spec.trainable_layers()[0] == [[0, 1], [2, 3]]


def test_factory_in_plain_tff_fed_avg():
  """Importable into TFF's own process (float weights: no cross-round smoothing)."""
  spec = ModelSpec(_mlp, (DIM,), CLASSES)
  opt = optimizers.sgdm(learning_rate=0.1)
  process = tff.learning.algorithms.build_weighted_fed_avg(
      model_fn=spec.tff_model, client_optimizer_fn=opt,
      server_optimizer_fn=optimizers.sgdm(learning_rate=1.0),
      model_aggregator=aggregators.layerwise_adaptive_factory(None, alpha=0.0))
  state = process.set_model_weights(process.initialize(), spec.initial_weights())
  reference = tff.learning.algorithms.build_weighted_fed_avg(
      model_fn=spec.tff_model, client_optimizer_fn=opt,
      server_optimizer_fn=optimizers.sgdm(learning_rate=1.0))
  ref_state = reference.set_model_weights(reference.initialize(), spec.initial_weights())
  output = process.next(state, _data())
  ref_output = reference.next(ref_state, _data())
  assert _max_diff(process.get_model_weights(output.state).trainable,
                   reference.get_model_weights(ref_output.state).trainable) <= 1e-5
  assert output.metrics['aggregator']['psi'].shape == (3, 4)  # every tensor its own layer
  # Rows are positions in the round (no client identity reaches the aggregator), named so.
  np.testing.assert_array_equal(output.metrics['aggregator']['position'], [0, 1, 2])
  assert 'client_index' not in output.metrics['aggregator']


def test_layer_groups_as_they_come_from_the_model_are_accepted_in_plain_tff():
  from fltff import models  # pylint: disable=g-import-not-at-top

  spec = ModelSpec(_mlp, (DIM,), CLASSES)
  groups = models.layer_groups(spec.keras_fn())
  factory = aggregators.layerwise_adaptive_factory(groups, alpha=0.0)
  process = tff.learning.algorithms.build_weighted_fed_avg(
      model_fn=spec.tff_model,
      client_optimizer_fn=optimizers.sgdm(learning_rate=0.1),
      model_aggregator=factory)
  state = process.set_model_weights(process.initialize(), spec.initial_weights())
  output = process.next(state, _data())
  assert output.metrics['aggregator']['psi'].shape == (3, 2)  # Two Dense layers.
  assert models.update_index_groups(groups) == spec.trainable_layers()[0] == [[0, 1], [2, 3]]


def test_per_client_smoothing_in_a_process_without_client_indices_is_one_clear_error():
  spec = ModelSpec(_mlp, (DIM,), CLASSES)
  with pytest.raises(ConfigError, match='needs the client\'s index in its update weight'):
    tff.learning.algorithms.build_weighted_fed_avg(
        model_fn=spec.tff_model,
        client_optimizer_fn=optimizers.sgdm(learning_rate=0.1),
        model_aggregator=aggregators.layerwise_adaptive_factory(None, num_clients=3))


# FedLayerWise's compiles in every run on two workers (test_vectorized's matrix).
@pytest.mark.parametrize('builder', ['fedadp'])
def test_process_compiles_to_mergeable_form(builder):
  spec = ModelSpec(_mlp, (DIM,), CLASSES)
  algorithm = getattr(learning, f'build_{builder}')(spec, num_clients=3)
  form = tff.backends.native.compile_to_mergeable_comp_form(algorithm.process.next)
  assert isinstance(form, tff.framework.MergeableCompForm)
