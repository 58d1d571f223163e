"""numasched.distributed: cross-GPU kernels over Iris (imported lazily)."""
