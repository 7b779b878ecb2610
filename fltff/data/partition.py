"""Partitioners: split a labelled training set into per-client index arrays.

Each takes `labels` (1-D integer array), `num_clients` and `seed` and returns one sorted int64
index array per client, deterministically. Clients are disjoint and every index is used once,
except in `mixed_partition` (fixed-size clients; the rest stays unused).
"""

from typing import Any, Optional, Sequence

import gin
import numpy as np

from fltff.config_checks import check_number
from fltff.errors import ConfigError

Partition = list[np.ndarray]


def _check_labels(labels: np.ndarray) -> np.ndarray:
  labels = np.asarray(labels)
  if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
    raise ConfigError(f'labels must be a 1-D integer array, got dtype {labels.dtype} and '
                      f'shape {labels.shape}.')
  if labels.size and labels.min() < 0:
    raise ConfigError(f'labels must be non-negative class indices, got {labels.min()}.')
  return labels


def _check_num_clients(num_examples: int, num_clients: int, min_per_client: int = 1) -> None:
  check_number('num_clients', num_clients, integer=True, low=1)
  if num_examples < num_clients * min_per_client:
    raise ConfigError(
        f'cannot split {num_examples} examples into {num_clients} clients with at least '
        f'{min_per_client} example(s) each; use at most '
        f'{num_examples // max(min_per_client, 1)} clients or more data.')


def _finish(parts: Sequence[np.ndarray]) -> Partition:
  return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]


@gin.configurable('iid_partition')
def iid_partition(labels: np.ndarray, num_clients: int, seed: int = 0) -> Partition:
  """Shuffles the examples and splits them as evenly as possible (sizes differ by <= 1)."""
  labels = _check_labels(labels)
  _check_num_clients(len(labels), num_clients)
  perm = np.random.default_rng(seed).permutation(len(labels))
  return _finish(np.array_split(perm, num_clients))


@gin.configurable('shard_partition')
def shard_partition(labels: np.ndarray,
                    num_clients: int,
                    num_shards: Optional[int] = None,
                    shards_per_client: int = 2,
                    seed: int = 0) -> Partition:
  """Pathological non-IID shards of McMahan et al. (AISTATS 2017, Sec. 3).

  Examples are sorted by label (stably) and cut into `num_shards` contiguous shards, the first
  `n % num_shards` one longer so none is lost; each client gets `shards_per_client` random ones.

  Args:
    num_shards: Must equal `num_clients * shards_per_client`; `None` means that (the paper:
      100 clients, 200 shards, so 2 per client).
  """
  labels = _check_labels(labels)
  check_number('shard_partition.shards_per_client', shards_per_client, integer=True, low=1)
  check_number('num_clients', num_clients, integer=True, low=1)
  needed = num_clients * shards_per_client
  if num_shards is None:
    num_shards = needed
  if num_shards != needed:
    raise ConfigError(
        f'shard_partition needs num_shards == num_clients * shards_per_client, got '
        f'num_shards={num_shards}, num_clients={num_clients}, '
        f'shards_per_client={shards_per_client}; set shard_partition.num_shards = {needed} '
        'or leave it unset.')
  if len(labels) < num_shards:
    raise ConfigError(f'cannot cut {len(labels)} examples into {num_shards} shards '
                      f'({num_clients} clients x {shards_per_client}); use fewer clients or '
                      'shards.')
  order = np.argsort(labels, kind='stable')
  shards = np.array_split(order, num_shards)
  assignment = np.random.default_rng(seed).permutation(num_shards)
  assignment = assignment.reshape(num_clients, shards_per_client)
  return _finish([np.concatenate([shards[s] for s in row]) for row in assignment])


@gin.configurable('dirichlet_partition')
def dirichlet_partition(labels: np.ndarray,
                        num_clients: int,
                        alpha: float = 0.5,
                        seed: int = 0,
                        min_samples_per_client: int = 1,
                        max_tries: int = 100) -> Partition:
  """Label-skewed partition with Dirichlet class proportions (Hsu et al., 2019).

  For every class c, draws p_c ~ Dir(alpha * 1_N) over the N clients and splits the shuffled
  examples of class c by p_c; the whole draw is repeated, up to `max_tries` times (else
  `ConfigError`), until every client has at least `min_samples_per_client` examples.

  Args:
    alpha: Concentration, > 0: 0.1 is very skewed, large values approach IID (the papers use
      0.1, 0.3, 0.5).
  """
  labels = _check_labels(labels)
  check_number('dirichlet_partition.alpha', alpha, low=0, open_low=True,
               hint='the papers use 0.1, 0.3 or 0.5')
  check_number('dirichlet_partition.min_samples_per_client', min_samples_per_client,
               integer=True, low=0)
  check_number('dirichlet_partition.max_tries', max_tries, integer=True, low=1)
  _check_num_clients(len(labels), num_clients, max(min_samples_per_client, 1))
  rng = np.random.default_rng(seed)
  class_indices = [np.flatnonzero(labels == c) for c in np.unique(labels)]
  smallest = 0
  for _ in range(max_tries):
    parts = [[] for _ in range(num_clients)]
    for idx in class_indices:
      idx = rng.permutation(idx)
      p = rng.dirichlet(np.full(num_clients, float(alpha)))
      cuts = (np.cumsum(p)[:-1] * len(idx)).astype(np.int64)
      for client, chunk in enumerate(np.split(idx, cuts)):
        parts[client].append(chunk)
    smallest = min(sum(map(len, part)) for part in parts)
    if smallest >= min_samples_per_client:
      return _finish([np.concatenate(part) for part in parts])
  raise ConfigError(
      f'dirichlet_partition could not give each of {num_clients} clients at least '
      f'{min_samples_per_client} examples (of {len(labels)}) with alpha={alpha} in '
      f'{max_tries} draws (last smallest client: {smallest}); lower min_samples_per_client, '
      'raise alpha, or use fewer clients.')


@gin.configurable('mixed_partition')
def mixed_partition(labels: np.ndarray,
                    num_clients: Optional[int] = None,
                    num_iid: Optional[int] = None,
                    num_noniid: Optional[int] = None,
                    samples_per_client: int = 600,
                    classes_per_noniid_client: int = 2,
                    seed: int = 0) -> Partition:
  """FedLayerWise's "k IID + m non-IID clients" partition (settings 5+5 and 2+8, 600 each).

  Every client gets exactly `samples_per_client` examples; left-over examples are not used. The
  `num_iid` IID clients come first, stratified over all classes present (the remainder to
  random classes). A non-IID client's examples are split evenly over the
  `classes_per_noniid_client` classes least used by earlier non-IID clients (ties at random).

  Args:
    num_clients: Optional; must equal `num_iid + num_noniid`, either of which may then be
      left unset.
  """
  labels = _check_labels(labels)
  if num_iid is None and num_noniid is None:
    raise ConfigError('mixed_partition needs num_iid and num_noniid, e.g. '
                      'mixed_partition.num_iid = 5 and mixed_partition.num_noniid = 5.')
  if num_iid is None:
    num_iid = (num_clients or 0) - num_noniid
  if num_noniid is None:
    num_noniid = (num_clients or 0) - num_iid
  if num_iid < 0 or num_noniid < 0 or num_iid + num_noniid < 1:
    raise ConfigError(f'mixed_partition needs num_iid >= 0, num_noniid >= 0 and at least '
                      f'one client, got num_iid={num_iid}, num_noniid={num_noniid}.')
  if num_clients is not None and num_iid + num_noniid != num_clients:
    raise ConfigError(f'mixed_partition has num_iid + num_noniid = {num_iid} + {num_noniid} '
                      f'= {num_iid + num_noniid} clients but num_clients is {num_clients}; '
                      'make them agree.')
  check_number('mixed_partition.samples_per_client', samples_per_client, integer=True, low=1)
  classes = np.unique(labels)
  check_number('mixed_partition.classes_per_noniid_client', classes_per_noniid_client,
               integer=True, low=1, high=len(classes), hint='at most the classes present')
  total = (num_iid + num_noniid) * samples_per_client
  if total > len(labels):
    raise ConfigError(
        f'mixed_partition needs {total} examples ({num_iid} IID + {num_noniid} non-IID '
        f'clients x {samples_per_client}) but only {len(labels)} are available; lower '
        'samples_per_client or the number of clients.')

  rng = np.random.default_rng(seed)
  num_classes = len(classes)
  # Per client: how many examples of each class (positions in `classes`).
  demand = np.zeros((num_iid + num_noniid, num_classes), dtype=np.int64)
  for i in range(num_iid):
    demand[i] = samples_per_client // num_classes
    extra = samples_per_client % num_classes
    demand[i, rng.choice(num_classes, extra, replace=False)] += 1
  usage = np.zeros(num_classes, dtype=np.int64)
  for j in range(num_noniid):
    tiebreak = rng.permutation(num_classes)
    chosen = np.lexsort((tiebreak, usage))[:classes_per_noniid_client]
    usage[chosen] += 1
    counts = np.full(classes_per_noniid_client,
                     samples_per_client // classes_per_noniid_client, dtype=np.int64)
    counts[:samples_per_client % classes_per_noniid_client] += 1
    demand[num_iid + j, chosen] = counts

  pools = [rng.permutation(np.flatnonzero(labels == c)) for c in classes]
  needed = demand.sum(axis=0)
  for c, (need, pool) in enumerate(zip(needed, pools)):
    if need > len(pool):
      raise ConfigError(
          f'mixed_partition needs {need} examples of class {classes[c]} but only {len(pool)} '
          f'are available (seed {seed}); lower samples_per_client or the number of clients, '
          'or change the seed.')
  starts = np.cumsum(demand, axis=0) - demand  # Each client's offset into each class's pool.
  parts = [np.concatenate([pools[c][s:s + k] for c, (s, k) in enumerate(zip(row_starts, row))])
           for row_starts, row in zip(starts, demand)]
  return _finish(parts)


@gin.configurable('natural_partition')
def natural_partition(labels: np.ndarray,
                      num_clients: Optional[int] = None,
                      seed: int = 0,
                      dataset: Any = None) -> Partition:
  """The dataset's own clients (`dataset.natural_partition`, e.g. synthetic or FEMNIST).

  Args:
    num_clients: Optional; must equal the number of natural clients.
    seed: Unused: the source fixes the partition.
    dataset: The `ArrayDataset` of `labels`; `build_federated_data` passes it.
  """
  del labels, seed
  parts = getattr(dataset, 'natural_partition', None)
  if parts is None:
    name = getattr(dataset, 'name', None)
    raise ConfigError(f'natural_partition needs a source with natural clients (e.g. '
                      f'synthetic_source), but dataset {name!r} has none; use another '
                      'partitioner such as dirichlet_partition.')
  if num_clients is not None and num_clients != len(parts):
    raise ConfigError(f'dataset {dataset.name!r} has {len(parts)} natural clients but '
                      f'num_clients is {num_clients}; set federated_data.num_clients = '
                      f'{len(parts)}.')
  return _finish(parts)  # `build_federated_data` checks the indices, as every partition's.


def label_histograms(labels: np.ndarray, partition: Sequence[np.ndarray],
                     num_classes: int) -> np.ndarray:
  """Per-client label counts, int64 `[num_clients, num_classes]`."""
  labels = _check_labels(labels)
  if labels.size and labels.max() >= num_classes:
    raise ConfigError(f'label {labels.max()} is out of range for num_classes={num_classes}.')
  hist = np.zeros((len(partition), num_classes), dtype=np.int64)
  for i, idx in enumerate(partition):
    hist[i] = np.bincount(labels[np.asarray(idx, dtype=np.int64)], minlength=num_classes)
  return hist


def local_test_split(test_labels: np.ndarray,
                     train_label_histogram_per_client: np.ndarray,
                     examples_per_client: int,
                     seed: int = 0) -> Partition:
  """Per-client local test sets (indices into the central test set) for personalised evaluation.

  Client i's `examples_per_client` are split over the classes in proportion to row i of
  `train_label_histogram_per_client` (`[num_clients, num_classes]`; largest remainder; classes
  absent from the test set dropped) and drawn from the test set without replacement, unless a
  class has too few (then with). Clients draw independently, so they may share examples.
  """
  test_labels = _check_labels(test_labels)
  hist = np.asarray(train_label_histogram_per_client)
  if hist.ndim != 2:
    raise ConfigError(f'train_label_histogram_per_client must be [num_clients, num_classes], '
                      f'got shape {hist.shape}.')
  check_number('examples_per_client', examples_per_client, integer=True, low=1)
  num_classes = hist.shape[1]
  pools = [np.flatnonzero(test_labels == c) for c in range(num_classes)]
  available = np.array([len(p) > 0 for p in pools])
  rng = np.random.default_rng(seed)
  parts = []
  for i, row in enumerate(hist):
    weights = np.where(available, row, 0).astype(np.float64)
    if weights.sum() <= 0:
      raise ConfigError(f'client {i} has no training examples of any class present in the '
                        'test set, so its local test split is undefined.')
    exact = weights / weights.sum() * examples_per_client  # Largest remainder; ties: lower class.
    counts = np.floor(exact).astype(np.int64)
    short = int(examples_per_client - counts.sum())
    if short > 0:
      counts[np.argsort(-(exact - counts), kind='stable')[:short]] += 1
    chunks = [rng.choice(pools[c], k, replace=k > len(pools[c]))
              for c, k in enumerate(counts) if k > 0]
    parts.append(np.concatenate(chunks))
  return _finish(parts)
