"""Keras model zoo and the layer grouping shared by every layer-wise method.

`build_model` (gin: `model.name`, `model.input_shape`, `model.num_classes`, `model.seed`)
builds a deterministic functional Keras model that outputs logits and names its last hidden
layer 'latent' (`latent_model`). `layer_groups` defines "layer l" (kernel + bias of a Dense/Conv
layer; normalisation layers on their own); `to_rows`, `row_cosine` and `row_squared_distance`
give the per-neuron view used by per-neuron rules such as FedLap's. `register(name, fn)` adds
your own model under a name.
"""

from fltff.models.layers import group_weights
from fltff.models.layers import layer_groups
from fltff.models.layers import LayerGroup
from fltff.models.layers import row_cosine
from fltff.models.layers import row_squared_distance
from fltff.models.layers import to_rows
from fltff.models.layers import update_index_groups
from fltff.models.zoo import build_model
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
