"""The GPU lease's scripts, which bench/gpu.sh runs on a lent GPU (step, bf16_hlo, train, feed,
kernel_profile; lease, which runs four of them under one deadline, and lease_table, its summary),
and twin.py, which compiles the GPU's step on this machine (`make gpu-twin`).
Each runs as ``python bench/gpu/<name>.py`` from the repository root. No module here may share
a name with a standard or installed module: running one puts this folder first on
``sys.path``, where it would shadow that module (hence kernel_profile.py, not profile.py: the
standard library's cProfile imports ``profile``)."""
