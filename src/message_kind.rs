//! The definition of [`MessageKind`], what a message between the ranks carries; users find it
//! at [`crate::collective::MessageKind`]. A leaf: it names nothing else of the crate, so that
//! [`Error::Timeout`](crate::Error::Timeout) can carry a `MessageKind` while the collective
//! layer returns [`Error`](crate::Error) without an import cycle.

/// What a message carries; a receiver checks that it gets the kind it expects.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum MessageKind {
    /// A key/value chunk: `[k, v]`.
    KeyValue,
    /// A query chunk for a helper's forward: `[q]`.
    Query,
    /// A helper's partial forward result, f32: `[o, m, l]`.
    PartialState,
    /// A query chunk for a backward step: `[q, dO, lse, delta]`.
    QueryBundle,
    /// Query gradient computed elsewhere, f32: `[dq]`.
    QueryGrad,
    /// Key/value gradients computed elsewhere, f32: `[dk, dv]`.
    KeyValueGrad,
    /// Small host values of
    /// [`Transport::all_gather_values`](crate::collective::Transport::all_gather_values).
    Values,
    /// A chunk of a tensor summed over the group
    /// ([`Transport::all_reduce`](crate::collective::Transport::all_reduce),
    /// [`Transport::reduce_scatter`](crate::collective::Transport::reduce_scatter)).
    Reduction,
    /// A rank's share of a tensor gathered by every rank
    /// ([`Transport::all_gather`](crate::collective::Transport::all_gather), and the second half
    /// of an all-reduce).
    Gathered,
}
