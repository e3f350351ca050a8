"""base/cache.py: where converted models and MLX's compiled CUDA kernels are kept."""

import inspect
import os
import subprocess
import sys
from pathlib import Path

from mlx_grpo.base.cache import CACHE_ENV, KERNEL_CACHE_ENV, cache_root, gpu_models, keep_compiled_kernels

CUDA = [("mlx", "0.32.4"), ("mlx-cuda-13", "0.32.4"), ("numpy", "2.1.0")]
H100 = ["NVIDIA H100 80GB HBM3"]


def keep(env, installed=CUDA, gpus=H100):
    return keep_compiled_kernels(env, lambda: installed, lambda: gpus)


def test_cache_root_is_the_variable_else_the_users_cache(tmp_path):
    assert cache_root({CACHE_ENV: str(tmp_path)}) == tmp_path
    assert cache_root({}) == Path.home() / ".cache" / "mlx-grpo"


def test_cuda_kernels_are_kept_beside_the_models_per_mlx_version_and_gpu(tmp_path):
    env = {CACHE_ENV: str(tmp_path)}
    path = keep(env)
    assert path == tmp_path / "kernels" / "mlx-0.32.4" / "NVIDIA-H100-80GB-HBM3"
    assert env[KERNEL_CACHE_ENV] == str(path) and path.is_dir()
    # the wheel's metadata may spell the name with underscores
    env = {CACHE_ENV: str(tmp_path)}
    assert keep(env, [("MLX", "0.33.0"), ("mlx_cuda_12", "0.33.0")], ["NVIDIA A100-SXM4-80GB"]) == \
        tmp_path / "kernels" / "mlx-0.33.0" / "NVIDIA-A100-SXM4-80GB"
    # the CLI's call runs the driver's list
    assert inspect.signature(keep_compiled_kernels).parameters["gpus"].default is gpu_models


def test_the_version_is_the_imported_mlx_the_first_on_the_path(tmp_path):
    env = {CACHE_ENV: str(tmp_path)}
    assert keep(env, [("mlx", "0.99.0"), ("mlx-cuda-13", "0.99.0"), ("mlx", "0.32.4")]).parent.name == "mlx-0.99.0"


def test_a_relative_cache_root_is_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    env = {CACHE_ENV: "rel"}
    assert keep(env) == tmp_path / "rel" / "kernels" / "mlx-0.32.4" / "NVIDIA-H100-80GB-HBM3"
    assert os.path.isabs(env[KERNEL_CACHE_ENV])


def test_left_alone_without_the_cuda_build_a_gpu_or_when_the_user_set_it(tmp_path):
    cases = [([("mlx", "0.32.4"), ("mlx-metal", "0.32.4")], H100), ([("mlx", "0.32.4")], H100),
             ([("mlx-cuda-13", "1")], H100), (CUDA, []),
             (CUDA, ["NVIDIA H100 80GB HBM3", "NVIDIA L4"])]  # two GPU models: which one runs is not known yet
    for installed, gpus in cases:
        env = {CACHE_ENV: str(tmp_path)}
        assert keep(env, installed, gpus) is None
        assert KERNEL_CACHE_ENV not in env
    for mine in ("/mine", ""):  # set empty, it turns MLX's cache off: the user's choice too
        env = {CACHE_ENV: str(tmp_path), KERNEL_CACHE_ENV: mine}
        assert keep(env) is None and env[KERNEL_CACHE_ENV] == mine
    assert not (tmp_path / "kernels").exists()


def test_left_alone_when_the_directory_cannot_be_made_or_there_is_no_home(tmp_path, monkeypatch):
    # MLX would then cache nothing; its default in /tmp still caches until the next boot
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    env = {CACHE_ENV: str(blocked)}
    assert keep(env) is None and KERNEL_CACHE_ENV not in env

    def no_home():
        raise RuntimeError("Could not determine home directory.")
    monkeypatch.setattr(Path, "home", no_home)
    env = {}
    assert keep(env) is None and KERNEL_CACHE_ENV not in env


def test_gpu_models_read_the_drivers_files(tmp_path):
    for bus, model in (("0000:00:06.0", "NVIDIA H100 80GB HBM3"), ("0000:00:07.0", "NVIDIA H100 80GB HBM3"),
                       ("0000:00:08.0", "NVIDIA L4")):
        (tmp_path / bus).mkdir()
        (tmp_path / bus / "information").write_text(f"Model: \t\t {model}\nIRQ:   \t\t 41\nBus Type: \t PCIe\n")
    assert gpu_models(tmp_path) == ["NVIDIA H100 80GB HBM3", "NVIDIA L4"]
    assert gpu_models(tmp_path / "missing") == []
    (tmp_path / "0000:00:09.0").mkdir()  # an empty Model line names nothing (not the next line)
    (tmp_path / "0000:00:09.0" / "information").write_text("Model: \t\t \nIRQ:   \t\t 41\n")
    assert gpu_models(tmp_path) == ["NVIDIA H100 80GB HBM3", "NVIDIA L4"]


def test_the_cli_sets_it_before_mlx_is_imported(tmp_path):
    """`mlx-grpo` calls keep_compiled_kernels before any subcommand imports mlx.core (MLX reads the variable
    when it first compiles a kernel): the CLI's own process, with a recorder in its place."""
    probe = ("import sys\n"
             "from mlx_grpo.commands import cli\n"
             "import mlx_grpo.reporting.plot\n"
             "calls = []\n"
             "cli.keep_compiled_kernels = lambda: calls.append(('kernels', 'mlx.core' in sys.modules))\n"
             "mlx_grpo.reporting.plot.plot_run = lambda *a, **k: calls.append(('plot', 'mlx.core' in sys.modules))\n"
             "cli.main(['plot', 'nowhere'])\n"
             "print(calls)\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                         env={**os.environ, CACHE_ENV: str(tmp_path)})
    assert out.returncode == 0, out.stderr
    assert "[('kernels', False), ('plot', False)]" in out.stdout
