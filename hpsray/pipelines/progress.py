"""Progress of ``fit()`` and ``hpsray train``: a tqdm bar on a terminal, log lines elsewhere.

When stderr is a terminal the bar shows examples, rate and, when the input's size is known, ETA.
Otherwise (``ray job submit``, a Kubernetes RayJob, ``nohup … > log``, CI) :class:`Progress`
logs one line on the ``hpsray.progress`` logger every :func:`progress_seconds` seconds and at the
end of every pass: batches and examples done, examples/s over the interval, the slowest stage,
the MEM-PS hit rate, SSD-PS bytes, ETA and the newest checkpoint (docs/operations.md: Progress).
The driver's gauges (``hpsray_progress_*``) get the same counts after every batch.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from tqdm import tqdm

from hpsray.data.formats import RowCount
from hpsray.env import env_seconds
from hpsray.errors import DataError

__all__ = [
    "DEFAULT_SECONDS",
    "ENV",
    "Progress",
    "ensure_handler",
    "format_line",
    "known_examples",
    "progress_bar",
    "progress_seconds",
]

log = logging.getLogger("hpsray.progress")

DEFAULT_SECONDS = 30.0
ENV = "HPSRAY_PROGRESS_SECONDS"
STAGES = ("read", "pull", "load", "train")


def known_examples(source: Any) -> RowCount | None:
    """Examples ``source`` yields in one pass, when they can be known: generated data's ``rows``
    (exact), else what the files' format counts or estimates from bytes (``exact`` says which;
    :meth:`hpsray.data.formats.Format.count_rows`); ``None`` when the files cannot be read."""
    rows = getattr(source, "rows", None)
    if isinstance(rows, int):
        return RowCount(rows, True, how="generated rows")
    schema = getattr(source, "schema", None)
    paths = getattr(source, "paths", None)
    if schema is None or paths is None:
        return None
    from hpsray.data.readers import count_rows

    try:
        return count_rows(paths, schema)
    except (OSError, ValueError, DataError):
        return None


def progress_bar(total: int | None, enabled: bool = True, desc: str = "hpsray") -> tqdm:
    """A bar counting examples on stderr; disabled (a no-op) unless ``enabled`` and stderr is a terminal."""
    return tqdm(
        total=total,
        disable=not enabled or not sys.stderr.isatty(),
        desc=desc,
        unit=" examples",
        unit_scale=True,
        dynamic_ncols=True,
        leave=True,
        file=sys.stderr,
    )


def progress_seconds(configured: float | None = None) -> float:
    """Seconds between progress lines: ``configured`` (the job's ``[pipeline] progress_seconds``)
    when given, else ``$HPSRAY_PROGRESS_SECONDS``, else 30; 0 turns the timed lines off (the
    pass-end line stays). Raises ``ValueError`` for a negative or unreadable value."""
    if configured is None:
        return env_seconds(ENV, DEFAULT_SECONDS, zero_ok=True)
    if not (configured >= 0 and math.isfinite(configured)):
        raise ValueError(f"progress_seconds must be a finite number of seconds >= 0, got {configured}")
    return float(configured)


def ensure_handler(level: int = logging.INFO) -> None:
    """Make the progress lines reach stderr when nothing routes them: in a process whose logging
    is not configured (no handler on ``hpsray.progress``, its parents or the root), the
    ``hpsray.progress`` logger gets one stderr handler at ``level``. A configured process, and
    hpsray's other loggers, are left as they are."""
    if log.hasHandlers():
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s", "%Y-%m-%d %H:%M:%S"))
    log.addHandler(handler)
    if log.level == logging.NOTSET or log.level > level:
        log.setLevel(level)


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _duration(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def format_line(
    batches: int,
    examples: int,
    total: int | None,
    rate: float,
    interval: float,
    stages: dict | None,
    checkpoint: str | None,
    end: bool = False,
    *,
    exact: bool = True,
    evaluation: Any = None,
) -> str:
    """One progress line; ``stages`` (``None`` when the actors did not answer) holds the training
    loss over the interval's batches (``loss``), the busy seconds of each stage over the interval
    (``busy``), the MEM-PS hit rate (``hit_rate``) and SSD-PS bytes read and written since the
    start (``ssd_read``, ``ssd_written``); ``evaluation``: the latest
    :class:`~hpsray.evaluation.EvalPoint` (or ``None``); a ``total`` that is not ``exact``
    (estimated from bytes) is shown as ``~N``."""
    what = "pass end" if end else "progress"
    of = f"/{'' if exact else '~'}{total:,} ({100.0 * examples / total:.0f}%)" if total else ""
    parts = [
        f"{what}: batches {batches:,}",
        f"examples {examples:,}{of}",
        f"{rate:,.0f} examples/s over {interval:.1f} s",
    ]
    if stages is not None and stages.get("loss") is not None:
        parts.append(f"loss {stages['loss']:.4f}")
    if evaluation is not None:
        parts.append(f"eval AUC {evaluation.auc:.4f} log-loss {evaluation.logloss:.4f} (batch {evaluation.batches:,})")
    if stages is not None:
        busy: dict[str, float] = stages.get("busy") or {}
        if busy:
            slow = max(busy, key=lambda k: busy[k])
            share = 100.0 * busy[slow] / interval if interval > 0 else 0.0
            parts.append(f"slowest stage {slow} (busy {busy[slow]:.2f} s, {share:.0f}%)")
        if stages.get("hit_rate") is not None:
            parts.append(f"MEM-PS hit rate {stages['hit_rate']:.3f}")
        if "ssd_read" in stages:
            parts.append(f"SSD-PS read {_bytes(stages['ssd_read'])} written {_bytes(stages['ssd_written'])}")
    if total and not end:
        left = max(total - examples, 0)
        parts.append(f"ETA {_duration(left / rate)}" if rate > 0 else "ETA unknown")
    parts.append(f"checkpoint {checkpoint}" if checkpoint else "checkpoint none")
    return ", ".join(parts)


class Progress:
    """Counts a pass's examples (``update`` after every batch, as :class:`~hpsray.pipelines.schedule.PassSchedule`
    calls it) for the bar, the driver's gauges and, when the bar is hidden, the log lines.

    ``nodes``: the pipeline's :class:`~hpsray.pipelines.placement.NodeActors` (empty: no stage
    figures, as for the reference trainer); ``seconds``: between lines (:func:`progress_seconds`);
    ``checkpoint()``: the newest checkpoint's path (``…/ckpt-NNNNNN``), or ``None``;
    ``first_batch``: the id of the first batch this run trains; ``done_batches`` and
    ``done_examples``: what a resumed pass trained before it (the counters, the bar and the
    lines continue from them, the rates count this run's examples only). Every ``seconds`` the interval closes: its
    examples/s go to the gauges, and the stage figures are asked of the actors without waiting;
    the line is logged once they answer (a batch later at most: each actor answers after the
    call it is running). :meth:`pass_end` logs the pass's last line, waiting for them.
    """

    def __init__(
        self,
        total: int | RowCount | None,
        enabled: bool = True,
        seconds: float = DEFAULT_SECONDS,
        nodes: Sequence[Any] = (),
        checkpoint: Callable[[], str | None] | None = None,
        desc: str = "hpsray",
        first_batch: int = 0,
        done_batches: int = 0,
        done_examples: int = 0,
        evaluation: Callable[[], Any] | None = None,
        board: Any = None,
    ) -> None:
        from hpsray.actors.livemetrics import LiveGauges

        # An estimated total (RowCount.exact False) is shown as "~N" and never ends the lines early.
        self.total_exact = total.exact if isinstance(total, RowCount) else True
        total = total.rows if isinstance(total, RowCount) else total
        self.total, self.seconds = total, seconds
        self.nodes = list(nodes)
        self.checkpoint = checkpoint or (lambda: None)
        self.bar = progress_bar(total, enabled, desc)
        self.logging = enabled and bool(self.bar.disable)  # lines only where no bar shows
        if self.logging:
            ensure_handler()
        self.evaluation = evaluation or (lambda: None)
        self.board = board  # a TensorBoardLog: each line's figures as scalars, lines logged or not
        self._first_batch = first_batch - done_batches  # the pass's first batch id
        self.gauges = LiveGauges(stage="driver", node="0")
        self.examples, self.batches, self._done_examples = done_examples, done_batches, done_examples
        if done_examples:  # as tqdm's initial=: counted, not part of the rate
            self.bar.n = self.bar.last_print_n = done_examples
        self.lines = 0
        self._t0 = self._tick_t = time.monotonic()
        self._tick_examples, self._last_batch = done_examples, first_batch
        self.rate: float | None = None  # examples/s of the last closed interval
        self._due: tuple | None = None  # (counts, rate, interval) of a line waiting for the actors
        self._asked: list = []  # their stats refs

    def begin(self) -> None:
        """The pass's clock starts (the actors are up): the first interval counts from now."""
        self._t0 = self._tick_t = time.monotonic()

    @property
    def n(self) -> int:
        return self.examples

    def update(self, examples: int) -> None:
        """One more batch trained, of ``examples`` examples."""
        self.bar.update(examples)
        self.examples += examples
        self.batches += 1
        now = time.monotonic()
        if self._due is not None:
            self._emit(wait=False)
        if self.seconds > 0 and now - self._tick_t >= self.seconds:
            self._close_interval(now)
        self._set_gauges(now)

    def _close_interval(self, now: float) -> None:
        interval = now - self._tick_t
        self.rate = (self.examples - self._tick_examples) / interval if interval > 0 else 0.0
        self._tick_t, self._tick_examples = now, self.examples
        done = self.total_exact and self.total is not None and self.examples >= self.total  # the pass-end line says it
        if (self.logging or self.board is not None) and self._due is None and not done:
            self._due = (self.batches, self.examples, self.rate, interval)
            self._asked = self._ask_actors()
            if not self._asked:
                self._emit(wait=False)

    def _set_gauges(self, now: float) -> None:
        rate = self.rate if self.rate is not None else (self.examples - self._done_examples) / max(now - self._t0, 1e-9)
        eta = (self.total - self.examples) / rate if self.total and rate > 0 else -1.0
        self.gauges.set(
            progress_examples=self.examples,
            progress_examples_per_s=rate,
            progress_eta_s=max(eta, -1.0),
            progress_checkpoint_batch=_batch_of(self.checkpoint()),
        )

    def _ask_actors(self) -> list:
        refs = []
        for node in self.nodes:
            for actor in (node.reader, node.mem, node.ssd, node.trainer):
                refs.append(actor.stats.remote())
        return refs

    def _emit(self, wait: bool, end: bool = False) -> None:
        """Log the due line once the actors answered (``wait``: wait for them)."""
        assert self._due is not None
        figures = None
        if self._asked:
            import ray

            if not wait:
                ready, _ = ray.wait(self._asked, num_returns=len(self._asked), timeout=0)
                if len(ready) < len(self._asked):
                    return
            try:
                figures = self._stage_figures(ray.get(self._asked))
            except Exception:  # noqa: BLE001 - an actor failed: fit() reports it; the line goes without its figures
                figures = None
        batches, examples, rate, interval = self._due
        self._due, self._asked = None, []
        if self.board is not None:
            self._scalars(batches, rate, interval, figures)
        if not self.logging:
            return
        line = format_line(
            batches,
            examples,
            self.total,
            rate,
            interval,
            figures,
            self.checkpoint(),
            end,
            exact=self.total_exact,
            evaluation=self.evaluation(),
        )
        log.info("%s", line)
        self.lines += 1

    def _scalars(self, batches: int, rate: float, interval: float, figures: dict | None) -> None:
        """The line's figures as TensorBoard scalars at the batches trained so far."""
        scalars: dict[str, float | None] = {"throughput/examples_per_s": rate}
        if figures is not None:
            scalars["train/loss"] = figures.get("loss")
            for stage, busy in (figures.get("busy") or {}).items():
                scalars[f"stages/{stage}_busy_share"] = busy / interval if interval > 0 else None
            scalars["mem_ps/hit_rate"] = figures.get("hit_rate")
            scalars["ssd_ps/bytes_read"] = figures.get("ssd_read")
            scalars["ssd_ps/bytes_written"] = figures.get("ssd_written")
        self.board.add(self._first_batch + batches, scalars)

    def _stage_figures(self, stats: list) -> dict:
        """Busy seconds per stage over the batches since the last line (the busiest node's),
        node 0's mean training loss and the mean MEM-PS hit rate over those batches, SSD-PS bytes
        since the stores opened."""
        first = self._last_batch
        busy: dict[str, float] = {}
        rates: list[float] = []
        read = written = 0
        newest = first
        trained = stats[3].get("losses", {}) if len(stats) >= 4 else {}
        losses = [v for b, v in trained.items() if isinstance(b, int) and b >= first and v == v]  # not nan

        def since(per_batch: dict) -> float:
            return sum(v for b, v in per_batch.items() if isinstance(b, int) and b >= first)

        for reader, mem, ssd, trainer in (stats[i : i + 4] for i in range(0, len(stats), 4)):
            mine = {name: since(s.get("per_batch", {})) for name, s in zip(STAGES, (reader, mem, ssd, trainer))}
            mine["load"] += since(ssd.get("dump", {}).get("per_batch", {}))
            for name, v in mine.items():
                busy[name] = max(busy.get(name, 0.0), v)
            newest = max([newest, *(b + 1 for b in trainer.get("per_batch", {}) if isinstance(b, int))])
            rates += [v for b, v in mem.get("hit_rate", {}).items() if isinstance(b, int) and b >= first]
            store = ssd.get("store", {})
            read += int(store.get("bytes_read", 0))
            written += int(store.get("bytes_written", 0))
        self._last_batch = newest
        return {
            "loss": sum(losses) / len(losses) if losses else None,
            "busy": busy,
            "hit_rate": sum(rates) / len(rates) if rates else None,
            "ssd_read": read,
            "ssd_written": written,
        }

    def pass_end(self) -> None:
        """Log the pass's last line, over the interval since the last one (waiting for the actors)."""
        if not self.logging and self.board is None:
            return
        if self._due is not None:
            self._emit(wait=True)
        now = time.monotonic()
        interval = now - self._tick_t
        rate = (self.examples - self._tick_examples) / interval if interval > 0 else 0.0
        self._due = (self.batches, self.examples, rate, interval)
        self._asked = self._ask_actors()
        self._emit(wait=True, end=True)

    def close(self) -> None:
        self.bar.close()


def _batch_of(checkpoint: str | None) -> float:
    """The batch count of a checkpoint directory named ``ckpt-NNNNNN`` (-1 without one)."""
    if not checkpoint:
        return -1.0
    name = os.path.basename(str(checkpoint).split(" ")[0].rstrip("/"))
    digits = name.rsplit("-", 1)[-1]
    return float(int(digits)) if digits.isdigit() else -1.0
