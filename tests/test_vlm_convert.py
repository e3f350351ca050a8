"""Vision-language models: conversion through mlx-vlm (logits equal the torch source's), quantized conversion,
`generate --image` / `chat --image`, and their bad inputs (one line, exit 2)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from mlx_grpo.commands.cli import main

pytest.importorskip("mlx_vlm")


def _red_png(path):
    from PIL import Image

    Image.new("RGB", (60, 50), (220, 30, 30)).save(path)
    return path


def _mlx_inputs(model_dir, image):
    from mlx_vlm import load
    from mlx_vlm.utils import prepare_inputs

    from mlx_grpo.commands.vision_inference import image_messages, prompt_text

    model, processor = load(str(model_dir))
    text = prompt_text(processor, image_messages("What colour is it?", 1))
    return model, prepare_inputs(processor, images=[image], prompts=[text],
                                 image_token_index=model.config.image_token_id)


def test_converted_logits_equal_the_torch_source(tiny_vlm_hf_dir, tiny_vlm_dir, tmp_path):
    import mlx.core as mx
    import torch
    from PIL import Image
    from transformers import Qwen2VLForConditionalGeneration

    image = Image.open(_red_png(tmp_path / "red.png"))
    model, inputs = _mlx_inputs(tiny_vlm_dir, image)
    ours = model(inputs["input_ids"], inputs["pixel_values"], mask=inputs["attention_mask"],
                 image_grid_thw=inputs["image_grid_thw"]).logits
    source = Qwen2VLForConditionalGeneration.from_pretrained(tiny_vlm_hf_dir, dtype=torch.float32).eval()
    ids = np.array(inputs["input_ids"])
    with torch.no_grad():  # mm_token_type_ids: 1 at image tokens (transformers' M-RoPE needs it)
        theirs = source(input_ids=torch.tensor(ids),
                        mm_token_type_ids=torch.tensor((ids == model.config.image_token_id).astype(np.int64)),
                        pixel_values=torch.tensor(np.array(inputs["pixel_values"].astype(mx.float32))),
                        image_grid_thw=torch.tensor(np.array(inputs["image_grid_thw"]))).logits
    assert (np.array(inputs["input_ids"]) == model.config.image_token_id).sum() == 4  # the image is in the prompt
    np.testing.assert_allclose(np.array(ours.astype(mx.float32)), theirs.numpy(), atol=2e-4, rtol=1e-3)
    record = json.loads((tiny_vlm_dir / "mlx_grpo_convert.json").read_text())
    assert record["vlm"] == "qwen2_vl" and record["quantize"] is False


def test_quantized_conversion_loads_and_generates(tiny_vlm_hf_dir, tmp_path, capsys):
    out = tmp_path / "q4"
    assert main(["convert", "--hf-path", str(tiny_vlm_hf_dir), "--output-dir", str(out), "-q", "--bits", "4",
                 "--group-size", "32"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"]["bits"] == 4
    from mlx.utils import tree_flatten
    from mlx_vlm import load

    params = dict(tree_flatten(load(str(out))[0].parameters()))
    assert any(k.startswith("language_model.") and k.endswith(".scales") for k in params)
    assert not any(k.startswith("vision_tower.") and k.endswith(".scales") for k in params)  # tower stays float
    capsys.readouterr()
    image = _red_png(tmp_path / "red.png")
    assert main(["generate", "--model", str(out), "--image", str(image), "--prompt", "colour?", "--max-tokens",
                 "4", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.endswith("\n")


def test_generate_with_images_streams_the_same_text(tiny_vlm_dir, tmp_path, capsys):
    image = _red_png(tmp_path / "red.png")
    args = ["generate", "--model", str(tiny_vlm_dir), "--image", str(image), "--image", str(image), "--prompt",
            "Name the colour.", "--max-tokens", "6", "--temperature", "0"]
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert main(args + ["--stream"]) == 0
    assert capsys.readouterr().out == plain


def test_chat_with_an_image(tiny_vlm_dir, tmp_path):
    from mlx_grpo.config import build_config
    from mlx_grpo.commands.vision_inference import run_chat_images

    cfg = build_config("chat", None, [("model_name", str(tiny_vlm_dir)), ("max_new_tokens", "3"),
                                      ("temperature", "0")])
    history = run_chat_images(cfg, [str(_red_png(tmp_path / "red.png"))], lines=["what is it?", "and now?"],
                              out=open(tmp_path / "out.txt", "w"))
    assert [m["role"] for m in history] == ["user", "assistant", "user", "assistant"]
    assert history[0]["content"][0] == {"type": "image"} and history[2]["content"][0]["type"] == "text"


@pytest.mark.parametrize("case", ["missing", "unreadable"])
def test_bad_image_is_one_line(tiny_vlm_dir, tmp_path, capsys, case):
    image = tmp_path / "a.png"
    if case == "unreadable":
        image.write_text("not a png")
    assert main(["generate", "--model", str(tiny_vlm_dir), "--image", str(image), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(image) in err[0]
    assert ("not found" if case == "missing" else "unreadable") in err[0]


def test_bad_vlm_sources_are_one_line(tiny_vlm_hf_dir, tmp_path, capsys):
    def convert_error(source):
        capsys.readouterr()
        assert main(["convert", "--hf-path", str(source), "--output-dir", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and not (tmp_path / "out").exists()
        return err[0]

    no_processor = tmp_path / "no-processor"
    shutil.copytree(tiny_vlm_hf_dir, no_processor)
    (no_processor / "preprocessor_config.json").unlink()
    assert "image processor" in convert_error(no_processor)
    unknown = tmp_path / "unknown"
    shutil.copytree(tiny_vlm_hf_dir, unknown)
    config = json.loads((unknown / "config.json").read_text())
    (unknown / "config.json").write_text(json.dumps({**config, "model_type": "no_such_vlm"}))
    assert "no_such_vlm" in convert_error(unknown)
    capsys.readouterr()
    image = _red_png(tmp_path / "red.png")
    assert main(["generate", "--model", str(tiny_vlm_hf_dir.parent / "nope"), "--image", str(image),
                 "--prompt", "hi"]) == 2
    assert "not a vision-language model" in capsys.readouterr().err
