"""``fs.optim.from_torch(torch.optim.X, **kwargs)``: any elementwise torch optimizer (NAdam, RAdam, Adamax, ASGD,
Adadelta, Rprop, ...) run on flat shards by torch's own implementation.

Each run of a shard (``plan``'s; on the CPU in cache-sized pieces where torch runs its single-tensor loop: ``piece``)
is handed to a fresh ``torch.optim.X(runs, **kwargs)`` as one parameter (the runs of an update with the same count,
rate and decay in one optimizer: ``apply_runs``), with the run's gradient as its
``.grad`` and the run's state as its ``state``, and ``X.step()`` does the arithmetic (its single-tensor function on
the CPU, foreach on CUDA, as torch picks them; ``foreach=True`` asks for it on the CPU), in place on the run's
slices; rows that ``step()`` replaced (SGD's first momentum buffer) are copied back. So the result equals
``torch.optim.X`` on the whole parameters wherever X is elementwise, which is what fshard needs: a run is a parameter
or a part of one.

What the state is, is read from X itself, once, when the optimizer is built: one step on a 3-element probe
parameter. Its state's tensors shaped like the parameter are the rows (in torch's order and under torch's names: a
checkpoint holds them as ``get_optimizer_state_dict`` would), ``step`` is the count's key, and 0-dim tensors are
per-parameter scalars (NAdam's ``mu_product``, ASGD's ``eta`` and ``mu``) that follow from the step count: they are
not stored but replayed, on a one-element parameter stepped as many times (continued from the last count, and
remembered), with the run's learning rate where they depend on it (ASGD's ``eta``, which then assumes the current
rate throughout: under a schedule each new rate replays from the first step; NAdam's do not: one replay serves
all). A state of any other shape, or an update that differs on a matrix stepped whole and as two halves (one that
reads norms: LAMB, LARS), is not elementwise and is refused, as are Adafactor, Muon, LBFGS and SparseAdam and their
subclasses by name, each pointing to what fshard offers instead. X's param-group fields are its own defaults
(``get_optimizer_state_dict``'s).
"""
from __future__ import annotations

import dataclasses
import inspect
import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..errors import ArgumentError, ArgumentTypeError
from ._elementwise import Elementwise, pieces, torch_ops_piece
from ._protocol import Row

# torch optimizers that are not elementwise, and what to use instead
_REFUSED = {
    "Adafactor": "fs.adafactor (factored second moments: its state is shaped by the matrix's rows and columns)",
    "Muon": "fs.muon (it orthogonalises whole matrices)",
    "LBFGS": "fs.optim.sgd or fs.adamw (LBFGS needs a closure that re-evaluates the loss and whole-model vectors)",
    "SparseAdam": "fs.optim.adam or fs.adamw (fshard's gradients are dense flat shards)",
}
_MEMO = 256  # the replayed scalars kept (a run asks for its count - 1: recent counts)
_RUNS = 8  # the replays kept going (per learning rate and weight decay, one per count stream), most recent last


class _Replays:
    """The replayed per-parameter scalars of one optimizer, by (lr, weight decay) and count, under a lock (runs
    may be updated on an offload worker thread beside the step's); copies and pickles as a new, empty one."""

    def __init__(self):
        self.lock = threading.Lock()
        self.runs: dict = {}   # ((lr, wd), id) -> (torch optimizer, its one-element parameter, steps taken)
        self.ids = itertools.count()
        self.memo: dict = {}   # (lr, wd, count) -> {name: 0-dim tensor}
        self.devices: dict = {}  # device -> {0-dim state name: kept on the parameter's device (else the CPU)}

    def __reduce__(self):
        return _Replays, ()


@dataclass(frozen=True)
class FromTorch(Elementwise):
    """A torch optimizer class ``cls`` with its keyword arguments ``kwargs`` (name, value pairs), run on each run of
    the shards (module docstring). ``lr`` (a float or a schedule) and ``weight_decay`` are taken out of the
    arguments so that a schedule and ``weight_decay_mask`` work as for fshard's own optimizers."""

    cls: type
    kwargs: tuple = ()
    lr: float | Callable[[int], float] = 1e-3
    weight_decay: float = 0.0
    weight_decay_mask: Callable | None = None
    decay: frozenset | None = dataclasses.field(default=None, repr=False)
    replays: Any = dataclasses.field(default_factory=_Replays, init=False, repr=False, compare=False)
    label: ClassVar[str] = "fs.optim.from_torch"

    def __post_init__(self):
        self._check_common()
        state, eager, group = _probe(self.cls, self._kw(_probe_lr(self.lr), self.weight_decay))
        rows, scalars, count_key, step_dtype = [], [], None, torch.float32
        for name, t in state.items():
            if name == "step":
                count_key, step_dtype = "step", t.dtype
            elif t.dim() == 0:
                scalars.append(name)
            else:
                init = float(eager[name].flatten()[0]) if name in eager else 0.0
                rows.append(Row(name, None if t.dtype == torch.float32 else t.dtype, init))
        object.__setattr__(self, "rows", tuple(rows))
        object.__setattr__(self, "count_key", count_key)
        object.__setattr__(self, "eager_state", bool(eager))
        object.__setattr__(self, "_scalars", tuple(scalars))
        object.__setattr__(self, "_step_dtype", step_dtype)
        object.__setattr__(self, "_fields", group)
        object.__setattr__(self, "_takes_wd", _takes(self.cls, "weight_decay"))  # (looked up once, not per run)
        object.__setattr__(self, "_rate_free", not scalars or _rate_free(self.cls, dict(self.kwargs), scalars))

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in (("lr", self.lr), *self.kwargs, ("weight_decay", self.weight_decay))
                         if k != "weight_decay" or _takes(self.cls, "weight_decay"))
        return f"fs.optim.from_torch({self.cls.__module__}.{self.cls.__qualname__}, {args})"

    def _kw(self, lr: float, wd: float) -> dict:
        kw = {**dict(self.kwargs), "lr": lr}
        if self.__dict__.get("_takes_wd", _takes(self.cls, "weight_decay")):
            kw["weight_decay"] = wd
        return kw

    def group_fields(self) -> dict:
        return dict(self._fields)

    apply = Elementwise.apply  # (defined here, beside apply_runs: optim._protocol.apply_runs's rule)

    def update_run(self, p, g, rows, step, lr, wd):
        self._step_runs([p], [g], [rows], step, lr, wd)

    def apply_runs(self, runs) -> None:
        """``apply`` on each of ``runs`` (``(p, g, rows, step, grad_scale, lr, weight_decay, copy)``, disjoint) with
        one torch optimizer per (step, lr, weight decay), each run (or piece of one: ``piece``) one of its parameters:
        torch's multi-tensor implementation (``foreach=True``, torch's default on CUDA) then takes a unit's runs in one
        call, as it takes a model's parameters, and the single-tensor one loops over them as it would. The same result
        as a run at a time: each run is its own parameter either way."""
        groups: dict = {}
        own = type(self).update_run is not FromTorch.update_run  # a subclass's own arithmetic: a run at a time
        for p, g, rows, step, scale, lr, wd, copy in runs:
            if own or lr is None:  # (a run without its rate: apply's checks and defaults)
                self.apply(p, g, *rows, step, scale, lr=lr, weight_decay=wd, copy=copy)
                continue
            wd = self.weight_decay if wd is None else wd
            groups.setdefault((int(step), lr, wd), []).extend(
                (p, g if scale == 1.0 else g * scale, rows, copy) for p, g, rows, copy in pieces(p, g, rows, copy,
                                                                                               self.piece(p)))
        for (step, lr, wd), rs in groups.items():
            self._step_runs([r[0] for r in rs], [r[1] for r in rs], [r[2] for r in rs], step, lr, wd)
            for p, _, _, copy in rs:
                if copy is not None:
                    copy.copy_(p)

    def piece(self, p):
        """Pieces where torch runs its single-tensor loop (its default on the CPU): each piece is one of its
        parameters, its ops' passes then read the piece from the caches. Its multi-tensor loop
        (``foreach=True``) passes over every parameter once an op, and its fused one (``fused=True``) is one pass, so
        they take whole runs."""
        kw = dict(self.kwargs)
        return 0 if kw.get("foreach") or kw.get("fused") else torch_ops_piece(p)

    def _step_runs(self, ps, gs, rowss, step, lr, wd) -> None:
        """One ``X.step()`` over the runs ``ps`` (their gradients ``gs``, rows ``rowss``), all at count ``step``."""
        opt = self.cls(ps, **self._kw(lr, wd))
        sts = [opt.state[p] for p in ps]
        if step > 1 or self.eager_state:  # a first update of a lazy optimizer: torch makes its state itself
            on = self._placement(ps[0].device)
            where = lambda k: ps[0].device if on.get(k, False) else torch.device("cpu")  # noqa: E731 - as torch has it
            scalars = self._replayed(step - 1, lr, wd) if self._scalars and step > 1 else {}
            for st, rows in zip(sts, rowss):
                if self.count_key is not None:
                    st[self.count_key] = torch.tensor(float(step - 1), dtype=self._step_dtype,
                                                      device=where(self.count_key))
                st.update(zip((r.name for r in self.rows), rows))
                st.update((k, v.clone().to(where(k))) for k, v in scalars.items())
        for p, g in zip(ps, gs):
            p.grad = g if g.dtype == p.dtype else g.to(p.dtype)
        try:
            opt.step()
        finally:
            for p in ps:
                p.grad = None
        for st, rows in zip(sts, rowss):
            for r, row in zip(self.rows, rows):
                if st[r.name] is not row:  # replaced, not updated in place (a first momentum buffer, a fresh state)
                    row.copy_(st[r.name])

    def _placement(self, device: torch.device) -> dict:
        """Which of X's 0-dim state tensors (``step``, the scalars) X keeps on the parameter's device rather than
        the CPU (torch keeps ``step`` on the CPU unless capturable, ASGD's ``eta`` on the device): read once per
        device from a probe step there, as X places them itself. On the CPU, nothing to tell apart."""
        if device.type == "cpu":
            return {}
        r = self.replays
        with r.lock:
            if str(device) not in r.devices:
                q = torch.zeros(3, device=device)
                opt = self.cls([q], **self._kw(_probe_lr(self.lr), self.weight_decay))
                q.grad = torch.full_like(q, 0.5)
                opt.step()
                r.devices[str(device)] = {k: v.device == q.device for k, v in opt.state[q].items() if v.dim() == 0}
            return r.devices[str(device)]

    def saved_scalars(self, count: int, updates: int, weight_decay: float) -> dict:
        """The per-parameter scalars after ``count`` updates (at the rate after ``updates``), which a checkpoint
        holds beside the rows as torch's ``get_optimizer_state_dict`` does (a load recomputes them)."""
        if not self._scalars:
            return {}
        return {k: v.clone() for k, v in self._replayed(count, self.lr_at(updates), weight_decay).items()}

    def _replayed(self, count: int, lr: float, wd: float) -> dict:
        """The per-parameter scalars after ``count`` updates at ``lr``: a one-element parameter stepped ``count``
        times with a zero gradient (they follow the count, not the data), continued from the last replay."""
        r = self.replays
        if self._rate_free:  # (NAdam's mu_product: one replay serves every rate and decay)
            lr, wd = _probe_lr(self.lr), self.weight_decay
        with r.lock:
            hit = r.memo.get((lr, wd, count))
            if hit is not None:
                return hit
            # the replay at this rate furthest along but not past ``count``: parameters whose counts differ
            # (unused on some steps) each keep one going, instead of restarting from 0 at every step
            behind = [(d, i) for (key, i), (_, _, d) in r.runs.items() if key == (lr, wd) and d <= count]
            if behind:
                i = max(behind)[1]
                opt, q, done = r.runs.pop(((lr, wd), i))
            else:  # a new rate, or a count below every replay's: start again
                q, i = torch.zeros(1), next(r.ids)
                opt, done = self.cls([q], **self._kw(lr, wd)), 0
            while done < count:
                q.grad = torch.zeros(1)
                opt.step()
                done += 1
            if len(r.runs) >= _RUNS:  # (a schedule: a new rate each step; the oldest replays go)
                r.runs.pop(next(iter(r.runs)))
            r.runs[((lr, wd), i)] = (opt, q, done)
            out = {k: opt.state[q][k].clone() for k in self._scalars}
            if len(r.memo) >= _MEMO:
                r.memo.pop(next(iter(r.memo)))
            r.memo[(lr, wd, count)] = out
            return out


def _rate_free(cls: type, kw: dict, scalars) -> bool:
    """Do ``cls``'s per-parameter scalars not depend on the learning rate and weight decay (NAdam's do not, ASGD's
    ``eta`` does)? Three steps at two rates and decays, compared."""
    seen = []
    for lr, wd in ((1e-3, 0.0), (3e-2, 0.1)):
        q = torch.zeros(1)
        opt = cls([q], **kw, lr=lr, **({"weight_decay": wd} if _takes(cls, "weight_decay") else {}))
        for _ in range(3):
            q.grad = torch.zeros(1)
            opt.step()
        seen.append([opt.state[q][k].item() for k in scalars])
    return seen[0] == seen[1]


def _takes(cls: type, name: str) -> bool:
    return name in inspect.signature(cls.__init__).parameters


def _probe_lr(lr) -> float:
    return 1e-3 if callable(lr) else float(lr)


def _probe(cls: type, kw: dict) -> tuple[dict, dict, dict]:
    """One step of ``cls`` on a 3-element parameter: its state after the step, its state before it (non-empty for
    an optimizer that makes it when built: Adagrad), and its param group's fields but ``params`` and ``lr``."""
    p = torch.zeros(3)
    try:
        opt = cls([p], **kw)
    except (TypeError, ValueError) as e:
        raise ArgumentError(f"fs.optim.from_torch({cls.__qualname__}, ...): torch refused the arguments "
                            f"{kw}: {e}") from None
    eager = {k: v.clone() for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)}
    p.grad = torch.full((3,), 0.5)
    opt.step()
    state = dict(opt.state[p])
    for name, t in state.items():
        if not isinstance(t, torch.Tensor) or (t.dim() != 0 and t.shape != p.shape):
            raise ArgumentError(f"fs.optim.from_torch({cls.__qualname__}): its state {name!r} is "
                                f"{type(t).__name__ if not isinstance(t, torch.Tensor) else tuple(t.shape)}, not "
                                "shaped like the parameter, so it is not elementwise and cannot run on flat shards.")
    group = {k: v for k, v in opt.param_groups[0].items() if k not in ("params", "lr")}
    _check_elementwise(cls, kw)
    return state, eager, group


def _check_elementwise(cls: type, kw: dict) -> None:
    """Refuse ``cls`` unless two steps on a (3, 4) matrix equal the same steps on its two halves as parameters of
    their own, and on the halves as two parameters of one optimizer (``apply_runs`` steps a unit's runs together):
    a state not shaped like the parameter (factored statistics) or an update that reads whole-tensor
    norms (LAMB's and LARS's trust ratios) would make each run of a shard a different optimizer."""
    g = torch.linspace(-1.0, 2.0, 12).reshape(3, 4)
    whole = torch.linspace(0.5, -0.5, 12).reshape(3, 4)
    halves = [h.clone() for h in whole.reshape(-1).split(6)]
    together = [h.clone() for h in halves]  # the halves as two parameters of one optimizer (apply_runs)
    gh = list(g.reshape(-1).split(6))
    # each optimizer's parameters and their gradients: the whole matrix; each half alone; both halves in one
    for params, gs in [([whole], [g]), *(([h], [x]) for h, x in zip(halves, gh)), (together, gh)]:
        opt = cls(params, **kw)
        for _ in range(2):
            for p, gp in zip(params, gs):
                p.grad = gp.clone()
            opt.step()
        bad = [name for p in params for name, v in opt.state[p].items()
               if isinstance(v, torch.Tensor) and v.dim() and v.shape != p.shape]
        if bad:
            raise ArgumentError(f"fs.optim.from_torch({cls.__qualname__}): its state {bad[0]!r} on a (3, 4) "
                                "matrix is not shaped like the matrix, so it is not elementwise and cannot run on "
                                "flat shards.")
    if not torch.allclose(torch.cat(together), torch.cat(halves), rtol=1e-5, atol=1e-7):
        raise ArgumentError(f"fs.optim.from_torch({cls.__qualname__}): two parameters stepped by one optimizer move "
                            "differently from the same parameters stepped by one optimizer each (its update couples "
                            "the parameters of a group), so it cannot run on runs of flat shards; write it on the "
                            "optimizer protocol (examples/custom_optimizer.py).")
    if not torch.allclose(whole.reshape(-1), torch.cat(halves), rtol=1e-5, atol=1e-7):
        raise ArgumentError(f"fs.optim.from_torch({cls.__qualname__}): stepping a matrix whole and as two halves "
                            "gives different results (its update reads whole-tensor quantities, e.g. a norm), so it "
                            "is not elementwise and cannot run on runs of flat shards; write it on the optimizer "
                            "protocol (examples/custom_optimizer.py) with whole-parameter statistics.")


def from_torch(cls: type, **kwargs) -> FromTorch:
    """``cls`` (an elementwise ``torch.optim`` optimizer class: NAdam, RAdam, Adamax, ASGD, ...) with ``kwargs`` as
    torch takes them, run on flat shards by torch's own implementation (module docstring). ``lr`` may be a schedule
    (``fs.schedules``), and ``weight_decay_mask(name, param) -> bool`` chooses the parameters that decay where
    ``cls`` has a ``weight_decay``."""
    if not isinstance(cls, type):
        raise ArgumentTypeError(f"fs.optim.from_torch({cls!r}): pass the torch optimizer class and its arguments, "
                                "e.g. fs.optim.from_torch(torch.optim.NAdam, lr=2e-3), not an instance.")
    base = next((c.__name__ for c in cls.__mro__ if c.__name__ in _REFUSED and c.__module__.startswith("torch.")),
                None)  # (torch's own, or a subclass of it under another name)
    if base is not None:
        named = cls.__name__ if base == cls.__name__ else f"{cls.__name__} (a torch.optim.{base})"
        raise ArgumentError(f"fs.optim.from_torch({cls.__name__}): {named} is not elementwise, so it cannot "
                            f"run on runs of flat shards; use {_REFUSED[base]}.")
    if not issubclass(cls, torch.optim.Optimizer):
        raise ArgumentTypeError(f"fs.optim.from_torch({cls.__qualname__}): not a torch.optim.Optimizer class.")
    if "params" in kwargs:
        raise ArgumentError("fs.optim.from_torch(..., params=...): fshard passes the parameters; give only the "
                            "optimizer's hyperparameters.")
    sig = inspect.signature(cls.__init__).parameters
    lr = kwargs.pop("lr", sig["lr"].default if "lr" in sig else 1e-3)
    wd = kwargs.pop("weight_decay", sig["weight_decay"].default if "weight_decay" in sig else 0.0)
    mask = kwargs.pop("weight_decay_mask", None)
    if mask is not None and "weight_decay" not in sig:
        raise ArgumentError(f"fs.optim.from_torch({cls.__name__}, weight_decay_mask=...): {cls.__name__} has no "
                            "weight_decay to mask.")
    return FromTorch(cls, tuple(kwargs.items()), lr, wd, mask)
