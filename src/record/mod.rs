//! Recordings: the versioned, streaming file `record` writes and every view reads
//! (docs/recording-format.md).

pub mod format;
pub mod model;
pub mod profile;
pub mod rotate;
#[cfg(test)]
pub mod synth;

pub use format::{read_recording, RecordingWriter};
pub use model::*;
