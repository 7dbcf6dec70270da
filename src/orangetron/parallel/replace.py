"""`replace_module`: the one way parallel code changes a model's structure.

Every dimension that `parallelize` applies puts its modules into the reference model through this function,
by the submodule's qualified name (`"layers.3.attention"`, `"layers.3.attention.core_attention"`,
`"tok_embeddings"`): the root stays the reference class, no `__init__` is skipped and no method is
overwritten on an instance. The parallel module takes over the parameters of the one it replaces under the
same attribute names, so parameter names (and checkpoints) stay the reference's.
"""

from __future__ import annotations

from torch import nn


class ReplaceError(AttributeError):
    """`replace_module` was given a path that names no submodule slot of the root."""


def replace_module(root: nn.Module, path: str, new: nn.Module | None) -> nn.Module | None:
    """Put `new` at the submodule `path` of `root` (dotted, as `named_modules` names it); return the old one.

    The slot must exist and hold a module or None (an emptied slot, or a part the model left out, such as a
    tied model's `output`). `new` None empties it: a pipeline stage drops the parts it does not run.
    """
    parent_path, _, name = path.rpartition(".")
    try:
        parent = root.get_submodule(parent_path)
    except AttributeError as err:
        raise ReplaceError(f"{path}: {err}") from None
    if not name or not hasattr(parent, name):
        raise ReplaceError(f"{path}: {type(parent).__name__} has no submodule {name!r} to replace")
    old = getattr(parent, name)
    if old is not None and not isinstance(old, nn.Module):
        raise ReplaceError(f"{path}: holds a {type(old).__name__}, not a submodule")
    setattr(parent, name, new)
    return old
