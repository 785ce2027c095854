"""A trainer's steps under SSP, A-BSP and ASP across nodes (docs/architecture.md: Consistency):
updates published under clocks and applied as they arrive, batch ends that are no barriers
under SSP/ASP, and the final barrier of a pass (:meth:`RelaxedSteps.settle`).

:class:`RelaxedSteps` is the strategy of those modes (:mod:`hpsray.training.strategies`): it
holds their clocks and what crosses batch ends, and steps the engine through the mini-batches
as BSP does (find once per batch, torch ops on the arena); the other trainers' updates reach
the rows it holds through :meth:`~hpsray.training.engine.TrainerEngine.apply_updates`. What
travels to the other trainers is numpy (the exchange's payload): each mini-batch's publish and
the apply of the others' updates are its stated host steps (:func:`~hpsray.training.marks.host_step`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Protocol

import numpy as np
import torch

from hpsray.cluster.updates import CarryOver, Payload, crosses_batches, merge_payloads
from hpsray.kernels.arrays import to_host
from hpsray.training.engine import TrainerEngine
from hpsray.training.layout import BatchIndex
from hpsray.training.marks import host_step, minibatch
from hpsray.training.strategies import Collective, Strategy, Timed, no_clock

__all__ = ["RelaxedSteps", "RelaxedSync", "UpdateExchange"]


class RelaxedSync(Protocol):
    """What the relaxed modes read of the pipeline's ``SyncSettings``."""

    @property
    def consistency(self) -> str: ...
    @property
    def staleness(self) -> int: ...
    @property
    def work_per_clock(self) -> int: ...
    @property
    def dense_staleness(self) -> int | None: ...
    @property
    def before_minibatch(self) -> Callable[[int, int], None] | None: ...


class UpdateExchange(Protocol):
    """How updates propagate (``hpsray.cluster.propagation.Exchange``)."""

    received_bytes: int

    def publish(self, channel: str, clock: int, payload: Payload) -> None: ...
    def fetch(
        self, channel: str, oldest: int, upto: int | None, seen: dict[int, int]
    ) -> list[tuple[int, int, Payload]]: ...
    def fail(self, batch_id: Hashable) -> None: ...
    def close(self) -> None: ...


class RelaxedSteps(Strategy):
    """SSP, A-BSP or ASP for one trainer (see the module docstring).

    Args:
        engine: the trainer's engine (working set, dense model, step counter).
        node: this trainer's rank; ``world``: how many there are.
        sync: the mode, its bounds and test hooks.
        exchange: how updates propagate.
        group: the trainers' collective group (A-BSP agrees on a failed batch there).
        straggle: the trainer's seeded straggler delay, called with each clock.
        timed: the trainer's clock of a batch.
    """

    def __init__(
        self,
        engine: TrainerEngine,
        node: int,
        world: int,
        sync: RelaxedSync,
        exchange: UpdateExchange,
        group: Collective,
        straggle: Callable[[int], None],
        timed: Timed = no_clock,
    ) -> None:
        super().__init__(engine, timed)
        self.node, self.sync, self.exchange, self.group = node, sync, exchange, group
        self.straggle = straggle
        self._max_staleness = 0
        self.seen: dict[int, int] = {r: 0 for r in range(world) if r != node}  # newest clock applied per other
        self.seen_dense: dict[int, int] = dict(self.seen)
        self.pending_dense: np.ndarray | None = None
        self.clock_base = 0  # the step every trainer of the group started from (restart_clocks)
        self.carry: CarryOver | None = None  # SSP/ASP across batch ends (see steps)
        self._sent = 0
        self.restart_clocks()

    @property
    def max_staleness(self) -> int:
        return self._max_staleness

    def staleness(self) -> dict[str, int]:
        carry = self.carry
        return {
            "max_staleness": self._max_staleness,
            "max_staleness_across_batches": carry.max_across if carry is not None else 0,
            "max_return_staleness": carry.max_return if carry is not None else 0,
        }

    def peer_failed(self, batch_id: Hashable, error: BaseException | None) -> bool:
        """SSP/ASP: a trainer that failed tells the others through the exchange (their waits
        raise); A-BSP agrees in the collective, a barrier."""
        if self.crosses_batches:
            if error is not None:
                self.exchange.fail(batch_id)
            return False
        failed = self.group.allreduce_sum(torch.tensor([0.0 if error is None else 1.0]))
        return error is None and float(failed[0]) > 0

    def close(self) -> None:
        self.exchange.close()

    @property
    def crosses_batches(self) -> bool:
        return crosses_batches(self.sync)

    def steps(self, index: BatchIndex, sizes: list[int]) -> list[torch.Tensor]:
        """One batch: publish each mini-batch's update (A-BSP: each clock's ``k``), apply the
        others' as they arrive, wait only when beyond the slack: ``staleness`` for the
        embeddings, ``dense_staleness`` (when given) for the dense parameters.

        A-BSP ends each batch with a barrier. SSP and ASP do not (docs/architecture.md:
        Consistency): the clock runs on, the batch end waits only as the bound requires for the
        next clock, and the rows borrowed anew first get the others' updates of the batch before
        (:class:`~hpsray.cluster.updates.CarryOver`); :meth:`settle` ends a pass."""
        engine, sync = self.engine, self.sync
        engine.dense.train(True)
        mode = sync.consistency
        k = max(1, sync.work_per_clock) if mode == "absp" else 1
        bound = sync.staleness if mode == "ssp" else (k - 1 if mode == "absp" else None)
        dense_bound = sync.dense_staleness
        hook = sync.before_minibatch  # an injection point for tests (a straggler); None otherwise
        carry = self._carry_over()
        if carry is not None:
            with host_step("replay"):
                self._replay(carry)
        arena = engine.arena
        steps = list(engine.global_minibatches(index, sizes))
        with host_step("keys"):  # the keys each mini-batch publishes, on the host once per batch
            host_keys = [
                to_host(engine.device.from_tensor(mb.keys)).view(np.uint64)
                for mb in index.minibatches
                if mb.keys is not None
            ]
        losses = []
        out_keys, out_grads, out_dense = [], [], None  # own updates of the clock not published yet
        for i, (mb, total) in enumerate(steps):
            with minibatch():
                clock = engine.step + 1
                if mode != "absp":
                    # ssp: every other trainer's update of clock - 1 - s must be in; asp: take what is there
                    others = self._fetch(clock - 1 - bound if bound is not None else -1, upto=clock - 1)
                elif i % k == 0 and i > 0:  # A-BSP: a clock's start is a barrier
                    others = self._fetch(clock - 1, upto=clock - 1)
                else:
                    others = self._no_update()
                with host_step("apply"):  # fetched updates reach the rows before this mini-batch reads them
                    self._apply_others(others)
                oldest = min(self.seen.values())
                self._max_staleness = max(self._max_staleness, clock - 1 - oldest)
                if carry is not None and oldest < carry.first - 1:  # another trainer is in an earlier batch
                    carry.max_across = max(carry.max_across, clock - 1 - oldest)
                self.straggle(clock)
                if hook is not None:
                    hook(self.node, clock)
                own: dict = {}

                def reduce(
                    flat: torch.Tensor, own: dict = own, others: dict = others, clock: int = clock
                ) -> torch.Tensor:  # via the host
                    with host_step("publish"):
                        own["dense"] = flat.detach().cpu().numpy().copy()
                        if dense_bound is None:  # the dense gradient travels with the sparse update
                            return flat + engine.device.tensor(others["dense"]) if others["dense"] is not None else flat
                        return engine.device.tensor(self._dense_with_slack(own["dense"], clock, dense_bound))

                if mb is not None:
                    gathered, loss, grads = engine.forward_backward(arena, mb, total)
                else:
                    engine.dense.zero_grad()
                engine.dense.step_optimizers(reduce)
                engine.step += 1
                if mb is not None:
                    arena.update(mb.rows, gathered, grads, engine.step)
                    assert mb.keys is not None  # the batch's index is made with its keys
                    with host_step("publish"):
                        out_keys.append(host_keys[i])
                        out_grads.append(to_host(engine.device.from_tensor(grads)))
                if dense_bound is None:
                    out_dense = own["dense"] if out_dense is None else out_dense + own["dense"]
                if (i + 1) % k == 0 or i + 1 == len(steps):
                    if not out_keys:
                        payload: Payload = (
                            np.empty(0, np.uint64),
                            np.empty((0, engine.grad_dim), np.float32),
                            out_dense,
                        )
                    elif len(out_keys) == 1:
                        payload = (out_keys[0], out_grads[0], out_dense)
                    else:  # A-BSP: the clock's k updates as one
                        merged = merge_payloads([(kk, gg, None) for kk, gg in zip(out_keys, out_grads, strict=True)])
                        payload = (merged[0], merged[1], out_dense)
                    self.exchange.publish("all", clock, payload)
                    out_keys, out_grads, out_dense = [], [], None
                self.sent.append(self.exchange.received_bytes - self._sent)
                self._sent = self.exchange.received_bytes
                if mb is not None:
                    losses.append(loss * total / mb.n_examples)
        engine.examples += index.n_examples
        with host_step("batch end"):
            if carry is None:  # A-BSP: the batch end is a barrier, every update in before write-back
                self._batch_end(engine.step)
            else:  # SSP/ASP: wait only as the next clock's bound requires; take what else has arrived
                self._batch_end(engine.step - bound if bound is not None else -1)
                oldest = min(self.seen.values())
                carry.max_return = max(carry.max_return, engine.step - oldest)
                carry.batch_end(engine.step, self._resident())
                carry.parts = []
        return losses

    def stamp(self, keys: Sequence[np.ndarray]) -> tuple[int, int] | None:
        """``(clock, oldest)`` to stamp the rows of ``keys`` (per owner) returned at a batch end
        with (SSP/ASP: this trainer's clock and the oldest clock of the others it holds; the
        owner keeps the freshest copy); ``None`` under A-BSP."""
        if self.carry is None or not self.crosses_batches:
            return None
        self.carry.parts.extend(keys)
        return self.engine.step, min(self.seen.values())

    def _carry_over(self) -> CarryOver | None:
        """The state across batch ends under SSP/ASP (``None`` under A-BSP: batch ends are barriers)."""
        if not self.crosses_batches:
            return None
        if self.carry is None or self.engine.step < self.carry.last:  # first batch, or restored from a checkpoint
            self.carry = CarryOver()
            self.carry.batch_end(self.engine.step, self._resident())
            self.carry.base = self.engine.step
        return self.carry

    def _resident(self) -> np.ndarray:
        keys = [to_host(t.keys()) for t in self.engine.hbm.tables]
        return np.sort(np.concatenate(keys)) if keys else np.empty(0, np.uint64)

    def _replay(self, carry: CarryOver) -> None:
        """A batch start under SSP/ASP: the rows borrowed anew were lent before the last batch's
        write-back; give them the others' updates of that batch received so far (later ones
        arrive through :meth:`_fetch` and reach every resident row)."""
        keys, grads = carry.replay(self._resident())
        if keys.size:
            self.engine.apply_updates(keys, grads)

    def _apply_others(self, others: dict) -> None:
        if others["keys"].size:
            self.engine.apply_updates(others["keys"], others["grads"])

    def _batch_end(self, oldest: int) -> None:
        """Fetch the others' updates up to this trainer's clock, after waiting for their clock
        ``oldest``, and apply them (the dense part waits for the next step)."""
        rest = self._fetch(oldest, upto=self.engine.step)
        self._apply_others(rest)
        if rest["dense"] is not None:
            self.pending_dense = rest["dense"]
        if self.sent:
            self.sent[-1] += self.exchange.received_bytes - self._sent
            self._sent = self.exchange.received_bytes

    def settle(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """The final barrier of a pass under SSP/ASP: wait for every other trainer's last
        clock, apply all their updates, and give the last batch's rows, complete, per owner."""
        carry = self._carry_over()
        assert carry is not None, "settle: only under ssp/asp"
        with host_step("settle"):
            self._batch_end(self.engine.step)
        out = [(k, self.engine.rows(k)) for k in carry.parts]
        carry.settled(self.engine.step, self._resident())
        return out

    def forget(self) -> None:
        """A recovery that keeps this process: the working set dropped, nothing applied, nothing pending."""
        self.engine.forget()
        self.seen = dict.fromkeys(self.seen, 0)
        self.pending_dense = None

    def _no_update(self) -> dict:
        dim = self.engine.grad_dim
        return {"keys": np.empty(0, np.uint64), "grads": np.empty((0, dim), np.float32), "dense": None}

    def _dense_with_slack(self, mine: np.ndarray, clock: int, slack: int) -> np.ndarray:
        """The dense gradient to step with at ``clock`` when the dense parameters have their own
        slack: this trainer's and the others' versions up to ``clock`` it has not used, after
        waiting for everyone's version ``clock - slack``, summed in (clock, rank) order. With
        slack 0 that is every trainer's gradient of ``clock`` in rank order: the same sum, so
        the same dense weights, on every node."""
        self.exchange.publish("dense", clock, (None, None, mine))
        got = self.exchange.fetch("dense", self._since_start(clock - slack), clock, self.seen_dense)
        for rank, c, _ in got:
            self.seen_dense[rank] = max(self.seen_dense[rank], c)
        parts = sorted(
            [(self.node, clock, mine), *((r, c, p[2]) for r, c, p in got if p[2] is not None)],
            key=lambda u: (u[1], u[0]),
        )
        total = parts[0][2].copy()
        for _, _, d in parts[1:]:
            total = total + d
        return total

    def restart_clocks(self) -> None:
        """Every trainer of a (re)formed group starts from the same step (a fresh run's 0, or the
        checkpoint's after a restore): count the others as having published up to it, since
        their versions before it will never come (the new mailboxes are empty)."""
        step = self.engine.step
        self.clock_base = step
        self.seen = dict.fromkeys(self.seen, step)
        self.seen_dense = dict(self.seen)

    def _since_start(self, oldest: int) -> int:
        """``oldest`` to wait for, or 0 (wait for nothing) when it predates the group's start."""
        return oldest if oldest > self.clock_base else 0

    def _fetch(self, oldest: int, upto: int | None = None) -> dict:
        """The others' updates not applied yet (waiting for clock ``oldest``), combined."""
        got = self.exchange.fetch("all", self._since_start(oldest), upto, self.seen)
        dim = self.engine.grad_dim
        keys: list[np.ndarray] = [np.empty(0, np.uint64)]
        grads: list[np.ndarray] = [np.empty((0, dim), np.float32)]
        dense = None
        if self.pending_dense is not None:
            dense, self.pending_dense = self.pending_dense, None
        carry = self.carry if self.crosses_batches else None
        for rank, clock, (k, g, d) in got:
            if k is not None and k.size:
                assert g is not None  # a payload with keys has their gradients
                keys.append(k)
                grads.append(g)
                if carry is not None:
                    carry.record(clock, k, g)
            if d is not None:
                dense = d.copy() if dense is None else dense + d
            self.seen[rank] = max(self.seen[rank], clock)
        return {"keys": np.concatenate(keys), "grads": np.concatenate(grads), "dense": dense}
