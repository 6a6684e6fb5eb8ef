"""Triton kernels: the CUDA platform's (platform/cuda.py), run on CPU tensors under
TRITON_INTERPRET=1 in the tests. Importing them needs triton (the `cuda` and `test` extras)."""
