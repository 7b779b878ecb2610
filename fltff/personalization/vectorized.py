"""Client-vectorised rounds for the personalised methods (KAPC, FedAMP, Local, pFedLA).

`build_personalized_process`'s client work (start model, E epochs on
`f_i(w) + λ Σ_l ||w^l − s_i^l||²`, the layer selection's Ω) for all participants in one TensorFlow step:
the training is `learning.vectorized.VectorizedClientWork` with per-client start weights and
proximal terms; the parts around it are `process.PersonalizedRound`'s `client_start` and
`client_result` under `tf.vectorized_map`. The server's parts stay TFF computations
(`PersonalizedAlgorithm.split_round`), so state and result equal TFF's to float rounding
(tests/test_vectorized.py). BatchNorm models: each client's moving statistics (its state's
`non_trainable`) train with it and return in its upload, as in TFF (FedBN keeps them local).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any, Optional

import numpy as np
import tensorflow as tf

from fltff.learning import client_work as client_work_lib
from fltff.learning.model_spec import ModelSpec
from fltff.learning.vectorized import VectorizedClientWork
from fltff.learning.vectorized import stack_clients
from fltff.learning.vectorized import with_clients


def participant_rows(rows, listed: Sequence[int], order: Sequence[int]) -> collections.OrderedDict:
  """Each participant's `client_row`, stacked in `order`, from the broadcast's `rows`.

  `rows`: `process.message_rows`, `[P, ...]` in the order `listed`. If `order` is that order
  (always, in `_vectorized_next`), `rows` is returned as it is, not copied by a gather; a client
  missing from `listed` raises `ValueError`."""
  listed = [int(k) for k in listed]
  if listed == list(order):
    return rows
  position = {k: p for p, k in enumerate(listed)}
  missing = [k for k in order if k not in position]
  if missing:
    raise ValueError(f'clients {missing} are not in the round\'s broadcast ({listed}).')
  index = tf.constant([position[k] for k in order], tf.int32)
  return tf.nest.map_structure(lambda m: tf.gather(m, index), rows)


class VectorizedPersonalWork:
  """Called with `(server_msg, client_inputs)`: `client_update`'s outputs stacked in input order."""

  def __init__(self, model_spec: ModelSpec, optimizer, parts, device: Optional[str] = None,
               factor_dense: bool = True):
    """`parts`: the round's `process.PersonalizedRound` (its client parts run here)."""
    self._parts = parts
    self._regularized = parts.rule.lambda_ > 0
    self._work = VectorizedClientWork(
        model_spec, optimizer, device=device, factor_dense=factor_dense,
        client_regularizer=(lambda terms: parts.client_regularizer(*terms)) if self._regularized
        else None, batch_norm=True)
    # Without autograph, as the training: no tensor-dependent Python control flow here.
    self._starts = tf.function(self._starts_fn, reduce_retracing=True, autograph=False)
    self._results = tf.function(self._results_fn, reduce_retracing=True, autograph=False)

  def _starts_fn(self, rows, personal, num_clients=None):
    rows, personal = with_clients((rows, personal), num_clients)
    return tf.vectorized_map(lambda args: tuple(self._parts.client_start(*args)),
                             (rows, personal))

  def _results_fn(self, personal, clients, s, sent, own, trained, examples_per_epoch,
                  num_clients=None):
    return tf.vectorized_map(
        lambda args: self._parts.client_result(*args),
        with_clients((personal, clients, s, sent, own, trained, examples_per_epoch),
                     num_clients))

  def __call__(self, server_msg, client_inputs: Sequence[Any]):
    server_msg = tf.nest.map_structure(tf.convert_to_tensor, server_msg)
    personal = stack_clients([data['state'] for data in client_inputs])
    infos = [client_work_lib.client_info_of_input(data) for data in client_inputs]
    order = [int(info['client_index']) for info in infos]
    clients = tf.constant(order, tf.int32)
    rows = participant_rows(self._parts.message_rows(server_msg),
                            np.asarray(server_msg['clients']), order)
    k = self._work.traced_client_count(len(client_inputs))
    start, s, sent, own = (tuple(part) for part in self._starts(rows, personal, num_clients=k))
    out, data = self._work.train(client_inputs, start=start,
                                 client_terms=(s, sent) if self._regularized else None,
                                 statistics=personal.get('non_trainable'))
    examples = out['sums'][1]
    examples_per_epoch = client_work_lib.examples_per_epoch(examples, data['epochs'])
    value, weight = self._results(personal, clients, s, sent, own, tuple(out['trained']),
                                  examples_per_epoch, num_clients=k)
    value = collections.OrderedDict(trainable=tuple(value['trainable']))
    if 'non_trainable' in out:
      value['non_trainable'] = tuple(out['non_trainable'])
    return value, weight, self._work.model_outputs(out['sums'])
