"""The GPU check (`pipelines.gpu_check`): its CPU half and its refusal where there is no GPU.

The GPU half (stages 1–3 on a GPU) runs only on a GPU machine; here the bench runs CPU-only
(the same table, both columns on the CPU) and the check refuses in one line.
"""

import os
import re

import pytest
import tensorflow as tf

from helpers import assert_one_line_error
from launcher import run_program
from pipelines import bench
from pipelines import gpu_check

GPUS = tf.config.list_physical_devices('GPU')
# One row of the executors table: shape, then seconds and ratio of each of the two columns.
ROW = re.compile(r'^  (\w+ \d+x[\d-]+)\s+(\d+\.\d{3}) s \(\s*(\d+\.\d{3})x\)'
                 r'\s+(\d+\.\d{3}) s \(\s*(\d+\.\d{3})x\)$', re.M)


def test_cpu_only_check_prints_both_columns_and_the_ratio_of_the_two():
  # A 1 s budget: the first shape is timed all the same, the second is not started.
  result = run_program('pipelines.gpu_check', '--cpu_only', '--bench_shapes=mlp2:4x100,cnn2:2x10',
                       '--bench_rounds=3', '--budget_s=1', timeout=600,
                       env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3'))
  assert result.returncode == 0, result.stderr[-3000:]
  out = result.stdout
  assert 'pip CUDA libraries: ' in out and '== 1/3' not in out and '== 2/3' not in out, out
  # The bench it ran, CPU first (every ratio is to it), printed as a command to rerun.
  assert re.search(r'== 3/3 bench .*-m pipelines\.bench --executors '
                   r'--executor_shapes=mlp2:4x100,cnn2:2x10 '
                   r'--executor_baseline=fltff_vectorized_cpu --executor_variants=fltff_vectorized '
                   r'--executor_methods= --rounds=3 --executor_budget_s=1\n', out), out
  assert 'cnn2 2x10: not timed (--executor_budget_s=1 spent)' in out, out
  assert re.search(r'mlp2 4x100 round 3: fltff_vectorized_cpu \d+\.\d+ s, fltff_vectorized '
                   r'\d+\.\d+ s\n', out), out
  assert 'median of rounds 2-3, ratio to fltff_vectorized_cpu:' in out, out
  assert re.search(r'^  shape\s+fltff_vectorized_cpu\s+fltff_vectorized$', out, re.M), out
  rows = ROW.findall(out)
  assert [r[0] for r in rows] == ['mlp2 4x100'], out
  _, cpu, cpu_ratio, other, ratio = rows[0]
  cpu, cpu_ratio, other, ratio = (float(v) for v in (cpu, cpu_ratio, other, ratio))
  assert cpu_ratio == 1.0 and cpu > 0 and other > 0, out
  # The ratio is the second column over the first, to the rounding of the printed seconds.
  low, high = (other - 5e-4) / (cpu + 5e-4), (other + 5e-4) / (cpu - 5e-4)
  assert low - 5e-4 <= ratio <= high + 5e-4, out
  assert 'fltff GPU check passed' in out and '(CPU only)' in out, out


def test_the_table_gives_each_columns_ratio_to_the_baseline():
  lines = bench.executor_table(
      [('cnn2 10x600', {'fltff_vectorized_cpu': 2.0, 'fltff_vectorized_gpu': 0.5}),
       ('resnet18 10x100', {'fltff_vectorized_cpu': 4.0})],
      ['fltff_vectorized_cpu', 'fltff_vectorized_gpu'], 'fltff_vectorized_cpu')
  assert re.match(r'  shape\s+fltff_vectorized_cpu\s+fltff_vectorized_gpu$', lines[0])
  assert ROW.findall('\n'.join(lines)) == [('cnn2 10x600', '2.000', '1.000', '0.500', '0.250')]
  assert re.match(r'  resnet18 10x100\s+4\.000 s \(\s*1\.000x\)\s+-$', lines[2]), lines


@pytest.mark.gpu
@pytest.mark.skipif(bool(GPUS), reason='TensorFlow sees a GPU here')
def test_gpu_check_refuses_in_one_line_where_tensorflow_sees_no_gpu():
  result = run_program('pipelines.gpu_check', '--bench_rounds=2', timeout=300,
                       env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3'))
  line = assert_one_line_error(result, f'error: TensorFlow {tf.__version__} sees no GPU: ',
                               '--cpu_only')
  assert gpu_check.why_no_gpu(tf.sysconfig.get_build_info(), gpu_check.nvidia_library_dirs()) in (
      line)
  assert '== 2/3' not in result.stdout and '== 3/3' not in result.stdout, result.stdout


class _Driver:
  """libcuda.so.1 with a GPU (cuInit succeeds)."""

  @staticmethod
  def cuInit(flags):  # pylint: disable=invalid-name
    del flags
    return 0


def test_what_is_missing_is_named(monkeypatch, tmp_path):
  cuda_build = {'is_cuda_build': True}
  assert gpu_check.why_no_gpu({'is_cuda_build': False}, {}) == (
      'this TensorFlow is not a CUDA build')
  unloadable = set()

  def cdll(name):
    if name in unloadable:
      raise OSError(f'{name}: cannot open shared object file')
    return _Driver()

  monkeypatch.setattr(gpu_check.ctypes, 'CDLL', cdll)
  unloadable.add('libcuda.so.1')
  assert gpu_check.why_no_gpu(cuda_build, {}).startswith(
      'no NVIDIA driver: libcuda.so.1 does not load')
  unloadable.clear()
  # A driver, and the pip CUDA libraries but cuDNN (as a tree of site-packages/nvidia).
  for package in gpu_check.CUDA_LIBRARIES:
    if package != 'cudnn':
      os.makedirs(tmp_path / 'nvidia' / package / 'lib')
  dirs = gpu_check.nvidia_library_dirs([str(tmp_path / 'nvidia')])
  assert dirs['cublas'] == str(tmp_path / 'nvidia' / 'cublas' / 'lib')
  assert gpu_check.why_no_gpu(cuda_build, dirs) == (
      'the CUDA 11.8 / cuDNN 8.7 libraries are not installed (no nvidia/cudnn in '
      'site-packages): run make setup-gpu')
  os.makedirs(tmp_path / 'nvidia' / 'cudnn' / 'lib')
  dirs = gpu_check.nvidia_library_dirs([str(tmp_path / 'nvidia')])
  unloadable.add('libcudnn.so.8')
  assert gpu_check.why_no_gpu(cuda_build, dirs).startswith(
      'libcudnn.so.8 (nvidia-cudnn-cu11) does not load: ')
  unloadable.clear()
  assert 'yet TensorFlow registered no GPU' in gpu_check.why_no_gpu(cuda_build, dirs)


def test_the_pip_cuda_libraries_go_first_on_the_library_path():
  env = gpu_check.cuda_environment({'LD_LIBRARY_PATH': '/b:/opt/x', 'CUDA_CACHE_MAXSIZE': '1'},
                                   ['/a', '/b'])
  assert env['LD_LIBRARY_PATH'] == '/a:/b:/opt/x'  # /b was there: not twice.
  assert env['CUDA_MODULE_LOADING'] == 'LAZY'
  assert env['CUDA_CACHE_MAXSIZE'] == '1'  # A value already set wins.
  assert 'LD_LIBRARY_PATH' not in gpu_check.cuda_environment({}, [])
