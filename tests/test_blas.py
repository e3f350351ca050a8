"""The CLI's choice of BLAS under MLX's Linux CPU build (blas.py): the decision as pure functions, and in a
fresh CLI process (only where OpenBLAS is installed) that it is loaded and matmuls stay right."""

from __future__ import annotations

import ctypes.util
import os
import re
import subprocess
import sys
import textwrap

import pytest

from mlx_grpo import blas
from mlx_grpo.errors import UserError

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


def _python(*args: str, setting: str | None = None, **extra_env: str) -> subprocess.CompletedProcess:
    """A fresh interpreter (the BLAS is chosen once per process) with MLX_GRPO_BLAS set to `setting`."""
    env = {k: v for k, v in os.environ.items() if k != blas.ENV} | ({blas.ENV: setting} if setting else {})
    env |= extra_env
    return subprocess.run([sys.executable, "-c", *args], capture_output=True, text=True, env=env, timeout=300)


def test_cli_import_does_not_import_mlx():
    """The BLAS can only be swapped before libmlx loads: cli.py and what it imports at the top must not
    import mlx.core."""
    proc = _python("import sys, mlx_grpo.cli; print('mlx.core' in sys.modules)")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


@pytest.mark.skipif(not LINUX, reason="MLX_GRPO_BLAS only acts on Linux")
def test_cli_reports_a_bad_blas_setting():
    proc = _python("from mlx_grpo.cli import main; raise SystemExit(main(['generate', '--prompt', 'hi']))",
                   setting="/no/such/libblas.so")
    assert proc.returncode == 2
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("mlx-grpo generate: error: MLX_GRPO_BLAS=/no/such/libblas.so: cannot use it")


# A real CLI command in a fresh process, then a matmul checked against numpy's float64 product.
CLI_THEN_MATMUL = textwrap.dedent("""
    import sys
    from mlx_grpo.cli import main
    assert main(["generate", "--model", sys.argv[1], "--prompt", "hi", "--max-tokens", "2"]) == 0
    import mlx.core as mx, numpy as np
    a, b = mx.random.normal((300, 200)), mx.random.normal((200, 100))
    ref = np.asarray(a).astype(np.float64) @ np.asarray(b).astype(np.float64)
    print(float(np.abs(np.asarray(a @ b) - ref).max() / np.abs(ref).max()))
""")


def _automatic_would_act() -> bool:
    names, vendored = blas._installed_mlx()
    return bool(blas.plan(None, platform=sys.platform, mlx_distributions=names, vendored_blas=vendored)[0])


@pytest.mark.skipif(not (LINUX and ctypes.util.find_library("openblas")),
                    reason="no OpenBLAS installed (e.g. apt install libopenblas0-pthread)")
@pytest.mark.skipif(not _automatic_would_act(), reason="MLX is not the mlx-cpu wheel with its reference BLAS")
@pytest.mark.parametrize("setting, library", [(None, "libopenblas"), ("reference", "libblas-")])
def test_cli_process_runs_on_openblas_unless_opted_out(tiny_model_dir, tmp_path, setting, library):
    # glibc's dynamic linker logs where each symbol of each library got bound: the direct evidence of
    # which BLAS libmlx calls (a library merely mapped into the process proves nothing).
    proc = _python(CLI_THEN_MATMUL, str(tiny_model_dir), setting=setting,
                   LD_DEBUG="bindings", LD_DEBUG_OUTPUT=str(tmp_path / "ld"))
    assert proc.returncode == 0, proc.stderr
    assert float(proc.stdout.strip().splitlines()[-1]) < 1e-5
    log = "".join(path.read_text() for path in tmp_path.glob("ld.*"))
    targets = {re.search(r" to (\S+) \[", line)[1] for line in log.splitlines()
               if "/libmlx.so " in line and "`cblas_sgemm'" in line}
    assert [os.path.basename(t).startswith(library) for t in targets] == [True], targets
