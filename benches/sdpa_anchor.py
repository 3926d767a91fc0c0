"""PyTorch SDPA as the comparison anchor for burn-distflash's attention kernels.

Measures `torch.nn.functional.scaled_dot_product_attention` on one CUDA GPU for the shape the
project compares against: causal, bf16, batch 1, 32 heads, head dim 128, sequence lengths
8192, 16384 and 32768, with two SDPA backends forced through
`torch.nn.attention.sdpa_kernel(SDPBackend.X)`:

  * FLASH_ATTENTION (FlashAttention-2 kernels bundled with PyTorch)
  * CUDNN_ATTENTION (cuDNN's fused attention)

and two passes:

  * fwd      the forward of a training step (inputs require grad, so the log-sum-exp is kept)
  * fwd+bwd  forward, then backward from a fixed random dO (gradients reset before each run)

Timing: CUDA events around each iteration, 3 warm-up iterations, then the median of 10
(`--wall-clock` adds both backends timed on the host clock, one synchronised call at a time, the
method of the Rust bench's one-call rows; `--queued` adds them timed as 8 calls back to back and
one wait on the host clock, per call, the method of the Rust bench's queued rows).
Throughput follows FlashAttention's convention: forward FLOPs = 4 * S^2 * H * D / 2 for causal
attention (= 2 * S^2 * H * D, times the batch), forward+backward = 3.5 x forward FLOPs.

A backend that cannot run a configuration (not available in this build, out of memory, ...) is
reported as `n/a` with the reason instead of stopping the script.

Run on the GPU machine (needs only PyTorch with CUDA):

    python3 benches/sdpa_anchor.py --json $OUT/sdpa.jsonl
    python3 benches/sdpa_anchor.py --seqs 8192,16384
    python3 benches/sdpa_anchor.py --seqs 8192 --chunks 4   # adds FA-2 and cuDNN pair by pair

Prints a markdown table (rows: backend x pass, columns: sequence length; cells: TFLOP/s and the
median time) and, with `--json PATH`, writes one JSON object per measurement:
{"impl", "pass", "seq", "tflops", "ms"} (failures have null tflops/ms and an "error" field).
"""

import argparse
import datetime
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BATCH = 1
HEADS = 32
HEAD_DIM = 128
DTYPE = torch.bfloat16
WARMUP = 3
ITERS = 10

BACKENDS = [
    ("torch_sdpa_flash", SDPBackend.FLASH_ATTENTION),
    ("torch_sdpa_cudnn", SDPBackend.CUDNN_ATTENTION),
]
PASSES = ["fwd", "fwd+bwd"]


KV_HEADS = HEADS


def causal_forward_flops(seq: int) -> float:
    """FlashAttention's count: 4 * S^2 * H * D (H query heads), halved for the causal mask,
    times the batch."""
    return BATCH * 4.0 * seq * seq * HEADS * HEAD_DIM / 2.0


def pass_flops(pass_name: str, seq: int) -> float:
    fwd = causal_forward_flops(seq)
    return fwd if pass_name == "fwd" else 3.5 * fwd


def make_inputs(seq: int):
    shape = (BATCH, HEADS, seq, HEAD_DIM)
    kv_shape = (BATCH, KV_HEADS, seq, HEAD_DIM)
    q = torch.randn(shape, dtype=DTYPE, device="cuda", requires_grad=True)
    k, v = (
        torch.randn(kv_shape, dtype=DTYPE, device="cuda", requires_grad=True) for _ in range(2)
    )
    grad_out = torch.randn(shape, dtype=DTYPE, device="cuda")
    return q, k, v, grad_out


def run_once(pass_name: str, q, k, v, grad_out) -> None:
    out = F.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=KV_HEADS != HEADS
    )
    if pass_name == "fwd+bwd":
        out.backward(grad_out)


def run_chunked(pass_name: str, chunks: int, q, k, v, grad_out) -> None:
    """The causal attention cut into `chunks` query and key chunks, every visible (query chunk,
    key chunk) pair one SDPA call (diagonal pairs causal, the others full), as a ring pass calls
    FlashAttention chunk by chunk. The partial outputs are not merged (a merge would only add
    time): a lower bound on what chunked FlashAttention-2 calls cost."""
    seq = q.shape[2]
    size = seq // chunks
    for qc in range(chunks):
        rows = slice(qc * size, (qc + 1) * size)
        for kc in range(qc + 1):
            keys = slice(kc * size, (kc + 1) * size)
            out = F.scaled_dot_product_attention(
                q[:, :, rows], k[:, :, keys], v[:, :, keys], is_causal=kc == qc,
                enable_gqa=KV_HEADS != HEADS,
            )
            if pass_name == "fwd+bwd":
                out.backward(grad_out[:, :, rows])


QUEUED = 8


def time_ms(
    backend, pass_name: str, q, k, v, grad_out, chunks: int = 1, wall: bool = False,
    queued: bool = False,
) -> float:
    """Median milliseconds of ITERS iterations after WARMUP, timed with CUDA events; with
    `chunks` > 1, of [`run_chunked`]. With `wall`, timed on the host clock from before the call
    to after `torch.cuda.synchronize()`, the way `benches/kernel_attention.rs` times a single
    call (launch and wait latency included). With `queued`, each iteration is QUEUED calls back
    to back and one wait, on the host clock, divided by QUEUED (the Rust bench's queued rows)."""
    times = []
    calls = QUEUED if queued else 1
    wall = wall or queued
    with sdpa_kernel(backend):
        for i in range(WARMUP + ITERS):
            for t in (q, k, v):
                t.grad = None
            if wall:
                torch.cuda.synchronize()
                begin = time.perf_counter()
            else:
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
            for _ in range(calls):
                if calls > 1:
                    for t in (q, k, v):
                        t.grad = None
                if chunks > 1:
                    run_chunked(pass_name, chunks, q, k, v, grad_out)
                else:
                    run_once(pass_name, q, k, v, grad_out)
            if wall:
                torch.cuda.synchronize()
                elapsed = (time.perf_counter() - begin) * 1e3 / calls
            else:
                end.record()
                torch.cuda.synchronize()
                elapsed = start.elapsed_time(end)
            if i >= WARMUP:
                times.append(elapsed)
    return statistics.median(times)


def first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:300]


def main() -> int:
    global HEAD_DIM, KV_HEADS
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--seqs",
        default="8192,16384,32768",
        help="comma-separated sequence lengths (default: 8192,16384,32768)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write JSON lines to PATH")
    parser.add_argument("--head-dim", type=int, default=HEAD_DIM, help="head dimension (128)")
    parser.add_argument(
        "--kv-heads", type=int, default=HEADS, help="key/value heads (32; fewer is GQA)"
    )
    parser.add_argument(
        "--chunks",
        type=int,
        default=1,
        help="also time FlashAttention-2 and cuDNN called pair by pair over this many chunks "
        "(the sequence must divide evenly)",
    )
    parser.add_argument(
        "--wall-clock",
        action="store_true",
        help="also time FlashAttention-2 and cuDNN on the host clock, one synchronised call at "
        "a time (the method of the Rust bench's single-call rows)",
    )
    parser.add_argument(
        "--queued",
        action="store_true",
        help=f"also time FlashAttention-2 and cuDNN as {QUEUED} calls back to back and one "
        "wait, on the host clock (the method of the Rust bench's queued rows)",
    )
    args = parser.parse_args()
    HEAD_DIM, KV_HEADS = args.head_dim, args.kv_heads
    seqs = [int(s) for s in args.seqs.split(",") if s.strip()]

    if not torch.cuda.is_available():
        print("error: no CUDA device visible to PyTorch", file=sys.stderr)
        return 1

    print(
        f"# PyTorch SDPA anchor, {datetime.date.today().isoformat()}: "
        f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
        f"CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}"
    )
    print(
        f"# causal, {str(DTYPE).replace('torch.', '')}, batch {BATCH}, {HEADS} heads "
        f"({KV_HEADS} kv heads), "
        f"head dim {HEAD_DIM}; median of {ITERS} after {WARMUP} warm-up iterations"
    )

    if args.chunks < 1:
        print(f"error: --chunks must be at least 1 (got {args.chunks})", file=sys.stderr)
        return 1
    backends = list(BACKENDS)
    if args.chunks > 1:
        if any(seq % args.chunks for seq in seqs):
            print(f"error: --chunks {args.chunks} does not divide every sequence", file=sys.stderr)
            return 1
        backends.append((f"torch_sdpa_flash, {args.chunks} chunks", SDPBackend.FLASH_ATTENTION))
        backends.append((f"torch_sdpa_cudnn, {args.chunks} chunks", SDPBackend.CUDNN_ATTENTION))
    if args.wall_clock:
        backends.append(("torch_sdpa_flash, wall clock", SDPBackend.FLASH_ATTENTION))
        backends.append(("torch_sdpa_cudnn, wall clock", SDPBackend.CUDNN_ATTENTION))
    if args.queued:
        backends.append(("torch_sdpa_flash, queued", SDPBackend.FLASH_ATTENTION))
        backends.append(("torch_sdpa_cudnn, queued", SDPBackend.CUDNN_ATTENTION))

    torch.manual_seed(0)
    records = []
    results = {}  # (impl, pass, seq) -> (tflops, ms) or error string
    for seq in seqs:
        q, k, v, grad_out = make_inputs(seq)
        for impl, backend in backends:
            chunks = args.chunks if impl.endswith("chunks") else 1
            wall = impl.endswith("wall clock")
            queued = impl.endswith("queued")
            for pass_name in PASSES:
                try:
                    ms = time_ms(backend, pass_name, q, k, v, grad_out, chunks, wall, queued)
                    tflops = pass_flops(pass_name, seq) / (ms * 1e-3) / 1e12
                    results[(impl, pass_name, seq)] = (tflops, ms)
                    records.append(
                        {"impl": impl, "pass": pass_name, "seq": seq,
                         "tflops": round(tflops, 2), "ms": round(ms, 4)}
                    )
                except Exception as err:  # a backend that cannot run this: report, go on
                    reason = first_line(err)
                    results[(impl, pass_name, seq)] = reason
                    records.append(
                        {"impl": impl, "pass": pass_name, "seq": seq,
                         "tflops": None, "ms": None, "error": reason}
                    )
                    print(f"{impl} {pass_name} S={seq}: n/a ({reason})", file=sys.stderr)
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()
        del q, k, v, grad_out
        torch.cuda.empty_cache()

    # Markdown table: TFLOP/s (median ms); failures as n/a with a numbered reason below.
    reasons = []
    header = "| impl | pass | " + " | ".join(f"S={s}" for s in seqs) + " |"
    print()
    print(header)
    print("| --- | --- | " + " | ".join("---" for _ in seqs) + " |")
    for impl, _ in backends:
        for pass_name in PASSES:
            cells = []
            for seq in seqs:
                result = results[(impl, pass_name, seq)]
                if isinstance(result, str):
                    if result not in reasons:
                        reasons.append(result)
                    cells.append(f"n/a [{reasons.index(result) + 1}]")
                else:
                    tflops, ms = result
                    cells.append(f"{tflops:.1f} ({ms:.2f} ms)")
            print(f"| {impl} | {pass_name} | " + " | ".join(cells) + " |")
    print()
    print("TFLOP/s (median ms); FLOPs: 2*S^2*H*D causal forward, x3.5 for forward+backward.")
    for i, reason in enumerate(reasons, 1):
        print(f"[{i}] n/a: {reason}")

    if args.json:
        with open(args.json, "w") as f:
            for record in records:
                f.write(json.dumps(record) + "\n")
        print(f"wrote {len(records)} records to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
