"""Full attention of one decode token over a long static cache: the engine's split-K Triton kernel
(`oda_hf.kernels.full_attention_decode`) against SDPA with the engine's bool mask (what the engine's Full pass
ran before the kernel) and SDPA without a mask (flash, GQA in the kernel: a floor no masked decode beats).

Per layer, batch 1 by default, Qwen2.5-Coder-0.5B's attention shape (14 query heads, 2 KV heads of 64), bf16.
Times are CUDA-event medians over `--repeats` calls after warm-up. CUDA only.

  python benchmarks/full_decode_kernel.py --lengths 16384,32768
  python benchmarks/full_decode_kernel.py --splits 128,256,512 --blocks 16,32 --dot
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from oda_hf.kernels import allocate_full_scratch, full_attention_decode, full_attention_decode_reference


def timed(fn, repeats: int) -> float:
    """Median milliseconds of `fn()` (CUDA events)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="16384,32768")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--q-heads", type=int, default=14)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--splits", default="256", help="columns per program (comma list)")
    parser.add_argument("--blocks", default="16", help="columns per inner iteration (comma list)")
    parser.add_argument("--dot", action="store_true", help="also the tensor-core (tl.dot) variant of each setting")
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("This benchmark times CUDA kernels: it needs a CUDA GPU.")
    device, dtype = torch.device("cuda"), torch.bfloat16
    b, hq, hkv, d = args.batch, args.q_heads, args.kv_heads, args.head_dim
    print(f"| columns | arm | ms per layer | vs SDPA + mask |\n|---:|:---|---:|---:|")
    for columns in map(int, args.lengths.split(",")):
        q = torch.randn(b, hq, 1, d, device=device, dtype=dtype)
        keys, values = (torch.randn(b, hkv, columns, d, device=device, dtype=dtype) for _ in range(2))
        valid = torch.ones(b, columns, dtype=torch.bool, device=device)
        position = torch.tensor([columns - 1], device=device)
        mask = valid[:, None, None, :]
        scale = d ** -0.5
        arms = {"SDPA, bool mask (GQA by repeat, as transformers)":
                lambda: F.scaled_dot_product_attention(q, keys.repeat_interleave(hq // hkv, 1),
                                                       values.repeat_interleave(hq // hkv, 1), attn_mask=mask),
                "SDPA, no mask, enable_gqa (flash)":
                lambda: F.scaled_dot_product_attention(q, keys, values, enable_gqa=True)}
        want = full_attention_decode_reference(q, keys, values, valid, position, scale).float()
        for split in map(int, args.splits.split(",")):
            for block in map(int, args.blocks.split(",")):
                for use_dot in (False, True) if args.dot else (False,):
                    scratch = allocate_full_scratch(b, hq, d, columns, device, split)
                    out = torch.empty(b, hq, 1, d, device=device, dtype=dtype)

                    def kernel(split=split, block=block, scratch=scratch, out=out, use_dot=use_dot):
                        return full_attention_decode(q, keys, values, valid, position, scale, out=out,
                                                     scratch=scratch, split_positions=split, block_positions=block,
                                                     use_dot=use_dot)

                    torch.testing.assert_close(kernel().float(), want, atol=1e-2, rtol=1e-2)
                    arms[f"split-K kernel (split {split}, block {block}{', tl.dot' if use_dot else ''})"] = kernel
        base = None
        for name, fn in arms.items():
            ms = timed(fn, args.repeats)
            base = base or ms
            print(f"| {columns:,} | {name} | {ms:.4f} | {base / ms:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
