"""What fs.load trusts a checkpoint for: nothing in it is executed, and what it says is checked before it is used.

- ``.metadata`` is a pickle (DCP's, FSDP2's and fshard's alike), and ``pickle.load`` runs whatever a crafted one
  names. ``read_metadata`` unpickles it admitting only the classes a DCP metadata file holds (the
  ``torch.distributed.checkpoint.metadata`` dataclasses, ``_StorageInfo``, ``torch.Size``, torch dtypes and
  layouts, paths) and plain containers; anything else is a ``CheckpointError`` "not a DCP metadata file". fshard
  hands what it read to DCP's reader (checkpoint/_dcp.py's ``_StreamingReader.read_metadata``), so DCP never unpickles
  it again. The classes were taken from what fshard's and FSDP2's ``.metadata`` reference (torch 2.13).
- Tensor data is ``torch.load(weights_only=True)`` in DCP's reader already; byte entries (fshard's
  ``transform_state``, the optimizer's ``param_groups``) DCP reads with ``weights_only=False``, so fshard's load
  planner reads them with ``weights_only=True`` (``load_bytes``), admitting fshard's own state classes; a custom
  transform's state class is admitted as torch admits any: ``torch.serialization.add_safe_globals([cls])``.
- ``check_consistent``: the manifest and the metadata agree (every file the metadata reads is in the manifest, the
  ranks that wrote are the manifest's world size, the parameter shapes are its layout's).
- ``saved_hparams`` / ``warn_hparams``: fs.load trains on with ``like``'s optimizer; where the checkpoint's
  ``param_groups`` say otherwise, a warning names each difference.
"""
from __future__ import annotations

import io
import math
import pickle
import re
import warnings
from pathlib import Path

import torch

from ..errors import CheckpointError

_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                              "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                              "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.distributed.checkpoint.planner": {"LoadItemType", "WriteItemType"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "tuple", "list", "dict", "bytes", "bytearray", "str", "int", "float", "bool"},
    "torch.serialization": {"_get_layout"},  # a layout by its name, from torch's own table
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if name in _DCP_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None),
                                                                (torch.dtype, torch.layout, torch.memory_format))):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which a DCP metadata file never holds")


def read_metadata(path: Path):
    """The checkpoint's DCP ``Metadata``, unpickled without running anything it names (module docstring)."""
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
    where = Path(path) / ".metadata"
    try:
        with open(where, "rb") as f:
            md = _MetadataUnpickler(f).load()
    except OSError as e:
        raise CheckpointError(f"fs.load: cannot read {where} ({e.strerror}); a DCP checkpoint directory holds "
                              "it. fs.latest(directory) finds the newest complete checkpoint.") from None
    except Exception as e:  # noqa: BLE001 - whatever a damaged or crafted pickle raises
        raise CheckpointError(f"fs.load: {where} is not a DCP metadata file ({type(e).__name__}: {e}); nothing in "
                              "it was run. Load only checkpoints written by fs.save or torch.distributed.checkpoint."
                              ) from None
    if not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict) \
            or not isinstance(md.storage_data, dict):
        raise CheckpointError(f"fs.load: {where} is not a DCP metadata file (it holds a {type(md).__name__}).")
    if getattr(md, "storage_meta", None) is None:
        md.storage_meta = StorageMeta()  # (as DCP's reader does)
    return md


def load_bytes(value: io.BytesIO):
    """A byte entry of the checkpoint, read with ``torch.load(weights_only=True)``: tensors, containers, numbers,
    strings and fshard's transform-state classes; any other class is a ``CheckpointError`` naming it and the fix."""
    from ..transforms._loss_scale import LossScaleState  # (here: these import the step's modules)
    from ..transforms._mixed_precision import MixedPrecisionState
    # and under the paths fshard pickled them by before its package layout (issue #39), so those checkpoints load
    old = [(LossScaleState, "fshard._loss_scale.LossScaleState"),
           (MixedPrecisionState, "fshard._mixed_precision.MixedPrecisionState")]
    try:
        with torch.serialization.safe_globals([LossScaleState, MixedPrecisionState, *old]):
            return torch.load(value, weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"fs.load: a byte entry of the checkpoint names a class that loading does not run "
                              f"({str(e).splitlines()[-1][:300]}). If it is a custom transform's state class, "
                              "admit it first: torch.serialization.add_safe_globals([YourStateClass]).") from None


def _rank_of(name: str) -> int | None:
    m = re.fullmatch(r"__(\d+)_\d+\.distcp", name)
    return int(m.group(1)) if m else None


def check_consistent(path: Path, manifest: dict | None, md) -> None:
    """The manifest (None: a checkpoint without one, FSDP2's) against the metadata; every data file the metadata
    reads exists and is long enough. Raises ``CheckpointError`` naming what disagrees."""
    spans: dict[str, int] = {}
    for info in md.storage_data.values():
        rel = str(getattr(info, "relative_path", ""))
        spans[rel] = max(spans.get(rel, 0), int(getattr(info, "offset", 0)) + int(getattr(info, "length", 0)))
    for rel, end in spans.items():
        f = Path(path) / rel
        missing = Path(rel).name != rel or not f.is_file()
        if missing or f.stat().st_size < end:
            raise CheckpointError(f"fs.load: {path}'s metadata reads {end:,} bytes of {rel!r}, which "
                                  f"{'is not a file in the checkpoint' if missing else 'is shorter'}: the checkpoint "
                                  "is incomplete or damaged.")
    if manifest is None:
        return
    edited = "the manifest (fshard.json) was edited or damaged; load an earlier checkpoint."
    unlisted = sorted((set(spans) | {".metadata"}) - set(manifest["files"]))
    if unlisted:
        raise CheckpointError(f"fs.load: {path}: the file(s) {', '.join(unlisted)} are not in fshard.json's "
                              f"list, so their checksums were never checked; {edited}")
    ranks = {r for r in map(_rank_of, manifest["files"]) if r is not None}
    if ranks != set(range(manifest["world_size"])):
        raise CheckpointError(f"fs.load: {path}: fshard.json says world_size {manifest['world_size']}, but the "
                              f"checkpoint holds the files of ranks {sorted(ranks)}; {edited}")
    for name, shape in manifest.get("params", {}).items():
        got = md.state_dict_metadata.get(f"model.{name}")
        if got is not None and tuple(getattr(got, "size", shape)) != tuple(shape):
            raise CheckpointError(f"fs.load: {path}: fshard.json gives {name} the shape {tuple(shape)}, the metadata "
                                  f"{tuple(got.size)}; {edited}")


def saved_hparams(md) -> list[str]:
    """The keys of the checkpoint's optimizer hyperparameters to read (``optim.param_groups.<i>.<field>``)."""
    keep = ("lr", "betas", "eps", "weight_decay", "params")
    return [k for k in md.state_dict_metadata if re.fullmatch(r"optim\.param_groups\.\d+\.(\w+)", k)
            and k.rsplit(".", 1)[1] in keep]


def warn_hparams(path, like, saved: dict) -> None:
    """Warn naming each hyperparameter the checkpoint's ``param_groups`` give a parameter (at the saved step) that
    differs from ``like``'s optimizer; fs.load keeps ``like``'s (README, "Saving and resuming")."""
    spec, opt = like.spec, like.spec.optimizer
    step = saved.get("step")  # (a schedule's rate is compared at the saved step; FSDP2's checkpoints have none)
    mine = {}  # parameter name -> the fields of like's group of it (the optimizer's param_groups)
    for g in opt.param_groups(spec.units, 0 if step is None else int(step)):
        fields = {k: v for k, v in g.items() if k != "params"}
        if step is None and (callable(getattr(opt, "lr", None)) or not hasattr(opt, "lr")):
            fields["lr"] = None  # a schedule's rate at an unknown step (a partition's may be one): not compared
        mine.update((name, fields) for name in g["params"])
    differ = {}
    groups = {}
    for k, v in saved.items():
        m = re.fullmatch(r"optim\.param_groups\.(\d+)\.(\w+)", k)
        if m:
            groups.setdefault(m.group(1), {})[m.group(2)] = v
    for g in groups.values():
        for name in g.get("params") or ():
            ours = mine.get(name)
            for field in ("lr", "betas", "eps", "weight_decay"):
                if ours is None or field not in g or ours.get(field) is None:
                    continue
                a, b = _plain(g[field]), _plain(ours[field])
                if not _close(a, b):
                    differ.setdefault((field, repr(a), repr(b)), []).append(name)
    if differ:
        rows = "; ".join(f"{field} {a} in the checkpoint, {b} in like ({len(n)} parameter{'s' * (len(n) > 1)}, "
                         f"e.g. {n[0]})" for (field, a, b), n in sorted(differ.items()))
        warnings.warn(f"fs.load({path}): the optimizer hyperparameters differ: {rows}. fs.load restores values, not "
                      "hyperparameters: training continues with like's optimizer (fs.adamw(...) as built). Build it "
                      "as saved to continue the same run.", UserWarning, stacklevel=3)


def _plain(v):
    if isinstance(v, torch.Tensor):
        v = v.tolist()
    return tuple(_plain(x) for x in v) if isinstance(v, (list, tuple)) else v


def _close(a, b) -> bool:
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-12)
    return a == b
