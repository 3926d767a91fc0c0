//! [`StatePlacement`]: where a sharded optimizer keeps its f32 master weights and moments (the
//! device, or host memory streamed through the device in chunks).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::Error;

/// Bytes of optimizer state (master weights and both moments together, 12 bytes per element)
/// one chunk holds (the unit the step updates, and a host-resident state brings to the device),
/// by default: 512 MiB.
pub const DEFAULT_STATE_CHUNK_BYTES: u64 = 512 << 20;

/// Where [`ShardedAdamW`](super::ShardedAdamW) keeps each rank's f32 master weights and moments.
///
/// - [`Gpu`](Self::Gpu): on the device, in chunks of a byte budget updated one by one.
/// - [`Host`](Self::Host): in host memory (pinned on CUDA), streamed through the device in
///   the same chunks: a chunk comes in while the one before is updated, and goes back once
///   updated. Bitwise the same results; the device holds two chunks of state instead of all of
///   it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub enum StatePlacement {
    /// On the device (the default).
    #[default]
    Gpu,
    /// In host memory, streamed through the device in chunks.
    Host,
}

impl fmt::Display for StatePlacement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Gpu => "gpu",
            Self::Host => "host",
        })
    }
}

impl FromStr for StatePlacement {
    type Err = Error;

    /// `"gpu"` or `"host"`; anything else is an [`Error::Invalid`].
    fn from_str(s: &str) -> Result<Self, Error> {
        match s {
            "gpu" => Ok(Self::Gpu),
            "host" => Ok(Self::Host),
            other => Err(Error::invalid(
                "the optimizer state's placement",
                "gpu (on the device) or host (in host memory, streamed through the device)",
                format!("{other:?}"),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placements_read_back_as_written_and_others_are_refused() {
        for placement in [StatePlacement::Gpu, StatePlacement::Host] {
            assert_eq!(
                placement.to_string().parse::<StatePlacement>().unwrap(),
                placement
            );
        }
        let err = "disk".parse::<StatePlacement>().unwrap_err().to_string();
        assert!(err.contains("gpu") && err.contains("\"disk\""), "{err}");
    }
}
