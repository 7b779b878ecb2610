"""The personalised round shared by KAPC, FedAMP, FedBN, Local and pFedLA (one single-pass TFF
round, docs/architecture.md). Participant i gets `s_i^l = Σ_{j∈P} r_ij^l w_j^l` from a layer-wise
slice R[P, :, P] (KAPC, Algorithm 1):

1. `prepare` (server): the rule's slice, s_i from the server's copies of the participants' latest
   models and the layers not sent (the rule's `LayerSelection`);
2. `client_update`: from the own model or s_i (`start_from`), E epochs on
   `f_i(w) + λ Σ_l ||w^l − s_i^l||²` (layers sent only), then upload the first Ω_i layers;
3. one gathering aggregate; 4. `finish` (server): the rule's server update.

A method is a `RelationRule` module that may declare a `LayerSelection` (KAPC's BLS); this module
knows none. Non-trainable weights (BatchNorm statistics) stay in the personal model.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any, Optional

import numpy as np
import tensorflow as tf

from fltff.config_checks import check_choice
from fltff.config_checks import check_number
from fltff.errors import ConfigError
from fltff.learning import client_work as client_work_lib
from fltff.learning import optimizers
from fltff.learning import protocol
from fltff.learning import regularizers
from fltff.learning.model_spec import ModelSpec
from fltff.learning.model_spec import type_num_bytes

START_FROM = ('own', 'server')


def normalize_rows(relation: tf.Tensor) -> tf.Tensor:
  """Maps rows (last axis) onto the simplex by clipping at 0 and renormalising (all-zero rows:
  uniform). Not the Euclidean projection (`project_rows_to_simplex`): it keeps the ratios of
  the positive entries instead of shifting them all by one threshold."""
  clipped = tf.maximum(relation, 0.0)
  total = tf.reduce_sum(clipped, axis=-1, keepdims=True)
  uniform = tf.ones_like(clipped) / tf.cast(tf.shape(clipped)[-1], clipped.dtype)
  return tf.where(total > 0, clipped / tf.where(total > 0, total, 1.0), uniform)


def project_rows_to_simplex(relation: tf.Tensor) -> tf.Tensor:
  """The Euclidean projection of each row (last axis) onto the probability simplex:
  `max(v − θ, 0)` with the one θ that makes the row sum to 1 (sort-based, Duchi et al., ICML
  2008, Fig. 1)."""
  v = tf.convert_to_tensor(relation)
  size = tf.shape(v)[-1]
  ordered = tf.sort(v, axis=-1, direction='DESCENDING')
  excess = tf.cumsum(ordered, axis=-1) - 1.0
  ranks = tf.cast(tf.range(1, size + 1), v.dtype)
  # The entries kept positive are a prefix of the sorted row: count them.
  kept = tf.reduce_sum(tf.cast(ordered - excess / ranks > 0, tf.int32), axis=-1, keepdims=True)
  theta = tf.gather(excess, kept - 1, axis=-1, batch_dims=v.shape.rank - 1) / tf.cast(
      kept, v.dtype)
  return tf.maximum(v - theta, 0.0)


def personalized_server_models(relation: tf.Tensor, models: Sequence[tf.Tensor],
                               layer_of: Sequence[int]) -> list[tf.Tensor]:
  """`s_i^l = Σ_j r_ij^l w_j^l` (KAPC, Algorithm 1) per tensor; `relation` `[P, L, P]`."""
  return [tf.reshape(tf.matmul(relation[:, layer, :], tf.reshape(w, [tf.shape(w)[0], -1])),
                     tf.shape(w)) for w, layer in zip(models, layer_of)]


def slice_relationship(relation: tf.Tensor, clients: tf.Tensor) -> tf.Tensor:
  """`R[P, :, P]` (Algorithm 5)."""
  return tf.gather(tf.gather(relation, clients, axis=0), clients, axis=2)


def scatter_relationship(relation: tf.Tensor, clients: tf.Tensor,
                         new_slice: tf.Tensor) -> tf.Tensor:
  """Writes a normalised slice into R scaled by its old mass; others kept (rows still sum to 1)."""
  rows = tf.gather(relation, clients, axis=0)                           # [P, L, N]
  old = tf.gather(rows, clients, axis=2)                                # [P, L, P]
  mass = tf.reduce_sum(old, axis=-1, keepdims=True)
  by_column = tf.transpose(rows, [2, 0, 1])                             # [N, P, L]
  by_column = tf.tensor_scatter_nd_update(by_column, clients[:, None],
                                          tf.transpose(new_slice * mass, [2, 0, 1]))
  rows = normalize_rows(tf.transpose(by_column, [1, 2, 0]))
  return tf.tensor_scatter_nd_update(relation, clients[:, None], rows)


def select_by_layer(chosen: Sequence[tf.Tensor], a: Sequence[tf.Tensor],
                    b: Sequence[tf.Tensor]) -> list[tf.Tensor]:
  """Per tensor, `a` where `chosen` (its layer's: s_i where sent, an upload where uploaded), else
  `b`; for one client (scalar `chosen`) or along a leading client axis (`[K]`)."""
  return [tf.where(tf.reshape(c, [-1] + [1] * (x.shape.rank - 1)) if c.shape.rank else c, x, y)
          for c, x, y in zip(chosen, a, b)]


RELATIONSHIP_INITS = ('uniform', 'identity', 'random')


def initial_relationship(num_clients: int, num_layers: int, init: str,
                         seed: int = 0) -> np.ndarray:
  """R at round 0: `'uniform'` (1/N), `'identity'` or `'random'`; else `ConfigError`.

  `'random'` (KAPC §4.4, Algorithm 1 line 2): U(0, 1) draws (ours; the paper names none) from
  `np.random.default_rng(seed)`, each row r_i^l divided by its sum (as Algorithm 5 lines 6, 12)."""
  check_choice('relationship_init', init, RELATIONSHIP_INITS)
  shape = [num_clients, num_layers, num_clients]
  if init == 'uniform':
    return np.full(shape, 1.0 / num_clients, np.float32)
  if init == 'identity':
    return np.tile(np.eye(num_clients, dtype=np.float32)[:, None, :], [1, num_layers, 1])
  draw = np.random.default_rng(seed).uniform(size=shape)
  return (draw / draw.sum(-1, keepdims=True)).astype(np.float32)


class LayerSelection:
  """Which layers a round sends and uploads, a part a rule declares (`RelationRule`): this
  default (`ALL_LAYERS`) all, measuring nothing. With one that may leave layers out (`partial`:
  KAPC's BLS, `bls.BidirectionalSelection`) clients keep their own models and the client term
  covers the layers sent. `skip`, `upload`, `measurements` run in the round's TFF computations.
  """
  name: Optional[str] = None  # Its measurements' group and the method name's suffix ('+name').
  partial: bool = False

  def check(self, name: str, num_layers: int) -> None:
    """Raises `ConfigError` for settings it cannot run with (`name`: the method's)."""

  def initial_client_state(self, num_layers: int) -> collections.OrderedDict:
    """What each client keeps for it besides Ω (NumPy values: their dtypes and shapes are types)."""
    return collections.OrderedDict()

  def skip(self, self_relation: tf.Tensor) -> tf.Tensor:
    """`bool[P, L]`: the layers not sent to each participant, from r_ii^l `[P, L]`."""
    return tf.zeros_like(self_relation, tf.bool)

  def upload(self, personal, trained: list, reference: list) -> tuple:
    """`(Ω, extra uploads)` of one client: `trained` and `reference` (s_i where sent, else the
    own start model) by layer, each a list of tensors; `personal`: the client's state."""
    return tf.constant(len(trained), tf.int32), collections.OrderedDict()

  def measurements(self, omega, skip, uploads) -> collections.OrderedDict:
    """The round's measurements from Ω `[P]`, `skip` `[P, L]` and the extra uploads `[P, ...]`."""
    return collections.OrderedDict()


ALL_LAYERS = LayerSelection()


@dataclasses.dataclass(frozen=True)
class RelationRule:
  """How a personalised method obtains R and updates its server state (one module each).

  Fields (subclasses set defaults): `lambda_` (λ of the client term towards s_i; 0: none),
  `start_from` (`START_FROM`), `local_layer_kinds` (kinds of layers whose rows are the identity:
  FedBN's normalisation layers), `relationship_init` and `relationship_seed` (R at round 0),
  `layer_selection`. `name` (a class attribute) names the method and its measurements. The
  methods run in the round's TFF computations; `context` is the round (`PersonalizedRound`).
  """
  name = 'personalized'
  lambda_: float = 0.0
  start_from: str = 'own'
  local_layer_kinds: tuple = ()
  relationship_init: str = 'uniform'
  relationship_seed: int = 0
  layer_selection: LayerSelection = ALL_LAYERS

  def check(self, name: str) -> None:
    """Raises `ConfigError` for settings the rule cannot run with."""

  def initial_state(self, context: PersonalizedRound) -> collections.OrderedDict:
    """The server state at round 0 (TF ops; `relation` is R ∈ ℝ^{N×L×N})."""
    return collections.OrderedDict(relation=tf.constant(initial_relationship(
        context.num_clients, context.num_layers, self.relationship_init,
        self.relationship_seed)))

  def relation(self, state, server_input, context: PersonalizedRound):
    """Returns (the `[P, L, P]` slice for s_i and r_ii, extra broadcast entries)."""
    return normalize_rows(slice_relationship(state['relation'], server_input['clients'])), {}

  def server_update(self, state, server_input, server_msg, trained, uploaded,
                    context: PersonalizedRound) -> collections.OrderedDict:
    """The new server state from the participants' `trained` models `[P, ...]` per tensor
    (in the order of `server_input['clients']`) and `uploaded` (`bool[P, L]`)."""
    del server_input, server_msg, trained, uploaded, context
    return collections.OrderedDict(relation=state['relation'])


@dataclasses.dataclass(frozen=True)
class PersonalizedAlgorithm(protocol.FederatedAlgorithm):
  """A built personalised method (`protocol.FederatedAlgorithm`), complete and immutable.

  `process.next(state, server_input, client_data)`, `server_input = OrderedDict(clients=int32[P],
  models=<[P, ...] server copies>, num_examples=float32[P])`, returns in `clients` order the new
  models (`personal`), `omega`, `uploaded` (`bool[P, L]`), the selection's client state and the
  bytes down/up. Client state: `OrderedDict(model=OrderedDict(trainable, non_trainable),
  server_copy, omega)` and the selection's entries. A partial layer selection also measures
  `stale_server_layers` (server copies' layers never uploaded: still the initial weights) and
  `stale_server_layer_fraction` (over P·L).
  """
  name: str
  process: object
  model_spec: ModelSpec
  parts: PersonalizedRound  # The round's parts: rule, layers, sizes, layer selection.
  num_clients: Optional[int] = None  # N: sizes R and the client state; indices must be < N.
  # `(prepare_round, end_round)` around the client work; a builder of `VectorizedPersonalWork`.
  split_round: Optional[tuple] = None
  vectorized_fn: Optional[Callable[..., Any]] = None
  _vectorized: Any = dataclasses.field(default=None, repr=False, compare=False)
  # The initial model's NumPy `ModelWeights` (new clients' models, stale layers' reference).
  initial_weights: Any = dataclasses.field(default=None, repr=False, compare=False)
  personalized = True
  personal_models = True
  has_client_state = True  # Overrides the protocol's property.

  def initialize(self, call: protocol.Call = protocol.direct_call):
    return call(self.process.initialize)

  def initial_client_state(self, client_index: int) -> collections.OrderedDict:
    del client_index
    return self.parts.initial_client_state(self.initial_weights)

  @property
  def bytes_down_per_client(self) -> int:
    """All but the local layers, each way (`bytes_up_per_client` too); a layer selection may send
    fewer: the round's `bytes_up` and `bytes_down` count what it sends."""
    return sum(size for size, keep in zip(self.parts.layer_sizes_bytes, self.parts.local_layers)
               if not keep)

  bytes_up_per_client = bytes_down_per_client

  def next(self, state, server_input, client_inputs: Sequence,
           call: protocol.Call = protocol.direct_call) -> protocol.RoundOutput:
    """`process.next` (vectorised: `prepare_round`, `VectorizedPersonalWork`, `end_round`, the
    same result); new client states rebuilt from the result and `server_input`'s copies."""
    # An input trains from its client's row of the server input (TFF's runtime: the first row
    # for a client not listed; vectorised: by position); the result is read by those rows.
    order = [client_work_lib.client_info_of_input(data)['client_index'] for data in client_inputs]
    listed = None if server_input is None else np.asarray(server_input['clients']).tolist()
    if order != listed:
      raise ConfigError(f'{self.name}: client inputs of clients {order} for a server input of '
                        f'clients {listed}: give algorithm.server_input(clients, client_states, '
                        'num_examples) and one input per client listed, in its order.')
    if self.vectorized:
      from fltff.runtime import in_process as runtime  # pylint: disable=g-import-not-at-top

      prepare_round, end_round = self.split_round
      # The `[P, ...]` copies and s_i stay tensors between computations: no NumPy round trips.
      with runtime.tensor_results() as in_process:
        if in_process:
          server_input = tf.nest.map_structure(runtime.stacked_tensor, server_input)
        server_msg = call(prepare_round, state, server_input)
      outputs = self._vectorized(server_msg, client_inputs)  # (value, weight, model_outputs)
      output = call(end_round, state, server_input, server_msg,
                    *(runtime.clients_argument(runtime.StackedClients(v, len(client_inputs)))
                      for v in outputs))
    else:
      output = call(self.process.next, state, server_input, client_inputs)
    result = output.result
    start = time.perf_counter()
    client_states = self.next_client_states(result, server_input)
    order = list(client_states)
    server_seconds = time.perf_counter() - start
    measurements = dict(output.measurements)
    train = measurements.pop('train')
    selection = self.parts.selection
    if selection.partial:  # Server copies still at the initial weights (class docstring).
      stale = self.stale_server_layers(client_states)
      measurements[selection.name] = collections.OrderedDict(
          measurements[selection.name], stale_server_layers=stale,
          stale_server_layer_fraction=stale / max(
              1, len(client_states) * self.parts.num_layers))
    return protocol.RoundOutput(
        state=output.state, client_states=client_states, train=train,
        measurements=measurements, clients=order,
        bytes_down=np.asarray(result['bytes_down'], np.float64),
        bytes_up=np.asarray(result['bytes_up'], np.float64),
        arrays={'clients': np.asarray(order)},
        server_seconds=server_seconds)

  def personal_weights(self, state, client_state):
    del state
    return client_state['model']

  def round_files(self, state) -> dict:
    """R for the report's heat map (KAPC paper, Fig. 7); none for a rule keeping no R (FedAMP)."""
    relation = np.asarray(state['relation'])
    return {'relationship.npy': relation} if relation.size else {}

  def summary_extras(self, num_clients: int) -> dict:
    """Server memory: its state (R; pFedLA's hypernetworks) plus one model copy per client."""
    server_state = type_num_bytes(self.process.initialize.type_signature.result.member)
    return {'server_memory_mb': (server_state + num_clients * self.bytes_up_per_client) / 1e6}

  def stale_server_layers(self, client_states: dict) -> int:
    """How many layers of `client_states`' server copies equal the initial model's bit for bit
    (a tensor's first element decides at once for nearly every trained one)."""
    initial = self.initial_weights[0]
    unchanged = lambda copy, t: (np.array_equal(copy.flat[:1], initial[t].flat[:1])
                                 and np.array_equal(copy, initial[t]))
    return sum(all(unchanged(np.asarray(state['server_copy'][t]), t) for t in layer)
               for state in client_states.values() for layer in self.parts.layers)

  def client_input(self, batches, client_index: int, epochs: int, client_state):
    """`client_work.client_input` with the client's `PersonalizedRound.personal` state."""
    # Vectorised client work reads the info in Python: no dataset for it.
    return client_work_lib.client_input(batches, client_index, epochs,
                                        client_state=self.parts.personal(client_state),
                                        state_in_dataset=False,
                                        info_in_dataset=not self.vectorized,
                                        input_spec=self.model_spec.input_spec)

  def server_input(self, clients: Sequence[int], client_states: Sequence,
                   num_examples: Sequence[float]) -> collections.OrderedDict:
    """Server input for `clients` (states in that order); an index outside [0, N): `ConfigError`."""
    from fltff.runtime.in_process import aligned_stack  # pylint: disable=g-import-not-at-top

    self.check_client_indices(clients)
    copies = [s['server_copy'] for s in client_states]
    # Aligned: vectorised clients take the stacks into TensorFlow without a copy.
    return collections.OrderedDict(
        clients=np.asarray(clients, np.int32),
        models=tuple(aligned_stack([c[t] for c in copies]) for t in range(len(copies[0]))),
        num_examples=np.asarray(num_examples, np.float32))

  def next_client_states(self, result, server_input) -> dict:
    """`{client: new state}` from a round's `result`; a layer not uploaded keeps the server's
    copy in `server_input` (copied: a view would pin the whole stack)."""
    personal = result['personal']
    uploaded, omega = np.asarray(result['uploaded']), np.asarray(result['omega'])
    out = {}
    for p, k in enumerate(np.asarray(result['clients']).tolist()):
      trainable = [np.asarray(w[p]) for w in personal['trainable']]
      out[k] = collections.OrderedDict(
          model=collections.OrderedDict(
              trainable=trainable,
              non_trainable=[np.asarray(w[p]) for w in personal.get('non_trainable', ())]),
          server_copy=[w if uploaded[p, l] else np.array(server_input['models'][t][p])
                       for t, (w, l) in enumerate(zip(trainable, self.parts.layer_of))],
          omega=np.int32(omega[p]),
          **{key: np.asarray(result[key][p], initial.dtype)
             for key, initial in self.parts.selection_state.items()})
    return out


@dataclasses.dataclass(frozen=True, eq=False)
class PersonalizedRound:
  """The round's parts (module docstring), run by the TFF process and by vectorised clients.

  Attributes:
    layers: Each layer's trainable tensor indices (`ModelSpec.trainable_layers`).
    local_layers: Per layer, whether it stays local (the rule's `local_layer_kinds`).
  """

  rule: RelationRule
  layers: tuple
  layer_of: tuple  # The layer of each trainable tensor.
  num_clients: int  # N.
  local_layers: tuple
  layer_sizes_bytes: tuple

  @property
  def num_layers(self) -> int:
    return len(self.layers)

  @property
  def selection(self) -> LayerSelection:
    return self.rule.layer_selection

  @property
  def communicates(self) -> bool:
    """Whether anything is exchanged: clients use s_i (λ > 0) or start from it."""
    return self.rule.lambda_ > 0 or self.rule.start_from == 'server'

  @property
  def model_from_client(self) -> bool:
    """Whether own trainable weights come from the client state, not `server_input`'s copy.

    Needed where the copy may differ (a partial layer selection; no communication); else using it
    ships a model less."""
    return self.selection.partial or not self.communicates

  @property
  def selection_state(self) -> collections.OrderedDict:
    """The layer selection's initial entries of a client state."""
    return self.selection.initial_client_state(self.num_layers)

  def initial_client_state(self, weights) -> collections.OrderedDict:
    """A new client's state from the initial model's NumPy `ModelWeights`: that model as its own
    and the server's copy, Ω = L and the layer selection's initial entries."""
    return collections.OrderedDict(
        model=collections.OrderedDict(trainable=[w.copy() for w in weights.trainable],
                                      non_trainable=[w.copy() for w in weights.non_trainable]),
        server_copy=[w.copy() for w in weights.trainable],
        omega=np.int32(self.num_layers), **self.selection_state)

  def personal(self, client_state) -> collections.OrderedDict:
    """What a client's input carries of its state: its own trainable weights where they are
    needed (`model_from_client`), BatchNorm statistics, last Ω and the selection's entries."""
    personal = collections.OrderedDict()
    if self.model_from_client:
      personal['trainable'] = tuple(client_state['model']['trainable'])
    if len(client_state['model']['non_trainable']):
      personal['non_trainable'] = tuple(client_state['model']['non_trainable'])
    personal['omega'] = np.int32(client_state['omega'])
    for key, initial in self.selection_state.items():
      personal[key] = np.asarray(client_state[key], initial.dtype)
    return personal

  def prepare(self, state, server_input):
    """The broadcast: per participant s_i, skip row (`LayerSelection.skip`), r_ii; the rule's
    extras."""
    rel, extra = self.rule.relation(state, server_input, self)
    if any(self.local_layers):
      eye = tf.eye(tf.shape(server_input['clients'])[0])[:, None, :]
      rel = tf.where(tf.constant(self.local_layers)[None, :, None], eye, rel)
    s = personalized_server_models(rel, list(server_input['models']), self.layer_of)
    self_rel = tf.transpose(tf.linalg.diag_part(tf.transpose(rel, [1, 0, 2])))  # r_ii^l, [P, L]
    message = collections.OrderedDict(clients=server_input['clients'], models=tuple(s),
                                      skip=self.selection.skip(self_rel), self_relation=self_rel)
    if not self.model_from_client and self.rule.start_from == 'own':
      message['own'] = tuple(server_input['models'])
    message.update(extra)
    return message

  def client_row(self, server_msg, k):
    """Client k's broadcast entries: s_i per tensor, skip row and, when sent, `own` weights."""
    pos = tf.argmax(tf.cast(tf.equal(server_msg['clients'], k), tf.int32), output_type=tf.int32)
    return {key: tf.nest.map_structure(lambda m: m[pos], server_msg[key])
            for key in ('models', 'skip', 'own') if key in server_msg}

  def client_start(self, row, personal):
    """`(start weights, s_i, per tensor whether its layer was sent, own model)` from a row, or
    from rows and states along a leading client axis."""
    s = list(row['models'])
    sent = [tf.logical_not(row['skip'][..., l]) for l in self.layer_of]
    if self.model_from_client:
      own = list(personal['trainable'])
    elif self.rule.start_from == 'own':
      own = list(row['own'])
    else:
      own = s  # Every layer is sent (no partial selection) and the client starts from s_i.
    start = select_by_layer(sent, s, own) if self.rule.start_from == 'server' else own
    return start, s, sent, own

  def client_regularizer(self, s, sent):
    """λ Σ_l ||w^l − s^l||²: proximal term, μ = 2λ, towards s_i (the layers sent); None if λ = 0."""
    if self.rule.lambda_ <= 0:
      return None
    mask = [tf.cast(c, w.dtype) for c, w in zip(sent, s)] if self.selection.partial else None
    return regularizers.ProximalRegularizer(2.0 * self.rule.lambda_, anchor=s, tensor_mask=mask)

  def client_result(self, personal, k, s, sent, own, trained, examples_per_epoch):
    """What client k uploads after training: its model and `(index, Ω, n_i, the selection's)`."""
    n_i = tf.cast(tf.maximum(examples_per_epoch, 1), tf.float32)
    reference = select_by_layer(sent, s, own)
    omega, extra = self.selection.upload(personal, [[trained[t] for t in g] for g in self.layers],
                                         [[reference[t] for t in g] for g in self.layers])
    weight = collections.OrderedDict(client_index=k, omega=omega, num_examples=n_i, **extra)
    return collections.OrderedDict(trainable=tuple(trained)), weight

  def finish(self, state, server_input, server_msg, gathered, value_template):
    """`(new state, result, measurements)`; `value_template`: one upload's structure."""
    clients = server_input['clients']
    ids = gathered['weight']['client_index']
    # Results arrive in any order (several workers): matched to clients by index.
    rows = tf.argmax(tf.cast(tf.equal(clients[:, None], ids[None, :]), tf.int32), axis=1,
                     output_type=tf.int32)
    # Already in order (one worker, vectorised clients): used as they are, not copied by a gather.
    in_order = tf.reduce_all(tf.equal(rows, tf.range(tf.size(rows))))
    values = [tf.cond(in_order, lambda v=v: tf.identity(v), lambda v=v: tf.gather(v, rows))
              for v in gathered['update']]
    weight = collections.OrderedDict((key, tf.gather(value, rows))
                                     for key, value in gathered['weight'].items())
    omega = weight.pop('omega')
    uploaded = tf.range(self.num_layers)[None, :] < omega[:, None]  # [P, L]
    sent = tf.logical_not(server_msg['skip'])
    if not self.communicates:
      uploaded, sent = tf.zeros_like(uploaded), tf.zeros_like(sent)
    update = tf.nest.pack_sequence_as(value_template, values)
    trained = list(update['trainable'])
    new_state = self.rule.server_update(state, server_input, server_msg, trained,
                                        uploaded, self)
    # A local layer's s_i is the client's own layer: neither sent nor uploaded.
    sizes = tf.constant(np.where(self.local_layers, 0, self.layer_sizes_bytes), tf.float64)
    bytes_down = tf.reduce_sum(tf.cast(sent, tf.float64) * sizes, axis=1)
    bytes_up = tf.reduce_sum(tf.cast(uploaded, tf.float64) * sizes, axis=1)
    personal = collections.OrderedDict((key, tuple(update[key]))
                                       for key in ('trainable', 'non_trainable') if key in update)
    result = collections.OrderedDict(
        clients=clients, personal=personal, omega=omega, uploaded=uploaded,
        **{key: weight[key] for key in self.selection_state}, bytes_down=bytes_down,
        bytes_up=bytes_up)
    self_relation = server_msg['self_relation']
    stats = collections.OrderedDict(self_relation_mean=tf.reduce_mean(self_relation),
                                    self_relation_max=tf.reduce_max(self_relation))
    # r_ii^l: per-layer means (CSV columns), all `[P, L]` in `clients` order (measurements.jsonl).
    for l in range(self.num_layers):
      stats[f'self_relation_layer_{l}'] = tf.reduce_mean(self_relation[:, l])
    stats['self_relation'] = self_relation
    measurements = collections.OrderedDict([(self.rule.name, stats)])
    if self.selection.name:
      measurements[self.selection.name] = self.selection.measurements(omega, server_msg['skip'],
                                                                      weight)
    return new_state, result, measurements


def build_personalized_process(model_spec: ModelSpec, num_clients: int, client_optimizer,
                               rule: RelationRule) -> PersonalizedAlgorithm:
  """Builds a personalised method from its `rule`: `PersonalizedRound` as TFF computations.

  The method is named `rule.name`, with `+<name>` of a named layer selection (e.g. 'kapc+bls').

  Args:
    num_clients: N.
    client_optimizer: Local training's optimizer (None: `optimizers.default_client_optimizer`).
  """
  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top
  from fltff.aggregators.gather import build_gather  # pylint: disable=g-import-not-at-top
  from fltff.models.layers import layer_groups  # pylint: disable=g-import-not-at-top

  client_optimizer = optimizers.default_client_optimizer(client_optimizer)
  selection = rule.layer_selection
  name = rule.name + (f'+{selection.name}' if selection.name else '')
  check_number(f'{name}.num_clients', num_clients, integer=True, low=1)
  check_number(f'{name}.lambda_', rule.lambda_, low=0)
  check_choice(f'{name}.start_from', rule.start_from, START_FROM)
  check_choice(f'{name}.relationship_init', rule.relationship_init, RELATIONSHIP_INITS)
  rule.check(name)

  weights = model_spec.initial_weights()
  with tf.Graph().as_default():
    groups = [g for g in layer_groups(model_spec.keras_fn()) if g.trainable_indices]
  metrics_aggregation_fn = client_work_lib.metrics_aggregation(model_spec)
  layers = tuple(tuple(g.trainable_indices) for g in groups)
  selection.check(name, len(layers))
  layer_of = tuple(l for _, l in sorted((t, l) for l, group in enumerate(layers) for t in group))
  parts = PersonalizedRound(
      rule=rule, layers=layers, layer_of=layer_of, num_clients=num_clients,
      local_layers=tuple(g.kind in rule.local_layer_kinds for g in groups),
      layer_sizes_bytes=tuple(sum(weights.trainable[t].nbytes for t in group)
                              for group in layers))
  personal_type = tff.types.to_type(tf.nest.map_structure(
      lambda a: (a.dtype, a.shape), parts.personal(parts.initial_client_state(weights))))
  _, data_type = client_work_lib.client_types(model_spec, state_type=personal_type,
                                              state_in_dataset=False)
  stacked = tff.types.to_type(tuple((w.dtype, [None, *w.shape]) for w in weights.trainable))
  server_input_type = tff.StructWithPythonType(
      [('clients', tff.TensorType(np.int32, [None])), ('models', stacked),
       ('num_examples', tff.TensorType(np.float32, [None]))], collections.OrderedDict)

  initial_state = tff.tensorflow.computation(lambda: rule.initial_state(parts))
  state_type = initial_state.type_signature.result
  prepare = tff.tensorflow.computation(parts.prepare, state_type, server_input_type)
  broadcast_type = prepare.type_signature.result

  @tff.tensorflow.computation(broadcast_type, data_type)
  def client_update(server_msg, data):
    personal = data['state']
    k = client_work_lib.client_index_of(data)
    start, s, sent, own = parts.client_start(parts.client_row(server_msg, k), personal)
    initial = tff.learning.models.ModelWeights(
        trainable=list(start), non_trainable=list(personal.get('non_trainable', ())))
    out = client_work_lib.build_local_training(model_spec.keras_fn(), client_optimizer,
                                               parts.client_regularizer(s, sent))(
        initial, data['batches'], data['info'])
    value, weight = parts.client_result(personal, k, s, sent, own, list(out['trained']),
                                        out['examples_per_epoch'])
    if weights.non_trainable:
      value['non_trainable'] = tuple(out['non_trainable'])
    return value, weight, out['metrics']

  value_type, weight_type, _ = client_update.type_signature.result
  gather, gathered_type = build_gather(value_type, weight_type)
  # `tf.nest` flattens dicts by key ('non_trainable' first): repack the update, don't slice it.
  value_template = tff.types.type_to_tf_tensor_specs(value_type)

  @tff.tensorflow.computation(state_type, server_input_type, broadcast_type, gathered_type)
  def finish(state, server_input, server_msg, gathered):
    return parts.finish(state, server_input, server_msg, gathered, value_template)

  @tff.federated_computation
  def init_fn():
    return tff.federated_eval(initial_state, tff.SERVER)

  def round_end(state, server_input, server_msg, value, weight, model_outputs):
    """Steps 3–4: the gathering aggregate, the server update and the measurements."""
    gathered = gather(value, weight)
    new_state, result, stats = tff.federated_map(
        finish, (state, server_input, server_msg, gathered))
    measurements = tff.federated_zip(collections.OrderedDict(
        train=metrics_aggregation_fn(model_outputs),
        **{group: stats[group] for group in (rule.name, selection.name) if group}))
    return tff.templates.MeasuredProcessOutput(new_state, result, measurements)

  server_types = (tff.FederatedType(state_type, tff.SERVER),
                  tff.FederatedType(server_input_type, tff.SERVER))

  @tff.federated_computation(*server_types, tff.FederatedType(data_type, tff.CLIENTS))
  def next_fn(state, server_input, client_data):
    server_msg = tff.federated_map(prepare, (state, server_input))
    value, weight, model_outputs = tff.federated_map(
        client_update, (tff.federated_broadcast(server_msg), client_data))
    return round_end(state, server_input, server_msg, value, weight, model_outputs)

  # The round split around `client_update`, which vectorised clients run outside TFF.
  prepare_round = tff.federated_computation(
      lambda state, server_input: tff.federated_map(prepare, (state, server_input)),
      *server_types)
  end_round = tff.federated_computation(
      round_end, *server_types, tff.FederatedType(broadcast_type, tff.SERVER),
      *(tff.FederatedType(t, tff.CLIENTS) for t in client_update.type_signature.result))

  process = tff.templates.IterativeProcess(init_fn, next_fn)
  return PersonalizedAlgorithm(
      name=name, process=process, model_spec=model_spec, parts=parts, num_clients=num_clients,
      split_round=(prepare_round, end_round), initial_weights=weights,
      vectorized_fn=lambda device, factor_dense=True: VectorizedPersonalWork(
          model_spec, client_optimizer, parts, device, factor_dense))


class VectorizedPersonalWork:
  """`client_update` for all participants in one TensorFlow step, called with `(server_msg,
  client_inputs)` in the broadcast's client order; returns its outputs stacked in that order.

  The training is `learning.vectorized.VectorizedClientWork` with per-client start weights and
  proximal terms; `PersonalizedRound.client_start` runs on the broadcast's `[P, ...]` rows as
  they are (no per-client gather), `client_result` under `tf.vectorized_map`. BatchNorm models:
  each client's moving statistics (its state's `non_trainable`) train with it, as in TFF.
  """

  def __init__(self, model_spec: ModelSpec, optimizer, parts: PersonalizedRound,
               device: Optional[str] = None, factor_dense: bool = True):
    from fltff.learning.vectorized import VectorizedClientWork  # pylint: disable=g-import-not-at-top
    from fltff.learning.vectorized import with_clients  # pylint: disable=g-import-not-at-top

    self._parts = parts
    self._regularized = parts.rule.lambda_ > 0
    self._work = VectorizedClientWork(
        model_spec, optimizer, device=device, factor_dense=factor_dense,
        client_regularizer=(lambda terms: parts.client_regularizer(*terms)) if self._regularized
        else None, batch_norm=True)
    # Without autograph, as the training: no tensor-dependent Python control flow here.
    self._results = tf.function(
        lambda *args, num_clients=None: tf.vectorized_map(
            lambda client_args: parts.client_result(*client_args), with_clients(args, num_clients)),
        reduce_retracing=True, autograph=False)

  def __call__(self, server_msg, client_inputs: Sequence[Any]):
    from fltff.learning.vectorized import stack_clients  # pylint: disable=g-import-not-at-top

    server_msg = tf.nest.map_structure(tf.convert_to_tensor, server_msg)
    personal = stack_clients([data['state'] for data in client_inputs])
    start, s, sent, own = (tuple(part)
                           for part in self._parts.client_start(server_msg, personal))
    out, data = self._work.train(client_inputs, start=start,
                                 client_terms=(s, sent) if self._regularized else None,
                                 statistics=personal.get('non_trainable'))
    examples_per_epoch = client_work_lib.examples_per_epoch(out['sums'][1], data['epochs'])
    value, weight = self._results(
        personal, server_msg['clients'], s, sent, own, tuple(out['trained']),
        examples_per_epoch, num_clients=self._work.traced_client_count(len(client_inputs)))
    if 'non_trainable' in out:
      value['non_trainable'] = tuple(out['non_trainable'])
    return value, weight, self._work.model_outputs(out['sums'])
