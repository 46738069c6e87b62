"""The house rules of kimi_convert (issue 28 §3), checked by reading the source: no import cycle between its
modules, counting the imports inside functions, and no module over 700 lines outside the quantization kernels."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "kimi_convert"
MAX_LINES = 700
EXEMPT = ("kimi_convert.quant.kernels",)        # numba kernels: one concern, long by nature


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The kimi_convert modules `name` imports, at module level or inside a function."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def add(target: str) -> None:
        while target and target not in modules:          # a name inside a module: its module
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("kimi_convert"):
                    add(a.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if not mod.startswith("kimi_convert"):
                continue
            for a in node.names:                          # `from . import x` may name a module
                full = f"{mod}.{a.name}"
                add(full if full in modules else mod)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, as the modules along it, or None."""
    state: dict[str, int] = {}          # 1: on the path, 2: done
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (c := visit(m)):
                return c
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (c := visit(n)):
            return c
    return None


def test_the_graph_sees_relative_and_function_level_imports():
    graph = import_graph()
    assert "kimi_convert.gguf_io.reader" in graph["kimi_convert.gguf_io"]       # from .reader import ...
    assert "kimi_convert.verify.check" in graph["kimi_convert.cli.verify"]       # inside a function
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle():
    cycle = _cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_module_over_700_lines():
    long = {name: n for name, path in _modules().items()
            if not name.startswith(EXEMPT) and (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"over {MAX_LINES} lines: {long}"


MAX_COMMAND_LINES = 60


def _commands() -> dict[str, int]:
    """Each command function of kimi_convert/cli (a typer command: `@app.command(...)` or registered with
    `app.command(...)(fn)`, in any of its modules) and the lines of its body, docstring aside."""
    trees = {path.stem: ast.parse(path.read_text(), str(path)) for path in sorted((PACKAGE / "cli").glob("*.py"))}
    registered = {node.args[0].id for tree in trees.values() for node in ast.walk(tree)
                  if isinstance(node, ast.Call) and isinstance(node.func, ast.Call)
                  and isinstance(node.func.func, ast.Attribute) and node.func.func.attr == "command"
                  and node.args and isinstance(node.args[0], ast.Name)}
    out = {}
    for stem, tree in trees.items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef):
                continue
            decorated = any(isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute) and d.func.attr == "command"
                            for d in node.decorator_list)
            if decorated or node.name in registered:
                body = node.body[1:] if ast.get_docstring(node) else node.body
                out[f"{stem}.{node.name}"] = node.end_lineno - body[0].lineno + 1
    return out


def test_commands_are_thin():
    """A command parses its options into one options object and runs a job of the library (convert/job.py,
    quant/job.py, imatrix/job.py, kld/job.py): no body over 60 lines."""
    commands = _commands()
    assert {"convert.convert", "quantize.quantize", "imatrix.imatrix", "kld.kld_cmd",
            "verify.check_cmd"} <= set(commands)
    long = {name: n for name, n in commands.items() if n > MAX_COMMAND_LINES}
    assert not long, f"command bodies over {MAX_COMMAND_LINES} lines: {long}"
