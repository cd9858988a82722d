"""The class swap both front-ends apply, as FSDP2 does: a managed module's class becomes a subclass
of the front-end's mixin (its controls: ``reshard``, ``no_sync``, ...) and of the user's class.

One naming policy: the swapped class keeps the user's class name and qualified name. Tools key on
it (Hugging Face writes ``type(model).__name__`` to ``config.json``'s ``architectures``;
pipelines and serving engines read it back); ``isinstance(model, MatrixFSDPModule)`` or
``isinstance(model, MatrixReplicateModule)`` tells a managed module apart, and
:func:`user_class` gives the original class.

[Note: front-end state]
A managed module keeps its front-end's state (``fully_shard``'s ``BlockState``, ``replicate``'s
``ReplicateState``) in its ``__dict__`` under one key, written and read only through
:func:`attach_state` and :func:`attached_state`: not a submodule, parameter or buffer, so it
never reaches ``state_dict()``, ``named_modules()`` or ``nn.Module.__setattr__``'s routing, and a
module holds at most one front-end's state.

Outside code that must add methods to swapped classes (the Hugging Face integration gives
``save_pretrained`` its collective form) registers a *class adapter* with
:func:`register_class_adapter`, explicitly, when its user asks for it (nothing registers one at
import); it applies to the classes swapped before and after. The front-ends know nothing of it.
"""

from __future__ import annotations

from typing import Any, Callable, NoReturn

import torch.nn as nn

__all__ = ["swap_class", "front_end_of", "user_class", "register_class_adapter", "attach_state",
           "attached_state"]

_STATE_KEY = "_matrixfsdp_state"

#: ``adapter(user_cls, mixin) -> {name: attribute}`` for each swapped class (see the docstring)
ClassAdapter = Callable[[type, type], dict[str, Any]]

_ADAPTERS: list[ClassAdapter] = []
_CACHE: dict[tuple[type, type], type] = {}
_MIXINS: set[type] = set()


def register_class_adapter(adapter: ClassAdapter) -> None:
    """Add ``adapter``'s attributes to every swapped class, those swapped already included
    (idempotent per adapter)."""
    if adapter in _ADAPTERS:
        return
    _ADAPTERS.append(adapter)
    for (cls, mixin), swapped in _CACHE.items():
        for name, value in adapter(cls, mixin).items():
            setattr(swapped, name, value)


def _refuse_deepcopy(api: str) -> Callable[..., NoReturn]:
    def __deepcopy__(self: Any, memo: Any) -> NoReturn:
        raise TypeError(f"{api}: deepcopy of a managed module is not supported; copy the model "
                        "before sharding it, or build a new one and load a state dict")
    return __deepcopy__


def swap_class(module: nn.Module, mixin: type, api: str) -> None:
    """Make ``module`` an instance of ``mixin`` and of its own class, keeping its class name."""
    cls = type(module)
    if issubclass(cls, mixin):
        return
    new_cls = _CACHE.get((cls, mixin))
    if new_cls is None:
        attrs: dict[str, Any] = {"__deepcopy__": _refuse_deepcopy(api), "__qualname__": cls.__qualname__,
                                 "__module__": cls.__module__}
        for adapter in _ADAPTERS:
            attrs.update(adapter(cls, mixin))
        new_cls = type(cls.__name__, (mixin, cls), attrs)
        _CACHE[(cls, mixin)] = new_cls
        _MIXINS.add(mixin)
    module.__class__ = new_cls


def front_end_of(module: nn.Module) -> type | None:
    """The front-end mixin ``module`` was swapped to (``MatrixFSDPModule``, ...), else None."""
    cls = type(module)
    base = cls.__bases__[0] if cls.__bases__ else None
    return base if base in _MIXINS else None


def user_class(module: nn.Module | type) -> type:
    """The class the user built ``module`` as (before any front-end swapped it)."""
    cls = module if isinstance(module, type) else type(module)
    while cls.__bases__ and cls.__bases__[0] in _MIXINS:
        cls = cls.__bases__[1]
    return cls


def attach_state(module: nn.Module, state: Any) -> None:
    """Give ``module`` its front-end state (see [Note: front-end state])."""
    module.__dict__[_STATE_KEY] = state


def attached_state(module: nn.Module, kind: type | None = None) -> Any:
    """``module``'s front-end state (of type ``kind``, if given), else ``None``."""
    state = module.__dict__.get(_STATE_KEY)
    return state if kind is None or isinstance(state, kind) else None
