"""The Posterior: one object for the mean and the variance; its state is validated entry by entry on load.

Oracles: the dense exact GP posterior (Rasmussen & Williams 2006, Alg. 2.1) and the DTC variance
computed densely (Titsias 2009, eq. 6); model files forged with a recomputed checksum must
fail at ``kgp.load`` with a ModelFileError naming the entry, before any allocation sized by the file.
"""

from __future__ import annotations

import copy
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import kgp
from kgp import io
from kgp.posterior import Posterior, PosteriorStateError

DATA = Path(__file__).resolve().parent / "data"
rng = np.random.default_rng(3)
X = rng.uniform(-2, 2, size=(120, 3))
Y = np.sin(X @ np.array([1.0, 0.5, -0.7])) + 0.05 * rng.normal(size=120)
XQ = rng.uniform(-2.5, 2.5, size=(25, 3))
NOISE = 0.05


def _rebuild(state, kernel, n_features):
    """A float64 CPU posterior of one output over a kernel expansion, from its state."""
    return Posterior.from_state(
        state,
        kernel,
        kgp.KernelExpansion,
        n_features=n_features,
        n_outputs=1,
        device=torch.device("cpu"),
        dtype=torch.float64,
    )


def _dense_exact(Xt, y, Xq, lengthscale, noise):
    def k(a, b):
        return np.exp(-0.5 * ((a[:, None, :] - b[None, :, :]) ** 2).sum(-1) / lengthscale**2)

    C = k(Xt, Xt) + noise * np.eye(len(Xt))
    kq = k(Xt, Xq)
    mean = kq.T @ np.linalg.solve(C, y)
    var = 1.0 - np.einsum("ij,ij->j", kq, np.linalg.solve(C, kq))
    return mean, np.sqrt(np.clip(var, 0, None))


def test_the_exact_posterior_matches_the_dense_gp():
    model = kgp.KernelRegressor("rbf", lengthscale=0.8, noise=NOISE, solver="exact").fit(X, Y)
    assert isinstance(model.posterior_, Posterior) and model.posterior_.variance_kind == "exact"
    mean, std = model.predict(XQ, return_std=True)
    ref_mean, ref_std = _dense_exact(X, Y, XQ, 0.8, NOISE)
    np.testing.assert_allclose(mean, ref_mean, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(std, ref_std, rtol=1e-7, atol=1e-8)


def test_a_nystrom_model_saved_before_any_std_gives_its_std_after_loading(tmp_path):
    """Every saved GP gives its std (the file keeps what the variance needs)."""
    model = kgp.KernelRegressor("rbf", lengthscale=0.8, noise=NOISE, solver="falkon", n_centers=40, random_state=0)
    model.fit(X, Y)
    model.save(tmp_path / "m.pt")  # no return_std call before saving
    _, std = model.predict(XQ, return_std=True)
    loaded = kgp.load(tmp_path / "m.pt")
    mean2, std2 = loaded.predict(XQ, return_std=True)
    np.testing.assert_allclose(std2, std, rtol=1e-12)
    np.testing.assert_array_equal(mean2, model.predict(XQ))
    # the DTC variance, densely: k(x,x) - Q(x,x) + s^2 k_Mx^T (s^2 K_MM + K_Mn K_nM)^{-1} k_Mx
    Z = model.centers_.numpy()

    def k(a, b):
        return np.exp(-0.5 * ((a[:, None, :] - b[None, :, :]) ** 2).sum(-1) / 0.8**2)

    kmm, knm, kmq = k(Z, Z), k(X, Z), k(Z, XQ)
    q = np.einsum("ij,ij->j", kmq, np.linalg.solve(kmm, kmq))
    s = NOISE * kmm + knm.T @ knm
    dtc = 1.0 - q + NOISE * np.einsum("ij,ij->j", kmq, np.linalg.solve(s, kmq))
    np.testing.assert_allclose(std2, np.sqrt(np.clip(dtc, 0, None)), rtol=1e-5, atol=1e-7)


def test_the_state_round_trips_exactly():
    model = kgp.KernelRegressor("rbf", lengthscale=0.8, noise=NOISE, solver="falkon", n_centers=10, random_state=1)
    model.fit(X, Y)
    model.predict(XQ, return_std=True)  # factors built: the state holds them
    post = model.posterior_
    state = post.state_dict()
    assert state["version"] == 1 and "factors" in state["variance"] and "train_X" not in state["variance"]
    rebuilt = _rebuild(state, post.kernel, n_features=3)
    Xq = torch.from_numpy(XQ)
    assert torch.equal(rebuilt.mean(Xq), post.mean(Xq)) and torch.equal(rebuilt.std(Xq), post.std(Xq))


@pytest.mark.parametrize(
    ("edit", "entry"),
    [
        (lambda s: s.__setitem__("noise", -5.0), "posterior.noise"),
        (lambda s: s.__setitem__("y_std", torch.zeros(1, dtype=torch.float64)), "posterior.y_std"),
        (lambda s: s.__setitem__("y_std", -torch.ones(1, dtype=torch.float64)), "posterior.y_std"),
        (lambda s: s.__setitem__("offset", torch.zeros(3, dtype=torch.float64)), "posterior.offset"),
        (lambda s: s["variance"].__setitem__("kind", "bogus"), "posterior.variance.kind"),
        (lambda s: s.__setitem__("version", 7), "posterior.version"),
        (
            lambda s: s["variance"]["factors"]["triangles"].diagonal().__setitem__(0, 0.0),
            "posterior.variance.factors.triangles",
        ),
        (
            lambda s: s["variance"]["factors"].__setitem__("triangles", torch.eye(5, dtype=torch.float64)),
            "posterior.variance.factors.triangles",
        ),
        (lambda s: s["variance"]["factors"]["triangles"].__setitem__((2, 7), math.nan), "factors.triangles"),
        (lambda s: s["variance"]["factors"].__setitem__("chol_s_diagonal", torch.ones(10, 10)), "chol_s_diagonal"),
        (lambda s: s["variance"]["factors"]["chol_s_diagonal"].__setitem__(4, -1.0), "chol_s_diagonal"),
        (
            lambda s: s["variance"]["factors"].__setitem__(
                "chol_s_diagonal", s["variance"]["factors"]["chol_s_diagonal"].float()
            ),
            "chol_s_diagonal",
        ),
        (lambda s: s["variance"]["factors"].__setitem__("kind", "exact"), "posterior.variance.factors.kind"),
        (lambda s: s["variance"].__setitem__("centers", torch.zeros(10, 2)), "posterior.variance.centers"),
    ],
)
def test_each_entry_of_a_posterior_state_is_checked(edit, entry):
    model = kgp.KernelRegressor("rbf", lengthscale=0.8, noise=NOISE, solver="falkon", n_centers=10, random_state=1)
    model.fit(X, Y).predict(XQ, return_std=True)
    state = copy.deepcopy(model.posterior_.state_dict())
    edit(state)
    with pytest.raises(PosteriorStateError, match=entry.replace(".", r"\.")):
        _rebuild(state, model.kernel_, n_features=3)


# ---------------------------------------------------------------------- forged model files
def _forge(tmp_path, state, name="forged.pt"):
    body = {k: v for k, v in state.items() if k not in ("format", "format_version", "checksum")}
    path = tmp_path / name
    io.write_model(body, path)  # a recomputed checksum: only the contents' checks can catch it
    return path


def _load_error(path) -> str:
    with pytest.raises(kgp.ModelFileError) as info:
        kgp.load(path)
    message = str(info.value)
    assert "\n" not in message and str(path) in message
    return message


@pytest.fixture(scope="module")
def saved_gp(tmp_path_factory):
    root = tmp_path_factory.mktemp("gp")
    model = kgp.KernelRegressor(
        "rbf", ard=True, learn="exact", normalize_y=True, random_state=0, learn_options={"iterations": 5}
    ).fit(X, Y)
    model.predict(XQ, return_std=True)
    model.save(root / "gp.pt")
    falkon = kgp.KernelRegressor("rbf", lengthscale=0.8, noise=NOISE, solver="falkon", n_centers=10, random_state=1)
    falkon.fit(X, Y).predict(XQ, return_std=True)
    falkon.save(root / "falkon.pt")
    return root


@pytest.mark.parametrize(
    ("file", "edit", "message"),
    [
        ("gp.pt", lambda s: s["posterior"].__setitem__("noise", -5.0), "posterior.noise"),
        ("gp.pt", lambda s: s["posterior"].__setitem__("y_std", torch.zeros(1, dtype=torch.float64)), "y_std"),
        ("gp.pt", lambda s: s["posterior"].__setitem__("y_std", -torch.ones(1, dtype=torch.float64)), "y_std"),
        ("gp.pt", lambda s: s["posterior"]["variance"].__setitem__("kind", "bogus"), "posterior.variance.kind"),
        (
            "falkon.pt",
            lambda s: s["posterior"]["variance"]["factors"]["triangles"].diagonal().__setitem__(3, 0.0),
            "posterior.variance.factors.triangles",
        ),
        (
            "falkon.pt",
            lambda s: s["posterior"]["variance"]["factors"].__setitem__("triangles", torch.eye(4, dtype=torch.float64)),
            "posterior.variance.factors.triangles: expected a matrix of shape (10, 10)",
        ),
        (
            "gp.pt",
            lambda s: s["kernel_state"].__setitem__("raw_outputscale", torch.tensor(1e300, dtype=torch.float64)),
            "the mean at the probe rows differs",
        ),
        ("gp.pt", lambda s: s["fitted"].__setitem__("n_features_in", 10**12), "fitted.n_features_in"),
        (
            "gp.pt",
            lambda s: s["kernel_spec"]["children"][0]["kwargs"].__setitem__("ard_num_dims", 10**12),
            "ard_num_dims",
        ),
        ("gp.pt", lambda s: s["probe"].__setitem__("mean", s["probe"]["mean"] + 1.0), "probe rows differs"),
    ],
)
def test_forged_model_files_fail_at_load_naming_the_entry(saved_gp, tmp_path, file, edit, message):
    state = torch.load(saved_gp / file, weights_only=True)
    edit(state)
    assert message in _load_error(_forge(tmp_path, state))


def test_a_deeply_nested_entry_fails_at_load(saved_gp, tmp_path):
    state = torch.load(saved_gp / "gp.pt", weights_only=True)
    nested: list = []
    for _ in range(3000):
        nested = [nested]
    state["fitted"]["learning"]["history"] = nested
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(20_000)  # a forger's Python can write what kgp's recursion limit cannot walk
    try:
        path = _forge(tmp_path, state)
    finally:
        sys.setrecursionlimit(limit)
    assert "nested too deeply" in _load_error(path)


@pytest.mark.parametrize("name", ["falkon_std", "exact_gp", "classifier"])
def test_files_of_format_version_2_still_load(name):
    """Files written by kgp before the Posterior (format version 2) load and predict as they did."""
    expected = np.load(DATA / "model_v2_expected.npz")
    model = kgp.load(DATA / f"model_v2_{name}.pt")
    Xq = expected["Xq"]
    if name == "classifier":
        np.testing.assert_allclose(model.predict_proba(Xq), expected["clf_proba"], rtol=1e-12)
        return
    key = "reg" if name == "falkon_std" else "gp"
    mean, std = model.predict(Xq, return_std=True)
    np.testing.assert_allclose(mean, expected[f"{key}_mean"], rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(std, expected[f"{key}_std"], rtol=1e-10, atol=1e-14)


def test_the_covariance_is_the_dense_exact_posterior_covariance_and_sample_y_draws_from_it():
    model = kgp.KernelRegressor("rbf", lengthscale=0.8, noise=NOISE, solver="exact").fit(X, Y)
    Xq = XQ[:8]

    def k(a, b):
        return np.exp(-0.5 * ((a[:, None, :] - b[None, :, :]) ** 2).sum(-1) / 0.8**2)

    C = k(X, X) + NOISE * np.eye(len(X))
    ref = k(Xq, Xq) - k(Xq, X) @ np.linalg.solve(C, k(X, Xq))
    cov = model.posterior_.covariance(torch.from_numpy(Xq)).numpy()
    np.testing.assert_allclose(cov, ref, atol=1e-9)
    draws = model.sample_y(Xq, n_samples=4000, random_state=0)
    assert draws.shape == (8, 4000)
    # 4000 draws: the sample mean is within 5 standard errors of the posterior mean, the covariance close
    mean = model.predict(Xq)
    se = np.sqrt(np.clip(np.diag(ref), 1e-12, None) / 4000)
    assert np.all(np.abs(draws.mean(1) - mean) < 5 * se + 1e-9)
    np.testing.assert_allclose(np.cov(draws), ref, atol=0.1 * np.abs(ref).max())
    np.testing.assert_array_equal(draws, model.sample_y(Xq, n_samples=4000, random_state=0))


def test_fit_hyperparameters_learns_what_fit_learns_and_leaves_the_estimator_unfitted():
    params = dict(learn="exact", random_state=0, learn_options={"iterations": 8})
    learned = kgp.KernelRegressor("rbf", **params).fit_hyperparameters(X, Y)
    fitted = kgp.KernelRegressor("rbf", **params).fit(X, Y)
    assert learned["noise"] == fitted.noise_ and torch.equal(learned["mean"], fitted.mean_)
    assert learned["history"] == fitted.learn_history_
    for a, b in zip(learned["kernel"].parameters(), fitted.kernel_.parameters()):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="fit_hyperparameters: set learn"):
        kgp.KernelRegressor("rbf").fit_hyperparameters(X, Y)


@pytest.mark.parametrize(
    ("centers", "ask_std", "stored"), [(10, True, "factors"), (60, True, "factors"), (60, False, "train_X")]
)
def test_a_model_file_keeps_built_nystrom_factors_else_the_rows(tmp_path, centers, ask_std, stored):
    """Built factors are stored even where they outnumber the rows (60 centers: 7,200 numbers against n d = 360):
    the loaded model's std then needs no Gram pass; a fit that never built them stores the rows."""
    model = kgp.KernelRegressor("rbf", lengthscale=0.8, noise=NOISE, solver="falkon", n_centers=centers)
    model.fit(X, Y)
    if ask_std:
        model.predict(XQ[:1], return_std=True)
    model.save(tmp_path / "m.pt")
    _, std = model.predict(XQ, return_std=True)
    variance = torch.load(tmp_path / "m.pt", weights_only=True)["posterior"]["variance"]
    assert stored in variance and ({"factors", "train_X"} - {stored}).isdisjoint(variance)
    loaded = kgp.load(tmp_path / "m.pt")
    assert loaded.posterior_.variance.built == ask_std
    np.testing.assert_allclose(loaded.predict(XQ, return_std=True)[1], std, rtol=1e-12)


def test_the_nystrom_factors_are_one_array_that_solves_as_both_cholesky_factors():
    """``triangles`` + ``chol_s_diagonal`` give the two projections of the DTC variance that separate factors
    of ``K_MM`` and ``noise K_MM + K_Mn K_nM`` (numpy's Cholesky, dense) give, and the model holds and stores
    one M x M array and an M-vector, not two M x M ones."""
    from kgp.variance.nystrom import nystrom_factors

    model = kgp.KernelRegressor("rbf", lengthscale=0.3, noise=NOISE, solver="falkon", n_centers=700, random_state=0)
    Xt = np.concatenate([X, rng.uniform(-2, 2, size=(1200, 3))])  # M = 700 > one 512-column panel of the fold
    Yt = np.sin(Xt @ np.array([1.0, 0.5, -0.7]))
    model.fit(Xt, Yt)
    Z = model.posterior_.variance.centers
    factors = nystrom_factors(model.kernel_, torch.from_numpy(Xt), Z, NOISE)
    kernel = model.kernel_
    with torch.no_grad():
        kzz = kernel(Z).to_dense().numpy()
        kzn = kernel(Z, torch.from_numpy(Xt)).to_dense().numpy()
        kx = kernel(Z, torch.from_numpy(XQ)).to_dense()
    L = np.linalg.cholesky(kzz)
    L_s = np.linalg.cholesky(NOISE * kzz + kzn @ kzn.T)
    (w0, P0), (w1, P1) = factors.projections(kx.clone())
    assert (w0, w1) == (-1.0, NOISE)
    # relative to the solves' scale, with the condition numbers of the two factors (rounding of both sides)
    for P, F in ((P0, L), (P1, L_s)):
        ref = np.linalg.solve(F, kx.numpy())
        cond = np.linalg.cond(F)
        np.testing.assert_allclose(P.numpy(), ref, rtol=0, atol=100 * cond * np.finfo(float).eps * np.abs(ref).max())
    assert factors.triangles.shape == (700, 700) and factors.chol_s_diagonal.shape == (700,)
    np.testing.assert_allclose(factors.chol_s_diagonal.numpy(), np.diag(L_s), rtol=1e-8)


def test_files_of_format_version_3_still_load():
    """A file with the two square factors (``chol``, ``chol_s``; kgp's format version 3) loads, folds them and
    predicts the std it was saved with; their entries are still checked by name."""
    expected = np.load(DATA / "model_v3_expected.npz")
    path = DATA / "model_v3_falkon_std.pt"
    state = torch.load(path, weights_only=True)
    assert state["format_version"] == 3 and {"chol", "chol_s"} <= set(state["posterior"]["variance"]["factors"])
    model = kgp.load(path)
    mean, std = model.predict(expected["Xq"], return_std=True)
    np.testing.assert_allclose(mean, expected["reg_mean"], rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(std, expected["reg_std"], rtol=1e-10, atol=1e-14)
    factors = state["posterior"]["variance"]["factors"]
    factors["chol_s"][0, 5] = 1.0  # not lower triangular
    with pytest.raises(PosteriorStateError, match=r"posterior\.variance\.factors\.chol_s"):
        _rebuild(state["posterior"], model.kernel_, n_features=2)


@pytest.mark.parametrize("mapped", [True, False], ids=["mapped", "read"])
def test_a_loaded_model_does_not_read_its_file_again(tmp_path, monkeypatch, mapped):
    """The file is mapped (or read) and its tensors copied: a model loaded from it predicts the same after the
    file is overwritten in place (``cp other.kgp model.kgp`` keeps the inode) or truncated."""
    model = kgp.KernelRegressor("rbf", lengthscale=0.8, noise=NOISE, solver="falkon", n_centers=40, random_state=0)
    model.fit(X, Y).predict(XQ[:1], return_std=True)
    path = tmp_path / "m.kgp"
    model.save(path)
    if not mapped:  # a system without /proc/self/fd: torch reads the open file
        monkeypatch.setattr(io, "_OPEN_FILE_PATH", str(tmp_path / "absent" / "{}"))
    loaded = kgp.load(path)
    size = path.stat().st_size
    with open(path, "r+b") as fh:  # same inode: a mapping would now see these bytes
        fh.write(b"\xff" * size)
    mean, std = loaded.predict(XQ, return_std=True)
    with open(path, "r+b") as fh:
        fh.truncate(0)  # a mapping's pages past the end would now fault (SIGBUS)
    np.testing.assert_array_equal(loaded.predict(XQ, return_std=True)[1], std)
    np.testing.assert_array_equal(mean, model.predict(XQ))
    np.testing.assert_array_equal(std, model.predict(XQ, return_std=True)[1])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a torch without CUDA")
def test_loading_onto_an_absent_device_names_it(saved_gp):
    with pytest.raises(ValueError, match="device: 'cuda:0' requested, but CUDA is not available"):
        kgp.load(saved_gp / "gp.pt", device="cuda:0")


@pytest.mark.parametrize("learn", [None, "exact"])
def test_an_exact_fit_reuses_the_solvers_factor_for_its_std(monkeypatch, learn):
    """The exact solve's Cholesky factor of K + s^2 I is handed on (kgp.plugin.Solution), not rebuilt."""
    import kgp.variance.exact as exact_module

    calls = []
    original = exact_module.exact_factors
    monkeypatch.setattr(exact_module, "exact_factors", lambda *a, **k: calls.append(1) or original(*a, **k))
    options = {"learn": learn, "learn_options": {"iterations": 5}} if learn else {"noise": NOISE}
    model = kgp.KernelRegressor("rbf", solver="exact", random_state=0, **options)
    model.fit(X, Y)
    assert model.posterior_.variance.built
    _, std = model.predict(XQ, return_std=True)
    assert not calls
    rebuilt = original(model.kernel_, model.posterior_.predictor.centers, model.noise_)
    scaled = model.posterior_.inputs(torch.from_numpy(XQ))
    ref = (kgp.variance.latent_variance(model.kernel_, scaled, rebuilt).sqrt() * model._y_train_std).numpy()
    np.testing.assert_allclose(std, ref, rtol=1e-10, atol=1e-14)
