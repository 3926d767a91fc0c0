#!/usr/bin/env python3
"""PyTorch anchor for `examples/llama/benches/llama_train.rs --gpus 1`: one training step of a
Hugging Face `LlamaForCausalLM` with the same shape, data, optimizer and FLOP count.

Llama-7B shape (hidden 4096, FFN 11008, 32 heads of 128, vocabulary 32000) cut to `--layers`
blocks, bf16 weights, AdamW, batch 1, SDPA restricted to one backend (`--sdpa`: FlashAttention-2
by default, or cuDNN), eager (no torch.compile). Tokens are the Rust bench's
`(i * 7919 + 13) % vocab`, inputs = labels.
Each configuration runs with and without gradient checkpointing (Hugging Face's per-layer
checkpointing, non-reentrant).

Model FLOPs per token, as in the Rust bench: 6 x (parameters - embedding) + 6 x layers x
d_model x S; recomputation is not counted. Prints one markdown row per configuration: tokens/s,
model TFLOP/s, peak reserved memory (GiB), the last loss.

    python3 benches/llama_anchor.py [--seqs 8192,32768] [--layers 4] [--iters 3] [--sdpa flash|cudnn]
"""

import argparse
import datetime
import statistics
import time

import torch

# The SDPA backends `--sdpa` names, as `torch.nn.attention.SDPBackend` members, with the name
# printed in the header.
SDPA_BACKENDS = {
    "flash": ("FLASH_ATTENTION", "FlashAttention-2"),
    "cudnn": ("CUDNN_ATTENTION", "cuDNN"),
}


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", default="8192,32768", help="comma-separated sequence lengths")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--iters", type=int, default=3, help="timed steps (median reported)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument(
        "--checkpoint",
        default="none,layer",
        help="comma-separated: none (no checkpointing), layer (Hugging Face's per-layer)",
    )
    parser.add_argument(
        "--sdpa",
        choices=sorted(SDPA_BACKENDS),
        default="flash",
        help="the one SDPA backend attention may use: flash (FlashAttention-2) or cudnn",
    )
    return parser.parse_args()


def build_model(layers, seq, checkpoint):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=32,
        max_position_embeddings=seq,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config).to(device="cuda", dtype=torch.bfloat16)
    model.train()
    if checkpoint == "layer":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    return model, config


def run(seq, layers, iters, warmup, checkpoint, sdpa):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model, config = build_model(layers, seq, checkpoint)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.tensor(
        [(i * 7919 + 13) % config.vocab_size for i in range(seq)], device="cuda"
    ).unsqueeze(0)
    times, loss = [], float("nan")
    with sdpa_kernel([getattr(SDPBackend, SDPA_BACKENDS[sdpa][0])]):
        for step in range(warmup + iters):
            torch.cuda.synchronize()
            start = time.perf_counter()
            out = model(input_ids=tokens, labels=tokens)
            out.loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            if step >= warmup:
                times.append(time.perf_counter() - start)
            loss = out.loss.item()
    secs = statistics.median(times)
    params = sum(p.numel() for p in model.parameters())
    embedding = config.vocab_size * config.hidden_size
    flops_per_token = 6.0 * (params - embedding) + 6.0 * layers * config.hidden_size * seq
    reserved = torch.cuda.max_memory_reserved() / 2**30
    del model, optimizer
    return seq / secs, flops_per_token * seq / secs / 1e12, reserved, loss


def main():
    args = parse_args()
    seqs = [int(s) for s in args.seqs.split(",")]
    print(
        f"# PyTorch HF Llama anchor, {datetime.date.today()}: {torch.cuda.get_device_name()}, "
        f"torch {torch.__version__}, layers {args.layers}, bf16, AdamW, batch 1, "
        f"SDPA {SDPA_BACKENDS[args.sdpa][1]}, eager; median of {args.iters} after {args.warmup} warm-up"
    )
    print("| implementation | checkpointing | S | tokens/s | model TFLOP/s | peak reserved GiB | loss |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    label = f"PyTorch HF Llama, {SDPA_BACKENDS[args.sdpa][1]}"
    for checkpoint in args.checkpoint.split(","):
        for seq in seqs:
            try:
                tok, tflops, gib, loss = run(
                    seq, args.layers, args.iters, args.warmup, checkpoint, args.sdpa
                )
                print(
                    f"| {label} | {checkpoint} | {seq} | {tok:.0f} | {tflops:.1f} "
                    f"| {gib:.1f} | {loss:.3f} |",
                    flush=True,
                )
            except torch.cuda.OutOfMemoryError:
                print(f"| {label} | {checkpoint} | {seq} | out of memory | | | |", flush=True)
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
