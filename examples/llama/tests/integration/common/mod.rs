//! Helpers shared by the Llama tests: the workspace's test support under its usual names (tensors
//! to and from f64, module visitors, scratch directories, the wall-clock limit, one test at a
//! time on wgpu), the bundled training text, and reading an input error.
#![allow(dead_code)]

pub use distflash_test_support::{exclusive_wgpu, host_values, modules, temp_dir, within};

use std::path::{Path, PathBuf};

/// The bundled text: where this crate was built, or (test binaries copied to a GPU machine, run
/// from the repository's root) under the working directory.
pub fn data_file() -> PathBuf {
    let built = Path::new(env!("CARGO_MANIFEST_DIR")).join("data/tiny_shakespeare.txt");
    match built.exists() {
        true => built,
        false => PathBuf::from("examples/llama/data/tiny_shakespeare.txt"),
    }
}

/// What was checked, what is allowed and what was given, of an input error
/// ([`Error::Invalid`](distflash_llama::Error::Invalid)); panics on any other result.
pub fn input_error<T: std::fmt::Debug>(
    result: Result<T, distflash_llama::Error>,
) -> (String, String, String) {
    match result {
        Err(distflash_llama::Error::Invalid {
            what,
            expected,
            got,
            ..
        }) => (what, expected, got),
        other => panic!("expected an input error, got {other:?}"),
    }
}
