"""Function specs: the ``module:function`` strings that name a user's transform on a command line.

One grammar, for ``streamds convert --transform`` and ``streamds bench --transform``::

    module:function                    the function itself
    module:Class.method                a dotted attribute path inside the module
    module:factory(arg, key=literal)   what calling factory with those Python literals returns

Arguments are Python literals only (numbers, strings, lists, dicts, tuples, None, True,
False): a spec never runs arbitrary code beyond importing the module it names. Imports only
the standard library.
"""

from __future__ import annotations

import ast
import importlib
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["FunctionSpec", "load_function", "parse_function_spec"]

_ATTRIBUTE = re.compile(r"\w+(?:\.\w+)*")
_CALL = re.compile(r"(\w+(?:\.\w+)*)\s*\((.*)\)", re.DOTALL)
_GRAMMAR = "'module:function' or 'module:factory(key=value)'"
_LITERALS = "Python literals (numbers, strings, lists, None, True/False)"


@dataclass(frozen=True)
class FunctionSpec:
    """A parsed spec: where the object lives and, for a factory, the literal arguments."""

    module: str
    attribute: str  # dotted path inside the module
    called: bool  # ``factory(...)``: the spec names what the call returns
    args: tuple[Any, ...] = ()
    kwargs: tuple[tuple[str, Any], ...] = ()


def parse_function_spec(spec: str) -> FunctionSpec:
    """Split `spec` into module, attribute and literal arguments; imports nothing.

    >>> parse_function_spec("mod:f(1, k='v')")
    FunctionSpec(module='mod', attribute='f', called=True, args=(1,), kwargs=(('k', 'v'),))
    >>> parse_function_spec("mod:Cls.method").attribute
    'Cls.method'
    """
    module, _, target = spec.partition(":")
    target = target.strip()
    if not module.strip() or not target:
        raise ValueError(f"transform must be {_GRAMMAR}, got {spec!r}")
    call = _CALL.fullmatch(target)
    if call is None:
        if _ATTRIBUTE.fullmatch(target) is None:
            raise ValueError(f"transform must be {_GRAMMAR}, got {spec!r}")
        return FunctionSpec(module.strip(), target, called=False)
    try:
        node = ast.parse(f"f({call[2]})", mode="eval").body
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            raise ValueError("expected one argument list")
        if any(keyword.arg is None for keyword in node.keywords):
            raise ValueError("**kwargs are not literals")
        args = tuple(ast.literal_eval(arg) for arg in node.args)
        kwargs = tuple((k.arg, ast.literal_eval(k.value)) for k in node.keywords if k.arg)
    except (SyntaxError, ValueError) as err:
        raise ValueError(f"transform {spec!r}: arguments must be {_LITERALS}: {err}") from err
    return FunctionSpec(module.strip(), call[1], called=True, args=args, kwargs=kwargs)


def load_function(spec: str) -> Callable[[Any], Any]:
    """The callable `spec` names (see the module docstring for the grammar).

    The working directory is importable, as under ``python -m``, so ``mymodule:clean`` finds
    ``./mymodule.py``. Raises ValueError naming the spec when it is malformed, cannot be
    imported, or names something that is not callable.

    >>> load_function("operator:itemgetter('text')")({"text": "abc", "id": 1})
    'abc'
    """
    parsed = parse_function_spec(spec)
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj: Any = importlib.import_module(parsed.module)
        for part in parsed.attribute.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"transform {spec!r}: cannot load it: {err}") from err
    if parsed.called:
        obj = obj(*parsed.args, **dict(parsed.kwargs))
    if not callable(obj):
        raise ValueError(f"transform {spec!r} is not callable ({type(obj).__name__})")
    return obj
