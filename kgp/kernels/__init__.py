"""Kernel helpers: shortcut names, fast-path recipes and (de)serialisation of GPyTorch kernels."""

from .recipes import KernelRecipe, recipe_for
from .shortcuts import KERNEL_SHORTCUTS, make_kernel

__all__ = ["KERNEL_SHORTCUTS", "KernelRecipe", "make_kernel", "recipe_for"]
