#!/usr/bin/env python3
"""PyTorch anchor for `examples/llama/benches/llama_train.rs --gpus N`: Llama training with the
sequence split over N GPUs of one host, as a PyTorch user would set it up.

One process per GPU (torchrun). The model is written here the way torchtitan writes it (plain
modules, `F.scaled_dot_product_attention(is_causal=True)`, which context_parallel can replace;
Hugging Face's Llama builds its own masks from the position ids, which the load-balanced shards
break): the Llama-7B shape (hidden 4096, FFN 11008, 32 heads of 128, vocabulary 32000, untied
output projection, RoPE theta 10000) cut to `--layers` blocks, batch 1, AdamW (lr 1e-4), tokens
`(i * 7919 + 13) % vocab` with the same tokens as targets (as the Rust bench). The parts:

  * sequence: `torch.distributed.tensor.experimental.context_parallel` over all N ranks, load
    balanced (head-tail chunks), K/V rotated as a ring (`set_rotate_method("alltoall")`); the
    input ids, targets and position ids are the sharded buffers, so every rank embeds, projects
    and scores only its own tokens; SDPA restricted to one backend (`--backend cudnn|flash`);
  * weights, gradients and optimizer: FSDP2 (`fully_shard`, one unit per decoder layer plus the
    root) over the same N ranks, mixed precision: f32 parameters and AdamW moments sharded 1/N,
    bf16 compute, gradients reduce-scattered in f32 (the counterpart of `llama_train --zero 2`:
    f32 master weights and moments sharded, gradients summed in f32). `--reshard` picks whether
    the gathered bf16 weights are freed after each layer's forward (FSDP's default, ZeRO 3) or
    kept until its backward (ZeRO 2 in memory);
  * checkpointing: none, or per layer (`torch.utils.checkpoint`, non-reentrant; `--checkpoint
    none,layer`).
The loss is the summed cross-entropy of the rank's tokens scaled so that FSDP's average over
ranks gives the mean over the whole sequence; the printed loss is that global mean.

Model FLOPs per token as in the Rust bench: 6 x (parameters - embedding) + 6 x layers x d_model x
S, S the whole sequence (causal attention forward and backward); recomputation not counted.
Timing: wall clock of whole steps (forward, backward, optimizer), a device sync and a barrier
before each, the slowest rank's time per step, the median over `--iters` after `--warmup`.
Peak memory: `torch.cuda.max_memory_reserved()`, the largest over ranks.

Run on the GPU machine (NVLink SHARP/multicast stays off):

    NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc_per_node=2 benches/llama_cp_anchor.py \\
        [--tokens-per-gpu 16384,32768,65536] [--layers 4] [--backend flash|cudnn] \\
        [--checkpoint layer] [--reshard on|off] [--iters 3] [--warmup 2]

Rank 0 prints one markdown row per (checkpointing, tokens per GPU) and, when env OUT is set,
writes the same rows as JSON lines to $OUT/llama_cp_anchor.jsonl. A configuration that runs out
of memory ends the run (exit code 3, after rank 0 prints an "out of memory" row): the other
ranks would wait in the next collective, so torchrun stops them.
"""

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.attention import SDPBackend, sdpa_kernel

from cp_anchor import cp_api  # the context-parallel module of this torch (benches/ is on the path)

BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}
HEADER = ("| implementation | GPUs | tokens/GPU | S | checkpointing | tokens/s | model TFLOP/s/GPU "
          "| MFU | peak reserved GiB | loss |")
H200_BF16_PEAK = 989e12


def int_list(text: str) -> list[int]:
    values = [int(s) for s in text.split(",") if s.strip()]
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens-per-gpu", type=int_list, default=[16384, 32768, 65536])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--backend", choices=sorted(BACKENDS), default="flash",
                        help="the SDPA backend context_parallel runs (default flash)")
    parser.add_argument("--checkpoint", default="layer",
                        help="comma-separated: none, layer (Hugging Face's per-layer)")
    parser.add_argument("--reshard", choices=["on", "off"], default="off",
                        help="free gathered weights after each layer's forward (ZeRO 3) or keep "
                             "them until its backward (default off)")
    parser.add_argument("--iters", type=int, default=3, help="timed steps (median)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    args = parser.parse_args()  # unknown arguments are an error
    if args.layers < 1 or args.iters < 1 or args.warmup < 0:
        parser.error("--layers and --iters must be at least 1, --warmup at least 0")
    checkpoints = args.checkpoint.split(",")
    if any(c not in ("none", "layer") for c in checkpoints):
        parser.error(f"--checkpoint takes none and/or layer, got {args.checkpoint!r}")
    args.checkpoint = checkpoints
    if any(t % 2 for t in args.tokens_per_gpu):
        parser.error("load balancing needs an even --tokens-per-gpu")
    return args


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rotate(x, cos, sin):
    """Llama's rotary embedding (halves rotated), cos/sin `[S, D]` at the tokens' positions."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Block(nn.Module):
    """A Llama decoder layer: pre-norm causal attention and SwiGLU feed-forward."""

    def __init__(self, dim: int, heads: int, ffn: int):
        super().__init__()
        self.heads = heads
        self.attention_norm = RMSNorm(dim)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.ffn_norm = RMSNorm(dim)
        self.gate = nn.Linear(dim, ffn, bias=False)
        self.up = nn.Linear(dim, ffn, bias=False)
        self.down = nn.Linear(ffn, dim, bias=False)

    def forward(self, x, cos, sin):
        batch, seq, dim = x.shape
        h = self.attention_norm(x)
        q, k, v = (w(h).view(batch, seq, self.heads, -1).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        # Looked up through F at call time: inside context_parallel this is torch's ring.
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(out.transpose(1, 2).reshape(batch, seq, dim))
        h = self.ffn_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    """The Llama-7B shape cut to `layers` blocks; `forward` returns the summed cross-entropy of
    this rank's tokens (the output projection untied from the embedding)."""

    def __init__(self, layers: int, checkpoint: bool, dim=4096, heads=32, ffn=11008,
                 vocab=32000, theta=10000.0):
        super().__init__()
        self.vocab, self.dim, self.head_dim, self.theta = vocab, dim, dim // heads, theta
        self.checkpoint = checkpoint
        self.embedding = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads, ffn) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids, targets, positions):
        inv_freq = 1.0 / self.theta ** (
            torch.arange(0, self.head_dim, 2, device=ids.device, dtype=torch.float32)
            / self.head_dim)
        angles = positions[0].float()[:, None] * inv_freq[None, :]
        angles = torch.cat((angles, angles), dim=-1)
        x = self.embedding(ids)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        for layer in self.layers:
            if self.checkpoint:
                x = torch.utils.checkpoint.checkpoint(layer, x, cos, sin, use_reentrant=False)
            else:
                x = layer(x, cos, sin)
        logits = self.output(self.norm(x)).float()
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")


def build_model(layers: int, checkpoint: str, mesh, reshard: bool):
    """The model with f32 parameters sharded by FSDP2, bf16 compute, f32 gradient reduction."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)  # the same initial weights on every rank before sharding
    with torch.device("cuda"):
        model = Llama(layers, checkpoint == "layer")
    for parameter in model.parameters():
        if parameter.dim() > 1:
            nn.init.normal_(parameter, std=0.02)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
    return model


def train_step(model, optimizer, ids, targets, positions, world: int, total: int) -> torch.Tensor:
    """One step on this rank's shard; returns the global mean loss (a 0-d tensor)."""
    local_sum = model(ids, targets, positions)
    # FSDP averages gradients over the ranks: scaling by world / total gives the global mean's.
    (local_sum * (world / total)).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    loss = local_sum.detach().float()
    dist.all_reduce(loss)
    return loss / total


def run(args, cp, mesh, tokens_per_gpu: int, checkpoint: str):
    """(tokens/s, model TFLOP/s per GPU, peak reserved GiB over ranks, last loss)."""
    world = mesh.size()
    seq = tokens_per_gpu * world
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model = build_model(args.layers, checkpoint, mesh, args.reshard == "on")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.tensor([(i * 7919 + 13) % model.vocab for i in range(seq)],
                       device="cuda").unsqueeze(0)
    targets = ids.clone()
    positions = torch.arange(seq, device="cuda").unsqueeze(0)
    cp._cp_options.enable_load_balance = True
    times, loss = [], float("nan")
    buffers = [ids, targets, positions]
    with cp.context_parallel(mesh, buffers=buffers, buffer_seq_dims=[1, 1, 1],
                             no_restore_buffers=set(buffers)):
        with sdpa_kernel(BACKENDS[args.backend]):
            for step in range(args.warmup + args.iters):
                torch.cuda.synchronize()
                dist.barrier()
                start = time.perf_counter()
                loss_tensor = train_step(model, optimizer, ids, targets, positions, world, seq)
                torch.cuda.synchronize()
                elapsed = torch.tensor(time.perf_counter() - start, device="cuda")
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                if step >= args.warmup:
                    times.append(elapsed.item())
                loss = loss_tensor.item()
    secs = statistics.median(times)
    params = sum(p.numel() for p in model.parameters())  # FSDP2: DTensor numel is global
    embedding = model.vocab * model.dim
    flops_per_token = 6.0 * (params - embedding) + 6.0 * args.layers * model.dim * seq
    peak = torch.tensor(torch.cuda.max_memory_reserved() / 2**30, device="cuda")
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    del model, optimizer
    return seq / secs, flops_per_token * seq / secs / world / 1e12, peak.item(), loss


def main() -> int:
    args = parse_args()
    if "LOCAL_RANK" not in os.environ:
        print("error: launch with torchrun --standalone --nproc_per_node=N", file=sys.stderr)
        return 2
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # the launcher should already set it
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank),
                            timeout=datetime.timedelta(minutes=20))
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cuda", (world,), mesh_dim_names=("cp",))
    cp = cp_api()
    cp.set_rotate_method("alltoall")
    implementation = f"PyTorch CP+FSDP2 ({args.backend})"
    jsonl = None
    if rank == 0:
        print(f"# PyTorch Llama context-parallel anchor, {datetime.date.today().isoformat()}: "
              f"{world} x {torch.cuda.get_device_name(local_rank)}, torch {torch.__version__}, "
              f"NCCL "
              f"{'.'.join(map(str, torch.cuda.nccl.version()))}")
        print(f"# Llama-7B shape, {args.layers} layers, batch 1, AdamW, FSDP2 f32 master / bf16 "
              f"compute / f32 reduce, reshard {args.reshard}; SDPA {args.backend}; median of "
              f"{args.iters} after {args.warmup} warm-up")
        print()
        print(HEADER)
        print("|" + " --- |" * (HEADER.count("|") - 1), flush=True)
        if os.environ.get("OUT"):
            os.makedirs(os.environ["OUT"], exist_ok=True)
            jsonl = open(os.path.join(os.environ["OUT"], "llama_cp_anchor.jsonl"), "w")
    for checkpoint in args.checkpoint:
        for tokens in args.tokens_per_gpu:
            seq = tokens * world
            try:
                tok_s, tflops, gib, loss = run(args, cp, mesh, tokens, checkpoint)
                row = (f"| {implementation} | {world} | {tokens} | {seq} | {checkpoint} "
                       f"| {tok_s:.0f} | {tflops:.1f} | {100 * tflops * 1e12 / H200_BF16_PEAK:.1f}% "
                       f"| {gib:.1f} | {loss:.3f} |")
                record = {"impl": implementation, "world": world, "tokens_per_gpu": tokens,
                          "seq": seq, "checkpoint": checkpoint, "tokens_per_s": round(tok_s),
                          "tflops_per_gpu": round(tflops, 2), "peak_reserved_gib": round(gib, 2),
                          "loss": loss, "layers": args.layers, "reshard": args.reshard}
            except torch.cuda.OutOfMemoryError:
                print(f"| {implementation} | {world} | {tokens} | {seq} | {checkpoint} "
                      f"| out of memory on rank {rank} | | | | |", flush=True)
                return 3
            if rank == 0:
                print(row, flush=True)
                if jsonl:
                    jsonl.write(json.dumps(record) + "\n")
                    jsonl.flush()
    if jsonl:
        jsonl.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
