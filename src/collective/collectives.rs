//! Collectives on point-to-point exchanges, the default of [`Transport::all_reduce`],
//! [`Transport::reduce_scatter`] and [`Transport::all_gather`] (the in-process transport's), and
//! the checks every transport makes before a collective moves anything.
//!
//! Order of the sums: the flattened tensor is cut into `P` chunks (chunk `j` holds elements
//! `j * len / P .. (j + 1) * len / P`); rank `j` receives every rank's chunk `j` and adds the
//! contributions in rank order, `((x_0 + x_1) + x_2) + ...`, in f32 for f16 and bf16 (rounded to
//! the input's type once, at the end). An all-reduce then gathers the chunks' sums. Every element
//! is summed once, by one rank, so every rank gets bitwise the same result.

use std::ops::Range;

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, FloatDType, Shape, Slice};

use super::{Incoming, MessageKind, Outgoing, Received, TensorLayout, Transport};
use crate::Error;

/// The float types the collectives take. In-process, f16 and bf16 are summed in f32 and rounded
/// once; over NCCL, sums are NCCL's own (in the tensor's type).
pub const COLLECTIVE_DTYPES: [DType; 4] = [DType::F32, DType::BF16, DType::F16, DType::F64];

/// Float types a peer may name in an agreement check (index + 1 is the code; 0 is any other).
const KNOWN_DTYPES: [DType; 5] = [
    DType::F64,
    DType::F32,
    DType::Flex32,
    DType::F16,
    DType::BF16,
];

/// A collective operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Collective {
    AllReduce,
    ReduceScatter,
    AllGather,
}

impl Collective {
    const ALL: [Collective; 3] = [
        Collective::AllReduce,
        Collective::ReduceScatter,
        Collective::AllGather,
    ];

    fn name(self) -> &'static str {
        match self {
            Collective::AllReduce => "all_reduce",
            Collective::ReduceScatter => "reduce_scatter",
            Collective::AllGather => "all_gather",
        }
    }

    /// The output's shape for an input of `shape` (checked) over `world` ranks.
    pub(crate) fn output_shape(self, shape: &[usize], world: usize) -> Vec<usize> {
        let mut out = shape.to_vec();
        match self {
            Collective::AllReduce => {}
            Collective::ReduceScatter => out[0] /= world,
            Collective::AllGather => out[0] *= world,
        }
        out
    }

    /// Refuses an input this collective cannot take over `world` ranks: a float type outside
    /// [`COLLECTIVE_DTYPES`], no dimension to split or join, or (reduce-scatter) a first
    /// dimension the world size does not divide.
    pub(crate) fn check(self, layout: &TensorLayout, world: usize) -> Result<(), Error> {
        let tensor = format!("the {} input", self.name());
        if !COLLECTIVE_DTYPES.contains(&layout.dtype) {
            return Err(Error::DType {
                tensor,
                expected: "F32, BF16, F16 or F64".into(),
                got: format!("{:?}", layout.dtype),
            });
        }
        let shape_error = |expected: String| Error::Shape {
            tensor: tensor.clone(),
            expected,
            got: format!("{:?}", layout.shape),
        };
        match (self, layout.shape.first()) {
            (Collective::AllReduce, _) => Ok(()),
            (_, None) => Err(shape_error(format!(
                "at least one dimension ({} splits or joins the first)",
                self.name()
            ))),
            (Collective::ReduceScatter, Some(rows)) if rows % world != 0 => {
                Err(shape_error(format!(
                    "a first dimension divisible by the group's {world} ranks (rank r gets rows \
                     r * n .. (r + 1) * n of the sum, n = rows / {world})"
                )))
            }
            _ => Ok(()),
        }
    }
}

/// Checks that every rank calls `collective` on a tensor of the same shape and float type,
/// then that the layout suits the collective ([`Collective::check`]). Every rank sees every
/// rank's call, so all refuse alike, before any tensor moves, and the group stays usable.
fn agree<B: Backend, T: Transport<B> + ?Sized>(
    transport: &T,
    collective: Collective,
    layout: &TensorLayout,
) -> Result<(), Error> {
    let (rank, world) = (transport.rank(), transport.world_size());
    if world > 1 {
        let code = KNOWN_DTYPES
            .iter()
            .position(|&d| d == layout.dtype)
            .map_or(0, |i| i as u64 + 1);
        // First what the call is (fixed length), then the dimensions where their counts agree.
        let head = [collective as u64, code, layout.shape.len() as u64];
        let heads = transport.all_gather_values(&head)?;
        let dims: Vec<u64> = layout.shape.iter().map(|&d| d as u64).collect();
        let all_dims = if heads.iter().all(|h| h[2] == head[2]) {
            Some(transport.all_gather_values(&dims)?)
        } else {
            None
        };
        let peer = differing(rank, &heads)
            .or_else(|| all_dims.as_ref().and_then(|all| differing(rank, all)));
        if let Some(peer) = peer {
            let dims_of = |r: usize| all_dims.as_ref().map(|d| d[r].as_slice());
            return Err(Error::RanksDisagree {
                rank,
                peer,
                mine: describe(&heads[rank], dims_of(rank)),
                theirs: describe(&heads[peer], dims_of(peer)),
            });
        }
    }
    collective.check(layout, world)
}

/// The first rank whose values differ from `rank`'s.
fn differing(rank: usize, all: &[Vec<u64>]) -> Option<usize> {
    all.iter().position(|values| *values != all[rank])
}

/// A rank's call from its agreement values: `"all_reduce of BF16 [5, 3]"`.
fn describe(head: &[u64], dims: Option<&[u64]>) -> String {
    let name =
        (Collective::ALL.get(head[0] as usize)).map_or("an unknown collective", |c| c.name());
    let dtype = match (head[1] as usize)
        .checked_sub(1)
        .and_then(|i| KNOWN_DTYPES.get(i))
    {
        Some(dtype) => format!("{dtype:?}"),
        None => "a non-float type".into(),
    };
    match dims {
        Some(dims) => format!("{name} of {dtype} {dims:?}"),
        None => format!("{name} of {dtype} with {} dimensions", head[2]),
    }
}

/// Default [`Transport::all_reduce`]: see the module's documentation.
pub(super) fn all_reduce<B: Backend, T: Transport<B> + ?Sized>(
    transport: &T,
    tensor: FloatTensor<B>,
) -> Result<FloatTensor<B>, Error> {
    let layout = TensorLayout::of::<B>(&tensor);
    agree(transport, Collective::AllReduce, &layout)?;
    let (world, len) = (transport.world_size(), elements(&layout));
    if world == 1 || len == 0 {
        return Ok(tensor);
    }
    let bounds = chunks(len, world);
    let own = scatter_sum(transport, flatten::<B>(tensor, len), &bounds, layout.dtype)?;
    let whole = gather(transport, own, &bounds, layout.dtype)?;
    Ok(B::float_reshape(whole, Shape::from(layout.shape)))
}

/// Default [`Transport::reduce_scatter`]: see the module's documentation.
pub(super) fn reduce_scatter<B: Backend, T: Transport<B> + ?Sized>(
    transport: &T,
    tensor: FloatTensor<B>,
) -> Result<FloatTensor<B>, Error> {
    let layout = TensorLayout::of::<B>(&tensor);
    agree(transport, Collective::ReduceScatter, &layout)?;
    let (world, len) = (transport.world_size(), elements(&layout));
    let shape = Shape::from(Collective::ReduceScatter.output_shape(&layout.shape, world));
    if world == 1 || len == 0 {
        return Ok(B::float_reshape(tensor, shape));
    }
    let bounds = chunks(len, world);
    let own = scatter_sum(transport, flatten::<B>(tensor, len), &bounds, layout.dtype)?;
    let own = own.expect("equal chunks of a non-empty tensor are not empty");
    Ok(B::float_reshape(own, shape))
}

/// Default [`Transport::all_gather`]: see the module's documentation.
pub(super) fn all_gather<B: Backend, T: Transport<B> + ?Sized>(
    transport: &T,
    tensor: FloatTensor<B>,
) -> Result<FloatTensor<B>, Error> {
    let layout = TensorLayout::of::<B>(&tensor);
    agree(transport, Collective::AllGather, &layout)?;
    let (world, len) = (transport.world_size(), elements(&layout));
    let shape = Shape::from(Collective::AllGather.output_shape(&layout.shape, world));
    if world == 1 || len == 0 {
        return Ok(B::float_reshape(tensor, shape));
    }
    let bounds = chunks(len * world, world);
    let own = Some(flatten::<B>(tensor, len));
    let whole = gather(transport, own, &bounds, layout.dtype)?;
    Ok(B::float_reshape(whole, shape))
}

fn elements(layout: &TensorLayout) -> usize {
    layout.shape.iter().product()
}

fn flatten<B: Backend>(tensor: FloatTensor<B>, len: usize) -> FloatTensor<B> {
    B::float_reshape(tensor, Shape::from(vec![len]))
}

/// Element ranges of `world` near-equal chunks of `len` elements, in rank order.
fn chunks(len: usize, world: usize) -> Vec<Range<usize>> {
    (0..world)
        .map(|j| j * len / world..(j + 1) * len / world)
        .collect()
}

fn flat_layout(len: usize, dtype: DType) -> Vec<TensorLayout> {
    vec![TensorLayout {
        shape: vec![len],
        dtype,
    }]
}

/// The one tensor of a received message.
fn single<B: Backend>(message: Option<Received<B>>) -> FloatTensor<B> {
    let tensors = message.expect("one message per expected receive").tensors;
    tensors.into_iter().next().expect("one tensor per message")
}

/// Rank `j` gets the sum over ranks of chunk `j` of `flat`, added in rank order (f16 and bf16
/// in f32); `None` when this rank's chunk is empty.
fn scatter_sum<B: Backend, T: Transport<B> + ?Sized>(
    transport: &T,
    flat: FloatTensor<B>,
    bounds: &[Range<usize>],
    dtype: DType,
) -> Result<Option<FloatTensor<B>>, Error> {
    let rank = transport.rank();
    let chunk = |range: &Range<usize>| {
        let slice = Slice::new(range.start as isize, Some(range.end as isize), 1);
        B::float_slice(flat.clone(), &[slice])
    };
    let peers = || (0..bounds.len()).filter(move |&p| p != rank);
    let sends = peers()
        .filter(|&p| !bounds[p].is_empty())
        .map(|peer| Outgoing {
            peer,
            kind: MessageKind::Reduction,
            tensors: vec![chunk(&bounds[peer])],
        })
        .collect();
    let mine = &bounds[rank];
    let receives = if mine.is_empty() {
        Vec::new()
    } else {
        peers()
            .map(|peer| Incoming {
                peer,
                kind: MessageKind::Reduction,
                layouts: flat_layout(mine.len(), dtype),
            })
            .collect()
    };
    let received = transport.exchange(sends, receives)?.wait()?;
    if mine.is_empty() {
        return Ok(None);
    }
    let accumulate = match dtype {
        DType::F16 | DType::BF16 => Some(FloatDType::F32),
        _ => None,
    };
    let widen = |t: FloatTensor<B>| match accumulate {
        Some(wide) => B::float_cast(t, wide),
        None => t,
    };
    let mut received = received.into_iter();
    let mut sum = None;
    for p in 0..bounds.len() {
        let next = widen(if p == rank {
            chunk(mine)
        } else {
            single(received.next())
        });
        sum = Some(match sum {
            None => next,
            Some(sum) => B::float_add(sum, next),
        });
    }
    let sum = sum.expect("a group has at least one rank");
    Ok(Some(match accumulate {
        Some(_) => B::float_cast(sum, dtype.into()),
        None => sum,
    }))
}

/// Every rank's flat share (rank `j`'s has `bounds[j].len()` elements; `own` is this rank's,
/// `None` when empty), concatenated in rank order.
fn gather<B: Backend, T: Transport<B> + ?Sized>(
    transport: &T,
    own: Option<FloatTensor<B>>,
    bounds: &[Range<usize>],
    dtype: DType,
) -> Result<FloatTensor<B>, Error> {
    let rank = transport.rank();
    let peers = || (0..bounds.len()).filter(move |&p| p != rank);
    let sends = match &own {
        None => Vec::new(),
        Some(own) => peers()
            .map(|peer| Outgoing {
                peer,
                kind: MessageKind::Gathered,
                tensors: vec![own.clone()],
            })
            .collect(),
    };
    let receives = peers()
        .filter(|&p| !bounds[p].is_empty())
        .map(|peer| Incoming {
            peer,
            kind: MessageKind::Gathered,
            layouts: flat_layout(bounds[peer].len(), dtype),
        })
        .collect();
    let mut received = transport.exchange(sends, receives)?.wait()?.into_iter();
    let mut own = own;
    let mut pieces = Vec::with_capacity(bounds.len());
    for (p, range) in bounds.iter().enumerate() {
        if p == rank {
            pieces.extend(own.take());
        } else if !range.is_empty() {
            pieces.push(single(received.next()));
        }
    }
    Ok(match pieces.len() {
        1 => pieces.pop().expect("one piece"),
        _ => B::float_cat(pieces, 0),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_every_element_once_in_order() {
        for world in 1..=8 {
            for len in [0, 1, 5, 7, 8, 13, 1001] {
                let bounds = chunks(len, world);
                assert_eq!(bounds.len(), world);
                assert_eq!(bounds[0].start, 0);
                assert_eq!(bounds[world - 1].end, len);
                for pair in bounds.windows(2) {
                    assert_eq!(pair[0].end, pair[1].start);
                }
                let (min, max) = (len / world, len.div_ceil(world));
                assert!(bounds.iter().all(|r| (min..=max).contains(&r.len())));
            }
        }
    }

    #[test]
    fn a_reduce_scatter_over_rows_the_world_does_not_divide_is_refused() {
        let layout = TensorLayout {
            shape: vec![7, 2],
            dtype: DType::F32,
        };
        let error = Collective::ReduceScatter.check(&layout, 3).unwrap_err();
        let message = error.to_string();
        assert!(
            message.contains("the reduce_scatter input has shape [7, 2]"),
            "{message}"
        );
        assert!(
            message.contains("divisible by the group's 3 ranks"),
            "{message}"
        );
        assert!(Collective::ReduceScatter.check(&layout, 7).is_ok());
        assert!(Collective::AllReduce.check(&layout, 3).is_ok());
    }

    #[test]
    fn integer_tensors_are_refused_with_the_allowed_float_types() {
        let layout = TensorLayout {
            shape: vec![4],
            dtype: DType::I32,
        };
        let message = Collective::AllGather
            .check(&layout, 2)
            .unwrap_err()
            .to_string();
        assert!(message.contains("the all_gather input is I32"), "{message}");
        assert!(message.contains("F32, BF16, F16 or F64"), "{message}");
    }

    #[test]
    fn calls_are_described_from_their_agreement_values() {
        let head = [Collective::AllReduce as u64, 5, 2];
        assert_eq!(describe(&head, Some(&[5, 3])), "all_reduce of BF16 [5, 3]");
        let head = [Collective::AllGather as u64, 0, 1];
        assert_eq!(
            describe(&head, None),
            "all_gather of a non-float type with 1 dimensions"
        );
    }
}
