"""The one protocol (`fltff.learning.protocol`) and the one driver that speaks it (issue 13).

Every method — global, with client state, personalised, wrapped with FedLap personalisation —
runs through `protocol.run_round` with its client states in and out; the driver keeps them in
one store, and checkpoints from before the single store (client states under `method/`)
still resume to the same numbers.
"""

import functools
import json
import os
import re
import shutil

import numpy as np
import pytest
import tensorflow_federated as tff

from fltff import learning
from fltff import personalization
from fltff.errors import ConfigError
from fltff.learning import protocol
from fltff.personalization.fedlap_mixing import FedLapPersonalization
from fltff.personalization.fedlap_mixing import with_fedlap_personalization
from fltff.simulation import RoundConfig
from fltff.simulation import RoundDriver
from fltff.simulation.state_store import ClientStateStore
from fltff.learning import optimizers
from helpers import client_batches
from helpers import mnist_sample_split
from helpers import read_csv

NUM_CLIENTS = 5
SGD = functools.partial(tff.learning.optimizers.build_sgdm, learning_rate=0.05)


@pytest.fixture(scope='module')
def data():
  return mnist_sample_split(NUM_CLIENTS, seed=2, local_test_examples=20)


def _round(algorithm, state, store, data, clients):
  return protocol.run_round(
      algorithm, state, clients,
      batches_of=lambda k: client_batches(*data.client_arrays(k), 32, shuffle_seed=k),
      epochs_of=lambda k: 1, num_examples_of=lambda k: len(data.train_indices[k]),
      client_state_of=store.get)[0]


def test_client_states_go_in_and_out_the_same_way_for_every_kind(data, spec):
  fedavg = learning.build_fedavg(spec, client_optimizer=SGD())
  scaffold = learning.build_scaffold(spec, NUM_CLIENTS, client_optimizer=SGD())
  kapc = personalization.build_kapc(spec, NUM_CLIENTS, client_optimizer=SGD())
  for algorithm, stateful in ((fedavg, False), (scaffold, True), (kapc, True)):
    assert isinstance(algorithm, protocol.FederatedAlgorithm)
    assert algorithm.has_client_state == stateful
    store = ClientStateStore(algorithm.initial_client_state)
    out = _round(algorithm, algorithm.initialize(), store, data, [3, 1])
    assert sorted(out.clients) == [1, 3]
    assert out.train['num_examples'] == sum(len(data.train_indices[k]) for k in (1, 3))
    assert sorted(out.client_states) == ([1, 3] if stateful else [])
    assert len(out.bytes_down) == len(out.bytes_up) == 2
  # SCAFFOLD's new c_i has the model's trainable shapes; KAPC's state is the personal model,
  # the server's copy and Ω (nothing else travels).
  shapes = [w.shape for w in spec.initial_weights().trainable]
  out = _round(scaffold, scaffold.initialize(), ClientStateStore(scaffold.initial_client_state),
               data, [0])
  assert [np.shape(c) for c in out.client_states[0]] == shapes
  out = _round(kapc, kapc.initialize(), ClientStateStore(kapc.initial_client_state), data, [2, 4])
  assert list(out.client_states[4]) == ['model', 'server_copy', 'omega']
  assert out.arrays['clients'].tolist() == out.clients


def test_personalised_inputs_are_refused_unless_they_are_the_server_inputs_clients(data, spec):
  """Each client input is matched to the row of its client in `server_input`: an input of a
  client it does not list trained from another client's row (the first), and a listed client
  without an input took another's trained model as its new state, silently. Refused in one
  line, on TFF's runtime and vectorised alike."""
  local = personalization.build_local(spec, NUM_CLIENTS, client_optimizer=SGD())
  for algorithm in (local, local.with_vectorized_clients()):
    states = {k: algorithm.initial_client_state(k) for k in range(NUM_CLIENTS)}
    server_input = algorithm.server_input([0, 1], [states[0], states[1]], [1.0, 1.0])
    for clients in ([0, 2], [1, 0], [0]):
      inputs = [algorithm.client_input(client_batches(*data.client_arrays(k), 32), k, 1,
                                       states[k]) for k in clients]
      with pytest.raises(ConfigError, match=re.escape(
          f'client inputs of clients {clients} for a server input of clients [0, 1]')):
        algorithm.next(algorithm.initialize(), server_input, inputs)


def test_fedlap_personalization_wraps_a_global_method_and_refuses_a_personalised_one(data,
                                                                                    spec):
  base = learning.build_fedavg(spec, client_optimizer=SGD())
  wrapped = with_fedlap_personalization(base, FedLapPersonalization(spec, SGD()))
  store = ClientStateStore(wrapped.initial_client_state)
  state = wrapped.initialize()
  out = _round(wrapped, state, store, data, [0, 2])
  # The global round is FedAvg's own: the same new weights as the bare method.
  bare = _round(base, base.initialize(), ClientStateStore(base.initial_client_state), data,
                [0, 2])
  for a, b in zip(wrapped.global_model_weights(out.state).trainable,
                  base.global_model_weights(bare.state).trainable):
    np.testing.assert_array_equal(a, b)
  # Each participant's local model moved from the initial model (trained on its own data).
  initial = spec.initial_weights().trainable
  assert sorted(out.client_states) == [0, 2]
  assert not np.allclose(out.client_states[0]['local']['trainable'][0], initial[0])
  # Its personalised model mixes local and global layer by layer (β = degree with 'fixed').
  fixed = with_fedlap_personalization(base, FedLapPersonalization(spec, SGD(), degree=0.25,
                                                                  mixing='fixed'))
  personal = fixed.personal_weights(out.state, out.client_states[0])
  expected = (0.25 * out.client_states[0]['local']['trainable'][0] +
              0.75 * np.asarray(base.global_model_weights(out.state).trainable[0]))
  np.testing.assert_allclose(personal['trainable'][0], expected, rtol=1e-6)
  kapc = personalization.build_kapc(spec, NUM_CLIENTS, client_optimizer=SGD())
  with pytest.raises(ConfigError, match='personalised already'):
    with_fedlap_personalization(kapc, FedLapPersonalization(spec, SGD()))
  # Nor around personal models (Ditto's: its round would get their inputs, not the method's).
  with pytest.raises(ConfigError, match='ditto is personalised already'):
    with_fedlap_personalization(personalization.build_ditto(spec, client_optimizer=SGD()),
                                FedLapPersonalization(spec, SGD()))


def _drive(algorithm, data, out, rounds, resume=False):
  config = RoundConfig(rounds=rounds, clients_per_round=3, batch_size=32, checkpoint_every=2,
                       seed=4)
  RoundDriver(algorithm, data, config, str(out), progress=lambda _: None).run(resume=resume)
  return read_csv(os.path.join(out, 'metrics.csv'))


def _as_legacy_checkpoint(out, round_num):
  """Rewrites a checkpoint as before the single store: client states under `method/`."""
  path = os.path.join(out, 'checkpoints', f'round_{round_num:05d}.npz')
  arrays = dict(np.load(path))
  assert any(k.startswith('client/') for k in arrays)
  legacy = {(('method/' + k[len('client/'):]) if k.startswith('client/') else k): v
            for k, v in arrays.items()}
  with open(path, 'wb') as f:
    np.savez(f, **legacy)


@pytest.mark.parametrize('method', ['scaffold', 'kapc'])
def test_a_checkpoint_from_before_the_single_store_resumes_exactly(method, data, spec,
                                                                  tmp_path):
  if method == 'scaffold':
    algorithm = learning.build_scaffold(spec, NUM_CLIENTS, client_optimizer=SGD())
  else:
    algorithm = personalization.build_kapc(spec, NUM_CLIENTS, client_optimizer=SGD())
  full = _drive(algorithm, data, tmp_path / 'full', rounds=4)
  _drive(algorithm, data, tmp_path / 'part', rounds=2)
  _as_legacy_checkpoint(tmp_path / 'part', 2)
  resumed = _drive(algorithm, data, tmp_path / 'part', rounds=4, resume=True)
  local = 'global_local_accuracy' if method == 'scaffold' else 'personal_local_accuracy'
  columns = ('train_loss', 'train_accuracy', local, 'bytes_up')
  assert [[r[c] for c in columns] for r in resumed] == [[r[c] for c in columns] for r in full]
  final = [np.load(os.path.join(tmp_path / run, 'checkpoints', 'round_00004.npz'))
           for run in ('full', 'part')]
  assert sorted(final[0]) == sorted(final[1])
  for key in final[0]:
    np.testing.assert_array_equal(final[0][key], final[1][key], err_msg=key)


def test_a_checkpoint_holds_the_model_a_kapc_state_holds_twice_once(data, spec, tmp_path):
  # KAPC uploads every layer: a participant's server copy is its new model, the same arrays,
  # written once (a cnn2 checkpoint at N = 100: 0.69 GB, not 1.38) and restored as one.
  kapc = personalization.build_kapc(spec, NUM_CLIENTS, client_optimizer=SGD())
  _drive(kapc, data, tmp_path, rounds=2)
  with np.load(tmp_path / 'checkpoints' / 'round_00002.npz') as npz:
    arrays = {key: npz[key] for key in npz.files}
  clients = {int(key.split('/')[1]) for key in arrays if key.startswith('client/')}
  assert len(clients) >= 3
  model_bytes = sum(w.nbytes for w in spec.initial_weights().trainable)
  assert sum(a.nbytes for key, a in arrays.items() if key.startswith('client/')) == (
      len(clients) * (model_bytes + np.dtype(np.int32).itemsize))  # A model and Ω each.
  store = ClientStateStore(kapc.initial_client_state)
  store.restore(2, arrays, kapc.initial_client_state)
  for k in clients:
    state = store.get(k)
    assert all(copy is own for copy, own in zip(state['server_copy'],
                                                state['model']['trainable']))


def test_a_layer_not_uploaded_keeps_the_servers_stale_copy_as_its_own_array(data, spec):
  # KAPC+BLS on a first selection: Ω = L − 1 = 1 (Algorithm 4, `test_bls`), so mlp2's second
  # layer is not uploaded and the server keeps its previous copy of it.
  kapc = personalization.build_kapc(spec, NUM_CLIENTS, client_optimizer=SGD(), bls_mu=0.5)
  store = ClientStateStore(kapc.initial_client_state)
  rng = np.random.default_rng(0)
  stale = {}
  for k in (1, 3):
    state = store.get(k)
    state['server_copy'] = [rng.normal(size=np.shape(w)).astype(np.float32)
                            for w in state['server_copy']]
    stale[k] = [w.copy() for w in state['server_copy']]
    store.set(k, state)
  out = _round(kapc, kapc.initialize(), store, data, [1, 3])
  layer_of = kapc.parts.layer_of
  for k in out.clients:
    omega = int(out.client_states[k]['omega'])
    assert omega < max(layer_of) + 1  # Something was not uploaded.
    new = out.client_states[k]
    for t, layer in enumerate(layer_of):
      if layer < omega:  # Uploaded: the server's copy is the client's new model.
        np.testing.assert_array_equal(new['server_copy'][t], new['model']['trainable'][t])
      else:  # Not uploaded: the stale copy, in an array of its own (no view of the round's
        np.testing.assert_array_equal(new['server_copy'][t], stale[k][t])  # [P, ...] stack).
        assert new['server_copy'][t].base is None


@pytest.mark.parametrize('store', ['memory', 'sqlite'])
def test_a_resume_whose_client_states_are_gone_is_refused_not_reset(store, data, spec, tmp_path):
  """Deleting client_states.sqlite (or the checkpoint's client arrays) must not resume with
  every client silently back at its initial state: one CheckpointError, nothing resumed."""
  from fltff.errors import CheckpointError  # pylint: disable=g-import-not-at-top

  algorithm = personalization.build_local(spec, NUM_CLIENTS, client_optimizer=SGD())

  def drive(rounds, resume):
    config = RoundConfig(rounds=rounds, clients_per_round=3, batch_size=32, checkpoint_every=2,
                         seed=4, client_state_store=store)
    RoundDriver(algorithm, data, config, str(tmp_path), progress=lambda _: None).run(
        resume=resume)

  drive(2, resume=False)
  header = (tmp_path / 'metrics.csv').read_text().splitlines()[0]
  drive(3, resume=True)  # Intact: resumes.
  assert [r['round'] for r in read_csv(tmp_path / 'metrics.csv')] == ['1', '2', '3']
  # The columns keep their order (rows restored from a checkpoint have sorted keys).
  assert (tmp_path / 'metrics.csv').read_text().splitlines()[0] == header
  assert header.startswith('round,')
  checkpoint = tmp_path / 'checkpoints' / 'round_00003.npz'
  if store == 'sqlite':
    for name in os.listdir(tmp_path):
      if name.startswith('client_states.sqlite'):
        os.remove(tmp_path / name)
  else:
    arrays = {k: v for k, v in np.load(checkpoint).items() if not k.startswith('client/')}
    with open(checkpoint, 'wb') as f:
      np.savez(f, **arrays)
  expected = ('client_states.sqlite is missing' if store == 'sqlite' else
              'client states do not match the checkpoint of round 3')
  with pytest.raises(CheckpointError, match=expected):
    drive(4, resume=True)
  assert [r['round'] for r in read_csv(tmp_path / 'metrics.csv')] == ['1', '2', '3']


class _Stopped(Exception):
  pass


def test_a_second_signal_checkpoints_the_last_completed_round(data, spec, tmp_path):
  """`StopSignal.before_exit` (what a second SIGTERM runs before the process ends) checkpoints
  the rounds completed since the last checkpoint."""
  from fltff.cli import StopSignal  # pylint: disable=g-import-not-at-top
  from fltff.simulation.checkpoint import Checkpointer  # pylint: disable=g-import-not-at-top

  stop = StopSignal()
  seen = []

  def progress(line):
    if line.startswith('round    2/'):
      stop.set()
      for save in list(stop.before_exit):
        save()
      seen.append(Checkpointer(str(tmp_path)).latest_round())
      raise _Stopped  # The process would end here (os._exit).

  config = RoundConfig(rounds=5, clients_per_round=3, batch_size=32, checkpoint_every=100, seed=4)
  algorithm = personalization.build_local(spec, NUM_CLIENTS, client_optimizer=SGD())
  with pytest.raises(_Stopped):
    RoundDriver(algorithm, data, config, str(tmp_path), progress=progress,
                stop_event=stop).run()
  assert seen == [2]
  assert not stop.before_exit  # The driver unregisters itself.


def test_a_resume_without_a_checkpoint_logs_each_round_once(data, spec, tmp_path):
  algorithm = personalization.build_local(spec, NUM_CLIENTS, client_optimizer=SGD())

  def drive(resume):
    config = RoundConfig(rounds=2, clients_per_round=3, batch_size=32, checkpoint_every=2,
                         seed=4)
    RoundDriver(algorithm, data, config, str(tmp_path), progress=lambda _: None).run(
        resume=resume)

  def logged():
    with open(tmp_path / 'measurements.jsonl') as f:
      return [json.loads(line)['round'] for line in f if line.strip()]

  drive(resume=False)
  assert logged() == [1, 2]
  shutil.rmtree(tmp_path / 'checkpoints')  # E.g. a run stopped before its first checkpoint.
  drive(resume=True)
  assert logged() == [1, 2]


def test_a_resume_that_reruns_rounds_leaves_each_round_once_in_tensorboard(data, spec, tmp_path):
  from tensorboard.backend.event_processing import event_accumulator  # pylint: disable=g-import-not-at-top

  algorithm = personalization.build_local(spec, NUM_CLIENTS, client_optimizer=SGD())

  def drive(rounds, resume):
    config = RoundConfig(rounds=rounds, clients_per_round=3, batch_size=32, checkpoint_every=2,
                         seed=4)
    RoundDriver(algorithm, data, config, str(tmp_path), progress=lambda _: None).run(
        resume=resume)

  drive(3, resume=False)  # Rounds 1-3 logged; the checkpoint holds round 2.
  drive(4, resume=True)  # Round 3 runs again.
  events = event_accumulator.EventAccumulator(str(tmp_path / 'tensorboard'))
  events.Reload()
  for tag in ('train_loss', 'clients'):
    assert [e.step for e in events.Tensors(tag)] == [1, 2, 3, 4], tag
  rows = read_csv(tmp_path / 'metrics.csv')
  assert [float(e.tensor_proto.float_val[0]) if e.tensor_proto.float_val else None
          for e in events.Tensors('train_loss')][2] == pytest.approx(float(rows[2]['train_loss']))


def test_vectorised_rounds_outside_the_in_process_executor_are_a_clear_error(data, spec):
  # The session's context is TFF's C++ runtime, where a vectorised round cannot run unplaced.
  fedavg = learning.build_fedavg(spec, client_optimizer=SGD()).with_vectorized_clients()
  store = ClientStateStore(fedavg.initial_client_state)
  with pytest.raises(ConfigError, match=r'InProcessRuntime\(\).*rt\.place\(algorithm\)'):
    _round(fedavg, fedavg.initialize(), store, data, [3, 1])


def test_a_personalised_round_without_its_server_input_is_a_clear_error(data, spec):
  kapc = personalization.build_kapc(spec, NUM_CLIENTS, client_optimizer=SGD())
  inputs = [kapc.client_input(client_batches(*data.client_arrays(k), 32), k, 1,
                              kapc.initial_client_state(k)) for k in (0, 1)]
  # Before: TypeError "'NoneType' object is not subscriptable".
  with pytest.raises(ConfigError, match=r'server input of clients None: give '
                                        r'algorithm\.server_input\(clients'):
    kapc.next(kapc.initialize(), None, inputs)


def test_negative_or_fractional_local_epochs_are_refused_and_zero_is_a_client_input(data, spec):
  # `client_input(..., epochs=-1)` trained nothing, silently; 0 is legitimate (a straggler past
  # the deadline), as is a NumPy integer (`channel.deadline_epochs`).
  from fltff.learning.client_work import client_info_of_input  # pylint: disable=g-import-not-at-top

  fedavg = learning.build_fedavg(spec, client_optimizer=SGD())
  kapc = personalization.build_kapc(spec, NUM_CLIENTS, client_optimizer=SGD())
  batches = client_batches(*data.client_arrays(2), 32)
  for algorithm in (fedavg, fedavg.with_vectorized_clients(), kapc):
    state = algorithm.initial_client_state(2)
    for epochs, problem in ((-1, 'be >= 0, got -1'), (1.5, 'be an integer, got 1.5'),
                            (True, 'be an integer, got True')):
      with pytest.raises(ConfigError, match=f"client 2's local epochs must {problem}"):
        algorithm.client_input(batches, 2, epochs, state)
    for epochs in (0, np.int64(3)):
      assert client_info_of_input(algorithm.client_input(batches, 2, epochs, state)) == {
          'client_index': 2, 'epochs': epochs}
  with pytest.raises(ConfigError, match="client 4's local epochs must be >= 0, got -2"):
    learning.client_input(batches, 4, -2)
