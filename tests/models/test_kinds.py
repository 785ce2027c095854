"""The model kinds: their published formulas, seeded weights and checked settings."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from hpsray.errors import ConfigError
from hpsray.first_order import FIRST_ORDER_KINDS
from hpsray.models.kinds import MODEL_KINDS, ModelSpec

B, S, DIM, DENSE = 6, 4, 8, 3


def _inputs(n_dense: int = DENSE) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(B, S, DIM, generator=g), torch.randn(B, n_dense, generator=g)


def _build(kind: str, n_dense: int = DENSE, seed: int = 0, settings: dict | None = None):
    """``kind``'s model over ``S`` slots of ``DIM`` (and, for the kinds of first-order rows, the
    ``S`` first-order slots after them), and a way to make its input from ``_inputs``'s."""
    spec = ModelSpec(kind, settings or {})
    if kind not in FIRST_ORDER_KINDS:
        return spec.build(S, DIM, n_dense, seed=seed), lambda pooled: pooled
    w = torch.randn(B, S, generator=torch.Generator().manual_seed(2))  # each slot's sum of first-order weights
    m = spec.build(2 * S, DIM, n_dense, seed=seed, slot_dims=(DIM,) * S + (1,) * S, first_order=S)
    return m, lambda pooled: torch.cat([pooled.reshape(B, -1), w], 1)


@pytest.mark.parametrize("kind", MODEL_KINDS)
@pytest.mark.parametrize("n_dense", [DENSE, 0])
def test_each_kind_gives_one_logit_per_example_from_its_seed_alone(kind, n_dense):
    pooled, dense = _inputs(n_dense)
    torch.manual_seed(123)  # the global RNG must not matter
    a, x = _build(kind, n_dense, seed=7)
    torch.manual_seed(456)
    b, _ = _build(kind, n_dense, seed=7)
    c, _ = _build(kind, n_dense, seed=8)
    pooled = x(pooled)
    out = a(pooled, dense)
    assert out.shape == (B,)
    assert torch.equal(out, b(pooled, dense))
    assert not torch.equal(out, c(pooled, dense))
    out.sum().backward()  # every parameter takes part
    assert all(p.grad is not None for p in a.parameters())


def test_dlrm_is_the_top_mlp_over_the_dense_embedding_and_its_pairwise_dots():
    pooled, dense = _inputs()
    m = ModelSpec("dlrm", {"bottom": [5], "top": [4]}).build(S, DIM, DENSE, seed=0)
    d = m.bottom(dense)
    assert d.shape == (B, DIM)
    feats = [d, *pooled.unbind(1)]
    dots = [(feats[i] * feats[j]).sum(1) for i, j in itertools.combinations(range(S + 1), 2)]
    expected = m.top(torch.cat([d, torch.stack(dots, 1)], 1)).squeeze(1)
    torch.testing.assert_close(m(pooled, dense), expected)


def test_dcn_cross_layers_follow_x0_times_wx_plus_b_plus_x_with_low_rank_and_both_structures():
    pooled, dense = _inputs()
    for structure in ("stacked", "parallel"):
        m = ModelSpec("dcn", {"cross_layers": 2, "low_rank": 3, "structure": structure, "hidden": [5]}).build(
            S, DIM, DENSE, seed=0
        )
        x0 = torch.cat([pooled.reshape(B, -1), dense], 1)
        x = x0
        for layer in m.cross:
            v, u = layer.w[0], layer.w[1]
            assert v.weight.shape == (3, x0.shape[1])  # rank 3
            x = x0 * (x @ v.weight.T @ u.weight.T + u.bias) + x
        out = m.deep(x) if structure == "stacked" else torch.cat([x, m.deep(x0)], 1)
        torch.testing.assert_close(m(pooled, dense), m.head(out).squeeze(1))
    full = ModelSpec("dcn", {"cross_layers": 1}).build(S, DIM, DENSE, seed=0)
    assert full.cross[0].w.weight.shape == (S * DIM + DENSE,) * 2


@pytest.mark.parametrize("kind", FIRST_ORDER_KINDS)
def test_deepfm_and_wide_deep_take_the_first_order_weights_from_their_own_slots(kind):
    v, dense = _inputs()
    m, x = _build(kind, settings={"hidden": [5]})
    pooled = x(v)
    w = pooled[:, S * DIM :]  # the first-order slots: each a width-1 row's pooled sum
    expected = m.linear(dense).squeeze(1) + w.sum(1) + m.deep(torch.cat([v.reshape(B, -1), dense], 1)).squeeze(1)
    if kind == "deepfm":
        pairs = itertools.combinations(range(S), 2)
        expected = expected + sum((v[:, i] * v[:, j]).sum(1) for i, j in pairs)
    torch.testing.assert_close(m(pooled, dense), expected)
    assert m.deep[0].in_features == S * DIM + DENSE  # every embedding float is a factor: none is w_i


@pytest.mark.parametrize(
    ("kind", "settings", "message"),
    [
        ("dlrn", {}, "unknown kind 'dlrn' (did you mean 'dlrm'?)"),
        ("dlrm", {"botom": [4]}, "model.botom: not a setting of kind 'dlrm' (did you mean 'bottom'?)"),
        ("dcn", {"structure": "side"}, 'model.structure: must be "stacked" or "parallel"'),
        ("dcn", {"low_rank": 0}, "model.low_rank: must be an integer >= 1"),
        ("mlp", {"hidden": [64, 0]}, "model.hidden: must be a list of integers >= 1"),
        ("deepfm", {"hidden": "64"}, "model.hidden: must be a list of integers >= 1"),
    ],
)
def test_a_bad_setting_is_a_config_error_naming_it(kind, settings, message):
    with pytest.raises(ConfigError) as e:
        ModelSpec(kind, settings)
    assert message in str(e.value)


def test_deepfm_needs_first_order_slots_and_the_others_take_none():
    with pytest.raises(ConfigError, match="'deepfm' takes 0 first-order slots"):
        ModelSpec("deepfm").build(S, DIM, DENSE, seed=0)
    with pytest.raises(ConfigError, match="'mlp' takes 2 first-order slots"):
        ModelSpec("mlp").build(S, DIM, DENSE, seed=0, first_order=2)
    with pytest.raises(ValueError, match="slot_dims must be 2 x 8 then 2 x 1"):
        ModelSpec("wide_deep").build(S, DIM, DENSE, seed=0, slot_dims=(DIM,) * S, first_order=2)


def test_the_recorded_spec_builds_the_same_model():
    spec = ModelSpec("dcn", {"low_rank": 2, "hidden": [8, 4]})
    again = ModelSpec.from_dict(spec.to_dict())
    assert again == spec
    assert spec.to_dict() == {"kind": "dcn", "cross_layers": 3, "low_rank": 2, "structure": "stacked", "hidden": [8, 4]}


def test_the_default_kind_is_the_papers_mlp_with_the_same_weights():
    from hpsray.models.dnn import DNN

    pooled, dense = _inputs()
    spec = ModelSpec("mlp", {"hidden": [16, 8]})
    torch.testing.assert_close(
        spec.build(S, DIM, DENSE, seed=3)(pooled, dense),
        DNN(S, DIM, DENSE, (16, 8), seed=3)(pooled, dense),
        atol=0,
        rtol=0,
    )


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_each_kind_states_its_input_shape(kind):
    m, _ = _build(kind)
    slots = 2 * S if kind in FIRST_ORDER_KINDS else S
    assert (m.n_slots, m.dim, m.n_dense) == (slots, DIM, DENSE)  # serving checks requests against these


EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "models"


@pytest.mark.parametrize("kind", [k for k in MODEL_KINDS if k != "mlp"])
def test_each_kind_has_an_example_job_that_names_it(kind):
    from hpsray.job import JobConfig

    job = JobConfig.load(EXAMPLES / f"{kind}.toml")
    assert job.train_config().model_kind == kind
    ModelSpec(kind, job.train_config().model_settings)  # its settings are the kind's


def test_a_job_files_model_mistake_names_the_file_and_the_key(tmp_path):
    from hpsray.job import JobConfig

    path = tmp_path / "job.toml"
    path.write_text('[data.synthetic]\nrows = 100\n[model]\nkind = "dlrm"\nbotom = [8]\n')
    with pytest.raises(ConfigError) as e:
        JobConfig.load(path)
    assert str(e.value).startswith(f"{path}: model.botom: unknown key (did you mean 'bottom'?")
    path.write_text('[data.synthetic]\nrows = 100\n[model]\nkind = "dcn"\nstructure = "side"\n')
    with pytest.raises(ConfigError, match=f'{path}: model.structure: must be "stacked" or "parallel"'):
        JobConfig.load(path)
