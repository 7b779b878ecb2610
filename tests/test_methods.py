"""The method registry (`fltff.methods`): every entry's traits hold for the built method."""

import dataclasses
import inspect
import os
import re

import gin
import pytest
import tensorflow_federated as tff

from fltff import methods
from fltff.errors import ConfigError
from fltff.learning import ModelSpec
from fltff.simulation import program
from fltff.learning import optimizers
from helpers import REPO
from helpers import tiny_mlp

DIM, CLASSES, N = 4, 3, 3
SPEC = ModelSpec(lambda: tiny_mlp(DIM, CLASSES, 13), (DIM,), CLASSES)


def _sgdm():
  return optimizers.sgdm(learning_rate=0.1, momentum=0.9)


# Every method, and the variants whose traits differ from their method's (CCN: client ids;
# FedLap personalisation: client state) or that change its round (KAPC with BLS).
@pytest.mark.parametrize('name', methods.names() + ['fedavg+ccn', 'fedavg+fedlap_personalization',
                                                    'kapc+bls'])
def test_each_entry_builds_with_the_traits_it_declares(name):
  info = methods.get(name)
  builder = info.build_fn()
  params = inspect.signature(inspect.unwrap(builder)).parameters
  assert ('num_clients' in params) == info.num_clients
  assert ('model_aggregator' in params) == info.composes_aggregator
  assert ('relationship_seed' in params) == info.relationship_seed
  # gin knows the method's builder by its gin name (`experiment.method = @<gin name>`), and
  # the registry knows gin's builder (`experiment.build_method`).
  assert inspect.unwrap(gin.get_configurable(info.gin_name)) is inspect.unwrap(builder)
  assert methods.of_builder(builder) == methods.METHODS[methods.VARIANTS[name].base
                                                        if name in methods.VARIANTS else name]
  algorithm = methods.build(name, SPEC, N, _sgdm())
  assert algorithm.personalized == info.personalised
  assert algorithm.has_client_state == info.client_state
  assert algorithm.num_clients == (N if info.num_clients else None)
  # Every method vectorises on models without BatchNorm.
  assert algorithm.with_vectorized_clients().vectorized and not algorithm.vectorized


@pytest.mark.parametrize('name', methods.names() + ['fedavg+fedlap_personalization'])
def test_a_client_optimizer_of_another_kind_is_refused_when_the_method_is_built(name):
  # A Keras optimizer, TFF's builder itself, a learning rate: each was accepted, to stop in
  # the first round with a traceback from inside the local training.
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  for wrong in (tf.keras.optimizers.SGD(0.1), tff.learning.optimizers.build_sgdm, 0.1):
    with pytest.raises(ConfigError, match='client_optimizer must be a tff.learning.optimizers'):
      methods.build(name, SPEC, N, wrong)


@pytest.mark.parametrize('name', [n for n in methods.names()
                                  if 'server_optimizer' in inspect.signature(
                                      methods.get(n).build_fn()).parameters])
def test_a_server_optimizer_of_another_kind_is_refused_when_the_method_is_built(name):
  # As the client optimizer: a Keras optimizer stopped the first round with a traceback.
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  builder = methods.get(name).build_fn()
  kwargs = {'num_clients': N} if 'num_clients' in inspect.signature(builder).parameters else {}
  for wrong in (tf.keras.optimizers.SGD(1.0), tff.learning.optimizers.build_sgdm, 1.0):
    with pytest.raises(ConfigError, match='server_optimizer must be a tff.learning.optimizers'):
      builder(SPEC, server_optimizer=wrong, **kwargs)
  builder(SPEC, server_optimizer=optimizers.build_optimizer('sgd', 1.0), **kwargs)


@pytest.mark.parametrize('name', ['fedavg+fedlap_personalization', 'kapc', 'fedprox'])
def test_an_entry_without_a_client_optimizer_gets_the_default(name):
  from fltff.learning import optimizers  # pylint: disable=g-import-not-at-top
  algorithm = methods.build(name, SPEC, N)
  default = optimizers.default_client_optimizer()
  personalization = getattr(algorithm, 'personalization', None)
  if personalization is not None:  # FedLap personalisation's own local training.
    assert personalization.optimizer.hyperparameters == default.hyperparameters
  assert algorithm.has_client_state == methods.get(name).client_state


@pytest.mark.parametrize('name', ['fedavg', 'fedavg+ccn', 'fednova', 'scaffold', 'kapc'])
def test_the_program_api_takes_exactly_the_methods_without_client_identity(name):
  # TFF's program API carries no client identity or client state.
  algorithm = methods.build(name, SPEC, N, _sgdm())
  info = methods.get(name)
  if info.client_ids or info.client_state:
    with pytest.raises(ConfigError, match='identity'):
      program.as_dataset_process(algorithm, epochs=1)
  else:
    program.as_dataset_process(algorithm, epochs=1)


@pytest.mark.parametrize('name', ['fedavg', 'fedadp', 'fedbabu', 'scaffold', 'moon'])
def test_a_built_global_method_is_complete_and_cannot_be_changed(name):
  algorithm = methods.build(name, SPEC, N, _sgdm())
  for field, value in (('num_clients', 7), ('bytes_down_per_client', 1), ('finetunes', True),
                       ('vectorized_fn', None), ('client_state_init', None)):
    with pytest.raises(dataclasses.FrozenInstanceError):
      setattr(algorithm, field, value)
  # The builder's description: FedBABU fine-tunes; SCAFFOLD sends its controls each way with
  # the model and the update (as many bytes again as the trainable weights).
  assert algorithm.finetunes == (name == 'fedbabu')
  plain = methods.build('fedavg', SPEC, N, _sgdm())
  trainable = sum(w.nbytes for w in SPEC.initial_weights().trainable)
  extra = trainable if name == 'scaffold' else 0
  assert algorithm.bytes_down_per_client == plain.bytes_down_per_client + extra
  assert algorithm.bytes_up_per_client == plain.bytes_up_per_client + extra + (
      4 if name == 'fedadp' else 0)  # FedAdp's weight also carries the int32 client index.
  vectorised = algorithm.with_vectorized_clients()
  assert vectorised is not algorithm and vectorised.vectorized and not algorithm.vectorized
  assert dataclasses.replace(vectorised, _vectorized=None) == algorithm


def test_the_experiment_builds_gins_method_through_the_registry_with_the_run_seed():
  # KAPC's random R follows the run seed unless gin binds kapc.relationship_seed.
  from fltff.simulation import experiment  # pylint: disable=g-import-not-at-top

  def relation(seed, bindings=()):
    gin.clear_config()
    try:
      gin.parse_config(['client_optimizer.name = "sgd"', *bindings])
      algorithm = experiment.build_method(gin.get_configurable('kapc'), SPEC, N, seed)
      return algorithm.process.initialize()['relation']
    finally:
      gin.clear_config()

  direct = methods.build('kapc', SPEC, N, _sgdm(), relationship_seed=2).process.initialize()
  assert (relation(2) == direct['relation']).all()
  assert not (relation(1) == relation(2)).all()
  assert (relation(2, ['kapc.relationship_seed = 1']) == relation(1)).all()
  with pytest.raises(ConfigError, match='not a method of fltff.methods'):
    experiment.build_method(lambda model_spec, **kwargs: None, SPEC, N)


def test_the_registry_refuses_unknown_names_and_composes_variants():
  with pytest.raises(ConfigError, match="unknown method 'fedsomething'.*fedavg"):
    methods.get('fedsomething')
  with pytest.raises(ConfigError, match='needs num_clients'):
    methods.build('kapc', SPEC, client_optimizer=_sgdm())
  # A variant is its method with the variant's traits.
  assert methods.get('fedavg+ccn').client_ids and not methods.get('fedavg').client_ids
  assert methods.get('kapc+bls').builder == methods.get('kapc').builder
  # Every variant's traits are its method's but for the ones it names.
  for name, variant in methods.VARIANTS.items():
    base = methods.METHODS[variant.base]
    assert methods.get(name) == dataclasses.replace(base, name=name, **variant.traits)


def test_the_methods_page_cites_each_method_as_the_registry_does():
  """docs/methods/index.md's table of papers is the registry's, one row per method and per
  composition that adds a paper ('—' for local training, which follows none)."""
  with open(os.path.join(REPO, 'docs', 'methods', 'index.md')) as f:
    rows = [[cell.strip() for cell in line.strip().strip('|').split('|')]
            for line in f if line.startswith('| ')]
  table = {gin_name: paper for _, gin_name, paper in rows if gin_name.startswith('`@')}
  expected = {f'`@{m.gin_name}`': m.citation or '—' for m in methods.METHODS.values()}
  expected['`@contribution_normalization()`'] = methods.CCN_CITATION
  expected['`@fedlap_personalization`'] = (
      methods.VARIANTS['fedavg+fedlap_personalization'].citation)
  assert table == expected
  # Authors, title, venue and year, but for the one method without a paper.
  assert [m.name for m in methods.METHODS.values()
          if not re.search(r'^[A-Z].*\. .+\. .*(19|20)\d\d', m.citation)] == ['local']


@pytest.mark.parametrize('name,message', [
    ('fedbabu', 'fedbabu freezes the head .* logistic has no other: nothing would train'),
    ('fedbabu+ccn', 'logistic has no other'),
    ('moon', r"logistic's latent layer is its input, .* would be constant \(MOON = FedAvg\)"),
])
def test_a_one_layer_model_is_refused_where_the_method_would_do_nothing_or_fedavg(name, message):
  """FedBABU would freeze the one layer (the global model never moves); MOON's latent layer
  would be the input (ℓ_con constant: FedAvg's numbers)."""
  import functools
  from fltff.models import build_model
  logistic = ModelSpec(functools.partial(build_model, 'logistic', (DIM,), CLASSES, seed=0),
                       (DIM,), CLASSES, name='logistic')
  with pytest.raises(ConfigError, match=message):
    methods.build(name, logistic, N, _sgdm())
  methods.build(name, dataclasses.replace(SPEC, name='mlp'), N, _sgdm())  # A hidden layer.
