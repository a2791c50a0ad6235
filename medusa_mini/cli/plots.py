"""Figures for the benchmark tables, as PNG files: node-budget sweeps and batch sizes.

matplotlib is an optional extra (`pip install -e ".[plot]"`), imported only when drawing, on the Agg
canvas (no display, no pyplot state). Without it every function raises PlotError, a one-line ValueError
that the command lines turn into exit status 2.
"""

from __future__ import annotations

from typing import Mapping, Sequence

MISSING = 'drawing a plot needs matplotlib: pip install matplotlib (or pip install -e ".[plot]")'
DPI = 120


class PlotError(ValueError):
    """A plot that cannot be drawn: matplotlib missing, or rows without the numbers it needs."""


def require_matplotlib() -> None:
    """Raise PlotError now if matplotlib is missing: scripts call this before a long run, not after."""
    _figure(1)


def _figure(ncols: int):
    """(figure, [axes]) on an Agg canvas, ncols panels side by side."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise PlotError(MISSING) from None
    fig = Figure(figsize=(5.5 * ncols, 4.2), layout="constrained")
    FigureCanvasAgg(fig)  # the canvas savefig renders with: Agg, whatever backend pyplot would pick
    axes = fig.subplots(1, ncols, squeeze=False)[0]
    return fig, list(axes)


def _number(row: Mapping, key: str, where: str) -> float:
    if row.get(key) is None:
        raise PlotError(f"{where}: a row has no {key!r}; it has {', '.join(sorted(row))}")
    return float(row[key])


def _tokens_per_s(row: Mapping, where: str) -> float:
    """tokens/s as given, or from ms/token (the sweep's rows carry the latter)."""
    if row.get("tokens_per_s") is not None:
        return float(row["tokens_per_s"])
    return 1000.0 / _number(row, "ms_per_token", where)


def plot_node_sweep(
    series: Sequence[tuple[str, Sequence[Mapping]]], path: str, *,
    plain_tokens_per_s: float | Mapping[str, float] | None = None, title: str = "",
) -> str:
    """Tokens/step (left) and tokens/s (right) against the node budget, one colour per named series.

    A row holds `nodes` (root excluded), `tokens_per_step`, `tokens_per_s` or `ms_per_token`, and
    optionally `expected_tokens_per_step` (dashed; at the measured `ms_per_step` on the right).
    plain_tokens_per_s: a dotted line, or one per plain decoder given {name: tokens/s}. Returns path.
    """
    if not series or not any(rows for _, rows in series):
        raise PlotError("plot_node_sweep: no rows to plot")
    fig, (steps_ax, speed_ax) = _figure(2)
    budgets: set[int] = set()
    for name, rows in series:
        where = f"series {name!r}"
        rows = sorted(rows, key=lambda r: _number(r, "nodes", where))
        nodes = [int(_number(r, "nodes", where)) for r in rows]
        budgets |= set(nodes)
        (line,) = steps_ax.plot(nodes, [_number(r, "tokens_per_step", where) for r in rows], marker="o",
                                label=f"{name}, measured")
        speed_ax.plot(nodes, [_tokens_per_s(r, where) for r in rows], marker="o", color=line.get_color(),
                      label=f"{name}, measured")
        expected = [r for r in rows if r.get("expected_tokens_per_step") is not None]
        if expected:
            x = [int(r["nodes"]) for r in expected]
            steps_ax.plot(x, [float(r["expected_tokens_per_step"]) for r in expected], ls="--", marker="x",
                          color=line.get_color(), label=f"{name}, expected")
            timed = [r for r in expected if r.get("ms_per_step")]
            speed_ax.plot([int(r["nodes"]) for r in timed],
                          [1000.0 * float(r["expected_tokens_per_step"]) / float(r["ms_per_step"]) for r in timed],
                          ls="--", marker="x", color=line.get_color(), label=f"{name}, expected at measured ms/step")
    steps_ax.axhline(1.0, color="gray", ls=":", label="plain decoding (1.00)")
    plain = plain_tokens_per_s if isinstance(plain_tokens_per_s, Mapping) else {"plain decoding": plain_tokens_per_s}
    greys = ("gray", "silver", "dimgray", "darkgray")
    for i, (name, tokens_per_s) in enumerate(plain.items()):
        if tokens_per_s:
            speed_ax.axhline(tokens_per_s, color=greys[i % len(greys)], ls=":", label=name)
    return _finish(fig, {steps_ax: "tokens per step (bonus counted)", speed_ax: "tokens per second"},
                   sorted(budgets), "node budget (root excluded)", title=title, path=path)


def plot_batch(rows: Sequence[Mapping], path: str, *, title: str = "") -> str:
    """Tokens/s (left) and the speedup of every method not named "plain ..." (right) against batch size.

    rows: one per (method, batch size), each with `method`, `batch_size`, `tokens_per_s` and `speedup`;
    the 1x line marks where Medusa stops paying. Returns path.
    """
    if not rows:
        raise PlotError("plot_batch: no rows to plot")
    by_method: dict[str, list[Mapping]] = {}
    for row in rows:
        if not row.get("method"):
            raise PlotError(f"plot_batch: a row has no 'method'; it has {', '.join(sorted(row))}")
        by_method.setdefault(str(row["method"]), []).append(row)
    fig, (speed_ax, gain_ax) = _figure(2)
    sizes: set[int] = set()
    for method, mrows in by_method.items():
        where = f"method {method!r}"
        mrows = sorted(mrows, key=lambda r: _number(r, "batch_size", where))
        b = [int(_number(r, "batch_size", where)) for r in mrows]
        sizes |= set(b)
        (line,) = speed_ax.plot(b, [_tokens_per_s(r, where) for r in mrows], marker="o", label=method)
        if not method.lower().startswith("plain"):
            gain_ax.plot(b, [_number(r, "speedup", where) for r in mrows], marker="o", color=line.get_color(),
                         label=method)
    gain_ax.axhline(1.0, color="black", ls="--", lw=1, label="1x: as fast as plain")
    return _finish(fig, {speed_ax: "tokens per second", gain_ax: "speedup over plain"}, sorted(sizes), "batch size",
                   title=title, path=path)


def _finish(fig, ylabels: Mapping, ticks: list[int], xlabel: str, *, title: str, path: str) -> str:
    """Label both panels (a log2 x axis at the measured points), title the figure, save it; returns path."""
    for ax, ylabel in ylabels.items():
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.set_xlabel(xlabel)
        ax.grid(True, alpha=0.3)
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize="small")
    if title:
        fig.suptitle(title)
    fig.savefig(path, dpi=DPI)
    return path
