"""TFF aggregation factories (single-pass, docs/architecture.md), usable in any TFF process.

- `layerwise_adaptive_factory` (FedLayerWise), `fedadp_factory` (FedAdp): weights from the angle
  between each client's and the global gradient, per layer or model; equations as TF functions.
- `contribution_normalization_factory` (CCN; gin `contribution_normalization`, a method's
  `model_aggregator`), `NormalizedMeanFactory` (CCN and/or FedNova's normalised averaging).
- Each declares the per-client statistics it needs sent with the updates
  (`client_statistics`: `fltff.learning.client_work.ClientStatistic`s); the builders'
  `model_aggregator=` takes them or any TFF weighted factory. `gather.build_gather` underlies all.
"""

from fltff.aggregators.adaptive_weighting import AdaptiveWeightingFactory
from fltff.aggregators.adaptive_weighting import GOMPERTZ_ALPHA
from fltff.aggregators.adaptive_weighting import adaptive_weights
from fltff.aggregators.adaptive_weighting import client_gradients
from fltff.aggregators.adaptive_weighting import fedadp_factory
from fltff.aggregators.adaptive_weighting import global_gradient
from fltff.aggregators.adaptive_weighting import gompertz
from fltff.aggregators.adaptive_weighting import instantaneous_angles
from fltff.aggregators.adaptive_weighting import layerwise_adaptive_factory
from fltff.aggregators.adaptive_weighting import smoothed_angles
from fltff.aggregators.adaptive_weighting import weighted_layer_mean
from fltff.aggregators.contribution_normalization import NormalizedMeanFactory
from fltff.aggregators.contribution_normalization import contribution_factors
from fltff.aggregators.contribution_normalization import contribution_normalization_factory
from fltff.aggregators.contribution_normalization import normalized_weights
from fltff.aggregators.contribution_normalization import nova_aggregate
from fltff.aggregators.contribution_normalization import similarity_matrix
from fltff.aggregators.composition import with_client_statistics_of

__all__ = [
    'adaptive_weights',
    'AdaptiveWeightingFactory',
    'client_gradients',
    'contribution_factors',
    'contribution_normalization_factory',
    'fedadp_factory',
    'global_gradient',
    'gompertz',
    'GOMPERTZ_ALPHA',
    'instantaneous_angles',
    'layerwise_adaptive_factory',
    'normalized_weights',
    'NormalizedMeanFactory',
    'nova_aggregate',
    'similarity_matrix',
    'smoothed_angles',
    'weighted_layer_mean',
    'with_client_statistics_of',
]
