"""The FEMNIST source on a tiny database in TFF's exact on-disk format, without network.

TFF 0.87's `tff.simulation.datasets.emnist.load_data` reads one SQLite file,
`<cache_dir>/emnist_all.sqlite`, with tables `examples(split_name, client_id,
serialized_example_proto)` and `client_metadata(client_id, split_name, num_examples)`; the
splits are 'all_train', 'all_test', 'digits_only_train', 'digits_only_test', and each example
is a `tf.train.Example` with float 'pixels' (28*28, 1.0 = background) and int64 'label'.
"""

import sqlite3
import urllib.error

import gin
import numpy as np
import pytest
import tensorflow as tf
from tensorflow_federated.python.simulation.datasets import download as tff_download

from fltff import data
from fltff.errors import ConfigError
from fltff.errors import DataError

DB_NAME = 'emnist_all.sqlite'
# writer id -> (training examples, test examples); 'f0003_22' is the only small writer.
SIZES = {
    'f0001_00': (5, 2),
    'f0002_11': (7, 1),
    'f0003_22': (2, 3),
    'f0004_33': (8, 1),
    'f0005_44': (4, 2),
    'f0006_55': (6, 2),
}


def _make_writers(seed=0):
  """writer -> split ('train'/'test') -> (float32 pixels [n, 28, 28], int32 labels [n])."""
  rng = np.random.default_rng(seed)
  writers = {}
  for w, (writer, sizes) in enumerate(sorted(SIZES.items())):
    writers[writer] = {}
    for split, n in zip(('train', 'test'), sizes):
      pixels = rng.random((n, 28, 28)).astype(np.float32)
      pixels[:, :4] = 1.0  # Background rows, as in the real data.
      pixels[:, 4, :3] = (0.0, 0.5, 1.0 / 255)  # Exact ink, a rounding tie, one grey step.
      labels = rng.integers(0, 62, n).astype(np.int32)
      labels[0] = (w + (split == 'test')) % 10  # Every writer has digits in both splits.
      writers[writer][split] = (pixels, labels)
  return writers


def _serialize(pixels, label):
  return tf.train.Example(features=tf.train.Features(feature={
      'pixels': tf.train.Feature(float_list=tf.train.FloatList(value=pixels.reshape(-1))),
      'label': tf.train.Feature(int64_list=tf.train.Int64List(value=[int(label)])),
  })).SerializeToString()


def _write_db(path, writers):
  """Writes `writers` in TFF's schema; examples of different writers are interleaved."""
  rows, metadata = [], []
  for writer, splits in writers.items():
    for split, (pixels, labels) in splits.items():
      digits = labels < 10
      for tff_split, keep in ((f'all_{split}', np.ones_like(digits)),
                              (f'digits_only_{split}', digits)):
        for i in np.flatnonzero(keep):
          rows.append((i, tff_split, writer, _serialize(pixels[i], labels[i])))
        metadata.append((writer, tff_split, int(keep.sum())))
  rows.sort(key=lambda r: r[0])  # Round-robin over writers; order within a writer kept.
  with sqlite3.connect(path) as con:
    con.execute('CREATE TABLE examples (split_name TEXT NOT NULL, client_id TEXT NOT NULL, '
                'serialized_example_proto BLOB NOT NULL);')
    con.execute('CREATE TABLE client_metadata (client_id TEXT NOT NULL, '
                'split_name TEXT NOT NULL, num_examples INTEGER NOT NULL);')
    con.executemany('INSERT INTO examples (split_name, client_id, serialized_example_proto) '
                    'VALUES (?, ?, ?);', [r[1:] for r in rows])
    con.executemany('INSERT INTO client_metadata (client_id, split_name, num_examples) '
                    'VALUES (?, ?, ?);', metadata)
  con.close()


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
  """Fails any test in which TFF tries to download (it would fetch the real 1 GB+ file)."""

  def fetch(origin, filename):
    raise AssertionError(f'TFF tried to download {origin} to {filename}')

  monkeypatch.setattr(tff_download, '_fetch_lzma_file', fetch)


@pytest.fixture(scope='module')
def writers():
  return _make_writers()


@pytest.fixture(scope='module')
def cache_dir(tmp_path_factory, writers):
  d = tmp_path_factory.mktemp('tff_cache')
  _write_db(str(d / DB_NAME), writers)
  return str(d)


def _expected_writers(num_clients, seed, min_examples=1):
  eligible = sorted(w for w, (n_train, _) in SIZES.items() if n_train >= min_examples)
  picked = np.random.default_rng(seed).choice(len(eligible), num_clients, replace=False)
  return [eligible[i] for i in sorted(picked)]


def _as_mnist(pixels):
  """The documented conversion, in NumPy: ink-on-black uint8 with a channel axis."""
  assert pixels.dtype == np.float32  # As TFF parses them; float32 arithmetic as documented.
  return np.round((1 - pixels) * 255).astype(np.uint8)[..., None]


def test_loads_chosen_writers_with_natural_partitions(cache_dir, writers):
  ds = data.femnist_source(num_clients=4, cache_dir=cache_dir, seed=3)
  chosen = _expected_writers(4, seed=3)
  assert ds.name == 'femnist' and ds.num_classes == 62
  assert ds.x_train.dtype == np.uint8 and ds.x_train.shape[1:] == (28, 28, 1)
  assert ds.y_train.dtype == np.int32 and ds.y_test.dtype == np.int32
  assert len(ds.natural_partition) == len(ds.natural_test_partition) == 4
  assert [len(p) for p in ds.natural_partition] == [SIZES[w][0] for w in chosen]
  assert [len(p) for p in ds.natural_test_partition] == [SIZES[w][1] for w in chosen]
  assert len(ds.y_train) == sum(SIZES[w][0] for w in chosen)
  assert len(ds.y_test) == sum(SIZES[w][1] for w in chosen)
  for writer, tr, te in zip(chosen, ds.natural_partition, ds.natural_test_partition):
    for split, idx, x, y in (('train', tr, ds.x_train, ds.y_train),
                             ('test', te, ds.x_test, ds.y_test)):
      pixels, labels = writers[writer][split]
      np.testing.assert_array_equal(x[idx], _as_mnist(pixels))
      np.testing.assert_array_equal(y[idx], labels)
  # Background (1.0) is black, full ink (0.0) is white, 0.5 rounds to 128 (half to even).
  first = ds.x_train[ds.natural_partition[0][0], ..., 0]
  assert np.all(first[:4] == 0)
  np.testing.assert_array_equal(first[4, :3], [255, 128, 254])
  # The partitions are contiguous and cover the arrays exactly once.
  np.testing.assert_array_equal(np.concatenate(ds.natural_partition),
                                np.arange(len(ds.y_train)))
  np.testing.assert_array_equal(np.concatenate(ds.natural_test_partition),
                                np.arange(len(ds.y_test)))


def test_selection_is_deterministic_per_seed_and_respects_min_examples(cache_dir):

  def train_sizes(**kwargs):
    ds = data.femnist_source(cache_dir=cache_dir, **kwargs)
    return [len(p) for p in ds.natural_partition], ds.y_train

  a_sizes, a_labels = train_sizes(num_clients=3, seed=0)
  b_sizes, b_labels = train_sizes(num_clients=3, seed=0)
  assert a_sizes == b_sizes
  np.testing.assert_array_equal(a_labels, b_labels)
  assert a_sizes == [SIZES[w][0] for w in _expected_writers(3, seed=0)]  # [8, 4, 6]
  c_sizes, _ = train_sizes(num_clients=3, seed=1)
  assert c_sizes == [SIZES[w][0] for w in _expected_writers(3, seed=1)]  # [7, 2, 4]
  assert c_sizes != a_sizes
  # The writer with 2 training examples is never chosen with min_examples_per_client=3.
  all_big, _ = train_sizes(num_clients=5, min_examples_per_client=3)
  assert sorted(all_big) == [4, 5, 6, 7, 8]
  everyone, _ = train_sizes(num_clients=6)
  assert everyone == [SIZES[w][0] for w in sorted(SIZES)]


def test_only_digits_reads_the_digit_splits(cache_dir, writers):
  ds = data.femnist_source(num_clients=6, only_digits=True, cache_dir=cache_dir)
  assert ds.name == 'femnist_digits' and ds.num_classes == 10
  assert ds.y_train.max() < 10 and ds.y_test.max() < 10
  for writer, tr, te in zip(sorted(SIZES), ds.natural_partition, ds.natural_test_partition):
    for split, idx, x, y in (('train', tr, ds.x_train, ds.y_train),
                             ('test', te, ds.x_test, ds.y_test)):
      pixels, labels = writers[writer][split]
      digits = labels < 10
      np.testing.assert_array_equal(y[idx], labels[digits])
      np.testing.assert_array_equal(x[idx], _as_mnist(pixels[digits]))


def test_too_many_clients_is_a_config_error(cache_dir):
  with pytest.raises(ConfigError, match='num_clients is 7 but only 6 writers'):
    data.femnist_source(num_clients=7, cache_dir=cache_dir)
  with pytest.raises(ConfigError, match='only 4 writers have at least 5 training'):
    data.femnist_source(num_clients=5, cache_dir=cache_dir, min_examples_per_client=5)
  with pytest.raises(ConfigError, match='num_clients must be >= 1'):
    data.femnist_source(num_clients=0, cache_dir=cache_dir)


def test_missing_file_is_a_one_line_data_error_and_nothing_is_created(tmp_path):
  missing = tmp_path / 'no_cache'
  with pytest.raises(DataError) as info:
    data.femnist_source(cache_dir=str(missing))
  # Gin appends 'In call to configurable ...', which pipelines/run.py drops.
  lines = [l for l in str(info.value).splitlines()
           if l.strip() and not l.strip().startswith('In call to configurable')]
  assert len(lines) == 1
  message = lines[0]
  assert DB_NAME in message and str(missing) in message
  assert 'femnist_source.download = True' in message
  assert not missing.exists()  # TFF was not called: it would have created the directory.


def test_corrupt_file_is_a_data_error(tmp_path):
  (tmp_path / DB_NAME).write_bytes(b'not a database' * 100)
  with pytest.raises(DataError, match='not a readable TFF EMNIST database'):
    data.femnist_source(cache_dir=str(tmp_path))


def test_download_goes_through_tff_and_a_failed_one_leaves_no_file(tmp_path, monkeypatch,
                                                                   writers):
  calls = []

  def fetch_ok(origin, filename):
    calls.append(origin)
    _write_db(filename, writers)

  monkeypatch.setattr(tff_download, '_fetch_lzma_file', fetch_ok)
  ds = data.femnist_source(num_clients=2, cache_dir=str(tmp_path / 'a'), download=True)
  assert calls == ['https://storage.googleapis.com/tff-datasets-public/emnist_all.sqlite.lzma']
  assert len(ds.natural_partition) == 2 and (tmp_path / 'a' / DB_NAME).is_file()

  def fetch_broken(origin, filename):
    with open(filename, 'wb') as f:
      f.write(b'partial')
    raise urllib.error.URLError('no route to host')

  monkeypatch.setattr(tff_download, '_fetch_lzma_file', fetch_broken)
  with pytest.raises(DataError, match='downloading FEMNIST .* failed .*no route to host'):
    data.femnist_source(cache_dir=str(tmp_path / 'b'), download=True)
  assert not (tmp_path / 'b' / DB_NAME).exists()


def test_build_federated_data_with_natural_partition_from_gin(cache_dir, writers):
  chosen = _expected_writers(4, seed=2)
  gin.clear_config()
  try:
    gin.parse_config(f"""
        femnist_source.cache_dir = '{cache_dir}'
        femnist_source.num_clients = 4
        femnist_source.seed = 2
        federated_data.source = @femnist_source
        federated_data.partitioner = @natural_partition
        federated_data.num_clients = 4
        federated_data.local_test_examples = 2
    """)
    fd = data.build_federated_data()
    gin.bind_parameter('federated_data.num_clients', 5)
    with pytest.raises(ConfigError, match='has 4 natural clients but num_clients is 5'):
      data.build_federated_data()
  finally:
    gin.clear_config()
  assert fd.num_clients() == 4 and fd.dataset.name == 'femnist'
  assert [len(p) for p in fd.train_indices] == [SIZES[w][0] for w in chosen]
  # Each client's local test split is its own writer's test examples (at most 2).
  assert fd.summary()['local_test_sizes'] == [min(2, SIZES[w][1]) for w in chosen]
  for i, writer in enumerate(chosen):
    x, y = fd.client_arrays(i)
    np.testing.assert_array_equal(y, writers[writer]['train'][1])
    xt, yt = fd.local_test_arrays(i)
    np.testing.assert_array_equal(yt, writers[writer]['test'][1][:2])
    np.testing.assert_array_equal(xt, _as_mnist(writers[writer]['test'][0][:2]))
  element = next(iter(fd.client_data().create_tf_dataset_for_client('client_001')))
  np.testing.assert_array_equal(element['x'].numpy(),
                                _as_mnist(writers[chosen[1]]['train'][0][:1])[0])
  assert int(element['y']) == writers[chosen[1]]['train'][1][0]
