"""TorchRec peer of ``hpsray bench peers``: runs in benchmarks/.torchrec-venv (torchrec_env.sh).

    benchmarks/.torchrec-venv/bin/python benchmarks/torchrec_peer.py SPEC.json

``SPEC.json`` is a :class:`hpsray.bench.baselines.PeerSpec`; the examples are the ``.npy`` files
that ``hpsray bench peers`` stored under its ``data_dir``. The model is the spec's kind over an
``EmbeddingBagCollection`` with one table per slot — for ``dlrm`` TorchRec's own
``torchrec.models.dlrm.DLRM``, started from the weights of hpsray's DLRM (same layers, same
order), for the other kinds hpsray's module — (``keys_per_slot`` rows, sum pooling; a
multi-hot slot pools its keys), sharded table-wise by ``DistributedModelParallel`` (world size 1,
gloo, CPU) with the fused FBGEMM kernel and its in-backward optimizer: ``EXACT_ADAGRAD`` (the
other systems' per-element Adagrad) or ``EXACT_ROWWISE_ADAGRAD``. Rows start from hpsray's per-key
initial values; the dense optimizer is TrainConfig's. The figures go to ``spec.result_path``
(JSON) and to stdout.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # hpsray, when not installed here

import numpy as np
import torch
import torch.distributed as dist

from hpsray.bench.baselines import PeerSpec, Vocabulary, load_examples, peer_result, split, write_result
from hpsray.models.dnn import make_dense_optimizer
from hpsray.models.kinds import ModelSpec, build_model


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_process_group() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    os.environ.setdefault("LOCAL_WORLD_SIZE", "1")
    dist.init_process_group("gloo", rank=0, world_size=1)


class MiniBatch:
    """A mini-batch as TorchRec input: per-slot ids (feature-major jagged) plus dense and labels."""

    def __init__(self, batch, vocab: Vocabulary, features: list[str]) -> None:
        from torchrec import KeyedJaggedTensor

        b, s = len(batch), batch.n_slots
        rows = vocab.index(batch.keys)
        slot = batch.slots.astype(np.int64)
        example = batch.example_of_key()
        # TorchRec wants every feature's values together: sort keys by (slot, example)
        order = np.lexsort((example, slot))
        ids = rows[order] - slot[order] * vocab.keys_per_slot  # rank within the slot's table
        lengths = np.bincount(slot * b + example, minlength=s * b)
        self.kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=features, values=torch.from_numpy(ids), lengths=torch.from_numpy(lengths.astype(np.int64))
        )
        self.dense = torch.from_numpy(np.array(batch.dense, dtype=np.float32))
        self.labels = torch.from_numpy(np.array(batch.labels, dtype=np.float32))

    def __len__(self) -> int:
        return int(self.labels.shape[0])


def _ebc(spec: PeerSpec, features: list[str], device: torch.device):
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType

    tables = [
        EmbeddingBagConfig(
            name=f"table{s}",
            embedding_dim=spec.dim,
            num_embeddings=spec.keys_per_slot,
            feature_names=[features[s]],
            pooling=PoolingType.SUM,
        )
        for s in range(spec.n_slots)
    ]
    return EmbeddingBagCollection(tables=tables, device=device)


class TorchRecDLRM(torch.nn.Module):
    """TorchRec's ``DLRM`` (dense arch, interaction arch, over arch) over an
    ``EmbeddingBagCollection``, its linear layers copied from hpsray's seeded DLRM."""

    def __init__(self, spec: PeerSpec, device: torch.device) -> None:
        from torchrec.models.dlrm import DLRM

        super().__init__()
        self.features = [f"slot{s}" for s in range(spec.n_slots)]
        settings = ModelSpec.from_dict(spec.model).settings
        self.dlrm = DLRM(
            embedding_bag_collection=_ebc(spec, self.features, device),
            dense_in_features=spec.n_dense,
            dense_arch_layer_sizes=[*settings["bottom"], spec.dim],
            over_arch_layer_sizes=[*settings["top"], 1],
        )
        ours = build_model(spec.train_config(), spec.n_slots, spec.n_dense)
        mine = [m for m in ours.modules() if isinstance(m, torch.nn.Linear)]
        theirs = [
            m
            for arch in (self.dlrm.dense_arch, self.dlrm.over_arch)
            for m in arch.modules()
            if isinstance(m, torch.nn.Linear)
        ]
        if [m.weight.shape for m in mine] != [m.weight.shape for m in theirs]:
            raise RuntimeError("TorchRec's DLRM and hpsray's have different layers")
        with torch.no_grad():
            for a, b in zip(mine, theirs):
                b.weight.copy_(a.weight)
                b.bias.copy_(a.bias)

    @property
    def ebc(self):
        return self.dlrm.sparse_arch.embedding_bag_collection

    def forward(self, kjt, dense: torch.Tensor) -> torch.Tensor:
        return self.dlrm(dense, kjt).squeeze(1)


class TorchRecCTR(torch.nn.Module):
    """``EmbeddingBagCollection`` (one table per slot) under hpsray's model of the spec's kind."""

    def __init__(self, spec: PeerSpec, device: torch.device) -> None:
        super().__init__()
        self.n_slots, self.dim = spec.n_slots, spec.dim
        self.features = [f"slot{s}" for s in range(spec.n_slots)]
        self.ebc = _ebc(spec, self.features, device)
        self.dnn = build_model(spec.train_config(), spec.n_slots, spec.n_dense)

    def forward(self, kjt, dense: torch.Tensor) -> torch.Tensor:
        pooled = self.ebc(kjt).values()  # [B, n_slots * dim], features in table order
        return self.dnn(pooled.view(-1, self.n_slots, self.dim), dense)


def build(spec: PeerSpec, weights: np.ndarray):
    """The model sharded by DistributedModelParallel, fused optimizer applied in backward."""
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    cfg = spec.train_config()
    opt = cfg.optimizer()
    if cfg.sparse_optimizer != "adagrad":
        raise ValueError(f"the TorchRec peer runs Adagrad only, not {cfg.sparse_optimizer!r}")
    kind = spec.model.get("kind", "mlp")
    model = (TorchRecDLRM if kind == "dlrm" else TorchRecCTR)(spec, torch.device("meta"))
    optim_cls = torch.optim.Adagrad if spec.torchrec_optimizer == "exact_adagrad" else RowWiseAdagrad
    apply_optimizer_in_backward(optim_cls, model.ebc.parameters(), {"lr": opt.lr, "eps": opt.eps})
    constraints = {
        f"table{s}": ParameterConstraints(sharding_types=["table_wise"], compute_kernels=["fused"])
        for s in range(spec.n_slots)
    }
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=1, compute_device="cpu"), constraints=constraints)
    plan = planner.collective_plan(model, [EmbeddingBagCollectionSharder()], dist.GroupMember.WORLD)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan)
    # same initial rows as hpsray: copy them into the (single, local) shard of each table
    state = dmp.state_dict()
    k = spec.keys_per_slot
    with torch.no_grad():
        for s in range(spec.n_slots):
            t = state[_table_key(state, s)]
            local = t.local_shards()[0].tensor if hasattr(t, "local_shards") else t
            local.copy_(torch.from_numpy(weights[s * k : (s + 1) * k]))
    dense_params = [p for n, p in dmp.named_parameters() if "embedding_bags" not in n]
    dense_opt = make_dense_optimizer(cfg.dense_optimizer, dense_params, cfg.dense_lr)
    return dmp, dense_opt, plan


def _table_key(state: dict, s: int) -> str:
    """The state key of table ``s``'s weights (``ebc.…``, or under TorchRec's DLRM ``….sparse_arch.…``)."""
    keys = [k for k in state if k.endswith(f"embedding_bags.table{s}.weight")]
    if len(keys) != 1:
        raise RuntimeError(f"table{s}: expected one weight in the model's state, found {keys}")
    return keys[0]


def _check_initial_rows(dmp, spec: PeerSpec, weights: np.ndarray) -> None:
    """The copy above must have reached the fused kernel's weights."""
    state = dmp.state_dict()
    t = state[_table_key(state, 0)]
    local = t.local_shards()[0].tensor if hasattr(t, "local_shards") else t
    if not np.allclose(local.detach().numpy()[:8], weights[:8]):
        raise RuntimeError("initial rows did not reach TorchRec's fused tables")


def run_peer(spec: PeerSpec) -> dict:
    """Train and evaluate the TorchRec peer; returns its figures."""
    import torchrec

    torch.set_num_threads(spec.threads or os.cpu_count() or 1)
    _init_process_group()
    t_prep = time.perf_counter()
    vocab = Vocabulary(spec.n_slots, spec.keys_per_slot)
    weights = vocab.initial_weights(spec)
    dmp, dense_opt, plan = build(spec, weights)
    _check_initial_rows(dmp, spec, weights)
    del weights
    features = [f"slot{s}" for s in range(spec.n_slots)]
    train = load_examples(spec, "train")

    def minibatches(examples, start: int, stop: int) -> list[MiniBatch]:
        return [
            MiniBatch(mb, vocab, features)
            for big in split(examples, spec.batch, start, stop)
            for mb in big.minibatches(spec.minibatch)
        ]

    warmup = minibatches(train, 0, spec.warmup_rows)
    measured = minibatches(train, spec.warmup_rows, spec.warmup_rows + spec.rows)
    held_out = [MiniBatch(mb, vocab, features) for mb in load_examples(spec, "eval").minibatches(spec.minibatch)]
    del train
    prep_s = time.perf_counter() - t_prep

    def fit(mbs: list[MiniBatch]) -> int:
        dmp.train()
        n = 0
        for mb in mbs:
            logits = dmp(mb.kjt, mb.dense)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, mb.labels)
            dense_opt.zero_grad(set_to_none=True)
            loss.backward()  # the fused optimizer updates the embedding rows here
            dense_opt.step()
            n += len(mb)
        return n

    fit(warmup)
    t0 = time.perf_counter()
    examples = fit(measured)
    train_s = time.perf_counter() - t0

    dmp.eval()
    with torch.no_grad():
        p = np.concatenate([torch.sigmoid(dmp(mb.kjt, mb.dense)).numpy() for mb in held_out])
    y = np.concatenate([mb.labels.numpy() for mb in held_out])
    result = {
        **peer_result(examples, train_s, y, p, prep_s, len(vocab)),
        "optimizer": f"fused FBGEMM {spec.torchrec_optimizer}",
        "sharding": "table_wise, fused kernel, DistributedModelParallel world size 1 (gloo)",
        "torch": torch.__version__,
        "torchrec": getattr(torchrec, "__version__", "?"),
        "threads": torch.get_num_threads(),
    }
    if os.environ.get("HPSRAY_TORCHREC_EXPORT"):  # tests: the trained parameters
        state = dmp.state_dict()
        tables = []
        for s in range(spec.n_slots):
            t = state[_table_key(state, s)]
            tables.append((t.local_shards()[0].tensor if hasattr(t, "local_shards") else t).detach().numpy())
        np.save(os.environ["HPSRAY_TORCHREC_EXPORT"], np.concatenate(tables))
    dist.destroy_process_group()
    return result


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    spec = PeerSpec.from_json(Path(argv[1]).read_text())
    result = run_peer(spec)
    write_result(spec, result)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
