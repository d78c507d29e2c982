"""Shared test set-up: the repository root on sys.path, TorchScale importable without timm, `lex_run`, and each
pytest-xdist worker on its share of the cores.

TorchScale 0.3.0 imports `timm.models.layers.drop_path` at import time, only for stochastic depth.
timm would pull torchvision (and a CUDA torch), so the tests install a stand-in that refuses to run:
every reference model here is built with drop_path_rate=0.
"""

import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _install_timm_stand_in() -> None:
    try:
        import timm.models.layers  # noqa: F401
        return
    except ImportError:
        pass

    def drop_path(x, drop_prob=0.0, training=False):
        if drop_prob and training:
            raise RuntimeError("the timm stand-in of the tests does not implement drop_path")
        return x

    timm = types.ModuleType("timm")
    models = types.ModuleType("timm.models")
    layers = types.ModuleType("timm.models.layers")
    layers.drop_path = drop_path
    timm.models, models.layers = models, layers
    sys.modules.update({"timm": timm, "timm.models": models, "timm.models.layers": layers})


_install_timm_stand_in()


import pytest  # noqa: E402


def pytest_configure(config) -> None:
    """Under pytest-xdist the workers share the machine's cores: each computes on its share of them (one thread
    each on 2 cores), as several torch processes with a thread per core each would contend badly."""
    import os

    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        import torch

        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // workers))


# The scopes (a module, or a class of one) that take longest, roughly longest first (pytest --durations).
# pytest-xdist hands scopes to its workers in collection order (README's test command passes --dist loadscope
# --no-loadscope-reorder), two to each worker at first, so these start first and the many short modules fill in
# beside them.
LONGEST_FIRST = (
    "tests/test_real_checkpoint.py::TestFourL", "tests/test_newcomer.py", "tests/test_train.py", "tests/test_gguf.py",
    "tests/test_real_checkpoint.py", "tests/test_quantization.py", "tests/test_study.py", "tests/test_model_card.py",
    "tests/test_staging.py", "tests/test_notebook.py", "tests/test_serve.py", "tests/test_document_state.py",
)


def pytest_collection_modifyitems(config, items: list) -> None:
    """Under pytest-xdist, the scopes of LONGEST_FIRST first, in that order; every other test after them, in
    collection order (a single process keeps collection order: a module's fixtures are set up once)."""
    import os

    if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0")) < 2:
        return

    def rank(item) -> int:
        scope = item.nodeid.rsplit("::", 1)[0]
        return LONGEST_FIRST.index(scope) if scope in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable


class LexRun:
    """`lex ARGS...` in this process, as a shell sees it: (exit status, stdout, stderr), whether the command
    returned its status or raised SystemExit (argparse's --help does)."""

    def __init__(self, capsys):
        self.capsys = capsys

    def __call__(self, *args: str) -> tuple[int, str, str]:
        from lex.cli import main

        self.capsys.readouterr()
        try:
            status = main([str(a) for a in args])
        except SystemExit as exit_:
            status = exit_.code if isinstance(exit_.code, int) else 1
        out, err = self.capsys.readouterr()
        return status, out, err


@pytest.fixture
def lex_run(capsys) -> LexRun:
    return LexRun(capsys)


@pytest.fixture
def fresh_dynamo():
    """dynamo's caches and graph counters emptied before and after the test (compiled-graph counts)."""
    import torch
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models decode fastest on one thread; several contend badly when the machine is busy. A module uses it
    with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
