"""Local training: every client trains only its own model; nothing is exchanged (0 bytes).

The personalised round with R fixed to the identity and λ = 0, so s_i is the client's own model.
With λ > 0 (`FixedRelation(lambda_=λ)`) each client trains FedProx(μ = 2λ) towards its own
previous model, a sanity case for tests.
"""

from __future__ import annotations

import dataclasses

import gin

from fltff.learning.model_spec import ModelSpec
from fltff.personalization import process as process_lib


@dataclasses.dataclass(frozen=True)
class FixedRelation(process_lib.RelationRule):
  """R never changes: `relationship_init` ('identity' or 'uniform') for every round."""
  name = 'local'
  relationship_init: str = 'identity'


@gin.configurable('local_training')
def build_local(model_spec: ModelSpec, num_clients: int,
                client_optimizer=None) -> process_lib.PersonalizedAlgorithm:
  """Local: every client trains only its own model (no communication)."""
  return process_lib.build_personalized_process(model_spec, num_clients, client_optimizer,
                                                FixedRelation())
