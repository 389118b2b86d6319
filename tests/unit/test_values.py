"""`values`: the one check for whole numbers that are not bools, and its message."""

from __future__ import annotations

import pytest

from rewrite.values import check_count, is_count, is_int


def test_bools_are_not_numbers_here():
    assert is_int(0) and is_int(-3) and not is_int(True) and not is_int(2.0) and not is_int("2")
    assert is_count(1) and is_count(0, least=0) and not is_count(0) and not is_count(True) and not is_count(None)


def test_check_count_names_its_owner_the_argument_and_the_value():
    check_count("Layer", "size", 3)
    with pytest.raises(TypeError, match=r"^Layer: size must be an int, got bool True$"):
        check_count("Layer", "size", True)
    with pytest.raises(ValueError, match=r"^Layer: size must be >= 2, got 1$"):
        check_count("Layer", "size", 1, least=2)
