"""cli/plots.py: PNG figures from benchmark rows; matplotlib optional, imported only when drawing."""

import subprocess
import sys

import pytest
from conftest import ROOT

from medusa_mini.cli import plots
from medusa_mini.cli.plots import PlotError, plot_batch, plot_node_sweep


def assert_png(path, *, colours: int) -> None:
    """A readable figure of two panels with at least `colours` distinct line colours drawn on it (a
    blank or a single-series image fails): the pixels far from white, grey and black, counted by hue."""
    image = pytest.importorskip("matplotlib.image").imread(path)[..., :3]  # [H, W, 3] in [0, 1]
    assert image.shape[0] > 200 and image.shape[1] > 400
    rgb = image.reshape(-1, 3)
    coloured = rgb[(rgb.max(axis=1) - rgb.min(axis=1)) > 0.3]  # saturated pixels: the series' lines
    hues = {tuple((c * 4).round().astype(int)) for c in coloured}
    assert len(coloured) > 200 and len(hues) >= colours, (len(coloured), hues)


def sweep_rows(scale: float) -> list[dict]:
    """Rows shaped as benchmarks/sweep.py writes them (ms_per_token, not tokens_per_s)."""
    return [{"nodes": n, "expected_tokens_per_step": 1 + scale * i / 2, "tokens_per_step": 1 + scale * i / 1.8,
             "ms_per_step": 4.0 + i, "ms_per_token": (4.0 + i) / (1 + scale * i / 1.8)}
            for i, n in enumerate((1, 2, 4, 8, 16, 32, 64))]


def batch_rows() -> list[dict]:
    rows = []
    for b in (1, 2, 4, 8, 16):
        plain = 100.0 * b / (1 + b / 16)
        for method, gain, tps in (("plain greedy", 1.0, 1.0), ("Medusa greedy", 2.2 - b / 10, 3.1),
                                  ("Medusa rejection (T=0.8)", 1.4 - b / 20, 1.9)):
            rows.append({"method": method, "batch_size": b, "tokens_per_s": plain * gain, "speedup": gain,
                         "tokens_per_step": tps})
    return rows


# a series without an expected curve that carries tokens/s directly instead of ms/token
DIRECT = [{"nodes": r["nodes"], "tokens_per_step": r["tokens_per_step"] + 0.2, "tokens_per_s": 1000 / r["ms_per_token"]}
          for r in sweep_rows(0.5)]


@pytest.mark.parametrize("draw, colours", [
    (lambda path: plot_node_sweep([("greedy", sweep_rows(0.5)), ("rejection", DIRECT)], path,
                                  plain_tokens_per_s=250.0, title="test"), 2),
    # greedy and rejection rows share the figure, each against its own plain decoder's speed
    (lambda path: plot_node_sweep([("static, greedy", sweep_rows(0.5)), ("static, rejection", sweep_rows(0.2))],
                                  path, plain_tokens_per_s={"plain greedy": 250.0, "plain sampling (T=0.8)": 240.0}), 2),
    (lambda path: plot_batch(batch_rows(), path, title="batch sizes"), 3),
])
def test_each_plot_draws_every_series_in_its_own_colour(tmp_path, draw, colours):
    out = str(tmp_path / "plot.png")
    assert draw(out) == out
    assert_png(out, colours=colours)


@pytest.mark.parametrize("draw", [
    lambda path: plot_node_sweep([("static", [{"nodes": 1, "ms_per_token": 2.0}])], path),  # no tokens_per_step
    lambda path: plot_node_sweep([], path),
    lambda path: plot_batch([{"method": "plain greedy", "batch_size": 1}], path),  # no tokens/s
    lambda path: plot_batch([{"batch_size": 1, "tokens_per_s": 3.0}], path),  # no method
])
def test_rows_without_the_needed_numbers_are_a_one_line_plot_error(tmp_path, draw):
    with pytest.raises(PlotError) as exc:
        draw(str(tmp_path / "x.png"))
    assert "\n" not in str(exc.value)
    assert not (tmp_path / "x.png").exists()


def test_without_matplotlib_every_plot_says_how_to_install_it_in_one_line(tmp_path, monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib...` now raises ImportError
    for draw in (lambda: plots.require_matplotlib(),
                 lambda: plot_batch(batch_rows(), str(tmp_path / "b.png")),
                 lambda: plot_node_sweep([("static", sweep_rows(0.5))], str(tmp_path / "s.png"))):
        with pytest.raises(PlotError) as exc:
            draw()
        assert str(exc.value) == plots.MISSING and "pip install matplotlib" in str(exc.value)
    assert not list(tmp_path.iterdir())


def test_importing_decode_and_the_plots_module_does_not_import_matplotlib():
    code = ("import sys, decode, medusa_mini.cli.plots; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'matplotlib'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True,
                         timeout=120).stdout
    assert out.strip() == "[]"
