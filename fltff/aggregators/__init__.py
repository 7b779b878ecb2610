"""TFF aggregation factories (single-pass, see DESIGN.md), importable into any TFF process.

- `layerwise_adaptive_factory` (FedLayerWise) and `fedadp_factory` (FedAdp): adaptive weighting
  of client updates from the angle between each client's and the global gradient, per layer or
  for the whole model; the equations are exported as pure TF functions.
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
