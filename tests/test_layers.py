"""The packages stack from the top down (ARCHITECTURE.md, Packages): launcher → gateway,
workers, notifier → herald (the core) → schemas. No module imports from a layer above its
own, and no service imports another service.

Every import is read from the source with ``ast``: at module level, inside functions, and
under ``if TYPE_CHECKING:`` alike, since each of them is an arrow a reader has to follow.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Higher numbers stand above lower ones. The services share a layer and do not import one
# another: a rule they both need belongs in the core.
LAYERS = {"launcher": 3, "gateway": 2, "workers": 2, "notifier": 2, "herald": 1, "schemas": 0}

Edge = tuple[str, str]  # (importing module, imported module)

def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path, root: Path = ROOT) -> Iterator[str]:
    """Every module ``path`` imports, anywhere in its body, with relative imports resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module_name(path, root).split(".")
    if path.name != "__init__.py":
        package.pop()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)]
                yield ".".join([*base, node.module] if node.module else base)
            else:
                assert node.module is not None
                yield node.module


def layered_modules(root: Path = ROOT) -> Iterator[Path]:
    for top in LAYERS:
        yield from sorted((root / top).rglob("*.py"))


def crossing_edges(root: Path = ROOT) -> set[Edge]:
    """Every import between two different layered packages that is not straight down."""
    found: set[Edge] = set()
    for path in layered_modules(root):
        importer = module_name(path, root)
        own = importer.split(".")[0]
        for imported in imported_modules(path, root):
            target = imported.split(".")[0]
            if target in LAYERS and target != own and LAYERS[target] >= LAYERS[own]:
                found.add((importer, imported))
    return found


def test_every_layered_package_is_read() -> None:
    # A package renamed or moved would make the walk below vacuous.
    for top in LAYERS:
        assert (ROOT / top / "__init__.py").is_file(), top
    assert len(list(layered_modules())) > 50


def test_the_walk_finds_arrows_up_and_sideways_wherever_they_hide(tmp_path: Path) -> None:
    sources = {
        "schemas/__init__.py": "",
        "herald/__init__.py": "import schemas\n",
        "herald/core.py": (
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from notifier.retry import Plan\n"
            "def later():\n    import launcher.cli\n"
            "from . import sibling\n"
        ),
        "herald/sibling.py": "from schemas import Job\n",
        "gateway/__init__.py": "from herald import core\n",
        "gateway/routes/__init__.py": "",
        "gateway/routes/hooks.py": "from ..bodies import x\nfrom notifier.signing import SigningKey\n",
        "workers/__init__.py": "",
        "notifier/__init__.py": "",
        "launcher/__init__.py": "from gateway import app\nfrom workers import runner\n",
    }
    for name, text in sources.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert crossing_edges(tmp_path) == {
        ("herald.core", "notifier.retry"),  # under TYPE_CHECKING
        ("herald.core", "launcher.cli"),  # inside a function
        ("gateway.routes.hooks", "notifier.signing"),  # sideways
    }
    assert "gateway.bodies" in set(imported_modules(tmp_path / "gateway/routes/hooks.py", tmp_path))
    assert "herald" in set(imported_modules(tmp_path / "herald/core.py", tmp_path))  # from . import sibling


def test_no_import_runs_up_or_sideways() -> None:
    unexpected = sorted(crossing_edges())
    assert not unexpected, "imports against the layers (launcher → services → herald → schemas):\n" + "\n".join(
        f"  {importer} imports {imported}" for importer, imported in unexpected)
