"""The house rules, checked: the Medusa core (the top level of `medusa_mini/`) stands alone, the wings (io/,
train/, cli/) lean on it, never the reverse, and the house stays small: every line budget lives in `BUDGETS`.
A reader who imports the decoding loop gets the algorithm and nothing of tokenizers, checkpoints, clocks or
command lines; the reference runs without the engine, which tests prove equal to it, never by calling it.
A budget is raised here, in a commit that gives the measurement earning the lines."""

import ast
import graphlib
import json
import os
import re
import subprocess
import sys

from conftest import ROOT

CORE = ("reference", "model", "heads", "tree", "sampling", "proposal", "acceptance", "step", "decoding", "training")
WINGS = ("io", "train", "cli")
PACKAGE = os.path.join(ROOT, "medusa_mini")
SCRIPTS = ("decode.py", "train_tiny.py")
BUDGETS = {  # most lines each may hold: the core (medusa_mini/*.py) and each core file, all code, the tests, the docs
    "core": 2200, "reference": 264, "model": 250, "heads": 235, "tree": 314, "sampling": 185, "proposal": 275,
    "acceptance": 200, "step": 170, "decoding": 247, "training": 145, "__init__": 25,
    "code": 6030, "tests": 5000, "README.md": 300, "BENCHMARKS.md": 400}
CORE_FUNCTION_LINES = 45  # one idea per function: a core function longer than this holds two
SPEED_WORDS = re.compile(r"graph|cuda|compil|static|captur|replay", re.IGNORECASE)  # what lives in the compiled wing
CORE_SPEED_LINES = 25  # the core may name the static KV cache and point at the wing, not more


def python_files(*folders: str) -> list[str]:
    return sorted(os.path.join(d, f) for top in folders for d, _, files in os.walk(os.path.join(ROOT, top))
                  for f in files if f.endswith(".py"))


def source(path: str) -> str:
    with open(path, encoding="utf-8") as f:  # closed at once: a file left to the collector is a ResourceWarning
        return f.read()


def imported_modules(path: str, *, runtime: bool = False) -> set[str]:
    """Absolute names of what a file imports, relative imports resolved; runtime=True leaves out those
    under `if TYPE_CHECKING:` (names for type hints only)."""
    package = os.path.relpath(os.path.dirname(path), ROOT).split(os.sep)
    names: set[str] = set()

    def visit(node: ast.AST) -> None:
        if runtime and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):  # `from .m import x` imports .m; `from . import m` (a package's), .m
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            package_of_ours = os.path.isdir(os.path.join(ROOT, *module.split(".")))
            names.update({f"{module}.{a.name}" for a in node.names} if package_of_ours else {module})
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source(path)))
    return names


def core_file(name: str) -> str:
    return os.path.join(PACKAGE, f"{name}.py")


def test_the_core_is_the_top_level_of_the_package_and_the_wings_are_subpackages():
    top = {f[:-3] for f in os.listdir(PACKAGE) if f.endswith(".py") and f != "__init__.py"}
    subpackages = {d for d in os.listdir(PACKAGE) if os.path.isfile(os.path.join(PACKAGE, d, "__init__.py"))}
    assert top == set(CORE) and subpackages == set(WINGS)


def test_core_modules_import_only_torch_numpy_the_standard_library_and_each_other():
    for name in CORE:
        for module in imported_modules(core_file(name)):
            root = module.split(".")[0]
            if root == "medusa_mini":
                assert module.split(".")[1] in CORE, f"core module {name} imports the wing {module}"
            else:
                assert root in {"torch", "numpy"} or root in sys.stdlib_module_names, f"{name} imports {module}"


def test_the_reference_runs_on_the_shared_sampling_alone_and_no_engine_module_imports_it():
    """Model, heads and tree are type names only in the reference (its `forward` reads the weights itself);
    a learner editing reference.py cannot silently change what the engine decides."""
    ours = {m for m in imported_modules(core_file("reference"), runtime=True) if m.startswith("medusa_mini")}
    assert ours <= {"medusa_mini.sampling"}
    assert not {m for m in imported_modules(core_file("sampling")) if m.startswith("medusa_mini")}
    for name in set(CORE) - {"reference"}:
        assert "medusa_mini.reference" not in imported_modules(core_file(name)), f"{name} imports the reference"


def test_no_module_imports_the_cli_except_the_cli_and_the_scripts():
    for path in python_files("medusa_mini"):
        if os.sep + "cli" + os.sep not in path:
            cli = {m for m in imported_modules(path) if m.startswith("medusa_mini.cli")}
            assert not cli, f"{os.path.relpath(path, ROOT)} imports {cli}"


def test_only_heads_py_knows_which_kind_of_heads_it_holds():
    """Each kind carries what differs (its forward, proposer and description), so nobody else asks which kind heads
    are: no comparison with a `.kind` or with "hydra", no isinstance / issubclass naming a heads class."""
    found, paths = [], [p for p in python_files("medusa_mini", "benchmarks") if p != core_file("heads")]
    for path in paths + [os.path.join(ROOT, s) for s in SCRIPTS]:
        for node in ast.walk(ast.parse(source(path))):
            if isinstance(node, ast.Compare):
                if any((isinstance(o, ast.Attribute) and o.attr == "kind")
                       or (isinstance(o, ast.Constant) and o.value == "hydra") for o in [node.left, *node.comparators]):
                    found.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}")
            elif isinstance(node, ast.Call) and getattr(node.func, "id", "") in ("isinstance", "issubclass"):
                named = {getattr(n, "id", getattr(n, "attr", "")) for n in ast.walk(node.args[-1])}
                if named & {"MedusaHeads", "HydraHeads"}:
                    found.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}")
    assert found == []


def test_importing_the_decoding_loop_loads_no_tokenizer_io_training_cli_or_benchmark_module_nor_matplotlib():
    """matplotlib is optional: decode.py and the sweep import it only to draw."""
    code = ("import json, sys, medusa_mini.decoding as d; assert callable(d.medusa_generate); "
            "loaded = sorted(sys.modules); import decode, benchmarks.sweep; "
            "print(json.dumps([loaded, [m for m in sys.modules if m.split('.')[0] == 'matplotlib']]))")
    loaded, plotting = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                                 cwd=ROOT, check=True, timeout=120).stdout)
    ours = {m for m in loaded if m.startswith("medusa_mini.")}
    assert ours and all(m.split(".")[1] in CORE for m in ours), ours
    assert not {m for m in loaded if m.split(".")[0] in {"tiktoken", "benchmarks", "decode", "train_tiny"}}
    assert plotting == []


def test_the_readme_map_names_every_module_and_every_named_file_exists():
    """The README's map is the one description of the layout: a module added, moved or removed without it fails."""
    readme = source(os.path.join(ROOT, "README.md"))
    listed = set(re.findall(r"^\| `([\w/]+\.py)` \|", readme, flags=re.M))
    modules = {os.path.relpath(p, ROOT).replace(os.sep, "/") for p in python_files("medusa_mini", "benchmarks")
               if not p.endswith("__init__.py")} | set(SCRIPTS)
    assert listed == modules, f"not in the map: {sorted(modules - listed)}; no such file: {sorted(listed - modules)}"
    stated = re.search(r"^(\d+) lines, batch 1", readme, flags=re.M)  # what "Read it first" promises a reader
    assert stated and int(stated[1]) == line_count(core_file("reference")), "README: reference.py's length"


def line_count(path: str) -> int:
    return source(path).count("\n")  # as `wc -l` counts


def test_every_part_of_the_house_stays_within_its_line_budget():
    core = {name: line_count(core_file(name)) for name in (*CORE, "__init__")}
    code = python_files("medusa_mini", "benchmarks") + [os.path.join(ROOT, s) for s in SCRIPTS]
    sizes = {**core, "core": sum(core.values()), "code": sum(map(line_count, code)),
             "tests": sum(map(line_count, python_files("tests"))),
             **{doc: line_count(os.path.join(ROOT, doc)) for doc in ("README.md", "BENCHMARKS.md")}}
    assert set(sizes) == set(BUDGETS)
    assert {k: v for k, v in sizes.items() if v > BUDGETS[k]} == {}, "over budget (lines)"


def test_no_core_function_is_longer_than_one_idea():
    long = [f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines" for name in CORE
            for node in ast.walk(ast.parse(source(core_file(name))))
            if isinstance(node, ast.FunctionDef) and node.end_lineno - node.lineno + 1 > CORE_FUNCTION_LINES]
    assert long == []


def test_the_core_speaks_of_compiling_only_to_point_at_the_wing():
    """Graphs, CUDA, compiling, static shapes, capture and replay are the compiled wing's business."""
    core = {name: source(core_file(name)).splitlines() for name in (*CORE, "__init__")}
    lines = [f"{name}: {line.strip()}" for name, text in core.items() for line in text
             if SPEED_WORDS.search(line) and "staticmethod" not in line]
    assert len(lines) <= CORE_SPEED_LINES, "\n".join(lines)


def test_no_module_of_the_package_imports_itself_through_others():
    """No import circle, type-only imports included: each module can be read before the ones it imports."""
    paths = python_files("medusa_mini")
    name_of = {p: ".".join(os.path.relpath(p, ROOT)[:-3].split(os.sep)).removesuffix(".__init__") for p in paths}
    graph = {name_of[p]: {m for m in imported_modules(p) if m in name_of.values() and m != name_of[p]} for p in paths}
    for package in [n for n in graph if any(k.startswith(n + ".") for k in graph)]:
        graph[package] -= {k for k in graph if k.startswith(package + ".")}  # a package's __init__ re-exports
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as circle:
        raise AssertionError(f"import circle: {circle.args[1]}") from None
