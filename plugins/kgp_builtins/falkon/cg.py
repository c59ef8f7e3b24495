r"""FALKON's iteration (Rudi, Carratino, Rosasco 2017, Def. 4 and Algorithm 1): preconditioned CG.

Conjugate gradient on ``W beta = b`` with ``W = B^T H B`` and ``b = B^T z`` (``H = K_nM^T K_nM +
lambda n K_MM``, ``z = K_nM^T y``), then ``alpha = B beta``. As in Algorithm 1 the ``1/sqrt(n)`` of
``B`` is folded into the operator: with ``B' = D Q T^{-1} A^{-1}`` (:class:`.Preconditioner`) CG runs on

    W' u = A^{-T} T^{-T} Q^T D K_nM^T K_nM D Q T^{-1} A^{-1} u / n + lambda A^{-T} A^{-1} u,
    b'   = A^{-T} T^{-T} Q^T D K_nM^T y / n,

whose solution ``beta' = beta / sqrt(n)`` gives ``alpha = B' beta'``. The second term of ``W'`` uses
``Q^T D K_MM D Q = T^T T``.

- One kernel pass per iteration: ``K_nM^T (K_nM v + w)`` (``fused_matmul``) for every output at once.
  The CG recurrences (vectors of length q) run in the preconditioner's precision.
- Multi-output: the k columns of ``y`` are k independent CGs in lock step (step lengths and direction
  coefficients per column); a column whose residual is exactly zero stops moving.
- The preconditioner's triangular solves are shared between ``B' p`` and the regulariser
  (:meth:`.Preconditioner.forward`, :meth:`.Preconditioner.normal`): four ``M x M`` solves per iteration
  instead of eight.
- Every ``residual_every`` iterations the true residual ``b' - W' beta'`` replaces the recursive
  one. It costs no extra pass: the current ``alpha`` rides along as extra columns of the fused
  pass ``K_nM^T (K_nM [p, alpha] + [0, -y])``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from kgp.diagnostics import diverged, warn_not_converged

from .preconditioner import Preconditioner

if TYPE_CHECKING:
    import kgp

__all__ = ["DIVERGED_RESIDUAL", "UNCONVERGED_RESIDUAL", "conjugate_gradient"]

DIVERGED_RESIDUAL = 100.0
"""A relative residual this large (100x that of alpha = 0) means CG diverged: raise, never return it."""

UNCONVERGED_RESIDUAL = 0.05
"""Warn when ``maxiter`` ends above this relative residual. With the default jitter the 20-iteration
residual was at most 0.015 on nine UCI sets with learned hyperparameters (M = 2,000), where the test
RMSE was within 1% of the converged one; the paper's jitter left 0.08-0.13 on kin40k and keggdirected,
with test RMSE 30-40% above it (docs/solvers/falkon.md, "Convergence")."""


def conjugate_gradient(
    op: kgp.KernelOperator,
    y: Tensor,
    prec: Preconditioner,
    *,
    maxiter: int,
    tol: float,
    residual_every: int,
    monitor: kgp.Monitor,
    expansion: Callable[[Tensor], Any],
    extras: Mapping[str, Any],
    accumulate: torch.dtype | None = None,
    n_total: int | None = None,
) -> Tensor:
    """Run preconditioned multi-RHS CG on ``W' beta' = b'`` (Def. 4); return ``beta'`` (q x k).

    Parameters
    ----------
    op:
        Lazy ``K_nM``; every product with it is one ``fused_matmul`` pass in ``y``'s dtype.
    y:
        ``n x k`` targets in the input dtype.
    prec:
        ``B'`` of Def. 3; its dtype is the working precision of the recurrences.
    maxiter, tol, residual_every:
        At most ``maxiter`` steps; stop once every column's relative residual ``||r|| / ||b'||`` is at
        most ``tol``; replace the recursive residual by the true one every ``residual_every`` steps
        (0: never).
    monitor:
        ``monitor.step(it, predictor_fn, residual=..., **extras)`` once per iteration; True stops.
    expansion:
        ``beta' -> predictor`` (``alpha = B' beta'``), evaluated lazily by the monitor.
    extras:
        Reported with every step (factorization, rank).
    accumulate:
        float64 for float32 inputs: the passes sum ``K_nM^T (.)`` in float64 and take the CG
        vectors in the working precision (:mod:`.precision`, item 1). None: everything in ``y``'s
        dtype.
    n_total:
        n of the global problem when ``op`` is row-sharded (:mod:`kgp.distributed`; ``y`` holds this
        rank's rows only). None: ``y``'s rows.

    Raises
    ------
    FloatingPointError
        If the residual becomes non-finite (CG diverged).
    """
    n_rows, k = y.shape
    n = n_rows if n_total is None else n_total
    dtype = y.dtype
    work = prec.dtype
    # b' = A^{-T} T^{-T} Q^T D K_nM^T y / n
    if accumulate is not None:
        b = prec.apply_t(op.transpose_matmul(y, accumulate=accumulate).to(work) / n)
    else:
        b = prec.apply_t((op.T @ y).to(work) / n)
    pass_dtype = dtype if accumulate is None else work  # what the passes take and give
    b_norm = b.norm(dim=0)
    scale = torch.where(b_norm > 0, b_norm, torch.ones_like(b_norm))
    beta = torch.zeros_like(b)
    r = b.clone()
    p = r.clone()
    rs = (r * r).sum(0)
    if bool((b_norm == 0).all()):
        monitor.step(1, lambda: expansion(beta), residual=0.0, **extras)
        return beta
    zeros_w = torch.zeros(n_rows, k, dtype=dtype, device=y.device) if residual_every else None
    for it in range(1, maxiter + 1):
        refresh = residual_every > 0 and it > 1 and (it - 1) % residual_every == 0
        v, solves = prec.forward(p)
        if refresh:
            # [K^T K v, K^T (K alpha - y)] in one pass: the true residual at beta.
            alpha, beta_solves = prec.forward(beta)
            cols = torch.cat([v, alpha], dim=1).to(pass_dtype)
            out = op.fused_matmul(cols, torch.cat([zeros_w, -y], dim=1), accumulate=accumulate).to(work) / n
            kv, grad = out[:, :k], out[:, k:]
            r = -prec.normal(grad, beta_solves)
            rs = (r * r).sum(0)
        else:
            kv = op.fused_matmul(v.to(pass_dtype), accumulate=accumulate).to(work) / n
        wp = prec.normal(kv, solves)
        pwp = (p * wp).sum(0)
        # exact line search along p; r.p equals r.r except after a residual replacement
        rp = (r * p).sum(0) if refresh else rs
        ok = (pwp > 0) & (rs > 0)
        a = torch.where(ok, rp / torch.where(ok, pwp, torch.ones_like(pwp)), torch.zeros_like(pwp))
        beta.add_(p * a)
        r.sub_(wp * a)
        rs_new = (r * r).sum(0)
        ratio = torch.where(rs > 0, rs_new / torch.where(rs > 0, rs, torch.ones_like(rs)), torch.zeros_like(rs))
        p = r + p * ratio
        rs = rs_new
        rel = rs.sqrt() / scale
        residual = float(rel.max())
        stop = monitor.step(it, lambda: expansion(beta), residual=residual, **extras)
        if not math.isfinite(residual) or residual > DIVERGED_RESIDUAL:
            raise diverged(
                "falkon",
                f"the CG residual became {residual:.3g} at iteration {it} (relative to the right-hand side)",
                cause="the kernel passes cannot resolve this system (float32 with tiny noise, or a "
                "rank-deficient K_MM with jitter 0)",
                remedy="float64 inputs, the default 'jitter' (or a larger one), or a larger noise",
            )
        if stop or residual <= tol:
            return beta
    if residual > UNCONVERGED_RESIDUAL:
        warn_not_converged(
            "falkon",
            f"stopped at maxiter={maxiter} with relative residual {residual:.3g} (tol {tol:g}); the fit may be "
            "noticeably off the Nystrom solution",
            cause="an ill-conditioned system (noise tiny next to the kernel scale, or many centers)",
            remedy="raise solver option 'maxiter' (e.g. 50), or a larger 'jitter' (e.g. 1e-2)",
            stacklevel=4,
        )
    return beta
