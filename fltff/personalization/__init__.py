"""Personalised federated learning: per-client models kept in the driver's client state store.

- `fedlap_personalization` (FedLap thesis): a purely local model per client, mixed with the
  global model layer by layer (fixed degree, or per layer from FedLap's dissimilarities).
"""

from fltff.personalization.fedlap_mixing import FedLapPersonalization
from fltff.personalization.fedlap_mixing import fedlap_personalization
from fltff.personalization.fedlap_mixing import layer_dissimilarities
from fltff.personalization.fedlap_mixing import mix_layers
from fltff.personalization.fedlap_mixing import mixing_coefficients
