"""Type checks of numeric settings, shared by the gin configuration and the library's builders.

`check_gin_bindings` applies `check_number` to every gin-bound parameter annotated `int`/`float`
(or `Optional` of them), so e.g. `experiment.clients_per_round = 2.5` ends in a `ConfigError`
naming the binding, not in a TypeError deep inside TensorFlow.
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


def check_number(name: str, value: Any, integer: bool = False,
                 allow_none: bool = False) -> None:
  """Raises `ConfigError` unless `value` is a real number (an `int` with `integer`); booleans,
  though `int`s to Python, never count."""
  if value is None and allow_none:
    return
  kind = numbers.Integral if integer else numbers.Real  # NumPy scalars included.
  if isinstance(value, bool) or not isinstance(value, kind):
    wanted = 'an integer' if integer else 'a number'
    raise ConfigError(f'{name} must be {wanted}, got {value!r}.')


def _numeric_kind(annotation: Any) -> Optional[tuple[bool, bool]]:
  text = annotation if isinstance(annotation, str) else getattr(annotation, '__name__', None)
  if not isinstance(text, str):
    text = str(annotation)
  return _NUMERIC_ANNOTATIONS.get(text.replace('typing.', '').replace(' ', ''))


def check_gin_bindings(config: Mapping[tuple[str, str], Mapping[str, Any]]) -> None:
  """`check_number` for every parameter bound in `config` and annotated as a number.

  Args:
    config: Gin's bindings, `{(scope, selector): {parameter: value}}`, as its finalize hooks
      get them; references and macros (`@name`, `%NAME`) are not checked.
  """
  import gin  # pylint: disable=g-import-not-at-top

  for (scope, selector), params in config.items():
    try:
      fn = inspect.unwrap(gin.get_configurable(selector))
      signature = inspect.signature(fn.__init__ if inspect.isclass(fn) else fn)
    except (ValueError, TypeError, KeyError):
      continue
    for param, value in params.items():
      if param not in signature.parameters or not isinstance(value, (str, int, float, list,
                                                                      tuple, dict)):
        continue
      kind = _numeric_kind(signature.parameters[param].annotation)
      if kind is not None:
        name = f'{scope + "/" if scope else ""}{selector.rsplit(".", 1)[-1]}.{param}'
        check_number(name, value, integer=kind[0], allow_none=kind[1])


def gin_binds(selector: str) -> bool:
  """Whether the current gin configuration binds `selector` ('configurable.parameter')."""
  import gin  # pylint: disable=g-import-not-at-top

  try:
    gin.query_parameter(selector)
    return True
  except ValueError:
    return False
