"""Adapter from kgp's center-selector contract to `bless` (Alg. 1) and `bless_r` (Alg. 2)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import kgp
from kgp.plugin import Centers, SelectionRequest

from .algorithms import bless, bless_r
from .options import BLESS_OPTIONS, BLESS_R_OPTIONS, LAM_OPTION
from .result import BlessResult


class _BlessFamilySelector:
    """Selector running ``run`` (:func:`bless` or :func:`bless_r`) on a :class:`kgp.SelectionRequest`.

    Its options are ``run``'s keyword arguments besides ``n_centers``, ``generator`` and ``shard``
    (taken from the request), declared in ``options`` (:mod:`.options`), plus ``lam``.
    """

    # every draw is over global row numbers (path.run_path): data-parallel
    # leverage scores depend on the kernel: a learning fit selects with the learned kernel
    capabilities = kgp.Capabilities(distributed=True, uses_kernel=True)

    def __init__(self, name: str, run: Callable[..., BlessResult], options: dict[str, kgp.Option]):
        self.name = name
        self._run = run
        self.option_defaults: dict[str, kgp.Option] = {"lam": LAM_OPTION, **options}

    def select(self, request: SelectionRequest) -> Centers:
        options: dict[str, Any] = dict(request.options)  # resolved by the core (kgp.resolve_options)
        lam = options.pop("lam")
        result = self._run(
            request.X,
            request.kernel,
            request.lam if lam is None else lam,
            n_centers=request.n_centers,
            generator=request.generator,
            shard=request.shard,
            **options,
        )
        if request.shard is None:
            return result.to_centers(request.X)
        # the centers' rows from the ranks that hold them (one exact all-reduce of M x d)
        return result.to_centers(request.X, request.shard.take_rows(request.X, result.indices))


BlessSelector = _BlessFamilySelector("bless", bless, BLESS_OPTIONS)
"""Selector ``bless``: :func:`bless` (Alg. 1) at ``request.lam`` (or the ``lam`` option)."""

BlessRSelector = _BlessFamilySelector("bless-r", bless_r, BLESS_R_OPTIONS)
"""Selector ``bless-r``: :func:`bless_r` (Alg. 2) at ``request.lam`` (or the ``lam`` option)."""
