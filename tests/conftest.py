"""Shared test set-up: the repository root on sys.path, and TorchScale importable without timm.

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
