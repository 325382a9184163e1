"""Re-run a layer's weight post-processing after a refit wrote its loader-format tensors, keeping the storage the
engine's forward reads.

vLLM's quantization methods turn loader-format parameters into kernel format after loading
(`quant_method.process_weights_after_loading(layer)`): the CPU backend repacks every Linear weight for its GEMM
(and may leave the parameter empty), FP8 methods rewrite scales, MoE methods shuffle experts. Writing the kernel
tensors directly would leave the forward on stale data, so for such a layer:

1. the live (kernel) parameters and buffers are set aside;
2. fresh parameters holding a copy of the loader-format tensors (with the loader's attributes) are put in their
   place, and the method runs on them exactly as after a checkpoint load;
3. every resulting tensor is copied into the set-aside kernel tensor of the same name and shape, which goes back
   on the layer: pointers captured by CUDA graphs stay valid. A kernel tensor whose shape or dtype changed is an
   error naming it.

Non-tensor state that the method rebuilds (the CPU backend's GEMM closure, an MoE method's kernel with its prepacked
experts) is the method's new one.
"""

from __future__ import annotations

import torch


def reprocess_layer(layer: torch.nn.Module, loader: dict[str, tuple[torch.Tensor, dict]], name: str) -> None:
    """Rebuild `layer`'s kernel tensors from the loader-format `loader` (param name -> (tensor, attributes)).

    Args:
        layer: a live module with a `quant_method`.
        loader: its loader-format tensors (not modified: the method works on a copy).
        name: the module's name, for errors.
    """
    saved_params, saved_buffers = dict(layer._parameters), dict(layer._buffers)  # with `None` entries (bias)
    kernel_params = {n: p for n, p in saved_params.items() if p is not None}
    kernel_buffers = {n: b for n, b in saved_buffers.items() if b is not None}
    for n in kernel_params:
        del layer._parameters[n]
    for n, (tensor, attrs) in loader.items():
        p = torch.nn.Parameter(tensor.clone(), requires_grad=False)
        for k, v in attrs.items():
            setattr(p, k, v)
        layer.register_parameter(n, p)
    if hasattr(layer, "_already_called_process_weights_after_loading"):
        delattr(layer, "_already_called_process_weights_after_loading")
    if getattr(layer.quant_method, "moe_kernel", None) is not None:
        # vLLM's MoE methods treat a second call as a weight update and skip the experts' own post-processing (the
        # CPU backend's grouped-GEMM prepack), which would leave the forward on the old experts: run it as a load
        layer.quant_method.moe_kernel = None
    try:
        layer.quant_method.process_weights_after_loading(layer)
        if hasattr(layer, "update_param_tp_status"):
            layer.update_param_tp_status()
    except BaseException:
        _restore(layer, saved_params, saved_buffers)
        raise
    new_params = {n: p for n, p in layer._parameters.items() if p is not None}
    new_buffers = {n: b for n, b in layer._buffers.items() if b is not None}
    problems = []
    for kind, old, new in (("parameter", kernel_params, new_params), ("buffer", kernel_buffers, new_buffers)):
        for n, t in old.items():
            fresh = new.get(n)
            if fresh is None:
                problems.append(f"{name}.{n}: {kind} missing after re-processing")
            elif fresh.shape != t.shape or fresh.dtype != t.dtype:
                problems.append(f"{name}.{n}: {kind} is {tuple(fresh.shape)} {fresh.dtype} after re-processing, "
                                f"{tuple(t.shape)} {t.dtype} in the running engine")
            elif fresh.data_ptr() != t.data_ptr():
                t.data.copy_(fresh.data)
        extra = sorted(set(new) - set(old))
        if extra:
            problems.append(f"{name}: re-processing made {kind}s {extra} the running engine does not have")
    _restore(layer, saved_params, saved_buffers)
    if problems:
        raise RuntimeError("reshard vLLM backend: re-processing changed the engine's tensors:\n  "
                           + "\n  ".join(problems))


def _restore(layer: torch.nn.Module, params: dict, buffers: dict) -> None:
    layer._parameters.clear()
    layer._parameters.update(params)
    layer._buffers.clear()
    layer._buffers.update(buffers)
