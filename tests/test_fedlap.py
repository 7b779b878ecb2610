"""FedLap: the regulariser against NumPy, its special cases against FedAvg/FedProx."""


import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from fltff import learning
from fltff.errors import ConfigError
from fltff.learning import ModelSpec
from helpers import random_client_datasets
from helpers import tiny_mlp

from fltff.learning import fedlap as fedlap_lib
from fltff.learning import optimizers

RNG = np.random.default_rng(1)
DIM, CLASSES = 6, 3


def np_rows(w):
  w = np.asarray(w)
  return w.reshape(1, -1) if w.ndim == 1 else w.reshape(-1, w.shape[-1])


def np_lambda(w, g):
  """1 − cos per row; a zero-norm row has no direction and λ = 0 (fltff's convention)."""
  a, b = np_rows(w), np_rows(g)
  norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
  cos = np.where(norms > 0, (a * b).sum(1) / np.where(norms > 0, norms, 1.0), 1.0)
  return 1 - cos


@pytest.mark.parametrize('q,expected', [(0.0, (0.0, 0.0)), (0.25, (0.5, 0.0)),
                                        (0.5, (1.0, 0.0)), (0.75, (0.5, 0.5)),
                                        (1.0, (0.0, 1.0))])
def test_importance_coefficients(q, expected):
  assert fedlap_lib.importance_coefficients(q) == pytest.approx(expected)


@pytest.mark.parametrize('q', [-0.1, 1.5])
def test_importance_out_of_range_is_config_error(q):
  with pytest.raises(ConfigError, match='q must be in'):
    fedlap_lib.importance_coefficients(q)


SHAPES = [(5, 4), (4,), (3, 3, 2, 4)]  # dense kernel, bias, conv kernel


def test_lambda_and_distance_match_numpy():
  local = [RNG.normal(size=s).astype(np.float32) for s in SHAPES]
  glob = [RNG.normal(size=s).astype(np.float32) for s in SHAPES]
  lambdas = fedlap_lib.neuron_dissimilarities(local, glob)
  dists = fedlap_lib.neuron_distances(local, glob)
  for w, g, lam, d in zip(local, glob, lambdas, dists):
    np.testing.assert_allclose(lam.numpy(), np_lambda(w, g), atol=1e-5)
    np.testing.assert_allclose(d.numpy(), ((np_rows(w) - np_rows(g))**2).sum(1), rtol=1e-5)
    assert np.all((lam.numpy() >= 0) & (lam.numpy() <= 2))


def test_lambda_is_zero_at_first_epoch_start_and_safe_for_zero_rows():
  glob = [RNG.normal(size=s).astype(np.float32) for s in SHAPES]
  reg = fedlap_lib.FedLapRegularizer(q=0.5)
  # local == global at the first epoch's start: λ is exactly 0 (Algorithm 1), not 0 up to
  # rsqrt's rounding, so vectorised clients can skip the term there (`learning.vectorized`);
  # also for rows of other scales, whose rounding would differ.
  for scale in (1.0, 3.7e-3, 123.0):
    for lam in reg.epoch_start([g * scale for g in glob], [g * scale for g in glob])[0]:
      np.testing.assert_array_equal(lam.numpy(), 0.0)
  zero = [np.zeros(s, np.float32) for s in SHAPES]
  local = [tf.Variable(z) for z in zero]
  with tf.GradientTape() as tape:
    lambdas = fedlap_lib.neuron_dissimilarities(local, glob)
    penalty = fedlap_lib.fedlap_penalty(local, glob, lambdas, q=0.5, mu=0.1)
  grads = tape.gradient(penalty, local)
  assert all(np.all(np.isfinite(x.numpy())) for x in lambdas)
  assert np.isfinite(penalty.numpy()) and all(np.all(np.isfinite(g.numpy())) for g in grads)


@pytest.mark.parametrize('q,mu', [(0.5, 0.0), (0.75, 0.3), (1.0, 0.2)])
def test_penalty_gradient_is_lambda_times_difference_per_row(q, mu):
  local = [tf.Variable(RNG.normal(size=s).astype(np.float32)) for s in SHAPES]
  glob = [RNG.normal(size=s).astype(np.float32) for s in SHAPES]
  lambdas = fedlap_lib.neuron_dissimilarities([v.numpy() for v in local], glob)
  with tf.GradientTape() as tape:
    penalty = fedlap_lib.fedlap_penalty(local, glob, lambdas, q, mu)
  grads = tape.gradient(penalty, local)
  a, b = fedlap_lib.importance_coefficients(q)
  expected_penalty = 0.0
  for v, g, grad in zip(local, glob, grads):
    w = v.numpy()
    c = a * np_lambda(w, g) + b * mu  # one coefficient per row
    diff = np_rows(w) - np_rows(g)
    np.testing.assert_allclose(np_rows(grad.numpy()), c[:, None] * diff, atol=1e-5)
    expected_penalty += 0.5 * (c * (diff**2).sum(1)).sum()
  assert penalty.numpy() == pytest.approx(expected_penalty, rel=1e-5)


@pytest.mark.parametrize('q,mu', [(0.3, 0.0), (0.5, 0.1), (0.9, 0.4)])
def test_closed_form_gradient_equals_autodiff(q, mu):
  local = [tf.Variable(RNG.normal(size=s).astype(np.float32)) for s in SHAPES]
  glob = [RNG.normal(size=s).astype(np.float32) for s in SHAPES]
  lambdas = fedlap_lib.neuron_dissimilarities([v.numpy() for v in local], glob)
  with tf.GradientTape() as tape:
    penalty = fedlap_lib.fedlap_penalty(local, glob, lambdas, q, mu)
  auto = tape.gradient(penalty, local)
  closed = fedlap_lib.fedlap_gradient([v.numpy() for v in local], glob, lambdas, q, mu)
  for x, y in zip(auto, closed):
    np.testing.assert_allclose(x.numpy(), y.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('q,mu', [(0.5, 0.1), (0.9, 0.4)])
def test_epoch_affine_gradient_equals_closed_form(q, mu):
  """The loop's per-epoch form `c ⊙ w + (−c ⊙ w_global)` equals `fedlap_gradient` at the
  epoch's λ, for the weights at the epoch start and after they moved within the epoch."""
  start = [RNG.normal(size=s).astype(np.float32) for s in SHAPES]
  glob = [tf.constant(RNG.normal(size=s).astype(np.float32)) for s in SHAPES]
  reg = fedlap_lib.FedLapRegularizer(q=q, mu=mu, refresh='epoch')
  context = reg.epoch_start([tf.constant(w) for w in start], glob)
  scales, offsets = reg.affine_gradient(glob, context)
  lambdas = fedlap_lib.neuron_dissimilarities(start, glob)
  for moved in (start, [w + 0.1 * RNG.normal(size=w.shape).astype(np.float32) for w in start]):
    want = fedlap_lib.fedlap_gradient(moved, glob, lambdas, q, mu)
    for s, o, w, y in zip(scales, offsets, moved, want):
      np.testing.assert_allclose((s * w + o).numpy(), y.numpy(), rtol=1e-4, atol=1e-6)
  # Per step λ follows the weights: no affine form is declared, so no loop asks for one.
  assert not fedlap_lib.FedLapRegularizer(q=q, mu=mu, refresh='step').traits.affine


# --- process-level special cases ----------------------------------------------------------
def _mlp(seed=21):
  return tiny_mlp(DIM, CLASSES, seed)


def _datasets(sizes=(10, 15, 20)):
  return random_client_datasets(sizes, 8, DIM, CLASSES, batch=5)


def _run(algorithm, epochs, rounds=2, sizes=(10, 15, 20)):
  process = algorithm.process
  state = process.set_model_weights(process.initialize(), algorithm.model_spec.initial_weights())
  for _ in range(rounds):
    inputs = [learning.client_input(ds, i, epochs) for i, ds in enumerate(_datasets(sizes))]
    output = process.next(state, inputs)
    state = output.state
  return process.get_model_weights(state).trainable, output.metrics


def _diff(a, b):
  return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(a, b))


SPEC = ModelSpec(_mlp, (DIM,), CLASSES)


def _opt():
  return optimizers.sgdm(learning_rate=0.1, momentum=0.9)


def test_q0_equals_tff_fedavg():
  ours, _ = _run(learning.build_fedlap(SPEC, q=0.0, mu=0.5, client_optimizer=_opt()), epochs=2)
  ref = tff.learning.algorithms.build_weighted_fed_avg(
      model_fn=SPEC.tff_model, client_optimizer_fn=_opt(),
      server_optimizer_fn=optimizers.sgdm(learning_rate=1.0))
  state = ref.set_model_weights(ref.initialize(), SPEC.initial_weights())
  for _ in range(2):
    state = ref.next(state, [ds.repeat(2) for ds in _datasets()]).state
  assert _diff(ours, ref.get_model_weights(state).trainable) <= 1e-5


def test_q1_equals_fltff_fedprox():
  ours, _ = _run(learning.build_fedlap(SPEC, q=1.0, mu=0.5, client_optimizer=_opt()), epochs=2)
  prox, _ = _run(learning.build_fedprox(SPEC, mu=0.5, client_optimizer=_opt()), epochs=2)
  avg, _ = _run(learning.build_fedavg(SPEC, client_optimizer=_opt()), epochs=2)
  assert _diff(ours, prox) <= 1e-5
  assert _diff(prox, avg) > 1e-3  # The proximal term really acts.


def test_half_is_fedlap_lambda_fixed_per_epoch():
  """q = 1/2, E = 1: λ = 0 for the only epoch, so exactly FedAvg; E = 3: it regularises."""
  # The epochs are client inputs: one process of each runs both.
  fedlap = learning.build_fedlap(SPEC, q=0.5, client_optimizer=_opt())
  fedavg = learning.build_fedavg(SPEC, client_optimizer=_opt())
  one, _ = _run(fedlap, epochs=1)
  avg1, _ = _run(fedavg, epochs=1)
  assert _diff(one, avg1) <= 1e-6
  three, _ = _run(fedlap, epochs=3)
  avg3, _ = _run(fedavg, epochs=3)
  assert _diff(three, avg3) > 1e-4
  step, _ = _run(learning.build_fedlap(SPEC, q=0.5, refresh='step', client_optimizer=_opt()),
                 epochs=1)
  assert _diff(step, avg1) > 1e-6  # Per-step λ regularises already in the first epoch.


def test_uniform_client_weighting_is_the_unweighted_mean():
  """client_weighting='uniform' (the paper's 1/|S_t| Σ_k w_k): the round's model is the plain
  mean of the clients' trained models, each from a round with that client alone."""
  algorithm = learning.build_fedlap(SPEC, q=0.5, client_optimizer=_opt(), client_weighting='uniform')
  process = algorithm.process
  state = process.set_model_weights(process.initialize(), SPEC.initial_weights())
  datasets = _datasets()
  inputs = [learning.client_input(ds, i, 3) for i, ds in enumerate(datasets)]
  ours = process.get_model_weights(process.next(state, inputs).state).trainable
  alone = [process.get_model_weights(process.next(
      state, [learning.client_input(ds, 0, 3)]).state).trainable for ds in datasets]
  mean = [np.mean([np.asarray(m[i]) for m in alone], axis=0) for i in range(len(ours))]
  assert _diff(ours, mean) <= 1e-5
  sizes = np.array([10., 15., 20.])
  weighted = [np.tensordot(sizes / sizes.sum(), [np.asarray(m[i]) for m in alone], axes=1)
              for i in range(len(ours))]
  assert _diff(mean, weighted) > 1e-3


def test_measurements_are_per_layer_lambda_and_distance():
  """One client, one round: the server model is the client's model; check λ, d vs NumPy."""
  start = [np.asarray(w) for w in SPEC.initial_weights().trainable]
  trained, metrics = _run(learning.build_fedlap(SPEC, q=0.5, client_optimizer=_opt()), epochs=2,
                          rounds=1, sizes=(20,))
  reg = metrics['client_work']['regularizer']
  names = list(reg['lambda_mean'])
  assert len(names) == 2  # two Dense layers
  for name, (k, b) in zip(names, [(0, 1), (2, 3)]):
    lam = np.concatenate([np_lambda(trained[i], start[i]) for i in (k, b)])
    d = np.concatenate([((np_rows(trained[i]) - np_rows(start[i]))**2).sum(1) for i in (k, b)])
    assert reg['lambda_mean'][name] == pytest.approx(lam.mean(), abs=1e-5)
    assert reg['distance_mean'][name] == pytest.approx(d.mean(), rel=1e-4)


def test_per_step_lambda_on_vectorised_clients_equals_tffs_runtime(data, spec, cpp):
  """refresh='step' declares no affine form (λ follows the weights): vectorised clients add its
  closed-form gradient at every step, as TFF's per-client work does."""
  from fltff.runtime.in_process import InProcessContext  # pylint: disable=g-import-not-at-top
  from helpers import EQUALITY_CLIENTS, assert_equal_runs, equality_sgdm, run_rounds  # pylint: disable=g-import-not-at-top

  build = lambda: learning.build_fedlap(spec, q=0.5, refresh='step',
                                        client_optimizer=equality_sgdm())
  expected = run_rounds(build(), data, cpp, EQUALITY_CLIENTS, rounds=2)
  actual = run_rounds(build().with_vectorized_clients(), data, InProcessContext(),
                      EQUALITY_CLIENTS, rounds=2)
  tff.framework.set_default_context(cpp)
  assert_equal_runs(expected, actual, 'FedLap per-step λ, vectorised vs C++ runtime', rtol=1e-5)
