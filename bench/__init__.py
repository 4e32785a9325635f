"""The benchmarks, the GPU lease's scripts (`bench.gpu`) and the probes (`bench.probes`), each
run as a script from the repository root (``python bench/levers.py``). A script imports its
neighbours as this package's modules (``from bench.common import write_results``): the package
is found where the repository root is on ``sys.path`` — the editable install's ``.pth`` file
(`make test`, `make gpu-twin`), or PYTHONPATH (bench/gpu.sh sets it on a lent GPU machine).
Not in the wheel: pyproject.toml's package list is ``twinstep*``."""
