"""Keras model zoo and the layer grouping shared by every layer-wise method.

`build_model` (gin: `model.name`, `model.input_shape`, `model.num_classes`, `model.seed`)
builds a deterministic functional Keras model that outputs logits and names its last hidden
layer 'latent'; `register(name, fn)` adds your own. `layer_groups` defines "layer l";
`to_rows`, `row_cosine` and `row_squared_distance` give per-neuron views (e.g. for FedLap).
"""

from fltff.models.layers import group_weights
from fltff.models.layers import layer_groups
from fltff.models.layers import LayerGroup
from fltff.models.layers import row_cosine
from fltff.models.layers import row_squared_distance
from fltff.models.layers import to_rows
from fltff.models.layers import update_index_groups
from fltff.models.zoo import build_model
from fltff.models.zoo import check_logits
from fltff.models.zoo import LATENT_LAYER
from fltff.models.zoo import latent_dim
from fltff.models.zoo import latent_model
from fltff.models.zoo import MODEL_NAMES
from fltff.models.zoo import model_names
from fltff.models.zoo import register

__all__ = [
    'LATENT_LAYER',
    'LayerGroup',
    'MODEL_NAMES',
    'build_model',
    'check_logits',
    'group_weights',
    'latent_dim',
    'latent_model',
    'layer_groups',
    'model_names',
    'register',
    'row_cosine',
    'row_squared_distance',
    'to_rows',
    'update_index_groups',
]
