"""Python named by text (``'module:attribute'``): the one place such a reference is imported, under a policy.

Pipeline files, agent specs and tools may name Python by reference: a step's ``call``, a tool given as
``'package.module:function'``, an output model ``'package.module:Class'``. Importing a module runs its code,
and calling what it holds runs more, so whoever wrote the reference chooses what the process executes. In a
file or a script that is its author, who runs the process anyway. In a request to a server it is a client,
so the server sets a `CodePolicy` for the request (`code_policy`) and every reference is imported through
`import_reference`, which refuses, before importing anything, a module the operator did not allow.

The policy lives in a context variable: it follows the request into the tasks it starts and into anyio's
worker threads. Code that runs with no policy set (a script, `orchestra run`, a pipeline file the operator
put in the server's folder) imports what it names, as Python itself would.
"""

from __future__ import annotations

import importlib
import keyword
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

from agents.errors import CodeNotAllowedError

__all__ = ["BUILTIN_TOOLS", "CodePolicy", "UNRESTRICTED", "code_policy", "colon_form", "current_code_policy", "import_reference",
           "parse_reference", "stdlib_module"]

BUILTIN_TOOLS = frozenset({"agents.tools:find"})
"""References a restricted policy still allows: the tools that ship with orchestra, as built-in agents do."""


def parse_reference(reference: str) -> tuple[str, tuple[str, ...]]:
    """``'pkg.mod:Attr.inner'`` as (``'pkg.mod'``, (``'Attr'``, ``'inner'``)); ValueError naming the form.

    Only the colon form is read: a module path of identifiers, then an attribute path of identifiers."""
    module, sep, attrs = reference.partition(":")
    parts = tuple(attrs.split(".")) if attrs else ()
    if not sep or not _dotted(module) or not parts or not all(_identifier(p) for p in parts):
        raise ValueError(f"{reference!r} is not a Python reference 'package.module:name'")
    return module, parts


def colon_form(path: str) -> str:
    """``'pkg.mod.Class'`` (the form pydantic users write for a class) as ``'pkg.mod:Class'``; a path with a colon
    as it is."""
    if ":" in path:
        return path
    module, _, attr = path.rpartition(".")
    return f"{module}:{attr}" if module and attr else path


def _identifier(text: str) -> bool:
    return text.isidentifier() and not keyword.iskeyword(text)


def _dotted(text: str) -> bool:
    return bool(text) and all(_identifier(part) for part in text.split("."))


def stdlib_module(module: str) -> bool:
    """Whether `module` belongs to the standard library (its top-level package is one of Python's own)."""
    return module.split(".")[0] in sys.stdlib_module_names


@dataclass(frozen=True)
class CodePolicy:
    """Which Python references may be imported: all of them (`UNRESTRICTED`), or the modules under `prefixes`
    plus the exact references in `exact` (by default the built-in tools).

    A prefix ``mypkg.checks`` allows ``mypkg.checks`` and ``mypkg.checks.sub``, not ``mypkg.checks_old``.
    Under a restricted policy a reference must also name a public attribute (no ``_`` parts), and what it
    finds must be defined under an allowed prefix: ``mypkg:run``, where mypkg did ``from subprocess import
    run``, is refused like ``subprocess:run``.
    """

    prefixes: tuple[str, ...] = ()
    exact: frozenset[str] = field(default=BUILTIN_TOOLS)
    unrestricted: bool = False
    flag: str = "--allow-code"
    """How an operator widens the policy: named in every refusal, so the message says what to change."""

    def __post_init__(self) -> None:
        for prefix in self.prefixes:
            if not _dotted(prefix):
                raise ValueError(f"{prefix!r} is not a module prefix: give a dotted module path such as "
                                 "'mycompany.checks'")

    def allows_module(self, module: str) -> bool:
        return self.unrestricted or any(module == p or module.startswith(p + ".") for p in self.prefixes)

    def refusal(self, reference: str, what: str) -> str | None:
        """Why `reference` may not be imported (None: it may); read from the text alone, nothing imported."""
        if self.unrestricted or reference in self.exact:
            return None
        try:
            module, parts = parse_reference(reference)
        except ValueError as exc:
            return str(exc)
        if not self.allows_module(module):
            allowed = ", ".join(self.prefixes) or "none"
            return (f"{what} {reference!r} names Python in module {module!r}, which this server does not allow "
                    f"(allowed module prefixes: {allowed}); the operator allows a package with {self.flag} PREFIX")
        if any(part.startswith("_") for part in parts):
            return f"{what} {reference!r} names a private attribute; name a public function or class"
        return None


UNRESTRICTED = CodePolicy(unrestricted=True)
"""Import whatever is named: the policy of scripts, the CLI and the operator's own pipeline files."""

_POLICY: ContextVar[CodePolicy] = ContextVar("orchestra_code_policy", default=UNRESTRICTED)


def current_code_policy() -> CodePolicy:
    """The policy in force in this context (`UNRESTRICTED` unless a `code_policy` block set one)."""
    return _POLICY.get()


@contextmanager
def code_policy(policy: CodePolicy) -> Iterator[CodePolicy]:
    """Import references under `policy` inside the block (and in the tasks and worker threads it starts)."""
    token = _POLICY.set(policy)
    try:
        yield policy
    finally:
        _POLICY.reset(token)


def import_reference(reference: str, *, what: str = "reference",
                     origin: Callable[[object], object] | None = None) -> object:
    """The object `reference` names, imported under the current policy.

    `CodeNotAllowedError` (before any import) when the policy refuses it; ImportError or AttributeError when
    it names nothing. `what` says in the message what the reference was for ("step", "tool", "output model");
    `origin` gives, for what was found, the object whose module must be allowed (a tool object: its function).
    """
    policy = current_code_policy()
    why = policy.refusal(reference, what)
    if why is not None:
        raise CodeNotAllowedError(why, reference=reference)
    module_name, parts = parse_reference(reference)
    obj: object = importlib.import_module(module_name)
    for part in parts:
        obj = getattr(obj, part)
    if not (policy.unrestricted or reference in policy.exact):
        found = origin(obj) if origin is not None else obj
        defined_in = getattr(found, "__module__", None)
        if not isinstance(defined_in, str) or not policy.allows_module(defined_in):
            raise CodeNotAllowedError(
                f"{what} {reference!r} reaches {getattr(found, '__qualname__', type(found).__name__)} from module "
                f"{defined_in!r}, which is not allowed here; the operator allows a package with "
                f"{policy.flag} PREFIX", reference=reference)
    return obj
