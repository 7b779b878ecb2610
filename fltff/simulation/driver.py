"""The round driver: sampling, local epochs, evaluation, metrics, checkpoints, resume.

One driver for every method, speaking only `fltff.learning.protocol`; the client states live
in one `ClientStateStore`, saved in every checkpoint. Every random choice (participants, data
order) is a function of `(seed, round, client)`, so a resumed run ends with exactly an
uninterrupted run's metrics. Data flow: docs/architecture.md.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
import resource
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional

import numpy as np
import tensorflow as tf

from fltff.data.pipeline import ClientDatasets
from fltff.config_checks import check_choice
from fltff.config_checks import check_number
from fltff.config_checks import check_seed
from fltff.errors import CheckpointError
from fltff.errors import ConfigError
from fltff.errors import DivergenceError
from fltff.errors import StopRequested
from fltff.errors import warn
from fltff.learning import protocol
from fltff.simulation import sampling
from fltff.simulation.channel import deadline_epochs
from fltff.simulation.channel import round_time_breakdown
from fltff.simulation.checkpoint import Checkpointer
from fltff.simulation.checkpoint import kept_message
from fltff.simulation import evaluation as evaluation_lib
from fltff.simulation.evaluation import Evaluator
from fltff.simulation.outputs import RunOutputs
from fltff.simulation.outputs import finite
from fltff.simulation.outputs import rounds_to_targets
from fltff.simulation.state_store import STORE_KINDS
from fltff.simulation.state_store import ClientStateStore
from fltff.simulation.state_store import SqliteClientStateStore


@dataclasses.dataclass
class RoundConfig:
  """What a round does (gin's `experiment` settings), checked when built."""

  rounds: int = 10
  clients_per_round: Optional[int] = None
  client_fraction: Optional[float] = None
  local_epochs: int = 1
  batch_size: int = 10
  eval_every: int = 1
  checkpoint_every: int = 5
  target_accuracies: Sequence[float] = ()
  seed: int = 0
  straggler_fraction: float = 0.0
  straggler_mode: str = 'partial'
  round_deadline: Optional[float] = None
  compute_seconds_per_example: float = 1e-4
  client_state_store: str = 'memory'
  evaluation: Optional[Sequence[str]] = None
  headline_statistic: str = 'best_round_mean'

  def __post_init__(self) -> None:
    for name in ('rounds', 'local_epochs', 'batch_size', 'eval_every', 'checkpoint_every'):
      check_number(f'experiment.{name}', getattr(self, name), integer=True, low=1)
    check_number('experiment.clients_per_round', self.clients_per_round, integer=True,
                 allow_none=True)
    targets = self.target_accuracies
    if isinstance(targets, str) or not isinstance(targets, (list, tuple)) or not all(
        isinstance(t, numbers.Real) and not isinstance(t, bool) and 0 < t <= 1 for t in targets):
      raise ConfigError(f'experiment.target_accuracies must be a list of accuracies in (0, 1], '
                        f'got {targets!r}.')
    self.target_accuracies = tuple(targets)
    check_seed('experiment.seed', self.seed)
    check_number('experiment.client_fraction', self.client_fraction, allow_none=True)
    check_number('experiment.straggler_fraction', self.straggler_fraction, low=0, high=1)
    check_choice('experiment.straggler_mode', self.straggler_mode, ('partial', 'drop'))
    check_number('experiment.round_deadline', self.round_deadline, allow_none=True, low=0,
                 open_low=True, hint='seconds')
    check_choice('experiment.client_state_store', self.client_state_store, STORE_KINDS)
    check_choice('experiment.headline_statistic', self.headline_statistic,
                 evaluation_lib.HEADLINE_STATISTICS)
    check_number('experiment.compute_seconds_per_example', self.compute_seconds_per_example,
                 low=0, open_low=True)


class RoundDriver:
  """Runs any `protocol.FederatedAlgorithm` on `FederatedData` for `config.rounds` rounds."""

  def __init__(self, algorithm: protocol.FederatedAlgorithm, data, config: RoundConfig,
               output_dir: str, progress: Callable[[str], None] = print, runtime=None,
               stop_event=None, channel=None, finetuner=None, record: Optional[dict] = None,
               client_work_reason: Optional[str] = None):
    """`record`: what the rounds are computed from (config, data, model); each checkpoint
    carries it, `config.gin` is written from it once a resume is verified, and
    `outputs.check_resume` compares a resume's with it.
    `client_work_reason`: why 'auto' left the clients unvectorised (`choose_client_work`)."""
    if config.round_deadline is not None and channel is None:
      raise ConfigError('experiment.round_deadline needs a channel model: set '
                        'experiment.channel = @channel_model.')
    if algorithm.personal_models and data.local_test_indices is None:
      raise ConfigError(f'{algorithm.name} evaluates personal models on local test splits: '
                        'set federated_data.local_test_examples > 0.')
    self.channel = channel
    has_local = data.local_test_indices is not None
    self.evaluator = Evaluator(algorithm.model_spec)
    # Only an unset evaluation takes the default: an empty list is refused, not defaulted.
    self.protocols = evaluation_lib.check_protocols(
        config.evaluation if config.evaluation is not None else
        (('personal_local',) if algorithm.personalized else
         ('central', 'global_local') if has_local else ('central',)),
        algorithm.personalized, has_local, algorithm.reports_trained_weights,
        algorithm.personal_models)
    if config.headline_statistic == 'mean_client_best' and self.protocols[0] == 'central':
      raise ConfigError("experiment.headline_statistic = 'mean_client_best' averages each "
                        "client's best round; the headline protocol is central (the first of "
                        "experiment.evaluation), which tests no clients: put a local protocol "
                        "first, or use 'best_round_mean'.")
    if config.target_accuracies and 'central' not in self.protocols:
      raise ConfigError('experiment.target_accuracies are read on the central test accuracy '
                        '(summary.json rounds_to_target), which this run does not evaluate: '
                        'add central to experiment.evaluation, or unset them.')
    # The runtime that runs the rounds ('auto': by the client work chosen); it fails over.
    self.runtime = (runtime.place(algorithm, 'trained_local' in self.protocols)
                    if runtime is not None else None)
    self.call = self.runtime.call if self.runtime is not None else protocol.direct_call
    self.algorithm = algorithm
    self.client_work_reason = client_work_reason
    self.data = data
    if 'finetuned_local' in self.protocols and finetuner is None:
      raise ConfigError(f'experiment.evaluation: finetuned_local needs a fine-tuning '
                        f'procedure, and {algorithm.name} has none (FedBABU has).')
    self.finetuner = finetuner
    self.run_info: dict = {}  # Written into the summary as it is (e.g. the run's seeds).
    self.segments: list[dict] = []  # Which rounds each process ran, on what code (`run`).
    self.config = config
    self.output_dir = output_dir
    self.progress = progress
    self.num_clients = data.num_clients()
    self.participants = sampling.num_participants(self.num_clients, config.clients_per_round,
                                                  config.client_fraction)
    sampling.check_stragglers(self.participants, config.local_epochs, config.straggler_fraction,
                              config.straggler_mode)
    self.record = record
    # All per-client state (SCAFFOLD's controls, MOON's previous models, personal models...).
    self.client_states = (ClientStateStore(algorithm.initial_client_state)
                          if config.client_state_store == 'memory' else
                          SqliteClientStateStore(output_dir, algorithm.initial_client_state))
    self.datasets = ClientDatasets(data.client_arrays, config.batch_size)
    self.outputs = RunOutputs(output_dir)
    self.checkpointer = Checkpointer(output_dir)
    self._checkpoint_costs: list[tuple[float, int]] = []  # (seconds, npz bytes) per save.
    self.rows: list[dict] = []
    self.stop_event = stop_event
    self._round_clients: list[int] = []
    self._round_arrays: dict = {}
    self._trained: Optional[tuple] = None
    self._loss_warned = False

  # -- one round ---------------------------------------------------------------------------
  def client_batches(self, round_num: int, client_index: int):
    """Client k's shuffled batches for round `round_num` (order a function of seed, round, k)."""
    return self.datasets.batches(client_index,
                                 sampling.shuffle_seed(self.config.seed, round_num, client_index))

  def plan_round(self, round_num: int):
    """`(participants, local epochs by client, dropped)`: stragglers from `straggler_fraction`
    or, with `round_deadline`, the channel (the whole epochs of `compute_seconds_per_example` ×
    examples that fit after the sampled clients' full-size transfers; none: dropped; a round
    with none left: `ConfigError`)."""
    cfg = self.config
    sampled = sampling.sample_clients(self.num_clients, self.participants, cfg.seed, round_num)
    epochs, dropped = sampling.straggler_plan(sampled, cfg.local_epochs, cfg.straggler_fraction,
                                              cfg.straggler_mode, cfg.seed, round_num)
    if cfg.round_deadline is not None:
      sizes = np.asarray([len(self.data.train_indices[k]) for k in sampled], np.float64)
      seconds = (self.channel.download_seconds(sampled, self.algorithm.bytes_down_per_client),
                 self.channel.upload_seconds(sampled, self.algorithm.bytes_up_per_client),
                 sizes * cfg.compute_seconds_per_example)
      fit = deadline_epochs(*seconds, cfg.local_epochs, cfg.round_deadline)
      # The quickest of the clients the straggler plan kept: the deadline alone drops them.
      kept = [i for i, k in enumerate(sampled) if int(k) not in dropped]
      epochs = {int(k): min(int(epochs[int(k)]), int(e)) for k, e in zip(sampled, fit)}
      dropped = set(dropped) | {int(k) for k, e in zip(sampled, fit) if e == 0}
      if len(dropped) == len(sampled):  # Nothing to aggregate: no round to run.
        raise ConfigError(
            f'experiment.round_deadline = {cfg.round_deadline:g} s drops every participant of '
            f'round {round_num} (the quickest of its {len(kept)} needs '
            f'{min(sum(seconds)[kept]):.4g} s for its download, one epoch and its upload). '
            f'{kept_message(self.checkpointer.directory, self.checkpointer.latest_round() or 0)}'
            '; raise the deadline.')
    return [int(k) for k in sampled if int(k) not in dropped], epochs, dropped

  def run_round(self, state, round_num: int):
    """One round: `(new_state, metrics row, the participants' new client states)`, the states
    not yet stored (`run` commits them once the round is known to be good)."""
    clients, epochs, dropped = self.plan_round(round_num)
    out, seconds = protocol.run_round(
        self.algorithm, state, clients,
        batches_of=lambda k: self.client_batches(round_num, k),
        epochs_of=lambda k: epochs[k],
        num_examples_of=lambda k: len(self.data.train_indices[k]),
        client_state_of=self.client_states.get, call=self.call)
    scalars, arrays = split_measurements(out.measurements)
    # Every sampled client downloads: a dropped one (at full size) before it is dropped.
    bytes_down = np.append(out.bytes_down, [self.algorithm.bytes_down_per_client] * len(dropped))
    row = {  # The metrics.csv columns every method has, then the method's measurements.
        'round': round_num,
        'train_loss': float(out.train['loss']),
        'train_accuracy': float(out.train['accuracy']),
        'examples': int(out.train['num_examples']),
        'clients': len(clients),
        'stragglers': sum(1 for k in clients if epochs[k] < self.config.local_epochs),
        'dropped': len(dropped),
        'bytes_down': int(bytes_down.sum()),
        'bytes_up': int(out.bytes_up.sum()),
        'round_seconds': seconds,
        **scalars,
    }
    if self.channel is not None and out.clients:
      # The simulated time breakdown (KAPC paper, Table 5), the downloads sharing the band as
      # `plan_round` assumed; compute is the deadline's model of the planned epochs or, without
      # a deadline, the measured training time apportioned by examples × epochs.
      down = self.channel.download_seconds([*out.clients, *sorted(dropped)], bytes_down)
      work = np.asarray([len(self.data.train_indices[k]) * epochs[k] for k in out.clients],
                        np.float64)
      if self.config.round_deadline is not None:
        compute = work * self.config.compute_seconds_per_example
      else:
        compute = seconds * work / max(work.sum(), 1.0)
      times = round_time_breakdown(down[:len(out.clients)], compute,
                                   self.channel.upload_seconds(out.clients, out.bytes_up),
                                   out.server_seconds)
      row.update({f'sim_{key}': float(value) for key, value in times.items()
                  if key != 'slowest_client_position'})
      # The mean download over every client that downloaded, the dropped included.
      row['sim_download_seconds'] = float(np.mean(down))
    arrays.update(out.arrays)
    self._round_arrays = arrays  # Logged with the evaluation's per-client arrays (`run`).
    self._round_clients = list(out.clients)
    self._trained = (self.algorithm.trained_weights() if 'trained_local' in self.protocols
                     else None)
    return out.state, row, out.client_states

  def evaluate(self, state, round_num: int) -> dict:
    """The round's evaluation under `self.protocols`, the local ones testing the round's
    participants (KAPC's "selected clients", §7.2): the mean goes to the protocol's column,
    per-client values to the row's `_clients` and measurements.jsonl."""
    out: dict = {}
    per_client: dict = {}
    global_weights = (None if self.algorithm.personalized else
                      self.algorithm.global_model_weights(state))
    clients = self._round_clients
    for protocol_name in self.protocols:
      column = evaluation_lib.PROTOCOL_COLUMNS[protocol_name]
      if protocol_name == 'central':
        self.evaluator.set_weights(global_weights)
        result = self.evaluator.evaluate(*self.data.central_test())
        out.update(test_loss=result['loss'], test_accuracy=result['accuracy'])
        continue
      if protocol_name == 'global_local':
        weights_of = lambda k: global_weights
      elif protocol_name == 'personal_local':
        weights_of = lambda k: self.algorithm.personal_weights(state, self.client_states.get(k))
      else:  # trained_local, finetuned_local: the participants' models stacked [K, ...].
        stacked = self._trained if protocol_name == 'trained_local' else self.finetuner(
            global_weights, [(k, self.client_batches(round_num, k)) for k in clients])
        position = {k: i for i, k in enumerate(clients)}
        weights_of = lambda k: {part: [np.asarray(t[position[k]]) for t in tensors]
                                for part, tensors in (('trainable', stacked.trainable),
                                                      ('non_trainable', stacked.non_trainable))}
      accuracies = self.local_accuracies(weights_of, clients)
      out[column] = float(np.mean(list(accuracies.values()))) if accuracies else float('nan')
      per_client[protocol_name] = [[int(k), float(a)] for k, a in accuracies.items()]
    if per_client:
      out['_clients'] = per_client
    if self.algorithm.personal_models and not self.algorithm.personalized:
      # Every client on its local test split, with its personal model (the global one for a
      # client that has never taken part) and with the global model (with trained statistics).
      everyone = range(self.num_clients)
      global_local = self.local_accuracies(lambda k: global_weights, everyone)
      personal = global_local | self.local_accuracies(
          lambda k: self.algorithm.personal_weights(state, self.client_states.get(k)),
          [k for k in everyone if k in self.client_states])
      out.update(personalized_accuracy=float(np.mean(list(personal.values()))),
                 global_model_local_accuracy=float(np.mean(list(global_local.values()))))
    return out

  def local_accuracies(self, weights_of: Callable[[int], Any],
                       clients: Sequence[int]) -> dict[int, float]:
    """Accuracy of each of `clients` on its local test split (if any), with `weights_of(k)`."""
    accuracies = {}
    for k in clients:
      x, y = self.data.local_test_arrays(k)
      if len(y):
        self.evaluator.set_weights(weights_of(k))
        accuracies[k] = self.evaluator.evaluate(x, y)['accuracy']
    return accuracies

  # -- checkpoints -------------------------------------------------------------------------
  def save(self, round_num: int, state) -> None:
    t0 = time.perf_counter()
    stem = self.checkpointer.save(
        round_num, state, {'rows': self.rows, 'run': self.record, 'segments': self.segments,
                           'client_states': self.client_states.fingerprint(round_num)},
        self.client_states.checkpoint(round_num))
    self.client_states.prune(self.checkpointer.rounds())
    # Its cost (seconds, file size) must grow with the clients changed, not the population.
    self._checkpoint_costs.append((time.perf_counter() - t0, os.path.getsize(stem + '.npz')))
    for name, array in self.algorithm.round_files(state).items():
      np.save(os.path.join(self.output_dir, name), array)

  def restore(self, template_state):
    """The newest intact checkpoint's round and state, its client states verified against the
    checkpoint's fingerprint before any output is rewritten."""
    round_num, state, meta, arrays = self.checkpointer.restore(template_state)
    self.client_states.restore(round_num, arrays, self.algorithm.initial_client_state)
    expected = meta.get('client_states')  # Absent in checkpoints written before the check.
    if expected is not None:
      found = self.client_states.fingerprint(round_num)
      if any(found.get(key) != value for key, value in expected.items()):
        raise CheckpointError(
            f'the client states do not match the checkpoint of round {round_num} (it has '
            f'{expected["clients"]} clients with a state, the store has {found["clients"]}'
            f'{"" if found["clients"] != expected["clients"] else ", with other contents"}): '
            f'{self.config.client_state_store} store of {self.output_dir} missing or changed. '
            'Nothing was resumed or changed: restore the store from a copy, or start the run '
            'again in a new --output_dir.')
    self.rows = [r for r in meta['rows'] if r['round'] <= round_num]
    # Absent in checkpoints written before them: what made their rounds is unknown.
    self.segments = meta.get('segments') or [dict(
        first_round=1, last_round=round_num, fltff_version=None, fltff_commit=None, executor=None)]
    # Continued past a last round evaluated off the eval_every grid: rows as if uninterrupted.
    if round_num % self.config.eval_every and round_num < self.config.rounds:
      for key in ('_clients', 'test_loss', 'personalized_accuracy', 'global_model_local_accuracy',
                  *evaluation_lib.PROTOCOL_COLUMNS.values()):
        self.rows[-1].pop(key, None)
    # Later rounds' rows and measurements go now: a resume that stops before its first round
    # must leave none that the kept state lacks.
    self.outputs.write_rows(self.rows)
    self.outputs.truncate_measurements(round_num)
    return round_num, state

  # -- the loop ----------------------------------------------------------------------------
  def run(self, resume: bool = False) -> dict:
    cfg = self.config
    latest = self.checkpointer.latest_round() if resume else None
    if cfg.round_deadline is not None:  # A round the deadline leaves empty: refused up front.
      for r in range((latest or 0) + 1, cfg.rounds + 1):
        self.plan_round(r)
    if self.runtime is not None:
      reason = self.client_work_reason
      self.progress(f'{self.algorithm.name} runs on {self.runtime.description}'
                    + (f" (experiment.client_work = 'auto': {reason})" if reason else '.'))
    state = self.algorithm.initialize(self.call)
    start_round = 1
    if latest is None:
      self.client_states.reset()
    if resume:
      if latest is None:
        self.progress(f'No checkpoint in {self.checkpointer.directory}; starting from round 1.')
        self.outputs.truncate_measurements(0)  # Rounds a stopped run logged are redone.
      else:
        last, state = self.restore(state)
        start_round = last + 1
        self.progress(f'Resumed from the checkpoint of round {last}.')
      self.outputs.restart_at(start_round)
    # This process's segment; `last_round` and `executor` follow its completed rounds.
    self.segments.append(dict(first_round=start_round, last_round=None, **{
        k: self.run_info.get(k) for k in ('fltff_version', 'fltff_commit')}, executor=None))
    # Written once the inputs are verified and the state restored: a refused resume leaves the
    # run's record as it was.
    if self.record is not None:
      self.outputs.write_text('config.gin', self.record['config'])
    self.outputs.write_json('partition.json', self.data.summary())

    # The last completed round and its state, and the last checkpointed round: a second
    # signal checkpoints the former (`save_completed`), so no completed round is lost.
    self._last_saved = start_round - 1
    self._last_good = (start_round - 1, state)
    self._consistent = True
    # Held by `save_completed`, which a second signal may run on another thread while this
    # one computes: a round's recording waits for that save instead of changing the store
    # under it (re-entrant: the signal handler may run in this thread inside `_recording`).
    self._save_lock = threading.RLock()
    before_exit = getattr(self.stop_event, 'before_exit', None)
    if before_exit is not None:
      before_exit.append(self.save_completed)
    t0 = time.perf_counter()
    try:
      for r in range(start_round, cfg.rounds + 1):
        state, row, client_states = self.run_round(state, r)
        self.check_divergence(row, state, client_states)
        # From here until round r is recorded, the client store holds round r's states and
        # the last completed round is r - 1: no checkpoint can pair them.
        self._recording()
        self.client_states.set_many(client_states, r)
        arrays = self._round_arrays
        if r % cfg.eval_every == 0 or r == cfg.rounds:
          row.update(self.evaluate(state, r))
          for protocol_name, values in row.get('_clients', {}).items():
            arrays[f'eval/{protocol_name}/clients'] = np.asarray([k for k, _ in values], np.int64)
            arrays[f'eval/{protocol_name}/accuracy'] = np.asarray([a for _, a in values])
        if arrays:
          self.outputs.log_arrays(r, arrays, scalar_tags=row)
        previous = self.rows[-1] if self.rows else {}
        row['mb_down_cumulative'] = previous.get('mb_down_cumulative', 0.0) + row['bytes_down'] / 1e6
        row['mb_up_cumulative'] = previous.get('mb_up_cumulative', 0.0) + row['bytes_up'] / 1e6
        if 'sim_round_seconds' in row:
          row['sim_time_cumulative'] = (previous.get('sim_time_cumulative', 0.0) +
                                        row['sim_round_seconds'])
        self.rows.append(row)
        self.segments[-1].update(last_round=r, executor=self.runtime and self.runtime.description)
        self._last_good = (r, state)
        self._consistent = True
        self.outputs.log_scalars(row)
        self.outputs.write_rows(self.rows)
        if r % cfg.checkpoint_every == 0 or r == cfg.rounds:
          self._recording()
          self.save(r, state)
          self._last_saved = r
          self._consistent = True
        done = r - start_round + 1
        eta = (time.perf_counter() - t0) / done * (cfg.rounds - r)
        acc = row.get(evaluation_lib.PROTOCOL_COLUMNS[self.protocols[0]])
        self.progress(
            f'round {r:4d}/{cfg.rounds} | {self.protocols[0]} acc '
            f'{"  -   " if acc is None else f"{acc:.4f}"} | train loss {row["train_loss"]:.4f} '
            f'| {row["round_seconds"]:.2f} s | ETA {eta:.0f} s')
        if self.runtime is not None and r < cfg.rounds:
          # E.g. recycles the local worker (runtime.recycle_every), sets the RPC deadline.
          self.runtime.after_round(r, row['round_seconds'])
        if self.stop_event is not None and self.stop_event.is_set() and r < cfg.rounds:
          raise StopRequested(
              f'Stopped by signal after round {r}. '
              f'{kept_message(self.checkpointer.directory, r)}: rerun with --resume to continue.')
    finally:
      if before_exit is not None and self.save_completed in before_exit:
        before_exit.remove(self.save_completed)
      # Whatever stopped the loop, completed rounds are kept (see `save_completed`).
      self.save_completed()
      if self.rows:
        self.outputs.write_json('summary.json', self.summary())
        self.outputs.plot(self.rows, f'{self.algorithm.name} on {self.data.dataset.name}')
        self.outputs.plot_matrices()
      self.outputs.close()
      self.client_states.close()
    return self.summary()

  def _recording(self) -> None:
    """Marks the client store and the last completed round as not to be paired (a round being
    recorded or checkpointed); first waits for a `save_completed` in progress."""
    with self._save_lock:
      self._consistent = False

  def save_completed(self) -> None:
    """Checkpoints the last completed round unless it is already (a second signal's
    `StopSignal.before_exit`, on any thread); a no-op while a round is being recorded."""
    with self._save_lock:
      if not self._consistent or self._last_good[0] <= self._last_saved:
        return
      self._consistent = False
      try:
        self.save(*self._last_good)
        self._last_saved = self._last_good[0]
      finally:
        self._consistent = True

  LOSS_WARNING_FACTOR = 1e3

  def check_divergence(self, row: dict, new_state, client_states: dict) -> None:
    """`DivergenceError` if the round's loss, new server state (global methods: its trainable
    weights) or client states are not finite. Warns once if the training loss exceeds
    `LOSS_WARNING_FACTOR` × ln(classes), a uniform guess's loss: divergence that may never
    reach NaN (round 1, which may already explode, is no reference). The run goes on."""
    checked = (new_state if self.algorithm.personalized else
               self.algorithm.global_model_weights(new_state).trainable)
    if not math.isfinite(row['train_loss']) or not all(
        np.all(np.isfinite(x)) for x in map(np.asarray, tf.nest.flatten(
            [checked, list(client_states.values())])) if x.dtype.kind == 'f'):
      raise DivergenceError(
          f'Training diverged in round {row["round"]}: the loss or the model weights became '
          f'NaN/inf. {kept_message(self.checkpointer.directory, row["round"] - 1)}; lower '
          'client_optimizer.learning_rate (or the server learning rate) and rerun.')
    limit = self.LOSS_WARNING_FACTOR * math.log(max(self.algorithm.model_spec.num_classes, 2))
    if not self._loss_warned and row['train_loss'] > limit:
      self._loss_warned = True
      warn(f'training loss {row["train_loss"]:.4g} in round {row["round"]} is over '
           f'{self.LOSS_WARNING_FACTOR:g} x ln(classes) = {limit:.4g}: the run is likely '
           'diverging; consider a lower client_optimizer.learning_rate.')

  def summary(self) -> dict:
    evals = [r for r in self.rows if 'test_accuracy' in r]
    best = max(evals, key=lambda r: r['test_accuracy']) if evals else None
    extra = {**self.run_info, 'segments': self.segments, 'evaluation': list(self.protocols),
             'headline': evaluation_lib.headline(self.rows, self.protocols[0],
                                                 self.config.headline_statistic)}
    for protocol_name in [p for p in self.protocols if p != 'central']:
      column = evaluation_lib.PROTOCOL_COLUMNS[protocol_name]
      best_local = evaluation_lib.headline(self.rows, protocol_name, 'best_round_mean')
      if best_local['value'] is not None:
        final = [r[column] for r in self.rows if finite(r.get(column))][-1]
        extra.update({f'final_{column}': final, f'best_{column}': best_local['value'],
                      f'best_{column}_round': best_local['round'],
                      f'mean_client_best_{column}': evaluation_lib.headline(
                          self.rows, protocol_name, 'mean_client_best')['value']})
    if self.rows and 'sim_time_cumulative' in self.rows[-1]:
      extra['sim_time_total'] = self.rows[-1]['sim_time_cumulative']
      extra['sim_round_seconds_mean'] = float(np.mean([r['sim_round_seconds']
                                                       for r in self.rows]))
    extra.update(self.algorithm.summary_extras(self.num_clients))
    if self._checkpoint_costs:
      seconds = [c[0] for c in self._checkpoint_costs]
      extra['checkpoint_seconds_median'] = float(np.median(seconds))
      extra['checkpoint_seconds_max'] = float(np.max(seconds))
      extra['checkpoint_megabytes'] = self._checkpoint_costs[-1][1] / 1e6
    extra['driver_peak_rss_mib'] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    if self.runtime is not None:
      extra['executor'] = self.runtime.description
    if self.rows:
      extra['round_seconds_median'] = float(np.median([r['round_seconds'] for r in self.rows]))
    for way in ('down', 'up'):
      per_round = [r[f'bytes_{way}'] for r in self.rows]
      extra.update({f'bytes_{way}_per_round': per_round, f'bytes_{way}_total': int(sum(per_round)),
                    f'mb_{way}_total': float(sum(per_round)) / 1e6})
    return extra | {
        'method': self.algorithm.name,
        'dataset': self.data.dataset.name,
        'source_fingerprint': self.data.source_fingerprint,
        'model': self.algorithm.model_spec.name,
        'rounds_completed': self.rows[-1]['round'] if self.rows else 0,
        'final_accuracy': evals[-1]['test_accuracy'] if evals else None,
        'best_accuracy': best['test_accuracy'] if best else None,
        'best_round': best['round'] if best else None,
        'rounds_to_target': rounds_to_targets(self.rows, self.config.target_accuracies),
        'examples_processed': int(sum(r['examples'] for r in self.rows)),
        'train_seconds_total': float(sum(r['round_seconds'] for r in self.rows)),
    }


def split_measurements(metrics, prefix: str = '') -> tuple[dict, dict]:
  """Splits a process's nested metrics into scalars (for CSV) and arrays (for JSONL)."""
  scalars, arrays = {}, {}
  if isinstance(metrics, (dict, list, tuple)):
    for key, value in metrics.items() if isinstance(metrics, dict) else enumerate(metrics):
      s, a = split_measurements(value, f'{prefix}{key}/')
      scalars.update(s)
      arrays.update(a)
  else:
    value = np.asarray(metrics)
    if value.ndim == 0 and value.dtype.kind in 'fiub':
      scalars[prefix.rstrip('/')] = value.item()
    elif value.ndim > 0:
      arrays[prefix.rstrip('/')] = value
  return scalars, arrays
