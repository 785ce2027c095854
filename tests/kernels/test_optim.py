"""Sparse-optimizer math: hand-computed values, and agreement with torch's optimizers."""

import math

import numpy as np
import pytest
import torch

from hpsray.kernels.optim import SGD, Adagrad, Adam, apply_to_rows, make_optimizer


def rows_of(w, state):
    return np.array([list(w) + list(state)], dtype=np.float32)


def step(opt, rows, g, t):
    apply_to_rows(rows, np.array([g], dtype=np.float32), opt, t)
    return rows


def test_sgd_by_hand():
    r = step(SGD(lr=0.1), rows_of([1.0, -1.0], []), [2.0, 0.5], 1)
    np.testing.assert_allclose(r, [[0.8, -1.05]], rtol=1e-6)


def test_adagrad_per_element_by_hand():
    opt = Adagrad(lr=0.1, eps=1e-8)
    r = step(opt, rows_of([1.0], [0.0]), [2.0], 1)
    np.testing.assert_allclose(r, [[0.9, 4.0]], rtol=1e-6)  # a = 4, w -= 0.1 * 2 / 2
    r = step(opt, r, [2.0], 2)
    np.testing.assert_allclose(r, [[0.9 - 0.2 / math.sqrt(8.0), 8.0]], rtol=1e-6)


def test_adagrad_per_row_by_hand():
    opt = Adagrad(lr=0.1, per_row=True)
    r = step(opt, rows_of([1.0, 1.0], [0.0]), [3.0, 4.0], 1)  # a = mean(9, 16) = 12.5
    s = 0.1 / math.sqrt(12.5)
    np.testing.assert_allclose(r, [[1 - 3 * s, 1 - 4 * s, 12.5]], rtol=1e-6)


def test_adam_by_hand():
    opt = Adam(lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8)
    r = step(opt, rows_of([1.0], [0.0, 0.0]), [2.0], 1)  # bias-corrected m/sqrt(v) = 1
    # 1 - beta2 is 0.00099998713 in float32, hence rtol 1e-4
    np.testing.assert_allclose(r, [[0.9, 0.2, 0.004]], rtol=1e-4)
    r = step(opt, r, [0.0], 2)
    m, v = 0.18, 0.003996
    w = 0.9 - 0.1 * (m / 0.19) / (math.sqrt(v / (1 - 0.999**2)) + 1e-8)
    np.testing.assert_allclose(r, [[w, m, v]], rtol=1e-4)


@pytest.mark.parametrize(
    "ours,theirs",
    [
        (SGD(lr=0.05), lambda p: torch.optim.SGD(p, lr=0.05)),
        (Adagrad(lr=0.05, eps=1e-10), lambda p: torch.optim.Adagrad(p, lr=0.05, eps=1e-10)),
        (Adam(lr=0.05), lambda p: torch.optim.Adam(p, lr=0.05, eps=1e-8)),
    ],
)
def test_matches_torch_when_every_row_is_touched(ours, theirs):
    rng = np.random.default_rng(0)
    dim, n = 4, 6
    w0 = rng.standard_normal((n, dim)).astype(np.float32)
    rows = np.zeros((n, dim + ours.state_width(dim)), np.float32)
    rows[:, :dim] = w0
    p = torch.nn.Parameter(torch.from_numpy(w0.copy()))
    topt = theirs([p])
    for t in range(1, 6):
        g = rng.standard_normal((n, dim)).astype(np.float32)
        apply_to_rows(rows, g, ours, t)
        p.grad = torch.from_numpy(g)
        topt.step()
    np.testing.assert_allclose(rows[:, :dim], p.detach().numpy(), rtol=1e-5, atol=1e-6)


def test_bad_optimizer_settings_are_named():
    with pytest.raises(ValueError, match="lr must be a positive number"):
        SGD(lr=0)
    with pytest.raises(ValueError, match="beta1, beta2"):
        Adam(beta1=1.0)
    with pytest.raises(ValueError, match="unknown sparse optimizer 'rmsprop'"):
        make_optimizer("rmsprop")
    with pytest.raises(ValueError, match="needs width 5"):
        apply_to_rows(np.zeros((1, 4), np.float32), np.zeros((1, 4), np.float32), Adagrad(per_row=True), 1)
