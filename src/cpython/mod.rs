//! Reading CPython from outside: binaries, versions, offsets, objects, frames.

pub mod asyncio;
pub mod binary;
pub mod builtins;
pub mod linetable;
pub mod memory;
pub mod objects;
pub mod offsets;
pub mod opcodes;
pub mod reader;
pub mod symbols;
#[cfg(test)]
pub mod testutil;
pub mod threading;
pub mod version;

pub use reader::{AttachError, Frame, PythonProcess, Snapshot, ThreadSnapshot};
