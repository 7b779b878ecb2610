"""Client-vectorised local training: one round's participants trained in one TensorFlow step.

The participants' weights get a leading client axis and every local step is one
`tf.vectorized_map` over the clients (a batched matmul/convolution, not K small ones) of
`client_work.client_step` (optimizer: `stacked_optimizer`), so a round equals TFF's to float
rounding. Unequal clients are padded and masked, or trained in groups (`round_data`). Exact
shortcuts: with every client starting from the global model under the shared regulariser, the
first epoch's context is computed once; an epoch whose anchored term `s ⊙ (w − global)` has
every scale zero (FedLap's first epoch: λ = 0 at local = global) takes the plain update. The
scope (anything else raises a `ConfigError` naming it): docs/runtime.md.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import functools
import weakref
from collections.abc import Sequence
from typing import Any, Callable, NamedTuple, Optional

import numpy as np
import tensorflow as tf

from fltff.config_checks import check_device
from fltff.errors import ConfigError
from fltff.learning import client_work as client_work_lib
from fltff.learning import factored_dense
from fltff.learning.groups import worker_groups
from fltff.learning.model_spec import ModelSpec
from fltff.learning.model_spec import unfinalized_metrics
from fltff.learning.round_data import client_groups
from fltff.learning.round_data import group_data
from fltff.learning.round_data import in_client_order
from fltff.learning.round_data import round_specs
from fltff.learning.round_data import stack_client_batches
from fltff.learning.round_data import step_overhead
from fltff.learning.stacked_optimizer import Anchor
from fltff.learning.stacked_optimizer import FusedSGDM
from fltff.learning.stacked_optimizer import broadcast_clients
from fltff.learning.stacked_optimizer import client_mask
from fltff.learning.stacked_optimizer import stacked_optimizer
from fltff.models.layers import macs_per_example
from fltff.runtime.in_process import StackedClients
from fltff.runtime.in_process import aligned_stack
from fltff.runtime.in_process import stacked_tensor
from fltff.runtime.in_process import clients_argument


def functional_apply(keras_model: tf.keras.Model, weights_model: Optional[tf.keras.Model] = None,
                     batch_norm: bool = False):
  """`apply(trainable, x, training)`: `keras_model`'s output with `weights_model`'s trainable
  weights (default `keras_model`'s; e.g. the full model of a latent sub-model sharing its
  layers) swapped, as layer attributes, for the tensors `trainable` (`trainable_weights` order),
  so the layers' own `call` runs on tensors `tf.vectorized_map` can stack.

  With `batch_norm`, BatchNormalization layers normalise with the moments of the batch's real
  examples (`apply(..., mask=)`), recorded by layer name in `apply(..., moments={})` for
  `moving_statistics`. `ConfigError` for other non-trainable weights, layer losses or weights
  not held as layer attributes.
  """
  weights_model = keras_model if weights_model is None else weights_model
  model_norms = batch_norms(weights_model) if batch_norm else []
  moving = {id(v) for layer in model_norms for v in (layer.moving_mean, layer.moving_variance)}
  if any(id(v) not in moving for v in weights_model.non_trainable_weights):
    raise ConfigError(
        f'vectorised clients need a model whose weights are all trainable; {keras_model.name} '
        f"has non-trainable weights (e.g. BatchNorm statistics): use "
        f"experiment.client_work = 'per_client'.")
  plain = lambda layer: (list(layer.input_spec.axes) == [layer.input_spec.ndim - 1]
                         and not layer.renorm and layer.virtual_batch_size is None
                         and layer.adjustment is None)
  if not all(plain(layer) for layer in model_norms):
    raise ConfigError(f'vectorised clients support BatchNormalization over the last axis, '
                      f'without renorm, virtual batches or adjustment ({keras_model.name}).')
  if weights_model.losses:
    raise ConfigError(f'vectorised clients do not support layer losses ({keras_model.name}).')
  slots = _slots_of(weights_model.trainable_weights, weights_model, keras_model)
  statistic_slots = _slots_of(weights_model.non_trainable_weights, weights_model, keras_model)
  norms = batch_norms(keras_model) if batch_norm else []  # Those whose `call` is swapped.

  def apply(trainable: Sequence[tf.Tensor], x: tf.Tensor, training: bool = True,
            kernel_products: Optional[dict[int, Callable]] = None,
            mask: Optional[tf.Tensor] = None, moments: Optional[dict] = None,
            statistics: Sequence[tf.Tensor] = ()) -> tf.Tensor:
    """`kernel_products`: `{trainable index: product}` computed for a plain `Dense` kernel's
    `x @ kernel`. `mask` (`[batch]`, 1 for a real example): what BatchNorm's moments count.
    `statistics`: in inference, the BatchNorm moving statistics (`non_trainable_weights`)."""
    if norms and not training and not statistics:
      raise ConfigError('vectorised clients train BatchNorm models; inference needs the moving '
                        'statistics.')
    swaps = list(zip(slots, trainable)) + (list(zip(statistic_slots, statistics))
                                           if not training else [])
    saved = [getattr(layer, name) for (layer, name), _ in swaps]
    products = kernel_products or {}
    swapped = [slots[i][0] for i in products] + (norms if training else [])
    try:
      for (layer, name), value in swaps:
        object.__setattr__(layer, name, value)  # No Keras tracking: restored below.
      for i, product in products.items():
        object.__setattr__(slots[i][0], 'call', factored_dense.dense_call(slots[i][0], product))
      for layer in swapped[len(products):]:
        object.__setattr__(layer, 'call', masked_batch_norm_call(layer, mask, moments))
      return keras_model(x, training=training)
    finally:
      for ((layer, name), _), value in zip(swaps, saved):
        object.__setattr__(layer, name, value)
      for layer in swapped:
        object.__delattr__(layer, 'call')  # The class's `call` again.

  apply.slots = slots
  return apply


def batch_norms(keras_model: tf.keras.Model) -> list[tf.keras.layers.BatchNormalization]:
  return [layer for layer in keras_model.layers
          if isinstance(layer, tf.keras.layers.BatchNormalization)]


def masked_batch_norm_call(layer: tf.keras.layers.BatchNormalization,
                           example_mask: Optional[tf.Tensor], moments: Optional[dict] = None):
  """A training-mode `call` for `layer`: Keras's BatchNorm over the examples where
  `example_mask` is 1 (biased variance); the moments the moving statistics follow go to
  `moments` if given, the variance unbiased (n / (n − 1)) where Keras's fused kernel runs."""

  def call(inputs, training=None, mask=None):
    del training, mask  # Training mode; the example mask is the round's, not Keras's.
    x = tf.cast(inputs, layer.compute_dtype)
    rank = x.shape.rank
    axes = [a for a in range(rank) if a != rank - 1]
    weight = (tf.ones(tf.shape(x)[:1], x.dtype) if example_mask is None
              else tf.cast(example_mask, x.dtype))
    weight = tf.reshape(weight, [-1] + [1] * (rank - 1))
    count = tf.reduce_sum(weight) * tf.cast(tf.reduce_prod(tf.shape(x)[1:-1]), x.dtype)
    mean = tf.reduce_sum(x * weight, axes) / tf.maximum(count, 1.0)
    variance = tf.reduce_sum(tf.math.squared_difference(x, tf.stop_gradient(mean)) * weight,
                             axes) / tf.maximum(count, 1.0)
    # A step without examples (an idle client) stays finite: its masked loss is zero, not NaN.
    variance = tf.where(count > 0, variance, tf.ones_like(variance))
    if moments is not None:
      moments[layer.name] = (mean, variance * count / tf.maximum(count - 1.0, 1.0)
                             if layer.fused else variance)
    return tf.nn.batch_normalization(x, mean, variance, layer.beta if layer.center else None,
                                     layer.gamma if layer.scale else None, layer.epsilon)

  return call


def moving_statistics(keras_model: tf.keras.Model) -> Callable:
  """`update(statistics, moments, trains)`: the BatchNorm moving statistics (`[K, ...]`, in
  `non_trainable_weights` order) after a step with batch `moments` (`functional_apply`'s):
  Keras's `v − (v − batch)(1 − momentum)`, for the clients in `trains`."""
  slot = {id(v): (layer.name, which, layer.momentum) for layer in batch_norms(keras_model)
          for which, v in enumerate((layer.moving_mean, layer.moving_variance))}
  slots = [slot[id(v)] for v in keras_model.non_trainable_weights]

  def update(statistics, moments, trains):
    out = []
    for value, (name, which, momentum) in zip(statistics, slots):
      batch = tf.cast(moments[name][which], value.dtype)
      moved = value - (value - batch) * tf.cast(1.0 - momentum, value.dtype)
      out.append(tf.where(client_mask(trains, value.shape.rank), moved, value))
    return tuple(out)

  return update


def _slots_of(variables, weights_model, keras_model) -> list[tuple[Any, str]]:
  slots = []
  for variable in variables:
    slot = next(((layer, name) for layer in weights_model.layers
                 for name, value in vars(layer).items() if value is variable), None)
    if slot is None:
      raise ConfigError(f'vectorised clients cannot find the layer attribute holding '
                        f'{variable.name} in {keras_model.name}.')
    slots.append(slot)
  return slots


# Client counts traced with a fixed client axis (`with_clients`); others share a dynamic one.
MAX_STATIC_CLIENT_COUNTS = 4


def with_clients(structure: Any, num_clients: Optional[int]) -> Any:
  """`structure`'s tensors with their leading (client) axis fixed at `num_clients` (None: as is).

  Unless a mapped tensor's leading dimension and the client count are known at trace time,
  pfor copies every argument of `tf.vectorized_map` (the stacked weights too) at every step.
  """
  if num_clients is None or structure is None:
    return structure

  def fix(t):
    t = tf.convert_to_tensor(t)
    shape = t.shape.as_list()
    shape[0] = num_clients
    return tf.ensure_shape(t, shape)

  return tf.nest.map_structure(fix, structure)


def on_cpu(device: Optional[str]) -> bool:
  """Whether computations placed on `device` (None: TensorFlow's choice) run on a CPU."""
  if device is not None:
    return 'CPU' in device.upper()
  return not tf.config.list_physical_devices('GPU')


def stack_clients(values: Sequence[Any]) -> Any:
  """The participants' nested arrays (client states, local models) stacked as `[K, ...]`."""
  return tf.nest.map_structure(lambda *rows: stacked_tensor(aligned_stack(rows)), *values)


@contextlib.contextmanager
def _quiet_looped_gradients():
  """Drops pfor's warning that it loops over clients: a convolution's filter gradient, looped
  by design (docs/performance.md)."""
  logger = tf.get_logger()
  quiet = lambda record: 'uses a while_loop. Fix that!' not in record.getMessage()
  logger.addFilter(quiet)
  try:
    yield
  finally:
    logger.removeFilter(quiet)


class _Regularization(NamedTuple):
  """How a round's regularisers enter the vectorised step (`VectorizedClientWork`)."""
  probe: Any  # The shared regulariser, or the first client's; None without one.
  traits: client_work_lib.RegularizerTraits
  of_client: Callable[[Any], Any]  # A client's terms → its regulariser.
  global_anchor: bool  # Affine, offsets `−scale ⊙ global` (one global model read by the update).
  client_anchor: bool  # Affine, offsets `−scale ⊙ a_i` with each client's own anchor.


class VectorizedClientWork:
  """`client_work.build_client_work`'s computation for all of a round's participants at once.

  `round_results(global_weights, client_inputs, call)` returns `(results, train_metrics,
  regularizer_stats, out)`: `StackedClientResults` (as `client_work.client_result`), the
  metrics through `tff.learning.metrics.sum_then_finalize` (run by `call`), the mean
  regulariser measurements (None without them) and the training's outputs.
  """

  def __init__(self, model_spec: ModelSpec, optimizer,
               regularizer: Optional[client_work_lib.LocalRegularizer] = None,
               client_statistics: Sequence[client_work_lib.ClientStatistic] = (),
               frozen: Sequence[int] = (),
               client_weighting: str = 'num_examples', device: Optional[str] = None,
               client_regularizer: Optional[Callable[[Any], Any]] = None,
               step_observers: Sequence[client_work_lib.StepObserver] = (), latent: bool = False,
               factor_dense: bool = True, batch_norm: bool = False,
               mean_aggregation: bool = False):
    """`batch_norm`: allow BatchNorm models (`functional_apply`); the moving statistics train
    from `train(statistics=)` and come back as `non_trainable`. `mean_aggregation`: the updates
    go to a plain weighted mean (TFF's `MeanFactory()`), so a group of clients trained on a
    worker may send its weighted mean and total weight instead (`fltff.learning.groups`)."""
    import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top

    check_device(device)
    if regularizer is not None and client_regularizer is not None:
      raise ValueError('give a shared regularizer or a client_regularizer, not both.')
    if regularizer is not None and client_work_lib.traits_of(regularizer).batch_term:
      raise ConfigError(f'vectorised clients do not support a shared regulariser with a batch '
                        f'term ({type(regularizer).__name__}).')
    metrics_type = tff.types.tensorflow_to_type(model_spec.unfinalized_metric_specs())
    metrics_aggregation_fn = client_work_lib.metrics_aggregation(model_spec)

    @tff.federated_computation(tff.FederatedType(metrics_type, tff.CLIENTS))
    def aggregate_metrics(model_outputs):
      return metrics_aggregation_fn(model_outputs)

    self._aggregate_metrics = aggregate_metrics
    # Built after the graph-mode model above: Keras invalidates eager models made before one.
    self._keras_fn = model_spec.keras_fn
    self._keras_model = model_spec.keras_fn()
    self._layer_bases = [(cls, cls.__bases__) for cls in
                         {type(layer) for layer in (self._keras_model, *self._keras_model.layers)}]
    batch_norm = batch_norm and bool(batch_norms(self._keras_model))
    reads_latent = latent or any(s.reads_latent for s in client_statistics)
    if batch_norm and reads_latent:
      raise ConfigError('vectorised clients do not compute latent representations of a model '
                        'with BatchNorm.')
    self._apply = functional_apply(self._keras_model, batch_norm=batch_norm)
    self._update_statistics = moving_statistics(self._keras_model) if batch_norm else None
    self._macs_per_example = macs_per_example(self._keras_model)
    self._latent, self.latent_dim = None, None  # `latent_apply` and its width.
    self._latent_and_output = None
    if reads_latent:
      # Built here, eagerly, like the model (not while `_train` is traced).
      from fltff.models import latent_model  # pylint: disable=g-import-not-at-top
      latent_keras = latent_model(self._keras_model)
      self._latent = functional_apply(latent_keras, self._keras_model)
      self.latent_dim = int(latent_keras.output_shape[-1])
    if latent:
      # Latent layer and logits from one forward pass (MOON's representation, no second pass).
      self._latent_and_output = functional_apply(
          latent_model(self._keras_model, with_output=True), self._keras_model)
    self._optimizer = optimizer
    self._updater = stacked_optimizer(optimizer, frozenset(frozen))
    # Dense kernels short rounds train factored (`factored_dense`); none with step observers,
    # which see every tensor's gradient.
    self._dense_kernels = (factored_dense.dense_kernels(self._apply.slots, frozenset(frozen))
                           if factor_dense and isinstance(self._updater, FusedSGDM)
                           and not step_observers else {})
    self._regularizer = regularizer
    self._client_regularizer = client_regularizer
    self._client_statistics = tuple(client_statistics)
    self._frozen = frozenset(frozen)
    self._client_weighting = client_weighting
    self.mean_aggregation = mean_aggregation and not client_statistics
    self._step_observers = tuple(step_observers)
    self._device = device
    # Clients of very unequal sizes train in groups (`round_data.client_groups`), on a CPU only:
    # its cost model is fitted there; on a GPU a step's fixed cost is far larger.
    self.group_clients = on_cpu(device)
    self._train = tf.function(self._train_fn, reduce_retracing=True, autograph=False)
    self._static_client_counts: set[int] = set()
    self._traced_for: set[tuple[Optional[int], frozenset]] = set()
    self._read_before = weakref.WeakSet()
    # Factored kernel sets traced so far (`factored_dense`), for inspection.
    self.factored_traces: set[tuple[int, ...]] = set()
    self.last_trained = None  # The last round's trained models (`round_results`).

  @property
  def latent_apply(self):
    """`functional_apply` of the latent layer (`models.latent_model`): CCN's latent mean, MOON's
    representation. `ValueError` without `latent=True` (or a statistic that `reads_latent`)."""
    if self._latent is None:
      raise ValueError('VectorizedClientWork(latent=True) builds the latent-layer model.')
    return self._latent

  # -- the TensorFlow part -----------------------------------------------------------------
  # No autograph: loops are `tf.while_loop`s, every condition a Python value (converting is slow).
  def _regularization(self, client_terms) -> _Regularization:
    """How the round's regularisers enter the step, from the traits of the shared one or the
    first client's (with `client_terms`; the same class for every client)."""
    shared = self._regularizer
    probe = shared
    if client_terms is not None:
      probe = self._client_regularizer(tf.nest.map_structure(lambda t: t[0], client_terms))
    traits = client_work_lib.traits_of(probe) or client_work_lib.PENALTY_ONLY
    if traits.reads_latent and self._latent_and_output is None:
      raise ValueError('a regulariser that reads the latent layer needs latent=True.')
    return _Regularization(
        probe=probe, traits=traits,
        of_client=(lambda terms: shared) if client_terms is None else self._client_regularizer,
        global_anchor=traits.affine and client_terms is None and traits.global_anchor,
        client_anchor=traits.affine and client_terms is not None and traits.own_anchor)

  def _client_step_fn(self, reg: _Regularization, global_trainable, plan, base_of, anchor_of):
    """One client's step, `(weights, x, y, mask, trains, context, terms, rows, anchors) →
    (gradients, metric sums, factors, differentiated, moments)`: affine terms are left to the
    updater, the sums weighted by `trains`, `factors` the factored kernels' `(inputs, δ)`."""
    traits = reg.traits

    def client_step(args):
      local, bx, by, bmask, trains, context, client, rows, anchors = args
      products, inputs, probes, moments = {}, {}, {}, {}
      for n, i in enumerate(plan.indices if plan else ()):
        # `x w_t` of a factored kernel; the gradient w.r.t. a zero added to the
        # pre-activations is δ (the kernel's gradient is never formed).
        probes[i] = tf.zeros([tf.shape(bx)[0], local[i].shape[-1]], local[i].dtype)

        def product(x, n=n, i=i, base=base_of(i, local), anchor=anchor_of(n, i, anchors)):
          inputs[i] = x
          return plan.product(x, base, rows[n], anchor, probes[i])

        products[i] = product

      def forward(local, x, mask):
        if traits.reads_latent:
          return self._latent_and_output(local, x, training=True)
        return None, self._apply(local, x, training=True, kernel_products=products, mask=mask,
                                 moments=moments)

      # Affine terms are left to the updater.
      gradients, differentiated, (loss_sum, n, correct), deltas, _ = client_work_lib.client_step(
          forward, local, collections.OrderedDict(x=bx, y=by, mask=bmask), reg.of_client(client),
          global_trainable, context, None, self._frozen, probes, affine_by_updater=True)
      count = tf.cast(trains, tf.float32)
      step_sums = (loss_sum * count, tf.cast(n * count, tf.int64), correct * count,
                   tf.cast(trains, tf.int64))
      factors = tuple((inputs[i], d) for i, d in zip(sorted(probes), deltas))
      return (gradients, step_sums, factors, differentiated if self._step_observers else (),
              moments)

    return client_step

  def _train_fn(self, global_trainable, start, client_terms, statistics, examples, labels, index,
                mask, valid, num_clients=None, factored=frozenset()):
    """Local training of every participant (`build_local_training` with a client axis).

    From `global_trainable` or each client's `start` `[K, ...]` (personalised methods), with the
    shared `regularizer` or, given `client_terms` `[K, ...]`, `client_regularizer(its terms)`
    (KAPC: towards its s_i). BatchNorm `statistics` are the global model's or, with `start`,
    each client's `[K, ...]`; the trained ones are `out['non_trainable']`.
    """
    reg = self._regularization(client_terms)
    plan = None
    if factored:
      self.factored_traces.add(tuple(sorted(factored)))
      plan = factored_dense.FactoredKernels(
          tuple(sorted(factored)), *self._optimizer.hyperparameters,
          with_anchor=reg.probe is not None and start is not None)
    # Reads of the updater's `[None, ...]` variables get the traced client count (`with_clients`).
    clients = functools.partial(with_clients, num_clients=num_clients)
    k = tf.shape(valid)[2] if num_clients is None else num_clients
    # Each client's start `[K, ...]`: the global model's or its own; BatchNorm statistics likewise.
    statistics = () if self._update_statistics is None else tuple(statistics)
    if start is None:
      global_trainable = tuple(global_trainable)
      weights = tuple(broadcast_clients(g, k) for g in global_trainable)
      statistics = tuple(broadcast_clients(v, k) for v in statistics)
    else:
      weights, statistics = tuple(start), clients(statistics)
    updater = self._updater
    read_weights = lambda carry: clients(updater.weights(carry))
    terms = () if client_terms is None else client_terms
    # A factored kernel's W_0 and A (`factored_dense`): one client's in the map, stacked outside.
    base_of = ((lambda i, w: global_trainable[i]) if start is None else (lambda i, w: w[i]))
    anchor_of = lambda n, i, anchors: ((anchors[n] if reg.client_anchor else global_trainable[i])
                                       if plan.with_anchor else None)

    def epoch_context(args):
      """One client's `(context, affine)`: the epoch context and, if affine, `(scales, offsets)`,
      `(scales,)` for the global anchor, `(scales, anchors)` for own ones."""
      local, client = args
      regularizer = reg.of_client(client)
      if regularizer is None:
        return (), ()
      context = regularizer.epoch_start(tuple(local), global_trainable)
      if not reg.traits.affine:
        return context, ()
      affine = regularizer.affine_gradient(global_trainable, context)
      if reg.global_anchor:
        affine = affine[:1]
      elif reg.client_anchor:
        affine = (affine[0], tuple(regularizer.offset_anchor(global_trainable)))
      # `None` scales (SCAFFOLD's correction) cannot cross vectorized_map: a scalar zero.
      return context, tuple(tuple(tf.zeros([], w.dtype) if a is None else a
                                  for a, w in zip(part, local)) for part in affine)

    client_step = self._client_step_fn(reg, global_trainable, plan, base_of, anchor_of)
    # The first epoch's context, shared by all clients here (module docstring): computed once.
    first_context = None
    if start is None and client_terms is None:
      first_context = tf.nest.map_structure(
          lambda t: broadcast_clients(t, k), epoch_context((global_trainable, ())))
    # The factored kernels' zero history and, with per-client anchors, each client's (KAPC's
    # s_i), fixed for the round.
    factored_state, plan_anchors, skip = (), (), frozenset()
    if plan is not None:
      factored_state = plan.initial_state(weights, k, tf.shape(valid)[0] * tf.shape(valid)[1],
                                          tf.shape(index)[3])
      if plan.with_anchor and reg.client_anchor:
        offset_anchors = tf.vectorized_map(
            lambda client: tuple(reg.of_client(client).offset_anchor(global_trainable)), terms)
        plan_anchors = tuple(offset_anchors[i] for i in plan.indices)
      skip = frozenset(plan.indices)
    num_epochs, num_steps = tf.shape(valid)[0], tf.shape(valid)[1]

    def epoch(e, carry, sums, observed, factored_state, statistics):
      local = read_weights(carry)
      per_client = lambda: tf.vectorized_map(epoch_context, (local, terms))
      context, affine = (per_client() if first_context is None
                         else tf.cond(tf.equal(e, 0), lambda: first_context, per_client))
      anchored = None  # With a global anchor: whether any client's scale is non-zero.
      if reg.client_anchor:
        affine = (affine[0], tuple(Anchor(a) for a in affine[1]))
      if reg.global_anchor:
        affine = (affine[0], tuple(Anchor(g) for g in global_trainable))
        # All scales zero (FedLap's first epoch; FedProx's μ = 0): the plain update.
        anchored = tf.reduce_any([tf.reduce_any(tf.not_equal(scale, 0.0)) for scale in affine[0]])

      def step(s, carry, sums, observed, factored_state, statistics):
        trains = valid[e, s]
        t = e * num_steps + s  # The step's place in the round's history.
        # The batch's static shape pinned (EnsureShape): after TFF's static Grappler, TF 2.14
        # infers no rank for it, and oneDNN's layout pass aborts on a Conv2D input without one.
        x = tf.gather(examples, index[e, s])
        gradients, step_sums, factors, differentiated, moments = tf.vectorized_map(
            client_step, (read_weights(carry), tf.ensure_shape(x, x.shape),
                          tf.gather(labels, index[e, s]), mask[e, s], trains, context, terms,
                          plan.client_rows(factored_state, t) if plan else (), plan_anchors))
        if anchored is not None:
          carry = tf.cond(anchored,
                          lambda: updater.step(carry, gradients, trains, affine, skip),
                          lambda: updater.step(carry, gradients, trains, None, skip))
        else:
          carry = updater.step(carry, gradients, trains, affine if reg.traits.affine else None,
                               skip)
        if plan is not None:
          # The regulariser's scale per client (zeros without one; `s ⊙ (w − a)`'s s).
          scales = tuple(affine[0][i] if reg.traits.affine else tf.zeros([k], weights[i].dtype)
                         for i in plan.indices)
          factored_state = plan.advance(factored_state, t, factors, scales, trains)
        sums = tuple(a + b for a, b in zip(sums, step_sums))
        observed = tuple(o.observe(state, differentiated)
                         for o, state in zip(self._step_observers, observed))
        if statistics:
          statistics = self._update_statistics(statistics, moments, trains)
        return s + 1, carry, sums, observed, factored_state, statistics

      return (e + 1, *tf.while_loop(
          lambda s, *_: s < num_steps, step,
          (tf.constant(0), carry, sums, observed, factored_state, statistics))[1:])

    # Per client: Σ batch-loss·n, examples, correct predictions, batches.
    sums = tuple(tf.zeros([k], dtype) for dtype in (tf.float32, tf.int64, tf.float32, tf.int64))
    observed = tuple(o.initial(weights) for o in self._step_observers)
    _, carry, sums, observed, factored_state, statistics = tf.while_loop(
        lambda e, *_: e < num_epochs, epoch,
        (tf.constant(0), updater.start(weights), sums, observed, factored_state, statistics))
    weights = clients(updater.finish(carry))
    if plan is not None:
      # Factored kernels formed once (the updater left them at the round's start).
      formed = dict(zip(plan.indices, plan.kernels(
          factored_state, [base_of(i, weights) for i in plan.indices],
          [anchor_of(n, i, plan_anchors) for n, i in enumerate(plan.indices)])))
      weights = clients(tuple(formed.get(i, w) for i, w in enumerate(weights)))
    out = collections.OrderedDict(trained=weights, sums=sums, steps=sums[3])
    if statistics:
      out['non_trainable'] = clients(statistics)
    for observer, state in zip(self._step_observers, observed):
      out[observer.name] = observer.result(state, out['steps'])
    if start is None:
      # Computed here, the update reaches the aggregator as a TF tensor (no NumPy round trip).
      out['update'] = tuple(g[tf.newaxis] - w for g, w in zip(global_trainable, weights))
    for statistic in self._client_statistics:
      if statistic.in_trace is not None:
        out[statistic.name] = statistic.in_trace(self, weights, (examples, index, mask, k))
    if reg.probe is not None and client_terms is None and reg.traits.measures:
      out['regularizer'] = tf.vectorized_map(
          lambda local: self._regularizer.measurements(tuple(local), global_trainable), weights)
    return out

  def factored_kernels(self, data) -> frozenset:
    """Trainable indices of the Dense kernels worth factoring (`factored_dense.worth_factoring`)
    in `data`'s round (`stack_client_batches`; epochs × steps × batch rows)."""
    epochs, steps, _, batch = np.shape(data['index'])
    rows = epochs * steps * batch
    return frozenset(i for i, (fan_in, fan_out) in self._dense_kernels.items()
                     if rows and factored_dense.worth_factoring(fan_in, fan_out, rows))

  # -- the round ----------------------------------------------------------------------------
  def traced_client_count(self, k: int) -> Optional[int]:
    """`k` for a fixed client axis (`with_clients`), for `MAX_STATIC_CLIENT_COUNTS` distinct
    counts; None (a dynamic axis) beyond."""
    if k in self._static_client_counts or len(
        self._static_client_counts) < MAX_STATIC_CLIENT_COUNTS:
      self._static_client_counts.add(k)
      return k
    return None

  def train(self, client_inputs: Sequence[Any], global_trainable=None, start=None,
            client_terms=None, statistics=None, read_before_elsewhere: bool = False
            ) -> tuple[collections.OrderedDict, collections.OrderedDict]:
    """`(out, data)`: `_train_fn`'s outputs (`trained`, metric `sums`, from a global model
    `update`, ...) and the round data (`stack_client_batches`); `ValueError` for a BatchNorm
    model without `statistics`. `read_before_elsewhere`: the datasets were read already this
    round (FedLap personalisation's local models): each is rebuilt first, as TFF deserialises
    it afresh for every computation."""
    # Keras builds a model in a graph (TFF's tracing, by any computation) by swapping its layer
    # classes' bases to TF1's, so earlier eager models refuse calls ("invalid state", e.g. when
    # `_train` retraces) until a model is built eagerly, which swaps them back.
    if any(cls.__bases__ != bases for cls, bases in self._layer_bases):
      self._keras_fn()
    on_workers = worker_groups(self)  # Where the runtime placed this work (`WorkerRuntime`).
    read_before = self._read_before
    if read_before_elsewhere:
      read_before = weakref.WeakSet(data['batches'] for data in client_inputs)
    data = stack_client_batches(client_inputs, read_before, raw=on_workers is not None)
    self._updater.prepare([tf.TensorSpec(w.shape, w.dtype)
                           for w in self._keras_model.trainable_weights], self._device)
    if self._update_statistics is None:
      statistics = None
    elif statistics is None:
      raise ValueError('a BatchNorm model trains from moving statistics: pass statistics=.')
    else:
      statistics = tuple(statistics)
    if on_workers is not None:
      return on_workers.train(data, global_trainable, start, client_terms, statistics), data
    overhead = step_overhead(self._macs_per_example, np.shape(data['index'])[3])
    groups = (client_groups(data['mask'], overhead) if self.group_clients
              else [np.arange(len(client_inputs))])
    if len(groups) == 1:
      return self._train_group(data, global_trainable, start, client_terms, statistics), data
    pick = lambda structure, clients: (None if structure is None else tf.nest.map_structure(
        lambda t: tf.gather(t, clients), structure))
    parts = [self._train_group(group_data(data, clients), global_trainable, pick(start, clients),
                               pick(client_terms, clients),
                               statistics if start is None else pick(statistics, clients))
             for clients in groups]
    return in_client_order(parts, groups), data

  def round_factoring(self, data, client_terms) -> frozenset:
    """The Dense kernels `data`'s round trains factored (`factored_kernels`), given its
    regulariser."""
    factored = self.factored_kernels(data)
    if factored:
      reg = self._regularization(client_terms)
      # Factoring needs no regulariser or an anchored one with `per_tensor_scales` (FedProx,
      # KAPC); for any other, reuse the unfactored trace rather than trace again.
      if reg.probe is not None and not ((reg.global_anchor or reg.client_anchor)
                                        and reg.traits.per_tensor_scales):
        factored = frozenset()
    return factored

  def train_in_graph(self, args, num_clients: Optional[int], factored: frozenset
                     ) -> collections.OrderedDict:
    """`_train_fn(*args)` traced into the graph being built (a TFF computation's,
    `fltff.learning.groups`) with an updater of its own, whose variables that graph holds."""
    work = copy.copy(self)
    work._updater = stacked_optimizer(self._optimizer, self._frozen)
    work._updater.prepare([tf.TensorSpec(w.shape, w.dtype)
                           for w in self._keras_model.trainable_weights])
    with _quiet_looped_gradients():
      return tf.function(work._train_fn, autograph=False)(  # pylint: disable=protected-access
          *args, num_clients=num_clients, factored=factored)

  def _train_group(self, data, global_trainable, start, client_terms, statistics
                   ) -> collections.OrderedDict:
    """`_train_fn` on `data`'s participants, traced once per client count and factoring."""
    k = self.traced_client_count(len(data['epochs']))
    factored = self.round_factoring(data, client_terms)
    args = (global_trainable, start, client_terms, statistics, data['examples'], data['labels'],
            data['index'], data['mask'], data['valid'])
    with (tf.device(self._device) if self._device else contextlib.nullcontext(),
          _quiet_looped_gradients()):
      if (k, factored) not in self._traced_for:
        # One trace per client count, with example count, epochs, steps and batch size unknown
        # (traced on exact shapes, `reduce_retracing` would retrace as they change).
        self._train.get_concrete_function(*round_specs(args, k), num_clients=k,
                                          factored=factored)
        self._traced_for.add((k, factored))
      return self._train(*args, num_clients=k, factored=factored)

  def update_weights(self, examples, epochs) -> tf.Tensor:
    """Each client's update weight ν (`[K]`, float32): 1, or n_i (`examples_per_epoch`)."""
    if self._client_weighting == 'uniform':
      return tf.ones(tf.shape(examples), tf.float32)
    return tf.cast(client_work_lib.examples_per_epoch(examples, epochs), tf.float32)

  def model_outputs(self, sums) -> collections.OrderedDict:
    """The participants' unfinalized metrics (`[K]`, NumPy) from the sums."""
    return tf.nest.map_structure(np.asarray, unfinalized_metrics(sums))

  def next(self, state, global_weights, client_inputs: Sequence[Any], call=None):
    """The client work's `next`: `(state, results, measurements)`, the state unchanged, the
    measurements `train` and, with a measuring regulariser, `regularizer`."""
    results, train, regularizer_stats, _ = self.round_results(global_weights, client_inputs,
                                                              call)
    measurements = collections.OrderedDict(train=train)
    if regularizer_stats is not None:
      measurements['regularizer'] = regularizer_stats
    return state, results, measurements

  def round_results(self, global_weights, client_inputs: Sequence[Any], call=None,
                    client_terms=None):
    """The round's results (class docstring); with `client_terms` (`[K, ...]`), each client's
    regulariser is `client_regularizer(its row)`."""
    call = call or (lambda fn, *args: fn(*args))
    global_trainable = tuple(np.asarray(w) for w in global_weights.trainable)
    out, data = self.train(client_inputs, global_trainable, client_terms=client_terms,
                           statistics=tuple(np.asarray(w) for w in global_weights.non_trainable))
    k = len(client_inputs)
    update = client_work_lib.with_moving_statistics(
        tf.nest.pack_sequence_as(list(global_weights.trainable), list(out['update'])),
        list(global_weights.non_trainable), out.get('non_trainable', ()))
    if 'update_weight' in out:  # Each group's mean update (`groups`): one result a group.
      weight = out['update_weight'].numpy()
    else:
      weight = client_work_lib.with_statistics(
          self.update_weights(out['sums'][1], data['epochs']).numpy(), self._client_statistics,
          lambda s: (s.of_clients(client_inputs, out) if s.of_clients
                     else np.asarray(out[s.name])))
    results = StackedClientResults(update, weight, len(tf.nest.flatten(weight)[0]))
    self.last_trained = trained_models(out)  # For the `trained_local` evaluation protocol.
    train = call(self._aggregate_metrics,
                 clients_argument(StackedClients(self.model_outputs(out['sums']), k)))
    regularizer_stats = None
    if 'regularizer' in out:
      regularizer_stats = tf.nest.map_structure(lambda t: np.float32(np.mean(t.numpy())),
                                                out['regularizer'])
    return results, train, regularizer_stats, out


def trained_models(out):
  """The trained models in `_train_fn`'s outputs `out`, `ModelWeights` of `[K, ...]` tensors
  (BatchNorm statistics included), or None (group means)."""
  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top

  return None if 'trained' not in out else tff.learning.models.ModelWeights(
      list(out['trained']), list(out.get('non_trainable', ())))


class StackedClientResults(Sequence):
  """A round's `ClientResult`s with `[K, ...]` `update` and `update_weight`, which the in-process
  context aggregates unsplit (`StackedClients`); `results[k]` is participant k's."""

  def __init__(self, update, update_weight, num_clients: int):
    self.update, self.update_weight, self._num_clients = update, update_weight, num_clients

  def __len__(self) -> int:
    return self._num_clients

  def __getitem__(self, k):
    import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top

    if not -self._num_clients <= k < self._num_clients:
      raise IndexError(k)
    pick = lambda a: a[k].numpy() if tf.is_tensor(a) else np.asarray(a)[k]
    weight = tf.nest.map_structure(pick, self.update_weight)
    return tff.learning.templates.ClientResult(
        update=tf.nest.map_structure(pick, self.update),
        update_weight=weight if isinstance(weight, collections.OrderedDict) else np.float32(weight))

  def aggregator_arguments(self) -> tuple:
    """`(updates, weights)` as the aggregator's `next` takes them in the current context."""
    return (clients_argument(StackedClients(self.update, self._num_clients)),
            clients_argument(StackedClients(self.update_weight, self._num_clients)))
