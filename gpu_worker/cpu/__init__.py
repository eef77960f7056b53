"""The worker's C kernels for the CPU, built with gcc at first use and called via ctypes.

`build.load_library(source)` builds one C file once per machine into the cache; each kernel
module (`linear.py`, `paged_decode.py`) declares its entry points and
falls back to torch when the library cannot be had.
"""
