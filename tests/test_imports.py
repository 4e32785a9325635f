"""The import graph (docs/code.md#imports): ``import twinstep`` and the command line's parser
import no JAX, and no module of twinstep starts a JAX backend when imported — so `twinstep.api`
imports its modules at the top and can still ask JAX for R virtual CPU devices before its first
operation. Controls: a module that does start a backend is caught, and one that fails to
import (an import cycle) is named."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# In a fresh process: every module named on the command line imported afresh (twinstep's modules
# dropped from sys.modules before each, so each is imported first, as a user's import would —
# an import cycle shows as an ImportError), the backend checked after each. Prints JSON
# {"failed": {module: error}, "started": [modules after whose import a backend had started]}.
IMPORT_EACH = """
import importlib, json, sys, traceback
from jax._src.xla_bridge import backends_are_initialized
failed, started = {}, []
for name in sys.argv[1:]:
    for loaded in [m for m in sys.modules if m == "twinstep" or m.startswith("twinstep.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except BaseException as e:
        failed[name] = f"{type(e).__name__}: {e}"
    if backends_are_initialized():
        started.append(name)
        break
print(json.dumps({"failed": failed, "started": started}))
"""


def modules() -> list[str]:
    """Every module of the twinstep package, by file (``__main__`` modules run; left out)."""
    names = []
    for folder, _, files in os.walk(os.path.join(ROOT, "twinstep")):
        package = os.path.relpath(folder, ROOT).replace(os.sep, ".")
        for f in sorted(files):
            if f.endswith(".py") and f != "__main__.py":
                names.append(package if f == "__init__.py" else f"{package}.{f[:-3]}")
    return sorted(names)


def _python(code: str, *args: str, extra_path: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    if extra_path:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [extra_path, env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=600)


def _import_each(names: list[str], extra_path: str | None = None) -> dict:
    p = _python(IMPORT_EACH, *names, extra_path=extra_path)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module", ["twinstep", "twinstep.cli", "twinstep.cli.plot",
                                    "twinstep.cli.compare", "twinstep.cli.launch",
                                    "twinstep.cli.pack"])
def test_the_facade_and_the_parser_import_no_jax(module):
    """``import twinstep`` (the API is loaded when first asked), ``import twinstep.cli`` (what
    ``twinstep --help`` loads) and the modules of the commands that never need JAX (all of
    cli/main's NO_JAX but recipe, whose recipes name the nets) import no JAX. The facade's
    version is version.py's."""
    code = (f"import sys, {module}, twinstep.version as v; "
            "assert sys.modules['twinstep'].__version__ == v.__version__; "
            "print(sorted(m for m in ('jax', 'jaxlib', 'numpy') if m in sys.modules))")
    p = _python(code)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "jax" not in p.stdout.strip(), p.stdout


def test_no_module_starts_a_backend_when_imported():
    """Each module of twinstep, imported first in a process, imports (no cycle) and leaves JAX's
    backends unstarted; and with the API imported, ``twinstep.devices`` can still ask for
    virtual CPU devices."""
    names = modules()
    assert "twinstep.api" in names and "twinstep.rendering.runner" in names
    found = _import_each(names)
    assert found == {"failed": {}, "started": []}, found
    code = ("import twinstep, jax; from twinstep import api; "
            "from jax._src.xla_bridge import backends_are_initialized as started; "
            "assert not started(); twinstep.devices(3); print(len(jax.devices()))")
    p = _python(code)
    assert p.returncode == 0 and p.stdout.split()[-1] == "3", p.stderr[-3000:]


def test_the_check_catches_a_backend_started_at_import_and_a_cycle(tmp_path):
    """The control: a module that runs a JAX operation at import is named, and so is one in an
    import cycle."""
    pkg = tmp_path / "probe"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "starts.py").write_text("import jax.numpy as jnp\nZERO = jnp.zeros(())\n")
    (pkg / "a.py").write_text("from probe.b import B\nA = 1\n")
    (pkg / "b.py").write_text("from probe.a import A\nB = 1\n")
    found = _import_each(["probe.a"], extra_path=str(tmp_path))
    assert list(found["failed"]) == ["probe.a"] and "ImportError" in found["failed"]["probe.a"]
    assert _import_each(["probe.starts"], extra_path=str(tmp_path))["started"] == [
        "probe.starts"]
