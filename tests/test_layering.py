"""The import graph of `reshard/` follows the data flow: no package imports one above it.

An AST walk over every module (imports inside functions included) checks each import against the table below,
which is the contract: planner < cost < kernels < comm < refit < integrations; sim uses planner and cost (and the
model shapes) only; testing and the top-level modules (the public `__init__`, the command line, the demo) may use
any of them. The pure packages (planner, cost, sim, models) make no `torch.distributed` process-group calls:
importing DTensor's placement classes (`torch.distributed.tensor`) is fine, `torch.distributed` itself is not.
Nothing in `reshard/` imports tests, perf or examples, and no `reshard` import hides in a function.

Inside the units too, the modules form no circle: the graph of module imports (those under `TYPE_CHECKING` and in
functions included) has no cycle, so each module can be read knowing only the ones below it (`planner/_plan` and
`planner/_format` formed the last one, until `describe` moved to the plan type).

And every room keeps its private parts: a room is a package of `reshard/` or one integration, and no module imports
another room's private module or name (`reshard.comm._handshake`, `from reshard.kernels import _pieces`): what
crosses is in the room's `__all__` (what users are promised, each name documented: tests/test_public_api.py) or
in its contract module `_contract` (the names only sibling packages use; each one used by another room, none also in
`__all__`), and nothing else the package happens to hold (on `70ef1cc` 26 imports crossed). The integrations are
shared homes (`SHARED_INTEGRATIONS`: the trainer side, the engine side, the group layout, the fused engine tensors,
the Hugging Face config vocabulary), which import no specific integration, and specific ones (vllm, verl, trl, hf,
megatron, deepspeed), which import only the shared homes, except verl -> vllm (`INTEGRATION_IMPORTS`: verl drives
vLLM engines). The package `reshard.integrations` itself imports the specific ones that register their kinds.
"""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "reshard"

TOP = "top"  # reshard/__init__.py, __main__.py and the other modules directly in reshard/ but models.py
ALLOWED: dict[str, frozenset[str]] = {
    "models": frozenset(),  # model shapes: a pure leaf, at the planner's level
    "planner": frozenset({"models"}),
    "cost": frozenset({"planner"}),
    "kernels": frozenset({"planner"}),
    "comm": frozenset({"planner", "cost", "kernels"}),
    "refit": frozenset({"planner", "cost", "kernels", "comm", "models"}),
    "integrations": frozenset({"planner", "cost", "kernels", "comm", "refit", "models"}),
    "sim": frozenset({"planner", "cost", "models"}),
    "testing": frozenset({"planner", "cost", "kernels", "comm", "refit", "integrations", "sim", "models"}),
    TOP: frozenset({"planner", "cost", "kernels", "comm", "refit", "integrations", "sim", "testing", "models", TOP}),
}
"""Which units each unit may import (besides itself)."""

PURE = frozenset({"models", "planner", "cost", "sim"})
"""Units that may not touch `torch.distributed` beyond its DTensor placement types."""

DISTRIBUTED_OK = ("torch.distributed.tensor",)
"""The part of `torch.distributed` the pure units may import: placement classes, no process group."""

FORBIDDEN_ROOTS = frozenset({"tests", "perf", "examples", "conftest"}) | frozenset(
    p.stem for d in ("tests", "perf", "examples") if (ROOT / d).is_dir() for p in (ROOT / d).rglob("*.py")
)
"""Top-level module names of the tooling beside the library (tests run with `tests/` on `sys.path`)."""

LAZY_RESHARD_IMPORTS: frozenset[tuple[str, str]] = frozenset({
    # the vLLM engine side imports vLLM (seconds, and absent from trainer environments): loaded on first use
    ("reshard/integrations/vllm/__init__.py", "reshard.integrations.vllm"),
    ("reshard/integrations/vllm/__init__.py", "reshard.integrations.vllm._layouts"),
})
"""`(module path, imported module)` of the function-level `reshard` imports that start-up cost justifies (each
with a one-line reason beside it in the code)."""


def unit_of(module: str) -> str:
    """The unit of a `reshard` module name: `reshard.planner._plan` -> `planner`, `reshard._demo` -> `top`."""
    parts = module.split(".")
    assert parts[0] == "reshard", module
    if len(parts) == 1:
        return TOP
    if parts[1] == "models":
        return "models"
    if parts[1] in ALLOWED:
        return parts[1]
    if parts[1].startswith("_"):  # a top-level private module (`_demo`, `_report`, `__main__`)
        return TOP
    raise AssertionError(f"module {module}: unit {parts[1]!r} is not in the layering table; add it to ALLOWED")


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(tree: ast.AST, module: str, is_package: bool) -> list[tuple[ast.stmt, str, tuple[str, ...], bool]]:
    """`(node, imported module, names, inside a function)` for every import in `tree`; relative imports resolved."""
    out = []
    in_function: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            for inner in ast.walk(node):
                if inner is not node:
                    in_function.add(id(inner))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                out.append((node, a.name, (), id(node) in in_function))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.append((node, target, tuple(a.name for a in node.names), id(node) in in_function))
    return out


def violations(source: str, module: str, *, is_package: bool = False, path: str = "<source>") -> list[str]:
    """Every import of `source` (the text of `reshard` module `module`) that the table forbids."""
    tree = ast.parse(source)
    unit = unit_of(module)
    found = []
    for node, target, names, in_function in _imports(tree, module, is_package):
        where = f"{path}:{node.lineno}"
        root = target.split(".")[0]
        if root in FORBIDDEN_ROOTS:
            found.append(f"{where}: {module} imports {target} (tooling beside the library)")
        if root == "reshard":
            if target == "reshard":
                # `from reshard import planner` imports a unit; `from reshard import Layout` the public face (top)
                pairs = [(f"reshard.{n}", n if n in ALLOWED or n == "models" else TOP) for n in names]
                pairs = pairs or [(target, TOP)]
            else:
                pairs = [(target, unit_of(target))]
            for t, t_unit in pairs:
                if t_unit != unit and t_unit not in ALLOWED[unit]:
                    found.append(f"{where}: {module} ({unit}) imports {t} ({t_unit}); {unit} may import "
                                 f"{sorted(ALLOWED[unit]) or 'no other unit'}")
            if in_function and (path, target) not in LAZY_RESHARD_IMPORTS:
                found.append(f"{where}: {module} imports {target} inside a function (import it at module level, "
                             "or list it in LAZY_RESHARD_IMPORTS with the start-up cost that justifies it)")
        if unit in PURE and (target == "torch.distributed" or target.startswith("torch.distributed.")):
            allowed = any(target == ok or target.startswith(ok + ".") for ok in DISTRIBUTED_OK)
            if target == "torch.distributed" and isinstance(node, ast.ImportFrom):
                allowed = all(n == "tensor" for n in names)
            if not allowed:
                found.append(f"{where}: {module} ({unit}, pure) imports {target}: no process groups here")
    if unit in PURE:
        for node in ast.walk(tree):
            # `torch.distributed.<call>` through a plain `import torch`
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                    and isinstance(node.value.value, ast.Name) and node.value.value.id == "torch"
                    and node.value.attr == "distributed" and node.attr != "tensor"):
                found.append(f"{path}:{node.lineno}: {module} ({unit}, pure) uses torch.distributed.{node.attr}")
    return found


def library_modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


@pytest.mark.parametrize("path", library_modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_module_follows_the_layering(path: Path) -> None:
    found = violations(path.read_text(), module_name(path), is_package=path.name == "__init__.py",
                       path=str(path.relative_to(ROOT)))
    assert not found, "\n".join(found)


def test_every_unit_of_the_table_is_known() -> None:
    # a new subpackage of reshard/ must be placed in the table (unit_of raises otherwise)
    units = {unit_of(module_name(p)) for p in library_modules()}
    assert {"planner", "cost", "kernels", "comm", "refit", "sim", "models", TOP} <= units
    assert units <= set(ALLOWED)


def test_table_has_no_cycle_and_follows_the_stack() -> None:
    # the table itself is a strict order: no unit may import one that may import it back
    for unit, deps in ALLOWED.items():
        for dep in deps - {unit}:
            assert unit not in ALLOWED[dep] or unit == dep, f"{unit} <-> {dep}"
    stack = ["planner", "cost", "kernels", "comm", "refit", "integrations"]
    for i, unit in enumerate(stack):
        assert not ALLOWED[unit] & set(stack[i + 1:]), f"{unit} may import a unit above it"
    assert ALLOWED["sim"] == {"planner", "cost", "models"}


def import_graph(sources: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """`module -> the reshard modules it imports`, for `sources` (`module -> (its text, whether it is a package)`).

    `from reshard.planner import _checks` imports the module `reshard.planner._checks`; `from reshard.planner
    import Box` the package `reshard.planner` (its `__init__`). Every import counts: module level, in a function,
    under `TYPE_CHECKING`."""
    graph: dict[str, set[str]] = {m: set() for m in sources}
    for module, (source, is_package) in sources.items():
        for _, target, names, _ in _imports(ast.parse(source), module, is_package):
            if target.split(".")[0] != "reshard":
                continue
            for t in [f"{target}.{n}" if f"{target}.{n}" in sources else target for n in names] or [target]:
                if t in sources and t != module:
                    graph[module].add(t)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of `graph` as `[a, b, ..., a]`, or `[]` when there is none (depth-first, in sorted order)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str]:
        state[m] = 1
        path.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                return path[path.index(t):] + [t]
            if t not in state and (found := visit(t)):
                return found
        state[m] = 2
        path.pop()
        return []

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return []


def test_modules_form_no_import_cycle() -> None:
    sources = {module_name(p): (p.read_text(), p.name == "__init__.py") for p in library_modules()}
    graph = import_graph(sources)
    assert sum(map(len, graph.values())) > 100  # the walk sees the imports (about 250 edges)
    cycle = find_cycle(graph)
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_cycle_check_flags_a_circle_through_type_checking() -> None:
    # the circle this check was written for: `_plan` imported `describe_plan`, `_format` imported `Plan` for a hint
    sources = {
        "reshard.planner": ("from reshard.planner._plan import plan\n", True),
        "reshard.planner._plan": ("from reshard.planner._format import describe_plan\n", False),
        "reshard.planner._format": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                    "    from reshard.planner._plan import Plan\n", False),
        "reshard.planner._box": ("from reshard.planner import Box\n", False),
    }
    assert find_cycle(import_graph(sources)) == ["reshard.planner._plan", "reshard.planner._format",
                                                 "reshard.planner._plan"]
    sources["reshard.planner._format"] = ("from reshard.planner._types import PlanStats\n", False)
    assert find_cycle(import_graph(sources)) == []
    # a module importing its own package's __init__, which imports it back
    sources["reshard.planner"] = ("from reshard.planner._box import Box\n", True)
    assert find_cycle(import_graph(sources)) == ["reshard.planner", "reshard.planner._box", "reshard.planner"]


# ---- negative controls: the checker flags what it must ---------------------------------------------------------

@pytest.mark.parametrize(
    ("module", "source", "expected"),
    [
        # the cycle this table removed: the simulator reaching into refit for the FP8 plan items
        ("reshard.sim._simulate", "def f():\n    from reshard.refit._fp8 import Fp8Weight\n",
         ["sim) imports reshard.refit._fp8 (refit)", "inside a function"]),
        ("reshard.planner._plan", "import torch.distributed as dist\n", ["pure) imports torch.distributed"]),
        ("reshard.planner._plan", "from torch.distributed import all_gather\n", ["pure) imports torch.distributed"]),
        ("reshard.cost._model", "import torch\nx = torch.distributed.new_group([0, 1])\n",
         ["uses torch.distributed.new_group"]),
        ("reshard.planner._x", "from reshard.comm import Group\n", ["(planner) imports reshard.comm (comm)"]),
        ("reshard.cost._x", "from reshard.sim import simulate\n", ["(cost) imports reshard.sim (sim)"]),
        ("reshard.kernels._x", "from reshard.comm._group import Group\n", ["(kernels) imports reshard.comm._group"]),
        ("reshard.comm._x", "from reshard.refit import Refit\n", ["(comm) imports reshard.refit (refit)"]),
        ("reshard.refit._x", "from reshard.sim import System\n", ["(refit) imports reshard.sim (sim)"]),
        ("reshard.refit._x", "from reshard import Layout\n", ["(refit) imports reshard.Layout (top)"]),
        ("reshard.planner._x", "from .._demo import run_demo\n", ["imports reshard._demo (top)"]),
        ("reshard.comm._x", "import comm_cases\n", ["imports comm_cases (tooling"]),
        ("reshard.sim._x", "from perf import scenarios\n", ["imports perf (tooling"]),
    ],
)
def test_checker_flags_a_violating_module(module: str, source: str, expected: list[str]) -> None:
    found = violations(source, module)
    for text in expected:
        assert any(text in f for f in found), (text, found)


def test_checker_passes_allowed_imports() -> None:
    source = textwrap.dedent("""
        import torch
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.placement_types import _StridedShard
        from reshard.planner._box import Box
        from reshard.models import PRESETS
        from . import _hardware
        x = torch.distributed.tensor.Shard(0)
    """)
    assert violations(source, "reshard.cost._model") == [
        "<source>:6: reshard.cost._model (cost) imports reshard.models (models); cost may import ['planner']"
    ]
    assert violations(source.replace("from reshard.models import PRESETS\n", ""), "reshard.cost._model") == []
    # the top level may import any unit, a function-level reshard import is still flagged
    assert violations("from reshard.sim import main\nfrom reshard.refit import Refit\n", "reshard.__main__") == []
    assert violations("def f():\n    from reshard.sim import main\n", "reshard.__main__")


# ---- integrations: third-party packages imported lazily, reshard's lower units through their public names -----------

LAZY_INTEGRATIONS: dict[str, str] = {
    "reshard/integrations/megatron": "megatron",  # megatron-core lives in the trainer's environment only
    "reshard/integrations/trl": "trl",  # TRL lives in .venv-trl only
    "reshard/integrations/deepspeed": "deepspeed",  # DeepSpeed lives in .venv-trl only (make deepspeed-env)
}
"""Integration package -> the third-party package it may import only inside functions (the integration then
imports everywhere; the package is needed only when it is used)."""


@pytest.mark.parametrize("package", sorted(LAZY_INTEGRATIONS))
def test_integration_imports_lazily_and_only_public_names(package: str) -> None:
    third = LAZY_INTEGRATIONS[package]
    own = module_name(ROOT / package / "__init__.py")
    found = []
    for path in sorted((ROOT / package).rglob("*.py")):
        module = module_name(path)
        for node, target, _, in_function in _imports(ast.parse(path.read_text()), module, path.name == "__init__.py"):
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            if target.split(".")[0] == third and not in_function:
                found.append(f"{where}: imports {target} at module level (import it where it is used)")
            parts = target.split(".")
            if parts[0] == "reshard" and not target.startswith(own) and any(p.startswith("_") for p in parts):
                found.append(f"{where}: imports {target}, a private module of another unit (use its public names)")
    assert not found, "\n".join(found)


# ---- rooms: no module reaches into another room's private modules or names -------------------------------------------

SHARED_INTEGRATIONS = frozenset({"fused", "group_layout", "model_config", "trainer", "trainer_link", "engine_side"})
"""The shared homes of `reshard/integrations/`, which every integration may import and which import only each other:
the fused engine tensors (`fused.py`), the group's ranks (`group_layout.py`), what a Hugging Face config says
(`model_config.py`), the trainer side's sources and link (`trainer.py`, `trainer_link.py`) and the engine side's
update state machine (`engine_side.py`)."""

INTEGRATION_IMPORTS: dict[str, frozenset[str]] = {
    "verl": frozenset({"vllm"}),  # verl's rollout runs vLLM engines: it may drive the vLLM integration
}
"""Which specific integrations each specific integration may import, besides `SHARED_INTEGRATIONS`; absent: none.
A shared home may import no specific integration."""


def room_of(module: str) -> str:
    """The room of a `reshard` module: its package of `reshard/` (`reshard.comm._group` -> `comm`), or for
    integrations the integration (`reshard.integrations.verl._stream` -> `integrations.verl`,
    `reshard.integrations.hf` -> `integrations.hf`); the modules directly in `reshard/` are the room `top`."""
    parts = module.split(".")
    assert parts[0] == "reshard", module
    if len(parts) == 1 or (PACKAGE / parts[1]).with_suffix(".py").is_file() or parts[1].startswith("_"):
        return TOP
    if parts[1] == "integrations" and len(parts) > 2:
        return f"integrations.{parts[2]}"
    return parts[1]


CONTRACT = "_contract"
"""The one private module of a room that other rooms may import: `reshard/<room>/_contract.py`, the names only
sibling packages use (users import what the package's `__all__` lists)."""


UNLISTED_CROSSINGS: frozenset[tuple[str, str, str]] = frozenset({
})
"""`(importing module, imported module, name)` of the crossings of a name in neither `__all__` nor a contract that
are still waiting for their room to export it or move it to its contract; each must still occur."""


def module_path(module: str) -> Path | None:
    """The source file of `reshard` module `module` (`reshard.comm` -> `reshard/comm/__init__.py`), or None."""
    base = PACKAGE.parent.joinpath(*module.split("."))
    for path in (base / "__init__.py", base.with_suffix(".py")):
        if path.is_file():
            return path
    return None


def declared_all(module: str) -> frozenset[str] | None:
    """The literal `__all__` of `reshard` module `module`, read from its source (no import), or None without one."""
    path = module_path(module)
    if path is None:
        return None
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return frozenset(ast.literal_eval(node.value))
    return None


def is_contract(target: str) -> bool:
    """Whether `target` is a room's contract module (`reshard.planner._contract`,
    `reshard.integrations.vllm._contract`)."""
    parts = target.split(".")
    return parts[-1] == CONTRACT and not any(p.startswith("_") for p in parts[1:-1]) and room_of(target) != TOP


def private_crossings(source: str, module: str, *, is_package: bool = False, path: str = "<source>",
                      exports: Callable[[str], frozenset[str] | None] | None = None) -> list[str]:
    """Every import of `source` (the text of `reshard` module `module`) of another room's private module (a `_`
    part in the imported module's name, but a room's `_contract`) or private name (`from reshard.comm import
    _wire`, `... import _x`), and of a name the room does not export: `from reshard.planner import X` needs `X` in
    `reshard.planner.__all__` (`from reshard.planner._contract import X` in the contract's). `exports(module)` gives
    a module's `__all__` (default: read from its source); a submodule (`from reshard import planner`) is no name."""
    exports = exports or declared_all
    room = room_of(module)
    found = []
    for node, target, names, _ in _imports(ast.parse(source), module, is_package):
        if target.split(".")[0] != "reshard" or room_of(target) == room:
            continue
        shown = f"from {target} import {', '.join(names)}" if names else f"import {target}"
        parts = target.split(".")[1:]
        private = [p for p in (parts[:-1] if is_contract(target) else parts) if p.startswith("_")]
        private += [n for n in names if n.startswith("_")]
        if private:
            found.append(f"{path}:{node.lineno}: {module} ({room}) {shown}: {', '.join(private)} is private to "
                         f"{room_of(target)}; import what its package exports (or, for sibling packages only, its "
                         f"{CONTRACT} module)")
            continue
        listed = exports(target)
        if listed is None:
            continue
        unlisted = [n for n in names if n not in listed and module_path(f"{target}.{n}") is None
                    and (module, target, n) not in UNLISTED_CROSSINGS]
        if unlisted:
            what = "contract" if is_contract(target) else "__all__"
            found.append(f"{path}:{node.lineno}: {module} ({room}) {shown}: {', '.join(unlisted)} not in {target}'s "
                         f"{what}; a name another room uses is exported (documented) or in {room_of(target)}'s "
                         f"{CONTRACT} module")
    return found


def integration_crossings(source: str, module: str, *, is_package: bool = False, path: str = "<source>") -> list[str]:
    """Every import by an integration of another integration that `INTEGRATION_IMPORTS` does not allow."""
    room = room_of(module)
    if not room.startswith("integrations."):
        return []
    own = room.split(".", 1)[1]
    allowed = SHARED_INTEGRATIONS | (frozenset() if own in SHARED_INTEGRATIONS else
                                     INTEGRATION_IMPORTS.get(own, frozenset()))
    found = []
    for node, target, names, _ in _imports(ast.parse(source), module, is_package):
        parts = target.split(".")
        if parts[:2] != ["reshard", "integrations"]:
            continue
        others = [parts[2]] if len(parts) > 2 else [n for n in names if n in _integration_names()]
        for other in others:
            if other != own and other not in allowed:
                kind = "shared home" if own in SHARED_INTEGRATIONS else "integration"
                found.append(f"{path}:{node.lineno}: {kind} {own} imports integration {other}; {own} may import "
                             f"{sorted(allowed)} (shared homes import no specific integration; specific ones import "
                             "each other only as INTEGRATION_IMPORTS says)")
    return found


def _integration_names() -> frozenset[str]:
    """The integrations: the packages and modules of `reshard/integrations/` (`vllm`, `hf`, ...)."""
    base = PACKAGE / "integrations"
    return frozenset(p.stem for p in base.iterdir() if not p.name.startswith("_")
                     and (p.suffix == ".py" or (p / "__init__.py").is_file())) | SHARED_INTEGRATIONS


@pytest.mark.parametrize("path", library_modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_module_keeps_to_public_names_of_other_rooms(path: Path) -> None:
    kw = dict(is_package=path.name == "__init__.py", path=str(path.relative_to(ROOT)))
    source, module = path.read_text(), module_name(path)
    found = private_crossings(source, module, **kw) + integration_crossings(source, module, **kw)
    assert not found, "\n".join(found)


def test_unlisted_crossings_are_current() -> None:
    for module, target, name in sorted(UNLISTED_CROSSINGS):
        path = module_path(module)
        assert path is not None, module
        imported = {(t, n) for _, t, names, _ in _imports(ast.parse(path.read_text()), module,
                                                           path.name == "__init__.py") for n in names}
        assert (target, name) in imported, f"{module} no longer imports {name} from {target}: drop the entry"
        assert name not in (declared_all(target) or ()), f"{target} now exports {name}: drop the entry"


def test_contract_modules_hold_only_what_siblings_use() -> None:
    # a contract name is used by another room (else it is the room's own) and is not also promised to users
    contracts = sorted(module_name(p) for p in library_modules() if p.stem == CONTRACT)
    assert {"reshard.planner._contract", "reshard.comm._contract"} <= set(contracts)
    used: set[tuple[str, str]] = set()
    for path in library_modules():
        module = module_name(path)
        for _, target, names, _ in _imports(ast.parse(path.read_text()), module, path.name == "__init__.py"):
            if is_contract(target) and room_of(target) != room_of(module):
                used |= {(target, n) for n in names}
    for contract in contracts:
        names = declared_all(contract)
        assert names, f"{contract} declares no __all__"
        package = contract.rsplit(".", 1)[0]
        unused = sorted(n for n in names if (contract, n) not in used)
        assert not unused, f"{contract} lists {unused}, which no other room imports: keep them private to {package}"
        both = sorted(names & (declared_all(package) or frozenset()))
        assert not both, f"{both} are in both {package}.__all__ and its contract: a name is one or the other"


@pytest.mark.parametrize(
    ("module", "source", "expected"),
    [
        # a name the package holds but does not export, and a contract name imported from the package
        ("reshard.refit._x", "from reshard.planner import Box, _checks\n", "_checks is private to planner"),
        ("reshard.refit._x", "from reshard.comm import broadcast_bytes\n",
         "broadcast_bytes not in reshard.comm's __all__"),
        ("reshard.refit._x", "from reshard.planner._contract import Box\n",
         "Box not in reshard.planner._contract's contract"),
        ("reshard.sim._x", "from reshard.planner._plan import plan\n", "_plan is private to planner"),
        ("reshard.sim._x", "from reshard.planner._contract._x import y\n", "_contract, _x is private to planner"),
    ],
)
def test_private_check_flags_an_unexported_name(module: str, source: str, expected: str) -> None:
    found = private_crossings(source, module)
    assert any(expected in f for f in found), (expected, found)


def test_private_check_allows_contracts_and_exports() -> None:
    source = ("from reshard.planner._contract import Fp8Items, encode_layout\nfrom reshard.planner import Box, plan\n"
              "from reshard.comm._contract import broadcast_bytes\nfrom reshard import planner\n")
    assert private_crossings(source, "reshard.refit._x") == []
    # the exports come from the package's __all__: a made-up export list flags what it leaves out
    assert private_crossings("from reshard.planner import Box, plan\n", "reshard.refit._x",
                             exports=lambda m: frozenset({"Box"}) if m == "reshard.planner" else None)


@pytest.mark.parametrize(
    ("module", "source", "expected"),
    [
        # the crossings this check was written for (main 70ef1cc)
        ("reshard.refit._refit", "from reshard.comm._handshake import agree, all_gather_json\n",
         "(refit) from reshard.comm._handshake import agree, all_gather_json: _handshake is private to comm"),
        ("reshard.kernels._pack", "from reshard.planner._box import Box\n", "_box is private to planner"),
        ("reshard.comm._fingerprint", "from reshard.kernels import _checksum\n", "_checksum is private to kernels"),
        ("reshard.comm._fingerprint", "from reshard.kernels import checksum, _pieces\n", "_pieces is private"),
        ("reshard.sim._simulate", "import reshard.planner._fp8 as f\n", "import reshard.planner._fp8: _fp8"),
        ("reshard.integrations.verl._vllm", "from reshard.integrations.vllm._trainer import ReshardTrainer\n",
         "(integrations.verl) from reshard.integrations.vllm._trainer"),
        ("reshard.integrations.hf", "from reshard.integrations.verl._stream import local_of\n",
         "_stream is private to integrations.verl"),
        ("reshard", "from reshard.planner._dtypes import dtype_from_name\n", "(top) from reshard.planner._dtypes"),
    ],
)
def test_private_check_flags_a_crossing(module: str, source: str, expected: str) -> None:
    found = private_crossings(source, module)
    assert any(expected in f for f in found), (expected, found)


def test_private_check_passes_own_room_and_public_names() -> None:
    assert private_crossings("from reshard.comm._group import Group\nfrom . import _wire\n", "reshard.comm._api") == []
    assert private_crossings("from reshard.comm import Group, agree\nfrom reshard.planner import Box\n",
                             "reshard.refit._refit") == []
    # one integration's private modules are its own, not the other integrations'
    assert private_crossings("from reshard.integrations.verl._stream import _full_mesh\n",
                             "reshard.integrations.verl._vllm") == []
    assert private_crossings("from reshard.integrations.fused import EngineTensor\n", "reshard.integrations.hf") == []


@pytest.mark.parametrize(
    ("module", "source", "flagged"),
    [
        ("reshard.integrations.verl._vllm", "from reshard.integrations.vllm import ReshardTrainer\n", False),
        ("reshard.integrations.verl._x", "from reshard.integrations import fused, trainer_link\n", False),
        ("reshard.integrations.vllm._x", "from reshard.integrations.trainer import x\n", False),
        ("reshard.integrations.vllm._x", "from reshard.integrations.engine_side import Updates\n", False),
        ("reshard.integrations.hf", "from reshard.integrations.fused import EngineTensor\n", False),
        ("reshard.integrations.engine_side", "from reshard.integrations.group_layout import GroupLayout\n", False),
        # the crossings the shared homes were made for: each is flagged now
        ("reshard.integrations.trainer", "def f():\n    from reshard.integrations.megatron import add_sources\n",
         True),
        ("reshard.integrations.trainer_link", "from reshard.integrations.vllm import ReshardTrainer\n", True),
        ("reshard.integrations.engine_side", "from reshard.integrations.hf import model_facts\n", True),
        ("reshard.integrations.trl._sync", "from reshard.integrations.vllm import ReshardTrainer\n", True),
        ("reshard.integrations.trl._generation", "from reshard.integrations.deepspeed import partition_source\n",
         True),
        ("reshard.integrations.deepspeed._sources", "from reshard.integrations.hf import model_facts\n", True),
        ("reshard.integrations.vllm._x", "from reshard.integrations.hf import model_facts\n", True),
        ("reshard.integrations.hf", "from reshard.integrations.engine_side import Updates\n", False),
        ("reshard.integrations.vllm._x", "from reshard.integrations.megatron import add_sources\n", True),
        ("reshard.integrations.vllm._x", "from reshard.integrations.verl import SHARD_MODE\n", True),
        ("reshard.integrations.vllm._x", "from reshard.integrations import verl\n", True),
        ("reshard.integrations.megatron._x", "from reshard.integrations.vllm import ReshardTrainer\n", True),
        ("reshard.integrations.hf", "from reshard.integrations.vllm import ReshardTrainer\n", True),
        ("reshard.integrations.vllm._x", "from reshard.integrations.verl import SHARD_MODE\n", True),
    ],
)
def test_integration_check(module: str, source: str, flagged: bool) -> None:
    assert bool(integration_crossings(source, module)) == flagged, integration_crossings(source, module)


# ---- perf/ and examples/: they use what users can use -------------------------------------------------------------

PERF_INTERNALS: dict[tuple[str, str], str] = {
    ("perf/bench_megatron.py", "reshard.refit._gather"): "wraps the gather-and-broadcast weights' own `execute` to "
    "count their bytes (instrumentation)",
    ("perf/gpu_streams_check.py", "reshard.comm._executor"): "sets the executor's slot count to compare pipeline "
    "depths (instrumentation)",
    ("perf/bench_scale.py", "reshard.refit._metawire"): "measures the metadata round's records and tables, which "
    "have no public face",
    ("perf/bench_scale.py", "reshard.refit._sources"): "times the trainer layouts' merge of the metadata round",
    ("perf/bench_scale.py", "reshard.comm._wire"): "sizes the metadata round's control messages",
    ("perf/bench_scale.py", "reshard.comm._contract"): "times the metadata round's table broadcast",
    ("perf/bench_scale.py", "reshard.comm._handshake"): "counts the agreement tree's messages from its shape",
    ("perf/bench_scale.py", "reshard._progress"): "the library's progress lines, for a long benchmark",
    ("perf/verl_gloo_baseline.py", "reshard.integrations.verl"): "the single-sender baseline engine reuses the verl "
    "backend's bucket layout (`_buckets`)",
}
"""`(perf file, reshard module)` of the benchmarks that measure or instrument what has no public name, each with
its reason; every other `reshard` import of `perf/` is of exported names."""


def perf_crossings(source: str, path: str) -> list[tuple[str, str]]:
    """`(imported module, what is wrong)` for each import of a benchmark's source of a private module or name of
    `reshard`, or of a name its module does not export."""
    found = []
    for node, target, names, _ in _imports(ast.parse(source), "perf", False):
        if target.split(".")[0] != "reshard":
            continue
        private = [p for p in target.split(".")[1:] if p.startswith("_")] + [n for n in names if n.startswith("_")]
        listed = declared_all(target)
        unlisted = [n for n in names if listed is not None and n not in listed and module_path(f"{target}.{n}") is None]
        if private or unlisted:
            found.append((target, f"{path}:{node.lineno}: imports {', '.join(private + unlisted)} of {target}"))
    return found


def perf_sources() -> list[Path]:
    """The benchmarks and the examples (the examples import only exported names: none is listed)."""
    return sorted((ROOT / "perf").glob("*.py")) + sorted((ROOT / "examples").glob("*.py"))


def test_perf_uses_public_names() -> None:
    found, seen = [], set()
    for path in perf_sources():
        rel = str(path.relative_to(ROOT))
        for target, what in perf_crossings(path.read_text(), rel):
            seen.add((rel, target))
            if (rel, target) not in PERF_INTERNALS:
                found.append(what)
    assert not found, "perf/ imports what users cannot (export and document it, or list the bench in " \
        "PERF_INTERNALS with why it measures an internal):\n" + "\n".join(found)
    stale = sorted(set(PERF_INTERNALS) - seen)
    assert not stale, f"PERF_INTERNALS entries no bench needs any more: {stale}"


def test_perf_check_flags_private_imports() -> None:
    src = ("from reshard.kernels._variants import kernel_variants\nfrom reshard.comm import broadcast_bytes\n"
           "from reshard.comm import Group, agree\nfrom reshard.integrations import hf\nimport reshard.refit._gather\n")
    assert [t for t, _ in perf_crossings(src, "perf/x.py")] == ["reshard.kernels._variants", "reshard.comm",
                                                                "reshard.refit._gather"]


def test_shared_homes_and_integrations_are_known() -> None:
    # every shared home exists (a renamed one must be renamed here), and no module of reshard/integrations/ is
    # both a shared home and a specific integration
    names = _integration_names() - SHARED_INTEGRATIONS
    base = PACKAGE / "integrations"
    assert all((base / f"{m}.py").is_file() for m in SHARED_INTEGRATIONS), sorted(SHARED_INTEGRATIONS)
    assert {"vllm", "verl", "trl", "hf", "megatron", "deepspeed"} <= names, sorted(names)
    assert set(INTEGRATION_IMPORTS) <= names and all(v <= names for v in INTEGRATION_IMPORTS.values())
