"""Local regularisers (pure TF functions plus the `LocalRegularizer` objects that use them)."""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf


def proximal_penalty(local: Sequence[tf.Tensor], global_: Sequence[tf.Tensor],
                     mu: float) -> tf.Tensor:
  """FedProx's proximal term `μ/2 ||w − w^t||²` (Li et al., MLSys 2020, eq. (2)).

  Its gradient with respect to `w` is `μ (w − w^t)`: it pulls the client towards the global
  model. (TFF 0.87's `proximal_client_work` adds `μ (w^t − w)` instead — the opposite sign.)
  """
  return 0.5 * mu * tf.add_n(
      [tf.reduce_sum(tf.square(w - g)) for w, g in zip(local, global_)])


class ProximalRegularizer:
  """`LocalRegularizer` for FedProx: `μ/2 ||w − w_global||²` with no per-epoch context."""

  def __init__(self, mu: float):
    if mu < 0:
      from fltff.errors import ConfigError  # pylint: disable=g-import-not-at-top
      raise ConfigError(f'FedProx mu must be >= 0, got {mu}.')
    self.mu = float(mu)

  def epoch_start(self, local, global_):
    del local, global_
    return ()

  def penalty(self, local, global_, context):
    del context
    return proximal_penalty(local, global_, self.mu)

  def gradient(self, local, global_, context):
    """∂/∂w of the penalty: `μ (w − w_global)`."""
    del context
    return [self.mu * (w - g) for w, g in zip(local, global_)]
