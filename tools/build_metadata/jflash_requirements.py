"""jflash's runtime requirements, computed when it is built.

A dynamic-metadata provider (pyproject.toml's [[tool.dynamic-metadata]],
scikit-build-core >= 1.0). The FFI handlers are compiled against the XLA FFI
headers of the jaxlib installed where the build runs (CMakeLists.txt records
its version as JFLASH_BUILD_JAXLIB_VERSION). A handler built against newer
headers than the running jaxlib's does not load, and takes the whole backend
down with it, so the package requires at least the jaxlib it was built
against; newer jaxlibs load handlers built against older FFI headers. The
same rule is checked again at import (jflash/_src/ffi.py), for installs that
bypass pip's resolver.

The version is read from the installed distribution in the build's own
interpreter, the one CMake runs to find the headers: hence the build without
isolation (README).
"""

from __future__ import annotations

from importlib import metadata


def dynamic_metadata(settings, project):
    del project
    if settings:
        raise ValueError(f"jflash_requirements takes no settings, got {sorted(settings)}")
    try:
        jaxlib = metadata.version("jaxlib")
    except metadata.PackageNotFoundError:
        raise RuntimeError(
            "jflash: building needs the jax (and jaxlib) that will run it, and none is "
            "installed here; install jax first, then build with --no-build-isolation"
        ) from None
    return {"dependencies": ["jax>=0.11", f"jaxlib>={jaxlib}", "numpy"]}


def dynamic_wheel(settings):
    """The requirements depend on the build environment, not on the source."""
    del settings
    return {"dependencies": True}
