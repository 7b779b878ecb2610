"""Gin's own errors said with a way out (`config_checks.explain_gin_error`): an unknown name
names the closest registered one and the choices; a value gin cannot read names the binding and
what its parameter takes. Each is one `error:` line of `fltff run`, exit status 2."""

import pytest

from helpers import SMALL
from helpers import run_pipeline_here

METHODS = ('ditto, fedadp, fedamp, fedavg, fedbabu, fedbn, fedlap, fedlayerwise, fednova, fedprox, '
           'kapc, local_training, moon, pfedla, scaffold, sgdm')
KAPC = ('model_spec, num_clients, client_optimizer, lambda_, beta, relationship_learning_rate, '
        'relationship_steps, bls_mu, min_upload_layers, relationship_update, coaching_loss, '
        'relationship_projection, relationship_init, relationship_seed')


@pytest.mark.parametrize('binding,message', [
    # An unknown configurable: the closest name, and for a method every method's name.
    ('experiment.method = @fedavgg',
     'experiment.method = @fedavgg (in --gin_bindings): no configurable is named fedavgg; '
     f'did you mean @fedavg? Methods: {METHODS} (fltff list cites them).'),
    ('fedavgg.mu = 1',
     'fedavgg.mu = 1 (in --gin_bindings): no configurable is named fedavgg; did you mean '
     f'fedavg? Methods: {METHODS} (fltff list cites them).'),
    ('experiment.method = @zzz',
     'experiment.method = @zzz (in --gin_bindings): no configurable is named zzz; '
     f'Methods: {METHODS} (fltff list cites them).'),
    ('federated_data.source = @npz_sourc',
     'federated_data.source = @npz_sourc (in --gin_bindings): no configurable is named '
     'npz_sourc; did you mean @npz_source? fltff list shows the methods, models, data sources '
     'and configs.'),
    # An unknown parameter: the closest, and all of that configurable's.
    ('kapc.lamda = 1',
     "kapc.lamda = 1 (in --gin_bindings): kapc has no parameter lamda; did you mean lambda_? "
     f"kapc's parameters: {KAPC}."),
    # A value gin cannot read: the binding and what its parameter takes.
    ('experiment.rounds = five',
     'experiment.rounds = five (in --gin_bindings): gin cannot read five as a value; '
     'experiment.rounds takes an integer (e.g. experiment.rounds = 10, its default).'),
    ('experiment.client_fraction = half',
     'experiment.client_fraction = half (in --gin_bindings): gin cannot read half as a value; '
     'experiment.client_fraction takes a number or None.'),
    ('fedprox.mu = 0.o1',
     'fedprox.mu = 0.o1 (in --gin_bindings): gin cannot read 0.o1 as a value; fedprox.mu takes '
     'a number (e.g. fedprox.mu = 0.01, its default).'),
    ('experiment.model = mlp2',
     "experiment.model = mlp2 (in --gin_bindings): gin cannot read mlp2 as a value; "
     "experiment.model takes a string in quotes ('...') (e.g. experiment.model = 'mlp2')."),
    ('experiment.method = fedprox',
     'experiment.method = fedprox (in --gin_bindings): gin cannot read fedprox as a value; '
     'experiment.method takes a configurable written with @ (write experiment.method = '
     '@fedprox).'),
    ('experiment.rounds = [1,\n five]',
     "gin cannot read five as a value (in --gin_bindings): write a number, a string in quotes "
     "('...'), True, False, None, a list, a @configurable or a %MACRO."),
])
def test_a_gin_error_is_one_line_with_the_way_out(binding, message, tmp_path):
  result = run_pipeline_here(SMALL[0], f'--gin_bindings={binding}',
                             f'--output_dir={tmp_path / "out"}')
  assert (result.returncode, result.stderr) == (2, f'error: Invalid gin configuration: {message}\n')
  assert not (tmp_path / 'out').exists()


@pytest.mark.parametrize('line,message', [
    ('experiment.method = @fedavgg', 'no configurable is named fedavgg; did you mean @fedavg?'),
    ('experiment.roundz = 5', 'experiment has no parameter roundz; did you mean rounds?'),
    ('experiment.rounds = five', 'gin cannot read five as a value; experiment.rounds takes an '
                                 'integer'),
])
def test_a_gin_file_error_names_the_file_and_line(line, message, tmp_path):
  gin_file = tmp_path / 'exp.gin'
  gin_file.write_text(f"include 'gin_configs/quickstart.gin'\n\n{line}\n")
  result = run_pipeline_here(f'--gin_file={gin_file}', f'--output_dir={tmp_path / "out"}')
  assert result.returncode == 2
  assert result.stderr.startswith(f'error: Invalid gin configuration: {line} (in {gin_file}, '
                                  f'line 3): {message}'), result.stderr
  assert len(result.stderr.splitlines()) == 1
