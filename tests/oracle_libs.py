"""torch and timm — the test oracles of the ``[oracle]`` extra — imported on first use.

Test files take them from here, so every file imports without the extra (`make test-fast`) and a
process that runs no oracle test never pays torch's import (~10 s on this machine, in each
pytest worker). The tests that use them are marked ``oracle``; conftest refuses to run a
selected oracle test when they are missing (`make test` never skips an oracle silently)."""

import importlib
import importlib.util

MISSING = ("the oracle tests need torch and timm: install the [oracle] extra "
           "(pip install -e '.[oracle,dev]'), or run `make test-fast`, which leaves them out")


def available() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("torch", "timm"))


class _Lazy:
    """A module imported (with ``submodules``) at its first attribute access."""

    def __init__(self, name: str, *submodules: str):
        self._name, self._submodules, self._module = name, submodules, None

    def __getattr__(self, attr):
        if self._module is None:
            for sub in self._submodules:
                importlib.import_module(f"{self._name}.{sub}")
            self._module = importlib.import_module(self._name)
        return getattr(self._module, attr)


torch = _Lazy("torch", "nn.functional")
F = _Lazy("torch.nn.functional")
timm = _Lazy("timm", "loss", "optim", "utils")
