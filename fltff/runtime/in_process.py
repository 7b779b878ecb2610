"""An in-process TFF execution context: TFF's native compiler lowers the computation to a tree
of federated intrinsics over compiled TensorFlow graphs, each imported once as a TensorFlow
function, and a small interpreter evaluates the tree with CLIENTS values as per-participant lists
or stacked (`StackedClients`). No arithmetic is rewritten: results equal the C++ runtime's up to
floating-point scheduling (docs/architecture.md, "The in-process executor").
"""

from __future__ import annotations

import collections
import contextlib
import itertools
from typing import Any, Optional

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff
# TFF 0.87's compiler and type internals, which this context is built on.
from tensorflow_federated.python.common_libs import structure
from tensorflow_federated.python.core.backends.native import compiler
from tensorflow_federated.python.core.impl.compiler import building_blocks
from tensorflow_federated.python.core.impl.computation import computation_impl
from tensorflow_federated.python.core.impl.context_stack import context_base
from tensorflow_federated.python.core.impl.types import computation_types
from tensorflow_federated.python.core.impl.types import type_analysis
from tensorflow_federated.python.core.impl.types import type_conversions
from tensorflow_federated.python.core.impl.types import type_serialization
from tensorflow_federated.python.core.impl.utils import tensorflow_utils
from tensorflow_federated.python.tensorflow_libs import serialization_utils

from fltff.config_checks import check_device
from fltff.errors import ConfigError


class InProcessError(ConfigError):
  """A computation uses something this context cannot execute (named in the message)."""


# ---- values ------------------------------------------------------------------------------
# Internal values: eager tf.Tensor, tf.data.Dataset, Struct, `_Clients`/`StackedClients`
# (of internal values), callable.


class _Clients(list):
  """A CLIENTS-placed value: one member value per participant, in the argument's order."""


class StackedClients:
  """A CLIENTS-placed value as one structure whose arrays lead with a participant axis: it stands
  for `[value with every array a[k]] for k in range(num_clients)`, and this context alone keeps
  it stacked through zip, map and aggregate (an argument, or its own values: Structs of tensors).
  """

  def __init__(self, value, num_clients: int):
    self.value = value
    self.num_clients = int(num_clients)

  def __len__(self) -> int:
    return self.num_clients

  def members(self) -> list:
    """The per-participant list this value stands for (NumPy leaves)."""
    arrays = tf.nest.map_structure(np.asarray, self.value)
    return [tf.nest.map_structure(lambda a, k=k: a[k], arrays) for k in range(self.num_clients)]


# TensorFlow's CPU tensors must start on this boundary (Eigen's EIGEN_MAX_ALIGN_BYTES): a
# tensor made on a misaligned buffer aborts the process.
_TENSOR_ALIGNMENT = 64
_SHARE_MIN_BYTES = 1 << 20
_SHAREABLE_DTYPES = frozenset(np.dtype(d) for d in (np.float16, np.float32, np.float64, np.int8,
                                                     np.int16, np.int32, np.int64, np.uint8))


def aligned_stack(rows) -> np.ndarray:
  """`np.stack(rows)` in a buffer aligned for TensorFlow, so `stacked_tensor` need not copy."""
  rows = [np.asarray(r) for r in rows]
  dtype = np.result_type(*rows)
  shape = (len(rows), *rows[0].shape)
  nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
  raw = np.empty(nbytes + _TENSOR_ALIGNMENT, np.uint8)
  start = (-raw.ctypes.data) % _TENSOR_ALIGNMENT
  out = raw[start:start + nbytes].view(dtype).reshape(shape)
  np.stack(rows, out=out)
  return out


def stacked_tensor(array) -> tf.Tensor:
  """`tf.convert_to_tensor(array)` sharing a model-sized `aligned_stack` result's buffer
  (DLPack; the array must not be written afterwards); any other value (misaligned,
  non-contiguous, read-only, small, another dtype) is copied."""
  if (isinstance(array, np.ndarray) and array.nbytes >= _SHARE_MIN_BYTES
      and array.dtype in _SHAREABLE_DTYPES and array.flags.c_contiguous
      and array.flags.writeable and array.ctypes.data % _TENSOR_ALIGNMENT == 0):
    return tf.experimental.dlpack.from_dlpack(array.__dlpack__())
  return tf.convert_to_tensor(array)


def _current_context() -> Optional[InProcessContext]:
  """The current TFF context if it is an `InProcessContext`, else None."""
  current = tff.framework.get_context_stack().current
  return current if isinstance(current, InProcessContext) else None


def tensor_results():
  """`InProcessContext.tensor_results()` of the current context if it is one (yields True);
  else a no-op yielding False (results are NumPy, as TFF returns them)."""
  current = _current_context()
  return contextlib.nullcontext(False) if current is None else current.tensor_results()


def clients_argument(stacked: StackedClients):
  """`stacked` itself in an `InProcessContext`, its per-participant list in any other context."""
  return stacked.members() if _current_context() is None else stacked


def _members(value) -> _Clients:
  """A CLIENTS-placed internal value as one value per participant (splits a `StackedClients`)."""
  if not isinstance(value, StackedClients):
    return value
  columns = [tf.unstack(leaf, num=value.num_clients) for leaf in structure.flatten(value.value)]
  return _Clients(structure.pack_sequence_as(value.value, [column[k] for column in columns])
                  for k in range(value.num_clients))


def _flatten(value) -> list:
  """The leaves of an internal value in the order of TFF's TensorFlow bindings (a dataset as
  its variant tensor)."""
  return [leaf._variant_tensor if isinstance(leaf, tf.data.Dataset) else leaf  # pylint: disable=protected-access
          for leaf in structure.flatten(value)]


def _build(leaves, type_spec):
  """Inverse of `_flatten` for results (tensors, datasets from variants, Structs) from an
  iterator of leaves; a module function: a recursive closure is a reference cycle, holding
  each call's result tensors until Python's cycle collector runs."""
  if isinstance(type_spec, computation_types.StructType):
    return structure.Struct([(name, _build(leaves, member))
                             for name, member in structure.to_elements(type_spec)])
  if isinstance(type_spec, computation_types.SequenceType):
    spec = type_conversions.type_to_tf_tensor_specs(type_spec.element)
    return tf.data.experimental.from_variant(next(leaves), structure=spec)
  return next(leaves)


def _stack(values: list, type_spec) -> Optional[StackedClients]:
  """Client values of `type_spec` as one `StackedClients`; None for fewer than two, datasets,
  strings, unequal shapes or dtypes."""
  if len(values) < 2:
    return None
  stacked = []
  for column in zip(*(_flatten(v) for v in values)):
    column = [x if tf.is_tensor(x) else tf.convert_to_tensor(x) for x in column]
    first = column[0]
    if first.dtype in _UNSTACKABLE or any(
        c.dtype != first.dtype or c.shape != first.shape for c in column[1:]):
      return None
    stacked.append(tf.stack(column))
  return StackedClients(_build(iter(stacked), type_spec), len(values)) if stacked else None


_FRESH_NAMES = itertools.count()


def fresh_dataset(dataset: tf.data.Dataset) -> tf.data.Dataset:
  """`dataset` rebuilt from its graph, fresh as TFF's runtime deserialises it for each call:
  a reshuffling dataset passed twice (FedLap personalisation) would otherwise go on with its
  seed generator's state, unlike on the C++ runtime."""
  serialized = tf.raw_ops.DatasetToGraphV2(
      input_dataset=tf.data.experimental.to_variant(dataset)).numpy()
  graph_def = tf.compat.v1.GraphDef()
  graph_def.ParseFromString(serialized)
  # Seed generators are named by handle, which here finds the live one (its state advanced);
  # a new name makes the runtime create a fresh generator.
  renamed = False
  for node in graph_def.node:
    if node.op != 'Const' or node.attr['dtype'].type != tf.resource.as_datatype_enum:
      continue
    for handle in node.attr['value'].tensor.resource_handle_val:
      if 'SeedGenerator' in handle.maybe_type_name:
        handle.name = f'{handle.name}_fltff{next(_FRESH_NAMES)}'
        renamed = True
  if renamed:
    serialized = graph_def.SerializeToString()
  variant = tf.raw_ops.DatasetFromGraph(graph_def=serialized)
  return tf.data.experimental.from_variant(variant, structure=dataset.element_spec)


def _ingest(value, type_spec, num_clients: Optional[int]):
  """A Python argument (numpy, lists, dicts, datasets) as an internal value of `type_spec`."""
  if isinstance(type_spec, computation_types.FederatedType):
    member_type = type_spec.member
    if type_spec.placement.uri == 'clients' and not type_spec.all_equal:
      if isinstance(value, StackedClients):
        if not type_analysis.contains(
            member_type, lambda s: isinstance(s, computation_types.SequenceType)):
          return StackedClients(_ingest(value.value, member_type, None), value.num_clients)
        value = value.members()
      return _Clients(_ingest(v, member_type, None) for v in value)
    single = _ingest(value, member_type, None)
    if type_spec.placement.uri == 'clients':
      return _Clients([single] * (num_clients or 0))
    return single
  if isinstance(type_spec, computation_types.StructType):
    if not isinstance(value, structure.Struct):
      value = structure.from_container(value, recursive=False)
    members = structure.to_elements(value)
    member_types = structure.to_elements(type_spec)
    if len(members) != len(member_types):
      raise InProcessError(f'argument has {len(members)} elements, its type {type_spec} '
                           f'has {len(member_types)}.')
    return structure.Struct([(name, _ingest(v, mt, num_clients))
                             for (_, v), (name, mt) in zip(members, member_types)])
  if isinstance(type_spec, computation_types.SequenceType):
    if isinstance(value, tf.data.Dataset):
      return fresh_dataset(value)
    spec = type_conversions.type_to_tf_tensor_specs(type_spec.element)
    return tf.data.Dataset.from_generator(lambda: iter(value), output_signature=spec)
  if isinstance(type_spec, computation_types.TensorType):
    return tf.convert_to_tensor(np.asarray(value, dtype=type_spec.dtype)
                                if not tf.is_tensor(value) else value)
  raise InProcessError(f'cannot take an argument of type {type_spec}.')


def _to_python(value, keep_tensors: bool = False):
  """Internal value -> numpy/Struct/list, as TFF's contexts return results (with
  `keep_tensors`, the tensors as they are: `InProcessContext.tensor_results`)."""
  if isinstance(value, (_Clients, StackedClients)):
    return [_to_python(v, keep_tensors) for v in _members(value)]
  if isinstance(value, structure.Struct):
    return structure.Struct([(n, _to_python(v, keep_tensors))
                             for n, v in structure.to_elements(value)])
  if tf.is_tensor(value) and not keep_tensors:
    # A read-only view over the tensor's own buffer: `numpy()` copies model-sized results into
    # fresh memory, which can be slow to touch. Read-only, as TensorFlow may share the buffer.
    value = np.asarray(value)
    if value.flags.writeable:
      value = value.view()
      value.flags.writeable = False
  return value


def _num_clients_of(value, type_spec) -> Optional[int]:
  if isinstance(type_spec, computation_types.FederatedType):
    if type_spec.placement.uri == 'clients' and not type_spec.all_equal:
      return len(value)
    return None
  if isinstance(type_spec, computation_types.StructType):
    if not isinstance(value, structure.Struct):
      value = structure.from_container(value, recursive=False)
    for (_, v), (_, vt) in zip(structure.to_elements(value), structure.to_elements(type_spec)):
      n = _num_clients_of(v, vt)
      if n is not None:
        return n
  return None


# ---- TensorFlow computations ---------------------------------------------------------------


def _rename_library_functions(graph_def, suffix: str) -> None:
  """Gives the graph's function library unique names, in place: TFF's compiler rewrites
  traced functions but keeps their names, which this process holds with the original bodies."""
  rename = {f.signature.name: f'{f.signature.name}_{suffix}' for f in graph_def.library.function}

  def fix_attr(attr):  # `func` and `list` are one `oneof`: at most one is set.
    for f in [attr.func] if attr.HasField('func') else attr.list.func:
      f.name = rename.get(f.name, f.name)

  def fix_nodes(nodes):
    for node in nodes:
      node.op = rename.get(node.op, node.op)
      for attr in node.attr.values():
        fix_attr(attr)

  fix_nodes(graph_def.node)
  for function in graph_def.library.function:
    function.signature.name = rename[function.signature.name]
    fix_nodes(function.node_def)
    for attr in function.attr.values():
      fix_attr(attr)
  for gradient in graph_def.library.gradient:
    gradient.function_name = rename.get(gradient.function_name, gradient.function_name)
    gradient.gradient_func = rename.get(gradient.gradient_func, gradient.gradient_func)


_UNSTACKABLE = (tf.variant, tf.resource, tf.string)


def _as_list(out) -> list:
  return list(out) if isinstance(out, (list, tuple)) else [out]


def _call_flat(function, leaves: list):
  """Calls a pruned function on its flat tensor inputs, skipping the public path's binding to
  a structured signature (which formats every tensor)."""
  return function._call_flat(leaves, function.captured_inputs)  # pylint: disable=protected-access


class _TensorFlowFunction:
  """One `CompiledComputation` as a callable on internal values (imported once)."""

  _suffixes = itertools.count()

  def __init__(self, proto, device: Optional[str]):
    self.device = device
    self.type_signature = type_serialization.deserialize_type(proto.type)
    tensorflow = proto.tensorflow
    graph_def = serialization_utils.unpack_graph_def(tensorflow.graph_def)
    # Unique shared names: two computations must never share a variable.
    suffix = f'fltff{next(self._suffixes)}'
    graph_def = tensorflow_utils._uniquify_shared_names_with_suffix(  # pylint: disable=protected-access
        graph_def, suffix)
    _rename_library_functions(graph_def, suffix)
    extract = tensorflow_utils.extract_tensor_names_from_binding
    parameter_names = (extract(tensorflow.parameter)
                       if tensorflow.HasField('parameter') else [])
    result_names = extract(tensorflow.result)
    token_name = tensorflow.session_token_tensor_name
    init_name = tensorflow.initialize_op

    def import_graph():
      input_map = {token_name: tf.constant('fltff_in_process')} if token_name else {}
      tf.graph_util.import_graph_def(graph_def, input_map=input_map, name='')

    wrapped = tf.compat.v1.wrap_function(import_graph, [])
    graph = wrapped.graph
    feeds = [graph.get_tensor_by_name(n) for n in parameter_names]
    fetches = [graph.get_tensor_by_name(n) for n in result_names]
    self._run = wrapped.prune(feeds, fetches)
    # TFF's TensorFlow executor runs the init op (variable initialisers) before every call.
    self._init = (wrapped.prune(feeds, graph.get_operation_by_name(init_name))
                  if init_name else None)
    self._looped = {}  # The looped tf.functions by name (`_call_looped`); None: unusable.
    self._append_columns = None  # `_find_append_columns`, on first fold; False: not a gather.
    # Stateful random ops (not the `Stateless*` ones): TFF runs the graph afresh each call (the
    # op's first draw); here it is pruned anew per call, so its state never advances (it is
    # never looped or vectorised).
    self._draws_random = any(
        op.op_def is not None and op.op_def.is_stateful and ('Random' in op.type or op.type in (
            'TruncatedNormal', 'Multinomial', 'ParameterizedTruncatedNormal'))
        for op in self._run.graph.get_operations())
    self._fresh_run = (lambda: wrapped.prune(feeds, fetches)) if self._draws_random else None
    # Whether `map_stacked` may be one call: not with an init op (variables), random draws, no
    # parameter, or datasets or strings out.
    self.maps_stacked = (self._init is None and not self._draws_random
                         and self.type_signature.parameter is not None
                         and all(o.dtype not in _UNSTACKABLE for o in _as_list(self._run.outputs)))

  # -- many clients in one call ------------------------------------------------------------
  # Not K calls from Python: a map over K participants is one pfor-vectorised call (where pfor
  # fails, one tf.function calling the graph per participant in order); a fold is that loop.

  def map_stacked(self, stacked_arg):
    """`self` on each participant's slice of `stacked_arg` (leaves with a leading participant
    axis) in one call, the result stacked alike, where `maps_stacked`; None when it cannot."""
    stacked = _flatten(stacked_arg)
    run = self._run

    def vectorized(*columns):
      return tf.vectorized_map(lambda leaves: _as_list(run(*leaves)), list(columns),
                               fallback_to_while_loop=False)

    out = self._call_looped('vectorized_map', vectorized, stacked)
    if out is None:
      specs = [tf.TensorSpec(o.shape, o.dtype) for o in _as_list(run.outputs)]

      def mapped(*columns):
        return tf.map_fn(lambda leaves: _as_list(run(*leaves)), list(columns),
                         fn_output_signature=specs, parallel_iterations=1)

      out = self._call_looped('looped_map', mapped, stacked)
    return None if out is None else self.unflatten_result(_as_list(out))

  def fold(self, zero, values):
    """`acc = zero; for v in values: acc = self((acc, v))` in one call (federated_aggregate's
    accumulate), over a list of client values or a `StackedClients` one's participants'
    slices; None when it cannot (see `map_stacked`)."""
    parameter = self.type_signature.parameter
    if self._init is not None or self._draws_random or parameter is None or len(parameter) != 2:
      return None
    if not isinstance(values, StackedClients):
      values = _stack(values, parameter[1])
    stacked = [] if values is None else _flatten(values.value)
    acc = [x if tf.is_tensor(x) else tf.convert_to_tensor(x) for x in _flatten(zero)]
    if not stacked or any(a.dtype in _UNSTACKABLE for a in acc):
      return None
    if self._append_columns is None:
      self._append_columns = self._find_append_columns(len(acc)) or False
    if self._append_columns:
      # A gathering accumulate appends each client's value as a row: the fold is one concat
      # (an empty accumulator, the zero, adds none: the stacked column is the result as is).
      return self.unflatten_result([
          stacked[j] if a.shape[0] == 0 else tf.concat([a, stacked[j]], 0)
          for a, j in zip(acc, self._append_columns)])
    run, num_acc = self._run, len(acc)

    def fold(*leaves):
      acc, columns = list(leaves[:num_acc]), leaves[num_acc:]

      def body(i, acc):
        return i + 1, _as_list(run(*acc, *(c[i] for c in columns)))

      # Accumulators may grow (e.g. gathered values with an unknown leading size).
      _, acc = tf.while_loop(
          lambda i, _: i < tf.shape(columns[0])[0], body, (tf.constant(0), acc),
          shape_invariants=(tf.TensorShape([]), [tf.TensorShape(None)] * num_acc),
          parallel_iterations=1)
      return acc

    out = self._call_looped('looped_fold', fold, acc + stacked)
    return None if out is None else self.unflatten_result(_as_list(out))

  def _find_append_columns(self, num_acc: int) -> Optional[list]:
    """For an accumulate `(acc, value) -> acc'` in which every output i is
    `concat([acc_i, expand_dims(value_j, 0)], 0)` and nothing else happens (fltff's gather,
    `aggregators/gather.py`): each output's value leaf j; None for any other graph."""
    run = self._run
    if run.captured_inputs:
      return None
    allowed = {'Placeholder', 'Const', 'ExpandDims', 'ConcatV2', 'Identity'}
    if any(op.type not in allowed for op in run.graph.get_operations()):
      return None
    inputs = list(run.inputs)
    acc_inputs, value_inputs = inputs[:num_acc], inputs[num_acc:]
    outputs = _as_list(run.outputs)
    if len(outputs) != num_acc:
      return None

    def source(t):
      while t.op.type == 'Identity':
        t = t.op.inputs[0]
      return t

    columns = []
    for i, out in enumerate(outputs):
      concat = source(out).op
      if concat.type != 'ConcatV2' or len(concat.inputs) != 3:
        return None
      head, row, axis = (source(x) for x in concat.inputs)
      if row.op.type != 'ExpandDims' or tf.get_static_value(axis) != 0:
        return None
      value, dim = (source(x) for x in row.op.inputs)
      if (head is not acc_inputs[i] or tf.get_static_value(dim) != 0
          or not any(value is v for v in value_inputs)):
        return None
      columns.append(next(j for j, v in enumerate(value_inputs) if v is value))
    return columns

  def _call_looped(self, name: str, python_fn, leaves: list):
    """Calls the looped function `name`, `tf.function(python_fn)` made on first use; on a first
    failure (a graph it cannot trace) marks it unusable and returns None, so the caller goes
    client by client."""
    if name not in self._looped:
      self._looped[name] = tf.function(python_fn, autograph=False)
    if self._looped[name] is None:
      return None
    try:
      with tf.device(self.device) if self.device else contextlib.nullcontext():
        return self._looped[name](*leaves)
    except (TypeError, ValueError, tf.errors.OpError, NotImplementedError):
      self._looped[name] = None
      return None

  def unflatten_result(self, leaves: list):
    return _build(iter(leaves), self.type_signature.result)

  def __call__(self, arg=None):
    leaves = [] if self.type_signature.parameter is None else _flatten(arg)
    with tf.device(self.device) if self.device else contextlib.nullcontext():
      leaves = [x if tf.is_tensor(x) else tf.convert_to_tensor(x) for x in leaves]
      if self._init is not None:
        _call_flat(self._init, leaves)  # Eager: it has run before the graph's main part starts.
      out = _call_flat(self._fresh_run() if self._draws_random else self._run, leaves)
    return self.unflatten_result(_as_list(out))


# ---- the interpreter -----------------------------------------------------------------------


def _zip_clients(value):
  """A (nested) Struct of CLIENTS values as CLIENTS Structs; stacked if every member is."""
  if isinstance(value, (_Clients, StackedClients)):
    return value
  zipped = [(name, _zip_clients(member)) for name, member in structure.to_elements(value)]
  if zipped and all(isinstance(member, StackedClients) for _, member in zipped):
    return StackedClients(structure.Struct([(name, member.value) for name, member in zipped]),
                          zipped[0][1].num_clients)
  zipped = [(name, _members(member)) for name, member in zipped]
  num = len(zipped[0][1]) if zipped else 0
  return _Clients(structure.Struct([(name, member[i]) for name, member in zipped])
                  for i in range(num))


class _Interpreter:
  """Evaluates a call-dominant TFF building block (see module docstring) in an environment
  (`collections.ChainMap`: the innermost scope first)."""

  def __init__(self, context: 'InProcessContext', num_clients: int):
    self._context = context
    self._num_clients = num_clients

  def evaluate(self, comp, env: collections.ChainMap):
    bb = building_blocks
    if isinstance(comp, bb.Reference):
      if comp.name not in env:
        raise InProcessError(f'unbound reference {comp.name!r} in the compiled computation.')
      return env[comp.name]
    if isinstance(comp, bb.Call):
      fn = self.evaluate(comp.function, env)
      if comp.argument is None:
        return fn()
      return fn(self.evaluate(comp.argument, env))
    if isinstance(comp, bb.Block):
      for name, local in comp.locals:
        env = env.new_child({name: self.evaluate(local, env)})
      return self.evaluate(comp.result, env)
    if isinstance(comp, bb.Struct):
      return structure.Struct([(name, self.evaluate(member, env))
                               for name, member in structure.to_elements(comp)])
    if isinstance(comp, bb.Selection):
      return self.evaluate(comp.source, env)[comp.as_index()]
    if isinstance(comp, bb.Lambda):
      return self._closure(comp, env)
    if isinstance(comp, bb.CompiledComputation):
      return self._context.tensorflow_function(comp)
    if isinstance(comp, bb.Intrinsic):
      return self._intrinsic(comp)
    if isinstance(comp, bb.Literal):
      return tf.constant(comp.value, dtype=comp.type_signature.dtype)
    raise InProcessError(f'cannot execute a {type(comp).__name__} building block '
                         f'({comp.compact_representation()[:200]}).')

  def _closure(self, comp, env: collections.ChainMap):
    # `(x -> C(x))` or `(x -> let v=C(x) in v)` runs as the compiled computation C: a map or
    # fold over stacked clients is then one call, not one per client (TFF's compiler leaves
    # such wrappers, e.g. around an aggregate's accumulate).
    bb = building_blocks
    body = comp.result
    if (isinstance(body, bb.Block) and len(body.locals) == 1
        and isinstance(body.result, bb.Reference) and body.result.name == body.locals[0][0]):
      body = body.locals[0][1]
    if (isinstance(body, bb.Call) and isinstance(body.function, bb.CompiledComputation)
        and isinstance(body.argument, bb.Reference) and comp.parameter_name is not None
        and body.argument.name == comp.parameter_name):
      return self._context.tensorflow_function(body.function)
    if comp.parameter_name is None:
      return lambda: self.evaluate(comp.result, env)
    return lambda arg: self.evaluate(comp.result, env.new_child({comp.parameter_name: arg}))

  def _intrinsic(self, comp):
    uri = comp.uri
    n = self._num_clients
    if uri == 'federated_broadcast' or uri == 'federated_value_at_clients':
      return lambda x: _Clients([x] * n)
    if uri in ('federated_value_at_server', 'federated_zip_at_server'):
      return lambda x: x
    if uri in ('federated_map', 'federated_map_all_equal'):
      return lambda arg: self._map(arg[0], arg[1])
    if uri == 'federated_apply':
      return lambda arg: arg[0](arg[1])
    if uri == 'federated_eval_at_clients':
      return lambda fn: _Clients(fn() for _ in range(n))
    if uri == 'federated_eval_at_server':
      return lambda fn: fn()
    if uri == 'federated_zip_at_clients':
      return _zip_clients
    if uri == 'federated_aggregate':
      return self._aggregate
    if uri == 'federated_sum':
      return self._sum
    if uri == 'federated_mean':
      return lambda x: structure.map_structure(lambda s: s / tf.cast(len(x), s.dtype),
                                               self._sum(x))
    raise InProcessError(
        f'the in-process executor does not implement the intrinsic {uri!r}; use '
        "runtime.executor = 'tff_cpp' for this computation.")

  def _map(self, fn, values):
    """`fn` on every participant's value; one call over them stacked where `fn` is one graph
    that maps stacked values (the result then stays stacked)."""
    if isinstance(fn, _TensorFlowFunction) and fn.maps_stacked:
      stacked = (values if isinstance(values, StackedClients)
                 else _stack(values, fn.type_signature.parameter))
      mapped = None if stacked is None else fn.map_stacked(stacked.value)
      if mapped is not None:
        return StackedClients(mapped, stacked.num_clients)
    return _Clients(fn(v) for v in _members(values))

  def _sum(self, values):
    values = _members(values)
    if not values:
      raise InProcessError('federated_sum over zero clients.')
    total = values[0]
    for v in values[1:]:
      total = structure.map_structure(lambda a, b: a + b, total, v)
    return total

  def _aggregate(self, arg):
    values, zero, accumulate, _, report = (arg[i] for i in range(5))
    # TFF's federating executor folds the clients in order into one accumulator (no merge).
    if isinstance(accumulate, _TensorFlowFunction):
      acc = accumulate.fold(zero, values)
      if acc is not None:
        return report(acc)
    acc = zero
    for v in _members(values):
      acc = accumulate(structure.Struct([(None, acc), (None, v)]))
    return report(acc)


class InProcessContext(context_base.SyncContext):
  """A TFF synchronous context that runs computations in this process (module docstring), on
  TensorFlow `device` (e.g. '/GPU:0'; None: TensorFlow's choice; one it lacks: `ConfigError`)."""

  def __init__(self, device: Optional[str] = None):
    check_device(device)
    self.device = device
    self._compiled: dict[int, tuple[Any, Any]] = {}
    self._functions: dict[int, tuple[Any, _TensorFlowFunction]] = {}
    self._tensor_results = 0

  @contextlib.contextmanager
  def tensor_results(self):
    """Within the block, computations return tensors as they are (not NumPy copies) and take
    them back uncopied: for a caller feeding one result into the next (the personalised
    vectorised round's model-sized s_i, from `prepare_round` to the clients and `end_round`)."""
    self._tensor_results += 1
    try:
      yield True
    finally:
      self._tensor_results -= 1

  # Called by the interpreter.
  def tensorflow_function(self, comp) -> _TensorFlowFunction:
    key = id(comp)
    if key not in self._functions:
      self._functions[key] = (comp, _TensorFlowFunction(comp.proto, self.device))
    return self._functions[key][1]

  def invoke(self, comp, arg):
    if id(comp) not in self._compiled:  # Kept with `comp`, so that its id stays its own.
      native = compiler.desugar_and_transform_to_native(comp)
      proto = computation_impl.ConcreteComputation.get_proto(native)
      self._compiled[id(comp)] = (comp, building_blocks.ComputationBuildingBlock.from_proto(proto))
    parameter_type = comp.type_signature.parameter
    num_clients = 0 if parameter_type is None else _num_clients_of(arg, parameter_type) or 0
    fn = _Interpreter(self, num_clients).evaluate(self._compiled[id(comp)][1],
                                                  collections.ChainMap())
    result = fn() if parameter_type is None else fn(_ingest(arg, parameter_type, num_clients))
    return type_conversions.type_to_py_container(
        _to_python(result, keep_tensors=self._tensor_results > 0), comp.type_signature.result)
