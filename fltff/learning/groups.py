"""Vectorised client work on TFF's workers: a round's participants as one group per worker.

Each group is one TFF client of a `tff.federated_map` over `train_group`, a
`tff.tensorflow.computation` around `VectorizedClientWork`'s own training function
(`train_in_graph`): the group's stacked round data (`round_data.stack_client_batches`, cut to
its clients; images as the source stores them, uint8, preprocessed on the worker) in, its
clients' trained weights, metric sums and the rest of the training's outputs `[K, ...]` out.
TFF's remote executor (one worker) or mergeable context (several: one sub-round per worker)
runs the groups, so no RPC of ours carries them; the driver stacks the groups' results back in
client order and runs the method's aggregator on them in process (`StackedClients`), as the
in-process vectorised rounds do. Each client's training depends on its own data only, so the
grouping changes the numbers only as batched kernels round (tests/test_groups.py).
"""

from __future__ import annotations

import collections
from typing import Any, Optional

import numpy as np
import tensorflow as tf

from fltff.data.pipeline import preprocess_batch
from fltff.learning.round_data import group_data

# `_train_fn`'s arguments in order; `None` ones are left out of the computation's types.
_ARGS = ('global_trainable', 'start', 'client_terms', 'statistics', 'examples', 'labels', 'index',
         'mask', 'valid', 'epochs')
_SERVER = ('global_trainable', 'statistics')  # Shared by every group (unless per client).


def split_clients(data, num_groups: int) -> list[np.ndarray]:
  """The participants of `data` (`stack_client_batches`) in `num_groups` groups of near-equal
  counts, each of clients of similar work (epochs × steps), so each pads little."""
  has_batch = np.asarray(data['mask']).any(axis=-1)  # [E, S, K]
  work = has_batch.sum(axis=(0, 1))
  order = np.argsort(work, kind='stable')
  return [np.sort(g) for g in np.array_split(order, num_groups) if len(g)]


def group_table(data, clients: np.ndarray) -> collections.OrderedDict:
  """`group_data(data, clients)` with the example table cut to the rows its clients read
  (the padding row last), its `index` renumbered."""
  group = group_data(data, clients)
  padding = len(data['labels']) - 1
  rows = np.union1d(np.unique(group['index']), [padding])
  group['index'] = np.searchsorted(rows, group['index']).astype(np.int64)
  group['examples'] = np.asarray(data['examples'])[rows]
  group['labels'] = np.asarray(data['labels'])[rows]
  return group


def _spec(array, client_axis: Optional[int], num_clients: Optional[int], unknown=()):
  shape = list(np.shape(array))
  for axis in unknown:
    shape[axis] = None
  if client_axis is not None:
    shape[client_axis] = num_clients
  return tf.TensorSpec(shape, tf.as_dtype(np.asarray(array).dtype if not tf.is_tensor(array)
                                           else array.dtype))


def _nbytes(structure) -> int:
  return int(sum(np.asarray(t).nbytes for t in tf.nest.flatten(structure)))


class WorkerGroups:
  """Trains `work`'s rounds (`VectorizedClientWork.on_workers`) as groups on `runtime`'s
  workers (a `fltff.runtime.WorkerRuntime`: its `context`, `workers` and failover `call`)."""

  def __init__(self, work, runtime):
    self._work, self._runtime = work, runtime
    self._computations: dict[Any, Any] = {}
    self.last_sizes: list[int] = []  # Clients per group (per call) in the last round.
    self.last_bytes: list[tuple[int, int]] = []  # Tensor bytes (to, from) each group's worker.

  def train(self, data, global_trainable, start, client_terms, statistics
            ) -> collections.OrderedDict:
    """`VectorizedClientWork.train`'s outputs for `data`'s round, trained on the workers."""
    import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top

    k = len(data['epochs'])
    groups = split_clients(data, max(1, min(len(self._runtime.workers), k)))
    factored = self._work.round_factoring(data, client_terms)
    values = dict(global_trainable=global_trainable, start=start, client_terms=client_terms,
                  statistics=statistics)
    per_client = {'start', 'client_terms'} | ({'statistics'} if start is not None else set())
    server = collections.OrderedDict(
        (name, tuple(np.asarray(t) for t in values[name])) for name in _SERVER
        if values[name] is not None and name not in per_client)
    pick = lambda structure, clients: tf.nest.map_structure(
        lambda t: np.asarray(t)[clients], structure)
    inputs = []
    for g, clients in enumerate(groups):
      group = group_table(data, clients)
      value = collections.OrderedDict(group=np.int32(g))
      for name in _ARGS:
        if name in per_client and values[name] is not None:
          value[name] = pick(values[name], clients)
        elif name in group:
          value[name] = group[name]
      inputs.append(value)
    sizes = {len(c) for c in groups}
    num_clients = sizes.pop() if len(sizes) == 1 else None
    comp = self._computation(server, inputs[0], num_clients, factored)
    args = (server, inputs) if server else (inputs,)
    results = self._runtime.call(self._invoke, comp, *args)
    results = sorted(results, key=lambda r: int(r[0]))  # Sub-rounds return in completion order.
    self.last_sizes = [len(c) for c in groups]
    self.last_bytes = [(_nbytes(server) + _nbytes(v), _nbytes(r)) for v, r in zip(inputs, results)]
    position = np.argsort(np.concatenate(groups))
    out = tf.nest.map_structure(
        lambda *parts: tf.gather(tf.concat([tf.convert_to_tensor(p) for p in parts], 0),
                                 position), *[r[1] for r in results])
    out = collections.OrderedDict(out)
    if start is None:  # As `_round_outputs`: the update from the global model, here.
      out['update'] = tuple(tf.constant(g)[tf.newaxis] - w
                            for g, w in zip(global_trainable, out['trained']))
    return out

  def _invoke(self, comp, *args):
    import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top

    with tff.framework.get_context_stack().install(self._runtime.context):
      return comp(*args)

  def _computation(self, server, group, num_clients: Optional[int], factored: frozenset):
    """The federated computation for groups like `group` (cached by types)."""
    import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top

    server_specs = tf.nest.map_structure(lambda t: _spec(t, None, None), server)
    group_specs = collections.OrderedDict()
    for name, value in group.items():
      if name in ('examples', 'labels'):
        spec = tf.nest.map_structure(lambda t: _spec(t, None, None, unknown=[0]), value)
      elif name in ('index', 'mask'):
        spec = _spec(value, 2, num_clients, unknown=[0, 1, 3])
      elif name == 'valid':
        spec = _spec(value, 2, num_clients, unknown=[0, 1])
      elif name == 'group':
        spec = _spec(value, None, None)
      else:
        spec = tf.nest.map_structure(lambda t: _spec(t, 0, num_clients), value)
      group_specs[name] = spec
    key = (repr(server_specs), repr(group_specs), factored)
    if key in self._computations:
      return self._computations[key]
    work = self._work
    group_type = tff.types.tensorflow_to_type(group_specs)

    def train(server_value, group_value):
      processed = preprocess_batch(collections.OrderedDict(x=group_value['examples'],
                                                           y=group_value['labels']))
      given = dict(server_value, **group_value)
      given.update(examples=processed['x'], labels=processed['y'])
      args = [given.get(name) for name in _ARGS]
      out = collections.OrderedDict(work.train_in_graph(args, num_clients, factored))
      out.pop('update', None)  # Formed by the driver from `trained` (`WorkerGroups.train`).
      return group_value['group'], out

    if server:
      server_type = tff.types.tensorflow_to_type(server_specs)
      train_group = tff.tensorflow.computation(train, server_type, group_type)

      @tff.federated_computation(tff.FederatedType(server_type, tff.SERVER),
                                 tff.FederatedType(group_type, tff.CLIENTS))
      def train_groups(server_value, groups):
        return tff.federated_map(train_group, (tff.federated_broadcast(server_value), groups))
    else:
      train_group = tff.tensorflow.computation(lambda g: train({}, g), group_type)

      @tff.federated_computation(tff.FederatedType(group_type, tff.CLIENTS))
      def train_groups(groups):
        return tff.federated_map(train_group, groups)

    self._computations[key] = train_groups
    return train_groups
