"""The transformers versions LEX declares are the ones it tests: one range in setup.cfg, in the generate() glue
(modeling_lex/generation.py) and in README's test command, a warning outside it, and the cache accepted under
both of its names on whichever version is installed. The torch floor is the one transformers keeps PyTorch on
above, and importing the model below it fails in one line."""

import configparser
import inspect
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from packaging.requirements import Requirement
from packaging.version import Version
from transformers import LlamaForCausalLM

from configuration_lex import OLDEST_TORCH
from modeling_lex import LexCache
from modeling_lex.generation import CACHE_NAME, TESTED_TRANSFORMERS, warn_if_untested
from tests.helpers import perturbed_model, prompt, tiny_config

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.oldest


def declared() -> Requirement:
    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg")
    requirements = [Requirement(line) for line in setup["options"]["install_requires"].split("\n") if line.strip()]
    return next(r for r in requirements if r.name == "transformers")


def test_one_range_in_setup_cfg_the_glue_and_the_test_command():
    specifiers = {s.operator: s.version for s in declared().specifier}
    assert Version(specifiers[">="]) == Version(TESTED_TRANSFORMERS[0])
    assert Version(specifiers["<"]) == Version(TESTED_TRANSFORMERS[1])
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    command = readme.split("<!-- test-command -->")[1].split("<!-- /test-command -->")[0]
    oldest = re.findall(r"transformers==([0-9.]+)", command)
    assert oldest and all(Version(v) == Version(TESTED_TRANSFORMERS[0]) for v in oldest)
    assert "-m oldest" in command


def test_the_installed_transformers_lies_in_the_range():
    assert transformers.__version__ in declared().specifier


@pytest.mark.parametrize("version, warns", [("5.22.2", True), ("5.23.0", False), ("5.24.0", False),
                                            ("5.24.9", False), ("5.25.0", False), ("5.25.9", False), ("5.26.0", True), ("6.0.0", True)])
def test_a_version_outside_the_range_gets_one_warning_naming_it(version, warns):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert warn_if_untested(version) is warns
    assert len(caught) == int(warns)
    if warns:
        assert f">={TESTED_TRANSFORMERS[0]},<{TESTED_TRANSFORMERS[1]}" in str(caught[0].message)
        assert version in str(caught[0].message)


def test_the_cache_name_is_the_installed_llamas():
    assert CACHE_NAME in inspect.signature(LlamaForCausalLM.forward).parameters


@pytest.mark.parametrize("name", ["cache", "past_key_values"])
def test_the_model_takes_the_cache_under_either_name(name):
    model = perturbed_model(tiny_config())
    ids = prompt(1, 9)
    cache = LexCache(model.config)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the old name is deprecated where transformers renamed it
        first = model(ids[:, :5], **{name: cache}, use_cache=True)
        second = model(ids[:, 5:], **{name: cache}, use_cache=True)
        whole = model(ids).logits
    assert cache.get_seq_length() == 9 and all(layer.keys.shape[2] == 9 for layer in cache.layers)
    assert getattr(first, CACHE_NAME) is cache
    torch.testing.assert_close(torch.cat([first.logits, second.logits], dim=1), whole, atol=1e-5, rtol=1e-5)


def test_the_torch_floor_is_the_one_the_import_checks():
    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg")
    torch_requirement = next(Requirement(line) for line in setup["options"]["install_requires"].split("\n")
                             if line.strip() and Requirement(line).name == "torch")
    assert str(torch_requirement.specifier) == f">={OLDEST_TORCH}"
    assert Version(torch.__version__).release >= Version(OLDEST_TORCH).release


@pytest.mark.parametrize("module", ["configuration_lex", "modeling_lex"])
def test_a_torch_below_the_floor_fails_the_import_in_one_line_naming_the_range(module):
    """A torch older than the floor (its version patched in a fresh process) stops the import before transformers
    is reached: one ImportError line naming the range, after a traceback of the import statement only."""
    script = f"import torch\ntorch.__version__ = '2.5.1+cpu'\nimport {module}\n"
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 1
    assert lines[-1] == (f"ImportError: lex-transformer needs torch>={OLDEST_TORCH} (transformers 5.23-5.25 turn "
                         f"PyTorch off below it); torch 2.5.1+cpu is installed: pip install 'torch>={OLDEST_TORCH}'")
    assert len(lines) <= 8 and not any("site-packages" in line for line in lines), run.stderr


@pytest.mark.parametrize("use_kernels", [None, False])
def test_a_loaded_model_trains_and_generates_kernelized_or_not(tmp_path, use_kernels):
    """transformers >= 5.25 kernelizes every model `from_pretrained` loads (`use_kernels` defaults to True there,
    and `train()`/`eval()` kernelize again): a LEX folder loads either way, its logits and greedy tokens are the
    saved model's, and a training step gives the saved model's gradients."""
    model = perturbed_model(tiny_config(attention_mode="sliding", attention_sinks=2))
    model.save_pretrained(tmp_path)
    options = {} if use_kernels is None else {"use_kernels": use_kernels}
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, **options)
    if use_kernels is None and Version(transformers.__version__) >= Version("5.25"):
        assert loaded.use_kernels  # the default took: the model was kernelized
    else:
        assert not loaded.use_kernels
    ids = prompt(2, 40, seed=4)
    for each in (model, loaded):
        each.train()
        each.zero_grad()
        each(ids, labels=ids).loss.backward()
        each.eval()
    for (name, expected), got in zip(model.named_parameters(), loaded.parameters()):
        torch.testing.assert_close(got.grad, expected.grad, msg=name)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)
    assert torch.equal(loaded.generate(ids, max_new_tokens=24, do_sample=False),
                       model.generate(ids, max_new_tokens=24, do_sample=False))
