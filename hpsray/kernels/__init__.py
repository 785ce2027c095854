"""Hash-table and sparse-optimizer kernels: one interface, CPU (numba) and CUDA backends."""
