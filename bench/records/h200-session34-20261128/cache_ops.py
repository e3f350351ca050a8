"""Which MLX / project ops go wrong on a [30, R, 3, S, 64] bf16 stacked cache past 2^31 elements (CUDA)."""
import sys, time
import mlx.core as mx
import numpy as np
sys.path.insert(0, "src")
from mlx_grpo.kernels.cache_write import write_rows
from mlx_grpo.kernels.fused_attention import fused_decode_attention, fused_decode_attention_reference

L, H, D = 30, 3, 64
def layer_pattern(l, R, S):  # exact small integers in bf16, distinct per (l, r, h, s) mod 97
    r = mx.arange(R)[:, None, None, None]; h = mx.arange(H)[None, :, None, None]
    s = mx.arange(S)[None, None, :, None]; d = mx.arange(D)[None, None, None, :]
    return ((l * 7 + r * 13 + h * 3 + s * 5 + d) % 97).astype(mx.bfloat16)

def check_layers(name, big, R, S, expect_fn, rows=None):
    bad = []
    for l in range(L):
        got = big[l]
        exp = expect_fn(l)
        if rows is not None:
            got, exp = got[rows], exp[rows]
        ok = mx.array_equal(got, exp).item()
        if not ok:
            diff = mx.any(mx.not_equal(got, exp), axis=(1, 2, 3)) if got.ndim == 4 else None
            badrows = np.nonzero(np.array(diff))[0] if diff is not None else []
            bad.append((l, list(badrows[:6]), len(badrows)))
    print(f"{name}: {'OK' if not bad else 'BAD ' + str(bad[:8])} ({len(bad)} layers bad)", flush=True)

SIZES = [tuple(map(int, a.split("x"))) for a in sys.argv[1:]] or [(256, 512), (768, 448), (1024, 512)]
for R, S in SIZES:
    n = L * R * H * S * D
    print(f"== R={R} S={S}: {n:.3e} elements ({n / 2**31:.2f} x 2^31), {2 * n / 2**31:.2f} x 2^31 bytes", flush=True)
    # 1. stack + pad + gather (CopyDecoder.prefill's path): prompts of width W padded to S, repeated G times
    G, W = 16, 200
    P = R // G
    small = mx.stack([layer_pattern(l, P, W) for l in range(L)])
    padded = mx.pad(small, [(0, 0), (0, 0), (0, 0), (S - W - 8, 8), (0, 0)])
    repeat = mx.array(np.repeat(np.arange(P), G))
    big = padded[:, repeat]
    mx.eval(big)
    def exp_prefill(l):
        return mx.pad(layer_pattern(l, P, W), [(0, 0), (0, 0), (S - W - 8, 8), (0, 0)])[repeat]
    check_layers("pad+gather (prefill)", big, R, S, exp_prefill)
    del padded, small
    # 2. a direct big pattern built layer by layer then stacked
    big2 = mx.stack([layer_pattern(l, R, S) for l in range(L)]); mx.eval(big2)
    check_layers("stack", big2, R, S, lambda l: layer_pattern(l, R, S))
    # 3. slice update of one slot (the non-writing step's cache write)
    new = mx.full((L, R, H, 1, D), 5, dtype=mx.bfloat16)
    big2[..., 300:301, :] = new; mx.eval(big2)
    def exp_su(l):
        e = layer_pattern(l, R, S); e[:, :, 300:301, :] = mx.full((R, H, 1, D), 5, dtype=mx.bfloat16); return e
    check_layers("slice update", big2, R, S, exp_su)
    # 4. select (compaction gather) of a permutation
    pick = mx.array(np.r_[np.arange(1, R), 0][: R - 3])
    sel = big2[:, pick]; mx.eval(sel)
    check_layers("select", sel, R - 3, S, lambda l: exp_su(l)[pick])
    del sel
    # 5. write_rows (kernel) into slots 0, R//2, R-1
    slots = mx.array([0, R // 2, R - 1], dtype=mx.int32)
    blk = mx.full((L, 3, H, 16, D), 9, dtype=mx.bfloat16)
    vals = mx.array(big2)  # a copy as values
    mx.eval(vals)
    k2, v2 = write_rows(big2, vals, blk, blk, slots, 100)
    mx.eval(k2)
    def exp_wr(l):
        e = exp_su(l); e[slots, :, 100:116, :] = mx.full((3, H, 16, D), 9, dtype=mx.bfloat16); return e
    check_layers("write_rows", k2, R, S, exp_wr)
    # 6. concatenate along rows (admit's append)
    extra = mx.stack([layer_pattern(l, 8, S) for l in range(L)])
    cat = mx.concatenate([k2, extra], axis=1); mx.eval(cat)
    check_layers("concatenate", cat, R + 8, S, lambda l: mx.concatenate([exp_wr(l), layer_pattern(l, 8, S)]))
    del cat, extra
    # 7. fused decode attention over layers 0 and 29, against its reference, rows 0, 1, mid, last
    keys = mx.random.normal((L, R, H, S, D), key=mx.random.key(1)).astype(mx.bfloat16)
    values = mx.random.normal((L, R, H, S, D), key=mx.random.key(2)).astype(mx.bfloat16)
    mx.eval(keys, values)
    qkv = mx.random.normal((R, (9 + 6) * D), key=mx.random.key(3)).astype(mx.bfloat16)
    start = mx.array(np.random.default_rng(0).integers(0, 100, R).astype(np.int32))
    stop = mx.array([S - 20], dtype=mx.int32)
    pos = mx.array(np.full(R, S - 20, np.int32))
    theta = (10000.0 ** (-mx.arange(0, D, 2) / D)).astype(mx.float32)
    for layer in (0, 29):
        out, k, v = fused_decode_attention(qkv, keys, values, start, stop, pos, theta, 0.125, 9, layer)
        ref, rk, rv = fused_decode_attention_reference(qkv, keys, values, start, stop, pos, theta, 0.125, 9, layer)
        err = mx.abs(out.astype(mx.float32) - ref).max(axis=(1, 2, 3))
        worst = np.argsort(-np.array(err))[:4]
        print(f"fused layer {layer}: max err {err.max().item():.4f} worst rows {list(worst)} {np.array(err)[worst]}", flush=True)
    # 8. fused with write_cache: slot stop written in place for all rows of layer 29
    out, k, v = fused_decode_attention(qkv, keys, values, start, stop, pos, theta, 0.125, 9, 29, write_cache=True)
    mx.eval(out, k, v)
    wrote = keys[29, :, :, S - 20:S - 19, :]
    print("fused write_cache layer 29:", "OK" if mx.array_equal(wrote, k).item() else
          f"BAD rows {np.nonzero(np.array(mx.any(mx.not_equal(wrote, k), axis=(1,2,3))))[0][:8]}", flush=True)
    del keys, values, big, big2, vals, k2, v2
    mx.clear_cache()
print("done", flush=True)
