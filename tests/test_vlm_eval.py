"""`mlx-grpo eval` on image data sets (commands/vision_eval.py): it answers as the in-run evaluation does, its output
records name the images, a trained checkpoint (lora or full) evaluates, and a text model given image_column
or a VLM without it is one line, exit 2."""

from __future__ import annotations

import json

import pytest

from mlx_grpo.commands.cli import main

pytest.importorskip("mlx_vlm")

from test_vlm_grpo import vlm_cfg  # noqa: E402

SMALL = ["--set", "eval_subset_size=3", "--set", "eval_max_new_tokens=4", "--set", "eval_batch_size=2"]


def _train_cfg(model_dir, tmp_path, **over):
    """test_vlm_grpo's run config, smaller: 2 prompts x 2 samples, a large step."""
    return vlm_cfg(model_dir, tmp_path, **{"num_generations": 2, "max_train_samples": 2, "learning_rate": 1e-2,
                                           **over})


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_eval_answers_as_the_in_run_evaluation_and_names_the_images(tiny_vlm_dir, tmp_path, capsys):
    from mlx_grpo.commands.assembly import build_job
    from mlx_grpo.data.examples import subset
    from mlx_grpo.data.sources import run_examples

    out = tmp_path / "e.jsonl"
    assert main(["eval", "--model", str(tiny_vlm_dir), "--set", "dataset=shapes", "--set", "image_column=image",
                 "-o", str(out), *SMALL]) == 0
    printed = capsys.readouterr().out
    rows = _rows(out)
    assert len(rows) == 3 and all(r["images"][0].startswith("shapes/test/") for r in rows)
    assert f"accuracy: 0.0000 (0/3)  lenient: 0.0000  formatted: 0.0000" in printed  # text eval's summary line
    cfg = _train_cfg(tiny_vlm_dir, tmp_path, eval_subset_size=3, eval_max_new_tokens=4, eval_batch_size=2)
    job = build_job(cfg)
    examples = subset(run_examples(cfg, "test"), 3, cfg.run.seed)
    inrun = job.answer(job.model, job.tokenizer, examples, cfg, max_new_tokens=4,
                                   system_prompt=job.eval_prompt.system)
    assert [r["completions"] for r in inrun] == [r["completions"] for r in rows]  # the same greedy answers
    assert [r["images"] for r in inrun] == [r["images"] for r in rows]
    assert any(r["completions"][0] for r in rows)  # something was decoded (the comparison is not of empties)


@pytest.mark.parametrize("train_type", ["lora", "full"])
def test_eval_of_a_trained_checkpoint_on_a_data_file(tiny_vlm_dir, tmp_path, monkeypatch, capsys, train_type):
    from PIL import Image

    from mlx_grpo.commands.train import train

    monkeypatch.chdir(tmp_path)
    run_dir = train(_train_cfg(tiny_vlm_dir, tmp_path, train_type=train_type, run_name=train_type))
    for name, colour in [("red.png", "red"), ("blue.png", "blue")]:
        Image.new("RGB", (56, 56), colour).save(tmp_path / name)
    data = tmp_path / "pics.jsonl"
    data.write_text("".join(json.dumps({"question": f"What colour is {n}?", "answer": "1", "picture": n}) + "\n"
                            for n in ("red.png", "blue.png")))
    out = tmp_path / "pics-eval.jsonl"
    code = main(["eval", "--model", str(run_dir / "checkpoint-1"), "--set", "image_column=picture",
                 "--set", f"eval_dataset_path={data}", "-o", str(out), *SMALL])
    assert code == 0, capsys.readouterr().err
    rows = _rows(out)
    assert sorted(r["images"][0] for r in rows) == ["blue.png", "red.png"]
    assert "accuracy:" in capsys.readouterr().out


def test_text_model_with_image_column_and_vlm_without_it_are_one_line(tiny_model_dir, tiny_vlm_dir, capsys):
    assert main(["eval", "--model", str(tiny_model_dir), "--set", "image_column=image", *SMALL]) == 2
    err = capsys.readouterr().err.strip()
    assert "needs a vision-language model" in err and len(err.splitlines()) == 1
    assert main(["eval", "--model", str(tiny_vlm_dir), "--set", "dataset=shapes", *SMALL]) == 2
    err = capsys.readouterr().err.strip()
    assert "set image_column" in err and len(err.splitlines()) == 1
