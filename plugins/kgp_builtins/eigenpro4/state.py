r"""The iterate of EigenPro 4 between two projections: the model on Z plus its temporary part.

Between projections the function is

    f = K(., Z) a + K(., X_s) c + K(., X_tmp) w

(``a`` on the model's centers, ``c`` on the preconditioner's Nystrom subsample X_s, ``w`` on the
batches' rows appended as temporary centers). The correction ``c`` belongs to the temporary part even
when X_s is a subset of the centers (``preconditioner="centers"``): it largely cancels the gradient's
component along the top eigendirections, so it must be projected together with it; added to ``a``
directly, the inexact projection's error on the large uncancelled gradient made the iteration diverge
(measured: n = 2,000, M = 100, q = 10). One buffer holds the points ``[Z; X_s; X_tmp]`` and one their
coefficients, so that a step evaluates one kernel block against all of them. When X_s is a subset of the
centers (``center_index``) it is not stored again: the centers' coefficients in the buffer hold ``a + c``
(scattered to X_s's positions), the prediction's ``K(X_b, X_s)`` columns being columns of ``K(X_b, Z)``,
and ``c`` is kept apart for the projection. Two running arrays avoid
kernel evaluations the step does not need:

- ``h`` (M x k): the temporary part of f evaluated at Z, the right-hand side of the projection
  ``K(Z, Z) v = h``;
- ``f_s`` (s x k): the whole f at the preconditioner's subsample, which the preconditioned ridge term
  needs every step.

Both are updated in closed form from the step's own products (``K(Z, X_b) g`` and ``K(X_s, X_b) g``
come out of the block that gave the predictions) and from ``K(Z, X_s) E`` / ``K(X_s, X_s) E``, formed once.
After a projection ``f(X_s) = K(X_s, Z) a`` (the temporary part dropped). When X_s is a subset of the centers
and the projection's residual ``r = h - K(Z, Z) v`` is known (``projection_residual="carry"``), that needs no
kernel evaluation either: ``K(X_s, Z) a`` is kept as ``f_z`` (it only shrinks between projections) and grows
by ``(K(Z, Z) v)[X_s] = (h - r)[X_s]``; otherwise ``K(X_s, Z) a`` is formed (``s M`` entries, as many as
``2,000 / (1.5 M)`` of a period's steps at the default period).

A step's predictions ``f(X_b)`` and its gradient ``K([Z; X_s; X_tmp], X_b) g`` come from one formation of
``K(X_b, [Z; X_s; X_tmp])`` (:meth:`kgp.operators.KernelOperator.residual_matmul`: natively on a CPU, without
the block in memory; otherwise in row blocks within ``kgp.settings.memory_budget``).
"""

from __future__ import annotations

from torch import Tensor

from kgp_builtins.eigenpro.nystrom import KernelOpFactory, NystromPreconditioner

__all__ = ["DelayedState"]


class DelayedState:
    """Points, coefficients and the running ``h`` / ``f_s`` of one fit (see the module docstring).

    Parameters
    ----------
    kop:
        Kernel factory (``problem.kernel_operator``).
    Z:
        The model's centers (M x d).
    pre:
        The preconditioner (its subsample, ``Q_s = E diag(d) E^T``).
    center_index:
        Positions of the subsample among the centers when it is drawn from them, else None (it then joins
        the buffer as extra points).
    capacity:
        Most temporary centers held before a projection (T m).
    k:
        Number of outputs.
    """

    def __init__(
        self,
        kop: KernelOpFactory,
        Z: Tensor,
        pre: NystromPreconditioner,
        center_index: Tensor | None,
        capacity: int,
        k: int,
    ):
        M, d = Z.shape[0], Z.shape[1]
        s = pre.points.shape[0]
        extra = 0 if center_index is not None else s
        self.kop, self.pre, self.M, self.extra = kop, pre, M, extra
        self.center_index = center_index
        self.c = Z.new_zeros(s, k) if center_index is not None else None  # c, kept apart from a + c
        self.points = Z.new_empty(M + extra + capacity, d)
        self.points[:M] = Z
        if extra:
            self.points[M : M + extra] = pre.points
        self.coef = Z.new_zeros(M + extra + capacity, k)
        self.used = M + extra  # rows of points / coef in use: the centers, X_s (data subsample), the temporaries
        self.h = Z.new_zeros(M, k)
        if pre.q > 0:
            self.SE = kop(pre.points, pre.points) @ pre.E  # K(X_s, X_s) E: the correction at X_s (f_s)
            self.ZE = kop(Z, pre.points) @ pre.E  # K(Z, X_s) E: the correction at Z (h)
        self.f_s = Z.new_zeros(s, k)
        self.f_z = Z.new_zeros(s, k) if center_index is not None else None  # K(X_s, Z) a, X_s among the centers

    @property
    def Z(self) -> Tensor:
        return self.points[: self.M]

    @property
    def alpha(self) -> Tensor:
        """The coefficients on the centers (a view; right after :meth:`absorb`, ``a`` alone)."""
        return self.coef[: self.M]

    def step(self, Xb: Tensor, yb: Tensor, eta: float, sigma2_n: float) -> float:
        r"""One preconditioned step on the batch ``(X_b, y_b)``; returns the batch's sum of squared residuals.

        With ``g = f(X_b) - y_b`` and the stochastic gradient (per-sample units, EigenPro 3 eq. 28 with
        the ridge term) ``F = (1/m) K(., X_b) g + (sigma^2/n) f``, the step is ``f <- f - eta P_s F``
        with ``P_s F = F - K(., X_s) Q_s F(X_s)`` (EigenPro 3 eq. 29-30, Lemma 5):

        - every coefficient shrinks by ``1 - eta sigma^2 / n`` (the ridge part of F);
        - the batch's rows join the temporary centers with coefficients ``-(eta/m) g``;
        - the subsample's coefficients ``c`` grow by ``eta Q_s r`` with
          ``r = F(X_s) = (1/m) K(X_s, X_b) g + (sigma^2/n) f(X_s)``.
        """
        width = self.used
        # g = f(X_b) - y_b and K([Z; X_s; X_tmp], X_b) g from one formation of the block; the temporaries'
        # part of the gradient is not needed (their coefficients only shrink), and costs one multiply-add
        # per entry next to the entry's evaluation
        g, grad = self.kop(Xb, self.points[:width]).residual_matmul(self.coef[:width], yb.neg())
        return self.apply_step(Xb, g, grad, eta, sigma2_n)

    def apply_step(self, Xb: Tensor, g: Tensor, grad: Tensor, eta: float, sigma2_n: float) -> float:
        """The update of :meth:`step` from its two products: the residual ``g = f(X_b) - y_b`` and
        ``grad``, whose first ``M + e`` rows are ``K([Z; X_s], X_b) g`` (e = 0 when X_s is among the centers)."""
        m, M, extra = Xb.shape[0], self.M, self.extra
        width = self.used
        coef = self.coef[:width]
        sq = float(g.pow(2).sum())
        gz = grad[:M]
        u = grad[M : M + extra] if extra else gz[self.center_index]  # K(X_s, X_b) g
        r = u.div(m)
        if sigma2_n:
            r.add_(self.f_s, alpha=sigma2_n)
            shrink = 1.0 - eta * sigma2_n
            coef.mul_(shrink)
            if self.c is not None:
                self.c.mul_(shrink)
            self.h.mul_(shrink)
            self.f_s.mul_(shrink)
            if self.f_z is not None:
                self.f_z.mul_(shrink)
        # the batch's rows as temporary centers
        self.points[width : width + m] = Xb
        self.coef[width : width + m] = g.mul(-eta / m)
        self.used = width + m
        self.h.add_(gz, alpha=-eta / m)
        self.f_s.add_(u, alpha=-eta / m)
        if self.pre.q > 0:
            t = self.pre.d.unsqueeze(-1) * (self.pre.E.mT @ r)  # diag(d) E^T r, q x k
            dc = self.pre.E @ t
            if extra:
                self.coef[M : M + extra].add_(dc, alpha=eta)
            else:
                self.c.add_(dc, alpha=eta)
                self.coef.index_add_(0, self.center_index, dc, alpha=eta)
            self.h.addmm_(self.ZE, t, alpha=eta)
            self.f_s.addmm_(self.SE, t, alpha=eta)
        return sq

    def room(self, m: int) -> bool:
        """Whether ``m`` more temporary centers fit the buffer."""
        return self.used + m <= self.points.shape[0]

    def absorb(self, v: Tensor, residual: Tensor | None) -> None:
        """After a projection ``v ~ K(Z, Z)^{-1} h``: ``a += v``, the temporary part dropped, ``f(X_s) = K(X_s, Z) a``
        (from the residual where it can: module docstring).

        ``residual``: the solve's ``h - K(Z, Z) v`` (:meth:`.projection.DelayedProjection.residual`), kept as
        the start of the next ``h`` (error feedback): the part of the temporary function that the solve missed
        is projected with the next period's instead of being lost, so the centers' coefficients follow the
        exactly projected iteration with a delay. None: the missed part is dropped, as in the paper.
        """
        self.alpha.add_(v)
        if self.c is not None:  # the centers' slots held a + c: c is projected (in v) and dropped
            self.alpha.index_add_(0, self.center_index, self.c, alpha=-1.0)
            self.c.zero_()
        self.coef[self.M :].zero_()
        self.used = self.M + self.extra
        if self.f_z is not None and residual is not None:
            self.f_z.add_(self.h[self.center_index]).sub_(residual[self.center_index])  # += (K(Z, Z) v)[X_s]
            self.f_s = self.f_z.clone()
        else:
            self.f_s = self.kop(self.pre.points, self.Z) @ self.alpha
            if self.f_z is not None:
                self.f_z = self.f_s.clone()
        if residual is not None:
            self.h = residual
        else:
            self.h.zero_()
