"""The worker's C kernels for the CPU, built with gcc at first use and called via ctypes.

`build.load_library(source)` builds one C file once per machine into the cache; each kernel
module (`linear.py`, `gpu_worker/attention/cpu_kernel.py`) declares its entry points and
falls back to torch when the library cannot be had.
"""
