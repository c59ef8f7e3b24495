"""Every hook a kgp plugin can implement, with its contract.

A plugin is a module (or object) with functions decorated by :data:`kgp.hookimpl`, made
known to kgp through an entry point in the ``kgp`` group::

    # pyproject.toml of the plugin's distribution
    [project.entry-points.kgp]
    my-solver = "my_package.plugin"

kgp's own solvers and selectors register through exactly these hooks (they live in the
``kgp_builtins`` package, outside the core). Each hook receives a ``register`` callback; call it
once per thing you provide. Names are global across all plugins: a third party registering a
built-in's name is ignored for that name (the built-in wins), two third parties registering the same
name make it unusable, with an error naming both origins. A decorated function whose name is none
of the hooks below (e.g. ``register_solver``) makes kgp skip the plugin, naming the closest hook.
"""

from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("kgp")
hookimpl = pluggy.HookimplMarker("kgp")


@hookspec
def register_solvers(register) -> None:
    """Register solvers by name.

    Call ``register(name, solver)`` for each solver. ``solver`` must satisfy
    :class:`kgp.plugin.Solver`:

    - ``option_defaults``: mapping of every option the solver accepts to its default, or to a
      :class:`kgp.Option` declaring the default, the accepted values and one line of help (the
      model rejects unknown option names and, for declared options, invalid values before
      fitting, with one message format; ``kgp plugins --options NAME`` prints them);
    - ``uses_centers``: whether ``fit`` needs ``problem.centers`` (the model selects them
      with a center selector when True, and refuses explicit centers when False);
    - ``fit(problem) -> Predictor``: solve the regularised least-squares problem described by
      :class:`kgp.plugin.Problem` (regularisation convention: GP noise variance sigma^2 =
      ``problem.noise``; the per-sample lambda of FALKON/BLESS is ``problem.lam = noise / n``).
      Multi-output targets are columns of ``problem.y``. Iterative solvers call
      ``problem.monitor.step(...)`` once per iteration and stop when it returns True (the model
      owns the monitor and closes it).
      Use ``problem.generator`` for all randomness, ``problem.kernel_operator(...)`` for every
      kernel product, and keep the dtype/device of ``problem.X``;
    - optionally ``partial_fit(problem, previous) -> Predictor`` to continue from a previous
      predictor on a new chunk of data (streaming); ``previous`` is None on the first chunk;
    - optionally ``needs_grad = True``: the model runs ``fit`` / ``partial_fit`` under
      ``torch.no_grad()`` otherwise;
    - optionally ``supports_distributed = True``: the solver accepts a row-sharded problem
      (``problem.shard``, :mod:`kgp.distributed`); ``fit(..., distributed=True)`` refuses others.
    """


@hookspec
def register_selectors(register) -> None:
    """Register center selectors by name.

    Call ``register(name, selector)`` for each selector. ``selector`` must satisfy
    :class:`kgp.plugin.CenterSelector`: ``option_defaults`` and
    ``select(request) -> Centers``, where :class:`kgp.plugin.SelectionRequest` carries the
    training inputs, the requested number of centers (None: the selector decides), the kernel,
    the noise / lambda, a seeded ``torch.Generator`` and the options. The returned
    :class:`kgp.plugin.Centers` holds the points, optional weights (the diagonal of FALKON's D
    matrix, Appendix A: weighted Nystrom), optional indices into the training set and a dict of
    diagnostics (e.g. estimated leverage scores). ``select`` runs under ``torch.no_grad()``
    unless the selector sets ``needs_grad = True``. A selector with ``supports_distributed = True``
    accepts a row-sharded request (``request.shard``) and returns the same centers on every rank.
    """


@hookspec
def register_predictors(register) -> None:
    """Register predictor kinds, so that saved models can be loaded.

    Call ``register(kind, cls)`` where ``cls.kind == kind`` and ``cls.from_state(state, kernel)``
    rebuilds a predictor from the tensors and plain values its ``state_dict()`` returned
    (see :class:`kgp.plugin.Predictor`). The core registers ``kernel_expansion``; a solver whose
    result has another form (e.g. a random-feature expansion) registers its own kind.
    """


@hookspec
def register_objectives(register) -> None:
    """Register hyperparameter objectives by name (what ``KernelRegressor(learn=NAME)`` minimises).

    Call ``register(name, objective)`` for each objective. ``objective`` must provide:

    - ``option_defaults``: mapping of every option it accepts to a default or a :class:`kgp.Option`
      (the user passes them in ``learn_options`` next to the loop's own options; unknown names are
      rejected before any work);
    - ``uses_centers``: whether it needs ``problem.centers`` (the model selects them with the
      center selector, or takes the explicit ``centers``);
    - optionally ``loop_defaults``: the loop's defaults that suit it, e.g.
      ``{"optimizer": "lbfgs", "iterations": 50}`` (validated; ``learn_options`` override them);
    - ``prepare(problem) -> loss``: called once per learning run with a
      :class:`kgp.learning.LearningProblem` (training data, a kernel whose GPyTorch parameters
      are being trained, optional centers with weights, a seeded generator, the merged options).
      Draw anything random (e.g. a subset of rows) here, from ``problem.generator``. It returns a
      function ``loss(noise, mean) -> Tensor``: ``noise`` is the current noise variance sigma^2
      (a 0-d tensor), ``mean`` the current constant mean (one value per output); ``loss`` returns a
      differentiable 0-d tensor **to minimise, per data point** (e.g. the negative log marginal
      likelihood divided by the number of points and outputs it was computed on), reading the
      kernel's current hyperparameters from ``problem.kernel``. kgp owns the optimisation loop
      (torch.optim over the kernel's raw parameters, the raw noise and the mean), adds the kernel's
      GPyTorch priors, and stops with an error on a NaN or infinite value.

    Every kernel product should go through ``problem.kernel_operator`` (or :func:`kgp.kernel_operator`
    on row blocks), never n x n, and n x M only within ``kgp.settings.memory_budget``.
    """
