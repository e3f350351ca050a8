"""Session 20: run a bench script with the attention kernel and the sampler picked: variant.py ATTN SAMPLER script args...
ATTN: new (src/) or old (git 976525f through previous.py, the kernel as shipped before); SAMPLER: keyed (src/) or mlx (vmapped categorical)."""
import runpy, sys
attn, sampler, script = sys.argv[1:4]
sys.argv = [script] + sys.argv[4:]
sys.path.insert(0, "bench")
if attn == "old":
    sys.path.insert(0, "bench/results/gpu-speed-20261125h")
    from previous import previous_attention
    old = previous_attention()
    from mlx_grpo.models import compiled_decode, decoder
    from mlx_grpo.rollout import decode
    decoder.fused_decode_attention = compiled_decode.fused_decode_attention = old.fused_decode_attention
    decoder.left_padded_attention_lse = old.left_padded_attention_lse
    decode.left_padded_attention = old.left_padded_attention
if sampler == "mlx":
    from mlx_grpo.rollout import sampling
    sampling.kernel_available = lambda: False
print(f"variant: attention {attn}, sampler {sampler}", flush=True)
runpy.run_path(script, run_name="__main__")
