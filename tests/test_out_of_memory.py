"""A failed device allocation ends a command with one line saying where and what to lower (exit 2, as a full
disk does), not a traceback; checkpoints written before it stay usable. Any other crash of train/sft (a GPU
fault, a bug) keeps its traceback and then says which checkpoint --resume continues from."""

import json
from pathlib import Path

import pytest

from mlx_grpo.base.errors import out_of_memory
from mlx_grpo.commands.cli import main
from mlx_grpo.rollout import engine

CUDA_OOM = "cudaMallocAsync(&data, size, stream) failed: out of memory"


def raised_in(filenames: list[str], message: str, kind: type = RuntimeError) -> BaseException:
    """An exception whose traceback passes through functions defined in `filenames` (outermost first)."""
    namespace: dict = {"kind": kind, "message": message}
    inner = "def f0():\n    raise kind(message)\n"
    exec(compile(inner, filenames[-1], "exec"), namespace)
    for i, name in enumerate(reversed(filenames[:-1]), start=1):
        exec(compile(f"def f{i}():\n    f{i - 1}()\n", name, "exec"), namespace)
    try:
        namespace[f"f{len(filenames) - 1}"]()
    except kind as exc:
        return exc
    raise AssertionError("nothing raised")


def test_the_phase_comes_from_the_traceback():
    root = "/site-packages/mlx_grpo"
    rollouts = raised_in([f"{root}/commands/train.py", f"{root}/training/sampling.py", f"{root}/rollout/engine.py"],
                         CUDA_OOM)
    assert out_of_memory(rollouts, "train") == (
        f"out of device memory while sampling rollouts ({CUDA_OOM}): lower batch_size x num_generations, "
        "max_new_tokens or max_prompt_length, or stop other processes using the GPU.")
    # --resume refuses those settings changed: the same settings resume (the GPU freed); lowering them is a new
    # run from the checkpoint, under another run_name (the run directory holds checkpoints already)
    assert out_of_memory(rollouts, "train", Path("/r/grpo/checkpoint-8")).endswith(
        " checkpoint-8 is intact: --resume /r/grpo/checkpoint-8 continues from it with the same settings; lowering "
        "those needs a new run from it (fresh optimizer, schedule and data order): "
        "rerun with --set model_name=/r/grpo/checkpoint-8 --set run_name=grpo-from-checkpoint-8.")
    # the CLI says how a new run starts from the checkpoint (an adapter one: merged first; tests/test_hints.py)
    assert out_of_memory(rollouts, "train", Path("/r/grpo/checkpoint-8"), "merge it first: mlx-grpo fuse ...").endswith(
        "(fresh optimizer, schedule and data order): merge it first: mlx-grpo fuse ... --set "
        "run_name=grpo-from-checkpoint-8.")
    # vision-language rollouts decode in vlm/image_rollout.py, under training/sampling.py
    vlm = raised_in([f"{root}/training/sampling.py", f"{root}/vlm/image_prompts.py", f"{root}/vlm/image_rollout.py"],
                    CUDA_OOM)
    assert "while sampling rollouts" in out_of_memory(vlm, "train")
    # an evaluation decodes through rollout/ too: its own settings are the ones to lower
    evaluation = raised_in([f"{root}/commands/train.py", f"{root}/commands/evaluate.py", f"{root}/rollout/engine.py"],
                           CUDA_OOM)
    line = out_of_memory(evaluation, "train", Path("/r/grpo/checkpoint-8"))
    assert line.startswith("out of device memory while evaluating") and "eval_batch_size" in line
    assert line.endswith("checkpoint-8 is intact: --resume /r/grpo/checkpoint-8 continues from it with those changed.")
    assert "--resume" not in out_of_memory(evaluation, "eval", Path("/r/grpo/checkpoint-8"))  # eval resumes nothing
    backward = raised_in([f"{root}/commands/train.py", f"{root}/training/optimization.py", "/mlx/nn/layers.py"],
                         "[malloc] Unable to allocate 1073741824 bytes.")
    line = out_of_memory(backward, "sft", Path("/r/sft/checkpoint-3"))
    assert "in the training pass" in line and "micro_batch_tokens" in line and "continues from it" in line
    # the ranks' collectives (training/distributed.py) name no phase: their callers do
    gathered = raised_in([f"{root}/commands/train.py", f"{root}/training/distributed.py"], CUDA_OOM)
    assert out_of_memory(gathered, "train").startswith(f"out of device memory ({CUDA_OOM}): lower batch_size")
    # outside our frames (a user's reward function, say): no phase, the general settings; perhaps host memory
    elsewhere = raised_in(["/home/me/reward.py"], "", MemoryError)
    assert out_of_memory(elsewhere, "train").startswith("out of memory (MemoryError): lower batch_size")
    assert out_of_memory(raised_in([f"{root}/rollout/engine.py"], CUDA_OOM), "generate").startswith(
        f"out of device memory while sampling rollouts ({CUDA_OOM}): lower --batch-size or max_new_tokens")
    assert ": lower max_new_tokens," in out_of_memory(raised_in([f"{root}/commands/inference.py"], CUDA_OOM), "chat")
    assert ": lower micro_batch_size" in out_of_memory(raised_in([f"{root}/commands/sft.py"], CUDA_OOM), "sft")


def test_other_errors_are_not_memory():
    assert out_of_memory(raised_in(["/x/mlx_grpo/rollout/engine.py"], "shape mismatch"), "train") is None
    assert out_of_memory(ValueError("out of range"), "train") is None
    # the words inside another error's message (a completion quoted, say) are not the backend's form
    quoted = raised_in(["/x/mlx_grpo/rollout/multiturn.py"], "no stop string in 'the cudaMalloc() failed: out of "
                                                              "memory, so [metal::malloc] Unable to allocate'")
    assert out_of_memory(quoted, "train") is None
    assert out_of_memory(RuntimeError("[malloc] Unable to allocate 64 bytes."), "train") is not None
    assert out_of_memory(RuntimeError("[metal::malloc] Resource limit (499000) exceeded."), "train") is not None
    assert out_of_memory(RuntimeError("[METAL] Command buffer execution failed: Insufficient Memory "
                                      "(00000008:kIOGPUCommandBufferCallbackErrorOutOfMemory)"), "train") is not None


def failing_from_update_2(model_dir, tmp_path, monkeypatch, message: str,
                          before_fault=lambda: None) -> tuple[list[str], list, object]:
    """A tiny train command (4 problems, 2 per update) whose rollouts raise RuntimeError(message) from the
    second call on, before_fault() called first: -> (its arguments, the calls made, which .clear() restarts,
    the real decode)."""
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"problem": f"What is {i} + 1?", "solution": f"\\boxed{{{i + 1}}}"}) + "\n"
                            for i in range(4)))
    decode, calls = engine.generate_rollout, []

    def decode_until_update_2(*a, **k):
        calls.append(1)
        if len(calls) > 1:
            before_fault()
            raise RuntimeError(message)
        return decode(*a, **k)

    monkeypatch.setattr(engine, "generate_rollout", decode_until_update_2)
    return (["train", "--model", str(model_dir), "--dataset", str(data), "--output-dir", str(tmp_path),
             "--batch-size", "2", "--num-generations", "2", "--max-new-tokens", "4"], calls, decode)


def test_a_run_that_runs_out_of_memory_says_one_line_and_resumes(tiny_model_dir, tmp_path, monkeypatch, capsys):
    # update 2's rollouts fail as the GPU's allocator does
    args, _, decode = failing_from_update_2(tiny_model_dir, tmp_path, monkeypatch, CUDA_OOM)
    args += ["--set", "save_steps=1"]
    run_dir: Path = tmp_path / "grpo"
    assert main(args) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert err[-1].startswith("mlx-grpo train: error: out of device memory while sampling rollouts (cudaMalloc")
    assert err[-1].endswith(f"rerun with --set model_name={run_dir / 'checkpoint-1'} --set "
                            "run_name=grpo-from-checkpoint-1.")
    assert not any("Traceback" in line for line in err)
    assert (run_dir / "checkpoint-1").is_dir() and not (run_dir / "checkpoint-2").exists()
    monkeypatch.setattr(engine, "generate_rollout", decode)  # the GPU freed: the same settings resume
    assert main(args + ["--resume"]) == 0
    steps = [json.loads(line)["update_step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
             if '"update_step"' in line]
    assert steps[0] == 1 and steps[-1] == 2


def test_out_of_memory_before_any_checkpoint_names_no_resume(tiny_model_dir, tmp_path, monkeypatch, capsys):
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"problem": "What is 1 + 1?", "solution": "\\boxed{2}"}) + "\n")
    monkeypatch.setattr(engine, "generate_rollout", lambda *a, **k: (_ for _ in ()).throw(RuntimeError(CUDA_OOM)))
    assert main(["train", "--model", str(tiny_model_dir), "--dataset", str(data), "--output-dir", str(tmp_path),
                 "--batch-size", "1", "--num-generations", "2", "--max-new-tokens", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith("or stop other processes using the GPU."), err[-1]  # nothing to --resume


GPU_FAULT = "cudaGetLastError() failed: unspecified launch failure"


def test_a_gpu_fault_keeps_its_traceback_and_says_where_the_run_resumes(tiny_model_dir, tmp_path, monkeypatch,
                                                                        capsys):
    # update 2's rollouts die as the H100 run of 2026-11-25 did
    args, calls, _ = failing_from_update_2(tiny_model_dir, tmp_path, monkeypatch, GPU_FAULT)
    assert main(args + ["--set", "save_steps=1"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and GPU_FAULT in err  # not a user error: where it failed stays on screen
    checkpoint = tmp_path / "grpo" / "checkpoint-1"
    assert err.strip().splitlines()[-1] == (f"mlx-grpo train: crashed (the traceback above says where); {checkpoint} "
                                            f"is intact: the command with --resume {checkpoint} continues from it.")
    calls.clear()
    monkeypatch.setenv("MLX_RANK", "1")  # another rank of a launched run: rank 0 owns the directory and the line
    assert main(args + ["--set", "save_steps=1", "--set", "run_name=rank1"]) == 1
    assert "crashed" not in capsys.readouterr().err
    monkeypatch.delenv("MLX_RANK")
    calls.clear()
    assert main(args + ["--set", "save_steps=0", "--set", "run_name=other"]) == 1  # nothing saved before the end
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        "no checkpoint of this run was written (save_steps = 0: only at the end): a rerun starts over.")
    # other commands resume nothing: the traceback alone
    data = tmp_path / "train.jsonl"
    assert main(["eval", "--model", str(tiny_model_dir), "--dataset", str(data), "--samples", "2", "--output",
                 str(tmp_path / "eval.jsonl")]) == 1
    err = capsys.readouterr().err
    assert GPU_FAULT in err and "crashed" not in err and "--resume" not in err


@pytest.mark.parametrize("message", [GPU_FAULT, CUDA_OOM])
def test_a_crash_after_a_resume_elsewhere_names_the_resumed_checkpoint(tiny_model_dir, tmp_path, monkeypatch,
                                                                        capsys, message):
    """Resumed from another directory into one that holds an older run's lower checkpoint, a crash (or a
    failed allocation) before the next save names the checkpoint resumed from (checkpoint.resume_point), not
    the older run's newest."""
    args, _, decode = failing_from_update_2(tiny_model_dir, tmp_path, monkeypatch, GPU_FAULT)
    save = ["--set", "save_steps=1", "--set", "num_epochs=2"]
    assert main(args + save) == 1  # grpo/checkpoint-1, then a fault at update 2
    monkeypatch.setattr(engine, "generate_rollout", decode)
    assert main(args + save + ["--set", "run_name=elsewhere"]) == 0  # its checkpoints 1-4
    resumed = tmp_path / "elsewhere" / "checkpoint-2"
    assert resumed.is_dir()
    _, calls, _ = failing_from_update_2(tiny_model_dir, tmp_path, monkeypatch, message)
    calls.append(1)  # the next rollout, update 3's, faults
    capsys.readouterr()
    assert main(args + save + ["--resume", str(resumed)]) == (1 if message == GPU_FAULT else 2)
    assert (tmp_path / "grpo" / "checkpoint-1").is_dir()
    last = capsys.readouterr().err.strip().splitlines()[-1]
    if message == GPU_FAULT:
        assert last == (f"mlx-grpo train: crashed (the traceback above says where); {resumed} is intact: the "
                        f"command with --resume {resumed} continues from it.")
    else:
        assert last.startswith("mlx-grpo train: error: out of device memory") and f"--resume {resumed}" in last
        assert "checkpoint-1" not in last


def test_a_crash_beside_a_lost_mount_says_resume_latest(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """The run directory cannot be listed when the crash line is written (the mount went with the GPU): the
    line still says where the run continues, as a failed save's line does: --resume latest, or the explicit
    checkpoint resumed from."""
    import errno

    from mlx_grpo.storage import checkpoint as ckpt

    def gone(run_dir):
        raise OSError(errno.ENOTCONN, "Transport endpoint is not connected")

    def lose_the_mount():
        monkeypatch.setattr(ckpt, "list_checkpoints", gone)

    args, calls, _ = failing_from_update_2(tiny_model_dir, tmp_path, monkeypatch, GPU_FAULT, lose_the_mount)
    save = ["--set", "save_steps=1"]
    assert main(args + save) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "mlx-grpo train: crashed (the traceback above says where); the run directory cannot be read now: once it "
        "can, the command with --resume latest continues from its newest checkpoint.")
    monkeypatch.undo()  # the mount is back; resumed explicitly, the next crash names the checkpoint resumed
    first = tmp_path / "grpo" / "checkpoint-1"
    assert first.is_dir()
    args, calls, _ = failing_from_update_2(tiny_model_dir, tmp_path, monkeypatch, GPU_FAULT, lose_the_mount)
    calls.append(1)  # the next rollout faults
    assert main(args + save + ["--set", "run_name=second", "--resume", str(first)]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"mlx-grpo train: crashed (the traceback above says where); {first} is intact: the command with --resume "
        f"{first} continues from it.")


def test_a_crashed_warm_start_says_where_it_resumes(tiny_model_dir, tmp_path, monkeypatch, capsys):
    from mlx_grpo.sft.steps import SFTTrainer

    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?", "completion": f"{i + 1}"}) + "\n"
                            for i in range(8)))
    update, calls = SFTTrainer.update, []

    def fault_at_update_3(self, rows):
        calls.append(1)
        if len(calls) > 2:
            raise RuntimeError(GPU_FAULT)
        return update(self, rows)

    monkeypatch.setattr(SFTTrainer, "update", fault_at_update_3)
    args = ["sft", "--model", str(tiny_model_dir), "--dataset-path", str(data), "--output-dir", str(tmp_path),
            "--batch-size", "2", "--set", "save_steps=2"]
    assert main(args) == 1
    checkpoint = tmp_path / "sft" / "checkpoint-2"
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        f"{checkpoint} is intact: the command with --resume {checkpoint} continues from it.")
    monkeypatch.setattr(SFTTrainer, "update", update)
    assert main(args + ["--resume", str(checkpoint)]) == 0
