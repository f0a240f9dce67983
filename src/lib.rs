//! enginescope: attach to a running CPython process (vLLM first) and see where its time goes.
//!
//! Module map (see ARCHITECTURE.md): `cpython` reads interpreters from outside; `procinfo`
//! wraps `/proc`; `dump` and `doctor` are the first views.

pub mod agent;
pub mod bpf;
pub mod cpython;
pub mod demo;
pub mod doctor;
pub mod dump;
pub mod metrics;
pub mod procinfo;
pub mod record;
pub mod sampler;
pub mod tui;
pub mod views;
pub mod vllm;
