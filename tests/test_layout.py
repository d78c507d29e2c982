"""The package's layout: imports flow one way (model < converters < library < command lines), with no cycle,
function-level imports included; inside the model, the rooms of modeling_lex/ flow one way too."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("lex_base", "configuration_lex", "modeling_lex", "convert", "lex")
# A module may import modules of its own layer or below, never above.
LAYERS = {"lex_base": -1, "configuration_lex": 0, "modeling_lex": 1, "convert": 2, "lex": 3, "lex.metrics": 4,
          "lex.commands": 4, "lex.cli": 5}
# The rooms of modeling_lex/, each importing only rooms before it: position encodings, the reading policy and the
# attention plan made from it, the kernels that apply positions and arrange a plan's tile for the backend, the block
# memory (retrieval), the stream's bookkeeping and one forward's record, the generate() glue, the caches (storage),
# and the model file that reads top to bottom.
MODEL_ROOMS = {
    "modeling_lex.positions": "position formulas and one class per position_embedding_type, in one registry",
    "modeling_lex.reading": "the reading policy (what a query sees, what a cache keeps, spans) and the attention plan",
    "modeling_lex.kernels": "positions applied, a plan's tile arranged for one backend call, the eager computation",
    "modeling_lex.memory": "retrieval: the block memory's store, its representatives, the choice and its evidence",
    "modeling_lex.stream": "the stream's bookkeeping and one forward's record, made from the caller's inputs",
    "modeling_lex.generation": "every coupling to transformers' generate() loop, with the versions it targets",
    "modeling_lex.cache": "storage: the bounded caches, a forward's step in which each layer's update stores",
    "modeling_lex.modeling_lex": "norm, MLP, attention, layer, model, causal-LM head; the Auto classes",
}
# Rooms that hold or change state; the reading policy, the plan and the kernels import none of them.
STATEFUL_ROOMS = ("modeling_lex.stream", "modeling_lex.memory", "modeling_lex.cache")
# The config's reading fields: read by the reading policy alone (ReadingPolicy.of), every other room asks it.
READING_FIELDS = {"attention_mode", "attention_window", "attention_sinks", "attention_sink_positions",
                  "attention_memory_blocks", "attention_memory_block_size", "local_attention_window"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {module_name(path): path for package in PACKAGES for path in (ROOT / package).rglob("*.py")}


def imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Project modules that `name` imports anywhere in its file (top level or inside functions)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            candidates = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {candidate for candidate in candidates if candidate in modules and candidate != name}
    return found


def layer(name: str) -> int:
    return max(rank for prefix, rank in LAYERS.items() if name == prefix or name.startswith(prefix + "."))


def graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imports(name, path, modules) for name, path in modules.items()}


def test_the_import_reader_sees_function_level_and_relative_imports():
    edges = graph()
    assert "lex.data" in edges["lex.perplexity"]  # from .data import ...
    assert "lex.study" in edges["lex.commands.demo"]  # from lex import study
    assert "modeling_lex.kernels" in edges["lex.resolution"]
    assert "lex.commands.train" not in edges["lex.cli"]  # the dispatcher imports by name, on demand


def test_the_model_rooms_are_every_module_and_import_only_earlier_rooms():
    edges, order = graph(), list(MODEL_ROOMS)
    assert set(order) == {name for name in edges if name.startswith("modeling_lex.")}
    later = [f"{name} -> {target}" for name in order for target in edges[name]
             if target in MODEL_ROOMS and order.index(target) > order.index(name)]
    assert later == []


def test_the_policy_the_plan_and_the_kernels_import_no_room_that_holds_state():
    """reading.py (the policy and the plan, a pure function of what a forward reads) imports neither the cache, the
    stream nor the memory (whose steps change what a cache holds), and neither do the kernels."""
    edges = graph()
    for room in ("modeling_lex.reading", "modeling_lex.kernels"):
        assert edges[room] & set(STATEFUL_ROOMS) == set(), room


def test_only_the_reading_policy_reads_the_config_s_reading_fields():
    """Every room but reading.py asks the policy (`ReadingPolicy.of(config)`) how the model reads: none reads an
    attention_* reading field of the config, so a rule about the window, the sinks or the memory's shape is
    written once."""
    readers = set()
    for name, path in project_modules().items():
        if name.startswith("modeling_lex."):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            if {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)} & READING_FIELDS:
                readers.add(name)
    assert readers == {"modeling_lex.reading"}


def test_imports_flow_down_the_layers():
    upward = [f"{name} -> {target}" for name, targets in graph().items() for target in targets
              if layer(target) > layer(name)]
    assert upward == []


def test_no_import_cycle():
    edges, state, cycles = graph(), {}, []

    def visit(name: str, path: list[str]) -> None:
        state[name] = "open"
        for target in sorted(edges[name]):
            if state.get(target) == "open":
                cycles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target, path + [target])
        state[name] = "done"

    for name in sorted(edges):
        if name not in state:
            visit(name, [name])
    assert cycles == []


MEMORY_TYPES = {"BlockMemory", "Choice", "OpenStep"}


def test_the_memory_types_are_named_in_two_rooms():
    """The block memory's types appear in its own room and in the cache that holds a memory per layer: the policy,
    the stream and the model pass what a forward reads of it on (`MemoryRead`, the policy's) without naming them."""
    naming = set()
    for name, path in project_modules().items():
        if name.startswith("modeling_lex."):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            words = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
            words |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for alias in node.names}
            words |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
            if words & MEMORY_TYPES:
                naming.add(name)
    assert naming == {"modeling_lex.memory", "modeling_lex.cache"}


def test_the_reading_path_benchmark_counts_the_crossings_of_one_decoded_token():
    """benchmarks/reading_path.py, the figure a redesign of the reading path is measured by: it sees the model's
    calls from one file into another (each layer's call into the cache), none from outside, and phases that add up
    to every crossing it lists."""
    import argparse
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from reading_path import trace_one_step

    args = argparse.Namespace(context=87, window=32, sinks=4, memory_blocks=2, memory_block_size=4, layers=3,
                              choosing=False)
    result = trace_one_step(args)
    edges = result["crossings"]
    assert sum(e["calls"] for e in edges) == (result["before_the_layers"] + result["per_layer"] * 3
                                             + result["after_the_layers"])
    assert any(e["phase"] == "layers" and e["from"] == "modeling_lex/modeling_lex.py" and e["calls"] == 3
               and e["to"] == "modeling_lex/cache.py" for e in edges)
    assert all(e["from"] != e["to"] for e in edges)
    assert set(result["modules_entered"]) <= {f"{p.parent.name}/{p.name}" for p in ROOT.glob("*_lex/*.py")}
    # issue 77's bounds: 12 crossings before the layers, 4 per layer, 4 after, into at most 8 modules
    assert result["before_the_layers"] <= 12 and result["per_layer"] <= 4 and result["after_the_layers"] <= 4
    assert len(result["modules_entered"]) <= 8


def ownership_table() -> list[tuple[str, str, list[str]]]:
    """(concept, module, names) of each row of docs/concepts/layout.md's ownership table."""
    rows = []
    for line in (ROOT / "docs" / "concepts" / "layout.md").read_text(encoding="utf-8").splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[1].startswith("`modeling_lex/"):
            rows.append((cells[0], cells[1].strip("`"), [name.strip("` ") for name in cells[2].split(",")]))
    return rows


def definitions(path: Path) -> set[str]:
    """Top-level functions, classes and assignments of a module, and `Class.method` of its classes' methods."""
    found = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            found.add(node.name)
        if isinstance(node, ast.ClassDef):
            found |= {f"{node.name}.{item.name}" for item in node.body if isinstance(item, ast.FunctionDef)}
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            found |= {target.id for target in targets if isinstance(target, ast.Name)}
    return found


def test_each_concept_of_the_reading_path_has_one_owner():
    """The ownership table of docs/concepts/layout.md: each concept's names are defined in the module it names and
    in no other room of modeling_lex/ (so a change of the sink rule or of the memory's choice is a change of one
    module), and every room appears in it."""
    rows = ownership_table()
    concepts = {concept for concept, _, _ in rows}
    assert {"position method", "window", "sinks", "memory choice", "memory store", "reading spans",
            "attention backend", "generate() coupling"} <= concepts
    rooms = {name: definitions(path) for name, path in project_modules().items() if name.startswith("modeling_lex.")}
    for concept, module, names in rows:
        owner = module.removesuffix(".py").replace("/", ".")
        assert owner in rooms, (concept, module)
        for name in names:
            assert name in rooms[owner], f"{concept}: {name} is not defined in {module}"
            others = [room for room, defined in rooms.items() if room != owner and name.split(".")[-1] in
                      {d.split(".")[-1] for d in defined if not d.startswith("_")}]
            assert others == [], f"{concept}: {name} is defined in {module} and in {others}"
    assert {module.removesuffix(".py").replace("/", ".") for _, module, _ in rows} == set(MODEL_ROOMS)


def test_attention_makes_one_call_of_the_backend_transformers_returns():
    """LexAttention.forward reads as Llama's: the variable assigned from `ALL_ATTENTION_FUNCTIONS.get_interface(` is
    called exactly once (what serving engines' transformers backends look for), and no other function of
    kernels.py runs attention on its behalf."""
    tree = ast.parse((ROOT / "modeling_lex" / "modeling_lex.py").read_text(encoding="utf-8"))
    attention = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "LexAttention")
    forward = next(item for item in attention.body if isinstance(item, ast.FunctionDef) and item.name == "forward")
    assigned = [node for node in ast.walk(forward) if isinstance(node, (ast.Assign, ast.AnnAssign))
                and "ALL_ATTENTION_FUNCTIONS.get_interface(" in ast.unparse(node.value)]
    assert len(assigned) == 1
    target = assigned[0].targets[0] if isinstance(assigned[0], ast.Assign) else assigned[0].target
    calls = [node for node in ast.walk(forward) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
             and node.func.id == target.id]
    assert len(calls) == 1
    rebound = [node for node in ast.walk(forward) if isinstance(node, (ast.Assign, ast.AnnAssign)) and target.id in
               {t.id for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                if isinstance(t, ast.Name)}]
    assert rebound == assigned  # the function called is the one transformers returned, not a substitute


def made_per_forward(forward) -> set[str]:
    """The classes of the reading path's modules whose constructors run during `forward()` (dataclasses, plain
    classes and named tuples alike)."""
    import inspect
    import sys

    from modeling_lex import cache, kernels, memory, positions, reading, stream

    ours = {obj for module in (cache, kernels, memory, positions, reading, stream) for obj in vars(module).values()
            if inspect.isclass(obj) and obj.__module__ == module.__name__}
    made = set()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_name in ("__init__", "__new__", "<lambda>"):
            made_by = frame.f_locals.get("self", frame.f_locals.get("_cls"))
            kind = made_by if isinstance(made_by, type) else type(made_by)
            if kind in ours:
                made.add(kind.__name__)

    sys.setprofile(profile)
    try:
        forward()
    finally:
        sys.setprofile(None)
    return made


def test_a_forward_makes_at_most_eight_data_types():
    """A decoded token and a prompt forward of a sliding model with sinks and the block memory (every room of the
    reading path at work) each make at most 8 of the reading path's data types, a choice of blocks included."""
    import torch

    from modeling_lex import LexCache
    from tests.helpers import perturbed_model, prompt, tiny_config

    config = tiny_config(attention_mode="sliding", attention_sinks=2, attention_sink_positions="cache",
                         attention_memory_blocks=3, attention_memory_block_size=4, position_embedding_type="rope")
    model = perturbed_model(config)
    cache = LexCache(config)
    ids = prompt(1, 48)
    with torch.no_grad():
        model(ids[:, :40], cache=cache)
        for step in range(40, 48):  # (a block completes in these: a decoded token that chooses among them)
            made = made_per_forward(lambda: model(ids[:, step : step + 1], cache=cache))
            assert len(made) <= 8, sorted(made)
        made = made_per_forward(lambda: model(prompt(1, 8, seed=2), cache=cache))
    assert "Choice" in made and len(made) <= 8, sorted(made)
