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
                  "idx_source.path = '/data/fmnist'")
         + 'experiment.new_parameter = 3\n')
  assert outputs.config_changes(earlier, now) == [('fedprox.mu', '1.0', '0.5')]
  assert outputs.config_changes(earlier, earlier) == []
  # Continuation lines (long lists) are one binding.
  assert outputs.config_changes('a.b = [1,\n    2]\n', 'a.b = [1, 2]\n') == []
  assert outputs.config_changes('a.b = [1,\n    2]\n', 'a.b = [1, 3]\n') == [
      ('a.b', '[1, 2]', '[1, 3]')]


def test_check_config_refuses_or_records(tmp_path):
  with open(CONFIG) as f:
    earlier = f.read()
  (tmp_path / 'config.gin').write_text(earlier)
  now = earlier.replace('experiment.seed = 0', 'experiment.seed = 1')
  outputs.check_config(str(tmp_path), now, resumed_from=None)  # Not a resume: nothing to check.
  with pytest.raises(ConfigError, match=r'experiment.seed: 0 -> 1\): rounds 1-7 were computed'):
    outputs.check_config(str(tmp_path), now, resumed_from=7)
  assert not (tmp_path / 'config_changes.txt').exists()
  outputs.check_config(str(tmp_path), now, resumed_from=7, allow_changes=True)
  assert (tmp_path / 'config_changes.txt').read_text() == (
      'resumed after round 7: experiment.seed: 0 -> 1\n')
