"""Checks of settings, shared by the gin configuration and the library's builders, and what
gin's own errors mean (`explain_gin_error`)."""

from __future__ import annotations

import difflib
import inspect
import math
import numbers
import re
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import gin

from fltff.errors import ConfigError

# Seeds are 32-bit unsigned integers, as NumPy's legacy generator and most FL tools take them;
# every stream fltff derives from one (TF's stateless int64 pairs, NumPy's generators) holds it.
MAX_SEED = 2**32 - 1


def check_seed(name: str, value: Any) -> None:
  """Raises `ConfigError` unless `value` is an integer seed in [0, MAX_SEED]."""
  check_number(name, value, integer=True, low=0, high=MAX_SEED)


def check_number(name: str, value: Any, integer: bool = False, allow_none: bool = False,
                 low: Optional[float] = None, high: Optional[float] = None, allow_inf: bool = False,
                 open_low: bool = False, open_high: bool = False, hint: str = '') -> None:
  """Raises `ConfigError` unless `value` is a real number (an `int` with `integer`; booleans,
  though `int`s to Python, never count), finite unless `allow_inf` (inf: 'wait forever'), within
  `low`..`high` (each included unless open; NaN never), naming `name`, the bounds and `hint`."""
  if value is None and allow_none:
    return
  kind = numbers.Integral if integer else numbers.Real  # NumPy scalars included.
  if isinstance(value, bool) or not isinstance(value, kind):
    wanted = 'an integer' if integer else 'a number'
    raise ConfigError(f'{name} must be {wanted}, got {value!r}.')
  if not (allow_inf or isinstance(value, numbers.Integral) or math.isfinite(value)):
    raise ConfigError(f'{name} must be finite, got {value}{"; " + hint if hint else ""}.')
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


def check_device(device: Optional[str], setting: str = 'device') -> None:
  """Raises `ConfigError` unless TensorFlow sees `device` ('/GPU:0', 'gpu'; None: its choice),
  naming the devices it sees: one it lacks would run on its CPU (soft placement), silently."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  wanted = tf.DeviceSpec.from_string(device or '')
  kind, index = wanted.device_type, wanted.device_index
  if kind is None or len(tf.config.list_logical_devices(kind)) > (index or 0):
    return
  hint = (' (`make setup-gpu` installs the CUDA libraries TensorFlow 2.14 needs, `python -m '
          'pipelines.gpu_check` says what is missing)') if kind == 'GPU' else ''
  raise ConfigError(f'{setting} = {device!r} but TensorFlow sees no {kind}'
                    f'{"" if index is None else f":{index}"}, only '
                    f'{", ".join(d.name for d in tf.config.list_logical_devices())}{hint}.')


def check_choice(name: str, value: Any, choices) -> None:
  """Raises `ConfigError` unless `value` is one of `choices`, naming them."""
  if value not in choices:
    raise ConfigError(f'{name} must be one of {", ".join(map(repr, choices))}, got {value!r}.')


# What a gin binding holds when it is written as a value (not a reference or a macro).
_PLAIN_VALUES = (str, int, float, list, tuple, dict)


def _annotation(annotation: Any) -> tuple[str, bool]:
  """An annotation, written (postponed) or evaluated, as text without module prefixes and spaces
  ('int', 'Callable[...]'), and whether it allows None (`Optional[...]`, `... | None`)."""
  text = annotation if isinstance(annotation, str) else (
      annotation.__name__ if isinstance(annotation, type) else str(annotation))
  text = re.sub(r'typing\.|collections\.abc\.|\s', '', text)
  if text.startswith('Optional[') and text.endswith(']'):
    return text[len('Optional['):-1], True
  return (text[:-len('|None')], True) if text.endswith('|None') else (text, False)


def configurable_parameters(selector: str) -> dict[str, inspect.Parameter]:
  """The parameters gin may bind of configurable `selector` (a class: its `__init__`'s), by
  name; none where it is unknown."""
  try:
    fn = inspect.unwrap(gin.get_configurable(selector))
  except (ValueError, KeyError):
    return {}
  return {name: p for name, p in parameters(fn.__init__ if inspect.isclass(fn) else fn).items()
          if name != 'self' and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}


def check_builder(name: str, value: Any, allow_none: bool,
                  config: Mapping[tuple[str, str], Mapping[str, Any]]) -> None:
  """Raises `ConfigError` unless `value`, bound to `name` (annotated `Callable`), is a reference
  to a configurable (`@fedavg`): not a string, number or collection, and not a call (`@fedavg()`)
  of one that needs arguments gin does not bind (`config`, as in `check_gin_bindings`)."""
  if value is None and allow_none:
    return
  if isinstance(value, gin.config.ConfigurableReference):
    params = configurable_parameters(value.configurable.selector) if value.evaluate else {}
    bound = config.get(('/'.join(value.scopes), value.configurable.selector), {})
    needed = [p for name, p in params.items()
              if name not in bound and p.default in (p.empty, gin.REQUIRED)]
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
  """`check_number` for every parameter bound in `config` and annotated as a number (inf, gin's
  `1e999`, is the configurable's to refuse), `check_builder` for every one annotated `Callable`.

  Args:
    config: Gin's bindings, `{(scope, selector): {parameter: value}}`, as its finalize hooks
      get them; macros (`%NAME`) are not checked.
  """
  for (scope, selector), params in config.items():
    declared = configurable_parameters(selector)
    for param, value in params.items():
      if param not in declared:
        continue
      name = f'{scope + "/" if scope else ""}{selector.rsplit(".", 1)[-1]}.{param}'
      kind, optional = _annotation(declared[param].annotation)
      if kind.startswith('Callable'):
        check_builder(name, value, optional, config)
      elif kind in ('int', 'float') and isinstance(value, _PLAIN_VALUES):
        check_number(name, value, integer=kind == 'int', allow_none=optional, allow_inf=True)


def parameters(fn: Any) -> Mapping[str, inspect.Parameter]:
  """`fn`'s parameters by name; none where Python cannot tell (some builtins and C functions)."""
  try:
    return inspect.signature(fn).parameters
  except (TypeError, ValueError):
    return {}


def gin_binds(selector: str) -> bool:
  """Whether the current gin configuration binds `selector` ('configurable.parameter')."""
  try:
    gin.query_parameter(selector)
    return True
  except ValueError:
    return False


def did_you_mean(name: str, choices, prefix: str = '') -> str:
  """' did you mean <prefix>X?' for the choice X closest to `name` (difflib), or '' when none
  is close."""
  close = difflib.get_close_matches(name, list(choices), n=1)
  return f' did you mean {prefix}{close[0]}?' if close else ''


def configurables() -> dict:
  """Every registered gin configurable, by its name (`fedavg`, `experiment`, ...)."""
  return {c.name: c for _, c in gin.config._REGISTRY.items()}  # pylint: disable=protected-access


def _expected(annotation: Any) -> Optional[str]:
  """What a parameter annotated `annotation` takes, in words; None when the annotation says
  nothing gin can write."""
  if annotation is inspect.Parameter.empty:
    return None
  kind, optional = _annotation(annotation)
  if kind.startswith('Callable'):
    return 'a configurable written with @ (e.g. @fedavg)'
  sequence = 'a list or tuple'
  kind = {'int': 'an integer', 'float': 'a number', 'str': "a string in quotes ('...')",
          'bool': 'True or False', 'Sequence': sequence, 'list': sequence, 'tuple': sequence,
          'Mapping': 'a dict', 'dict': 'a dict'}.get(kind.split('[')[0])
  return kind and kind + (' or None' if optional else '')


def _unreadable_value(error: SyntaxError) -> Optional[str]:
  """A value gin cannot read (`experiment.rounds = five`): the binding and what it takes."""
  token = re.search(r"Failed to parse token '(.*)'", error.msg or '')
  line = (error.text or '').strip()
  binding = re.match(r'^([\w./]+\.\w+)\s*=\s*(.+)$', line)
  malformed = 'malformed node' in (error.msg or '') or token
  if not (binding or malformed):
    return None
  where = f'{error.filename}, line {error.lineno}' if error.filename else '--gin_bindings'
  value = token.group(1) if token else (binding.group(2) if binding else line)
  if not binding:  # Inside a value over several lines: say it without ast's repr.
    return (f'gin cannot read {value} as a value (in {where}): write a number, a string in '
            "quotes ('...'), True, False, None, a list, a @configurable or a %MACRO.")
  target = binding.group(1)
  configurable, param = target.rsplit('/', 1)[-1].rsplit('.', 1)
  configurable = configurables().get(configurable.rsplit('.', 1)[-1])
  parameter = configurable_parameters(configurable.selector).get(param) if configurable else None
  expected = _expected(parameter.annotation) if parameter else None
  text = f'{target} = {binding.group(2)} (in {where}): gin cannot read {value} as a value; '
  if expected is None:
    return text + (f"write a number, a string in quotes ('{value}'), True, False, None, a list, "
                   f'a configurable (@{value}) or a macro (%{value}).')
  if expected.startswith('a string'):
    example = f" (e.g. {target} = '{value}')"
  elif expected.startswith('a configurable') and value in configurables():
    example, expected = f' (write {target} = @{value})', 'a configurable written with @'
  elif parameter.default is not inspect.Parameter.empty and isinstance(
      parameter.default, (bool, int, float, str)):
    example = f' (e.g. {target} = {parameter.default!r}, its default)'
  else:
    example = ''
  return text + f'{target} takes {expected}{example}.'


def explain_gin_error(error: BaseException, method_names: Sequence[str] = ()) -> Optional[str]:
  """What gin's parse `error` means and what to write instead, in one line, or None for an error
  it does not recognise.

  An unknown configurable or reference names the closest registered name (and for a method
  every name of `method_names`, the registry's gin names); an unknown parameter the closest
  parameter and all of that configurable's; a value gin cannot read (`experiment.rounds = five`)
  the binding and what its parameter takes.
  """
  if isinstance(error, SyntaxError):
    return _unreadable_value(error)
  message = str(error)
  # Where: '--gin_bindings' or 'file, line n', and the configuration line it quotes.
  where, line, lines = '', '', [l.strip() for l in message.splitlines()]
  for i, text in enumerate(lines):
    in_file = re.match(r'In file "([^"]+)", line (\d+)', text)
    if in_file or text.startswith('In bindings string'):
      where = f'{in_file.group(1)}, line {in_file.group(2)}' if in_file else '--gin_bindings'
      line = lines[i + 1] if i + 1 < len(lines) else ''
      break
  binding = f'{line} (in {where})' if '=' in line else f'in {where}' if where else ''
  unknown_param = re.match(r"Configurable '([\w.]+)' doesn't have a parameter named '(\w+)'",
                           message)
  if unknown_param:
    configurable, param = unknown_param.groups()
    known = configurables().get(configurable.rsplit('.', 1)[-1])
    params = [p for p in (configurable_parameters(known.selector) if known else ())
              if (known.allowlist is None or p in known.allowlist)
              and p not in (known.denylist or ())]
    return (f'{binding}: {configurable} has no parameter {param};'
            f'{did_you_mean(param, params)} {configurable}\'s parameters: {", ".join(params)}.'
            ).lstrip(': ')
  unknown = re.match(r"No configurable matching (reference )?'@?([\w./]+?)(\(\))?'", message)
  if not unknown:
    return None
  reference, name = unknown.group(1), unknown.group(2).rsplit('/', 1)[-1].rsplit('.', 1)[-1]
  suggestion = did_you_mean(name, configurables(), '@' if reference else '')
  methods = sorted(method_names)
  # A method's binding (`experiment.method = @...`), or a name close to a method's.
  is_method = methods and (re.match(r'^[\w./]*\bmethod\s*=', line) is not None
                           or difflib.get_close_matches(name, methods, n=1) != [])
  listed = (f' Methods: {", ".join(methods)} (fltff list cites them).' if is_method else
            ' fltff list shows the methods, models, data sources and configs.')
  return f'{binding}: no configurable is named {name};{suggestion}{listed}'.lstrip(': ')


def short_gin_message(exc: BaseException) -> str:
  """Gin appends 'In call to configurable ...' / 'In file ...' context lines: keep them short."""
  lines = [l.strip() for l in str(exc).strip().splitlines()
           if l.strip() and not l.strip().startswith('In call to configurable')]
  return ' '.join(lines[:3])
