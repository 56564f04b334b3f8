"""A transform's fields and how they are written in its repr and its cross-rank fingerprint.

A transform's fields are what its ``__init__`` left on the instance (``vars``; a dataclass's declared fields).
``describe`` writes a value the same way in every process that holds an equal value: an address (``<... at
0x7f...>``) or a rank's own device would make equal transforms differ between ranks, and the rank check would fail
a correct run; so those are left out and an object without a repr of its own counts by its type.
"""
from __future__ import annotations

import dataclasses
import enum
import types
from collections.abc import Mapping, Set

import torch

FROZEN = "_fshard_frozen"  # set on an instance once its class's __init__ has returned (never a field)
_DEPTH = 6  # nested containers written out; deeper ones as "..."


def fields(obj) -> dict:
    """Field name -> value, in the order ``__init__`` set them (a dataclass: its declared fields)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    return {k: v for k, v in vars(obj).items() if k != FROZEN}


def describe(v, depth: int = 0) -> str:
    """``v`` written alike in every process that holds an equal value (see the module docstring)."""
    if depth > _DEPTH:
        return "..."
    if v is None or isinstance(v, (bool, int, float, complex, str, bytes, torch.dtype, enum.Enum)):
        return repr(v)
    if isinstance(v, torch.device):  # cuda:0 on one rank is cuda:1 on the next: the kind is what must agree
        return f"device({v.type!r})"
    if isinstance(v, torch.Tensor):  # its values may be large; its device is the rank's own
        return f"tensor(shape={list(v.shape)}, dtype={v.dtype})"
    if isinstance(v, (tuple, list)):
        inner = ", ".join(describe(x, depth + 1) for x in v)
        return f"({inner}{',' if len(v) == 1 else ''})" if isinstance(v, tuple) else f"[{inner}]"
    if isinstance(v, Set):
        return "{" + ", ".join(sorted(describe(x, depth + 1) for x in v)) + "}"
    if isinstance(v, Mapping):
        return "{" + ", ".join(f"{describe(k, depth + 1)}: {describe(x, depth + 1)}" for k, x in v.items()) + "}"
    if isinstance(v, (types.FunctionType, types.BuiltinFunctionType, types.MethodType, type)):
        return f"{getattr(v, '__module__', None) or '?'}.{getattr(v, '__qualname__', type(v).__name__)}"
    if dataclasses.is_dataclass(v):  # its identity is its fields
        return f"{type(v).__qualname__}(" + ", ".join(
            f"{k}={describe(x, depth + 1)}" for k, x in fields(v).items()) + ")"
    text = repr(v)
    return type(v).__qualname__ if " at 0x" in text else text

