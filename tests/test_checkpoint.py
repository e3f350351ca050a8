"""Checkpoint writing: durable stage-then-rename, replacement that never removes the old copy first,
recovery after a hard kill, umask, save_total_limit."""

import json
import os
import re
from pathlib import Path

import pytest

from mlx_grpo.base.errors import UserError
from mlx_grpo.commands import train as run_mod
from mlx_grpo.config import build_config, parse_set
from mlx_grpo.models.writing import recover_staged, staged_output


def test_staged_output_replaces_only_after_the_new_copy_is_written(tmp_path):
    out = tmp_path / "checkpoint-2"
    with staged_output(out) as tmp:
        (tmp / "a").write_text("old")
    with pytest.raises(UserError, match="already exists"):
        with staged_output(out):
            pass
    with pytest.raises(RuntimeError):
        with staged_output(out, replace=True) as tmp:
            (tmp / "a").write_text("half")
            raise RuntimeError("killed mid-write")
    assert (out / "a").read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2"]
    with staged_output(out, replace=True) as tmp:
        (tmp / "a").write_text("new")
    assert (out / "a").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2"]


def test_published_directories_follow_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        with staged_output(tmp_path / "m") as tmp:
            (tmp / "w").write_text("x")
    finally:
        os.umask(old)
    assert (tmp_path / "m").stat().st_mode & 0o777 == 0o755


def test_recovery_after_a_kill_restores_the_moved_aside_copy_and_drops_temporaries(tmp_path):
    # killed between moving checkpoint-8 aside and renaming its replacement in
    (tmp_path / ".old-checkpoint-8-abc123").mkdir()
    (tmp_path / ".old-checkpoint-8-abc123" / "trainer_state.json").write_text("{}")
    (tmp_path / ".tmp-checkpoint-abc123").mkdir()
    (tmp_path / ".tmp-checkpoint-zzz").mkdir()
    done = recover_staged(tmp_path, ".tmp-checkpoint-")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-8"]
    assert (tmp_path / "checkpoint-8" / "trainer_state.json").is_file()
    assert any("restored checkpoint-8" in d for d in done) and sum("unfinished" in d for d in done) == 2


def test_save_total_limit_keeps_the_newest_and_stale_temporaries_are_cleaned(tiny_model_dir, tmp_path, capsys):
    items = [f"model_name={tiny_model_dir}", f"output_dir={tmp_path}", "batch_size=2", "num_generations=4",
             "max_new_tokens=8", "max_train_samples=8", "learning_rate=1e-3", "log_completions_steps=0",
             "max_prompt_length=96", "system_prompt=", "save_steps=1", "save_total_limit=2"]
    run_dir = tmp_path / "grpo"
    run_dir.mkdir()
    (run_dir / ".tmp-checkpoint-dead").mkdir()  # left by a run killed while saving
    run = run_mod.train(build_config("train", overrides=parse_set(items)))
    assert sorted(p.name for p in Path(run).iterdir() if p.name.startswith(("checkpoint-", ".tmp", ".old"))) == \
        ["checkpoint-3", "checkpoint-4"]
    assert "removed the unfinished .tmp-checkpoint-dead" in capsys.readouterr().out


def _items(model_dir, out, *extra):
    return [f"model_name={model_dir}", f"output_dir={out}", "batch_size=2", "num_generations=4",
            "max_new_tokens=8", "max_train_samples=8", "learning_rate=1e-3", "log_completions_steps=0",
            "max_prompt_length=96", "system_prompt=", "save_steps=1", *extra]


def _cfg(*items):
    return build_config("train", overrides=parse_set(list(items)))


def test_resume_checks_what_it_resumes(tiny_model_dir, tmp_path, capsys):
    run = Path(run_mod.train(_cfg(*_items(tiny_model_dir, tmp_path))))
    assert [p.name for p in sorted(run.glob("checkpoint-*"))] == [f"checkpoint-{i}" for i in range(1, 5)]
    # a change that alters the run's math is refused, naming the field; logging may change
    with pytest.raises(UserError, match=r"learning_rate \(0.001 -> 0.002\)"):
        run_mod.train(_cfg(*_items(tiny_model_dir, tmp_path, "learning_rate=2e-3")), resume="latest")
    # the newest checkpoint is unreadable: latest skips it, says so, and resumes the one before
    (run / "checkpoint-4" / "model.safetensors").write_bytes(b"not a safetensors file")
    run_mod.train(_cfg(*_items(tiny_model_dir, tmp_path, "logging_steps=2")), resume="latest")
    out = capsys.readouterr().out
    assert "skipping checkpoint-4, which cannot be read" in out and "resumed from" in out
    # an explicit broken checkpoint is one line
    (run / "checkpoint-2" / "optimizer.safetensors").write_bytes(b"")
    with pytest.raises(UserError, match=r"checkpoint-2 cannot be read"):
        run_mod.train(_cfg(*_items(tiny_model_dir, tmp_path)), resume=str(run / "checkpoint-2"))
    # resuming an older checkpoint sets the later ones aside: a later plain --resume cannot jump back
    run_mod.train(_cfg(*_items(tiny_model_dir, tmp_path)), resume=str(run / "checkpoint-1"))
    out = capsys.readouterr().out
    assert "abandoned-checkpoint-3: a checkpoint after the resumed one" in out
    # (the unreadable checkpoint-4 was set aside by the first resume, its redone successor by this one)
    assert sorted(p.name for p in run.glob("abandoned-*")) == ["abandoned-checkpoint-2", "abandoned-checkpoint-3",
                                                               "abandoned-checkpoint-4", "abandoned-checkpoint-4.2"]
    assert sorted(p.name for p in run.glob("checkpoint-*")) == [f"checkpoint-{i}" for i in range(1, 5)]


def test_resume_with_another_model_is_one_line(tiny_model_dir, tmp_path):
    from conftest import write_tiny_model

    other = write_tiny_model(tmp_path / "wider", hidden=48)
    run = Path(run_mod.train(_cfg(*_items(tiny_model_dir, tmp_path, "max_train_samples=2"))))
    with pytest.raises(UserError, match=r"model_name") as info:
        run_mod.train(_cfg(*_items(other, tmp_path, "max_train_samples=2")), resume=str(run / "checkpoint-1"))
    # short, not mlx's list of every tensor (the paths aside: the line names the checkpoint in its resume command)
    line = str(info.value).replace(str(run), "RUN").replace(str(other), "M").replace(str(tiny_model_dir), "M")
    assert "\n" not in line and len(line) < 400


def test_one_run_per_run_directory_and_a_fresh_start_moves_old_logs_aside(tiny_model_dir, tmp_path, capsys):
    import fcntl

    run_dir = tmp_path / "grpo"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"update_step": 1}\n')  # an earlier run killed before a checkpoint
    with open(run_dir / ".lock", "a+") as held:  # another run holds the directory
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(UserError, match="is in use by another mlx-grpo run"):
            run_mod.train(_cfg(*_items(tiny_model_dir, tmp_path, "max_train_samples=2")))
    run = Path(run_mod.train(_cfg(*_items(tiny_model_dir, tmp_path, "max_train_samples=2"))))
    assert "held the logs of an earlier run without a checkpoint" in capsys.readouterr().out
    assert (run / "previous-1" / "metrics.jsonl").read_text() == '{"update_step": 1}\n'
    steps = [line for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 1  # the new run's own update only


def test_an_output_dir_that_is_a_file_is_one_line(tiny_model_dir, tmp_path):
    (tmp_path / "taken").write_text("a file")
    with pytest.raises(UserError, match=r"cannot use the run directory .*taken/grpo"):
        run_mod.train(_cfg(*_items(tiny_model_dir, tmp_path / "taken", "max_train_samples=2")))


def test_sequences_longer_than_the_context_window_are_said_once(tiny_model_dir, tmp_path, capsys):
    """The tiny model's copy with a context window of 128 positions (its config's max_position_embeddings, as
    a real model's 2048): prompts of ~150 tokens exceed it, as ~3,000 would the 2048 (a run ~100x longer)."""
    import json
    import shutil

    model = Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 128}))
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps({"prompt": "x " * 60 + str(i), "answer": "1"}) + "\n" for i in range(4)))
    run_mod.train(_cfg(*_items(model, tmp_path, f"dataset_path={data}", "max_prompt_length=400",
                               "max_new_tokens=8", "max_train_samples=4")))
    out = capsys.readouterr().out
    assert out.count("exceed") == 1 and "context window of 128 tokens" in out
    # the same prompts cut to fit: no word
    run_mod.train(_cfg(*_items(model, tmp_path, f"dataset_path={data}", "max_prompt_length=120",
                               "max_new_tokens=8", "max_train_samples=2", "run_name=fits")))
    assert "exceed" not in capsys.readouterr().out


def test_a_checkpoint_that_cannot_be_written_is_one_line(tiny_model_dir, tmp_path, monkeypatch):
    """A full disk while saving: the staged copy is removed, earlier checkpoints stay, one line."""
    import errno

    from mlx_grpo.storage import checkpoint as ckpt

    real = ckpt.mx.save_safetensors
    calls = {"n": 0}

    def full_disk(path, *args, **kwargs):
        calls["n"] += 1
        if "checkpoint" in str(path) and calls["n"] > 2:  # the first checkpoint (model, optimizer) is written
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(ckpt.mx, "save_safetensors", full_disk)
    run = tmp_path / "grpo"
    newest = run / "checkpoint-1"
    with pytest.raises(UserError, match=r"saving checkpoint-2 in .* failed: No space left on device; .*checkpoint-1 is "
                       r"intact: once there is room, the command with --resume .*checkpoint-1 continues from it$") \
            as caught:
        run_mod.train(_cfg(*_items(tiny_model_dir, tmp_path)))
    assert f"--resume {newest} continues" in str(caught.value)
    assert sorted(p.name for p in run.iterdir() if "checkpoint" in p.name) == ["checkpoint-1"]


def test_a_grpo_save_failing_after_a_resume_elsewhere_names_the_resumed_checkpoint(tiny_model_dir, tmp_path,
                                                                                     monkeypatch):
    import errno

    from mlx_grpo.storage import checkpoint as ckpt

    first = Path(run_mod.train(_cfg(*_items(tiny_model_dir, tmp_path)))) / "checkpoint-2"

    def full_disk(path, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", path)

    monkeypatch.setattr(ckpt.mx, "save_safetensors", full_disk)
    with pytest.raises(UserError, match=rf"saving checkpoint-3 in .*again failed: No space left on device; "
                       rf"{re.escape(str(first))} is intact: once there is room"):
        run_mod.train(_cfg(*_items(tiny_model_dir, tmp_path, "run_name=again")), resume=str(first))


def test_a_first_checkpoint_that_cannot_be_written_says_a_rerun_starts_over(tmp_path):
    """Nothing of the run on disk yet: the line does not point at a checkpoint to resume."""
    import errno

    from mlx_grpo.storage import checkpoint as ckpt

    with pytest.raises(UserError, match=r"saving checkpoint-1 in .* failed: No space left on device; no checkpoint of "
                       r"this run exists yet: once there is room, a rerun starts over$"):
        with ckpt.write_failures_as_one_line(tmp_path, 1):
            raise OSError(errno.ENOSPC, "No space left on device")


def test_a_failed_save_after_a_resume_points_back_to_what_was_resumed(tmp_path):
    """Resumed from another directory into one holding an older run's checkpoints (at and below the resumed
    update; a resume sets aside later ones): the line names the resumed checkpoint until this session writes a
    later one. A lost mount is not told to make room; MLX's writer error may be either."""
    import errno

    from mlx_grpo.storage import checkpoint as ckpt

    elsewhere, run = tmp_path / "a" / "checkpoint-4", tmp_path / "b"

    def written(step: int) -> Path:
        (run / f"checkpoint-{step}").mkdir(parents=True)
        (run / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
        return run / f"checkpoint-{step}"

    written(1), written(4)  # the older run's
    at = re.escape(str(elsewhere))
    with pytest.raises(UserError, match=rf"Input/output error; {at} is intact: once the disk can be written again, "
                       rf"the command with --resume {at} continues from it$"):
        with ckpt.write_failures_as_one_line(run, 5, (elsewhere, 4)):
            raise OSError(errno.EIO, "Input/output error")
    six = re.escape(str(written(6)))  # this session's
    with pytest.raises(UserError, match=rf"failed: \[write\] Unable to write 3859 bytes to file\.; {six} is intact: "
                       rf"once there is room \(or the disk can be written again\), the command with --resume {six} "
                       "continues from it$"):
        with ckpt.write_failures_as_one_line(run, 7, (elsewhere, 4)):
            raise RuntimeError("\n[write] Unable to write 3859 bytes to file.\nmore detail")


def test_a_failed_save_on_a_lost_mount_or_a_device_fault(tmp_path, monkeypatch):
    """The directory cannot be listed: still one line, pointing at the resumed checkpoint or at --resume latest.
    A RuntimeError that is not MLX's writer (a GPU fault, out of memory) is not called a disk problem."""
    import errno

    from mlx_grpo.storage import checkpoint as ckpt

    def gone(run_dir):
        raise OSError(errno.ENOTCONN, "Transport endpoint is not connected")

    monkeypatch.setattr(ckpt, "list_checkpoints", gone)
    with pytest.raises(UserError, match=r"not connected; the run directory cannot be read now: once the disk can be "
                       r"written again, the command with --resume latest continues from its newest checkpoint$"):
        with ckpt.write_failures_as_one_line(tmp_path, 3):
            raise OSError(errno.ENOTCONN, "Transport endpoint is not connected")
    with pytest.raises(UserError, match=rf"{re.escape(str(tmp_path / 'x'))} is intact"):
        with ckpt.write_failures_as_one_line(tmp_path, 3, (tmp_path / "x", 2)):
            raise OSError(errno.ENOTCONN, "Transport endpoint is not connected")
    with pytest.raises(RuntimeError, match="cudaGetLastError"):
        with ckpt.write_failures_as_one_line(tmp_path, 3):
            raise RuntimeError("cudaGetLastError() failed: unspecified launch failure")


def test_a_rollout_too_large_for_the_machine_is_refused_up_front(tiny_model_dir, tmp_path):
    with pytest.raises(UserError, match=r"400000 rollout rows .* need at least .* GB .* more than this machine's"):
        run_mod.train(_cfg(*_items(tiny_model_dir, tmp_path, "batch_size=4", "num_generations=100000",
                                   "max_new_tokens=1000")))


def test_the_running_rows_count_up_front_where_a_decode_holds_them(tiny_model_dir, tmp_path, monkeypatch):
    """The memory check counts the widest batch the sampling copy can hold: the rows it starts with (running_rows
    of the batch steps one decode holds: an update's accumulated steps, or dynamic sampling's pass of draws;
    one step's rows without it, per rank), padded to a power of two by a refill that rebuilds the batch while
    rows wait for a slot (later prompts, tool turns); a batch with none waiting only shrinks."""
    import mlx.core as mx

    from mlx_grpo.commands import assembly
    from mlx_grpo.models import decoder
    from mlx_grpo.models.model_loading import load_model
    from mlx_grpo.rollout.decode import rollout_memory_bytes
    from mlx_grpo.training.distributed import World

    model = load_model(str(tiny_model_dir), "float32")[0]

    def room(rows: int) -> None:  # the machine holds `rows` rows of the tests' prompts and completions, no more
        # (on a CPU the copy's step writes a new cache each step: 2x; copy_decoder.cache_copies)
        need = rollout_memory_bytes(model, rows, 96 + 8, 2.0) + decoder.copy_bytes(model, mx.float32)
        monkeypatch.setattr(assembly, "machine_memory_bytes", lambda: need)

    room(8)
    items = _items(tiny_model_dir, tmp_path, "rollout_engine=copy", "running_rows=24")
    assert assembly.build_job(_cfg(*items)).trainer.policies.engine.rows == 24  # one step a decode: 8 rows
    with pytest.raises(UserError, match=r"^32 rollout rows \(running_rows 24, 24 padded to a power of two, at least 8, "
                                        r"by a refill\) .* lower running_rows or max_new_tokens$"):
        assembly.build_job(_cfg(*items, "gradient_accumulation_steps=4"))  # 4 steps a decode: 24 rows, then 32
    # dynamic sampling: the draws of a pass (2 here, of the 1 + 3 an update may draw) start together
    sampled = ["dynamic_sampling=true", "max_resample_batches=3", "max_train_samples=16"]
    assembly.build_job(_cfg(*items, *sampled, "draws_per_pass=1"))
    with pytest.raises(UserError, match=r"^16 rollout rows \(running_rows 24\) "):
        assembly.build_job(_cfg(*items, *sampled, "draws_per_pass=2"))
    # without running_rows: one step's 6 rows, which only shrink; padded to 8 once rows wait for their slots
    room(6)
    copy = _items(tiny_model_dir, tmp_path, "rollout_engine=copy", "num_generations=3")
    assembly.build_job(_cfg(*copy))
    waiting = r"^8 rollout rows \(batch_size 2 x num_generations 3, 6 padded to a power of two, at least 8, by a refill\) "
    with pytest.raises(UserError, match=waiting + r".* lower num_generations, batch_size or max_new_tokens, or set "
                                                  r"rollout_engine = model$"):
        assembly.build_job(_cfg(*copy, "gradient_accumulation_steps=2"))  # the second step's prompts wait
    with pytest.raises(UserError, match=waiting):
        assembly.build_job(_cfg(*copy, "tools=[\"calculator\"]", "max_tool_turns=2"))  # next turns wait
    assembly.build_job(_cfg(*copy, "gradient_accumulation_steps=2", "rollout_engine=model"))  # decodes 6 rows a step
    # per rank: a rank decodes its share of the prompts (2 of 4 here: 8 rows)
    room(8)
    ranked = _items(tiny_model_dir, tmp_path, "rollout_engine=copy", "batch_size=4")
    assembly.build_job(_cfg(*ranked), World(size=2))
    with pytest.raises(UserError, match=r"^16 rollout rows \(batch_size 4 x num_generations 4\) "):
        assembly.build_job(_cfg(*ranked))


def test_the_copy_s_cache_copies_count_up_front(tiny_model_dir, tmp_path, monkeypatch):
    """The sampling copy holds more than one KV cache for a moment: each step, where no fused kernel writes the
    cache in place (a CPU here), writes a new one while the last step reads the old (2x); with the kernel, a
    refill that rebuilds the batch for waiting rows (here next turns) holds the old values beside the new keys
    (1.5x), a compaction the kept rows' keys beside the cache (1.25x at 16 rows, 1.33x at 24: a power of two
    of rows kept), nothing at 8 rows (never compacted). The model path keeps one."""
    import mlx.core as mx

    from mlx_grpo.commands import assembly
    from mlx_grpo.models import decoder
    from mlx_grpo.models.model_loading import load_model
    from mlx_grpo.rollout.decode import rollout_memory_bytes

    model = load_model(str(tiny_model_dir), "float32")[0]

    def room(rows: int, copies: float, engine_copy: bool = True) -> None:  # the tests' prompts and completions
        need = rollout_memory_bytes(model, rows, 96 + 8, copies) + (decoder.copy_bytes(model, mx.float32)
                                                                    if engine_copy else 0)
        monkeypatch.setattr(assembly, "machine_memory_bytes", lambda: need)

    def refused(items, why):
        with pytest.raises(UserError, match=r"^\d+ rollout rows .* their KV cache \(" + why + r"\) and logits"):
            assembly.build_job(_cfg(*items))

    plain = _items(tiny_model_dir, tmp_path, "rollout_engine=copy")  # 2 prompts x 4 samples
    turns = plain + ["tools=[\"calculator\"]", "max_tool_turns=2"]
    assert not decoder.steps_write_cache(model)  # no CUDA kernel here (nor one for its head size of 16)
    room(8, 1.5)
    refused(plain, r"2x as each step writes it anew")
    refused(turns, r"2x as each step writes it anew")  # the step's copy, not the refill's, bounds it
    with monkeypatch.context() as m:  # the fused kernel: served, and not for a RoPE it cannot take by angles
        m.setattr(decoder, "kernel_serves", lambda spec: True)
        assert decoder.steps_write_cache(model)
        m.setattr(decoder, "rope_angles", lambda rope, dim: None)
        assert not decoder.steps_write_cache(model)
    room(8, 2.0)
    assembly.build_job(_cfg(*plain))
    monkeypatch.setattr(decoder, "steps_write_cache", lambda m: True)  # as where the fused kernel serves
    room(8, 1.0)
    assembly.build_job(_cfg(*plain))  # 8 rows: never compacted
    refused(turns, r"1.5x while a refill rebuilds the batch")
    room(8, 1.5)
    assembly.build_job(_cfg(*turns))
    for batch, copies in ((4, "1.25"), (6, "1.33")):  # 16 rows keep 8 at most; 24 keep 16
        room(batch * 4, 1.0)
        refused(plain + [f"batch_size={batch}", "max_train_samples=24"], copies + r"x while the batch is compacted")
        room(batch * 4, float(copies) + 0.01)
        assembly.build_job(_cfg(*plain, f"batch_size={batch}", "max_train_samples=24"))
    room(8, 1.0, engine_copy=False)
    assembly.build_job(_cfg(*_items(tiny_model_dir, tmp_path, "rollout_engine=model", *turns[-2:])))


def test_the_rollout_process_s_copy_of_the_model_counts_up_front(tiny_model_dir, tmp_path, monkeypatch):
    """rollout_worker = process: the worker's copy of the model is part of what the machine must hold."""
    from mlx.utils import tree_flatten

    from mlx_grpo.commands import assembly
    from mlx_grpo.models.model_loading import load_model
    from mlx_grpo.rollout.decode import rollout_memory_bytes

    model = load_model(str(tiny_model_dir), "float32")[0]
    need = rollout_memory_bytes(model, 2 * 4, 96 + 8)  # batch_size x num_generations rows, prompt + new tokens
    weights = sum(w.nbytes for _, w in tree_flatten(model.parameters()))
    monkeypatch.setattr(assembly, "machine_memory_bytes", lambda: need + weights // 2)  # room for all but half of it
    items = _items(tiny_model_dir, tmp_path, "batch_size=2", "num_generations=4", "max_new_tokens=8",
                   "max_prompt_length=96", "rollout_engine=model", "async_rollouts=1",
                   "rollout_correction=token_truncate")
    assert assembly.build_job(_cfg(*items)).source.process is None  # the thread: it fits
    # the thread's engine decodes as the trainer's would (running_rows), on a machine with room for the copy
    import mlx.core as mx

    from mlx_grpo.models import decoder
    copy_need = rollout_memory_bytes(model, 8, 96 + 8, 2.0) + decoder.copy_bytes(model, mx.float32)
    monkeypatch.setattr(assembly, "machine_memory_bytes", lambda: copy_need)
    copy_items = [i for i in items if i != "rollout_engine=model"] + ["rollout_engine=copy", "running_rows=8"]
    assert assembly.build_job(_cfg(*copy_items)).source.engine.rows == 8
    monkeypatch.setattr(assembly, "machine_memory_bytes", lambda: need + weights // 2)
    with pytest.raises(UserError, match=r"plus 0.0 GB for the rollout process's copy of the model, more than this "
                                        r"machine's .* or rollout_worker = thread"):
        assembly.build_job(_cfg(*items, "rollout_worker=process"))


def test_the_resume_point_after_a_crash_reads_the_resumed_update_from_disk(tmp_path):
    from mlx_grpo.storage import checkpoint as ckpt

    run, elsewhere = tmp_path / "run", tmp_path / "a" / "checkpoint-4"
    for path, step in ((run / "checkpoint-2", 2), (elsewhere, 4)):
        path.mkdir(parents=True)
        (path / "trainer_state.json").write_text(json.dumps({"counters": {"update_step": step}}))
    assert ckpt.resume_point_after_crash(run, str(elsewhere)) == elsewhere  # the older run's 2 is not ours
    assert ckpt.resume_point_after_crash(run, None) == run / "checkpoint-2"
    assert ckpt.resume_point_after_crash(run, "latest") == run / "checkpoint-2"
    (run / "checkpoint-5").mkdir()
    (run / "checkpoint-5" / "trainer_state.json").write_text("{}")
    assert ckpt.resume_point_after_crash(run, str(elsewhere)) == run / "checkpoint-5"  # saved after the resume
    (elsewhere / "trainer_state.json").write_text("{not json")  # unreadable: counted as not resumed
    assert ckpt.resume_point_after_crash(run, str(elsewhere)) == run / "checkpoint-5"


def test_the_resume_point_after_a_crash_on_a_lost_mount(tmp_path, monkeypatch):
    """The run directory cannot be listed: the checkpoint resumed from, as a failed save names it; none: OSError
    (the CLI's crash line then says --resume latest)."""
    import errno

    from mlx_grpo.storage import checkpoint as ckpt

    elsewhere = tmp_path / "a" / "checkpoint-4"
    elsewhere.mkdir(parents=True)
    (elsewhere / "trainer_state.json").write_text(json.dumps({"counters": {"update_step": 4}}))

    def gone(run_dir):
        raise OSError(errno.ENOTCONN, "Transport endpoint is not connected")

    monkeypatch.setattr(ckpt, "list_checkpoints", gone)
    assert ckpt.resume_point_after_crash(tmp_path / "run", str(elsewhere)) == elsewhere
    for resume in (None, "latest"):
        with pytest.raises(OSError):
            ckpt.resume_point_after_crash(tmp_path / "run", resume)
    monkeypatch.undo()
    # Path.glob swallows a listing error on Python 3.12+ (and EACCES everywhere): the directory is listed first
    run = tmp_path / "run"
    (run / "checkpoint-2").mkdir(parents=True)
    (run / "checkpoint-2" / "trainer_state.json").write_text("{}")
    listdir = os.listdir

    def lost(path):
        if Path(path) == run:
            raise OSError(errno.ENOTCONN, "Transport endpoint is not connected")
        return listdir(path)

    monkeypatch.setattr(os, "listdir", lost)
    with pytest.raises(OSError):
        ckpt.resume_point(run, None)
    with pytest.raises(OSError):  # the caller (a failed save's line, the crash line) falls back to `resumed`
        ckpt.resume_point(run, (elsewhere, 4))
    with pytest.raises(OSError):
        ckpt.resume_point_after_crash(run, None)
    assert ckpt.resume_point_after_crash(run, str(elsewhere)) == elsewhere
    monkeypatch.undo()
    assert ckpt.resume_point(tmp_path / "not-made", None) is None  # a run directory not made yet holds none


def test_a_refused_resume_names_a_command_that_works_when_pasted(tiny_model_dir, tmp_path, capsys):
    """A resume refused for changed settings names `mlx-grpo train --config CHECKPOINT/config.resolved.json
    --resume CHECKPOINT`; that command, run as written, resumes (`--config` reads the stored JSON config)."""
    import shlex

    from mlx_grpo.commands.cli import main

    argv = ["train", *(a for item in _items(tiny_model_dir, tmp_path, "max_train_samples=4") for a in ("--set", item))]
    assert main(argv) == 0
    capsys.readouterr()
    assert main(argv + ["--set", "learning_rate=2e-3", "--resume"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    checkpoint = tmp_path / "grpo" / "checkpoint-2"
    command = re.search(r"resume with its config: mlx-grpo (.*?), or start a new run", line)[1]
    assert command == f"train --config {checkpoint / 'config.resolved.json'} --resume"
    assert main(shlex.split(command)) == 0
    assert f"resumed from {checkpoint} at update 2" in capsys.readouterr().out
    # an explicit checkpoint is named again
    earlier = tmp_path / "grpo" / "checkpoint-1"
    assert main(argv + ["--set", "learning_rate=2e-3", "--resume", str(earlier)]) == 2
    command = re.search(r"resume with its config: mlx-grpo (.*?), or start", capsys.readouterr().err)[1]
    assert command == f"train --config {earlier / 'config.resolved.json'} --resume {earlier}"
    assert main(shlex.split(command)) == 0
    assert f"resumed from {earlier} at update 1" in capsys.readouterr().out


def test_train_prints_one_start_line_before_its_first_update(tiny_model_dir, tmp_path, capsys):
    """Without a terminal (no progress bar) `train` says what it starts before the first update's line: the
    model, the prompts, the updates and the run directory, once."""
    from mlx_grpo.commands.cli import main

    argv = ["train", *(a for item in _items(tiny_model_dir, tmp_path, "max_train_samples=4") for a in ("--set", item))]
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    starts = [i for i, line in enumerate(out) if line.startswith("[mlx-grpo] train: ")]
    assert len(starts) == 1, out
    assert out[starts[0]] == (f"[mlx-grpo] train: model {tiny_model_dir}, 4 prompts, 2 updates of 2 prompts x 4 "
                              f"completions; run directory {tmp_path / 'grpo'}")
    first_update = next(i for i, line in enumerate(out) if line.startswith("[mlx-grpo] update 1:"))
    assert starts[0] < first_update
    # with dynamic sampling the data can end the run first, and a time budget is a bound too: both said
    out_dir = tmp_path / "ds"
    argv = ["train", *(a for item in _items(tiny_model_dir, out_dir, "max_train_samples=4", "dynamic_sampling=true",
                                           "max_minutes=30") for a in ("--set", item))]
    assert main(argv) == 0
    start = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("[mlx-grpo] train: "))
    assert start == (f"[mlx-grpo] train: model {tiny_model_dir}, 4 prompts, up to 2 updates of 2 prompts x 4 "
                     "completions (dynamic sampling draws more prompts where a group's rewards are all equal), a "
                     f"time budget of 30 minutes; run directory {out_dir / 'grpo'}")
    # without extra draws (max_resample_batches = 0) the data lasts every planned update
    argv = ["train", *(a for item in _items(tiny_model_dir, tmp_path / "ds0", "max_train_samples=4",
                                           "dynamic_sampling=true", "max_resample_batches=0") for a in ("--set", item))]
    assert main(argv) == 0
    start = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("[mlx-grpo] train: "))
    assert ", 4 prompts, 2 updates of 2 prompts x 4 completions; run directory" in start


def test_resume_without_a_checkpoint_says_why(tiny_model_dir, tmp_path):
    """--resume where no checkpoint is: a run directory no run has used, or one whose run stopped before its first
    save (save_steps = 0 saves only at the end)."""
    with pytest.raises(UserError, match=r"no checkpoint found in .*: no run has started there \(check output_dir"):
        run_mod.train(_cfg(*_items(tiny_model_dir, tmp_path, "max_train_samples=2")), resume="latest")
    run_dir = tmp_path / "grpo"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"update_step": 1}\n')  # an earlier run, stopped at update 1
    (run_dir / "config.resolved.json").write_text(json.dumps({"save_steps": 0}))
    with pytest.raises(UserError, match=r"stopped before its first checkpoint \(save_steps = 0 writes a checkpoint "
                                        r"only at the end\); without --resume a rerun starts over"):
        run_mod.train(_cfg(*_items(tiny_model_dir, tmp_path, "max_train_samples=2")), resume="latest")
