"""The `kgp` command never mis-reads data: columns by name, targets in range, scoring only when asked,
and one-line errors that name the flag."""

from __future__ import annotations

import numpy as np
import pytest

import kgp
from kgp.cli import main
from kgp.cli_data import NamedColumns


def _write_csv(path, header, rows):
    with open(path, "w") as fh:
        if header is not None:
            fh.write(",".join(header) + "\n")
        for row in rows:
            fh.write(",".join(repr(float(v)) for v in row) + "\n")
    return path


@pytest.fixture
def table(tmp_path):
    """A CSV with features x1, x2, x3 and a target; the target depends on every feature."""
    rng = np.random.default_rng(0)
    X = rng.normal(size=(120, 3))
    y = np.sin(X[:, 0]) + 0.5 * X[:, 1] - X[:, 2] ** 2 / 2
    path = _write_csv(tmp_path / "d.csv", ["x1", "x2", "x3", "target"], np.column_stack([X, y]))
    return path, X, y


def _fit(tmp_path, data, *extra):
    model = tmp_path / "m.pt"
    assert main(["fit", "--data", str(data), "--noise", "0.01", "--out", str(model), *extra]) == 0
    return model


def _r2(out: str) -> float:
    return float(out.split("R2 ")[1].split(";")[0])


def test_predict_selects_columns_by_name_in_any_order(tmp_path, table, capsys):
    data, X, y = table
    model = _fit(tmp_path, data, "--target", "target")
    assert kgp.load(model).feature_names_in_.tolist() == ["x1", "x2", "x3"]
    shuffled = _write_csv(
        tmp_path / "s.csv", ["target", "x3", "x1", "x2"], np.column_stack([y, X[:, 2], X[:, 0], X[:, 1]])
    )
    capsys.readouterr()
    for file in (data, shuffled):
        assert main(["predict", "--model", str(model), "--data", str(file), "--target", "target"]) == 0
    first, second = capsys.readouterr().out.splitlines()
    assert _r2(first) > 0.95 and _r2(first) == _r2(second)  # the reordered file predicts the same
    out = tmp_path / "p.npy"
    assert main(["predict", "--model", str(model), "--data", str(shuffled), "--out", str(out)]) == 0
    expected = kgp.load(model).predict(NamedColumns(X, ["x1", "x2", "x3"]))
    np.testing.assert_allclose(np.load(out), expected, rtol=0, atol=0)


def test_a_target_column_left_in_the_file_is_not_used_as_a_feature(tmp_path, table, capsys):
    """Fitted with --target x3, predicted on the same file: x3 is a feature, 'target' is not (issue: it was)."""
    data, X, y = table
    model = _fit(tmp_path, data, "--target", "x3")
    assert kgp.load(model).feature_names_in_.tolist() == ["x1", "x2", "target"]
    out = tmp_path / "p.npy"
    capsys.readouterr()
    assert main(["predict", "--model", str(model), "--data", str(data), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "columns not used: x3" in text and "R2" not in text  # nothing scored without --target
    np.testing.assert_allclose(
        np.load(out),
        kgp.load(model).predict(NamedColumns(np.column_stack([X[:, :2], y]), ["x1", "x2", "target"])),
        rtol=0,
        atol=0,
    )


def test_a_missing_feature_name_is_refused(tmp_path, table, capsys):
    data, X, y = table
    model = _fit(tmp_path, data)
    partial = _write_csv(tmp_path / "p.csv", ["x1", "x3", "target"], np.column_stack([X[:, 0], X[:, 2], y]))
    capsys.readouterr()
    assert main(["predict", "--model", str(model), "--data", str(partial)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "lacks the model's feature column(s) 'x2'" in err


def test_headerless_file_goes_by_position_with_a_note_and_exact_width(tmp_path, table, capsys):
    data, X, y = table
    model = _fit(tmp_path, data)
    bare = _write_csv(tmp_path / "bare.csv", None, X)
    capsys.readouterr()
    assert main(["predict", "--model", str(model), "--data", str(bare)]) == 0
    assert "taking its 3 columns by position as the model's features x1, x2, x3" in capsys.readouterr().err
    wide = _write_csv(tmp_path / "wide.csv", None, np.column_stack([X, y]))
    assert main(["predict", "--model", str(model), "--data", str(wide)]) == 1
    assert "has 4 feature column(s) but the model expects 3; if one of them is the target, name it with --target" in (
        capsys.readouterr().err
    )
    assert main(["predict", "--model", str(model), "--data", str(wide), "--target", "3"]) == 0
    assert _r2(capsys.readouterr().out) > 0.95


def test_target_index_out_of_range_is_an_error(tmp_path, table, capsys):
    data, X, y = table
    assert main(["fit", "--data", str(data), "--target", "99", "--out", str(tmp_path / "m.pt")]) == 1
    err = capsys.readouterr().err
    assert "--target: column index 99 is out of range" in err and "has 4 columns" in err
    assert not (tmp_path / "m.pt").exists()
    assert main(["fit", "--data", str(data), "--target", "-1", "--out", str(tmp_path / "m.pt")]) == 0
    assert "target target" in capsys.readouterr().out
    assert main(["fit", "--data", str(data), "--target", "nope", "--out", str(tmp_path / "m.pt")]) == 1
    assert "'nope' is not a column" in capsys.readouterr().err


def test_npz_scores_only_when_asked_like_csv(tmp_path, table, capsys):
    _, X, y = table
    np.savez(tmp_path / "d.npz", X=X, y=y, feature_names=np.array(["a", "b", "c"]))
    model = _fit(tmp_path, tmp_path / "d.npz")
    assert kgp.load(model).feature_names_in_.tolist() == ["a", "b", "c"]
    capsys.readouterr()
    assert main(["predict", "--model", str(model), "--data", str(tmp_path / "d.npz")]) == 0
    assert "R2" not in capsys.readouterr().out
    assert main(["predict", "--model", str(model), "--data", str(tmp_path / "d.npz"), "--target", "y"]) == 0
    assert _r2(capsys.readouterr().out) > 0.95
    assert main(["predict", "--model", str(model), "--data", str(tmp_path / "d.npz"), "--target", "3"]) == 1
    assert "has no array '3'" in capsys.readouterr().err


def test_model_flag_errors(tmp_path, table, capsys):
    data, _, _ = table
    assert main(["predict", "--model", str(tmp_path / "missing.pt"), "--data", str(data)]) == 1
    assert capsys.readouterr().err == f"kgp predict: error: --model: no such file {tmp_path / 'missing.pt'}\n"
    (tmp_path / "empty.pt").write_bytes(b"")
    (tmp_path / "foreign.pt").write_text("x1,x2\n1,2\n")
    for bad in ("empty.pt", "foreign.pt"):
        assert main(["predict", "--model", str(tmp_path / bad), "--data", str(data)]) == 1
        err = capsys.readouterr().err
        assert err.startswith("kgp predict: error: --model: ") and err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("x1,x2,y\n", "has a header but no data rows"),
        ("", "is empty"),
        ("1,2,3,4\n0.5,0.1,0.2,1.0\n0.3,0.2,0.1,2.0\n", "looks like column numbers"),
        ("a,b,y\n1,2,3\n4,5\n", "line 3 has 2 fields, expected 3"),
        ("a,b,y\n1,x,3\n", "line 2, column 'b': 'x' is not a number"),
        ("a,a,y\n1,2,3\n", "repeats column name(s) 'a'"),
    ],
)
def test_malformed_csv_gives_one_line(tmp_path, capsys, content, message):
    (tmp_path / "bad.csv").write_text(content)
    assert main(["fit", "--data", str(tmp_path / "bad.csv"), "--out", str(tmp_path / "m.pt")]) == 1
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and err.startswith("kgp fit: error: --data: ")


def test_numeric_header_is_read_when_told(tmp_path, capsys):
    rng = np.random.default_rng(1)
    X = rng.normal(size=(40, 3))
    data = _write_csv(tmp_path / "n.csv", ["1", "2", "3", "4"], np.column_stack([X, X[:, 0]]))
    assert main(["fit", "--data", str(data), "--header", "yes", "--out", str(tmp_path / "m.pt")]) == 0
    assert kgp.load(tmp_path / "m.pt").feature_names_in_.tolist() == ["1", "2", "3"]
    assert "fitted 40 x 3" in capsys.readouterr().out
    assert main(["fit", "--data", str(data), "--header", "no", "--out", str(tmp_path / "m.pt")]) == 0
    assert "fitted 41 x 3" in capsys.readouterr().out


def test_data_directory_and_binary_file(tmp_path, capsys):
    assert main(["fit", "--data", str(tmp_path), "--out", str(tmp_path / "m.pt")]) == 1
    assert "is a directory" in capsys.readouterr().err
    (tmp_path / "b.csv").write_bytes(bytes(range(256)) * 4)
    assert main(["fit", "--data", str(tmp_path / "b.csv"), "--out", str(tmp_path / "m.pt")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--data:" in err


def test_version_and_help_with_defaults(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.strip() == f"kgp {kgp.__version__}"
    with pytest.raises(SystemExit):
        main(["fit", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: auto)" in text and "(default: 0.01)" in text and "(default: auto)" in text
    assert "--device" in text and "--selector-option" in text and "--header" in text


def test_errors_speak_cli_flags(tmp_path, table, capsys):
    data, _, _ = table
    args = ["fit", "--data", str(data), "--solver", "exact", "--n-centers", "5", "--out", str(tmp_path / "m.pt")]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "leave out --centers and --n-centers" in err and "n_centers" not in err
    assert main(["fit", "--data", str(data), "--noise", "-1", "--out", str(tmp_path / "m.pt")]) == 1
    assert "error: --noise: expected a finite positive number" in capsys.readouterr().err


def test_device_flag(tmp_path, table, capsys):
    data, _, _ = table
    assert main(["fit", "--data", str(data), "--device", "cpu", "--out", str(tmp_path / "m.pt")]) == 0
    assert main(["fit", "--data", str(data), "--device", "gpu0", "--out", str(tmp_path / "m.pt")]) == 1
    assert "--device: expected a torch device" in capsys.readouterr().err
