"""TrainState: the whole training state as an immutable pytree of shards, plus its static description.

Leaves are tensors (this rank's shards, the replicated buffers, the step count); everything static — the module
template, the unit layouts, the mesh, the optimizer — sits in ``ShardSpec``, the pytree's metadata. All nodes are
registered with optree under the "fshard" namespace: ``optree.tree_leaves(state, namespace="fshard")``.
"""
from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import optree
import torch

from ..errors import AbstractStateError, DonatedStateError, FrozenStateError, SaveInProgressError
from ._flat import UnitLayout

NAMESPACE = "fshard"


def _frozen_setattr(self, name, value=None):
    raise FrozenStateError(
        f"cannot assign to {type(self).__name__}.{name}: fshard states are immutable values. Make a modified "
        f"copy with state.replace({name}=...) (dataclasses.replace), or take the new state a step returns."
    )


def register_node(cls):
    """Register a frozen dataclass as an optree node (namespace "fshard") whose fields are all children."""
    names = tuple(f.name for f in dataclasses.fields(cls))
    optree.register_pytree_node(
        cls, lambda x: (tuple(getattr(x, n) for n in names), None, names),
        lambda _, children: cls(*children), namespace=NAMESPACE)
    cls.__setattr__ = _frozen_setattr
    cls.__delattr__ = _frozen_setattr
    cls.replace = lambda self, **kw: dataclasses.replace(self, **kw)
    return cls


class Busy:
    """A non-blocking lock that copies and pickles as a new, free one (a copied spec has a template of its own)."""

    __slots__ = ("_lock",)

    def __init__(self):
        self._lock = threading.Lock()

    def acquire(self) -> bool:
        return self._lock.acquire(blocking=False)

    def release(self) -> None:
        self._lock.release()

    def __reduce__(self):
        return Busy, ()


@dataclass(frozen=True, eq=False)
class ShardSpec:
    """What never changes during training: the static half of a TrainState."""

    template: Any                 # the nn.Module, on the meta device, with its unit modules routed through fshard
    units: tuple[UnitLayout, ...]
    param_names: tuple[str, ...]  # canonical names in model.named_parameters() order
    mesh: Any
    optimizer: Any
    fingerprint: int              # identical on every rank that built the same model: checked each step
    groups: tuple = ()            # (container path, member unit names) per routed container (fs.init(routed=...))
    # held while a step or eval pass runs the template (a step swaps its tensors): a second one is refused
    busy: Any = field(default_factory=lambda: Busy(), repr=False, compare=False)

    def unit(self, name: str) -> UnitLayout:
        return next(u for u in self.units if u.name == name)

    @functools.cached_property  # (the template's structure is fixed by fs.init; written once, outside __setattr__)
    def owners(self) -> dict[str, tuple[dict, str]]:
        """Every name of every parameter and buffer in the template (a tied one under each of its names) -> (the
        ``_parameters`` or ``_buffers`` dict of the module that holds it, its key): resolved once, for the binds a
        step makes at each unit call (fshard/run/_dispatch.py's ``bind_at``), not by a walk of the module tree at
        every call as ``functional_call`` makes."""
        t, out = self.template, {}
        for kind, named in (("_parameters", t.named_parameters), ("_buffers", t.named_buffers)):
            for n, _ in named(remove_duplicate=False):
                path, _, attr = n.rpartition(".")
                out[n] = (getattr(t.get_submodule(path), kind), attr)
        return out

    @functools.cached_property
    def buffer_aliases(self) -> dict[str, tuple[str, ...]]:
        """Each buffer's name in ``named_buffers()`` (a key of ``TrainState.buffers``) -> every name of it in the
        template (a buffer registered at several paths is one tensor under each), found by identity as
        ``functional_call``'s ``tie_weights`` finds them. First read before a step binds anything (the root's bind)."""
        names: dict[int, list[str]] = {}
        for n, b in self.template.named_buffers(remove_duplicate=False):
            names.setdefault(id(b), []).append(n)
        return {n: tuple(names[id(b)]) for n, b in self.template.named_buffers()}


class FrozenMap(Mapping):
    """A read-only mapping (name -> tensor or optimizer state), in insertion order: the ``params``, ``opt_state``
    and ``buffers`` of a TrainState. Assigning to it raises ``FrozenStateError`` with the fix; make a changed copy
    as ``{**state.params, name: t}`` and pass it to ``state.replace(params=...)``."""

    __slots__ = ("_data", "_field")

    def __init__(self, data=(), field: str = "mapping"):
        object.__setattr__(self, "_data", dict(data))
        object.__setattr__(self, "_field", field)

    def __getitem__(self, key):
        return self._data[key]

    def __iter__(self):
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key) -> bool:
        return key in self._data

    def __setitem__(self, key, value):
        raise FrozenStateError(
            f"cannot assign state.{self._field}[{key!r}]: fshard states are immutable values, and so are their "
            f"mappings. Make a changed copy: state.replace({self._field}={{**state.{self._field}, {key!r}: ...}}).")

    def __delitem__(self, key):
        self.__setitem__(key, None)

    def __setattr__(self, name, value):
        raise FrozenStateError(f"FrozenMap is immutable; make a changed copy with state.replace({self._field}=...).")

    def __reduce__(self):  # copy, deepcopy and pickle rebuild it through __init__ (__setattr__ refuses)
        return FrozenMap, (self._data, self._field)

    def __repr__(self) -> str:
        return f"FrozenMap({self._data!r})"


optree.register_pytree_node(
    FrozenMap, lambda m: (tuple(m._data.values()), (m._field, tuple(m._data)), tuple(m._data)),
    lambda meta, children: FrozenMap(zip(meta[1], children), meta[0]), namespace=NAMESPACE)


class Donation:
    """Whether a state's tensors were handed to a step composed with ``donate=True``, which updates them in place,
    and whether an asynchronous save (``fs.save(..., blocking=False)``) is reading them, which such a step must
    not overwrite: ``saves`` holds the handles not yet waited for.

    Every state holds one (``state.donation``). States that share their tensors share it: ``state.replace(...)``
    keeps it, so donating either one makes both unusable. A state rebuilt from leaves (optree) gets a new one.
    """

    __slots__ = ("step", "saves")

    def __init__(self):
        self.step: int | None = None  # the step count of the state when it was donated
        self.saves: list = []  # SaveHandles of fs.save(..., blocking=False) not yet waited for

    @property
    def done(self) -> bool:
        return self.step is not None

    def take(self, step: int) -> None:
        self.step = step

    def check_not_saving(self) -> None:
        """Raise if an asynchronous save of these tensors has not been waited for. It depends on the program's
        order only (``handle.wait()`` called or not), not on how far the save got, so every rank decides alike."""
        if self.saves:
            raise SaveInProgressError(
                f"this TrainState is being written by fs.save(..., blocking=False) ({self.saves[0].path}), and a step "
                "composed with donate=True would update its tensors in place while they are written. Call "
                "handle.wait() on the save's handle before the step, or compose without donate=True: a step "
                "that does not donate leaves its input as it is, so the save needs no copy.")

    def __repr__(self) -> str:
        return "Donation(not donated)" if self.step is None else f"Donation(donated at step {self.step})"


@dataclass(frozen=True, eq=False)
class TrainState:
    """params: unit name -> this rank's shard. opt_state: unit name -> optimizer state of that shard (units with
    no trainable parameter have none). step: number of updates taken. buffers: name -> replicated buffer.
    skipped: number of steps skipped (fs.skip_nonfinite, an fp16 overflow), a 0-dim int64 tensor like ``step``.
    transform_state: transform name -> the state a transform keeps across steps (a pytree: fp16's loss scale), the
    way optax keeps a transform's state with the parameters; a state from ``fs.init`` has none, and a step adds
    its transforms' initial states (``step.init(state)`` adds them without a step). copies: unit name -> a
    low-precision copy of its parameter shard that gathers send instead of casting the shard each time
    (``fs.mixed_precision(param_copies=True)``); the step makes them once from the shards, and every update keeps
    them equal to the cast of the new shards, writing them in its kernel pass. Empty without. donation: see
    ``Donation``. The five mappings are read-only (``FrozenMap``)."""

    params: Mapping[str, torch.Tensor]
    opt_state: Mapping[str, Any]
    step: torch.Tensor
    buffers: Mapping[str, torch.Tensor]
    spec: ShardSpec
    skipped: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.int64))
    transform_state: Mapping[str, Any] = field(default_factory=dict)
    copies: Mapping[str, torch.Tensor] = field(default_factory=dict)
    donation: Donation = field(default_factory=Donation, repr=False)

    def __post_init__(self):
        for f in ("params", "opt_state", "buffers", "transform_state", "copies"):
            v = getattr(self, f)
            if not isinstance(v, FrozenMap):
                object.__setattr__(self, f, FrozenMap(v, f))

    def replace(self, **changes) -> "TrainState":
        """A copy with ``changes``; it shares the tensors it does not change, and so the donation token too (pass
        ``donation=fs.state.Donation()`` for a copy that shares no tensor with this state). The changed fields are
        checked against the spec (units, shapes, dtypes; fshard/state/_check.py): a wrong one is an
        ``ArgumentError`` that names it, here rather than deep inside the next step."""
        new = dataclasses.replace(self, **changes, **({} if "donation" in changes else {"donation": self.donation}))
        from ._check import check_fields
        check_fields(new, changes)
        return new

    @property
    def mesh(self):
        return self.spec.mesh

    @property
    def abstract(self) -> bool:
        """Whether this state has shapes but no values (``fs.init(..., abstract=True)``)."""
        return any(p.is_meta for p in self.params.values())

    def check_usable(self) -> None:
        if self.abstract:
            raise AbstractStateError(
                "this TrainState is abstract (fs.init(..., abstract=True)): it has shapes and dtypes but no values. "
                "Load values into one like it, state = fs.load(path, like=state), or make it with fs.init without "
                "abstract=True.")
        if self.donation.done:
            raise DonatedStateError(
                f"this TrainState was donated to a step (compose(..., donate=True)) at step {self.donation.step}, "
                "which updated its tensors in place; use the state that step returned, or compose without "
                "donate=True to keep inputs intact.")

    def nbytes(self) -> dict[str, int]:
        """Bytes this rank holds in memory, by part (``copies``: the low-precision parameter copies; gradient shards
        exist only inside a step, and are counted too), and ``stored``: the bytes of leaves that live in a store
        (fs.offload_state: moments, and parameter shards with params=True)."""
        leaves = lambda t: optree.tree_leaves(t, namespace=NAMESPACE)  # noqa: E731
        grads = sum(self.params[u.name].nbytes for u in self.spec.units if u.trainable)  # one reduced shard each
        opt = leaves(self.opt_state) + [p for p in self.params.values() if not isinstance(p, torch.Tensor)]
        return {"params": sum(t.nbytes for t in leaves(self.params) if isinstance(t, torch.Tensor)),
                "copies": sum(t.nbytes for t in leaves(self.copies)),
                "grads": grads,
                "opt_state": sum(t.nbytes for t in opt if isinstance(t, torch.Tensor)),
                "buffers": sum(t.nbytes for t in leaves(self.buffers)),
                "stored": sum(t.nbytes for t in opt if not isinstance(t, torch.Tensor))}

    def __repr__(self) -> str:
        """A table, one row per unit, under two header lines; no object addresses (a weight-decay mask shows as
        its function's name)."""
        rows = [f"TrainState(step={int(self.step)}, skipped={int(self.skipped)}, {self.spec.mesh}"
                f"{', ' + repr(self.donation) if self.donation.done else ''})",
                f"  optimizer: {_describe(self.spec.optimizer)}"]
        dt = lambda d: str(d).removeprefix("torch.")  # noqa: E731
        table = []
        for u in self.spec.units:
            opt = optree.tree_leaves(self.opt_state.get(u.name), namespace=NAMESPACE)
            copy = self.copies.get(u.name)
            per_rank = sum(t.nbytes for t in opt + [self.params[u.name]] if isinstance(t, torch.Tensor)) + (
                0 if copy is None else copy.nbytes)
            table.append((u.name, len(u.slots), u.used_numel, u.numel, u.shard_numel, dt(u.dtype),
                          dt(self.compute_dtype(u.name)), per_rank))
        table.append(("total", *(sum(r[i] for r in table) for i in range(1, 5)), "", "", sum(r[7] for r in table)))
        w = max(len("unit"), *(len(r[0]) for r in table)) + 2  # the longest unit name sets the first column
        rows.append(f"  {'unit':<{w}}{'params':>7}{'numel':>12}{'padded':>12}{'shard':>11}{'master':>10}"
                    f"{'compute':>10}{'bytes/rank':>14}")
        rows += [f"  {n:<{w}}{k:>7}{a:>12,}{b:>12,}{c:>11,}{d:>10}{e:>10}{f:>14,}" for n, k, a, b, c, d, e, f in table]
        nb = self.nbytes()
        copies = f", {dt(next(iter(self.copies.values())).dtype)} copies {nb['copies']:,} B" if self.copies else ""
        rows.append(f"  per rank: params {nb['params']:,} B{copies}, opt_state {nb['opt_state']:,} B, "
                    f"grads (in step) {nb['grads']:,} B, buffers {nb['buffers']:,} B ({len(self.buffers)} replicated)"
                    + (f", in a store {nb['stored']:,} B" if nb["stored"] else ""))
        rows += [f"  {n}: {p!r}" for n, p in self.params.items() if not isinstance(p, torch.Tensor)]
        for name, s in self.opt_state.items():  # leaves that live in a store: key, bytes, location
            stored = [(f, getattr(s, f)) for f in getattr(s, "__dataclass_fields__", {})
                      if not isinstance(getattr(s, f), torch.Tensor)]
            rows += [f"  {name}.{f}: {v!r}" for f, v in stored]
        rows += [f"  transform_state[{k!r}]: {_describe(v)}" for k, v in self.transform_state.items()]
        return "\n".join(rows)

    def compute_dtype(self, unit: str) -> torch.dtype:
        """The dtype a step computes ``unit`` in, as this state records it: the ``param_dtype`` of a transform
        state that has one (``fs.mixed_precision``'s, once a step or ``step.init`` put it there), else the unit's
        master dtype."""
        for entry in self.transform_state.values():
            if isinstance(getattr(entry, "param_dtype", None), torch.dtype):
                return entry.param_dtype
        return self.spec.unit(unit).dtype


def _describe(obj) -> str:
    """``obj`` for print(state): its repr, unless that holds an object's address (a function's repr does): then a
    dataclass as ``Name(field=value, ...)`` over its repr fields, a function by its name (``<lambda>`` for a lambda),
    anything else by its type's name."""
    text = repr(obj)
    if " at 0x" not in text:
        return text
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = [f"{f.name}={_describe(getattr(obj, f.name))}" for f in dataclasses.fields(obj) if f.repr]
        return f"{type(obj).__name__}({', '.join(fields)})"
    if isinstance(obj, (tuple, list)):
        inner = ", ".join(_describe(x) for x in obj)
        return f"({inner}{',' if len(obj) == 1 else ''})" if isinstance(obj, tuple) else f"[{inner}]"
    return getattr(obj, "__name__", type(obj).__name__)


_CHILDREN = ("params", "opt_state", "step", "skipped", "buffers", "transform_state", "copies")
optree.register_pytree_node(
    TrainState, lambda s: (tuple(getattr(s, f) for f in _CHILDREN), s.spec, _CHILDREN),
    lambda spec, children: TrainState(spec=spec, **dict(zip(_CHILDREN, children))), namespace=NAMESPACE)
TrainState.__setattr__ = _frozen_setattr
TrainState.__delattr__ = _frozen_setattr
