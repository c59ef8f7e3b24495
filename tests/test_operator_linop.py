"""linear_operator's own test suites run against :class:`kgp.operators.KernelOperator`.

The oracle (``evaluate_linear_op``) is an independent, differentiable dense evaluation built from the
operator's representation tensors: pairwise differences (not the augmented GEMM the operator uses) for
the fast families, and the GPyTorch kernel's own ``forward`` (``torch.func.functional_call`` with the
operator's parameter tensors) for the generic fallback. Gradients of every inherited test are therefore
checked against autograd through a formula that shares no code with the operator.
"""

from __future__ import annotations

import math
import unittest

import gpytorch
import torch
from linear_operator.test.linear_operator_test_case import (
    LinearOperatorTestCase,
    RectangularLinearOperatorTestCase,
)

from kgp.operators import KernelOperator, kernel_operator


def reference_dense(op: KernelOperator) -> torch.Tensor:
    """Dense, differentiable K(x1, x2) (transposed if the operator is) from the representation."""
    x1, x2, hypers, formula = op.x1, op.x2, op.hypers, op.formula
    family = formula.family
    if family == "generic":
        params = dict(zip(formula.param_names, hypers))
        out = torch.func.functional_call(op.kernel, params, (x1, x2))
        out = out.to_dense() if not torch.is_tensor(out) else out
    else:
        shape = hypers[0]
        if family in ("rbf", "matern12", "matern32", "matern52"):
            diff = (x1.unsqueeze(1) - x2.unsqueeze(0)) / shape.reshape(-1)
            d2 = diff.pow(2).sum(-1)
            if family == "rbf":
                out = torch.exp(-0.5 * d2)
            else:
                # clamp as GPyTorch does: keeps d sqrt / d d2 finite on the diagonal of K(X, X)
                r = d2.clamp_min(1e-30).sqrt()
                if family == "matern12":
                    out = torch.exp(-r)
                elif family == "matern32":
                    out = (1 + math.sqrt(3) * r) * torch.exp(-math.sqrt(3) * r)
                else:
                    out = (1 + math.sqrt(5) * r + 5.0 / 3.0 * r * r) * torch.exp(-math.sqrt(5) * r)
        elif family == "linear":
            out = shape.reshape(()) * (x1 @ x2.T)
        else:
            out = (x1 @ x2.T + shape.reshape(())).pow(formula.power)
        if formula.scaled:
            out = out * hypers[1].reshape(())
    return out.T if op.transposed else out


def make_kernel(name: str, d: int) -> gpytorch.kernels.Kernel:
    if name == "rbf":
        k = gpytorch.kernels.RBFKernel()
        k.lengthscale = 1.3
    elif name == "scale_rbf_ard":
        k = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=d))
        k.base_kernel.lengthscale = torch.linspace(0.8, 1.6, d)
        k.outputscale = 0.5
    elif name.startswith("matern"):
        nu = {"matern12": 0.5, "matern32": 1.5, "matern52": 2.5}[name]
        k = gpytorch.kernels.MaternKernel(nu=nu)
        k.lengthscale = 1.1
    elif name == "scale_matern32":
        k = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=1.5))
        k.base_kernel.lengthscale = 0.9
        k.outputscale = 0.6
    elif name == "linear":
        k = gpytorch.kernels.LinearKernel()
        k.variance = 0.7
    elif name == "polynomial":
        k = gpytorch.kernels.PolynomialKernel(power=2)
        k.offset = 0.5
    elif name == "periodic":
        k = gpytorch.kernels.PeriodicKernel()
        k.lengthscale = 1.2
        k.period_length = 2.5
    else:
        raise KeyError(name)
    return k


class _KernelOpMixin:
    seed = 0
    kernel_name = "rbf"
    dtype = torch.float32
    n, m, d = 9, 6, 3
    square = False

    def setUp(self):
        self._default_dtype = torch.get_default_dtype()
        # linear_operator's tests draw right-hand sides with torch.randn in the default dtype
        torch.set_default_dtype(self.dtype)
        super().setUp()

    def tearDown(self):
        super().tearDown()
        torch.set_default_dtype(self._default_dtype)

    def create_linear_op(self):
        gen = torch.Generator().manual_seed(11)
        x1 = torch.randn(self.n, self.d, generator=gen, dtype=self.dtype)
        kernel = make_kernel(self.kernel_name, self.d).to(self.dtype)
        if self.square:
            return kernel_operator(kernel, x1)
        x2 = torch.randn(self.m, self.d, generator=gen, dtype=self.dtype)
        return kernel_operator(kernel, x1, x2)

    def evaluate_linear_op(self, linear_op):
        return reference_dense(linear_op)


# --------------------------------------------------------------------- rectangular K(X, Z)
class TestRectRBF(_KernelOpMixin, RectangularLinearOperatorTestCase, unittest.TestCase):
    kernel_name = "rbf"


class TestRectRBFDouble(_KernelOpMixin, RectangularLinearOperatorTestCase, unittest.TestCase):
    kernel_name = "rbf"
    dtype = torch.float64


class TestRectScaleRBFARD(_KernelOpMixin, RectangularLinearOperatorTestCase, unittest.TestCase):
    kernel_name = "scale_rbf_ard"


class TestRectMatern12(_KernelOpMixin, RectangularLinearOperatorTestCase, unittest.TestCase):
    kernel_name = "matern12"


class TestRectScaleMatern32Double(_KernelOpMixin, RectangularLinearOperatorTestCase, unittest.TestCase):
    kernel_name = "scale_matern32"
    dtype = torch.float64


class TestRectMatern52(_KernelOpMixin, RectangularLinearOperatorTestCase, unittest.TestCase):
    kernel_name = "matern52"


class TestRectLinear(_KernelOpMixin, RectangularLinearOperatorTestCase, unittest.TestCase):
    kernel_name = "linear"


class TestRectPolynomial(_KernelOpMixin, RectangularLinearOperatorTestCase, unittest.TestCase):
    kernel_name = "polynomial"


class TestRectPeriodicGeneric(_KernelOpMixin, RectangularLinearOperatorTestCase, unittest.TestCase):
    kernel_name = "periodic"


# --------------------------------------------------------------------- square K(X, X)
class _Square(_KernelOpMixin):
    square = True
    n = 8
    d = 3


class TestSquareRBF(_Square, LinearOperatorTestCase, unittest.TestCase):
    kernel_name = "rbf"


class TestSquareScaleRBFARDDouble(_Square, LinearOperatorTestCase, unittest.TestCase):
    kernel_name = "scale_rbf_ard"
    dtype = torch.float64


class TestSquareMatern52Double(_Square, LinearOperatorTestCase, unittest.TestCase):
    kernel_name = "matern52"
    dtype = torch.float64


class TestSquareMatern12(_Square, LinearOperatorTestCase, unittest.TestCase):
    kernel_name = "matern12"


class TestSquarePeriodicGeneric(_Square, LinearOperatorTestCase, unittest.TestCase):
    kernel_name = "periodic"
    dtype = torch.float64
