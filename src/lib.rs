//! enginescope: attach to a running CPython process (vLLM first) and see where its time goes.
//!
//! Module map (see ARCHITECTURE.md): `sys` (clock, host facts, stop token) is the bottom layer;
//! `cpython` reads interpreters from outside; `procinfo` wraps `/proc`; `bpf` loads the kernel
//! side; `record` is the file format; `sampler` is the recording loop over a sample source;
//! `views`, `tui`, `agent`, `dump`, `doctor` sit on top.

pub mod accounting;
pub mod agent;
pub mod bpf;
pub mod cli;
pub mod cpython;
pub mod demo;
pub mod doctor;
pub mod dump;
pub mod estimate;
pub mod metrics;
pub mod native;
pub mod procinfo;
pub mod record;
pub mod sampler;
pub mod sys;
pub mod tui;
pub mod views;
pub mod vllm;
