"""ModuleDefaultDict: an ``nn.ModuleDict`` that builds missing entries with a factory."""

from __future__ import annotations

from collections.abc import Callable, ItemsView, Iterable, Iterator, Mapping, ValuesView
from typing import TYPE_CHECKING, Any, Generic, TypeVar, overload

from torch import nn

__all__ = ["ModuleDefaultDict", "ModuleT"]

ModuleT = TypeVar("ModuleT", bound=nn.Module)
_T = TypeVar("_T")


class ModuleDefaultDict(nn.ModuleDict, Generic[ModuleT]):
    """Holds submodules in a dictionary and calls a factory function to supply missing values.

    It is to ``torch.nn.ModuleDict`` what ``collections.defaultdict`` is to
    ``dict``: reading a missing key with ``d[key]`` calls ``default_factory()``,
    registers the result as a submodule under ``key`` and returns it. Per-task heads and
    per-language adapters are the usual use: the set of keys is open, and each entry must be
    a registered submodule so that ``parameters()``, ``state_dict()`` and ``.to()`` see it.

    Only ``d[key]`` creates entries. ``in``, ``len``, iteration, ``keys()``, ``values()``,
    ``items()``, ``get()`` and ``pop()`` never call the factory. With
    ``default_factory=None`` it is a drop-in ``torch.nn.ModuleDict``: the same entries, order
    and errors, with ``get()`` added and ``update()`` made all or nothing.

    A missing key is checked before the factory runs: it must be a non-empty ``str`` without
    ``"."`` that is not already an attribute of the dict (such as ``"training"`` or
    ``"forward"``). The factory must return a ``torch.nn.Module``. When a check fails
    the call raises and the dict is left exactly as it was.

    Loading a state dict creates the entries it names through the factory before their
    tensors are loaded, so ``fresh.load_state_dict(trained.state_dict(), strict=True)``
    restores a checkpoint into a newly built model. Like ``load_state_dict`` itself, a load
    that fails part way (a shape mismatch, say) is not rolled back: the entries it created
    stay. Wrappers such as DDP or FSDP only manage the parameters that exist when they wrap,
    so create entries (or restore the checkpoint) before wrapping.

    Inside ``torch.compile``, reading an existing key compiles to a plain lookup. A miss
    mutates the module tree, which a compiled graph cannot do: with ``fullgraph=True`` it
    raises, and otherwise it falls back to eager execution for that call. Create entries
    before compiling.

    ``copy.deepcopy`` keeps the factory. ``pickle`` and ``torch.save`` need a picklable
    factory, such as a class or ``functools.partial(nn.Linear, 4, 4)``; a ``lambda`` or a
    local function cannot be pickled.

    Args:
        default_factory: A no argument constructor for missing Module items. If None,
            missing items will raise a KeyError.
        *args: At most one initial mapping from names to modules, or iterable of
            ``(name, module)`` pairs, as ``torch.nn.ModuleDict`` and
            ``collections.defaultdict`` take. Its order is kept.
        **kwargs: Initial dictionary values, inserted after those of ``*args``.

    Raises:
        TypeError: If ``default_factory`` is neither callable nor None, if more than one
            positional mapping is given, or if an initial value is not a Module.

    Added in version v3.58.0.

    Examples:
        >>> import functools
        >>> from torch import nn
        >>> from toolkit.nn import ModuleDefaultDict
        >>> heads = ModuleDefaultDict(functools.partial(nn.Linear, 8, 2))
        >>> head = heads["sentiment"]
        >>> heads["sentiment"] is head
        True
        >>> list(heads)
        ['sentiment']
        >>> "topic" in heads
        False
    """

    if TYPE_CHECKING:
        _modules: dict[str, ModuleT]  # type: ignore[assignment]

        def __setitem__(self, key: str, module: ModuleT) -> None: ...  # type: ignore[override]
        def __iter__(self) -> Iterator[str]: ...
        def values(self) -> ValuesView[ModuleT]: ...
        def items(self) -> ItemsView[str, ModuleT]: ...

    def __init__(
        self,
        default_factory: Callable[[], ModuleT] | None = None,
        *args: Mapping[str, ModuleT] | Iterable[tuple[str, ModuleT]],
        **kwargs: ModuleT,
    ) -> None:
        if len(args) > 1:
            raise TypeError(
                f"ModuleDefaultDict expected at most 2 positional arguments "
                f"(default_factory and one initial mapping), got {1 + len(args)}"
            )
        _check_factory(default_factory)
        super().__init__()
        self.__dict__["_default_factory"] = default_factory
        for initial in (*args, kwargs):
            nn.ModuleDict.update(self, initial)  # type: ignore[arg-type]

    @property
    def default_factory(self) -> Callable[[], ModuleT] | None:
        """The no argument constructor that ``d[key]`` calls for a missing key, or None.

        Assigning a value that is neither callable nor None raises TypeError and keeps the
        previous factory.
        """
        return self.__dict__["_default_factory"]  # type: ignore[no-any-return]

    @default_factory.setter
    def default_factory(self, value: Callable[[], ModuleT] | None) -> None:
        _check_factory(value)
        self.__dict__["_default_factory"] = value

    def __setattr__(self, name: str, value: object) -> None:
        # nn.Module.__setattr__ would register a Module-valued factory as a child entry;
        # send the factory straight to its property instead.
        if name == "default_factory":
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)  # type: ignore[arg-type]

    def __getitem__(self, key: str) -> ModuleT:
        """Retrieve a module by key, creating it if missing.

        Args:
            key: The name of the module to retrieve.

        Returns:
            The requested module.

        Raises:
            KeyError: If ``key`` is missing and ``default_factory`` is None (``args`` is
                ``(key,)``, as for a dict, whatever the key's type), or if the missing
                ``key`` is empty, contains ``"."`` or names an existing attribute.
            TypeError: If a factory is set and the missing ``key`` is not a str, or
                ``default_factory`` returns something that is not a Module.
        """
        try:
            return self._modules[key]
        except KeyError:
            pass
        # Outside the except block, so that errors from the factory or the key checks are
        # not chained to the lookup's KeyError.
        return self.__missing__(key)

    def __missing__(self, key: str) -> ModuleT:
        """Create, register and return the entry for a missing ``key``.

        ``__getitem__`` calls this for a key that is not present, as ``dict`` does. The
        key is checked before the factory is called, and the factory's result after; on any
        failure nothing is inserted.

        Args:
            key: The missing name.

        Returns:
            The new module, now registered under ``key``.

        Raises:
            KeyError: If ``default_factory`` is None, or ``key`` is not a valid new name.
            TypeError: If a factory is set and ``key`` is not a str, or the factory returns
                a non-Module.
        """
        factory = self.default_factory
        if factory is None:
            raise KeyError(key)
        self._check_new_key(key)
        module = factory()
        if not isinstance(module, nn.Module):
            raise TypeError(
                f"ModuleDefaultDict.default_factory {factory!r} returned "
                f"{module!r} (type {type(module).__name__}) for key {key!r}; "
                "it must return an nn.Module instance"
            )
        self.add_module(key, module)
        return module

    @overload
    def get(self, key: str, default: None = None) -> ModuleT | None: ...
    @overload
    def get(self, key: str, default: _T) -> ModuleT | _T: ...

    def get(self, key: str, default: object = None) -> object:
        """Return the module for ``key`` if present, else ``default``, as ``dict.get`` does.

        It never calls the factory.

        Args:
            key: The name of the module to look up.
            default: What to return when ``key`` is missing.

        Returns:
            The module stored under ``key``, or ``default``.
        """
        return self._modules.get(key, default)

    def pop(self, key: str) -> ModuleT:
        """Remove ``key`` and return its module, as ``torch.nn.ModuleDict.pop`` does.

        Unlike ``d[key]``, it never calls the factory.

        Args:
            key: The name of the module to remove.

        Returns:
            The removed module.

        Raises:
            KeyError: If ``key`` is missing; ``args`` is ``(key,)``.
        """
        return self._modules.pop(key)

    def update(self, modules: Mapping[str, ModuleT] | Iterable[tuple[str, ModuleT]]) -> None:  # type: ignore[override]
        """Insert or overwrite entries, as ``torch.nn.ModuleDict.update`` does.

        It raises the same errors as ``torch.nn.ModuleDict.update``, but all or nothing:
        if any pair is rejected, the dict is restored to what it was before the call.

        Args:
            modules: A mapping from names to modules, or an iterable of ``(name, module)``
                pairs. The order of an ordered mapping or of the pairs is kept.
        """
        before = dict(self._modules)
        try:
            super().update(modules)  # type: ignore[arg-type]
        except BaseException:
            self._modules.clear()
            self._modules.update(before)
            raise

    def extra_repr(self) -> str:
        """Show the factory, as the repr of ``collections.defaultdict`` does."""
        return f"default_factory={self.default_factory!r}"

    def _check_new_key(self, key: object) -> None:
        if not isinstance(key, str):
            raise TypeError(
                f"ModuleDefaultDict keys must be str, got {type(key).__name__} {key!r}; "
                "module names are strings"
            )
        if not key:
            raise KeyError("ModuleDefaultDict key must be a non-empty string, got ''")
        if "." in key:
            raise KeyError(
                f"ModuleDefaultDict key {key!r} contains '.', which separates submodule "
                "names in state_dict keys; use another character such as '_'"
            )
        if hasattr(self, key):
            raise KeyError(
                f"ModuleDefaultDict key {key!r} clashes with the existing attribute "
                f"{type(self).__name__}.{key}; choose another name"
            )

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        # Module.load_state_dict loads a module before walking its children, so entries
        # created here are loaded like the others. Names that cannot be entries are left
        # alone and reach the caller as unexpected keys.
        if self.default_factory is not None:
            for name in _child_names(state_dict, prefix):
                if name not in self._modules and _is_valid_new_key(self, name):
                    self.__missing__(name)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )


def _check_factory(factory: object) -> None:
    if factory is not None and not callable(factory):
        raise TypeError(
            f"ModuleDefaultDict.default_factory must be callable or None, got "
            f"{type(factory).__name__} {factory!r}; pass a Module class or a "
            "functools.partial that builds one"
        )


def _child_names(state_dict: Mapping[str, Any], prefix: str) -> dict[str, None]:
    """The first name after ``prefix`` in each key that has a further part, in key order."""
    names: dict[str, None] = {}
    for key in state_dict:
        if key.startswith(prefix):
            head, dot, _ = key[len(prefix) :].partition(".")
            if dot:
                names[head] = None
    return names


def _is_valid_new_key(mdd: ModuleDefaultDict[Any], key: str) -> bool:
    try:
        mdd._check_new_key(key)
    except KeyError:
        return False
    return True
