"""Running one notebook under limits: the parent's watch (execute), the child that runs papermill
(child), the kernels forked from a template (warm), the kernel launcher and its limits (sandbox)
and the bubblewrap view (bwrap)."""
