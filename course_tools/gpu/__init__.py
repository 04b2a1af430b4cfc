"""The GPU check: `make gpu-check` runs the course's kernels and steps on a CUDA machine."""
