"""streamds.spec: the one ``module:function(args)`` grammar of convert and bench
--transform."""

from __future__ import annotations

import doctest
import operator
import sys

import pytest

from streamds import spec
from streamds.spec import FunctionSpec, load_function, parse_function_spec


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("json:dumps", FunctionSpec("json", "dumps", called=False)),
        ("os.path:join", FunctionSpec("os.path", "join", called=False)),
        ("pkg.mod:Class.method", FunctionSpec("pkg.mod", "Class.method", called=False)),
        (" mod : f ", FunctionSpec("mod", "f", called=False)),
        ("mod:f()", FunctionSpec("mod", "f", called=True)),
        ("mod:make(3, 'a', [1, None], flag=True, limit=-2.5)",
         FunctionSpec("mod", "make", called=True, args=(3, "a", [1, None]),
                      kwargs=(("flag", True), ("limit", -2.5)))),
        ("mod:make(\n  max_words=512,\n)",
         FunctionSpec("mod", "make", called=True, kwargs=(("max_words", 512),))),
    ],
)
def test_grammar(text, parsed):
    assert parse_function_spec(text) == parsed


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("nocolon", "must be 'module:function'"),
        (":f", "must be 'module:function'"),
        ("mod:", "must be 'module:function'"),
        ("mod:f(x)", "arguments must be Python literals"),
        ("mod:f(len('a'))", "arguments must be Python literals"),
        ("mod:f(**{'a': 1})", "arguments must be Python literals"),
        ("mod:f(*[1])", "arguments must be Python literals"),
        ("mod:f(1", "must be 'module:function'"),
        ("mod:f(1)(2)", "arguments must be Python literals"),
    ],
)
def test_malformed_specs_name_the_grammar(text, message):
    with pytest.raises(ValueError, match=message) as info:
        parse_function_spec(text)
    assert repr(text) in str(info.value)


def test_load_function_imports_and_calls_factories():
    assert load_function("json:dumps") is sys.modules["json"].dumps
    assert load_function("os.path:join") is sys.modules["os"].path.join
    getter = load_function("operator:itemgetter('a', 'b')")
    assert isinstance(getter, operator.itemgetter)
    assert getter({"a": 1, "b": 2, "c": 3}) == (1, 2)
    assert load_function("collections:OrderedDict.fromkeys")(["x"]) == {"x": None}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("no_such_module_xyz:f", "cannot load it"),
        ("json:nosuch", "cannot load it"),
        ("math:pi", "is not callable"),
        ("operator:itemgetter", None),  # the class itself is callable: fine
    ],
)
def test_load_function_errors(text, message):
    if message is None:
        assert load_function(text) is operator.itemgetter
        return
    with pytest.raises(ValueError, match=message):
        load_function(text)


def test_working_directory_is_importable(tmp_path, monkeypatch):
    (tmp_path / "spec_user_module.py").write_text("def clean(r):\n    return r + 1\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert load_function("spec_user_module:clean")(1) == 2


def test_docstring_examples():
    result = doctest.testmod(spec)
    assert result.attempted >= 3 and result.failed == 0
