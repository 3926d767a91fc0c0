//! [`Offload`]: which of a model's checkpointed layers keep their checkpoints in host memory
//! between the forward and the backward (pure logic; the mechanism is `crate::offload`).

use core::str::FromStr;

use burn::config::Config;

/// Which checkpointed layers of a model move what their backward keeps (the layer input, and
/// attention's output and lse under
/// [`CheckpointPlacement::AttentionOutput`](crate::layers::CheckpointPlacement::AttentionOutput)) to host
/// memory as soon as their forward ends, bringing it back one layer ahead of their backward.
///
/// The backward visits the layers last to first, so the last layers' checkpoints are needed
/// first, with no earlier backward to hide their copy behind: [`Offload::AllButLast`] keeps
/// those on the device and offloads the others (the device fills first). A model applies the
/// policy per layer with [`Offload::offloads`]
/// (`TransformerBlockConfig::with_offload(policy.offloads(layer, n_layers))`). Offloading
/// changes where the checkpoints wait, never what is computed: gradients are bitwise the same.
///
/// Parsed from `off`, `all` or a number `N` (all layers but the last `N`; `0` is `all`).
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum Offload {
    /// Every checkpoint stays on the device.
    Off,
    /// Every checkpointed layer offloads.
    All,
    /// The last `N` layers (in forward order) keep their checkpoints on the device; the others
    /// offload.
    AllButLast(usize),
}

impl Offload {
    /// Whether layer `layer` (0 is the first in the forward) of a model of `n_layers` layers
    /// offloads its checkpoint.
    pub fn offloads(&self, layer: usize, n_layers: usize) -> bool {
        match *self {
            Offload::Off => false,
            Offload::All => layer < n_layers,
            Offload::AllButLast(kept) => layer + kept < n_layers,
        }
    }

    /// How many of `n_layers` layers offload.
    pub fn offloaded_layers(&self, n_layers: usize) -> usize {
        (0..n_layers)
            .filter(|&l| self.offloads(l, n_layers))
            .count()
    }

    /// Whether any layer offloads (`AllButLast(n)` with `n` at least the layer count does not).
    pub fn is_on(&self, n_layers: usize) -> bool {
        self.offloaded_layers(n_layers) > 0
    }
}

impl FromStr for Offload {
    type Err = String;

    /// `off`, `all`, or `N`: every layer but the last `N` (`0` is `all`).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "off" => Ok(Offload::Off),
            "all" => Ok(Offload::All),
            n => match n.parse::<usize>() {
                Ok(0) => Ok(Offload::All),
                Ok(kept) => Ok(Offload::AllButLast(kept)),
                Err(_) => Err(format!(
                    "takes off, all, or N (offload every layer but the last N), got {s:?}"
                )),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_last_layers_stay_on_the_device() {
        let offloaded = |policy: Offload, n| (0..n).map(|l| policy.offloads(l, n)).collect();
        let v: Vec<bool> = offloaded(Offload::AllButLast(2), 5);
        assert_eq!(v, [true, true, true, false, false]);
        let v: Vec<bool> = offloaded(Offload::All, 3);
        assert_eq!(v, [true; 3]);
        let v: Vec<bool> = offloaded(Offload::Off, 3);
        assert_eq!(v, [false; 3]);
        assert_eq!(Offload::AllButLast(7).offloaded_layers(4), 0);
        assert!(!Offload::AllButLast(4).is_on(4));
        assert!(Offload::AllButLast(3).is_on(4));
        assert!(
            !Offload::All.offloads(4, 4),
            "a layer beyond the model does not offload"
        );
    }

    #[test]
    fn parses_what_the_command_line_says_and_names_what_it_refuses() {
        assert_eq!("off".parse(), Ok(Offload::Off));
        assert_eq!("all".parse(), Ok(Offload::All));
        assert_eq!("0".parse(), Ok(Offload::All));
        assert_eq!("4".parse(), Ok(Offload::AllButLast(4)));
        let err = "-1".parse::<Offload>().unwrap_err();
        assert!(
            err.contains("off, all, or N") && err.contains("\"-1\""),
            "{err}"
        );
        assert!("half".parse::<Offload>().is_err());
    }
}
