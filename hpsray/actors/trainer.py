"""``Trainer``: a node's HBM-PS working set and its dense model replicas, training batches."""

from __future__ import annotations

import os
import time

import numpy as np
import torch

from hpsray.actors.livemetrics import LiveGauges
from hpsray.actors.messages import Returned, TrainInputs, TrainOutcome
from hpsray.actors.timing import StageClock
from hpsray.cluster.consistency import merge_payloads
from hpsray.config import TrainConfig
from hpsray.data.batch import Batch
from hpsray.errors import PeerFailedError
from hpsray.kernels.arrays import to_host
from hpsray.models.device import StepDevice
from hpsray.models.dnn import DNN
from hpsray.models.pooling import BagLayout, pool_sum
from hpsray.models.step import DenseReplicas
from hpsray.tiers.hbm import HbmPS
from hpsray.tiers.warmup import warm_trainer_step


class Trainer:
    """Trains each batch on its working set (paper Algorithm 1, step 4).

    Args:
        node, n_nodes: this node and how many there are (for the device hash).
        config: model shape, optimizers, mini-batch size, seed.
        n_slots, n_dense: input shape.
        capacity: rows the working set of two consecutive batches may hold.
        n_devices: ``D`` device tables and dense replicas ("virtual devices" on CPU).
        device: where the whole step runs: ``"cpu"`` (numba tables, torch on CPU) or ``"cuda"``
            (numba.cuda tables, CuPy key work and torch on this process's GPU; Ray gives the
            actor its own GPU with ``num_gpus=1``). Per mini-batch only the keys, dense
            features and labels go to the GPU; the loss is read once per batch.
        model: a module ``(pooled [B, n_slots, dim], dense) -> logits``; the DNN when ``None``.
        threads: torch intra-op threads (default: all cores).
    """

    def __init__(
        self,
        node: int,
        n_nodes: int,
        config: TrainConfig,
        n_slots: int,
        n_dense: int,
        capacity: int,
        n_devices: int = 1,
        device: str = "cpu",
        model: torch.nn.Module | None = None,
        threads: int | None = None,
    ) -> None:
        self.node, self.config = node, config  # first, so repr() works if the rest fails
        torch.set_num_threads(threads or os.cpu_count() or 1)
        self.optimizer = config.optimizer()
        self.device = StepDevice(device)
        self.hbm = HbmPS(capacity, config.row_width, config.row_init(), n_devices, n_nodes, device)
        self._capacity = capacity
        model = model if model is not None else DNN(n_slots, config.dim, n_dense, config.hidden, seed=config.seed)
        self.dense = DenseReplicas(model, n_devices, config.dense_optimizer, config.dense_lr, self.device)
        self.n_nodes = n_nodes
        self.group = None  # the collective group, when n_nodes > 1 (see join)
        self.dense_reducer = None
        self._mailbox = None
        self.sync, self.board, self.exchange = None, None, None  # relaxed modes: how updates propagate (see join)
        self.max_staleness = 0
        self._seen = {r: 0 for r in range(n_nodes) if r != node}  # newest clock applied per other trainer
        self._pending_dense = None
        self.exchanged_bytes: list[int] = []  # per global mini-batch, this node's payload
        self._sent = 0
        self._empty = Batch.empty(n_slots, n_dense)
        self.step = 0
        self.examples = 0
        self.losses: dict = {}
        self.clock = StageClock("train", node)
        self.gauges = LiveGauges(stage="train", node=node)
        # numba (and on CUDA, CuPy and torch's kernels) compile here, before the pipeline's clock
        warm_trainer_step(
            HbmPS(256, config.row_width, config.row_init(), n_devices, n_nodes, device),
            self.dense,
            self.optimizer,
            config.dim,
            config.row_init(),
            config.row_width,
            n_slots,
            n_dense,
        )

    def __repr__(self) -> str:
        return f"Trainer[node {self.node}]"

    def join(self, world: int, group: str, sync, aggregators=None, board=None) -> int:
        """Join the trainers' collective group (every trainer calls this at once); ``sync`` is
        the pipeline's :class:`~hpsray.pipelines.SyncStage`. Under a relaxed mode this also
        sets up how updates propagate (:mod:`hpsray.cluster.consistency`): push and pull start
        this trainer's mailbox and find the others'; relay uses ``board``."""
        from hpsray.cluster.collective import CollectiveGroup

        backend = "nccl" if self.hbm.device == "cuda" else "gloo"
        self.group = CollectiveGroup(world, self.node, group, backend)
        self.sync, self.board = sync, board
        self.exchange = None
        if sync.consistency != "bsp":
            from hpsray.cluster import consistency

            propagation = getattr(sync, "propagation", "relay")
            boxes = None
            if propagation != "relay":
                self._mailbox = consistency.start_mailbox(group, world, self.node)
                boxes = consistency.find_mailboxes(group, world)
            self.exchange = consistency.make_exchange(propagation, self.node, world, board, boxes)
            self._seen = {r: 0 for r in range(world) if r != self.node}
            self._seen_dense = dict(self._seen)
        if sync.dense == "chunked":
            from hpsray.cluster.aggregation import ChunkedAggregator

            self.dense_reducer = ChunkedAggregator(aggregators, world, self.node, chunk_bytes=sync.chunk_bytes)
        return self.node

    def _reduce_dense(self, flat: torch.Tensor) -> torch.Tensor:
        if self.dense_reducer is not None:
            out = self.dense_reducer.reduce(flat, self.step)
            self.group.bytes_sent += flat.numel() * flat.element_size()
            return out
        return self.group.allreduce_sum(flat)

    def train(self, batch_id, inputs: TrainInputs) -> tuple:
        """Train a batch on its working set and return its rows to their owners.

        Returns one :class:`Returned` per owner node, then a :class:`TrainOutcome`; call with
        ``.options(num_returns=n_nodes + 1)`` so each owner's write-back fetches only its part.
        Trainers of several nodes step through the same number of global mini-batches
        (``inputs.sizes``; an exhausted node contributes empty ones).

        With several nodes the trainers first agree that every one of them has its inputs: if
        one failed (a bad batch, a pull over capacity), all fail this batch together instead of
        leaving the others waiting in the collective.
        """
        import ray

        error = None
        try:
            batch, key_parts, loans, refreshed = inputs.unpack(ray.get(inputs.refs()))
        except Exception as e:  # noqa: BLE001 - re-raised below, after telling the peers
            error = e
        if self.n_nodes > 1 and self.group is not None:
            failed = self.group.allreduce_sum(torch.tensor([0.0 if error is None else 1.0]))
            if error is None and float(failed[0]) > 0:
                raise PeerFailedError(batch_id)  # "batch N failed on another node; see that trainer's error"
        if error is not None:
            raise error
        with self.clock.timed(batch_id):
            one = len(key_parts) == 1
            keys = key_parts[0] if one else np.concatenate(key_parts)
            rows = loans[0] if one else np.concatenate(loans)
            self.hbm.borrow(keys, rows, [(r.keys, r.rows) for r in refreshed])
            if self.n_nodes == 1:
                losses = self._train_local(batch)
            elif self.exchange is None:
                losses = self._train_steps(batch, inputs.sizes)
            else:
                losses = self._train_stale(batch, inputs.sizes)
            self.examples += len(batch) if batch is not None else 0
            # the losses stay on the device until here: one read per batch
            self.losses[batch_id] = float(torch.stack(losses).sum()) / len(losses) if losses else float("nan")
            out = [Returned(self.node, k, self.hbm.get(k)) for k in key_parts]
        done = len(batch) if batch is not None else 0
        self.gauges.set(loss=self.losses[batch_id], examples_per_s=done / max(self.clock.per_batch[batch_id], 1e-9))
        self.gauges.set_sync(self.max_staleness, self.exchanged_bytes)
        return (*out, TrainOutcome(self.losses[batch_id], done))

    def _weights(self, keys):
        return self.hbm.get(keys, columns=self.config.dim)

    def _train_local(self, batch) -> list[torch.Tensor]:
        self.dense.train(True)
        losses = []
        for mb in batch.minibatches(self.config.minibatch_size):
            loss, gkeys, grads = self.dense.step(mb, self._weights)
            self.step += 1
            self.hbm.apply_gradients(gkeys, grads, self.optimizer, self.step)
            losses.append(loss)
        return losses

    def _train_steps(self, batch, sizes: list[int]) -> list[torch.Tensor]:
        """BSP across nodes: after every global mini-batch, all trainers combine their sparse
        updates (each applies every node's to the rows it holds) and sum their dense gradients."""
        self.dense.train(True)
        losses = []
        for mb, total in self._global_minibatches(batch, sizes):
            self._straggle(self.step + 1)
            loss, gkeys, grads = self.dense.step(mb, self._weights, total=total, reduce=self._reduce_dense)
            all_keys, all_grads = self.group.allgather_sparse(gkeys, grads)
            self.step += 1
            self.hbm.apply_gradients(all_keys, all_grads, self.optimizer, self.step, resident_only=True)
            self.exchanged_bytes.append(self.group.bytes_sent - self._sent)
            self._sent = self.group.bytes_sent
            if len(mb):
                losses.append(loss * total / len(mb))
        return losses

    def _global_minibatches(self, batch, sizes: list[int]):
        """This node's part of each global mini-batch of the batch (empty once its examples are
        used up), with the global mini-batch's size: every node steps through as many as the
        node with the most examples."""
        m = self.config.minibatch_size
        n = len(batch) if batch is not None else 0
        for k in range(max(-(-s // m) for s in sizes)):
            total = sum(min(max(s - k * m, 0), m) for s in sizes)
            yield (batch.slice(k * m, min((k + 1) * m, n)) if k * m < n else self._empty), total

    def _straggle(self, clock: int) -> None:
        """``SyncStage(straggler_delay_s=...)``: the trainer of ``straggler_node`` sleeps before
        mini-batch ``clock`` for a seeded delay, ``delay * U(0, 2)`` with probability
        ``straggler_probability`` (the same delays in every mode, for experiments)."""
        sync = self.sync
        delay = getattr(sync, "straggler_delay_s", 0.0) if sync is not None else 0.0
        if not delay or self.node != sync.straggler_node:
            return
        rng = np.random.default_rng([sync.straggler_seed, self.node, clock])
        if rng.random() < sync.straggler_probability:
            time.sleep(delay * rng.uniform(0.0, 2.0))

    def _train_stale(self, batch, sizes: list[int]) -> list[torch.Tensor]:
        """SSP, A-BSP and ASP across nodes (:mod:`hpsray.cluster.consistency`): publish each
        mini-batch's update (A-BSP: each clock's ``k``), apply the others' as they arrive, wait
        only when beyond the slack: ``staleness`` for the embeddings, ``dense_staleness`` (when
        given) for the dense parameters."""
        self.dense.train(True)
        sync = self.sync
        mode = sync.consistency
        k = max(1, getattr(sync, "work_per_clock", 1)) if mode == "absp" else 1
        bound = sync.staleness if mode == "ssp" else (k - 1 if mode == "absp" else None)
        dense_bound = getattr(sync, "dense_staleness", None)
        hook = sync.before_minibatch  # an injection point for tests (a straggler); None otherwise
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
            if others["keys"].size:  # fetched updates reach the rows before this mini-batch reads them
                self.hbm.apply_gradients(others["keys"], others["grads"], self.optimizer, self.step, resident_only=True)
            self.max_staleness = max(self.max_staleness, clock - 1 - min(self._seen.values()))
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
        # the batch end is a barrier: every update of the batch reaches the rows before write-back
        rest = self._fetch(self.step, upto=self.step)
        if rest["keys"].size:
            self.hbm.apply_gradients(rest["keys"], rest["grads"], self.optimizer, self.step, resident_only=True)
        if rest["dense"] is not None:
            self._pending_dense = rest["dense"]
        if self.exchanged_bytes:
            self.exchanged_bytes[-1] += self.exchange.received_bytes - self._sent
            self._sent = self.exchange.received_bytes
        return losses

    def _no_update(self) -> dict:
        return {"keys": np.empty(0, np.uint64), "grads": np.empty((0, self.config.dim), np.float32), "dense": None}

    def _dense_with_slack(self, mine: np.ndarray, clock: int, slack: int) -> np.ndarray:
        """The dense gradient to step with at ``clock`` when the dense parameters have their own
        slack: this trainer's and the others' versions up to ``clock`` it has not used, after
        waiting for everyone's version ``clock - slack``, summed in (clock, rank) order. With
        slack 0 that is every trainer's gradient of ``clock`` in rank order: the same sum, so
        the same dense weights, on every node."""
        self.exchange.publish("dense", clock, (None, None, mine))
        got = self.exchange.fetch("dense", clock - slack, clock, self._seen_dense)
        for rank, c, _ in got:
            self._seen_dense[rank] = max(self._seen_dense[rank], c)
        parts = sorted([(self.node, clock, mine), *((r, c, p[2]) for r, c, p in got)], key=lambda u: (u[1], u[0]))
        total = parts[0][2].copy()
        for _, _, d in parts[1:]:
            total = total + d
        return total

    def _fetch(self, oldest: int, upto: int | None = None) -> dict:
        """The others' updates not applied yet (waiting for clock ``oldest``), combined."""
        got = self.exchange.fetch("all", oldest, upto, self._seen)
        keys, grads, dense = [np.empty(0, np.uint64)], [np.empty((0, self.config.dim), np.float32)], None
        if self._pending_dense is not None:
            dense, self._pending_dense = self._pending_dense, None
        for rank, clock, (k, g, d) in got:
            if k is not None and k.size:
                keys.append(k)
                grads.append(g)
            if d is not None:
                dense = d.copy() if dense is None else dense + d
            self._seen[rank] = max(self._seen[rank], clock)
        return {"keys": np.concatenate(keys), "grads": np.concatenate(grads), "dense": dense}

    @torch.no_grad()
    def predict(self, batch, keys: list, rows: list) -> np.ndarray:
        """Click probabilities of ``batch`` given, per owner node, refs of its keys and of their
        current rows."""
        import ray

        values = ray.get([*keys, *rows])
        keys, rows = np.concatenate(values[: len(keys)]), np.concatenate(values[len(keys) :])
        order = np.argsort(keys)
        keys, rows = keys[order], rows[order]
        model = self.dense.models[0]
        model.eval()
        out = []
        dim, dev = self.config.dim, self.device
        for mb in batch.minibatches(self.config.minibatch_size):
            layout = BagLayout.of(mb)
            emb = dev.tensor(np.ascontiguousarray(rows[np.searchsorted(keys, layout.unique_keys), :dim]))
            out.append(torch.sigmoid(model(pool_sum(emb, layout), dev.tensor(mb.dense))).cpu().numpy())
        return np.concatenate(out) if out else np.empty(0, np.float32)

    def dense_state(self) -> dict:
        """The dense model's parameters (replica 0; all replicas are equal)."""
        return {k: v.detach().cpu().clone() for k, v in self.dense.models[0].state_dict().items()}

    def save_state(self, path: str) -> int:
        """Write what continuing exactly needs to ``path`` (a checkpoint's file): the dense
        weights and optimizer state of every replica, the mini-batch step, the losses so far
        and torch's random state; returns the bytes written."""
        state = {
            "models": [m.state_dict() for m in self.dense.models],
            "optimizers": [o.state_dict() for o in self.dense.optimizers],
            "step": self.step,
            "examples": self.examples,
            "losses": dict(self.losses),
            "rng": torch.get_rng_state(),
        }
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        torch.save(state, path)
        return os.path.getsize(path)

    def reset(self, path: str) -> int:
        """Forget the working set and continue from :meth:`save_state`'s file (a recovery that
        keeps this process); returns the step restored."""
        c = self.config
        self.hbm = HbmPS(self._capacity, c.row_width, c.row_init(), self.hbm.n_devices, self.n_nodes, self.hbm.device)
        self._seen = dict.fromkeys(self._seen, 0)
        self._pending_dense = None
        return self.load_state(path)

    def load_state(self, path: str) -> int:
        """Continue from :meth:`save_state`'s file; returns the step restored."""
        state = torch.load(path, map_location=self.device.torch, weights_only=False)
        for model, saved in zip(self.dense.models, state["models"], strict=True):
            model.load_state_dict(saved)
        for optimizer, saved in zip(self.dense.optimizers, state["optimizers"], strict=True):
            optimizer.load_state_dict(saved)
        self.step, self.examples = int(state["step"]), int(state["examples"])
        self.losses = dict(state["losses"])
        torch.set_rng_state(state["rng"])
        return self.step

    def replicas_equal(self) -> bool:
        ref = self.dense.models[0].state_dict()
        return all(torch.equal(ref[k], m.state_dict()[k]) for m in self.dense.models[1:] for k in ref)

    def stats(self) -> dict:
        sent = self.exchanged_bytes
        return {
            **self.clock.snapshot(),
            "examples": self.examples,
            "steps": self.step,
            "losses": dict(self.losses),
            "exchanged_bytes_per_step": float(np.mean(sent)) if sent else 0.0,
            "max_staleness": self.max_staleness,
        }
