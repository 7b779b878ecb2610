"""The run folder: owned by one run at a time, never someone else's files, and a resume that
computes what its checkpointed rounds did (`fltff.simulation.outputs`)."""

import os
import subprocess
import sys

import pytest

from fltff.errors import ConfigError
from fltff.simulation import outputs
from helpers import REPO

CONFIG = os.path.join(REPO, 'results', 'runs', 'fedlap_fmnist_fedprox_mu1_s0', 'config.gin')


def test_a_folder_of_other_files_is_never_written_into(tmp_path):
  (tmp_path / 'config.gin').write_text('my own config\n')
  (tmp_path / 'partition.json').write_text('{}')
  for resume in (False, True):
    with pytest.raises(ConfigError, match=r"not a fltff run's \(config.gin, partition.json\)"):
      outputs.prepare_output_dir(str(tmp_path), resume)
  assert sorted(os.listdir(tmp_path)) == ['config.gin', 'partition.json']
  assert (tmp_path / 'config.gin').read_text() == 'my own config\n'


def test_an_output_dir_too_long_to_create_leaves_nothing_behind(tmp_path):
  # makedirs creates folders until the path runs out (File name too long): those go again.
  out = os.path.join(str(tmp_path), 'runs', *['d' * 200] * 25)
  with pytest.raises(ConfigError, match=r'Cannot write to --output_dir .*File name too long'):
    outputs.prepare_output_dir(out, resume=False)
  assert os.listdir(tmp_path) == []
  (tmp_path / 'kept').mkdir()  # A folder that was there before stays.
  with pytest.raises(ConfigError, match='File name too long'):
    outputs.prepare_output_dir(os.path.join(str(tmp_path), 'kept', *['d' * 200] * 25), False)
  assert os.listdir(tmp_path) == ['kept'] and os.listdir(tmp_path / 'kept') == []


def test_a_run_folder_is_marked_and_taken_again_by_the_same_process(tmp_path):
  out = str(tmp_path / 'run')
  outputs.prepare_output_dir(out, resume=False)
  outputs.prepare_output_dir(out, resume=False)  # pipelines.run, then run_experiment.
  assert os.path.exists(os.path.join(out, outputs.RUN_MARKER))
  outputs.prepare_output_dir(out, resume=True)


def test_a_folder_in_use_by_another_run_is_one_error(tmp_path):
  out = str(tmp_path / 'run')
  holder = subprocess.Popen(
      [sys.executable, '-c', 'import sys, time; from fltff.simulation import outputs; '
       'outputs.prepare_output_dir(sys.argv[1], False); print("held", flush=True); '
       'time.sleep(600)', out], cwd=REPO, stdout=subprocess.PIPE, text=True,
      env=dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL='3'))
  try:
    assert holder.stdout.readline().strip() == 'held'
    with pytest.raises(ConfigError, match=f'in use by another run \\(pid {holder.pid}\\)'):
      outputs.prepare_output_dir(out, resume=True)
  finally:
    holder.kill()
    holder.wait()
  # The kernel released the lock with the process: no stale lock to clear by hand.
  outputs.prepare_output_dir(out, resume=True)


def test_config_changes_name_what_changes_the_computation():
  with open(CONFIG) as f:
    earlier = f.read()
  now = (earlier.replace('fedprox.mu = 1.0', 'fedprox.mu = 0.5')
         .replace('experiment.rounds = 100', 'experiment.rounds = 200')
         .replace("runtime.executor = 'auto'", "runtime.executor = 'tff_cpp'")
         .replace("idx_source.path = '/work/shared/data/fashion-mnist'",
                  "idx_source.path = '/data/fmnist'"))
  assert outputs.config_changes(earlier, now) == [('fedprox.mu', '1.0', '0.5')]
  assert outputs.config_changes(earlier, earlier) == []
  # Continuation lines (long lists) are one binding.
  assert outputs.config_changes('a.b = [1,\n    2]\n', 'a.b = [1, 2]\n') == []
  assert outputs.config_changes('a.b = [1,\n    2]\n', 'a.b = [1, 3]\n') == [
      ('a.b', '[1, 2]', '[1, 3]')]


@pytest.mark.parametrize('earlier_extra, now_extra, expected', [
    # A binding on one side only: a configurable used by one run only changes the computation.
    ('', 'server_optimizer.learning_rate = 5.0\n',
     [('server_optimizer.learning_rate', outputs.ABSENT, '5.0')]),
    ('server_optimizer.learning_rate = 5.0\n', '',
     [('server_optimizer.learning_rate', '5.0', outputs.ABSENT)]),
    # Where the run executes and where its files lie are not changes of what it computes.
    ('', "runtime.workers = ['a:1']\n", []),
    ('', "npz_source.path = '/x.npz'\n", []),
    # A parameter added to fltff since the run began, at its default, changes nothing.
    ('', 'client_optimizer.weight_decay = 0.0\n', []),
    ('', 'client_optimizer.weight_decay = 1e-05\n',
     [('client_optimizer.weight_decay', outputs.ABSENT, '1e-05')]),
])
def test_config_changes_count_a_binding_on_one_side(earlier_extra, now_extra, expected):
  import fltff.learning.optimizers  # pylint: disable=g-import-not-at-top,unused-import
  base = 'experiment.seed = 0\n'
  assert outputs.config_changes(base + earlier_extra, base + now_extra) == expected


def _record(config, data='d' * 64, model='m' * 64):
  return {'config': config, 'data': data, 'model': model}


def test_check_resume_refuses_or_records(tmp_path):
  with open(CONFIG) as f:
    earlier = f.read()
  now = earlier.replace('experiment.seed = 0', 'experiment.seed = 1')
  # Not a resume: nothing to check.
  outputs.check_resume(str(tmp_path), _record(now), _record(earlier), resumed_from=None)
  with pytest.raises(ConfigError,
                     match=r'computed with \(experiment.seed: 0 -> 1\)\. Resume with the same'):
    outputs.check_resume(str(tmp_path), _record(now), _record(earlier), resumed_from=7)
  assert not (tmp_path / 'config_changes.txt').exists()
  outputs.check_resume(str(tmp_path), _record(now), _record(earlier), resumed_from=7,
                       allow_changes=True)
  assert (tmp_path / 'config_changes.txt').read_text() == (
      'resumed after round 7: experiment.seed: 0 -> 1\n')


def test_check_resume_refuses_other_data_or_another_model(tmp_path, capsys):
  config = 'experiment.seed = 0\n'
  with pytest.raises(ConfigError, match=r'rounds 1-4 were computed with \(the data \(content '
                     r'fingerprint\): aaaaaaaaaaaaaaaa -> bbbbbbbbbbbbbbbb\)'):
    outputs.check_resume(str(tmp_path), _record(config, 'b' * 64), _record(config, 'a' * 64),
                         resumed_from=4)
  with pytest.raises(ConfigError, match=r'\(the model \(architecture fingerprint\): '
                     r'aaaaaaaaaaaaaaaa -> bbbbbbbbbbbbbbbb\)'):
    outputs.check_resume(str(tmp_path), _record(config, model='b' * 64),
                         _record(config, model='a' * 64), resumed_from=4)
  outputs.check_resume(str(tmp_path), _record(config), _record(config), resumed_from=4)
  # A record from before the model was in it: resumed, with no line.
  earlier = _record(config)
  del earlier['model']
  outputs.check_resume(str(tmp_path), _record(config), earlier, resumed_from=4)
  assert capsys.readouterr().err == ''


def test_check_resume_without_any_record_of_the_config_refuses(tmp_path, capsys):
  config = 'experiment.seed = 0\n'
  # A checkpoint older than the record, and no config.gin: nothing to verify against.
  with pytest.raises(ConfigError, match=r'the configuration: not recorded \(config.gin is '
                     r'missing\) -> this one'):
    outputs.check_resume(str(tmp_path), _record(config), None, resumed_from=3)
  assert 'no data fingerprint' in capsys.readouterr().err
  # With config.gin present, the old checkpoint's run resumes; its data are not verified.
  (tmp_path / 'config.gin').write_text(config)
  outputs.check_resume(str(tmp_path), _record(config), None, resumed_from=3)
  assert capsys.readouterr().err == (
      'warning: the checkpoint of round 3 records no data fingerprint (written by an earlier '
      'fltff): the data of the resumed rounds are not verified.\n')
  # Deliberately: recorded in the run.
  (tmp_path / 'config.gin').unlink()
  outputs.check_resume(str(tmp_path), _record(config), None, resumed_from=3, allow_changes=True)
  assert (tmp_path / 'config_changes.txt').read_text() == (
      'resumed after round 3: the configuration: not recorded (config.gin is missing) -> '
      'this one\n')


def test_a_superseded_parameter_is_compared_with_the_binding_it_now_follows():
  """pFedLA's hypernetwork seed `pfedla.seed`, which earlier runs recorded, is the run seed now:
  a seed-0 run made with it computes what seed 0 gives now; another seed, or another bound
  `pfedla.relationship_seed`, is a change named by the old binding."""
  import fltff.simulation.experiment  # pylint: disable=g-import-not-at-top,unused-import
  path = os.path.join(REPO, 'results', 'runs', 'kapc_fmnist_n10_dir0.3_pfedla_s0', 'config.gin')
  with open(path) as f:
    earlier = f.read()
  assert 'pfedla.seed = 0\n' in earlier and 'experiment.seed = 0\n' in earlier
  now = earlier.replace('pfedla.seed = 0\n', '')
  assert outputs.config_changes(earlier, now) == []
  assert outputs.config_changes(earlier, now.replace('experiment.seed = 0', 'experiment.seed = 1')
                                ) == [('experiment.seed', '0', '1'), ('pfedla.seed', '0', '1')]
  assert outputs.config_changes(earlier.replace('pfedla.seed = 0', 'pfedla.seed = 1'), now) == [
      ('pfedla.seed', '1', '0')]
  # As parsed (`fltff reproduce`, `fltff sweep`): the run seed unbound is its default, 0.
  assert outputs.config_changes('pfedla.seed = 0\n', '', parsed=True) == []
  assert outputs.config_changes('pfedla.seed = 0\n', 'experiment.seed = 1\n', parsed=True) == [
      ('pfedla.seed', '0', '1')]
  assert outputs.config_changes('pfedla.seed = 0\n', 'experiment.seed = 0\n'
                                'pfedla.relationship_seed = 2\n', parsed=True) == [
                                    ('pfedla.seed', '0', '2')]


def test_a_seed_the_run_passes_unless_bound_is_compared_with_the_run_seed():
  """The channel's seed and KAPC's and pFedLA's relationship seeds are the run seed unless gin
  binds them: bound on one side only, the run seed's value is no change, another value (their
  default 0 included) is one."""
  import fltff.simulation.experiment  # pylint: disable=g-import-not-at-top,unused-import
  run = 'experiment.seed = 3\n'
  for key in ('channel_model.seed', 'kapc.relationship_seed', 'pfedla.relationship_seed'):
    assert outputs.config_changes(run, run + f'{key} = 3\n') == []
    assert outputs.config_changes(run + f'{key} = 3\n', run) == []
    assert outputs.config_changes(run, run + f'{key} = 0\n') == [(key, '3', '0')]
    assert outputs.config_changes(run + f'{key} = 0\n', run) == [(key, '0', '3')]
    assert outputs.config_changes(run + f'{key} = 0\n', run, parsed=True) == [(key, '0', '3')]
    assert outputs.config_changes(f'{key} = 0\n', '', parsed=True) == []


def test_config_changes_read_a_parsed_configuration_as_gin_does():
  """`fltff sweep` compares what its gin file gives now (`gin.config_str()`) with a run's
  operative config: a binding only the parsed one has is of a configurable the run never
  called; a scoped parameter takes its enclosing scope's binding."""
  import gin  # pylint: disable=g-import-not-at-top

  @gin.configurable('parsed_test_point')
  def point(mu=1, b=2):
    return mu, b

  @gin.configurable('parsed_test_unused')
  def unused(x=3):
    return x

  def parse(text):
    gin.clear_config()
    gin.parse_config(text)
    return gin.config_str()

  text = ('MU = 0.5\nparsed_test_point.mu = %MU\nsc/parsed_test_point.b = 7\n'
          'parsed_test_unused.x = 4\n')
  try:
    parse(text)
    point()
    with gin.config_scope('sc'):
      point()
    operative = gin.operative_config_str()
    assert 'sc/parsed_test_point.mu = %MU' in operative and 'parsed_test_unused' not in operative
    assert outputs.config_changes(operative, parse(text), parsed=True) == []
    assert outputs.config_changes(operative, parse(text.replace('0.5', '0.7').replace(
        'sc/parsed_test_point.b = 7\n', '')), parsed=True) == [
            ('MU', '0.5', '0.7'), ('sc/parsed_test_point.b', '7', outputs.ABSENT)]
    assert outputs.config_changes(operative, parse(text.replace('sc/', '')), parsed=True) == [
        ('parsed_test_point.b', '2', '7')]
  finally:
    gin.clear_config()
  del unused
