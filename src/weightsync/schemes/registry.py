"""Schemes by name, loaded lazily: ``scheme_class("shm")`` imports only what it names.

The demo, the benchmark and the integrations choose a transport by a short name; this is
the one table that maps those names to classes, so an optional extra (Ray) is imported
only when its scheme is asked for, and a plug-in can add its own with
:func:`register_scheme`.
"""

from __future__ import annotations

import importlib
from typing import Any

_SCHEMES: dict[str, str] = {
    "shm": "weightsync.schemes.shared_mem:SharedMemWeightSyncScheme",
    "mp": "weightsync.schemes.multiprocess:MultiProcessWeightSyncScheme",
    "file": "weightsync.schemes.double_buffer:VLLMDoubleBufferSyncScheme",
    "ray": "weightsync.schemes.ray:RayWeightSyncScheme",
    "net": "weightsync.schemes.net:NetWeightSyncScheme",
}


def register_scheme(name: str, target: str | type) -> None:
    """Make ``name`` select ``target`` (a class, or ``"module:Class"`` imported on use).

    A name is registered once: a second registration raises ``ValueError`` rather than
    silently changing what code elsewhere gets for that name (vLLM's factories do the same).
    """
    if not name or not isinstance(name, str):
        raise ValueError(f"a scheme name must be a non-empty str, got {name!r}")
    spec = target if isinstance(target, str) else f"{target.__module__}:{target.__qualname__}"
    if name in _SCHEMES:
        raise ValueError(
            f"scheme name {name!r} is already registered (to {_SCHEMES[name]}); "
            f"pick another name for {spec}"
        )
    _SCHEMES[name] = spec


def scheme_names() -> list[str]:
    """The names :func:`scheme_class` accepts."""
    return sorted(_SCHEMES)


def scheme_class(name: str) -> Any:
    """The scheme class registered as ``name``; ValueError (listing the names) if none,
    ImportError naming the extra to install if its module cannot be imported."""
    try:
        target = _SCHEMES[name]
    except KeyError:
        raise ValueError(
            f"unknown scheme {name!r}; known: {', '.join(scheme_names())}"
        ) from None
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ImportError(
            f"scheme {name!r} needs {exc.name or module_name}, which is not installed"
            + (" (pip install 'weightsync[ray]')" if name == "ray" else "")
        ) from exc
    return getattr(module, attr)
