"""The pytest base classes: subclass one, set its class attributes, and pytest runs one test per check.

Checks that do not apply (no GPU, no centers, no ``partial_fit``, no oracle) are reported as skipped.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from .objective_checks import OBJECTIVE_CHECKS
from .oracles import DEFAULT_SPEC, OracleSpec
from .selector_checks import SELECTOR_CHECKS
from .solver_model_checks import SOLVER_CHECKS
from .support import skip

__all__ = ["ObjectiveConformance", "SelectorConformance", "SolverConformance"]


class SolverConformance:
    """Subclass as ``class TestMySolver(SolverConformance)`` and set the class attributes.

    Each ``test_*`` method runs one check of :data:`~kgp.testing.SOLVER_CHECKS`.
    """

    solver_name: ClassVar[str] = ""
    solver_options: ClassVar[dict[str, Any]] = {}
    rtol: ClassVar[float] = 1e-6
    rtol_float32: ClassVar[float] = 1e-3
    iterative: ClassVar[bool] = False
    invalid_options: ClassVar[tuple[dict[str, Any], ...]] = ()
    spec: ClassVar[OracleSpec] = DEFAULT_SPEC
    device: ClassVar[str | None] = None
    skip_checks: ClassVar[tuple[str, ...]] = ()

    def run_check(self, check: str) -> dict[str, Any]:
        if not self.solver_name:
            raise AssertionError(f"{type(self).__name__}: set the class attribute solver_name")
        if check in self.skip_checks:
            skip(f"{check} listed in skip_checks")
        return SOLVER_CHECKS[check](
            self.solver_name,
            solver_options=self.solver_options,
            rtol=self.rtol,
            rtol_float32=self.rtol_float32,
            iterative=self.iterative,
            invalid_options=tuple(self.invalid_options),
            spec=self.spec,
            device=self.device,
        )

    def test_protocol(self):
        self.run_check("protocol")

    def test_oracle(self):
        self.run_check("oracle")

    def test_dtype(self):
        self.run_check("dtype")

    def test_device(self):
        self.run_check("device")

    def test_multi_output(self):
        self.run_check("multi_output")

    def test_seed(self):
        self.run_check("seed")

    def test_callback(self):
        self.run_check("callback")

    def test_validation_metric(self):
        self.run_check("validation_metric")

    def test_unknown_option(self):
        self.run_check("unknown_option")

    def test_invalid_options(self):
        self.run_check("invalid_options")

    def test_save_load(self):
        self.run_check("save_load")

    def test_center_weights(self):
        self.run_check("center_weights")

    def test_partial_fit(self):
        self.run_check("partial_fit")


class SelectorConformance:
    """Subclass as ``class TestMySelector(SelectorConformance)``; one ``test_*`` per selector check.

    Set ``data_rows = True`` when the selector promises rows of ``X``, and ``invalid_options`` to option dicts
    it must refuse; without them those two checks are skipped.
    """

    selector_name: ClassVar[str] = ""
    selector_options: ClassVar[dict[str, Any]] = {}
    n_centers: ClassVar[int] = 40
    exact_count: ClassVar[bool] = True
    data_rows: ClassVar[bool] = False
    invalid_options: ClassVar[tuple[dict[str, Any], ...]] = ()
    spec: ClassVar[OracleSpec] = DEFAULT_SPEC
    device: ClassVar[str | None] = None
    solver: ClassVar[str | None] = None
    solver_options: ClassVar[dict[str, Any]] = {}
    rtol: ClassVar[float] = 1e-6
    skip_checks: ClassVar[tuple[str, ...]] = ()

    def run_check(self, check: str) -> dict[str, Any]:
        if not self.selector_name:
            raise AssertionError(f"{type(self).__name__}: set the class attribute selector_name")
        if check in self.skip_checks:
            skip(f"{check} listed in skip_checks")
        return SELECTOR_CHECKS[check](
            self.selector_name,
            selector_options=self.selector_options,
            n_centers=self.n_centers,
            exact_count=self.exact_count,
            data_rows=self.data_rows,
            invalid_options=tuple(self.invalid_options),
            spec=self.spec,
            device=self.device,
            solver=self.solver,
            solver_options=self.solver_options,
            rtol=self.rtol,
        )

    def test_contract(self):
        self.run_check("contract")

    def test_distinct(self):
        self.run_check("distinct")

    def test_data_rows(self):
        self.run_check("data_rows")

    def test_seed(self):
        self.run_check("seed")

    def test_device(self):
        self.run_check("device")

    def test_unknown_option(self):
        self.run_check("unknown_option")

    def test_invalid_options(self):
        self.run_check("invalid_options")

    def test_memory(self):
        self.run_check("memory")

    def test_in_model(self):
        self.run_check("in_model")


class ObjectiveConformance:
    """Subclass as ``class TestMyObjective(ObjectiveConformance)``; one ``test_*`` per objective check.

    ``oracle`` says what the objective computes: ``"exact_nll"``, ``"sgpr_bound"``, or a function
    ``oracle(problem, noise, mean) -> float``; None skips the value check.
    """

    objective_name: ClassVar[str] = ""
    oracle: ClassVar[str | Callable | None] = None
    objective_options: ClassVar[dict[str, Any]] = {}
    rtol: ClassVar[float] = 1e-6
    invalid_options: ClassVar[tuple[dict[str, Any], ...]] = ()
    memory_options: ClassVar[dict[str, Any]] = {}
    spec: ClassVar[OracleSpec] = DEFAULT_SPEC
    device: ClassVar[str | None] = None
    skip_checks: ClassVar[tuple[str, ...]] = ()

    def run_check(self, check: str) -> dict[str, Any]:
        if not self.objective_name:
            raise AssertionError(f"{type(self).__name__}: set the class attribute objective_name")
        if check in self.skip_checks:
            skip(f"{check} listed in skip_checks")
        return OBJECTIVE_CHECKS[check](
            self.objective_name,
            oracle=type(self).oracle,  # read from the class: a plain function is not bound to the test
            objective_options=self.objective_options,
            rtol=self.rtol,
            invalid_options=tuple(self.invalid_options),
            memory_options=self.memory_options,
            spec=self.spec,
            device=self.device,
        )

    def test_protocol(self):
        self.run_check("protocol")

    def test_value(self):
        self.run_check("value")

    def test_gradcheck(self):
        self.run_check("gradcheck")

    def test_seed(self):
        self.run_check("seed")

    def test_unknown_option(self):
        self.run_check("unknown_option")

    def test_invalid_options(self):
        self.run_check("invalid_options")

    def test_memory(self):
        self.run_check("memory")

    def test_device(self):
        self.run_check("device")
