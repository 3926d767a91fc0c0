//! Attention's heads in groups: a checkpointed block can run its attention over `groups` groups
//! of heads one after another, each group's queries, keys and values projected by column slices
//! of the projection weights, so that the per-head tensors of attention's forward and backward
//! (the rotated projections, the kernels' f32 gradient accumulators, a sequence-parallel
//! group's received key/value shards and their gradients) exist for one group at a time. Each
//! head's attention is independent of the others', so the outputs are the same; each group's
//! attention output and `dq, dk, dv` are written into their columns of whole tensors
//! ([`ColumnJoin`]), whose products then run once, as for all heads at once.
//!
//! A group holds whole grouped-query sets: `groups` divides `n_kv_heads`, and group `g` takes
//! query heads `g * n_heads / groups ..` and key/value heads `g * n_kv_heads / groups ..`.

use std::ops::Range;

use burn::tensor::Tensor;

use crate::extension::FlashAttentionBackend;
use crate::Error;

/// One group of heads: a contiguous range of query heads and the key/value heads they read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct HeadGroup {
    /// Query heads.
    pub query: Range<usize>,
    /// Key/value heads.
    pub key_value: Range<usize>,
}

impl HeadGroup {
    /// The columns of `heads` in a `[.., heads * head_dim]` projection.
    pub fn columns(heads: &Range<usize>, head_dim: usize) -> Range<usize> {
        heads.start * head_dim..heads.end * head_dim
    }
}

/// The `groups` groups of `n_heads` query heads over `n_kv_heads` key/value heads, in head
/// order. `groups` must divide `n_kv_heads` ([`check_head_groups`]).
pub(crate) fn head_groups(n_heads: usize, n_kv_heads: usize, groups: usize) -> Vec<HeadGroup> {
    let (queries, key_values) = (n_heads / groups, n_kv_heads / groups);
    (0..groups)
        .map(|g| HeadGroup {
            query: g * queries..(g + 1) * queries,
            key_value: g * key_values..(g + 1) * key_values,
        })
        .collect()
}

/// Errors unless `groups` is a divisor of `n_kv_heads` (a group holds whole grouped-query sets).
pub(crate) fn check_head_groups(groups: usize, n_kv_heads: usize) -> Result<(), Error> {
    match groups > 0 && n_kv_heads.is_multiple_of(groups) {
        true => Ok(()),
        false => Err(Error::config(
            "attention_head_groups",
            format!(
                "a divisor of the key/value heads ({n_kv_heads}): each group holds whole \
                 grouped-query sets"
            ),
            groups,
        )),
    }
}

/// A `[batch, seq, width]` tensor written a range of columns at a time (one group of heads'),
/// in place: a part that covers every column is the tensor itself.
pub(crate) struct ColumnJoin<B: FlashAttentionBackend> {
    dims: [usize; 3],
    whole: Option<Tensor<B, 3>>,
}

impl<B: FlashAttentionBackend> ColumnJoin<B> {
    /// An empty tensor of `dims`, allocated at the first part.
    pub fn new(dims: [usize; 3]) -> Self {
        Self { dims, whole: None }
    }

    /// Writes `part` `[batch, seq, columns.len()]` into `columns`.
    pub fn put(&mut self, part: Tensor<B, 3>, columns: Range<usize>) {
        let [batch, seq, width] = self.dims;
        if columns == (0..width) {
            self.whole = Some(part);
            return;
        }
        let whole = (self.whole.take())
            .unwrap_or_else(|| Tensor::empty(self.dims, (&part.device(), part.dtype())));
        self.whole = Some(whole.slice_assign([0..batch, 0..seq, columns], part));
    }

    /// The tensor, every column written.
    ///
    /// # Panics
    ///
    /// When no part was written.
    pub fn finish(self) -> Tensor<B, 3> {
        self.whole.expect("every group of heads wrote its columns")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_split_query_and_key_value_heads_alike() {
        let groups = head_groups(32, 8, 4);
        assert_eq!(groups.len(), 4);
        assert_eq!(groups[1].query, 8..16);
        assert_eq!(groups[1].key_value, 2..4);
        assert_eq!(groups[3].query, 24..32);
        assert_eq!(head_groups(6, 6, 1)[0].query, 0..6);
        assert_eq!(HeadGroup::columns(&(2..4), 64), 128..256);
    }

    #[test]
    fn groups_must_divide_the_key_value_heads() {
        assert!(check_head_groups(4, 8).is_ok());
        assert!(check_head_groups(1, 3).is_ok());
        for (groups, kv) in [(0, 8), (3, 8), (16, 8)] {
            let err = check_head_groups(groups, kv).unwrap_err().to_string();
            assert!(err.contains("a divisor of the key/value heads"), "{err}");
        }
    }
}
