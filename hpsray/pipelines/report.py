"""The run report on disk: JSON plus the paper's per-batch plots, and a stage table for terminals.

:func:`write_report` writes ``out.json`` and beside it

- ``out.stage_times.png``: busy seconds of each stage per batch (paper Fig. 3c),
- ``out.cache_hit_rate.png``: MEM-PS cache hit rate per batch (Fig. 4c),
- ``out.ssd_io.png``: the ``load`` stage's busy seconds per batch, the stage that reads rows from
  SSD-PS and writes evicted ones to it (Fig. 5a), with the run's SSD-PS bytes read and written.
- ``out.loss.png``: training loss per batch and, with evaluation while training, the held-out
  AUC of each evaluation, against the batches trained.

A report lacking a series (the reference trainer has no cache) still gets its plot, saying so.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any

STAGES = ("read", "pull", "load", "train")
PLOTS = ("stage_times", "cache_hit_rate", "ssd_io", "loss")


def _series(per_batch: Mapping[str, float] | None, batches: int | None = None) -> tuple[list[int], list[float]]:
    """A ``{batch: value}`` map (JSON keys are strings) as sorted ``(batches, values)``: with
    ``batches`` (the run's count), its first ``batches`` ids only (not the reader's empty
    end-of-data reads). A resumed run's ids start where the checkpoint left off, not at 0."""
    if not per_batch:
        return [], []
    items = sorted((int(k), float(v)) for k, v in per_batch.items())
    if batches is not None:
        items = items[: max(int(batches), 0)]
    return [k for k, _ in items], [v for _, v in items]


def plot_paths(path: str | os.PathLike) -> dict[str, str]:
    """Where :func:`write_report` puts each PNG for a report written to ``path``."""
    path = os.fspath(path)
    stem = path.removesuffix(".json")
    return {name: f"{stem}.{name}.png" for name in PLOTS}


def _json_default(v: Any) -> Any:
    try:  # numpy scalars and arrays
        return v.tolist()
    except AttributeError:
        return str(v)


def write_report(report: Mapping[str, Any], path: str | os.PathLike) -> list[str]:
    """Write ``report`` as JSON to ``path`` and the PNG plots beside it (:data:`PLOTS`); returns all paths."""
    path = os.fspath(path)
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=2, default=_json_default, allow_nan=True)
        f.write("\n")
    os.replace(tmp, path)
    pngs = plot_paths(path)
    _plot_stage_times(report, pngs["stage_times"])
    _plot_cache_hit_rate(report, pngs["cache_hit_rate"])
    _plot_ssd_io(report, pngs["ssd_io"])
    _plot_loss(report, pngs["loss"])
    return [path, *pngs.values()]


def _figure(title: str) -> tuple[Any, Any, Any]:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.set_title(title)
    ax.set_xlabel("batch")
    ax.grid(True, alpha=0.3)
    return plt, fig, ax


def _save(plt: Any, fig: Any, ax: Any, path: str, empty: bool, why: str, bottom: float = 0.0) -> None:
    if empty:
        ax.text(0.5, 0.5, why, ha="center", va="center", transform=ax.transAxes, color="gray")
    fig.tight_layout(rect=(0.0, bottom, 1.0, 1.0))
    fig.savefig(path, format="png")
    plt.close(fig)


def _plot_stage_times(report: Mapping[str, Any], path: str) -> None:
    plt, fig, ax = _figure("time per stage per batch")
    per = report.get("per_batch_s") or {}
    names = [s for s in STAGES if s in per] + [s for s in per if s not in STAGES]
    drawn = False
    for name in names:
        x, y = _series(per[name], report.get("batches"))
        if x:
            ax.plot(x, y, marker="o", markersize=3, label=name)
            drawn = True
    ax.set_ylabel("busy seconds")
    if drawn:
        ax.legend()
    _save(plt, fig, ax, path, not drawn, "no per-batch stage times in this report")


def _plot_cache_hit_rate(report: Mapping[str, Any], path: str) -> None:
    plt, fig, ax = _figure("MEM-PS cache hit rate per batch")
    x, y = _series(report.get("cache_hit_rate"))
    if x:
        ax.plot(x, y, marker="o", markersize=3, color="tab:green")
        ax.set_ylim(0, 1.02)
    ax.set_ylabel("hit rate")
    _save(plt, fig, ax, path, not x, "no MEM-PS cache in this run")


def _plot_loss(report: Mapping[str, Any], path: str) -> None:
    plt, fig, ax = _figure("training loss and held-out AUC")
    x, y = _series(report.get("loss"))
    if x:
        ax.plot([b + 1 for b in x], y, color="tab:blue", label="training loss (batch mean)")
    ax.set_ylabel("loss")
    points = ((report.get("evaluations") or {}).get("points")) or []
    if points:
        right = ax.twinx()
        right.plot([p["batches"] for p in points], [p["auc"] for p in points], "o-", color="tab:red", label="eval AUC")
        right.set_ylabel("AUC")
        lines = ax.get_lines() + right.get_lines()
        ax.legend(lines, [line.get_label() for line in lines], loc="center right", fontsize=8)
    ax.set_xlabel("batches trained")
    _save(plt, fig, ax, path, not x and not points, "no losses in this report")


def ssd_io_labels(report: Mapping[str, Any]) -> tuple[str, str, str]:
    """``(title, y label, caption)`` of the SSD-PS plot: what it draws is the ``load`` stage's
    busy seconds per batch (SSD-PS reads and writes, and the stage's own work), so it says
    seconds; the caption gives the run's SSD-PS bytes and seconds (``ssd``), when known."""
    ssd = report.get("ssd") or {}
    caption = ""
    if ssd:
        caption = (
            f"SSD-PS in all: {_bytes(ssd.get('bytes_read', 0))} read in {ssd.get('load_seconds', 0.0):.2f} s, "
            f"{_bytes(ssd.get('bytes_written', 0))} written in {ssd.get('dump_seconds', 0.0):.2f} s"
        )
    return "load stage (SSD-PS reads and writes) per batch", "load-stage busy seconds", caption


def _plot_ssd_io(report: Mapping[str, Any], path: str) -> None:
    title, ylabel, caption = ssd_io_labels(report)
    plt, fig, ax = _figure(title)
    x, y = _series((report.get("per_batch_s") or {}).get("load"))
    if x:
        ax.bar(x, y, color="tab:orange")
    ax.set_ylabel(ylabel)
    if caption:
        fig.text(0.5, 0.01, caption, ha="center", va="bottom", fontsize=8, color="dimgray")
    _save(plt, fig, ax, path, not x, "no SSD-PS in this run", bottom=0.05 if caption else 0.0)


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def format_stage_table(report: Mapping[str, Any]) -> str:
    """A plain-text summary: per-stage busy time (and CPU seconds while busy), pipeline
    efficiency, cache hit rate, SSD bytes, each table's figures (a model of several), the edges
    between the stages and how often the stages overlapped."""
    wall = float(report.get("wall_s") or 0.0)
    busy = report.get("stage_busy_s") or {}
    cpu = report.get("stage_cpu_s") or {}
    per = report.get("per_batch_s") or {}
    head = f"{'stage':<8}{'busy s':>10}{'% of wall':>11}{'mean/batch s':>14}{'max/batch s':>13}"
    lines = [head + (f"{'CPU s':>9}{'CPU/busy':>10}" if cpu else "")]
    names = [s for s in STAGES if s in busy] + [s for s in busy if s not in STAGES]
    for name in names:
        _, ys = _series(per.get(name), report.get("batches"))
        mean = sum(ys) / len(ys) if ys else math.nan
        peak = max(ys) if ys else math.nan
        share = 100.0 * busy[name] / wall if wall else math.nan
        line = f"{name:<8}{busy[name]:>10.2f}{share:>10.1f}%{mean:>14.3f}{peak:>13.3f}"
        if name in cpu:
            ratio = cpu[name] / busy[name] if busy[name] else math.nan
            line += f"{cpu[name]:>9.2f}{ratio:>10.2f}"
        lines.append(line)
    ex = report.get("examples", 0)
    startup = float(report.get("startup_s") or 0.0)
    lines.append(
        f"wall {wall:.2f} s, {report.get('batches', 0)} batches, {ex:,} examples, "
        f"{report.get('examples_per_s', 0.0):,.0f} examples/s"
        + (f" (after {startup:.2f} s starting actors)" if startup >= 0.01 else "")
    )
    ttfb = report.get("time_to_first_batch_s")
    if isinstance(ttfb, (int, float)):
        start = report.get("start") or {}
        parts = [
            f"{label} {start[k]:.2f} s"
            for k, label in (("ray_init_s", "Ray"), ("actors_s", "actors"), ("other_s", "the rest"))
            if k in start
        ]
        parts = [", ".join(parts)] if parts else []
        ready = start.get("ready_s") or {}
        if ready:
            parts.append("actors up after " + ", ".join(f"{k} {v:.2f} s" for k, v in ready.items()))
        lines.append(f"time to first batch {ttfb:.2f} s" + (f" ({'; '.join(parts)})" if parts else ""))
    if busy:
        slowest = max(busy, key=lambda stage: busy[stage])
        lines.append(
            f"pipeline efficiency {report.get('pipeline_efficiency', 0.0):.2f} "
            f"(slowest stage {slowest}: busy {busy[slowest]:.2f} s of {wall:.2f} s wall)"
        )
    _, rates = _series(report.get("cache_hit_rate"))
    if rates:
        overall = (report.get("cache") or {}).get("hit_rate")
        tail = f", overall {overall:.3f}" if isinstance(overall, (int, float)) else ""
        lines.append(
            f"cache hit rate per batch: first {rates[0]:.3f}, last {rates[-1]:.3f}, "
            f"mean {sum(rates) / len(rates):.3f}{tail}"
        )
    ssd = report.get("ssd") or {}
    if ssd:
        lines.append(
            f"SSD-PS: {_bytes(ssd.get('bytes_read', 0))} read in {ssd.get('load_seconds', 0.0):.2f} s, "
            f"{_bytes(ssd.get('bytes_written', 0))} written in {ssd.get('dump_seconds', 0.0):.2f} s, "
            f"{ssd.get('files', 0)} files, {ssd.get('compactions', 0)} compactions"
        )
    for name, t in (report.get("tables") or {}).items():
        lines.append(
            f"table {name}: {t['lookups']:,} lookups, hit rate {t['hit_rate']:.3f}; "
            f"{t['ssd_rows_loaded']:,} rows ({_bytes(t['ssd_bytes_loaded'])}) loaded from SSD-PS, "
            f"{t['rows_created']:,} rows ({_bytes(t['bytes_created'])}) created; "
            f"{t.get('ssd_live_rows', 0):,} rows ({_bytes(t.get('ssd_live_bytes', 0))}) in SSD-PS files"
        )
    queues = report.get("queues") or {}
    if queues:
        lines.append(
            "edges (max depth/capacity, stalls): "
            + ", ".join(f"{name} {q['max_depth']}/{q['capacity']} {q['stalls']}" for name, q in queues.items())
        )
    ov = report.get("overlap") or {}
    if ov.get("batches"):
        lines.append(
            f"overlap over {ov['batches']} batches: load of t+1 during train of t "
            f"{100 * ov['load_during_train']:.0f}%, read of t+2 + load of t+1 + train of t at once "
            f"{100 * ov['read_load_train']:.0f}%"
        )
    ws = report.get("working_set") or {}
    if ws.get("per_batch"):
        lines.append(
            f"trainer working set per batch: {ws['rows_to_trainer_per_batch']:,.0f} rows "
            f"({_bytes(ws['bytes_to_trainer_per_batch'])}) shipped to it, "
            f"{ws['rows_to_owner_per_batch']:,.0f} ({_bytes(ws['bytes_to_owner_per_batch'])}) returned; "
            f"hit rate {ws['trainer_hit_rate']:.3f}"
        )
    bad = report.get("bad_input") or {}
    if bad:
        lines.append(
            f"bad input: {bad.get('rows_bad', 0):,} rows and {bad.get('files_bad', 0)} files skipped"
            + (f" ({', '.join(f'{k}: {v}' for k, v in bad['counts'].items())})" if bad.get("counts") else "")
        )
    return "\n".join(lines)
