"""Evaluation protocols (`fltff.simulation.evaluation`): each against a NumPy reference on a
tiny federation, the headline statistics against NumPy on hand-made rows, and the refusals."""

import functools

import numpy as np
import pytest
import tensorflow_federated as tff

from fltff import learning
from fltff import personalization
from fltff.data.pipeline import ClientDatasets
from fltff.errors import ConfigError
from fltff.simulation import RoundConfig
from fltff.simulation import RoundDriver
from fltff.simulation import evaluation
from fltff.learning import ModelSpec
from fltff.learning import optimizers
from fltff.learning import protocol
from helpers import mnist_sample_split
from test_vectorized import _small_batchnorm_model

NUM_CLIENTS = 4
LR = 0.05
SGD = functools.partial(tff.learning.optimizers.build_sgdm, learning_rate=LR)


@pytest.fixture(autouse=True)
def vectorised_clients_run_in_process(in_process):
  del in_process


@pytest.fixture(scope='module')
def data():
  return mnist_sample_split(NUM_CLIENTS, seed=5, local_test_examples=20)


def numpy_accuracy(weights, x, y) -> float:
  """mlp2 (784-200-10, ReLU) in NumPy: the fraction of `y` its argmax logit gets right."""
  kernel1, bias1, kernel2, bias2 = (np.asarray(w, np.float64) for w in weights)
  h = np.maximum(x.reshape(len(x), -1).astype(np.float64) / 255.0 @ kernel1 + bias1, 0.0)
  return float(np.mean(np.argmax(h @ kernel2 + bias2, axis=-1) == y))


def drive(algorithm, data, tmp_path, evaluation_protocols, rounds=2, finetuner=None,
          headline='best_round_mean', clients_per_round=NUM_CLIENTS):
  algorithm = algorithm.with_vectorized_clients()
  config = RoundConfig(rounds=rounds, clients_per_round=clients_per_round, local_epochs=1,
                       batch_size=16, checkpoint_every=10, evaluation=evaluation_protocols,
                       headline_statistic=headline)
  driver = RoundDriver(algorithm, data, config, str(tmp_path), progress=lambda _: None,
                       finetuner=finetuner)
  return driver


def test_every_global_protocol_matches_numpy_on_the_models_it_names(data, spec, tmp_path):
  """One FedAvg round by hand: global_local tests the new global model, trained_local each
  participant's trained model (whose example-weighted mean is the new global model), central the
  global model on the central test set."""
  algorithm = learning.build_fedavg(spec, client_optimizer=SGD())
  driver = drive(algorithm, data, tmp_path, ['trained_local', 'global_local', 'central'])
  algorithm = driver.algorithm  # Its clients vectorised (`drive`).
  state = algorithm.initialize()
  state, row, _ = driver.run_round(state, 1)
  row.update(driver.evaluate(state, 1))
  trained = [np.asarray(t) for t in algorithm.trained_weights().trainable]
  clients = driver._round_clients  # pylint: disable=protected-access
  assert sorted(clients) == list(range(NUM_CLIENTS))
  sizes = np.asarray([len(data.train_indices[k]) for k in clients], np.float64)
  global_weights = [np.asarray(w) for w in algorithm.global_model_weights(state).trainable]
  for t, g in zip(trained, global_weights):  # FedAvg's aggregate of the reported models.
    np.testing.assert_allclose(np.tensordot(sizes / sizes.sum(), t, axes=1), g, atol=2e-6)

  expected_trained = {k: numpy_accuracy([t[i] for t in trained], *data.local_test_arrays(k))
                      for i, k in enumerate(clients)}
  expected_global = {k: numpy_accuracy(global_weights, *data.local_test_arrays(k))
                     for k in clients}
  got = {p: dict(v) for p, v in row['_clients'].items()}
  assert got['trained_local'] == pytest.approx(expected_trained)
  assert got['global_local'] == pytest.approx(expected_global)
  assert row['trained_local_accuracy'] == pytest.approx(np.mean(list(expected_trained.values())))
  assert row['global_local_accuracy'] == pytest.approx(np.mean(list(expected_global.values())))
  assert row['test_accuracy'] == pytest.approx(
      numpy_accuracy(global_weights, *data.central_test()))
  # After local training the clients' own models fit their skewed labels better than the
  # global model does: the two protocols really test different models.
  assert row['trained_local_accuracy'] > row['global_local_accuracy']


def test_one_participant_at_server_rate_one_trains_the_global_model(data, spec, tmp_path):
  """With a single participant, FedAvg's new global model is that client's trained model, so
  trained_local and global_local agree exactly."""
  algorithm = learning.build_fedavg(spec, client_optimizer=SGD())
  driver = drive(algorithm, data, tmp_path, ['trained_local', 'global_local'],
                 clients_per_round=1)
  algorithm = driver.algorithm  # Its clients vectorised (`drive`).
  state = algorithm.initialize()
  for r in (1, 2):
    state, row, _ = driver.run_round(state, r)
    row.update(driver.evaluate(state, r))
    assert row['trained_local_accuracy'] == pytest.approx(row['global_local_accuracy'], abs=1e-9)


def test_finetuned_local_is_fedavg_local_training_of_the_whole_model(data, spec, tmp_path):
  """FedBABU's fine-tuning trains body and head from the global model: the same numbers as a
  FedAvg participant's local training on the same batches; with learning rate 0 it changes
  nothing, so finetuned_local equals global_local."""
  fedbabu = learning.build_fedbabu(spec, client_optimizer=SGD())
  tuner = evaluation.Finetuner(spec, SGD(), epochs=1)
  driver = drive(fedbabu, data, tmp_path / 'babu', ['finetuned_local', 'global_local'],
                 finetuner=tuner)
  fedbabu = driver.algorithm
  state = fedbabu.initialize()
  state, row, _ = driver.run_round(state, 1)
  row.update(driver.evaluate(state, 1))
  clients = list(driver._round_clients)  # pylint: disable=protected-access
  global_weights = fedbabu.global_model_weights(state)
  tuned = [np.asarray(t) for t in tuner(global_weights, [(k, driver.client_batches(1, k))
                                                         for k in clients]).trainable]
  # The reference: FedAvg's vectorised round from FedBABU's global model on the same batches.
  fedavg = learning.build_fedavg(spec, client_optimizer=SGD()).with_vectorized_clients()
  ref_state = fedavg.process.set_model_weights(fedavg.initialize(), global_weights)
  from fltff.learning import protocol  # pylint: disable=g-import-not-at-top
  protocol.run_round(fedavg, ref_state, clients, batches_of=lambda k: driver.client_batches(1, k),
                     epochs_of=lambda k: 1, num_examples_of=lambda k: 1.0,
                     client_state_of=lambda k: None)
  for a, b in zip(tuned, fedavg.trained_weights().trainable):
    np.testing.assert_allclose(a, np.asarray(b), rtol=1e-5, atol=1e-6)
  expected = {k: numpy_accuracy([t[i] for t in tuned], *data.local_test_arrays(k))
              for i, k in enumerate(clients)}
  assert dict(row['_clients']['finetuned_local']) == pytest.approx(expected)

  frozen = evaluation.Finetuner(
      spec, optimizers.sgdm(learning_rate=0.0), epochs=1)
  driver = drive(fedbabu, data, tmp_path / 'zero', ['finetuned_local', 'global_local'],
                 finetuner=frozen)
  state = driver.algorithm.initialize()
  state, row, _ = driver.run_round(state, 1)
  row.update(driver.evaluate(state, 1))
  assert row['finetuned_local_accuracy'] == row['global_local_accuracy']


def test_personal_local_tests_each_clients_own_model(data, spec, tmp_path):
  algorithm = personalization.build_local(spec, NUM_CLIENTS, client_optimizer=SGD())
  driver = drive(algorithm, data, tmp_path, None)
  assert driver.protocols == ('personal_local',)
  algorithm = driver.algorithm  # Its clients vectorised (`drive`).
  state = algorithm.initialize()
  state, row, client_states = driver.run_round(state, 1)
  driver.client_states.set_many(client_states, 1)
  row.update(driver.evaluate(state, 1))
  expected = {}
  for k in range(NUM_CLIENTS):
    weights = algorithm.personal_weights(state, driver.client_states.get(k))
    weights = weights['trainable'] if isinstance(weights, dict) else weights.trainable
    expected[k] = numpy_accuracy(weights, *data.local_test_arrays(k))
  assert dict(row['_clients']['personal_local']) == pytest.approx(expected)


BATCHNORM_SPEC = ModelSpec(_small_batchnorm_model, (28, 28, 1), 10)


def test_a_global_model_on_batchnorm_is_tested_with_its_aggregated_statistics(data, tmp_path):
  """A global method's server averages the participants' BatchNorm moving statistics
  (`process.build_statistics_mean`), so every protocol that tests the global model runs; after
  10 FedAvg rounds its central accuracy is above that of the same weights with the initial
  statistics (0, 1), which the global model kept before (0.655 against 0.625: Keras's moving
  averages, momentum 0.99, have come some 80% of the way in the rounds' 150 steps)."""
  fedavg = learning.build_fedavg(BATCHNORM_SPEC, client_optimizer=SGD())
  driver = drive(fedavg, data, tmp_path,
                 ['central', 'global_local', 'finetuned_local', 'trained_local'],
                 finetuner=evaluation.Finetuner(BATCHNORM_SPEC, SGD(), epochs=1))
  state = driver.algorithm.initialize()
  for r in range(1, 11):
    state, _, _ = driver.run_round(state, r)
  row = driver.evaluate(state, 10)
  weights = driver.algorithm.global_model_weights(state)
  initial = BATCHNORM_SPEC.initial_weights().non_trainable
  assert all(np.abs(np.asarray(w) - i).max() > 1e-2 for w, i in zip(weights.non_trainable,
                                                                     initial))
  driver.evaluator.set_weights({'trainable': weights.trainable, 'non_trainable': initial})
  untrained = driver.evaluator.evaluate(*data.central_test())['accuracy']
  assert row['test_accuracy'] > untrained + 0.02, (row['test_accuracy'], untrained)
  assert 0 < row['global_local_accuracy'] <= 1 and 0 < row['finetuned_local_accuracy'] <= 1
  # trained_local tests each participant's model with its own trained statistics.
  trained = driver.algorithm.trained_weights().non_trainable
  assert [np.shape(t) for t in trained] == [(NUM_CLIENTS, *np.shape(i)) for i in initial]
  assert np.abs(trained[0][0] - trained[0][1]).max() > 1e-3
  assert 0 < row['trained_local_accuracy'] <= 1


def test_personal_and_global_models_on_batchnorm_are_tested(data, tmp_path):
  """Ditto's personal models carry their own BatchNorm statistics, its global model the
  participants' mean: both are tested (`global_model_local_accuracy`, and
  `personalized_accuracy`, which takes the global model for clients never trained)."""
  ditto = personalization.build_ditto(BATCHNORM_SPEC, client_optimizer=SGD())
  driver = drive(ditto, data, tmp_path, ['personal_local'], clients_per_round=2)
  state = driver.algorithm.initialize()
  state, row, client_states = driver.run_round(state, 1)
  driver.client_states.set_many(client_states, 1)
  row.update(driver.evaluate(state, 1))
  assert 0 < row['personal_local_accuracy'] <= 1
  assert 0 < row['global_model_local_accuracy'] <= 1 and 0 < row['personalized_accuracy'] <= 1


def test_fedlap_personalised_models_on_batchnorm_take_the_local_models_statistics(data):
  """FedLap personalisation mixes the local and global trainable weights; the statistics are
  the local model's own trained ones (its client's data), not the global model's mean."""
  from fltff import methods  # pylint: disable=g-import-not-at-top
  fedlap = methods.build('fedavg+fedlap_personalization', BATCHNORM_SPEC,
                         client_optimizer=SGD()).with_vectorized_clients()
  datasets = ClientDatasets(data.client_arrays, 16)
  state = fedlap.initialize()
  out, _ = protocol.run_round(fedlap, state, [0, 1], batches_of=lambda k: datasets.batches(k, k),
                              epochs_of=lambda k: 1, num_examples_of=lambda k: 1.0,
                              client_state_of=fedlap.initial_client_state)
  local = out.client_states[1]['local']['non_trainable']
  personal = fedlap.personal_weights(out.state, out.client_states[1])['non_trainable']
  assert not np.array_equal(local[0], BATCHNORM_SPEC.initial_weights().non_trainable[0])
  for a, b in zip(personal, local):
    np.testing.assert_array_equal(a, b)


ROWS = [
    {'round': 1, 'trained_local_accuracy': 0.5, '_clients': {'trained_local': [[0, 0.2], [1, 0.8]]}},
    {'round': 2, 'trained_local_accuracy': 0.6, '_clients': {'trained_local': [[0, 0.7], [1, 0.5]]}},
    {'round': 3, 'trained_local_accuracy': 0.55, '_clients': {'trained_local': [[1, 0.55], [2, 0.9]]}},
]


def test_headline_statistics_against_numpy():
  per_round = np.array([0.5, 0.6, 0.55])
  best = evaluation.headline(ROWS, 'trained_local', 'best_round_mean')
  assert best['value'] == per_round.max() and best['round'] == 2
  # Client 0's best is round 2, client 1's round 1, client 2 was evaluated once.
  clients = evaluation.headline(ROWS, 'trained_local', 'mean_client_best')
  assert clients['value'] == pytest.approx(np.mean([0.7, 0.8, 0.9]))
  assert clients['clients'] == 3
  # Never below the best round's mean (each client's best is at least its value there).
  assert clients['value'] >= best['value']
  assert evaluation.headline([], 'central', 'best_round_mean')['value'] is None


@pytest.mark.parametrize('protocols, personalized, local, trained, fragment', [
    (['central', 'nonsense'], False, True, True, "unknown protocol 'nonsense'"),
    ('central', False, True, True, 'non-empty list'),
    (['central', 'central'], False, True, True, 'twice'),
    (['central'], True, True, True, 'only personal_local'),
    (['personal_local'], False, True, True, 'use trained_local'),
    (['global_local'], False, False, True, 'local_test_examples'),
    (['trained_local'], False, True, False, 'vectorised client work'),
    # Ditto or experiment.personalization: the personal models are what a client has.
    (['personal_local', 'trained_local'], 'personal models', True, True,
     'has personal models .* use personal_local'),
])
def test_protocols_that_cannot_run_are_refused_in_one_line(protocols, personalized, local,
                                                           trained, fragment):
  with pytest.raises(ConfigError, match=fragment):
    evaluation.check_protocols(protocols, personalized is True, local, trained,
                               personal_models=personalized == 'personal models')


def test_an_empty_evaluation_list_is_refused_not_defaulted(data, spec, tmp_path):
  algorithm = learning.build_fedavg(spec, client_optimizer=SGD())
  with pytest.raises(ConfigError, match=r'non-empty list of protocols .*got \[\]'):
    drive(algorithm, data, tmp_path, [])
  assert drive(algorithm, data, tmp_path, None).protocols == ('central', 'global_local')


def test_finetuned_local_needs_a_method_that_fine_tunes(data, spec, tmp_path):
  algorithm = learning.build_fedavg(spec, client_optimizer=SGD())
  with pytest.raises(ConfigError, match='FedBABU has'):
    drive(algorithm, data, tmp_path, ['finetuned_local'])


def test_a_mean_of_client_bests_needs_a_local_headline_protocol(data, spec, tmp_path):
  """`central` has one accuracy a round and no clients, so its mean of client bests was None in
  summary.json's headline, silently; refused in one line (also when central is the default)."""
  fedavg = learning.build_fedavg(spec, client_optimizer=SGD())
  for protocols in (['central', 'global_local'], None):
    with pytest.raises(ConfigError, match="'mean_client_best' .* headline protocol is central"):
      drive(fedavg, data, tmp_path, protocols, headline='mean_client_best')
  assert drive(fedavg, data, tmp_path, ['global_local', 'central'],
               headline='mean_client_best').protocols[0] == 'global_local'


def test_target_accuracies_need_the_central_protocol(data, spec, tmp_path):
  """summary.json's `rounds_to_target` reads test_accuracy: a run without central read every
  target as never reached (null), silently; refused in one line."""
  local = personalization.build_local(spec, NUM_CLIENTS, client_optimizer=SGD())
  config = RoundConfig(rounds=2, target_accuracies=[0.5])
  with pytest.raises(ConfigError, match='target_accuracies .* central'):
    RoundDriver(local, data, config, str(tmp_path), progress=lambda _: None)


def test_the_summary_names_the_protocols_and_the_headline(data, spec, tmp_path):
  algorithm = learning.build_fedavg(spec, client_optimizer=SGD())
  driver = drive(algorithm, data, tmp_path, ['global_local', 'central'],
                 headline='mean_client_best')
  summary = driver.run()
  assert summary['evaluation'] == ['global_local', 'central']
  head = summary['headline']
  assert head['protocol'] == 'global_local' and head['statistic'] == 'mean_client_best'
  bests = evaluation.client_bests(driver.rows, 'global_local')
  assert head['value'] == pytest.approx(np.mean(list(bests.values())))
  assert summary['mean_client_best_global_local_accuracy'] == pytest.approx(head['value'])
  assert summary['best_global_local_accuracy'] == max(r['global_local_accuracy']
                                                      for r in driver.rows)
  header = open(tmp_path / 'metrics.csv').readline().strip().split(',')
  assert 'global_local_accuracy' in header and '_clients' not in header
