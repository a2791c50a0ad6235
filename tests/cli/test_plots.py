"""The figures: the batch table's (runs.plot_batch) and the sweep's (sweep.plot_sweep), drawn by common.draw;
matplotlib optional, imported only when drawing (tests/test_layout.py checks it)."""

import contextlib
import os
import sys

import pytest

from benchmarks.sweep import plot_sweep
from medusa_mini.cli.common import PLOT_FORMATS, check_plot_path
from medusa_mini.cli.runs import plot_batch


def draw_sweep(path: str) -> str:  # two series, with and without an expected curve, each against its own plain
    rows = [{"rule": rule, "temperature": T, "draft_vocab": None, "nodes": n, "tokens_per_step": 1 + scale * i,
             "expected_tokens_per_step": 1 + scale * i / 1.1 if T == 0 else None, "ms_per_step": 4.0 + i,
             "tokens_per_s": 1000 * (1 + scale * i) / (4.0 + i), "new_tokens": 64, "steps": 10, "seconds": 0.1}
            for rule, T, scale in (("greedy", 0, 0.3), ("rejection-drawn", 0.8, 0.1))
            for i, n in enumerate((1, 2, 4, 8, 16, 32, 64))]
    plain = {"plain greedy": {"temperature": 0, "tokens_per_s": 250.0},
             "plain sampling (T=0.8)": {"temperature": 0.8, "tokens_per_s": 240.0}}
    return plot_sweep({"rows": rows, "plain": plain}, path, title="test")


def batch_rows() -> list[dict]:
    return [{"method": method, "batch_size": b, "tokens_per_s": 100.0 * b / (1 + b / 16) * gain, "speedup": gain}
            for b in (1, 2, 4, 8, 16) for method, gain in (("plain greedy", 1.0), ("Medusa greedy", 2.2 - b / 10),
                                                           ("Medusa rejection", 1.4 - b / 20))]


def test_each_plot_draws_every_series_in_its_own_colour(tmp_path):
    imread = pytest.importorskip("matplotlib.image").imread
    for path, colours in ((draw_sweep(str(tmp_path / "sweep.png")), 2),
                          (plot_batch(batch_rows(), str(tmp_path / "batch.png"), title="batch sizes"), 3)):
        image = imread(path)[..., :3]  # [H, W, 3] in [0, 1]
        assert image.shape[0] > 200 and image.shape[1] > 400
        coloured = image[(image.max(axis=2) - image.min(axis=2)) > 0.3]  # far from white, grey and black: the lines
        hues = {tuple((c * 4).round().astype(int)) for c in coloured}
        assert len(coloured) > 200 and len(hues) >= colours, (len(coloured), hues)  # a colour per series


def test_the_batch_figure_draws_each_drafters_speedup_and_every_rows_tokens_per_s(monkeypatch):
    monkeypatch.setattr("medusa_mini.cli.runs.draw", lambda path, panels, **kw: panels)  # what would be drawn
    rows, panels = batch_rows(), plot_batch(batch_rows(), "b.png", title="b")
    of = lambda method, key: [r[key] for r in rows if r["method"] == method]  # noqa: E731
    assert [ys for xs, ys, _ in panels["speedup over plain"] if xs is not None] == [
        of("Medusa greedy", "speedup"), of("Medusa rejection", "speedup")]
    assert [ys for _, ys, _ in panels["tokens per second"]] == [
        of(m, "tokens_per_s") for m in ("plain greedy", "Medusa greedy", "Medusa rejection")]


@pytest.mark.parametrize("name, message", [
    ("", "--plot needs a file name"), (".", "is a folder"), ("folder", "is a folder"),  # savefig: folder.png
    ("plot.txt", "end the name in .png"), ("plot", "end the name in .png"),  # savefig: unknown format; plot.png
    ("missing/plot.png", "does not exist"), ("/proc/p.png", "can be written"), ("plot.png", "pip install matplotlib")])
def test_a_path_savefig_would_not_write_as_named_or_no_matplotlib_is_one_line(tmp_path, monkeypatch, name, message):
    """The path is judged first, before matplotlib is looked for; then a missing one says how to install it."""
    (tmp_path / "folder").mkdir()
    monkeypatch.chdir(tmp_path)
    for module in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, module)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib...` now raises ImportError
    drawing = [lambda: plot_batch(batch_rows(), name, title="b"), lambda: draw_sweep(name)]  # refuse a good path too
    for check in [lambda: check_plot_path(name)] + (drawing if name == "plot.png" else []):
        assert (exc := pytest.raises(ValueError, check)).match(message) and "\n" not in str(exc.value)
    assert sorted(os.listdir(tmp_path)) == ["folder"]


def test_each_format_accepted_is_written_and_a_figure_that_fails_leaves_the_older(tmp_path, monkeypatch):
    canvas, figure = pytest.importorskip("matplotlib.backends.backend_agg"), pytest.importorskip("matplotlib.figure")
    assert set(PLOT_FORMATS) <= set(canvas.FigureCanvasAgg(figure.Figure()).get_supported_filetypes())
    for name in ("b.SVG", "b.pdf", "b.png"):
        check_plot_path(str(tmp_path / name))
        assert plot_batch(batch_rows(), str(tmp_path / name), title="b") == str(tmp_path / name)
    heads = {p.name: p.read_bytes()[:5] for p in tmp_path.iterdir()}
    assert heads == {"b.SVG": b"<?xml", "b.pdf": b"%PDF-", "b.png": b"\x89PNG\r"}  # only these: no temporary

    def fail_halfway(self, file, *args, **kwargs):  # savefig writes as it renders: a half-written figure
        with open(file, "wb") if isinstance(file, (str, os.PathLike)) else contextlib.nullcontext(file) as f:
            f.write(b"half a figure")
        raise RuntimeError("cannot render")
    monkeypatch.setattr(figure.Figure, "savefig", fail_halfway)
    pytest.raises(RuntimeError, plot_batch, batch_rows(), str(tmp_path / "b.png"), title="b").match("cannot render")
    assert (tmp_path / "b.png").read_bytes()[:5] == b"\x89PNG\r" and len(os.listdir(tmp_path)) == 3
