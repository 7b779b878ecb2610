"""FedLap personalisation (thesis extension of FedLap): a persistent local model per client,
evaluated mixed layer by layer with the global one, `p_l = β_l w_l^local + (1 − β_l) w_l^global`,
with `mixing` 'fixed' (β_l = `degree`) or 'dissimilarity' (β_l = clip(degree · D_l / mean D, 0,
1), D_l the layer's mean FedLap dissimilarity λ/2; the mean β is `degree`). Why, and results:
docs/methods/fedlap.md. The local models train as `personal_models` declares.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import gin
import numpy as np

from fltff.config_checks import check_choice
from fltff.config_checks import check_number
from fltff.learning import optimizers
from fltff.learning import protocol
from fltff.personalization.personal_models import PersonalTraining
from fltff.personalization.personal_models import WithPersonalModels
from fltff.personalization.personal_models import with_personal_models


def layer_dissimilarities(local: Sequence[np.ndarray], global_: Sequence[np.ndarray],
                          layers: Sequence[Sequence[int]]) -> np.ndarray:
  """D_l = mean over the rows of layer l of λ_lj / 2 (FedLap's λ), in [0, 1]."""
  from fltff.learning.fedlap import neuron_dissimilarities  # pylint: disable=g-import-not-at-top

  lambdas = [np.asarray(x) for x in neuron_dissimilarities(local, global_)]
  return np.array([np.concatenate([lambdas[i] for i in g]).mean() / 2.0 for g in layers])


def mixing_coefficients(dissimilarities: np.ndarray, degree: float, mixing: str) -> np.ndarray:
  """β_l per layer (module docstring)."""
  mean = float(np.mean(dissimilarities))
  if mixing == 'fixed' or mean <= 0.0:
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
    check_number('personalization.degree', degree, low=0, high=1)
    check_choice('personalization.mixing', mixing, ('fixed', 'dissimilarity'))
    self.degree, self.mixing = float(degree), mixing
    self.layers = model_spec.trainable_layers()[0]
    self.model_spec, self.optimizer = model_spec, optimizer

  def personalized_weights(self, local, global_):
    """ModelWeights-like OrderedDict(trainable, non_trainable) of the personalised model: the
    trainable weights mixed, the local model's statistics (of its client's own data)."""
    d = layer_dissimilarities(local['trainable'], global_.trainable, self.layers)
    betas = mixing_coefficients(d, self.degree, self.mixing)
    return collections.OrderedDict(
        trainable=mix_layers(local['trainable'], global_.trainable, self.layers, betas),
        non_trainable=[np.asarray(x) for x in local['non_trainable']])


def with_fedlap_personalization(algorithm: protocol.FederatedAlgorithm,
                                personalization: FedLapPersonalization) -> WithPersonalModels:
  """`algorithm` with FedLap personalisation's local models (module docstring): trained without
  a regulariser, evaluated mixed with the global model."""
  return with_personal_models(algorithm, PersonalTraining(
      personalization.model_spec, personalization.optimizer,
      personalization.personalized_weights))


@gin.configurable('fedlap_personalization')
def build_fedlap_personalization(model_spec, degree: float = 0.5,
                                 mixing: str = 'dissimilarity',
                                 client_optimizer=None) -> FedLapPersonalization:
  """Gin entry: `experiment.personalization = @fedlap_personalization`."""
  return FedLapPersonalization(
      model_spec, optimizers.default_client_optimizer(client_optimizer), degree, mixing)
