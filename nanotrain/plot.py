"""Loss curves as PNG (matplotlib, imported lazily: plotting is optional)."""
from __future__ import annotations

from pathlib import Path


def plot_curves(curves: dict[str, list[float]], path: str | Path, title: str, ylabel: str = "training loss") -> None:
    """One line per curve; the first is drawn wide and grey as the reference the others overlay."""
    path = Path(path)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: no plot {path.name} (pip install matplotlib)")
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (name, c) in enumerate(curves.items()):
        style = dict(color="0.7", lw=5) if i == 0 and len(curves) > 1 else \
            dict(lw=1.4, ls=("-", "--", "-.", ":", (0, (5, 1)))[i % 5])
        ax.plot(range(1, len(c) + 1), c, label=name, **style)
    ax.set(xlabel="step", ylabel=ylabel, title=title)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")
