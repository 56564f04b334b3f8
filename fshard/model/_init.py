"""fs.init and fs.full_params: from an nn.Module to a sharded TrainState, and back to full tensors.

init never needs the whole model on one rank: a model built on the meta device is materialised one unit at a
time (a copy of the unit's modules, initialised by ``reset_parameters`` or ``init_fn``), and each rank cuts its
shard straight from it (``_layout.shard``) and drops the copy before the next unit; a model on the CPU is sharded the
same way, unit by unit. tests/test_init_memory.py measures the peak.
"""
from __future__ import annotations

import copy
import ctypes.util
import functools
import uuid
import zlib
from typing import Callable

import torch
import torch.nn as nn

from ..dist._agreement import HASH_BITS, agree
from ..dist._collectives import Comm
from ..errors import ArgumentError, ArgumentTypeError, InitError, RankDivergenceError
from ..state._flat import ALIGN_BYTES, ROOT, UnitLayout, plan_unit, shard, views
from ..dist._mesh import Mesh
from ..state._placement import place_unit, placement_for
from ..state._stored import resident
from ..state._train_state import ShardSpec, TrainState
from ..store._checksum import checksum
from ..run._dispatch import route_units
from ..run._routed_groups import route_groups, routed_groups
from ._wrapped import check_not_wrapped


def init(model: nn.Module, mesh: Mesh, opt, *, units=None, routed=None,
         init_fn: Callable[[nn.Module], None] | None = None,
         seed: int | None = None, align_bytes: int = ALIGN_BYTES, abstract: bool = False,
         offload=None) -> TrainState:
    """Shard ``model`` over ``mesh`` and make the optimizer state of each shard.

    units: module paths (or modules) that each form one unit; by default every child of every ModuleList or
    Sequential. Parameters outside all units, and parameters tied across units, form the root unit.
    routed: modules (paths or modules) that call a data-dependent subset of their children, as a mixture-of-experts
    layer calls its experts: each child becomes a unit, and a call of the container gathers, reduces and frees all
    of them on every rank, whatever each rank's tokens use (run/_routed_groups.py). A module without such children
    (fused experts: one module of 3-D parameters for all experts, as in transformers 5) is an ArgumentError: it is
    gathered whole at each call already, so it needs no routed= (units=[...] makes it a unit of its own).
    init_fn / seed: for a model on the meta device, each unit is materialised with ``init_fn(module)`` (or each
    module's ``reset_parameters()``) under a seed derived from ``seed`` (default ``torch.initial_seed()``) and the
    unit's index, so the initial weights do not depend on the world size.
    The order is Hugging Face's (``PreTrainedModel.initialize_weights``): children before parents, so a parent's
    ``init_fn`` call overrides what its children's calls wrote (GPT-2's scaled ``c_proj``, T5's projections), and
    ties after: while ``init_fn`` runs, every name of a tied parameter has its own tensor, and the parameter keeps
    the value of its tie source (``model.all_tied_weights_keys`` on an HF model, else its first name in
    ``model.named_parameters()``), as HF ties after initialising. Calls run under ``torch.no_grad()``, once per
    module of a unit, on a copy whose other units are empty placeholders: ``init_fn(module)`` may write the
    parameters and buffers of ``module`` and of its submodules in the same unit, not those of other units. For an
    HF model pass ``init_fn=model._init_weights``.
    abstract: materialise nothing, as ``jax.eval_shape``: the shards, moments and (for a meta model) buffers are
    tensors on the meta device with the shapes and dtypes of the real ones. Such a state is only a ``like`` for
    ``fs.load``, which allocates each rank's shards and fills them, so resuming never holds the model whole; a
    step, a save or ``fs.full_params`` refuses it.
    offload: the ``fs.offload_state(store, ...)`` the step will be composed with (any ``fs.state.Placement``): the
    moments (and, with ``params=True``, the parameter shards) it keeps in a store are put there as each unit is
    made, so the device never holds more than one unit's moments and parameters (fshard/state/_placement.py). Moving
    them on the first step instead needs every moment on the device first: a 6.3B-parameter GPT's 50 GB of moments
    beside its 25 GB of fp32 weights ran an H100 out of memory at init.
    """
    _check_args(model, mesh, opt, units, init_fn, seed, align_bytes)
    device = _check_devices(model, mesh)
    opt = opt.bind(model)  # evaluates the optimizer's per-parameter choices (a weight-decay mask) once
    unit_mods = _find_units(model, units)
    groups = routed_groups(model, routed, unit_mods)
    owners, aliases = _assign(model, unit_mods)
    layouts = _plan(model, unit_mods, owners, aliases, mesh.shard_size, align_bytes)  # (2-D: the shard group's)
    buffers: dict[str, torch.Tensor] = {}
    if abstract:  # shapes and dtypes only
        values = ((u, None) for u in layouts)
        buffers.update((n, b.detach().to(mesh.device, copy=True) if device.type != "meta" else b.detach())
                       for n, b in model.named_buffers())
    elif device.type == "meta":
        values = _materialize(model, unit_mods, aliases, layouts, mesh.device, init_fn,
                              torch.initial_seed() if seed is None else seed, buffers)
    else:
        params_of = {n: p.detach() for n, p in model.named_parameters()}
        values = ((u, {s.name: params_of[s.name] for s in u.slots}) for u in layouts)
        buffers.update((n, b.detach().to(mesh.device, copy=True)) for n, b in model.named_buffers())

    params, opt_state, digests = {}, {}, {}
    # where offload= keeps each unit: written there as the unit is made (the units the optimizer makes state for)
    where = ({} if abstract or offload is None else
             placement_for(offload, [u for u in layouts if u.trainable], mesh.shard_rank, "fs.init(..., offload=)"))
    rows, tag = tuple(r.name for r in opt.rows), uuid.uuid4().hex[:8]
    for u, full in values:  # one unit's full values alive at a time; only this rank's shard is kept
        if mesh.group is not None and full is not None:
            digests[u.name] = _digest(full[s.name] for s in u.slots)
        params[u.name] = (shard(u, full, mesh.shard_rank, mesh.device) if not abstract else
                          torch.empty(u.shard_numel, dtype=u.dtype, device="meta"))
        del full
        state = opt.init(u, mesh.shard_rank, params[u.name])
        if state is not None and u.name in where:
            params[u.name], state = place_unit(where[u.name], u, mesh.shard_rank, params[u.name], state, rows,
                                               f"{u.name}@init-{tag}")
        if state is not None:
            opt_state[u.name] = state
    params = {u.name: params[u.name] for u in layouts}  # layout order (the root may come last from _materialize)
    buffers = {n: buffers[n] for n, _ in model.named_buffers()}
    template = _make_template(model)
    route_units(template, layouts)
    named = {u.name for u in layouts}
    groups = tuple((path, tuple(m for m in members if m in named)) for path, members in groups)
    route_groups(template, groups)
    names = tuple(n for n, _ in model.named_parameters())
    spec = ShardSpec(template, tuple(layouts), names, mesh, opt,
                     zlib.crc32(repr((layouts, names, tuple(buffers), groups)).encode()) & ((1 << HASH_BITS) - 1),
                     groups)
    if mesh.group is not None:  # (a mesh without a process group has no other rank to agree with)
        _agree_on_values(mesh, spec.fingerprint, digests,
                         {} if abstract else {n: _digest([b]) for n, b in buffers.items()})
    return TrainState(params, opt_state, torch.zeros((), dtype=torch.int64), buffers, spec)


def _digest(tensors) -> int:
    """A hash of the tensors' bytes, the same on every rank that holds the same values (fshard.store's checksum)."""
    h = 0
    for t in tensors:
        u8 = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        h = zlib.crc32(checksum(u8).to_bytes(16, "little") + str(t.dtype).encode(), h)
    return h & ((1 << HASH_BITS) - 1)


def _agree_on_values(mesh: Mesh, fingerprint: int, units: dict, buffers: dict) -> None:
    """Do all ranks hold the same model, layout and initial values? Every rank shards what it holds, so ranks that
    built the model under different seeds would otherwise stitch shards of different models together (DDP
    broadcasts rank 0's parameters at construction for the same reason). One all-reduce; every rank raises alike."""
    comm = Comm(mesh, context="fs.init")
    _, same = agree(comm, [], [fingerprint, *units.values(), *buffers.values()])
    if not same[0]:
        raise RankDivergenceError("fs.init: ranks built different models (parameter names, shapes, dtypes, units or "
                                  "buffers differ); build the same model with the same units on every rank.")
    bad = [n for n, ok in zip(list(units) + list(buffers), same[1:]) if not ok]
    if bad:
        raise RankDivergenceError(
            f"fs.init: ranks hold different initial values for {len(bad)} unit(s) or buffer(s): {bad[:8]}"
            f"{' ...' if len(bad) > 8 else ''}. Each rank keeps its shard of what it holds, so training would stitch "
            "together pieces of different models. Seed every rank alike before building the model "
            "(torch.manual_seed(s) on each rank), or load the same weights everywhere; a model built on the meta "
            "device is initialised by fs.init from seed=, which must then be the same on every rank.")


def full_params(state: TrainState) -> dict[str, torch.Tensor]:
    """Collective: every parameter at full size, keys and order as in ``model.named_parameters()``."""
    if not isinstance(state, TrainState):
        raise ArgumentTypeError(f"fs.full_params(state): state must be an fs.TrainState, got {type(state).__name__}.")
    spec = state.spec
    spec.mesh.check_alive()
    comm, out = Comm(spec.mesh, verify=True, context="fs.full_params"), {}
    try:  # each gather is checked first: a rank that fails (an abstract or donated state, a store that cannot be
        state.check_usable()  # read) tells the others at their next check, where every rank raises
        for u in spec.units:
            flat = torch.empty(u.numel, dtype=u.dtype, device=spec.mesh.device)
            comm.all_gather(flat, resident(state.params[u.name]).to(flat.device), u.name)
            out.update(views(flat, u))
    except Exception as e:
        comm.fail(e)
        raise
    return {n: out[n] for n in spec.param_names}


def _check_args(model, mesh, opt, units, init_fn, seed, align_bytes) -> None:
    """fs.init's arguments, each refused with what it takes (rather than an AttributeError deep inside)."""
    if not isinstance(model, nn.Module):
        raise ArgumentTypeError(f"fs.init(model, mesh, opt): model must be a torch.nn.Module, got "
                                f"{type(model).__name__}.")
    check_not_wrapped(model)  # DDP, DataParallel, FSDP1/2, torch.compile: the plain module is what fshard takes
    if not isinstance(mesh, Mesh):
        raise ArgumentTypeError(f"fs.init(model, mesh, opt): mesh must be an fs.Mesh (fs.Mesh.from_env() under "
                                f"torchrun, fs.Mesh.local() for one rank), got {type(mesh).__name__}.")
    if not all(callable(getattr(opt, m, None)) for m in ("bind", "init", "plan", "apply", "fingerprint")):
        raise ArgumentTypeError(
            f"fs.init(model, mesh, opt): opt must be an fshard optimizer such as fs.adamw(lr=...), got "
            f"{type(opt).__module__}.{type(opt).__name__}. fshard keeps the optimizer state sharded in the TrainState, "
            "so a torch.optim optimizer cannot be used; fs.adamw and fs.optim.sgd, adam, adagrad, rmsprop have torch's "
            "arithmetic and arguments, and fs.optim.from_torch(torch.optim.X, **kwargs) runs any elementwise one.")
    if units is not None and (isinstance(units, (str, nn.Module)) or not hasattr(units, "__iter__")):
        raise ArgumentTypeError(f"fs.init(units={units!r}): units must be a list of module paths or modules, e.g. "
                                "units=['blocks.0', 'blocks.1'].")
    if init_fn is not None and not callable(init_fn):
        raise ArgumentTypeError(f"fs.init(init_fn={init_fn!r}): init_fn must be callable as init_fn(module), e.g. "
                                "model._init_weights for a Hugging Face model.")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise ArgumentTypeError(f"fs.init(seed={seed!r}): seed must be an int (the same on every rank).")
    if not isinstance(align_bytes, int) or align_bytes < 16 or align_bytes % 16:
        raise ArgumentError(f"fs.init(align_bytes={align_bytes!r}): align_bytes must be a positive multiple of 16 "
                            f"(default {ALIGN_BYTES}: each parameter and shard starts on a cache line).")
    lazy = [n for n, p in model.named_parameters() if isinstance(p, nn.parameter.UninitializedTensorMixin)]
    if lazy:
        raise InitError(f"fs.init: the model has uninitialized (lazy) parameters {lazy[:5]}, whose shapes forward "
                        "decides. Run one forward on a dummy batch before fs.init, so that they exist.")
    if not any(True for _ in model.parameters()):
        raise InitError(f"fs.init: the model ({type(model).__name__}) has no parameters: nothing to shard or train.")
    params = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    for n, b in model.named_buffers(remove_duplicate=False):
        if id(b) in params:  # (fshard trains a parameter's shards and keeps a buffer whole: the two would part)
            raise InitError(f"fs.init: buffer {n!r} is the tensor of parameter {params[id(b)]!r}; register it once, "
                            "or register a copy as the buffer (register_buffer(name, param.detach().clone())).")


def _check_devices(model: nn.Module, mesh: Mesh) -> torch.device:
    where: dict[torch.device, str] = {}
    for n, t in list(model.named_parameters()) + list(model.named_buffers()):
        where.setdefault(t.device, n)
    if len(where) > 1:
        listing = ", ".join(f"{n!r} on {d}" for d, n in where.items())
        raise InitError(f"fs.init: the model's parameters and buffers are on mixed devices ({listing}). Put the "
                        "whole model on one device (model.to(device)), or build it on the meta device "
                        "(with torch.device('meta'): model = ...) and fs.init materialises it on the mesh's device.")
    device = next(iter(where), mesh.device)
    if device.type not in ("meta", "cpu", mesh.device.type):
        raise InitError(f"fs.init: the model is on {device} but the mesh ({mesh}) computes on {mesh.device}. Build "
                        f"the model on the CPU or the meta device, or start the mesh with a {device.type} backend.")
    return device


def _find_units(model: nn.Module, units) -> list[tuple[str, nn.Module]]:
    paths = {id(m): p for p, m in model.named_modules()}
    if units is None:
        found, seen = [], set()
        for path, m in model.named_modules():
            if isinstance(m, (nn.ModuleList, nn.Sequential)):
                for cname, c in m.named_children():
                    if id(c) not in seen and id(c) != id(model):
                        seen.add(id(c))
                        found.append((f"{path}.{cname}" if path else cname, c))
    else:
        found = []
        for u in units:
            try:
                m = model.get_submodule(u) if isinstance(u, str) else u
            except AttributeError:  # a path that names no submodule
                m = None
            if id(m) not in paths or m is model:
                raise InitError(f"fs.init(units=...): {u!r} is not a submodule of the model. Pass module paths as in "
                                "model.named_modules() (e.g. 'blocks.0') or the submodules themselves.")
            found.append((paths[id(m)], m))
    return [("", model)] + found


def _assign(model, unit_mods):
    """Owning unit of each parameter (canonical name -> unit index), and canonical name -> all of its names.
    A parameter reached from two units (tied across them) belongs to the root, which is gathered all forward."""
    unit_of_module = {id(m): i for i, (_, m) in enumerate(unit_mods)}
    modules = dict(model.named_modules(remove_duplicate=False))
    canonical, aliases, owners = {}, {}, {}
    for name, p in model.named_parameters(remove_duplicate=False):
        canon = canonical.setdefault(id(p), name)
        aliases.setdefault(canon, []).append(name)
        parts = name.split(".")[:-1]
        owner = next((unit_of_module[id(modules[".".join(parts[:k])])] for k in range(len(parts), 0, -1)
                      if id(modules[".".join(parts[:k])]) in unit_of_module), 0)
        owners.setdefault(canon, set()).add(owner)
    return {n: (o.pop() if len(o) == 1 else 0) for n, o in owners.items()}, aliases


def _plan(model, unit_mods, owners, aliases, world_size, align_bytes) -> list[UnitLayout]:
    layouts = []
    params = dict(model.named_parameters())
    for i, (path, _) in enumerate(unit_mods):
        mine = [n for n in params if owners[n] == i]
        if not mine:
            continue
        dtypes = {params[n].dtype for n in mine}
        if len(dtypes) > 1:
            raise InitError(f"fs.init: unit {path or ROOT!r} mixes parameter dtypes {sorted(map(str, dtypes))}; a "
                            "unit is one flat buffer of one dtype. Cast the model to one dtype, or pass units=[...] "
                            "so that parameters of different dtypes fall in different units.")
        entries = [(tuple(aliases[n]), tuple(params[n].shape), params[n].requires_grad) for n in mine]
        layouts.append(plan_unit(path or ROOT, path, entries, dtypes.pop(), world_size, align_bytes))
    return layouts


def _materialize(model, unit_mods, aliases, layouts, device, init_fn, seed, buffers: dict):
    """Yield (layout, canonical name -> full value) for each layout as soon as its values exist, materialising one
    unit copy at a time (the other units as placeholders) and filling ``buffers``. A unit's own layout comes right
    after its copy; the root's comes last, because a parameter tied across units belongs to the root but takes its
    value from the unit copy that holds its tie source. In a copy, each name of a tied parameter is its own tensor
    while the modules are initialised (children first), so the tie is made after init, as HF makes it."""
    to_canon = {a: c for c, names in aliases.items() for a in names}
    source = _tie_sources(model, aliases)
    by_module = {u.module: u for u in layouts}
    root = by_module.get("")
    root_names = {s.name for s in root.slots} if root is not None else set()
    held = {}  # the root's values, until the root's turn: canonical name -> (not the source, value)
    for i, (path, mod) in enumerate(unit_mods):
        placeholders = {id(m): nn.Module() for j, (_, m) in enumerate(unit_mods) if j != i}
        skip = {id(p) for p in placeholders.values()}
        part = copy.deepcopy(mod, dict(placeholders))
        _untie(part, path, to_canon, source)
        part.to_empty(device=device)
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed((seed * 1_000_003 + i) % (1 << 63))
            for sub_path, sub in _children_first(part):
                if id(sub) not in skip:
                    _init_module(sub, f"{path}.{sub_path}".strip("."), init_fn, skip)
        mine = {}
        for n, p in part.named_parameters(prefix=path, remove_duplicate=False):
            c = to_canon[n]
            got = held if c in root_names else mine
            if c not in got or (got[c][0] and n == source[c]):  # the source's value, else the first name's
                got[c] = (n != source[c], p.detach())
        buffers.update((n, b.detach()) for n, b in part.named_buffers(prefix=path))
        del part
        if i > 0 and path in by_module:
            yield by_module[path], {c: v for c, (_, v) in mine.items()}
        del mine
        _trim_heap()  # the copy is gone: give its pages back before the next one
    if root is not None:
        yield root, {c: v for c, (_, v) in held.items()}


def _tie_sources(model, aliases) -> dict[str, str]:
    """Canonical name -> the name whose initial value a tied parameter keeps: the source of an HF tie
    (``all_tied_weights_keys``: target -> source), else the first name, as ``named_parameters()`` lists them."""
    source = {c: c for c in aliases}
    to_canon = {a: c for c, names in aliases.items() for a in names}
    hf = getattr(model, "all_tied_weights_keys", None)
    for target, src in (hf.items() if isinstance(hf, dict) else ()):
        if to_canon.get(target) is not None and to_canon.get(target) == to_canon.get(src):
            source[to_canon[src]] = src
    return source


def _untie(part: nn.Module, path: str, to_canon: dict, source: dict) -> None:
    """Give every name of a tied parameter but its source a tensor of its own in the (still meta) copy ``part``.
    (``to_empty`` happens to untie them too, but not under ``torch.__future__``'s swap of module params.)"""
    for n, p in list(part.named_parameters(prefix=path, remove_duplicate=False)):
        if n == source[to_canon[n]]:
            continue
        mod_path, _, attr = n[len(path):].lstrip(".").rpartition(".")
        owner = part.get_submodule(mod_path)
        owner._parameters[attr] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)


def _children_first(module: nn.Module, prefix: str = "", seen: set | None = None):
    """(path, module) of ``module``'s tree, each module after its children, as HF's ``smart_apply`` visits them;
    a module reached at two paths comes once, at the first."""
    seen = set() if seen is None else seen
    seen.add(id(module))
    for name, child in module.named_children():
        if id(child) not in seen:
            yield from _children_first(child, f"{prefix}.{name}" if prefix else name, seen)
    yield prefix, module


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to call
        return None


def _trim_heap() -> None:
    """Return freed heap pages to the OS. glibc keeps a dropped unit copy's memory in its heap, where the shards and
    moments kept since fragment it, so without this the RSS of a meta init grows by about half a unit per unit
    (measured: 285 MiB over 32 units of 16 MiB, benchmarks/RESULTS.md)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def _init_module(m: nn.Module, path: str, init_fn, placeholders: set) -> None:
    if init_fn is not None:
        try:
            init_fn(m)
        except AttributeError as e:
            if not any(id(x) in placeholders for x in m.modules()):
                raise
            raise InitError(f"fs.init: init_fn({path or ROOT!r}) failed ({e}) on a copy of the unit in which the "
                            "other units are empty placeholders: init_fn(module) may only write module's own "
                            "tensors and those of its submodules in the same unit. Initialise each unit's tensors "
                            "in the call for a module inside that unit, or pass units=[...] so that the module and "
                            "what it initialises fall in one unit.") from e
        return
    own = list(m._parameters.values()) + list(m._buffers.values())
    if not any(t is not None for t in own):
        return
    if not hasattr(m, "reset_parameters"):
        raise InitError(f"fs.init: module {path or ROOT!r} ({type(m).__name__}) is on the meta device and has its "
                        "own parameters or buffers but no reset_parameters(). Pass init_fn=fn, called as fn(module) "
                        "for every module, or build the model on the CPU.")
    m.reset_parameters()


def _make_template(model: nn.Module) -> nn.Module:
    """A copy of the model whose tensors are all on the meta device: structure and code, no data."""
    memo = {}
    for t in list(model.parameters()) + list(model.buffers()):
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(model, memo)
