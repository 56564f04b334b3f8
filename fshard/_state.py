"""TrainState: the whole training state as an immutable pytree of shards, plus its static description.

Leaves are tensors (this rank's shards, the replicated buffers, the step count); everything static — the module
template, the unit layouts, the mesh, the optimizer — sits in ``ShardSpec``, the pytree's metadata. All nodes are
registered with optree under the "fshard" namespace: ``optree.tree_leaves(state, namespace="fshard")``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import optree
import torch

from ._errors import DonatedStateError, FrozenStateError
from ._layout import UnitLayout

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


@dataclass(frozen=True, eq=False)
class ShardSpec:
    """What never changes during training: the static half of a TrainState."""

    template: Any                 # the nn.Module, on the meta device, with its unit modules routed through fshard
    units: tuple[UnitLayout, ...]
    param_names: tuple[str, ...]  # canonical names in model.named_parameters() order
    mesh: Any
    optimizer: Any
    fingerprint: int              # identical on every rank that built the same model: checked each step

    def unit(self, name: str) -> UnitLayout:
        return next(u for u in self.units if u.name == name)


@dataclass(frozen=True, eq=False)
class TrainState:
    """params: unit name -> this rank's shard. opt_state: unit name -> optimizer state of that shard (units with
    no trainable parameter have none). step: number of steps taken. buffers: name -> replicated buffer."""

    params: dict[str, torch.Tensor]
    opt_state: dict[str, Any]
    step: torch.Tensor
    buffers: dict[str, torch.Tensor]
    spec: ShardSpec

    def replace(self, **changes) -> "TrainState":
        return dataclasses.replace(self, **changes)

    @property
    def mesh(self):
        return self.spec.mesh

    def check_usable(self) -> None:
        if self.__dict__.get("_donated"):
            raise DonatedStateError(
                "this TrainState was donated to a step (compose(..., donate=True)), which updated its tensors in "
                "place; use the state that step returned, or compose without donate=True to keep inputs intact.")

    def nbytes(self) -> dict[str, int]:
        """Bytes this rank holds in memory, by part (gradient shards exist only inside a step; they are counted
        too), and ``stored``: the bytes of leaves that live in a store (fs.offload_state)."""
        leaves = lambda t: optree.tree_leaves(t, namespace=NAMESPACE)  # noqa: E731
        grads = sum(self.params[u.name].nbytes for u in self.spec.units if u.trainable)  # one reduced shard each
        opt = leaves(self.opt_state)
        return {"params": sum(t.nbytes for t in leaves(self.params)),
                "grads": grads,
                "opt_state": sum(t.nbytes for t in opt if isinstance(t, torch.Tensor)),
                "buffers": sum(t.nbytes for t in leaves(self.buffers)),
                "stored": sum(t.nbytes for t in opt if not isinstance(t, torch.Tensor))}

    def __repr__(self) -> str:
        m = self.spec.mesh
        rows = [f"TrainState(step={int(self.step)}, {m}, optimizer={self.spec.optimizer})",
                f"  {'unit':<24}{'params':>7}{'numel':>12}{'padded':>12}{'shard':>11}{'dtype':>10}{'bytes/rank':>12}"]
        for u in self.spec.units:
            opt = optree.tree_leaves(self.opt_state.get(u.name), namespace=NAMESPACE)
            per_rank = self.params[u.name].nbytes + sum(t.nbytes for t in opt)
            rows.append(f"  {u.name:<24}{len(u.slots):>7}{u.used_numel:>12,}{u.numel:>12,}{u.shard_numel:>11,}"
                        f"{str(u.dtype).removeprefix('torch.'):>10}{per_rank:>12,}")
        nb = self.nbytes()
        rows.append(f"  per rank: params {nb['params']:,} B, opt_state {nb['opt_state']:,} B, "
                    f"grads (in step) {nb['grads']:,} B, buffers {nb['buffers']:,} B ({len(self.buffers)} replicated)"
                    + (f", in a store {nb['stored']:,} B" if nb["stored"] else ""))
        for name, s in self.opt_state.items():  # leaves that live in a store: key, bytes, location
            stored = [(f, getattr(s, f)) for f in getattr(s, "__dataclass_fields__", {})
                      if not isinstance(getattr(s, f), torch.Tensor)]
            rows += [f"  {name}.{f}: {v!r}" for f, v in stored]
        return "\n".join(rows)


optree.register_pytree_node(
    TrainState,
    lambda s: ((s.params, s.opt_state, s.step, s.buffers), s.spec, ("params", "opt_state", "step", "buffers")),
    lambda spec, children: TrainState(*children, spec=spec),
    namespace=NAMESPACE)
TrainState.__setattr__ = _frozen_setattr
TrainState.__delattr__ = _frozen_setattr
