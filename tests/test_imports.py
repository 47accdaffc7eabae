"""What a process pays to import one module of ``hf_lowzero`` (``hf_lowzero/lazy_names.py``).

A Ray snapshot holder (one per node per run) and the run's controller import a few modules of
``hf_lowzero.ray``; before the package names were imported on first use, each of those processes
also imported ``transformers`` (and through it ``peft``, ``bitsandbytes`` and ``torchao``): about
9 s of CPU per process, on the cores that train. Each import below runs in a fresh interpreter.
"""

import importlib
import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "peft", "torchao", "bitsandbytes")


def heavy_imports(module: str) -> list[str]:
    """The packages of ``HEAVY`` that a fresh interpreter has imported after ``import module``."""
    code = f"import sys, json, {module}; print(json.dumps(sorted(set(m.split('.')[0] for m in sys.modules))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return [name for name in HEAVY if name in json.loads(out.splitlines()[-1])]


def test_import_hf_lowzero_imports_no_torch():
    assert heavy_imports("hf_lowzero") == []


@pytest.mark.parametrize(
    "module",
    [
        "hf_lowzero.ray.holder",  # it checks, keeps and sends pieces' bytes: no tensor
        "hf_lowzero.ray.holder_lifetime",  # ReleaseSnapshots, on the controller
        "hf_lowzero.ray.events",  # ConsoleEvents, on the controller
    ],
)
def test_the_holder_and_the_controllers_callbacks_import_neither_torch_nor_transformers(module):
    pytest.importorskip("ray")
    assert heavy_imports(module) == []


@pytest.mark.parametrize("package", ["hf_lowzero", "hf_lowzero.ray", "hf_lowzero.checkpoint", "hf_lowzero.snapshot"])
def test_every_public_name_resolves_to_its_modules_object(package):
    if package == "hf_lowzero.ray":
        pytest.importorskip("ray")
    module = importlib.import_module(package)
    for name in module.__all__:
        value = getattr(module, name)
        home = importlib.import_module(getattr(value, "__module__", None) or package)
        assert getattr(home, name) is value, name
        assert name in dir(module)
    with pytest.raises(AttributeError, match=f"module '{package}' has no attribute 'no_such_name'"):
        module.no_such_name  # noqa: B018


def test_a_submodule_is_reached_as_an_attribute_as_before():
    """``import hf_lowzero`` then ``hf_lowzero.checkpoint.load...``: the eager imports made each
    subpackage an attribute of its package, and callers may rely on it."""
    code = (
        "import hf_lowzero; load = hf_lowzero.checkpoint.load.load_checkpoint; "
        "from hf_lowzero.checkpoint.load import load_checkpoint; assert load is load_checkpoint; "
        "assert not hasattr(hf_lowzero, 'no_such_module')"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
