"""The GP quantities of a fitted model, as views of its :class:`kgp.Posterior` (a mixin of the estimators)."""

from __future__ import annotations

from torch import Tensor

__all__ = ["GPQuantities"]


class GPQuantities:
    """``noise_``, ``mean_``, ``log_marginal_likelihood_value_`` and the target scaling of ``posterior_``.

    The estimator provides ``posterior_``, ``learn_summary_`` and ``_check_fitted``.
    """

    @property
    def noise_(self) -> float:
        """The noise variance sigma^2 of the fit (learned with ``learn``), in the scaled target units."""
        self._check_fitted()
        return self.posterior_.noise

    @property
    def mean_(self) -> Tensor:
        """The constant mean per output (learned with ``learn``, else 0), in the scaled target units."""
        self._check_fitted()
        return self.posterior_.offset

    @mean_.setter
    def mean_(self, value: Tensor) -> None:
        self._check_fitted()
        self.posterior_.offset = value

    @property
    def log_marginal_likelihood_value_(self) -> float | None:
        """The log marginal likelihood at the learned hyperparameters, as scikit-learn's attribute of that name.

        ``log p(y) = -1/2 r^T (K + sigma^2 I)^{-1} r - 1/2 log|K + sigma^2 I| - n/2 log(2 pi)`` (Rasmussen &
        Williams 2006, eq. 2.30), summed over outputs, in the scaled target units (after ``normalize_y``,
        as scikit-learn's), over the rows the objective used: all training rows for ``learn="exact"``
        without ``subset``, the random subset otherwise, the wider ``refine_subset`` when that stage ran
        (``learn_summary_['likelihood_terms']`` counts rows x outputs); for ``learn="sgpr"`` the collapsed
        lower bound on it (Titsias 2009, eq. 9). With priors on the kernel it includes their log densities.
        None when nothing was learned, when the objective is no likelihood (``holdout``), or when
        ``refit_subset`` moved the point afterwards.
        """
        self._check_fitted()
        summary = self.learn_summary_
        return None if summary is None else summary.get("log_marginal_likelihood")

    @property
    def _y_train_mean(self) -> Tensor:
        return self.posterior_.scaling.mean

    @property
    def _y_train_std(self) -> Tensor:
        return self.posterior_.scaling.std
