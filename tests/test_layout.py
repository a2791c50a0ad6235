"""The house rules, checked: the Medusa core stands alone, and the wings lean on it, never the reverse.

The core is the top level of `medusa_mini/` (the reference; model, heads, tree, sampling, proposal,
hydra, acceptance, step, decoding, training); io/, train/, tune/ and cli/ are the wings. A reader who
imports the decoding loop gets the algorithm and nothing of tokenizers, checkpoints, clocks or command lines.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys

from conftest import ROOT

CORE = ("reference", "model", "heads", "hydra", "tree", "sampling", "proposal", "acceptance", "step", "decoding",
        "training")
WINGS = ("io", "train", "tune", "cli")
PACKAGE = os.path.join(ROOT, "medusa_mini")


def imported_modules(path: str) -> set[str]:
    """Absolute names of what a module imports, relative imports resolved inside medusa_mini."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    package = os.path.relpath(os.path.dirname(path), ROOT).replace(os.sep, ".")
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            base = base[: len(base) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names |= {module} if node.module else {f"{module}.{a.name}" for a in node.names}
    return names


def test_the_core_is_the_top_level_of_the_package_and_the_wings_are_subpackages():
    top = {f[:-3] for f in os.listdir(PACKAGE) if f.endswith(".py") and f != "__init__.py"}
    subpackages = {d for d in os.listdir(PACKAGE) if os.path.isfile(os.path.join(PACKAGE, d, "__init__.py"))}
    assert top == set(CORE) and subpackages == set(WINGS)


def test_core_modules_import_only_torch_numpy_the_standard_library_and_each_other():
    third_party = {"torch", "numpy"}
    for name in CORE:
        for module in imported_modules(os.path.join(PACKAGE, f"{name}.py")):
            root = module.split(".")[0]
            if root == "medusa_mini":
                assert module.split(".")[1] in CORE, f"core module {name} imports the wing {module}"
            else:
                assert root in third_party or root in sys.stdlib_module_names, f"{name} imports {module}"


def test_no_module_imports_the_cli_layer_except_the_cli():
    for wing in ("io", "train", "tune"):
        folder = os.path.join(PACKAGE, wing)
        for f in (f for f in os.listdir(folder) if f.endswith(".py")):
            cli = {m for m in imported_modules(os.path.join(folder, f)) if m.startswith("medusa_mini.cli")}
            assert not cli, f"{wing}/{f} imports {cli}"


def test_importing_the_decoding_loop_loads_no_tokenizer_io_training_cli_or_benchmark_module():
    code = ("import json, sys, medusa_mini.decoding as d; assert callable(d.medusa_generate); "
            "print(json.dumps(sorted(sys.modules)))")
    loaded = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                       cwd=ROOT, check=True, timeout=120).stdout)
    ours = {m for m in loaded if m.startswith("medusa_mini.")}
    assert ours and all(m.split(".")[1] in CORE for m in ours), ours
    assert not {m for m in loaded if m.split(".")[0] in {"tiktoken", "benchmarks", "decode", "train_tiny"}}


def test_the_readme_map_names_every_module_and_every_named_file_exists():
    # The README's map is the one description of the layout: a module added, moved or removed without
    # the map following it fails here. (Sizes are not checked: every edit would have to touch the README.)
    import re

    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    listed = set(re.findall(r"^\| `([\w/]+\.py)` \|", readme, flags=re.M))
    modules = {os.path.relpath(os.path.join(d, f), ROOT).replace(os.sep, "/")
               for top in ("medusa_mini", "benchmarks") for d, _, files in os.walk(os.path.join(ROOT, top))
               for f in files if f.endswith(".py") and f != "__init__.py"}
    assert listed == modules | {"decode.py", "train_tiny.py"}, listed ^ (modules | {"decode.py", "train_tiny.py"})


def test_every_test_file_has_its_own_name():
    """pytest imports test files by their base name (tests/ has no packages), so two files of one name
    in different folders stop the whole run at collection."""
    seen: dict[str, str] = {}
    for folder, _, files in os.walk(os.path.join(ROOT, "tests")):
        for name in files:
            if name.startswith("test_") and name.endswith(".py"):
                path = os.path.relpath(os.path.join(folder, name), ROOT)
                assert name not in seen, f"{path} and {seen[name]} share a name"
                seen[name] = path


def test_no_engine_module_imports_the_reference():
    """The engine is proven equal to the reference by tests, not by calling it: a learner editing
    reference.py cannot silently change what the engine decides."""
    for name in CORE:
        if name != "reference":
            imports = imported_modules(os.path.join(PACKAGE, f"{name}.py"))
            assert "medusa_mini.reference" not in imports, f"{name} imports the reference"
