"""The report's plot: loss, grad norm and LR over steps (and the lead rank's step
phases when timed), skipped steps and spikes marked, a resume marked where the earlier
run's rows end. Drawn from :class:`~guardrails.cli.report_stats.Curves`; matplotlib is
the optional ``plot`` extra, imported only here, only when drawing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from guardrails.cli.report_runs import Run
from guardrails.cli.report_stats import Curves
from guardrails.util.files import make_dirs, restrict

PLOT_HINT = 'PNG not written: matplotlib is missing; pip install "torch-guardrails[plot]"'


def plot(run: Run, s: dict[str, Any], path: Path) -> bool:
    """Loss, grad norm (log) and LR over steps, skipped steps and spikes marked; a
    resumed run's curve starts with the rows of the run it resumed from, up to the
    resume step (marked). Drawn from ``run.curves`` (:func:`gather`): every row up to
    4000 steps, bins of steps (mean line, min-max band) beyond. False when matplotlib is
    missing or there are no rows."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed; safe before pyplot is imported
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return False
    curves = run.curves
    if curves is None or not curves.ranks:
        return False
    phases = curves.phases()
    rows = 3 if phases is None else 4
    fig, axes = plt.subplots(rows, 1, sharex=True, figsize=(9, 2.5 * rows), constrained_layout=True)
    panels = (("loss", "loss", "linear"), ("grad_norm", "grad norm", "log"), ("lr", "LR", "linear"))
    s["plot_scales"] = {}
    if phases is not None:  # where the lead rank's step time goes, stacked
        x, lines = phases
        ax = axes[3]
        ax.stackplot(x, *(v * 1e3 for v in lines.values()), labels=list(lines), alpha=0.8)
        ax.set_ylabel(f"rank {curves.lead} step (ms)")
        ax.legend(loc="upper right", fontsize="small", ncol=5)
        ax.grid(alpha=0.3)
    for ax, (col, label, scale) in zip(axes[:3], panels, strict=True):
        _draw_panel(ax, curves, s, col=col, label=label, scale=scale)
    axes[-1].set_xlabel("optimizer step")
    axes[-1].xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    handles = axes[0].get_legend_handles_labels()
    if handles[0]:
        axes[0].legend(loc="upper right", fontsize="small")
    axes[0].set_title(f"{s['run_dir']}: run started {s['started']}, ended {_how(s)}", fontsize=10)
    make_dirs(path.parent)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    restrict(path)  # matplotlib creates it 0o666 less the umask
    return True


def _draw_panel(
    ax: Any, curves: Curves, s: dict[str, Any], *, col: str, label: str, scale: str
) -> None:
    """One column's lines (a band per bin when binned), on the axis scale its values
    need, with the skipped steps, spikes and resume marked."""
    import numpy as np

    ranks = curves.ranks
    kw: dict[str, float] = {}
    if scale == "linear":  # a blow-up's 4e8 on a linear axis flattens every other step
        values = [v for r in ranks for v in curves.line(r, col)[1:]]
        scale, kw = axis_scale(np.concatenate(values) if values else np.empty(0))
        if scale != "linear":
            s["plot_scales"][col] = scale
    for r in ranks:
        # NaN, not dropped: a skipped step shows as a gap in the line.
        x, y, lo, hi = curves.line(r, col)
        (line,) = ax.plot(x, y, lw=1, label=f"rank {r}" if len(ranks) > 1 else None)
        if curves.binned:  # each point a bin's mean: its range as a band
            ax.fill_between(x, lo, hi, color=line.get_color(), alpha=0.2, lw=0)
        if col == "lr" and len(ranks) > 1:
            break  # the same LR everywhere
    ax.set_ylabel(label + (f" ({scale})" if col in s["plot_scales"] else ""))
    ax.set_yscale(scale, **kw)
    ax.grid(alpha=0.3)
    _mark_steps(ax, s)


def _mark_steps(ax: Any, s: dict[str, Any]) -> None:
    """The skipped steps and spikes as vertical marks, and where a resume continued."""
    # One collection per kind, not a line each: a long run's thousands of skipped
    # steps as axvlines took 300 MB and most of the report's time. Past 50 they are
    # ticks along the bottom, or they would hide the curves.
    marks = (
        (s["skipped_steps"], "red", "-", "skipped"),
        ([sp["step"] for sp in s["spikes"]], "orange", "--", "spike"),
    )
    for steps, color, style, what in marks:
        if steps:
            ax.vlines(
                steps,
                0,
                1 if len(steps) <= 50 else 0.04,
                transform=ax.get_xaxis_transform(),
                colors=color,
                linestyles=style,
                lw=1,
                alpha=0.5 if what == "skipped" else 1,
                label=what,
            )
    resumed = s.get("resumed")
    if resumed and resumed.get("earlier_rows"):
        where = f"resumed here (run {resumed['from_run']}'s steps before)"
        ax.axvline(resumed["step"], color="green", ls=":", lw=1.5, label=where)


def _how(s: dict[str, Any]) -> str:
    """How the run ended, in the plot's title."""
    end = s["ended"]
    if end is None:
        return "no end event (died)"
    if end.get("preempted"):
        return f"stopped by {end['preempted']['signal']}"
    return "error" if end["error"] else "clean"


#: Largest over typical (median) magnitude a linear axis is kept for: beyond it the
#: typical steps would be drawn within 0.1% of the axis' height, a flat line at 0.
SPAN_LINEAR = 1e3


def axis_scale(values: Any) -> tuple[str, dict[str, float]]:
    """The y scale for ``values`` (a numpy array; NaN ignored) and its keywords:
    ``linear``, unless its largest magnitude is :data:`SPAN_LINEAR` or more times its
    median one (a loss of 4.4e8 at one step among losses of 2): then ``log`` where every
    value is positive, else ``symlog`` (a loss that can be 0 or negative), linear up to
    the median magnitude."""
    import numpy as np

    v = np.asarray(values, dtype=np.float64)
    v = v[np.isfinite(v)]
    mags = np.abs(v[v != 0])
    if not mags.size:
        return "linear", {}
    typical = float(np.median(mags))
    if float(mags.max()) < SPAN_LINEAR * typical:
        return "linear", {}
    if (v > 0).all():
        return "log", {}
    return "symlog", {"linthresh": typical}
