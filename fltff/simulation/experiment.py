"""The wiring of one experiment from gin, in the order data flows (docs/architecture.md): data,
model, method (given its optimizers here: library builders never read gin), round driver."""

from __future__ import annotations

import dataclasses
import functools
import re
import tokenize
from collections.abc import Callable, Sequence
from typing import Any, Optional

from absl import logging
import gin
import numpy as np

import fltff
from fltff import methods
from fltff import resources
from fltff.data import build_federated_data
from fltff.config_checks import check_choice
from fltff.config_checks import check_gin_bindings
from fltff.config_checks import check_seed
from fltff.config_checks import explain_gin_error
from fltff.config_checks import gin_binds
from fltff.config_checks import parameters
from fltff.config_checks import short_gin_message
from fltff.errors import ConfigError
from fltff.errors import warn
from fltff.learning import optimizers
from fltff.learning.model_spec import ModelSpec
from fltff.learning.round_data import cheapest_groups
from fltff.learning.round_data import step_overhead
from fltff.learning.vectorized import on_cpu
from fltff.models import build_model
from fltff.models import layer_groups
from fltff.models.layers import macs_per_example
from fltff.personalization.fedlap_mixing import with_fedlap_personalization
from fltff.simulation.driver import RoundConfig
from fltff.simulation.driver import RoundDriver
from fltff.simulation import sampling
from fltff.simulation.evaluation import Finetuner
from fltff.simulation.checkpoint import Checkpointer
from fltff.simulation.outputs import prepare_output_dir
from fltff.simulation.outputs import check_resume
from fltff.simulation.outputs import unread_bindings


def build_model_spec(data, model: str, seed: int) -> ModelSpec:
  """The zoo model `model` sized for `data`'s examples and classes."""
  shape = tuple(data.dataset.x_train.shape[1:])
  keras_fn = functools.partial(build_model, name=model, input_shape=shape,
                               num_classes=data.dataset.num_classes, seed=seed)
  keras_fn()  # Fail fast (unknown name, incompatible shape) before TFF traces it.
  return ModelSpec(keras_fn=keras_fn, input_shape=shape, num_classes=data.dataset.num_classes,
                   name=model)


CLIENT_WORKS = ('auto', 'vectorised', 'per_client')


def expected_padding(steps: Sequence[int], participants: int, draws: int = 64,
                     step_overhead: Optional[float] = None) -> float:
  """E[client steps a vectorised round runs] / E[Σ steps] for K = `participants` clients drawn
  from `steps`; 1.0 means no padding.

  A vectorised round runs every participant for the longest one's steps (K · max), or with
  `step_overhead` (`round_data.step_overhead`) each group of similar clients for its longest
  member's (`round_data.cheapest_groups`). Partial participation is estimated from `draws`
  fixed-seed draws; every client is assumed to train all its epochs (stragglers and a round
  deadline pad further).
  """
  steps = np.asarray(steps, np.int64)
  if participants >= len(steps):
    chosen = steps[np.newaxis]
  else:
    rng = np.random.default_rng(0)
    chosen = steps[np.stack([rng.choice(len(steps), participants, replace=False)
                             for _ in range(draws)])]

  def run(row):
    if step_overhead is None:
      return len(row) * row.max()
    return sum(len(g) * row[g].max() for g in cheapest_groups(np.ones_like(row), row,
                                                             step_overhead))

  return float(np.mean([run(row) for row in chosen]) / chosen.sum(axis=1).mean())


def conv_padding_limit(participants: int) -> float:
  """The padding above which 'auto' trains a convolutional model's clients one by one on a CPU.

  Our rounded fit to cnn2 rounds on a 2-core CPU (docs/performance.md, "Executors"):
  vectorised convolutions gain little over TFF's C++ runtime at 10 clients (break-even ≈ 1.05)
  and more at 100, where the per-client cost of the C++ runtime grows (break-even ≈ 1.7).
  """
  return 1.0 + participants / 150.0


def choose_client_work(algorithm, client_work: str = 'auto', factor_dense: bool = True,
                       runtime=None, steps: Optional[Sequence[int]] = None,
                       participants: Optional[int] = None, batch_size: int = 32
                       ) -> tuple[Any, Optional[str]]:
  """The experiment's choice of what its clients compute with (`experiment.client_work`):
  `(algorithm, why 'auto' left it unvectorised or None)` (the run's first line says why).

  'vectorised' gives `algorithm` with its vectorised client work (`with_vectorized_clients`;
  `ConfigError` where the method or model has none); 'per_client' keeps TFF's client work;
  'auto' vectorises where the method, the model and the runtime (`auto_vectorises`) allow it,
  except a convolutional model on a CPU whose rounds would pad the
  clients' local `steps` (one entry per client, of `batch_size` examples) beyond
  `conv_padding_limit(participants)` (`expected_padding`, grouped as the vectorised work groups
  them). The runtime then only places the rounds (`Runtime.place`).
  """
  check_choice('experiment.client_work', client_work, CLIENT_WORKS)
  if not isinstance(factor_dense, bool):
    raise ConfigError(f'experiment.factor_dense must be True or False, got {factor_dense!r}.')
  # Without a runtime to place the rounds, 'auto' leaves TFF's client work to the context.
  if client_work == 'per_client' or (client_work == 'auto' and (
      runtime is None or not runtime.auto_vectorises)):
    return algorithm, None
  if (client_work == 'auto' and runtime.per_client_on_cpp and steps is not None
      and participants and on_cpu(runtime.device)
      and any(g.kind == 'conv' for g in layer_groups(algorithm.model_spec.keras_fn()))):
    overhead = step_overhead(macs_per_example(algorithm.model_spec.keras_fn()), batch_size)
    padding = expected_padding(steps, participants, step_overhead=overhead)
    if padding > conv_padding_limit(participants):
      return algorithm, (
          f'its clients differ in size: a vectorised round would pad them to {padding:.2f}x '
          f'their steps (in groups of similar clients where that pays), slower for '
          f"convolutions on a CPU than client by client; experiment.client_work = 'vectorised' "
          f'forces it')
  try:
    return algorithm.with_vectorized_clients(None if runtime is None else runtime.device,
                                             factor_dense), None
  except ConfigError as e:
    if client_work == 'vectorised':
      raise
    return algorithm, str(e)


def configure(gin_files: Sequence[str], gin_bindings: Sequence[str]) -> None:
  """Registers every configurable, then parses the experiment's gin files and bindings and
  checks them (`check_gin_bindings`), as `fltff run`, `sweep` and `reproduce` read them;
  `ConfigError` in one line for a bad configuration."""
  fltff.register_configurables()
  if not gin_files:
    raise ConfigError('Pass --gin_file=gin_configs/<experiment>.gin (see README).')
  found = resources.find_gin_files(gin_files, gin_bindings)
  resources.enable_gin_lookup()
  try:
    gin.parse_config_files_and_bindings(found, gin_bindings, finalize_config=False,
                                        skip_unknown=False)
  except Exception as e:  # pylint: disable=broad-except
    # Gin reports a bad file with many exception types (a tokenizer error for an unclosed
    # bracket, a TypeError for an include it cannot find, ...): each is the configuration's.
    message = short_gin_message(e)
    if isinstance(e, tokenize.TokenError):
      message = f'a gin file or --gin_bindings value leaves a bracket or string open ({e.args[0]})'
    elif isinstance(e, (TypeError, OSError)) and 'include' in message:
      # An include in a --gin_bindings value (those in files are checked by find_gin_files).
      target = re.search(r"include '([^']+)'", message)
      where = re.search(r'In file "([^"]+)", line (\d+)', message)
      raise ConfigError(resources.include_not_found(
          target.group(1) if target else '?',
          f'{where.group(1)}, line {where.group(2)}' if where else '--gin_bindings')) from e
    else:
      message = explain_gin_error(
          e, [m.gin_name for m in methods.METHODS.values()]) or message
    raise ConfigError(f'Invalid gin configuration: {message}') from e
  check_gin_bindings(gin.config._CONFIG)  # pylint: disable=protected-access


def build_method(method: Callable[..., Any], model_spec: ModelSpec, num_clients: int,
                 seed: int = 0):
  """Builds gin's `method` through `fltff.methods`: with the gin-configured `client_optimizer()`,
  as its entry declares the experiment's number of clients and, unless gin binds it, the run's
  `seed` as `relationship_seed` (KAPC's random R), and, when a `server_optimizer.*` parameter is
  bound, `server_optimizer()` (a method without one refuses it in one line)."""
  entry = methods.of_builder(method)
  kwargs = {}
  if entry.relationship_seed and not gin_binds(f'{entry.gin_name}.relationship_seed'):
    kwargs['relationship_seed'] = seed
  if any(gin_binds(f'server_optimizer.{name}')
         for name in parameters(optimizers.server_optimizer)):
    if 'server_optimizer' not in parameters(method):
      raise ConfigError(f'server_optimizer.* is bound, but {entry.name} has no server optimizer '
                        f'to replace (remove those bindings).')
    kwargs['server_optimizer'] = optimizers.server_optimizer()
  return methods.build(entry.name, model_spec, num_clients,
                       client_optimizer=optimizers.client_optimizer(), **kwargs)


@gin.configurable('experiment', denylist=['output_dir', 'resume', 'runtime', 'stop_event',
                                          'allow_config_change'])
def run_experiment(output_dir: str,
                   resume: bool = False,
                   runtime=None,
                   method: Callable[..., Any] = gin.REQUIRED,
                   model: str = gin.REQUIRED,
                   model_seed: Optional[int] = None,
                   rounds: int = 10,
                   clients_per_round: Optional[int] = None,
                   client_fraction: Optional[float] = None,
                   local_epochs: int = 1,
                   batch_size: int = 10,
                   eval_every: int = 1,
                   checkpoint_every: int = 5,
                   target_accuracies: Sequence[float] = (),
                   seed: int = 0,
                   straggler_fraction: float = 0.0,
                   straggler_mode: str = 'partial',
                   personalization: Optional[Callable[..., Any]] = None,
                   channel: Optional[Callable[..., Any]] = None,
                   round_deadline: Optional[float] = None,
                   compute_seconds_per_example: float = 1e-4,
                   client_state_store: str = 'memory',
                   evaluation: Optional[Sequence[str]] = None,
                   headline_statistic: str = 'best_round_mean',
                   finetune_epochs: int = 5,
                   client_work: str = 'auto',
                   factor_dense: bool = True,
                   progress: Callable[[str], None] = print,
                   stop_event=None, allow_config_change: bool = False) -> dict:
  """Runs one experiment end to end and returns its summary (also in summary.json).

  Args:
    output_dir: Where config.gin, metrics.csv, summary.json, TensorBoard events, the plot,
      partition.json and checkpoints go.
    resume: Continue from the latest checkpoint in `output_dir`.
    runtime: The `fltff.runtime.Runtime` (enables failover); None: the current context.
    stop_event: Optional `fltff.cli.StopSignal` (or `threading.Event`); once set, the run stops after the current round
      with its checkpoint saved (`StopRequested`).
    method: A method builder taking a `ModelSpec` (gin: `@fedavg`, `@fedprox`, `@sgdm`).
    model: Model zoo name (see `fltff.models.MODEL_NAMES`).
    model_seed: Seed of the initial weights; None (default): `seed`.
    rounds: Rounds of the run (`RoundConfig`, like the next seven).
    clients_per_round: Participants per round (or `client_fraction` of the clients).
    client_fraction: Fraction of the clients per round, when `clients_per_round` is None.
    local_epochs: Local epochs of each participant.
    batch_size: Local batch size.
    eval_every: Evaluate every this many rounds (and after the last).
    checkpoint_every: Checkpoint every this many rounds (and after the last).
    target_accuracies: Accuracies whose first round `summary.json` reports.
    seed: The run's seed: participants, data order, stragglers, and (unless bound on their
      own) the initial weights (`model_seed`) and the partition (`federated_data.seed`).
    straggler_fraction: Fraction of each round's participants that are stragglers
      (`sampling.straggler_plan`).
    straggler_mode: 'partial' (a straggler trains random epochs in [1, E]) or 'drop'.
    personalization: Optional builder taking the `ModelSpec` (gin:
      `@fedlap_personalization`); adds personalised evaluation on local test splits.
    channel: Optional wireless channel model builder taking `num_clients` (gin:
      `@channel_model`): adds the simulated time breakdown (sim_* columns).
    round_deadline: Optional deadline in simulated seconds: clients run only the epochs that
      fit (needs `channel`); see `RoundDriver.plan_round`.
    compute_seconds_per_example: The deadline's compute model (seconds per example-epoch), also
      the `sim_compute_seconds` of its rounds.
    client_state_store: Where per-client state lives: 'memory' (default; each checkpoint holds
      every client's state) or 'sqlite' (`<output_dir>/client_states.sqlite`; RAM bounded by
      the round's participants, checkpoints cost the clients changed; for large populations).
    evaluation: The evaluation protocols, headline first (`fltff.simulation.evaluation`:
      'central', 'global_local', 'personal_local', 'trained_local', 'finetuned_local');
      None: the method's default (personal_local for personalised methods; else central, and
      global_local with local test splits).
    headline_statistic: How the headline protocol's accuracy is taken over rounds:
      'best_round_mean' (best round of the clients' mean) or 'mean_client_best' (mean of each
      client's best round).
    finetune_epochs: Epochs of the finetuned_local protocol's fine-tuning (the whole model,
      with the client optimizer, on the client's training data).
    client_work: What the clients compute with: 'auto' (default): vectorised where the
      method, the model and the runtime allow it (`choose_client_work`), else client by
      client; 'vectorised': every round's participants in one vectorised TensorFlow step
      (`fltff.learning.vectorized`; refused where it cannot be); 'per_client': TFF's client
      work, client by client. The numbers agree to float rounding (docs/runtime.md).
    factor_dense: With vectorised clients, train Dense kernels in factored form in rounds
      whose history is short against the kernel (`fltff.learning.factored_dense`; the same
      numbers up to float rounding). False: every kernel takes the per-step update.
    progress: Where progress lines go.
    allow_config_change: With `resume`, continue even when the configuration differs from
      the run's `config.gin` in more than `outputs.RESUMABLE_CHANGES`; the differences are
      appended to `config_changes.txt`. False: such a resume is refused (`ConfigError`).
  """
  arguments = locals()  # The parameters only: RoundConfig's fields are among them.
  prepare_output_dir(output_dir, resume)
  config = RoundConfig(**{f.name: arguments[f.name] for f in dataclasses.fields(RoundConfig)})
  if model_seed is None:
    model_seed = seed
  check_seed('experiment.model_seed', model_seed)
  data = build_federated_data(run_seed=seed)
  model_spec = build_model_spec(data, model, model_seed)
  algorithm = build_method(method, model_spec, data.num_clients(), seed)
  if personalization is not None:
    algorithm = with_fedlap_personalization(
        algorithm, personalization(model_spec, client_optimizer=optimizers.client_optimizer()))
  # trained_local reads the vectorised clients' models: 'auto' keeps them vectorised for it.
  steps = (None if 'trained_local' in (evaluation or ()) else
           [-(-len(indices) // batch_size) for indices in data.train_indices])
  algorithm, client_work_reason = choose_client_work(
      algorithm, client_work, factor_dense, runtime, steps,
      sampling.num_participants(data.num_clients(), clients_per_round, client_fraction),
      batch_size)
  finetuner = None
  if evaluation is not None and 'finetuned_local' in evaluation and algorithm.finetunes:
    finetuner = Finetuner(model_spec, optimizers.client_optimizer(), finetune_epochs)

  def seed_of(binding: str) -> int:  # A bound seed is gin's to pass (and record); else `seed`.
    return gin.query_parameter(binding) if gin_binds(binding) else seed

  if channel:
    channel = channel(num_clients=data.num_clients(),
                      **({} if gin_binds('channel_model.seed') else {'seed': seed}))
  # A resume must compute what the checkpointed rounds did: its configuration (once every
  # configurable has been called), data and model are checked against the checkpoint's record.
  record = {'config': gin.operative_config_str(), 'data': data.fingerprint(),
            'model': model_spec.architecture()}
  checkpointer = Checkpointer(output_dir)
  resumed_from = checkpointer.latest_round() if resume else None
  check_resume(output_dir, record, checkpointer.recorded() if resumed_from else None,
               resumed_from, allow_config_change)
  if resumed_from is not None and resumed_from > rounds:
    raise ConfigError(f'--resume: the checkpoint holds rounds 1-{resumed_from}, more than '
                      f'experiment.rounds = {rounds}; resume with experiment.rounds >= '
                      f'{resumed_from} (the run is unchanged).')
  driver = RoundDriver(algorithm, data, config, output_dir, progress=progress, runtime=runtime,
                       stop_event=stop_event, channel=channel, finetuner=finetuner, record=record,
                       client_work_reason=client_work_reason)
  driver.run_info['seeds'] = {'run': seed, 'model': model_seed,
                              'data': seed_of('federated_data.seed'),
                              **({'channel': seed_of('channel_model.seed')} if channel else {}),
                              **({} if data.source_seed is None else {'source': data.source_seed})}
  driver.run_info.update(resources.source_version())
  # The record's configurables are all the experiment calls (data, model, method, channel...).
  unread = unread_bindings(gin.config_str(), record['config'])
  if unread:
    warn(f'this run does not read {", ".join(unread)}: gin ignores a binding of a configurable '
         'the run never calls (another method\'s parameter) or of a parameter its caller passes '
         '(a partitioner\'s num_clients or seed: bind federated_data\'s).')
  logging.info('%s: %d clients, %d per round, %d rounds.', algorithm.name, data.num_clients(),
               driver.participants, rounds)
  return driver.run(resume=resume)
