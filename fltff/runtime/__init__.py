"""Execution contexts: TFF's local C++ runtime or a remote TFF worker, with clean shutdown."""

from fltff.runtime.local import TffRuntime
from fltff.runtime.local import WorkerLostError
from fltff.runtime.local import WorkerProcess
from fltff.runtime.local import install_signal_handlers
from fltff.runtime.local import local_runtime
from fltff.runtime.local import make_runtime
from fltff.runtime.local import release_default_context
from fltff.runtime.local import StopSignal
from fltff.runtime.local import worker_binary_path

__all__ = [
    'install_signal_handlers',
    'local_runtime',
    'make_runtime',
    'release_default_context',
    'StopSignal',
    'TffRuntime',
    'worker_binary_path',
    'WorkerLostError',
    'WorkerProcess',
]
