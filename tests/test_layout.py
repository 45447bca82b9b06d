"""The package layout: the core (`orbax_mtc/` outside `orbax_mtc/tools/`) never imports the
tools, `orbax_mtc/tools/size.py` stays pure arithmetic, every module path the package hands
to a subprocess (`python -m orbax_mtc...`) names a module that exists, no new import loop,
the RAM tier (`local/`) never imports the peers, and no module or class grows past its size
limit (the known exceptions are listed, for issue 42 to remove).

Read from the source with `ast`, nothing imported: a wrong import fails here with its module and
line even when importing the package would fail first.
"""

from __future__ import annotations

import ast
import re
import subprocess
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
    ("from ..tools.size import GIB", "orbax_mtc/peers/copy_store.py"),
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


# ----------------------------------------------------------------------------- the import graph

# Limits for every Python file of the repository (tools, integrations and tests included).
MODULE_LINES, CLASS_LINES = 500, 400
_PACKAGES = ("orbax_mtc", "maxtext_patch", "pax_patch")


def _package_modules() -> dict[str, Path]:
  """Dotted name -> file, for every module of the shipped packages."""
  modules = {}
  for package in _PACKAGES:
    for path in sorted((REPO / package).rglob("*.py")):
      if "__pycache__" not in path.parts:
        modules[_module_name(path)] = path
  return modules


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
  """Module -> the modules of `modules` it imports anywhere in its source (a function-level
  import counts: it is an arrow all the same). `from pkg import name` is an arrow to the
  submodule `pkg.name` when there is one, else to `pkg`."""

  def owner(name: str) -> str:
    while name and name not in modules:
      name = name.rpartition(".")[0]
    return name

  graph: dict[str, set[str]] = {name: set() for name in modules}
  for name, path in modules.items():
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
      if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom):
        base = _absolute(node, path)
        targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                   for a in node.names]
      else:
        continue
      graph[name] |= {found for found in map(owner, targets) if found and found != name}
  return graph


def loops(graph: dict[str, set[str]]) -> list[set[str]]:
  """The import loops: strongly connected groups of more than one module (Tarjan)."""
  index: dict[str, int] = {}
  low: dict[str, int] = {}
  stack: list[str] = []
  found: list[set[str]] = []

  def visit(node: str) -> None:
    index[node] = low[node] = len(index)
    stack.append(node)
    for nxt in graph[node]:
      if nxt not in index:
        visit(nxt)
        low[node] = min(low[node], low[nxt])
      elif nxt in stack:
        low[node] = min(low[node], index[nxt])
    if low[node] == index[node]:
      group = set()
      while True:
        member = stack.pop()
        group.add(member)
        if member == node:
          break
      if len(group) > 1:
        found.append(group)

  for node in sorted(graph):
    if node not in index:
      visit(node)
  return found


def test_no_import_loop():
  graph = import_graph(_package_modules())
  assert "orbax_mtc.ledger" in graph["orbax_mtc.forms.parts"]  # the graph is read, arrows and all
  found = [sorted(group) for group in loops(graph)]
  assert not found, f"import loops: {found}"


def test_the_loop_finder_finds_a_loop_and_nothing_else():
  assert loops({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
  assert loops({"a": {"b"}, "b": set()}) == []


def unit_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
  """The graph with each subpackage (`orbax_mtc.local`, `orbax_mtc.restore`, ...) as one node:
  a loop here is an upward arrow (a subpackage importing a module that imports it)."""

  def unit(name: str) -> str:
    parts = name.split(".")
    if len(parts) > 2 or (len(parts) == 2 and (REPO.joinpath(*parts) / "__init__.py").is_file()):
      return ".".join(parts[:2]) + "/"
    return name

  units: dict[str, set[str]] = {}
  for name, targets in graph.items():
    units.setdefault(unit(name), set()).update(unit(t) for t in targets if unit(t) != unit(name))
  for targets in list(units.values()):
    for target in targets:
      units.setdefault(target, set())
  return units


def test_no_upward_arrow_between_a_subpackage_and_the_modules_above_it():
  units = unit_graph(import_graph(_package_modules()))
  assert "orbax_mtc.local/" in units["orbax_mtc.forms/"]
  found = [sorted(group) for group in loops(units)]
  assert not found, f"a subpackage and a module above it import each other: {found}"


def test_the_ram_tier_never_imports_the_peers():
  graph = import_graph(_package_modules())
  upward = [f"{name} -> {target}" for name, targets in graph.items()
            if name.startswith("orbax_mtc.local") for target in targets
            if target.startswith("orbax_mtc.peers")]
  assert not upward, upward


def _python_files() -> list[Path]:
  return sorted(REPO / line for line in subprocess.run(
      ["git", "ls-files", "*.py"], cwd=REPO, capture_output=True, text=True,
      check=True).stdout.split())


def test_no_module_or_class_grows_past_the_limits():
  files = _python_files()
  assert REPO / "orbax_mtc" / "manager.py" in files
  too_long, too_big = [], []
  for path in files:
    text = path.read_text()
    where = str(path.relative_to(REPO))
    if text.count("\n") > MODULE_LINES:
      too_long.append(f"{where}: {text.count(chr(10))} lines")
    too_big += [f"{where}: class {node.name}: {node.end_lineno - node.lineno + 1} lines"
                for node in ast.walk(ast.parse(text, filename=where))
                if isinstance(node, ast.ClassDef)
                and node.end_lineno - node.lineno + 1 > CLASS_LINES]
  assert not too_long, f"modules over {MODULE_LINES} lines (split them): {too_long}"
  assert not too_big, f"classes over {CLASS_LINES} lines: {too_big}"


# ----------------------------------------------------------------------------- design rules

_RULE_CITATION = re.compile(r"\brules? (\d+)((?:(?:, | and | or )\d+)*)")


def _design_rules() -> set[int]:
  """The numbers of docs/design.md's "Rules that keep it correct"."""
  text = (REPO / "docs" / "design.md").read_text()
  section = text.split("## Rules that keep it correct", 1)[1].split("\n## ", 1)[0]
  return {int(n) for n in re.findall(r"(?m)^(\d+)\. \*\*", section)}


def test_every_rule_the_code_cites_is_numbered_in_the_design_notes():
  rules = _design_rules()
  assert set(range(1, 13)) <= rules
  cited = []
  for path in _python_files():
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
      for match in _RULE_CITATION.finditer(line):
        numbers = [int(match.group(1))] + [int(n) for n in re.findall(r"\d+", match.group(2))]
        cited += [(f"{path.relative_to(REPO)}:{lineno}", n) for n in numbers]
  assert len(cited) > 20  # the code does cite them
  unknown = [f"{where}: rule {n}" for where, n in cited if n not in rules]
  assert not unknown, f"rules cited but not in docs/design.md: {unknown}"
