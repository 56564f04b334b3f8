"""fs.timeline: one step's spans, from every rank, drawn as a PNG with one lane per kind of work per rank.

A step composed with ``timeline=True`` puts ``metrics["trace/timeline"]``: this rank's spans
``(lane, label, start_s, end_s)``, in seconds since the step began on this rank. Who records them:

    compute  the step: each micro-batch's "forward" and "backward" (exposed waits included)
    gather   the step's ``Comm``: one span per gather, issue -> completion, labelled with the unit
    reduce   the ``Comm``: one span per reduce_scatter or reduce_each call (a bucket's N reduces are one span)
    replica  the ``Comm``, on a 2-D mesh: one span per all-reduce of a reduced shard between shard groups
    control  the ``Comm``: each small blocking all-reduce (the rank checks, the gradient norm)
    exchange the ``Comm``: one span per all-to-all of an optimizer's update (fs.muon's pieces), issue -> completion
    update   the step: the update stage; offload_state: each unit updated early, in its worker thread
    store    offload_state, through ``StepView.record``: each unit's chunks streamed, moments written
    wait     ``Flight.wait()``: compute blocked on a gather or reduction that was still running

``fs.timeline`` gathers every rank's spans (a collective) and draws them; the waits are drawn over the compute
lane. Overlap is ``1 - exposed wait seconds / seconds at least one gather or reduction was in flight``.
"""
from __future__ import annotations

import os
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass

import torch.distributed as dist

from ..errors import ArgumentError, ArgumentTypeError
from ..dist._bare import bare
from ..dist._mesh import Mesh

LANES = ("compute", "gather", "reduce", "replica", "control", "update", "store")  # drawing order; waits over compute
COLORS = {"compute": "#8fb3d9", "gather": "#55a868", "reduce": "#8172b2", "replica": "#c44e52",
          "control": "#999999",
          "update": "#dd8452", "store": "#937860", "wait": "#d62728"}
DPI, WIDTH_IN, ROW_IN, FRAME_IN = 100, 14.0, 0.45, 2.0  # the PNG is WIDTH_IN x (FRAME_IN + ROW_IN * rows) inches
MATPLOTLIB = "matplotlib==3.11.2"


@dataclass(frozen=True)
class Timeline:
    """The spans of one step on every rank, and what ``fs.timeline`` drew.

    Attributes:
      spans: ``(rank, lane, label, start_s, end_s)`` of every rank, each rank's times since its own step began.
      step_seconds: the slowest rank's ``metrics["time/step"]``.
      overlap: over all ranks, ``1 - exposed wait seconds / seconds some gather or reduction was in flight``
        (0.0 when no collective ran).
      rank_seconds: each rank's step seconds, in rank order.
      rank_overlap: each rank's overlap, in rank order.
      path: the PNG written (on the rank that wrote it), else None.
      size: the PNG's (width, height) in pixels, where one was written, else None.
    """

    spans: tuple
    step_seconds: float
    overlap: float
    rank_seconds: tuple
    rank_overlap: tuple
    path: str | None = None
    size: tuple | None = None

    def lanes(self, rank: int) -> dict:
        """Rank ``rank``'s spans by lane: lane -> ``((label, start_s, end_s), ...)`` in start order; the known
        lanes first (in drawing order, then "wait"), then any a policy recorded."""
        out: dict = {}
        for r, lane, label, a, b in sorted(self.spans, key=lambda s: s[3]):
            if r == rank:
                out.setdefault(lane, []).append((label, a, b))
        order = [x for x in (*LANES, "wait") if x in out] + sorted(set(out) - set(LANES) - {"wait"})
        return {lane: tuple(out[lane]) for lane in order}


def timeline(metrics, path=None, *, mesh: Mesh | None = None, title: str | None = None) -> Timeline:
    """Draw one step's timeline: every rank's compute, gathers, reductions, update and store I/O, and what compute
    waited on.

    With ``mesh`` of more than one rank this is a collective: every rank calls it with the metrics of the same
    step; rank 0 writes the PNG and every rank gets the same spans back.

    Args:
      metrics: the metrics of a step composed with ``fs.compose(..., timeline=True)``.
      path: where to write the PNG (its folder is made if needed); None: only return the spans. Drawing needs
        matplotlib, imported here and nowhere else.
      mesh: the step's mesh (``state.spec.mesh``); None: this rank's spans only, drawn as rank 0.
      title: the first line of the picture's title (default "fshard step timeline").

    Returns:
      a ``fs.Timeline``: the spans of every rank, the step's seconds and its overlap.
    """
    if not isinstance(metrics, Mapping):
        raise ArgumentTypeError(f"fs.timeline: metrics must be the metrics dict a step returned, got "
                                f"{type(metrics).__name__}.")
    if "trace/timeline" not in metrics:
        raise ArgumentError("fs.timeline: these metrics carry no 'trace/timeline'. Compose the step with "
                            "fs.compose(loss_fn, ..., timeline=True) and pass the metrics of one of its steps.")
    if mesh is not None and not isinstance(mesh, Mesh):
        raise ArgumentTypeError(f"fs.timeline: mesh must be an fs.Mesh (state.spec.mesh) or None, got "
                                f"{type(mesh).__name__}.")
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise ArgumentTypeError(f"fs.timeline: path must be a file path or None, got {type(path).__name__}.")
    spans = tuple(metrics["trace/timeline"])
    seconds = float(metrics.get("time/step", max((s[3] for s in spans), default=0.0)))
    rank = 0 if mesh is None else mesh.rank
    ranks = [(rank, spans, seconds)]
    if mesh is not None and mesh.world_size > 1:
        mesh.check_alive()
        ranks = [None] * mesh.world_size
        with bare():  # (no Python object of the caller's saved-tensor hooks into the work: fshard/dist/_bare.py)
            dist.all_gather_object(ranks, (rank, spans, seconds), group=mesh.group)
    ranks.sort(key=lambda x: x[0])
    flat = tuple((r, *s) for r, sp, _ in ranks for s in sp)
    busy = [_union([(a, b) for lane, _, a, b in sp if lane in ("gather", "reduce")]) for _, sp, _ in ranks]
    waits = [sum(b - a for lane, label, a, b in sp if lane == "wait" and label.startswith(("gather:", "reduce:")))
             for _, sp, _ in ranks]  # (the waits on the lanes counted busy; replica and exchange waits are not)
    tl = Timeline(flat, max(s for *_, s in ranks), _overlap(sum(waits), sum(busy)), tuple(s for *_, s in ranks),
                  tuple(_overlap(w, b) for w, b in zip(waits, busy)))
    if path is None or rank != 0:
        return tl
    size = _draw(tl, [r for r, _, _ in ranks], os.fspath(path), title or "fshard step timeline")
    return Timeline(tl.spans, tl.step_seconds, tl.overlap, tl.rank_seconds, tl.rank_overlap, os.fspath(path), size)


def _union(intervals) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _overlap(exposed: float, busy: float) -> float:
    return 0.0 if busy <= 0 else max(0.0, 1.0 - exposed / busy)


def _rows(spans) -> list:
    """Sub-rows so that spans of one lane never cover each other: each goes to the first sub-row free at its
    start. Returns one list of (label, start, end) per sub-row."""
    rows: list = []
    for label, a, b in sorted(spans, key=lambda s: s[1]):
        for row in rows:
            if row[-1][2] <= a:
                row.append((label, a, b))
                break
        else:
            rows.append([(label, a, b)])
    return rows


def _draw(tl: Timeline, ranks: list, path: str, title: str) -> tuple:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as e:
        raise ArgumentError(f"fs.timeline(path=...) draws with matplotlib, which cannot be imported here ({e}). "
                            f"Install it (pip install {MATPLOTLIB}), or pass path=None to get the spans only.") from e
    lanes = {r: tl.lanes(r) for r in ranks}
    kinds = [k for k in (*LANES, *sorted({k for ls in lanes.values() for k in ls} - set(LANES) - {"wait"}))
             if any(k in ls or (k == "compute" and "wait" in ls) for ls in lanes.values())]
    n_rows = len(ranks) * len(kinds)
    height = FRAME_IN + ROW_IN * n_rows
    fig = Figure(figsize=(WIDTH_IN, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    scale = 1e3  # milliseconds
    x_max = max(tl.step_seconds, max((s[4] for s in tl.spans), default=0.0)) * scale * 1.01 or 1.0
    px_per_ms = (WIDTH_IN - 2.2) * DPI / x_max
    labels, y = [], 0
    for i, r in enumerate(ranks):
        for kind in kinds:
            rows = _rows(lanes[r].get(kind, ()))
            h = 0.8 / max(1, len(rows))
            for j, row in enumerate(rows):
                _bars(ax, row, y + 0.1 + j * h, h, COLORS.get(kind, "#bbbbbb"), scale, px_per_ms, len(rows) <= 2)
            if kind == "compute":
                waits = lanes[r].get("wait", ())
                ax.broken_barh([(a * scale, max((b - a) * scale, 1.5 / px_per_ms)) for _, a, b in waits],
                               (y + 0.1, 0.8),
                               facecolors=COLORS["wait"], edgecolors="#7f0000", hatch="////", linewidth=0.5)
                labels.append(f"rank {r} compute\n{tl.rank_seconds[i] * scale:.0f} ms, overlap "
                              f"{tl.rank_overlap[i]:.0%}")
            else:
                labels.append(f"rank {r} {kind}")
            y += 1
        if i < len(ranks) - 1:
            ax.axhline(y, color="black", linewidth=1.0)
    ax.set_ylim(n_rows, 0)
    ax.set_yticks([k + 0.5 for k in range(n_rows)], labels, fontsize=8)
    ax.set_xlim(0, x_max)
    ax.set_xlabel("milliseconds since the step began (each rank's own clock)")
    ax.grid(axis="x", color="#dddddd", linewidth=0.6)
    ax.set_axisbelow(True)
    plural = "s" if len(ranks) > 1 else ""
    ax.set_title(f"{textwrap.shorten(title, 160)}\nstep {tl.step_seconds * scale:.1f} ms (slowest of {len(ranks)} "
                 f"rank{plural}), overlap {tl.overlap:.0%} = 1 - exposed waits / time a gather or reduction was "
                 "in flight", fontsize=10)
    handles = [Patch(facecolor=COLORS.get(k, "#bbbbbb"), label=k) for k in kinds]
    handles.append(Patch(facecolor=COLORS["wait"], edgecolor="#7f0000", hatch="////",
                         label="compute waited (exposed)"))
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), fontsize=8, frameon=False)
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    fig.savefig(path, format="png", dpi=DPI)
    return fig.canvas.get_width_height()


def _bars(ax, row, y0, h, color, scale, px_per_ms, text) -> None:
    """One sub-row of a lane: the bars (at least 1.5 px wide, so that a short collective stays visible), and each
    label that fits inside its bar."""
    ax.broken_barh([(a * scale, max((b - a) * scale, 1.5 / px_per_ms)) for _, a, b in row], (y0, h),
                   facecolors=color, edgecolors="#333333", linewidth=0.3)
    if not text:
        return
    for label, a, b in row:
        if (b - a) * scale * px_per_ms >= 5.2 * len(label) + 6:
            ax.text((a + b) / 2 * scale, y0 + h / 2, label, ha="center", va="center", fontsize=7, clip_on=True)
