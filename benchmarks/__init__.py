"""Benchmarks that live in the repository, not in the installed `vtc` package: `bench_kernels` (`vtc bench-kernels`)
and `kernel_baselines`, the official repositories' way of computing each shared op (copies of their code, kept only
as the baseline the benchmark times vtc's ops against).

`vtc bench-kernels` loads this folder from the checkout vtc runs from (`vtc.tools.cli.benchmark_module`); from an
installed wheel the command says it needs a checkout.
"""
