"""Centralised evaluation of the global model, in the driver process (no TFF round-trip)."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from fltff.config_checks import check_number
from fltff.data.pipeline import preprocess_batch
from fltff.errors import ConfigError
from fltff.learning.model_spec import batch_loss


class Evaluator:
  """Loss and accuracy of `ModelWeights` on fixed arrays, with one compiled Keras model."""

  def __init__(self, model_spec, batch_size: int = 1000):
    self.model = model_spec.keras_fn()
    self.batch_size = batch_size

    @tf.function
    def batch_stats(x, y):
      loss_sum, _, correct = batch_loss(self.model(x, training=False), y)[1]
      return loss_sum, correct

    self._batch_stats = batch_stats

  def set_weights(self, model_weights) -> None:
    """Loads `ModelWeights` or a dict with 'trainable' and 'non_trainable' lists."""
    if isinstance(model_weights, dict):
      trainable, non_trainable = model_weights['trainable'], model_weights['non_trainable']
    else:
      trainable, non_trainable = model_weights.trainable, model_weights.non_trainable
    for var, value in zip(self.model.trainable_weights, trainable):
      var.assign(value)
    for var, value in zip(self.model.non_trainable_weights, non_trainable):
      var.assign(value)

  def evaluate(self, x: np.ndarray, y: np.ndarray) -> dict[str, float]:
    total_loss, total_correct = 0.0, 0.0
    for start in range(0, len(x), self.batch_size):
      batch = preprocess_batch({'x': tf.constant(x[start:start + self.batch_size]),
                                'y': tf.constant(y[start:start + self.batch_size])})
      loss, correct = self._batch_stats(batch['x'], batch['y'])
      total_loss += float(loss)
      total_correct += float(correct)
    n = max(len(x), 1)
    return {'loss': total_loss / n, 'accuracy': total_correct / n}


# Protocols (which model on which data) -> metrics.csv column. All but 'central' test clients on
# their local test splits; the column holds the mean (each client's: measurements.jsonl).
PROTOCOL_COLUMNS = {
    # The global model on the central test set (FedAvg-family papers: FedLap, FedLayerWise, CCN).
    'central': 'test_accuracy',
    # The global model (KAPC paper §7.1: its FedAvg baseline).
    'global_local': 'global_local_accuracy',
    # Each client's own model (personalised methods: KAPC, FedAMP, FedBN, pFedLA, local training).
    'personal_local': 'personal_local_accuracy',
    # Each participant's model right after its local training in the round: a global method read
    # as personalised (the KAPC paper counts FedProx and MOON among those, §7.2).
    'trained_local': 'trained_local_accuracy',
    # The global model after the method's own fine-tuning on the client's training data
    # (FedBABU: the whole model fine-tuned, Oh et al. §3).
    'finetuned_local': 'finetuned_local_accuracy',
}
# How a run's headline number is taken over rounds: the best round of the clients' mean (KAPC
# §7.2, "best mean accuracy"), or the mean over clients of each client's best round (KAPC §7.1
# for its local-training and FedAvg baselines).
HEADLINE_STATISTICS = ('best_round_mean', 'mean_client_best')


def check_protocols(protocols, personalized: bool, has_local_splits: bool,
                    can_report_trained: bool, personal_models: bool = False) -> tuple[str, ...]:
  """`protocols` as a tuple, or `ConfigError` naming what cannot be evaluated and why
  (`personal_models`: a global method whose clients keep personal models, e.g. Ditto)."""
  if isinstance(protocols, str) or not protocols:
    raise ConfigError('experiment.evaluation must be a non-empty list of protocols '
                      f'({", ".join(PROTOCOL_COLUMNS)}), got {protocols!r}.')
  protocols = tuple(protocols)
  for p in protocols:
    if p not in PROTOCOL_COLUMNS:
      raise ConfigError(f'experiment.evaluation: unknown protocol {p!r}; choose from '
                        f'{", ".join(PROTOCOL_COLUMNS)}.')
  if len(set(protocols)) != len(protocols):
    raise ConfigError(f'experiment.evaluation names a protocol twice: {list(protocols)}.')
  if personalized:
    wrong = [p for p in protocols if p != 'personal_local']
    if wrong:
      raise ConfigError(f'experiment.evaluation: a personalised method has no global model, so '
                        f'only personal_local applies (got {", ".join(wrong)}).')
  elif 'personal_local' in protocols and not personal_models:
    raise ConfigError("experiment.evaluation: personal_local needs personal models (a "
                      "personalised method, Ditto); for a global method's clients after local "
                      "training use trained_local.")
  if not has_local_splits and set(protocols) - {'central'}:
    raise ConfigError('experiment.evaluation: the local protocols need local test splits: set '
                      'federated_data.local_test_examples > 0.')
  if 'trained_local' in protocols and personal_models:
    raise ConfigError("experiment.evaluation: trained_local tests a global method's participants; "
                      'this run has personal models (Ditto, personalisation): use personal_local.')
  if 'trained_local' in protocols and not can_report_trained:
    raise ConfigError("experiment.evaluation: trained_local reads the participants' trained "
                      'models from the vectorised client work; this run does not vectorise its '
                      "clients (runtime.executor = 'in_process' or 'auto').")
  return protocols


def headline(rows, protocol: str, statistic: str) -> dict:
  """The run's headline number: `protocol`'s accuracy taken over rounds by `statistic`.

  Returns `{protocol, column, statistic, value, round}` (`round` only for 'best_round_mean';
  `value` None when nothing was evaluated). Per-client values come from each row's `_clients`.
  """
  column = PROTOCOL_COLUMNS[protocol]
  out = {'protocol': protocol, 'column': column, 'statistic': statistic, 'value': None}
  if statistic == 'best_round_mean':
    evaluated = [r for r in rows if isinstance(r.get(column), float) and np.isfinite(r[column])]
    if evaluated:
      best = max(evaluated, key=lambda r: r[column])
      out.update(value=best[column], round=best['round'])
  else:
    best = client_bests(rows, protocol)
    if best:
      out['value'] = float(np.mean(list(best.values())))
      out['clients'] = len(best)
  return out


def client_bests(rows, protocol: str) -> dict[int, float]:
  """Each client's best accuracy under `protocol` over the rounds it was evaluated in."""
  best: dict[int, float] = {}
  for row in rows:
    for k, acc in row.get('_clients', {}).get(protocol, []):
      best[int(k)] = max(best.get(int(k), -np.inf), float(acc))
  return best


class Finetuner:
  """The `finetuned_local` protocol's fine-tuning as FedBABU defines it (Oh et al., ICLR 2022,
  §3: the global model's body and head both trained on the client's own data before testing).

  The epochs and the optimizer (the run's client optimizer) are our choice: the KAPC paper,
  whose FedBABU baseline this serves, does not state them. Runs fltff's local training
  (`VectorizedClientWork`, no regulariser, nothing frozen) for all the round's clients at once.
  """

  def __init__(self, model_spec, client_optimizer, epochs: int):
    check_number('experiment.finetune_epochs', epochs, integer=True, low=1)
    self.epochs = epochs
    self._model_spec, self._optimizer = model_spec, client_optimizer
    self._work = None

  def __call__(self, global_weights, client_batches):
    """Fine-tunes `global_weights` on each `(client index, batches)`; returns the models
    (`vectorized.trained_models`, BatchNorm statistics trained too), in the order given."""
    from fltff.learning import client_work as client_work_lib  # pylint: disable=g-import-not-at-top
    from fltff.learning import vectorized  # pylint: disable=g-import-not-at-top

    if self._work is None:
      self._work = vectorized.VectorizedClientWork(self._model_spec, self._optimizer,
                                                   batch_norm=True)
    inputs = [client_work_lib.client_input(batches, k, self.epochs, state_in_dataset=False,
                                           info_in_dataset=False)
              for k, batches in client_batches]
    out, _ = self._work.train(inputs, tuple(np.asarray(w) for w in global_weights.trainable),
                              statistics=[np.asarray(w) for w in global_weights.non_trainable])
    return vectorized.trained_models(out)
