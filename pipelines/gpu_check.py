r"""The GPU check: whether fltff runs on this machine's GPU, and how fast against its CPU.

  bash .ci/gpu                       # make setup, make setup-gpu, then this module
  python -m pipelines.gpu_check [--bench_rounds=3] [--bench_shapes=cnn2:10x600,resnet18:10x100]
  python -m pipelines.gpu_check --cpu_only --bench_shapes=mlp2:2x20 --bench_rounds=2

In a checkout whose .venv has the GPU libraries (`make setup-gpu`), in three stages:
1. device: the GPU TensorFlow sees, or one `error:` line saying what is missing (no NVIDIA
   driver, the CUDA 11.8 / cuDNN 8.7 libraries not installed or not loadable), exit status 2;
2. tests: the tests marked `gpu` (`pytest -m gpu tests`: GPU rounds equal the CPU's);
3. bench: vectorised FedAvg rounds on '/GPU:0' against the same rounds on this machine's CPU
   ('/CPU:0'), per --bench_shapes entry, timed alternately in one process (`pipelines.bench
   --executors --executor_baseline=fltff_vectorized_cpu --executor_variants=fltff_vectorized_gpu`):
   seconds per round (median of rounds 2 to --bench_rounds; the first traces) and their ratio
   GPU/CPU.
The exit status is 0 only if every stage passed.

--cpu_only skips stages 1 and 2 and times the bench's second column on TensorFlow's choice of
device with every GPU hidden, i.e. the CPU again: the same table on any machine, for the test
suite (an A/A run, so its ratios show the machine's noise).

The CUDA libraries come from pip (`nvidia-*-cu11` in site-packages/nvidia/*/lib): the check puts
those folders on LD_LIBRARY_PATH (re-running itself, since the loader reads it at start), sets
CUDA_MODULE_LOADING=LAZY (TensorFlow 2.14 has no kernels built for compute capability 9.0, so
the driver compiles each one from PTX; lazily, only those used) and a 4 GiB CUDA_CACHE_MAXSIZE
(the compiled kernels kept for the later stages), each unless already set.
"""

import ctypes
import glob
import importlib.util
import os
import shutil
import subprocess
import sys
import time
from typing import Mapping, Optional, Sequence

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')  # As the bench: its reasons are said here.

from absl import flags  # pylint: disable=g-import-not-at-top,wrong-import-position

_SHAPES = flags.DEFINE_list(
    'bench_shapes', ['cnn2:10x600', 'resnet18:10x100', 'cnn2:100x60', 'resnet18:100x10'],
    'model:CLIENTSxEXAMPLES entries to time (pipelines.bench --executor_shapes): resnet18 on '
    'CIFAR-shaped images, the others MNIST-shaped.')
_ROUNDS = flags.DEFINE_integer('bench_rounds', 3, 'FedAvg rounds per shape and device (the '
                               'first traces and is left out of the median).')
_CPU_ONLY = flags.DEFINE_bool('cpu_only', False, 'Skip the device check and the GPU tests; time '
                              'the bench with every GPU hidden (its second column on the CPU).')
_TESTS = flags.DEFINE_bool('tests', True, 'Run the tests marked gpu (--notests: skip them).')
_BUDGET = flags.DEFINE_float(
    'budget_s', 420.0, 'The bench starts no further shape once the check has run this long '
    '(counted from FLTFF_GPU_CHECK_START, epoch seconds, which .ci/gpu sets before the setup; '
    'else from this program\'s start); a shape started runs to its end. 0: no limit.')

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The pip packages (site-packages/nvidia/<name>/lib) whose libraries TensorFlow 2.14 opens to
# register a GPU, with those libraries' sonames.
CUDA_LIBRARIES = {'cuda_runtime': 'libcudart.so.11.0', 'cublas': 'libcublas.so.11',
                  'cufft': 'libcufft.so.10', 'cusolver': 'libcusolver.so.11',
                  'cusparse': 'libcusparse.so.11', 'cudnn': 'libcudnn.so.8'}
CUDA_DEFAULTS = {'CUDA_MODULE_LOADING': 'LAZY', 'CUDA_CACHE_MAXSIZE': str(4 << 30)}
_RESTARTED = 'FLTFF_GPU_CHECK_RESTARTED'


def nvidia_library_dirs(roots: Optional[Sequence[str]] = None) -> dict[str, str]:
  """`{package: its lib folder}` of the pip-installed NVIDIA libraries under `roots` (default:
  where the `nvidia` package is installed), e.g. `{'cudnn': '.../nvidia/cudnn/lib'}`."""
  if roots is None:
    spec = importlib.util.find_spec('nvidia')
    roots = list(spec.submodule_search_locations or []) if spec else []
  dirs = {}
  for root in roots:
    for lib in sorted(glob.glob(os.path.join(root, '*', 'lib'))):
      dirs.setdefault(os.path.basename(os.path.dirname(lib)), lib)
  return dirs


def cuda_environment(environ: Mapping[str, str], library_dirs: Sequence[str]) -> dict[str, str]:
  """`environ` with `library_dirs` first on LD_LIBRARY_PATH (those not on it already) and the
  CUDA settings of `CUDA_DEFAULTS` where unset."""
  env = dict(environ)
  path = [p for p in env.get('LD_LIBRARY_PATH', '').split(':') if p]
  missing = [d for d in library_dirs if d not in path]
  if missing:
    env['LD_LIBRARY_PATH'] = ':'.join(missing + path)
  for name, value in CUDA_DEFAULTS.items():
    env.setdefault(name, value)
  return env


def why_no_gpu(build_info: Mapping, library_dirs: Mapping[str, str]) -> str:
  """The first missing piece of a GPU TensorFlow 2.14 can use, in words."""
  if not build_info.get('is_cuda_build'):
    return 'this TensorFlow is not a CUDA build'
  try:
    cuda = ctypes.CDLL('libcuda.so.1')
  except OSError:
    smi = shutil.which('nvidia-smi')
    return ('no NVIDIA driver: libcuda.so.1 does not load'
            + (f' (though {smi} exists)' if smi else ' and there is no nvidia-smi'))
  status = cuda.cuInit(0)
  if status != 0:
    visible = os.environ.get('CUDA_VISIBLE_DEVICES')
    return (f'the NVIDIA driver gives no usable GPU (cuInit error {status}'
            + (f'; CUDA_VISIBLE_DEVICES={visible!r}' if visible is not None else '') + ')')
  missing = [p for p in CUDA_LIBRARIES if p not in library_dirs]
  if missing:
    return ('the CUDA 11.8 / cuDNN 8.7 libraries are not installed (no nvidia/'
            + ', nvidia/'.join(missing) + ' in site-packages): run make setup-gpu')
  for package, soname in CUDA_LIBRARIES.items():
    try:
      ctypes.CDLL(soname)
    except OSError as e:
      return f'{soname} (nvidia-{package.replace("_", "-")}-cu11) does not load: {e}'
  return ('the driver and the CUDA libraries load, yet TensorFlow registered no GPU: rerun with '
          "TF_CPP_MIN_LOG_LEVEL=0 for TensorFlow's reason")


def describe_gpu() -> Optional[str]:
  """A few lines on the GPU TensorFlow sees and how it will run there; None if it sees none
  (then `why_no_gpu` says why)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  gpus = tf.config.list_physical_devices('GPU')
  if not gpus:
    return None
  details = tf.config.experimental.get_device_details(gpus[0])
  build = tf.sysconfig.get_build_info()
  major, minor = details.get('compute_capability', (0, 0))
  built = build.get('cuda_compute_capabilities', [])
  lines = [f'GPU: {details.get("device_name", gpus[0].name)}, compute capability {major}.{minor} '
           f'({len(gpus)} visible; the bench uses /GPU:0); TensorFlow {tf.__version__} built '
           f'for CUDA {build.get("cuda_version")}, cuDNN {build.get("cudnn_version")}, '
           f'kernels {", ".join(built)}']
  if f'sm_{major}{minor}' not in built:
    lines.append(f'  no kernels built for {major}.{minor}: the driver compiles them from PTX on '
                 f'first use (CUDA_MODULE_LOADING={os.environ.get("CUDA_MODULE_LOADING")}, '
                 f'cache ~/.nv/ComputeCache up to CUDA_CACHE_MAXSIZE='
                 f'{os.environ.get("CUDA_CACHE_MAXSIZE")}), so first rounds are slower')
  lines.append('  TensorFloat-32 for float32 matmuls and convolutions: '
               + ('on (TensorFlow\'s default)' if
                  tf.config.experimental.tensor_float_32_execution_enabled() else 'off'))
  return '\n'.join(lines)


def _cpu_name() -> str:
  try:
    with open('/proc/cpuinfo') as f:
      names = [l.split(':', 1)[1].strip() for l in f if l.startswith('model name')]
    return names[0] if names else 'unknown CPU'
  except OSError:
    return 'unknown CPU'


def bench_command(shapes: Sequence[str], rounds: int, cpu_only: bool,
                  budget_s: float = 0.0) -> list[str]:
  """The `pipelines.bench` run of stage 3: the CPU column first (every ratio is to it)."""
  return [sys.executable, '-m', f'{__package__ or "pipelines"}.bench', '--executors',
          f'--executor_shapes={",".join(shapes)}', '--executor_baseline=fltff_vectorized_cpu',
          '--executor_variants=' + ('fltff_vectorized' if cpu_only else 'fltff_vectorized_gpu'),
          '--executor_methods=', f'--rounds={rounds}'] + (
              [f'--executor_budget_s={budget_s:.0f}'] if budget_s else [])


def _stage(title: str, command: Optional[list[str]] = None) -> None:
  print(f'\n== {title}' + (f': {" ".join(command)}' if command else ''), flush=True)


def main(argv) -> int:
  del argv
  start = time.perf_counter()
  try:  # .ci/gpu's start, before the setup.
    began = float(os.environ.get('FLTFF_GPU_CHECK_START', time.time()))
  except ValueError:
    began = time.time()
  cpu_only = _CPU_ONLY.value
  if _ROUNDS.value < 2:
    print(f'error: --bench_rounds={_ROUNDS.value}: the first round traces and is left out of '
          'the median, so the bench needs --bench_rounds=2 or more.', file=sys.stderr)
    return 2
  library_dirs = nvidia_library_dirs()
  if cpu_only:
    # The stages' environment: TensorFlow's choice of device is then the CPU.
    env = dict(os.environ, CUDA_VISIBLE_DEVICES='-1')
  else:
    env = cuda_environment(os.environ, list(library_dirs.values()))
    if (env.get('LD_LIBRARY_PATH') != os.environ.get('LD_LIBRARY_PATH')
        and not os.environ.get(_RESTARTED)):
      # The dynamic loader reads LD_LIBRARY_PATH once, at the start of a process.
      env[_RESTARTED] = '1'
      sys.stdout.flush()
      os.execve(sys.executable, [sys.executable, '-m', __spec__.name, *sys.argv[1:]], env)
    os.environ.update(env)  # Read when TensorFlow starts CUDA here (stage 1).
  print(f'fltff GPU check: {os.cpu_count()} CPU cores ({_cpu_name()}); pip CUDA libraries: '
        + (', '.join(library_dirs) or 'none'), flush=True)
  failed = []
  if not cpu_only:
    _stage('1/3 device')
    import tensorflow as tf  # pylint: disable=g-import-not-at-top

    described = describe_gpu()
    if described is None:
      print(f'error: TensorFlow {tf.__version__} sees no GPU: '
            f'{why_no_gpu(tf.sysconfig.get_build_info(), library_dirs)} (--cpu_only times the '
            'CPU half alone).', file=sys.stderr)
      return 2
    print(described, flush=True)
    if _TESTS.value:
      command = [sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider', '-m', 'gpu',
                 'tests']
      _stage('2/3 tests marked gpu', command)
      t0 = time.perf_counter()
      code = subprocess.run(command, cwd=REPO, env=env, check=False).returncode
      print(f'tests marked gpu: exit status {code} in {time.perf_counter() - t0:.0f} s',
            flush=True)
      if code != 0:
        failed.append(f'the tests marked gpu (pytest exit status {code})')
  budget = max(1.0, _BUDGET.value - (time.time() - began)) if _BUDGET.value else 0.0
  command = bench_command(_SHAPES.value, _ROUNDS.value, cpu_only, budget)
  _stage('3/3 bench' + (' (CPU only: the second column on the CPU as well)' if cpu_only else
                        ': GPU/CPU is the fltff_vectorized_gpu column\'s ratio'), command)
  t0 = time.perf_counter()
  code = subprocess.run(command, cwd=REPO, env=env, check=False).returncode
  print(f'bench: exit status {code} in {time.perf_counter() - t0:.0f} s', flush=True)
  if code != 0:
    failed.append(f'the bench (exit status {code})')
  if failed:
    print(f'error: {" and ".join(failed)} failed; see above.', file=sys.stderr)
    return 1
  print(f'\nfltff GPU check passed in {time.perf_counter() - start:.0f} s'
        + (' (CPU only)' if cpu_only else ''), flush=True)
  return 0


if __name__ == '__main__':
  from fltff.cli import run_program  # pylint: disable=g-import-not-at-top
  run_program(main)
