"""Client work shared by every method: local training with an optional regulariser
(docs/methods/index.md). A client input is `OrderedDict(batches, info)`; `info` (client index,
local epochs) is a one-element dataset because `compose_learning_process` accepts only
sequence-valued client data (TFF 0.87). Unlike TFF, non-finite updates are *not* zeroed:
divergence must surface so the round driver can stop and keep the last good checkpoint.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any, Optional, Protocol, Union

import numpy as np
import tensorflow as tf

from fltff.config_checks import check_choice
from fltff.config_checks import check_number
from fltff.data.pipeline import ClientBatches
from fltff.errors import ConfigError
from fltff.errors import DataError
from fltff.learning.model_spec import ModelSpec
from fltff.learning.model_spec import batch_loss
from fltff.learning.model_spec import unfinalized_metrics

CLIENT_INFO_SPEC = collections.OrderedDict(
    client_index=tf.TensorSpec([], tf.int32),
    epochs=tf.TensorSpec([], tf.int32),
)


@dataclasses.dataclass(frozen=True)
class RegularizerTraits:
  """A `LocalRegularizer`'s declared `traits`, read (never probed) by the training loops: each
  flag promises a method or a form of the gradient beyond `epoch_start` and `penalty`.

  Attributes:
    analytic: `gradient(local, global_, context)`, `penalty`'s closed-form gradient w.r.t.
      `local`, added to the data gradient instead of differentiating `penalty`.
    affine: `affine_gradient(global_, context) -> (scales, offsets) or None`: the gradient is
      `scale_t * w_t + offset_t`, fixed for the epoch (a None scale: 0); None: use `gradient`.
    global_anchor: The offsets are `−scale ⊙ global_` (FedProx, FedLap).
    own_anchor: `offset_anchor(global_)`: the offsets are `−scale ⊙ anchor` (KAPC's s_i).
    per_tensor_scales: Each `affine_gradient` scale is one number per tensor (`factored_dense`).
    batch_term: `batch_penalty(local, global_, batch, context) -> scalar`, a minibatch term
      (MOON's) differentiated with the data loss, on top of `penalty`/`gradient`; `batch` has
      `x`, `y` and `mask` (1 for a real example of a padded batch; average over those only).
    reads_latent: `batch_penalty` reads the training pass's latent layer (`batch['latent']`).
    measures: `measurements(trained, global_) -> nested dict of scalars`, averaged over the
      participants and reported as `client_work/regularizer/...` (FedLap's λ, d).
  """
  analytic: bool = False
  affine: bool = False
  global_anchor: bool = False
  own_anchor: bool = False
  per_tensor_scales: bool = False
  batch_term: bool = False
  reads_latent: bool = False
  measures: bool = False

  def __post_init__(self):
    if self.affine and not self.analytic:
      raise ValueError('an affine gradient is an analytic one: set analytic=True too.')
    if self.reads_latent and not self.batch_term:
      raise ValueError('reads_latent describes a batch term: set batch_term=True too.')


# The traits of a regulariser that declares none (a user's own): only `penalty`, differentiated.
PENALTY_ONLY = RegularizerTraits()


def traits_of(regularizer) -> Optional[RegularizerTraits]:
  """`regularizer`'s declared `traits` (`PENALTY_ONLY` if none); None without a regulariser."""
  if regularizer is None:
    return None
  return getattr(regularizer, 'traits', PENALTY_ONLY)


class LocalRegularizer(Protocol):
  """A term of the client's local objective that depends on the global weights.

  `epoch_start` returns a context fixed for the epoch (FedLap's λ; by default none, `()`, for
  a subclass); `penalty` is differentiated with the data loss every step unless `traits`
  (`RegularizerTraits`) offer a closed form.
  """
  traits: RegularizerTraits

  def epoch_start(self, local: Sequence[tf.Tensor], global_: Sequence[tf.Tensor]) -> Any:
    del local, global_
    return ()

  def penalty(self, local: Sequence[tf.Variable], global_: Sequence[tf.Tensor],
              context: Any) -> tf.Tensor:
    ...


class StepObserver(Protocol):
  """State a method accumulates over a client's local steps (SCAFFOLD's `GradientMean`),
  output as `result` under `name` by both training loops. `observe` sees the gradients as
  differentiated: without closed-form or affine terms, before frozen tensors are zeroed."""
  name: str

  def initial(self, weights: Sequence[tf.Tensor]) -> Any:
    ...

  def observe(self, state: Any, gradients: Sequence[tf.Tensor]) -> Any:
    ...

  def result(self, state: Any, steps: tf.Tensor) -> Any:
    """From the final state and the client's step count (a scalar, or `[K]`)."""


def client_input(batches: Union[tf.data.Dataset, ClientBatches], client_index: int, epochs: int,
                 client_state: Optional[Sequence[np.ndarray]] = None,
                 state_in_dataset: bool = True, info_in_dataset: bool = True,
                 input_spec: Optional[collections.OrderedDict] = None):
  """One participant's batches (a dataset or `pipeline.ClientBatches`) and info in the layout
  `build_client_work` expects.

  `client_state` (SCAFFOLD's c_i, KAPC's personal model) travels under `state`: a one-element
  dataset like `info` or, with `state_in_dataset=False`, plain tensors (cheaper: a model-sized
  constant in a dataset graph is parsed on every call). `info_in_dataset=False`: `info` as
  NumPy scalars and `ClientBatches` as they are, for inputs only Python reads (vectorised).
  `input_spec` (the model's): batches neither `OrderedDict(x=, y=)` nor `(x, y)` of it are a
  `DataError` here, before any executor reads them (`ClientBatches` are built to it). `epochs`
  may be 0 (a straggler: no local step), not negative or fractional (`ConfigError`).
  """
  check_number(f"client {client_index}'s local epochs", epochs, integer=True, low=0)
  spec = getattr(batches, 'element_spec', input_spec)
  named = dict(x=spec[0], y=spec[1]) if isinstance(spec, tuple) and len(spec) == 2 else spec
  if input_spec is not None and not (isinstance(named, dict) and set(named) == {'x', 'y'} and all(
      named[key].is_compatible_with(input_spec[key]) for key in named)):
    raise DataError(f"client {client_index}'s batches are {spec}, not the model's input_spec "
                    f'{dict(input_spec)}.')
  info = collections.OrderedDict(client_index=np.int32(client_index), epochs=np.int32(epochs))
  if info_in_dataset:
    info = tf.data.Dataset.from_tensors(info)
    if isinstance(batches, ClientBatches):
      batches = batches.dataset
  out = collections.OrderedDict(batches=batches, info=info)
  if client_state is not None:
    if isinstance(client_state, list):
      client_state = tuple(client_state)  # tf.data reads a list as one stacked tensor.
    state = tf.nest.map_structure(np.asarray, client_state)
    out['state'] = tf.data.Dataset.from_tensors(state) if state_in_dataset else state
  return out


def client_types(model_spec: ModelSpec, state_type=None, state_in_dataset: bool = True):
  """TFF types of the broadcast `ModelWeights` and of one client's input (`client_input`);
  `state_type`: of its `state` (of one element of it with `state_in_dataset`), if any."""
  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top

  element_type, weights_type = model_spec.element_type(), model_spec.weights_type()
  fields = [('batches', tff.SequenceType(element_type)),
            ('info', tff.SequenceType(tff.types.tensorflow_to_type(CLIENT_INFO_SPEC)))]
  if state_type is not None:
    fields.append(('state', tff.SequenceType(state_type) if state_in_dataset else state_type))
  data_type = tff.StructWithPythonType(fields, collections.OrderedDict)
  return weights_type, data_type


def read_single(dataset: tf.data.Dataset):
  """The element of a one-element dataset (`info`, `state`), inside a TFF computation."""
  zero = tf.nest.map_structure(lambda s: tf.zeros(s.shape, s.dtype), dataset.element_spec)
  return dataset.reduce(zero, lambda _, x: x)


def client_index_of(data) -> tf.Tensor:
  """The client slot carried in a client input's `info`."""
  return read_single(data['info'])['client_index']


def client_info_of_input(data) -> dict:
  """The `info` packed into one `client_input(...)` (Python ints: client_index, epochs)."""
  info = data['info']
  if isinstance(info, tf.data.Dataset):
    # One op: an iterator per client would cost milliseconds.
    info = info.get_single_element()
  return {name: int(value) for name, value in info.items()}


def examples_per_epoch(examples, epochs):
  """FedAvg's update weight n_i: examples trained on over all epochs // max(epochs, 1); one
  client's scalars or `[K]` vectors."""
  return tf.cast(examples, tf.int64) // tf.cast(tf.maximum(epochs, 1), tf.int64)


def step_gradients(gradients, values, regularizer: Optional[LocalRegularizer],
                   global_trainable, context, affine, frozen: frozenset) -> list:
  """The data gradients plus the regulariser's closed form (`affine` terms if given, else
  `regularizer.gradient` if analytic), frozen tensors zeroed."""
  if affine is not None:
    gradients = [tf.add_n([g, o] if a is None else [g, a * w, o])
                 for g, w, a, o in zip(gradients, values, *affine)]
  elif regularizer is not None and traits_of(regularizer).analytic:
    gradients = [g + r for g, r in zip(
        gradients, regularizer.gradient(values, global_trainable, context))]
  if frozen:
    gradients = [tf.zeros_like(g) if i in frozen else g for i, g in enumerate(gradients)]
  return list(gradients)


def client_step(forward: Callable, local, batch, regularizer: Optional[LocalRegularizer],
                global_trainable, context, affine=None, frozen: frozenset = frozenset(),
                probes: Optional[dict[int, tf.Tensor]] = None, isolate: bool = False,
                affine_by_updater: bool = False) -> tuple:
  """One client's local step up to the optimizer, on both executors: `(gradients,
  differentiated (as step observers see them), batch_loss's sums, probe gradients, values of
  local)` of `batch_loss + regulariser` w.r.t. `local`.

  `forward(local, x, mask) -> (latent or None, logits)`. `affine_by_updater`: the updater adds
  affine terms (vectorised clients). `probes`: `{index: tensor}` differentiated in place of
  `local[index]` (`factored_dense`). `isolate`: the data loss in a function of its own (as
  TFF's `forward_pass`), which keeps the per-client numbers bit for bit.
  """
  traits = traits_of(regularizer) or PENALTY_ONLY
  probes = probes or {}

  def data_loss(x, y, mask):
    latent, logits = forward(local, x, mask)
    return latent, *batch_loss(logits, y, mask)

  with tf.GradientTape() as tape:
    tape.watch(local)
    for i in sorted(probes):
      tape.watch(probes[i])
    latent, loss, sums = (tf.function(data_loss, autograph=False) if isolate else data_loss)(
        batch['x'], batch['y'], batch['mask'])
    if regularizer is not None and not traits.analytic:
      loss += regularizer.penalty(local, global_trainable, context)
    if traits.batch_term:  # MOON's contrastive term, over the batch's real examples.
      batch = collections.OrderedDict(x=batch['x'], y=batch['y'], mask=batch['mask'])
      if traits.reads_latent:
        batch['latent'] = latent
      loss += regularizer.batch_penalty(local, global_trainable, batch, context)
  sources = [w for i, w in enumerate(local) if i not in probes]
  found = iter(tape.gradient(loss, sources + [probes[i] for i in sorted(probes)]))
  differentiated = tuple(tf.zeros([], w.dtype) if i in probes else next(found)
                         for i, w in enumerate(local))
  values = tuple(tf.convert_to_tensor(w) for w in local)
  closed_form = None if affine_by_updater and traits.affine else regularizer
  gradients = step_gradients(differentiated, values, closed_form, global_trainable, context,
                             affine, frozen)
  return tuple(gradients), differentiated, sums, list(found), values


def build_local_training(keras_model: tf.keras.Model, optimizer,
                         regularizer: Optional[LocalRegularizer] = None,
                         frozen: Sequence[int] = (),
                         step_observers: Sequence[StepObserver] = ()):
  """A `tf.function` running the local epochs of `client_step` on `keras_model`:
  `(initial_weights, batches, info)` → OrderedDict of the `trained` and `non_trainable`
  weights, `examples_per_epoch`, `steps`, unfinalized `metrics` and each step observer's result
  under its `name`, all read inside (in a graph-mode TFF computation, reads outside would not
  follow the loop). `frozen`: trainable tensors kept fixed (FedBABU's head).
  """
  if keras_model.losses:
    raise ConfigError(f'client training does not support layer losses ({keras_model.name}).')
  # A closed-form gradient is added directly: the update of differentiating `penalty` (tested).
  traits = traits_of(regularizer) or PENALTY_ONLY
  frozen = frozenset(frozen)
  forward = lambda local, x, mask: (None, keras_model(x, training=True))
  if traits.reads_latent:
    from fltff.models import latent_model  # pylint: disable=g-import-not-at-top
    latent_and_output = latent_model(keras_model, with_output=True)
    forward = lambda local, x, mask: tuple(latent_and_output(x, training=True))

  # No autograph: loops are `tf.while_loop`s, every `if` is on a Python value (converting is slow).
  @tf.function(autograph=False)
  def train(initial_weights, batches, info, anchor_weights=None):
    info = read_single(info)
    epochs = info['epochs']
    variables = tuple(keras_model.trainable_weights)
    statistics = tuple(keras_model.non_trainable_weights)
    for v, t in zip(variables + statistics, tf.nest.flatten(initial_weights.trainable) +
                    tf.nest.flatten(initial_weights.non_trainable)):
      v.assign(t)
    # The regulariser's `global_`: the start, or a model of its own (Ditto's w^t).
    global_trainable = tuple(tf.nest.flatten(
        (initial_weights if anchor_weights is None else anchor_weights).trainable))
    optimizer_state = optimizer.initialize(
        tuple(tf.TensorSpec(v.shape, v.dtype) for v in variables))

    def run_epoch(sums, optimizer_state, observed):
      context = ()
      if regularizer is not None:
        context = regularizer.epoch_start(
            tuple(v.read_value() for v in variables), global_trainable)
      affine = regularizer.affine_gradient(global_trainable, context) if traits.affine else None

      def step(state, batch):
        sums, optimizer_state, observed = state
        batch = collections.OrderedDict(batch, mask=tf.ones(tf.shape(batch['y']), tf.float32))
        gradients, differentiated, step_sums, _, values = client_step(
            forward, variables, batch, regularizer, global_trainable, context, affine, frozen,
            isolate=True)
        observed = tuple(o.observe(state, differentiated)
                         for o, state in zip(step_observers, observed))
        optimizer_state, updated = optimizer.next(optimizer_state, values, gradients)
        for i, (v, u) in enumerate(zip(variables, updated)):
          if i not in frozen:
            v.assign(u)
        loss_sum, examples, correct = step_sums
        sums = (sums[0] + loss_sum, sums[1] + tf.cast(examples, tf.int64), sums[2] + correct,
                sums[3] + 1)
        return sums, optimizer_state, observed

      # Batches read into TensorArrays, then trained on in a `tf.while_loop` (faster than TFF's
      # steps inside `Dataset.reduce`); read per epoch, so a reshuffling dataset reshuffles.
      arrays = tf.nest.map_structure(
          lambda spec: tf.TensorArray(spec.dtype, size=0, dynamic_size=True, infer_shape=False,
                                      element_shape=spec.shape), batches.element_spec)

      def collect(state, batch):
        i, arrays = state
        return i + 1, tf.nest.map_structure(lambda a, t: a.write(i, t), arrays, batch)

      count, arrays = batches.reduce((tf.constant(0), arrays), collect)

      def body(i, state):
        batch = tf.nest.map_structure(lambda a: a.read(i), arrays)
        return i + 1, step(state, batch)

      _, state = tf.while_loop(lambda i, _: i < count, body,
                               (tf.constant(0), (sums, optimizer_state, observed)))
      return state

    # Per client: Σ batch-loss·n, examples, correct predictions, batches.
    sums = (tf.constant(0.0), tf.constant(0, tf.int64), tf.constant(0.0), tf.constant(0, tf.int64))
    observed = tuple(o.initial(variables) for o in step_observers)
    _, sums, optimizer_state, observed = tf.while_loop(
        lambda e, *_: e < epochs, lambda e, *state: (e + 1, *run_epoch(*state)),
        (tf.constant(0), sums, optimizer_state, observed))
    steps = tf.cast(sums[3], tf.int32)
    result = collections.OrderedDict(
        trained=tuple(v.read_value() for v in variables),
        non_trainable=tuple(v.read_value() for v in statistics),
        examples_per_epoch=examples_per_epoch(sums[1], epochs),
        steps=steps,
        metrics=unfinalized_metrics(sums))
    for observer, state in zip(step_observers, observed):
      result[observer.name] = observer.result(state, steps)
    return result

  return train


@dataclasses.dataclass(frozen=True)
class ClientStatistic:
  """A per-client value an aggregation factory needs (its `client_statistics`), sent in the
  update weight `OrderedDict(num_examples=ν, <name>=<value>, ...)` in declared order.

  `of_client(keras_model, client data, build_local_training's outputs)`: its tensor in TFF's
  client computation (a read of the model must depend on `outputs['trained']`).
  `of_clients(client inputs, VectorizedClientWork.train's outputs)`: `[K, ...]` for vectorised
  clients; None: `outputs[name]`, from `in_trace(work, trained [K, ...], (examples, index,
  mask, K) of the first epoch)` in the training's trace (`reads_latent`: it reads
  `work.latent_apply`).
  """
  name: str
  dtype: type
  of_client: Callable[[Any, Any, Any], Any]
  of_clients: Optional[Callable[[Sequence, Any], Any]] = None
  shape: Callable[[ModelSpec], tuple] = lambda model_spec: ()
  in_trace: Optional[Callable[..., Any]] = None
  reads_latent: bool = False


# The participant's client index: keys a stateful aggregator's per-client state (FedAdp,
# FedLayerWise) and labels per-client measurements (CCN).
CLIENT_INDEX = ClientStatistic(
    'client_index', np.int32, lambda keras_model, data, out: client_index_of(data),
    lambda client_inputs, out: np.asarray(
        [client_info_of_input(c)['client_index'] for c in client_inputs], np.int32))


CLIENT_WEIGHTINGS = ('num_examples', 'uniform')


def client_result(initial_weights, data, out, statistics: Sequence[ClientStatistic] = (),
                  client_weighting: str = 'num_examples', keras_model=None):
  """The `ClientResult` of local training `out` (of `keras_model`): update `initial − trained`,
  weight ν = n_k (`client_weighting='num_examples'`) or 1 (`'uniform'`), with `statistics`."""
  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top

  update = tf.nest.map_structure(
      tf.subtract, tuple(tf.nest.flatten(initial_weights.trainable)), out['trained'])
  update = with_moving_statistics(tf.nest.pack_sequence_as(initial_weights.trainable, update),
                                  initial_weights.non_trainable, out['non_trainable'])
  if client_weighting == 'uniform':
    weight = tf.constant(1.0, tf.float32)
  else:
    weight = tf.cast(out['examples_per_epoch'], tf.float32)
  weight = with_statistics(weight, statistics, lambda s: s.of_client(keras_model, data, out))
  return tff.learning.templates.ClientResult(update=update, update_weight=weight)


def with_moving_statistics(update, initial, trained):
  """A global method's update: the trainable delta, or for a model with BatchNorm moving
  statistics `ModelWeights(delta, initial − trained statistics)` (`trained` may lead with a
  client axis), for `process.build_statistics_mean`."""
  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top

  if not tf.nest.flatten(initial):
    return update
  change = [tf.subtract(i, t) for i, t in zip(tf.nest.flatten(initial), trained)]
  return tff.learning.models.ModelWeights(
      trainable=update, non_trainable=tf.nest.pack_sequence_as(initial, change))


def with_statistics(weight, statistics: Sequence[ClientStatistic],
                    value_of: Callable[[ClientStatistic], Any]):
  """`weight` alone without `statistics`, else `OrderedDict(num_examples=weight, <name>=
  value_of(statistic) for each statistic)`."""
  if not statistics:
    return weight
  return collections.OrderedDict(num_examples=weight, **{s.name: value_of(s) for s in statistics})


def client_result_type(model_spec: ModelSpec, statistics: Sequence[ClientStatistic] = ()):
  """The TFF type of one participant's `client_result`, without tracing the client work
  (`process.build_algorithm` makes the aggregator from it before any round runs)."""
  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top

  weight = tff.types.to_type(with_statistics(tff.TensorType(np.float32), statistics, lambda s:
                                             tff.TensorType(s.dtype, s.shape(model_spec))))
  weights_type = model_spec.weights_type()
  update = weights_type if len(weights_type.non_trainable) else weights_type.trainable
  return tff.StructWithPythonType(
      [('update', update), ('update_weight', weight)],
      tff.learning.templates.ClientResult)


def metrics_aggregation(model_spec: ModelSpec):
  """TFF's `sum_then_finalize` of the model's metrics (the participants' unfinalized metrics →
  the round's), built in a graph of its own (not the caller's)."""
  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top

  with tf.Graph().as_default():
    return tff.learning.metrics.sum_then_finalize(model_spec.metric_finalizers())


def build_stateless_initialize():
  """The `initialize` of a stateless client work (`build_client_work`'s): `()` at the server."""
  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top

  @tff.federated_computation
  def initialize():
    return tff.federated_value((), tff.SERVER)

  return initialize


def build_client_work(model_spec: ModelSpec,
                      optimizer,
                      regularizer: Optional[LocalRegularizer] = None,
                      client_statistics: Sequence[ClientStatistic] = (),
                      frozen: Sequence[int] = (),
                      client_weighting: str = 'num_examples'):
  """A `tff.learning.templates.ClientWorkProcess` doing local training from the global model.

  The update is `initial − trained` (TFF's model-delta convention) and its weight the client's
  training examples per epoch n_k, FedAvg's weighting (McMahan et al. (2017), eq. (1)), or 1
  with `client_weighting='uniform'` (the unweighted mean 1/|S_t| Σ_k w_k of the FedProx and
  FedLap papers). `optimizer`: a `tff.learning.optimizers.Optimizer`.

  Args:
    client_statistics: The aggregator's `ClientStatistic`s, sent with the update
      (`with_statistics`).
    frozen: Indices of trainable tensors kept fixed (FedBABU's head).
    client_weighting: 'num_examples' (ν = n_k) or 'uniform' (ν = 1).
  """
  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top

  check_choice('client_weighting', client_weighting, CLIENT_WEIGHTINGS)
  metrics_aggregation_fn = metrics_aggregation(model_spec)
  weights_type, data_type = client_types(model_spec)

  reports_measurements = regularizer is not None and traits_of(regularizer).measures

  @tff.tensorflow.computation(weights_type, data_type)
  def client_update(initial_weights, data):
    keras_model = model_spec.keras_fn()
    out = build_local_training(keras_model, optimizer, regularizer, frozen)(
        initial_weights, data['batches'], data['info'])
    result = client_result(initial_weights, data, out, client_statistics, client_weighting,
                           keras_model)
    regularizer_stats = ()
    if reports_measurements:
      regularizer_stats = regularizer.measurements(
          out['trained'], tuple(tf.nest.flatten(initial_weights.trainable)))
    return result, out['metrics'], regularizer_stats

  init_fn = build_stateless_initialize()

  @tff.federated_computation(init_fn.type_signature.result,
                             tff.FederatedType(weights_type, tff.CLIENTS),
                             tff.FederatedType(data_type, tff.CLIENTS))
  def next_fn(state, weights, client_data):
    client_result, model_outputs, regularizer_stats = tff.federated_map(
        client_update, (weights, client_data))
    measurements = collections.OrderedDict(train=metrics_aggregation_fn(model_outputs))
    if reports_measurements:
      measurements['regularizer'] = tff.federated_mean(regularizer_stats)
    measurements = tff.federated_zip(measurements)
    return tff.templates.MeasuredProcessOutput(state, client_result, measurements)

  return tff.learning.templates.ClientWorkProcess(init_fn, next_fn)


def build_local_update(model_spec: ModelSpec, optimizer,
                       regularizer: Optional[LocalRegularizer] = None):
  """Federated computation training each participant's *own* model on its data.

  `(weights@CLIENTS, global weights@SERVER, client_input@CLIENTS) -> (client_index, trained
  ModelWeights)@CLIENTS`: no aggregation; `regularizer`'s `global_` is the broadcast global
  model (Ditto's proximal term; None: plain local training, the global model unused). The index
  because TFF's mergeable context returns results in finish order."""
  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top

  weights_type, data_type = client_types(model_spec)

  @tff.tensorflow.computation(weights_type, weights_type, data_type)
  def local_update(weights, global_weights, data):
    out = build_local_training(model_spec.keras_fn(), optimizer, regularizer)(
        weights, data['batches'], data['info'], global_weights)
    new_weights = tff.learning.models.ModelWeights(
        trainable=tf.nest.pack_sequence_as(weights.trainable, list(out['trained'])),
        non_trainable=tf.nest.pack_sequence_as(weights.non_trainable,
                                               list(out['non_trainable'])))
    return client_index_of(data), new_weights

  @tff.federated_computation(tff.FederatedType(weights_type, tff.CLIENTS),
                             tff.FederatedType(weights_type, tff.SERVER),
                             tff.FederatedType(data_type, tff.CLIENTS))
  def run(weights, global_weights, client_data):
    return tff.federated_map(local_update, (weights, tff.federated_broadcast(global_weights),
                                            client_data))

  return run
