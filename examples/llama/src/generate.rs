//! Text generation from a trained [`Llama`]: greedy decoding or top-k sampling, one token at a
//! time from the last `context` tokens (no key/value cache: a short sample after training).

use burn::tensor::{Int, Tensor, TensorData};
use burn_distflash::{AttentionContext, FlashAttentionBackend};

use crate::model::Llama;
use crate::rng::SplitMix64;
use crate::Error;

/// How the next token is chosen from the model's logits.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Sampling {
    /// The most likely token (the lowest id among equals).
    Greedy,
    /// A token drawn from the `k` most likely, with probabilities `softmax(logits / temperature)`
    /// renormalised over those `k`, from a generator seeded with `seed`.
    TopK {
        /// How many of the most likely tokens are candidates (at least 1).
        k: usize,
        /// Softmax temperature (finite, above 0); below 1 sharpens the distribution.
        temperature: f64,
        /// Seed of the draws: the same seed, model and prompt give the same text.
        seed: u64,
    },
}

/// The candidates' ids in order of decreasing logit (ties: lower id first).
fn ranked(logits: &[f32]) -> Vec<usize> {
    let mut ids: Vec<usize> = (0..logits.len()).collect();
    ids.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    ids
}

/// The next token for one position's `logits`.
fn pick(logits: &[f32], sampling: Sampling, rng: &mut SplitMix64) -> usize {
    let ranked = ranked(logits);
    let Sampling::TopK { k, temperature, .. } = sampling else {
        return ranked[0];
    };
    let top = &ranked[..k.min(ranked.len())];
    let max = f64::from(logits[top[0]]);
    let weights: Vec<f64> = top
        .iter()
        .map(|&id| ((f64::from(logits[id]) - max) / temperature).exp())
        .collect();
    let mut target = rng.unit() * weights.iter().sum::<f64>();
    for (&id, w) in top.iter().zip(&weights) {
        if target < *w {
            return id;
        }
        target -= w;
    }
    top[top.len() - 1]
}

/// `prompt` followed by `new_tokens` generated tokens. Each step runs the model on the last
/// `context` tokens on one device and picks the next token from the last position's logits.
///
/// The prompt must be non-empty and its ids inside the model's vocabulary; `context` must be
/// at least 1, and top-k needs `k >= 1` and a finite temperature above 0.
pub fn generate<B: FlashAttentionBackend>(
    model: &Llama<B>,
    prompt: &[u32],
    new_tokens: usize,
    context: usize,
    sampling: Sampling,
) -> Result<Vec<u32>, Error> {
    let vocab = model.embedding.weight.dims()[0];
    if prompt.is_empty() {
        return Err(Error::invalid("the prompt", "at least one token", "empty"));
    }
    if let Some(&id) = prompt.iter().find(|&&id| id as usize >= vocab) {
        return Err(Error::invalid(
            "a prompt token",
            format!("an id inside the model's vocabulary of {vocab} (ids 0..{vocab})"),
            id,
        ));
    }
    if context == 0 {
        return Err(Error::invalid("the context length", "at least 1", 0));
    }
    let mut seed = 0;
    if let Sampling::TopK {
        k,
        temperature,
        seed: s,
    } = sampling
    {
        if k == 0 || !(temperature.is_finite() && temperature > 0.0) {
            return Err(Error::invalid(
                "top-k's k and temperature",
                "k >= 1 and a finite temperature above 0",
                format!("k {k}, temperature {temperature}"),
            ));
        }
        seed = s;
    }
    let mut rng = SplitMix64::for_step(seed, 0);
    let device = model.embedding.weight.val().device();
    let mut tokens = prompt.to_vec();
    for _ in 0..new_tokens {
        let window = &tokens[tokens.len().saturating_sub(context)..];
        let ids: Vec<i64> = window.iter().map(|&t| i64::from(t)).collect();
        let input =
            Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [1, window.len()]), &device);
        let logits = model
            .forward(input, &AttentionContext::Local)
            .map_err(|source| Error::Attention {
                during: "generation",
                source,
            })?;
        let last = logits
            .slice([0..1, window.len() - 1..window.len(), 0..vocab])
            .into_data()
            .convert::<f32>();
        let last = last
            .as_slice::<f32>()
            .map_err(|e| Error::invalid("the logits", "readable as f32", format!("{e:?}")))?;
        tokens.push(pick(last, sampling, &mut rng) as u32);
    }
    Ok(tokens)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_largest_logit_and_the_lowest_id_among_equals() {
        let mut rng = SplitMix64(1);
        assert_eq!(pick(&[0.1, 2.0, -1.0, 2.0], Sampling::Greedy, &mut rng), 1);
    }

    #[test]
    fn top_k_draws_only_the_k_most_likely_in_proportion() {
        let logits = [0.0f32, 3.0, (2.0f32).ln() + 3.0, 1.0, -5.0];
        let sampling = Sampling::TopK {
            k: 2,
            temperature: 1.0,
            seed: 0,
        };
        let mut rng = SplitMix64(5);
        let mut counts = [0usize; 5];
        for _ in 0..3000 {
            counts[pick(&logits, sampling, &mut rng)] += 1;
        }
        assert_eq!(counts[0] + counts[3] + counts[4], 0, "{counts:?}");
        // Token 2 is twice as likely as token 1.
        let ratio = counts[2] as f64 / counts[1] as f64;
        assert!((ratio - 2.0).abs() < 0.25, "{counts:?}");
    }
}
