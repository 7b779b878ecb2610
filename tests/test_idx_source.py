"""Tests for the MNIST-family IDX source and the random data fraction (KAPC's 10 %)."""

import gzip
import pathlib
import struct

import gin
import numpy as np
import pytest

from fltff import data
from fltff.errors import ConfigError
from fltff.errors import DataError

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]


def _idx_bytes(array: np.ndarray) -> bytes:
  """The IDX encoding of `array` (uint8 or int32), written independently of the reader."""
  code = {np.dtype('u1'): 0x08, np.dtype('i4'): 0x0C}[array.dtype]
  header = bytes([0, 0, code, array.ndim]) + b''.join(struct.pack('>I', d) for d in array.shape)
  return header + array.astype(array.dtype.newbyteorder('>')).tobytes()


def _write_set(root: pathlib.Path, n_train=12, n_test=5, compress=True, seed=0):
  rng = np.random.default_rng(seed)
  arrays = {
      'train-images-idx3-ubyte': rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
      'train-labels-idx1-ubyte': rng.integers(0, 10, n_train, dtype=np.uint8),
      't10k-images-idx3-ubyte': rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
      't10k-labels-idx1-ubyte': rng.integers(0, 10, n_test, dtype=np.uint8),
  }
  root.mkdir(parents=True, exist_ok=True)
  for stem, a in arrays.items():
    raw = _idx_bytes(a)
    if compress:
      with gzip.open(root / f'{stem}.gz', 'wb') as f:
        f.write(raw)
    else:
      (root / stem).write_bytes(raw)
  return arrays


@pytest.mark.parametrize('compress', [True, False])
def test_idx_source_reads_what_was_written(tmp_path, compress):
  arrays = _write_set(tmp_path / 'fashion-mnist', compress=compress)
  ds = data.idx_source(str(tmp_path / 'fashion-mnist'))
  assert ds.name == 'fashion_mnist' and ds.num_classes == 10
  assert ds.x_train.shape == (12, 28, 28, 1) and ds.x_train.dtype == np.uint8
  np.testing.assert_array_equal(ds.x_train[..., 0], arrays['train-images-idx3-ubyte'])
  np.testing.assert_array_equal(ds.y_train, arrays['train-labels-idx1-ubyte'])
  np.testing.assert_array_equal(ds.x_test[..., 0], arrays['t10k-images-idx3-ubyte'])
  np.testing.assert_array_equal(ds.y_test, arrays['t10k-labels-idx1-ubyte'])
  assert ds.y_train.dtype == np.int32


def test_read_idx_big_endian_int32(tmp_path):
  a = np.array([[1, -2, 70000], [3, 4, -5]], np.int32)
  (tmp_path / 'x').write_bytes(_idx_bytes(a))
  out = data.read_idx(str(tmp_path / 'x'))
  np.testing.assert_array_equal(out, a)
  assert out.dtype.byteorder in ('=', '<', '|')


def test_idx_source_errors(tmp_path):
  root = tmp_path / 'set'
  with pytest.raises(DataError, match='not found.*apt-get install dataset-fashion-mnist'):
    data.idx_source(str(root))
  _write_set(root)
  (root / 't10k-labels-idx1-ubyte.gz').unlink()
  with pytest.raises(DataError, match=r'lacks t10k-labels-idx1-ubyte\[\.gz\]'):
    data.idx_source(str(root))

  # Truncated data (a partial download): the gzip stream ends early.
  _write_set(root)
  full = (root / 'train-images-idx3-ubyte.gz').read_bytes()
  (root / 'train-images-idx3-ubyte.gz').write_bytes(full[:len(full) // 2])
  with pytest.raises(DataError, match='damaged or truncated'):
    data.idx_source(str(root))
  # Truncated payload inside an intact container.
  _write_set(root)
  raw = _idx_bytes(np.zeros((12, 28, 28), np.uint8))[:-10]
  with gzip.open(root / 'train-images-idx3-ubyte.gz', 'wb') as f:
    f.write(raw)
  with pytest.raises(DataError, match=r'is truncated: shape \(12, 28, 28\)'):
    data.idx_source(str(root))
  # Not IDX at all.
  _write_set(root)
  with gzip.open(root / 'train-labels-idx1-ubyte.gz', 'wb') as f:
    f.write(b'<html>not found</html>')
  with pytest.raises(DataError, match='is not an IDX file'):
    data.idx_source(str(root))
  # Images and labels from different sets.
  _write_set(root)
  with gzip.open(root / 'train-labels-idx1-ubyte.gz', 'wb') as f:
    f.write(_idx_bytes(np.zeros(11, np.uint8)))
  with pytest.raises(DataError, match='12 images but train-labels-idx1-ubyte.gz has 11 labels'):
    data.idx_source(str(root))
  # Test images of another size.
  _write_set(root)
  with gzip.open(root / 't10k-images-idx3-ubyte.gz', 'wb') as f:
    f.write(_idx_bytes(np.zeros((5, 32, 32), np.uint8)))
  with pytest.raises(DataError, match='must match'):
    data.idx_source(str(root))
  # Labels out of range.
  _write_set(root)
  with gzip.open(root / 't10k-labels-idx1-ubyte.gz', 'wb') as f:
    f.write(_idx_bytes(np.full(5, 12, np.uint8)))
  with pytest.raises(DataError, match=r'y_test holds 5 labels outside \[0, 10\)'):
    data.idx_source(str(root))


def test_subsample_draws_fraction_without_replacement():
  rng = np.random.default_rng(1)
  ds = data.ArrayDataset('t', x_train=np.arange(1000, dtype=np.float32)[:, None],
                         y_train=rng.integers(0, 10, 1000).astype(np.int32),
                         x_test=np.arange(200, dtype=np.float32)[:, None],
                         y_test=rng.integers(0, 10, 200).astype(np.int32), num_classes=10)
  small = data.subsample(ds, 0.1, seed=3)
  assert len(small.y_train) == 100 and len(small.y_test) == 20
  kept = small.x_train[:, 0].astype(int)
  assert len(np.unique(kept)) == 100 and np.all(np.diff(kept) > 0)
  np.testing.assert_array_equal(small.y_train, ds.y_train[kept])
  again = data.subsample(ds, 0.1, seed=3)
  np.testing.assert_array_equal(again.x_train, small.x_train)
  assert not np.array_equal(data.subsample(ds, 0.1, seed=4).x_train, small.x_train)
  assert data.subsample(ds, 1.0, seed=0) is ds
  for bad, message in ((0, r'must be in \(0, 1\], got 0\.'), (1.5, r'must be in \(0, 1\]'),
                       (-0.1, r'must be in \(0, 1\]'), ('0.1', "must be a number, got '0.1'")):
    with pytest.raises(ConfigError, match=f'federated_data.data_fraction {message}'):
      data.subsample(ds, bad, seed=0)
  natural = data.synthetic_source(num_clients=3)
  with pytest.raises(ConfigError, match='natural partition'):
    data.subsample(natural, 0.5, seed=0)


def test_fmnist_idx_gin_with_fraction(tmp_path):
  """base/fmnist_idx.gin + a path binding + data_fraction, as the KAPC N=10 twins use it."""
  _write_set(tmp_path / 'fm', n_train=200, n_test=50)
  gin.clear_config()
  try:
    gin.parse_config_files_and_bindings(
        [str(REPO_ROOT / 'gin_configs/base/fmnist_idx.gin')],
        [f"idx_source.path = '{tmp_path / 'fm'}'",
         'federated_data.partitioner = @iid_partition', 'federated_data.num_clients = 4',
         'federated_data.data_fraction = 0.1'])
    fd = data.build_federated_data()
  finally:
    gin.clear_config()
  assert fd.dataset.name == 'fashion_mnist'
  assert sum(len(i) for i in fd.train_indices) == 20 and len(fd.dataset.y_test) == 5
