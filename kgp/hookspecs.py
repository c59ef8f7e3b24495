"""Every hook a kgp plugin can implement, with its contract.

A plugin is a module (or object) with functions decorated by :data:`kgp.hookimpl`, made
known to kgp through an entry point in the ``kgp`` group::

    # pyproject.toml of the plugin's distribution
    [project.entry-points.kgp]
    my-solver = "my_package.plugin"

kgp's own solvers, selectors and objectives register through exactly these hooks (they live in the
``kgp_builtins`` package, outside the core). Each hook receives a ``register`` callback; call it
once per thing you provide; every solver, selector and objective declares its
:class:`kgp.Capabilities` and its options (:class:`kgp.Option`), checked when it registers. Names
are global across all plugins: a third party registering a built-in's name is ignored for that name
(the built-in wins), two third parties registering the same name make it unusable, with an error
naming both origins. A decorated function whose name is none
of the hooks below (e.g. ``register_solver``) makes kgp skip the plugin, naming the closest hook.

The hooks are historic (pluggy's ``call_historic``): kgp calls each plugin's implementations once,
when the plugin registers (at discovery, or in :func:`kgp.register`), never again.
"""

from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("kgp")
hookimpl = pluggy.HookimplMarker("kgp")


@hookspec(historic=True)
def register_solvers(register) -> None:
    """Register solvers by name.

    Call ``register(name, solver)`` for each solver. ``solver`` must satisfy
    :class:`kgp.plugin.Solver` (the registry checks it when the plugin registers and refuses the
    whole plugin otherwise, naming what is wrong):

    - ``capabilities = kgp.Capabilities(...)``: ``uses_centers`` (``fit`` needs ``problem.centers``;
      the model selects them with a center selector, and refuses explicit centers when no plugin of
      the fit uses them), ``target`` (the posterior ``fit`` approximates: ``"exact"`` the GP
      posterior mean, ``"nystrom"`` the Nystrom estimator on the centers, ``"mean_only"`` the exact
      mean in a form without a variance; it decides ``predict(return_std=True)`` and the conformance
      kit's oracle), ``needs_grad`` (else ``fit`` / ``partial_fit`` run under ``torch.no_grad()``),
      ``distributed`` (accepts a row-sharded ``problem.shard``; else ``distributed_refusal`` says
      why, quoted when ``fit(..., distributed=True)`` refuses it) and ``partial_fit``;
    - ``option_defaults``: every option the solver accepts, each a :class:`kgp.Option` declaring the
      default, the accepted values and one line of help (``kgp plugins --options NAME`` prints
      them); optionally ``check_options(options) -> options`` for rules between options. kgp
      resolves the user's options once, before any work (:func:`kgp.resolve_options`: unknown names
      and invalid values rejected with one message format), and ``fit`` reads ``problem.options``
      without validating them again;
    - ``fit(problem) -> Predictor``: solve the regularised least-squares problem described by
      :class:`kgp.plugin.Problem` (regularisation convention: GP noise variance sigma^2 =
      ``problem.noise``; the per-sample lambda of FALKON/BLESS is ``problem.lam = noise / n``).
      Multi-output targets are columns of ``problem.y``. Iterative solvers call
      ``problem.monitor.step(...)`` once per iteration and stop when it returns True (the model
      owns the monitor and closes it).
      Use ``problem.generator`` for all randomness, ``problem.kernel_operator(...)`` for every
      kernel product (never n x n), and keep the dtype/device of ``problem.X``;
    - with ``Capabilities(partial_fit=True)`` (and only then) ``partial_fit(problem, previous) ->
      Predictor`` to continue from a previous predictor on a new chunk of data (streaming);
      ``previous`` is None on the first chunk.
    """


@hookspec(historic=True)
def register_selectors(register) -> None:
    """Register center selectors by name.

    Call ``register(name, selector)`` for each selector. ``selector`` must satisfy
    :class:`kgp.plugin.CenterSelector`: ``capabilities = kgp.Capabilities(...)`` (``needs_grad``:
    else ``select`` runs under ``torch.no_grad()``; ``distributed``: it accepts a row-sharded
    request, ``request.shard``, and returns the same centers on every rank), ``option_defaults``
    (each a :class:`kgp.Option`; optionally ``check_options``) and ``select(request) -> Centers``,
    where :class:`kgp.plugin.SelectionRequest` carries the training inputs, the requested number of
    centers (None: the selector decides), the kernel, the noise / lambda, a seeded
    ``torch.Generator`` and the resolved options. The returned :class:`kgp.plugin.Centers` holds
    the points, optional weights (the diagonal of FALKON's D matrix, Appendix A: weighted Nystrom),
    optional indices into the training set and a dict of diagnostics (e.g. estimated leverage scores).
    """


@hookspec(historic=True)
def register_predictors(register) -> None:
    """Register predictor kinds, so that saved models can be loaded.

    Call ``register(kind, cls)`` where ``cls.kind == kind`` and ``cls.from_state(state, kernel)``
    rebuilds a predictor from the tensors and plain values its ``state_dict()`` returned
    (see :class:`kgp.plugin.Predictor`). The core registers ``kernel_expansion``; a solver whose
    result has another form (e.g. a random-feature expansion) registers its own kind.
    """


@hookspec(historic=True)
def register_objectives(register) -> None:
    """Register hyperparameter objectives by name (what ``KernelRegressor(learn=NAME)`` minimises).

    Call ``register(name, objective)`` for each objective. ``objective`` must satisfy
    :class:`kgp.plugin.Objective`:

    - ``capabilities = kgp.Capabilities(...)``: ``uses_centers`` (it needs ``problem.centers``; the
      model selects them with the center selector, or takes the explicit ``centers``),
      ``distributed`` (it accepts ``problem.shard``), ``loop_defaults``, the loop's defaults that
      suit it, e.g. ``{"optimizer": "lbfgs", "iterations": 50}`` (validated; ``learn_options``
      override them), and ``likelihood`` (its value is a negative log likelihood per point, below);
    - ``option_defaults``: every option it accepts, each a :class:`kgp.Option` (the user passes them
      in ``learn_options`` next to the loop's own options; unknown names are rejected before any
      work); ``problem.options`` holds them resolved;
    - ``prepare(problem) -> loss``: called once per learning run with a
      :class:`kgp.learning.LearningProblem` (training data, a kernel whose GPyTorch parameters
      are being trained, optional centers with weights, a seeded generator, the resolved options).
      Draw anything random (e.g. a subset of rows) here, from ``problem.generator``. It returns a
      :class:`kgp.learning.ObjectiveLoss` ``(loss, terms)`` (a bare function ``loss`` is accepted
      too, its ``terms`` read from an attribute of that name), with ``loss(noise, mean) -> Tensor``:
      ``noise`` is the current noise variance sigma^2 (a 0-d tensor), ``mean`` the current constant
      mean (one value per output); ``loss`` returns a differentiable 0-d tensor **to minimise, per
      data point** (e.g. the negative log marginal likelihood divided by the number of points and
      outputs it was computed on), reading the kernel's current hyperparameters from
      ``problem.kernel``. kgp owns the optimisation loop (torch.optim over the kernel's raw
      parameters, the raw noise and the mean), adds the kernel's GPyTorch priors, and stops with an
      error on a NaN or infinite value. An objective whose value is a negative log likelihood per
      point declares ``Capabilities(likelihood=True)`` and sets ``terms`` to the number of (row,
      output) terms it averages: the model then reports ``-value * terms`` as
      ``log_marginal_likelihood_value_``.

    Every kernel product goes through ``problem.kernel_operator`` (or :func:`kgp.kernel_operator`
    on row blocks), never n x n (an objective that needs the dense matrix refuses n above
    ``kgp.settings.max_exact_size.value()``), and n x M only within
    ``kgp.settings.memory_budget.value(device)`` bytes. The conformance kit
    (:class:`kgp.testing.ObjectiveConformance`) checks all of this.
    """


@hookspec(historic=True)
def register_recipes(register) -> None:
    """Register recipes by name: what ``solver="auto"`` / ``learn="auto"`` run (:mod:`kgp.recipes`).

    Call ``register(name, recipe)``; ``recipe.choose(request: kgp.recipes.RecipeRequest) ->
    kgp.recipes.RecipeChoice`` sees the data's shape and the machine's limits (never the data) and names
    the solver, the number of centers, the objective and their options, with one line of reason each.
    The estimators ask the recipe named ``"auto"``; kgp's built-in one (``kgp_builtins.recipes``) holds
    the measured rule, and a built-in name always wins over a third party's.
    """
