"""Load a file of Triton kernels in interpreter mode (CPU tensors) or compiled mode (CUDA tensors).

Triton decides at import whether `@triton.jit` functions are interpreted. Loading the file twice, once in each
mode, gives kernels for both devices in one process, whatever `TRITON_INTERPRET` says.

Before an interpreted copy is loaded, `_fix_interpreter_index` mends Triton's interpreter for numpy >= 2.4 where
it needs it (Triton 3.6 with numpy 2.4 or newer; the compiled path is not affected).
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
        if interpret:
            _fix_interpreter_index()
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


def _fix_interpreter_index() -> None:
    """Let the interpreter's scalars be used as indices (`range(n)` of a runtime int) under numpy >= 2.4.

    Triton's interpreter holds a scalar as a 1-element array of shape `(1,)` and gives `tl.tensor` an `__index__`
    of `int(data)`; in Triton 3.6 (3.9 squeezes it first) that is `int()` of a 1-dim array, which numpy 2.4 refuses
    ("only 0-dimensional arrays can be converted to Python scalars"; numpy 1.25 to 2.3 warn each time). Where this
    numpy refuses or warns, the interpreter's tensor patching is wrapped to set the squeezing `__index__` after its
    own (it is restored with the interpreter's other patches when a launch ends). Applied once per process; nothing
    changes for the compiled kernels, or where numpy converts 1-element arrays silently.
    """
    import warnings

    import numpy as np
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "reshard_index_fix", False):
        return
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # numpy 1.25-2.3 warn for each such conversion
        try:
            int(np.zeros(1, dtype=np.int32))
            return  # this numpy converts a 1-element array silently
        except (TypeError, DeprecationWarning):
            pass

    def patch_lang_tensor(tensor: type, *args: object, **kwargs: object) -> None:
        original(tensor, *args, **kwargs)
        index = lambda self: int(self.handle.data.reshape(()))  # noqa: E731
        scope = args[0] if args else kwargs.get("scope")
        if scope is not None and hasattr(scope, "set_attr"):
            scope.set_attr(tensor, "__index__", index)
        else:
            tensor.__index__ = index

    patch_lang_tensor.reshard_index_fix = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patch_lang_tensor
