"""What the import checks share: imports under `if TYPE_CHECKING:` never run, its `else:` does."""

from __future__ import annotations

import ast

__all__ = ["RuntimeImportVisitor", "is_type_checking"]


def is_type_checking(test: ast.expr) -> bool:
    """Whether an `if` test is `TYPE_CHECKING` (or `typing.TYPE_CHECKING`)."""
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


class RuntimeImportVisitor(ast.NodeVisitor):
    """A visitor that skips the body of `if TYPE_CHECKING:` and visits its `else:`."""

    def visit_If(self, node: ast.If) -> None:
        if is_type_checking(node.test):
            for child in node.orelse:  # `else:` of TYPE_CHECKING runs
                self.visit(child)
            return
        self.generic_visit(node)
