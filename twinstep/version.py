"""twinstep's version, the one place it is written: ``twinstep.__version__`` re-exports it, and
pyproject.toml reads it from here (``[tool.setuptools.dynamic]``). It imports nothing, so any
module may import it without importing the package's facade."""

__version__ = "0.1.0"
