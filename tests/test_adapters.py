"""LoRA / DoRA / QLoRA: what is trained, the adapters switched off being exactly the base, adapter
checkpoints (ours and mlx-lm's loader), `fuse`, and the routed experts of MoE models."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import pytest
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear
from mlx_lm.tuner.dora import DoRALinear
from mlx_lm.tuner.lora import LoRASwitchLinear

from conftest import write_tiny_model
from mlx_grpo.base.errors import UserError
from mlx_grpo.commands.fuse import run_fuse
from mlx_grpo.config import Config
from mlx_grpo.models.adapters import (adapter_modules, adapter_parameters, adapters_disabled, apply_adapters,
                                      is_adapter_checkpoint, lora_block_keys, quantize_base)
from mlx_grpo.models.model_loading import load_model, load_with_adapters
from mlx_grpo.models.tiny import write_tiny_family
from mlx_grpo.storage import checkpoint as ckpt

TOKENS = mx.array([[5, 17, 42, 99, 3, 250, 7, 64]])
LLAMA_KEYS = ["mlp.down_proj", "mlp.gate_proj", "mlp.up_proj", "self_attn.k_proj", "self_attn.o_proj",
              "self_attn.q_proj", "self_attn.v_proj"]
# (train_type, load_in_bits): float LoRA, float DoRA, QLoRA, QLoRA with DoRA
VARIANTS = [("lora", 0), ("dora", 0), ("lora", 4), ("dora", 8)]
VARIANT_IDS = ["lora", "dora", "qlora4", "qdora8"]


@pytest.fixture(scope="module")
def wide_model_dir(tmp_path_factory) -> Path:
    """Input widths 64/128: quantizable with group size 64 (the tiny model's 32 are not)."""
    return write_tiny_model(tmp_path_factory.mktemp("wide") / "model", seed=1, hidden=64)


def _logits(model) -> mx.array:
    out = model(TOKENS)
    mx.eval(out)
    return out


def _base(model_dir: Path, bits: int):
    model, _ = load_model(str(model_dir))
    if bits:
        quantize_base(model, bits)
    return model


def _adapted(model_dir: Path, train_type: str, bits: int = 0, **kwargs):
    model = _base(model_dir, bits)
    options = {"rank": 4, "alpha": 8.0, "dropout": 0.0, "num_layers": 0, "keys": []} | kwargs
    config = apply_adapters(model, train_type, **options)
    config["mlx_grpo"] = {"base_model": str(model_dir), "base_dir": str(model_dir), "load_in_bits": bits,
                          "model_dtype": "auto"}
    return model, config


def _perturb(model, seed: int = 3) -> None:
    """Fresh adapters are a no-op (lora_b = 0, DoRA's m = the base norms): make them matter."""
    mx.random.seed(seed)
    new = {k: v + 0.2 * mx.random.normal(v.shape) * (1.0 if k.endswith("lora_b") else v.abs().mean())
           for k, v in adapter_parameters(model).items() if k.endswith(("lora_b", ".m"))}
    model.update(tree_unflatten(list(new.items())))
    mx.eval(model.parameters())


def _loss(model, tokens: mx.array) -> mx.array:
    return nn.losses.cross_entropy(model(tokens[:, :-1]), tokens[:, 1:]).mean()


def _train_steps(model, optimizer, steps: int = 2) -> None:
    grad_fn = nn.value_and_grad(model, lambda tokens: _loss(model, tokens))
    for _ in range(steps):
        _, grads = grad_fn(TOKENS)
        optimizer.update(model, grads)
        mx.eval(model.parameters(), optimizer.state)


def _save(run_dir: Path, model_dir: Path, model, adapter_config: dict | None, old=None) -> Path:
    optimizer = optim.AdamW(learning_rate=1e-2)
    _train_steps(model, optimizer)
    run_dir.mkdir(parents=True, exist_ok=True)
    return ckpt.save_checkpoint(run_dir, 2, model=model, optimizer=optimizer, trainer_state={"counters": {}},
                                config=Config(), source_dir=model_dir,
                                model_config=json.loads((model_dir / "config.json").read_text()),
                                old_params=old, adapter_config=adapter_config)


# --------------------------------------------------------------------------- what is trained
@pytest.mark.parametrize("train_type", ["lora", "dora"])
def test_only_adapter_parameters_are_trainable(tiny_model_dir, train_type):
    model, config = _adapted(tiny_model_dir, train_type)
    names = sorted(adapter_parameters(model))
    leaves = ("lora_a", "lora_b", "m") if train_type == "dora" else ("lora_a", "lora_b")
    expected = sorted(f"model.layers.{i}.{key}.{leaf}" for i in range(2) for key in LLAMA_KEYS for leaf in leaves)
    assert names == expected
    assert config == {"fine_tune_type": train_type, "num_layers": 2, "mlx_grpo": config["mlx_grpo"],
                      "lora_parameters": {"rank": 4, "scale": 2.0, "dropout": 0.0, "keys": LLAMA_KEYS}}


def test_default_keys_are_every_projection_of_a_block(tiny_model_dir):
    model, _ = load_model(str(tiny_model_dir))
    assert lora_block_keys(model) == LLAMA_KEYS


def test_num_layers_adapts_only_the_last_blocks(tiny_model_dir):
    model, config = _adapted(tiny_model_dir, "lora", num_layers=1, keys=["self_attn.v_proj", "self_attn.q_proj"])
    assert sorted(adapter_parameters(model)) == [
        "model.layers.1.self_attn.q_proj.lora_a", "model.layers.1.self_attn.q_proj.lora_b",
        "model.layers.1.self_attn.v_proj.lora_a", "model.layers.1.self_attn.v_proj.lora_b"]
    assert config["num_layers"] == 1
    assert config["lora_parameters"]["keys"] == ["self_attn.q_proj", "self_attn.v_proj"]
    with pytest.raises(UserError, match="num_layers=3, but the model has 2 layers"):
        _adapted(tiny_model_dir, "lora", num_layers=3)


def test_dropout_follows_the_model_mode(tiny_model_dir):
    model, _ = _adapted(tiny_model_dir, "lora", dropout=0.5)  # load_model returns an eval-mode model
    _perturb(model)
    assert mx.array_equal(_logits(model), _logits(model))  # eval: no dropout (rollouts, log-probs)
    model.train()
    assert not mx.array_equal(_logits(model), _logits(model))  # training passes drop adapter inputs


def test_unknown_key_names_the_nearest_valid_key(tiny_model_dir):
    with pytest.raises(UserError) as err:
        _adapted(tiny_model_dir, "lora", keys=["self_attn.q_prj"])
    message = str(err.value)
    assert "did you mean 'self_attn.q_proj'" in message
    assert all(key in message for key in LLAMA_KEYS) and "\n" not in message


# --------------------------------------------------------------------------- adapters off = the base
@pytest.mark.parametrize("train_type,bits", VARIANTS, ids=VARIANT_IDS)
def test_adapters_disabled_is_exactly_the_base_model(tiny_model_dir, wide_model_dir, train_type, bits):
    model_dir = wide_model_dir if bits else tiny_model_dir
    base_logits = _logits(_base(model_dir, bits))  # loaded (and quantized) separately
    model, _ = _adapted(model_dir, train_type, bits)
    _perturb(model)
    enabled = _logits(model)
    assert mx.abs(enabled - base_logits).max().item() > 1e-3  # the adapters do change the model
    with adapters_disabled(model):
        assert mx.array_equal(_logits(model), base_logits)
        assert adapter_parameters(model) == {}
    assert mx.array_equal(_logits(model), enabled)  # switched back on
    assert len(adapter_parameters(model)) == 2 * 7 * (3 if train_type == "dora" else 2)


# --------------------------------------------------------------------------- QLoRA
def test_qlora_quantizes_the_base_and_trains_only_adapters(wide_model_dir):
    model, _ = _adapted(wide_model_dir, "lora", 4)
    q_proj = model.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj.linear, nn.QuantizedLinear) and q_proj.linear.bits == 4
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding)
    frozen = {k: v for k, v in tree_flatten(model.parameters()) if k not in adapter_parameters(model)}
    before = adapter_parameters(model)
    _train_steps(model, optim.AdamW(learning_rate=1e-2))
    after = dict(tree_flatten(model.parameters()))
    assert all(mx.array_equal(after[k], v) for k, v in frozen.items())
    assert any(not mx.array_equal(after[k], v) for k, v in before.items())


def test_quantize_base_refusals(tiny_model_dir, wide_model_dir):
    model = _base(wide_model_dir, 4)
    with pytest.raises(UserError, match="model is already quantized; drop load_in_bits"):
        quantize_base(model, 4)
    with pytest.raises(UserError, match="4 or 8"):
        quantize_base(_base(wide_model_dir, 0), 3)
    with pytest.raises(UserError, match="multiple of the group size 128"):
        quantize_base(_base(tiny_model_dir, 0), 4, group_size=128)  # widths 32, 64: nothing to quantize


# --------------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("train_type,bits", VARIANTS, ids=VARIANT_IDS)
def test_adapter_checkpoint_roundtrip(tmp_path, tiny_model_dir, wide_model_dir, train_type, bits):
    from mlx_lm import load as mlx_lm_load

    model_dir = wide_model_dir if bits else tiny_model_dir
    model, config = _adapted(model_dir, train_type, bits)
    old = adapter_parameters(model)  # the sampling policy before the update
    path = _save(tmp_path / "run", model_dir, model, config, old=model.parameters())
    files = {p.name for p in path.iterdir()}
    assert {"adapters.safetensors", "adapter_config.json", "old_adapters.safetensors", "optimizer.safetensors",
            "trainer_state.json", "config.json", "tokenizer.json"} <= files
    assert not files & {"model.safetensors", "old_model.safetensors"}
    assert is_adapter_checkpoint(path) and ckpt.list_checkpoints(tmp_path / "run") == [path]

    weights, optimizer_state, _, old_tree = ckpt.load_checkpoint(path)
    current = adapter_parameters(model)
    assert sorted(weights) == sorted(current) and all(mx.array_equal(weights[k], current[k]) for k in current)
    assert all(mx.array_equal(v, old[k]) for k, v in tree_flatten(old_tree)) and len(tree_flatten(old_tree)) == len(old)
    assert optimizer_state["step"].item() == 2

    expected = _logits(model)
    reloaded, tokenizer = load_model(str(path))
    assert mx.array_equal(_logits(reloaded), expected)
    assert sorted(adapter_parameters(reloaded)) == sorted(current)  # only the adapters are trainable
    assert not reloaded.training and not reloaded.model.layers[1].self_attn.q_proj.training  # no dropout
    assert tokenizer.encode("hi") == load_model(str(model_dir))[1].encode("hi")
    if not bits:  # mlx-lm reads our adapter_config.json too (a base quantized at load time it cannot rebuild)
        lm_model, _ = mlx_lm_load(str(model_dir), adapter_path=str(path))
        assert mx.allclose(_logits(lm_model), expected, atol=1e-6)


def test_full_checkpoint_is_unchanged(tmp_path, tiny_model_dir):
    model, _ = load_model(str(tiny_model_dir))
    path = _save(tmp_path / "run", tiny_model_dir, model, None, old=model.parameters())
    files = {p.name for p in path.iterdir()}
    assert {"model.safetensors", "old_model.safetensors"} <= files
    assert not files & {"adapters.safetensors", "adapter_config.json", "old_adapters.safetensors"}
    weights, _, _, old = ckpt.load_checkpoint(path)
    assert sorted(weights) == sorted(k for k, _ in tree_flatten(model.parameters())) and old is not None
    assert not is_adapter_checkpoint(path)


def test_missing_base_is_a_user_error(tmp_path, tiny_model_dir):
    model, config = _adapted(tiny_model_dir, "lora")
    config["mlx_grpo"] |= {"base_model": str(tmp_path / "gone"), "base_dir": str(tmp_path / "gone")}
    path = _save(tmp_path / "run", tiny_model_dir, model, config)
    with pytest.raises(UserError, match="cannot load its base model"):
        load_with_adapters(path)


def test_adapters_of_another_shape_are_refused(tmp_path, tiny_model_dir):
    model, config = _adapted(tiny_model_dir, "lora")
    path = _save(tmp_path / "run", tiny_model_dir, model, config)
    record = json.loads((path / "adapter_config.json").read_text())
    record["lora_parameters"]["rank"] = 8
    (path / "adapter_config.json").write_text(json.dumps(record))
    with pytest.raises(UserError, match="does not match the adapter layers"):
        load_model(str(path))


# --------------------------------------------------------------------------- fuse
@pytest.mark.parametrize("train_type,bits,dequantize,atol", [
    ("lora", 0, False, 1e-5), ("dora", 0, False, 1e-5), ("lora", 4, True, 1e-4), ("dora", 8, True, 1e-4)],
    ids=["lora", "dora", "qlora4-dequantized", "qdora8-dequantized"])
def test_fuse_gives_the_adapted_model(tmp_path, tiny_model_dir, wide_model_dir, train_type, bits, dequantize,
                                      atol):
    from mlx_lm import load as mlx_lm_load

    model_dir = wide_model_dir if bits else tiny_model_dir
    model, config = _adapted(model_dir, train_type, bits)
    _perturb(model)
    path = _save(tmp_path / "run", model_dir, model, config)
    out = run_fuse(str(path), str(tmp_path / "fused"), dequantize=dequantize)
    files = {p.name for p in out.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"} <= files
    assert not files & {"adapters.safetensors", "adapter_config.json", "optimizer.safetensors",
                        "trainer_state.json", "config.resolved.json"}
    assert "quantization" not in json.loads((out / "config.json").read_text())
    fused, _ = load_model(str(out))
    assert not any("scales" in m for _, m in fused.named_modules())
    assert mx.allclose(_logits(fused), _logits(model), atol=atol)
    assert mx.allclose(_logits(mlx_lm_load(str(out))[0]), _logits(model), atol=atol)


def test_fuse_keeps_a_qlora_base_quantized(tmp_path, wide_model_dir):
    model, config = _adapted(wide_model_dir, "lora", 8)
    _perturb(model)
    path = _save(tmp_path / "run", wide_model_dir, model, config)
    out = run_fuse(str(path), str(tmp_path / "fused"))
    assert json.loads((out / "config.json").read_text())["quantization"] == {"group_size": 64, "bits": 8,
                                                                              "mode": "affine"}
    fused, _ = load_model(str(out))
    assert isinstance(fused.model.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    # The fused weights are re-quantized: close to the adapted model, not equal.
    expected, got = _logits(model), _logits(fused)
    assert mx.abs(got - expected).max().item() < 0.05 * mx.abs(expected).max().item()


def test_fuse_refusals_leave_no_output(tmp_path, tiny_model_dir, monkeypatch):
    import mlx_lm.utils

    full, _ = load_model(str(tiny_model_dir))
    full_path = _save(tmp_path / "full", tiny_model_dir, full, None)
    with pytest.raises(UserError, match="holds full weights; it is already a plain model: use it directly") as err:
        run_fuse(str(full_path), str(tmp_path / "out"))
    assert "\n" not in str(err.value)
    with pytest.raises(UserError, match="not found"):
        run_fuse(str(tmp_path / "nothing"), str(tmp_path / "out"))

    model, config = _adapted(tiny_model_dir, "lora")
    path = _save(tmp_path / "run", tiny_model_dir, model, config)
    (tmp_path / "taken").mkdir()
    with pytest.raises(UserError, match="already exists"):
        run_fuse(str(path), str(tmp_path / "taken"))

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(mlx_lm.utils, "save_config", broken)
    with pytest.raises(OSError):
        run_fuse(str(path), str(tmp_path / "out"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full", "run", "taken"]
    shutil.rmtree(tmp_path / "taken")


# --------------------------------------------------------------------------- MoE experts
# family -> where its routed experts (SwitchLinear, one [experts, out, in] weight per projection) sit in a block
MOE_EXPERTS = {"qwen3_moe": "mlp.switch_mlp", "gpt_oss": "mlp.experts", "qwen3_next": "mlp.switch_mlp"}
EXPERT_KEYS = {family: [f"{where}.{p}" for p in ("down_proj", "gate_proj", "up_proj")]
               for family, where in MOE_EXPERTS.items()}
# 39 positions x 2 experts each: past the 64 routed rows at which SwitchGLU sorts them by expert (a batch's path)
LONG = mx.array([[(7 * i) % 250 + 3 for i in range(40)]])


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory) -> dict[str, Path]:
    """family -> a tiny random MoE model directory; "qwen3_moe-wide": widths 64, quantizable with group size 64."""
    root = tmp_path_factory.mktemp("moe")
    dirs = {family: write_tiny_family(root / family, family, seed=2) for family in MOE_EXPERTS}
    wide = {"hidden_size": 64, "moe_intermediate_size": 64}
    return dirs | {"qwen3_moe-wide": write_tiny_family(root / "wide", "qwen3_moe", seed=2, overrides=wide)}


@pytest.mark.parametrize("family", list(MOE_EXPERTS))
def test_moe_experts_are_adapted_by_default_and_by_key(moe_dirs, family):
    experts = EXPERT_KEYS[family]
    model, config = _adapted(moe_dirs[family], "lora")
    assert set(experts) <= set(config["lora_parameters"]["keys"])  # lora_block_keys: every projection
    wrapped = {n.rsplit("layers.", 1)[1]: m for n, m in adapter_modules(model) if isinstance(m, LoRASwitchLinear)}
    assert sorted(wrapped) == sorted(f"{i}.{k}" for i in range(len(model.layers)) for k in experts)
    assert all(isinstance(m.linear, SwitchLinear) and m.lora_a.shape == (4, 4, m.linear.input_dims)
               for m in wrapped.values())  # one rank-4 adapter per expert

    model, config = _adapted(moe_dirs[family], "lora", num_layers=1, keys=[experts[1]])
    last, names = f"{len(model.layers) - 1}.{experts[1]}", [n.split("layers.")[-1] for n in adapter_parameters(model)]
    assert config["lora_parameters"]["keys"] == [experts[1]] and sorted(names) == [f"{last}.lora_a", f"{last}.lora_b"]


@pytest.mark.parametrize("family", list(MOE_EXPERTS))
def test_moe_expert_adapters_get_the_loss_gradient(moe_dirs, family):
    model, _ = _adapted(moe_dirs[family], "lora", keys=EXPERT_KEYS[family])
    _perturb(model)  # with lora_b = 0, lora_a's gradient would be zero
    grads = dict(tree_flatten(nn.value_and_grad(model, lambda tokens: _loss(model, tokens))(LONG)[1]))
    assert sorted(grads) == sorted(adapter_parameters(model)) and len(grads) == 2 * 3 * len(model.layers)
    assert all(mx.abs(g).max().item() > 0 for g in grads.values())
    # The gradient is the loss's: a central difference along a random direction of the last block's expert
    # adapters (earlier blocks' would move later routers' inputs, and a flipped top-k choice is a jump).
    last = f"layers.{len(model.layers) - 1}."
    params, eps = {k: v for k, v in adapter_parameters(model).items() if last in k}, 1e-3
    direction = {k: mx.random.normal(v.shape, key=mx.random.key(i)) for i, (k, v) in enumerate(params.items())}

    def loss_at(sign: float) -> float:
        model.update(tree_unflatten([(k, v + sign * eps * direction[k]) for k, v in params.items()]))
        return _loss(model, LONG).item()

    numeric = (loss_at(1.0) - loss_at(-1.0)) / (2 * eps)
    analytic = sum((grads[k] * direction[k]).sum().item() for k in params)
    assert abs(numeric - analytic) < 2e-2 * abs(analytic) + 1e-3


@pytest.mark.parametrize("family,bits", [("qwen3_moe", 0), ("gpt_oss", 0), ("qwen3_next", 0), ("qwen3_moe", 8)],
                         ids=["qwen3_moe", "gpt_oss", "qwen3_next", "qwen3_moe-qlora8"])
def test_moe_expert_checkpoint_reloads_and_fuses(tmp_path, moe_dirs, family, bits):
    from mlx_lm import load as mlx_lm_load

    model_dir = moe_dirs[family + "-wide" if bits else family]
    model, config = _adapted(model_dir, "lora", bits, keys=EXPERT_KEYS[family])  # experts alone: they must matter
    assert not bits or isinstance(model.layers[0].mlp.switch_mlp.up_proj.linear, QuantizedSwitchLinear)
    _perturb(model)
    path = _save(tmp_path / "run", model_dir, model, config)
    expected = _logits(model)
    with adapters_disabled(model):
        assert mx.abs(_logits(model) - expected).max().item() > 1e-3
    reloaded, _ = load_model(str(path))
    assert mx.array_equal(_logits(reloaded), expected)
    assert sorted(adapter_parameters(reloaded)) == sorted(adapter_parameters(model))
    if not bits:  # mlx-lm's loader builds the same LoRASwitchLinear layers from our adapter_config.json
        assert mx.allclose(_logits(mlx_lm_load(str(model_dir), adapter_path=str(path))[0]), expected, atol=1e-6)

    out = run_fuse(str(path), str(tmp_path / "fused"), dequantize=bool(bits))
    fused, _ = load_model(str(out))
    assert not adapter_modules(fused) and not any("scales" in m for _, m in fused.named_modules())
    assert mx.allclose(_logits(fused), expected, atol=1e-4 if bits else 1e-5)
    if bits:  # fused without dequantize: the experts are re-quantized, close to the adapted model
        fused, _ = load_model(str(run_fuse(str(path), str(tmp_path / "fused-q"))))
        assert isinstance(fused.layers[0].mlp.switch_mlp.up_proj, QuantizedSwitchLinear)
        assert mx.abs(_logits(fused) - expected).max().item() < 0.05 * mx.abs(expected).max().item()


def test_moe_key_refusals_are_one_line(moe_dirs):
    with pytest.raises(UserError, match="did you mean 'mlp.switch_mlp.gate_proj'"):
        _adapted(moe_dirs["qwen3_moe"], "lora", keys=["mlp.switch_mlp.gate_prj"])
    # mlx-lm has no DoRA for experts: refused, not silently skipped
    with pytest.raises(UserError, match="use train_type = lora, or set lora_keys to") as err:
        _adapted(moe_dirs["qwen3_moe"], "dora")
    assert "\n" not in str(err.value) and all(key in str(err.value) for key in EXPERT_KEYS["qwen3_moe"])
    model, _ = _adapted(moe_dirs["qwen3_moe"], "dora", keys=["mlp.gate", "self_attn.q_proj"])  # the rest can
    assert sum(isinstance(m, DoRALinear) for _, m in adapter_modules(model)) == 2 * len(model.layers)
