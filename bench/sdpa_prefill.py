"""PyTorch SDPA at the shape of kvs_bench_kernels' prefill benchmark: 4096 tokens,
causal, 32 query heads / 8 KV heads, head_dim 128, bf16. Prints TFLOP/s with the
same FLOP count (4 * heads * d * causal pairs). Flash backend first (GQA through
enable_gqa when this torch has it, else K/V repeated to 32 heads), then the
default dispatch; then the default dispatch at 16384 and 32768 tokens.
Usage: python3 bench/sdpa_prefill.py"""
import sys

import torch
import torch.nn.functional as F

T, H, KV, D = 4096, 32, 8, 128
flops = 4.0 * H * D * (T * (T + 1) / 2)
dev = "cuda"
torch.manual_seed(0)
q = torch.randn(1, H, T, D, device=dev, dtype=torch.bfloat16)
k = torch.randn(1, KV, T, D, device=dev, dtype=torch.bfloat16)
v = torch.randn(1, KV, T, D, device=dev, dtype=torch.bfloat16)
k_rep, v_rep = k.repeat_interleave(H // KV, dim=1), v.repeat_interleave(H // KV, dim=1)


def bench(fn, iters=30):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2] / 1e3


def run(name, fn):
    try:
        t = bench(fn)
        print(f"sdpa {name}: {t * 1e3:.3f} ms, {flops / t / 1e12:.1f} TFLOP/s")
    except Exception as e:  # noqa: BLE001 - report and go on
        print(f"sdpa {name}: failed: {type(e).__name__}: {e}".splitlines()[0])


print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
try:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        run("flash, enable_gqa", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
        run("flash, K/V repeated", lambda: F.scaled_dot_product_attention(q, k_rep, v_rep, is_causal=True))
except ImportError:
    print("sdpa: torch.nn.attention.sdpa_kernel missing")
run("default dispatch, K/V repeated", lambda: F.scaled_dot_product_attention(q, k_rep, v_rep, is_causal=True))
# the longer shapes (16k, 32k tokens): the default dispatch (cuDNN) alone, fewer iterations
for T in (16384, 32768):
    flops = 4.0 * H * D * (T * (T + 1) / 2)
    q = torch.randn(1, H, T, D, device=dev, dtype=torch.bfloat16)
    k_rep = torch.randn(1, H, T, D, device=dev, dtype=torch.bfloat16)
    v_rep = torch.randn(1, H, T, D, device=dev, dtype=torch.bfloat16)
    t = bench(lambda: F.scaled_dot_product_attention(q, k_rep, v_rep, is_causal=True), iters=5)
    print(f"sdpa default dispatch {T} tokens: {t * 1e3:.3f} ms, {flops / t / 1e12:.1f} TFLOP/s")
sys.stdout.flush()
