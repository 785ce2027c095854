"""Errors of the serving path: a bad request (HTTP 400, with its reason) and a model that cannot be served."""

from __future__ import annotations

from hpsray.errors import HpsrayError

__all__ = ["BadRequest", "ServingError"]


class ServingError(HpsrayError):
    """A model directory that cannot be served (no export there, no input schema, bad options)."""


class BadRequest(ServingError, ValueError):
    """A request the endpoint refuses with HTTP 400; ``str(e)`` is the reason sent back."""
