"""Torch references for fshard.ops.adamw_ and fshard.ops.sq_norm: the same contracts, built from torch ops.

They are the fallbacks when the native build is unavailable, and the specs the native
kernels are tested against. The AdamW update itself is torch._fused_adamw_ (or
torch._fused_adam_ for the L2 mode), so its arithmetic is ATen's; the extra
passes around it (grad cast and scale, the non-finite check, the low-precision
copy) are the passes the native kernel fuses away.
"""
from __future__ import annotations

import torch
from ..errors import ArgumentError, ArgumentTypeError

Tensors = list[torch.Tensor]


def as_list(x, name: str, op: str = "adamw_", read_only: bool = False) -> Tensors:
    if x is None:
        return []
    if isinstance(x, torch.Tensor):
        return [plain(x, name, op, read_only)]
    if isinstance(x, (list, tuple)):
        return [plain(t, name, op, read_only) for t in x]
    raise ArgumentTypeError(f"fshard.ops.{op}: {name} must be a Tensor or a list of Tensors, got {type(x).__name__}")


def plain(t, name: str, op: str, read_only: bool):
    """``t`` as a tensor whose memory the native kernels can read: itself, unless it is a tensor subclass that
    holds no memory of its own (a one-rank ``SlotGrad``, fshard/state/_slot_grad.py: its data pointer is 0),
    which is read through torch's ops into a plain copy. Only a ``read_only`` argument (a gradient) can be such:
    a kernel's writes into a copy would be lost, so one written in place is refused."""
    if type(t) is torch.Tensor or type(t) is torch.nn.Parameter or not isinstance(t, torch.Tensor):
        return t
    if t.numel() and t.data_ptr() == 0:
        if not read_only:
            raise ArgumentTypeError(f"fshard.ops.{op}: {name} is a {type(t).__name__}, which holds no memory of "
                                    "its own; the kernel writes into it in place, so pass a plain tensor.")
        t = torch.Tensor.clone(t)  # (a SlotGrad: its slots' gradients, assembled)
    return t


SQ_NORM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_sq_norm_dtypes(tensors: Tensors) -> None:
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise ArgumentTypeError(f"fshard.ops.sq_norm: tensors[{i}] is a {type(t).__name__}, not a Tensor")
        if t.dtype not in SQ_NORM_DTYPES:
            raise ArgumentTypeError(f"fshard.ops.sq_norm: tensors[{i}] has dtype {t.dtype}; it takes float32, "
                                    "bfloat16 or float16 tensors")


@torch.no_grad()
def sq_norm_reference(tensors) -> float:
    """The sum over every element of every tensor of x*x, in float64, from torch ops (any device); see
    fshard.ops.sq_norm. One sync per device. Its rounding differs from the native kernel's (and torch's own
    reduction order depends on the thread count), by about 1e-15 relative."""
    ts = as_list(tensors, "tensors", "sq_norm", read_only=True)
    check_sq_norm_dtypes(ts)
    per_device: dict[torch.device, Tensors] = {}
    for t in ts:
        if t.numel():
            per_device.setdefault(t.device, []).append(torch.linalg.vector_norm(t, dtype=torch.float64) ** 2)
    return float(sum(torch.stack(v).sum().item() for v in per_device.values()))


@torch.no_grad()
def adamw_reference_(params, grads, exp_avgs, exp_avg_sqs, *, step: int, lr: float, beta1: float,
                     beta2: float, eps: float, weight_decay: float, grad_scale: float = 1.0,
                     param_copies=None, adam_w_mode: bool = True, check_finite: bool = True) -> bool:
    """In-place AdamW (or Adam with L2) on lists of fp32 tensors; see fshard.ops.adamw_."""
    params, grads = as_list(params, "params"), as_list(grads, "grads", read_only=True)
    exp_avgs, exp_avg_sqs = as_list(exp_avgs, "exp_avgs"), as_list(exp_avg_sqs, "exp_avg_sqs")
    copies = as_list(param_copies, "param_copies")
    n = len(params)
    if not (len(grads) == len(exp_avgs) == len(exp_avg_sqs) == n):
        raise ArgumentError("fshard.ops.adamw_: params, grads, exp_avgs and exp_avg_sqs must have the same "
                            f"length, got {n}, {len(grads)}, {len(exp_avgs)}, {len(exp_avg_sqs)}")
    if copies and len(copies) != n:
        raise ArgumentError(f"fshard.ops.adamw_: param_copies has {len(copies)} tensors but params has {n}")
    if step < 1:
        raise ArgumentError(f"fshard.ops.adamw_: step must be >= 1, got {step}")
    for i in range(n):
        for name, t in (("grads", grads[i]), ("exp_avgs", exp_avgs[i]), ("exp_avg_sqs", exp_avg_sqs[i])):
            if t.numel() != params[i].numel():
                raise ArgumentError(f"fshard.ops.adamw_: {name}[{i}] has {t.numel()} elements but "
                                    f"params[{i}] has {params[i].numel()}")
    keep = [i for i in range(n) if params[i].numel() > 0]
    if not keep:
        return False
    # Pass 1: grads to fp32 and scaled (g = grad * grad_scale, in fp32 like the kernel).
    g32 = [grads[i].reshape(-1).float() for i in keep]
    if grad_scale != 1.0:
        g32 = [g * torch.tensor(grad_scale, dtype=torch.float32, device=g.device) for g in g32]
    # Pass 2: non-finite check over every grad; nothing is modified when it trips.
    if check_finite:
        bad = torch.stack([torch.logical_not(torch.isfinite(g)).any() for g in g32]).any()
        if bool(bad):
            return True
    p = [params[i].view(-1) for i in keep]
    m = [exp_avgs[i].view(-1) for i in keep]
    v = [exp_avg_sqs[i].view(-1) for i in keep]
    steps = [torch.tensor(float(step), device=t.device) for t in p]
    # Pass 3: ATen's fused update.
    fused = torch._fused_adamw_ if adam_w_mode else torch._fused_adam_
    fused(p, g32, m, v, [], steps, lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay,
          eps=eps, amsgrad=False, maximize=False)
    # Pass 4: the low-precision copy.
    if copies:
        torch._foreach_copy_([copies[i].view(-1) for i in keep], p)
    return False
