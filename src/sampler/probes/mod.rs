//! `record --probe`: per-call latency of chosen Python functions, from outside.
//!
//! A probe names a function by qualified name, optionally with its file
//! (`shm_broadcast.py:MessageQueue.dequeue`). Code objects are found as the sampler meets them
//! (every new code object a stack walk resolves is checked against the probes), so a probe on
//! a function whose module is imported later stays pending and attaches when the code object
//! first runs and is sampled.
//!
//! **Exact method** (BPF backend, CPython 3.11+, not a generator or coroutine): a hardware
//! write watchpoint on the code object's reference count (`ob_refcnt`, its first 8 bytes).
//! CPython takes a reference to the code object when it pushes a frame of it and drops it
//! when it pops the frame, on every call path (inlined Python calls and calls entered from C):
//! measured 2.000 writes per call on 3.11 to 3.15 (docs/probes.md). One debug register per
//! function, whatever its number of return instructions. Watchpoints are per thread: x86 has 4
//! debug registers per thread, so they go only on the threads seen running the function (in a
//! sample or an off-CPU stack), from the first time they are seen; calls a thread makes before
//! that are not counted (the recording's `probe_thread_attaches` counter says when threads
//! joined).
//!
//! Pushes and pops are told apart by the new count the BPF program reads after each write:
//! +1 from the last value this thread saw is a push, -1 a pop (see [`Probes::hit`]), so
//! recursion nests. Each write costs one trap (~14 µs here); the measured duration includes
//! about one trap's cost (the end of the push trap and the start of the pop trap), which is
//! calibrated at start and subtracted.
//!
//! This module also owns the per-thread GC watchpoints (one debug register per thread, set
//! before any probe's), since both draw on the same four registers.
//!
//! **Sampled method** (everything else): a call is followed across consecutive samples of a
//! thread whose stack contains the function, and across the times the thread blocks inside it
//! (its switch-out stack contains the function); its duration is the run's length, so only
//! calls longer than the sampling interval are seen, and back-to-back calls merge.

use crate::sys::Schedstat;
use std::collections::{HashMap, HashSet};

use crate::bpf::Breakpoint;
use crate::cpython::objects::CodeInfo;
use crate::cpython::opcodes;
use crate::cpython::{Frame, PythonProcess};
use crate::record::model::{FunctionCall, ProbeInfo, ProbeWatch};

use super::sink::Sink;
use super::Pipeline;
use crate::sys::next_random;

mod calls;
mod counters;
pub mod replay;
mod schedule;
mod spec;
mod watch;

use calls::{Edge, OpenCall, ThreadCalls, MAX_OPEN_CALLS};
pub use counters::{counters, Counters};
use schedule::{
    budget_on_ns, forced_share, off_phase_ns, on_phase_len, phase_and_width, phase_steps,
    rotate_ns, watched_switches, BudgetWindow, PhaseState, PhaseStep, ThreadRegs,
    BUDGET_FIRST_WINDOW_NS, BUDGET_WINDOW_NS,
};
pub use schedule::{full_cost, BUDGET_MIN_PHASE, BUDGET_ON_NS, ROTATE_NS};
pub use spec::{is_headline, names, ProbeSpec, VLLM_DEFAULT_PROBES, VLLM_HEADLINE_PROBES};
use watch::{attach_all, no_register};
pub use watch::{Watch, Watchpoints};

/// Where the watchpoint of one exactly probed code object goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExactPlan {
    /// Address of the code object's `ob_refcnt` (the object's first 8 bytes).
    pub refcnt: u64,
}

/// A watchpoint set in more than this is counted slow (`probe_watch_switches_slow`): tens of
/// µs on a quiet thread, up to a second on a vLLM thread that spins on `sched_yield`.
const SLOW_SWITCH_NS: u64 = 10_000_000;

/// Calls in a second whose ends went unseen (a quarter of the calls or more) that switch an
/// exact probe to sampling: an exception's traceback keeping a frame now and then is not one.
const UNSEEN_ENDS_MIN: u64 = 3;
/// Hardware breakpoints per thread (x86 debug registers DR0-DR3).
const DEBUG_REGISTERS: usize = 4;
/// How often a thread refused registers asks for one more ([`Probes::regain_registers`]).
const REGAIN_NS: u64 = 1_000_000_000;
/// Largest bytecode we walk, in bytes.
const MAX_CODE_BYTES: u64 = 1 << 20;

/// Plan exact probing of the code object at `code`, or say why it cannot be done.
///
/// The exact method watches the code object's reference count: CPython 3.11+ takes a
/// reference to the code object when it pushes a frame of it (`_PyFrame_Initialize`,
/// `_PyFrame_InitializeSpecials`) and drops it when it pops the frame (`_PyFrame_Clear`), on
/// every call path (inlined Python-to-Python calls and calls entered from C alike). Measured
/// with `perf stat -e mem:ADDR/8:w`: 2.000 writes per call on 3.11.7, 3.12.1, 3.13.0/18,
/// 3.14.10 and 3.15.2 (docs/probes.md). Generators and coroutines are refused: their frames
/// live as long as the generator object, not the call.
pub fn plan_exact(proc: &PythonProcess, code: u64) -> Result<ExactPlan, String> {
    let minor = proc.version.minor;
    if minor < 11 {
        return Err(format!(
            "Python 3.{minor}: exact probes need 3.11+ (3.10 reuses a zombie frame per code object, which keeps its reference)"
        ));
    }
    // A code address read from the target: stale or garbage ones must not overflow below.
    if code == 0 || code >= 1 << 57 {
        return Err(format!("implausible code object address {code:#x}"));
    }
    let o = &proc.offsets;
    let adaptive = o
        .code_code_adaptive
        .ok_or("no co_code_adaptive offset for this interpreter")?;
    // PyCodeObject is a PyVarObject whose ob_size counts 2-byte code units.
    let units = proc
        .mem
        .read_u64(code + 16)
        .map_err(|e| format!("reading the code object's size: {e}"))?;
    let bytes = units.saturating_mul(2);
    if bytes == 0 || bytes > MAX_CODE_BYTES {
        return Err(format!("implausible bytecode size {bytes}"));
    }
    let mut buf = vec![0u8; bytes as usize];
    proc.mem
        .read(code + adaptive, &mut buf)
        .map_err(|e| format!("reading the bytecode: {e}"))?;
    // The walk only tells generators and coroutines apart: the watch does not depend on the
    // bytecode, so instrumentation (sys.monitoring) in the way is no reason to refuse.
    match opcodes::return_sites(minor, &buf) {
        Ok(_) | Err(opcodes::WalkError::Instrumented { .. }) => {}
        Err(e) => return Err(e.to_string()),
    }
    if !code.is_multiple_of(8) {
        return Err(format!("code object at {code:#x} is not 8-byte aligned"));
    }
    Ok(ExactPlan { refcnt: code })
}

/// Reference count of the code object at `code` now (its low 32 bits, which are what 3.12+
/// increments; 3.11's 64-bit count fits in them for any real code object).
fn read_refcnt(proc: &PythonProcess, code: u64) -> Option<u32> {
    proc.mem.read_u64(code).ok().map(|v| v as u32)
}

/// Whether a thread's watched share, re-sized from `said` (the share last said, none the first
/// time) to `duty`, is worth a line again: the first sizing, a share that halved or doubled
/// since, and a move to or from watching all the time.
fn said_again(said: Option<f64>, duty: f64) -> bool {
    let Some(said) = said else {
        return true;
    };
    if (said >= 1.0) != (duty >= 1.0) {
        return true;
    }
    duty >= said * 2.0 || duty * 2.0 <= said
}

struct Active<H> {
    info: ProbeInfo,
    /// Code object address.
    code: u64,
    /// Index of the spec it matched: earlier specs win debug registers from later ones.
    prio: usize,
    plan: Option<ExactPlan>,
    /// tid → breakpoints set on it.
    links: HashMap<i32, Vec<H>>,
    /// Threads where setting them failed (not retried).
    failed: HashSet<i32>,
    /// Replaced by a sampled probe (too many calls for breakpoints): takes no more calls.
    retired: bool,
    /// Entries since `window_start_ns` (exact probes' rate check).
    window_calls: u64,
    /// Calls among them whose end wrote nothing (`Counters::ends_unseen`).
    window_unseen: u64,
    window_start_ns: u64,
}

impl<H> Active<H> {
    /// A probe of code object `code`, matched by spec `prio`; exact when `plan` is given.
    fn new(info: ProbeInfo, code: u64, prio: usize, plan: Option<ExactPlan>) -> Self {
        Active {
            info,
            code,
            prio,
            plan,
            links: HashMap::new(),
            failed: HashSet::new(),
            retired: false,
            window_calls: 0,
            window_unseen: 0,
            window_start_ns: 0,
        }
    }

    /// An exact probe of `function` in process `pid` whose code object (and watched
    /// reference count) is at `code`, probe id `id` (the schedule's tests and replays).
    fn exact(id: usize, pid: i32, function: String, code: u64) -> Self {
        let info = ProbeInfo {
            id: id as u32,
            pid,
            function,
            file: "x.py".into(),
            method: "exact".into(),
            ..Default::default()
        };
        Self::new(info, code, id, Some(ExactPlan { refcnt: code }))
    }
}

/// Probe state of one recording.
pub struct Probes<H = Breakpoint> {
    specs: Vec<ProbeSpec>,
    active: Vec<Active<H>>,
    /// (pid, code address) already considered.
    seen: HashSet<(i32, u64)>,
    /// (pid, watched address) → probe index.
    by_addr: HashMap<(i32, u64), usize>,
    /// (tid, probe index) → what this thread wrote last and its open calls.
    open: HashMap<(i32, usize), ThreadCalls>,
    /// (tid, probe index) → (first, last) sample time of the current sampled run.
    runs: HashMap<(i32, usize), (u64, u64)>,
    /// Runs whose thread was switched out inside the function: the next sample continues them
    /// whatever the gap (the thread was blocked in the call).
    blocked: HashSet<(i32, usize)>,
    /// Cost of one breakpoint trap, subtracted from exact durations.
    pub trap_ns: u64,
    /// What a trap costs the code it interrupts, cache lines refetched included
    /// (`TrapCost::in_use`): what the budget is sized from. 0 = `trap_ns`.
    pub budget_trap_ns: u64,
    /// What a context switch costs a thread holding watchpoints here (calibrated at start;
    /// zero when it could not be).
    pub switch_cost: crate::bpf::SwitchCost,
    /// Per thread: the debug traps seen on it (probe hits and GC watchpoint writes). A call's
    /// duration loses the cost of one trap (the end of its push trap and the start of its
    /// pop trap); the traps the thread took inside the call (probed calls nested in it, GC
    /// watchpoint writes) stay in it, as they stay in what the call really took while it was
    /// recorded (what in-process timers measure, the ground truth of tests/live_probes.rs:
    /// taking them out read `Engine.step`'s median 5-14% short of it). They are counted.
    traps: HashMap<i32, u64>,
    /// Draws the on-phases' lengths ([`on_phase_len`]).
    rng: u64,
    period_ns: u64,
    quiet: bool,
    /// tid → the share of the time it was last said to be watched ([`said_again`]): the
    /// budget re-sizes a thread's share every few seconds as its call rate moves, and a line
    /// each time filled a long recording's terminal.
    said_duty: HashMap<i32, f64>,
    /// tid → the exact probes wanting a register there.
    regs: HashMap<i32, ThreadRegs>,
    /// Watch edges not yet written (absolute times).
    edges: Vec<ProbeWatch>,
    /// Length of one register assignment, ns ([`ROTATE_NS`]).
    rotate_ns: u64,
    /// pid → `gcstate->collecting` address, for processes whose GC is watched.
    gc_addr: HashMap<i32, u64>,
    /// tid → its GC watchpoint.
    gc_links: HashMap<i32, H>,
    /// `--probe-budget` as a share (0.02 = 2%); 0 = probes watched all the time.
    budget: f64,
    /// Every watchpoint removed and none set until [`Self::resume`] (`record --measure-cost`'s
    /// off arms).
    suspended: bool,
    /// Events up to here (absolute ns) have been drained ([`Self::drained_to`]).
    drained_ns: u64,
    /// What the probes did, for the recording's counters ([`counters`]).
    pub n: Counters,
}

impl<H: Watch> Probes<H> {
    pub fn new(specs: Vec<ProbeSpec>, period_ns: u64, quiet: bool) -> Self {
        Probes {
            specs,
            active: Vec::new(),
            seen: HashSet::new(),
            by_addr: HashMap::new(),
            open: HashMap::new(),
            runs: HashMap::new(),
            blocked: HashSet::new(),
            trap_ns: 0,
            budget_trap_ns: 0,
            traps: HashMap::new(),
            rng: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0x9E37_79B9_7F4A_7C15, |d| d.as_nanos() as u64)
                | 1,
            period_ns: period_ns.max(1),
            quiet,
            said_duty: HashMap::new(),
            regs: HashMap::new(),
            edges: Vec::new(),
            rotate_ns: rotate_ns(),
            gc_addr: HashMap::new(),
            gc_links: HashMap::new(),
            budget: 0.0,
            switch_cost: crate::bpf::SwitchCost::default(),
            suspended: false,
            drained_ns: 0,
            n: Counters::default(),
        }
    }

    /// Watch `gcstate->collecting` at `addr` in every thread of `pid` (and in threads that
    /// appear later). Fails, setting nothing, when the first thread refuses.
    pub(crate) fn watch_gc(
        &mut self,
        b: &mut dyn Watchpoints<Watch = H>,
        pid: i32,
        addr: u64,
        tids: &[i32],
    ) -> anyhow::Result<()> {
        let mut set = Vec::new();
        for &tid in tids {
            match b.watch_gc_thread(tid, addr) {
                Ok(l) => set.push((tid, l)),
                Err(e) if set.is_empty() => return Err(e),
                Err(_) => self.n.gc_attach_failures += 1,
            }
        }
        self.gc_links.extend(set);
        self.gc_addr.insert(pid, addr);
        Ok(())
    }

    pub fn is_empty(&self) -> bool {
        self.specs.is_empty()
    }

    /// Probes found plus (probe, thread) watches wanted: what the warm-up waits to stop
    /// growing.
    pub fn placed(&self) -> usize {
        self.active.len() + self.regs.values().map(|r| r.want.len()).sum::<usize>()
    }

    /// A code object seen for the first time in process `proc`, in a stack of thread `tid`:
    /// probe it if a spec matches. `b` is the BPF sampler when there is one.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn consider(
        &mut self,
        b: Option<&mut dyn Watchpoints<Watch = H>>,
        proc: &PythonProcess,
        tid: i32,
        code: u64,
        info: &CodeInfo,
        now_rel_ns: u64,
        pipe: &mut Pipeline<impl Sink>,
    ) -> anyhow::Result<()> {
        // A code object met in a stack of an unknown thread is left for a later sighting.
        if self.specs.is_empty() || tid == 0 || !self.seen.insert((proc.pid, code)) {
            return Ok(());
        }
        let Some((prio, spec)) = self
            .specs
            .iter()
            .enumerate()
            .find(|(_, s)| s.matches(&info.qualname, &info.filename, proc.version.minor >= 11))
        else {
            return Ok(());
        };
        let spec = spec.clone();
        let now_abs = crate::sys::monotonic_ns().max(now_rel_ns.saturating_add(pipe.start_ns));
        let id = self.active.len();
        let (mut plan, mut why_sampled) = match (&b, plan_exact(proc, code)) {
            (None, _) => (None, "no BPF backend".to_string()),
            (Some(_), Err(e)) => (None, e),
            (Some(_), Ok(p)) => (Some(p), String::new()),
        };
        self.active
            .push(Active::new(ProbeInfo::default(), code, prio, plan.clone()));
        if let (Some(bpf), Some(_)) = (b, &plan) {
            if let Some(p) = &plan {
                self.by_addr.insert((proc.pid, p.refcnt), id);
            }
            // Exact whatever the registers left: when this thread has none free, the
            // registers rotate among its exact probes and each is watched for part of the time.
            if let Err(e) = self.want(bpf, proc, tid, id, now_abs) {
                why_sampled = format!(
                    "no hardware watchpoint ({e:#}; another enginescope, perf or a debugger on this process may hold the thread's debug registers)"
                );
                self.by_addr.retain(|_, &mut i| i != id);
                self.active[id].plan = None;
                plan = None;
            }
        }
        let exact = plan.is_some();
        let probe = ProbeInfo {
            id: id as u32,
            spec: spec.spec.clone(),
            pid: proc.pid,
            function: info.qualname.clone(),
            file: info.filename.clone(),
            firstlineno: info.firstlineno,
            method: if exact { "exact" } else { "sampled" }.into(),
            resolution_ns: if exact { self.trap_ns } else { self.period_ns },
            t_ns: now_rel_ns,
        };
        if !self.quiet {
            if exact {
                let shared = self.regs.get(&tid).is_some_and(|r| r.want.len() > r.cap);
                eprintln!(
                    "enginescope: probe {} -> {} ({}:{}) in process {}: exact, one watchpoint (its code object's reference count) on each thread that runs it{}",
                    spec.spec,
                    info.qualname,
                    info.filename,
                    info.firstlineno,
                    proc.pid,
                    if shared {
                        "; thread {tid} has more exact probes than debug registers, so they take turns (counts scaled by the share of the window each was watched)"
                            .replace("{tid}", &tid.to_string())
                    } else {
                        String::new()
                    }
                );
            } else {
                eprintln!(
                    "enginescope: probe {} -> {} ({}:{}) in process {}: sampled ({why_sampled})",
                    spec.spec, info.qualname, info.filename, info.firstlineno, proc.pid
                );
            }
        }
        pipe.writer.probe(&probe)?;
        self.active[id].info = probe;
        self.flush_watches(pipe)
    }

    /// Thread `tid` runs exact probe `i`: give it a debug register there now if one is free,
    /// else a turn in the thread's rotation. Err when the thread cannot have any watchpoint
    /// at all (the probe is then not exact on this thread).
    fn want(
        &mut self,
        b: &mut dyn Watchpoints<Watch = H>,
        proc: &PythonProcess,
        tid: i32,
        i: usize,
        now_abs: u64,
    ) -> anyhow::Result<()> {
        let gc = usize::from(self.gc_links.contains_key(&tid));
        let traps = self.traps.get(&tid).copied().unwrap_or(0);
        let r = self.regs.entry(tid).or_insert_with(|| ThreadRegs {
            want: Vec::new(),
            cap: DEBUG_REGISTERS - gc,
            next: 0,
            last_ns: now_abs,
            phase: 1.0,
            width: 0,
            off_until: None,
            on_since: now_abs,
            on_len: budget_on_ns(),
            late: 0,
            budget_mark: (now_abs, traps),
            measured: false,
            sched: Schedstat::of_thread(tid),
            window: BudgetWindow {
                on_mark: now_abs,
                ..BudgetWindow::default()
            },
            held: 0,
            held_mark: None,
            regain_at: now_abs + REGAIN_NS,
        });
        if !r.want.contains(&i) {
            r.want.push(i);
        }
        let per_turn = r.per_turn();
        let on = r
            .want
            .iter()
            .filter(|&&j| self.active[j].links.contains_key(&tid))
            .count();
        let off = self.suspended || self.regs.get(&tid).is_some_and(|r| r.off_until.is_some());
        if self.active[i].links.contains_key(&tid) || on >= per_turn || off {
            // Set already, or waits for its turn (or for the thread's next on-phase).
            return Ok(());
        }
        match self.watch_on(b, proc, tid, i, now_abs) {
            Ok(()) => Ok(()),
            Err(e) => {
                let r = self.regs.get_mut(&tid);
                if no_register(&e) && on > 0 {
                    // Fewer registers than we thought (another tool holds some): share the
                    // ones this thread's probes hold.
                    if let Some(r) = r {
                        r.cap = on;
                    }
                    return Ok(());
                }
                if let Some(r) = r {
                    r.want.retain(|&j| j != i);
                }
                self.active[i].failed.insert(tid);
                self.n.attach_failures += 1;
                Err(e)
            }
        }
    }

    /// Set probe `i`'s watchpoint on `tid`, seeded with the count now; queue the edge.
    fn watch_on(
        &mut self,
        b: &mut dyn Watchpoints<Watch = H>,
        proc: &PythonProcess,
        tid: i32,
        i: usize,
        now_abs: u64,
    ) -> anyhow::Result<()> {
        let Some(p) = self.active[i].plan.clone() else {
            return Ok(());
        };
        // The count before the watch is set: the first write the watch sees is then one away
        // from it (a push, or the pop of a call already running, which is dropped).
        let seed = read_refcnt(proc, p.refcnt);
        let t = std::time::Instant::now();
        // A thread watched in on-phases gets watchpoints on every CPU, which it does not
        // reload at its context switches (`bpf::CpuSlot`); one watched all the time, its own
        // (any number of threads at once, four registers each). A thread's own are set on the
        // helper thread (`bpf::Switcher`); the loop sleeps until they are.
        let every_cpu = self.budget > 0.0 && self.regs.get(&tid).is_some_and(|r| r.phase < 1.0);
        let ls = attach_all(b, tid, &p, every_cpu);
        self.note_switch(t);
        let ls = ls?;
        // The watched interval begins once the watch is surely set.
        let set_ns = crate::sys::monotonic_ns().max(now_abs);
        if let Some(r) = self.regs.get_mut(&tid) {
            r.window.watch(set_ns, 1);
        }
        if ls.iter().all(|l| l.on_every_cpu()) {
            self.n.watches_every_cpu += 1;
        } else {
            self.held_changed(tid, 1);
        }
        self.active[i].links.insert(tid, ls);
        if let Some(old) = self.open.insert((tid, i), ThreadCalls::new(seed, set_ns)) {
            self.drop_open(&old);
        }
        self.edges.push(ProbeWatch {
            t_ns: set_ns,
            probe: i as u32,
            tid,
            on: true,
        });
        Ok(())
    }

    /// Remove probe `i`'s watchpoint from `tid` (calls open there are dropped: counted as
    /// dropped at a rotation with `rotation`, else unfinished); queue the edge.
    fn watch_off(
        &mut self,
        b: &mut dyn Watchpoints<Watch = H>,
        tid: i32,
        i: usize,
        now_abs: u64,
        rotation: bool,
    ) {
        let Some(ls) = self.active[i].links.remove(&tid) else {
            return;
        };
        // The watched interval ends before the removal begins: writes up to here are timed
        // when they are drained, later ones are not.
        let now_abs = crate::sys::monotonic_ns().max(now_abs);
        if let Some(r) = self.regs.get_mut(&tid) {
            r.window.watch(now_abs, -1);
        }
        if !ls.iter().all(|l| l.on_every_cpu()) {
            self.held_changed(tid, -1);
        }
        if let Some(c) = self.open.get_mut(&(tid, i)) {
            c.until = now_abs;
            c.rotated = rotation;
        }
        let t = std::time::Instant::now();
        // Closed on the helper thread; the loop does not wait.
        for l in ls {
            b.unwatch_refcount(l);
        }
        self.note_removal(t);
        self.edges.push(ProbeWatch {
            t_ns: now_abs,
            probe: i as u32,
            tid,
            on: false,
        });
    }

    /// One watchpoint set, begun at `t`: counted, with the loop's wait for it (the helper
    /// thread sets it while the loop waits).
    fn note_switch(&mut self, t: std::time::Instant) {
        let ns = t.elapsed().as_nanos() as u64;
        self.n.switch_ns += ns;
        self.n.switch_max_ns = self.n.switch_max_ns.max(ns);
        if ns > SLOW_SWITCH_NS {
            self.n.switches_slow += 1;
        }
        self.n.switches += 1;
    }

    /// One watchpoint removed, begun at `t`: counted apart from the settings, with the
    /// loop's time handing it to the helper thread, which removes it without the loop
    /// waiting (µs; the removal itself can take up to seconds on a thread that spins).
    fn note_removal(&mut self, t: std::time::Instant) {
        self.n.removals += 1;
        self.n.removal_ns += t.elapsed().as_nanos() as u64;
    }

    /// Thread `tid`'s probes span its whole life, watched or not: where the recording ends
    /// or the thread exits while a probe that wants it is unwatched (an off-phase of the
    /// budget, or its turn at the registers not come), an `off` edge with no watch open marks
    /// that its span runs to here (`report` scales its calls to the span; without it the span
    /// ended at the last watch and a count covered part of the window that it claimed whole).
    fn mark_span_end(&mut self, tid: i32, now_abs: u64) {
        let Some(r) = self.regs.get(&tid) else {
            return;
        };
        for &i in &r.want {
            if self.active[i].links.contains_key(&tid) || self.active[i].retired {
                continue;
            }
            self.edges.push(ProbeWatch {
                t_ns: now_abs,
                probe: i as u32,
                tid,
                on: false,
            });
        }
    }

    /// Thread `tid`'s watchpoints change by `delta`: the switches it made holding the ones
    /// it had are counted, at what each cost it.
    fn held_changed(&mut self, tid: i32, delta: i64) {
        let cost = self.switch_cost;
        let Some(r) = self.regs.get_mut(&tid) else {
            return;
        };
        let now = Schedstat::of_thread(tid).map(|s| s.switches);
        let (n, ns) = watched_switches(r.held_mark, now, r.held, cost);
        self.n.watched_switches += n;
        self.n.watched_switch_ns += ns;
        r.held_mark = now;
        r.held = r.held.saturating_add_signed(delta as isize);
    }

    /// Write the queued watch edges (their probes' records are written).
    pub(crate) fn flush_watches(&mut self, pipe: &mut Pipeline<impl Sink>) -> anyhow::Result<()> {
        for mut w in std::mem::take(&mut self.edges) {
            w.t_ns = pipe.rel(w.t_ns);
            pipe.writer.probe_watch(&w)?;
        }
        Ok(())
    }

    /// Threads with more exact probes than registers: every [`ROTATE_NS`], the next
    /// assignment (one probe out, the next in, round-robin). `proc_of` gives a process's
    /// memory, to seed the counts of the probes coming in. `now_abs` absolute ns.
    pub fn rotate<'a>(
        &mut self,
        b: &mut dyn Watchpoints<Watch = H>,
        proc_of: impl Fn(i32) -> Option<&'a PythonProcess>,
        now_abs: u64,
    ) {
        if self.suspended {
            return;
        }
        self.apply_budget(now_abs);
        self.phases(b, &proc_of, now_abs);
        self.regain_registers(b, &proc_of, now_abs);
        let period = self.rotate_ns;
        let tids = self.threads_where(|r| {
            r.takes_turns() && r.phase >= 1.0 && now_abs.saturating_sub(r.last_ns) >= period
        });
        for tid in tids {
            let Some(r) = self.regs.get_mut(&tid) else {
                continue;
            };
            let chosen = r.advance(now_abs);
            self.n.rotations += 1;
            self.assign(b, &proc_of, tid, &chosen, now_abs);
        }
    }

    /// Threads that found fewer debug registers than they have probes (the kernel refused
    /// the rest: another tool held them, such as an agent before it gave them back,
    /// `bpf::watchers`) ask for one more every [`REGAIN_NS`], so that their probes stop
    /// taking turns once the registers are free again; a refusal lowers the cap back
    /// ([`Self::assign`]). Without this, one refusal at start made a recording's probes take
    /// turns for its whole window.
    fn regain_registers<'a>(
        &mut self,
        b: &mut dyn Watchpoints<Watch = H>,
        proc_of: &impl Fn(i32) -> Option<&'a PythonProcess>,
        now_abs: u64,
    ) {
        let tids = self.threads_where(|r| {
            r.off_until.is_none()
                && r.cap < r.want.len()
                && r.per_turn() == r.cap
                && now_abs >= r.regain_at
        });
        for tid in tids {
            let full = DEBUG_REGISTERS - usize::from(self.gc_links.contains_key(&tid));
            let Some(r) = self.regs.get_mut(&tid) else {
                continue;
            };
            r.regain_at = now_abs + REGAIN_NS;
            if r.cap >= full {
                continue;
            }
            r.cap += 1;
            self.n.register_asks += 1;
            // The probes watched now and the next of the rotation not watched: the rotation
            // itself goes on as it was (a refusal changes nothing that is set).
            let n = r.want.len();
            let active = &self.active;
            let on = |k: usize| active[k].links.contains_key(&tid);
            let mut chosen: Vec<usize> = r.want.iter().copied().filter(|&k| on(k)).collect();
            if let Some(k) = (0..n).map(|d| r.want[(r.next + d) % n]).find(|&k| !on(k)) {
                chosen.push(k);
            }
            self.assign(b, proc_of, tid, &chosen, now_abs);
        }
    }

    /// Remove every probe watchpoint and set none until [`Self::resume`]: what watching costs
    /// is then nothing but the idle registers (`record --measure-cost`'s off arms). Calls open are
    /// dropped as at a rotation; counts scale by the watched time as under a budget.
    pub(crate) fn suspend<'a>(
        &mut self,
        b: &mut dyn Watchpoints<Watch = H>,
        proc_of: impl Fn(i32) -> Option<&'a PythonProcess>,
        now_abs: u64,
    ) {
        if self.suspended {
            return;
        }
        self.suspended = true;
        for tid in self.threads_where(|_| true) {
            self.assign(b, &proc_of, tid, &[], now_abs);
        }
    }

    /// Watch again after [`Self::suspend`]: each thread begins an on-phase with the next
    /// assignment of its rotation.
    pub(crate) fn resume<'a>(
        &mut self,
        b: &mut dyn Watchpoints<Watch = H>,
        proc_of: impl Fn(i32) -> Option<&'a PythonProcess>,
        now_abs: u64,
    ) {
        if !self.suspended {
            return;
        }
        self.suspended = false;
        for tid in self.threads_where(|_| true) {
            let Some(r) = self.regs.get_mut(&tid) else {
                continue;
            };
            r.off_until = None;
            r.on_since = now_abs;
            r.late = 0;
            let chosen = r.advance(now_abs);
            self.assign(b, &proc_of, tid, &chosen, now_abs);
        }
    }

    /// Watch exactly `chosen` of thread `tid`'s probes: the others it wants go out first
    /// (that frees the registers the ones coming in take; their open calls are dropped as at
    /// a rotation), then those of `chosen` not set yet come in.
    fn assign<'a>(
        &mut self,
        b: &mut dyn Watchpoints<Watch = H>,
        proc_of: &impl Fn(i32) -> Option<&'a PythonProcess>,
        tid: i32,
        chosen: &[usize],
        now_abs: u64,
    ) {
        let want = self
            .regs
            .get(&tid)
            .map(|r| r.want.clone())
            .unwrap_or_default();
        for j in want {
            if !chosen.contains(&j) && self.active[j].links.contains_key(&tid) {
                self.watch_off(b, tid, j, now_abs, true);
            }
        }
        for &j in chosen {
            if self.active[j].links.contains_key(&tid) {
                continue;
            }
            let Some(proc) = proc_of(self.active[j].info.pid) else {
                continue;
            };
            match self.watch_on(b, proc, tid, j, now_abs) {
                Ok(()) => {}
                Err(e) if no_register(&e) => {
                    // Fewer registers than the cap (another tool took some, or one asked
                    // for again is still held): the probes share those the thread holds.
                    self.n.registers_refused += 1;
                    let held = chosen
                        .iter()
                        .filter(|&&k| self.active[k].links.contains_key(&tid))
                        .count();
                    if let Some(r) = self.regs.get_mut(&tid) {
                        r.cap = held.max(1);
                    }
                }
                Err(_) => self.n.rotation_attach_failures += 1,
            }
        }
    }

    /// `--probe-budget`: keep what each thread's probes cost it under `budget` of its wall time.
    /// Per thread, over a window of at least [`BUDGET_WINDOW_NS`] and two whole cycles of its
    /// phases (so that each probe was watched about its share of it), the traps it took times
    /// the calibrated trap cost, divided by the share each probe was watched, plus its context
    /// switches times what one costs it holding its watchpoints ([`full_cost`]), is what
    /// watching them all the time would cost; the thread's on-phases then get the share that
    /// brings that under the budget. Re-measured every window, so a thread whose call rate
    /// changes is re-sized.
    pub(crate) fn set_budget(&mut self, budget: f64) {
        self.budget = budget.max(0.0);
    }

    /// The `--probe-budget` share (0 = every call watched).
    pub fn budget(&self) -> f64 {
        self.budget
    }

    /// Threads under `--probe-budget`: end an on-phase that has lasted [`BUDGET_ON_NS`] (every
    /// watch of the thread off, the calls open dropped as at a rotation) and start the next
    /// when its off-phase is over (the next assignment of the rotation on).
    fn phases<'a>(
        &mut self,
        b: &mut dyn Watchpoints<Watch = H>,
        proc_of: &impl Fn(i32) -> Option<&'a PythonProcess>,
        now_abs: u64,
    ) {
        let states: Vec<PhaseState> = self
            .threads_where(|r| !r.want.is_empty() && (r.phase < 1.0 || r.off_until.is_some()))
            .into_iter()
            .filter_map(|tid| {
                let r = self.regs.get(&tid)?;
                Some(PhaseState {
                    tid,
                    phase: r.phase,
                    off_until: r.off_until,
                    on_since: r.on_since,
                    on_len: r.on_len,
                    late: r.late,
                })
            })
            .collect();
        for (tid, step) in phase_steps(&states, now_abs) {
            let draw = next_random(&mut self.rng);
            let Some(r) = self.regs.get_mut(&tid) else {
                continue;
            };
            match step {
                PhaseStep::End { off_until } => {
                    r.off_until = Some(off_until);
                    self.assign(b, proc_of, tid, &[], now_abs);
                }
                PhaseStep::Start { late } => {
                    r.off_until = None;
                    r.on_since = now_abs;
                    r.on_len = on_phase_len(budget_on_ns(), draw);
                    r.late = late;
                    self.n.late_starts += u64::from(late > 0);
                    let chosen = r.advance(now_abs);
                    self.assign(b, proc_of, tid, &chosen, now_abs);
                }
            }
        }
    }

    /// The threads whose registers' state satisfies `f`, in tid order.
    fn threads_where(&self, f: impl Fn(&ThreadRegs) -> bool) -> Vec<i32> {
        let mut tids: Vec<i32> = self
            .regs
            .iter()
            .filter(|(_, r)| f(r))
            .map(|(&t, _)| t)
            .collect();
        tids.sort_unstable();
        tids
    }

    fn apply_budget(&mut self, now_abs: u64) {
        if self.budget <= 0.0 {
            return;
        }
        let trap_ns = if self.budget_trap_ns > 0 {
            self.budget_trap_ns
        } else if self.trap_ns > 0 {
            self.trap_ns
        } else {
            10_000
        };
        // The window ends where the events are known: those drained (by their own times).
        let end = if self.drained_ns > 0 {
            self.drained_ns.min(now_abs)
        } else {
            now_abs
        };
        let mut changed = Vec::new();
        for (&tid, r) in self.regs.iter_mut() {
            if r.want.is_empty() {
                continue;
            }
            let traps = self.traps.get(&tid).copied().unwrap_or(0);
            let (t0, _) = r.budget_mark;
            // At least one whole cycle of phases and turns, so that each probe was watched
            // about its share of the window.
            let on = budget_on_ns();
            let cycle = (on + off_phase_ns(on, r.phase))
                * if r.takes_turns() {
                    r.want.len() as u64
                } else {
                    1
                };
            let dt = end.saturating_sub(t0);
            let least = if r.measured {
                BUDGET_WINDOW_NS
            } else {
                BUDGET_FIRST_WINDOW_NS
            };
            if dt < least.max(2 * cycle) {
                continue;
            }
            let took = r.window.traps;
            // What the probes were really watched (the phases run when the loop gets to
            // them), per probe: watching all of them all the time would cost the traps
            // taken per watched probe-time, times the probes.
            let watched = r.window.watched(end);
            r.budget_mark = (end, traps);
            r.window.restart(end);
            let sched = Schedstat::of_thread(tid);
            let from = std::mem::replace(&mut r.sched, sched);
            // A forced share holds without traps too (`ENGINESCOPE_PROBE_PARKED` takes none).
            if (took == 0 || watched == 0) && forced_share().is_none() {
                continue;
            }
            r.measured = true;
            let trap_share = if watched == 0 {
                0.0
            } else {
                took as f64 * trap_ns as f64 * r.want.len() as f64 / watched as f64
            };
            // Holding registers also costs every context switch (the kernel reloads them):
            // the thread's switches over the window, at the registers it holds when all of
            // its probes are on.
            let full = full_cost(
                trap_share,
                from,
                sched,
                self.switch_cost,
                r.want.len().min(r.cap),
            );
            // The share of the time each probe is watched that brings the cost under the
            // budget, in steps of a tenth of itself (a thread re-measured a little over or
            // under keeps its phase); as few probes watched at once as that share allows.
            let want = (self.budget / full).clamp(BUDGET_MIN_PHASE, 1.0);
            let duty = if let Some(share) = forced_share() {
                share
            } else if want >= 1.0 {
                1.0
            } else {
                let step = 10f64.powf((want.log10() * 10.0).floor() / 10.0);
                step.clamp(BUDGET_MIN_PHASE, 1.0)
            };
            let (phase, width) = phase_and_width(duty, r.want.len(), r.cap);
            if (phase - r.phase).abs() > 1e-9 || width != r.width {
                r.width = width;
                if r.phase >= 1.0 && phase < 1.0 && r.off_until.is_none() {
                    // Out of watching all the time: that time was not an on-phase to size an
                    // off-phase from (a second watched whole, then a share of 5%, would be
                    // followed by 19 s unwatched). The on-phase ends now, as one of the
                    // planned length.
                    r.on_since = now_abs.saturating_sub(r.on_len);
                }
                r.phase = phase;
                if phase >= 1.0 && r.off_until.is_some() {
                    // Back to all the time: the off-phase ends now.
                    r.off_until = Some(now_abs);
                }
                changed.push((tid, full, r.duty()));
            }
        }
        changed.sort_by_key(|c| c.0);
        for (tid, full, duty) in changed {
            self.n.budget_resizes += 1;
            if !self.quiet && said_again(self.said_duty.get(&tid).copied(), duty) {
                self.said_duty.insert(tid, duty);
                eprintln!(
                    "enginescope: thread {tid}: its exact probes would cost {:.1}% of its time watched all the time (debug traps and context switches); watched {:.0}% of the time for --probe-budget {:.2}% (counts scaled, coverage on every figure)",
                    full * 100.0,
                    duty * 100.0,
                    self.budget * 100.0
                );
            }
        }
    }

    /// Every exact probe whose calls in the last second exceed `max_per_s` (each call costs two
    /// debug traps) or whose calls' ends went unseen (a quarter of them, [`UNSEEN_ENDS_MIN`] at
    /// least) is switched to the sampled method: its breakpoints are removed and a new sampled
    /// probe on the same function takes its later calls. `now_ns` absolute; `max_per_s` 0: no
    /// rate cap.
    pub(crate) fn enforce_rate(
        &mut self,
        b: &mut dyn Watchpoints<Watch = H>,
        now_ns: u64,
        max_per_s: u64,
        pipe: &mut Pipeline<impl Sink>,
    ) -> anyhow::Result<()> {
        let mut demote = Vec::new();
        for (i, a) in self.active.iter_mut().enumerate() {
            if a.plan.is_none() || a.retired {
                continue;
            }
            if a.window_start_ns == 0 {
                a.window_start_ns = now_ns;
                continue;
            }
            let dt = now_ns.saturating_sub(a.window_start_ns);
            if dt < 1_000_000_000 {
                continue;
            }
            let rate = a.window_calls * 1_000_000_000 / dt.max(1);
            let (calls, unseen) = (a.window_calls, a.window_unseen);
            a.window_calls = 0;
            a.window_unseen = 0;
            a.window_start_ns = now_ns;
            if max_per_s > 0 && rate > max_per_s {
                demote.push((
                    i,
                    format!(
                        "{rate} calls/s is more than --probe-max-rate {max_per_s} for breakpoints"
                    ),
                ));
            } else if unseen >= UNSEEN_ENDS_MIN && unseen * 4 >= calls {
                demote.push((
                    i,
                    format!(
                        "{unseen} of its last {calls} calls ended without releasing their \
                         reference to the code object (the program keeps the calls' frame \
                         objects alive: a stored traceback or frame, or a frame in a reference \
                         cycle until the GC frees it), so the watchpoint cannot see them end \
                         (counter probe_ends_unseen)"
                    ),
                ));
            }
        }
        for (i, why) in demote {
            self.demote(b, i, &why, now_ns, pipe)?;
        }
        Ok(())
    }

    /// Switch exact probe `i` to the sampled method from `now_ns` on: remove its breakpoints
    /// and add a sampled probe on the same function (a new probe record).
    fn demote(
        &mut self,
        b: &mut dyn Watchpoints<Watch = H>,
        i: usize,
        why: &str,
        now_ns: u64,
        pipe: &mut Pipeline<impl Sink>,
    ) -> anyhow::Result<()> {
        self.active[i].retired = true;
        let tids: Vec<i32> = self.active[i].links.keys().copied().collect();
        for tid in tids {
            self.watch_off(b, tid, i, now_ns, false);
        }
        for r in self.regs.values_mut() {
            r.want.retain(|&j| j != i);
        }
        let pid = self.active[i].info.pid;
        self.by_addr
            .retain(|&(p, _), &mut idx| !(p == pid && idx == i));
        let mut dropped = 0;
        self.open.retain(|&(_, idx), c| {
            if idx == i {
                dropped += c.open.len() as u64;
            }
            idx != i
        });
        self.n.unfinished += dropped;
        let mut info = self.active[i].info.clone();
        info.id = self.active.len() as u32;
        info.method = "sampled".into();
        info.resolution_ns = self.period_ns;
        info.t_ns = pipe.rel(now_ns);
        if !self.quiet {
            eprintln!(
                "enginescope: probe {} in process {}: {why}; sampled from now on",
                info.function, info.pid
            );
        }
        pipe.writer.probe(&info)?;
        let (code, prio) = (self.active[i].code, self.active[i].prio);
        self.active.push(Active::new(info, code, prio, None));
        self.n.demoted += 1;
        Ok(())
    }

    /// A stack of thread `tid` of `pid` (raw code object addresses): an exact probe whose
    /// function is in it wants a register on this thread, if it does not have one or a turn.
    pub(crate) fn observe(
        &mut self,
        b: &mut dyn Watchpoints<Watch = H>,
        proc: &PythonProcess,
        tid: i32,
        codes: &[u64],
    ) {
        let pid = proc.pid;
        let now = crate::sys::monotonic_ns();
        let wanted: Vec<usize> = (0..self.active.len())
            .filter(|&i| self.wants_thread(i, pid, tid, codes))
            .collect();
        for i in wanted {
            if self.want(b, proc, tid, i, now).is_ok() {
                self.n.thread_attaches += 1;
            }
        }
    }

    /// Whether exact probe `i` of `pid` is in `codes` and has neither a register nor a turn on
    /// `tid` (nor failed there).
    fn wants_thread(&self, i: usize, pid: i32, tid: i32, codes: &[u64]) -> bool {
        let a = &self.active[i];
        a.plan.is_some()
            && !a.retired
            && a.info.pid == pid
            && !a.failed.contains(&tid)
            && !self.regs.get(&tid).is_some_and(|r| r.want.contains(&i))
            && codes.contains(&a.code)
    }

    /// Whether `observe` would try to set breakpoints for this stack.
    pub(crate) fn needs_attach(&self, pid: i32, tid: i32, codes: &[u64]) -> bool {
        (0..self.active.len()).any(|i| self.wants_thread(i, pid, tid, codes))
    }

    /// Whether any exact probe is active in `pid` (stacks must be passed to `observe`).
    pub(crate) fn wants_stacks(&self, pid: i32) -> bool {
        self.active
            .iter()
            .any(|a| a.plan.is_some() && !a.retired && a.info.pid == pid)
    }

    /// A thread of `pid` appeared: watch its GC state.
    pub(crate) fn thread_added(&mut self, b: &mut dyn Watchpoints<Watch = H>, pid: i32, tid: i32) {
        if let Some(&addr) = self.gc_addr.get(&pid) {
            if let std::collections::hash_map::Entry::Vacant(e) = self.gc_links.entry(tid) {
                match b.watch_gc_thread(tid, addr) {
                    Ok(l) => {
                        e.insert(l);
                    }
                    Err(_) => self.n.gc_attach_failures += 1,
                }
            }
        }
    }

    /// A thread exited: drop its breakpoints and its open calls.
    pub(crate) fn thread_gone(&mut self, b: &mut dyn Watchpoints<Watch = H>, tid: i32) {
        if let Some(l) = self.gc_links.remove(&tid) {
            b.unwatch_gc_thread(l);
        }
        let now = crate::sys::monotonic_ns();
        self.mark_span_end(tid, now);
        for i in 0..self.active.len() {
            if self.active[i].links.contains_key(&tid) {
                self.watch_off(b, tid, i, now, false);
            }
        }
        self.regs.remove(&tid);
        self.traps.remove(&tid);
        self.said_duty.remove(&tid);
        let gone: Vec<(i32, usize)> = self.open.keys().filter(|k| k.0 == tid).copied().collect();
        for k in gone {
            if let Some(c) = self.open.remove(&k) {
                self.drop_open(&c);
            }
        }
        // Forget the thread everywhere, so that threads coming and going for hours leave
        // nothing behind (tids are reused).
        for a in self.active.iter_mut() {
            a.failed.remove(&tid);
        }
        self.runs.retain(|(t, _), _| *t != tid);
    }

    /// A process exited (after [`Self::thread_gone`] for its threads): its probes take no more
    /// calls and what was kept per code object and per breakpoint address goes. The probes
    /// themselves stay, since probe ids index them.
    pub(crate) fn process_gone(&mut self, b: &mut dyn Watchpoints<Watch = H>, pid: i32) {
        let now = crate::sys::monotonic_ns();
        for i in 0..self.active.len() {
            if self.active[i].info.pid != pid {
                continue;
            }
            self.active[i].retired = true;
            self.active[i].failed.clear();
            let tids: Vec<i32> = self.active[i].links.keys().copied().collect();
            for tid in tids {
                self.watch_off(b, tid, i, now, false);
            }
            for r in self.regs.values_mut() {
                r.want.retain(|&j| j != i);
            }
        }
        self.seen.retain(|(p, _)| *p != pid);
        self.by_addr.retain(|(p, _), _| *p != pid);
        self.gc_addr.remove(&pid);
    }

    /// The calls a watch left open when it was removed (or at the end): counted, not timed.
    fn drop_open(&mut self, c: &ThreadCalls) {
        let n = c.open.len() as u64;
        if c.rotated {
            self.n.rotation_dropped += n;
        } else {
            self.n.unfinished += n;
        }
    }

    /// Thread `tid` took a debug trap that is not a probe hit (a GC watchpoint write): counted
    /// inside the calls open on it.
    pub(crate) fn note_trap(&mut self, tid: i32, t_ns: u64) {
        *self.traps.entry(tid).or_default() += 1;
        self.budget_trap(tid, t_ns);
    }

    /// A trap of thread `tid` at `t_ns` (event time) counts in its budget window if it
    /// happened in it.
    fn budget_trap(&mut self, tid: i32, t_ns: u64) {
        if let Some(r) = self.regs.get_mut(&tid) {
            if t_ns >= r.budget_mark.0 {
                r.window.traps += 1;
            }
        }
    }

    /// Events up to `t_ns` (absolute) have been drained: the budget's windows end there.
    pub(crate) fn drained_to(&mut self, t_ns: u64) {
        self.drained_ns = t_ns;
    }

    /// A watchpoint hit (BPF PROBE_HIT): thread `tid` wrote the reference count of a probed
    /// code object, leaving `f.value`; `t_ns` absolute monotonic time. +1 from the last value
    /// this thread saw is a frame of the function pushed (a call begins), -1 one popped (it
    /// ends, by a return or an exception); recursion nests.
    pub fn hit(
        &mut self,
        pid: i32,
        tid: i32,
        t_ns: u64,
        addr: u64,
        f: crate::bpf::abi::ProbeFrame,
        pipe: &mut Pipeline<impl Sink>,
    ) -> anyhow::Result<()> {
        let traps = self.traps.entry(tid).or_default();
        let before = *traps;
        *traps += 1;
        self.budget_trap(tid, t_ns);
        let Some(&probe) = self.by_addr.get(&(pid, addr)) else {
            return Ok(());
        };
        // No state: a write drained after the watch was removed (a rotation, an on-phase's
        // end); it belongs to no watched interval.
        let Some(tc) = self.open.get_mut(&(tid, probe)) else {
            self.n.late_hits += 1;
            return Ok(());
        };
        if t_ns > tc.until {
            // After its watch was removed.
            self.n.late_hits += 1;
            return Ok(());
        }
        let (edge, sure) = tc.classify(f.value as u32);
        if t_ns < tc.since {
            // Before the watch's interval began: the count is kept, nothing is timed.
            self.n.late_hits += 1;
            return Ok(());
        }
        if !sure {
            self.n.ambiguous_edges += 1;
        }
        // A frame makes one call at a time: an open call whose caller frame is current again
        // has ended, and so have the calls opened above it. At a push that means their ends
        // wrote nothing (a frame object outlived the call and took its reference); at a pop
        // the call is the one whose caller it is, and only those above it went unseen.
        let mine = (f.frame != 0)
            .then(|| tc.open.iter().rposition(|c| c.caller == f.frame))
            .flatten();
        if let Some(k) = mine {
            let keep = if matches!(edge, Edge::Push) { k } else { k + 1 };
            let unseen = (tc.open.len() - keep) as u64;
            tc.open.truncate(keep);
            self.n.ends_unseen += unseen;
            self.active[probe].window_unseen += unseen;
        }
        match edge {
            Edge::Push => {
                self.active[probe].window_calls += 1;
                tc.open.push(OpenCall {
                    start_ns: t_ns,
                    traps: before,
                    caller: f.frame,
                });
                if tc.open.len() > MAX_OPEN_CALLS {
                    // Entries that never saw their pop (an exception left a frame object
                    // holding the reference): the oldest go.
                    tc.open.remove(0);
                    self.n.unfinished += 1;
                }
            }
            Edge::Pop => {
                // The current frame is no open call's caller: a reference dropped by something
                // else (a frame object of an earlier call freed), not an end.
                if mine.is_none()
                    && f.frame != 0
                    && !tc.open.is_empty()
                    && tc.open.iter().all(|c| c.caller != 0)
                {
                    self.n.foreign_releases += 1;
                    return Ok(());
                }
                match tc.open.pop() {
                    Some(OpenCall {
                        start_ns: start,
                        traps: at_push,
                        ..
                    }) => {
                        self.n.nested_traps += before.saturating_sub(at_push).saturating_sub(1);
                        let dur = t_ns.saturating_sub(start).saturating_sub(self.trap_ns);
                        self.write_call(probe, (pid, tid), (start, dur), start, pipe)?;
                    }
                    None => self.n.unmatched_returns += 1,
                }
            }
        }
        Ok(())
    }

    /// The sampled probes of `pid`, each with whether its function is in `frames`.
    fn sampled_in(&self, pid: i32, frames: &[Frame]) -> Vec<(usize, bool)> {
        self.active
            .iter()
            .enumerate()
            .filter(|(_, a)| a.plan.is_none() && !a.retired && a.info.pid == pid)
            .map(|(i, a)| {
                let inside = frames
                    .iter()
                    .any(|f| f.function == a.info.function && f.file == a.info.file);
                (i, inside)
            })
            .collect()
    }

    /// A resolved stack of thread `tid` (times absolute), from an on-CPU sample or, with
    /// `switched_out`, from a switch-out where the thread blocked: follows sampled probes'
    /// calls. A call goes on across samples at most 2 periods apart, and across any gap after
    /// the thread blocked inside it; a blocking switch-out inside a function starts or extends
    /// its call.
    pub fn stack(
        &mut self,
        pid: i32,
        tid: i32,
        t_ns: u64,
        frames: &[Frame],
        switched_out: bool,
        pipe: &mut Pipeline<impl Sink>,
    ) -> anyhow::Result<()> {
        for (i, inside) in self.sampled_in(pid, frames) {
            let key = (tid, i);
            let run = self.runs.get(&key).copied();
            let was_blocked = if switched_out {
                self.blocked.contains(&key)
            } else {
                self.blocked.remove(&key)
            };
            match (inside, run) {
                (true, Some((first, last)))
                    if switched_out
                        || was_blocked
                        || t_ns.saturating_sub(last) <= 2 * self.period_ns =>
                {
                    self.runs.insert(key, (first, t_ns));
                }
                (true, run) => {
                    if let Some(r) = run {
                        self.emit_run(i, pid, tid, r, pipe)?;
                    }
                    self.runs.insert(key, (t_ns, t_ns));
                }
                (false, Some(r)) => {
                    self.runs.remove(&key);
                    self.blocked.remove(&key);
                    self.emit_run(i, pid, tid, r, pipe)?;
                }
                (false, None) => {}
            }
            if switched_out && inside {
                self.blocked.insert(key);
            }
        }
        Ok(())
    }

    fn emit_run(
        &mut self,
        probe: usize,
        pid: i32,
        tid: i32,
        (first, last): (u64, u64),
        pipe: &mut Pipeline<impl Sink>,
    ) -> anyhow::Result<()> {
        // The run stands for a call from half a period before its first sample to half a
        // period after its last.
        let start = first.saturating_sub(self.period_ns / 2);
        let dur = last - first + self.period_ns;
        self.write_call(probe, (pid, tid), (start, dur), first, pipe)
    }

    /// A call of probe `probe` on thread `(pid, tid)`, `(start, dur)` (absolute ns): written
    /// when `seen` (when it was first seen) lies in the window, else counted as before it
    /// (the warm-up).
    fn write_call(
        &mut self,
        probe: usize,
        (pid, tid): (i32, i32),
        (start, dur): (u64, u64),
        seen: u64,
        pipe: &mut Pipeline<impl Sink>,
    ) -> anyhow::Result<()> {
        if !pipe.in_window(seen) {
            self.n.calls_before_window += 1;
            return Ok(());
        }
        self.n.calls += 1;
        pipe.writer.call(&FunctionCall {
            probe: probe as u32,
            pid,
            tid,
            start_ns: start.saturating_sub(pipe.start_ns),
            dur_ns: dur,
        })
    }

    /// Remove every breakpoint and close sampled runs.
    pub fn close(
        &mut self,
        b: Option<&mut dyn Watchpoints<Watch = H>>,
        pipe: &mut Pipeline<impl Sink>,
    ) -> anyhow::Result<()> {
        if let Some(b) = b {
            for (_, l) in self.gc_links.drain() {
                b.unwatch_gc_thread(l);
            }
            let now = crate::sys::monotonic_ns();
            let tids: Vec<i32> = self.regs.keys().copied().collect();
            for tid in tids {
                self.mark_span_end(tid, now);
            }
            for i in 0..self.active.len() {
                let tids: Vec<i32> = self.active[i].links.keys().copied().collect();
                for tid in tids {
                    self.watch_off(b, tid, i, now, false);
                }
            }
            self.regs.clear();
        }
        self.flush_watches(pipe)?;
        let runs: Vec<_> = self.runs.drain().collect();
        for ((tid, i), r) in runs {
            let pid = self.active[i].info.pid;
            self.emit_run(i, pid, tid, r, pipe)?;
        }
        for (_, c) in std::mem::take(&mut self.open) {
            self.drop_open(&c);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_resized_share_is_said_again_only_when_it_moves_far() {
        use super::said_again;
        assert!(said_again(None, 0.2));
        assert!(!said_again(Some(0.2), 0.25));
        assert!(!said_again(Some(0.2), 0.16));
        assert!(said_again(Some(0.2), 0.4));
        assert!(said_again(Some(0.2), 0.1));
        assert!(said_again(Some(0.8), 1.0));
        assert!(said_again(Some(1.0), 0.9));
        assert!(!said_again(Some(1.0), 1.0));
    }

    use super::super::sink::Event;
    use super::*;
    use crate::bpf::abi::ProbeFrame;

    const MS: u64 = 1_000_000;
    const T0: u64 = 1_000 * MS;

    /// Probes with one active probe on function `f` (code 0xC0DE) of process 1: exact (its
    /// reference count watched) or sampled; as `consider` sets them up with a BPF sampler,
    /// without one.
    fn one_probe(exact: bool) -> Probes {
        let mut p = Probes::new(vec![ProbeSpec::parse("f").unwrap()], 10 * MS, true);
        p.trap_ns = 1000;
        let plan = exact.then_some(ExactPlan { refcnt: 0xC0DE });
        if exact {
            p.by_addr.insert((1, 0xC0DE), 0);
        }
        p.active.push(Active {
            info: ProbeInfo {
                id: 0,
                pid: 1,
                function: "f".into(),
                file: "x.py".into(),
                method: if exact { "exact" } else { "sampled" }.into(),
                ..Default::default()
            },
            code: 0xC0DE,
            prio: 0,
            plan,
            links: HashMap::new(),
            failed: HashSet::new(),
            retired: false,
            window_calls: 0,
            window_unseen: 0,
            window_start_ns: 0,
        });
        p
    }

    fn calls(events: &[Event]) -> Vec<(i32, u64, u64)> {
        events
            .iter()
            .filter_map(|e| match e {
                Event::Call(c) => Some((c.tid, c.start_ns, c.dur_ns)),
                _ => None,
            })
            .collect()
    }

    /// Thread `tid` attached to probe 0 with the count at `last`.
    fn seed(p: &mut Probes, tid: i32, last: u32) {
        p.open.insert((tid, 0), ThreadCalls::new(Some(last), 0));
    }

    /// A write that left the count at `value` (its frame not read).
    fn rc(value: u64) -> ProbeFrame {
        rc_in(value, 0)
    }

    #[test]
    fn exact_writes_pair_by_thread_and_count() {
        let mut p = one_probe(true);
        let mut pipe = Pipeline::new(Vec::<Event>::new(), T0, 100);
        // Thread 10 attached with the count at 5: an outer call and a recursive one.
        seed(&mut p, 10, 5);
        for (t, v) in [(1, 6), (2, 7), (3, 6), (5, 5)] {
            p.hit(1, 10, T0 + t * MS, 0xC0DE, rc(v), &mut pipe).unwrap();
        }
        // Thread 11 attached inside a call (count 6 includes it): its first write is a pop
        // with no push; then a whole call.
        seed(&mut p, 11, 6);
        for (t, v) in [(6, 5), (7, 6), (9, 5)] {
            p.hit(1, 11, T0 + t * MS, 0xC0DE, rc(v), &mut pipe).unwrap();
        }
        // Thread 12: another thread wrote in between (the count jumped by 2): with no call
        // open the write is a push, with one open a pop.
        seed(&mut p, 12, 5);
        for (t, v) in [(10, 7), (12, 9)] {
            p.hit(1, 12, T0 + t * MS, 0xC0DE, rc(v), &mut pipe).unwrap();
        }
        // A push left open at the end, and another process's write at the same address.
        p.hit(1, 10, T0 + 13 * MS, 0xC0DE, rc(6), &mut pipe)
            .unwrap();
        p.hit(2, 20, T0 + 14 * MS, 0xC0DE, rc(4), &mut pipe)
            .unwrap();
        p.close(None, &mut pipe).unwrap();
        assert_eq!(
            calls(&pipe.writer),
            [
                (10, 2 * MS, MS - 1000),
                (10, MS, 4 * MS - 1000),
                (11, 7 * MS, 2 * MS - 1000),
                (12, 10 * MS, 2 * MS - 1000)
            ]
        );
        assert_eq!(p.n.calls, 4);
        assert_eq!(p.n.unmatched_returns, 1);
        assert_eq!(p.n.ambiguous_edges, 2);
        assert_eq!(p.n.unfinished, 1);
    }

    /// A write with the thread's current frame `frame` that left the count at `value`.
    fn rc_in(value: u64, frame: u64) -> ProbeFrame {
        ProbeFrame {
            value,
            frame,
            ..Default::default()
        }
    }

    /// Calls whose frames outlive them (a frame object takes the code reference at the end,
    /// which writes nothing): a push from a caller frame with a call of its own still open
    /// ends that call unseen; a release made with no open call's caller current (the frame
    /// object freed later, by the GC) is no call's end; a pop from a caller's frame closes
    /// that caller's call, and any opened above it went unseen. Enough unseen ends in a
    /// second switch the probe to sampling.
    #[test]
    fn ends_that_write_nothing_are_seen_by_the_caller_frame() {
        let mut p = one_probe(true);
        let mut pipe = Pipeline::new(Vec::<Event>::new(), T0, 100);
        seed(&mut p, 10, 50);
        // Frame A calls three times; the first two ends write nothing (51, 52, 53).
        for (t, v) in [(1, 51), (3, 52), (5, 53)] {
            p.hit(1, 10, T0 + t * MS, 0xC0DE, rc_in(v, 0xA), &mut pipe)
                .unwrap();
        }
        assert_eq!((p.n.ends_unseen, p.n.calls), (2, 0));
        // A frame object freed by the GC in frame G: no call's end.
        p.hit(1, 10, T0 + 6 * MS, 0xC0DE, rc_in(52, 0x6), &mut pipe)
            .unwrap();
        assert_eq!((p.n.foreign_releases, p.n.calls), (1, 0));
        // The third call (from A) calls it from B inside it, whose end writes nothing; then A's
        // call ends with its write, made with A current: timed, B's counted unseen.
        p.hit(1, 10, T0 + 7 * MS, 0xC0DE, rc_in(53, 0xB), &mut pipe)
            .unwrap();
        p.hit(1, 10, T0 + 9 * MS, 0xC0DE, rc_in(52, 0xA), &mut pipe)
            .unwrap();
        assert_eq!(calls(&pipe.writer), [(10, 5 * MS, 4 * MS - 1000)]);
        assert_eq!((p.n.ends_unseen, p.n.foreign_releases), (3, 1));
        assert_eq!(
            (p.active[0].window_calls, p.active[0].window_unseen),
            (4, 3)
        );
    }

    /// An exact probe whose calls' ends go unseen is switched to sampling at the second's
    /// end: a quarter of its calls and at least [`UNSEEN_ENDS_MIN`]; fewer stay exact.
    #[test]
    fn unseen_ends_switch_a_probe_to_sampling() {
        let (mut p, mut k, proc) = (exact_probes(1), FakeWatchpoints::default(), fake_process());
        let t0 = base();
        let mut pipe = Pipeline::new(Vec::<Event>::new(), t0, 100);
        p.want(&mut k, &proc, TID, 0, t0).unwrap();
        p.enforce_rate(&mut k, t0, 1000, &mut pipe).unwrap();
        for (second, calls, unseen, demoted) in [(1, 100, 24, 0), (2, 8, 2, 0), (3, 12, 3, 1)] {
            p.active[0].window_calls = calls;
            p.active[0].window_unseen = unseen;
            p.enforce_rate(&mut k, t0 + second * 1_000 * MS, 1000, &mut pipe)
                .unwrap();
            assert_eq!(p.n.demoted, demoted, "{calls} calls, {unseen} unseen");
        }
        assert_eq!(p.active[1].info.method, "sampled");
    }

    /// Traps the thread takes inside a call (another probe's, a GC watchpoint's) stay in its
    /// duration and are counted; those of other threads are not.
    #[test]
    fn traps_nested_in_a_call_are_counted() {
        let mut p = one_probe(true);
        let mut pipe = Pipeline::new(Vec::<Event>::new(), T0, 100);
        seed(&mut p, 10, 5);
        p.hit(1, 10, T0 + MS, 0xC0DE, rc(6), &mut pipe).unwrap();
        // A write at an address no probe has (a probe rotated out meanwhile), two GC
        // watchpoint writes, and another thread's trap.
        p.hit(1, 10, T0 + 2 * MS, 0xBAD, rc(1), &mut pipe).unwrap();
        p.note_trap(10, 0);
        p.note_trap(10, 0);
        p.note_trap(11, 0);
        p.hit(1, 10, T0 + 5 * MS, 0xC0DE, rc(5), &mut pipe).unwrap();
        // The next call has none inside.
        p.hit(1, 10, T0 + 6 * MS, 0xC0DE, rc(6), &mut pipe).unwrap();
        p.hit(1, 10, T0 + 7 * MS, 0xC0DE, rc(5), &mut pipe).unwrap();
        assert_eq!(
            calls(&pipe.writer),
            [(10, MS, 4 * MS - 1000), (10, 6 * MS, MS - 1000)]
        );
        assert_eq!(p.n.nested_traps, 3);
        let mut c = std::collections::BTreeMap::new();
        counters(Some(&p), &mut c);
        assert_eq!(c.get("probe_nested_traps"), Some(&3));
    }

    #[test]
    fn sampled_calls_follow_samples_and_blocking() {
        let mut p = one_probe(false);
        let mut pipe = Pipeline::new(Vec::<Event>::new(), T0, 100);
        let inside = [Frame {
            function: "f".into(),
            file: "x.py".into(),
            line: Some(3),
        }];
        let outside = [Frame {
            function: "g".into(),
            file: "x.py".into(),
            line: Some(9),
        }];
        p.stack(1, 10, T0, &inside, false, &mut pipe).unwrap();
        p.stack(1, 10, T0 + 10 * MS, &inside, false, &mut pipe)
            .unwrap();
        // More than two periods later: a new call (the first one ended in between).
        p.stack(1, 10, T0 + 50 * MS, &inside, false, &mut pipe)
            .unwrap();
        // It blocks inside the function: the call goes on across the gap.
        p.stack(1, 10, T0 + 55 * MS, &inside, true, &mut pipe)
            .unwrap();
        p.stack(1, 10, T0 + 200 * MS, &inside, false, &mut pipe)
            .unwrap();
        p.stack(1, 10, T0 + 210 * MS, &outside, false, &mut pipe)
            .unwrap();
        // Still inside at the end: closed there.
        p.stack(1, 11, T0 + 300 * MS, &inside, false, &mut pipe)
            .unwrap();
        p.close(None, &mut pipe).unwrap();
        let half = 5 * MS;
        assert_eq!(
            calls(&pipe.writer),
            [
                (10, 0, 20 * MS),
                (10, 50 * MS - half, 160 * MS),
                (11, 300 * MS - half, 10 * MS)
            ]
        );
        assert_eq!(p.n.calls, 3);
    }

    /// Found by the `walker` fuzz target (issue 15): a code address read from the target near
    /// the top of the address space overflowed `code + 16` (ob_size) before any read.
    #[test]
    fn plan_exact_rejects_wild_code_addresses() {
        let mut f = crate::cpython::testutil::Fake::new();
        let c = f.code("ok", 1);
        let p = f.process(0);
        for code in [u64::MAX, u64::MAX - 15, 1 << 63, 0] {
            assert!(plan_exact(&p, code).is_err(), "{code:#x}");
        }
        // A plausible address that is not mapped is a read error, not a panic.
        assert!(plan_exact(&p, c + (1 << 40)).is_err());
    }

    // ---- The schedule through the fake kernel (rotation, budget phases, demotion, refusals,
    // nothing left behind).

    use super::watch::fake::{FakeWatch, FakeWatchpoints};

    /// A thread id no process can have (above the kernel's largest `pid_max`): its scheduler
    /// counters read as absent.
    const TID: i32 = 9_999_991;

    /// Event times: far ahead of the monotonic clock, which `watch_on` takes the later of.
    fn base() -> u64 {
        crate::sys::monotonic_ns() + 1_000_000 * 1_000_000_000
    }

    /// `n` exact probes of process 1, function `f{i}` at code `0x1000 * (i + 1)`, as
    /// `consider` leaves them with a BPF sampler.
    fn exact_probes(n: usize) -> Probes<FakeWatch> {
        let specs = (0..n)
            .map(|i| ProbeSpec::parse(&format!("f{i}")).unwrap())
            .collect();
        let mut p = Probes::new(specs, 10 * MS, true);
        p.trap_ns = 1000;
        for i in 0..n {
            let code = 0x1000 * (i as u64 + 1);
            p.by_addr.insert((1, code), i);
            p.active.push(Active::exact(i, 1, format!("f{i}"), code));
        }
        p
    }

    fn fake_process() -> PythonProcess {
        crate::cpython::testutil::Fake::new().process(0)
    }

    /// The watch edges written, per probe: (on, off).
    fn edges(events: &[Event], probe: u32) -> (usize, usize) {
        let mut n = (0, 0);
        for e in events {
            if let Event::ProbeWatch(w) = e {
                if w.probe == probe {
                    if w.on {
                        n.0 += 1
                    } else {
                        n.1 += 1
                    }
                }
            }
        }
        n
    }

    /// Five exact probes on a thread with four registers: every turn one goes out and the next
    /// comes in, each watched four turns in five, never more than four set, and every edge
    /// written.
    #[test]
    fn rotation_gives_each_probe_its_turns() {
        let (mut p, mut k, proc) = (exact_probes(5), FakeWatchpoints::default(), fake_process());
        let t0 = base();
        let mut pipe = Pipeline::new(Vec::<Event>::new(), t0, 100);
        for i in 0..5 {
            p.want(&mut k, &proc, TID, i, t0).unwrap();
        }
        assert_eq!(k.on_thread(TID), 4);
        let mut turns = [0; 5];
        let period = p.rotate_ns;
        for turn in 1..=50 {
            p.rotate(&mut k, |_| Some(&proc), t0 + turn * period);
            assert_eq!(k.on_thread(TID), 4, "turn {turn}");
            for (i, n) in turns.iter_mut().enumerate() {
                *n += usize::from(k.watched(TID, 0x1000 * (i as u64 + 1)));
            }
        }
        assert_eq!(turns, [40; 5]);
        assert_eq!(p.n.rotations, 50);
        assert_eq!(p.n.rotation_attach_failures, 0);
        // Between turns the loop does nothing: no rotation before the period is over.
        p.rotate(&mut k, |_| Some(&proc), t0 + 50 * period + period / 2);
        assert_eq!(p.n.rotations, 50);
        p.flush_watches(&mut pipe).unwrap();
        for i in 0..5u32 {
            let (on, off) = edges(&pipe.writer, i);
            let now = usize::from(k.watched(TID, 0x1000 * (u64::from(i) + 1)));
            assert_eq!(on, off + now, "probe {i}: {on} on, {off} off");
        }
    }

    /// Another tool holds two of a thread's registers: the kernel refuses the third watch, so
    /// the probes share the two left (each watched two turns in three) and none is lost; a
    /// thread with none left gets no exact probe (counted).
    #[test]
    fn refused_registers_are_shared_not_lost() {
        let (mut p, mut k, proc) = (exact_probes(3), FakeWatchpoints::default(), fake_process());
        k.held_elsewhere.insert(TID, 2);
        let t0 = base();
        for i in 0..3 {
            p.want(&mut k, &proc, TID, i, t0).unwrap();
        }
        assert_eq!(k.on_thread(TID), 2);
        assert_eq!(p.regs[&TID].cap, 2);
        let mut turns = [0; 3];
        for turn in 1..=30 {
            p.rotate(&mut k, |_| Some(&proc), t0 + turn * p.rotate_ns);
            assert!(k.on_thread(TID) <= 2);
            for (i, n) in turns.iter_mut().enumerate() {
                *n += usize::from(k.watched(TID, 0x1000 * (i as u64 + 1)));
            }
        }
        assert_eq!(turns, [20; 3]);
        assert_eq!(p.n.attach_failures, 0);
        // Asked for again once a second, and refused while the other tool holds them.
        assert_eq!(p.n.register_asks, 15);
        assert_eq!(p.n.registers_refused, 15);
        assert_eq!(p.regs[&TID].cap, 2);
        // The other tool gives them back: within a second every probe is watched, and the
        // rotation stops.
        k.held_elsewhere.remove(&TID);
        let t1 = t0 + 30 * p.rotate_ns;
        for turn in 1..=2 {
            p.rotate(&mut k, |_| Some(&proc), t1 + turn * p.rotate_ns);
        }
        assert_eq!(p.regs[&TID].cap, 3);
        assert_eq!(k.on_thread(TID), 3);
        let rotations = p.n.rotations;
        for turn in 3..=10 {
            p.rotate(&mut k, |_| Some(&proc), t1 + turn * p.rotate_ns);
            assert_eq!(k.on_thread(TID), 3);
        }
        assert_eq!(p.n.rotations, rotations);
        // A thread asks for no more than its registers.
        assert_eq!(p.regs[&TID].cap, 3);
        // No register at all on another thread.
        k.held_elsewhere.insert(TID + 1, 4);
        assert!(p.want(&mut k, &proc, TID + 1, 0, t0).is_err());
        assert_eq!(p.n.attach_failures, 1);
        assert!(p.active[0].failed.contains(&(TID + 1)));
        assert!(!p.wants_thread(0, 1, TID + 1, &[0x1000]));
    }

    /// `--probe-budget 0.1%` on a thread whose one probe takes 1,000 traps a second at
    /// 10 µs each (1% of its time watched all the time): after the first window it is watched
    /// a tenth of the time, in on-phases on every CPU (not on the thread, whose switches
    /// would reload them), and the traps it takes cost it about the budget; a recording loop
    /// that looks every 10 ms and one that looks every 200 ms alike.
    #[test]
    fn budget_phases_keep_the_traps_under_the_budget() {
        for tick in [10 * MS, 200 * MS] {
            let (mut p, mut k, proc) =
                (exact_probes(1), FakeWatchpoints::default(), fake_process());
            p.set_budget(0.001);
            p.budget_trap_ns = 10_000;
            let t0 = base();
            p.want(&mut k, &proc, TID, 0, t0).unwrap();
            assert_eq!(
                k.on_thread(TID),
                1,
                "watched all the time at first, on the thread"
            );
            let (mut now, mut traps_after, mut watched_ns) = (t0, 0u64, 0u64);
            let settle = t0 + 2_000 * MS;
            let end = t0 + 120_000 * MS;
            while now < end {
                // Over the next tick the thread takes a trap every ms while watched.
                let watched = k.watched(TID, 0x1000);
                if watched {
                    for ms in 0..tick / MS {
                        p.note_trap(TID, now + ms * MS);
                    }
                    if now >= settle {
                        traps_after += tick / MS;
                        watched_ns += tick;
                    }
                }
                if watched && now >= settle {
                    assert_eq!(
                        k.on_thread(TID),
                        0,
                        "budgeted on-phases use the CPUs' slots"
                    );
                }
                now += tick;
                p.drained_to(now);
                p.rotate(&mut k, |_| Some(&proc), now);
            }
            let share = watched_ns as f64 / (end - settle) as f64;
            assert!(
                (share - 0.1).abs() < 0.02,
                "tick {tick}: watched {share:.3}"
            );
            let cost = traps_after as f64 * 10_000.0 / (end - settle) as f64;
            assert!((cost - 0.001).abs() < 0.0002, "tick {tick}: cost {cost:.5}");
            assert_eq!(p.n.budget_resizes, 1, "tick {tick}");
            assert!((p.regs[&TID].phase - 0.1).abs() < 1e-9);
            assert!(p.n.watches_every_cpu > 10);
        }
    }

    /// Three probes on one thread under a budget: each watched its share of the time and the
    /// traps within the budget, as with one probe, but one at a time: a watched call never
    /// carries another probe's traps.
    #[test]
    fn budgeted_probes_of_a_thread_are_watched_one_at_a_time() {
        let tick = 10 * MS;
        let (mut p, mut k, proc) = (exact_probes(3), FakeWatchpoints::default(), fake_process());
        p.set_budget(0.001);
        p.budget_trap_ns = 10_000;
        let t0 = base();
        for i in 0..3 {
            p.want(&mut k, &proc, TID, i, t0).unwrap();
        }
        assert_eq!(k.on_thread(TID), 3, "all watched at first");
        let (mut now, mut traps, mut most) = (t0, 0u64, 0usize);
        let mut watched_ns = [0u64; 3];
        let settle = t0 + 2_000 * MS;
        let end = t0 + 300_000 * MS;
        while now < end {
            // Each probe's calls trap once a ms while it is watched.
            let on: Vec<usize> = (0..3)
                .filter(|&i| k.watched(TID, 0x1000 * (i as u64 + 1)))
                .collect();
            for &i in &on {
                for ms in 0..tick / MS {
                    p.note_trap(TID, now + ms * MS);
                }
                if now >= settle {
                    traps += tick / MS;
                    watched_ns[i] += tick;
                }
            }
            if now >= settle {
                most = most.max(on.len());
            }
            now += tick;
            p.drained_to(now);
            p.rotate(&mut k, |_| Some(&proc), now);
        }
        // All three watched all the time would cost 3% (3,000 traps a second at 10 µs), so
        // each gets the least share (5%, a fifth of a percent), one at a time.
        assert_eq!(most, 1, "one probe watched at a time");
        let r = &p.regs[&TID];
        assert_eq!(r.width, 1);
        assert!((r.duty() - 0.05).abs() < 1e-9, "duty {}", r.duty());
        for (i, w) in watched_ns.iter().enumerate() {
            let share = *w as f64 / (end - settle) as f64;
            assert!((share - 0.05).abs() < 0.01, "probe {i}: watched {share:.3}");
        }
        let cost = traps as f64 * 10_000.0 / (end - settle) as f64;
        assert!((cost - 0.0015).abs() < 0.0003, "cost {cost:.5}");
    }

    /// An exact probe over `--probe-max-rate`: its watchpoints go, a sampled probe on the same
    /// function takes its later calls (a new probe record), and no thread wants it any more.
    #[test]
    fn demotion_removes_the_watches_and_adds_a_sampled_probe() {
        let (mut p, mut k, proc) = (exact_probes(1), FakeWatchpoints::default(), fake_process());
        let t0 = base();
        let mut pipe = Pipeline::new(Vec::<Event>::new(), t0, 100);
        p.want(&mut k, &proc, TID, 0, t0).unwrap();
        p.want(&mut k, &proc, TID + 1, 0, t0).unwrap();
        assert_eq!(k.live.len(), 2);
        p.enforce_rate(&mut k, t0, 1000, &mut pipe).unwrap();
        // 999 calls in a second stay exact; 2,000 do not.
        p.active[0].window_calls = 999;
        p.enforce_rate(&mut k, t0 + 1_000 * MS, 1000, &mut pipe)
            .unwrap();
        assert_eq!((p.n.demoted, k.live.len()), (0, 2));
        p.active[0].window_calls = 2000;
        p.enforce_rate(&mut k, t0 + 2_000 * MS, 1000, &mut pipe)
            .unwrap();
        assert_eq!((p.n.demoted, k.live.len()), (1, 0));
        assert!(p.active[0].retired);
        assert_eq!(p.active.len(), 2);
        assert_eq!(p.active[1].info.method, "sampled");
        assert!(p.regs.values().all(|r| r.want.is_empty()));
        let probes: Vec<&ProbeInfo> = pipe
            .writer
            .iter()
            .filter_map(|e| match e {
                Event::Probe(i) => Some(i),
                _ => None,
            })
            .collect();
        assert_eq!(probes.len(), 1);
        assert_eq!((probes[0].id, probes[0].function.as_str()), (1, "f0"));
        // Its rotation does not bring it back.
        p.rotate(&mut k, |_| Some(&proc), t0 + 10_000 * MS);
        assert!(k.live.is_empty());
    }

    /// `record --measure-cost`'s off arms remove every probe watchpoint (the GC's stay), and
    /// the on arms set them again; a thread that exits and the recording's end leave nothing
    /// set.
    #[test]
    fn suspend_resume_and_the_end_leave_nothing_behind() {
        let (mut p, mut k, proc) = (exact_probes(2), FakeWatchpoints::default(), fake_process());
        let t0 = base();
        let mut pipe = Pipeline::new(Vec::<Event>::new(), t0, 100);
        p.watch_gc(&mut k, 1, 0x9000, &[TID, TID + 1]).unwrap();
        for tid in [TID, TID + 1] {
            for i in 0..2 {
                p.want(&mut k, &proc, tid, i, t0).unwrap();
            }
        }
        assert_eq!(k.live.len(), 6);
        p.suspend(&mut k, |_| Some(&proc), t0 + MS);
        assert_eq!(k.live.len(), 2, "the GC's watchpoints stay");
        // Nothing comes back while suspended, rotation or not.
        p.rotate(&mut k, |_| Some(&proc), t0 + 5_000 * MS);
        p.want(&mut k, &proc, TID + 2, 0, t0 + 5_000 * MS).unwrap();
        assert_eq!(k.live.len(), 2);
        p.resume(&mut k, |_| Some(&proc), t0 + 6_000 * MS);
        assert_eq!(k.live.len(), 2 + 5);
        // A thread that appears later gets the GC's watchpoint; one that exits loses all.
        p.thread_added(&mut k, 1, TID + 3);
        assert_eq!(k.on_thread(TID + 3), 1);
        p.thread_gone(&mut k, TID);
        assert_eq!(k.on_thread(TID), 0);
        assert!(!p.regs.contains_key(&TID));
        p.close(Some(&mut k), &mut pipe).unwrap();
        assert!(k.live.is_empty(), "{:?}", k.live);
        let sets = k.log.iter().filter(|l| l.0).count();
        assert_eq!(sets, k.log.len() - sets, "every setting removed once");
    }
}
