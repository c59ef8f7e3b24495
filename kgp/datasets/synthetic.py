"""Regression data of any size with a known noise floor: a GP prior draw plus Gaussian noise.

:class:`PriorDraw` is one function ``f`` drawn from a zero-mean GP prior with an ARD RBF (squared
exponential) covariance ``outputscale * exp(-sum_j (x_j - x'_j)^2 / (2 l_j^2))``, approximated by
random Fourier features (Rahimi & Recht 2007, Eq. 2): with frequencies ``w_k ~ N(0, diag(l^-2))`` and
weights ``a_k, b_k ~ N(0, 1)``,

    f(x) = sqrt(outputscale / D) * sum_{k=1..D} (a_k cos(w_k . x) + b_k sin(w_k . x)).

Inputs are standard normal, targets ``y = f(x) + e`` with ``e ~ N(0, noise_std^2)``: the Bayes-optimal
predictor is ``f`` itself, so the best possible test RMSE is ``noise_std`` and a model's distance from it
is the excess error ``sqrt(RMSE^2 - noise_std^2)`` (:func:`excess_rmse`).

Rows are generated in fixed chunks of :data:`CHUNK_ROWS`, each from its own random stream keyed by
``(seed, split, chunk index)``: row ``i`` of a split is the same whatever ``n``, ``start`` or block size
asked for it, the training and test splits share the one ``f`` (it depends on the seed, ``d`` and the
kernel only), and ``n = 10^7`` rows can be written straight to memory-mapped ``.npy`` files block by
block (:func:`numpy.lib.format.open_memmap`).
"""

from __future__ import annotations

import math
import os
from numbers import Integral, Real
from typing import Any

import numpy as np
import torch

__all__ = ["CHUNK_ROWS", "DEFAULT_FEATURES", "PriorDraw", "excess_rmse", "make_gp_regression"]

CHUNK_ROWS = 1024
"""Rows per random stream and per evaluation of ``f``: fixed, so that values never depend on the block size."""

DEFAULT_FEATURES = 8192
"""Frequencies D of the default draw (2 D = 16,384 basis functions).

Why this many. (1) The draw is exactly a sample from the GP whose covariance is the D-term Monte-Carlo
estimate of the RBF kernel; its variance ``E f(x)^2`` equals ``outputscale`` exactly for every x (the
cos^2 + sin^2 pairs), and its covariance at distinct points deviates from the RBF one by a random amount of
standard deviation at most ``outputscale * sqrt(1 / (2 D))`` = 0.8% of the outputscale at D = 8,192, below
what a test RMSE can resolve. (2) The draw is a finite sum of sinusoids, while a kernel model with M centers
(Nystrom, FALKON, SVGP, a kernel expansion) is a sum of M Gaussian bumps: no such sum equals a sinusoid on
all of R^d, so no model with any number of centers represents ``f`` exactly and the floor ``noise_std``
is reached only in the limit. (3) The learnable part is not low-rank at the benchmark's sizes: 2 D =
16,384 independent basis functions is above the 11,241 centers of the default recipe at 10^5 rows and of
the same order as a 50,000-center model, so a model at M <= 50,000 cannot "fit the generator's
coefficients" parametrically; more features would push that further at a cost of n * D sines and cosines
(at D = 8,192 about 0.1 ms of CPU per row on the 2-core development host: 16 CPU minutes for 10^7 rows).
"""

_SPLITS = {"train": 1, "test": 2}


def _check_int(value: Any, name: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise TypeError(f"{name}: expected an integer, got {value!r}")
    if value < low:
        raise ValueError(f"{name}: expected an integer >= {low}, got {value}")
    return int(value)


def _check_real(value: Any, name: str, *, positive: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name}: expected a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise ValueError(f"{name}: expected a finite number {'> 0' if positive else '>= 0'}, got {value!r}")
    return value


def default_lengthscales(d: int) -> np.ndarray:
    """ARD lengthscales ``sqrt(d) * geomspace(0.25, 1, d)``: the most relevant feature four times the least.

    The ``sqrt(d)`` keeps the sum of inverse squared lengthscales (how fast ``f`` varies along a typical
    direction of the standard normal inputs) nearly the same for every ``d`` (5.86 at d = 8, 5.53 at
    d = 28, 15 / ln 16 = 5.41 as d grows), so that d = 8 and d = 28 are of comparable difficulty.
    """
    d = _check_int(d, "d", 1)
    return math.sqrt(d) * np.geomspace(0.25, 1.0, d)


class PriorDraw:
    """One draw ``f`` from an ARD RBF GP prior (random Fourier features) and noisy samples of it.

    Parameters
    ----------
    d:
        Number of input features (>= 1).
    seed:
        Seed of ``f`` and of the rows (non-negative integer).
    noise_std:
        Standard deviation of the Gaussian noise added to ``f`` (>= 0): the Bayes-optimal test RMSE.
    n_features:
        Number D of random frequencies (see :data:`DEFAULT_FEATURES` for the default's justification).
    lengthscale:
        ARD lengthscales: a positive number, a length-``d`` sequence, or None for
        :func:`default_lengthscales`.
    outputscale:
        Prior variance of ``f`` (> 0).

    Attributes
    ----------
    frequencies:
        ``d x D`` array of the frequencies ``w_k`` (columns).
    weights:
        ``2 x D`` array: the cosine and sine weights, already scaled by ``sqrt(outputscale / D)``.
    """

    def __init__(
        self,
        d: int = 8,
        *,
        seed: int = 0,
        noise_std: float = 0.1,
        n_features: int = DEFAULT_FEATURES,
        lengthscale: float | np.ndarray | None = None,
        outputscale: float = 1.0,
    ):
        self.d = _check_int(d, "d", 1)
        self.seed = _check_int(seed, "seed", 0)
        self.noise_std = _check_real(noise_std, "noise_std", positive=False)
        self.n_features = _check_int(n_features, "n_features", 1)
        self.outputscale = _check_real(outputscale, "outputscale", positive=True)
        if lengthscale is None:
            ls = default_lengthscales(self.d)
        else:
            ls = np.asarray(lengthscale, dtype=np.float64)
            if ls.ndim == 0:
                ls = np.full(self.d, float(ls))
            if ls.shape != (self.d,):
                raise ValueError(f"lengthscale: expected a number or {self.d} numbers, got shape {ls.shape}")
            if not (np.isfinite(ls).all() and (ls > 0).all()):
                raise ValueError(f"lengthscale: expected finite positive values, got {ls}")
        self.lengthscale = ls
        # stream 0 of the seed is f's; the rows use streams 1 (train) and 2 (test)
        rng = np.random.default_rng([self.seed, 0])
        self.frequencies = rng.standard_normal((self.d, self.n_features)) / ls[:, None]
        self.weights = rng.standard_normal((2, self.n_features)) * math.sqrt(self.outputscale / self.n_features)
        self._w = torch.from_numpy(self.frequencies)
        self._a = torch.from_numpy(self.weights[0].copy())
        self._b = torch.from_numpy(self.weights[1].copy())

    @property
    def bayes_rmse(self) -> float:
        """The best test RMSE any model can reach on this data: the noise standard deviation."""
        return self.noise_std

    def __repr__(self) -> str:
        return (
            f"PriorDraw(d={self.d}, seed={self.seed}, noise_std={self.noise_std}, "
            f"n_features={self.n_features}, outputscale={self.outputscale})"
        )

    # ------------------------------------------------------------------ f
    def _f_chunk(self, X: np.ndarray) -> np.ndarray:
        # torch: its sin/cos are vectorised and threaded, numpy's are not (n * D of each is the whole cost)
        phase = torch.from_numpy(np.ascontiguousarray(X, dtype=np.float64)) @ self._w
        out = torch.cos(phase) @ self._a
        out += torch.sin(phase, out=phase) @ self._b
        return out.numpy()

    def f(self, X: Any) -> np.ndarray:
        """The noiseless function at the rows of ``X`` (``n x d``), evaluated :data:`CHUNK_ROWS` rows at a time.

        Returns
        -------
        numpy.ndarray
            float64 values, shape ``(n,)``.
        """
        X = np.asarray(X)
        if X.ndim != 2 or X.shape[1] != self.d:
            raise ValueError(f"X: expected shape (n, {self.d}), got {X.shape}")
        out = np.empty(X.shape[0], dtype=np.float64)
        for lo in range(0, X.shape[0], CHUNK_ROWS):
            out[lo : lo + CHUNK_ROWS] = self._f_chunk(X[lo : lo + CHUNK_ROWS])
        return out

    # ------------------------------------------------------------------ rows
    def _chunk(self, split: str, index: int) -> tuple[np.ndarray, np.ndarray]:
        """Rows ``index * CHUNK_ROWS ...`` of ``split``: inputs, then targets (one stream per chunk)."""
        rng = np.random.default_rng([self.seed, _SPLITS[split], index])
        X = rng.standard_normal((CHUNK_ROWS, self.d))
        y = self._f_chunk(X)
        y += self.noise_std * rng.standard_normal(CHUNK_ROWS)
        return X, y

    def sample(
        self,
        n: int,
        *,
        split: str = "train",
        start: int = 0,
        block_rows: int = 65536,
        dtype: Any = np.float64,
        X_out: str | os.PathLike | np.ndarray | None = None,
        y_out: str | os.PathLike | np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Rows ``start .. start + n - 1`` of ``split``: inputs ``X`` (``n x d``) and targets ``y`` (``n``).

        Parameters
        ----------
        n:
            Number of rows (>= 1).
        split:
            ``"train"`` or ``"test"``: two disjoint row streams of the same ``f``.
        start:
            Index of the first row (>= 0); rows do not depend on ``n``, ``start`` or ``block_rows``.
        block_rows:
            Rows generated and written at a time (>= 1; rounded up to a multiple of :data:`CHUNK_ROWS`):
            beyond the output, memory holds one block of rows and one chunk's ``CHUNK_ROWS x D`` phases.
        dtype:
            ``float64`` or ``float32`` for the output (values are computed in float64).
        X_out, y_out:
            Where to write: a path (a new ``.npy`` file, memory-mapped while it is written, so that the
            data may exceed memory) or an array of the right shape and dtype; None allocates in memory.

        Returns
        -------
        X, y:
            The outputs (``numpy.memmap`` where a path was given; reopen them with
            ``numpy.load(path, mmap_mode="r")``).
        """
        n = _check_int(n, "n", 1)
        start = _check_int(start, "start", 0)
        block_rows = _check_int(block_rows, "block_rows", 1)
        if split not in _SPLITS:
            raise ValueError(f"split: expected 'train' or 'test', got {split!r}")
        dtype = np.dtype(dtype)
        if dtype not in (np.float32, np.float64):
            raise TypeError(f"dtype: expected float32 or float64, got {dtype}")
        X = _output(X_out, "X_out", (n, self.d), dtype)
        y = _output(y_out, "y_out", (n,), dtype)
        per_block = -(-block_rows // CHUNK_ROWS)
        first, last = start // CHUNK_ROWS, (start + n - 1) // CHUNK_ROWS
        for lo_chunk in range(first, last + 1, per_block):
            chunks = [self._chunk(split, c) for c in range(lo_chunk, min(lo_chunk + per_block, last + 1))]
            block_X = np.concatenate([c[0] for c in chunks])
            block_y = np.concatenate([c[1] for c in chunks])
            row0 = lo_chunk * CHUNK_ROWS  # global index of block_X[0]
            lo, hi = max(start, row0), min(start + n, row0 + block_X.shape[0])
            X[lo - start : hi - start] = block_X[lo - row0 : hi - row0]
            y[lo - start : hi - start] = block_y[lo - row0 : hi - row0]
        for out in (X, y):
            if isinstance(out, np.memmap):
                out.flush()
        return X, y


def _output(out: Any, name: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    if out is None:
        return np.empty(shape, dtype=dtype)
    if isinstance(out, np.ndarray):
        if out.shape != shape or out.dtype != dtype or not out.flags.writeable:
            raise ValueError(
                f"{name}: expected a writeable array of shape {shape} and dtype {dtype}, "
                f"got shape {out.shape}, dtype {out.dtype}"
            )
        return out
    if isinstance(out, (str, os.PathLike)):
        return np.lib.format.open_memmap(os.fspath(out), mode="w+", dtype=dtype, shape=shape)
    raise TypeError(f"{name}: expected None, a path or a numpy array, got {type(out).__name__}")


def make_gp_regression(
    n: int,
    d: int = 8,
    *,
    seed: int = 0,
    split: str = "train",
    noise_std: float = 0.1,
    n_features: int = DEFAULT_FEATURES,
    **sample_options: Any,
) -> tuple[np.ndarray, np.ndarray]:
    """``n`` rows of :class:`PriorDraw` ``(d, seed, noise_std, n_features)``: shorthand for its ``sample``.

    ``make_gp_regression(n_train, seed=s)`` and ``make_gp_regression(n_test, seed=s, split="test")`` are a
    training and a test set of the same function; ``sample_options`` go to :meth:`PriorDraw.sample`
    (``start``, ``block_rows``, ``dtype``, ``X_out``, ``y_out``). The best achievable test RMSE is
    ``noise_std``.
    """
    return PriorDraw(d, seed=seed, noise_std=noise_std, n_features=n_features).sample(n, split=split, **sample_options)


def excess_rmse(rmse: float, noise_std: float) -> float:
    """``sqrt(rmse^2 - noise_std^2)``: a test RMSE's distance above the noise floor (0 where it is below).

    A test RMSE below the floor happens by sampling error on a finite test set; it is reported as 0.
    """
    rmse = _check_real(rmse, "rmse", positive=False)
    noise_std = _check_real(noise_std, "noise_std", positive=False)
    return math.sqrt(max(rmse * rmse - noise_std * noise_std, 0.0))
