//! The f64 attention oracle on the host, forward and backward.
//!
//! Every intermediate passes through a [`Rounding`], so the same code gives the exact f64
//! reference ([`exact`](crate::exact)) and the "naive computation in low precision" that the
//! tolerance rule compares against (round every intermediate to f16 or bf16).

use distflash_kernels::{AttentionDims, Mask};

use crate::rounding::Rounding;

/// Outputs of the reference forward: `out` `[B, Hq, Sq, D]` and `lse` `[B, Hq, Sq]`.
#[derive(Debug, Clone)]
pub struct ReferenceForward {
    /// Normalised output.
    pub out: Vec<f64>,
    /// Log-sum-exp per row (`-inf` for a row that sees no key).
    pub lse: Vec<f64>,
}

/// Gradients of the reference backward, shaped like q, k, v.
#[derive(Debug, Clone)]
pub struct ReferenceGrads {
    /// Gradient of q.
    pub dq: Vec<f64>,
    /// Gradient of k (summed over the query heads of each group).
    pub dk: Vec<f64>,
    /// Gradient of v (likewise).
    pub dv: Vec<f64>,
}

struct Indexer {
    dims: AttentionDims,
}

impl Indexer {
    fn q(&self, b: usize, h: usize, i: usize) -> usize {
        ((b * self.dims.q_heads + h) * self.dims.q_len + i) * self.dims.head_dim
    }
    fn kv(&self, b: usize, h: usize, j: usize) -> usize {
        let kvh = h / self.dims.group_size();
        ((b * self.dims.kv_heads + kvh) * self.dims.kv_len + j) * self.dims.head_dim
    }
    fn row(&self, b: usize, h: usize, i: usize) -> usize {
        (b * self.dims.q_heads + h) * self.dims.q_len + i
    }
}

fn dot(a: &[f64], b: &[f64], round: Rounding) -> f64 {
    round(a.iter().zip(b).map(|(x, y)| x * y).sum())
}

/// Probabilities of one query row (normalised) and its lse; `None` entries are masked keys.
fn row_probabilities(
    x: &Indexer,
    q: &[f64],
    k: &[f64],
    (b, h, i): (usize, usize, usize),
    mask: &Mask,
    scale: f64,
    round: Rounding,
) -> (Vec<Option<f64>>, f64) {
    let d = x.dims.head_dim;
    let qi = &q[x.q(b, h, i)..][..d];
    let scores: Vec<Option<f64>> = (0..x.dims.kv_len)
        .map(|j| {
            mask.visible(b, i, j)
                .then(|| round(dot(qi, &k[x.kv(b, h, j)..][..d], round) * scale))
        })
        .collect();
    let max = scores
        .iter()
        .flatten()
        .fold(f64::NEG_INFINITY, |a, &s| a.max(s));
    if max == f64::NEG_INFINITY {
        return (scores.iter().map(|_| None).collect(), f64::NEG_INFINITY);
    }
    let weights: Vec<Option<f64>> = scores
        .iter()
        .map(|s| s.map(|s| round((s - max).exp())))
        .collect();
    let sum = round(weights.iter().flatten().sum::<f64>());
    let probs = weights.iter().map(|w| w.map(|w| round(w / sum))).collect();
    (probs, max + sum.ln())
}

/// Reference forward over all of k, v.
pub fn forward(
    dims: &AttentionDims,
    q: &[f64],
    k: &[f64],
    v: &[f64],
    mask: &Mask,
    scale: f64,
    round: Rounding,
) -> ReferenceForward {
    let x = Indexer { dims: *dims };
    let d = dims.head_dim;
    let mut out = vec![0.0; q.len()];
    let mut lse = vec![0.0; dims.batch * dims.q_heads * dims.q_len];
    for b in 0..dims.batch {
        for h in 0..dims.q_heads {
            for i in 0..dims.q_len {
                let (probs, row_lse) = row_probabilities(&x, q, k, (b, h, i), mask, scale, round);
                lse[x.row(b, h, i)] = row_lse;
                let o = &mut out[x.q(b, h, i)..][..d];
                for (j, p) in probs.iter().enumerate() {
                    if let Some(p) = p {
                        let vj = &v[x.kv(b, h, j)..][..d];
                        o.iter_mut().zip(vj).for_each(|(o, v)| *o += p * v);
                    }
                }
                o.iter_mut().for_each(|o| *o = round(*o));
            }
        }
    }
    ReferenceForward { out, lse }
}

/// Reference backward: gradients of `sum(out * grad_out)` with respect to q, k, v.
#[allow(clippy::too_many_arguments)]
pub fn backward(
    dims: &AttentionDims,
    q: &[f64],
    k: &[f64],
    v: &[f64],
    grad_out: &[f64],
    mask: &Mask,
    scale: f64,
    round: Rounding,
) -> ReferenceGrads {
    let x = Indexer { dims: *dims };
    let d = dims.head_dim;
    let fwd = forward(dims, q, k, v, mask, scale, round);
    let mut dq = vec![0.0; q.len()];
    let mut dk = vec![0.0; k.len()];
    let mut dv = vec![0.0; v.len()];
    for b in 0..dims.batch {
        for h in 0..dims.q_heads {
            for i in 0..dims.q_len {
                let (probs, _) = row_probabilities(&x, q, k, (b, h, i), mask, scale, round);
                let qi = x.q(b, h, i);
                let do_i = &grad_out[qi..][..d];
                let delta = dot(do_i, &fwd.out[qi..][..d], round);
                for (j, p) in probs.iter().enumerate() {
                    let Some(p) = *p else { continue };
                    let kj = x.kv(b, h, j);
                    let dp = dot(do_i, &v[kj..][..d], round);
                    let ds = round(p * (dp - delta)) * scale;
                    for e in 0..d {
                        dq[qi + e] += ds * k[kj + e];
                        dk[kj + e] += ds * q[qi + e];
                        dv[kj + e] += p * do_i[e];
                    }
                }
            }
        }
    }
    for g in [&mut dq, &mut dk, &mut dv] {
        g.iter_mut().for_each(|x| *x = round(*x));
    }
    ReferenceGrads { dq, dk, dv }
}
