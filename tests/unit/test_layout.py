"""The layout rules the folders promise, checked on the source (no process group, nothing runs).

- no import cycle inside ddp_lab (imports inside functions count too);
- analysis/ is offline: it imports neither torch.distributed nor code from launcher/, rank/,
  strategies/ or tasks/;
- checked on the modules a fresh interpreter has loaded after importing every module of a package
  (`sys.modules`), so an import through another module counts too: spec/ (the description layer
  every process reads) and arithmetic/ (the arithmetic every process shares) load no torch and none of
  the folders that read them; nothing that runs in a
  rank or the launcher (rank/, strategies/, tasks/, launcher/) loads analysis/, which is a leaf; the
  launcher loads no rank code (not rank/, strategies/ or tasks/);
- rank/ never imports launcher/ (a rank does not run the launcher's code), and the launcher never
  imports rank/;
- at most 10 modules directly in ddp_lab/;
- every conf/strategy/NAME.yaml extends the spec the registry lists under NAME, whose runtime class
  keeps the contract (its own knob defaults agreeing with the spec's), and every registered strategy
  has a YAML; every conf/model/NAME.yaml extends a node of spec/models/ naming a class of ddp_lab.models,
  and composes and builds on the meta device;
- no function in ddp_lab/ over 80 lines.
"""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.utils import get_class
from omegaconf import OmegaConf

from ddp_lab.spec.strategies import SPECS
from ddp_lab.strategies import DataParallelBase

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "ddp_lab"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every module an import statement in the file names (absolute names)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
GRAPH = {name: {m for m in _imports(path) if m in MODULES and m != name} for name, path in MODULES.items()}


def _cycle() -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the stack, 2 done

    def visit(name, stack):
        state[name] = 1
        for dep in sorted(GRAPH[name]):
            if dep == name.rsplit(".", 1)[0] or name.startswith(dep + "."):
                continue  # a package's __init__ and its own submodules are one unit
            if state.get(dep) == 1:
                return stack[stack.index(dep):] + [dep] if dep in stack else [name, dep]
            if dep not in state:
                found = visit(dep, stack + [dep])
                if found:
                    return found
        state[name] = 2
        return None

    for name in sorted(GRAPH):
        if name not in state:
            found = visit(name, [name])
            if found:
                return found
    return None


def test_no_import_cycle():
    assert _cycle() is None, " -> ".join(_cycle())


def _in(folder: str):
    return {name: path for name, path in MODULES.items() if name.startswith(f"ddp_lab.{folder}.")
            or name == f"ddp_lab.{folder}"}


@pytest.mark.parametrize("folder, forbidden", [
    ("analysis", ("torch.distributed", "ddp_lab.launcher", "ddp_lab.rank", "ddp_lab.strategies", "ddp_lab.tasks")),
    ("rank", ("ddp_lab.launcher",)),
    ("launcher", ("ddp_lab.rank",)),
])
def test_folders_import_only_what_their_process_runs(folder, forbidden):
    offending = {name: sorted(m for m in _imports(path) if m.startswith(forbidden))
                 for name, path in _in(folder).items()}
    assert not {k: v for k, v in offending.items() if v}


PACKAGES = ("ddp_lab.spec", "ddp_lab.arithmetic", "ddp_lab.strategies", "ddp_lab.rank", "ddp_lab.tasks",
            "ddp_lab.launcher")
LOADS_TORCH = ("ddp_lab.strategies", "ddp_lab.rank", "ddp_lab.tasks", "ddp_lab.launcher")  # torch is allowed there


@pytest.fixture(scope="module")
def loaded() -> dict[str, set[str]]:
    """{package: every module an interpreter has loaded after importing each module of the package}. One
    interpreter, forked per package: the packages that may load torch fork from one that imported torch
    and nothing of ddp_lab (seconds saved per package), the others from one that imported nothing."""
    probe = f"""
import importlib, json, os, pkgutil, sys
def walk(package):
    read, write = os.pipe()
    if os.fork() == 0:
        package = importlib.import_module(package)
        for m in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            importlib.import_module(m.name)
        os.write(write, json.dumps(sorted(sys.modules)).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        return json.loads(f.read())
out = {{p: walk(p) for p in {PACKAGES!r} if p not in {LOADS_TORCH!r}}}
import torch
out.update({{p: walk(p) for p in {LOADS_TORCH!r}}})
print(json.dumps(out))
"""
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT)
    return {package: set(modules) for package, modules in json.loads(run.stdout).items()}


@pytest.mark.parametrize("package, forbidden", [
    ("ddp_lab.spec", ("torch", "ddp_lab.analysis", "ddp_lab.launcher", "ddp_lab.rank", "ddp_lab.strategies",
                      "ddp_lab.tasks")),
    ("ddp_lab.arithmetic", ("torch", "ddp_lab.analysis", "ddp_lab.launcher", "ddp_lab.rank", "ddp_lab.strategies",
                            "ddp_lab.tasks")),
    ("ddp_lab.strategies", ("ddp_lab.analysis", "ddp_lab.launcher", "ddp_lab.tasks", "rich", "matplotlib")),
    ("ddp_lab.rank", ("ddp_lab.analysis", "ddp_lab.launcher", "matplotlib")),
    ("ddp_lab.tasks", ("ddp_lab.analysis", "ddp_lab.launcher", "matplotlib")),
    ("ddp_lab.launcher", ("ddp_lab.analysis", "ddp_lab.rank", "ddp_lab.strategies", "ddp_lab.tasks", "matplotlib")),
])
def test_what_a_package_loads(loaded, package, forbidden):
    assert not sorted(m for m in loaded[package] if m in forbidden or m.startswith(tuple(f + "." for f in forbidden)))


def test_launch_py_loads_torch_only_where_a_check_needs_it():
    """A mistake in a key, a range or a knob is answered in about a second: what launch.py imports loads no
    torch (launcher/config_checks.py imports it, and the meta model, where a check first needs them)."""
    modules = sorted(m for m in _imports(ROOT / "launch.py") if m in MODULES)
    probe = (f"import importlib, sys\nfor m in {modules!r}:\n    importlib.import_module(m)\n"
             "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT)
    assert modules and out.stdout.strip() == "False"


def test_few_modules_directly_in_the_package():
    flat = [p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py"]
    assert len(flat) <= 10, flat


@pytest.mark.parametrize("yaml", sorted((ROOT / "conf" / "strategy").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_strategy_yaml_is_its_registered_spec(yaml):
    """conf/strategy/NAME.yaml extends the spec registered as NAME; the spec names itself (`_target_`,
    `name`) and a runtime class that keeps the contract."""
    assert OmegaConf.load(yaml).defaults == [f"/spec/strategy/{yaml.stem}@_here_"]
    spec = SPECS[yaml.stem]()
    assert get_class(spec._target_) is SPECS[yaml.stem] and spec.name == yaml.stem
    assert issubclass(spec.runtime_class(), DataParallelBase)


def test_every_registered_strategy_has_a_yaml():
    assert set(SPECS) == {p.stem for p in (ROOT / "conf" / "strategy").glob("*.yaml")}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_runtime_defaults_are_the_specs(name):
    """A knob's default is written in its spec; where the runtime class takes the knob by name with a default
    of its own (for users who build it by hand), the two agree. A spec default of None means unset: the
    runtime's default is what unset means (said in the knob's doc)."""
    import enum
    import inspect
    from dataclasses import fields

    spec = SPECS[name]()
    parameters = inspect.signature(spec.runtime_class().__init__).parameters

    def plain(value):
        return value.value if isinstance(value, enum.Enum) else value

    for knob in fields(spec):
        default, taken = getattr(spec, knob.name), parameters.get(knob.name)
        if default is None or taken is None or taken.default is inspect.Parameter.empty:
            continue
        assert plain(taken.default) == plain(default), (name, knob.name, taken.default, default)


@pytest.mark.parametrize("yaml", sorted((ROOT / "conf" / "model").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_model_yaml_composes_and_builds_on_the_meta_device(yaml):
    """As strategies are held to their specs: each conf/model/NAME.yaml composes on its class's node (as
    launch.py composes it) and builds, on the meta device (no memory, so 2.7b too), a module with weights."""
    import torch

    from ddp_lab.config import compose_model
    from ddp_lab.models import build_model

    node = compose_model(yaml.stem)
    assert node.name == yaml.stem
    with torch.device("meta"):
        model = build_model(node)
    assert sum(p.numel() for p in model.parameters()) > 0


@pytest.mark.parametrize("yaml", sorted((ROOT / "conf" / "model").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_model_yaml_extends_a_registered_node_of_a_real_class(yaml):
    """As a strategy YAML extends its spec: each conf/model/NAME.yaml extends one node of spec/models/, whose
    `_target_` is a model class of ddp_lab.models."""
    from ddp_lab.spec.models import MODEL_SCHEMAS

    (entry,) = OmegaConf.load(yaml).defaults
    node = entry.removeprefix("/schema/model/").removesuffix("@_here_")
    assert node in MODEL_SCHEMAS, entry
    target = MODEL_SCHEMAS[node]._target_
    assert target.startswith("ddp_lab.models.") and isinstance(get_class(target), type)


def test_no_function_over_80_lines():
    """Simple to change: a function a reader takes in at once (the predictor's replay is a class of
    small methods, not one function of closures)."""
    long = [f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path in PACKAGE.rglob("*.py") for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80]
    assert not long, long
