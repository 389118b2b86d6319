"""Adding behaviour to a module object in place: its class becomes a subclass of the original with a
mixin in front; the object, its parameters and their names are kept (optimizers, checkpoints see the same).
"""

from __future__ import annotations

from torch import nn

__all__ = ["add_mixin"]

_SUBCLASSES: dict[tuple[type, type], type] = {}


def add_mixin(module: nn.Module, mixin: type) -> nn.Module:
    """Put `mixin` in front of `module`'s class, in place (once); returns the module."""
    cls = type(module)
    if isinstance(module, mixin):
        return module
    key = (mixin, cls)
    if key not in _SUBCLASSES:
        _SUBCLASSES[key] = type(f"{mixin.__name__}{cls.__name__}", (mixin, cls), {"__module__": mixin.__module__})
    module.__class__ = _SUBCLASSES[key]
    return module
