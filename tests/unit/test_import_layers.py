"""The import graph of the shipped packages, read from the source (ast, nothing imported):
no circle; no service importing another service's package or the worker; common/ and
gpu_worker/ importing no service; the worker's sub-packages in order, its kernels leaves; the
gateway's layers in order.

    common  <-  gpu_worker            services/<one package each>  <-  services/*.py
       ^                                   (the supervisor, launch.py and friends)
       └──────────── services/gateway: engine <- openai <- (http | grpc) <- actor

The worker, each sub-package `gpu_worker.<sub>` one unit and each root module its own, bottom
first (a unit imports only units below it, or beside it without a circle):

    kv_quant                the KV rows' format (float, int8, fp8): imports no worker code
    kernels, cpu            the Triton and the C kernels: import no other worker code
    attention               the attention backends (call the kernels)
    distributed, kv_cache,  tensor parallelism; the KV cache's memory, and the prefix
    kv_tiers                cache's lower tiers (host slots, files)
    kv_handover             prefill/decode hand-over of blocks (in kv_tiers' file format)
    layers                  linear methods and layer ops: bind the kernels, once, at load
    models                  the model code (names no kernel)
    model_loader            reads checkpoints into a model
    lora                    adapters around a loaded model's linear methods
    sample                  sampling, logits controls, speculative drafts, pooling
    runner                  a step: batches, versions, CUDA graphs
    worker, rank, main      the process (and the package's own __init__)

An import under `if TYPE_CHECKING:` is for annotations only and does not count; an import
inside a function does (it runs)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("common", "services", "gpu_worker", "tools", "proto")
# the gateway's layers, bottom first: a layer imports only from layers below it (and its own)
GATEWAY_LAYERS = {"engine": 0, "openai": 1, "admin_auth": 2, "http": 3, "grpc": 3}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imported_names(tree: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node):
            names |= {n for child in node.orelse for n in _imported_names(child)}
            continue
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
        names |= _imported_names(node)
    return names


def _graph() -> dict[str, set[str]]:
    """module -> the shipped modules it imports (a name resolves to its longest module)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = set()
        for imported in _imported_names(ast.parse(path.read_text())):
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            if imported and imported != name and not name.startswith(imported + "."):
                deps.add(imported)  # (a package's own __init__ is not an edge back)
        graph[name] = deps
    return graph


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return _graph()


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_is_read(graph: dict[str, set[str]]) -> None:
    assert "common.config" in graph["common.actor"]
    assert "common.prefix_hash" in graph["services.router.policy"]


def test_no_import_circle(graph: dict[str, set[str]]) -> None:
    assert _cycles(graph) == []


def test_the_checker_finds_a_circle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _service(module: str) -> str | None:
    """The service package a module belongs to (`services.router.policy` -> router), or
    None for a module of services/ itself (the supervisor, the CLI)."""
    parts = module.split(".")
    return parts[1] if parts[0] == "services" and len(parts) > 2 else None


def test_no_service_imports_another_services_module(graph: dict[str, set[str]]) -> None:
    crossing = [
        (m, d)
        for m, deps in graph.items()
        for d in deps
        if _service(m) and _service(d) and _service(m) != _service(d)
    ]
    assert crossing == []


def test_common_and_the_worker_import_no_service(graph: dict[str, set[str]]) -> None:
    upward = [
        (m, d)
        for m, deps in graph.items()
        if m.split(".")[0] in ("common", "gpu_worker")
        for d in deps
        if d.split(".")[0] in ("services", "tools")
    ]
    assert upward == []


def test_no_service_package_imports_the_worker(graph: dict[str, set[str]]) -> None:
    """The CPU processes never load the model's code (torch); only the supervisor's
    worker_group reads the model's config to check a tensor-parallel layout."""
    wrong = [
        (m, d)
        for m, deps in graph.items()
        if _service(m)
        for d in deps
        if d.startswith("gpu_worker")
    ]
    assert wrong == []


# the worker's kernels: C (cpu/) and Triton (kernels/), and the attention backends over them;
# beside them the KV rows' format they all read (kv_quant.py: imports no worker code)
KERNEL_PACKAGES = (
    "gpu_worker.cpu",
    "gpu_worker.kernels",
    "gpu_worker.attention",
    "gpu_worker.kv_quant",
)


def test_the_workers_kernels_are_leaves(graph: dict[str, set[str]]) -> None:
    """Kernels never import the model, its layers, linear methods or the runner: the model's
    layers hold the kernel objects they call (chosen by gpu_worker/layers/kernel_choice.py),
    never the other way round (no kernel subclasses or patches the model; the one-call step
    reads the model through Protocols)."""
    inward = [
        (m, d)
        for m, deps in graph.items()
        if m.startswith(KERNEL_PACKAGES)
        for d in deps
        if d.startswith("gpu_worker") and not d.startswith(KERNEL_PACKAGES)
    ]
    assert inward == []


# the worker's units, bottom first (see the module docstring); "" is the package's __init__
WORKER_ORDER: tuple[tuple[str, ...], ...] = (
    ("kv_quant",),
    ("kernels", "cpu"),
    ("attention",),
    ("distributed", "kv_cache", "kv_tiers"),
    ("kv_handover",),
    ("layers",),
    ("models",),
    ("model_loader",),
    ("lora",),
    ("sample",),
    ("runner",),
    ("worker", "rank", "main", "__main__", ""),
)


def _worker_unit(module: str) -> str | None:
    """The worker's unit a module belongs to (`gpu_worker.cpu.gguf` -> cpu, the package's own
    __init__ -> ""), or None outside the worker."""
    parts = module.split(".")
    if parts[0] != "gpu_worker":
        return None
    return parts[1] if len(parts) > 1 else ""


def _worker_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The worker's units and the units each imports (itself left out)."""
    units: dict[str, set[str]] = {}
    for m, deps in graph.items():
        unit = _worker_unit(m)
        if unit is None:
            continue
        imported = {_worker_unit(d) for d in deps} - {None, unit}
        units.setdefault(unit, set()).update(u for u in imported if u is not None)
    return units


def test_no_circle_between_the_workers_units(graph: dict[str, set[str]]) -> None:
    assert _cycles(_worker_graph(graph)) == []


def test_the_workers_units_import_downwards(graph: dict[str, set[str]]) -> None:
    level = {unit: i for i, units in enumerate(WORKER_ORDER) for unit in units}
    units = _worker_graph(graph)
    assert sorted(set(units) - set(level)) == []  # a new unit takes its place in the order
    upward = [(u, d) for u, deps in units.items() for d in deps if level[d] > level[u]]
    assert sorted(upward) == []


def test_the_unit_checker_finds_a_circle() -> None:
    modules = {"gpu_worker.a.x": {"gpu_worker.b.y"}, "gpu_worker.b.y": {"gpu_worker.a.z"}}
    assert _cycles(_worker_graph(modules)) == [["a", "b"]]


def _gateway_layer(module: str) -> int | None:
    parts = module.split(".")
    if parts[:2] != ["services", "gateway"] or len(parts) < 3:
        return None
    return GATEWAY_LAYERS.get(parts[2])  # None: actor, main (above every layer)


def test_the_gateways_layers_import_downwards_only(graph: dict[str, set[str]]) -> None:
    wrong = []
    for m, deps in graph.items():
        layer = _gateway_layer(m)
        if layer is None:
            continue
        for d in deps:
            below = _gateway_layer(d)
            if d.startswith("services.gateway.") and (below is None or below > layer):
                wrong.append((m, d))
            elif below == layer and m.split(".")[2] != d.split(".")[2]:
                wrong.append((m, d))  # http and grpc are beside each other, not stacked
    assert wrong == []
