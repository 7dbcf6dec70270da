"""Hashes of the frozen descriptions (model, job, cluster) that key the planner's cost caches.

A search looks the same few objects up in its caches hundreds of thousands of times, and a dataclass hashes
every field on each lookup. `hash_fields_once`, assigned as `__hash__` in the class body, hashes the fields
once per object. The hash is kept beside the object, by its id, not on it (its `__dict__` stays its fields),
and dropped when the object is freed, before its id can be reused.
"""

from __future__ import annotations

import weakref
from dataclasses import fields
from typing import Any

_HASHES: dict[int, int] = {}  # id of a live object -> the hash of its fields


def hash_fields_once(obj: Any) -> int:
    """The hash of `obj`'s fields (frozen: they never change), computed on first use."""
    key = id(obj)
    cached = _HASHES.get(key)
    if cached is None:
        cached = _HASHES[key] = hash(tuple(getattr(obj, f.name) for f in fields(obj)))
        weakref.finalize(obj, _HASHES.pop, key, None)
    return cached
