"""Data sources: each returns the whole dataset as in-memory NumPy arrays.

Six sources, all gin-configurable and none of which downloads anything unless asked to:

* `tfds_source`: MNIST, Fashion-MNIST, CIFAR-10/100 through `tfds.load` from a prepared
  `data_dir` (or with `download=True`).
* `idx_source`: the MNIST-family IDX files as their authors (and Debian's
  `dataset-fashion-mnist` package) distribute them (`train-images-idx3-ubyte.gz`, ...).
* `npz_source`: a Keras-layout `.npz` file (`x_train, y_train, x_test, y_test`).
* `image_folder_source`: an image folder in the published CINIC-10 layout
  (`<root>/<split>/<class>/*.png`).
* `femnist_source`: FEMNIST (federated EMNIST, one client per writer) through
  `tff.simulation.datasets.emnist.load_data`, with its natural writer partition.
* `synthetic_source`: the Synthetic(alpha, beta) generator of FedProx (Li et al., "Federated
  Optimization in Heterogeneous Networks", MLSys 2020, Sec. 5.1), itself from LEAF. It needs
  nothing on disk and is the offline default.
"""

import dataclasses
import os
import pathlib
import sqlite3
import zipfile
from typing import Optional

import gin
import numpy as np

from fltff import resources
from fltff.errors import ConfigError
from fltff.errors import DataError


@dataclasses.dataclass(frozen=True)
class ArrayDataset:
  """A whole dataset in memory.

  Attributes:
    name: A short name, e.g. 'mnist' or 'synthetic_1_1'.
    x_train: Images as uint8 `[n, H, W, C]`; feature vectors as float32 `[n, d]`.
    y_train: int32 labels `[n]` in `[0, num_classes)`.
    x_test: Like `x_train`, the central test set.
    y_test: Like `y_train`.
    num_classes: The number of classes.
    natural_partition: Optional per-client index arrays into `x_train` for datasets that come
      with clients (the synthetic source: one array per generated client).
    natural_test_partition: Optional per-client index arrays into `x_test`, aligned with
      `natural_partition`: each client's own held-out examples.
  """
  name: str
  x_train: np.ndarray
  y_train: np.ndarray
  x_test: np.ndarray
  y_test: np.ndarray
  num_classes: int
  natural_partition: Optional[list[np.ndarray]] = None
  natural_test_partition: Optional[list[np.ndarray]] = None


# Split once into batches of this size when materialising a TFDS split as arrays.
_TFDS_BATCH = 8192


def _tfds_data_dir(data_dir: Optional[str]) -> str:
  """The directory `tfds.load` reads from: `data_dir`, $TFDS_DATA_DIR or TFDS's default."""
  if data_dir:
    return os.path.abspath(os.path.expanduser(data_dir))
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  default = os.environ.get('TFDS_DATA_DIR') or tfds.core.constants.DATA_DIR
  return os.path.abspath(os.path.expanduser(default))


def _images(x: np.ndarray) -> np.ndarray:
  """Adds a channel axis to `[n, H, W]` images."""
  return x[..., np.newaxis] if x.ndim == 3 else x


@gin.configurable('tfds_source')
def tfds_source(name: str,
                data_dir: Optional[str] = None,
                download: bool = False) -> ArrayDataset:
  """Loads a TFDS image classification dataset as arrays.

  Args:
    name: A TFDS image classification dataset with 'train' and 'test' splits and an
      (image, label) supervised form: e.g. 'mnist', 'fashion_mnist', 'cifar10', 'cifar100',
      'kmnist', 'emnist/digits', 'svhn_cropped'. Its class count comes from the label feature.
    data_dir: The TFDS data directory; `None` means $TFDS_DATA_DIR or `~/tensorflow_datasets`.
    download: Whether TFDS may download and prepare the data if it is not in `data_dir`.

  Returns:
    An `ArrayDataset` with uint8 images `[n, H, W, C]` and int32 labels.

  Raises:
    ConfigError: For a name TFDS does not know, or a dataset that is not image
      classification.
    DataError: If the data is not prepared in `data_dir` and `download` is False.
  """
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

  num_classes = _tfds_num_classes(tfds, name, data_dir)
  try:
    # Not `batch_size=-1`: TFDS then batches by the split size from the metadata, which
    # `tfds.testing.mock_data` reports as 0, and the process aborts (batch of sys.maxsize).
    splits = tfds.load(name, split=['train', 'test'], as_supervised=True,
                       data_dir=data_dir, download=download)
  except Exception as e:  # pylint: disable=broad-except
    not_prepared = isinstance(e, (AssertionError, FileNotFoundError)) or (
        'NotFound' in type(e).__name__)
    if not not_prepared:
      raise
    resolved = _tfds_data_dir(data_dir)
    raise DataError(
        f'TFDS dataset {name!r} is not prepared in {resolved} and downloading is off '
        f'({type(e).__name__}); prepare it on a machine with network access with '
        f'`python -c "import tensorflow_datasets as tfds; tfds.load(\'{name}\', '
        f'data_dir=\'{resolved}\')"` and copy that directory here, or set '
        f'`tfds_source.download = True`.') from e

  arrays = []
  for ds in splits:
    xs, ys = [], []
    for x, y in tfds.as_numpy(ds.batch(_TFDS_BATCH)):
      xs.append(x)
      ys.append(y)
    if not xs:
      raise DataError(f'TFDS dataset {name!r} in {_tfds_data_dir(data_dir)} has an empty '
                      'split; re-prepare it with tfds.load(..., download=True).')
    arrays.append((_images(np.concatenate(xs)).astype(np.uint8),
                   np.concatenate(ys).astype(np.int32).reshape(-1)))
  (x_train, y_train), (x_test, y_test) = arrays
  return ArrayDataset(name=name, x_train=x_train, y_train=y_train, x_test=x_test,
                      y_test=y_test, num_classes=num_classes)


def _tfds_num_classes(tfds, name: str, data_dir: Optional[str]) -> int:
  """The class count of TFDS dataset `name` (from its builder's label feature, no data read);
  `ConfigError` for an unknown name or a dataset that is not (image, label) classification."""
  try:
    builder = tfds.builder(name, data_dir=data_dir)
  except Exception as e:  # pylint: disable=broad-except
    if 'NotFound' not in type(e).__name__:
      raise
    raise ConfigError(f'TFDS has no dataset {name!r} (tfds_source.name; see '
                      'https://www.tensorflow.org/datasets/catalog), or use npz_source for '
                      'other data.') from None
  keys = builder.info.supervised_keys
  label = builder.info.features[keys[1]] if keys and len(keys) == 2 else None
  if label is None or not hasattr(label, 'num_classes') or len(
      getattr(builder.info.features[keys[0]], 'shape', ())) not in (2, 3):
    raise ConfigError(f'TFDS dataset {name!r} is not image classification (a supervised '
                      '(image, label) pair with a class label); tfds_source reads those only.')
  return int(label.num_classes)


def _candidates(path: str) -> list[pathlib.Path]:
  """Where a relative data path is looked up: the current directory, then fltff's shipped
  files (`fltff/data/samples/...`, in a checkout or an installed package)."""
  p = pathlib.Path(os.path.expanduser(path))
  if p.is_absolute():
    return [p]
  return [pathlib.Path.cwd() / p] + [pathlib.Path(r) / p for r in resources.shipped_roots()]


def _resolve_path(path: str) -> pathlib.Path:
  """Resolves `path` against the current directory, then fltff's shipped files."""
  candidates = _candidates(path)
  for c in candidates:
    if c.is_file():
      return c
  tried = ', '.join(str(c.resolve()) for c in candidates)
  raise DataError(f'npz file {path!r} not found (tried {tried}); check npz_source.path, '
                  'relative paths are resolved against the current directory and then '
                  "fltff's shipped files.")


_NPZ_KEYS = ('x_train', 'y_train', 'x_test', 'y_test')

# IDX element types (LeCun's format description, "THE IDX FILE FORMAT"): the third byte of the
# magic number; data are stored big-endian.
_IDX_DTYPES = {0x08: np.dtype('u1'), 0x09: np.dtype('i1'), 0x0B: np.dtype('>i2'),
               0x0C: np.dtype('>i4'), 0x0D: np.dtype('>f4'), 0x0E: np.dtype('>f8')}
# The four files of the MNIST family, per split: (images, labels).
IDX_FILES = {
    'train': ('train-images-idx3-ubyte', 'train-labels-idx1-ubyte'),
    'test': ('t10k-images-idx3-ubyte', 't10k-labels-idx1-ubyte'),
}
_IDX_HINT = ('Fashion-MNIST: `apt-get install dataset-fashion-mnist` (Debian/Ubuntu, files in '
             '/usr/share/datasets/fashion-mnist/) or the four .gz files from '
             'github.com/zalandoresearch/fashion-mnist; MNIST: the same four files from its '
             'authors. Bind idx_source.path to their folder.')


def read_idx(path: str) -> np.ndarray:
  """Reads one IDX file (gzip-compressed if its name ends in `.gz`) into a NumPy array.

  The format: two zero bytes, a type byte (0x08 uint8 ... 0x0E float64), the number of
  dimensions, each dimension as a big-endian uint32, then the data in row-major order.

  Raises:
    DataError: For a file that is not IDX, is truncated, or has bytes left over.
  """
  import gzip  # pylint: disable=g-import-not-at-top
  import zlib  # pylint: disable=g-import-not-at-top

  opener = gzip.open if str(path).endswith('.gz') else open
  try:
    with opener(path, 'rb') as f:
      raw = f.read()
  except (OSError, EOFError, zlib.error) as e:  # gzip.BadGzipFile is an OSError.
    raise DataError(f'cannot read {path} ({type(e).__name__}: {e}); the file is damaged or '
                    f'truncated, fetch it again. {_IDX_HINT}') from e
  if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES or raw[3] == 0:
    raise DataError(f'{path} is not an IDX file (magic bytes {raw[:4].hex() or "missing"}, '
                    f'expected 0000 <type> <ndim>). {_IDX_HINT}')
  dtype, ndim = _IDX_DTYPES[raw[2]], raw[3]
  header = 4 + 4 * ndim
  if len(raw) < header:
    raise DataError(f'{path} is truncated: its header needs {header} bytes, the file has '
                    f'{len(raw)}. Fetch it again. {_IDX_HINT}')
  shape = tuple(int(d) for d in np.frombuffer(raw, '>u4', count=ndim, offset=4))
  expected = header + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
  if len(raw) != expected:
    what = 'truncated' if len(raw) < expected else 'longer than its header says'
    raise DataError(f'{path} is {what}: shape {shape} needs {expected} bytes, the file has '
                    f'{len(raw)}. Fetch it again. {_IDX_HINT}')
  return np.frombuffer(raw, dtype, offset=header).reshape(shape).astype(dtype.newbyteorder('='))


def _idx_file(root: pathlib.Path, stem: str) -> Optional[pathlib.Path]:
  for candidate in (root / f'{stem}.gz', root / stem):
    if candidate.is_file():
      return candidate
  return None


@gin.configurable('idx_source')
def idx_source(path: str = '/usr/share/datasets/fashion-mnist',
               name: Optional[str] = None,
               num_classes: int = 10) -> ArrayDataset:
  """MNIST-family data from the four IDX files its authors distribute.

  Reads `train-images-idx3-ubyte[.gz]`, `train-labels-idx1-ubyte[.gz]`,
  `t10k-images-idx3-ubyte[.gz]` and `t10k-labels-idx1-ubyte[.gz]` from `path`: the layout of
  MNIST (LeCun et al.), Fashion-MNIST (Xiao et al., 2017; Debian/Ubuntu package
  `dataset-fashion-mnist` installs it in `/usr/share/datasets/fashion-mnist/`) and KMNIST.

  Args:
    path: The folder with the four files (absolute, or relative to the current directory
      or the repository root); each file may be gzip-compressed (`.gz`) or not.
    name: Dataset name for outputs; defaults to the folder name with '-' as '_'
      (`fashion_mnist`).
    num_classes: Number of classes; every label must lie in `[0, num_classes)`.

  Returns:
    An `ArrayDataset` with uint8 images `[n, 28, 28, 1]` and int32 labels.

  Raises:
    DataError: For a missing folder or file, a file that is not IDX or is truncated, or files
      that do not match (image and label counts, image shapes, label range).
  """
  root = next((c for c in _candidates(path) if c.is_dir()),
              pathlib.Path(os.path.expanduser(path)))
  if not root.is_dir():
    raise DataError(f'IDX data folder {path!r} not found. {_IDX_HINT}')
  stems = [stem for pair in IDX_FILES.values() for stem in pair]
  files = {stem: _idx_file(root, stem) for stem in stems}
  missing = [stem for stem, f in files.items() if f is None]
  if missing:
    raise DataError(f'{root} lacks {", ".join(s + "[.gz]" for s in missing)}. {_IDX_HINT}')

  arrays = {}
  for split, (images_stem, labels_stem) in IDX_FILES.items():
    x, y = read_idx(str(files[images_stem])), read_idx(str(files[labels_stem]))
    if x.ndim != 3 or x.dtype != np.uint8:
      raise DataError(f'{files[images_stem]} holds {x.dtype} data of shape {x.shape}; '
                      'images must be uint8 [n, rows, cols].')
    if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
      raise DataError(f'{files[labels_stem]} holds {y.dtype} data of shape {y.shape}; '
                      'labels must be integers [n].')
    if len(x) != len(y):
      raise DataError(f'{files[images_stem].name} has {len(x)} images but '
                      f'{files[labels_stem].name} has {len(y)} labels; the files do not '
                      f'belong together. {_IDX_HINT}')
    if y.size and (y.min() < 0 or y.max() >= num_classes):
      raise DataError(f'{files[labels_stem]} has label {int(y.max())} outside '
                      f'[0, {num_classes}); set idx_source.num_classes.')
    arrays[split] = (_images(x), y.astype(np.int32))
  (x_train, y_train), (x_test, y_test) = arrays['train'], arrays['test']
  if x_train.shape[1:] != x_test.shape[1:]:
    raise DataError(f'{root}: training images are {x_train.shape[1:]}, test images '
                    f'{x_test.shape[1:]}; they must match.')
  return ArrayDataset(name=name or root.name.replace('-', '_'), x_train=x_train,
                      y_train=y_train, x_test=x_test, y_test=y_test,
                      num_classes=int(num_classes))


def _labels(y: np.ndarray, key: str, path: pathlib.Path) -> np.ndarray:
  """Checks that labels are integers and flattens `[n, 1]` labels to `[n]`."""
  if y.ndim == 2 and y.shape[1] == 1:
    y = y[:, 0]
  if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
    raise DataError(f'{key} in {path} must be integer class labels of shape [n] or [n, 1], '
                    f'got dtype {y.dtype} and shape {y.shape}; store class indices, not '
                    'one-hot vectors.')
  return y.astype(np.int32)


def _features(x: np.ndarray) -> np.ndarray:
  """uint8 images get a channel axis if needed; other inputs become float32."""
  if x.dtype == np.uint8:
    return _images(x)
  return _images(x).astype(np.float32) if x.ndim == 3 else x.astype(np.float32)


@gin.configurable('npz_source')
def npz_source(path: str,
               name: Optional[str] = None,
               num_classes: Optional[int] = None) -> ArrayDataset:
  """Loads a Keras-layout `.npz` file (`x_train, y_train, x_test, y_test`).

  Args:
    path: The file; a relative path is looked up in the current directory, then relative to
      the repository root (the parent of the `fltff` package).
    name: The dataset name; defaults to the file name without extension.
    num_classes: Defaults to `max(label) + 1` over both splits.

  Returns:
    An `ArrayDataset`; uint8 `[n, H, W]` images get a channel axis, non-uint8 inputs become
    float32.

  Raises:
    DataError: If the file or one of its arrays is missing or inconsistent.
  """
  resolved = _resolve_path(path)
  try:
    with np.load(resolved, allow_pickle=False) as f:
      missing = [k for k in _NPZ_KEYS if k not in f.files]
      if missing:
        raise DataError(f'npz file {resolved} lacks arrays {missing} (it has {f.files}); '
                        f'a Keras-layout file needs {list(_NPZ_KEYS)}.')
      raw = {k: f[k] for k in _NPZ_KEYS}
  except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:  # Truncated or not a zip.
    raise DataError(f'cannot read {resolved} as an .npz file ({e}); write it with '
                    'np.savez(path, x_train=..., y_train=..., x_test=..., y_test=...).') from e
  x_train, x_test = _features(raw['x_train']), _features(raw['x_test'])
  y_train = _labels(raw['y_train'], 'y_train', resolved)
  y_test = _labels(raw['y_test'], 'y_test', resolved)
  for split, x, y in (('train', x_train, y_train), ('test', x_test, y_test)):
    if len(x) != len(y):
      raise DataError(f'{resolved}: x_{split} has {len(x)} examples but y_{split} has '
                      f'{len(y)}; both must have the same length.')
  if x_train.shape[1:] != x_test.shape[1:]:
    raise DataError(f'{resolved}: x_train examples have shape {x_train.shape[1:]} but x_test '
                    f'examples have shape {x_test.shape[1:]}; they must match.')
  all_labels = np.concatenate([y_train, y_test])
  if all_labels.size and all_labels.min() < 0:
    raise DataError(f'{resolved} has negative label {all_labels.min()}; labels must be class '
                    'indices in [0, num_classes).')
  inferred = int(all_labels.max()) + 1 if all_labels.size else 0
  if num_classes is None:
    num_classes = inferred
  elif inferred > num_classes:
    raise ConfigError(f'npz_source.num_classes is {num_classes} but {resolved} has label '
                      f'{inferred - 1}; set num_classes to at least {inferred} or leave it '
                      'unset.')
  return ArrayDataset(name=name or resolved.stem, x_train=x_train, y_train=y_train,
                      x_test=x_test, y_test=y_test, num_classes=int(num_classes))


CINIC10_CLASSES = ('airplane', 'automobile', 'bird', 'cat', 'deer', 'dog', 'frog', 'horse',
                   'ship', 'truck')
_IMAGE_SUFFIXES = ('.png', '.jpg', '.jpeg')


def _read_image_split(root: pathlib.Path, split: str, classes) -> tuple[np.ndarray, np.ndarray]:
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  split_dir = root / split
  if not split_dir.is_dir():
    raise DataError(f'{split_dir} does not exist; an image folder needs '
                    f'<root>/{split}/<class>/*.png (CINIC-10 layout).')
  images, labels, shape = [], [], None
  for label, name in enumerate(classes):
    class_dir = split_dir / name
    if not class_dir.is_dir():
      raise DataError(f'{class_dir} does not exist; expected one folder per class '
                      f'({", ".join(classes)}) under {split_dir}.')
    for path in sorted(class_dir.iterdir()):
      if path.suffix.lower() not in _IMAGE_SUFFIXES:
        continue
      img = tf.io.decode_image(tf.io.read_file(str(path)), channels=3,
                               expand_animations=False).numpy()
      if shape is None:
        shape = img.shape
      elif img.shape != shape:
        raise DataError(f'{path} is {img.shape[1]}x{img.shape[0]}, the other images are '
                        f'{shape[1]}x{shape[0]}; all images must have the same size.')
      images.append(img)
      labels.append(label)
  if not images:
    raise DataError(f'no images (*.png, *.jpg) under {split_dir}.')
  return np.stack(images).astype(np.uint8), np.asarray(labels, np.int32)


@gin.configurable('image_folder_source')
def image_folder_source(path: str,
                        name: str = 'cinic10',
                        classes=CINIC10_CLASSES,
                        train_split: str = 'train',
                        test_split: str = 'test') -> ArrayDataset:
  """Images from `<path>/<split>/<class>/*.png`, CINIC-10's published layout.

  CINIC-10 (Darlow et al., 2018) is distributed as such a folder (`train/`, `valid/`, `test/`,
  each with the ten CIFAR class folders); download and unpack it, then point `path` at it.
  `train_split` may also be e.g. 'train' with 'valid' merged by the user beforehand.

  Args:
    path: The dataset root (absolute, or relative to the current directory or repository root).
    name: Dataset name for outputs.
    classes: Class folder names in label order (default: CINIC-10's, CIFAR-10's order).
    train_split: Folder of the training images.
    test_split: Folder of the central test images.
  """
  root = next((c for c in _candidates(path) if c.is_dir()),
              pathlib.Path(os.path.expanduser(path)))
  if not root.is_dir():
    raise DataError(f'image folder {path!r} not found; download CINIC-10 (or any folder with '
                    '<split>/<class>/*.png) and set image_folder_source.path.')
  classes = tuple(classes)
  x_train, y_train = _read_image_split(root, train_split, classes)
  x_test, y_test = _read_image_split(root, test_split, classes)
  if x_train.shape[1:] != x_test.shape[1:]:
    raise DataError(f'{root}: {train_split} images are {x_train.shape[1:]}, {test_split} '
                    f'images {x_test.shape[1:]}; they must match.')
  return ArrayDataset(name=name, x_train=x_train, y_train=y_train, x_test=x_test,
                      y_test=y_test, num_classes=len(classes))


# TFF (0.87) keeps federated EMNIST as one SQLite database for both variants: `load_data`
# fetches `emnist_all.sqlite.lzma` and decompresses it on the fly into
# `<cache_dir>/emnist_all.sqlite` (default cache_dir `~/.tff`); the variants are splits.
_EMNIST_URL = 'https://storage.googleapis.com/tff-datasets-public/emnist_all.sqlite.lzma'
_EMNIST_FILE = 'emnist_all.sqlite'
_EMNIST_TRAIN_SPLIT = {True: 'digits_only_train', False: 'all_train'}


def _tff_cache_dir(cache_dir: Optional[str]) -> str:
  """The directory TFF's dataset loaders cache in: `cache_dir` or `~/.tff`."""
  return os.path.abspath(os.path.expanduser(cache_dir or os.path.join('~', '.tff')))


def _emnist_train_counts(path: str, only_digits: bool) -> dict[str, int]:
  """Training examples per writer, from the database's `client_metadata` table."""
  connection = sqlite3.connect(pathlib.Path(path).as_uri() + '?mode=ro', uri=True)
  try:
    rows = connection.execute(
        'SELECT client_id, num_examples FROM client_metadata WHERE split_name = ?',
        (_EMNIST_TRAIN_SPLIT[only_digits],)).fetchall()
  finally:
    connection.close()
  return {str(cid): int(n) for cid, n in rows}


def _emnist_pixels_to_uint8(pixels: np.ndarray) -> np.ndarray:
  """TFF's float [0, 1] white-background pixels -> uint8 ink-on-black `[n, 28, 28, 1]`."""
  x = np.round((1.0 - np.asarray(pixels, np.float32)) * 255.0)
  return np.clip(x, 0, 255).astype(np.uint8).reshape(-1, 28, 28, 1)


def _writer_arrays(client_data, writer: str) -> tuple[np.ndarray, np.ndarray]:
  """One writer's examples as (uint8 `[n, 28, 28, 1]`, int32 `[n]`); empty if absent."""
  pixels, labels = [np.zeros((0, 28, 28), np.float32)], [np.zeros(0, np.int32)]
  if writer in client_data.client_ids:
    for batch in client_data.create_tf_dataset_for_client(writer).batch(
        1024).as_numpy_iterator():
      pixels.append(batch['pixels'])
      labels.append(batch['label'])
  return (_emnist_pixels_to_uint8(np.concatenate(pixels)),
          np.concatenate(labels).astype(np.int32).reshape(-1))


@gin.configurable('femnist_source')
def femnist_source(num_clients: int = 10,
                   only_digits: bool = False,
                   cache_dir: Optional[str] = None,
                   download: bool = False,
                   seed: int = 0,
                   min_examples_per_client: int = 1) -> ArrayDataset:
  """FEMNIST (LEAF's federated EMNIST, one client per writer) through TFF's loader.

  The data comes from `tff.simulation.datasets.emnist.load_data(only_digits, cache_dir)`,
  which in TFF 0.87 reads one SQLite file, `<cache_dir>/emnist_all.sqlite` (default
  `~/.tff`), for both variants. Nothing is downloaded unless `download=True`: then TFF
  fetches `emnist_all.sqlite.lzma` (about 3,400 writers) and decompresses it there.

  `num_clients` writers are drawn among those with at least `min_examples_per_client`
  training examples: the eligible writer ids are sorted and
  `np.random.default_rng(seed).choice(..., num_clients, replace=False)` picks them; the
  chosen ids are then sorted again, so client i is the i-th chosen writer in id order.

  TFF's pixels are float32 in [0, 1] with 1.0 the white background and 0.0 the ink, the
  inverse of MNIST's look. They are converted to uint8 ink-on-black like MNIST (0
  background, 255 ink): `x = round((1 - pixels) * 255)`.

  Args:
    num_clients: Number of writers (clients).
    only_digits: Only digit examples (10 classes, about 3,380 writers) instead of digits,
      upper- and lower-case letters (62 classes, about 3,400 writers).
    cache_dir: TFF's cache directory; `None` means TFF's default, `~/.tff`.
    download: Whether TFF may download the database if it is not in `cache_dir`.
    seed: Seed of the writer selection.
    min_examples_per_client: Only writers with at least this many training examples are
      eligible.

  Returns:
    An `ArrayDataset` named 'femnist' ('femnist_digits' with `only_digits`): uint8
    `[n, 28, 28, 1]` images and int32 labels of the chosen writers, the writers' training
    examples as `natural_partition` (contiguous, one index array per writer) and their test
    examples as the central test set and `natural_test_partition`.

  Raises:
    ConfigError: For `num_clients` or `min_examples_per_client` below 1, or fewer eligible
      writers than `num_clients`.
    DataError: If the database is missing and `download` is False, the download fails, or
      the file is not a readable TFF EMNIST database.
  """
  if num_clients < 1:
    raise ConfigError(f'femnist_source.num_clients must be >= 1, got {num_clients}.')
  if min_examples_per_client < 1:
    raise ConfigError(f'femnist_source.min_examples_per_client must be >= 1, got '
                      f'{min_examples_per_client}.')
  resolved = _tff_cache_dir(cache_dir)
  path = os.path.join(resolved, _EMNIST_FILE)
  existed = os.path.isfile(path)
  if not existed and not download:
    # Checked here: TFF's `load_data` would start downloading right away.
    raise DataError(
        f'FEMNIST file {_EMNIST_FILE} is not in {resolved} and femnist_source.download is '
        f'False; set femnist_source.download = True once on a machine with network access '
        f'(TFF downloads {_EMNIST_URL} and decompresses it there), or copy {_EMNIST_FILE} '
        f'from such a machine\'s TFF cache (~/.tff) into {resolved}.')

  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top
  try:
    train, test = tff.simulation.datasets.emnist.load_data(only_digits=only_digits,
                                                           cache_dir=resolved)
    counts = _emnist_train_counts(path, only_digits)
  except BaseException as e:
    if not existed and os.path.isfile(path):
      os.remove(path)  # TFF decompresses straight into the cache: drop a partial file.
    if not isinstance(e, Exception):
      raise
    if not existed:
      raise DataError(f'downloading FEMNIST from {_EMNIST_URL} into {resolved} failed '
                      f'({type(e).__name__}: {e}); check the network, or copy '
                      f'{_EMNIST_FILE} from another machine\'s ~/.tff into {resolved}.') from e
    if isinstance(e, sqlite3.Error) or type(e).__name__ == 'DatabaseFormatError':
      raise DataError(f'{path} is not a readable TFF EMNIST database ({type(e).__name__}: '
                      f'{e}); delete it and set femnist_source.download = True, or copy '
                      'an intact emnist_all.sqlite there.') from e
    raise

  eligible = sorted(cid for cid in train.client_ids
                    if counts.get(cid, 0) >= min_examples_per_client)
  if len(eligible) < num_clients:
    raise ConfigError(
        f'femnist_source.num_clients is {num_clients} but only {len(eligible)} writers have '
        f'at least {min_examples_per_client} training examples in {path}; ask for fewer '
        'clients or lower femnist_source.min_examples_per_client.')
  rng = np.random.default_rng(seed)
  chosen = [eligible[i] for i in np.sort(rng.choice(len(eligible), size=num_clients,
                                                    replace=False))]

  num_classes = 10 if only_digits else 62
  splits = []
  for client_data in (train, test):
    xs, ys, parts, start = [], [], [], 0
    for writer in chosen:
      x, y = _writer_arrays(client_data, writer)
      xs.append(x)
      ys.append(y)
      parts.append(np.arange(start, start + len(y), dtype=np.int64))
      start += len(y)
    splits.append((np.concatenate(xs), np.concatenate(ys), parts))
  (x_train, y_train, train_parts), (x_test, y_test, test_parts) = splits
  for writer, part in zip(chosen, train_parts):
    if part.size == 0:
      raise DataError(f'writer {writer!r} has no training examples in {path} although its '
                      'metadata lists some; the database is inconsistent, download it again.')
  labels = np.concatenate([y_train, y_test])
  if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
    raise DataError(f'{path} has label {labels.max()} outside [0, {num_classes}) for '
                    f'only_digits={only_digits}; the database is not TFF\'s EMNIST.')
  if not len(y_test):
    raise DataError(f'the {num_clients} chosen writers have no test examples in {path}; '
                    'the database is inconsistent, download it again.')
  return ArrayDataset(name='femnist_digits' if only_digits else 'femnist',
                      x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test,
                      num_classes=num_classes, natural_partition=train_parts,
                      natural_test_partition=test_parts)


@gin.configurable('synthetic_source')
def synthetic_source(alpha: float = 1.0,
                     beta: float = 1.0,
                     num_clients: int = 30,
                     dimension: int = 60,
                     num_classes: int = 10,
                     iid: bool = False,
                     min_samples: int = 50,
                     max_samples: int = 1000,
                     test_fraction: float = 0.2,
                     seed: int = 0) -> ArrayDataset:
  """Synthetic(alpha, beta) of FedProx (Li et al., MLSys 2020, Sec. 5.1) / LEAF.

  Per client k: u_k ~ N(0, alpha), B_k ~ N(0, beta); W_k[j, c] ~ N(u_k, 1),
  b_k[c] ~ N(u_k, 1); v_k[j] ~ N(B_k, 1); x ~ N(v_k, Sigma) with diagonal
  Sigma_jj = j^-1.2; y = argmax(softmax(W_k x + b_k)). As in the FedProx reference
  generator, alpha and beta are used as standard deviations (`np.random.normal(0, alpha)`).
  `iid=True` is FedProx's Synthetic-IID: one W, b ~ N(0, 1) shared by all clients and
  v_k = B_k (all zeros for beta = 0, the setting of the paper).

  Client sizes follow the reference generator's power law, `int(lognormal(4, 2)) + 50`,
  here `min_samples + int(lognormal(4, 2))`, clipped to `max_samples` (the unclipped
  lognormal has a heavy tail: a few clients would get tens of thousands of examples).
  Each client keeps a random `test_fraction` of its examples (at least one) as held-out
  test data; these form the central test set and `natural_test_partition`.

  Args:
    alpha: How much the clients' models differ (>= 0).
    beta: How much the clients' input distributions differ (>= 0).
    num_clients: The number of generated clients.
    dimension: Input dimension.
    num_classes: Number of classes.
    iid: Generate Synthetic-IID instead.
    min_samples: Smallest number of examples per client (train + test).
    max_samples: Largest number of examples per client (train + test).
    test_fraction: Fraction of each client's examples held out for testing, in [0, 1).
    seed: Seed of the generator; the output is a deterministic function of all arguments.

  Returns:
    An `ArrayDataset` with float32 `x` `[n, dimension]`, int32 `y`, and the natural
    partition (one train index array per client, contiguous).

  Raises:
    ConfigError: For negative alpha/beta, fewer than one client, or inconsistent sizes.
  """
  if alpha < 0 or beta < 0:
    raise ConfigError(f'synthetic_source needs alpha >= 0 and beta >= 0, got alpha={alpha} '
                      f'and beta={beta}; use e.g. alpha = beta = 1 (Synthetic(1, 1)).')
  if num_clients < 1:
    raise ConfigError(f'synthetic_source needs num_clients >= 1, got {num_clients}.')
  if dimension < 1 or num_classes < 2:
    raise ConfigError(f'synthetic_source needs dimension >= 1 and num_classes >= 2, got '
                      f'dimension={dimension} and num_classes={num_classes}.')
  if not 0 <= test_fraction < 1:
    raise ConfigError(f'synthetic_source.test_fraction must be in [0, 1), got '
                      f'{test_fraction}.')
  smallest = 2 if test_fraction > 0 else 1
  if min_samples < smallest or max_samples < min_samples:
    raise ConfigError(f'synthetic_source needs {smallest} <= min_samples <= max_samples, got '
                      f'min_samples={min_samples} and max_samples={max_samples}.')

  rng = np.random.default_rng(seed)
  sizes = np.minimum(min_samples + rng.lognormal(4, 2, num_clients).astype(np.int64),
                     max_samples)
  mean_w = rng.normal(0, alpha, num_clients)  # u_k; the reference uses it for b_k too.
  big_b = rng.normal(0, beta, num_clients)
  if iid:
    mean_x = np.repeat(big_b[:, None], dimension, axis=1)
    w_global = rng.normal(0, 1, (dimension, num_classes))
    b_global = rng.normal(0, 1, num_classes)
  else:
    mean_x = rng.normal(big_b[:, None], 1, (num_clients, dimension))
  std_x = np.power(np.arange(1, dimension + 1, dtype=np.float64), -1.2) ** 0.5

  train_x, train_y, test_x, test_y = [], [], [], []
  train_part, test_part = [], []
  n_train_total = n_test_total = 0
  for k in range(num_clients):
    if iid:
      w, b = w_global, b_global
    else:
      w = rng.normal(mean_w[k], 1, (dimension, num_classes))
      b = rng.normal(mean_w[k], 1, num_classes)
    n = int(sizes[k])
    x = mean_x[k] + std_x * rng.standard_normal((n, dimension))
    y = np.argmax(x @ w + b, axis=1)  # softmax is monotone: argmax of the logits.
    n_test = max(1, int(round(test_fraction * n))) if test_fraction > 0 else 0
    perm = rng.permutation(n)
    test_idx, train_idx = np.sort(perm[:n_test]), np.sort(perm[n_test:])
    train_x.append(x[train_idx])
    train_y.append(y[train_idx])
    test_x.append(x[test_idx])
    test_y.append(y[test_idx])
    train_part.append(np.arange(n_train_total, n_train_total + len(train_idx),
                                dtype=np.int64))
    test_part.append(np.arange(n_test_total, n_test_total + n_test, dtype=np.int64))
    n_train_total += len(train_idx)
    n_test_total += n_test

  name = 'synthetic_iid' if iid else f'synthetic_{alpha:g}_{beta:g}'
  return ArrayDataset(
      name=name,
      x_train=np.concatenate(train_x).astype(np.float32),
      y_train=np.concatenate(train_y).astype(np.int32),
      x_test=np.concatenate(test_x).astype(np.float32).reshape(-1, dimension),
      y_test=np.concatenate(test_y).astype(np.int32),
      num_classes=num_classes,
      natural_partition=train_part,
      natural_test_partition=test_part)
