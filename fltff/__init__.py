"""fltff: layer-aware federated learning on non-IID data, built on TensorFlow Federated.

Subpackages (imported lazily, so `import fltff.data.partition` stays free of TensorFlow):
  data         sources (TFDS, Keras .npz, Synthetic(α, β)) → non-IID partitioners → ClientData
  models       Keras model zoo and the one layer grouping every layer-wise method uses
  learning     client work and process builders, one module per method (FedAvg, FedProx, SGDM)
  aggregators  TFF aggregation factories (FedAdp, FedLayerWise)
  personalization  per-client models (FedLap personalisation)
  simulation   round driver: sampling, evaluation, metrics, checkpoints, per-client state
  runtime      TFF execution contexts (local C++ worker_binary, remote worker) with clean shutdown
  errors       the exceptions the pipeline reports as one readable line
"""

import importlib

__all__ = ['aggregators', 'data', 'errors', 'learning', 'models', 'personalization', 'runtime',
           'simulation']


def __getattr__(name):
  if name in __all__:
    return importlib.import_module(f'fltff.{name}')
  raise AttributeError(f'module fltff has no attribute {name!r}')


def register_configurables() -> None:
  """Imports every subpackage so all gin configurables are registered."""
  for name in __all__:
    importlib.import_module(f'fltff.{name}')
