# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""A stand-in ``torch_npu`` for the runtime calls of the NPU path: device and memory (``torch.npu``), the profiler,
ATB registration and the HCCL process-group class, modelled on torch_npu 2.8.0's Python sources.

- Runtime initialisation as torch_npu keeps it (``torch_npu/npu/__init__.py``): the functions for which torch_npu
  runs ``_lazy_init()`` initialise the runtime of the process (``set_device``: its C++ binding runs
  ``npu_lazy_init``; ``synchronize`` utils.py:70; ``current_device`` utils.py:95; ``mem_get_info`` __init__.py:463;
  ``current_stream`` / ``default_stream`` utils.py:266, 281); ``empty_cache`` and the ``memory_stats`` family do
  nothing / return nothing before initialisation (memory.py:158, 246); ``get_device_name`` and ``config`` setters
  do not initialise (__init__.py:442-446, npu_config.py:139-144). After a ``multiprocessing`` fork of an initialised
  process, the child's first initialising call raises (``_after_fork`` __init__.py:265-273, registered with
  ``multiprocessing.util.register_after_fork``; the raise at lines 246-249). Every call is logged in ``calls``.
- ``profiler``: ``profile``, ``_ExperimentalConfig`` and ``tensorboard_trace_handler`` check each call against the
  parameters of the wheel's own definitions (``profiler/profiler.py``, ``profiler/experimental_config.py``, read
  from the wheel with ``ast``), and record what they were given.
- ``op_plugin.atb._atb_ops._register_atb_extensions``: raises the configured load error (torch_npu raises its
  ``NNAL_EX``, an ``OSError``, _atb_ops.py:83-87) or records the registration; ``_npu_matmul_add_fp32`` records the
  warm-up call.
- ``_C._distributed_c10d.ProcessGroupHCCL``: records its construction and ``Options``, and is accepted by
  ``ProcessGroup._register_backend`` as a real c10d backend (it is a :class:`torch.distributed.ProcessGroupGloo`
  underneath, so the group works on CPU tensors).

:func:`install` puts it in ``sys.modules`` (and ``torch.npu``, ``torch.distributed.is_hccl_available``) for a whole
process (subprocess scripts); :func:`install_for_test` does the same through pytest's ``monkeypatch``.
"""

from __future__ import annotations

import ast
import enum
import functools
import importlib.machinery
import multiprocessing.util
import os
import sys
import threading
import types
import zipfile
from typing import Any

import torch

from .npu_binding_rules import BindingRuleError
from .torch_npu_docs import Signature, _signature_from_def, wheel_path

FORK_MESSAGE = "torch_npu stand-in: cannot re-initialize the NPU runtime in a forked subprocess; use 'spawn'"


@functools.cache
def wheel_signature(path: str, qualname: str) -> Signature:
    """The parameters of ``qualname`` (``func`` or ``Class.method``, ``self`` dropped) as defined in the wheel's
    ``path`` (e.g. ``torch_npu/profiler/profiler.py``)."""
    with zipfile.ZipFile(wheel_path()) as zf:
        tree = ast.parse(zf.read(path).decode("utf-8"))
    scope: list[ast.stmt] = tree.body
    *outer, name = qualname.split(".")
    for part in outer:
        scope = next(n for n in scope if isinstance(n, ast.ClassDef) and n.name == part).body
    fn = next(n for n in scope if isinstance(n, ast.FunctionDef) and n.name == name)
    sig = _signature_from_def(qualname, fn)
    if outer:  # a method: drop self
        sig = Signature(sig.name, sig.params[1:], None, "wheel", sig.text, sig.var_positional, sig.var_keyword)
    return sig


def _checked(path: str, qualname: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    problems = wheel_signature(path, qualname).problems(len(args), list(kwargs))
    if problems:
        raise BindingRuleError(f"torch_npu.{qualname}: {'; '.join(problems)} [source: torch_npu 2.8.0 wheel {path}]")


class RuntimeState:
    """torch_npu's per-process runtime flags and a log of every runtime call."""

    def __init__(self) -> None:
        self.initialized = False
        self.bad_fork = False
        self.pid: int | None = None
        self.calls: list[str] = []
        self.lock = threading.Lock()

    def lazy_init(self) -> None:
        if self.initialized:
            return
        with self.lock:
            if self.initialized:
                return
            if self.bad_fork:
                raise RuntimeError(FORK_MESSAGE)
            self.pid = os.getpid()
            self.initialized = True

    def after_fork(self) -> None:
        if self.initialized and self.pid != os.getpid():
            self.initialized = False
            self.bad_fork = True
        self.lock = threading.Lock()

    def initialising_calls(self) -> list[str]:
        return [c for c in self.calls if c in INITIALISING]


#: The stand-in's calls that run torch_npu's _lazy_init.
INITIALISING = frozenset(
    {"set_device", "synchronize", "current_device", "mem_get_info", "current_stream", "default_stream"}
)


class _Config:
    def __init__(self, state: RuntimeState) -> None:
        object.__setattr__(self, "_state", state)
        object.__setattr__(self, "options", {})

    def __setattr__(self, name: str, value: Any) -> None:  # npu_config.py:139-144: _npu_setOption, no init
        self._state.calls.append(f"config.{name}")
        self.options[name] = value


def _npu_module(state: RuntimeState, total_bytes: int) -> types.ModuleType:
    npu = types.ModuleType("torch_npu.npu")

    def initialising(name: str, result: Any = None) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            state.calls.append(name)
            state.lazy_init()
            return result(*args, **kwargs) if callable(result) else result

        call.__name__ = name
        return call

    def guarded(name: str, result: Any) -> Any:  # memory.py: nothing before initialisation
        def call(*args: Any, **kwargs: Any) -> Any:
            state.calls.append(name)
            return result if state.initialized and not state.bad_fork else type(result)()

        call.__name__ = name
        return call

    npu._lazy_init = state.lazy_init  # type: ignore[attr-defined]
    npu.is_initialized = lambda: state.initialized and not state.bad_fork  # type: ignore[attr-defined]
    npu.set_device = initialising("set_device")  # type: ignore[attr-defined]
    npu.synchronize = initialising("synchronize")  # type: ignore[attr-defined]
    npu.current_device = initialising("current_device", 0)  # type: ignore[attr-defined]
    npu.mem_get_info = initialising("mem_get_info", lambda device=None: (total_bytes // 2, total_bytes))  # type: ignore[attr-defined]
    npu.current_stream = initialising("current_stream", lambda device=None: object())  # type: ignore[attr-defined]
    npu.default_stream = initialising("default_stream", lambda device=None: object())  # type: ignore[attr-defined]
    npu.empty_cache = guarded("empty_cache", None)  # type: ignore[attr-defined]
    npu.memory_stats = guarded("memory_stats", {"allocated_bytes.all.peak": 1 << 20})  # type: ignore[attr-defined]
    npu.memory_allocated = guarded("memory_allocated", 1 << 20)  # type: ignore[attr-defined]
    npu.memory_reserved = guarded("memory_reserved", 2 << 20)  # type: ignore[attr-defined]
    npu.max_memory_allocated = guarded("max_memory_allocated", 1 << 20)  # type: ignore[attr-defined]
    npu.reset_peak_memory_stats = guarded("reset_peak_memory_stats", None)  # type: ignore[attr-defined]

    def get_device_name(device_name: Any = None) -> str:
        state.calls.append("get_device_name")
        return "Ascend910B3"

    npu.get_device_name = get_device_name  # type: ignore[attr-defined]
    npu.config = _Config(state)  # type: ignore[attr-defined]
    # Not initialising in torch_npu either (device_count: __init__.py:415-427). is_available answers False so that
    # libraries probing for an NPU (transformers' npu_flash_attention integration) stay on their CPU paths and never
    # import kernels this stand-in does not have.
    npu.device_count = lambda: 1  # type: ignore[attr-defined]
    npu.is_available = lambda: False  # type: ignore[attr-defined]
    return npu


class ProfilerActivity(enum.Enum):
    CPU = 0
    NPU = 1


def _profiler_module(record: dict[str, list[Any]]) -> types.ModuleType:
    prof = types.ModuleType("torch_npu.profiler")
    cfg_path, prof_path = "torch_npu/profiler/experimental_config.py", "torch_npu/profiler/profiler.py"

    class _ExperimentalConfig:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            _checked(cfg_path, "_ExperimentalConfig.__init__", args, kwargs)
            self.kwargs = kwargs
            record["experimental_config"].append(kwargs)

    class profile:  # noqa: N801  (torch_npu's name)
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            _checked(prof_path, "profile.__init__", args, kwargs)
            self.kwargs = kwargs
            self.events: list[str] = []
            record["profile"].append(self)

        def start(self) -> None:
            self.events.append("start")

        def stop(self) -> None:
            self.events.append("stop")
            handler = self.kwargs.get("on_trace_ready")
            if handler is not None:
                handler(self)

    def tensorboard_trace_handler(*args: Any, **kwargs: Any) -> Any:
        _checked(prof_path, "tensorboard_trace_handler", args, kwargs)
        record["trace_handler"].append((args, kwargs))

        def handler(prof_inst: Any) -> None:
            record["traces"].append(prof_inst)

        return handler

    prof.ProfilerActivity = ProfilerActivity  # type: ignore[attr-defined]
    prof._ExperimentalConfig = _ExperimentalConfig  # type: ignore[attr-defined]
    prof.profile = profile  # type: ignore[attr-defined]
    prof.tensorboard_trace_handler = tensorboard_trace_handler  # type: ignore[attr-defined]
    # experimental_config.py:35-62: the constants vllm-ascend passes (values are torch_npu's Constant names)
    prof.ExportType = types.SimpleNamespace(Text="text", Db="db")  # type: ignore[attr-defined]
    prof.ProfilerLevel = types.SimpleNamespace(Level0="Level0", Level1="Level1", Level2="Level2")  # type: ignore[attr-defined]
    prof.AiCMetrics = types.SimpleNamespace(AiCoreNone="ACL_AICORE_NONE", PipeUtilization="ACL_AICORE_PIPE_UTILIZATION")  # type: ignore[attr-defined]
    return prof


def _hccl_class(record: dict[str, list[Any]]) -> type:
    from torch.distributed import ProcessGroupGloo

    class ProcessGroupHCCL(ProcessGroupGloo):  # type: ignore[misc]
        class Options:
            def __init__(self) -> None:
                self._timeout: Any = None

        def __init__(self, store: Any, rank: int, size: int, options: Any) -> None:
            assert isinstance(options, ProcessGroupHCCL.Options), options
            super().__init__(store, rank, size, timeout=options._timeout)
            record["hccl"].append({"rank": rank, "size": size, "timeout": options._timeout})

        def _set_sequence_number_for_group(self) -> None:
            record["hccl_calls"].append("_set_sequence_number_for_group")
            super()._set_sequence_number_for_group()

    return ProcessGroupHCCL


class StandIn:
    """The stand-in module tree and what it recorded."""

    def __init__(self, *, atb_load_error: OSError | None = None, total_bytes: int = 64 << 30) -> None:
        self.state = RuntimeState()
        self.record: dict[str, list[Any]] = {
            k: [] for k in ("experimental_config", "profile", "trace_handler", "traces", "atb", "hccl", "hccl_calls")
        }
        root = types.ModuleType("torch_npu")
        root.npu = _npu_module(self.state, total_bytes)  # type: ignore[attr-defined]
        root.profiler = _profiler_module(self.record)  # type: ignore[attr-defined]
        atb_ops = types.ModuleType("torch_npu.op_plugin.atb._atb_ops")

        def _register_atb_extensions() -> None:
            if atb_load_error is not None:
                raise atb_load_error
            self.record["atb"].append("register")

        atb_ops._register_atb_extensions = _register_atb_extensions  # type: ignore[attr-defined]

        def _npu_matmul_add_fp32(x: torch.Tensor, weight: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
            # ATB MatmulAdd: c += x^T @ weight in fp32 (shapes [k, m] fp16 x [k, n] fp16 into [m, n] fp32)
            assert x.dtype == weight.dtype == torch.float16 and c.dtype == torch.float32, (x.dtype, c.dtype)
            assert c.shape == (x.shape[1], weight.shape[1]), (x.shape, weight.shape, c.shape)
            self.record["atb"].append("_npu_matmul_add_fp32")
            return c.add_(x.float().T @ weight.float())

        root._npu_matmul_add_fp32 = _npu_matmul_add_fp32  # type: ignore[attr-defined]
        c_mod = types.ModuleType("torch_npu._C")
        c10d = types.ModuleType("torch_npu._C._distributed_c10d")
        c10d.ProcessGroupHCCL = _hccl_class(self.record)  # type: ignore[attr-defined]
        c_mod._distributed_c10d = c10d  # type: ignore[attr-defined]
        root._C = c_mod  # type: ignore[attr-defined]
        op_plugin, atb = types.ModuleType("torch_npu.op_plugin"), types.ModuleType("torch_npu.op_plugin.atb")
        atb._atb_ops = atb_ops  # type: ignore[attr-defined]
        op_plugin.atb = atb  # type: ignore[attr-defined]
        root.op_plugin = op_plugin  # type: ignore[attr-defined]
        self.module = root
        self.modules = {
            "torch_npu": root,
            "torch_npu.npu": root.npu,  # type: ignore[attr-defined]
            "torch_npu.profiler": root.profiler,  # type: ignore[attr-defined]
            "torch_npu.op_plugin": op_plugin,
            "torch_npu.op_plugin.atb": atb,
            "torch_npu.op_plugin.atb._atb_ops": atb_ops,
            "torch_npu._C": c_mod,
            "torch_npu._C._distributed_c10d": c10d,
        }
        for name, module in self.modules.items():  # importlib.util.find_spec needs a spec on sys.modules entries
            module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        multiprocessing.util.register_after_fork(self.state, RuntimeState.after_fork)


def install(**kwargs: Any) -> StandIn:
    """Install a stand-in for the rest of this process (subprocess scripts), with torch's ``npu`` device name, which
    torch_npu's import registers for the PrivateUse1 backend (irreversible, hence process-wide only)."""
    standin = StandIn(**kwargs)
    torch.utils.rename_privateuse1_backend("npu")
    sys.modules.update(standin.modules)
    torch.npu = standin.module.npu  # type: ignore[attr-defined]
    torch.distributed.is_hccl_available = lambda: True  # type: ignore[attr-defined]
    return standin


def install_for_test(monkeypatch: Any, **kwargs: Any) -> StandIn:
    """Install a stand-in until the test ends (pytest's ``monkeypatch``)."""
    standin = StandIn(**kwargs)
    for name, module in standin.modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(torch, "npu", standin.module.npu, raising=False)
    monkeypatch.setattr(torch.distributed, "is_hccl_available", lambda: True, raising=False)
    return standin
