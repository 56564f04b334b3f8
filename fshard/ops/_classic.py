"""Native single-tensor kernels for ``fs.optim.adam``, ``sgd`` and ``adagrad`` (ops/classic*.cpp).

Each does torch's single-tensor CPU arithmetic (``torch.optim.adam._single_tensor_adam``, ``sgd``'s, ``adagrad``'s:
what ``torch.optim.Adam()`` etc. run on the CPU by default) in one pass over memory, so the result is bitwise
torch's whatever the length of the run and wherever a flat shard or an offload chunk cuts it (design/OPS.md,
"Single-tensor kernels"). The hyperparameters are folded here in Python floats exactly as torch's code folds them;
the kernel casts each to float32 once, as ATen casts a Python scalar. Tensors: float32, contiguous, on the CPU,
all of one length. Without a native build these raise BuildError: callers check ``native_available()`` and run
the torch ops instead (the same bits, several passes).
"""
from __future__ import annotations

import torch

ADAM, SGD, ADAGRAD = 0, 1, 2


def _run(kind, p, g, rows, *, wd=0.0, maximize=False, lerp_w=0.0, beta2=0.0, sq_coeff=0.0, bc2_sqrt=1.0, eps=0.0,
         neg_step=0.0, amsgrad=False, momentum=0.0, damp1=1.0, neg_lr=0.0, nesterov=False, first=False,
         isa=None) -> None:
    from . import _cap_for, _lib, load
    from ._reference import plain

    lib = _lib if _lib is not None else load()  # built and loaded: no lock on every run
    g = plain(g, "g", "classic", read_only=True)
    lib.classic_step(kind, p, g, list(rows), float(wd), bool(maximize), float(lerp_w), float(beta2),
                        float(sq_coeff), float(bc2_sqrt), float(eps), float(neg_step), bool(amsgrad), float(momentum),
                        float(damp1), float(neg_lr), bool(nesterov), bool(first), _cap_for(isa))


@torch.no_grad()
def adam_(p, g, exp_avg, exp_avg_sq, max_exp_avg_sq=None, *, step: float, lr: float, beta1: float, beta2: float,
          eps: float, weight_decay: float = 0.0, isa: str | None = None) -> None:
    """torch.optim.Adam's single-tensor step (L2 weight decay, AMSGrad where ``max_exp_avg_sq`` is given) in place;
    ``step`` is the count after this update."""
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    rows = (exp_avg, exp_avg_sq) + (() if max_exp_avg_sq is None else (max_exp_avg_sq,))
    _run(ADAM, p, g, rows, wd=weight_decay, lerp_w=1 - beta1, beta2=beta2, sq_coeff=1 - beta2,
         bc2_sqrt=bias_correction2**0.5, eps=eps, neg_step=-(lr / bias_correction1),
         amsgrad=max_exp_avg_sq is not None, isa=isa)


@torch.no_grad()
def sgd_(p, g, momentum_buffer=None, *, first: bool, lr: float, momentum: float = 0.0, dampening: float = 0.0,
         weight_decay: float = 0.0, nesterov: bool = False, maximize: bool = False, isa: str | None = None) -> None:
    """torch.optim.SGD's single-tensor step in place; ``first``: the buffer starts as a copy of the gradient."""
    if momentum != 0 and momentum_buffer is None:
        from ..errors import ArgumentError
        raise ArgumentError(f"fshard.ops.sgd_(momentum={momentum}): momentum needs its momentum_buffer (a float32 "
                            "tensor of p's length, updated in place); pass momentum_buffer=, or momentum=0.")
    rows = () if momentum == 0 else (momentum_buffer,)
    _run(SGD, p, g, rows, wd=weight_decay, maximize=maximize, momentum=momentum, damp1=1 - dampening, neg_lr=-lr,
         nesterov=nesterov, first=first, isa=isa)


@torch.no_grad()
def adagrad_(p, g, state_sum, *, step: float, lr: float, lr_decay: float = 0.0, weight_decay: float = 0.0,
             eps: float = 1e-10, maximize: bool = False, isa: str | None = None) -> None:
    """torch.optim.Adagrad's single-tensor (dense) step in place; ``step`` is the count after this update."""
    clr = lr / (1 + (step - 1) * lr_decay)
    _run(ADAGRAD, p, g, (state_sum,), wd=weight_decay, maximize=maximize, eps=eps, neg_step=-clr, isa=isa)
