"""fltff data layer: sources -> partitioners -> per-client data (TFF `ClientData`).

Sources (`*_source`) return an `ArrayDataset` of NumPy arrays; partitioners (`*_partition`)
split its training labels into per-client index arrays; `build_federated_data` (gin name
`federated_data`) combines both into a `FederatedData`, whose `client_data()` is a
`tff.simulation.datasets.ClientData`.
"""

from fltff.data.federated import build_federated_data
from fltff.data.federated import FederatedData
from fltff.data.federated import subsample
from fltff.data.partition import dirichlet_partition
from fltff.data.partition import iid_partition
from fltff.data.partition import label_histograms
from fltff.data.partition import local_test_split
from fltff.data.partition import mixed_partition
from fltff.data.partition import natural_partition
from fltff.data.partition import shard_partition
from fltff.data.sources import ArrayDataset
from fltff.data.sources import femnist_source
from fltff.data.sources import idx_source
from fltff.data.sources import image_folder_source
from fltff.data.sources import read_idx
from fltff.data.sources import npz_source
from fltff.data.sources import synthetic_source
from fltff.data.sources import tfds_source

__all__ = [
    'ArrayDataset',
    'FederatedData',
    'build_federated_data',
    'dirichlet_partition',
    'femnist_source',
    'iid_partition',
    'idx_source',
    'image_folder_source',
    'label_histograms',
    'local_test_split',
    'mixed_partition',
    'natural_partition',
    'npz_source',
    'read_idx',
    'shard_partition',
    'subsample',
    'synthetic_source',
    'tfds_source',
]
