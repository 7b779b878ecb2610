"""Dense kernels trained in factored form on vectorised clients (`learning.factored_dense`).

The factored kernels must give TFF's numbers: for each way a factored kernel is trained, 3
rounds with factoring forced for both kernels of mlp2 against TFF's C++ runtime are part of
`test_vectorized.py`'s executor matrix (`FACTORED_TOO`); here the vectorised training with and
without factoring is compared on rounds with idle steps, several epochs, per-client start
weights and anchors, with and without momentum (where momentum enters), and which kernels a
round factors.
"""

import collections

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from fltff.learning import client_work as client_work_lib
from fltff.learning import factored_dense
from fltff.learning import vectorized
from fltff.learning.regularizers import ProximalRegularizer
from fltff.learning import optimizers
from helpers import EQUALITY_CLIENTS
from helpers import equality_methods
from helpers import mnist_sample_split


@pytest.fixture(scope='module', name='data')
def short_rounds_data():
  # A quarter of the equality federation's data: rounds of a few steps (batch 16, 1 or 2
  # epochs), histories of the length factoring is used for (`worth_factoring`).
  return mnist_sample_split(EQUALITY_CLIENTS, seed=3, local_test_examples=10,
                            data_fraction=0.25)


def _trained_works(algorithm):
  work = algorithm._vectorized  # pylint: disable=protected-access
  return getattr(work, '_work', work)


def _client_inputs(rng, sizes, epochs, batch):
  inputs = []
  for k, (n, e) in enumerate(zip(sizes, epochs)):
    examples = collections.OrderedDict(
        x=rng.normal(size=(n, 28, 28, 1)).astype(np.float32),
        y=rng.integers(0, 10, size=n).astype(np.int32))
    batches = tf.data.Dataset.from_tensor_slices(examples).batch(batch)
    inputs.append(client_work_lib.client_input(batches, k, e))
  return inputs


# Momentum enters only the recurrence (`advance`), the start weights only the products, so
# the momentum cases of a shared start without a regulariser and of a per-client start add
# nothing here; both also run factored with momentum against TFF's C++ runtime
# (test_vectorized's FACTORED_TOO: FedBABU; KAPC+BLS, its start and anchor per client).
@pytest.mark.parametrize('case,momentum', [
    ('global', None), ('prox', 0.9), ('prox', None), ('own_start', None), ('own_anchor', 0.9),
    ('own_anchor', None)])
def test_factored_training_equals_the_per_step_update(spec, case, momentum):
  """Clients of 7, 23 and 12 examples in batches of 5 (partial batches, idle steps), 2, 1 and
  3 epochs: the factored training gives the per-step update's kernels and metrics."""
  rng = np.random.default_rng(7)
  optimizer = optimizers.sgdm(learning_rate=0.05, momentum=momentum)
  inputs = _client_inputs(rng, (7, 23, 12), (2, 1, 3), 5)
  model = spec.keras_fn()
  global_trainable = tuple(w.numpy() for w in model.trainable_weights)
  k = len(inputs)
  start = client_terms = None
  regularizer = client_regularizer = None
  if case == 'prox':
    regularizer = ProximalRegularizer(0.3)
  if case in ('own_start', 'own_anchor'):
    start = tuple(np.stack([w + 0.01 * rng.normal(size=w.shape).astype(np.float32)
                            for _ in range(k)]) for w in global_trainable)
  if case == 'own_anchor':
    client_terms = collections.OrderedDict(
        anchor=tuple(np.stack([w + 0.05 * rng.normal(size=w.shape).astype(np.float32)
                               for _ in range(k)]) for w in global_trainable),
        mask=np.asarray([[1, 1, 0, 1], [1, 0, 1, 1], [0, 1, 1, 1]], np.float32))
    client_regularizer = lambda terms: ProximalRegularizer(  # pylint: disable=g-long-lambda
        0.4, anchor=terms['anchor'], tensor_mask=tuple(terms['mask'][i] for i in range(4)))
  outs = []
  for factor in (True, False):
    work = vectorized.VectorizedClientWork(spec, optimizer, regularizer,
                                           client_regularizer=client_regularizer,
                                           factor_dense=factor)
    if factor:  # Forced: these rounds are longer than `worth_factoring` takes.
      work.factored_kernels = lambda data: frozenset({0, 2})
    out, _ = work.train(inputs, global_trainable, start=start, client_terms=client_terms)
    outs.append(out)
    assert work.factored_traces == ({(0, 2)} if factor else set())
  factored, per_step = outs
  for a, b in zip(factored['trained'], per_step['trained']):
    np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6)
  for a, b in zip(factored['sums'], per_step['sums']):
    np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6)
  # The clients moved (the comparison is not of untouched start weights).
  moved = factored['trained'][0].numpy() - (
      global_trainable[0] if start is None else start[0])
  assert np.min(np.abs(moved).reshape(k, -1).max(axis=1)) > 1e-4


def test_worth_factoring_compares_the_history_with_the_kernel():
  # mlp2's hidden kernel, 784 x 200: 6 steps of 10 (100 clients x 60) factor, 60 do not.
  assert factored_dense.worth_factoring(784, 200, 60)
  assert factored_dense.worth_factoring(784, 200, 159)
  assert not factored_dense.worth_factoring(784, 200, 160)
  assert not factored_dense.worth_factoring(784, 200, 600)
  assert not factored_dense.worth_factoring(784, 10, 10)  # Logistic regression's kernel.


def test_which_kernels_a_round_factors(spec):
  optimizer = optimizers.sgdm(learning_rate=0.05, momentum=0.9)
  work = vectorized.VectorizedClientWork(spec, optimizer)
  assert work._dense_kernels == {0: (784, 200), 2: (200, 10)}  # pylint: disable=protected-access
  short = {'index': np.zeros([1, 6, 100, 10])}
  long = {'index': np.zeros([1, 60, 10, 10])}
  assert work.factored_kernels(short) == frozenset({0})
  assert work.factored_kernels(long) == frozenset()
  # Not with another optimizer (its update is not SGD(M)'s), nor when switched off.
  adam = vectorized.VectorizedClientWork(spec, tff.learning.optimizers.build_adam(0.01))
  assert adam.factored_kernels(short) == frozenset()
  # ... and its rounds train (the mapped optimizer's step; nothing factored).
  model = spec.keras_fn()
  out, _ = adam.train(_client_inputs(np.random.default_rng(1), (7, 12), (1, 2), 5),
                      tuple(w.numpy() for w in model.trainable_weights))
  assert adam.factored_traces == set()
  assert np.abs(out['trained'][0].numpy() - model.trainable_weights[0].numpy()).max() > 0
  off = vectorized.VectorizedClientWork(spec, optimizer, factor_dense=False)
  assert off.factored_kernels(short) == frozenset()


def test_experiment_factor_dense_false_reaches_the_vectorised_work(spec, data, cpp):
  from fltff.errors import ConfigError  # pylint: disable=g-import-not-at-top
  from fltff.runtime import InProcessRuntime  # pylint: disable=g-import-not-at-top
  from fltff.simulation.experiment import choose_client_work  # pylint: disable=g-import-not-at-top

  short = {'index': np.zeros([1, 6, 100, 10])}
  for factor, expected in ((True, frozenset({0})), (False, frozenset())):
    for method in ('fedavg', 'kapc'):
      rt = InProcessRuntime()
      try:
        algorithm = equality_methods()[method](spec)
        algorithm, _ = choose_client_work(algorithm, 'vectorised', factor, rt)
        rt.place(algorithm)
        assert _trained_works(algorithm).factored_kernels(short) == expected, (method, factor)
      finally:
        rt.close()
  tff.framework.set_default_context(cpp)
  with pytest.raises(ConfigError, match='experiment.factor_dense must be True or False'):
    choose_client_work(equality_methods()['fedavg'](spec), 'vectorised', 'no')
