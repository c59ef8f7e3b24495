"""Describe GPyTorch kernels as plain data, so saved models need no pickled code.

A spec is a dict of strings, numbers and lists: the class name inside ``gpytorch.kernels``, the
constructor arguments that shape the parameters, and the specs of child kernels. Hyperparameter
values travel separately as the kernel's ``state_dict``.
"""

from __future__ import annotations

from typing import Any

import gpytorch

__all__ = ["kernel_from_spec", "kernel_to_spec"]

# Constructor arguments (beyond ard_num_dims / active_dims / batch_shape) that change the shape or
# meaning of a kernel's parameters, per class.
_EXTRA_ARGS = {
    "MaternKernel": ("nu",),
    "PolynomialKernel": ("power",),
    "PolynomialKernelGrad": ("power",),
    "SpectralMixtureKernel": ("num_mixtures",),
    "RQKernel": (),
    "PeriodicKernel": (),
    "CosineKernel": (),
    "LinearKernel": (),
    "RBFKernel": (),
    "ScaleKernel": (),
    "AdditiveKernel": (),
    "ProductKernel": (),
}


def kernel_to_spec(kernel: gpytorch.kernels.Kernel) -> dict[str, Any]:
    """Return a plain-data description of ``kernel``.

    Raises
    ------
    TypeError
        For kernels outside ``gpytorch.kernels`` or with constructor arguments kgp cannot record.
    """
    cls = type(kernel)
    name = cls.__name__
    if getattr(gpytorch.kernels, name, None) is not cls or name not in _EXTRA_ARGS:
        supported = ", ".join(sorted(_EXTRA_ARGS))
        raise TypeError(
            f"kernel: cannot save a {cls.__module__}.{name}; saving supports these gpytorch kernels: {supported}"
        )
    spec: dict[str, Any] = {"class": name, "kwargs": {}}
    kwargs = spec["kwargs"]
    if kernel.ard_num_dims is not None:
        kwargs["ard_num_dims"] = int(kernel.ard_num_dims)
    if kernel.active_dims is not None:
        kwargs["active_dims"] = [int(i) for i in kernel.active_dims.tolist()]
    if len(kernel.batch_shape):
        kwargs["batch_shape"] = [int(s) for s in kernel.batch_shape]
    for arg in _EXTRA_ARGS[name]:
        value = getattr(kernel, arg)
        kwargs[arg] = value.item() if hasattr(value, "item") else value
    if name == "ScaleKernel":
        spec["children"] = [kernel_to_spec(kernel.base_kernel)]
    elif name in ("AdditiveKernel", "ProductKernel"):
        spec["children"] = [kernel_to_spec(k) for k in kernel.kernels]
    return spec


def kernel_from_spec(spec: dict[str, Any]) -> gpytorch.kernels.Kernel:
    """Rebuild a kernel (with initial hyperparameters) from :func:`kernel_to_spec` output."""
    name = spec.get("class")
    if name not in _EXTRA_ARGS or not hasattr(gpytorch.kernels, name):
        raise ValueError(f"model file: unknown kernel class {name!r}")
    cls = getattr(gpytorch.kernels, name)
    kwargs = dict(spec.get("kwargs", {}))
    if "batch_shape" in kwargs:
        import torch

        kwargs["batch_shape"] = torch.Size(kwargs["batch_shape"])
    children = [kernel_from_spec(c) for c in spec.get("children", [])]
    if name == "ScaleKernel":
        return cls(children[0], **kwargs)
    if name in ("AdditiveKernel", "ProductKernel"):
        return cls(*children, **kwargs)
    return cls(**kwargs)
