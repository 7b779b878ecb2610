"""Optimizers (TFF's functional optimizers): one plain builder, and its two gin faces.

Library builders never read gin; the experiment wiring (`fltff.simulation.experiment`) passes
them the gin-configured `client_optimizer()` and, if any `server_optimizer.*` is bound,
`server_optimizer()`.
"""

from __future__ import annotations

import inspect
from typing import Optional

import gin

from fltff.config_checks import check_number
from fltff.errors import ConfigError


def declared(inner, hyperparameters=None, weight_decay: float = 0.0):
  """`inner` (a `tff.learning.optimizers.Optimizer`) stepping on `gradient + weight_decay · w`
  (coupled L2 decay, the gradient of `weight_decay/2 ||w||²`, as PyTorch's `SGD(weight_decay=)`)
  and declaring `hyperparameters`: SGD(M)'s float32 `(η, μ or None)` (`sgdm`), which vectorised
  clients apply fused (`stacked_optimizer.FusedSGDM`); None: mapped over the clients."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top

  class Declared(tff.learning.optimizers.Optimizer):

    def initialize(self, specs):
      return inner.initialize(specs)

    def next(self, state, weights, gradients):
      if weight_decay:
        gradients = tf.nest.map_structure(lambda g, w: g + float(weight_decay) * w, gradients,
                                          weights)
      return inner.next(state, weights, gradients)

  optimizer = Declared()
  optimizer.hyperparameters = hyperparameters
  return optimizer


def sgdm(learning_rate: float, momentum: Optional[float] = None, role: str = 'sgdm'):
  """TFF's `build_sgdm` (a ← μ·a + g, w ← w − η·a; without momentum w ← w − η·g), `declared`;
  `ConfigError` (naming `role`) unless η >= 0 (0: no step) and μ in [0, 1) (TFF takes NaN)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top

  check_number(f'{role}.learning_rate', learning_rate, low=0)
  check_number(f'{role}.momentum', momentum, allow_none=True, low=0, high=1, open_high=True)
  return declared(tff.learning.optimizers.build_sgdm(learning_rate=learning_rate,
                                                     momentum=momentum),
                  (float(np.float32(learning_rate)),
                   None if momentum is None else float(np.float32(momentum))))


def build_optimizer(name: str, learning_rate: float, momentum: float = 0.9,
                    beta_1: float = 0.9, beta_2: float = 0.999, epsilon: float = 1e-7,
                    role: str = 'optimizer', weight_decay: float = 0.0):
  """`'sgd'`, `'sgdm'` (momentum) or `'adam'` as a `tff.learning.optimizers.Optimizer`; a
  positive `weight_decay` adds coupled L2 decay (`declared`)."""
  check_number(f'{role}.learning_rate', learning_rate, low=0, open_low=True)
  given = dict(momentum=momentum, beta_1=beta_1, beta_2=beta_2, epsilon=epsilon)
  for what, value in given.items():
    check_number(f'{role}.{what}', value)
  check_number(f'{role}.weight_decay', weight_decay, low=0)
  uses = {'sgd': (), 'sgdm': ('momentum',), 'adam': ('beta_1', 'beta_2', 'epsilon')}.get(name)
  defaults = inspect.signature(build_optimizer).parameters  # A run's config.gin binds them all.
  unused = [f'{role}.{what} = {value}' for what, value in given.items()
            if uses is not None and what not in uses and value != defaults[what].default]
  if unused:
    raise ConfigError(f'{", ".join(unused)} has no effect with {role}.name = {name!r}, which '
                      f'uses {", ".join(uses) or "only the learning rate"}: name the optimizer '
                      "that uses it ('sgdm': momentum; 'adam': beta_1, beta_2, epsilon) or drop "
                      'the binding.')
  if name in ('sgd', 'sgdm'):
    optimizer = sgdm(learning_rate, momentum if name == 'sgdm' else None, role)
  elif name == 'adam':
    import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top
    optimizer = tff.learning.optimizers.build_adam(
        learning_rate=learning_rate, beta_1=beta_1, beta_2=beta_2, epsilon=epsilon)
  else:
    raise ConfigError(f'Unknown {role}.name {name!r}; choose one of sgd, sgdm, adam.')
  return declared(optimizer, weight_decay=weight_decay) if weight_decay else optimizer


def checked_optimizer(given, role: str):
  """`given` if it is a `tff.learning.optimizers.Optimizer`, else `ConfigError` naming `role`:
  refused when the method is built, not with a traceback from inside its first round."""
  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top

  if not isinstance(given, tff.learning.optimizers.Optimizer):
    raise ConfigError(f'{role} must be a tff.learning.optimizers.Optimizer (e.g. '
                      f'fltff.learning.optimizers.sgdm(0.01)), got a {type(given).__name__}.')
  return given


def default_client_optimizer(given=None):
  """`given` (`checked_optimizer`) or, for None, the library's local optimizer: SGD 0.01 with
  momentum 0.9."""
  if given is None:
    return build_optimizer('sgdm', 0.01, 0.9, role='client_optimizer')
  return checked_optimizer(given, 'client_optimizer')


@gin.configurable('client_optimizer')
def client_optimizer(name: str = 'sgdm', learning_rate: float = 0.01, momentum: float = 0.9,
                     beta_1: float = 0.9, beta_2: float = 0.999, epsilon: float = 1e-7,
                     weight_decay: float = 0.0):
  """The optimizer used for local steps (`'sgd'`, `'sgdm'` or `'adam'`), with optional coupled
  L2 `weight_decay` (0: none)."""
  return build_optimizer(name, learning_rate, momentum, beta_1, beta_2, epsilon,
                         'client_optimizer', weight_decay)


@gin.configurable('server_optimizer')
def server_optimizer(name: str = 'sgd', learning_rate: float = 1.0, momentum: float = 0.9,
                     beta_1: float = 0.9, beta_2: float = 0.999, epsilon: float = 1e-7):
  """The optimizer applying the aggregated update at the server.

  `'sgd'` with learning rate 1 is FedAvg's averaging; `'sgdm'` is server momentum (Hsu et al.
  2019, "FedAvgM"). Used only when a `server_optimizer.*` parameter is bound, then by every
  FedAvg-family method instead of its `server_learning_rate` (the `sgdm` method, with its own
  momentum, refuses it)."""
  return build_optimizer(name, learning_rate, momentum, beta_1, beta_2, epsilon,
                         'server_optimizer')


def server_sgd(server_optimizer_arg, server_learning_rate: float, method: str):
  """The server optimizer passed in (`checked_optimizer`; `ConfigError` unless η_s is 1), else
  SGD with η_s."""
  if server_optimizer_arg is None:  # Checked under its own name, not build_optimizer's role's.
    check_number(f'{method}.server_learning_rate', server_learning_rate, low=0, open_low=True)
    return build_optimizer('sgd', server_learning_rate, role=f'{method} server optimizer')
  if server_learning_rate != 1.0:
    raise ConfigError(f'{method}: pass server_optimizer or server_learning_rate, not both '
                      f'(server_learning_rate={server_learning_rate} would be ignored).')
  return checked_optimizer(server_optimizer_arg, f'{method} server_optimizer')
