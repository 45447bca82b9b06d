"""The package layout: the core (`orbax_mtc/` outside `orbax_mtc/tools/`) never imports the
tools, `orbax_mtc/tools/size.py` stays pure arithmetic, and every module path the package hands
to a subprocess (`python -m orbax_mtc...`) names a module that exists.

Read from the source with `ast`, nothing imported: a wrong import fails here with its module and
line even when importing the package would fail first.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "orbax_mtc"
TOOLS = PACKAGE / "tools"
# `python -m orbax_mtc` is the `orbax-mtc` command: the one core module allowed to reach it.
ALLOWED = {PACKAGE / "__main__.py"}
_TOOLS_MODULE = "orbax_mtc.tools"
_MODULE_PATH = re.compile(r"^orbax_mtc(\.[a-z_][a-z0-9_]*)+$")


def _module_name(path: Path) -> str:
  parts = list(path.relative_to(REPO).with_suffix("").parts)
  if parts[-1] == "__init__":
    parts.pop()
  return ".".join(parts)


def _absolute(node: ast.ImportFrom, path: Path) -> str:
  """The absolute module of a `from X import ...` in `path` (relative ones resolved)."""
  if node.level == 0:
    return node.module or ""
  package = _module_name(path).split(".")
  if path.name != "__init__.py":
    package.pop()  # a module's own package
  base = package[:len(package) - (node.level - 1)]
  return ".".join(base + ([node.module] if node.module else []))


def _is_tools(module: str) -> bool:
  return module == _TOOLS_MODULE or module.startswith(_TOOLS_MODULE + ".")


def tools_imports(source: str, path: Path) -> list[tuple[int, str]]:
  """(line, statement) for every import of `orbax_mtc.tools` in `source`, in any form:
  `import orbax_mtc.tools[.x]`, `from orbax_mtc.tools[.x] import ...`, `from orbax_mtc import
  tools`, their relative spellings, and importlib.import_module / __import__ of such a name."""
  found = []
  for node in ast.walk(ast.parse(source, filename=str(path))):
    if isinstance(node, ast.Import):
      found += [(node.lineno, f"import {a.name}") for a in node.names if _is_tools(a.name)]
    elif isinstance(node, ast.ImportFrom):
      module = _absolute(node, path)
      names = [a.name for a in node.names]
      if _is_tools(module) or any(_is_tools(f"{module}.{name}") for name in names):
        found.append((node.lineno, f"from {'.' * node.level}{node.module or ''} import "
                                   f"{', '.join(names)}"))
    elif isinstance(node, ast.Call) and node.args:
      func = node.func
      name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
      first = node.args[0]
      if name in ("import_module", "__import__") and isinstance(first, ast.Constant) \
          and isinstance(first.value, str) and _is_tools(first.value):
        found.append((node.lineno, f"{name}({first.value!r})"))
  return sorted(found)


def _core_modules() -> list[Path]:
  return sorted(p for p in PACKAGE.rglob("*.py")
                if TOOLS not in p.parents and p not in ALLOWED and "__pycache__" not in p.parts)


def test_the_core_never_imports_the_tools():
  modules = _core_modules()
  assert PACKAGE / "manager.py" in modules and not any(TOOLS in p.parents for p in modules)
  offending = [f"{path.relative_to(REPO)}:{line}: {statement}"
               for path in modules
               for line, statement in tools_imports(path.read_text(), path)]
  assert not offending, ("the core imports orbax_mtc.tools (tools may import the core, never "
                         "the other way):\n" + "\n".join(offending))


@pytest.mark.parametrize("source, where", [
    ("import orbax_mtc.tools", "orbax_mtc/manager.py"),
    ("import orbax_mtc.tools.cli as c", "orbax_mtc/manager.py"),
    ("from orbax_mtc.tools import cli", "orbax_mtc/manager.py"),
    ("from orbax_mtc.tools.bench import limits", "orbax_mtc/manager.py"),
    ("from orbax_mtc import tools", "orbax_mtc/manager.py"),
    ("from orbax_mtc import lkg, tools", "orbax_mtc/manager.py"),
    ("def f():\n  from orbax_mtc.tools import launch", "orbax_mtc/manager.py"),
    ("from . import tools", "orbax_mtc/manager.py"),
    ("from . import tools", "orbax_mtc/__init__.py"),
    ("from .tools import cli", "orbax_mtc/manager.py"),
    ("from ..tools.size import GIB", "orbax_mtc/peers/store.py"),
    ("import importlib\nimportlib.import_module('orbax_mtc.tools.cli')", "orbax_mtc/manager.py"),
])
def test_every_spelling_of_a_tools_import_is_caught(source, where):
  ((line, _),) = tools_imports(source, REPO / where)
  assert line == source.count("\n") + 1


@pytest.mark.parametrize("source, where", [
    ("import orbax_mtc.toolsmith", "orbax_mtc/manager.py"),
    ("from orbax_mtc import lkg, local_tier", "orbax_mtc/manager.py"),
    ("from . import lkg", "orbax_mtc/manager.py"),
    ("from .peers import store", "orbax_mtc/manager.py"),
    ("x = 'orbax_mtc.tools.cli'", "orbax_mtc/manager.py"),  # a mention, not an import
])
def test_other_imports_pass(source, where):
  assert tools_imports(source, REPO / where) == []


def test_size_is_pure_arithmetic():
  """tools/size.py: no file I/O, no command line (size_render.py and cli.py hold those)."""
  path = TOOLS / "size.py"
  tree = ast.parse(path.read_text())
  allowed = {"__future__", "dataclasses", "math", "re", "collections", "fractions", "pathlib"}
  imported = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      imported |= {a.name.split(".")[0] for a in node.names}
    elif isinstance(node, ast.ImportFrom):
      imported.add("." if node.level else (node.module or "").split(".")[0])
  assert imported <= allowed, sorted(imported - allowed)
  io_calls = {"open", "print", "read_text", "write_text", "read_bytes", "write_bytes", "stat",
              "iterdir", "rglob", "glob", "mkdir", "exists", "is_dir", "is_file"}
  calls = [(node.lineno, name) for node in ast.walk(tree) if isinstance(node, ast.Call)
           for name in [getattr(node.func, "attr", getattr(node.func, "id", None))]
           if name in io_calls]
  assert not calls, calls


def _exists(module: str) -> bool:
  path = REPO.joinpath(*module.split("."))
  return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def test_module_paths_in_the_package_exist():
  """Strings such as `-m orbax_mtc.tools.demo_train` (subprocess command lines) name real
  modules: a move that misses one fails here, not in a child process."""
  named = []
  for path in sorted(PACKAGE.rglob("*.py")):
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
      if isinstance(node, ast.Constant) and isinstance(node.value, str) \
          and _MODULE_PATH.match(node.value):
        named.append((f"{path.relative_to(REPO)}:{node.lineno}", node.value))
  assert any(value == "orbax_mtc.tools.demo_train" for _, value in named)
  missing = [f"{where}: {value}" for where, value in named if not _exists(value)]
  assert not missing, "module paths that name no module:\n" + "\n".join(missing)
