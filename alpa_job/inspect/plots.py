"""PNG plots of a RunRecord for the HTML report (matplotlib, headless)."""

from __future__ import annotations

import io
from typing import List, Optional, Tuple

from alpa_job.record.run_record import RunRecord

STRATEGY_COLORS = {"DP": "#4c78a8", "ZeRO": "#f58518", "MP": "#54a24b", "MP+ZeRO": "#e45756", "replicated": "#9d9d9d"}


def _figure_png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return buf.getvalue()


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def bytes_by_strategy(record: RunRecord) -> Optional[bytes]:
    """Stacked bars: bytes per device (and total) of params / opt_state, by strategy label."""
    rows = record.params
    if not rows:
        return None
    plt = _pyplot()
    groups = ["params", "opt_state", "other"]
    present = {r.strategy for r in rows}
    labels = [s for s in STRATEGY_COLORS if s in present]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    sums: dict = {}  # (bytes field, strategy, group) -> bytes, in one pass over the leaves (10,000+ in a big model)
    for r in rows:
        for key in ("bytes", "bytes_per_device"):
            where = (key, r.strategy, _group(r.path))
            sums[where] = sums.get(where, 0) + getattr(r, key)
    for ax, key, title in ((axes[0], "bytes", "total bytes"), (axes[1], "bytes_per_device", "bytes per device")):
        bottom = [0.0] * len(groups)
        for label in labels:
            heights = [sums.get((key, label, g), 0) / 2**20 for g in groups]
            ax.bar(groups, heights, bottom=bottom, label=label, color=STRATEGY_COLORS[label])
            bottom = [b + h for b, h in zip(bottom, heights)]
        ax.set_title(title)
        ax.set_ylabel("MiB")
    axes[1].legend(title="strategy", fontsize=8)
    fig.suptitle(f"where the state lives ({record.strategy}, mesh {_mesh_text(record)})", y=1.04)
    return _figure_png(fig)


def loss_figure(record: RunRecord):
    """The train loss per step with the eval points over it (x = the global step, so a resumed run's
    curve starts where it resumed and lines up with its eval steps); None when there is nothing to draw."""
    losses: List[float] = record.losses
    if len(losses) < 2 and not record.evals:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3))
    first = (record.resumed_from_step or 0) + 1
    shown = [float("nan") if v is None else v for v in losses]  # a diverged run's non-finite loss: a gap
    ax.plot(range(first, first + len(shown)), shown, marker=".", label="train")
    if record.evals:
        ax.plot([e.step for e in record.evals], [e.loss for e in record.evals], marker="o", color="#e45756", label="eval")
        ax.legend(fontsize=8)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("training and eval loss" if record.evals else "training loss")
    return fig


def loss_curve(record: RunRecord) -> Optional[bytes]:
    fig = loss_figure(record)
    return None if fig is None else _figure_png(fig)


def search_times(record: RunRecord) -> Optional[bytes]:
    table = [r for r in (record.search or []) if r.step_time_s]
    if not table:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3))
    names = [f"{r.strategy} {tuple(r.mesh_shape)}" for r in table]
    colors = ["#e45756" if r.chosen else "#4c78a8" for r in table]
    ax.barh(names, [r.step_time_s * 1e3 for r in table], color=colors)
    ax.set_xlabel("ms / step (red: chosen)")
    ax.set_title("auto search candidates")
    return _figure_png(fig)


def all_plots(record: RunRecord) -> List[Tuple[str, str, bytes]]:
    """(file name, caption, png) for every plot that has data."""
    out = []
    loss_caption = "Training and eval loss" if record.evals else "Training loss"
    for name, caption, fn in (
        ("plot_bytes_by_strategy.png", "Bytes by strategy", bytes_by_strategy),
        ("plot_loss.png", loss_caption, loss_curve),
        ("plot_search.png", "Auto search", search_times),
    ):
        png = fn(record)
        if png:
            out.append((name, caption, png))
    return out


def _group(path: str) -> str:
    head = path.split("/", 1)[0]
    return head if head in ("params", "opt_state") else "other"


def _mesh_text(record: RunRecord) -> str:
    return "x".join(str(s) for s in record.mesh.shape) or "?"
