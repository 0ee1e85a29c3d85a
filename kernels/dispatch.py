"""One dispatch layer for every op in vtc_kernels: a torch reference (the spec, runs anywhere) and, where it
pays, a Triton kernel picked automatically on CUDA tensors.

An op is declared once, on its reference:

    @kernel_op("max_min_select", tolerance=Tolerance.exact(), triton="vtc_kernels.triton.diverse:max_min_select")
    def max_min_select(dist, count, lengths=None): ...

and the decorated name is what plugins call. Which implementation runs:

  backend "auto"   (default) the Triton kernel when the op has one, the first tensor argument is on CUDA, Triton
                   imports, and the kernel's `supports(*args, **kwargs)` accepts the arguments (dtype, sizes);
                   otherwise the reference;
  backend "torch"  always the reference;
  backend "triton" the Triton kernel of every op that has one, and an error when it cannot run (arguments it does
                   not support, or CPU tensors without TRITON_INTERPRET=1); ops without a kernel run their
                   reference (`kernel_ops()` lists which ops have one).

Pick the backend with `use_backend("torch")` (a context manager, for tests and benchmarks) or the environment
variable VTC_KERNELS_BACKEND. `trace()` records which implementation each call took, so a test can check that a
plugin calls the shared op and not a private copy.

Triton modules are imported on first use only: importing Triton costs seconds, and CPU runs never need it.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import importlib
import os
from typing import Any, Callable, Iterator

import torch

BACKENDS = ("auto", "torch", "triton")
ENV_BACKEND = "VTC_KERNELS_BACKEND"


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """How closely a Triton kernel must match its reference: `exact` (index and integer outputs, equal
    element by element) or `allclose` with per-dtype (rtol, atol) bounds on float outputs. `note` states what
    else the contract says (e.g. how ties are broken)."""

    kind: str
    bounds: tuple[tuple[torch.dtype, float, float], ...] = ()
    note: str = ""

    @classmethod
    def exact(cls, note: str = "") -> "Tolerance":
        return cls("exact", (), note)

    @classmethod
    def allclose(cls, bounds: dict[torch.dtype, tuple[float, float]], note: str = "") -> "Tolerance":
        return cls("allclose", tuple((dtype, rtol, atol) for dtype, (rtol, atol) in bounds.items()), note)

    def bound(self, dtype: torch.dtype) -> tuple[float, float]:
        """(rtol, atol) for outputs of `dtype` (exact contracts: (0, 0))."""
        if self.kind == "exact":
            return 0.0, 0.0
        for bound_dtype, rtol, atol in self.bounds:
            if bound_dtype == dtype:
                return rtol, atol
        known = ", ".join(str(d) for d, _, _ in self.bounds)
        raise KeyError(f"no tolerance stated for {dtype}; stated for {known}")

    def check(self, actual: torch.Tensor, expected: torch.Tensor, what: str = "output") -> None:
        """Raise AssertionError naming the worst element when `actual` breaks the contract against `expected`."""
        if actual.shape != expected.shape:
            raise AssertionError(f"{what}: shape {tuple(actual.shape)} != reference {tuple(expected.shape)}")
        if self.kind == "exact" or not expected.is_floating_point():
            if not torch.equal(actual.cpu(), expected.cpu()):
                where = (actual.cpu() != expected.cpu()).nonzero()[:5].tolist()
                raise AssertionError(f"{what}: not equal to the reference at {where}")
            return
        rtol, atol = self.bound(expected.dtype)
        a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
        both_nan = a.isnan() & e.isnan()
        excess = ((a - e).abs() - (atol + rtol * e.abs())).masked_fill(both_nan, float("-inf"))
        if excess.numel() and bool((excess > 0).any() | (a.isnan() ^ e.isnan()).any()):
            worst = int(excess.nan_to_num(float("inf")).flatten().argmax())
            raise AssertionError(
                f"{what}: beyond rtol={rtol}, atol={atol} ({expected.dtype}); worst at flat index {worst}: "
                f"{a.flatten()[worst].item()} vs reference {e.flatten()[worst].item()}"
            )


@dataclasses.dataclass
class KernelOp:
    """One op: its reference, its Triton kernel's import path ("module:function", or None) and tolerance."""

    name: str
    reference: Callable
    tolerance: Tolerance
    triton: str | None = None

    def triton_impl(self) -> Callable:
        """The Triton implementation (imports its module on first use)."""
        if self.triton is None:
            raise LookupError(f"vtc_kernels op {self.name!r} has no Triton kernel")
        return _load(self.triton)


OPS: dict[str, KernelOp] = {}
_backend: contextvars.ContextVar[str | None] = contextvars.ContextVar("vtc_kernels_backend", default=None)
_trace: contextvars.ContextVar[list | None] = contextvars.ContextVar("vtc_kernels_trace", default=None)


@functools.lru_cache(maxsize=None)
def _load(path: str) -> Callable:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    """Whether Triton imports here (it ships with CUDA builds of torch)."""
    try:
        import triton  # noqa: F401
    except Exception:  # ImportError, or a broken install that fails on import
        return False
    return True


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1, read when Triton is imported)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def current_backend() -> str:
    """The backend in force: `use_backend`'s, else VTC_KERNELS_BACKEND, else "auto"."""
    chosen = _backend.get() or os.environ.get(ENV_BACKEND) or "auto"
    if chosen not in BACKENDS:
        raise ValueError(f"vtc_kernels backend must be one of {BACKENDS}, got {chosen!r} (from {ENV_BACKEND}?)")
    return chosen


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Run the block with every op on backend `name` ("auto", "torch" or "triton")."""
    if name not in BACKENDS:
        raise ValueError(f"vtc_kernels backend must be one of {BACKENDS}, got {name!r}")
    token = _backend.set(name)
    try:
        yield
    finally:
        _backend.reset(token)


@contextlib.contextmanager
def trace() -> Iterator[list[tuple[str, str]]]:
    """Record (op name, "torch" | "triton") for every op call made in the block."""
    calls: list[tuple[str, str]] = []
    token = _trace.set(calls)
    try:
        yield calls
    finally:
        _trace.reset(token)


def _first_tensor(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The first tensor among the arguments, looking inside dataclasses (e.g. `QuantizedGroups`): its device
    decides whether "auto" may pick the Triton kernel."""
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            inner = _first_tensor(tuple(getattr(value, f.name) for f in dataclasses.fields(value)), {})
            if inner is not None:
                return inner
    return None


def _supports(impl: Callable, args: tuple, kwargs: dict) -> str | None:
    """None when the kernel accepts the arguments, else why not (the kernel's `supports` returns a reason)."""
    check = getattr(impl, "supports", None)
    return None if check is None else check(*args, **kwargs)


def choose(op: KernelOp, args: tuple, kwargs: dict) -> tuple[str, Callable]:
    """("torch" | "triton", implementation) for one call under the backend in force."""
    backend = current_backend()
    if backend == "torch" or op.triton is None:
        return "torch", op.reference
    first = _first_tensor(args, kwargs)
    if backend == "auto":
        if first is None or first.device.type != "cuda" or not triton_available():
            return "torch", op.reference
        impl = op.triton_impl()
        return ("triton", impl) if _supports(impl, args, kwargs) is None else ("torch", op.reference)
    # forced "triton": run the kernel or say why it cannot
    if not triton_available():
        raise RuntimeError(f"{op.name}: backend 'triton' was asked for but Triton does not import here")
    if first is not None and first.device.type != "cuda" and not interpreting():
        raise RuntimeError(
            f"{op.name}: Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 set before Triton is imported "
            f"(got a tensor on {first.device})"
        )
    impl = op.triton_impl()
    reason = _supports(impl, args, kwargs)
    if reason is not None:
        raise ValueError(f"{op.name}: the Triton kernel does not support these arguments: {reason}")
    return "triton", impl


def kernel_op(name: str, *, tolerance: Tolerance, triton: str | None = None) -> Callable[[Callable], Callable]:
    """Declare an op on its reference (see the module docstring). The returned function dispatches; it keeps
    the reference as `.reference` and the op's record as `.op`."""

    def wrap(reference: Callable) -> Callable:
        op = KernelOp(name, reference, tolerance, triton)
        if name in OPS:
            raise ValueError(f"vtc_kernels op {name!r} is declared twice")
        OPS[name] = op

        @functools.wraps(reference)
        def dispatched(*args: Any, **kwargs: Any) -> Any:
            backend, impl = choose(op, args, kwargs)
            calls = _trace.get()
            if calls is not None:
                calls.append((name, backend))
            return impl(*args, **kwargs)

        dispatched.reference = reference  # type: ignore[attr-defined]
        dispatched.op = op  # type: ignore[attr-defined]
        return dispatched

    return wrap


def kernel_ops() -> list[str]:
    """Names of the ops that have a Triton kernel."""
    return sorted(name for name, op in OPS.items() if op.triton is not None)
