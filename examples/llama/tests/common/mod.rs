//! Helpers shared by the Llama tests. The module helpers and the wall-clock limit are the
//! plugin's own test helpers, included from its `tests/common` so both crates test with one copy;
//! the scratch directory is the one this crate's unit tests use.
#![allow(dead_code)]

#[path = "../../../../tests/common/host_values.rs"]
pub mod host_values;
#[path = "../../../../tests/common/modules.rs"]
pub mod modules;
#[path = "../../src/temp_dir.rs"]
pub mod temp_dir;
#[path = "../../../../tests/common/within.rs"]
pub mod within;
