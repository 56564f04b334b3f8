"""Hypothesis strategies and invariant checkers for fshard states, for your own tests.

    from hypothesis import given
    import fshard.testing as ft

    @given(ft.param_trees(), ft.world_sizes())
    def test_roundtrip(tree, n):
        ft.check_roundtrip(tree, n)

Strategies generate parameter pytrees and small random modules whose shapes include 0-dim, empty and prime sizes,
in fp32, bf16 and fp16, and world sizes 1-8. Checkers raise AssertionError with a message saying which invariant
failed where.
"""
from __future__ import annotations

import optree
import torch
import torch.nn as nn
from hypothesis import strategies as st

from .state._flat import UnitLayout, flatten, plan_unit, shard, unshard
from .state._train_state import NAMESPACE, TrainState

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_DIMS = (0, 1, 2, 3, 5, 7, 11, 13, 31)  # includes empty and prime sizes


def dtypes() -> st.SearchStrategy[torch.dtype]:
    return st.sampled_from(DTYPES)


def world_sizes(max_size: int = 8) -> st.SearchStrategy[int]:
    return st.integers(1, max_size)


def shapes() -> st.SearchStrategy[tuple[int, ...]]:
    """0-dim, empty and prime-sized shapes of up to 3 dims."""
    return st.one_of(st.just(()), st.lists(st.sampled_from(_DIMS), min_size=1, max_size=3).map(tuple))


@st.composite
def tensors(draw, shape=None, dtype=None) -> torch.Tensor:
    shape = draw(shapes()) if shape is None else shape
    dtype = draw(dtypes()) if dtype is None else dtype
    seed = draw(st.integers(0, 2**31 - 1))
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@st.composite
def param_trees(draw, dtype=None, min_size: int = 1, max_size: int = 8) -> dict[str, torch.Tensor]:
    """A flat dict name -> tensor, all of one dtype (a unit holds one dtype)."""
    dtype = draw(dtypes()) if dtype is None else dtype
    names = draw(st.lists(st.from_regex(r"[a-z]{1,6}", fullmatch=True), min_size=min_size, max_size=max_size,
                          unique=True))
    return {n: draw(tensors(dtype=dtype)) for n in names}


class RandomBlock(nn.Module):
    """Parameters of arbitrary shapes, each used in a differentiable way (even empty and 0-dim ones)."""

    def __init__(self, shapes_, dtype, frozen=()):
        super().__init__()
        self.ps = nn.ParameterList(
            nn.Parameter(torch.randn(s).to(dtype) * 0.5, requires_grad=i not in frozen) for i, s in enumerate(shapes_))

    def forward(self, h):
        for p in self.ps:
            h = h * (1 + 0.1 * torch.tanh(p.float()).sum()) + 0.01 * p.float().sum()
        return h


class RandomModule(nn.Module):
    """Root parameters plus a ModuleList of blocks (the default units), with a buffer."""

    def __init__(self, root_shapes, block_shapes, dtype=torch.float32, frozen=()):
        super().__init__()
        self.root = RandomBlock(root_shapes, dtype, frozen)
        self.blocks = nn.ModuleList(RandomBlock(s, dtype) for s in block_shapes)
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, x):
        h = self.root(x) * self.scale
        for b in self.blocks:
            h = b(h)
        return h


@st.composite
def modules(draw, dtype=None, max_blocks: int = 3) -> RandomModule:
    dtype = draw(dtypes()) if dtype is None else dtype
    root = draw(st.lists(shapes(), min_size=1, max_size=4))
    blocks = draw(st.lists(st.lists(shapes(), min_size=1, max_size=3), min_size=0, max_size=max_blocks))
    frozen = draw(st.sets(st.integers(0, len(root) - 1), max_size=len(root) - 1))
    torch.manual_seed(draw(st.integers(0, 2**31 - 1)))
    return RandomModule(root, blocks, dtype, frozen)


def module_loss(module, x):
    """A loss for RandomModule: a scalar that depends on every parameter."""
    return module(x).float().square().mean()


# ---------------------------------------------------------------- checkers


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a tensor: compares NaNs and -0.0 exactly, where == would not."""
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def layout_of(tree: dict[str, torch.Tensor], world_size: int, frozen=()) -> UnitLayout:
    dtype = next(iter(tree.values())).dtype
    entries = [((n,), tuple(t.shape), n not in frozen) for n, t in tree.items()]
    return plan_unit("unit", "", entries, dtype, world_size)


def check_roundtrip(tree: dict[str, torch.Tensor], world_size: int) -> None:
    """unshard(shard(x)) == x, bit for bit, for every parameter, assembling all ranks' shards."""
    layout = layout_of(tree, world_size)
    flat = flatten(layout, tree)
    back = unshard([shard(layout, tree, r) for r in range(world_size)])
    assert torch.equal(_bits(back), _bits(flat)), "unshard(shard(x)) differs from x"
    for s in layout.slots:
        got = back[s.offset:s.offset + s.numel].view(s.shape)
        assert torch.equal(_bits(got), _bits(tree[s.name])), f"{s.name} changed"


def check_tiling(layout: UnitLayout, flat: torch.Tensor | None = None) -> None:
    """Shards tile the padded flat buffer with no gap or overlap; slots don't overlap; padding is zero."""
    n = layout.world_size
    assert layout.numel % n == 0, f"{layout.name}: numel {layout.numel} not a multiple of world size {n}"
    ranges = [layout.shard_range(r) for r in range(n)]
    assert ranges[0][0] == 0 and ranges[-1][1] == layout.numel, f"{layout.name}: shards do not cover the buffer"
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])), f"{layout.name}: gap or overlap between shards"
    covered = torch.zeros(layout.numel, dtype=torch.int32)
    for s in layout.slots:
        assert 0 <= s.offset and s.offset + s.numel <= layout.numel, f"{s.name} outside the buffer"
        covered[s.offset:s.offset + s.numel] += 1
    assert int(covered.max()) <= 1, f"{layout.name}: slots overlap"
    if flat is not None:
        pad = flat[covered == 0]
        assert bool((pad == 0).all()), f"{layout.name}: padding is not zero"


def check_same_structure(before: TrainState, after: TrainState) -> None:
    """Same tree structure, and every leaf has the same shape and dtype (so the same shard sizes)."""
    la, sa = optree.tree_flatten(before, namespace=NAMESPACE)
    lb, sb = optree.tree_flatten(after, namespace=NAMESPACE)
    assert sa == sb, f"tree structure changed:\n{sa}\n->\n{sb}"
    for path, a, b in zip(optree.tree_paths(before, namespace=NAMESPACE), la, lb):
        assert (a.shape, a.dtype, a.device) == (b.shape, b.dtype, b.device), \
            f"leaf {path}: {a.shape}/{a.dtype} -> {b.shape}/{b.dtype}"


def snapshot(state: TrainState) -> list[torch.Tensor]:
    """Copies of every leaf, to compare against after a step (check_unchanged)."""
    return [_value(t) for t in optree.tree_leaves(state, namespace=NAMESPACE)]


def _value(leaf) -> torch.Tensor:
    """A leaf's data: a copy of a tensor, or a stored leaf (fs.offload_state) read back from its store."""
    return leaf.load() if hasattr(leaf, "load") else leaf.detach().clone()


def check_unchanged(state: TrainState, snap: list[torch.Tensor]) -> None:
    """Every leaf still equals its snapshot, bit for bit: nothing mutated the state."""
    for path, t, s in zip(optree.tree_paths(state, namespace=NAMESPACE),
                          optree.tree_leaves(state, namespace=NAMESPACE), snap):
        assert torch.equal(_bits(_value(t)), _bits(s)), f"leaf {path} was mutated"


def check_memory_bound(state: TrainState, moments: int = 2) -> None:
    """This rank's params + grads + optimizer state <= (those of the whole model) / shard size + padding (the
    world size on a 1-D mesh; on a 2-D mesh each rank holds 1/k of the model, k its shard group's ranks).

    ``moments``: optimizer tensors per trainable element (2 for AdamW). Padding is the layout's alignment and
    world-size padding, plus the per-parameter step counts. The bound is for models without frozen parameters:
    frozen parameters sit at the end of their unit, so the ranks holding the trainable prefix hold all of its
    optimizer state (frozen parameters themselves have none).
    """
    n = state.spec.mesh.shard_size
    nb = state.nbytes()
    held = nb["params"] + nb["grads"] + nb["opt_state"]
    total = padding = 0.0
    for u in state.spec.units:
        item, per_elem = u.dtype.itemsize, 1 + (1 + moments) * bool(u.trainable)
        used = sum(s.numel for s in u.slots)
        total += sum(s.numel * item * (1 + (1 + moments) * s.requires_grad) for s in u.slots)
        padding += (u.numel - used) * item * per_elem / n + 8 * len(u.trainable)
    assert held <= total / n + padding + 1e-6, \
        f"rank {state.spec.mesh.rank} holds {held} B > total/N + padding = {total / n:.0f} + {padding:.0f} B"


def check_same_collectives(traces: list[tuple]) -> None:
    """Every rank issued the same collectives in the same order (pass metrics['trace/collectives'] per rank)."""
    first = list(traces[0])
    for r, t in enumerate(traces[1:], 1):
        t = list(t)
        if t != first:
            i = next((i for i, (a, b) in enumerate(zip(first, t)) if a != b), min(len(first), len(t)))
            raise AssertionError(f"rank {r} diverges from rank 0 at collective {i}: "
                                 f"{first[i] if i < len(first) else None} vs {t[i] if i < len(t) else None}")

