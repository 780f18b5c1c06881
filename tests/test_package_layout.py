"""The house rules of ``hf_dp/``: no import cycle between its modules, no module over 500 lines, no function over 60,
the public names where users import them, and the old module paths still served.

The import graph is read from the source (every ``import`` and ``from ... import``, function-level ones included:
a cycle through a function-level import is still a cycle of the design), except imports under ``if TYPE_CHECKING:``.
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "hf_dp"
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for n in ast.walk(node))
    return skipped


def _imported(node: ast.AST, base: list[str]) -> list[str]:
    """The dotted names an import statement may load (``from p import x``: ``p`` and ``p.x``)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        target = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    return [target] + [f"{target}.{alias.name}" for alias in node.names]


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (a name imported from a module is an edge to that module)."""
    files = {module_name(root, path): path for path in root.rglob("*.py")}
    edges: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skipped = _type_checking_nodes(tree)
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            for target in _imported(node, base):
                parts = target.split(".")
                while parts and ".".join(parts) not in files:  # a.b.name: the module a.b
                    parts.pop()
                if parts and ".".join(parts) != name:
                    edges[name].add(".".join(parts))
    return edges


def find_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return cycles


def long_functions(root: Path, limit: int) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1
                if length > limit:
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name} ({length} lines)")
    return found


# ---------------------------------------------------------------------- the package
def test_no_import_cycle_between_modules_of_hf_dp():
    assert find_cycles(import_graph(PACKAGE)) == []


def test_no_module_over_the_budget():
    long = [
        f"{path.relative_to(PACKAGE.parent)} ({n} lines)"
        for path in sorted(PACKAGE.rglob("*.py"))
        if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES
    ]
    assert long == [], "split these modules by job"


def test_no_function_over_the_budget():
    assert long_functions(PACKAGE, MAX_FUNCTION_LINES) == [], "split these functions into named steps"


def test_nothing_inside_imports_the_top_level_package():
    """``hf_dp/__init__`` imports the trainers; a module that imported ``hf_dp`` back would close a cycle."""
    graph = import_graph(PACKAGE)
    assert sorted(name for name, targets in graph.items() if "hf_dp" in targets) == []


# ---------------------------------------------------------------------- the checker itself
def _write_package(root: Path, files: dict[str, str]) -> Path:
    package = root / "pkg"
    for name, text in files.items():
        path = package / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return package


def test_the_checker_finds_a_cycle_through_a_function_level_import(tmp_path):
    package = _write_package(
        tmp_path,
        {
            "__init__.py": "",
            "a.py": "from .b import helper\n",
            "b.py": "def helper():\n    from .a import nothing\n",
            "c.py": "from . import a\n",
        },
    )
    assert find_cycles(import_graph(package)) == [["pkg.a", "pkg.b"]]


def test_the_checker_finds_a_cycle_through_a_package_init_and_ignores_type_checking(tmp_path):
    package = _write_package(
        tmp_path,
        {
            "__init__.py": "from .sub.x import X\n",
            "sub/__init__.py": "",
            "sub/x.py": "from .. import version\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
            "    from ..y import Y\nX = 1\n",
            "y.py": "from .sub.x import X\n",
        },
    )
    cycles = find_cycles(import_graph(package))
    assert cycles == [["pkg", "pkg.sub.x"]]  # `from ... import version` is `import pkg`; y -> x is no cycle


def test_the_checker_sees_a_cycle_introduced_in_hf_dp(tmp_path):
    """The real package with one import added (release -> trainers, the wrong way): the check fails on it."""
    import shutil

    copy = tmp_path / "hf_dp"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    card = copy / "release" / "model_card.py"
    card.write_text(card.read_text(encoding="utf-8") + "\n\ndef _late():\n    from ..trainers import mixin\n")
    cycles = find_cycles(import_graph(copy))
    assert any({"hf_dp.release.model_card", "hf_dp.trainers.mixin"} <= set(c) for c in cycles), cycles


def test_the_length_checks_count_what_they_should(tmp_path):
    package = _write_package(tmp_path, {"m.py": "def f():\n" + "    x = 1\n" * 60 + "\n\ndef g():\n    pass\n"})
    assert long_functions(package, 60) == ["pkg/m.py:1 f (61 lines)"]


# ---------------------------------------------------------------------- public names and old paths
PUBLIC_NAMES = [
    "CLIPPING_MODES",
    "BookKeepingClipper",
    "DPArgumentsMixin",
    "DPCallback",
    "DPSeq2SeqTrainer",
    "DPSeq2SeqTrainingArguments",
    "DPTrainer",
    "DPTrainerMixin",
    "DPTrainingArguments",
    "LayerRule",
    "PoissonBatchSampler",
    "SelfCheckError",
    "UnsupportedModuleError",
    "register_rule",
    "replace_batchnorm",
]
#: The TRL trainers: public names of ``hf_dp`` served on first use (``_LAZY_NAMES``), not in ``__all__`` (which
#: ``import hf_dp`` resolves without TRL), and all of ``hf_dp.trl``.
TRL_PUBLIC_NAMES = [
    "DPCPOConfig",
    "DPCPOTrainer",
    "DPDPOConfig",
    "DPDPOTrainer",
    "DPORPOConfig",
    "DPORPOTrainer",
    "DPRewardConfig",
    "DPRewardTrainer",
    "DPSFTConfig",
    "DPSFTTrainer",
]


def test_public_names_are_where_users_import_them():
    import hf_dp

    assert sorted(hf_dp.__all__) == sorted(PUBLIC_NAMES)
    for name in PUBLIC_NAMES:
        assert getattr(hf_dp, name) is not None
    for module in ("hf_dp.accounting", "hf_dp.audit", "hf_dp.engine", "hf_dp.layers", "hf_dp.losses"):
        importlib.import_module(module)


def test_old_module_paths_serve_the_new_modules_with_a_future_warning():
    code = textwrap.dedent(
        """
        import importlib, sys, warnings
        import hf_dp
        from hf_dp._moved import MOVED_MODULES
        for old, new in MOVED_MODULES.items():
            if old == "hf_dp.trl_dpo":
                continue  # imports TRL: checked in test_trl_dpo
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                module = importlib.import_module(old)
            assert module is importlib.import_module(new), old
            assert module.__spec__.name == new, old  # the new module keeps its own spec
            assert any(issubclass(w.category, FutureWarning) and new in str(w.message) for w in caught), old
        from hf_dp.sampler import PoissonBatchSampler
        assert PoissonBatchSampler is hf_dp.PoissonBatchSampler
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


def test_importing_a_new_path_warns_nothing():
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        importlib.import_module("hf_dp.step.dp_step")
        importlib.import_module("hf_dp.sampling.poisson")


@pytest.mark.parametrize("name", TRL_PUBLIC_NAMES)
def test_trl_names_are_served_lazily(name):
    import hf_dp

    assert name in dir(hf_dp)
    assert sorted(hf_dp._LAZY_NAMES) == sorted(TRL_PUBLIC_NAMES)


def test_trl_module_serves_every_trl_name():
    pytest.importorskip("trl")
    import hf_dp
    import hf_dp.trl

    assert sorted(hf_dp.trl.__all__) == sorted(TRL_PUBLIC_NAMES)
    for name in TRL_PUBLIC_NAMES:
        assert getattr(hf_dp.trl, name) is getattr(hf_dp, name)
