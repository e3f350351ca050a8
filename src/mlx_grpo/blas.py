"""Which BLAS MLX's Linux CPU build runs its matmuls in: an installed OpenBLAS instead of the reference BLAS.

The `mlx-cpu` wheel (`pip install "mlx[cpu]"`) vendors the reference BLAS and LAPACK
(`mlx_cpu.libs/libblas-<hash>.so`), about 20x slower than OpenBLAS on float32 matmuls. This module owns
the one decision the CLI makes about that, once per process, before anything imports `mlx.core`: if
OpenBLAS is installed, load it into the process's global symbol scope, where the dynamic linker finds
`cblas_sgemm`, `sgemm_`, `spotrf_`, ... before it searches libmlx's own dependencies.

`MLX_GRPO_BLAS` steers it: unset, empty or `auto` (OpenBLAS when installed, silently nothing otherwise),
`reference` (keep the BLAS that MLX ships), or a library path or soname to load instead (an error if it
cannot be loaded or has no CBLAS). Only the CLI calls this; a library user who wants the same calls
`use_optimized_blas()` before the first `import mlx.core`.
"""

from __future__ import annotations

import ctypes
import os
import re
import sys
from collections.abc import Iterable, Mapping

from mlx_grpo.errors import UserError

ENV = "MLX_GRPO_BLAS"
OPT_OUT = "reference"
# LP64 OpenBLAS under the names distributions give it: Debian/Ubuntu (the alternatives' choice of
# pthread/openmp/serial), Arch, conda; Fedora's pthread build. The ILP64 builds (libopenblas64_) export
# suffixed symbols, so they could not replace anything.
CANDIDATES = ("libopenblas.so.0", "libopenblasp.so.0")


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def plan(setting: str | None, *, platform: str, mlx_distributions: Iterable[str],
         vendored_blas: str | None) -> tuple[tuple[str, ...], bool]:
    """The libraries to try in order (empty: leave MLX's BLAS alone) and whether the user named one.

    `setting` is the value of MLX_GRPO_BLAS; `mlx_distributions` the names of installed distributions
    (only mlx ones matter); `vendored_blas` the file name of the BLAS inside the `mlx-cpu` wheel."""
    setting = (setting or "").strip()
    # macOS links Accelerate; Windows has no mlx-cpu wheel; dlopen's global scope is a Linux (ELF) fact.
    if not platform.startswith("linux") or setting.lower() == OPT_OUT:
        return (), False
    if setting and setting.lower() != "auto":
        return (setting,), True
    names = {_normalise(n) for n in mlx_distributions}
    # Automatic only where MLX is the CPU wheel with its reference BLAS: not the CUDA build (its CPU work
    # is minor and its wheel is not ours to second-guess), not a source build (linked to whatever BLAS
    # it was built with), and not a future mlx-cpu that ships an optimized BLAS itself.
    if "mlx-cpu" not in names or any(n.startswith("mlx-cuda") for n in names):
        return (), False
    if not (vendored_blas or "").startswith("libblas"):
        return (), False
    return CANDIDATES, False


def load_first(names: Iterable[str], *, explicit: bool) -> str | None:
    """Load the first library of `names` that has CBLAS into the global symbol scope; return its name.

    Silent when none loads, unless the user named it (`explicit`): then a UserError says why."""
    for name in names:
        try:
            # RTLD_LOCAL first: a library without CBLAS (a Fortran-only libblas.so.3, a typo'd lib) must
            # not put half a BLAS into the global scope.
            lib = ctypes.CDLL(name)
            lib.cblas_sgemm  # noqa: B018 (dlsym; AttributeError when absent)
        except (OSError, AttributeError) as exc:
            if explicit:
                why = "it has no cblas_sgemm" if isinstance(exc, AttributeError) else str(exc)
                raise UserError(f"{ENV}={name}: cannot use it as the BLAS ({why}); unset {ENV} to pick "
                                f"OpenBLAS when installed, or set {ENV}={OPT_OUT} to keep MLX's own") from None
            continue
        # The same dlopen with RTLD_GLOBAL promotes the loaded object into the global scope, which the
        # dynamic linker searches before libmlx.so's own DT_NEEDED libblas/liblapack when mlx.core loads.
        ctypes.CDLL(name, mode=os.RTLD_GLOBAL)
        return name
    return None


def _installed_mlx() -> tuple[list[str], str | None]:
    """Names of the installed distributions and the BLAS file vendored by `mlx-cpu`, read from the
    package metadata (importing mlx to ask would bind its BLAS before we get a say)."""
    from importlib import metadata

    names = [d.name for d in metadata.distributions() if d.name]
    vendored = None
    if "mlx-cpu" in {_normalise(n) for n in names}:
        for file in metadata.distribution("mlx-cpu").files or ():
            if file.parts[0] == "mlx_cpu.libs" and file.name.startswith("libblas"):
                vendored = file.name
    return names, vendored


def use_optimized_blas(environ: Mapping[str, str] | None = None) -> str | None:
    """Put an optimized BLAS under MLX's CPU build if one is installed and the user did not opt out;
    return the library loaded, or None. Must run before the first `import mlx.core`."""
    environ = os.environ if environ is None else environ
    if "mlx.core" in sys.modules:  # libmlx is loaded and its symbols bound: loading now would change nothing
        return None
    setting = environ.get(ENV)
    # Only the automatic choice on Linux depends on what is installed: skip the metadata scan otherwise.
    automatic = sys.platform.startswith("linux") and (setting or "").strip().lower() in ("", "auto")
    names, vendored = _installed_mlx() if automatic else ([], None)
    libraries, explicit = plan(setting, platform=sys.platform, mlx_distributions=names, vendored_blas=vendored)
    return load_first(libraries, explicit=explicit)
