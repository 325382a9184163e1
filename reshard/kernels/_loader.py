"""Load a file of Triton kernels in interpreter mode (CPU tensors) or compiled mode (CUDA tensors).

Triton decides at import whether `@triton.jit` functions are interpreted. Loading the file twice, once in each
mode, gives kernels for both devices in one process, whatever `TRITON_INTERPRET` says.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from types import ModuleType

_LOADED: dict[tuple[str, bool], ModuleType] = {}


def load_device_module(path: str, name: str, interpret: bool) -> ModuleType:
    """The module at `path`, registered as `name`, loaded once per (path, mode) with Triton's interpreter on or off."""
    key = (path, interpret)
    if key not in _LOADED:
        from triton import knobs

        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        with knobs.runtime.scope():
            knobs.runtime.interpret = interpret
            sys.modules[name] = module
            spec.loader.exec_module(module)
        _LOADED[key] = module
    return _LOADED[key]


def launch_in_mode(launch: Callable[..., object], interpret: bool, *args: object, **kwargs: object) -> None:
    """Call `launch` (a gridded kernel of a module copy loaded by `load_device_module`) with Triton's interpreter
    switched to the mode that copy was loaded in, whatever `TRITON_INTERPRET` says."""
    from triton import knobs

    if knobs.runtime.interpret == interpret:
        launch(*args, **kwargs)
        return
    with knobs.runtime.scope():
        knobs.runtime.interpret = interpret
        launch(*args, **kwargs)
