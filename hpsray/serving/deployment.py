"""The Ray Serve deployment: ``POST /predict`` over HTTP and ``predict(Batch)`` for Python callers.

Each replica holds one :class:`~hpsray.serving.model.ServableModel`. Requests (HTTP ones after
parsing, handle calls as they come) meet in one ``@serve.batch`` method, which concatenates them
into one :class:`Batch` (so keys are deduplicated across the requests of a batch), predicts in a
worker thread (one batch at a time) and splits the result.

Hot swap: a background task polls the model directory every ``watch_s`` seconds; a newer export, or
a new incremental delta of the served one (:func:`~hpsray.serving.model.export_version`), is loaded
beside the serving one (its hot rows carried over, re-read from the new state) and swapped in by
one reference assignment; batches in flight finish on the model they started with (each request is
parsed and predicted by the same model, even across exports with different schemas), so no request
fails during a swap. A newer export that fails to load is logged and not retried until it changes.
``reload()`` forces a look.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from dataclasses import asdict
from typing import cast

import numpy as np
from ray import serve
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from hpsray.data.batch import Batch
from hpsray.errors import BadRequest, ServingError
from hpsray.serving.metrics import CONTENT_TYPE, ServeMetrics
from hpsray.serving.model import LoadOptions, ServableModel, export_version, resolve_export
from hpsray.serving.request import Limits

__all__ = ["Predictor"]

log = logging.getLogger("ray.serve")

try:
    import orjson

    def _dumps(doc: dict) -> bytes:
        return orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY)
except ImportError:  # pragma: no cover - orjson comes with the serve extra

    def _dumps(doc: dict) -> bytes:
        return json.dumps({k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in doc.items()}).encode()


def _options(d: dict) -> LoadOptions:
    d = dict(d)
    limits = Limits(**d.pop("limits", {}))
    return LoadOptions(limits=limits, **d)


@serve.deployment(name="hpsray-predictor", max_ongoing_requests=256)
class Predictor:
    """One replica; see the module docstring.

    Args:
        model_dir: an export directory, or a directory of exports (the newest is served).
        load: :class:`LoadOptions` as a dict (``limits`` as a dict of :class:`Limits`).
        max_batch_size: requests per dynamic batch; batch_wait_s: how long a batch waits to fill.
        watch_s: how often to look for a newer export (0: never; ``reload()`` still works).
        torch_threads: torch's intra-op threads in the replica.
    """

    def __init__(
        self,
        model_dir: str,
        load: dict | None = None,
        max_batch_size: int = 16,
        batch_wait_s: float = 0.002,
        watch_s: float = 2.0,
        torch_threads: int = 1,
    ) -> None:
        import torch

        from hpsray.models.vml import warm_vml

        torch.set_num_threads(torch_threads)  # one batch at a time; more threads only contend
        warm_vml()  # with more than one thread, a model's first float op may meet VML's first call
        self._root = os.fspath(model_dir)
        self._load = _options(load or {})
        self._model = ServableModel.load(self._root, self._load)
        self._swap_lock = asyncio.Lock()
        self.swaps = 0
        self.metrics = ServeMetrics()  # GET /metrics
        self._failed: tuple[str, int, tuple[int, ...]] | None = None
        # ray's serve.batch is annotated as returning a plain callable; its wrapper has these setters
        self._batched.set_max_batch_size(max_batch_size)  # type: ignore[attr-defined]
        self._batched.set_batch_wait_timeout_s(batch_wait_s)  # type: ignore[attr-defined]
        self._watch_s = watch_s
        self._watcher: asyncio.Task | None = None
        try:
            asyncio.get_running_loop()
            self._ensure_watcher()
        except RuntimeError:  # constructed off the replica's loop: started by the first call
            pass

    # -- hot swap -----------------------------------------------------------------------------

    def _ensure_watcher(self) -> None:
        if self._watcher is None and self._watch_s > 0:
            self._watcher = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self._watch_s)
            try:
                await self.reload()
            except Exception as e:  # a half-written or bad export must not stop serving
                log.warning("hpsray serve: not swapping to the newer export: %s", e)

    async def reload(self, path: str | None = None) -> str:
        """Load the newest export under ``path`` (default: the served directory) if it differs from
        the serving one, and swap it in; returns the directory now served."""
        self._ensure_watcher()
        async with self._swap_lock:
            root = path or self._root
            directory = resolve_export(root)
            version = export_version(directory)
            if version != self._model.version and version != self._failed:
                try:
                    model = await asyncio.to_thread(ServableModel.load, directory, self._load, self._model)
                except Exception:
                    self._failed = version  # not retried until that export changes again
                    raise
                self._model = model  # batches in flight keep the model they started with
                self._root = root
                self.swaps += 1
                log.info("hpsray serve: now serving %s (delta %d)", directory, model.delta)
            return self._model.directory

    # -- predictions --------------------------------------------------------------------------

    @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.002)
    async def _batched(self, items: list[tuple[ServableModel, Batch]]) -> list[np.ndarray]:
        # each request is predicted by the model that parsed it (two only around a swap)
        out: list[np.ndarray | None] = [None] * len(items)
        for model in dict.fromkeys(m for m, _ in items):
            idx = [i for i, (m, _) in enumerate(items) if m is model]
            batches = [items[i][1] for i in idx]
            merged = Batch.concat(batches) if len(batches) > 1 else batches[0]
            probs = await asyncio.to_thread(model.predict, merged)
            start = 0
            for i, b in zip(idx, batches):
                out[i] = probs[start : start + len(b)]
                start += len(b)
        return cast("list[np.ndarray]", out)  # every item was predicted above

    async def predict(self, batch: Batch) -> np.ndarray:
        """Click probabilities (``float32[B]``) of a :class:`Batch` of already-encoded examples."""
        self._ensure_watcher()
        return await self._batched((self._model, batch))

    async def predict_examples(self, examples: list[dict]) -> np.ndarray:
        """Click probabilities of raw examples (as in the HTTP body's ``examples``)."""
        model = self._model
        return await self._batched((model, model.parser.parse_examples(examples)))

    async def __call__(self, request: Request) -> Response:
        self._ensure_watcher()
        path = request.url.path.rstrip("/")
        if path.endswith("/healthz"):
            return PlainTextResponse("ok")
        if path.endswith("/metrics"):  # Prometheus' text format, this replica's series
            text = self.metrics.exposition(self._model.stats(), self.swaps, str(os.getpid()))
            return Response(text, media_type=CONTENT_TYPE)
        if not path.endswith("/predict"):
            return PlainTextResponse(
                f"no such endpoint {request.url.path!r}; POST /predict, GET /metrics, GET /healthz", status_code=404
            )
        if request.method != "POST":
            return PlainTextResponse("POST /predict only", status_code=405)
        t0 = time.perf_counter()
        try:
            response, examples = await self._predict_http(request)
        except Exception:
            self.metrics.observe(500, 0, time.perf_counter() - t0)  # Serve answers it with a 500
            raise
        self.metrics.observe(response.status_code, examples, time.perf_counter() - t0)
        return response

    async def _predict_http(self, request: Request) -> tuple[Response, int]:
        """The answer to ``POST /predict`` and the examples it predicted."""
        model = self._model  # parses and predicts this request, even if a swap lands meanwhile
        parser = model.parser
        limit = parser.limits.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return JSONResponse({"error": f"body of {declared} bytes exceeds the limit of {limit}"}, status_code=400), 0
        chunks, size = [], 0
        async for chunk in request.stream():
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:
                return JSONResponse({"error": f"body exceeds the limit of {limit} bytes"}, status_code=400), 0
        try:
            batch = parser.parse_body(chunks[0] if len(chunks) == 1 else b"".join(chunks))
        except BadRequest as e:
            return JSONResponse({"error": str(e)}, status_code=400), 0
        try:
            probs = await self._batched((model, batch))
        except ServingError as e:
            return JSONResponse({"error": str(e)}, status_code=500), 0
        return Response(_dumps({"probabilities": probs}), media_type="application/json"), len(batch)

    # -- introspection ------------------------------------------------------------------------

    def stats(self) -> dict:
        return {**self._model.stats(), "swaps": self.swaps, "pid": os.getpid(), "load": asdict(self._load)}

    async def check_health(self) -> None:
        self._ensure_watcher()
        if self._watcher is not None and self._watcher.done() and self._watcher.exception() is not None:
            raise RuntimeError(f"model watcher died: {self._watcher.exception()}")
