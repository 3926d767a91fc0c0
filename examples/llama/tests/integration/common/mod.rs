//! Helpers shared by the Llama tests. The module helpers and the wall-clock limit are the
//! plugin's own test helpers, included from its `tests/common` so both crates test with one copy;
//! the scratch directory is the one this crate's unit tests use.
#![allow(dead_code)]

#[path = "../../../../../tests/integration/common/host_values.rs"]
pub mod host_values;
#[path = "../../../../../tests/integration/common/modules.rs"]
pub mod modules;
#[path = "../../../src/temp_dir.rs"]
pub mod temp_dir;
#[path = "../../../../../tests/integration/common/within.rs"]
pub mod within;

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
