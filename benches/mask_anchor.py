"""PyTorch FlexAttention as the anchor for burn-distflash's masked attention (issue 18).

Measures `torch.nn.attention.flex_attention` (compiled with `torch.compile`, block-sparse: it
skips the 128 x 128 blocks its block mask marks empty, as our kernels skip tiles) on one CUDA GPU
for the two masks long-context training uses, both causal, bf16, batch 1, 32 heads, head dim 128:

  * window W   a query sees itself and the W - 1 keys before it (Mistral-style)
  * documents  packed documents of 2K-8K tokens (the lengths of DOCUMENT_LENGTHS, repeated and
               cut at the sequence's end, as `benches/kernel_attention.rs --mask-seqs` packs them);
               a query sees the earlier keys of its own document

and two passes, fwd and fwd+bwd (backward from a fixed random dO). Timing: CUDA events around
each iteration, 3 warm-up iterations (the first compiles), then the median of 10. Throughput is
counted on the visible (query, key) pairs only: forward FLOPs = 4 * pairs * H * D, forward +
backward 3.5 x that (FlashAttention's convention with the pair count in place of S^2 / 2).

    python3 benches/mask_anchor.py --seqs 32768 --window 4096 --json $OUT/mask.jsonl

A configuration that fails is reported as `n/a` with the reason.
"""

import argparse
import datetime
import json
import statistics
import sys

import torch

BATCH = 1
HEADS = 32
HEAD_DIM = 128
DTYPE = torch.bfloat16
WARMUP = 3
ITERS = 10
DOCUMENT_LENGTHS = [3000, 7000, 2048, 5500, 8000, 4100]


def packed_documents(seq: int) -> list:
    """Cumulative lengths of DOCUMENT_LENGTHS packed into `seq` positions."""
    cu = [0]
    i = 0
    while cu[-1] < seq:
        cu.append(min(cu[-1] + DOCUMENT_LENGTHS[i % len(DOCUMENT_LENGTHS)], seq))
        i += 1
    return cu


def masks(seq: int, window: int):
    """(name, mask_mod, visible pairs) of the two masks."""
    cu = packed_documents(seq)
    doc_id = torch.zeros(seq, dtype=torch.int32, device="cuda")
    for d in range(len(cu) - 1):
        doc_id[cu[d] : cu[d + 1]] = d

    def sliding_window(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < window)

    def documents(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (doc_id[q_idx] == doc_id[kv_idx])

    window_pairs = sum(min(i + 1, window) for i in range(seq))
    doc_pairs = sum((b - a) * (b - a + 1) // 2 for a, b in zip(cu, cu[1:]))
    return [
        (f"window {window}", sliding_window, window_pairs),
        ("documents 2K-8K", documents, doc_pairs),
    ]


def time_ms(run, tensors) -> float:
    times = []
    for i in range(WARMUP + ITERS):
        for t in tensors:
            t.grad = None
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        if i >= WARMUP:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:300]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", default="32768", help="comma-separated lengths (32768)")
    parser.add_argument("--window", type=int, default=4096, help="window size (4096)")
    parser.add_argument("--json", metavar="PATH", help="also write JSON lines to PATH")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("error: no CUDA device visible to PyTorch", file=sys.stderr)
        return 1
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    flex = torch.compile(flex_attention)
    print(
        f"# FlexAttention anchor, {datetime.date.today().isoformat()}: "
        f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}"
    )
    print(f"# causal, bf16, batch {BATCH}, {HEADS} heads, head dim {HEAD_DIM}")
    print("| implementation | pass | S | ms | TFLOP/s |")
    print("| --- | --- | --- | --- | --- |")
    out_json = open(args.json, "w") if args.json else None
    for seq in [int(s) for s in args.seqs.split(",") if s.strip()]:
        shape = (BATCH, HEADS, seq, HEAD_DIM)
        q, k, v = (
            torch.randn(shape, dtype=DTYPE, device="cuda", requires_grad=True) for _ in range(3)
        )
        grad_out = torch.randn(shape, dtype=DTYPE, device="cuda")
        for name, mask_mod, pairs in masks(seq, args.window):
            flops = 4.0 * pairs * HEADS * HEAD_DIM
            for pass_name in ("fwd", "fwd+bwd"):
                impl = f"torch flex_attention, {name}"
                record = {"impl": impl, "pass": pass_name, "seq": seq}
                try:
                    block_mask = create_block_mask(mask_mod, None, None, seq, seq)

                    def run():
                        out = flex(q, k, v, block_mask=block_mask)
                        if pass_name == "fwd+bwd":
                            out.backward(grad_out)

                    ms = time_ms(run, (q, k, v))
                    total = flops if pass_name == "fwd" else 3.5 * flops
                    record.update(ms=ms, tflops=total / ms / 1e9)
                    print(f"| {impl} | {pass_name} | {seq} | {ms:.2f} | {total / ms / 1e9:.1f} |")
                except Exception as err:  # noqa: BLE001 (report and go on)
                    record.update(ms=None, tflops=None, error=first_line(err))
                    print(f"| {impl} | {pass_name} | {seq} | n/a | n/a ({first_line(err)}) |")
                if out_json:
                    out_json.write(json.dumps(record) + "\n")
                sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
