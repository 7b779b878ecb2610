"""Tests for fltff.data: sources, partitioners and FederatedData."""

import dataclasses
import json
import os
import pathlib
import re

import gin
import numpy as np
import pytest

from fltff import data
from fltff.errors import ConfigError
from fltff.errors import DataError

MNIST_NPZ = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'fltff', 'data', 'samples', 'mnist_first1003.npz')
REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]


def _balanced_labels(num_classes=10, per_class=100, seed=0):
  labels = np.repeat(np.arange(num_classes), per_class)
  return np.random.default_rng(seed).permutation(labels).astype(np.int32)


LABELS = _balanced_labels()

# name -> (partition fn taking (labels, seed), complete?)
PARTITIONERS = {
    'iid': (lambda y, s: data.iid_partition(y, num_clients=7, seed=s), True),
    'shard': (lambda y, s: data.shard_partition(y, num_clients=10, shards_per_client=2,
                                                seed=s), True),
    'dirichlet': (lambda y, s: data.dirichlet_partition(y, num_clients=10, alpha=0.3,
                                                        seed=s), True),
    'mixed': (lambda y, s: data.mixed_partition(y, num_clients=5, num_iid=2, num_noniid=3,
                                                samples_per_client=100, seed=s), False),
}


def _entropy(hist):
  p = hist / hist.sum(axis=1, keepdims=True)
  with np.errstate(divide='ignore', invalid='ignore'):
    return -np.nansum(np.where(p > 0, p * np.log(p), 0.0), axis=1)


@pytest.mark.parametrize('name', sorted(PARTITIONERS))
def test_partition_deterministic_disjoint_complete(name):
  fn, complete = PARTITIONERS[name]
  a, b, c = fn(LABELS, 1), fn(LABELS, 1), fn(LABELS, 2)
  assert len(a) == len(b)
  assert all(np.array_equal(x, y) for x, y in zip(a, b))
  assert not all(np.array_equal(x, y) for x, y in zip(a, c))
  for part in a:
    assert part.dtype == np.int64
    assert np.all(np.diff(part) > 0)  # Sorted and no duplicates within a client.
  flat = np.concatenate(a)
  assert len(np.unique(flat)) == len(flat)  # Disjoint.
  if complete:
    np.testing.assert_array_equal(np.sort(flat), np.arange(len(LABELS)))
  else:
    assert [len(p) for p in a] == [100] * 5


def test_iid_partition_sizes_and_mixing():
  parts = data.iid_partition(LABELS, num_clients=7, seed=0)
  assert sorted({len(p) for p in parts}) == [142, 143]  # 1000 = 6 * 143 + 142.
  hist = data.label_histograms(LABELS, parts, 10)
  assert hist.min() >= 3  # Every client sees every class.


@pytest.mark.parametrize('n,num_clients,shards_per_client', [(1000, 10, 2), (1003, 10, 2),
                                                            (997, 4, 3)])
def test_shard_partition_gives_contiguous_shards(n, num_clients, shards_per_client):
  labels = np.random.default_rng(3).integers(0, 10, n).astype(np.int32)
  parts = data.shard_partition(labels, num_clients=num_clients,
                               shards_per_client=shards_per_client, seed=5)
  num_shards = num_clients * shards_per_client
  order = np.argsort(labels, kind='stable')
  shard_of = np.empty(n, dtype=np.int64)
  for s, shard in enumerate(np.array_split(order, num_shards)):
    shard_of[shard] = s
  sizes = [len(s) for s in np.array_split(order, num_shards)]
  used = []
  for part in parts:
    shards = np.unique(shard_of[part])
    assert len(shards) == shards_per_client
    assert len(part) == sum(sizes[s] for s in shards)  # Whole shards only.
    used.extend(shards.tolist())
  assert sorted(used) == list(range(num_shards))


def test_shard_partition_two_labels_per_client_when_aligned():
  # 10 classes x 100 examples, 20 shards of 50: every shard holds one label.
  parts = data.shard_partition(LABELS, num_clients=10, num_shards=20, seed=0)
  hist = data.label_histograms(LABELS, parts, 10)
  assert np.all((hist > 0).sum(axis=1) <= 2)
  assert np.all(hist.sum(axis=1) == 100)
  assert set(np.unique(hist)) <= {0, 50, 100}


def test_dirichlet_small_alpha_is_more_skewed():
  labels = _balanced_labels(per_class=300)
  entropies = {}
  for alpha in (0.1, 0.5, 100.0):
    parts = data.dirichlet_partition(labels, num_clients=20, alpha=alpha, seed=0)
    entropies[alpha] = _entropy(data.label_histograms(labels, parts, 10)).mean()
  assert entropies[0.1] < entropies[0.5] < entropies[100.0]
  assert entropies[0.1] < 0.5 * np.log(10)
  assert entropies[100.0] > 0.95 * np.log(10)


def test_dirichlet_min_samples_per_client():
  parts = data.dirichlet_partition(LABELS, num_clients=20, alpha=0.1, seed=0,
                                   min_samples_per_client=10)
  assert min(len(p) for p in parts) >= 10
  assert sum(len(p) for p in parts) == 1000


def test_mixed_partition_iid_and_noniid_clients():
  labels = _balanced_labels(per_class=800)  # Enough for 5 + 5 and 2 + 8 clients x 600.
  parts = data.mixed_partition(labels, num_clients=10, num_iid=5, num_noniid=5, seed=0)
  hist = data.label_histograms(labels, parts, 10)
  np.testing.assert_array_equal(hist.sum(axis=1), [600] * 10)
  np.testing.assert_array_equal(hist[:5], np.full((5, 10), 60))  # IID: 60 per class.
  for row in hist[5:]:  # Non-IID: two classes, 300 each.
    assert sorted(row[row > 0].tolist()) == [300, 300]
  # Five non-IID clients x 2 classes cover all 10 classes once (least-used first).
  assert np.all((hist[5:] > 0).sum(axis=0) == 1)
  # num_noniid derived from num_clients.
  derived = data.mixed_partition(labels, num_clients=10, num_iid=2, seed=0)
  assert len(derived) == 10
  assert [int((h > 0).sum()) for h in data.label_histograms(labels, derived, 10)] == (
      [10, 10] + [2] * 8)


@pytest.mark.parametrize('call,message', [
    (lambda: data.iid_partition(np.zeros(1003, np.int32), num_clients=2000, seed=0),
     'cannot split 1003 examples into 2000 clients'),
    (lambda: data.dirichlet_partition(LABELS, num_clients=2000, alpha=0.5, seed=0),
     'cannot split 1000 examples into 2000 clients'),
    (lambda: data.dirichlet_partition(LABELS, num_clients=10, alpha=0.0, seed=0),
     'alpha must be > 0, got 0.0'),
    (lambda: data.dirichlet_partition(LABELS, num_clients=10, alpha=-1, seed=0),
     'alpha must be > 0, got -1'),
    (lambda: data.dirichlet_partition(LABELS, num_clients=100, alpha=0.01, seed=0,
                                      min_samples_per_client=10, max_tries=3),
     'could not give each of 100 clients at least 10 examples'),
    (lambda: data.shard_partition(LABELS, num_clients=10, num_shards=200, seed=0),
     r'num_shards=200, num_clients=10, shards_per_client=2; set shard_partition.num_shards '
     '= 20'),
    (lambda: data.shard_partition(LABELS[:15], num_clients=10, seed=0),
     'cannot cut 15 examples into 20 shards'),
    (lambda: data.mixed_partition(np.zeros(1003, np.int32) + np.arange(1003) % 10,
                                  num_iid=5, num_noniid=5, seed=0),
     r'needs 6000 examples \(5 IID \+ 5 non-IID clients x 600\) but only 1003 are available'),
    (lambda: data.mixed_partition(_balanced_labels(per_class=400), num_iid=0, num_noniid=6,
                                  seed=0),
     'needs 600 examples of class .* but only 400 are available'),
    (lambda: data.mixed_partition(LABELS, num_clients=10, num_iid=2, num_noniid=3,
                                  samples_per_client=10, seed=0),
     r'num_iid \+ num_noniid = 2 \+ 3 = 5 clients but num_clients is 10'),
    (lambda: data.natural_partition(LABELS, num_clients=10,
                                    dataset=data.npz_source(MNIST_NPZ)),
     "dataset 'mnist_first1003' has none"),
])
def test_partition_errors(call, message):
  with pytest.raises(ConfigError, match=message):
    call()


def test_label_histograms_sum_to_client_sizes():
  parts = data.dirichlet_partition(LABELS, num_clients=8, alpha=0.5, seed=4)
  hist = data.label_histograms(LABELS, parts, 10)
  assert hist.shape == (8, 10)
  np.testing.assert_array_equal(hist.sum(axis=1), [len(p) for p in parts])
  np.testing.assert_array_equal(hist.sum(axis=0), np.bincount(LABELS))


def test_local_test_split_matches_train_proportions():
  test_labels = _balanced_labels(per_class=50, seed=9)
  train_hist = np.array([[30, 10, 0, 0, 0, 0, 0, 0, 0, 60],
                         [1, 1, 1, 1, 1, 1, 1, 1, 1, 1],
                         [0, 0, 7, 0, 0, 0, 0, 0, 0, 0]])
  parts = data.local_test_split(test_labels, train_hist, examples_per_client=25, seed=0)
  again = data.local_test_split(test_labels, train_hist, examples_per_client=25, seed=0)
  assert all(np.array_equal(a, b) for a, b in zip(parts, again))
  local_hist = data.label_histograms(test_labels, parts, 10)
  np.testing.assert_array_equal(local_hist.sum(axis=1), [25, 25, 25])
  expected = train_hist / train_hist.sum(axis=1, keepdims=True) * 25
  assert np.all(np.abs(local_hist - expected) < 1)
  np.testing.assert_array_equal(local_hist[0], [8, 2, 0, 0, 0, 0, 0, 0, 0, 15])
  np.testing.assert_array_equal(local_hist[2], [0, 0, 25, 0, 0, 0, 0, 0, 0, 0])
  for p in parts:  # Without replacement when the class has enough test examples.
    assert len(np.unique(p)) == len(p)


def test_local_test_split_with_replacement_when_needed():
  test_labels = np.array([0, 0, 1, 1, 1], np.int32)
  parts = data.local_test_split(test_labels, np.array([[1, 0]]), examples_per_client=6,
                                seed=0)
  assert len(parts[0]) == 6
  assert set(test_labels[parts[0]]) == {0}


# ----------------------------------------------------------------------------- sources


@pytest.fixture(scope='module')
def mnist():
  return data.npz_source(MNIST_NPZ)


def test_npz_source_on_shared_mnist(mnist):
  assert mnist.name == 'mnist_first1003'
  assert mnist.x_train.shape == (1003, 28, 28, 1)
  assert mnist.x_test.shape == (1003, 28, 28, 1)
  assert mnist.x_train.dtype == np.uint8
  assert mnist.y_train.dtype == np.int32
  assert mnist.num_classes == 10
  assert set(np.unique(mnist.y_train)) == set(range(10))
  assert set(np.unique(mnist.y_test)) == set(range(10))
  assert mnist.natural_partition is None


def test_npz_source_relative_paths(monkeypatch, tmp_path):
  rel = os.path.relpath(MNIST_NPZ, REPO_ROOT)  # 'fltff/data/samples/mnist_first1003.npz'
  monkeypatch.chdir(REPO_ROOT)
  assert data.npz_source(rel).x_train.shape == (1003, 28, 28, 1)
  monkeypatch.chdir(tmp_path)  # Not found from here: falls back to the repository root.
  assert data.npz_source(rel, name='m').name == 'm'


@pytest.mark.parametrize('dtype,stored,seen', [
    # uint8: images, divided by 255 when batched; any other dtype: float32, as stored.
    (np.uint8, [0, 51, 255], [0.0, 0.2, 1.0]),
    (np.float64, [0.0, 51.0, 255.0], [0.0, 51.0, 255.0]),
    (np.float32, [-1.5, 0.25, 3.0], [-1.5, 0.25, 3.0]),
    (np.int64, [0, 51, 255], [0.0, 51.0, 255.0]),
])
def test_npz_features_are_scaled_only_when_uint8(dtype, stored, seen, tmp_path):
  """docs/configuration.md: what the `.npz` source and the batches do to the features."""
  from fltff.data.pipeline import preprocess_batch  # pylint: disable=g-import-not-at-top

  x = np.array([stored] * 2, dtype)  # Two examples of three features.
  np.savez(tmp_path / 'f.npz', x_train=x, y_train=np.array([0, 1]),
           x_test=np.array([stored[::-1]], dtype), y_test=np.array([1]))
  source = data.npz_source(str(tmp_path / 'f.npz'))
  assert source.x_train.dtype == (np.uint8 if dtype == np.uint8 else np.float32)
  batch = preprocess_batch({'x': source.x_train, 'y': source.y_train})
  assert batch['x'].dtype.name == 'float32'
  np.testing.assert_allclose(batch['x'].numpy(), [seen] * 2, rtol=1e-6)


def test_npz_source_errors_and_label_shapes(tmp_path):
  with pytest.raises(DataError, match='not found'):
    data.npz_source(str(tmp_path / 'missing.npz'))
  partial = tmp_path / 'partial.npz'
  np.savez(partial, x_train=np.zeros((3, 2)), y_train=np.zeros(3, np.int64))
  with pytest.raises(DataError, match=r"lacks arrays \['x_test', 'y_test'\]"):
    data.npz_source(str(partial))
  cifar_like = tmp_path / 'c.npz'
  np.savez(cifar_like, x_train=np.full((4, 8, 8, 3), 9, np.uint8),
           y_train=np.array([[0], [1], [2], [1]]), x_test=np.full((2, 8, 8, 3), 200, np.uint8),
           y_test=np.array([[2], [0]]))
  # Negative labels, and labels and examples of different counts.
  for y_train, message in (([0, -1, 2, 1], r'y_train holds 1 labels outside \[0, 3\)'),
                           ([0, 1, 2], 'x_train has 4 examples but y_train has 3')):
    bad = tmp_path / 'bad.npz'
    np.savez(bad, x_train=np.full((4, 8, 8, 3), 9, np.uint8), y_train=np.array(y_train),
             x_test=np.full((2, 8, 8, 3), 200, np.uint8), y_test=np.array([2, 0]))
    with pytest.raises(DataError, match=f'{bad}: {message}'):
      data.npz_source(str(bad))
  ds = data.npz_source(str(cifar_like), num_classes=5)
  assert ds.y_train.shape == (4,) and ds.y_train.dtype == np.int32
  assert ds.x_train.shape == (4, 8, 8, 3) and ds.num_classes == 5
  # A truncated download, and a file overwritten with something else.
  truncated = tmp_path / 'truncated.npz'
  truncated.write_bytes(cifar_like.read_bytes()[:300])
  overwritten = tmp_path / 'overwritten.npz'
  overwritten.write_bytes(b'PK\x03\x04' + b'\0' * 100)
  one_array = tmp_path / 'x.npy'  # np.save'd: a traceback before.
  np.save(one_array, np.zeros((4, 8, 8, 3), np.uint8))
  for path in (truncated, overwritten, one_array):
    with pytest.raises(DataError, match='cannot read .* as an .npz file'):
      data.npz_source(str(path))



def test_npz_labels_that_skip_a_class_need_a_declared_class_count(tmp_path):
  """1-based labels (MATLAB's; SVHN's .mat files hold 1..10) or labels with a gap: the class
  count inferred from the largest label would hold a class no example has, silently."""
  x = np.zeros((4, 2), np.float32)
  path = tmp_path / 'one_based.npz'
  np.savez(path, x_train=x, y_train=np.array([1, 2, 3, 1]), x_test=x[:2] + 1,
           y_test=np.array([3, 2]))
  with pytest.raises(DataError, match=re.escape(
      f'{path}: no example has label 0, but the class count inferred from the largest label '
      'is 4: labels are class indices 0..C-1 (1-based labels: subtract 1)')):
    data.npz_source(str(path))
  with pytest.raises(DataError, match=r'y_train holds 1 labels outside \[0, 3\) .*1-based '
                                      'labels, subtract 1'):
    data.npz_source(str(path), num_classes=3)
  assert data.npz_source(str(path), num_classes=4).num_classes == 4  # Declared: kept.


@pytest.mark.parametrize('name,shape,classes', [
    ('mnist', (28, 28, 1), 10), ('cifar10', (32, 32, 3), 10),
    # Any TFDS image classification dataset, its class count from its label feature.
    ('kmnist', (28, 28, 1), 10), ('emnist/letters', (28, 28, 1), 37)])
def test_tfds_source_on_mock_data(name, shape, classes):
  tfds = pytest.importorskip('tensorflow_datasets')
  with tfds.testing.mock_data(num_examples=12):
    ds = data.tfds_source(name)
  assert ds.name == name and ds.num_classes == classes
  assert ds.x_train.shape == (12,) + shape and ds.x_test.shape == (12,) + shape
  assert ds.x_train.dtype == np.uint8 and ds.y_train.dtype == np.int32
  assert ds.y_train.shape == (12,)
  assert ds.y_train.min() >= 0 and ds.y_train.max() < classes


def test_tfds_source_offline_unprepared(tmp_path):
  with pytest.raises(DataError) as e:
    data.tfds_source('mnist', data_dir=str(tmp_path))
  message = str(e.value)
  assert f"'mnist' is not prepared in {tmp_path}" in message
  assert "tfds.load('mnist'" in message and 'tfds_source.download = True' in message


def test_tfds_source_unknown_name_or_not_image_classification():
  with pytest.raises(ConfigError, match=r"TFDS has no dataset 'no_such_data'"):
    data.tfds_source('no_such_data')
  with pytest.raises(ConfigError, match=r"'imdb_reviews' is not image classification"):
    data.tfds_source('imdb_reviews')


def test_synthetic_source():
  a = data.synthetic_source(alpha=1, beta=1, num_clients=12, seed=3)
  b = data.synthetic_source(alpha=1, beta=1, num_clients=12, seed=3)
  c = data.synthetic_source(alpha=1, beta=1, num_clients=12, seed=4)
  np.testing.assert_array_equal(a.x_train, b.x_train)
  np.testing.assert_array_equal(a.y_test, b.y_test)
  assert a.x_train.shape != c.x_train.shape or not np.array_equal(a.x_train, c.x_train)
  assert a.name == 'synthetic_1_1' and a.num_classes == 10
  assert a.x_train.dtype == np.float32 and a.x_train.shape[1] == 60
  assert a.y_train.dtype == np.int32 and a.x_test.shape == (len(a.y_test), 60)
  assert 0 <= a.y_train.min() and a.y_train.max() < 10
  assert len(a.natural_partition) == 12
  flat = np.concatenate(a.natural_partition)
  np.testing.assert_array_equal(flat, np.arange(len(a.y_train)))
  totals = np.array([len(p) for p in a.natural_partition]) + np.array(
      [len(p) for p in a.natural_test_partition])
  assert totals.min() >= 50 and totals.max() <= 1000
  for tr, te in zip(a.natural_partition, a.natural_test_partition):
    assert len(te) == max(1, round(0.2 * (len(tr) + len(te))))
  iid = data.synthetic_source(alpha=0, beta=0, iid=True, num_clients=5, dimension=8,
                              num_classes=3, seed=0)
  assert iid.name == 'synthetic_iid' and iid.x_train.shape[1] == 8 and iid.y_train.max() < 3
  with pytest.raises(ConfigError, match='alpha >= 0 and beta >= 0, got alpha=-1'):
    data.synthetic_source(alpha=-1)
  with pytest.raises(ConfigError, match='synthetic_source.num_clients must be >= 1, got 0'):
    data.synthetic_source(num_clients=0)


# ----------------------------------------------------------------------------- federated


def test_build_federated_data_from_gin(mnist):
  gin.clear_config()
  try:
    gin.parse_config(f"""
        npz_source.path = '{MNIST_NPZ}'
        shard_partition.shards_per_client = 2
        federated_data.source = @npz_source
        federated_data.partitioner = @shard_partition
        federated_data.num_clients = 5
        federated_data.local_test_examples = 20
    """)
    fd = data.build_federated_data()
  finally:
    gin.clear_config()
  assert fd.num_clients() == 5
  assert fd.client_ids == [f'client_{i:03d}' for i in range(5)]
  assert sum(len(p) for p in fd.train_indices) == 1003
  hist = fd.label_histograms()
  np.testing.assert_array_equal(hist.sum(axis=1), [len(p) for p in fd.train_indices])
  x, y = fd.client_arrays(3)
  assert x.shape == (len(fd.train_indices[3]), 28, 28, 1)
  np.testing.assert_array_equal(np.bincount(y, minlength=10), hist[3])
  xt, yt = fd.local_test_arrays(3)
  assert xt.shape == (20, 28, 28, 1)
  local = np.bincount(yt, minlength=10)
  assert np.all(np.abs(local - hist[3] / hist[3].sum() * 20) < 1)
  assert fd.central_test()[0].shape == (1003, 28, 28, 1)
  summary = json.loads(json.dumps(fd.summary()))
  assert summary['dataset'] == 'mnist_first1003' and summary['num_clients'] == 5
  assert summary['train_sizes'] == [len(p) for p in fd.train_indices]
  assert summary['label_histograms'] == hist.tolist()
  assert summary['local_test_sizes'] == [20] * 5


def test_build_federated_data_natural_synthetic():
  src = lambda: data.synthetic_source(num_clients=6, seed=1)
  fd = data.build_federated_data(source=src, partitioner=data.natural_partition,
                                 num_clients=6, local_test_examples=5)
  ds = src()
  for i in range(6):
    np.testing.assert_array_equal(fd.train_indices[i], ds.natural_partition[i])
    np.testing.assert_array_equal(fd.local_test_indices[i], ds.natural_test_partition[i][:5])
  assert fd.local_test_arrays(0)[0].shape == (5, 60)
  with pytest.raises(ConfigError, match='has 6 natural clients but num_clients is 4'):
    data.build_federated_data(source=src, partitioner=data.natural_partition, num_clients=4)
  no_local = data.build_federated_data(source=src, partitioner=data.iid_partition,
                                       num_clients=3)
  with pytest.raises(ConfigError, match='no local test splits'):
    no_local.local_test_arrays(0)


def test_the_source_fingerprint_is_what_the_data_are_not_how_a_seed_split_them(mnist):
  """summary.json's `source_fingerprint`, by which `fltff report` tells data apart: one for
  every seed (partition, `data_fraction` draw), another for other data, none for data a source
  drew with a seed."""
  def build(source, seed, **kwargs):
    return data.build_federated_data(source=source, partitioner=data.iid_partition,
                                     num_clients=4, seed=seed, **kwargs)

  a, b = build(lambda: mnist, 0), build(lambda: mnist, 1, data_fraction=0.5)
  assert a.fingerprint() != b.fingerprint()
  assert a.source_fingerprint == b.source_fingerprint and len(a.source_fingerprint) == 64
  relabelled = dataclasses.replace(mnist, y_train=np.roll(mnist.y_train, 1))
  assert build(lambda: relabelled, 0).source_fingerprint not in (None, a.source_fingerprint)
  assert build(data.synthetic_source, 0).source_fingerprint is None


def test_a_client_without_local_test_examples_is_refused():
  """A natural partition whose client has no held-out examples: its local accuracy would read 0
  (before this check, a run stopped with a traceback where the data fingerprint hashed it)."""
  two = data.ArrayDataset('two', x_train=np.zeros((4, 3), np.float32),
                          y_train=np.array([0, 1, 0, 1]), x_test=np.ones((2, 3), np.float32),
                          y_test=np.array([0, 1]), num_classes=2,
                          natural_partition=[np.arange(2), np.arange(2, 4)],
                          natural_test_partition=[np.arange(2), np.arange(0)])
  with pytest.raises(ConfigError) as error:
    data.build_federated_data(source=lambda: two, partitioner=data.natural_partition,
                              num_clients=2, local_test_examples=3)
  assert str(error.value).splitlines()[0] == (
      'client 1 (client_001) has no local test examples: its source holds none for it; draw '
      'other clients or set federated_data.local_test_examples = 0.')
  assert data.build_federated_data(source=lambda: two, partitioner=data.natural_partition,
                                   num_clients=2).local_test_indices is None


@pytest.mark.parametrize('test_parts, message', [
    ([np.arange(2), np.array([1, 9])], "2 index arrays, 1 indices outside x_test's [0, 2)"),
    ([np.arange(2)], "1 index arrays, 0 indices outside x_test's [0, 2)"),
])
def test_natural_test_indices_that_miss_the_test_split_are_refused(test_parts, message):
  """A source of your own with natural clients: local test indices of another length or outside
  the test split (before, an IndexError traceback at the first local evaluation)."""
  own = data.ArrayDataset('own', x_train=np.zeros((4, 3), np.float32),
                          y_train=np.array([0, 1, 0, 1]), x_test=np.ones((2, 3), np.float32),
                          y_test=np.array([0, 1]), num_classes=2,
                          natural_partition=[np.arange(2), np.arange(2, 4)],
                          natural_test_partition=test_parts)
  with pytest.raises(DataError, match=re.escape(
      f'<lambda>: natural_test_partition has {message}; it needs one array of x_test indices '
      'per client of natural_partition (2).')):
    data.build_federated_data(source=lambda: own, partitioner=data.natural_partition,
                              num_clients=2, local_test_examples=2)

def test_client_data_elements(mnist):
  tf = pytest.importorskip('tensorflow')
  pytest.importorskip('tensorflow_federated')
  fd = data.build_federated_data(
      source=lambda: mnist,
      partitioner=lambda labels, num_clients, seed: data.dirichlet_partition(
          labels, num_clients, alpha=0.5, seed=seed),
      num_clients=4, seed=2)
  cd = fd.client_data()
  assert cd.client_ids == fd.client_ids
  spec = cd.element_type_structure
  assert list(spec) == ['x', 'y']
  assert spec['x'].shape == (28, 28, 1) and spec['x'].dtype == tf.uint8
  assert spec['y'].shape == () and spec['y'].dtype == tf.int32
  elements = list(cd.create_tf_dataset_for_client('client_002').as_numpy_iterator())
  assert len(elements) == len(fd.train_indices[2])
  x, y = fd.client_arrays(2)
  np.testing.assert_array_equal(np.stack([e['x'] for e in elements]), x)
  np.testing.assert_array_equal([e['y'] for e in elements], y)
  # The serialisable path (a symbolic client id, as inside a tff.Computation).
  traced = tf.function(cd.serializable_dataset_fn)
  assert traced(tf.constant('client_001')).reduce(0, lambda n, _: n + 1).numpy() == len(
      fd.train_indices[1])
  assert str(cd.dataset_computation.type_signature) == '(str -> <x=uint8[28,28,1],y=int32>*)'
