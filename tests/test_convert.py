"""`mlx-grpo convert`: every flag has an effect; bad flag combinations give one clear error."""

import json

import mlx.core as mx
import pytest
from mlx_lm import load

from mlx_grpo.commands.cli import main


def _dtypes(path):
    return {v.dtype for v in mx.load(str(path / "model.safetensors")).values()}


def test_hf_path_with_dtype(tiny_model_dir, tmp_path):
    out = tmp_path / "f16"
    assert main(["convert", "--hf-path", str(tiny_model_dir), "--output-dir", str(out), "--dtype", "float16"]) == 0
    assert _dtypes(out) == {mx.float16}
    load(str(out))
    assert json.loads((out / "mlx_grpo_convert.json").read_text())["dtype"] == "float16"


def test_hf_path_quantized_bits_and_group_size(tiny_model_dir, tmp_path):
    out = tmp_path / "q"
    assert main(["convert", "--hf-path", str(tiny_model_dir), "--output-dir", str(out), "--quantize",
                 "--bits", "8", "--group-size", "32"]) == 0
    quant = json.loads((out / "config.json").read_text())["quantization"]
    assert quant["bits"] == 8 and quant["group_size"] == 32
    model, _ = load(str(out))
    assert model(mx.array([[3, 4, 5]])).shape[-1] > 0


def test_gguf_flag_converts_and_quantizes(tmp_path):
    from test_gguf import _tiny_model, _write_gguf  # the llama.cpp-style GGUF writer of the GGUF tests

    gguf_file = _write_gguf(tmp_path / "m.gguf", _tiny_model(tied=True))
    out = tmp_path / "g"
    assert main(["convert", "--gguf", str(gguf_file), "--output-dir", str(out), "--dtype", "float16"]) == 0
    assert _dtypes(out) == {mx.float16}
    quantized = tmp_path / "gq"
    assert main(["convert", "--gguf", str(gguf_file), "--output-dir", str(quantized), "--quantize",
                 "--bits", "4", "--group-size", "32"]) == 0
    assert json.loads((quantized / "config.json").read_text())["quantization"]["bits"] == 4


@pytest.mark.parametrize("extra,message", [
    (["--gguf", "x.gguf"], "exactly one of --hf-path, --gguf or --nanochat"),
    ([], "already exists"),
])
def test_bad_flag_combinations(tiny_model_dir, tmp_path, capsys, extra, message):
    out = tmp_path / "exists"
    out.mkdir()
    assert main(["convert", "--hf-path", str(tiny_model_dir), "--output-dir", str(out), *extra]) == 2
    assert message in capsys.readouterr().err


def test_trust_remote_code_rejected_for_gguf(tmp_path, capsys):
    assert main(["convert", "--gguf", "m.gguf", "--output-dir", str(tmp_path / "o"), "--trust-remote-code"]) == 2
    assert "--trust-remote-code applies to --hf-path only" in capsys.readouterr().err
