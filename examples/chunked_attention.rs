//! Distributed-style chunked attention on the CPU path: one causal sequence is split into
//! `--chunks` equal shards, as a device group would hold it. Each query shard steps the
//! stat-carrying forward kernel over the key/value shards it may see (ring order: its own shard
//! first, then earlier ones), the last shard also builds its state as two merged partials (what
//! the load-balanced schedule does), and the result is compared with the f64 reference of the
//! test-only `distflash-test-support` crate. The backward of every (query shard, key shard) pair is
//! accumulated the same way and checked too.
//!
//! `cargo run --release --example chunked_attention -- [--seq 512] [--chunks 4] [--heads 4]
//! [--kv-heads 2] [--head-dim 64]` (`-- --help` lists them with their defaults). Runs on wgpu; on a machine without a GPU that is Mesa's
//! software Vulkan (`apt-get install mesa-vulkan-drivers`).

use clap::{value_parser, Parser};
use cubecl::wgpu::{WgpuDevice, WgpuRuntime};
use cubecl::Runtime;
use distflash_kernels::{
    AttentionDims, DeviceTensor, ElemType, GradAccumulators, Mask, SoftmaxState, StepOptions,
};
use distflash_test_support::{self as oracle, exact};

/// The example's command line.
#[derive(Parser)]
#[command(about = "One causal sequence in chunks through the stat-carrying kernels, against f64")]
struct Args {
    /// Tokens of the whole sequence (a multiple of --chunks)
    #[arg(long, value_name = "TOKENS", value_parser = value_parser!(u64).range(1..), default_value_t = 512)]
    seq: u64,
    /// Shards the sequence is cut into
    #[arg(long, value_name = "N", value_parser = value_parser!(u64).range(1..), default_value_t = 4)]
    chunks: u64,
    /// Query heads (a multiple of --kv-heads)
    #[arg(long, value_name = "N", value_parser = value_parser!(u64).range(1..), default_value_t = 4)]
    heads: u64,
    /// Key/value heads
    #[arg(long, value_name = "N", value_parser = value_parser!(u64).range(1..), default_value_t = 2)]
    kv_heads: u64,
    /// Head dimension
    #[arg(long, value_name = "D", value_parser = value_parser!(u64).range(1..), default_value_t = 64)]
    head_dim: u64,
}

/// Rows `[start, end)` of every head of a `[1, heads, len, d]` host tensor.
fn rows(data: &[f64], heads: usize, len: usize, d: usize, start: usize, end: usize) -> Vec<f32> {
    (0..heads)
        .flat_map(|h| {
            data[(h * len + start) * d..(h * len + end) * d]
                .iter()
                .map(|&x| x as f32)
        })
        .collect()
}

fn main() {
    let args = Args::parse();
    let (seq, chunks) = (args.seq as usize, args.chunks as usize);
    let (heads, kv_heads, d) = (
        args.heads as usize,
        args.kv_heads as usize,
        args.head_dim as usize,
    );
    if seq % chunks != 0 || heads % kv_heads != 0 {
        eprintln!(
            "error: --seq ({seq}) must be a multiple of --chunks ({chunks}) and --heads ({heads}) \
             of --kv-heads ({kv_heads})"
        );
        std::process::exit(2);
    }
    let shard = seq / chunks;
    let client = WgpuRuntime::client(&WgpuDevice::Cpu);
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let mut random = |n: usize| -> Vec<f64> {
        (0..n)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                ((state >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) as f32 as f64
            })
            .collect()
    };
    let (q, k, v, dout) = (
        random(heads * seq * d),
        random(kv_heads * seq * d),
        random(kv_heads * seq * d),
        random(heads * seq * d),
    );
    let upload = |data: Vec<f32>, h: usize| {
        DeviceTensor::from_f32(&client, &data, vec![1, h, shard, d], ElemType::F32)
    };
    let q_shards: Vec<_> = (0..chunks)
        .map(|p| upload(rows(&q, heads, seq, d, p * shard, (p + 1) * shard), heads))
        .collect();
    let k_shards: Vec<_> = (0..chunks)
        .map(|p| {
            upload(
                rows(&k, kv_heads, seq, d, p * shard, (p + 1) * shard),
                kv_heads,
            )
        })
        .collect();
    let v_shards: Vec<_> = (0..chunks)
        .map(|p| {
            upload(
                rows(&v, kv_heads, seq, d, p * shard, (p + 1) * shard),
                kv_heads,
            )
        })
        .collect();
    let do_shards: Vec<_> = (0..chunks)
        .map(|p| {
            upload(
                rows(&dout, heads, seq, d, p * shard, (p + 1) * shard),
                heads,
            )
        })
        .collect();
    let pair_options = |qp: usize, kp: usize| StepOptions {
        mask: Mask::causal().at((qp * shard) as i64, (kp * shard) as i64),
        ..StepOptions::default()
    };

    // Forward: query shard p meets key shards p, p-1, ..., 0 (ring order).
    let mut outputs = Vec::new();
    for (p, q_shard) in q_shards.iter().enumerate() {
        let stepped = SoftmaxState::empty(&client, 1, heads, shard, d).unwrap();
        for kp in (0..=p).rev() {
            distflash_kernels::forward_step(
                &client,
                q_shard,
                &k_shards[kp],
                &v_shards[kp],
                &stepped,
                &pair_options(p, kp),
            )
            .unwrap();
        }
        outputs.push(distflash_kernels::finalize(&client, &stepped, ElemType::F32).unwrap());
    }
    // The last shard again, as two independent partials merged (a helper's contribution).
    let last = chunks - 1;
    let (own, helped) = (
        SoftmaxState::empty(&client, 1, heads, shard, d).unwrap(),
        SoftmaxState::empty(&client, 1, heads, shard, d).unwrap(),
    );
    for kp in 0..=last {
        let target = if kp >= last / 2 { &own } else { &helped };
        distflash_kernels::forward_step(
            &client,
            &q_shards[last],
            &k_shards[kp],
            &v_shards[kp],
            target,
            &pair_options(last, kp),
        )
        .unwrap();
    }
    distflash_kernels::merge(&client, &own, &helped).unwrap();
    let (merged_out, _) = distflash_kernels::finalize(&client, &own, ElemType::F32).unwrap();

    // Backward: per pair, dq stays with the query shard, dk/dv with the key shard.
    let dims = |kv_len| AttentionDims {
        batch: 1,
        q_heads: heads,
        kv_heads,
        q_len: shard,
        kv_len,
        head_dim: d,
    };
    let dk_acc: Vec<_> = (0..chunks)
        .map(|_| distflash_kernels::zeros_f32(&client, vec![1, kv_heads, shard, d]).unwrap())
        .collect();
    let dv_acc: Vec<_> = (0..chunks)
        .map(|_| distflash_kernels::zeros_f32(&client, vec![1, kv_heads, shard, d]).unwrap())
        .collect();
    let mut dq_acc = Vec::new();
    for (p, (out, lse)) in outputs.iter().enumerate() {
        let delta = distflash_kernels::backward_delta(&client, out, &do_shards[p]).unwrap();
        let dq = distflash_kernels::zeros_f32(&client, dims(shard).q_shape()).unwrap();
        for kp in 0..=p {
            let grads = GradAccumulators {
                dq: dq.clone(),
                dk: dk_acc[kp].clone(),
                dv: dv_acc[kp].clone(),
            };
            distflash_kernels::backward_step(
                &client,
                &q_shards[p],
                &k_shards[kp],
                &v_shards[kp],
                &do_shards[p],
                lse,
                &delta,
                &grads,
                &pair_options(p, kp),
            )
            .unwrap();
        }
        dq_acc.push(dq);
    }

    let full = AttentionDims {
        q_len: seq,
        kv_len: seq,
        ..dims(seq)
    };
    let scale = 1.0 / (d as f64).sqrt();
    let fwd = oracle::forward(&full, &q, &k, &v, &Mask::causal(), scale, exact);
    let grads = oracle::backward(&full, &q, &k, &v, &dout, &Mask::causal(), scale, exact);
    let gather = |parts: Vec<Vec<f32>>, h: usize| -> Vec<f64> {
        let mut full = vec![0.0; h * seq * d];
        for (p, part) in parts.iter().enumerate() {
            for head in 0..h {
                for (i, x) in part[head * shard * d..(head + 1) * shard * d]
                    .iter()
                    .enumerate()
                {
                    full[(head * seq + p * shard) * d + i] = *x as f64;
                }
            }
        }
        full
    };
    let read = |t: &DeviceTensor| t.to_f32(&client);
    let out = gather(outputs.iter().map(|(o, _)| read(o)).collect(), heads);
    let merged: Vec<f64> = read(&merged_out).iter().map(|&x| x as f64).collect();
    let merged_ref = rows(&fwd.out, heads, seq, d, last * shard, seq)
        .iter()
        .map(|&x| x as f64)
        .collect::<Vec<_>>();
    println!("causal attention, {seq} tokens in {chunks} shards, {heads} query heads over {kv_heads} kv heads, head dim {d}, f32 on wgpu");
    println!("max |error| vs f64 reference:");
    println!(
        "  output (ring order steps)  {:.2e}",
        oracle::max_abs_diff(&out, &fwd.out)
    );
    println!(
        "  last shard (merged halves) {:.2e}",
        oracle::max_abs_diff(&merged, &merged_ref)
    );
    println!(
        "  dq {:.2e}",
        oracle::max_abs_diff(&gather(dq_acc.iter().map(read).collect(), heads), &grads.dq)
    );
    println!(
        "  dk {:.2e}",
        oracle::max_abs_diff(
            &gather(dk_acc.iter().map(read).collect(), kv_heads),
            &grads.dk
        )
    );
    println!(
        "  dv {:.2e}",
        oracle::max_abs_diff(
            &gather(dv_acc.iter().map(read).collect(), kv_heads),
            &grads.dv
        )
    );
}
