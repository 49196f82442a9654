"""The grader's side of isolated repository grading: the solution's modules as proxies.

pytest and the pristine tests run in the grader; importing a module of the repository gives
a `RemoteModule` whose attributes live in the solution process (`runner.serve_objects`).
What crosses back is plain data, decoded by `codec` into genuine builtins, or a handle: a
`Remote` proxy (functions, classes, objects, iterators) or, for an exception class, a local
class of the same name deriving from the same builtin exception, so `pytest.raises` works.

Proxies compare only with proxies (the solution's `__eq__` decides between its own
objects); against plain data they are unequal and unordered, so an object that claims to
equal anything cannot stand in for an expected value.
"""

from __future__ import annotations

import builtins
import importlib.abc
import importlib.machinery
import types

import codec

_PLAIN = (type(None), bool, int, float, str, bytes, complex)


class RemoteError(Exception):
    """The solution raised an exception of a type that crossed as neither builtin nor class."""


class Objects:
    """The grader's view of the solution's objects, over `request(list) -> reply list`."""

    def __init__(self, request):
        self._request = request
        self.proxies: dict[int, object] = {}
        self.exceptions: dict[tuple[str, str], type] = {}
        self.exception_refs: dict[type, int] = {}

    def ask(self, *req) -> object:
        reply = self._request(list(req))
        if reply[0] == "ok" and len(reply) == 2:
            return self.local(reply[1])
        if reply[0] == "stop":
            raise StopIteration
        if reply[0] == "raise" and len(reply) == 3:
            cls = self.local(reply[1])
            if isinstance(cls, type) and issubclass(cls, Exception):
                raise cls(str(reply[2]))
            raise RemoteError(str(reply[2]))
        raise TypeError(f"malformed reply from the solution: {str(reply)[:200]}")

    def local(self, desc: object) -> object:
        """A reply's value: genuine plain data, or a proxy for a handle."""
        if type(desc) is not list or not desc:
            raise TypeError("malformed value from the solution")
        if desc[0] == "v" and len(desc) == 2:
            return codec.decode(desc[1])
        if desc[0] != "ref" or len(desc) != 6:
            raise TypeError("malformed value from the solution")
        _, ref, kind, name, module, base = desc
        if type(ref) is not int or not all(type(s) is str for s in (kind, name, module, base)):
            raise TypeError("malformed handle from the solution")
        if kind == "exception":
            return self._exception(ref, name, module, base)
        if ref not in self.proxies:
            self.proxies[ref] = Remote(self, ref, kind, name)
        return self.proxies[ref]

    def _exception(self, ref: int, name: str, module: str, base: str) -> type:
        builtin = getattr(builtins, name, None) if module == "builtins" else None
        if isinstance(builtin, type) and issubclass(builtin, BaseException):
            return builtin
        if (module, name) not in self.exceptions:
            parent = getattr(builtins, base, Exception)
            if not (isinstance(parent, type) and issubclass(parent, Exception)):
                parent = Exception
            cls = type(name.rpartition(".")[2], (parent,), {"__module__": module, "__qualname__": name})
            self.exceptions[(module, name)] = cls
            self.exception_refs[cls] = ref
        return self.exceptions[(module, name)]

    def remote(self, value: object, depth: int = 0) -> object:
        """An argument for the solution: a handle for a proxy, else plain data only."""
        if isinstance(value, Remote):
            return {"ref": value._ref}
        if isinstance(value, type) and value in self.exception_refs:
            return {"ref": self.exception_refs[value]}
        cls = type(value)
        if cls in _PLAIN or depth > 50:
            return codec.encode(value)
        if cls is list:
            return [self.remote(v, depth + 1) for v in value]
        if cls is tuple:
            return {"t": [self.remote(v, depth + 1) for v in value]}
        if cls in (dict, set, frozenset):
            return codec.encode(value)  # plain members only: codec marks anything else opaque
        raise TypeError(f"a {cls.__qualname__} cannot be passed to the solution's code")


_NOT_FORWARDED = frozenset({"__wrapped__", "__code__", "__signature__", "__func__", "__self__",
                            "__mro__", "__origin__", "__args__", "__len__"})  # fmt: skip


class Remote:
    """A function, class or object of the solution's."""

    __slots__ = ("_kind", "_name", "_objects", "_ref")

    def __init__(self, objects: Objects, ref: int, kind: str, name: str):
        object.__setattr__(self, "_objects", objects)
        object.__setattr__(self, "_ref", ref)
        object.__setattr__(self, "_kind", kind)
        object.__setattr__(self, "_name", name)

    def __getattr__(self, name: str) -> object:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)  # introspection (pytest, inspect) stays local
        return self._objects.ask("getattr", self._ref, name)

    def __setattr__(self, name: str, value: object) -> None:
        self._objects.ask("setattr", self._ref, name, self._objects.remote(value))

    def __call__(self, *args, **kwargs) -> object:
        o = self._objects
        return o.ask("call", self._ref, o.remote(list(args)), [list(kwargs), o.remote(list(kwargs.values()))])

    def _op(self, dunder: str, *args) -> object:
        return self._objects.ask("op", self._ref, dunder, self._objects.remote(list(args)))

    def _typed(self, dunder: str, kind: type) -> object:
        value = self._op(dunder)
        if type(value) is not kind:
            raise TypeError(f"{self._name}.{dunder} returned {type(value).__name__}, not {kind.__name__}")
        return value

    def __repr__(self) -> str:
        if self._kind in ("function", "class", "module"):
            return f"<solution {self._kind} {self._name}>"
        return self._typed("__repr__", str)

    def __str__(self) -> str:
        return self._typed("__str__", str)

    def __len__(self) -> int:
        return self._typed("__len__", int)

    def __bool__(self) -> bool:
        return self._typed("__bool__", bool) if self._kind == "object" else True

    def __hash__(self) -> int:
        return self._typed("__hash__", int)

    def __iter__(self):
        iterator = self._op("__iter__")
        return iterator if isinstance(iterator, Remote) else iter(iterator)

    def __next__(self):
        return self._objects.ask("next", self._ref)

    def __contains__(self, item) -> bool:
        value = self._op("__contains__", item)
        if type(value) is not bool:
            raise TypeError(f"{self._name}.__contains__ returned {type(value).__name__}")
        return value

    def __getitem__(self, key):
        return self._op("__getitem__", key)

    def __setitem__(self, key, value) -> None:
        self._op("__setitem__", key, value)

    def __delitem__(self, key) -> None:
        self._op("__delitem__", key)

    def __enter__(self):
        return self._op("__enter__")

    def __exit__(self, *exc) -> bool:
        return bool(self._op("__exit__", None, None, None)) and exc[0] is None


def _compare(dunder: str):
    def method(self, other):
        if not isinstance(other, Remote):
            return NotImplemented  # never equal to, or ordered against, plain data
        value = self._op(dunder, other)
        if type(value) is not bool:
            raise TypeError(f"{self._name}.{dunder} returned {type(value).__name__}, not bool")
        return value

    return method


def _arith(dunder: str):
    return lambda self, other: self._op(dunder, other)


for _name in ("__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__"):
    setattr(Remote, _name, _compare(_name))
for _name in ("__add__", "__sub__", "__mul__", "__truediv__", "__floordiv__", "__mod__"):
    setattr(Remote, _name, _arith(_name))
Remote.__neg__ = lambda self: self._op("__neg__")


class RemoteModule(types.ModuleType):
    """A module of the repository: its attributes are the solution process's."""

    def __getattr__(self, name: str) -> object:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        handle = self.__dict__["__remote__"]
        return handle._objects.ask("getattr", handle._ref, name)


class SolutionFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports of the repository's top-level modules (and their submodules) become proxies."""

    def __init__(self, objects: Objects, names: set[str]):
        self.objects, self.names = objects, names

    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] not in self.names:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        return RemoteModule(spec.name)

    def exec_module(self, module) -> None:
        handle = self.objects.ask("import", module.__name__)
        if not isinstance(handle, Remote):
            raise ImportError(f"{module.__name__} did not import as a module")
        module.__dict__["__remote__"] = handle
        module.__path__ = []  # a package, as far as the import system needs to know
