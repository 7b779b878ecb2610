"""FedBABU (Oh et al., ICLR 2022): federated training of the body with the head frozen.

The head (the last layer of the layer grouping) keeps its random initialisation: its gradients
are zeroed in local training, so its update is exactly 0 and it never changes (tested).
"""

from __future__ import annotations

import gin

from fltff.errors import ConfigError
from fltff.learning.model_spec import ModelSpec
from fltff.learning.process import Algorithm
from fltff.learning.process import build_averaging_method


@gin.configurable('fedbabu')
def build_fedbabu(model_spec: ModelSpec, client_optimizer=None,
                  server_learning_rate: float = 1.0, server_optimizer=None,
                  model_aggregator=None) -> Algorithm:
  """FedBABU: FedAvg on the body, head frozen. Evaluation first fine-tunes the whole global
  model on each client's data (`fltff.simulation.evaluation.Finetuner`, 'finetuned_local')."""
  layers = model_spec.trainable_layers()[0]
  if len(layers) < 2:
    raise ConfigError(f'fedbabu freezes the head (the last layer) and {model_spec.name} has no '
                      'other: nothing would train. Use a model with a hidden layer.')
  return build_averaging_method(
      'fedbabu', model_spec, client_optimizer, server_optimizer, server_learning_rate,
      model_aggregator, frozen=layers[-1], finetunes=True)
