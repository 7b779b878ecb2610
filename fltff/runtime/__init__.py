"""Where TFF computations execute: one `Runtime` class per executor (`runtimes.py`), the worker
processes they own (`processes.py`) and their gRPC channels (`channels.py`)."""

from fltff.runtime.channels import WorkerLostError
from fltff.runtime.channels import release_default_context
from fltff.runtime.processes import WorkerProcess
from fltff.runtime.processes import worker_binary_path
from fltff.runtime.runtimes import AutoRuntime
from fltff.runtime.runtimes import InProcessRuntime
from fltff.runtime.runtimes import LocalWorkerRuntime
from fltff.runtime.runtimes import make_runtime
from fltff.runtime.runtimes import RemoteWorkersRuntime
from fltff.runtime.runtimes import Runtime

__all__ = [
    'AutoRuntime',
    'InProcessRuntime',
    'LocalWorkerRuntime',
    'make_runtime',
    'release_default_context',
    'RemoteWorkersRuntime',
    'Runtime',
    'worker_binary_path',
    'WorkerLostError',
    'WorkerProcess',
]
