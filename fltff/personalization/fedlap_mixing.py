"""FedLap personalisation: a persistent purely local model mixed layer by layer with the global.

Thesis extension of FedLap. Every client keeps its own model, trained only on its own data
whenever it takes part in a round (it persists in the round driver's client state store across
the rounds it skips). Its personalised model mixes local and global weights per layer l:

    p_l = β_l w_l^local + (1 − β_l) w_l^global,

with the degree of personalisation chosen by `mixing`:

* `'fixed'`: β_l = `degree` for every layer.
* `'dissimilarity'` (default): β_l = clip(degree · D_l / mean_l' D_l', 0, 1), where
  D_l = mean_j λ_lj / 2 ∈ [0, 1] is FedLap's per-neuron dissimilarity
  λ_lj = 1 − cos(w_lj^local, w_lj^global) averaged over the layer's rows. Layers on which the
  client's own model has moved away from the global one (client-specific features) are
  personalised more, layers on which both agree keep the better-trained global weights; the
  average β over layers is `degree`, so the knob means the same in both modes.

A client that has never trained locally is evaluated with the global model (β = 0).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import gin
import numpy as np

from fltff.errors import ConfigError


def layer_dissimilarities(local: Sequence[np.ndarray], global_: Sequence[np.ndarray],
                          layers: Sequence[Sequence[int]]) -> np.ndarray:
  """D_l = mean over the rows of layer l of λ_lj / 2 (FedLap's λ), in [0, 1]."""
  from fltff.learning.fedlap import neuron_dissimilarities  # pylint: disable=g-import-not-at-top

  lambdas = [np.asarray(x) for x in neuron_dissimilarities(local, global_)]
  return np.array([np.concatenate([lambdas[i] for i in g]).mean() / 2.0 for g in layers])


def mixing_coefficients(dissimilarities: np.ndarray, degree: float, mixing: str) -> np.ndarray:
  """β_l per layer (module docstring)."""
  if mixing == 'fixed':
    return np.full(len(dissimilarities), degree)
  mean = float(np.mean(dissimilarities))
  if mean <= 0.0:
    return np.full(len(dissimilarities), degree)
  return np.clip(degree * dissimilarities / mean, 0.0, 1.0)


def mix_layers(local: Sequence[np.ndarray], global_: Sequence[np.ndarray],
               layers: Sequence[Sequence[int]], betas: np.ndarray) -> list[np.ndarray]:
  """p_l = β_l local_l + (1 − β_l) global_l for every tensor of every layer."""
  out = [np.asarray(g).copy() for g in global_]
  for beta, group in zip(betas, layers):
    for i in group:
      out[i] = beta * np.asarray(local[i]) + (1.0 - beta) * np.asarray(global_[i])
  return out


class FedLapPersonalization:
  """Local models, their federated update computation and the personalised mixing."""

  def __init__(self, model_spec, optimizer, degree: float = 0.5,
               mixing: str = 'dissimilarity'):
    from fltff.learning.client_work import build_local_update  # pylint: disable=g-import-not-at-top

    if not 0.0 <= degree <= 1.0:
      raise ConfigError(f'personalization.degree must be in [0, 1], got {degree}.')
    if mixing not in ('fixed', 'dissimilarity'):
      raise ConfigError(f"personalization.mixing must be 'fixed' or 'dissimilarity', got "
                        f'{mixing!r}.')
    self.degree, self.mixing = float(degree), mixing
    self.layers = model_spec.trainable_layers()[0]
    self.local_update = build_local_update(model_spec, optimizer)

  def personalized_weights(self, local, global_):
    """ModelWeights-like OrderedDict(trainable, non_trainable) of the personalised model."""
    d = layer_dissimilarities(local['trainable'], global_.trainable, self.layers)
    betas = mixing_coefficients(d, self.degree, self.mixing)
    return collections.OrderedDict(
        trainable=mix_layers(local['trainable'], global_.trainable, self.layers, betas),
        non_trainable=[np.asarray(x) for x in global_.non_trainable])


@gin.configurable('fedlap_personalization')
def build_fedlap_personalization(model_spec, degree: float = 0.5,
                                 mixing: str = 'dissimilarity',
                                 client_optimizer=None) -> FedLapPersonalization:
  """Gin entry: `experiment.personalization = @fedlap_personalization`."""
  from fltff.learning import optimizers  # pylint: disable=g-import-not-at-top

  return FedLapPersonalization(
      model_spec, client_optimizer or optimizers.default_client_optimizer(), degree, mixing)
