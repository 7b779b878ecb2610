"""Ditto (T. Li, S. Hu, A. Beirami, V. Smith, ICML 2021): FedAvg's global model w^t plus a
personal model v_k per client, trained on the same batches on `F_k(v_k) + λ/2 ||v_k − w^t||²`
(eq. (2), Algorithm 1): a `ProximalRegularizer` with μ = λ anchored at w^t. Our choices where the
paper leaves them: docs/methods/ditto.md.
"""

from __future__ import annotations

import gin

from fltff.learning import optimizers
from fltff.learning.fedavg import build_fedavg
from fltff.learning.model_spec import ModelSpec
from fltff.learning.regularizers import ProximalRegularizer
from fltff.personalization.personal_models import PersonalTraining
from fltff.personalization.personal_models import WithPersonalModels
from fltff.personalization.personal_models import with_personal_models


@gin.configurable('ditto')
def build_ditto(model_spec: ModelSpec, client_optimizer=None, lambda_: float = 1.0,
                server_learning_rate: float = 1.0, server_optimizer=None, model_aggregator=None,
                client_weighting: str = 'num_examples') -> WithPersonalModels:
  """Ditto with personal-term weight `lambda_` (λ ≥ 0; λ = 0: local training beside FedAvg).

  The global model is `build_fedavg(model_spec, client_optimizer, server_learning_rate,
  server_optimizer, model_aggregator, client_weighting)` as it is."""
  regularizer = ProximalRegularizer(lambda_, setting='ditto.lambda_')  # Checks λ first.
  client_optimizer = optimizers.default_client_optimizer(client_optimizer)
  global_method = build_fedavg(model_spec, client_optimizer, server_learning_rate,
                               server_optimizer, model_aggregator, client_weighting)
  return with_personal_models(global_method, PersonalTraining(
      model_spec, client_optimizer, regularizer=regularizer), 'ditto')
