"""Figures of the benchmark tables (node-budget sweeps, batch sizes) as PNG or another of FORMATS.
matplotlib is an optional extra, imported only when drawing, on the Agg canvas (no display, no pyplot)."""

from __future__ import annotations

import os
from typing import Mapping, Sequence

from ..io.files import atomic_write
from .common import check_file_path

# What matplotlib's Agg canvas writes (3.5 on) with no other tool, so that a path is checked without
# importing matplotlib; savefig takes the file's extension as its format.
FORMATS = ("png", "svg", "svgz", "pdf", "eps", "ps", "jpg", "jpeg", "tif", "tiff")
MISSING = 'drawing a plot needs matplotlib: pip install matplotlib (or pip install -e ".[plot]")'


def check_plot_path(path: str) -> None:
    """A ValueError now, not after a long run, if matplotlib is missing or `path` is no file it writes as
    named (savefig would write a folder or an unknown extension as PATH.png)."""
    check_file_path("--plot", path, "plot.png")
    if _format(path) not in FORMATS:
        raise ValueError(f"--plot {path}: end the name in .png or another format matplotlib writes: "
                         + ", ".join(f".{f}" for f in FORMATS))
    _figure()


def _format(path: str) -> str:
    return os.path.splitext(path)[1][1:].lower()


def _figure():
    """(figure, [left axes, right axes]) on an Agg canvas, whatever backend pyplot would pick."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ValueError(MISSING) from None
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    return fig, list(fig.subplots(1, 2, squeeze=False)[0])


def plot_node_sweep(series: Sequence[tuple[str, Sequence[Mapping]]], path: str, *,
                    plain_tokens_per_s: Mapping[str, float] = {}, title: str) -> str:
    """Tokens/step (left) and tokens/s (right) against the node budget, a colour per named series of rows
    (`nodes`, `tokens_per_step`, `tokens_per_s`, optionally `expected_tokens_per_step`: dashed, on the right
    at the measured `ms_per_step`); a dotted line per plain decoder. Returns path."""
    fig, (steps_ax, speed_ax) = _figure()
    for name, rows in series:
        rows = sorted(rows, key=lambda r: r["nodes"])
        nodes, expected = [r["nodes"] for r in rows], [r for r in rows if r.get("expected_tokens_per_step") is not None]
        (line,) = steps_ax.plot(nodes, [r["tokens_per_step"] for r in rows], marker="o", label=f"{name}, measured")
        style = dict(ls="--", marker="x", color=line.get_color())
        speed_ax.plot(nodes, [r["tokens_per_s"] for r in rows], marker="o", color=style["color"],
                      label=f"{name}, measured")
        if expected:
            at = [r["nodes"] for r in expected]
            steps_ax.plot(at, [r["expected_tokens_per_step"] for r in expected], label=f"{name}, expected", **style)
            speed_ax.plot(at, [1000 * r["expected_tokens_per_step"] / r["ms_per_step"] for r in expected],
                          label=f"{name}, expected at measured ms/step", **style)
    steps_ax.axhline(1.0, color="gray", ls=":", label="plain decoding (1.00)")
    for i, (name, tokens_per_s) in enumerate(plain_tokens_per_s.items()):
        speed_ax.axhline(tokens_per_s, color=("gray", "silver", "dimgray")[i % 3], ls=":", label=name)
    return _finish(fig, {steps_ax: "tokens per step (bonus counted)", speed_ax: "tokens per second"},
                   sorted({r["nodes"] for _, rows in series for r in rows}), "node budget (root excluded)",
                   title=title, path=path)


def plot_batch(rows: Sequence[Mapping], path: str, *, title: str) -> str:
    """Tokens/s (left) and the speedup of every method but "plain ..." (right) against batch size. Returns path."""
    fig, (speed_ax, gain_ax) = _figure()
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = sorted((r for r in rows if r["method"] == method), key=lambda r: r["batch_size"])
        sizes = [r["batch_size"] for r in mine]
        (line,) = speed_ax.plot(sizes, [r["tokens_per_s"] for r in mine], marker="o", label=method)
        if not method.startswith("plain"):
            gain_ax.plot(sizes, [r["speedup"] for r in mine], marker="o", color=line.get_color(), label=method)
    gain_ax.axhline(1.0, color="black", ls="--", lw=1, label="1x: as fast as plain")
    return _finish(fig, {speed_ax: "tokens per second", gain_ax: "speedup over plain"},
                   sorted({r["batch_size"] for r in rows}), "batch size", title=title, path=path)


def _finish(fig, ylabels: Mapping, ticks: list[int], xlabel: str, *, title: str, path: str) -> str:
    """Both panels labelled (a log2 x axis at the measured points), the figure titled and saved."""
    for ax, ylabel in ylabels.items():
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.set(xlabel=xlabel, ylabel=ylabel)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(title)
    # Into a temporary file first: a figure that fails to render leaves an older one at `path` as it was.
    atomic_write(path, lambda f: fig.savefig(f, format=_format(path) or "png", dpi=120))
    return path
