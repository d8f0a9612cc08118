"""The package's import structure: data flows one way, TVM stays behind ``redfuser.tvm``.

Every module's imports are read with ``ast`` (those inside functions too, since a lazy
import still makes a dependency) and checked against the layering that
docs/architecture.md describes (its diagram and package list).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import algebra.components
from algebra.families import Family
from redfuser.lowering.backends import BACKENDS
from redfuser.lowering.families import lowering_for_family

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("redfuser", "algebra")
TVM = ("tvm", "tvm_ffi")
ADAPTER = "redfuser.tvm"  # the package that wraps TVM, one module a role
TOOLS = "redfuser.tools"
# (importer prefix, imported prefix, why it must never happen)
FORBIDDEN = [
    ("algebra", "redfuser", "the algebra engine is sympy and numpy only"),
    ("redfuser.lowering", "redfuser.runtime", "lowering builds IR; it neither compiles nor runs"),
    ("redfuser.lowering", "redfuser.kernel", "lowering sits below the Kernel"),
    ("redfuser.lowering", "redfuser.tune", "lowering knows nothing of tuning"),
    ("redfuser.tune", "redfuser.kernel", "the tuner measures through a callable it is given"),
    ("redfuser.lowering.cpu", "redfuser.lowering.cuda", "a target's package knows no other"),
    ("redfuser.lowering.cuda", "redfuser.lowering.cpu", "a target's package knows no other"),
    ("redfuser", "redfuser.tools", "tools are scripts on top of the library, never below it"),
]
ENTRY_POINTS = ("redfuser.tools", "redfuser.cli")  # on top of everything: may import anything


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> list[tuple[str, int, bool]]:
    """(imported module, line, at module level) for every import in the file; ``from . import
    x`` names the submodule x when there is one."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    top = {id(n) for n in tree.body} | {id(n) for n in ast.walk(tree)
                                        if isinstance(n, ast.If | ast.Try) and n in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
                       for a in node.names]
        else:
            continue
        found += [(t, node.lineno, id(node) in top) for t in targets]
    return found


GRAPH = {m: {t for t, _, _ in _imports(m, p) if t in MODULES and t != m}
         for m, p in MODULES.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def test_there_is_no_import_cycle():
    assert _cycles(GRAPH) == []


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]


@pytest.mark.parametrize("importer,imported,why", FORBIDDEN)
def test_layers_point_down(importer, imported, why):
    wrong = [(m, t) for m, deps in GRAPH.items() if _under(m, importer)
             and not any(_under(m, top) for top in ENTRY_POINTS)
             for t in deps if _under(t, imported)]
    assert wrong == [], why


def test_only_the_tvm_package_and_tools_import_tvm():
    wrong = [f"{m}:{line}" for m, p in MODULES.items() for t, line, _ in _imports(m, p)
             if t.split(".")[0] in TVM and not _under(m, ADAPTER) and not _under(m, TOOLS)]
    assert wrong == []


def test_imports_inside_functions_say_why():
    """A function-level import needs a comment on its line or the line above (lazy TVM
    loading, an optional dependency, code that runs in a worker process)."""
    wrong = []
    for m, p in MODULES.items():
        lines = p.read_text().splitlines()
        for _, line, top in _imports(m, p):
            here, above = lines[line - 1], lines[line - 2] if line > 1 else ""
            if not top and "#" not in here and not above.strip().startswith("#") \
                    and "#" not in above:
                wrong.append(f"{p.relative_to(ROOT)}:{line}")
    assert sorted(set(wrong)) == []


FAMILIES_PACKAGE = "redfuser.lowering.families"  # the one place that may know the classes
COMPONENT_CLASSES = frozenset(
    name for name, value in vars(algebra.components).items()
    if isinstance(value, type) and issubclass(value, algebra.components.Component))


def _family_tests(source: str) -> list[int]:
    """Lines of ``isinstance(x, C)`` calls where C names a component class (also inside a
    tuple or union): code that should ask ``x.family`` instead."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance" \
                and len(node.args) == 2:
            names = {getattr(n, "id", getattr(n, "attr", None)) for n in ast.walk(node.args[1])}
            if names & COMPONENT_CLASSES:
                found.append(node.lineno)
    return found


def test_no_module_tests_a_component_family_by_class():
    wrong = [f"{p.relative_to(ROOT)}:{line}" for m, p in MODULES.items()
             if _under(m, "redfuser") and not _under(m, FAMILIES_PACKAGE)
             for line in _family_tests(p.read_text())]
    assert wrong == [], "ask comp.family (algebra.families) instead of testing the class"


def test_the_family_checker_catches_a_class_test():
    assert _family_tests("if isinstance(c, LinearComponent) and c.anchors:\n    pass\n") == [1]
    assert _family_tests("ok = isinstance(c, (int, components.SelectComponent))\n") == [1]
    assert _family_tests("ok = isinstance(e, Dot) or c.family.linear\n") == []


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_every_family_has_a_lowering_on_every_backend(backend):
    for family in Family:
        assert lowering_for_family(family, backend) is not None, (family, backend)


# Target facts belong to the Backend (``redfuser.lowering.backends``): only these modules may
# test a target's name or an instruction set's (module prefix, why)
TARGET_PLACES = (
    ("redfuser.lowering.backends", "the table of backends, keyed by target name"),
    ("redfuser.lowering.cpu", "the CPU backend: its instruction sets and facts"),
    ("redfuser.lowering.cuda", "the CUDA backend: its facts"),
    ("redfuser.tvm.cuda", "finds the CUDA module among a build's imports by TVM's own "
                          "module kind"),
)
TARGET_WORDS = frozenset({
    "cpu", "cuda", "llvm", "c", "metal", "rocm", "opencl", "vulkan", "webgpu", "hexagon",
    "sse2", "sse4.1", "sse4.2", "avx2", "avx512f", "avx512bw", "avx512vnni", "avxvnni",
    "avx512bf16", "avx512fp16", "amx", "amx-tile", "amx-int8", "amx-bf16", "neon", "sve",
    "dotprod", "i8mm"})


def _words(node: ast.AST) -> set[str]:
    """The string constants of ``node``, or of the elements of a tuple, list or set."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return set().union(set(), *map(_words, node.elts))
    return set()


def _target_tests(source: str) -> list[int]:
    """Lines that compare with a target or ISA name (``==``, ``in (...)``) or key a dict or
    a set by one: facts a ``Backend`` should own."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            parts = (node.left, *node.comparators)
        elif isinstance(node, ast.Dict):
            parts = tuple(k for k in node.keys if k is not None)
        elif isinstance(node, ast.Set):
            parts = (node,)
        else:
            continue
        if set().union(set(), *map(_words, parts)) & TARGET_WORDS:
            found.append(node.lineno)
    return found


def test_only_the_backends_test_a_target_name():
    wrong = [f"{p.relative_to(ROOT)}:{line}" for m, p in MODULES.items()
             if _under(m, "redfuser") and not any(_under(m, place) for place, _ in TARGET_PLACES)
             for line in _target_tests(p.read_text())]
    assert wrong == [], "a target fact outside its Backend (lowering/backends.py)"


def test_the_target_checker_catches_a_target_test():
    assert _target_tests('if target == "cuda":\n    pass\n') == [1]
    assert _target_tests('ok = kind in ("llvm", "c")\n') == [1]
    assert _target_tests('TABLE = {"cpu": 1}\n') == [1]
    assert _target_tests('ok = "avx512vnni" in {"avx2", "avx512vnni"}\n') == [1, 1]
    assert _target_tests('t = {"kind": "llvm"}\nok = name == "x"\n') == []
