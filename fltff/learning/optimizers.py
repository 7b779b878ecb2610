"""Gin-configurable client and server optimizers (TFF's functional optimizers)."""

from __future__ import annotations

import gin

from fltff.errors import ConfigError

_NAMES = ('sgd', 'sgdm', 'adam')


def _build(name: str, learning_rate: float, momentum: float, beta_1: float, beta_2: float,
           epsilon: float, role: str):
  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top

  if learning_rate <= 0:
    raise ConfigError(f'{role}.learning_rate must be > 0, got {learning_rate}.')
  if name == 'sgd':
    return tff.learning.optimizers.build_sgdm(learning_rate=learning_rate)
  if name == 'sgdm':
    if not 0 <= momentum < 1:
      raise ConfigError(f'{role}.momentum must be in [0, 1), got {momentum}.')
    return tff.learning.optimizers.build_sgdm(learning_rate=learning_rate, momentum=momentum)
  if name == 'adam':
    return tff.learning.optimizers.build_adam(
        learning_rate=learning_rate, beta_1=beta_1, beta_2=beta_2, epsilon=epsilon)
  raise ConfigError(f'Unknown {role}.name {name!r}; choose one of {", ".join(_NAMES)}.')


@gin.configurable('client_optimizer')
def client_optimizer(name: str = 'sgdm', learning_rate: float = 0.01, momentum: float = 0.9,
                     beta_1: float = 0.9, beta_2: float = 0.999, epsilon: float = 1e-7):
  """The optimizer used for local steps (`'sgd'`, `'sgdm'` or `'adam'`)."""
  return _build(name, learning_rate, momentum, beta_1, beta_2, epsilon, 'client_optimizer')


@gin.configurable('server_optimizer')
def server_optimizer(name: str = 'sgd', learning_rate: float = 1.0, momentum: float = 0.9,
                     beta_1: float = 0.9, beta_2: float = 0.999, epsilon: float = 1e-7):
  """The optimizer applying the aggregated update at the server.

  `'sgd'` with learning rate 1 is FedAvg's plain averaging; `'sgdm'` is server momentum
  (SGDM, Hsu et al. 2019 "FedAvgM").
  """
  return _build(name, learning_rate, momentum, beta_1, beta_2, epsilon, 'server_optimizer')
