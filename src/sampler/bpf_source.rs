//! The BPF source: cpu-clock samples and sched_switch records with the Python stack walked in
//! the kernel (`ebpf/sampler.bpf.c`), GIL waits, GC pauses (write watchpoints) and probed calls
//! (breakpoints), drained from the ring buffer every tick and resolved through each target's
//! symbolizer.

use std::collections::BTreeMap;
use std::time::Duration;

use super::gc::GcTracing;
use super::pipeline::OnCpu;
use super::probes::Probes;
use super::runtime_weight::RuntimeWeights;
use super::source::Source;
use super::target::{Target, Targets};
use super::Pipeline;
use crate::bpf::abi::{self, kind};
use crate::bpf::{watchers, BpfSampler, EsThread};
use crate::cpython::{Frame, PythonProcess};
use crate::native::backlog::Backlog;
use crate::native::RawNative;
use crate::record::flags;
use crate::sys::monotonic_ns;

/// What the BPF programs trace besides samples.
#[derive(Debug, Clone, Copy)]
pub(crate) struct BpfTracing {
    pub offcpu: bool,
    pub gil: bool,
    pub gc: bool,
    /// Calls per second above which an exact probe switches to sampling (0: never).
    pub probe_max_rate: u64,
    pub quiet: bool,
    /// Native and kernel frames (`record --native` / `--kernel-stacks`).
    pub native: crate::native::NativeOptions,
    /// A preempted thread's off-CPU interval carries the stack walked where it was
    /// preempted; false: its last known stack (aggregated recordings: the agent).
    pub preempted_stacks: bool,
    /// Always on in the background (the agent): its probes give their debug registers back
    /// while a foreground recording on the host watches probes ([`watchers`]).
    pub yields_registers: bool,
}

/// How often each process that watches probes reads who else does on the host
/// ([`watchers::others`]: a directory of a few files).
const WATCHERS_LOOK_NS: u64 = 100_000_000;
/// The longest a foreground recording waits for the others to give their registers back.
const ROOM_WAIT: Duration = Duration::from_secs(2);

/// This process among the host's probe watchers, and (the agent) whether it has given its
/// registers back to a foreground recording.
#[derive(Debug, Default)]
struct Courtesy {
    /// Its entry, held while it lives (None: no probes, or the directory could not be made).
    registration: Option<watchers::Registration>,
    /// What its entry says now.
    said: Option<watchers::State>,
    /// The agent: since when its probes are suspended for a foreground recording
    /// (absolute ns).
    yielding: Option<u64>,
    /// A foreground recording: whether it has waited for room.
    waited: bool,
    /// Looks in a row that found no foreground recording.
    fg_absent: u32,
    next_look_ns: u64,
    /// Times the agent gave its registers back, and for how long in all (counters
    /// `probe_yields`, `probe_yielded_ns`).
    yields: u64,
    yielded_ns: u64,
}

pub(crate) struct BpfSource {
    b: BpfSampler,
    probes: Probes,
    tracing: BpfTracing,
    /// Symbolization and pairing of native-stack records, when asked for.
    native: Option<crate::native::NativeState>,
    /// Events waiting for their native frames' symbol tables (empty without `--native`).
    backlog: Backlog<Prepared>,
    /// The longest the drain spent on one event (a stall would show here: the drain runs
    /// for as long as events keep coming, so its own length says little), and how long
    /// finishing waited for symbol tables (counters `bpf_event_max_us`,
    /// `native_finish_wait_ms`).
    event_max_ns: u64,
    finish_wait_ns: u64,
    /// Ring-buffer records too short or of an unknown layout (counter `events_unparsed`).
    unparsed: u64,
    /// Samples' CPU time from the threads' scheduler runtime, and the machine's steal for
    /// threads not sampled long enough yet.
    weights: RuntimeWeights,
    steal: super::runtime_weight::Steal,
    /// How each target's GC pauses are timed, and the uprobes that time them.
    gc: GcTracing,
    /// The calibrated watchpoint trap cost, measured once something will trap (a probe, or a
    /// target's GC timed by a watchpoint), with its working-set figure when probes need it.
    trap_cost: Option<crate::bpf::TrapCost>,
    /// Sharing the debug registers with other enginescope processes on the host.
    courtesy: Courtesy,
}

/// Events waiting for symbols at most (~25 s at 1 kHz on 2 CPUs with switch-outs; each
/// holds its resolved Python frames and up to ~100 native addresses, a few KiB).
const BACKLOG_CAP: usize = 50_000;
/// Events waiting for symbols beyond which the symbol loader stops running at a low priority
/// (a few seconds of events).
const BACKLOG_HURRY: usize = 5_000;

impl BpfSource {
    /// Load and attach the BPF programs.
    pub fn start(rate_hz: u32, tracing: BpfTracing, probes: Probes) -> anyhow::Result<Self> {
        // Native stacks send 0.6 KiB plus each thread's stack window (2-4 KiB for most, up
        // to 16 KiB) per sample and blocking switch-out: 16 MiB holds ~3,000 typical ones
        // (1.5 s at 1 kHz on 2 CPUs; ~1,000 of the largest) for a drain held up by a busy
        // host. (Creating the ring clears its pages: ~2 ms per MiB here.)
        let ring = tracing.native.user.then_some(16 << 20);
        // Said first, so that the others on the host give their registers back while the
        // programs load (they look every WATCHERS_LOOK_NS).
        let courtesy = Courtesy::begin(&probes, tracing);
        let b = BpfSampler::start_sized(rate_hz, tracing.offcpu, tracing.gil, ring)?;
        let native = tracing
            .native
            .any()
            .then(|| crate::native::NativeState::new(tracing.native));
        Ok(BpfSource {
            b,
            probes,
            tracing,
            native,
            backlog: Backlog::new(BACKLOG_CAP),
            event_max_ns: 0,
            unparsed: 0,
            finish_wait_ns: 0,
            weights: RuntimeWeights::new(crate::record::Period::of_hz(rate_hz).ns()),
            steal: Default::default(),
            gc: GcTracing::new(tracing.quiet),
            trap_cost: None,
            courtesy,
        })
    }

    /// A foreground recording, before it sets its first watchpoint: wait (at most
    /// [`ROOM_WAIT`]) until the other enginescope processes on the host leave it every debug
    /// register (agents given way, no slots on every CPU held), so that its probes find them
    /// all from the start. Before the window: start-up is longer by this wait (about two of
    /// the others' looks) only where another process watches probes.
    fn wait_for_room(&mut self) {
        let c = &mut self.courtesy;
        if self.tracing.yields_registers || c.registration.is_none() || c.waited {
            return;
        }
        c.waited = true;
        let _s = crate::sys::steps::step("wait_for_room");
        let late = watchers::wait_for_room(std::path::Path::new(watchers::DIR), ROOM_WAIT);
        if !late.is_empty() && !self.tracing.quiet {
            eprintln!(
                "enginescope: enginescope process {} on this host still holds debug registers after {} s: this recording's probes may take turns until it gives them back",
                join_pids(&late),
                ROOM_WAIT.as_secs()
            );
        }
    }

    /// Share the debug registers with the other enginescope processes on the host that watch
    /// probes ([`watchers`]), looked at every [`WATCHERS_LOOK_NS`]: slots on every CPU only
    /// while none is registered; the agent gives all its registers back (its probes
    /// suspended) while a foreground recording is, and watches again once none is. Each
    /// says what it holds in its file.
    fn share_registers(&mut self, targets: &Targets) {
        let c = &mut self.courtesy;
        if c.registration.is_none() {
            return;
        }
        let now = monotonic_ns();
        if now < c.next_look_ns {
            return;
        }
        c.next_look_ns = now + WATCHERS_LOOK_NS;
        let others = watchers::others(std::path::Path::new(watchers::DIR));
        // A foreground recording beside agents that have given way keeps its cheap watches
        // on every CPU (per-thread ones cost the engine a register reload at each switch).
        let alone = if self.tracing.yields_registers {
            others.is_empty()
        } else {
            others
                .iter()
                .all(|w| w.role == watchers::Role::Agent && w.state == watchers::State::Yielded)
        };
        self.b.allow_cpu_slots(alone);
        let fg: Vec<i32> = others
            .iter()
            .filter(|w| w.role == watchers::Role::Foreground)
            .map(|w| w.pid)
            .collect();
        // Watching again takes two looks in a row with no foreground recording (a file read
        // while it is rewritten says nothing for one look).
        c.fg_absent = if fg.is_empty() { c.fg_absent + 1 } else { 0 };
        if self.tracing.yields_registers {
            let proc_of = |pid| targets.iter().find(|t| t.pid == pid).map(|t| &t.proc);
            match (c.yielding, fg.is_empty() && c.fg_absent >= 2) {
                (None, _) if !fg.is_empty() => {
                    self.probes.suspend(&mut self.b, proc_of, now);
                    // The watches on every CPU are gone with the probes: close the slots now.
                    self.b.allow_cpu_slots(false);
                    c.yields += 1;
                    c.yielding = Some(now);
                    if !self.tracing.quiet {
                        eprintln!(
                            "enginescope: a recording (pid {}) watches probes on this host: this agent's probes give it their debug registers until it ends (their counts scale by the time watched)",
                            join_pids(&fg)
                        );
                    }
                }
                (Some(since), true) => {
                    c.yielded_ns += now.saturating_sub(since);
                    c.yielding = None;
                    self.probes.resume(&mut self.b, proc_of, now);
                    if !self.tracing.quiet {
                        eprintln!("enginescope: no recording watches probes on this host any more: this agent's probes are watched again");
                    }
                }
                _ => {}
            }
        }
        let state = if self.b.holds_cpu_slots() {
            watchers::State::CpuSlots
        } else if c.yielding.is_some() {
            watchers::State::Yielded
        } else {
            watchers::State::ThreadsOnly
        };
        if c.said != Some(state) {
            if let Some(reg) = &c.registration {
                if reg.say(state).is_ok() {
                    c.said = Some(state);
                }
            }
        }
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
        if self.tracing.native.kernel {
            fl |= abi::TARGET_KSTACK;
        }
        if self.tracing.native.user {
            fl |= abi::TARGET_USTACK;
        }
        if !self.tracing.preempted_stacks {
            fl |= abi::TARGET_PREEMPT_LAST;
        }
        if let Some(n) = self.native.as_mut() {
            // Map its modules now: their symbol tables load while it runs.
            n.native.attach(t.pid);
            if n.native.opts.user {
                // Name C functions with no symbol from the interpreter's builtins.
                if let Ok(interp) = t.proc.main_interpreter() {
                    n.native.watch_builtins(t.pid, &t.proc.offsets, interp);
                }
            }
        }
        let mut cfg = t.bpf_config(fl)?;
        if self.tracing.gc {
            self.gc
                .configure(&mut self.b, &mut self.probes, t, &mut cfg);
        }
        self.b.set_target(t.pid as u32, &cfg)
    }

    /// Time a watchpoint hit here, once (`in_use`: with its working-set figure too), and
    /// give it to the pipeline (GC pauses) and the probes.
    fn calibrate_traps(&mut self, pipe: &mut Pipeline, in_use: bool) {
        if self.trap_cost.is_some() {
            return;
        }
        let _s = crate::sys::steps::step("trap_calibration");
        match self.b.watchpoint_costs_ns(in_use) {
            Ok(c) => {
                pipe.gc_trap_ns = c.hot;
                self.probes.trap_ns = c.hot;
                self.probes.budget_trap_ns = c.in_use;
                self.trap_cost = Some(c);
            }
            Err(e) => {
                // Not again for every target that needs it.
                self.trap_cost = Some(crate::bpf::TrapCost { hot: 0, in_use: 0 });
                if !self.tracing.quiet {
                    eprintln!("enginescope: could not time a watchpoint hit: {e:#}")
                }
            }
        }
    }

    /// Write the GC methods chosen since the last call; a GC watchpoint's pauses hold about
    /// one trap, which the pipeline subtracts: time one now if nothing has (targets whose GC
    /// is timed by uprobes never trap).
    fn flush_gc_methods(&mut self, pipe: &mut Pipeline) -> anyhow::Result<()> {
        if self.gc.needs_trap_cost() {
            self.calibrate_traps(pipe, false);
        }
        self.gc.flush(pipe)
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
        let now = pipe.rel(monotonic_ns());
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

    /// Resolve and record the events waiting in the ring buffer: all of them, or for at most
    /// `slice` (the recording loop's turn, [`DRAIN_SLICE`]: it comes back for the rest after
    /// its other work, and sees a stop between: a recorder starved of CPU, an unoptimized
    /// build behind a busy engine, spent 15 s in one drain after `q` while the kernel kept
    /// adding events). Never reads a symbol table:
    /// events whose native frames wait for one go to the backlog, applied in order once
    /// their modules' symbols are read.
    fn drain(
        &mut self,
        targets: &mut Targets,
        pipe: &mut Pipeline,
        slice: Option<std::time::Duration>,
    ) -> anyhow::Result<()> {
        // Everything that happened before now is in the ring buffer: drained, once it empties.
        let now = monotonic_ns();
        let slice_end = slice.map(|d| std::time::Instant::now() + d);
        let mut err = None;
        let mut event_max_ns = self.event_max_ns;
        let mut unparsed = 0u64;
        let mut attach = Vec::new();
        let probes = &mut self.probes;
        let native = &mut self.native;
        let backlog = &mut self.backlog;
        let weights = &mut self.weights;
        let mut handle = |bytes: &[u8]| {
            if err.is_some() {
                return;
            }
            let started = std::time::Instant::now();
            let _timed = Timed(started, &mut event_max_ns);
            let Some((h, mut frames)) = abi::parse_event(bytes) else {
                unparsed += 1;
                return;
            };
            let pid = h.tgid as i32;
            let tid = h.tid as i32;
            let Some(t) = targets.get_mut(pid) else {
                return;
            };
            if h.kind == kind::NATIVE_STACK {
                if let Some(n) = native.as_mut() {
                    n.stash(pid, bytes);
                }
                return;
            }
            let entry = crate::native::entry_marks(&mut frames, t.proc.version.minor);
            if matches!(h.kind, kind::SAMPLE | kind::SWITCH_OUT) && probes.wants_stacks(pid) {
                let codes: Vec<u64> = frames.iter().map(|f| f.code).collect();
                if probes.needs_attach(pid, tid, &codes) && attach.len() < 1024 {
                    attach.push((pid, tid, codes));
                }
            }
            let Some(p) = prepare(t, native.as_mut(), weights, &h, &frames, entry, bytes) else {
                return;
            };
            let ready = p.ready();
            let mut apply_now = backlog.admit(p, ready);
            loop {
                let Some((p, ready)) = apply_now.take() else {
                    break;
                };
                if let Err(e) = apply(p, probes, native.as_mut(), pipe, ready) {
                    err = Some(e);
                    return;
                }
                // Over its bound, the backlog gives its oldest back.
                apply_now = backlog.next(Prepared::ready, false);
            }
        };
        let emptied = loop {
            if self.b.drain(DRAIN_CHUNK, &mut handle) < DRAIN_CHUNK {
                break true;
            }
            if slice_end.is_some_and(|e| std::time::Instant::now() >= e) {
                break false;
            }
        };
        if emptied {
            self.probes.drained_to(now);
        }
        self.event_max_ns = event_max_ns;
        self.unparsed += unparsed;
        if self.backlog.len() > BACKLOG_HURRY {
            if let Some(n) = &self.native {
                n.native.hurry_symbols();
            }
        }
        if let Some(n) = self.native.as_mut() {
            for (tid, window) in n.take_window_changes() {
                // A failed update leaves the thread's previous window: costlier or shorter
                // stacks, never a wrong one.
                let _ = self.b.set_thread_window(tid as u32, window);
            }
        }
        for (pid, tid, codes) in attach {
            if let Some(t) = targets.get_mut(pid) {
                self.probes.observe(&mut self.b, &t.proc, tid, &codes);
            }
        }
        if let Some(e) = err {
            return Err(e);
        }
        self.apply_backlog(pipe, false)
    }

    /// Apply the waiting events whose symbols are read (`all`: every one, reading the
    /// symbol tables still unread).
    fn apply_backlog(&mut self, pipe: &mut Pipeline, all: bool) -> anyhow::Result<()> {
        while let Some((p, ready)) = self.backlog.next(Prepared::ready, all) {
            apply(
                p,
                &mut self.probes,
                self.native.as_mut(),
                pipe,
                ready || all,
            )?;
        }
        Ok(())
    }
}

/// The longest one drain of the ring buffer runs before the loop takes its turn again.
const DRAIN_SLICE: std::time::Duration = std::time::Duration::from_millis(100);
/// Events drained between two looks at the clock.
const DRAIN_CHUNK: usize = 256;

/// Keeps the longest time from its start to its drop (one event's handling).
struct Timed<'a>(std::time::Instant, &'a mut u64);

impl Drop for Timed<'_> {
    fn drop(&mut self) {
        *self.1 = (*self.1).max(self.0.elapsed().as_nanos() as u64);
    }
}

/// A ring-buffer event resolved as far as it can be while draining: the Python frames read
/// from the target now (its code objects may be gone later), the native stack unwound, its
/// names left for when its modules' symbols are read.
struct Prepared {
    pid: i32,
    tid: i32,
    time_ns: u64,
    flags: u8,
    /// The thread's scheduler runtime at `time_ns` (samples and switches; 0: not carried).
    runtime_ns: u64,
    body: Body,
}

enum Body {
    /// A sample, or a blocking switch-out (`switch_out`), with its stack.
    Stack {
        switch_out: bool,
        /// A sample's CPU time (ns).
        weight_ns: u64,
        /// Shared with the thread's `last_walked` (a switch-out with the same stack reuses it).
        python: std::sync::Arc<[Frame]>,
        entry: Vec<bool>,
        native: Option<RawNative>,
    },
    /// A switch-out with no stack walked: the thread's latest known stack stands for it.
    Preempted {
        preempted: bool,
    },
    SwitchIn,
    GilWaitStart {
        holder_tid: i32,
        python: Vec<Frame>,
    },
    GilWaitEnd,
    Wake {
        waker_tid: i32,
        python: Vec<Frame>,
    },
    GcEdge(i64, abi::GcStats),
    ProbeHit(u64, abi::ProbeFrame),
}

impl Prepared {
    /// Whether it can be written without waiting for a symbol table.
    fn ready(&self) -> bool {
        match &self.body {
            Body::Stack {
                native: Some(n), ..
            } => n.ready(),
            _ => true,
        }
    }
}

/// Resolve what must be read now of one event of target `t` (None: nothing to record).
fn prepare(
    t: &mut Target,
    native: Option<&mut crate::native::NativeState>,
    weights: &mut RuntimeWeights,
    h: &abi::EsEventHeader,
    frames: &[abi::EsFrame],
    entry: Vec<bool>,
    bytes: &[u8],
) -> Option<Prepared> {
    let (pid, tid) = (h.tgid as i32, h.tid as i32);
    let body = match h.kind {
        kind::SWITCH_OUT if h.flags & abi::ev::SAME_STACK != 0 => match t.last_walked.get(&tid) {
            // The stack last walked, unchanged (the kernel compared every frame's address
            // and instruction): as if walked again.
            Some(python) => Body::Stack {
                switch_out: true,
                weight_ns: 0,
                native: None,
                python: python.clone(),
                entry,
            },
            // Its walk was not seen (dropped before the window, lost): the latest known stack.
            None => Body::Preempted {
                preempted: h.flags & abi::ev::PREEMPTED != 0,
            },
        },
        kind::SAMPLE | kind::SWITCH_OUT
            if !(h.kind == kind::SWITCH_OUT
                && frames.is_empty()
                && h.flags & abi::ev::PREEMPTED != 0) =>
        {
            let python: std::sync::Arc<[Frame]> = t.resolve(tid, frames).into();
            let switch_out = h.kind == kind::SWITCH_OUT;
            if h.flags & (abi::ev::PARTIAL | abi::ev::TRUNCATED | abi::ev::NO_TSTATE) == 0 {
                t.last_walked.insert(tid, python.clone());
            } else {
                t.last_walked.remove(&tid);
            }
            Body::Stack {
                switch_out,
                // A sample carries its thread's scheduler runtime.
                weight_ns: if switch_out {
                    0
                } else {
                    weights.weight(tid, h.ip)
                },
                native: native.and_then(|n| n.take(tid, h.time_ns)),
                python,
                entry,
            }
        }
        // Still runnable inside sched_yield (a busy-wait loop): no stack walked.
        kind::SWITCH_OUT => Body::Preempted { preempted: true },
        kind::PROBE_HIT => Body::ProbeHit(h.ip, abi::parse_probe_frame(bytes)?),
        kind::SWITCH_IN => Body::SwitchIn,
        kind::GIL_WAIT_START => {
            let holder_tid = t.tid_of_tstate(h.ip).unwrap_or(0);
            // The frames are the holder's stack: code objects first met here belong to the
            // holder's thread (0: unknown, no probe is set from them).
            Body::GilWaitStart {
                holder_tid,
                python: t.resolve(holder_tid, frames),
            }
        }
        kind::GIL_WAIT_END => Body::GilWaitEnd,
        kind::WAKE => {
            // The frames are the waker's stack (h.ip its tid, from the kernel).
            let waker_tid = h.ip as i32;
            Body::Wake {
                waker_tid,
                python: t.resolve(waker_tid, frames),
            }
        }
        kind::GC_EDGE => Body::GcEdge(h.ip as i64, abi::parse_gc_stats(bytes)?),
        _ => return None,
    };
    let runtime_ns = match h.kind {
        kind::SAMPLE | kind::SWITCH_OUT | kind::SWITCH_IN => h.ip,
        _ => 0,
    };
    Some(Prepared {
        pid,
        tid,
        time_ns: h.time_ns,
        flags: h.flags,
        runtime_ns,
        body,
    })
}

/// Write one prepared event. `wait`: name native frames even if that means reading a symbol
/// table now (else frames of modules not read yet are written as not loaded).
fn apply(
    p: Prepared,
    probes: &mut Probes,
    native: Option<&mut crate::native::NativeState>,
    pipe: &mut Pipeline,
    wait: bool,
) -> anyhow::Result<()> {
    let Prepared {
        pid,
        tid,
        time_ns,
        flags: ev_flags,
        runtime_ns,
        body,
    } = p;
    match body {
        Body::Stack {
            switch_out,
            weight_ns,
            python,
            entry,
            native: raw,
        } => {
            // Python frames merged with the native record sent with the event, when native
            // stacks are recorded (else the Python frames alone).
            let (s, nf) = match (native, raw) {
                (Some(n), Some(raw)) => (
                    n.mixed_stack(&mut pipe.writer, &raw, &python, &entry, wait)?,
                    true,
                ),
                _ => (pipe.writer.intern_stack(&python)?, false),
            };
            if switch_out {
                pipe.runtime_at(pid, tid, time_ns, runtime_ns, OnCpu::Leaves)?;
                pipe.switch_out(pid, tid, time_ns, s, ev_flags & abi::ev::PREEMPTED != 0)?;
            } else {
                let fl = sample_flags(ev_flags) | if nf { flags::NATIVE_FRAMES } else { 0 };
                pipe.sample(pid, tid, time_ns, s, fl, weight_ns)?;
                pipe.runtime_at(pid, tid, time_ns, runtime_ns, OnCpu::Runs)?;
            }
            probes.stack(pid, tid, time_ns, &python, switch_out, pipe)
        }
        Body::Preempted { preempted } => {
            // Its latest known stack.
            let s = pipe.last_stack(pid, tid);
            pipe.runtime_at(pid, tid, time_ns, runtime_ns, OnCpu::Leaves)?;
            pipe.switch_out(pid, tid, time_ns, s, preempted)
        }
        Body::ProbeHit(ip, frame) => probes.hit(pid, tid, time_ns, ip, frame, pipe),
        Body::SwitchIn => {
            pipe.switch_in(pid, tid, time_ns)?;
            pipe.runtime_at(pid, tid, time_ns, runtime_ns, OnCpu::Enters)
        }
        Body::GilWaitStart { holder_tid, python } => {
            let s = pipe.writer.intern_stack(&python)?;
            let switch_wait = ev_flags & abi::ev::SWITCH_WAIT != 0;
            pipe.gil_wait_start(pid, tid, time_ns, holder_tid, s, switch_wait);
            Ok(())
        }
        Body::GilWaitEnd => pipe.gil_wait_end(pid, tid, time_ns).map(|_| ()),
        Body::Wake { waker_tid, python } => {
            let s = pipe.writer.intern_stack(&python)?;
            pipe.wake(pid, tid, time_ns, waker_tid, s)
        }
        Body::GcEdge(value, st) => {
            if !pipe.gc_uprobe_pids.contains(&pid) {
                probes.note_trap(tid, time_ns);
            }
            pipe.gc_edge(pid, tid, time_ns, value, st)
        }
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
        // Steal is measured per stay on a CPU, which only switch records bound.
        pipe.measure_steal = self.tracing.offcpu;
        // Stacks at start, for threads that are blocked when we begin.
        let initial = crate::sys::steps::step("initial_stacks");
        for t in targets.iter_mut() {
            t.sym.collect_new_code = !self.probes.is_empty();
            if let Ok(stacks) = t.stacks() {
                for th in stacks {
                    let stack = pipe.writer.intern_stack(&th.frames)?;
                    pipe.initial_stack(t.pid, th.tid, stack);
                }
            }
        }
        drop(initial);
        let mut failed = Vec::new();
        for t in targets.iter_mut() {
            let _s = crate::sys::steps::step("configure");
            if let Err(e) = self.configure(t) {
                failed.push((t.pid, e));
            }
        }
        if !self.probes.is_empty() {
            // The working-set figure only where a budget sizes the probes' phases from it.
            self.calibrate_traps(pipe, self.probes.budget() > 0.0);
        }
        self.flush_gc_methods(pipe)?;
        if !self.probes.is_empty() && self.probes.budget() > 0.0 {
            // What holding watchpoints costs a thread per context switch: part of what the
            // budget sizes (a busy-wait loop yields thousands of times a second).
            let _s = crate::sys::steps::step("switch_calibration");
            match self.b.watched_switch_cost_ns() {
                Ok(c) => self.probes.switch_cost = c,
                Err(e) if !self.tracing.quiet => eprintln!(
                    "enginescope: could not time a context switch with watchpoints held ({e:#}); the probe budget counts debug traps only"
                ),
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
            let ustack_window = self.native.as_ref().map_or(0, |n| n.window_of(tid));
            self.b.set_thread(
                tid as u32,
                &EsThread {
                    tstate,
                    tgid: pid as u32,
                    ustack_window,
                },
            )?;
            self.probes.thread_added(&mut self.b, pid, tid);
        }
        if !gone.is_empty() {
            self.weights.retain(|tid| !gone.contains(&tid));
        }
        for &tid in gone {
            self.b.remove_thread(tid as u32);
            if let Some(n) = self.native.as_mut() {
                n.thread_gone(tid);
            }
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
        self.drain(targets, pipe, None)?;
        for t in targets.iter().filter(|t| exited.contains(&t.pid)) {
            for &tid in t.threads.keys() {
                self.b.remove_thread(tid as u32);
                self.probes.thread_gone(&mut self.b, tid);
            }
            self.probes.process_gone(&mut self.b, t.pid);
            if let Some(n) = self.native.as_mut() {
                n.native.forget(t.pid);
            }
            self.gc.process_gone(&mut self.b, t.pid);
        }
        Ok(())
    }

    fn collect(&mut self, targets: &mut Targets, pipe: &mut Pipeline) -> anyhow::Result<()> {
        if let Some(n) = self.native.as_mut() {
            n.native.apply_builtins();
        }
        self.b.rephase_sampling();
        if let Some(share) = self.steal.not_stolen(monotonic_ns()) {
            self.weights.set_unsettled(share);
        }
        self.flush_gc_methods(pipe)?;
        self.drain(targets, pipe, Some(DRAIN_SLICE))?;
        self.consider_new_code(targets, pipe)?;
        self.probes.enforce_rate(
            &mut self.b,
            monotonic_ns(),
            self.tracing.probe_max_rate,
            pipe,
        )?;
        let ts: &Targets = targets;
        self.share_registers(ts);
        self.probes.rotate(
            &mut self.b,
            |pid| ts.iter().find(|t| t.pid == pid).map(|t| &t.proc),
            monotonic_ns(),
        );
        self.probes.flush_watches(pipe)
    }

    fn set_off(&mut self, mask: u32, targets: &Targets) -> anyhow::Result<()> {
        self.b.set_off(mask)?;
        let proc_of = |pid| targets.iter().find(|t| t.pid == pid).map(|t| &t.proc);
        if mask & crate::bpf::abi::OFF_PROBE != 0 {
            self.probes.suspend(&mut self.b, proc_of, monotonic_ns());
        } else {
            self.probes.resume(&mut self.b, proc_of, monotonic_ns());
        }
        Ok(())
    }

    fn look_for_probes(
        &mut self,
        targets: &mut Targets,
        pipe: &mut Pipeline,
    ) -> anyhow::Result<usize> {
        if self.probes.is_empty() {
            return Ok(0);
        }
        // An agent that finds a foreground recording on the host sets nothing; a foreground
        // recording lets the others give their registers back before it sets its own.
        self.share_registers(targets);
        self.wait_for_room();
        let mut seen = Vec::new();
        for t in targets.iter_mut() {
            let threads: Vec<(i32, u64)> =
                t.threads.iter().map(|(&tid, &(ts, _))| (tid, ts)).collect();
            for (tid, tstate) in threads {
                let (raw, _) = t.proc.walk_raw(tstate);
                // Resolving collects the code objects met for the first time.
                let _ = t.resolve(tid, &raw);
                seen.push((t.pid, tid, raw.iter().map(|f| f.code).collect::<Vec<u64>>()));
            }
        }
        self.consider_new_code(targets, pipe)?;
        for (pid, tid, codes) in seen {
            if self.probes.needs_attach(pid, tid, &codes) {
                if let Some(t) = targets.get_mut(pid) {
                    self.probes.observe(&mut self.b, &t.proc, tid, &codes);
                }
            }
        }
        self.probes.flush_watches(pipe)?;
        Ok(self.probes.placed())
    }

    fn finish(&mut self, targets: &mut Targets, pipe: &mut Pipeline) -> anyhow::Result<()> {
        // Stop new events, then drain what is left.
        for t in targets.iter() {
            self.b.remove_target(t.pid as u32);
        }
        let drained = {
            let _s = crate::sys::steps::step("finish_drain");
            self.drain(targets, pipe, None)
        };
        // What still waits for symbols: read them now (the target is no longer sampled).
        let t = std::time::Instant::now();
        let waited = self.apply_backlog(pipe, true);
        self.finish_wait_ns = t.elapsed().as_nanos() as u64;
        let closed = {
            let _s = crate::sys::steps::step("finish_probes");
            self.probes.close(Some(&mut self.b), pipe)
        };
        self.gc.finish(&mut self.b);
        drained.and(waited).and(closed)
    }

    fn counters(&self, pipe: &Pipeline, out: &mut BTreeMap<String, u64>) {
        out.extend(self.b.counters());
        let c = &self.courtesy;
        let yielding = c
            .yielding
            .map_or(0, |since| monotonic_ns().saturating_sub(since));
        out.insert("probe_yields".into(), c.yields);
        out.insert("probe_yielded_ns".into(), c.yielded_ns + yielding);
        out.insert("gc_watchpoint_cost_ns".into(), pipe.gc_trap_ns);
        out.insert(
            "offcpu_switch_ins_missed".into(),
            pipe.written.switch_ins_missed,
        );
        out.insert(
            "offcpu_switch_ins_unpaired".into(),
            pipe.written.switch_ins_unpaired,
        );
        out.insert("offcpu_stolen_intervals".into(), pipe.written.stolen);
        out.insert(
            "gc_watch_attach_failures".into(),
            self.probes.n.gc_attach_failures,
        );
        self.gc.counters(out);
        out.insert(
            "gc_uprobe_calls_without_collection".into(),
            pipe.written.gc_calls_without_collection,
        );
        if !self.probes.is_empty() {
            super::probes::counters(Some(&self.probes), out);
        }
        out.insert("bpf_event_max_us".into(), self.event_max_ns / 1_000);
        out.insert(
            "samples_steal_ms".into(),
            self.weights.left_out_ns / 1_000_000,
        );
        out.insert("events_unparsed".into(), self.unparsed);
        if let Some(n) = &self.native {
            n.counters(out);
            out.insert("native_deferred_events".into(), self.backlog.deferred);
            out.insert("native_backlog_max".into(), self.backlog.max_len);
            out.insert("native_backlog_overflow".into(), self.backlog.overflow);
            out.insert(
                "native_finish_wait_ms".into(),
                self.finish_wait_ns / 1_000_000,
            );
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
                ustack_window: 0,
            },
        )?;
    }
    b.set_target(pid as u32, &target.bpf_config(abi::TARGET_OFFCPU)?)?;
    std::thread::sleep(duration);
    b.remove_target(pid as u32);
    let mut out: BTreeMap<String, u64> = b.counters().into_iter().collect();
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

impl Courtesy {
    /// Register this process among the host's probe watchers when it has probes; a
    /// foreground recording says which agents will give their registers back.
    fn begin(probes: &Probes, tracing: BpfTracing) -> Courtesy {
        if probes.is_empty() {
            return Courtesy::default();
        }
        let role = if tracing.yields_registers {
            watchers::Role::Agent
        } else {
            watchers::Role::Foreground
        };
        let dir = std::path::Path::new(watchers::DIR);
        let registration = watchers::register(dir, role).ok();
        if role == watchers::Role::Foreground && !tracing.quiet {
            let agents: Vec<i32> = watchers::others(dir)
                .into_iter()
                .filter(|w| w.role == watchers::Role::Agent)
                .map(|w| w.pid)
                .collect();
            if !agents.is_empty() {
                eprintln!(
                    "enginescope: the agent (pid {}) on this host watches probes too: it gives this recording its debug registers while it runs",
                    join_pids(&agents)
                );
            }
        }
        Courtesy {
            registration,
            ..Courtesy::default()
        }
    }
}

fn join_pids(pids: &[i32]) -> String {
    pids.iter()
        .map(|p| p.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}
