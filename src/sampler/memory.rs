//! The source without BPF: poll each target from user space through the same CPython reader
//! (`process_vm_readv`), at a lower rate. At each tick every thread's Python stack is read, and
//! the CPU time the kernel charged to the thread since the previous tick
//! (`/proc/PID/task/TID/schedstat`, nanoseconds) becomes a sample of that weight at that stack;
//! the rest of the tick becomes an off-CPU interval at that stack. So per-thread on/off-CPU
//! totals are exact, and their attribution to stacks is sampled at the tick rate.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use super::probes::Probes;
use super::source::Source;
use super::target::{Target, Targets};
use super::Pipeline;
use crate::record::flags;
use crate::sys::monotonic_ns;

/// Highest rate the memory backend attempts; each tick reads every thread's stack.
pub(crate) const MAX_RATE_HZ: u32 = 250;

pub struct MemorySource {
    period: Duration,
    /// (thread CPU ns, monotonic ns) at the previous tick, per (pid, tid).
    last: HashMap<(i32, i32), (u64, u64)>,
    /// Probed functions, timed by sampling (breakpoints need the BPF source): a call is
    /// followed across the ticks whose stack holds it.
    probes: Probes,
    /// Ticks at which a target's thread list and stacks could not be read at all (the
    /// threads' CPU time since then goes to the next tick that reads them).
    failed_snapshots: u64,
}

impl MemorySource {
    /// `probes` made with this source's period ([`Self::period_ns`]).
    pub fn new(rate_hz: u32, probes: Probes) -> Self {
        MemorySource {
            period: Duration::from_nanos(Self::period_ns(rate_hz)),
            last: HashMap::new(),
            probes,
            failed_snapshots: 0,
        }
    }

    /// The tick at `rate_hz` (at most [`MAX_RATE_HZ`]).
    pub(crate) fn period_ns(rate_hz: u32) -> u64 {
        crate::record::Period::of_hz(rate_hz.min(MAX_RATE_HZ)).ns()
    }

    /// Offer code objects the symbolizer met for the first time to the probes (sampled).
    fn consider_new_code(&mut self, t: &mut Target, pipe: &mut Pipeline) -> anyhow::Result<()> {
        if t.sym.new_code.is_empty() {
            return Ok(());
        }
        let now = pipe.rel(monotonic_ns());
        for (code, info, tid) in std::mem::take(&mut t.sym.new_code) {
            self.probes
                .consider(None, &t.proc, tid, code, &info, now, pipe)?;
        }
        Ok(())
    }

    /// One tick of one target: every thread's stack, its CPU time since the last tick as a
    /// sample, the rest as off CPU.
    fn poll(&mut self, t: &mut Target, pipe: &mut Pipeline) -> anyhow::Result<()> {
        let Ok(threads) = t.stacks() else {
            self.failed_snapshots += 1;
            return Ok(());
        };
        for th in threads {
            let Some(cpu) = crate::sys::Schedstat::of_task(t.pid, th.tid).map(|s| s.run_ns) else {
                continue;
            };
            let now = monotonic_ns();
            let stack = pipe.writer.intern_stack(&th.frames)?;
            let Some((cpu0, t0)) = self.last.insert((t.pid, th.tid), (cpu, now)) else {
                continue;
            };
            let wall = now.saturating_sub(t0);
            let on = cpu.saturating_sub(cpu0).min(wall);
            if on > 0 {
                let mut fl = 0;
                if th.holds_gil {
                    fl |= flags::GIL;
                }
                if th.gc_collecting {
                    fl |= flags::GC;
                }
                if th.partial {
                    fl |= flags::PARTIAL;
                }
                pipe.sample_weighted(t.pid, th.tid, now, stack, fl, on)?;
            }
            if wall > on {
                pipe.offcpu_interval(t.pid, th.tid, now - (wall - on), wall - on, stack)?;
            }
            self.probes
                .stack(t.pid, th.tid, now, &th.frames, false, pipe)?;
        }
        self.consider_new_code(t, pipe)
    }
}

impl Source for MemorySource {
    fn name(&self) -> &'static str {
        "memory"
    }

    fn period(&self) -> Duration {
        self.period
    }

    fn start(
        &mut self,
        targets: &mut Targets,
        _pipe: &mut Pipeline,
    ) -> anyhow::Result<Vec<(i32, anyhow::Error)>> {
        for t in targets.iter_mut() {
            t.sym.collect_new_code = !self.probes.is_empty();
        }
        Ok(Vec::new())
    }

    fn add_target(&mut self, t: &mut Target) -> anyhow::Result<()> {
        t.sym.collect_new_code = !self.probes.is_empty();
        Ok(())
    }

    fn threads_changed(
        &mut self,
        pid: i32,
        _changed: &[(i32, u64)],
        gone: &[i32],
    ) -> anyhow::Result<()> {
        for &tid in gone {
            self.last.remove(&(pid, tid));
        }
        Ok(())
    }

    fn remove_targets(
        &mut self,
        _targets: &mut Targets,
        exited: &[i32],
        _pipe: &mut Pipeline,
    ) -> anyhow::Result<()> {
        self.last.retain(|(pid, _), _| !exited.contains(pid));
        Ok(())
    }

    fn collect(&mut self, targets: &mut Targets, pipe: &mut Pipeline) -> anyhow::Result<()> {
        for t in targets.iter_mut() {
            self.poll(t, pipe)?;
        }
        Ok(())
    }

    fn finish(&mut self, _targets: &mut Targets, pipe: &mut Pipeline) -> anyhow::Result<()> {
        self.probes.close(None, pipe)
    }

    fn counters(&self, pipe: &Pipeline, out: &mut BTreeMap<String, u64>) {
        // The same keys as the BPF source's, so that readers see one set.
        out.insert("gc_watchpoint_cost_ns".into(), pipe.gc_trap_ns);
        out.insert("gc_watch_attach_failures".into(), 0);
        out.insert("memory_failed_snapshots".into(), self.failed_snapshots);
        if !self.probes.is_empty() {
            super::probes::counters(Some(&self.probes), out);
        }
    }
}
