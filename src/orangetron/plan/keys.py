"""Hashes of the frozen descriptions (model, job, cluster) that key the planner's cost caches.

A search looks the same few objects up in its caches hundreds of thousands of times, and a dataclass hashes
every field on each lookup. These two functions, assigned as `__hash__` and `__getstate__` in the class body,
hash the fields once per object and keep the result on it; a pickled copy drops it, since string hashes differ
between processes.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

_HASH = "_fields_hash"


def hash_fields_once(obj: Any) -> int:
    """The hash of `obj`'s fields, computed on first use."""
    cached = obj.__dict__.get(_HASH)
    if cached is None:
        cached = hash(tuple(getattr(obj, f.name) for f in fields(obj)))
        object.__setattr__(obj, _HASH, cached)  # frozen: the fields never change, nor does their hash
    return cached


def state_without_hash(obj: Any) -> dict[str, Any]:
    """`obj`'s state for pickle and copy, without the cached hash."""
    return {k: v for k, v in obj.__dict__.items() if k != _HASH}
