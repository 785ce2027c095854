"""The dense model's optimizers: Adam, Adagrad and SGD with torch's defaults.

Each step is torch's multi-tensor (``foreach``) implementation of ``torch.optim.Adam`` /
``Adagrad`` / ``SGD``, the same ``torch._foreach_*`` ops in the same order, so the weights and the
state are bit-equal to torch's (tests/models/test_dense_optim.py) on any device. They are not
``torch.optim.Optimizer`` subclasses because every call of those (construction, ``step``)
imports TorchDynamo first: 1.3 s of CPU in each trainer's start (docs/benchmarks.md, The start).
``state_dict`` has torch's layout: states saved from torch's optimizers load too.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from hpsray.config import DENSE_OPTIMIZERS
from hpsray.models.vml import warm_vml

__all__ = ["DenseOptimizer"]

_BETAS = (0.9, 0.999)  # torch.optim.Adam's defaults
_ADAM_EPS = 1e-8
_ADAGRAD_EPS = 1e-10  # torch.optim.Adagrad's default (lr_decay 0, initial accumulator 0)


def _step_dtype() -> torch.dtype:
    """The dtype torch keeps an optimizer's ``step`` counter in (on the CPU)."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _count_step(steps: list[torch.Tensor]) -> None:
    if steps[0].is_cpu:  # torch's CPU path: one wrapped scalar for all counters
        torch._foreach_add_(steps, torch.tensor(1.0, device="cpu"), alpha=1.0)
    else:
        torch._foreach_add_(steps, 1)


class DenseOptimizer:
    """``name``'s update of ``params`` (those with a gradient at each :meth:`step`) at rate ``lr``;
    its process's VML kernels are chosen before its first step (:mod:`hpsray.models.vml`)."""

    def __init__(self, name: str, params: Iterable[torch.nn.Parameter], lr: float) -> None:
        name = name.lower()
        if name not in DENSE_OPTIMIZERS:
            raise ValueError(f"unknown dense optimizer {name!r}; choose adam, adagrad or sgd")
        warm_vml()  # Adam's sqrt runs on every thread at once from its first step
        self.name, self.lr = name, float(lr)
        self.params: list[torch.Tensor] = list(params)
        self.state: list[dict[str, torch.Tensor]] = [{} for _ in self.params]
        if name == "adagrad":  # torch.optim.Adagrad makes its state up front
            for p, st in zip(self.params, self.state, strict=True):
                st["step"] = torch.tensor(0.0, dtype=_step_dtype())
                st["sum"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    @torch.no_grad()
    def step(self) -> None:
        """One update of every parameter that has a gradient."""
        at = [i for i, p in enumerate(self.params) if p.grad is not None]
        if not at:
            return
        params = [self.params[i] for i in at]
        grads = [p.grad for p in params if p.grad is not None]
        if self.name == "sgd":
            torch._foreach_add_(params, grads, alpha=-self.lr)
        elif self.name == "adam":
            self._adam(params, grads, [self._adam_state(i) for i in at])
        else:
            self._adagrad(params, grads, [self.state[i] for i in at])

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the parameters' gradients (as ``torch.optim.Optimizer.zero_grad``)."""
        for p in self.params:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()

    def _adam_state(self, i: int) -> dict[str, torch.Tensor]:
        st = self.state[i]
        if not st:
            p = self.params[i]
            st["step"] = torch.tensor(0.0, dtype=_step_dtype(), device="cpu")
            st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return st

    def _adam(self, params: list[torch.Tensor], grads: list[torch.Tensor], states: list[dict]) -> None:
        beta1, beta2 = _BETAS
        steps = [s["step"] for s in states]
        exp_avgs = [s["exp_avg"] for s in states]
        exp_avg_sqs = [s["exp_avg_sq"] for s in states]
        _count_step(steps)
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
        counts = [s.item() for s in steps]
        step_size = [(self.lr / (1 - beta1**t)) * -1 for t in counts]
        bias2_sqrt = [(1 - beta2**t) ** 0.5 for t in counts]
        denom = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denom, bias2_sqrt)
        torch._foreach_add_(denom, _ADAM_EPS)
        torch._foreach_addcdiv_(params, exp_avgs, denom, step_size)

    def _adagrad(self, params: list[torch.Tensor], grads: list[torch.Tensor], states: list[dict]) -> None:
        steps = [s["step"] for s in states]
        sums = [s["sum"] for s in states]
        _count_step(steps)
        minus_clr = [-self.lr / 1.0 for _ in steps]  # lr_decay 0: -lr / (1 + (step - 1) * 0)
        torch._foreach_addcmul_(sums, grads, grads, value=1)
        std = torch._foreach_sqrt(sums)
        torch._foreach_add_(std, _ADAGRAD_EPS)
        numerator = torch._foreach_mul(grads, minus_clr)
        torch._foreach_addcdiv_(params, numerator, std)

    def state_dict(self) -> dict[str, Any]:
        """torch's layout: ``state`` by parameter index (tensors shared, not copied), one group."""
        return {
            "state": {i: dict(st) for i, st in enumerate(self.state) if st},
            "param_groups": [{"name": self.name, "lr": self.lr, "params": list(range(len(self.params)))}],
        }

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict` (or a ``torch.optim`` optimizer's of the same kind):
        tensors copied onto each parameter's device, the step counters kept on the CPU."""
        groups = saved.get("param_groups", [])
        n = sum(len(g["params"]) for g in groups) if groups else len(self.params)
        if n != len(self.params):
            raise ValueError(f"saved optimizer state has {n} parameters, this model {len(self.params)}")
        state: list[dict[str, torch.Tensor]] = [{} for _ in self.params]
        for i, st in saved.get("state", {}).items():
            p = self.params[int(i)]
            for k, v in st.items():
                if not isinstance(v, torch.Tensor):
                    continue
                state[int(i)][k] = v.clone() if k == "step" else v.to(device=p.device, dtype=p.dtype).clone()
        self.state = state
