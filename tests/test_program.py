"""A fltff process under TFF's program API: `tff.learning.programs.train_model` with a
`tff.program.FileProgramStateManager`, resumed exactly after a stop."""

import asyncio

import numpy as np
import pytest
import tensorflow_federated as tff

from fltff import learning
from fltff.learning import ModelSpec
from fltff.simulation import program
from fltff.learning import optimizers
from helpers import random_client_arrays
from helpers import tiny_mlp

DIM, CLASSES = 4, 3
SPEC = ModelSpec(lambda: tiny_mlp(DIM, CLASSES, 13), (DIM,), CLASSES)


def _arrays(seed=0, sizes=(6, 9, 7, 8)):
  return random_client_arrays(sizes, seed, DIM, CLASSES)


def _train(runtime, algorithm, source, state_dir, rounds):
  """`train_model` under the runtime's program context; the final released model."""
  models = tff.program.MemoryReleaseManager()
  tff.framework.set_default_context(runtime.program_context())
  try:
      asyncio.run(tff.learning.programs.train_model(
        train_process=program.as_dataset_process(algorithm, epochs=2),
        train_data_source=source, train_per_round_clients=2,
        train_total_rounds=rounds,
        program_state_manager=tff.program.FileProgramStateManager(str(state_dir)),
        model_output_manager=models, evaluation_manager=None, evaluation_periodicity=1))
  finally:
    tff.framework.set_default_context(runtime.context)
  (key, state), = models.values().items()  # The final LearningAlgorithmState.
  assert key == f'training_checkpoint_round_{rounds}'
  return [np.asarray(w) for w in state.global_model_weights.trainable]


def _algorithm():
  return learning.build_fedprox(SPEC, mu=0.1,
                                client_optimizer=optimizers.sgdm(0.1))


def test_train_model_equals_our_own_loop_and_resumes_exactly(tmp_path, tff_runtime):
  algorithm = _algorithm()
  source = program.ClientInputDataSource(_arrays(), batch_size=4, epochs=2, seed=5,
                                         batches_only=True)
  full = _train(tff_runtime, algorithm, source, tmp_path / 'full', 3)
  # The same three rounds by hand on fltff's own process and client inputs (client index 0,
  # as the wrapper packs them): train_model and the wrapper add nothing.
  iterator = program.ClientInputDataSource(_arrays(), batch_size=4, epochs=2, seed=5).iterator()
  state = algorithm.process.initialize()
  for _ in range(3):
    inputs = [learning.client_input(data['batches'], 0, 2) for data in iterator.select(2)]
    state = algorithm.process.next(state, inputs).state
  for a, b in zip(full, algorithm.process.get_model_weights(state).trainable):
    np.testing.assert_allclose(a, b, atol=1e-6)
  # Stopped after round 2, then run to 3 rounds from the saved program state (the server
  # state and the data iterator's position): the same final model. The second call gets a
  # source with another seed: only a real resume (iterator restored from the program state,
  # rounds 1-2 not redone) gives the uninterrupted model.
  _train(tff_runtime, algorithm, source, tmp_path / 'part', 2)
  other = program.ClientInputDataSource(_arrays(), batch_size=4, epochs=2, seed=6,
                                        batches_only=True)
  resumed = _train(tff_runtime, algorithm, other, tmp_path / 'part', 3)
  fresh = _train(tff_runtime, algorithm, other, tmp_path / 'fresh', 3)
  assert max(float(np.max(np.abs(a - b))) for a, b in zip(full, fresh)) > 1e-4
  for a, b in zip(full, resumed):
    np.testing.assert_allclose(a, b, atol=1e-6)
  assert not all(np.allclose(a, b) for a, b in zip(full, SPEC.initial_weights().trainable))


@pytest.mark.parametrize('batches_only', [False, True])
def test_iterator_round_trips_through_bytes(batches_only):
  iterator = program.ClientInputDataSource(_arrays(), batch_size=4, epochs=1, seed=2,
                                           batches_only=batches_only).iterator()
  iterator.select(3)
  copy = type(iterator).from_bytes(iterator.to_bytes())
  assert copy == iterator
  assert copy.federated_type == iterator.federated_type
  assert [d['info'] if not batches_only else d for d in copy.select(2)]


def test_methods_that_need_client_identity_are_refused():
  from fltff.errors import ConfigError  # pylint: disable=g-import-not-at-top
  with pytest.raises(ConfigError, match='fedlayerwise needs each client'):
    program.as_dataset_process(learning.build_fedlayerwise(SPEC, num_clients=3), epochs=1)


def test_the_arrays_of_federated_data_are_read_as_the_model_reads_them():
  """`FederatedData.client_arrays` holds uint8 images; before, their batches were uint8 and
  `train_model` stopped in TFF's traceback ('Cannot serialize dataset with elements of type
  <x=uint8...')."""
  x = np.arange(2 * 4, dtype=np.uint8).reshape(2, 4) * 30
  source = program.ClientInputDataSource([(x, np.array([1, 0], np.int64))], batch_size=2,
                                         epochs=1, batches_only=True)
  assert str(source.federated_type) == '{<x=float32[?,4],y=int32[?]>*}@CLIENTS'
  batch = next(iter(source.iterator().select(1)[0]))
  order = np.argsort(batch['y'].numpy())[::-1]  # Shuffled: back to the arrays' order.
  np.testing.assert_allclose(batch['x'].numpy()[order], x / 255, rtol=1e-6)

