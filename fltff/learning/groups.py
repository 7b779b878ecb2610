"""Vectorised client work on TFF's workers: a round's participants as one group per worker.

Each group is one TFF client of a `tff.federated_map` over a `tff.tensorflow.computation`
around `VectorizedClientWork`'s own training (`train_in_graph`): the group's round data
(`round_data.stack_client_batches`, cut to its clients; images as the source stores them,
uint8, preprocessed on the worker) in, its clients' trained weights, metric sums and the rest
of the training's outputs `[K, ...]` out; for work whose updates go to a plain weighted mean
(`VectorizedClientWork.mean_aggregation`), the group's weighted mean update (BatchNorm
statistics too) and total weight instead of its clients' models, unless the driver needs those
(`trained_local`). Each
worker's TFF remote executor runs its group, the workers at once, so no RPC of ours carries
them; the driver puts the groups' results back in client order and runs the method's
aggregator on them in process (`StackedClients`), as in-process vectorised rounds do. A
client's training reads its own data only: grouping changes the numbers only as batched
kernels round (tests/test_groups.py).
"""

from __future__ import annotations

import collections
import concurrent.futures
from typing import Optional

import numpy as np
import tensorflow as tf

from fltff.data.pipeline import preprocess_batch
from fltff.learning.round_data import group_data
from fltff.learning.round_data import in_client_order
from fltff.learning.round_data import round_specs
from fltff.runtime.in_process import InProcessContext

# `VectorizedClientWork._train_fn`'s arguments, in order (a group's `epochs` weigh its updates).
_ARGS = ('global_trainable', 'start', 'client_terms', 'statistics', 'examples', 'labels', 'index',
         'mask', 'valid')


def split_clients(data, num_groups: int) -> list[np.ndarray]:
  """`data`'s participants (`stack_client_batches`) in `num_groups` groups of near-equal counts,
  each of clients of similar work (epochs × steps), so that each pads little."""
  work = np.asarray(data['mask']).any(axis=-1).sum(axis=(0, 1))
  return [np.sort(g) for g in np.array_split(np.argsort(work, kind='stable'), num_groups)
          if len(g)]


def group_table(data, clients: np.ndarray) -> collections.OrderedDict:
  """`group_data(data, clients)` with the example table cut to the rows its clients read (the
  padding row last) and `index` renumbered to them."""
  group = group_data(data, clients)
  rows = np.union1d(np.unique(group['index']), [len(data['labels']) - 1])
  group['index'] = np.searchsorted(rows, group['index']).astype(np.int64)
  group['examples'], group['labels'] = (np.asarray(data[k])[rows] for k in ('examples', 'labels'))
  return group


def _nbytes(structure) -> int:
  return int(sum(np.asarray(t).nbytes for t in tf.nest.flatten(structure)))


class WorkerGroups:
  """Trains `work`'s rounds as groups on `runtime`'s workers (a `fltff.runtime.WorkerRuntime`:
  its `worker_contexts`, `workers` and failover `call`)."""

  def __init__(self, work, runtime, keep_trained: bool = False):
    self.work, self._runtime = work, runtime
    self._keep_trained = keep_trained
    self._computations = {}
    self.last_sizes: list[int] = []  # Clients per group (per call) in the last round.
    self.last_bytes: list[tuple[int, int]] = []  # Tensor bytes to and from each group's worker.

  def train(self, data, global_trainable, start, client_terms, statistics
            ) -> collections.OrderedDict:
    """`VectorizedClientWork.train`'s outputs for `data`'s round, trained on the workers."""
    own = start is not None  # Per-client starts come with per-client statistics.
    summed = self.work.mean_aggregation and not own and not self._keep_trained
    server = collections.OrderedDict(
        (name, tf.nest.map_structure(np.asarray, value)) for name, value in
        (('global_trainable', global_trainable), ('statistics', None if own else statistics))
        if value is not None)
    per_client = {'start': start, 'client_terms': client_terms,
                  'statistics': statistics if own else None}
    groups, inputs, results = self._runtime.call(
        self._train_groups, data, server, per_client,
        self.work.round_factoring(data, client_terms), summed)
    self.last_sizes = [len(c) for c in groups]
    self.last_bytes = [(_nbytes(server) + _nbytes(v), _nbytes(r)) for v, r in zip(inputs, results)]
    parts = [collections.OrderedDict(r) for r in results]
    # Group means: one row a group, in group order (per-client outputs go back to client order).
    means = {} if not summed else {
        name: tf.nest.map_structure(lambda *g: tf.concat(g, 0), *[p.pop(name) for p in parts])
        for name in ('update', 'update_weight', 'non_trainable') if name in parts[0]}
    out = collections.OrderedDict(in_client_order(parts, groups), **means)
    if not own and not summed:  # As `_train_fn` forms it, from the global model.
      out['update'] = tuple(tf.constant(g)[tf.newaxis] - w
                            for g, w in zip(global_trainable, out['trained']))
    return out

  def _train_groups(self, data, server, per_client, factored: frozenset, summed: bool) -> tuple:
    """`(groups, their inputs, their outputs)`: `data`'s participants as one group per worker
    (`runtime.worker_contexts`, fewer after a lost one), each trained on its worker, the workers
    at once: a thread each, as TFF's remote executor blocks on its calls."""
    import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top

    contexts = self._runtime.worker_contexts
    groups = split_clients(data, max(1, min(len(contexts), len(data['epochs']))))
    inputs = []
    for clients in groups:
      value = group_table(data, clients)
      value.update((name, tf.nest.map_structure(lambda t, c=clients: np.asarray(t)[c], v))
                   for name, v in per_client.items() if v is not None)
      inputs.append(value)
    sizes = {len(c) for c in groups}
    comp = self._computation(server, inputs[0], sizes.pop() if len(sizes) == 1 else None,
                             factored, summed)

    def on_worker(g):
      with tff.framework.get_context_stack().install(contexts[g]):
        return comp(*((server, [inputs[g]]) if server else ([inputs[g]],)))[0]

    with concurrent.futures.ThreadPoolExecutor(len(groups)) as pool:
      return groups, inputs, list(pool.map(on_worker, range(len(groups))))

  def _computation(self, server, group, num_clients: Optional[int], factored: frozenset,
                   summed: bool):
    """The federated computation for values like `server` and `group` (cached by type); with
    `summed`, the group's mean update and weight replace its clients' models."""
    import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top

    specs = dict(zip(_ARGS, round_specs([{**server, **group}.get(n) for n in _ARGS], num_clients)),
                 epochs=tf.TensorSpec([num_clients], tf.int32))
    server_type, group_type = (tff.types.tensorflow_to_type(collections.OrderedDict(
        (name, specs[name]) for name in value)) if value else None for value in (server, group))
    key = (str(server_type), str(group_type), factored, summed)
    if key in self._computations:
      return self._computations[key]
    work = self.work

    def train(server_value, group_value):
      given = {**server_value, **group_value, **preprocess_batch(
          collections.OrderedDict(x=group_value['examples'], y=group_value['labels']))}
      given['examples'], given['labels'] = given.pop('x'), given.pop('y')
      out = collections.OrderedDict(
          work.train_in_graph([given.get(n) for n in _ARGS], num_clients, factored))
      if summed:  # MeanFactory's Σ ν_i Δ_i / Σ ν_i over the group; the driver's weighs by Σ ν_i.
        weight = work.update_weights(out['sums'][1], group_value['epochs'])
        total = tf.reduce_sum(weight)
        for name in {'update', 'non_trainable'} & set(out):  # BatchNorm statistics alike.
          out[name] = tuple(tf.math.divide_no_nan(tf.tensordot(weight, u, 1), total)[tf.newaxis]
                            for u in out[name])
        out['update_weight'] = total[tf.newaxis]
        del out['trained']
      else:  # Formed by the driver from `trained` (`WorkerGroups.train`).
        out.pop('update', None)
      return out

    clients = tff.FederatedType(group_type, tff.CLIENTS)
    if server_type is not None:
      train_group = tff.tensorflow.computation(train, server_type, group_type)
      comp = tff.federated_computation(
          lambda s, g: tff.federated_map(train_group, (tff.federated_broadcast(s), g)),
          tff.FederatedType(server_type, tff.SERVER), clients)
    else:
      train_group = tff.tensorflow.computation(lambda g: train({}, g), group_type)
      comp = tff.federated_computation(lambda g: tff.federated_map(train_group, g), clients)
    self._computations[key] = comp
    return comp


class DriverContext(InProcessContext):
  """A `WorkerRuntime`'s context for vectorised client work: the in-process executor runs the
  rounds, but for the client training of the placed work, which `groups` run on the workers."""

  def __init__(self, groups: WorkerGroups):
    super().__init__()
    self.groups = groups


def worker_groups(work) -> Optional[WorkerGroups]:
  """The current context's `WorkerGroups` if placed for `work`; None: it trains in process."""
  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top

  context = tff.framework.get_context_stack().current
  if isinstance(context, DriverContext) and context.groups.work is work:
    return context.groups
  return None
