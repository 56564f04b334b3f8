"""fshard's package layout (design/ARCHITECTURE.md, "Package layout"; issue #39): no import cycle among its modules,
module-level and function-level imports alike; each package imports only the packages below it, as the table says;
at most 12 modules in a folder. The import graph is read from the source (ast), as
../shared/tools/import_cycles.py reads it, so an import inside a function or under TYPE_CHECKING counts too."""
from __future__ import annotations

import ast
import pathlib

import fshard as fs

FSHARD = pathlib.Path(fs.__file__).parent

# package -> the packages it may import (besides itself and the leaves errors.py, _pages.py and _frames.py, which
# import no fshard module): design/ARCHITECTURE.md's table. "fshard" is the top level (fshard/__init__.py,
# fshard/_malloc.py), which may import everything.
LEAVES = ("errors", "_pages", "_frames")
MAY_IMPORT = {
    "ops": set(),
    "store": set(),
    "state": {"store"},
    "dist": set(),
    "optim": {"ops", "state"},
    "protocol": {"dist", "ops", "state"},
    "transforms": {"ops", "protocol", "state"},
    "run": {"dist", "protocol", "state"},
    "step": {"dist", "protocol", "run", "state", "transforms"},
    "offload": {"dist", "optim", "protocol", "state", "store"},
    "model": {"dist", "optim", "run", "state", "store"},
    "checkpoint": {"dist", "optim", "state", "store", "transforms"},
    "testing": {"state"},
}


def _modules() -> dict[str, pathlib.Path]:
    """Dotted module name -> file, a package by its __init__.py's name."""
    out = {}
    for path in sorted(FSHARD.rglob("*.py")):
        rel = path.relative_to(FSHARD.parent).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        out[name] = path
    return out


def _imports(mods: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    """Module -> the fshard modules it imports anywhere in its body (a package's __init__ it sits in excluded: Python
    runs that first in any case)."""
    edges = {m: set() for m in mods}
    for m, path in mods.items():
        base = m if path.name == "__init__.py" else m.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                parts = base.split(".")
                t = (".".join(parts[:len(parts) - (node.level - 1)] + ([node.module] if node.module else []))
                     if node.level else node.module or "")
                names = [t] + [f"{t}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for t in names:
                if t in mods and t != m and not (m.startswith(t + ".") and mods[t].name == "__init__.py"):
                    edges[m].add(t)
    return edges


def _cycles(edges: dict[str, set[str]], mods) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    index, low, on, stack, out, n = {}, {}, set(), [], [], 0
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = n
        n += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = n
                    n += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if sum(mods[x].name != "__init__.py" for x in comp) > 1:
                    out.append(sorted(comp))
    return out


def _package(module: str) -> str:
    part = module.split(".")[1] if "." in module else ""
    return part if part in LEAVES else "fshard" if part == "" or part.startswith("_") else part


def test_no_import_cycle_among_fshard_modules():
    mods = _modules()
    assert _cycles(_imports(mods), mods) == []


def test_the_cycle_finder_finds_a_cycle():
    """The check above can fail: two modules importing each other (one inside a function) are a cycle."""
    mods = {"fshard.a": pathlib.Path("a.py"), "fshard.b": pathlib.Path("b.py"), "fshard.c": pathlib.Path("c.py")}
    assert _cycles({"fshard.a": {"fshard.b"}, "fshard.b": {"fshard.a"}, "fshard.c": {"fshard.a"}}, mods) == [
        ["fshard.a", "fshard.b"]]
    assert _cycles({"fshard.a": {"fshard.b"}, "fshard.b": set(), "fshard.c": {"fshard.a"}}, mods) == []


def test_each_package_imports_only_the_packages_below_it():
    mods = _modules()
    assert {_package(m) for m in mods} - {"fshard", *LEAVES} == set(MAY_IMPORT)
    bad = []
    for m, targets in _imports(mods).items():
        p = _package(m)
        if p in ("fshard", *LEAVES):
            continue
        for t in targets:
            q = _package(t)
            if q not in (p, *LEAVES) and q not in MAY_IMPORT[p]:
                bad.append(f"{m} imports {t}")
    assert bad == []
    for leaf in LEAVES:  # the bottom: they import no fshard module
        assert _package(f"fshard.{leaf}") == leaf and not _imports(mods)[f"fshard.{leaf}"]


def test_at_most_12_modules_in_a_folder():
    count = {}
    for path in FSHARD.rglob("*.py"):
        if path.name != "__init__.py":
            count[path.parent.relative_to(FSHARD.parent)] = count.get(path.parent.relative_to(FSHARD.parent), 0) + 1
    assert {str(d): n for d, n in count.items() if n > 12} == {}


def test_a_small_public_face():
    """At most 40 names in ``fs.__all__``; every error type in ``fs.errors``, each an FshardError, and the top-level
    errors are the same objects."""
    assert len(fs.__all__) <= 40, len(fs.__all__)
    errors = {n: v for n, v in vars(fs.errors).items() if isinstance(v, type) and issubclass(v, BaseException)}
    assert all(issubclass(v, fs.FshardError) for v in errors.values()), errors
    assert {"OffloadError", "StoreError", "BuildError", "TorchVersionError"} <= set(errors)
    assert all(getattr(fs, n) is errors[n] for n in fs.__all__ if n.endswith("Error"))
    assert fs.store.StoreError is fs.errors.StoreError


def test_pyproject_ships_every_package():
    """A package missing from pyproject's list would be left out of the wheel: fshard imported from an install fails."""
    import re
    text = (FSHARD.parent / "pyproject.toml").read_text()
    start = text.index("packages = [")
    listed = set(re.findall(r'"(fshard[\w.]*)"', text[start:text.index("]", start)]))
    found = {".".join(p.parent.relative_to(FSHARD.parent).parts) for p in FSHARD.rglob("__init__.py")}
    assert found <= listed, sorted(found - listed)


def test_adamw_moments_named_only_in_the_optimizer_package():
    """Checkpoint, offload, state checks and the step iterate over the optimizer's declared rows
    (fshard/optim/_protocol.py); only the optimizer package and the native kernels name AdamW's moments."""
    named = sorted(str(p.relative_to(FSHARD)) for p in FSHARD.rglob("*.py")
                   if "exp_avg" in p.read_text() and p.relative_to(FSHARD).parts[0] not in ("optim", "ops"))
    assert named == []


def _offload_importers(mods: dict[str, pathlib.Path]) -> list[str]:
    """Modules outside fshard/offload/ (and fshard/__init__.py) that import anything of it."""
    return sorted(m for m, targets in _imports(mods).items()
                  if not (m == "fshard.offload" or m.startswith("fshard.offload.") or m == "fshard")
                  and any(t == "fshard.offload" or t.startswith("fshard.offload.") for t in targets))


def test_offload_is_imported_by_nothing_outside_its_package_but_the_top_level(tmp_path):
    """Placement is a property of the state (issue #39): fs.init and fs.load take any Placement
    (fshard/state/_placement.py), so the core never imports the transform that places units in stores."""
    mods = _modules()
    assert _offload_importers(mods) == []
    # the check can fail: a module importing offload (at function level too) is named
    fake = tmp_path / "_fake.py"
    fake.write_text("def f():\n    from fshard.offload._transform import offload_state\n")
    assert _offload_importers({**mods, "fshard.model._fake": fake}) == ["fshard.model._fake"]


def _stored_type_checks(path: pathlib.Path) -> list[int]:
    """Lines of ``path`` with an ``isinstance``/``issubclass`` call whose types name ``Stored`` or ``StoredParam``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("isinstance", "issubclass") and len(node.args) == 2):
            names = {n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(node.args[1])
                     if isinstance(n, (ast.Name, ast.Attribute))}
            if names & {"Stored", "StoredParam"}:
                out.append(node.lineno)
    return out


def test_the_core_never_checks_a_leaf_for_being_stored(tmp_path):
    """Outside fshard/state/ (where the leaves are defined) and fshard/offload/, the core asks a leaf through one
    interface (``fs.state.in_store``), never ``isinstance(x, StoredParam/Stored)``."""
    bad = {str(p.relative_to(FSHARD)): lines for p in sorted(FSHARD.rglob("*.py"))
           if p.relative_to(FSHARD).parts[0] not in ("state", "offload") and (lines := _stored_type_checks(p))}
    assert bad == {}
    # the check can fail: it sees a type check on a leaf, through a module attribute too
    fake = tmp_path / "_fake.py"
    fake.write_text("def f(x, st):\n    return isinstance(x, (int, st.StoredParam)) or isinstance(x, Stored)\n")
    assert _stored_type_checks(fake) == [2, 2]

