"""PyTorch context-parallel ring attention as the anchor for our sequence-parallel benchmark.

Measures `torch.distributed.tensor.experimental.context_parallel` around
`F.scaled_dot_product_attention(is_causal=True)` on N GPUs of one host: causal, bf16, batch 1,
32 heads, head dim 128, total sequence S = tokens_per_gpu * world_size. q, k, v and dO are
created at full length on every rank (same seed) and sharded along the sequence (dim 2) by
`context_parallel(mesh, buffers=[q, k, v, dO], buffer_seq_dims=[2, 2, 2, 2], ...)`. The SDPA
backend is forced with `sdpa_kernel(SDPBackend.CUDNN_ATTENTION)` (or FLASH_ATTENTION).

  * rotation: torch's own default is "allgather"; this script calls
    `set_rotate_method("alltoall")` (a ring: each step hands the K/V shard to the next rank)
    unless `--rotate allgather`. The backward always rotates dK/dV with all-to-all.
  * load balance: `_cp_options.enable_load_balance` (head-tail reordering of the sequence),
    on, off or both (default both; "on" needs an even tokens-per-GPU).

Timing: CUDA events, 3 warm-up iterations then K timed ones (`--iters`, default 10); every
iteration starts after a device sync and `dist.barrier()`. An iteration's time is the slowest
rank's; the median over iterations is reported. Passes as in benches/sdpa_anchor.py: "fwd" is
the forward of a training step (inputs require grad), "fwd+bwd" adds backward from dO.
FLOPs follow FlashAttention: causal forward of the whole sequence = 4 * S^2 * H * D / 2,
forward+backward = 3.5x that; the CP rate per GPU divides by world size. Rank 0 also times
plain single-GPU SDPA (same backend) on the full sequence S ("-" when it does not fit or fails),
so PyTorch's own CP efficiency = per-GPU CP rate / single-GPU rate (the "eff_*" JSON fields).

Run on the GPU machine (NCCL_NVLS_ENABLE=0 belongs to the launcher: NVLink SHARP/multicast
must stay off there; the script only sets it if it is missing):

    NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc_per_node=8 benches/cp_anchor.py \\
        [--tokens-per-gpu 8192,16384,32768] [--heads 32] [--head-dim 128] [--iters 10] \\
        [--load-balance on|off|both] [--backend cudnn|flash] [--rotate alltoall|allgather]

Rank 0 prints one markdown row per (tokens/GPU, load balance) and, when env OUT is set, writes
the same rows as JSON lines to $OUT/cp_anchor.jsonl.
"""

import argparse
import datetime
import importlib
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.attention import SDPBackend, sdpa_kernel

BATCH = 1
DTYPE = torch.bfloat16
WARMUP = 3
BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}
LOAD_BALANCE = {"on": [True], "off": [False], "both": [True, False]}
HEADER = ("| world | tokens/GPU | total | lb | fwd TFLOP/s/GPU | fwd+bwd TFLOP/s/GPU "
          "| single-GPU fwd | single-GPU fwd+bwd |")


def int_list(text: str) -> list[int]:
    values = [int(s) for s in text.split(",") if s.strip()]
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens-per-gpu", type=int_list, default=[8192, 16384, 32768])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--iters", type=int, default=10, help="timed iterations (median)")
    parser.add_argument("--load-balance", choices=sorted(LOAD_BALANCE), default="both")
    parser.add_argument("--backend", choices=sorted(BACKENDS), default="cudnn")
    parser.add_argument("--rotate", choices=["alltoall", "allgather"], default="alltoall",
                        help="K/V rotation; alltoall is the ring (default)")
    args = parser.parse_args()  # unknown arguments are an error
    if args.iters < 1:
        parser.error("--iters must be at least 1")
    if args.load_balance != "off" and any(t % 2 for t in args.tokens_per_gpu):
        parser.error("load balancing needs an even --tokens-per-gpu")
    return args


def cp_api():
    """The module holding context_parallel, set_rotate_method and _cp_options (torch 2.11:
    experimental/_attention.py re-exports experimental/_context_parallel/_attention.py)."""
    for name in ("torch.distributed.tensor.experimental._attention",
                 "torch.distributed.tensor.experimental._context_parallel"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if all(hasattr(module, a) for a in ("context_parallel", "set_rotate_method", "_cp_options")):
            return module
    raise ImportError("torch context-parallel API (context_parallel, set_rotate_method) not found")


def causal_fwd_flops(seq: int, heads: int, head_dim: int) -> float:
    """FlashAttention's count for the whole sequence: 4 * S^2 * H * D / 2 (times the batch)."""
    return BATCH * 4.0 * seq * seq * heads * head_dim / 2.0


def sdpa_step(q, k, v, dout, backward: bool) -> None:
    # Looked up through F at call time: inside context_parallel this is torch's CP wrapper.
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if backward:
        out.backward(dout)


def time_iters(q, k, v, dout, backward: bool, iters: int, distributed: bool) -> list[float]:
    """Milliseconds of `iters` iterations after WARMUP (CUDA events, barrier before each)."""
    times = []
    for i in range(WARMUP + iters):
        for t in (q, k, v):
            t.grad = None
        torch.cuda.synchronize()
        if distributed:
            dist.barrier()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        sdpa_step(q, k, v, dout, backward)
        end.record()
        torch.cuda.synchronize()
        if i >= WARMUP:
            times.append(start.elapsed_time(end))
    return times


def measure_cp(cp, mesh, args, tokens_per_gpu: int, load_balance: bool) -> tuple[float, float]:
    """Median (fwd ms, fwd+bwd ms) of context-parallel SDPA, slowest rank per iteration."""
    shape = (BATCH, args.heads, tokens_per_gpu * mesh.size(), args.head_dim)
    torch.manual_seed(0)  # identical full tensors on every rank
    q, k, v, dout = (torch.randn(shape, dtype=DTYPE, device="cuda") for _ in range(4))
    cp._cp_options.enable_load_balance = load_balance  # read when sharding and in the ring
    buffers = [q, k, v, dout]
    results = []
    # Buffers must not require grad here: context_parallel shards them in place (resize_).
    with cp.context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2] * len(buffers),
                             no_restore_buffers=set(buffers)):
        for t in (q, k, v):
            t.requires_grad_(True)
        with sdpa_kernel(BACKENDS[args.backend]):
            for backward in (False, True):
                times = torch.tensor(time_iters(q, k, v, dout, backward, args.iters, True),
                                     device="cuda")
                dist.all_reduce(times, op=dist.ReduceOp.MAX)
                results.append(statistics.median(times.tolist()))
        for t in (q, k, v):
            t.grad = None
            t.requires_grad_(False)
    return results[0], results[1]


def measure_single(args, seq: int):
    """Median (fwd ms, fwd+bwd ms) of plain SDPA on this GPU over the full sequence, or
    (None, None) if it does not fit (or the backend refuses it)."""
    shape = (BATCH, args.heads, seq, args.head_dim)
    try:
        torch.manual_seed(0)
        q, k, v = (torch.randn(shape, dtype=DTYPE, device="cuda", requires_grad=True)
                   for _ in range(3))
        dout = torch.randn(shape, dtype=DTYPE, device="cuda")
        with sdpa_kernel(BACKENDS[args.backend]):
            return tuple(statistics.median(time_iters(q, k, v, dout, backward, args.iters, False))
                         for backward in (False, True))
    except Exception as err:  # torch.OutOfMemoryError above all
        text = str(err).strip().splitlines()
        print(f"single-GPU S={seq}: - ({type(err).__name__}: {text[0] if text else ''})",
              file=sys.stderr)
        return None, None


def tflops(flops: float, ms) -> float | None:
    return None if ms is None else flops / (ms * 1e-3) / 1e12


def cell(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def main() -> int:
    args = parse_args()
    if "LOCAL_RANK" not in os.environ:
        print("error: launch with torchrun --standalone --nproc_per_node=N", file=sys.stderr)
        return 2
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # the launcher should already set it
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    # Long timeout: the other ranks wait in a barrier while rank 0 times single-GPU SDPA.
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank),
                            timeout=datetime.timedelta(minutes=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cuda", (world,), mesh_dim_names=("cp",))
    cp = cp_api()
    cp.set_rotate_method(args.rotate)

    jsonl = None
    if rank == 0:
        print(f"# PyTorch context_parallel anchor, {datetime.date.today().isoformat()}: "
              f"{world} x {torch.cuda.get_device_name(local_rank)}, torch {torch.__version__}, "
              f"CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}, "
              f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")
        print(f"# causal bf16, batch {BATCH}, {args.heads} heads, head dim {args.head_dim}; "
              f"SDPA backend {args.backend}, rotate {args.rotate}; median of {args.iters} after "
              f"{WARMUP} warm-up; FLOPs 2*S^2*H*D (x3.5 fwd+bwd), CP rate divided by world")
        print()
        print(HEADER)
        print("|" + " --- |" * (HEADER.count("|") - 1), flush=True)
        if os.environ.get("OUT"):
            os.makedirs(os.environ["OUT"], exist_ok=True)
            jsonl = open(os.path.join(os.environ["OUT"], "cp_anchor.jsonl"), "w")

    for tokens in args.tokens_per_gpu:
        seq = tokens * world
        fwd_flops = causal_fwd_flops(seq, args.heads, args.head_dim)
        cp_ms = {lb: measure_cp(cp, mesh, args, tokens, lb)
                 for lb in LOAD_BALANCE[args.load_balance]}
        torch.cuda.empty_cache()
        single_ms = measure_single(args, seq) if rank == 0 else (None, None)
        torch.cuda.empty_cache()
        dist.barrier()
        if rank != 0:
            continue
        single = (tflops(fwd_flops, single_ms[0]), tflops(3.5 * fwd_flops, single_ms[1]))
        for lb, (fwd_ms, fwd_bwd_ms) in cp_ms.items():
            per_gpu = (tflops(fwd_flops / world, fwd_ms), tflops(3.5 * fwd_flops / world, fwd_bwd_ms))
            eff = [None if s is None else round(c / s, 4) for c, s in zip(per_gpu, single)]
            print(f"| {world} | {tokens} | {seq} | {'on' if lb else 'off'} | {cell(per_gpu[0])} "
                  f"| {cell(per_gpu[1])} | {cell(single[0])} | {cell(single[1])} |", flush=True)
            if jsonl:
                record = {
                    "impl": f"torch_cp_{args.backend}", "rotate": args.rotate, "world": world,
                    "tokens_per_gpu": tokens, "total": seq, "lb": lb,
                    "heads": args.heads, "head_dim": args.head_dim,
                    "fwd_ms": round(fwd_ms, 4), "fwd_bwd_ms": round(fwd_bwd_ms, 4),
                    "fwd_tflops_per_gpu": round(per_gpu[0], 2),
                    "fwd_bwd_tflops_per_gpu": round(per_gpu[1], 2),
                    "single_fwd_tflops": None if single[0] is None else round(single[0], 2),
                    "single_fwd_bwd_tflops": None if single[1] is None else round(single[1], 2),
                    "eff_fwd": eff[0], "eff_fwd_bwd": eff[1], "torch": torch.__version__,
                }
                jsonl.write(json.dumps(record) + "\n")
                jsonl.flush()

    if jsonl:
        jsonl.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
