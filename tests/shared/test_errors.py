"""shared/ raises from one error tree (shared/errors.py), never a bare ValueError."""

import ast
import inspect
from pathlib import Path

import pytest

import shared
import shared.errors
from shared.errors import PrivacyInputError, SharedError
from shared.privacy.errors import PrivacyError, SetupError
from shared.tensors.codec import PayloadError
from shared.terms import TermsError

SHARED = Path(shared.__file__).parent


def _bare_value_errors(path: Path) -> list[int]:
    """Lines of `raise ValueError(...)` (or `raise ValueError`) in the module at `path`."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not isinstance(node, ast.Raise) or node.exc is None:
            continue
        raised = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
        if isinstance(raised, ast.Name) and raised.id == "ValueError":
            lines.append(node.lineno)
    return sorted(lines)


def test_no_module_of_shared_raises_a_bare_value_error() -> None:
    found = {
        f"shared/{path.relative_to(SHARED).as_posix()}:{line}"
        for path in sorted(SHARED.rglob("*.py"))
        for line in _bare_value_errors(path)
    }
    assert not found, f"raise a kind of shared.errors.SharedError instead of ValueError: {sorted(found)}"


def test_the_check_sees_a_bare_value_error(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f(x):\n    if x:\n        raise ValueError(f'{x}')\n    raise ValueError\n")
    assert _bare_value_errors(module) == [3, 4]


def _classes_of_errors_module() -> list[type]:
    return [
        cls for _, cls in inspect.getmembers(shared.errors, inspect.isclass) if cls.__module__ == shared.errors.__name__
    ]


@pytest.mark.parametrize("cls", _classes_of_errors_module(), ids=lambda cls: cls.__name__)
def test_every_class_of_the_errors_module_is_a_shared_error_and_a_value_error(cls: type) -> None:
    assert issubclass(cls, SharedError) and issubclass(cls, ValueError)
    assert cls.__doc__ and "\n" not in cls.__doc__.strip()


def test_the_errors_module_exports_exactly_its_classes() -> None:
    assert sorted(shared.errors.__all__) == sorted(cls.__name__ for cls in _classes_of_errors_module())


@pytest.mark.parametrize("cls", [PayloadError, TermsError, SetupError, PrivacyError], ids=lambda cls: cls.__name__)
def test_the_older_subtrees_hang_under_the_base(cls: type) -> None:
    assert issubclass(cls, SharedError) and issubclass(cls, ValueError)


def test_a_wrong_privacy_input_is_no_privacy_error() -> None:
    """A site leaves a secure round on a PrivacyError; a wrong-sized seed must not be mistaken for one."""
    assert not issubclass(PrivacyInputError, PrivacyError)


def test_the_errors_module_imports_nothing() -> None:
    tree = ast.parse(Path(shared.errors.__file__).read_text())
    imports = [node for node in ast.walk(tree) if isinstance(node, ast.Import | ast.ImportFrom)]
    assert all(isinstance(node, ast.ImportFrom) and node.module == "__future__" for node in imports)
