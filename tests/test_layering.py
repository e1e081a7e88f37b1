"""The house: one import name, no cycle, every arrow pointing down.

Layers (bottom to top): the base (``promptsplice.errors``, ``blocks``, ``tenancy``,
``assets``, ...), ``dedup`` (a leaf over the base), ``assembler`` and ``kernels``, the
engine side, then ``benchmarks`` with the CLI.  Read from the source with ``ast`` (every
import, function-level ones included), so a lazy import cannot hide an upward arrow.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FOLDERS = {
    "promptsplice": "promptsplice",
    "promptsplice.dedup": "dedup",
    "promptsplice.assembler": "assembler",
    "promptsplice.engine_adapters": "engine_adapters",
    "promptsplice.kernels": "kernels",
    "promptsplice.benchmarks": "benchmarks",
}
# What each room may import from the project (besides itself).
ALLOWED = {
    "base": set(),
    "dedup": {"base"},
    "assembler": {"base", "dedup"},
    "kernels": {"base"},
    "engine_adapters": {"base", "dedup", "assembler", "kernels"},
    "benchmarks": {"base", "dedup", "assembler", "kernels", "engine_adapters"},
}
FORBIDDEN_THIRD_PARTY = {
    "base": {"vllm", "torch", "transformers", "langchain_core"},
    "dedup": {"vllm", "torch", "numpy", "transformers", "langchain_core", "tokenizers"},
    "assembler": {"vllm", "torch", "transformers", "langchain_core"},
    "kernels": {"vllm", "transformers", "langchain_core"},
}


def _modules() -> dict[str, Path]:
    found = {}
    for package, folder in FOLDERS.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            rel = path.relative_to(REPO / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([package, *parts])
            if package == "promptsplice" and parts and f"promptsplice.{parts[0]}" in FOLDERS:
                continue
            found[name] = path
    return found


def _room(module: str) -> str:
    parts = module.split(".")
    if len(parts) > 1 and f"promptsplice.{parts[1]}" in FOLDERS:
        return parts[1]
    return "base"


def _imports(module: str, path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_pkg else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.add(target)
            out.update(f"{target}.{a.name}" for a in node.names)
    return out


MODULES = _modules()
GRAPH = {m: _imports(m, p) for m, p in MODULES.items()}


def test_every_project_import_points_down():
    upward = []
    for module, targets in GRAPH.items():
        room = _room(module)
        for t in targets:
            if t.split(".")[0] in set(FOLDERS.values()) - {"promptsplice"}:
                upward.append(f"{module} imports {t}: the old top-level name")
            if not t.startswith("promptsplice."):
                continue
            if t not in MODULES:
                continue  # `from pkg import name` also lists pkg.name
            other = _room(t)
            if other != room and other not in ALLOWED[room]:
                upward.append(f"{module} ({room}) imports {t} ({other})")
    assert not upward, "\n".join(sorted(upward))


def test_no_room_imports_what_it_must_not():
    bad = []
    for module, targets in GRAPH.items():
        room = _room(module)
        for t in targets:
            if t.split(".")[0] in FORBIDDEN_THIRD_PARTY.get(room, ()):
                bad.append(f"{module} imports {t}")
    assert not bad, "\n".join(sorted(bad))


def test_the_module_graph_has_no_cycle():
    edges = {m: {t for t in ts if t in MODULES and t != m} for m, ts in GRAPH.items()}
    # A package's __init__ re-exporting its own private modules is not a cycle of rooms;
    # drop edges from a module to a package that contains it.
    for m in edges:
        edges[m] = {t for t in edges[m] if not m.startswith(t + ".")}
    state: dict[str, int] = {}
    cycles = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(edges[m]):
            if state.get(t) == 1:
                cycles.append(" -> ".join(stack[stack.index(t):] + [t]))
            elif t not in state:
                visit(t, stack)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m, [])
    assert not cycles, "\n".join(cycles)


def test_modules_over_600_lines_say_why():
    long = []
    for module, path in MODULES.items():
        lines = path.read_text().splitlines()
        if len(lines) > 600:
            doc = ast.get_docstring(ast.parse("\n".join(lines))) or ""
            if "one module" not in doc and "one room" not in doc:
                long.append(f"{module}: {len(lines)} lines, no reason in its opening docstring")
    assert not long, "\n".join(long)


@pytest.mark.timeout(300)
def test_the_wheel_adds_only_the_promptsplice_name(tmp_path):
    # Built from the checkout's files alone, as from a clean clone: setuptools never
    # empties build/, so a wheel built in place can carry files an older layout left.
    if (REPO / ".git").exists():
        listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, check=True,
                                capture_output=True, text=True).stdout.split("\0")
    else:  # an unpacked sdist: its files are the sources (MANIFEST.in), caches aside
        skip = {".venv", "build", "__pycache__", ".hypothesis", ".pytest_cache"}
        listed = [str(p.relative_to(REPO)) for p in REPO.rglob("*")
                  if p.is_file() and not skip.intersection(p.relative_to(REPO).parts) and p.suffix != ".so"]
    source = tmp_path / "source"
    for name in filter(None, listed):
        if (REPO / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            (source / name).write_bytes((REPO / name).read_bytes())
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(source)],
        check=True, capture_output=True, text=True, cwd=tmp_path,
    )
    (wheel,) = tmp_path.glob("promptsplice-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"promptsplice"}
    for room in ("dedup", "assembler", "engine_adapters/store", "engine_adapters/integrations", "kernels", "benchmarks"):
        assert f"promptsplice/{room}/__init__.py" in names
    assert "promptsplice/benchmarks/data/agent-sample.jsonl" in names
    assert "promptsplice/py.typed" in names  # PEP 561: mypy skipped the package as untyped
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)  # Apache-2.0, as declared
    assert not [n for n in names if n.endswith(".c")]  # the wheel carries the built core, not its source
    # The core install is the torch-free room; the engine side comes in extras.
    meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
    requires = [line.split(":", 1)[1].strip() for line in zipfile.ZipFile(wheel).read(meta).decode().splitlines()
                if line.startswith("Requires-Dist:")]
    core = {r.split(">")[0].split("=")[0].split("[")[0].strip() for r in requires if "extra ==" not in r}
    assert core == {"xxhash", "tokenizers", "jinja2"}
    # the full installs run the demo, whose chart needs matplotlib
    assert all(any(r.startswith("promptsplice[") and "bench" in r and f'extra == "{x}"' in r for r in requires)
               for x in ("cpu", "gpu"))
    for extra, dep in (("engine", "torch"), ("engine", "httpx"), ("remote", "httpx"), ("langchain", "langchain-core"),
                       ("redis", "redis"), ("bench", "numpy"), ("bench", "matplotlib")):
        assert any(r.startswith(dep) and f'extra == "{extra}"' in r for r in requires), (extra, dep)


_CORE_ONLY = """
import importlib.abc, sys
EXTRAS = {"torch", "triton", "vllm", "numpy", "httpx", "redis", "tiktoken", "langchain_core", "langchain",
          "langgraph", "agents", "transformers", "gguf"}
class Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in EXTRAS:
            raise ImportError(f"{name} is an extra")
sys.meta_path.insert(0, Blocked())
from promptsplice import assemble_prompt, blocks
from promptsplice.assembler import ContextHook, DropFailedCalls, TruncateToolOutputs, load_tokenizer
from promptsplice.dedup import dedup
folder = sys.argv[1]  # the user's own tokenizer and template: no default-model asset here
tok = load_tokenizer(folder)
chunks = [{"id": "a", "text": "The same passage. " * 20}, {"id": "b", "text": "The same passage. " * 20}]
p = assemble_prompt(chunks, query="What does it say?", block_size=32, tokenizer=tok)
assert len(dedup(chunks).chunks) == 1 and p.token_ids and p.block_hashes
hook = ContextHook(folder, policies=[TruncateToolOutputs(), DropFailedCalls()], block_size=32)  # its template too
msgs = [{"role": "user", "content": "hi"}]
hook("s", msgs)
ctx = hook("s", msgs + [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}])
assert ctx.kind.value == "append", ctx.kind
assert blocks.chain_hashes(list(range(64)), 32)
print("core ok")
"""


def test_the_core_runs_with_every_extra_blocked(tmp_path):
    """dedup, assembly, the agent hook and block identity need none of the extras (torch,
    vLLM, httpx, LangChain, Redis, tiktoken, numpy): a service that only assembles prompts
    installs the core alone.  Run on a fresh home (no default-model asset built), with
    the user's own tokenizer folder, as on a machine that never ran ``make setup``."""
    import os
    import shutil

    from promptsplice.assets import default_tokenizer_dir

    folder = tmp_path / "my-tokenizer"
    shutil.copytree(default_tokenizer_dir(), folder)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROMPTSPLICE_")}
    env["PROMPTSPLICE_HOME"] = str(tmp_path / "empty-home")
    run = subprocess.run([sys.executable, "-c", _CORE_ONLY, str(folder)], capture_output=True, text=True,
                         cwd="/", timeout=120, env=env)
    assert run.returncode == 0 and "core ok" in run.stdout, run.stderr[-2000:]
    assert not any((tmp_path / "empty-home").rglob("tokenizer.json"))  # no default asset was needed
