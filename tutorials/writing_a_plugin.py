"""Tutorial (d): write a center selector, register it at runtime, check it with ``kgp.testing``.

Run it with ``python tutorials/writing_a_plugin.py [OUTPUT_DIR]`` (about half a minute; the test suite
runs it with fewer center counts). It uses the UCI concrete data that ship inside kgp.

The plugin: **farthest-point (k-center) centers**. Gonzalez's greedy rule starts from one seeded
random training point and repeatedly adds the training point farthest (Euclidean, in the kernel's
lengthscale units when the kernel has a plain ``lengthscale``) from every center chosen so far. The
centers cover the input space evenly, where uniform sampling follows the data density. One pass
over the n points per center: O(n M d) time, O(n) extra memory.

Steps:

1. a selector object with ``capabilities`` (a ``kgp.Capabilities``: what it can do),
   ``option_defaults`` (every option declared) and ``select(request) -> kgp.Centers``
   (docs/plugin-author-guide.md);
2. a hook implementation ``register_selectors(register)`` on a small namespace, registered with
   ``kgp.register(plugin, name=...)`` (no packaging needed while developing; an installed plugin uses
   the ``kgp`` entry-point group instead, same hook);
3. ``kgp.testing.check_selector`` runs the conformance checks (contract, seed, unknown option, and
   FALKON at the chosen centers against the dense Nystrom solution);
4. use it by name next to ``uniform`` and plot test RMSE against M (``plugin_kcenter_vs_uniform.png``);
5. ``kgp.unregister`` removes it again.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import numpy as np
import torch

import kgp
import kgp.testing
from kgp.datasets import load_demo

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _shared import pyplot  # noqa: E402


class FarthestPointSelector:
    """Greedy k-center (farthest-point) centers from the training points; D = I."""

    capabilities = kgp.Capabilities()  # one process (not distributed), no autograd
    option_defaults = {
        "scale_by_lengthscale": kgp.Option.boolean(
            True, help="measure distances in units of the kernel's lengthscale when it has one"
        ),
    }

    def select(self, request: kgp.SelectionRequest) -> kgp.Centers:
        options = request.options  # resolved by kgp before select: validated, defaults filled in
        X = request.X
        n = X.shape[0]
        m = min(request.n_centers or kgp.default_n_centers(n), n)
        Xs = X
        lengthscale = getattr(_base_kernel(request.kernel), "lengthscale", None)
        if options["scale_by_lengthscale"] and lengthscale is not None:
            Xs = X / lengthscale.detach().to(X.dtype).reshape(1, -1)
        chosen = torch.empty(m, dtype=torch.long)
        # the seeded generator of the request: same random_state, same centers
        chosen[0] = torch.randint(n, (1,), generator=request.generator)
        distance = torch.full((n,), float("inf"), dtype=X.dtype, device=X.device)
        for i in range(1, m):
            # squared distance of every point to its nearest center so far (one O(n d) update)
            distance = torch.minimum(distance, ((Xs - Xs[chosen[i - 1]]) ** 2).sum(1))
            chosen[i] = int(torch.argmax(distance))
        return kgp.Centers(points=X[chosen].clone(), indices=chosen)


def _base_kernel(kernel):
    # ScaleKernel(RBFKernel) keeps the lengthscale on its base kernel
    return getattr(kernel, "base_kernel", kernel)


@kgp.hookimpl
def register_selectors(register):
    register("farthest-point", FarthestPointSelector())


def run(output_dir: str | Path = "tutorials/output", *, m_values: tuple[int, ...] = (25, 50, 100, 200, 400)):
    """Register, check, compare with ``uniform``, plot, unregister; return the RMSE curves."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    plugin = types.SimpleNamespace(register_selectors=register_selectors)
    name = kgp.register(plugin, name="tutorial-farthest-point")
    try:
        report = kgp.testing.check_selector("farthest-point", solver="falkon", solver_options={"maxiter": 50})
        print("conformance checks passed:", ", ".join(sorted(report)))

        X, y = load_demo()
        perm = np.random.default_rng(0).permutation(len(y))
        tr, te = perm[:824], perm[824:]
        mu, sd, ymu, ysd = X[tr].mean(0), X[tr].std(0), y[tr].mean(), y[tr].std()
        Xs, ys = (X - mu) / sd, (y - ymu) / ysd
        curves: dict[str, dict[int, float]] = {"uniform": {}, "farthest-point": {}}
        for selector, curve in curves.items():
            for m in m_values:
                model = kgp.KernelRegressor(
                    "rbf",
                    lengthscale=2.0,
                    noise=0.05,
                    solver="falkon",
                    centers=selector,
                    n_centers=m,
                    solver_options={"maxiter": 50},
                    random_state=0,
                )
                pred = model.fit(Xs[tr], ys[tr]).predict(Xs[te]) * ysd + ymu
                curve[m] = float(np.sqrt(np.mean((pred - y[te]) ** 2)))
                print(f"{selector:>15}  M={m:>4}: test RMSE {curve[m]:.2f} MPa")
    finally:
        kgp.unregister(name)

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for selector, curve in curves.items():
        ms = sorted(curve)
        ax.plot(ms, [curve[m] for m in ms], marker="o", label=selector)
    ax.set_xscale("log")
    ax.set_xlabel("M (n_centers)")
    ax.set_ylabel("test RMSE (MPa)")
    ax.set_title("concrete, FALKON: a runtime selector plugin against uniform")
    ax.legend()
    fig.tight_layout()
    fig.savefig(output_dir / "plugin_kcenter_vs_uniform.png", dpi=120)
    plt.close(fig)
    return {"conformance": report, **curves}


if __name__ == "__main__":
    run(sys.argv[1] if len(sys.argv) > 1 else "tutorials/output")
