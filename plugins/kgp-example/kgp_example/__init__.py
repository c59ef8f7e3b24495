"""kgp-example: a third-party kgp plugin distribution.

It registers, through the ``kgp`` entry-point group (see ``pyproject.toml``):

- solver ``nystrom-direct`` (:mod:`kgp_example.nystrom`): the Nystrom estimator by one dense
  M x M solve, a reference for center-based solvers;
- center selector ``kmeans++`` (:mod:`kgp_example.kmeanspp`): k-means++ seeding in the kernel's
  feature space.

It imports only kgp's public API (``kgp``, ``kgp.plugin``); each plugin declares what it can do
(``kgp.Capabilities``) and its options (``kgp.Option``).
"""

__version__ = "0.1.0"
