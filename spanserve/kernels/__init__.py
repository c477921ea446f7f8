"""spanserve's compute kernels and what decides how they run, at the bottom of the package: the C
sources (csrc/), their build for the running CPU and its variants (native.py, variants.py), their
ctypes wrappers (cpu_kernel.py), the weight layouts the GEMMs read and the w8a8 product's torch
twin (layouts.py), the check each build passes before it is used (selfcheck.py), the CPU thread
policy (threads.py) and whether the Triton kernels can run (gpu.py). Models and attention import
this package; it imports neither."""
