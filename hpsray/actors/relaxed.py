"""A trainer's steps under SSP, A-BSP and ASP across nodes (docs/architecture.md: Consistency):
updates published under clocks and applied as they arrive, batch ends that are no barriers
under SSP/ASP, and the final barrier of a pass (:meth:`RelaxedSteps.settle`).

:class:`RelaxedSteps` is a part of :class:`~hpsray.actors.trainer.Trainer` (its base class),
apart because BSP, the default, never runs it; it uses the trainer's tables, dense replicas,
exchange and clocks.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from hpsray.actors.messages import Returned
from hpsray.cluster.consistency import CarryOver, crosses_batches, merge_payloads
from hpsray.kernels.arrays import to_host


class RelaxedSteps:
    """The relaxed modes' half of a trainer (see the module docstring)."""

    # set by the trainer (attributes this part reads and writes)
    node: int
    step: int
    sync: Any
    exchange: Any
    hbm: Any
    dense: Any
    device: Any
    optimizer: Any
    config: Any
    clock: Any
    max_staleness: int
    exchanged_bytes: list[int]
    _seen: dict[int, int]
    _seen_dense: dict[int, int]
    _sent: int
    _pending_dense: Any
    _clock_base: int
    _carry: CarryOver | None = None  # SSP/ASP across batch ends (see _train_stale)

    def _train_stale(self, batch, sizes: list[int]) -> list[torch.Tensor]:
        """SSP, A-BSP and ASP across nodes (:mod:`hpsray.cluster.consistency`): publish each
        mini-batch's update (A-BSP: each clock's ``k``), apply the others' as they arrive, wait
        only when beyond the slack: ``staleness`` for the embeddings, ``dense_staleness`` (when
        given) for the dense parameters.

        A-BSP ends each batch with a barrier. SSP and ASP do not (docs/architecture.md:
        Consistency): the clock runs on, the batch end waits only as the bound requires for the
        next clock, and the rows borrowed anew first get the others' updates of the batch before
        (:class:`~hpsray.cluster.consistency.CarryOver`); :meth:`settle` ends a pass."""
        self.dense.train(True)
        sync = self.sync
        mode = sync.consistency
        k = max(1, getattr(sync, "work_per_clock", 1)) if mode == "absp" else 1
        bound = sync.staleness if mode == "ssp" else (k - 1 if mode == "absp" else None)
        dense_bound = getattr(sync, "dense_staleness", None)
        hook = sync.before_minibatch  # an injection point for tests (a straggler); None otherwise
        carry = self._carry_over()
        if carry is not None:
            self._replay(carry)
        steps = list(self._global_minibatches(batch, sizes))
        losses = []
        out_keys, out_grads, out_dense = [], [], None  # own updates of the clock not published yet
        for i, (mb, total) in enumerate(steps):
            clock = self.step + 1
            if mode != "absp":
                # ssp: every other trainer's update of clock - 1 - s must be in; asp: take what is there
                others = self._fetch(clock - 1 - bound if bound is not None else -1, upto=clock - 1)
            elif i % k == 0 and i > 0:  # A-BSP: a clock's start is a barrier
                others = self._fetch(clock - 1, upto=clock - 1)
            else:
                others = self._no_update()
            self._apply_others(others)  # fetched updates reach the rows before this mini-batch reads them
            oldest = min(self._seen.values())
            self.max_staleness = max(self.max_staleness, clock - 1 - oldest)
            if carry is not None and oldest < carry.first - 1:  # another trainer is in an earlier batch
                carry.max_across = max(carry.max_across, clock - 1 - oldest)
            self._straggle(clock)
            if hook is not None:
                hook(self.node, clock)
            own: dict = {}

            def reduce(flat: torch.Tensor, own=own, others=others, clock=clock) -> torch.Tensor:  # via the host
                own["dense"] = flat.detach().cpu().numpy().copy()
                if dense_bound is None:  # the dense gradient travels with the sparse update
                    return flat + self.device.tensor(others["dense"]) if others["dense"] is not None else flat
                return self.device.tensor(self._dense_with_slack(own["dense"], clock, dense_bound))

            loss, gkeys, grads = self.dense.step(mb, self._weights, total=total, reduce=reduce)
            gkeys, grads = to_host(gkeys), to_host(grads)
            self.step += 1
            self.hbm.apply_gradients(gkeys, grads, self.optimizer, self.step, resident_only=True)
            out_keys.append(gkeys)
            out_grads.append(grads)
            if dense_bound is None:
                out_dense = own["dense"] if out_dense is None else out_dense + own["dense"]
            if (i + 1) % k == 0 or i + 1 == len(steps):
                if len(out_keys) == 1:
                    payload = (out_keys[0], out_grads[0], out_dense)
                else:  # A-BSP: the clock's k updates as one
                    merged = merge_payloads([(kk, gg, None) for kk, gg in zip(out_keys, out_grads, strict=True)])
                    payload = (merged[0], merged[1], out_dense)
                self.exchange.publish("all", clock, payload)
                out_keys, out_grads, out_dense = [], [], None
            self.exchanged_bytes.append(self.exchange.received_bytes - self._sent)
            self._sent = self.exchange.received_bytes
            if len(mb):
                losses.append(loss * total / len(mb))
        if carry is None:  # A-BSP: the batch end is a barrier, every update in before write-back
            self._batch_end(self.step)
        else:  # SSP/ASP: wait only as the next clock's bound requires; take what else has arrived
            self._batch_end(self.step - bound if bound is not None else -1)
            oldest = min(self._seen.values())
            carry.max_return = max(carry.max_return, self.step - oldest)
            carry.batch_end(self.step, self._resident())
            carry.parts = []
        return losses

    def _carry_over(self) -> CarryOver | None:
        """The state across batch ends under SSP/ASP (``None`` under A-BSP: batch ends are barriers)."""
        if not crosses_batches(self.sync):
            return None
        if self._carry is None or self.step < self._carry.last:  # first batch, or restored from a checkpoint
            self._carry = CarryOver()
            self._carry.batch_end(self.step, self._resident())
            self._carry.base = self.step
        return self._carry

    def _resident(self) -> np.ndarray:
        keys = [to_host(t.keys()) for t in self.hbm.tables]
        return np.sort(np.concatenate(keys)) if keys else np.empty(0, np.uint64)

    def _replay(self, carry: CarryOver) -> None:
        """A batch start under SSP/ASP: the rows borrowed anew were lent before the last batch's
        write-back; give them the others' updates of that batch received so far (later ones
        arrive through :meth:`_fetch` and reach every resident row)."""
        keys, grads = carry.replay(self._resident())
        if keys.size:
            self.hbm.apply_gradients(keys, grads, self.optimizer, self.step, resident_only=True)

    def _apply_others(self, others: dict) -> None:
        if others["keys"].size:
            self.hbm.apply_gradients(others["keys"], others["grads"], self.optimizer, self.step, resident_only=True)

    def _batch_end(self, oldest: int) -> None:
        """Fetch the others' updates up to this trainer's clock, after waiting for their clock
        ``oldest``, and apply them (the dense part waits for the next step)."""
        rest = self._fetch(oldest, upto=self.step)
        self._apply_others(rest)
        if rest["dense"] is not None:
            self._pending_dense = rest["dense"]
        if self.exchanged_bytes:
            self.exchanged_bytes[-1] += self.exchange.received_bytes - self._sent
            self._sent = self.exchange.received_bytes

    def settle(self, batch_id) -> tuple:
        """The final barrier of a pass under SSP/ASP (the schedule calls it after the last
        batch's ``train``): wait for every other trainer's last clock, apply all their updates,
        and return the last batch's rows, complete, one :class:`Returned` per owner (call with
        ``.options(num_returns=n_nodes)``)."""
        carry = self._carry_over()
        assert carry is not None, "settle: only under ssp/asp"
        with self.clock.timed(batch_id):
            self._batch_end(self.step)
            parts = list(carry.parts)
            out = [Returned(self.node, k, self.hbm.get(k), self.step, None) for k in parts]
            carry.settled(self.step, self._resident())
        return tuple(out)

    def _no_update(self) -> dict:
        return {"keys": np.empty(0, np.uint64), "grads": np.empty((0, self.config.dim), np.float32), "dense": None}

    def _dense_with_slack(self, mine: np.ndarray, clock: int, slack: int) -> np.ndarray:
        """The dense gradient to step with at ``clock`` when the dense parameters have their own
        slack: this trainer's and the others' versions up to ``clock`` it has not used, after
        waiting for everyone's version ``clock - slack``, summed in (clock, rank) order. With
        slack 0 that is every trainer's gradient of ``clock`` in rank order: the same sum, so
        the same dense weights, on every node."""
        self.exchange.publish("dense", clock, (None, None, mine))
        got = self.exchange.fetch("dense", self._since_start(clock - slack), clock, self._seen_dense)
        for rank, c, _ in got:
            self._seen_dense[rank] = max(self._seen_dense[rank], c)
        parts = sorted([(self.node, clock, mine), *((r, c, p[2]) for r, c, p in got)], key=lambda u: (u[1], u[0]))
        total = parts[0][2].copy()
        for _, _, d in parts[1:]:
            total = total + d
        return total

    def _restart_clocks(self) -> None:
        """Every trainer of a (re)formed group starts from the same step (a fresh run's 0, or the
        checkpoint's after a restore): count the others as having published up to it, since
        their versions before it will never come (the new mailboxes are empty)."""
        self._clock_base = self.step
        self._seen = dict.fromkeys(self._seen, self.step)
        self._seen_dense = dict(self._seen)

    def _since_start(self, oldest: int) -> int:
        """``oldest`` to wait for, or 0 (wait for nothing) when it predates the group's start."""
        return oldest if oldest > self._clock_base else 0

    def _fetch(self, oldest: int, upto: int | None = None) -> dict:
        """The others' updates not applied yet (waiting for clock ``oldest``), combined."""
        got = self.exchange.fetch("all", self._since_start(oldest), upto, self._seen)
        keys, grads, dense = [np.empty(0, np.uint64)], [np.empty((0, self.config.dim), np.float32)], None
        if self._pending_dense is not None:
            dense, self._pending_dense = self._pending_dense, None
        carry = self._carry if crosses_batches(self.sync) else None
        for rank, clock, (k, g, d) in got:
            if k is not None and k.size:
                keys.append(k)
                grads.append(g)
                if carry is not None:
                    carry.record(clock, k, g)
            if d is not None:
                dense = d.copy() if dense is None else dense + d
            self._seen[rank] = max(self._seen[rank], clock)
        return {"keys": np.concatenate(keys), "grads": np.concatenate(grads), "dense": dense}
