"""``DevicePart``: what one device process gives back of a batch (numpy only: the actors'
messages import it without torch)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class DevicePart:
    """One device process's result of a batch: its rows of each owner's keys going back (in the
    keys' order, only those it holds) and its loss share of each global mini-batch, with the
    factor that turns the node's summed shares into its mean loss (0: the node's part was empty)."""

    rows: list[np.ndarray]
    losses: list[float]
    scales: list[float]
    returned: list[np.ndarray | None]  # per owner, which of its keys go back (None: all)
