"""Personalised federated learning: per-client models kept in the driver's client state store.

- `fedlap_personalization` (FedLap thesis): a purely local model per client, mixed with the
  global model layer by layer (fixed degree, or per layer from FedLap's dissimilarities).
- `kapc` (KAPC + BLS, IEEE TMC 2024) and the personalised baselines built on the same process:
  `local_training`, `fedamp`, `fedbn` (`kapc.py`), `pfedla` (`pfedla.py`); BLS's pure
  functions in `bls.py`.
"""

from fltff.personalization.fedlap_mixing import FedLapPersonalization
from fltff.personalization.fedlap_mixing import fedlap_personalization
from fltff.personalization.fedlap_mixing import layer_dissimilarities
from fltff.personalization.fedlap_mixing import mix_layers
from fltff.personalization.fedlap_mixing import mixing_coefficients
from fltff.personalization.kapc import PersonalizedAlgorithm
from fltff.personalization.kapc import build_personalized_process
from fltff.personalization.kapc import fedamp
from fltff.personalization.kapc import fedbn
from fltff.personalization.kapc import kapc
from fltff.personalization.kapc import local_training
from fltff.personalization.pfedla import pfedla
