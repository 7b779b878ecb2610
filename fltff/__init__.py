"""fltff: layer-aware federated learning on non-IID data, built on TensorFlow Federated.

Subpackages (imported lazily, so `import fltff.data.partition` stays free of TensorFlow):
  data         sources (TFDS, Keras .npz, Synthetic(α, β)) → non-IID partitioners → ClientData
  models       Keras model zoo and the one layer grouping every layer-wise method uses
  learning     client work and process builders, one module per method (FedAvg, FedProx, SGDM)
  aggregators  TFF aggregation factories (FedAdp, FedLayerWise)
  methods      the one registry of methods: name → builder and what each needs
  personalization  per-client models (FedLap personalisation)
  simulation   round driver: sampling, evaluation, metrics, checkpoints, per-client state
  runtime      where TFF computations run: one class per executor (in process, local or remote worker)
  errors       the exceptions the pipeline reports as one readable line
"""

import atexit
import importlib
import sys

__version__ = '0.1.0'

__all__ = ['aggregators', 'data', 'errors', 'learning', 'methods', 'models', 'personalization',
           'runtime', 'simulation']


def __getattr__(name):
  if name in __all__:
    return importlib.import_module(f'fltff.{name}')
  raise AttributeError(f'module fltff has no attribute {name!r}')


def register_configurables() -> None:
  """Imports every fltff module, registering all gin configurables, even of a method module
  no package `__init__` names yet."""
  import pkgutil  # pylint: disable=g-import-not-at-top

  for name in __all__:
    package = importlib.import_module(f'fltff.{name}')
    for info in pkgutil.walk_packages(getattr(package, '__path__', []), f'fltff.{name}.'):
      importlib.import_module(info.name)


def _release_tff_context_at_exit() -> None:
  """Releases TFF's default context while Python is whole: collected at interpreter exit it
  prints a traceback (`ServiceManager.__del__`)."""
  if 'tensorflow_federated' not in sys.modules:
    return
  try:
    from fltff.runtime.channels import release_default_context  # pylint: disable=g-import-not-at-top
    release_default_context()
  except Exception:  # pylint: disable=broad-except
    pass  # Exiting anyway; never turn an exit into an error.


atexit.register(_release_tff_context_at_exit)
