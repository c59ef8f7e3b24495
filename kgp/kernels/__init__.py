"""Kernel helpers: shortcut names, fast-path formulas and (de)serialisation of GPyTorch kernels."""

from .formulas import KernelFormula, KernelParameters, formula_for, kernel_parameters
from .shortcuts import KERNEL_SHORTCUTS, make_kernel

__all__ = ["KERNEL_SHORTCUTS", "KernelFormula", "KernelParameters", "formula_for", "kernel_parameters", "make_kernel"]
