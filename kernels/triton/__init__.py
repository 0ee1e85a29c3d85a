"""Triton kernels of vtc_kernels ops, one module per topic beside the reference module of the same name
(`vtc_kernels.similarity` -> `vtc_kernels.triton.similarity`). Nothing here is imported until an op
dispatches to it (see `vtc_kernels.dispatch`)."""
