"""The one registry of fltff's methods: name → builder and what the method needs.

Gin (`experiment.method = @<gin name>`), `fltff bench`, `fltff list`, the memory bench, the
program API (`fltff.simulation.program`) and the tests read it. `VARIANTS` names the
compositions they compare (CCN on a FedAvg-family method, KAPC with BLS, FedAvg with FedLap
personalisation). Each entry cites the paper it follows (the table of docs/methods/index.md).

    from fltff import learning, methods
    algorithm = methods.build('kapc+bls', model_spec, num_clients=10,
                              client_optimizer=learning.optimizers.sgdm(0.01))
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from typing import Any, Optional

from fltff.errors import ConfigError

__all__ = ['CCN_CITATION', 'METHODS', 'Method', 'VARIANTS', 'Variant', 'build', 'get',
           'names']


@dataclasses.dataclass(frozen=True)
class Method:
  """A method of fltff and what it needs (`tests/test_methods.py` checks each trait).

  Attributes:
    builder: `module:function` of its `build_<method>` (imported when used).
    gin_name: `experiment.method = @<gin_name>`; `name`, but `local_training` for `local`.
    citation: The paper the method follows (authors, title, venue, year); '' for local
      training, which has none.
    num_clients: The builder takes the total number of clients N (state sized by N).
    client_ids: Its round uses each participant's client index (per-client server memory,
      client state or aggregator weights), so TFF's program API (which has none) cannot drive it.
    client_state: Clients carry state between rounds (SCAFFOLD's c_i, MOON's previous model,
      personal models), kept by the round driver's store.
    personalised: Every client is evaluated with its own model; there is no global model.
    factors: Vectorised (as every method's client work can be, `experiment.client_work`), it
      can train Dense kernels in factored form (`experiment.factor_dense`): plain SGD(M) steps,
      or a proximal term with one scale per tensor.
    composes_aggregator: The builder takes `model_aggregator=` (any TFF weighted aggregation
      factory; CCN with `+ccn`).
    relationship_seed: The builder's `relationship_seed` (KAPC's R, pFedLA's hypernetworks)
      follows the run's seed unless gin binds it (`simulation.experiment.build_method`).
  """
  name: str
  builder: str
  gin_name: str
  citation: str
  num_clients: bool = False
  client_ids: bool = False
  client_state: bool = False
  personalised: bool = False
  factors: bool = True
  composes_aggregator: bool = False
  relationship_seed: bool = False

  def build_fn(self) -> Callable[..., Any]:
    module, function = self.builder.split(':')
    return getattr(importlib.import_module(module), function)


def _m(name, module, citation, gin_name='', **traits):
  return Method(name, f'{module}:build_{name}', gin_name or name, citation, **traits)


_L, _P = 'fltff.learning', 'fltff.personalization'
METHODS: Mapping[str, Method] = {m.name: m for m in (
    _m('fedavg', _L, 'H. B. McMahan, E. Moore, D. Ramage, S. Hampson, B. Agüera y Arcas. '
       'Communication-Efficient Learning of Deep Networks from Decentralized Data. '
       'AISTATS 2017.', composes_aggregator=True),
    _m('fedprox', _L, 'T. Li, A. K. Sahu, M. Zaheer, M. Sanjabi, A. Talwalkar, V. Smith. '
       'Federated Optimization in Heterogeneous Networks. MLSys 2020.',
       composes_aggregator=True),
    _m('sgdm', _L, 'T.-M. H. Hsu, H. Qi, M. Brown. Measuring the Effects of Non-Identical Data '
       'Distribution for Federated Visual Classification. arXiv:1909.06335, 2019.',
       composes_aggregator=True),
    _m('fedlap', _L, 'E. Charteros, I. Koutsopoulos. Lay Importance on the Layer: Federated '
       'Learning for Non-IID data with Layer-based Regularization. IEEE INFOCOM Workshops '
       '2023.', composes_aggregator=True, factors=False),
    _m('fedadp', _L, 'H. Wu, P. Wang. Fast-Convergent Federated Learning with Adaptive '
       'Weighting. IEEE Transactions on Cognitive Communications and Networking 7(4), 2021.',
       num_clients=True, client_ids=True),
    _m('fedlayerwise', _L, 'V. S. Lanjewar, H.-A. Tran, T. X. Tran. Layer-Wise Adaptive '
       'Weighting for Faster Convergence in Federated Learning. IEEE IRI 2024.',
       num_clients=True, client_ids=True),
    _m('fednova', _L, 'J. Wang, Q. Liu, H. Liang, G. Joshi, H. V. Poor. Tackling the Objective '
       'Inconsistency Problem in Heterogeneous Federated Optimization. NeurIPS 2020.',
       client_ids=True, composes_aggregator=True),
    _m('fedbabu', _L, 'J. Oh, S. Kim, S.-Y. Yun. FedBABU: Toward Enhanced Representation for '
       'Federated Image Classification. ICLR 2022.', composes_aggregator=True),
    _m('scaffold', _L, 'S. P. Karimireddy, S. Kale, M. Mohri, S. J. Reddi, S. U. Stich, '
       'A. T. Suresh. SCAFFOLD: Stochastic Controlled Averaging for Federated Learning. '
       'ICML 2020.', num_clients=True, client_ids=True, client_state=True, factors=False,
       composes_aggregator=True),
    _m('moon', _L, 'Q. Li, B. He, D. Song. Model-Contrastive Federated Learning. CVPR 2021.',
       num_clients=True, client_ids=True, client_state=True, factors=False),
    _m('kapc', _P, 'M. Zhi, Y. Bi, L. Cai, W. Xu, H. Wang, T. Xiang, Q. He. Knowledge-Aware '
       'Parameter Coaching for Communication-Efficient Personalized Federated Learning in '
       'Mobile Edge Computing. IEEE Transactions on Mobile Computing, 2024 '
       '(doi:10.1109/TMC.2024.3464512).', num_clients=True, client_ids=True,
       client_state=True, personalised=True, relationship_seed=True),
    _m('fedamp', _P, 'Y. Huang, L. Chu, Z. Zhou, L. Wang, J. Liu, J. Pei, Y. Zhang. '
       'Personalized Cross-Silo Federated Learning on Non-IID Data. AAAI 2021.',
       num_clients=True, client_ids=True, client_state=True, personalised=True),
    _m('pfedla', _P, 'X. Ma, J. Zhang, S. Guo, W. Xu. Layer-wised Model Aggregation for '
       'Personalized Federated Learning. CVPR 2022.', num_clients=True, client_ids=True,
       client_state=True, personalised=True, relationship_seed=True),
    _m('fedbn', _P, 'X. Li, M. Jiang, X. Zhang, M. Kamp, Q. Dou. FedBN: Federated Learning on '
       'Non-IID Features via Local Batch Normalization. ICLR 2021.', num_clients=True,
       client_ids=True, client_state=True, personalised=True),
    _m('ditto', _P, 'T. Li, S. Hu, A. Beirami, V. Smith. Ditto: Fair and Robust Federated '
       'Learning Through Personalization. ICML 2021.', client_ids=True, client_state=True,
       composes_aggregator=True),
    _m('local', _P, '', num_clients=True, client_ids=True, client_state=True,
       personalised=True, gin_name='local_training'),
)}


def _ccn() -> dict:
  from fltff import aggregators  # pylint: disable=g-import-not-at-top
  return {'model_aggregator': aggregators.contribution_normalization_factory()}


@dataclasses.dataclass(frozen=True)
class Variant:
  """A composition the programs and tests compare: method `base` built with `kwargs()` (called
  per use: aggregation factories are built anew) and the traits in `traits` changed;
  `citation`: the paper of what it adds to `base` ('' when that is no paper's)."""
  base: str
  kwargs: Callable[[], dict] = dict
  traits: Mapping[str, bool] = dataclasses.field(default_factory=dict)
  citation: str = ''


CCN_CITATION = ('M. K. Kundalwal, A. Saraswat, I. Mishra, D. Mishra. Client Contribution '
                'Normalization for Enhanced Federated Learning. arXiv:2411.06352, 2024.')

# `<method>+ccn` for each method that composes an aggregator (CCN's Λ needs client indices);
# `+fedlap_personalization` wraps the built method (`with_fedlap_personalization`).
VARIANTS: Mapping[str, Variant] = {
    **{f'{name}+ccn': Variant(name, _ccn, {'client_ids': True}, CCN_CITATION)
       for name, m in METHODS.items() if m.composes_aggregator},
    'fedavg_uniform': Variant('fedavg', lambda: {'client_weighting': 'uniform'}),
    'kapc+bls': Variant('kapc', lambda: {'bls_mu': 0.5}, citation=METHODS['kapc'].citation),
    # Participants keep their local models between rounds.
    'fedavg+fedlap_personalization': Variant(
        'fedavg', traits={'client_state': True},
        citation="The FedLap thesis's personalisation (title and author are not in its text)."),
}


def names(variants: bool = False) -> list[str]:
  """The registry's method names (with `variants`: also `VARIANTS`), sorted."""
  return sorted({**METHODS, **VARIANTS} if variants else METHODS)


def get(name: str) -> Method:
  """The registry entry of `name` (a variant's: its method's with the variant's traits);
  `ConfigError` for an unknown name, listing the known ones."""
  if name in METHODS:
    return METHODS[name]
  if name not in VARIANTS:
    raise ConfigError(f'unknown method {name!r}; fltff has {", ".join(names(variants=True))}.')
  return dataclasses.replace(METHODS[VARIANTS[name].base], name=name, **VARIANTS[name].traits)


def of_builder(builder: Callable[..., Any]) -> Method:
  """The entry of `builder` (gin's `@<gin name>`); `ConfigError` for a builder of no entry."""
  for method in METHODS.values():
    if method.build_fn() is builder:
      return method
  raise ConfigError(f'{getattr(builder, "__name__", builder)} is not a method of fltff.methods; '
                    f'experiment.method takes @{", @".join(m.gin_name for m in METHODS.values())}.')


def build(name: str, model_spec, num_clients: Optional[int] = None, client_optimizer=None,
          **kwargs):
  """Method or variant `name` built for `model_spec` with `client_optimizer`, `num_clients`
  (where taken), the variant's kwargs and `kwargs`."""
  method = get(name)
  if name in VARIANTS:
    kwargs = {**VARIANTS[name].kwargs(), **kwargs}
  if method.num_clients:
    if num_clients is None:
      raise ConfigError(f'{name} needs num_clients (the total number of clients).')
    kwargs['num_clients'] = num_clients
  algorithm = method.build_fn()(model_spec, client_optimizer=client_optimizer, **kwargs)
  if name == 'fedavg+fedlap_personalization':
    from fltff.personalization import fedlap_mixing  # pylint: disable=g-import-not-at-top
    algorithm = fedlap_mixing.with_fedlap_personalization(
        algorithm, fedlap_mixing.build_fedlap_personalization(
            model_spec, client_optimizer=client_optimizer))
  return algorithm
