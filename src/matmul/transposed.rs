//! [`Transposed`]: the operand layouts of the linear layers' products, shared by Burn's path
//! ([`super::product`]) and the cuBLAS one.

/// Which operand of a product enters transposed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transposed {
    /// `a b`: `a` is `[m, k]`, `b` is `[k, n]`.
    Neither,
    /// `a^T b`: `a` is `[k, m]`, `b` is `[k, n]` (a weight gradient `x^T dy`).
    Lhs,
    /// `a b^T`: `a` is `[m, k]`, `b` is `[n, k]` (an input gradient `dy W^T`).
    Rhs,
}
