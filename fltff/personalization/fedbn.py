"""FedBN (Li et al., ICLR 2021): FedAvg with the normalisation layers kept local.

Paper: "FedBN: Federated Learning on Non-IID Features via Local Batch Normalization". The
personalised round's slice is FedAvg's sample-weighted mean (r_ij = n_j / Σ_P n), the identity
in normalisation layers; clients start from s_i, so each gets FedAvg's aggregate with its own
normalisation layers and statistics, which never leave it (the bytes count only the other
layers, as the KAPC paper's Table 6 does for FedBN). Without normalisation layers (cnn2, mlp2)
this is FedAvg whose clients keep their trained models, so the KAPC paper's MNIST/FMNIST
configs run FedBN on `cnn2_bn`. Vectorised clients train their own moving statistics
(`learning.vectorized.moving_statistics`), as TFF's client work does.
"""

from __future__ import annotations

import dataclasses

import gin
import tensorflow as tf

from fltff.learning.model_spec import ModelSpec
from fltff.personalization import process as process_lib


@dataclasses.dataclass(frozen=True)
class SampleWeightedRelation(process_lib.RelationRule):
  """r_ij = n_j / Σ_P n for every layer (rows of `local_layer_kinds` become the identity)."""
  name = 'fedbn'
  start_from: str = 'server'
  local_layer_kinds: tuple = ('norm',)

  def relation(self, state, server_input, context):
    del state
    n = server_input['num_examples']
    row = n / tf.reduce_sum(n)
    return tf.tile(row[None, None, :], [tf.shape(n)[0], context.num_layers, 1]), {}


@gin.configurable('fedbn')
def build_fedbn(model_spec: ModelSpec, num_clients: int,
                client_optimizer=None) -> process_lib.PersonalizedAlgorithm:
  """FedBN: FedAvg's aggregate with normalisation layers local."""
  return process_lib.build_personalized_process(model_spec, num_clients, client_optimizer,
                                                SampleWeightedRelation())
