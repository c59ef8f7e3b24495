"""Dense Gaussian negative log likelihood with its closed-form gradient (for the ``exact`` objective).

Autograd through ``torch.linalg.cholesky`` and ``solve_triangular`` costs about four n^3 passes in
the backward (matrix products and n-column triangular solves, measured: 74 % of an ``exact`` step at
n = 1,500). The gradient has a closed form (Rasmussen & Williams 2006, eq. 5.9): for
``f(C, R) = 1/2 tr(R^T C^{-1} R) + k/2 log|C|`` with ``alpha = C^{-1} R``::

    df/dC = 1/2 (k C^{-1} - alpha alpha^T),        df/dR = alpha,

and ``C^{-1}`` comes from the Cholesky factor by :func:`kgp.linalg.inverse_from_cholesky` (a blocked
triangular inverse and ``W^T W``, ``2 n^3 / 3`` flops): 1.6-1.9x faster than ``cholesky_solve`` of the
identity (``2 n^3`` flops, used before) and 1.1-2x faster than ``cholesky_inverse`` (LAPACK ``?potri``) at
n = 2,000-5,000 on the development host; the inverse is most of an ``exact`` step.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kgp.linalg import cholesky_in_place, flush_for_cholesky, inverse_from_cholesky


class GaussianNLL(torch.autograd.Function):
    """``1/2 tr(R^T C^{-1} R) + k/2 log|C|`` with ``C = K + s I`` (``K`` n x n SPD, ``s`` the noise, 0-d).

    ``C`` is formed on one copy of ``K`` and factored where it lies, and ``dC/ds = I`` gives
    ``df/ds = tr(df/dC)``: forming ``K + s * eye(n)`` in the autograd graph cost three more ``n x n`` passes
    forward and two backward (0.10 s of a 0.9 s step at n = 3,000, development host).
    """

    @staticmethod
    def forward(ctx, K: Tensor, noise: Tensor, R: Tensor, what: str, remedy: str) -> Tensor:
        C = K.detach().clone()
        C.diagonal().add_(noise.detach().to(C.dtype))
        # entries whose products are subnormal are set to 0 (kgp.linalg.tiny_fraction; the exact solver does
        # the same): below 1e-150 of the scale in float64, and slow in the GEMMs of the factorization and of
        # the backward's inverse on some CPUs
        L = cholesky_in_place(C, what=what, remedy=remedy, flush_below=flush_for_cholesky(C))
        # two solves on the whole factor (row- or column-contiguous: no copy), where cholesky_solve copies
        # L into LAPACK's order, n^2 fresh entries a step
        alpha = torch.linalg.solve_triangular(L.mT, torch.linalg.solve_triangular(L, R, upper=False), upper=True)
        value = 0.5 * (R * alpha).sum() + R.shape[1] * torch.log(L.diagonal()).sum()
        # intermediates, kept as attributes: the backward turns L into C^{-1} in place (below), which
        # save_for_backward's version check would refuse at a second backward through the same graph
        ctx.factor, ctx.alpha, ctx.inverted = L, alpha, False
        return value

    @staticmethod
    def backward(ctx, grad: Tensor):
        alpha = ctx.alpha
        grad_K = grad_noise = grad_R = None
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
            if not ctx.inverted:
                # C^{-1} in the factor's own memory: no fresh n x n arrays but grad_C (15 ms of first touch
                # each at n = 3,000 on the development host); kept for a second backward (gradcheck)
                inverse_from_cholesky(ctx.factor, flush=True, overwrite=True)
                ctx.inverted = True
            grad_C = ctx.factor.mul(0.5 * alpha.shape[1]).addmm_(alpha, alpha.T, alpha=-0.5).mul_(grad)
            if ctx.needs_input_grad[1]:
                grad_noise = grad_C.diagonal().sum()
            if ctx.needs_input_grad[0]:
                grad_K = grad_C
        if ctx.needs_input_grad[2]:
            grad_R = alpha * grad
        return grad_K, grad_noise, grad_R, None, None


def gaussian_nll(K: Tensor, noise: Tensor, R: Tensor, *, what: str, remedy: str) -> Tensor:
    """``1/2 tr(R^T C^{-1} R) + k/2 log|C|`` for ``C = K + noise I`` (differentiable in K, noise and R).

    Raises
    ------
    NotPSDError
        If ``C`` is not numerically positive definite (``what`` names it, ``remedy`` ends the message).
    """
    if not torch.is_tensor(noise):
        noise = torch.tensor(float(noise), dtype=K.dtype, device=K.device)
    return GaussianNLL.apply(K, noise, R, what, remedy)
