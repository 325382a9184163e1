"""The public face: each public module's `__all__` is what users are promised, and every name in it is documented.

Two tiers: a package's `__all__` lists the names users may import (each one named on a docs page, in an example or
in a README block: checked here by reading that text, not against a hand list); the names only sibling packages
use live in the package's `_contract` module, which users do not import (tests/test_layering.py allows exactly
those across rooms). `__all__` lists are sorted, every listed name is defined, and `reshard.sim` does not re-export
`reshard.cost`'s names (users import the cost model from `reshard.cost`).

The `__all__` lists are read from the source (the integrations import optional packages), so every public module
is covered in every environment: those of `reshard/integrations/` too.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "reshard"

IMPORTABLE = ["reshard", "reshard.planner", "reshard.cost", "reshard.kernels", "reshard.comm", "reshard.refit",
              "reshard.sim", "reshard.testing", "reshard.models"]
"""The public modules that import in the core environment (the integrations need their frameworks)."""

UNDOCUMENTED_INTEGRATIONS: dict[str, frozenset[str]] = {}
"""Exported integration names no page names yet, kept here until their package decides (document the name or
take it out of `__all__`); each entry must still be undocumented, so the list only shrinks."""

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_FENCE = re.compile(r"^```.*?$(.*?)^```", re.S | re.M)
_SPAN = re.compile(r"`((?:[^`\n]|\n(?!\s*\n))+)`")  # a code span may break a line, not a paragraph


def public_modules() -> list[tuple[str, Path]]:
    """`(module name, path)` of every public module of `reshard/`: no `_`-prefixed part in its dotted name."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts[:-1]) if rel.name == "__init__" else list(rel.parts)
        if "__pycache__" in path.parts or any(p.startswith("_") for p in parts):
            continue
        found.append((".".join(parts), path))
    return found


def declared_all(source: str) -> list[str] | None:
    """The literal `__all__` of a module's source, or None when it has none."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    return None


def markdown_names(text: str) -> set[str]:
    """The identifiers a Markdown page shows as code: in its fenced blocks and its `inline code` spans."""
    code = [m.group(1) for m in _FENCE.finditer(text)]
    prose = _FENCE.sub("", text)
    code += _SPAN.findall(prose)
    return {name for chunk in code for name in _IDENTIFIER.findall(chunk)}


def documented_names(root: Path = ROOT) -> set[str]:
    """Every identifier the docs show as code (README.md, docs/*.md) or an example uses (examples/*.py)."""
    names: set[str] = set()
    for page in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        names |= markdown_names(page.read_text())
    for example in sorted((root / "examples").glob("*.py")):
        names |= set(_IDENTIFIER.findall(example.read_text()))
    return names


def undocumented(exports: dict[str, list[str]], documented: set[str]) -> dict[str, list[str]]:
    """`module -> its exported names that no page, example or README block names` (modules with none left out)."""
    missing = {m: [n for n in names if n not in documented] for m, names in exports.items()}
    return {m: names for m, names in missing.items() if names}


def exports() -> dict[str, list[str]]:
    """`module -> __all__` for every public module that declares one."""
    found = {}
    for module, path in public_modules():
        names = declared_all(path.read_text())
        if names is not None:
            found[module] = names
    return found


def isort_key(name: str) -> tuple[int, str]:
    """The order ruff's RUF022 keeps `__all__` in: CONSTANTS, then Classes, then functions, each alphabetical."""
    return (0 if name.isupper() else 1 if name[:1].isupper() else 2, name)


def test_every_exported_name_is_documented() -> None:
    found = exports()
    assert {"reshard", "reshard.planner", "reshard.integrations.vllm", "reshard.integrations.hf"} <= set(found)
    missing = undocumented(found, documented_names())
    for module, names in UNDOCUMENTED_INTEGRATIONS.items():
        left = set(missing.get(module, ())) - names
        missing.pop(module, None)
        if left:
            missing[module] = sorted(left)
    assert not missing, ("exported but named on no docs page, in no example and no README block (document each, or "
                         f"take it out of `__all__`; a name only sibling packages use goes in `_contract`): {missing}")


def test_undocumented_integration_list_is_current() -> None:
    found, documented = exports(), documented_names()
    for module, names in UNDOCUMENTED_INTEGRATIONS.items():
        assert names <= set(found.get(module, ())), f"{module} no longer exports {sorted(names - set(found[module]))}"
        assert not names & documented, f"now documented, drop from UNDOCUMENTED_INTEGRATIONS: {names & documented}"


def test_check_flags_an_exported_name_no_page_names(tmp_path: Path) -> None:
    # negative control: a name added to an `__all__` and mentioned nowhere fails; prose (not code) does not count
    (tmp_path / "docs").mkdir()
    (tmp_path / "examples").mkdir()
    (tmp_path / "README.md").write_text("Use `plan` and\n```python\nfrom reshard import Box\n```\nthe Layout class.\n")
    (tmp_path / "docs" / "a.md").write_text("`reshard.cost.link_time(loads)` models a link.\n")
    (tmp_path / "examples" / "e.py").write_text("import reshard\nreshard.fuse()\n")
    documented = documented_names(tmp_path)
    assert {"plan", "Box", "link_time", "cost", "fuse"} <= documented
    assert "Layout" not in documented  # named in prose only
    assert undocumented({"reshard": ["Box", "Layout", "plan", "brand_new"]}, documented) == {
        "reshard": ["Layout", "brand_new"]}
    # and the real docs do not name a made-up export
    assert undocumented({"reshard": ["Box", "not_a_documented_name"]}, documented_names()) == {
        "reshard": ["not_a_documented_name"]}


@pytest.mark.parametrize("module", sorted(exports()))
def test_all_is_sorted_and_unique(module: str) -> None:
    names = exports()[module]
    assert names == sorted(names, key=isort_key), f"{module}.__all__ is not sorted (constants, classes, functions)"
    assert len(set(names)) == len(names), f"{module}.__all__ repeats a name"


@pytest.mark.parametrize("name", IMPORTABLE)
def test_all_is_importable(name: str) -> None:
    module = importlib.import_module(name)
    assert module.__doc__, f"{name} has no docstring"
    for n in module.__all__:
        assert hasattr(module, n), f"{name}.__all__ lists {n!r}, which it does not define"
    star: dict = {}
    exec(f"from {name} import *", star)  # what `import *` gives is exactly __all__
    assert set(star) - {"__builtins__"} == set(module.__all__)


def test_sim_does_not_reexport_cost() -> None:
    import reshard.cost
    import reshard.sim

    shared = sorted(set(reshard.sim.__all__) & set(reshard.cost.__all__))
    assert not shared, f"reshard.sim re-exports reshard.cost's {shared}: users import them from reshard.cost"
    assert not hasattr(reshard.sim, "Hardware") and not hasattr(reshard.sim, "link_time")


def test_reexports_are_the_same_objects() -> None:
    import reshard
    import reshard.comm
    import reshard.cost
    import reshard.kernels
    import reshard.planner

    assert reshard.kernels.Box is reshard.planner.Box is reshard.Box
    assert reshard.gather_broadcast_bytes is reshard.cost.gather_broadcast_bytes
    assert reshard.execute is reshard.comm.execute and reshard.ExplicitLayout is reshard.planner.ExplicitLayout
