"""The package's layout: imports flow one way (model < converters < library < command lines), with no cycle,
function-level imports included; inside the model, the rooms of modeling_lex/ flow one way too."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("lex_base", "configuration_lex", "modeling_lex", "convert", "lex")
# A module may import modules of its own layer or below, never above.
LAYERS = {"lex_base": -1, "configuration_lex": 0, "modeling_lex": 1, "convert": 2, "lex": 3, "lex.metrics": 4,
          "lex.commands": 4, "lex.cli": 5}
# The rooms of modeling_lex/, each importing only rooms before it: formulas, then who sees whom, one forward's
# record and the shared terms, the block memory, the stream's bookkeeping, the generate() glue, the caches that
# keep what a record says, the caller's inputs read into a record, the attention plan made from a record, the
# kernels that run it, and the model file that reads top to bottom.
MODEL_ROOMS = {
    "modeling_lex.xpos": "position formulas (xPos, RoPE, ALiBi, KERPLE, Sandwich, sinusoidal)",
    "modeling_lex.positions": "one class per position_embedding_type, in one registry",
    "modeling_lex.visibility": "who sees whom: the window rule, the one sink rule, the chunk index map",
    "modeling_lex.record": "one forward's frozen record and the typed request a layer hands its cache; the shared terms",
    "modeling_lex.memory": "the block memory: which blocks a forward may read, the store, who chooses, the evidence",
    "modeling_lex.stream": "the stream's bookkeeping: documents, positions, the keep policy, sink slots, rollback",
    "modeling_lex.generation": "every coupling to transformers' generate() loop, with the versions it targets",
    "modeling_lex.cache": "the bounded caches: a forward's step, in which each layer reads and the step's end keeps",
    "modeling_lex.inputs": "the caller's mask, position ids and cache checked and read into a forward's record",
    "modeling_lex.masking": "the attention plan's tiles and masks: a pure function of a record",
    "modeling_lex.kernels": "the attention backends run over the plan's tiles, reading (never writing) the cache's keys",
    "modeling_lex.modeling_lex": "norm, MLP, attention, layer, model, causal-LM head; the Auto classes",
}
# Rooms that may change a cache's state; the plan and the kernels may import none of them.
STATEFUL_ROOMS = ("modeling_lex.stream", "modeling_lex.memory", "modeling_lex.cache", "modeling_lex.inputs")


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


def test_the_plan_and_the_kernels_import_no_room_that_holds_state():
    """masking.py is a pure function of a forward's record: it imports the record, never the cache or the stream
    (whose begin/commit and rollback change what a cache holds), and neither do the kernels."""
    edges = graph()
    for room in ("modeling_lex.masking", "modeling_lex.kernels"):
        assert edges[room] & set(STATEFUL_ROOMS) == set(), room
    assert "modeling_lex.record" in edges["modeling_lex.masking"]


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


MEMORY_TYPES = {"BlockMemory", "Choice", "Evidence", "MemoryRead", "MemoryStep"}


def test_the_memory_types_are_named_in_three_rooms():
    """The block memory's types appear in its own room, in the record that carries what a forward reads of it, and
    in the cache that holds it: the plan, the stream and the model pass it on without naming it."""
    naming = set()
    for name, path in project_modules().items():
        if name.startswith("modeling_lex."):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            words = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
            words |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for alias in node.names}
            words |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
            if words & MEMORY_TYPES:
                naming.add(name)
    assert naming == {"modeling_lex.record", "modeling_lex.memory", "modeling_lex.cache"}


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
