"""fltff methods under TFF's program API (`tff.learning.programs.train_model`).

TFF 0.87's `NativeFederatedContext` only materialises CLIENTS data whose member is a dataset or
a tensor, but fltff's client input (`fltff.learning.client_input`) is a struct of two datasets:
`as_dataset_process` wraps a method into a `LearningProcess` taking each client's batches as
one dataset, as TFF's own processes do, and packs fltff's input (client index 0) inside the
computation. `ClientInputDataSource` is a serialisable `tff.program.FederatedDataSource` of
per-client arrays (`train_model` stores its position in the program state).
"""

from __future__ import annotations

import collections
import io
import json
from collections.abc import Sequence
from typing import Optional

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from fltff import methods
from fltff.data.pipeline import preprocess_batch
from fltff.errors import ConfigError
from fltff.learning.client_work import client_input


def _client_inputs(arrays, clients, batch_size, epochs, seed):
  out = []
  for k in clients:
    x, y = arrays[k]
    batches = tf.data.Dataset.from_tensor_slices(collections.OrderedDict(x=x, y=y)).shuffle(
        len(y), seed=seed, reshuffle_each_iteration=True).batch(batch_size)
    out.append(client_input(batches, int(k), epochs))
  return out


class ClientInputIterator(tff.program.FederatedDataSourceIterator):
  """Selects `k` clients per call, without replacement within a call, seeded by
  `(seed, number of calls so far)`; serialisable, so `train_model` resumes it exactly. The
  arrays are taken as the model reads them (`preprocess_batch`: uint8 images to [0, 1])."""

  def __init__(self, arrays: Sequence[tuple[np.ndarray, np.ndarray]], batch_size: int,
               epochs: int, seed: int = 0, calls: int = 0):
    self._arrays = [tuple(v.numpy() for v in preprocess_batch(dict(
        x=tf.constant(x), y=tf.constant(y))).values()) for x, y in arrays]
    self._batch_size, self._epochs, self._seed, self._calls = batch_size, epochs, seed, calls
    sample = _client_inputs(self._arrays, [0], batch_size, epochs, seed)[0]
    self._type = tff.FederatedType(tff.StructWithPythonType(
        [(name, tff.SequenceType(tff.types.tensorflow_to_type(ds.element_spec)))
         for name, ds in sample.items()], collections.OrderedDict), tff.CLIENTS)

  @property
  def federated_type(self) -> tff.FederatedType:
    return self._type

  def select(self, k: Optional[int] = None) -> list:
    if k is None or not 0 < k <= len(self._arrays):
      raise ConfigError(f'select needs 1 <= k <= {len(self._arrays)} clients, got {k}.')
    rng = np.random.default_rng([self._seed, self._calls])
    self._calls += 1
    clients = np.sort(rng.choice(len(self._arrays), size=k, replace=False))
    return _client_inputs(self._arrays, clients, self._batch_size, self._epochs,
                          self._seed * 100003 + self._calls)

  def to_bytes(self) -> bytes:
    buffer = io.BytesIO()
    arrays = {f'x{k}': x for k, (x, _) in enumerate(self._arrays)}
    arrays.update({f'y{k}': y for k, (_, y) in enumerate(self._arrays)})
    meta = dict(batch_size=self._batch_size, epochs=self._epochs, seed=self._seed,
                calls=self._calls, clients=len(self._arrays))
    np.savez(buffer, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8), **arrays)
    return buffer.getvalue()

  @classmethod
  def from_bytes(cls, buffer: bytes) -> 'ClientInputIterator':
    with np.load(io.BytesIO(buffer)) as data:
      meta = json.loads(bytes(data['meta']).decode())
      arrays = [(data[f'x{k}'], data[f'y{k}']) for k in range(meta['clients'])]
    return cls(arrays, meta['batch_size'], meta['epochs'], meta['seed'], meta['calls'])

  def __deepcopy__(self, memo) -> 'ClientInputIterator':
    # `train_model` deep-copies the iterator every round; only the call count ever changes
    # (and TFF's struct types do not survive `copy.deepcopy`), so a shallow copy is independent.
    del memo
    clone = object.__new__(type(self))
    clone.__dict__.update(self.__dict__)
    return clone

  def __eq__(self, other: object) -> bool:
    if type(other) is not type(self):  # pylint: disable=unidiomatic-typecheck
      return NotImplemented
    return (self._batch_size, self._epochs, self._seed, self._calls) == (
        other._batch_size, other._epochs, other._seed, other._calls) and all(
            np.array_equal(a, b) for p, q in zip(self._arrays, other._arrays)
            for a, b in zip(p, q)) and len(self._arrays) == len(other._arrays)


class ClientInputDataSource(tff.program.FederatedDataSource):
  """A `tff.program.FederatedDataSource` of fltff client inputs over per-client arrays.

  Args:
    arrays: Per client `(x, y)` NumPy arrays (e.g. from `FederatedData.client_arrays`), as
      fltff's sources give them: uint8 images are scaled to [0, 1], other features and the
      labels are cast to float32 and int32.
    batch_size, epochs: B and E of every participant.
    seed: Seed of client selection and of the per-round shuffles.
    batches_only: Select each client's batches only (for `as_dataset_process`).
  """

  def __init__(self, arrays: Sequence[tuple[np.ndarray, np.ndarray]], batch_size: int,
               epochs: int, seed: int = 0, batches_only: bool = False):
    if not arrays:
      raise ConfigError('ClientInputDataSource needs at least one client.')
    self._iterator_args = (arrays, batch_size, epochs, seed)
    self._iterator_class = DatasetIterator if batches_only else ClientInputIterator
    self._type = self._iterator_class(*self._iterator_args).federated_type

  @property
  def federated_type(self) -> tff.FederatedType:
    return self._type

  def iterator(self) -> ClientInputIterator:
    return self._iterator_class(*self._iterator_args)


def as_dataset_process(algorithm, epochs: int):
  """`algorithm.process` as a `tff.learning.templates.LearningProcess` whose client data is
  each client's batched dataset (elements `OrderedDict(x=..., y=...)`), for TFF's program API.

  Every client trains `epochs` local epochs as fltff client index 0. Raises `ConfigError` for
  a method that needs the client's identity or driver-held client state (`pipelines.run` runs
  those: FedAdp, FedLayerWise, CCN, FedNova, SCAFFOLD, MOON, the personalised methods).
  """
  without_identity = [m.name for m in methods.METHODS.values()
                      if not (m.client_ids or m.client_state)]
  if algorithm.name not in without_identity:
    raise ConfigError(
        f'{algorithm.name} needs each client\'s identity or driver-held client state, which a '
        f'plain TFF LearningProcess cannot carry; run it with pipelines.run (methods for TFF\'s '
        f'program API: {", ".join(without_identity)}).')
  inner = algorithm.process  # Without client state, its client data is `batches` and `info`.
  batches_type = inner.next.type_signature.parameter[1].member['batches']

  @tff.tensorflow.computation(batches_type)
  def pack(batches):
    info = tf.data.Dataset.from_tensors(
        collections.OrderedDict(client_index=tf.constant(0, tf.int32),
                                epochs=tf.constant(epochs, tf.int32)))
    return collections.OrderedDict(batches=batches, info=info)

  state_type = inner.next.type_signature.parameter[0]

  @tff.federated_computation(state_type, tff.FederatedType(batches_type, tff.CLIENTS))
  def next_fn(state, client_batches):
    return inner.next(state, tff.federated_map(pack, client_batches))

  return tff.learning.templates.LearningProcess(
      inner.initialize, next_fn, inner.get_model_weights, inner.set_model_weights)


class DatasetIterator(ClientInputIterator):
  """`ClientInputIterator` selecting each client's batches only (for `as_dataset_process`)."""

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self._type = tff.FederatedType(self._type.member['batches'], tff.CLIENTS)

  def select(self, k: Optional[int] = None) -> list:
    return [data['batches'] for data in super().select(k)]
