"""Kernel helpers: shortcut names, fast-path recipes and (de)serialisation of GPyTorch kernels."""

from .recipes import KernelParameters, KernelRecipe, kernel_parameters, recipe_for
from .shortcuts import KERNEL_SHORTCUTS, make_kernel

__all__ = ["KERNEL_SHORTCUTS", "KernelParameters", "KernelRecipe", "kernel_parameters", "make_kernel", "recipe_for"]
