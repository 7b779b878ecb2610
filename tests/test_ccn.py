"""CCN, FedNova and FedBABU: equations vs NumPy, special cases vs FedAvg, the paper's Fig. 1."""

import collections
import functools
import os

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from fltff import aggregators
from fltff import learning
from fltff.errors import ConfigError
from fltff.learning import ModelSpec
from fltff.models import build_model
from fltff.learning import optimizers
from helpers import REPO
from helpers import random_client_datasets
from helpers import start_process
from helpers import tiny_mlp

RNG = np.random.default_rng(3)
DIM, CLASSES = 6, 3


def np_similarity(z):
  n = np.linalg.norm(z, axis=1)
  s = z @ z.T / np.outer(n, n)
  np.fill_diagonal(s, 1.0)
  return s


def np_factors(s, t):
  e = np.exp(s.sum(axis=1) / t)
  return np.array([(e.sum() - e[r]) / e.sum() for r in range(len(e))])  # Σ_{q≠r} e_q / Σ_q e_q


def test_similarity_and_factors_match_numpy():
  z = RNG.normal(size=(5, 7)).astype(np.float32)
  s = aggregators.similarity_matrix(z).numpy()
  np.testing.assert_allclose(s, np_similarity(z.astype(np.float64)), atol=1e-5)
  for t in (0.5, 1.0, 3.0):
    lam = aggregators.contribution_factors(s, t).numpy()
    np.testing.assert_allclose(lam, np_factors(s.astype(np.float64), t), rtol=1e-5)
  nu = np.array([10., 20., 5., 1., 8.], np.float32)
  omega = aggregators.normalized_weights(lam, nu).numpy()
  np.testing.assert_allclose(omega, lam * nu / (lam * nu).sum(), rtol=1e-5)


def test_one_client_keeps_the_base_weight():
  """One participant: Λ = 0, so Λ·ν = 0 and ω falls back to ν/Σν = 1 (not 0/0)."""
  z = RNG.normal(size=(1, 7)).astype(np.float32)
  lam = aggregators.contribution_factors(aggregators.similarity_matrix(z), 1.0)
  np.testing.assert_array_equal(lam.numpy(), [0.0])
  omega = aggregators.normalized_weights(lam, np.array([12.0], np.float32)).numpy()
  np.testing.assert_array_equal(omega, [1.0])
  # Any Λ·ν = 0 gives the normalised base weights; all ν = 0 gives zeros, never NaN.
  np.testing.assert_allclose(aggregators.normalized_weights(
      np.zeros(3, np.float32), np.array([1., 3., 4.], np.float32)).numpy(), [.125, .375, .5])
  np.testing.assert_array_equal(aggregators.normalized_weights(
      np.array([.5, .5], np.float32), np.zeros(2, np.float32)).numpy(), [0.0, 0.0])


def test_outlier_gets_largest_contribution_factor():
  """Two clients share a distribution, the third differs: Λ_3 is the largest (paper Fig. 1)."""
  base = RNG.normal(size=16)
  z = np.stack([base + 0.1 * RNG.normal(size=16), base + 0.1 * RNG.normal(size=16),
                RNG.normal(size=16)]).astype(np.float32)
  lam = aggregators.contribution_factors(aggregators.similarity_matrix(z), 1.0).numpy()
  assert np.argmax(lam) == 2 and lam[2] > lam[0] + 0.05


def test_nova_aggregate_matches_numpy():
  updates = [RNG.normal(size=(3, 4, 2)).astype(np.float32)]
  p = np.array([0.2, 0.5, 0.3], np.float32)
  tau = np.array([10, 40, 25], np.int32)
  got = aggregators.nova_aggregate(updates, p, tau)[0].numpy()
  want = (p * tau).sum() * np.einsum('k,kij->ij', p / tau, updates[0])
  np.testing.assert_allclose(got, want, rtol=1e-5)


def test_factory_round_by_hand():
  value_type = tff.types.to_type([(np.float32, (2, 3)), (np.float32, (3,))])
  weight_type = tff.types.to_type(collections.OrderedDict(
      num_examples=np.float32, client_index=np.int32, latent_mean=(np.float32, (4,)),
      local_steps=np.int32))
  process = aggregators.NormalizedMeanFactory(
      temperature=0.7, normalized_averaging=True).create(value_type, weight_type)
  updates = [[RNG.normal(size=(2, 3)).astype(np.float32), RNG.normal(size=3).astype(np.float32)]
             for _ in range(3)]
  z = RNG.normal(size=(3, 4)).astype(np.float32)
  nu, tau, cid = np.array([3., 9., 6.]), np.array([5, 12, 7]), [7, 2, 4]
  weights = [collections.OrderedDict(num_examples=np.float32(nu[k]), client_index=np.int32(cid[k]),
                                     latent_mean=z[k], local_steps=np.int32(tau[k]))
             for k in range(3)]
  out = process.next(process.initialize(), updates, weights)
  lam = np_factors(np_similarity(z.astype(np.float64)), 0.7)
  omega = lam * nu / (lam * nu).sum()
  tau_eff = (omega * tau).sum()
  for i in range(2):
    want = tau_eff * sum(omega[k] / tau[k] * updates[k][i] for k in range(3))
    np.testing.assert_allclose(out.result[i], want, rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(out.measurements['contribution'], lam, rtol=1e-5)
  np.testing.assert_array_equal(out.measurements['client_index'], cid)


# --- inside learning processes --------------------------------------------------------------
def _mlp(seed=31):
  return tiny_mlp(DIM, CLASSES, seed)


SPEC = ModelSpec(_mlp, (DIM,), CLASSES)


def _datasets(sizes):
  return random_client_datasets(sizes, 9, DIM, CLASSES, batch=5)


def _run(algorithm, sizes=(20, 20, 20), epochs=(2, 2, 2), rounds=2):
  process = algorithm.process
  state = process.set_model_weights(process.initialize(), algorithm.model_spec.initial_weights())
  for _ in range(rounds):
    inputs = [learning.client_input(ds, i, e) for i, (ds, e) in enumerate(zip(_datasets(sizes),
                                                                            epochs))]
    output = process.next(state, inputs)
    state = output.state
  return process.get_model_weights(state).trainable, output.metrics


def _diff(a, b):
  return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(a, b))


def _opt():
  return optimizers.sgdm(learning_rate=0.1, momentum=0.9)


def test_fednova_with_equal_steps_is_fedavg_and_differs_otherwise():
  fedavg = learning.build_fedavg(SPEC, client_optimizer=_opt())
  fednova = learning.build_fednova(SPEC, client_optimizer=_opt())
  avg, _ = _run(fedavg)
  nova, _ = _run(fednova)
  assert _diff(nova, avg) <= 1e-5
  uneven = dict(sizes=(10, 20, 30), epochs=(1, 2, 3))  # Client inputs: the same processes.
  avg_u, _ = _run(fedavg, **uneven)
  nova_u, _ = _run(fednova, **uneven)
  assert _diff(nova_u, avg_u) > 1e-3


def test_fednova_keeps_ccns_temperature_and_refuses_other_aggregators():
  ccn = learning.build_fednova(
      SPEC, model_aggregator=aggregators.contribution_normalization_factory(2.0))
  assert ccn.name == 'fednova+ccn' and learning.build_fednova(SPEC).name == 'fednova'
  with pytest.raises(ConfigError,
                     match=r'^fednova\.model_aggregator must be CCN .* got MeanFactory\.'):
    learning.build_fednova(SPEC, model_aggregator=tff.aggregators.MeanFactory())


def test_ccn_with_huge_temperature_is_the_base_scheme():
  """T → ∞ makes every Λ_r = 1 − 1/K: ω = ν/Σν, i.e. the base scheme unchanged."""
  sizes = (10, 20, 30)
  avg, _ = _run(learning.build_fedavg(SPEC, client_optimizer=_opt()), sizes=sizes)
  ccn, metrics = _run(learning.build_fedavg(SPEC, client_optimizer=_opt(),
                                            model_aggregator=aggregators.contribution_normalization_factory(1e9)),
                      sizes=sizes)
  assert _diff(ccn, avg) <= 1e-5
  np.testing.assert_allclose(metrics['aggregator']['contribution'], 2 / 3, rtol=1e-5)
  ccn1, metrics1 = _run(learning.build_fedavg(SPEC, client_optimizer=_opt(),
                                              model_aggregator=aggregators.contribution_normalization_factory(0.05)),
                        sizes=sizes)
  assert _diff(ccn1, avg) > 1e-4
  np.testing.assert_allclose(np.sum(metrics1['aggregator']['weight']), 1.0, rtol=1e-5)


def test_ccn_round_with_one_participant_is_the_base_scheme():
  """A round with a single participant: CCN's new model is FedAvg's (no NaN from Λ = 0)."""
  models = {}
  for ccn in (False, True):
    algorithm = learning.build_fedavg(SPEC, client_optimizer=_opt(),
                                      model_aggregator=aggregators.contribution_normalization_factory() if ccn else None)
    process, state = start_process(algorithm)
    output = process.next(state, [learning.client_input(_datasets((20,))[0], 4, 2)])
    models[ccn] = process.get_model_weights(output.state).trainable
  assert all(np.all(np.isfinite(w)) for w in models[True])
  assert _diff(models[True], models[False]) <= 1e-6
  assert _diff(models[False], SPEC.initial_weights().trainable) > 1e-3  # It trained.
  np.testing.assert_array_equal(output.metrics['aggregator']['weight'], [1.0])


def test_uniform_client_weighting_composes_with_ccn():
  """`client_weighting='uniform'` sets ν = num_examples = 1 in the weight struct that also
  carries CCN's fields, so CCN's ω = Λ/ΣΛ whatever the client sizes."""
  work = learning.build_client_work(
      SPEC, _opt(), client_statistics=aggregators.contribution_normalization_factory().client_statistics,
      client_weighting='uniform')
  weights = SPEC.initial_weights()
  inputs = [learning.client_input(ds, i, 1) for i, ds in enumerate(_datasets((10, 20, 30)))]
  results = work.next(work.initialize(), [weights] * 3, inputs).result
  for r in results:
    assert set(r.update_weight) == {'num_examples', 'client_index', 'latent_mean'}
    assert r.update_weight['num_examples'] == 1.0
  _, metrics = _run(learning.build_fedavg(SPEC, client_optimizer=_opt(),
                                          model_aggregator=aggregators.contribution_normalization_factory(0.05),
                                          client_weighting='uniform'),
                    sizes=(10, 20, 30), rounds=1)
  lam = np.asarray(metrics['aggregator']['contribution'])
  np.testing.assert_allclose(metrics['aggregator']['weight'], lam / lam.sum(), rtol=1e-5)


def test_fedbabu_never_changes_the_head():
  algorithm = learning.build_fedbabu(SPEC, client_optimizer=_opt())
  head = [2, 3]  # The last Dense layer's kernel and bias: FedBABU's head.
  trained, _ = _run(algorithm)
  start = SPEC.initial_weights().trainable
  for i in head:
    np.testing.assert_array_equal(trained[i], start[i])
  assert _diff([trained[0]], [start[0]]) > 1e-3  # The body trains.


# FedNova's compiles in every run on two workers (test_vectorized's matrix).
@pytest.mark.parametrize('builder', ['fedavg', 'fedprox', 'sgdm', 'fedbabu', 'fedlap'])
def test_every_base_scheme_with_ccn_compiles_to_mergeable_form(builder):
  algorithm = getattr(learning, f'build_{builder}')(SPEC, model_aggregator=aggregators.contribution_normalization_factory())
  assert algorithm.name == f'{builder}+ccn'
  form = tff.backends.native.compile_to_mergeable_comp_form(algorithm.process.next)
  assert isinstance(form, tff.framework.MergeableCompForm)


def test_mnist_outlier_client_gets_largest_lambda():
  """Real latents: two clients hold digits {0, 1}, the third {7, 8}; CCN favours the third."""
  data = np.load(os.path.join(REPO, 'fltff', 'data', 'samples', 'mnist_first1003.npz'))
  x, y = data['x_train'], data['y_train']
  pick = lambda classes, n, offset: np.where(np.isin(y, classes))[0][offset:offset + n]
  parts = [pick([0, 1], 40, 0), pick([0, 1], 40, 40), pick([7, 8], 40, 0)]
  spec = ModelSpec(functools.partial(build_model, 'mlp2', (28, 28, 1), 10, seed=0),
                   (28, 28, 1), 10)
  algorithm = learning.build_fedavg(spec, client_optimizer=_opt(), model_aggregator=aggregators.contribution_normalization_factory())
  state = algorithm.process.initialize()
  inputs = []
  for k, idx in enumerate(parts):
    ds = tf.data.Dataset.from_tensor_slices(collections.OrderedDict(
        x=(x[idx, ..., None] / 255.0).astype(np.float32), y=y[idx].astype(np.int32))).batch(10)
    inputs.append(learning.client_input(ds, k, 1))
  metrics = algorithm.process.next(state, inputs).metrics['aggregator']
  order = np.argsort(metrics['client_index'])
  lam = np.asarray(metrics['contribution'])[order]
  assert np.argmax(lam) == 2, lam


_FIX = ("Build the process with an fltff builder, whose client work sends the factory's "
        'client_statistics: fltff.learning.build_fedavg(model_spec, model_aggregator=<this '
        'factory>) or another that takes model_aggregator (fltff.methods marks them '
        'composes_aggregator), or build_algorithm(..., model_aggregator=<this factory>) for a '
        'method of your own.')


@pytest.mark.parametrize('factory,message', [
    (aggregators.contribution_normalization_factory(),
     "CCN (contribution_normalization_factory) needs each client's latent_mean, the mean of its "
     "model's 'latent' layer over its local training data, sent with its update in the update "
     "weight, a struct (num_examples, latent_mean); this process's update weight is float32, "
     "without num_examples, latent_mean (TFF's own client work sends only the example count). "
     + _FIX),
    (aggregators.NormalizedMeanFactory(normalized_averaging=True),
     "FedNova's normalised averaging needs each client's local_steps, sent with its update in "
     "the update weight, a struct (num_examples, local_steps); this process's update weight is "
     "float32, without num_examples, local_steps (TFF's own client work sends only the example "
     "count). " + _FIX),
])
def test_in_tffs_own_fedavg_the_aggregator_says_what_it_needs_and_how(factory, message):
  """TFF's `build_weighted_fed_avg` sends the example count alone as the update weight: the
  factory says, in one message, what it needs and which builders send it."""
  with pytest.raises(ConfigError) as raised:
    tff.learning.algorithms.build_weighted_fed_avg(
        model_fn=SPEC.tff_model, client_optimizer_fn=_opt(), model_aggregator=factory)
  assert str(raised.value) == message
