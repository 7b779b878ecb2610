"""Personalised federated learning: per-client models kept in the driver's client state store.

- `build_fedlap_personalization` (gin `fedlap_personalization`, FedLap thesis): a local model per
  client mixed layer by layer with the global one (`fedlap_mixing.py`); `build_ditto` (Ditto,
  ICML 2021): FedAvg plus a personal model per client pulled towards the global (`ditto.py`);
  both on `personal_models.py` (a global method plus persistent personal models).
- `process.py`: the round shared by KAPC and the personalised baselines, one `RelationRule` module
  each: `kapc.py` (KAPC + BLS, IEEE TMC 2024; BLS's functions in `bls.py`), `local.py` (gin
  `local_training`), `fedamp.py`, `fedbn.py`, `pfedla.py`.
"""

from fltff.personalization.ditto import build_ditto
from fltff.personalization.fedamp import build_fedamp
from fltff.personalization.fedbn import build_fedbn
from fltff.personalization.fedlap_mixing import FedLapPersonalization
from fltff.personalization.fedlap_mixing import build_fedlap_personalization
from fltff.personalization.fedlap_mixing import layer_dissimilarities
from fltff.personalization.fedlap_mixing import mix_layers
from fltff.personalization.fedlap_mixing import mixing_coefficients
from fltff.personalization.kapc import build_kapc
from fltff.personalization.local import build_local
from fltff.personalization.pfedla import build_pfedla
from fltff.personalization.process import PersonalizedAlgorithm
from fltff.personalization.process import RelationRule
from fltff.personalization.process import build_personalized_process

__all__ = [
    'FedLapPersonalization',
    'PersonalizedAlgorithm',
    'RelationRule',
    'build_ditto',
    'build_fedamp',
    'build_fedbn',
    'build_fedlap_personalization',
    'build_kapc',
    'build_local',
    'build_personalized_process',
    'build_pfedla',
    'layer_dissimilarities',
    'mix_layers',
    'mixing_coefficients',
]
