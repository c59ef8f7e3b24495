"""Lazy kernel matrices (the one backend every solver shares)."""

from .blocks import plan_block_rows, row_slices
from .kernel_operator import KernelOperator, kernel_operator

__all__ = ["KernelOperator", "kernel_operator", "plan_block_rows", "row_slices"]
