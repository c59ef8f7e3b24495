"""Model files are validated on load: one ModelFileError, one line, for every damaged, foreign, tampered or
inconsistent file, from Python and from `kgp predict`; pickled code is never run."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
import torch

import kgp
from kgp import io
from kgp.cli import main

_rng = np.random.default_rng(0)
X = _rng.normal(size=(80, 2))
Y = np.sin(X[:, 0]) + X[:, 1]
LABELS = np.digitize(X[:, 0], [-0.5, 0.5])  # three classes


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    reg = kgp.KernelRegressor(noise=0.1, solver="falkon", n_centers=20, random_state=0).fit(X, Y)
    clf = kgp.KernelClassifier(noise=0.1, random_state=0).fit(X, LABELS)
    reg.save(root / "reg.pt")
    clf.save(root / "clf.pt")
    return root, reg, clf


def _state(path) -> dict:
    return torch.load(path, weights_only=True)


def _rewrite(tmp_path, state: dict, name="edited.pt", *, fresh_checksum=True):
    """Write ``state`` as a model file; with ``fresh_checksum`` the checksum matches (a deliberate forgery)."""
    path = tmp_path / name
    body = {k: v for k, v in state.items() if k not in ("format", "format_version", "checksum")}
    if fresh_checksum:
        io.write_model(body, path)
    else:
        torch.save(state, path)
    return path


def _load_error(path) -> str:
    with pytest.raises(kgp.ModelFileError) as info:
        kgp.load(path)
    message = str(info.value)
    assert "\n" not in message and str(path) in message and "weights_only" not in message
    return message


def test_round_trip_is_exact_and_checksummed(saved):
    root, reg, clf = saved
    state = _state(root / "reg.pt")
    assert state["format_version"] == io.FORMAT_VERSION == 4 and state["checksum"] == io.checksum(state)
    np.testing.assert_array_equal(kgp.load(root / "reg.pt").predict(X), reg.predict(X))
    np.testing.assert_array_equal(kgp.load(root / "clf.pt").predict_proba(X), clf.predict_proba(X))


def test_empty_truncated_and_foreign_files(saved, tmp_path):
    root, _, _ = saved
    (tmp_path / "empty.pt").write_bytes(b"")
    assert "empty file" in _load_error(tmp_path / "empty.pt")
    raw = (root / "reg.pt").read_bytes()
    for fraction in (0.1, 0.5, 0.9):
        (tmp_path / "cut.pt").write_bytes(raw[: int(len(raw) * fraction)])
        assert "truncated or corrupted" in _load_error(tmp_path / "cut.pt")
    (tmp_path / "text.pt").write_text("x1,x2\n1,2\n")
    assert "not a kgp model file (not a torch zip archive)" in _load_error(tmp_path / "text.pt")
    torch.save({"weights": torch.zeros(3)}, tmp_path / "other.pt")
    assert "not a kgp model file" in _load_error(tmp_path / "other.pt")
    torch.save(torch.zeros(3), tmp_path / "tensor.pt")
    assert "not a kgp model file" in _load_error(tmp_path / "tensor.pt")
    with pytest.raises(FileNotFoundError, match="no such file"):
        kgp.load(tmp_path / "missing.pt")


def test_a_flipped_byte_in_a_tensor_is_caught_by_the_checksum(saved, tmp_path):
    root, reg, _ = saved
    raw = bytearray((root / "reg.pt").read_bytes())
    alpha = reg.predictor_.alpha.detach().cpu().numpy().tobytes()
    at = bytes(raw).find(alpha)
    assert at > 0  # torch stores tensor data uncompressed
    raw[at + len(alpha) // 2] ^= 0x10
    (tmp_path / "flipped.pt").write_bytes(bytes(raw))
    assert (
        torch.load(tmp_path / "flipped.pt", weights_only=True)["posterior"]["predictor"]["alpha"] is not None
    )  # torch takes it
    assert "checksum mismatch" in _load_error(tmp_path / "flipped.pt")


def test_large_tensors_are_hashed_by_blocks_from_version_4_and_every_byte_counts():
    """Version 4 hashes a tensor above 16 MiB as its blocks' digests (on torch's threads): the same checksum
    whatever the thread count, a flipped byte in any block changes it; versions 2 and 3 keep the one-stream
    SHA-256 (the hash of the same tokens, checked here against hashlib directly)."""
    import hashlib

    big = torch.arange(5 * 2**20, dtype=torch.float64)  # 40 MiB: three blocks
    contents = {"format_version": 4, "w": big, "name": "m"}
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = io.checksum(contents)
    finally:
        torch.set_num_threads(threads)
    assert one.startswith("sha256-blocks:") and io.checksum(contents) == one
    for position in (0, 2**24 // 8 + 3, big.numel() - 1):  # in the first, second and last block
        flipped = big.clone()
        flipped.view(torch.uint8)[position * 8] ^= 1
        assert io.checksum({**contents, "w": flipped}) != one
    old = {**contents, "format_version": 3}
    stream = hashlib.sha256()
    for token in io._tokens({k: v for k, v in old.items()}):
        stream.update(token)
    assert io.checksum(old) == "sha256:" + stream.hexdigest()


def test_a_swapped_kernel_spec_is_caught(saved, tmp_path):
    root, _, _ = saved
    state = _state(root / "reg.pt")
    matern = copy.deepcopy(state)
    matern["kernel_spec"] = kgp.kernels.serialize.kernel_to_spec(__import__("gpytorch").kernels.MaternKernel(nu=2.5))
    # edited in place (stale checksum): the checksum catches it
    assert "checksum mismatch" in _load_error(_rewrite(tmp_path, matern, fresh_checksum=False))
    # a spec whose parameters do not fit the stored hyperparameters is caught even with a forged checksum
    scaled = copy.deepcopy(state)
    scaled["kernel_spec"] = kgp.kernels.serialize.kernel_to_spec(
        __import__("gpytorch").kernels.ScaleKernel(__import__("gpytorch").kernels.RBFKernel())
    )
    assert "inconsistent model file" in _load_error(_rewrite(tmp_path, scaled))


def _predictor(state: dict) -> dict:
    return state["posterior"]["predictor"]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda s: _predictor(s).__setitem__("alpha", _predictor(s)["alpha"] * np.nan), "contains NaN"),
        (lambda s: _predictor(s).__setitem__("centers", _predictor(s)["centers"] * np.inf), "infinite"),
        (lambda s: s["params"].__setitem__("noise", -1.0), "params.noise must be a finite positive number"),
        (lambda s: s["params"].__setitem__("dtype", "float99"), "params.dtype must be one of float32, float64"),
        (lambda s: s["params"].__setitem__("lengthscale", 0.0), "params.lengthscale"),
        (lambda s: s["fitted"].__setitem__("n_features_in", 3), "fitted.n_features_in must be the probe's 2 features"),
        (lambda s: s["fitted"].update(n_outputs=2, y_ndim=2), "records 2"),
        (lambda s: s["fitted"].__setitem__("n_outputs", 2), "fitted.y_ndim must be 1 (one output)"),
        (lambda s: s["fitted"].__setitem__("feature_names", ["a"]), "fitted.feature_names must be 2 strings"),
        (lambda s: s["kernel_state"].__setitem__("raw_lengthscale", torch.zeros(1, 5)), "size mismatch"),
        (lambda s: _predictor(s).__setitem__("alpha", torch.zeros(7, 1)), "inconsistent model file"),
        (lambda s: s["posterior"].__setitem__("predictor", [1, 2]), "posterior.predictor: expected a dict"),
        (lambda s: s.__setitem__("posterior", [1, 2]), "posterior is missing or not a dict"),
        (lambda s: s.__setitem__("estimator", "KernelSomething"), "unknown estimator 'KernelSomething'"),
    ],
)
def test_inconsistent_contents_are_refused_even_with_a_valid_checksum(saved, tmp_path, edit, message):
    root, _, _ = saved
    state = _state(root / "reg.pt")
    edit(state)
    assert message in _load_error(_rewrite(tmp_path, state))


def test_a_changed_class_count_is_refused(saved, tmp_path):
    root, _, _ = saved
    state = _state(root / "clf.pt")
    state["fitted"]["classes"] = [0, 1, 2, 3]
    # the class count sizes the mean offset and the predictor's outputs: either check names the mismatch
    message = _load_error(_rewrite(tmp_path, state))
    assert "posterior.offset: expected a vector of length 1 or 4" in message
    state["fitted"]["classes"] = [1, 1, 2]
    assert "fitted.classes must be a list of at least 2 distinct labels" in _load_error(_rewrite(tmp_path, state))


class _Payload:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))  # would create the marker file if unpickled


def test_a_pickle_with_a_code_payload_is_refused_and_not_run(tmp_path, capsys):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    torch.save({"format": io.FORMAT, "format_version": 2, "params": _Payload(marker)}, path)
    assert not marker.exists()
    message = _load_error(path)
    assert "refused" in message and "never unpickles" in message and not marker.exists()
    with open(tmp_path / "evil.pkl", "wb") as fh:
        pickle.dump(_Payload(marker), fh)
    assert "not a kgp model file" in _load_error(tmp_path / "evil.pkl") and not marker.exists()
    (tmp_path / "d.csv").write_text("a,b\n1,2\n")
    assert main(["predict", "--model", str(path), "--data", str(tmp_path / "d.csv")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kgp predict: error: --model: ") and "refused" in err and err.count("\n") == 1
    assert "weights_only" not in err and not marker.exists()


def test_version_1_files_without_checksum_still_load(tmp_path):
    """A file of kgp before the Posterior (tests/data/model_v2_*.pt), rewritten as version 1 (no checksum)."""
    from pathlib import Path

    data = Path(__file__).resolve().parent / "data"
    state = _state(data / "model_v2_falkon_std.pt")
    state["format_version"] = 1
    del state["checksum"]
    path = tmp_path / "v1.pt"
    torch.save(state, path)
    expected = np.load(data / "model_v2_expected.npz")
    np.testing.assert_allclose(kgp.load(path).predict(expected["Xq"]), expected["reg_mean"], rtol=1e-12, atol=1e-14)
    state["format_version"] = 99
    torch.save(state, path)
    assert "version 99 is not supported" in _load_error(path)


def test_kgp_predict_reports_tampered_files_in_one_line(saved, tmp_path, capsys):
    root, _, _ = saved
    state = _state(root / "reg.pt")
    state["params"]["noise"] = -1.0
    path = _rewrite(tmp_path, state)
    np.savez(tmp_path / "d.npz", X=X)
    assert main(["predict", "--model", str(path), "--data", str(tmp_path / "d.npz")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--model: " in err and "params.noise" in err


@pytest.mark.parametrize(
    ("where", "value", "message"),
    [
        (("estimator",), [], "unknown estimator []"),
        (("params", "dtype"), [], "params.dtype must be one of"),
    ],
)
def test_unhashable_entries_are_refused_not_a_type_error(saved, tmp_path, where, value, message):
    root, _, _ = saved
    state = _state(root / "reg.pt")
    target = state
    for key in where[:-1]:
        target = target[key]
    target[where[-1]] = value
    assert message in _load_error(_rewrite(tmp_path, state))


@pytest.mark.filterwarnings("ignore::kgp.ConvergenceWarning")
def test_variance_rows_that_overflow_the_distances_are_refused(tmp_path):
    # the variance's centers are read only by return_std, so the mean probe cannot see them: a center
    # with an entry of 1e300 (squared: inf) made K_MM NaN at the first predict(return_std=True)
    model = kgp.KernelRegressor("rbf", learn="sgpr", n_centers=12, random_state=0, learn_options={"iterations": 3})
    model.fit(X, Y).save(tmp_path / "gp.pt")
    state = _state(tmp_path / "gp.pt")
    assert state["posterior"]["variance"]["kind"] == "nystrom"
    state["posterior"]["variance"]["centers"][3, 1] = 1e300
    message = _load_error(_rewrite(tmp_path, state))
    assert "variance.centers" in message and "squared norm overflows float64" in message
