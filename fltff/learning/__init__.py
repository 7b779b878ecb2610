"""Client work and process builders, one module per method.

Every builder takes a `ModelSpec` and returns an `Algorithm` (a TFF learning process plus its
per-client communication sizes). Gin names: `fedavg`, `fedprox`, `sgdm`, `fedadp`,
`fedlayerwise`, `fedlap`, `fednova`, `fedbabu`, `scaffold`, `moon`; the FedAvg-family
builders take `contribution_normalization=True` for CCN. A builder that declares a `num_clients` argument receives the experiment's
total number of clients from the round driver (stateful aggregators size their state by it).
"""

from fltff.learning.client_work import CLIENT_INFO_SPEC
from fltff.learning.client_work import LocalRegularizer
from fltff.learning.client_work import build_client_work
from fltff.learning.client_work import build_local_training
from fltff.learning.client_work import client_input
from fltff.learning.fedavg import fedavg
from fltff.learning.fedbabu import fedbabu
from fltff.learning.fedlap import FedLapRegularizer
from fltff.learning.fedlap import fedlap
from fltff.learning.fedlap import fedlap_penalty
from fltff.learning.fedlap import importance_coefficients
from fltff.learning.fedlap import neuron_dissimilarities
from fltff.learning.fedlap import neuron_distances
from fltff.learning.fedlayerwise import fedadp
from fltff.learning.fedlayerwise import fedlayerwise
from fltff.learning.fednova import fednova
from fltff.learning.fedprox import fedprox
from fltff.learning.model_spec import ModelSpec
from fltff.learning.model_spec import type_num_bytes
from fltff.learning.moon import model_contrastive_loss
from fltff.learning.moon import moon
from fltff.learning.optimizers import client_optimizer
from fltff.learning.optimizers import server_optimizer
from fltff.learning.process import Algorithm
from fltff.learning.process import build_algorithm
from fltff.learning.regularizers import ProximalRegularizer
from fltff.learning.regularizers import proximal_penalty
from fltff.learning.scaffold import scaffold
from fltff.learning.sgdm import sgdm
