"""Type checks of numeric settings, shared by the gin configuration and the library's builders.

`check_gin_bindings` applies `check_number` to every gin-bound parameter annotated `int`/`float`
(or `Optional` of them), so e.g. `experiment.clients_per_round = 2.5` ends in a `ConfigError`
naming the binding, not in a TypeError deep inside TensorFlow; and `check_builder` to every one
annotated `Callable`, so `experiment.method = 'fedavg'` (a string, not `@fedavg`) ends in one.
"""

from __future__ import annotations

import inspect
import numbers
from collections.abc import Mapping
from typing import Any, Optional

from fltff.errors import ConfigError

# Annotation text (without 'typing.' and spaces) -> (integer wanted, None allowed).
_NUMERIC_ANNOTATIONS = {
    'float': (False, False), 'int': (True, False),
    'Optional[float]': (False, True), 'Optional[int]': (True, True),
    'float|None': (False, True), 'int|None': (True, True),
}


# Seeds are 32-bit unsigned integers, as NumPy's legacy generator and most FL tools take them;
# every stream fltff derives from one (TF's stateless int64 pairs, NumPy's generators) holds it.
MAX_SEED = 2**32 - 1


def check_seed(name: str, value: Any) -> None:
  """Raises `ConfigError` unless `value` is an integer seed in [0, MAX_SEED]."""
  check_number(name, value, integer=True, low=0, high=MAX_SEED)


def check_number(name: str, value: Any, integer: bool = False, allow_none: bool = False,
                 low: Optional[float] = None, high: Optional[float] = None,
                 open_low: bool = False, open_high: bool = False, hint: str = '') -> None:
  """Raises `ConfigError` unless `value` is a real number (an `int` with `integer`; booleans,
  though `int`s to Python, never count) within `low`..`high` (each included unless open; NaN
  never within), naming `name` and the bounds, then `hint` (e.g. '0: off')."""
  if value is None and allow_none:
    return
  kind = numbers.Integral if integer else numbers.Real  # NumPy scalars included.
  if isinstance(value, bool) or not isinstance(value, kind):
    wanted = 'an integer' if integer else 'a number'
    raise ConfigError(f'{name} must be {wanted}, got {value!r}.')
  above = low is None or (value > low if open_low else value >= low)
  below = high is None or (value < high if open_high else value <= high)
  if not (above and below):
    if high is None:
      bound = f'{">" if open_low else ">="} {low}'
    elif low is None:
      bound = f'{"<" if open_high else "<="} {high}'
    else:
      bound = f'in {"(" if open_low else "["}{low}, {high}{")" if open_high else "]"}'
    raise ConfigError(f'{name} must be {bound}, got {value}{"; " + hint if hint else ""}.')


def check_choice(name: str, value: Any, choices) -> None:
  """Raises `ConfigError` unless `value` is one of `choices`, naming them."""
  if value not in choices:
    raise ConfigError(f'{name} must be one of {", ".join(map(repr, choices))}, got {value!r}.')


def _numeric_kind(annotation: Any) -> Optional[tuple[bool, bool]]:
  text = annotation if isinstance(annotation, str) else getattr(annotation, '__name__', None)
  if not isinstance(text, str):
    text = str(annotation)
  return _NUMERIC_ANNOTATIONS.get(text.replace('typing.', '').replace(' ', ''))


# What a gin binding holds when it is written as a value (not a reference or a macro).
_PLAIN_VALUES = (str, int, float, list, tuple, dict)


def _callable_kind(annotation: Any) -> Optional[bool]:
  """For a `Callable` annotation whether None is allowed (`Optional`); None otherwise."""
  text = (annotation if isinstance(annotation, str) else str(annotation)).replace(
      'typing.', '').replace('collections.abc.', '').replace(' ', '')
  if text.startswith('Callable'):
    return text.endswith('|None')
  return True if text.startswith('Optional[Callable') else None


def _signature(selector: str) -> Optional[inspect.Signature]:
  import gin  # pylint: disable=g-import-not-at-top

  try:
    fn = inspect.unwrap(gin.get_configurable(selector))
    return inspect.signature(fn.__init__ if inspect.isclass(fn) else fn)
  except (ValueError, TypeError, KeyError):
    return None


def check_builder(name: str, value: Any, allow_none: bool,
                  config: Mapping[tuple[str, str], Mapping[str, Any]]) -> None:
  """Raises `ConfigError` unless `value`, bound to `name` (annotated `Callable`), is a reference
  to a configurable (`@fedavg`): not a string, number or collection, and not a call (`@fedavg()`)
  of one that needs arguments gin does not bind (`config`, as in `check_gin_bindings`)."""
  import gin  # pylint: disable=g-import-not-at-top

  if value is None and allow_none:
    return
  if isinstance(value, gin.config.ConfigurableReference):
    signature = _signature(value.configurable.selector) if value.evaluate else None
    if signature is None:
      return
    bound = config.get(('/'.join(value.scopes), value.configurable.selector), {})
    needed = [p for p in signature.parameters.values()
              if p.name != 'self' and p.name not in bound and p.default in (p.empty, gin.REQUIRED)
              and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if needed:
      target = value.selector.rsplit('.', 1)[-1]
      raise ConfigError(f'{name} = @{target}() calls {target} while gin reads the '
                        f'configuration, without its {needed[0].name}: write @{target}.')
    return
  if not isinstance(value, _PLAIN_VALUES):
    return
  known = isinstance(value, str) and value.strip('@ ').isidentifier() and (
      gin.config._REGISTRY.matching_selectors(value.strip('@ ')))  # pylint: disable=protected-access
  hint = f'write {name} = @{value.strip("@ ")}' if known else f'{name} = @<configurable>'
  raise ConfigError(f'{name} must name a configurable with @ ({hint}); got {value!r}.')


def check_gin_bindings(config: Mapping[tuple[str, str], Mapping[str, Any]]) -> None:
  """`check_number` for every parameter bound in `config` and annotated as a number,
  `check_builder` for every one annotated `Callable`.

  Args:
    config: Gin's bindings, `{(scope, selector): {parameter: value}}`, as its finalize hooks
      get them; macros (`%NAME`) are not checked.
  """
  for (scope, selector), params in config.items():
    signature = _signature(selector)
    for param, value in params.items():
      if signature is None or param not in signature.parameters:
        continue
      name = f'{scope + "/" if scope else ""}{selector.rsplit(".", 1)[-1]}.{param}'
      annotation = signature.parameters[param].annotation
      builder = _callable_kind(annotation)
      kind = _numeric_kind(annotation)
      if builder is not None:
        check_builder(name, value, builder, config)
      elif kind is not None and isinstance(value, _PLAIN_VALUES):
        check_number(name, value, integer=kind[0], allow_none=kind[1])


def parameters(fn: Any) -> Mapping[str, inspect.Parameter]:
  """`fn`'s parameters by name; none where Python cannot tell (some builtins and C functions)."""
  try:
    return inspect.signature(fn).parameters
  except (TypeError, ValueError):
    return {}


def gin_binds(selector: str) -> bool:
  """Whether the current gin configuration binds `selector` ('configurable.parameter')."""
  import gin  # pylint: disable=g-import-not-at-top

  try:
    gin.query_parameter(selector)
    return True
  except ValueError:
    return False
