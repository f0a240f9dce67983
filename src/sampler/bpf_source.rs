//! The BPF source: cpu-clock samples and sched_switch records with the Python stack walked in
//! the kernel (`ebpf/sampler.bpf.c`), GIL waits, GC pauses (write watchpoints) and probed calls
//! (breakpoints), drained from the ring buffer every tick and resolved through each target's
//! symbolizer.

use std::collections::BTreeMap;
use std::time::Duration;

use super::probes::Probes;
use super::source::Source;
use super::target::{Target, Targets};
use super::Pipeline;
use crate::bpf::abi::{self, kind};
use crate::bpf::{BpfSampler, EsThread};
use crate::cpython::PythonProcess;
use crate::record::flags;
use crate::sys::monotonic_ns;

/// What the BPF programs trace besides samples.
#[derive(Debug, Clone, Copy)]
pub struct BpfTracing {
    pub offcpu: bool,
    pub gil: bool,
    pub gc: bool,
    /// Calls per second above which an exact probe switches to sampling (0: never).
    pub probe_max_rate: u64,
    pub quiet: bool,
}

pub struct BpfSource {
    b: BpfSampler,
    probes: Probes,
    tracing: BpfTracing,
}

impl BpfSource {
    /// Load and attach the BPF programs.
    pub fn start(rate_hz: u32, tracing: BpfTracing, probes: Probes) -> anyhow::Result<Self> {
        let b = BpfSampler::start_with(rate_hz, tracing.offcpu, tracing.gil)?;
        Ok(BpfSource { b, probes, tracing })
    }

    /// Push one target's configuration to BPF, with its GC watchpoints.
    fn configure(&mut self, t: &Target) -> anyhow::Result<()> {
        let mut fl = 0;
        if self.tracing.offcpu {
            fl |= abi::TARGET_OFFCPU;
        }
        if self.tracing.gil {
            fl |= abi::TARGET_GIL;
        }
        let mut cfg = t.bpf_config(fl)?;
        if self.tracing.gc {
            let tids: Vec<i32> = t.threads.keys().copied().collect();
            match self
                .probes
                .watch_gc(&mut self.b, t.pid, cfg.gc_collecting_addr, &tids)
            {
                Ok(()) => cfg.flags |= abi::TARGET_GC,
                Err(e) => {
                    if !self.tracing.quiet {
                        eprintln!(
                            "enginescope: no exact GC pauses for process {}: {e:#}",
                            t.pid
                        );
                    }
                }
            }
        }
        self.b.set_target(t.pid as u32, &cfg)
    }

    /// Offer code objects met for the first time to the probes.
    fn consider_new_code(
        &mut self,
        targets: &mut Targets,
        pipe: &mut Pipeline,
    ) -> anyhow::Result<()> {
        if self.probes.is_empty() {
            return Ok(());
        }
        let now = monotonic_ns().saturating_sub(pipe.start_ns);
        for t in targets.iter_mut() {
            if t.sym.new_code.is_empty() {
                continue;
            }
            let fresh = std::mem::take(&mut t.sym.new_code);
            for (code, info, tid) in fresh {
                self.probes
                    .consider(Some(&mut self.b), &t.proc, tid, code, &info, now, pipe)?;
            }
        }
        Ok(())
    }

    /// Resolve and record every event waiting in the ring buffer.
    fn drain(&mut self, targets: &mut Targets, pipe: &mut Pipeline) -> anyhow::Result<()> {
        let mut err = None;
        let mut attach = Vec::new();
        let probes = &mut self.probes;
        self.b.drain(usize::MAX, |bytes| {
            if err.is_some() {
                return;
            }
            let Some((h, frames)) = abi::parse_event(bytes) else {
                return;
            };
            let pid = h.tgid as i32;
            let tid = h.tid as i32;
            let Some(t) = targets.get_mut(pid) else {
                return;
            };
            if matches!(h.kind, kind::SAMPLE | kind::SWITCH_OUT) && probes.wants_stacks(pid) {
                let codes: Vec<u64> = frames.iter().map(|f| f.code).collect();
                if probes.needs_attach(pid, tid, &codes) && attach.len() < 1024 {
                    attach.push((pid, tid, codes));
                }
            }
            if let Err(e) = record_event(t, probes, pipe, &h, &frames, bytes) {
                err = Some(e);
            }
        });
        for (pid, tid, codes) in attach {
            self.probes.observe(&mut self.b, pid, tid, &codes);
        }
        err.map_or(Ok(()), Err)
    }
}

/// One ring-buffer event of target `t`, resolved and written.
fn record_event(
    t: &mut Target,
    probes: &mut Probes,
    pipe: &mut Pipeline,
    h: &abi::EsEventHeader,
    frames: &[abi::EsFrame],
    bytes: &[u8],
) -> anyhow::Result<()> {
    let (pid, tid) = (h.tgid as i32, h.tid as i32);
    match h.kind {
        kind::SAMPLE => {
            let resolved = t.resolve(tid, frames);
            let s = pipe.writer.intern_stack(&resolved)?;
            pipe.sample(pid, tid, h.time_ns, s, sample_flags(h.flags))?;
            probes.stack(pid, tid, h.time_ns, &resolved, false, pipe)
        }
        kind::PROBE_HIT => match abi::parse_probe_frame(bytes) {
            Some(frame) => probes.hit(pid, tid, h.time_ns, h.ip, frame, pipe),
            None => Ok(()),
        },
        kind::SWITCH_OUT if frames.is_empty() && h.flags & abi::ev::PREEMPTED != 0 => {
            // Still runnable (preempted, yielded): no stack walked; its latest known one.
            let s = pipe.last_stack(pid, tid);
            pipe.switch_out(pid, tid, h.time_ns, s, true);
            Ok(())
        }
        kind::SWITCH_OUT => {
            let resolved = t.resolve(tid, frames);
            let s = pipe.writer.intern_stack(&resolved)?;
            pipe.switch_out(pid, tid, h.time_ns, s, h.flags & abi::ev::PREEMPTED != 0);
            probes.stack(pid, tid, h.time_ns, &resolved, true, pipe)
        }
        kind::SWITCH_IN => pipe.switch_in(pid, tid, h.time_ns),
        kind::GIL_WAIT_START => {
            let holder_tid = t.tid_of_tstate(h.ip).unwrap_or(0);
            // The frames are the holder's stack: code objects first met here belong to the
            // holder's thread (0: unknown, no probe is set from them).
            let resolved = t.resolve(holder_tid, frames);
            let s = pipe.writer.intern_stack(&resolved)?;
            let switch_wait = h.flags & abi::ev::SWITCH_WAIT != 0;
            pipe.gil_wait_start(pid, tid, h.time_ns, holder_tid, s, switch_wait);
            Ok(())
        }
        kind::GIL_WAIT_END => pipe.gil_wait_end(pid, tid, h.time_ns).map(|_| ()),
        kind::GC_EDGE => match abi::parse_gc_stats(bytes) {
            Some(st) => pipe.gc_edge(pid, tid, h.time_ns, h.ip as i64, st),
            None => Ok(()),
        },
        _ => Ok(()),
    }
}

fn sample_flags(ev_flags: u8) -> u8 {
    let mut f = 0;
    if ev_flags & abi::ev::GIL != 0 {
        f |= flags::GIL;
    }
    if ev_flags & abi::ev::GC != 0 {
        f |= flags::GC;
    }
    if ev_flags & abi::ev::NATIVE != 0 {
        f |= flags::NATIVE;
    }
    if ev_flags & abi::ev::KERNEL != 0 {
        f |= flags::KERNEL;
    }
    if ev_flags & (abi::ev::PARTIAL | abi::ev::TRUNCATED | abi::ev::NO_TSTATE) != 0 {
        f |= flags::PARTIAL;
    }
    f
}

impl Source for BpfSource {
    fn name(&self) -> &'static str {
        "bpf"
    }

    fn period(&self) -> Duration {
        Duration::from_millis(20)
    }

    fn start(
        &mut self,
        targets: &mut Targets,
        pipe: &mut Pipeline,
    ) -> anyhow::Result<Vec<(i32, anyhow::Error)>> {
        // Stacks at start, for threads that are blocked when we begin.
        for t in targets.iter_mut() {
            t.sym.collect_new_code = !self.probes.is_empty();
            if let Ok(stacks) = t.stacks() {
                for th in stacks {
                    let stack = pipe.writer.intern_stack(&th.frames)?;
                    pipe.initial_stack(t.pid, th.tid, stack);
                }
            }
        }
        let mut failed = Vec::new();
        for t in targets.iter_mut() {
            if let Err(e) = self.configure(t) {
                failed.push((t.pid, e));
            }
        }
        if self.tracing.gc || !self.probes.is_empty() {
            match self.b.watchpoint_cost_ns() {
                Ok(ns) => {
                    pipe.gc_trap_ns = ns;
                    self.probes.trap_ns = ns;
                }
                Err(e) if !self.tracing.quiet => {
                    eprintln!("enginescope: could not time a watchpoint hit: {e:#}")
                }
                Err(_) => {}
            }
        }
        Ok(failed)
    }

    fn add_target(&mut self, t: &mut Target) -> anyhow::Result<()> {
        t.sym.collect_new_code = !self.probes.is_empty();
        self.configure(t)
    }

    fn threads_changed(
        &mut self,
        pid: i32,
        changed: &[(i32, u64)],
        gone: &[i32],
    ) -> anyhow::Result<()> {
        for &(tid, tstate) in changed {
            self.b.set_thread(
                tid as u32,
                &EsThread {
                    tstate,
                    tgid: pid as u32,
                    pad: 0,
                },
            )?;
            self.probes.thread_added(&mut self.b, pid, tid);
        }
        for &tid in gone {
            self.b.remove_thread(tid as u32);
            self.probes.thread_gone(&mut self.b, tid);
        }
        Ok(())
    }

    fn remove_targets(
        &mut self,
        targets: &mut Targets,
        exited: &[i32],
        pipe: &mut Pipeline,
    ) -> anyhow::Result<()> {
        for &pid in exited {
            self.b.remove_target(pid as u32);
        }
        self.drain(targets, pipe)?;
        for t in targets.iter().filter(|t| exited.contains(&t.pid)) {
            for &tid in t.threads.keys() {
                self.b.remove_thread(tid as u32);
                self.probes.thread_gone(&mut self.b, tid);
            }
            self.probes.process_gone(&mut self.b, t.pid);
        }
        Ok(())
    }

    fn collect(&mut self, targets: &mut Targets, pipe: &mut Pipeline) -> anyhow::Result<()> {
        self.drain(targets, pipe)?;
        self.consider_new_code(targets, pipe)?;
        if self.tracing.probe_max_rate > 0 {
            self.probes.enforce_rate(
                &mut self.b,
                monotonic_ns(),
                self.tracing.probe_max_rate,
                pipe,
            )?;
        }
        Ok(())
    }

    fn finish(&mut self, targets: &mut Targets, pipe: &mut Pipeline) -> anyhow::Result<()> {
        // Stop new events, then drain what is left.
        for t in targets.iter() {
            self.b.remove_target(t.pid as u32);
        }
        let drained = self.drain(targets, pipe);
        let closed = self.probes.close(Some(&mut self.b), pipe);
        drained.and(closed)
    }

    fn counters(&self, pipe: &Pipeline, out: &mut BTreeMap<String, u64>) {
        for (k, v) in self.b.counters() {
            out.insert(k.to_string(), v);
        }
        out.insert("gc_watchpoint_cost_ns".into(), pipe.gc_trap_ns);
        out.insert(
            "gc_watch_attach_failures".into(),
            self.probes.gc_attach_failures,
        );
        if !self.probes.is_empty() {
            super::probes::counters(Some(&self.probes), out);
        }
    }
}

/// A short BPF check for `doctor`: load and attach the programs, sample `pid` for `duration`,
/// and return the counters plus how many events came back (by kind).
pub fn bpf_selftest(pid: i32, duration: Duration) -> anyhow::Result<BTreeMap<String, u64>> {
    let mut target = Target::new(PythonProcess::attach(pid)?);
    let mut b = BpfSampler::start(997, true)?;
    let (changed, _) = target.refresh_threads();
    for (tid, tstate, _) in changed {
        b.set_thread(
            tid as u32,
            &EsThread {
                tstate,
                tgid: pid as u32,
                pad: 0,
            },
        )?;
    }
    b.set_target(pid as u32, &target.bpf_config(abi::TARGET_OFFCPU)?)?;
    std::thread::sleep(duration);
    b.remove_target(pid as u32);
    let mut out: BTreeMap<String, u64> = b
        .counters()
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
    let mut frames = 0u64;
    let mut unresolved = 0u64;
    b.drain(usize::MAX, |bytes| {
        if let Some((h, f)) = abi::parse_event(bytes) {
            let key = match h.kind {
                kind::SAMPLE => "events_sample",
                kind::SWITCH_OUT => "events_switch_out",
                kind::SWITCH_IN => "events_switch_in",
                _ => "events_other",
            };
            *out.entry(key.into()).or_default() += 1;
            let resolved = target.resolve(0, &f);
            frames += resolved.len() as u64;
            unresolved += resolved
                .iter()
                .filter(|fr| fr.function == "<unknown>")
                .count() as u64;
        }
    });
    out.insert("frames_resolved".into(), frames - unresolved);
    out.insert("frames_unresolved".into(), unresolved);
    Ok(out)
}
