"""The reference trainer (the oracle), its model, metrics and the planted synthetic data."""

import os

import numpy as np
import pytest
import torch

from hpsray.config import TrainConfig
from hpsray.data import Batch, PlantedCTR
from hpsray.kernels.init import initial_rows
from hpsray.models import DNN, BagLayout, auc, logloss, pool_sum
from hpsray.models.kinds import build_model
from hpsray.reference import ReferenceTrainer

SMALL = dict(hidden=(32, 16), minibatch_size=256)


def test_auc_matches_pairwise_definition_with_ties():
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 300)
    s = rng.integers(0, 20, 300).astype(float)  # many ties
    pos, neg = s[y == 1], s[y == 0]
    wins = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    pairwise = wins / (pos.size * neg.size)
    assert auc(y, s) == pytest.approx(pairwise)
    assert np.isnan(auc(np.ones(5), np.arange(5)))


def test_logloss_by_hand():
    assert logloss([1, 0], [0.8, 0.4]) == pytest.approx(-(np.log(0.8) + np.log(0.6)) / 2)


def test_planted_stream_does_not_depend_on_batch_size():
    g = PlantedCTR(n_slots=4, keys_per_slot=100, n_dense=2, seed=3)
    whole = g.generate(10_000)
    pieces = Batch.concat(list(g.batches(10_000, 777)))
    for f in ("labels", "dense", "keys", "offsets", "slots"):
        np.testing.assert_array_equal(getattr(whole, f), getattr(pieces, f))
    assert 0.05 < whole.labels.mean() < 0.95


def test_equal_raw_values_in_different_slots_give_different_keys():
    g = PlantedCTR(n_slots=3, keys_per_slot=5, n_dense=0, seed=0)
    b = g.generate(2000)
    by_slot = [set(b.keys[b.slots == s].tolist()) for s in range(3)]
    assert all(len(k) == 5 for k in by_slot)
    assert not (by_slot[0] & by_slot[1]) and not (by_slot[1] & by_slot[2])


def test_batch_validation_names_the_field():
    with pytest.raises(ValueError, match="Batch.keys: expected uint64"):
        Batch(
            np.zeros(1, np.float32),
            np.zeros((1, 0), np.float32),
            np.zeros(1, np.int64),
            np.array([0, 1], np.int64),
            np.zeros(1, np.int32),
            1,
        )
    with pytest.raises(ValueError, match="Batch.slots: slot ids must lie in"):
        Batch(
            np.zeros(1, np.float32),
            np.zeros((1, 0), np.float32),
            np.zeros(1, np.uint64),
            np.array([0, 1], np.int64),
            np.array([3], np.int32),
            2,
        )


def test_pooling_sums_each_example_slot_bag_even_out_of_order():
    # example 0: slot 1 key 10, slot 0 keys 11 and 10; example 1: nothing in slot 0
    b = Batch(
        np.zeros(2, np.float32),
        np.zeros((2, 0), np.float32),
        np.array([10, 11, 10, 12], np.uint64),
        np.array([0, 3, 4], np.int64),
        np.array([1, 0, 0, 1], np.int32),
        2,
    )
    layout = BagLayout.of(b)
    rows = torch.tensor([[1.0, 2.0], [10.0, 20.0], [100.0, 200.0]])  # keys 10, 11, 12
    pooled = pool_sum(rows, layout)
    np.testing.assert_array_equal(pooled.numpy(), [[[11, 22], [1, 2]], [[0, 0], [100, 200]]])


def test_dnn_is_seeded_and_checks_its_shape():
    a, b = DNN(3, 4, 2, (8,), seed=1), DNN(3, 4, 2, (8,), seed=1)
    torch.manual_seed(123)  # the global RNG must not matter
    c = DNN(3, 4, 2, (8,), seed=1)
    for pa, pb, pc in zip(a.parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb) and torch.equal(pa, pc)
    assert a(torch.zeros(5, 3, 4), torch.zeros(5, 2)).shape == (5,)
    with pytest.raises(ValueError, match="hidden widths >= 1"):
        DNN(3, 4, 2, (0,))


def test_one_sgd_step_equals_plain_pytorch_embedding_bag():
    g = PlantedCTR(n_slots=3, keys_per_slot=50, nnz_per_slot=2, n_dense=2, seed=5)
    mb = g.generate(64)
    cfg = TrainConfig(dim=4, hidden=(8,), sparse_optimizer="sgd", sparse_lr=0.5, minibatch_size=64, init_scale=0.1)
    ref = ReferenceTrainer(3, 2, cfg)
    ref.train_batch(mb)
    # independent computation: nn.EmbeddingBag over a dense table of this batch's keys
    uniq = np.unique(mb.keys)
    table = torch.nn.EmbeddingBag(uniq.size, 4, mode="sum")
    with torch.no_grad():
        table.weight.copy_(torch.from_numpy(initial_rows(uniq, 4, cfg.row_init())))
    model = DNN(3, 4, 2, (8,), seed=cfg.seed)
    order = np.argsort(mb.bag_index(), kind="stable")
    idx = torch.from_numpy(np.searchsorted(uniq, mb.keys[order]))
    counts = np.bincount(mb.bag_index(), minlength=64 * 3)
    offsets = torch.from_numpy(np.r_[0, np.cumsum(counts)[:-1]])
    logits = model(table(idx, offsets).view(64, 3, 4), torch.from_numpy(mb.dense))
    torch.nn.functional.binary_cross_entropy_with_logits(logits, torch.from_numpy(mb.labels)).backward()
    expected = table.weight.detach().numpy() - 0.5 * table.weight.grad.numpy()
    keys, rows, _ = ref.export()
    np.testing.assert_array_equal(keys, uniq)
    np.testing.assert_allclose(rows, expected, rtol=1e-5, atol=1e-7)


def test_training_is_deterministic_for_a_seed():
    g = PlantedCTR(n_slots=4, keys_per_slot=300, n_dense=3, seed=2)
    runs = []
    for _ in range(2):
        t = ReferenceTrainer(4, 3, TrainConfig(**SMALL, sparse_optimizer="adam", sparse_lr=0.01))
        t.fit(g.batches(3000, 1000))
        runs.append(t.export())
    np.testing.assert_array_equal(runs[0][0], runs[1][0])
    np.testing.assert_array_equal(runs[0][1], runs[1][1])
    for k in runs[0][2]:
        assert torch.equal(runs[0][2][k], runs[1][2][k])


def test_reference_learns_the_planted_model():
    g = PlantedCTR(n_slots=8, keys_per_slot=2000, n_dense=4, seed=7)
    t = ReferenceTrainer(8, 4, TrainConfig(hidden=(64, 32), minibatch_size=512))
    t.fit(g.batches(100_000, 10_000))
    held_out = g.generate(20_000, start_row=10**7)
    result = t.evaluate([held_out])
    bayes = auc(held_out.labels, g.true_logits(held_out))
    assert result.auc >= 0.75, result
    assert result.auc <= bayes + 0.01  # cannot beat the planted model
    assert result.logloss < logloss(held_out.labels, np.full(len(held_out), held_out.labels.mean())) - 0.05


def test_trainer_refuses_a_batch_of_another_shape():
    t = ReferenceTrainer(4, 3, TrainConfig(**SMALL))
    with pytest.raises(ValueError, match="built for 4 and 3"):
        t.train_batch(PlantedCTR(n_slots=5, n_dense=3).generate(10))


def _hpsray_imports_of(module: str) -> set[str]:
    """Every hpsray module ``module`` imports, transitively: any import statement anywhere in a
    file (inside functions and ``TYPE_CHECKING`` blocks too), and each imported module's parent
    packages (their ``__init__`` runs first)."""
    import ast
    from pathlib import Path

    import hpsray

    root = Path(hpsray.__file__).parent.parent

    def path_of(name: str) -> Path | None:
        base = root.joinpath(*name.split("."))
        for p in (base.with_suffix(".py"), base / "__init__.py"):
            if p.is_file():
                return p
        return None

    seen: set[str] = set()
    todo = [module]
    while todo:
        name = todo.pop()
        if name in seen or path_of(name) is None:
            continue
        seen.add(name)
        path = path_of(name)
        assert path is not None
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                todo += [a.name for a in node.names if a.name.split(".")[0] == "hpsray"]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if target.split(".")[0] == "hpsray":
                    todo.append(target)
                    todo += [f"{target}.{a.name}" for a in node.names]  # a submodule, when it is one
    return seen


def test_the_reference_imports_nothing_of_the_system_under_test():
    """The oracle stands apart (issue 26): no module it reaches imports hpsray.tiers, .actors
    or .pipelines, so a bug there shows as a difference instead of in both."""
    reached = _hpsray_imports_of("hpsray.reference")
    assert "hpsray.models.step" in reached and "hpsray.kernels.optim" in reached  # the walk follows imports
    system = sorted(m for m in reached if m.split(".")[:2][-1] in ("tiers", "actors", "pipelines"))
    assert not system, f"hpsray.reference reaches {system}"


def test_the_import_walk_sees_a_system_module_where_there_is_one():
    assert "hpsray.tiers.admission" in _hpsray_imports_of("hpsray.actors.memps")


@pytest.mark.parametrize("admit_after, expire", [(2, 3), (3, None), (0, 1), (4, 2)])
def test_the_references_own_admission_rule_decides_as_the_owners_table(admit_after, expire):
    """Two statements of one rule (the reference's SeenCounts, the owners' Admission) agree
    on every decision and count over a random stream of batches."""
    from hpsray.reference import SeenCounts
    from hpsray.tiers.admission import Admission

    rng = np.random.default_rng(admit_after)
    owner, ref = Admission(admit_after, expire, capacity=16), SeenCounts(admit_after, expire)
    for b in range(40):
        keys = np.unique(rng.integers(0, 300, rng.integers(0, 80)).astype(np.uint64))
        np.testing.assert_array_equal(ref.see(b, keys), owner.see(b, keys))
        np.testing.assert_array_equal(ref.expire(b), owner.expire(b))
    assert ref.stats == owner.stats and ref.stats["admitted"] > 0
    with pytest.raises(ValueError, match="admit_after"):
        SeenCounts(-1)


class _ThreadsSeen(torch.nn.Module):
    """``config``'s model, noting torch's intra-op thread count at every forward."""

    def __init__(self, config: TrainConfig, n_slots: int, n_dense: int) -> None:
        super().__init__()
        self.inner = build_model(config, n_slots, n_dense)
        self.seen: set[int] = set()

    def forward(self, pooled: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        self.seen.add(torch.get_num_threads())
        return self.inner(pooled, dense)


def _fit(threads: int | None) -> tuple[np.ndarray, np.ndarray, dict, set[int]]:
    gen = PlantedCTR(n_slots=4, keys_per_slot=2000, n_dense=2, seed=3)
    cfg = TrainConfig(dim=8, hidden=(8,), minibatch_size=1000)
    model = _ThreadsSeen(cfg, gen.n_slots, gen.n_dense)
    ref = ReferenceTrainer(gen.n_slots, gen.n_dense, cfg, model, threads=threads)
    ref.fit(gen.batches(6000, 2000))
    return (*ref.export(), model.seen)


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two cores")
def test_the_reference_trains_with_its_own_threads_whatever_the_caller_set():
    """The pipeline's trainer uses the machine's cores; the reference trains with as many
    whatever this process set (a test before it set 1, and CI's bigger-than-memory run differed
    in 20 rows), and leaves the caller's setting as it was. Where the BLAS sums a dense weight's
    gradient in chunks per thread, one thread trains other bits (so it did where this guard was
    written); whether it does is the BLAS's and the CPU's (MKL on an AMD EPYC, 2026-12-02: the
    same bits at 1 and 2 threads), so the guard is the thread count the model's forward sees."""
    cores = os.cpu_count() or 1
    caller = torch.get_num_threads()
    _, rows, dense, seen = _fit(None)
    torch.set_num_threads(1)
    try:
        _, rows_caller_1, dense_caller_1, seen_caller_1 = _fit(None)
        assert torch.get_num_threads() == 1  # restored
        _, _, _, seen_1 = _fit(1)
    finally:
        torch.set_num_threads(caller)
    assert seen == seen_caller_1 == {cores}  # its own count, whatever the caller set
    assert seen_1 == {1}
    assert np.array_equal(rows, rows_caller_1)
    assert all(torch.equal(dense[k], v) for k, v in dense_caller_1.items())
