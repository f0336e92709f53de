"""ModuleDefaultDict: an ``nn.ModuleDict`` that builds missing entries with a factory."""

from __future__ import annotations

import inspect
import reprlib
from collections.abc import Callable, ItemsView, Iterable, Iterator, Mapping, ValuesView
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Self, TypeVar, overload

import torch
from torch import nn

from toolkit.nn._entry_placement import UNMOVED, EntryPlacement

__all__ = ["ModuleDefaultDict", "ModuleT"]

ModuleT = TypeVar("ModuleT", bound=nn.Module)
T = TypeVar("T")


class ModuleDefaultDict(nn.ModuleDict, Generic[ModuleT]):
    """An ``nn.ModuleDict`` that builds a missing entry with a factory, as ``defaultdict`` does.

    ``d[key]`` on a missing key calls ``default_factory()``, registers the result under
    ``key`` and returns it; nothing else (``in``, ``get``, ``pop``, iteration) calls the
    factory. A new entry takes the device, dtype and training mode the dict was last given,
    and ``load_state_dict`` creates the entries a checkpoint names before loading them. With
    ``default_factory=None`` it is a drop-in ``nn.ModuleDict``. The
    [per-task heads guide][per-task-heads-with-moduledefaultdict] shows it in a model, and
    what it guarantees under moves, loads, ``torch.compile`` and pickling.

    Args:
        default_factory: A callable without arguments that returns a new Module, such as
            ``functools.partial(nn.Linear, 8, 2)``; None makes a missing key a KeyError.
        modules: Optional, positional: the initial entries, a mapping of names to modules
            or an iterable of ``(name, module)`` pairs, kept in order.
        **kwargs: Initial entries, after those of ``modules``.

    Raises:
        TypeError: If ``default_factory`` is neither callable nor None, or is a mapping
            (initial entries go second: ``ModuleDefaultDict(None, mapping)``), or an
            initial value is not a Module.

    Added in version v3.58.0.

    Examples:
        >>> import functools
        >>> from torch import nn
        >>> from toolkit.nn import ModuleDefaultDict
        >>> heads = ModuleDefaultDict(functools.partial(nn.Linear, 8, 2))
        >>> heads["sentiment"] is heads["sentiment"]
        True
        >>> list(heads), "topic" in heads
        (['sentiment'], False)
    """

    # TorchScript compiles properties unless told not to, and cannot type the factory; like
    # nn.ModuleDict, a scripted dict only looks entries up.
    __jit_unused_properties__: ClassVar[list[str]] = ["default_factory"]
    # Where new entries go. A class default, so that dicts pickled before it existed still load.
    _entry_placement: EntryPlacement = UNMOVED

    if TYPE_CHECKING:
        _modules: dict[str, ModuleT]  # type: ignore[assignment]

        def __iter__(self) -> Iterator[str]: ...
        def values(self) -> ValuesView[ModuleT]: ...
        def items(self) -> ItemsView[str, ModuleT]: ...

    @overload
    def __init__(
        self, default_factory: Callable[[], ModuleT] | None = None, **kwargs: ModuleT
    ) -> None: ...
    @overload
    def __init__(
        self,
        default_factory: Callable[[], ModuleT] | None,
        modules: Mapping[str, ModuleT] | Iterable[tuple[str, ModuleT]] | None,
        /,
        **kwargs: ModuleT,
    ) -> None: ...

    # mypy's objection: a key "default_factory" among the second form's keywords would clash
    # with the first argument. Python raises TypeError for that call, as it should.
    def __init__(  # type: ignore[misc]
        self,
        default_factory: Callable[[], ModuleT] | None = None,
        *modules: Mapping[str, ModuleT] | Iterable[tuple[str, ModuleT]] | None,
        **kwargs: ModuleT,
    ) -> None:
        if len(modules) > 1:
            raise TypeError(
                f"ModuleDefaultDict expected at most 2 positional arguments "
                f"(default_factory and one initial mapping), got {1 + len(modules)}"
            )
        _check_factory(default_factory)
        super().__init__()
        self.__dict__["_default_factory"] = default_factory
        for initial in (*modules, kwargs):
            if initial is not None:
                nn.ModuleDict.update(self, initial)  # type: ignore[arg-type]

    @property
    def default_factory(self) -> Callable[[], ModuleT] | None:
        """The no argument constructor that ``d[key]`` calls for a missing key, or None.

        Assigning a value that is neither callable nor None, or a mapping or
        ``torch.nn.ModuleDict``, raises TypeError and keeps the previous factory. Assigning
        None closes the dict: a miss then raises KeyError.
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

    def __setitem__(self, key: str, module: ModuleT) -> None:  # type: ignore[override]
        # A new key is checked as a miss checks it, so that setting a key that cannot be an
        # entry says why and what to write instead, as reading it does.
        if key not in self._modules:
            self._check_new_key(key)
        super().__setitem__(key, module)

    def __missing__(self, key: str) -> ModuleT:
        """Create, register and return the entry for a missing ``key``.

        ``__getitem__`` calls this for a key that is not present, as ``dict`` does. The
        key is checked before the factory is called, and the factory's result after; on any
        failure nothing is inserted. The new module is then moved and cast as the dict was,
        and set to the dict's training mode, before it is registered.

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
        self._entry_placement.apply(module)
        module.train(self.training)
        self.add_module(key, module)
        return module

    @overload
    def get(self, key: str, default: None = None) -> ModuleT | None: ...
    @overload
    def get(self, key: str, default: T) -> ModuleT | T: ...

    def get(self, key: str, default: object = None) -> object:
        """Return the module for ``key`` if present, else ``default``, as ``dict.get`` does.

        It never calls the factory.

        Args:
            key: The name of the module to look up.
            default (T | None): What to return when ``key`` is missing.

        Returns:
            (ModuleT | T | None): The module stored under ``key``, or ``default``.
        """
        return self._modules.get(key, default)

    @overload
    def pop(self, key: str) -> ModuleT: ...
    @overload
    def pop(self, key: str, default: ModuleT | T, /) -> ModuleT | T: ...

    def pop(self, key: str, *default: object) -> object:
        """Remove ``key`` and return its module, or ``default`` if given, as ``dict.pop`` does.

        Unlike ``d[key]``, it never calls the factory. Without ``default`` it is
        ``torch.nn.ModuleDict.pop``.

        Args:
            key: The name of the module to remove.
            *default (ModuleT | T): What to return when ``key`` is missing, if given.

        Returns:
            (ModuleT | T): The removed module, or ``default``.

        Raises:
            KeyError: If ``key`` is missing and no ``default`` is given; ``args`` is
                ``(key,)``.
        """
        return self._modules.pop(key, *default)

    def setdefault(self, key: str, default: ModuleT) -> ModuleT:
        """Return the module for ``key``, first inserting ``default`` if missing, as ``dict`` does.

        It never calls the factory: ``default`` is the module inserted.

        Args:
            key: The name of the module.
            default: The module to insert under ``key`` if it is missing.

        Returns:
            The module now stored under ``key``.

        Raises:
            KeyError: If ``key`` is missing and not a valid module name, as for
                ``d[key] = default``.
            TypeError: If ``key`` is missing and ``default`` is not a Module, as for
                ``d[key] = default``.
        """
        if key not in self._modules:
            self[key] = default
        return self._modules[key]

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
        """Show the factory, as the repr of ``collections.defaultdict`` does.

        A factory whose repr shows the dict again, such as a bound method of the model that
        holds the dict, shows as ``...`` there, as in ``defaultdict``'s repr.
        """
        return "default_factory=" + self._factory_repr()

    @reprlib.recursive_repr()
    def _factory_repr(self) -> str:
        return repr(self.default_factory)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Self:
        # Every move or cast of a module reaches its children through _apply, whether it was
        # called on the dict or on a model above it. Keep its net effect for entries created
        # later; learn it first, so that a conversion that fails changes nothing here. One
        # that does not recurse (to_empty(recurse=False)) leaves the entries, and so new ones,
        # alone.
        placement = self._entry_placement.after(fn) if recurse else self._entry_placement
        super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
        self._entry_placement = placement
        return self

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
        # created here are loaded like the others. They are created by a load pre-hook
        # registered for this load only, after the dict's own pre-hooks, so that a hook
        # renaming old keys runs before the keys name the entries.
        handle = self.register_load_state_dict_pre_hook(_create_loaded_entries)  # type: ignore[no-untyped-call]
        try:
            super()._load_from_state_dict(
                state_dict,
                prefix,
                local_metadata,
                strict,
                missing_keys,
                unexpected_keys,
                error_msgs,
            )
        finally:
            handle.remove()


def _create_loaded_entries(
    module: ModuleDefaultDict[Any], state_dict: Mapping[str, Any], prefix: str, *_: object
) -> None:
    create_from_keys(module, state_dict, prefix)


def create_from_keys(mdd: ModuleDefaultDict[Any], keys: Iterable[str], prefix: str) -> list[str]:
    """Create the missing entries of ``mdd`` that ``keys``, state-dict keys under ``prefix``, name.

    This is the one place where entries are created from state-dict keys: loading and
    ``create_entries`` both call it. Names that cannot be entries are left alone; a load
    reports their keys as unexpected.

    Returns:
        The names of the entries created, in key order.
    """
    if mdd.default_factory is None:
        return []
    created = []
    for key in keys:
        # The first name after the prefix, if the key has a further part, names an entry; an
        # existing entry is not a valid new key, so each is created once.
        head, dot, _ = key[len(prefix) :].partition(".")
        if key.startswith(prefix) and dot and is_valid_new_key(mdd, head):
            mdd.__missing__(head)
            created.append(head)
    return created


def _check_factory(factory: object) -> None:
    if isinstance(factory, (Mapping, nn.ModuleDict)):
        # Every Module is callable, so converting nn.ModuleDict(x) to ModuleDefaultDict(x)
        # would silently take x for the factory and drop its entries.
        raise TypeError(
            f"ModuleDefaultDict.default_factory must build a new Module, got a "
            f"{type(factory).__name__}; to start from a mapping's entries, pass it second: "
            "ModuleDefaultDict(None, mapping) or ModuleDefaultDict(factory, mapping)"
        )
    if isinstance(factory, nn.Module):
        # A module is callable, but calling it runs its forward instead of building an entry.
        name = type(factory).__name__
        raise TypeError(
            f"ModuleDefaultDict.default_factory must build a new Module on each call, got a "
            f"{name} instance, whose call is its forward; pass a callable that builds one, "
            f"such as lambda: {name}(...) or functools.partial({name}, ...)"
        )
    if factory is not None and not callable(factory):
        raise TypeError(
            f"ModuleDefaultDict.default_factory must be callable or None, got "
            f"{type(factory).__name__} {factory!r}; pass a Module class or a "
            "functools.partial that builds one"
        )
    needed = _required_arguments(factory)
    if needed:
        names = ", ".join(needed)
        name = getattr(factory, "__name__", "")
        partial = (
            f"functools.partial({name}, {names})" if name.isidentifier() else "functools.partial"
        )
        raise TypeError(
            f"ModuleDefaultDict.default_factory is called with no arguments, but {factory!r} "
            f"needs {names}; bind them with {partial}, or pass a lambda that builds the module"
        )


def _required_arguments(factory: object) -> list[str]:
    """The parameters that ``factory()`` leaves without a value, where its signature says."""
    try:
        parameters = inspect.signature(factory).parameters.values()  # type: ignore[arg-type]
    except (TypeError, ValueError):  # None, or a callable without a signature
        return []
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return [p.name for p in parameters if p.default is p.empty and p.kind not in variadic]


def is_valid_new_key(mdd: ModuleDefaultDict[Any], key: str) -> bool:
    try:
        mdd._check_new_key(key)
    except KeyError:
        return False
    return True
