//! Cutting a whole sequence into the ranks' shards for a [`Layout`], and joining shards back.

use crate::Error;
use burn::tensor::backend::Backend;
use burn::tensor::{BasicOps, Tensor};

use crate::schedule::Layout;

fn error(layout: Layout, world: usize, what: String) -> Error {
    Error::Layout {
        layout,
        world,
        what,
    }
}

fn check_dim<const D: usize>(layout: Layout, world: usize, dim: usize) -> Result<(), Error> {
    if dim >= D {
        return Err(error(
            layout,
            world,
            format!("the sequence dimension must be below the tensor's rank {D}; got {dim}"),
        ));
    }
    Ok(())
}

/// Rank `rank`'s shard of `full`, a whole-sequence tensor whose dimension `dim` is the sequence
/// (`2` for q, k, v, `1` for tokens; float, int or bool), for `world` ranks under `layout` (the one
/// [`crate::sequence_parallel::SequenceParallelOptions::layout`] gives). The chunks are
/// concatenated in the layout's local order.
///
/// # Shapes
///
/// - full: any shape with `seq` at dimension `dim`, e.g. `[batch, heads, seq, head_dim]` (q, k,
///   v) or `[batch, seq]` (tokens)
/// - output: like `full`, with `seq / world` at dimension `dim`
///
/// # Errors
///
/// [`Error`] when `dim` is not below the tensor's rank `D`, when `world` is zero, when
/// `seq` is zero or not a multiple of the layout's number of chunks (`world`, or `2 * world`
/// for zigzag), or when `rank` is not below `world`.
pub fn shard_sequence<B: Backend, const D: usize, K: BasicOps<B>>(
    full: Tensor<B, D, K>,
    dim: usize,
    layout: Layout,
    world: usize,
    rank: usize,
) -> Result<Tensor<B, D, K>, Error> {
    check_dim::<D>(layout, world, dim)?;
    let shard_len = layout.shard_len(world, full.dims()[dim])?;
    if rank >= world {
        return Err(error(
            layout,
            world,
            format!("ranks are 0..{world}; got rank {rank}"),
        ));
    }
    let pieces: Vec<Tensor<B, D, K>> = (layout.ranges(world, rank, shard_len)?.into_iter())
        .map(|r| full.clone().narrow(dim, r.start, r.len()))
        .collect();
    Ok(Tensor::cat(pieces, dim))
}

/// The whole sequence from every rank's shard (`shards[r]` from rank `r`, the sequence along
/// dimension `dim`), the inverse of [`shard_sequence`].
///
/// # Shapes
///
/// - each of shards: one shape with `shard_len` at dimension `dim`, e.g.
///   `[batch, heads, shard_len, head_dim]`
/// - output: like a shard, with `shards.len() * shard_len` at dimension `dim`
///
/// # Errors
///
/// [`Error`] when `dim` is not below the tensors' rank `D`, when `shards` is empty, when
/// the shards' lengths along `dim` differ, or when `shard_len` is zero or (zigzag) odd.
///
/// # Panics
///
/// When shards differ in a dimension other than `dim` (Burn's `Tensor::cat` refuses them).
pub fn gather_sequence<B: Backend, const D: usize, K: BasicOps<B>>(
    shards: Vec<Tensor<B, D, K>>,
    dim: usize,
    layout: Layout,
) -> Result<Tensor<B, D, K>, Error> {
    let world = shards.len();
    check_dim::<D>(layout, world, dim)?;
    let Some(first) = shards.first() else {
        return Err(error(layout, 0, "no shards to gather".into()));
    };
    let shard_len = first.dims()[dim];
    if let Some((rank, s)) = (shards.iter().enumerate()).find(|(_, s)| s.dims()[dim] != shard_len) {
        return Err(error(
            layout,
            world,
            format!(
                "every shard must have the same length; rank 0 has {shard_len} but rank {rank} \
                 has {}",
                s.dims()[dim]
            ),
        ));
    }
    layout.check_shard_len(world, shard_len)?;
    let chunk = shard_len / layout.chunks_per_rank();
    let mut pieces: Vec<(usize, Tensor<B, D, K>)> = Vec::with_capacity(layout.num_chunks(world));
    for (rank, shard) in shards.into_iter().enumerate() {
        for (local, c) in layout.chunks(world, rank).into_iter().enumerate() {
            pieces.push((c, shard.clone().narrow(dim, local * chunk, chunk)));
        }
    }
    pieces.sort_by_key(|(c, _)| *c);
    Ok(Tensor::cat(
        pieces.into_iter().map(|(_, t)| t).collect(),
        dim,
    ))
}
