"""A dataset split into clients, and its conversion to TFF `ClientData`."""

import collections
import hashlib
import dataclasses
from typing import Any, Callable, Optional

import gin
import numpy as np

from fltff.data import partition as partition_lib
from fltff.data.sources import ArrayDataset
from fltff.data.sources import check_dataset
from fltff.config_checks import check_number
from fltff.config_checks import check_seed
from fltff.config_checks import gin_binds
from fltff.config_checks import parameters
from fltff.errors import ConfigError


@dataclasses.dataclass
class FederatedData:
  """A dataset split into clients.

  Attributes:
    client_ids: One id per client, e.g. 'client_000'.
    train_indices: Per client, indices into `dataset.x_train`, aligned with `client_ids`.
    local_test_indices: Optional per-client indices into `dataset.x_test` (personalised
      evaluation).
    source_seed: The seed the source drew its data with, if it has one.
    source_fingerprint: `digest` of the source's data wherever they lie (`fltff report`'s seed
      groups); None for data a source drew with a seed (its settings tell them apart).
  """
  dataset: ArrayDataset
  client_ids: list[str]
  train_indices: list[np.ndarray]
  local_test_indices: Optional[list[np.ndarray]] = None
  source_seed: Optional[int] = None
  source_fingerprint: Optional[str] = None

  def num_clients(self) -> int:
    return len(self.client_ids)

  def client_arrays(self, i: int) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) of client i's training data."""
    idx = self.train_indices[i]
    return self.dataset.x_train[idx], self.dataset.y_train[idx]

  def local_test_arrays(self, i: int) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) of client i's local test data."""
    if self.local_test_indices is None:
      raise ConfigError('this FederatedData has no local test splits; set '
                        'federated_data.local_test_examples to a positive number.')
    idx = self.local_test_indices[i]
    return self.dataset.x_test[idx], self.dataset.y_test[idx]

  def central_test(self) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) of the central test set."""
    return self.dataset.x_test, self.dataset.y_test

  def label_histograms(self) -> np.ndarray:
    """Training label counts, int64 `[num_clients, num_classes]`."""
    return partition_lib.label_histograms(self.dataset.y_train, self.train_indices,
                                          self.dataset.num_classes)

  def summary(self) -> dict[str, Any]:
    """A JSON-able description: sizes and label histograms per client."""
    out = {
        'dataset': self.dataset.name,
        'num_clients': self.num_clients(),
        'num_classes': int(self.dataset.num_classes),
        'num_train_examples': int(len(self.dataset.y_train)),
        'num_test_examples': int(len(self.dataset.y_test)),
        'client_ids': list(self.client_ids),
        'train_sizes': [int(len(idx)) for idx in self.train_indices],
        'label_histograms': self.label_histograms().tolist(),
    }
    if self.local_test_indices is not None:
      out['local_test_sizes'] = [int(len(idx)) for idx in self.local_test_indices]
    return out

  def fingerprint(self) -> str:
    """sha256 of everything a run reads of the data: the arrays (values, dtypes, shapes), the
    class count and the clients' training and local test indices. A resume compares it with
    the one its checkpoint recorded, so other data under the same path are refused."""
    return digest(self.dataset, list(self.train_indices) + list(self.local_test_indices or []))

  def client_data(self):
    """The training split as `tff.simulation.datasets.ClientData` of `OrderedDict(x=, y=)` in the
    arrays' dtypes, unscaled and unbatched; `dataset_computation` embeds the arrays as constants."""
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top

    x_all, y_all = self.dataset.x_train, self.dataset.y_train
    position = {cid: i for i, cid in enumerate(self.client_ids)}
    flat = np.concatenate(self.train_indices).astype(np.int64)
    bounds = np.concatenate([[0], np.cumsum([len(idx) for idx in self.train_indices])])
    ids = list(self.client_ids)

    def from_arrays(x, y):
      return tf.data.Dataset.from_tensor_slices(collections.OrderedDict(x=x, y=y))

    def dataset_fn(client_id):
      if isinstance(client_id, bytes):
        client_id = client_id.decode()
      if tf.is_tensor(client_id) and tf.executing_eagerly():
        client_id = client_id.numpy().decode()
      if isinstance(client_id, str):
        if client_id not in position:
          raise ConfigError(f'unknown client id {client_id!r}; ids are {ids[0]!r} .. '
                            f'{ids[-1]!r}.')
        idx = self.train_indices[position[client_id]]
        return from_arrays(x_all[idx], y_all[idx])
      # Symbolic id (tf.function, TFF computation): in-graph lookup; unknown ids fail at run time.
      i = tf.where(tf.equal(tf.constant(ids), client_id))[0, 0]
      b = tf.constant(bounds, dtype=tf.int64)
      idx = tf.constant(flat)[b[i]:b[i + 1]]
      return from_arrays(tf.gather(tf.constant(x_all), idx), tf.gather(tf.constant(y_all), idx))

    return tff.simulation.datasets.ClientData.from_clients_and_tf_fn(ids, dataset_fn)


def digest(dataset: ArrayDataset, indices: list[np.ndarray]) -> str:
  """sha256 of the class count and the arrays (values, dtypes, shapes) of `dataset`, then of
  `indices`."""
  return arrays_digest(f'{dataset.num_classes};', [dataset.x_train, dataset.y_train,
                                                   dataset.x_test, dataset.y_test, *indices])


def arrays_digest(head: str, arrays) -> str:
  """sha256 of `head`, then of each array's dtype, shape and bytes (a data fingerprint, a client
  state's digest)."""
  sha = hashlib.sha256(head.encode())
  for array in arrays:
    array = np.ascontiguousarray(array)
    sha.update(f'{array.dtype.str}{array.shape};'.encode())
    sha.update(memoryview(array).cast('B') if array.size else b'')
  return sha.hexdigest()


def _validate_partition(parts: Any, num_clients: int, num_examples: int) -> list[np.ndarray]:
  if not isinstance(parts, (list, tuple)):
    raise ConfigError(f'the partitioner must return a list of index arrays, got '
                      f'{type(parts).__name__}.')
  parts = [np.asarray(p, dtype=np.int64).reshape(-1) for p in parts]
  if len(parts) != num_clients:
    raise ConfigError(f'the partitioner returned {len(parts)} clients but num_clients is '
                      f'{num_clients}; make federated_data.num_clients match the partition.')
  for i, p in enumerate(parts):
    if p.size == 0:
      raise ConfigError(f'client {i} of {num_clients} has no training examples; use fewer '
                        'clients or a less skewed partition.')
    if p.min() < 0 or p.max() >= num_examples:
      raise ConfigError(f'client {i} has indices outside [0, {num_examples}); the '
                        'partitioner is broken.')
  flat = np.concatenate(parts)
  if len(np.unique(flat)) != len(flat):
    raise ConfigError('the partitioner assigned some examples to more than one client; '
                      'clients must be disjoint.')
  return parts


def subsample(dataset: ArrayDataset, fraction: float, seed: int) -> ArrayDataset:
  """A seeded random `fraction` of the training and of the test examples, in original order.

  KAPC's setting without client selection keeps 10 % of both before partitioning. `ConfigError`
  for a fraction outside (0, 1] or a dataset with a natural partition (a draw would break it).
  """
  check_number('federated_data.data_fraction', fraction, low=0, high=1, open_low=True)
  if fraction == 1:
    return dataset
  if dataset.natural_partition is not None:
    raise ConfigError(f'federated_data.data_fraction = {fraction} cannot be used with '
                      f'{dataset.name!r}, whose clients come with the data (natural '
                      'partition); choose fewer clients in the source instead.')
  rng = np.random.default_rng(seed)

  def draw(n: int) -> np.ndarray:
    keep = max(1, int(round(fraction * n)))
    return np.sort(rng.choice(n, size=keep, replace=False))

  train, test = draw(len(dataset.y_train)), draw(len(dataset.y_test))
  return dataclasses.replace(dataset, x_train=dataset.x_train[train],
                             y_train=dataset.y_train[train], x_test=dataset.x_test[test],
                             y_test=dataset.y_test[test])


@gin.configurable('federated_data', denylist=['run_seed'])
def build_federated_data(source: Callable[[], ArrayDataset] = gin.REQUIRED,
                         partitioner: Callable[..., list[np.ndarray]] = gin.REQUIRED,
                         num_clients: int = 10,
                         seed: Optional[int] = None,
                         local_test_examples: int = 0,
                         data_fraction: float = 1.0,
                         run_seed: int = 0) -> FederatedData:
  """Loads a source, partitions its training set and optionally makes local test splits.

  Args:
    source: A callable returning an `ArrayDataset` (in gin: `@npz_source`).
    partitioner: A callable `(labels=, num_clients=, seed=)` returning the partition (in gin:
      `@shard_partition`); one that also takes `dataset=` receives the dataset.
    seed: Seed of the partition, the local test splits, the `data_fraction` draw and a source
      that draws its data (e.g. `synthetic_source`) unless its own seed is bound; None:
      `run_seed` (`experiment.seed`), so one seed changes them all.
    local_test_examples: Per client, 0 for none: at most this many of its own held-out examples
      under a natural partition that has them, else drawn from the central test set in its
      label proportions (`local_test_split`).
    data_fraction: Fraction of the training and of the test examples kept (`subsample`)
      before partitioning.
  """
  check_number('federated_data.num_clients', num_clients, integer=True, low=1)
  check_number('federated_data.local_test_examples', local_test_examples, integer=True, low=0)
  if seed is None:
    seed = run_seed
  check_seed('federated_data.seed', seed)
  # A source with a `seed` parameter that gin does not bind (`<source name>.seed`) gets `seed`.
  origin = getattr(source, '__name__', 'federated_data.source')
  if 'seed' not in parameters(source):
    dataset, source_seed = source(), None
  elif gin_binds(f'{origin}.seed'):
    dataset, source_seed = source(), gin.query_parameter(f'{origin}.seed')
  else:
    dataset, source_seed = source(seed=seed), seed
  if not isinstance(dataset, ArrayDataset):
    raise ConfigError(f'federated_data.source must return an ArrayDataset, got '
                      f'{type(dataset).__name__}; use e.g. @npz_source or @tfds_source.')
  if gin_binds(f'{origin}.path'):
    origin = f"{origin} ({gin.query_parameter(f'{origin}.path')})"
  check_dataset(dataset, origin)
  source_fingerprint = digest(dataset, []) if source_seed is None else None
  dataset = subsample(dataset, data_fraction, seed)
  kwargs = dict(labels=dataset.y_train, num_clients=num_clients, seed=seed)
  if 'dataset' in parameters(partitioner):
    kwargs['dataset'] = dataset
  parts = _validate_partition(partitioner(**kwargs), num_clients, len(dataset.y_train))
  width = max(3, len(str(num_clients - 1)))
  client_ids = [f'client_{i:0{width}d}' for i in range(num_clients)]

  local_test = None
  if local_test_examples > 0:
    natural, natural_test = dataset.natural_partition, dataset.natural_test_partition
    is_natural = natural is not None and len(natural) == len(parts) and all(
        np.array_equal(np.sort(a), b) for a, b in zip(natural, parts))
    if is_natural and natural_test is not None:
      local_test = [np.sort(np.asarray(t, dtype=np.int64))[:local_test_examples]
                    for t in natural_test]
      for i in [i for i, t in enumerate(local_test) if not t.size][:1]:
        raise ConfigError(f'client {i} ({client_ids[i]}) has no local test examples: its source '
                          'holds none for it; draw other clients or set '
                          'federated_data.local_test_examples = 0.')
    else:
      hist = partition_lib.label_histograms(dataset.y_train, parts, dataset.num_classes)
      local_test = partition_lib.local_test_split(dataset.y_test, hist, local_test_examples,
                                                  seed)
  return FederatedData(dataset=dataset, client_ids=client_ids, train_indices=parts,
                       local_test_indices=local_test, source_seed=source_seed,
                       source_fingerprint=source_fingerprint)
