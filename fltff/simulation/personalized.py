"""Round driver for personalised processes (KAPC, FedAMP, FedBN, Local; see
`fltff.personalization.process`).

Each client's state in the driver's store is `OrderedDict(model=<its personal ModelWeights as
arrays>, server_copy=<the server's latest copy of its trainable weights, stale layers
included>, omega=<its last Ω>)`. Per round the driver passes the participants' personal models
(CLIENTS) and the server's copies (SERVER, stacked in participant order) into the process and
writes both back from the result — only after the round passed the divergence check. The
server copies belong to the server's side of the algorithm (KAPC's server keeps the latest
model of every client); the store is simply where they survive between rounds and in
checkpoints.

Evaluation is personalised: the mean accuracy of the round's clients, each with its own model,
on its own local test split (the KAPC paper's metric); the best over rounds is the summary's
`best_mean_local_accuracy`.
"""

from __future__ import annotations

import os
import time

import numpy as np

from fltff.errors import ConfigError
from fltff.simulation.driver import RoundDriver
from fltff.simulation.driver import _finite_tree
from fltff.simulation.driver import split_measurements
from fltff.simulation.state_store import ClientStateStore


class PersonalizedRoundDriver(RoundDriver):
  """`RoundDriver` for a `PersonalizedAlgorithm`."""

  def __init__(self, algorithm, data, config, output_dir, **kwargs):
    if kwargs.get('personalization') is not None:
      raise ConfigError(f'{algorithm.name} is personalised already; remove '
                        'experiment.personalization.')
    if data.local_test_indices is None:
      raise ConfigError(f'{algorithm.name} is evaluated on local test splits: set '
                        'federated_data.local_test_examples > 0.')
    super().__init__(algorithm, data, config, output_dir, **kwargs)
    self.method_states = ClientStateStore(lambda k: algorithm.new_client_state())

  def client_state_template(self, client_index: int):
    del client_index
    return self.algorithm.new_client_state()

  def restore(self, template_state):
    round_num, state, meta, arrays = self.checkpointer.restore(template_state)
    self.rows = [r for r in meta['rows'] if r['round'] <= round_num]
    self.outputs.truncate_measurements(round_num)
    self.method_states.load_arrays(arrays, template_fn=self.client_state_template,
                                   prefix='method')
    return round_num, state

  def save(self, round_num: int, state) -> None:
    super().save(round_num, state)
    # The relationship cube for the report's heatmap (KAPC paper, Fig. 7).
    np.save(os.path.join(self.output_dir, 'relationship.npy'), np.asarray(state['relation']))

  def algorithm_bytes_down(self) -> int:
    return int(sum(self.algorithm.layer_sizes_bytes))

  def algorithm_bytes_up(self) -> int:
    return int(sum(self.algorithm.layer_sizes_bytes))

  def initial_state(self):
    return self.call(self.process.initialize)

  def is_finite(self, new_state, pending) -> bool:
    return _finite_tree(new_state) and all(
        _finite_tree(s['model']['trainable']) for s in pending['method_states'].values())

  def client_inputs(self, round_num, clients, epochs=None):
    from fltff.data.pipeline import client_batches  # pylint: disable=g-import-not-at-top
    from fltff.simulation import sampling  # pylint: disable=g-import-not-at-top

    inputs = []
    for k in clients:
      x, y = self.data.client_arrays(k)
      ds = client_batches(x, y, self.config.batch_size,
                          sampling.shuffle_seed(self.config.seed, round_num, k))
      e = self.config.local_epochs if epochs is None else epochs[k]
      inputs.append(self.algorithm.client_input(ds, k, e, self.method_states.get(k)))
    return inputs

  def run_round(self, state, round_num: int):
    clients, epochs, dropped = self.plan_round(round_num)
    inputs = self.client_inputs(round_num, clients, epochs)
    server_start = time.perf_counter()
    server_input = self.algorithm.server_input(
        clients, [self.method_states.get(k) for k in clients],
        [len(self.data.train_indices[k]) for k in clients])
    server_seconds = time.perf_counter() - server_start
    start = time.perf_counter()
    output = self.call(self.process.next, state, server_input, inputs)
    seconds = time.perf_counter() - start
    result = output.result
    server_start = time.perf_counter()
    pending = {'method_states': self.algorithm.next_client_states(result,
                                                                  self.method_states.get)}
    order = [int(k) for k in np.asarray(result['clients'])]
    server_seconds += time.perf_counter() - server_start
    measurements = dict(output.measurements)
    train = measurements.pop('train')
    scalars, arrays = split_measurements(measurements)
    bytes_down = np.asarray(result['bytes_down'], np.float64)
    bytes_up = np.asarray(result['bytes_up'], np.float64)
    row = self.round_row(round_num, train, clients, epochs, dropped, bytes_down.sum(),
                         bytes_up.sum(), seconds)
    row.update(scalars)
    # The server's R update runs inside the TFF round, so the measured round time covers it;
    # `server_seconds` here is the driver's server-side bookkeeping (copies in and out).
    row.update(self.system_columns(order, epochs, bytes_down, bytes_up, seconds,
                                   server_seconds))
    arrays['omega'] = np.asarray(result['omega'])
    arrays['clients'] = np.asarray(order)
    self.outputs.log_arrays(round_num, arrays)
    return output.state, row, pending

  def evaluate(self, state) -> dict[str, float]:
    del state
    accuracy = self.mean_local_accuracy(lambda k: self.method_states.get(k)['model'])
    return {'mean_local_accuracy': accuracy}

  def summary(self) -> dict:
    """Adds the server's memory for the method: its state (KAPC's R `[N, L, N]`; pFedLA's
    hypernetworks too) plus one model copy per client (the stale layers KAPC keeps)."""
    from fltff.learning.model_spec import type_num_bytes  # pylint: disable=g-import-not-at-top

    out = super().summary()
    state = type_num_bytes(self.process.initialize.type_signature.result.member)
    out['server_memory_mb'] = (state + self.num_clients * self.algorithm_bytes_up()) / 1e6
    return out
