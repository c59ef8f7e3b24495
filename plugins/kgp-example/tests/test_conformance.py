"""The example plugin passes kgp's conformance kit (kgp.testing), as any plugin should.

The oracle of each check follows the solver's declared target: ``nystrom-direct`` declares
``kgp.Capabilities(uses_centers=True, target="nystrom")``, so it is compared with the dense Nystrom
estimator on the same centers.
"""

from __future__ import annotations

from kgp.testing import SelectorConformance, SolverConformance


class TestNystromDirect(SolverConformance):
    solver_name = "nystrom-direct"
    # A direct solve: float64 agrees with the float64 least-squares oracle to 3e-13 (measured), float32
    # to 4e-5 on the kit's problem; the float32 bound leaves room for other BLAS / GPUs.
    rtol = 1e-9
    rtol_float32 = 1e-3
    iterative = False
    invalid_options = ({"rcond": -1.0}, {"rcond": "big"}, {"rcond": 1.5})


class TestKMeansPP(SelectorConformance):
    selector_name = "kmeans++"
    data_rows = True  # k-means++ seeding picks rows of X: the kit checks every center is one
    invalid_options = ({"n_local_trials": 0}, {"metric": "cosine"})
    solver = "nystrom-direct"
    rtol = 1e-9


class TestKMeansPPEuclideanGreedy(SelectorConformance):
    selector_name = "kmeans++"
    selector_options = {"metric": "euclidean", "n_local_trials": 3}
    data_rows = True
    solver = "nystrom-direct"
    rtol = 1e-9
