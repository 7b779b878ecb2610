"""The benchmark tool runs and reports ratios (a smoke test: timings are never asserted)."""

import os
import re

import pytest
import tensorflow as tf

from helpers import run_program_here
from launcher import run_program

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize('extra,pattern', [
    ([], r'ratio fltff/plain:\s+\d+\.\d+'),
    # A personalised method with client states, vectorised (the comparison is the same for
    # every method: the plain case above and the executors bench time rounds on TFF's
    # runtimes, the latter a regularised method vectorised too).
    (['--compare=kapc+bls', '--vectorize_clients'],
     r'vectorised clients(.|\n)*'
     r'kapc\+bls\s+\d+\.\d+ s\s+ratio vs fedavg \d+\.\d+'),
    # Both in one process, as the flags allow.
    (['--runtimes', '--runtime_shapes=mlp2:4x20', '--capacity_shapes=cnn2:1x10',
      '--capacity_clients=100', '--checkpoints', '--clients=4'],
     r'mlp2:4x20: local \d+\.\d+ s \| client by client: 1 worker \d+\.\d+ s, 2 workers '
     r'\d+\.\d+ s \| vectorised: 1 worker \d+\.\d+ s, 2 workers \d+\.\d+ s \| vectorised '
     r'in process \d+\.\d+ s\n'
     r'.*vectorised on 1 worker: \d+\.\d+x .* on 2 workers \d+\.\d+x of 1 worker\n'
     r'.*vectorised 1 worker: MB to / from each worker per round: \d+\.\d+ / \d+\.\d+\n'
     r'.*vectorised 2 workers: MB to / from each worker per round: (\d+\.\d+ / \d+\.\d+, ){1}'
     r'\d+\.\d+ / \d+\.\d+(.|\n)*'
     r'cnn2:1x10: vectorised in process \d+\.\d+ s\n'
     r'\nCapacity model (.|\n)*mlp2:4x20 on 2 worker\(s\): \d+\.\d+ s / \d+\.\d+ s(.|\n)*'
     r'projection, 100 participants(.|\n)*cnn2, 10 examples a client, group means: 4 workers '
     r"\d+\.\d+ s(.|\n)*cnn2, 10 examples a client, clients' models: 4 workers \d+\.\d+ s(.|\n)*"
     r'durable:\s+\d+\.\d+ s  \(ratio to durable: 1\.000\)\n\s+without fsync:\s+\d+\.\d+ s  '
     r'\(ratio to durable: \d+\.\d+\)\n\s+durable, every state hashed:\s+\d+\.\d+ s  '
     r'\(ratio to durable: \d+\.\d+\)'),
])
def test_bench_prints_ratio(extra, pattern):
  result = run_program('pipelines.bench', '--rounds=2', '--clients=3', '--examples=20', *extra,
                       timeout=300, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3'))
  assert result.returncode == 0, result.stderr[-3000:]
  assert re.search(pattern, result.stdout), result.stdout


def test_bench_executors_prints_ratios_to_tffs_builtin():
  # Unequal clients (10, 20 and 30 examples), as a label-skewed partition makes them.
  result = run_program('pipelines.bench', '--executors', '--executor_shapes=mlp2:3x10-30',
                       '--executor_methods=fedlap', '--rounds=2', timeout=300,
                       env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3'))
  assert result.returncode == 0, result.stderr[-3000:]
  # Built-in, C++ runtime, in-process, vectorised, and the one-model floor.
  assert re.search(r'tff_builtin\s+fltff_tff_cpp\s+fltff_in_process\s+fltff_vectorized\s+'
                   r'one_model_floor\n', result.stdout), result.stdout
  assert re.search(r'mlp2 3x10-30\s+\d+\.\d+ s \(\s*1\.000x\)(\s+\d+\.\d+ s \(\s*\d+\.\d{3}x\)){4}',
                   result.stdout), result.stdout
  # The other methods, vectorised, in the same runs: to the built-in and to fltff's FedAvg.
  table = result.stdout.split('Other methods with vectorised clients')[-1]
  assert re.search(r'\s+fedlap\n', table), result.stdout
  assert re.search(r'mlp2 3x10-30\s+\d+\.\d+ s \(\s*\d+\.\d{3}x \[\s*\d+\.\d{2}x\]\)',
                   table), result.stdout
  assert re.search(r'peak RSS of this process .*: \d+ MiB', result.stdout), result.stdout


def test_bench_executors_refuses_an_unknown_variant_or_method_in_one_line():
  # In this process: the flags are checked before any work.
  result = run_program_here('pipelines.bench', '--executors', '--executor_variants=fltff_tpu')
  assert result.returncode == 2
  assert "error: --executor_variants ['fltff_tpu']" in result.stderr, result.stderr[-2000:]
  result = run_program_here('pipelines.bench', '--executors', '--executor_baseline=fltff_tpu')
  assert result.returncode == 2
  assert "error: --executor_baseline 'fltff_tpu': tff_builtin or one of" in result.stderr, (
      result.stderr[-2000:])
  result = run_program_here('pipelines.bench', '--executors', '--executor_methods=fedsgd')
  assert result.returncode == 2
  assert "error: --executor_methods ['fedsgd']: choose from" in result.stderr, (
      result.stderr[-2000:])
  result = run_program_here('pipelines.bench', '--executors', '--rounds=1')
  assert result.returncode == 2
  assert 'error: --rounds=1: the first round traces' in result.stderr, result.stderr[-2000:]
  result = run_program_here('pipelines.bench', '--executors', '--executor_shapes=mlp2:3x30-0')
  assert result.returncode == 2
  assert ("error: --executor_shapes entry 'mlp2:3x30-0' is not model:CLIENTSxEXAMPLES or "
          'model:CLIENTSxFEWEST-MOST') in result.stderr, result.stderr[-2000:]
  assert 'Traceback' not in result.stderr


@pytest.mark.gpu
@pytest.mark.skipif(bool(tf.config.list_physical_devices('GPU')),
                    reason='TensorFlow sees a GPU here')
def test_bench_gpu_variant_is_refused_in_one_line_without_a_gpu():
  for flag in ('--executor_variants=fltff_vectorized_gpu',
               '--executor_baseline=fltff_vectorized_gpu'):
    result = run_program_here('pipelines.bench', '--executors', flag)
    assert result.returncode == 2
    assert ("error: fltff_vectorized_gpu: runtime.device = 'gpu' but TensorFlow sees no GPU"
            in result.stderr), result.stderr[-2000:]
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr[-2000:]


def test_short_soak_driver_memory_does_not_grow_per_round():
  """20 rounds of fltff's FedAvg pipeline: the driver grew +0.42 MiB/round with a traced
  `Dataset.map` per client per round; a quarter of that fails the test."""
  result = run_program('pipelines.bench', '--memory=fedavg', '--memory_rounds=20', timeout=600,
                       env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3'))
  assert result.returncode == 0, result.stderr[-3000:]
  match = re.search(r'fedavg: driver \d+ -> \d+ MiB \(([-+]\d+\.\d+) MiB/round, '
                    r'anonymous ([-+]\d+\.\d+)\)', result.stdout)
  assert match, result.stdout
  assert float(match.group(1)) < 0.105, result.stdout
  assert float(match.group(2)) < 0.105, result.stdout


def test_executor_shapes_give_resnet18_cifar_images_as_the_pytorch_reference_does():
  from pipelines import bench  # pylint: disable=g-import-not-at-top
  from pipelines import torch_reference  # pylint: disable=g-import-not-at-top

  assert bench._parse_shape('cnn2:10x100-1100') == ('cnn2', 10, (100, 1100))  # pylint: disable=protected-access
  assert bench.input_shape('resnet18') == (32, 32, 3)
  assert bench.input_shape('cnn2_bn') == bench.input_shape('mlp2') == (28, 28, 1)
  for model in torch_reference.MODELS:  # The same images, channels first there.
    height, width, channels = bench.input_shape(model)
    assert torch_reference.input_shape(model) == (channels, height, width)
