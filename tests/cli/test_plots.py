"""cli/plots.py: PNG figures from benchmark rows; matplotlib optional, imported only when drawing."""

import contextlib
import os
import subprocess
import sys

import pytest

from conftest import ROOT
from medusa_mini.cli import plots
from medusa_mini.cli.plots import plot_batch, plot_node_sweep


def assert_png(path, *, colours: int) -> None:
    """A figure with at least `colours` line colours: its pixels far from white, grey and black, by hue."""
    image = pytest.importorskip("matplotlib.image").imread(path)[..., :3]  # [H, W, 3] in [0, 1]
    assert image.shape[0] > 200 and image.shape[1] > 400
    rgb = image.reshape(-1, 3)
    coloured = rgb[(rgb.max(axis=1) - rgb.min(axis=1)) > 0.3]  # saturated pixels: the series' lines
    hues = {tuple((c * 4).round().astype(int)) for c in coloured}
    assert len(coloured) > 200 and len(hues) >= colours, (len(coloured), hues)


def sweep_rows(scale: float) -> list[dict]:
    return [{"nodes": n, "expected_tokens_per_step": 1 + scale * i / 2, "tokens_per_step": 1 + scale * i / 1.8,
             "ms_per_step": 4.0 + i, "tokens_per_s": 1000 * (1 + scale * i / 1.8) / (4.0 + i)}
            for i, n in enumerate((1, 2, 4, 8, 16, 32, 64))]


def batch_rows() -> list[dict]:
    return [{"method": method, "batch_size": b, "tokens_per_s": 100.0 * b / (1 + b / 16) * gain, "speedup": gain}
            for b in (1, 2, 4, 8, 16) for method, gain in (("plain greedy", 1.0), ("Medusa greedy", 2.2 - b / 10),
                                                           ("Medusa rejection", 1.4 - b / 20))]


def draw_sweep(path: str) -> str:  # two series, without and with an expected curve, each against its own plain
    return plot_node_sweep([("greedy", sweep_rows(0.5)), ("rejection", [
        {k: r[k] for k in ("nodes", "tokens_per_step", "tokens_per_s")} for r in sweep_rows(0.2)])], path,
        plain_tokens_per_s={"plain greedy": 250.0, "plain sampling (T=0.8)": 240.0}, title="test")


def test_each_plot_draws_every_series_in_its_own_colour(tmp_path):
    assert_png(draw_sweep(str(tmp_path / "sweep.png")), colours=2)
    assert_png(plot_batch(batch_rows(), str(tmp_path / "batch.png"), title="batch sizes"), colours=3)


def test_importing_decode_and_the_plots_module_does_not_import_matplotlib():
    code = ("import sys, decode, medusa_mini.cli.plots; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'matplotlib'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("with_matplotlib", [True, False])
@pytest.mark.parametrize("name, message", [
    ("", "--plot needs a file name"), (".", "is a folder"), ("folder", "is a folder"),  # savefig: folder.png
    ("plot.txt", "end the name in .png"), ("plot", "end the name in .png"),  # savefig: unknown format; plot.png
    ("missing/plot.png", "its folder does not exist"), ("plot.png", None),
])
def test_a_path_savefig_would_not_write_as_named_or_a_missing_matplotlib_is_one_line_before_any_drawing(
        tmp_path, monkeypatch, with_matplotlib, name, message):
    """The path is judged first, with or without matplotlib; then a missing matplotlib says how to install it."""
    (tmp_path / "folder").mkdir()
    monkeypatch.chdir(tmp_path)
    if not with_matplotlib:
        for module in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
            monkeypatch.delitem(sys.modules, module)
        monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib...` now raises ImportError
    checks = [lambda: plots.check_plot_path(name)]
    if message is None and not with_matplotlib:
        message = "pip install matplotlib"
        checks += [lambda: plot_batch(batch_rows(), name, title="b"), lambda: draw_sweep(name)]
    for check in checks if message else []:
        with pytest.raises(ValueError, match=message) as exc:
            check()
        assert "\n" not in str(exc.value)
    assert sorted(os.listdir(tmp_path)) == ["folder"]


def test_every_format_the_check_accepts_is_one_matplotlib_writes_and_the_file_is_written_in_it(tmp_path):
    canvas = pytest.importorskip("matplotlib.backends.backend_agg")
    figure = pytest.importorskip("matplotlib.figure")
    assert set(plots.FORMATS) <= set(canvas.FigureCanvasAgg(figure.Figure()).get_supported_filetypes())
    for name in ("b.SVG", "b.pdf", "b.png"):
        plots.check_plot_path(str(tmp_path / name))
        assert plot_batch(batch_rows(), str(tmp_path / name), title="b") == str(tmp_path / name)
    heads = {p.name: p.read_bytes()[:5] for p in tmp_path.iterdir()}
    assert heads == {"b.SVG": b"<?xml", "b.pdf": b"%PDF-", "b.png": b"\x89PNG\r"}  # only these: no temporary


def test_a_figure_that_fails_to_render_leaves_the_older_file_as_it_was(tmp_path, monkeypatch):
    figure = pytest.importorskip("matplotlib.figure")
    out = tmp_path / "b.png"
    out.write_bytes(b"an older figure")

    def fail_halfway(self, file, *args, **kwargs):  # savefig writes as it renders: a half-written figure
        with open(file, "wb") if isinstance(file, (str, os.PathLike)) else contextlib.nullcontext(file) as f:
            f.write(b"half a figure")
        raise RuntimeError("cannot render")
    monkeypatch.setattr(figure.Figure, "savefig", fail_halfway)
    with pytest.raises(RuntimeError, match="cannot render"):
        plot_batch(batch_rows(), str(out), title="b")
    assert out.read_bytes() == b"an older figure" and os.listdir(tmp_path) == ["b.png"]
