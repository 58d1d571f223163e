"""numasched.kernels: Triton kernels that take a mapping policy as constexpr device functions."""
