"""streamds.checks: the one integer, optional-integer, bool and choice rule, and its messages."""

from __future__ import annotations

import pytest

from streamds.checks import check_bool, check_choice, check_int, check_optional_int, is_int


def test_is_int_refuses_bools_and_floats():
    assert [is_int(v) for v in (0, -3, 2**70, True, False, 1.0, "1", None)] == [
        True, True, True, False, False, False, False, False]  # fmt: skip


def test_check_int_names_parameter_value_and_fix():
    check_int("n", 5, 1, "fix it", maximum=5)
    with pytest.raises(ValueError, match=r"^n must be an integer >= 1, got 0; fix it$"):
        check_int("n", 0, 1, "fix it")
    with pytest.raises(ValueError, match=r"^n must be an integer in \[1, 5\], got 6; fix it$"):
        check_int("n", 6, 1, "fix it", maximum=5)
    with pytest.raises(ValueError, match="got True"):
        check_int("n", True, 0, "fix it")


def test_check_optional_int_takes_none_and_checks_the_rest():
    check_optional_int("limit", None, 1, "use None for no limit")
    check_optional_int("limit", 1, 1, "use None for no limit")
    for bad in (0, 1.5, True, "3"):
        with pytest.raises(ValueError, match=r"^limit must be an integer >= 1, .*no limit$"):
            check_optional_int("limit", bad, 1, "use None for no limit")


def test_check_bool():
    check_bool("flag", True)
    check_bool("flag", False)
    for bad in (0, 1, "yes", None):
        with pytest.raises(ValueError, match=rf"^flag must be True or False, got {bad!r}$"):
            check_bool("flag", bad)


def test_check_choice():
    check_choice("mode", "a", ("a", "b"))
    with pytest.raises(ValueError, match=r"^mode must be one of \('a', 'b'\), got 'c'; pick one$"):
        check_choice("mode", "c", ("a", "b"), "pick one")
