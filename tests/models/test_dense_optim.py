"""The dense optimizers step bit for bit as torch's (multi-tensor) Adam, Adagrad and SGD, save
and restore their state in torch's layout, and never import TorchDynamo."""

import subprocess
import sys

import pytest
import torch

from hpsray.models import DNN, make_dense_optimizer

TORCH = {
    "adam": lambda p, lr: torch.optim.Adam(p, lr=lr, foreach=True),
    "adagrad": lambda p, lr: torch.optim.Adagrad(p, lr=lr, foreach=True),
    "sgd": lambda p, lr: torch.optim.SGD(p, lr=lr, foreach=True),
}


def _grads(model: torch.nn.Module, step: int, skip_last: bool) -> None:
    gen = torch.Generator().manual_seed(step)
    params = list(model.parameters())
    for i, p in enumerate(params):
        # the last parameter has no gradient on odd steps: it must not move (nor its state)
        p.grad = None if skip_last and i == len(params) - 1 and step % 2 else torch.randn(p.shape, generator=gen)


def _train(opt_of, name: str, steps: int, state=None):
    model = DNN(3, 4, 2, hidden=(8, 5), seed=1)
    opt = opt_of(name, model.parameters())
    if state is not None:
        opt.load_state_dict(state)
    for t in range(steps):
        _grads(model, t, skip_last=True)
        opt.step()
    return model, opt


def ours(name, params):
    return make_dense_optimizer(name, params, 0.01)


def theirs(name, params):
    return TORCH[name](params, 0.01)


@pytest.mark.parametrize("name", ["adam", "adagrad", "sgd"])
def test_each_step_is_bit_equal_to_torchs_optimizer(name):
    a, _ = _train(ours, name, 7)
    b, _ = _train(theirs, name, 7)
    for (k, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), (name, k, (x - y).abs().max())


@pytest.mark.parametrize("name", ["adam", "adagrad"])
def test_state_saved_by_either_continues_in_ours_bit_for_bit(name):
    """A checkpoint from before (torch's optimizer) or from now (ours) resumes exactly."""
    whole, _ = _train(ours, name, 6)
    for first in (ours, theirs):
        model, opt = _train(first, name, 3)
        resumed = make_dense_optimizer(name, model.parameters(), 0.01)
        resumed.load_state_dict(opt.state_dict())
        for t in range(3, 6):
            _grads(model, t, skip_last=True)
            resumed.step()
        for x, y in zip(model.state_dict().values(), whole.state_dict().values(), strict=True):
            assert torch.equal(x, y)


def test_a_state_of_another_model_is_refused():
    _, opt = _train(ours, "adam", 1)
    small = make_dense_optimizer("adam", [torch.nn.Parameter(torch.zeros(2))], 0.01)
    with pytest.raises(ValueError, match="parameters"):
        small.load_state_dict(opt.state_dict())
    with pytest.raises(ValueError, match="unknown dense optimizer"):
        make_dense_optimizer("rmsprop", [], 0.01)


def test_a_step_does_not_import_torch_dynamo():
    """torch.optim imports TorchDynamo on every optimizer's first call: 1.3 s of a trainer's start."""
    code = (
        "import sys, torch; from hpsray.models import DNN, make_dense_optimizer; "
        "m = DNN(2, 2, 1, hidden=(3,)); o = make_dense_optimizer('adam', m.parameters(), 0.1); "
        "m(torch.zeros(4, 2, 2), torch.zeros(4, 1)).sum().backward(); o.step(); "
        "print('torch._dynamo' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
