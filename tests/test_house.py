"""House rules of the test tree itself: test modules share helpers through tests/support/,
never by importing one another (a test module imported elsewhere runs its module-level setup
twice and ties unrelated files together)."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def imported_test_modules(source: str) -> list[str]:
    """The modules ``source`` imports whose last dotted part is a test module (test_*)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            # `from . import test_x` and `from tests.algebra import test_x` name it in the list
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found += [name for name in names if name.rsplit(".", 1)[-1].startswith("test_")]
    return found


def test_no_imported_test_modules_another():
    offenders = {str(path.relative_to(TESTS)): imported_test_modules(path.read_text())
                 for path in sorted(TESTS.rglob("*.py"))}
    assert len(offenders) > 30, "the scan found too few test files to mean anything"
    offenders = {path: names for path, names in offenders.items() if names}
    assert not offenders, f"import shared helpers from tests.support instead: {offenders}"


def test_the_import_scan_sees_every_spelling():
    """Negative self-test: each way of importing a test module is caught, the helpers not."""
    snippet = ("import test_fuzz\nfrom test_kernel_properties import cascades\n"
               "from tests.algebra import test_fuzz\nfrom . import test_staged\n"
               "from tests.algebra.test_fuzz import specs\n"
               "from tests.support import specs\nimport pytest\n")
    assert imported_test_modules(snippet) == [
        "test_fuzz", "test_kernel_properties", "tests.algebra.test_fuzz", ".test_staged",
        "tests.algebra.test_fuzz"]
