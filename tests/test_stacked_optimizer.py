"""The vectorised clients' optimizer updaters: in place (TFF's SGD(M)) and mapped (any
optimizer) against TFF's own `next`, client by client, in NumPy."""

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from fltff.learning import client_work
from fltff.learning.stacked_optimizer import FusedSGDM
from fltff.learning.stacked_optimizer import MappedOptimizer
from fltff.learning.stacked_optimizer import stacked_optimizer
from fltff.learning import optimizers

K = 5
SHAPES = [(4, 3), (3,)]
# Steps of the clients that train (False: no batch at that step, the client must not move).
TRAINS = [[True] * K, [True, False, True, True, False], [False, True, True, True, True],
          [True] * K]


def _steps(seed=0):
  rng = np.random.default_rng(seed)
  start = [rng.normal(size=(K, *s)).astype(np.float32) for s in SHAPES]
  gradients = [[rng.normal(size=(K, *s)).astype(np.float32) for s in SHAPES] for _ in TRAINS]
  return start, gradients


def _affine(seed=2):
  """FedProx-like terms: a scalar scale per client for the kernel, a per-element scale (the
  client's `(3,)` against its `(3,)` bias) for the bias; offsets of the weights' shapes."""
  rng = np.random.default_rng(seed)
  scales = [rng.uniform(0.1, 1.0, size=K).astype(np.float32),
            rng.uniform(0.1, 1.0, size=(K, 3)).astype(np.float32)]
  offsets = [rng.normal(size=(K, *s)).astype(np.float32) for s in SHAPES]
  return scales, offsets


def _run(updater, start, gradients, unknown_client_count=False, affine=None):
  """The updater through the steps of TRAINS inside one tf.function, as the training runs it
  (traced for any number of clients with `unknown_client_count`, as `reduce_retracing`
  retraces it for a round of another size)."""
  updater.prepare([tf.TensorSpec(s, tf.float32) for s in SHAPES])
  specs = [tf.TensorSpec([None, *s], tf.float32) for s in SHAPES]
  signature = [specs, [specs] * len(TRAINS)] if unknown_client_count else None

  @tf.function(input_signature=signature)
  def train(start, gradients):
    carry = updater.start(tuple(start))
    for trains, step in zip(TRAINS, gradients):
      carry = updater.step(carry, tuple(step), tf.constant(trains), affine)
    return updater.finish(carry)

  return [t.numpy() for t in train(start, gradients)]


def _reference(optimizer, start, gradients, frozen=frozenset(), affine=None):
  """TFF's `optimizer.next`, client by client, skipping a client's idle steps (the gradients
  given for them are not zero: an updater that applied them would differ), with the affine
  terms added as `client_work.step_gradients` adds them."""
  out = []
  for k in range(K):
    weights = tuple(tf.constant(w[k]) for w in start)
    state = optimizer.initialize(tuple(tf.TensorSpec(s, tf.float32) for s in SHAPES))
    for trains, step in zip(TRAINS, gradients):
      if trains[k]:
        client_affine = None if affine is None else [[t[k] for t in part] for part in affine]
        grads = client_work.step_gradients([tf.constant(g[k]) for g in step], weights, None,
                                           None, None, client_affine, frozen)
        state, updated = optimizer.next(state, weights, tuple(grads))
        weights = tuple(w if i in frozen else u for i, (w, u) in enumerate(zip(weights, updated)))
    out.append([w.numpy() for w in weights])
  return [np.stack([client[i] for client in out]) for i in range(len(SHAPES))]


@pytest.mark.parametrize('momentum', [None, 0.9])
@pytest.mark.parametrize('frozen', [frozenset(), frozenset({1})])
@pytest.mark.parametrize('unknown_client_count', [False, True])
@pytest.mark.parametrize('with_affine', [False, True])
def test_fused_sgdm_equals_tff_sgdm_client_by_client(momentum, frozen, unknown_client_count,
                                                     with_affine):
  optimizer = optimizers.sgdm(learning_rate=0.1, momentum=momentum)
  updater = stacked_optimizer(optimizer, frozen)
  assert isinstance(updater, FusedSGDM)
  start, gradients = _steps()
  affine = _affine() if with_affine else None
  got = _run(updater, start, gradients, unknown_client_count, affine)
  want = _reference(optimizer, start, gradients, frozen, affine)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)
  if frozen:
    np.testing.assert_array_equal(got[1], start[1])


def test_the_fused_update_lets_go_of_its_buffers_and_runs_again():
  optimizer = optimizers.sgdm(learning_rate=0.1, momentum=0.9)
  updater = stacked_optimizer(optimizer)
  start, gradients = _steps()
  first = _run(updater, start, gradients)
  assert all(v.numpy().shape[0] == 0 for v in updater._weights + updater._accumulators)  # pylint: disable=protected-access
  # Another round on the same variables.
  again = _run(updater, start, gradients)
  for a, b in zip(first, again):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize('with_affine', [False, True])
def test_other_optimizers_are_mapped_and_equal_tff(with_affine):
  optimizer = tff.learning.optimizers.build_adam(learning_rate=0.05)
  updater = stacked_optimizer(optimizer)
  assert isinstance(updater, MappedOptimizer)
  start, gradients = _steps(1)
  affine = _affine() if with_affine else None
  got = _run(updater, start, gradients, affine=affine)
  for g, w in zip(got, _reference(optimizer, start, gradients, affine=affine)):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_only_an_optimizer_declaring_sgdm_is_fused():
  assert optimizers.sgdm(0.01, 0.9).hyperparameters == (np.float32(0.01), np.float32(0.9))
  assert optimizers.sgdm(0.5).hyperparameters == (0.5, None)
  for undeclared in (tff.learning.optimizers.build_sgdm(0.01, 0.9),
                     tff.learning.optimizers.build_adam(0.01),
                     optimizers.build_optimizer('sgdm', 0.01, weight_decay=1e-5)):
    assert isinstance(stacked_optimizer(undeclared), MappedOptimizer)


def test_a_loop_of_steps_with_per_client_offsets_runs_repeatedly():
  # Every client trains at every step, so the step's other branch (some clients idle, the
  # affine terms added outside the fused update) is not taken. When that branch summed with
  # one `tf.add_n`, Grappler turned the model-sized AddN into a named temporary variable that
  # was created but never destroyed: the next call failed with AlreadyExistsError.
  clients, shapes = 100, [(784, 200), (200,)]
  rng = np.random.default_rng(0)
  start = [tf.constant(rng.normal(size=(clients, *s)), tf.float32) for s in shapes]
  gradients = [tf.constant(rng.normal(size=(clients, *s)), tf.float32) for s in shapes]
  offsets = tuple(tf.constant(rng.normal(size=(clients, *s)), tf.float32) for s in shapes)
  scales = tuple(tf.fill([clients], 0.5) for _ in shapes)
  updater = FusedSGDM(0.01, 0.9)
  updater.prepare([tf.TensorSpec(s, tf.float32) for s in shapes])

  @tf.function
  def train(start, gradients):
    carry = updater.start(tuple(start))
    for _ in tf.range(3):
      carry = updater.step(carry, tuple(gradients), tf.ones([clients], tf.bool),
                           (scales, offsets))
    return updater.finish(carry)

  first = [t.numpy() for t in train(start, gradients)]
  for _ in range(3):
    again = [t.numpy() for t in train(start, gradients)]
  # Three steps of SGDM 0.01 / 0.9 on g + 0.5 w + o, in NumPy.
  for w, g, o, got in zip(start, gradients, offsets, first):
    w, a = w.numpy(), np.zeros(w.shape, np.float32)
    for _ in range(3):
      a = 0.9 * a + (g.numpy() + 0.5 * w + o.numpy())
      w = w - 0.01 * a
    np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-6)
  for x, y in zip(first, again):
    np.testing.assert_array_equal(x, y)
