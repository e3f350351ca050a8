"""cache.py: where converted models and MLX's compiled CUDA kernels are kept."""

import os
import subprocess
import sys
from pathlib import Path

from mlx_grpo.cache import CACHE_ENV, KERNEL_CACHE_ENV, cache_root, keep_compiled_kernels

CUDA = [("mlx", "0.32.4"), ("mlx-cuda-13", "0.32.4"), ("numpy", "2.1.0")]


def test_cache_root_is_the_variable_else_the_users_cache(tmp_path):
    assert cache_root({CACHE_ENV: str(tmp_path)}) == tmp_path
    assert cache_root({}) == Path.home() / ".cache" / "mlx-grpo"


def test_cuda_kernels_are_kept_beside_the_models_per_mlx_version(tmp_path):
    env = {CACHE_ENV: str(tmp_path)}
    path = keep_compiled_kernels(env, lambda: CUDA)
    assert path == tmp_path / "kernels" / "mlx-0.32.4"
    assert env[KERNEL_CACHE_ENV] == str(path) and path.is_dir()
    # the wheel's metadata may spell the name with underscores
    env = {CACHE_ENV: str(tmp_path)}
    assert keep_compiled_kernels(env, lambda: [("MLX", "0.33.0"), ("mlx_cuda_12", "0.33.0")]) == \
        tmp_path / "kernels" / "mlx-0.33.0"


def test_left_alone_without_the_cuda_build_or_when_the_user_set_it(tmp_path):
    for installed in ([("mlx", "0.32.4"), ("mlx-metal", "0.32.4")], [("mlx", "0.32.4")], [("mlx-cuda-13", "1")]):
        env = {CACHE_ENV: str(tmp_path)}
        assert keep_compiled_kernels(env, lambda: installed) is None
        assert KERNEL_CACHE_ENV not in env
    env = {CACHE_ENV: str(tmp_path), KERNEL_CACHE_ENV: "/mine"}
    assert keep_compiled_kernels(env, lambda: CUDA) is None and env[KERNEL_CACHE_ENV] == "/mine"
    assert not (tmp_path / "kernels").exists()


def test_left_alone_when_the_directory_cannot_be_made(tmp_path):
    # MLX would then cache nothing; its default in /tmp still caches until the next boot
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    env = {CACHE_ENV: str(blocked)}
    assert keep_compiled_kernels(env, lambda: CUDA) is None
    assert KERNEL_CACHE_ENV not in env


def test_the_cli_sets_it_before_mlx_is_imported(tmp_path):
    """`mlx-grpo` calls keep_compiled_kernels before any subcommand imports mlx.core (MLX reads the variable
    when it first compiles a kernel). The CLI's own process is checked through a stand-in CUDA build."""
    probe = ("import sys, mlx_grpo.cache as c\n"
             "c._installed = lambda: [('mlx', '9.9'), ('mlx-cuda-13', '9.9')]\n"
             "from mlx_grpo import cli\n"
             "seen = {}\n"
             "def plot(*a, **k):\n"
             "    import os\n"
             "    seen['mlx_loaded'] = 'mlx.core' in sys.modules\n"
             "    seen['dir'] = os.environ.get('MLX_PTX_CACHE_DIR')\n"
             "import mlx_grpo.plot\n"
             "mlx_grpo.plot.plot_run = plot\n"
             "cli.main(['plot', 'nowhere'])\n"
             "print(seen)\n")
    env = {k: v for k, v in os.environ.items() if k != KERNEL_CACHE_ENV}
    env[CACHE_ENV] = str(tmp_path)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"'dir': '{tmp_path / 'kernels' / 'mlx-9.9'}'" in out.stdout
    assert "'mlx_loaded': False" in out.stdout
