//! The seam between the recording loop ([`super::recorder`]) and where samples come from. A
//! source reads what the targets did since its last call and writes it through the
//! [`Pipeline`]; the loop does everything else (threads, exits, engine metrics, rediscovery,
//! flush, rotation) the same way for every source. Sources: [`super::bpf_source::BpfSource`]
//! (kernel-side stack walks, exact off-CPU, GIL waits, GC pauses, probes) and
//! [`super::memory::MemorySource`] (user-space polling). In the spirit of py-spy's and rbspy's
//! single consumer loop over a sampler.

use std::collections::BTreeMap;
use std::time::Duration;

use super::target::{Target, Targets};
use super::Pipeline;

pub trait Source {
    /// "bpf" or "memory" (`Meta::backend`).
    fn name(&self) -> &'static str;

    /// How long the loop waits between two [`Self::collect`] calls.
    fn period(&self) -> Duration;

    /// Begin with the targets attached at start (their threads already synced). Returns the
    /// pids that could not be set up, with the error (the loop decides whether that is fatal).
    fn start(
        &mut self,
        targets: &mut Targets,
        pipe: &mut Pipeline,
    ) -> anyhow::Result<Vec<(i32, anyhow::Error)>>;

    /// A process attached while recording (its threads already synced).
    fn add_target(&mut self, t: &mut Target) -> anyhow::Result<()>;

    /// Threads of `pid` that appeared or changed (tid, `PyThreadState` address), and those gone.
    fn threads_changed(
        &mut self,
        pid: i32,
        changed: &[(i32, u64)],
        gone: &[i32],
    ) -> anyhow::Result<()>;

    /// Processes that exited: write their last events, then forget them.
    fn remove_targets(
        &mut self,
        targets: &mut Targets,
        exited: &[i32],
        pipe: &mut Pipeline,
    ) -> anyhow::Result<()>;

    /// Read what happened since the last call and write it through `pipe`.
    fn collect(&mut self, targets: &mut Targets, pipe: &mut Pipeline) -> anyhow::Result<()>;

    /// Stop new events and write what is left (before the pipeline closes its intervals).
    fn finish(&mut self, targets: &mut Targets, pipe: &mut Pipeline) -> anyhow::Result<()>;

    /// Before the window: read every thread's stack from memory and offer what is on it to
    /// the probes, so that they are set before the window begins instead of when sampling
    /// first meets them. Returns how many (probe, thread) watches are wanted so far (the
    /// warm-up ends once that stops growing).
    fn look_for_probes(
        &mut self,
        _targets: &mut Targets,
        _pipe: &mut Pipeline,
    ) -> anyhow::Result<usize> {
        Ok(0)
    }

    /// Switch the parts in `mask` off (`crate::bpf::abi::OFF_*`; 0 = everything on) for
    /// `record --measure-cost`: their BPF programs return at once and, for probes, every
    /// watchpoint is removed until they are on again. Sources that cannot say so.
    fn set_off(&mut self, _mask: u32, _targets: &Targets) -> anyhow::Result<()> {
        anyhow::bail!(
            "the {} backend cannot switch its parts off (record --measure-cost needs the BPF backend)",
            self.name()
        )
    }

    /// This source's failure-path and health counters (docs/recording-format.md, record 8).
    fn counters(&self, pipe: &Pipeline, out: &mut BTreeMap<String, u64>);
}
