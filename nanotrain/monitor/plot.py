"""Plots as PNG: loss curves and pipeline timelines (matplotlib, imported lazily: plotting is optional)."""
from __future__ import annotations

from pathlib import Path

KIND_COLOURS = {"F": "tab:blue", "B": "tab:green", "I": "tab:orange", "W": "tab:red"}


def _pyplot(path: Path):
    """matplotlib's pyplot on the file backend, or None (and a note) when it is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: no plot {path.name} (pip install matplotlib)")
        return None
    return plt


def _save(plt, fig, path: Path) -> None:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def plot_curves(curves: dict[str, list[float]], path: str | Path, title: str, ylabel: str = "training loss",
                points: dict[str, tuple[list[int], list[float]]] | None = None) -> None:
    """One line per curve (a value per step from 1); the first is drawn wide and grey as the reference the
    others overlay. ``points``: (steps, values) drawn as marked lines, e.g. a validation loss every N steps."""
    path = Path(path)
    if (plt := _pyplot(path)) is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (name, c) in enumerate(curves.items()):
        style = dict(color="0.7", lw=5) if i == 0 and len(curves) > 1 else \
            dict(lw=1.4, ls=("-", "--", "-.", ":", (0, (5, 1)))[i % 5])
        ax.plot(range(1, len(c) + 1), c, label=name, **style)
    for name, (steps, values) in (points or {}).items():
        ax.plot(steps, values, "o-", ms=4, lw=1.2, label=name)
    ax.set(xlabel="step", ylabel=ylabel, title=title)
    ax.legend()
    _save(plt, fig, path)


def plot_timeline(ranks: list[list[tuple[str, int, float, float]]], path: str | Path, title: str) -> None:
    """A pipeline step as a Gantt chart: one row per rank, a bar per action (kind, micro-batch, start
    and end in ms), coloured by kind and labelled with its micro-batch; white is idle."""
    path = Path(path)
    if (plt := _pyplot(path)) is None:
        return
    from matplotlib.patches import Patch

    fig, ax = plt.subplots(figsize=(12, 0.6 * len(ranks) + 1.5))
    end_ms = max(end for actions in ranks for *_, end in actions)
    for r, actions in enumerate(ranks):
        for kind, mb, start, end in actions:
            ax.broken_barh([(start, end - start)], (r - 0.4, 0.8), color=KIND_COLOURS[kind], edgecolor="white", lw=0.3)
            if end - start > 0.012 * end_ms:
                ax.text((start + end) / 2, r, str(mb), ha="center", va="center", fontsize=6, color="white")
    ax.set(xlabel="ms from the step's start", yticks=range(len(ranks)),
           yticklabels=[f"rank {r}" for r in range(len(ranks))], title=title)
    ax.invert_yaxis()
    kinds = sorted({kind for actions in ranks for kind, *_ in actions}, key="FBIW".index)
    ax.legend(handles=[Patch(color=KIND_COLOURS[k], label=k) for k in kinds], loc="upper right", fontsize=7,
              ncol=len(kinds))
    _save(plt, fig, path)
