"""Shared fixtures of the serving tests: one small trained model (the reference trainer) exported
under the two schemas its data can be read with, and raw examples for it."""

from __future__ import annotations

import numpy as np
import pytest

N_SLOTS, N_DENSE = 6, 3
NNZ = (1, 1, 2, 1, 3, 1)  # slots 2 and 4 multi-hot


@pytest.fixture(scope="session")
def planted():
    from hpsray.data import PlantedCTR

    return PlantedCTR(n_slots=N_SLOTS, keys_per_slot=3000, n_dense=N_DENSE, nnz_per_slot=NNZ, seed=0)


@pytest.fixture(scope="session")
def trained(planted):
    """A reference trainer fitted on 20k planted examples (the oracle of the predictions)."""
    from hpsray.config import TrainConfig
    from hpsray.reference import ReferenceTrainer

    config = TrainConfig(
        dim=8, hidden=(32, 16), sparse_optimizer="adagrad", sparse_lr=0.05, minibatch_size=500, seed=3, init_scale=0.02
    )
    trainer = ReferenceTrainer(N_SLOTS, N_DENSE, config)
    trainer.fit(planted.batches(20_000, 5_000))
    return trainer


@pytest.fixture(scope="session")
def retrained(planted, trained):
    """``trained`` trained further on 6k more examples: rows changed, keys added, dense moved
    (the state an incremental export of the same job writes as a delta)."""
    import copy

    t = copy.deepcopy(trained)
    t.fit(planted.batches(6_000, 3_000, start_row=40_000))
    return t


@pytest.fixture(scope="session")
def exports(tmp_path_factory, planted, trained):
    """``{"parquet": DIR, "criteo": DIR}``: the model exported with each schema of its data."""
    from hpsray.data.generate import dataset_schema
    from hpsray.export import export

    root = tmp_path_factory.mktemp("exports")
    out = {}
    for fmt in ("parquet", "criteo"):
        out[fmt] = str(root / fmt)
        export(
            trained.export(),
            out[fmt],
            trained.config,
            n_slots=N_SLOTS,
            n_dense=N_DENSE,
            schema=dataset_schema(planted, fmt),
            rows_per_file=4000,
        )
    return out


def raw_examples(planted, n: int, start_block: int = 100_000, fmt: str = "parquet"):
    """``(batch, examples)``: ``n`` unseen examples as a Batch and as the JSON a client sends."""
    from hpsray.data.generate import _table

    batch, ranks = planted.raw_block(start_block)
    batch = batch.slice(0, n)
    table = _table(planted, batch, ranks[: batch.nnz], fmt).drop(["label"])
    examples = table.to_pylist()
    if fmt == "criteo":  # headerless Criteo columns are c0 (label), c1.. (dense), then categorical
        names = [f"c{i}" for i in range(1, 1 + N_DENSE + N_SLOTS)]
        examples = [dict(zip(names, ex.values())) for ex in examples]
    return batch, examples


@pytest.fixture(scope="session")
def examples(planted):
    return raw_examples(planted, 400)


def close(a, b) -> bool:
    return np.allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=1e-5, atol=1e-6)
