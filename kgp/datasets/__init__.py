"""Small real data shipped inside the package (no downloads)."""

from __future__ import annotations

from importlib import resources

import numpy as np

__all__ = ["load_demo"]


def load_demo() -> tuple[np.ndarray, np.ndarray]:
    """UCI Concrete Compressive Strength (Yeh 1998): 1,030 x 8 inputs, strength in MPa.

    Features: cement, blast-furnace slag, fly ash, water, superplasticizer, coarse aggregate,
    fine aggregate (kg/m^3) and age (days). License: CC BY 4.0 (UCI Machine Learning Repository);
    see kgp/datasets/README.md.

    Returns
    -------
    X, y:
        float64 arrays of shape (1030, 8) and (1030,).
    """
    with resources.files(__package__).joinpath("concrete.npz").open("rb") as fh:
        with np.load(fh, allow_pickle=False) as z:
            return z["X"].astype(np.float64), z["y"].astype(np.float64)
