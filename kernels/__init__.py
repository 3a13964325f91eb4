"""Jinja templates of CUDA C kernels (shipped in the wheel as ``loragen._kernels``)."""
