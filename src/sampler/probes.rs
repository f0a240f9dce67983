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

use crate::bpf::BpfSampler;
use crate::cpython::objects::CodeInfo;
use crate::cpython::opcodes;
use crate::cpython::{Frame, PythonProcess};
use crate::record::model::{FunctionCall, ProbeInfo, ProbeWatch};

use super::cost::next_random;
use super::sink::Sink;
use super::Pipeline;

/// Functions probed by default in vLLM processes (`record --vllm`): the calls that proved the
/// router-replay fix, most important first (earlier probes win debug registers). Names that
/// match nothing cost nothing.
pub const VLLM_DEFAULT_PROBES: &[&str] = &[
    "MessageQueue.enqueue",
    "MessageQueue.dequeue",
    "Worker.execute_model",
    "_evict_to_fit",
    "EngineCore.step",
    "EngineCore.step_with_batch_queue",
    "BlockObjectStore.put",
    "AuxOutputStore.put",
];

/// Of the default probes, the ones that say what a vLLM process is doing, for `top`'s line per
/// process: an engine core's step and a worker's model run (what the MessageQueue calls inside
/// them add up to).
pub const VLLM_HEADLINE_PROBES: &[&str] = &[
    "EngineCore.step",
    "EngineCore.step_with_batch_queue",
    "Worker.execute_model",
];

/// Whether a qualified name is `name` or ends with it as a dotted suffix
/// (`mod.<locals>.MessageQueue.enqueue` names `MessageQueue.enqueue`).
pub fn names(qualname: &str, name: &str) -> bool {
    qualname == name
        || qualname
            .strip_suffix(name)
            .is_some_and(|head| head.ends_with('.'))
}

/// Whether a probed function is one of [`VLLM_HEADLINE_PROBES`].
pub fn is_headline(function: &str) -> bool {
    VLLM_HEADLINE_PROBES.iter().any(|h| names(function, h))
}

/// A function to probe, as asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeSpec {
    pub spec: String,
    file: Option<String>,
    name: String,
}

impl ProbeSpec {
    /// `[FILE:]QUALNAME`. QUALNAME matches a function's qualified name exactly or as a
    /// dotted suffix (`MessageQueue.enqueue` matches `pkg.<locals>.MessageQueue.enqueue`; a
    /// bare name matches any function of that name); FILE matches the code's file name
    /// exactly or as a path suffix (`shm_broadcast.py`, `device_communicators/shm_broadcast.py`).
    pub fn parse(s: &str) -> anyhow::Result<Self> {
        let s = s.trim();
        let (file, name) = match s.rsplit_once(':') {
            Some((f, n)) => (Some(f.trim().to_string()), n.trim().to_string()),
            None => (None, s.to_string()),
        };
        anyhow::ensure!(
            !name.is_empty()
                && !name.starts_with('.')
                && !name.ends_with('.')
                && file.as_ref().is_none_or(|f| !f.is_empty()),
            "bad probe {s:?}: expected [FILE:]QUALNAME, e.g. MessageQueue.enqueue or shm_broadcast.py:MessageQueue.dequeue"
        );
        Ok(ProbeSpec {
            spec: s.to_string(),
            file,
            name,
        })
    }

    /// `has_qualname`: false for 3.10 code objects, which carry only the bare name; then the
    /// spec's last component is compared.
    pub fn matches(&self, qualname: &str, filename: &str, has_qualname: bool) -> bool {
        let name_ok = if has_qualname {
            names(qualname, &self.name)
        } else {
            self.name.rsplit('.').next() == Some(qualname)
        };
        let file_ok = match &self.file {
            None => true,
            Some(f) => {
                filename == f
                    || filename
                        .strip_suffix(f.as_str())
                        .is_some_and(|head| head.ends_with('/'))
            }
        };
        name_ok && file_ok
    }
}

/// Where the watchpoint of one exactly probed code object goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExactPlan {
    /// Address of the code object's `ob_refcnt` (the object's first 8 bytes).
    pub refcnt: u64,
}

/// Hardware breakpoints per thread (x86 debug registers DR0-DR3).
const DEBUG_REGISTERS: usize = 4;
/// Largest bytecode we walk, in bytes.
const MAX_CODE_BYTES: u64 = 1 << 20;
/// Most calls kept open per thread and probe (recursion depth).
const MAX_OPEN_CALLS: usize = 64;
/// How long one assignment of a thread's debug registers lasts when more exact probes want
/// one on that thread than it has: then the registers rotate among them (one probe out, the
/// next in, every period), each probe watched for `registers / probes` of the time, in runs
/// of `registers` periods (1.5-2 s), so calls of up to ~100 ms are mostly seen whole (a call
/// is lost when a switch falls inside it). Measured on mq_pipeline (five probes on one
/// thread, 2-core machine at load 10-20): with 500 ms, estimated counts within 1.5% of the
/// truth on 3.11-3.15 and p50/p90 within 10% but for one p90 of six at -10.1%; with 200 ms,
/// counts off by up to 15% and a p90 by -40% (each switch perturbs the thread; a call slowed
/// by it is never timed by the probe coming in or going out).
/// `ENGINESCOPE_PROBE_ROTATE_MS` overrides it (measurements).
pub const ROTATE_NS: u64 = 500_000_000;

fn rotate_ns() -> u64 {
    ns_from_env_ms("ENGINESCOPE_PROBE_ROTATE_MS", ROTATE_NS)
}

/// A length in ms from the environment variable `var` (measurements), as ns; `default` when
/// it is unset, not a number or 0.
fn ns_from_env_ms(var: &str, default: u64) -> u64 {
    std::env::var(var)
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|&ms| ms > 0)
        .map_or(default, |ms| ms * 1_000_000)
}

/// The exact probes that want a debug register on one thread, and which of them have one.
#[derive(Debug)]
struct ThreadRegs {
    /// Probe indexes, in the order they came.
    want: Vec<usize>,
    /// Registers the probes may use here: 4, less the GC watchpoint's, lowered to what the
    /// thread holds when the kernel refuses one (another tool holds the rest).
    cap: usize,
    /// Rotation position: the next assignment starts at `want[next]`.
    next: usize,
    /// When the assignment last changed, absolute ns.
    last_ns: u64,
    /// `--probe-budget`: the share of the time the thread's probes are watched at all
    /// (1.0 = all the time). Below 1, they are watched in on-phases of [`BUDGET_ON_NS`]
    /// separated by off-phases, all of the thread's watched probes together; with more
    /// probes than registers each on-phase takes the next assignment of the rotation.
    phase: f64,
    /// In an off-phase: when it ends (absolute ns).
    off_until: Option<u64>,
    /// When the current on-phase began (absolute ns).
    on_since: u64,
    /// How long the current on-phase lasts (drawn at its start, [`on_phase_len`]).
    on_len: u64,
    /// How late the current on-phase began after its off-phase ended (another thread's
    /// on-phase held it back, [`phase_steps`]): taken off the next off-phase.
    late: u64,
    /// Start of the thread's current budget window (absolute ns) and its trap count then.
    budget_mark: (u64, u64),
    /// Whether a budget window has been measured on the thread yet.
    measured: bool,
    /// The thread's scheduler counters at the budget window's start (None when unreadable).
    sched: Option<Schedstat>,
    /// What the budget is sized from, by the events' own times (not when they were
    /// drained, which lags when the recording loop does): the traps the thread took at or
    /// after the window's start, and its probes' watched time (probe·ns) since then: the
    /// watched time summed up to `on_mark`, plus `on_count` probes watched since it.
    window: BudgetWindow,
    /// Watchpoints the thread holds now (its probes watched, not the GC's).
    held: usize,
    /// The thread's context switches when `held` last changed (None when unreadable): each
    /// switch while it holds watchpoints costs it a reload of its debug registers.
    held_mark: Option<u64>,
}

/// The context switches from `from` to `to` of a thread holding `held` watchpoints all that
/// time, and what they cost it at `cost` (nothing without a reading at both ends, or with no
/// watchpoint held).
fn watched_switches(
    from: Option<u64>,
    to: Option<u64>,
    held: usize,
    cost: crate::bpf::SwitchCost,
) -> (u64, u64) {
    match (from, to) {
        (Some(a), Some(b)) if held > 0 => {
            let n = b.saturating_sub(a);
            (n, n.saturating_mul(cost.with_regs(held)))
        }
        _ => (0, 0),
    }
}

/// What watching a thread's probes all the time would cost it, as a share of its wall time:
/// `trap_share` (its traps' time over the wall time, scaled to every probe watched) plus its
/// context switches from `from` to `to` times what each costs holding `regs` watchpoints.
/// Without scheduler counters, the trap share alone.
pub fn full_cost(
    trap_share: f64,
    from: Option<Schedstat>,
    to: Option<Schedstat>,
    switch: crate::bpf::SwitchCost,
    regs: usize,
) -> f64 {
    let (Some(a), Some(b)) = (from, to) else {
        return trap_share;
    };
    let wall = b.t_ns.saturating_sub(a.t_ns);
    if wall == 0 {
        return trap_share;
    }
    let switches = b.switches.saturating_sub(a.switches) as f64;
    trap_share + switches * switch.with_regs(regs) as f64 / wall as f64
}

/// One thread's budget window, measured by event time.
#[derive(Debug, Default, Clone, Copy)]
struct BudgetWindow {
    traps: u64,
    on_acc: u64,
    on_count: u64,
    on_mark: u64,
}

impl BudgetWindow {
    /// The thread's watched probe count changes by `delta` at `t`.
    fn watch(&mut self, t: u64, delta: i64) {
        let t = t.max(self.on_mark);
        self.on_acc += self.on_count * (t - self.on_mark);
        self.on_mark = t;
        self.on_count = self.on_count.saturating_add_signed(delta);
    }

    /// Watched probe·ns from the window's start to `t`.
    fn watched(&self, t: u64) -> u64 {
        self.on_acc + self.on_count * t.saturating_sub(self.on_mark)
    }

    /// A new window from `t` on (the probes watched then stay counted).
    fn restart(&mut self, t: u64) {
        self.traps = 0;
        self.on_acc = 0;
        self.on_mark = self.on_mark.max(t);
    }
}

impl ThreadRegs {
    /// Whether the registers take turns among more probes than they are.
    fn rotates(&self) -> bool {
        self.want.len() > self.cap && self.cap > 0
    }

    /// The share of the time each probe is watched: the on-phases' share, times the
    /// rotation's `cap / probes` where the probes outnumber the registers.
    fn duty(&self) -> f64 {
        let turns = if self.rotates() {
            self.cap as f64 / self.want.len() as f64
        } else {
            1.0
        };
        self.phase * turns
    }

    /// The assignment of the next turn: the `cap` probes from `next` on, round-robin.
    fn advance(&mut self, now_abs: u64) -> Vec<usize> {
        let n = self.want.len();
        if n == 0 {
            return Vec::new();
        }
        if self.rotates() {
            self.next = (self.next + 1) % n;
        }
        self.last_ns = now_abs;
        (0..self.cap.min(n))
            .map(|k| self.want[(self.next + k) % n])
            .collect()
    }
}

/// The shortest window over which a thread's trap time is measured for `--probe-budget`.
const BUDGET_WINDOW_NS: u64 = 2_000_000_000;
/// The first window, watched all the time, is shorter: it costs the full price (hundreds of
/// calls at the rates that make a budget matter).
const BUDGET_FIRST_WINDOW_NS: u64 = 500_000_000;
/// Length of one on-phase under `--probe-budget` (on average; each is drawn between half and
/// one and a half times it): short, so that a window holds many of them. A count scaled from a
/// few phases follows the engine's own swings: at 250 ms a 28 s window of a loaded vllm serve
/// held 6-7 phases per thread and the estimated counts were 5-18% off, at 50 ms 23-25 phases
/// and every count within 1.4% of the in-process timers (docs/probes.md). A call is timed only
/// when it lies inside one phase, so calls of more than a few tens of ms are timed less often
/// (and weighted for it, `views::latency`). Sizing the phases from the thread's longest recent
/// call was tried: a probed call that waits (the EngineCore's `dequeue` while the engine is
/// idle) made them seconds long, and the off-phases after them (their real length × 19 at a
/// 5% share) left one thread unwatched for a whole 28 s window.
pub const BUDGET_ON_NS: u64 = 50_000_000;

/// A watchpoint set in more than this is counted slow (`probe_watch_switches_slow`): tens of
/// µs on a quiet thread, up to a second on a vLLM thread that spins on `sched_yield`.
const SLOW_SWITCH_NS: u64 = 10_000_000;

/// [`BUDGET_ON_NS`], or `ENGINESCOPE_PROBE_PHASE_MS` (measurements).
fn budget_on_ns() -> u64 {
    static ON: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *ON.get_or_init(|| ns_from_env_ms("ENGINESCOPE_PROBE_PHASE_MS", BUDGET_ON_NS))
}
/// The least share of the time the probes are watched under `--probe-budget` (a probe
/// watched less would time too few calls to say anything).
pub const BUDGET_MIN_PHASE: f64 = 0.05;

/// The off-phase that follows an on-phase of `on_ns` for an on share of `phase`.
fn off_phase_ns(on_ns: u64, phase: f64) -> u64 {
    let phase = phase.clamp(BUDGET_MIN_PHASE, 1.0);
    (on_ns as f64 * (1.0 / phase - 1.0)).round() as u64
}

/// When the off-phase of an on-phase that began at `on_since` and ends at `now` ends, for an
/// on share of `phase`: sized from the on-phase as it really lasted, not as planned, so that
/// a recording loop that gets to the phase's end late (a busy machine, normal priority) still
/// keeps the probes within their share over every on/off cycle.
fn off_phase_end(on_since: u64, now: u64, phase: f64) -> u64 {
    now.saturating_add(off_phase_ns(now.saturating_sub(on_since), phase))
}

/// A thread's on-phase lasts between half and one and a half times `on_ns`, drawn from
/// `draw` (uniform 64 bits): phases of one length would fall in step with an engine loop of
/// a commensurate period and watch the same part of it every time.
fn on_phase_len(on_ns: u64, draw: u64) -> u64 {
    let u = (draw >> 11) as f64 / (1u64 << 53) as f64;
    (on_ns as f64 * (0.5 + u)).round() as u64
}

/// A thread's place in the `--probe-budget` schedule, as [`phase_steps`] reads it.
#[derive(Debug, Clone, Copy)]
struct PhaseState {
    tid: i32,
    phase: f64,
    off_until: Option<u64>,
    on_since: u64,
    on_len: u64,
    late: u64,
}

/// What the schedule does to one thread now.
#[derive(Debug, Clone, Copy, PartialEq)]
enum PhaseStep {
    /// End its on-phase; the off-phase lasts until then.
    End { off_until: u64 },
    /// Begin an on-phase, `late` ns after its off-phase ended.
    Start { late: u64 },
}

/// The `--probe-budget` schedule at `now` (pure: the kernel side is [`Probes::phases`]).
/// An on-phase that has lasted its length ends, followed by an off-phase sized from how long
/// it really lasted (a late loop keeps the share) less how late it began. Budgeted threads
/// take turns: no more of them are on at once than the sum of their shares rounded up (one,
/// on an engine whose threads are watched a few percent each), the longest-waiting first. An
/// engine's step runs through several watched threads in turn (the EngineCore waits for its
/// worker), and every watched call's two debug traps lengthen it: with each thread on in its
/// own time, a watched call carries the traps of its own thread's probes only, not those of
/// every thread the step crosses. A thread watched all the time takes no turn.
fn phase_steps(ts: &[PhaseState], now: u64) -> Vec<(i32, PhaseStep)> {
    let budgeted = |t: &&PhaseState| t.phase < 1.0;
    let mut out = Vec::new();
    let mut on = 0usize;
    for t in ts.iter().filter(budgeted) {
        match t.off_until {
            None if now.saturating_sub(t.on_since) >= t.on_len => {
                let end = off_phase_end(t.on_since, now, t.phase);
                let off_until = end.saturating_sub(t.late).max(now);
                out.push((t.tid, PhaseStep::End { off_until }));
            }
            None => on += 1,
            Some(_) => {}
        }
    }
    let total: f64 = ts.iter().filter(budgeted).map(|t| t.phase).sum();
    let limit = ((total - 1e-9).ceil() as usize).max(1);
    let mut due: Vec<(u64, i32, bool)> = ts
        .iter()
        .filter_map(|t| {
            let at = t.off_until.filter(|&at| now >= at)?;
            Some((at, t.tid, t.phase < 1.0))
        })
        .collect();
    due.sort_unstable();
    for (at, tid, takes_turn) in due {
        if takes_turn {
            if on >= limit {
                continue;
            }
            on += 1;
        }
        let late = if takes_turn { now - at } else { 0 };
        out.push((tid, PhaseStep::Start { late }));
    }
    out
}

/// Whether setting a watchpoint failed for want of a free debug register.
fn no_register(e: &anyhow::Error) -> bool {
    let s = format!("{e:#}");
    s.contains("No space left") || s.contains("os error 28")
}

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

/// What a write to a watched reference count was, from the value this thread last saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Edge {
    Push,
    Pop,
}

/// Per thread and exact probe: the last reference count this thread wrote and its open calls
/// (innermost last).
#[derive(Debug, Default)]
struct ThreadCalls {
    last: Option<u32>,
    open: Vec<OpenCall>,
    /// When the watch was known to be set (absolute ns): writes before it (the watch becomes
    /// active somewhere inside the `perf_event_open` that sets it) keep the count but time
    /// nothing, so that every timed call lies inside the watched interval written to the
    /// recording.
    since: u64,
    /// When the watch was removed (absolute ns; `u64::MAX` while set): writes up to it,
    /// drained later, are still timed; later ones (the removal takes effect inside the
    /// syscall) are not. The state stays until the watch is set again or the thread goes.
    until: u64,
    /// Removed by a rotation or an on-phase's end (its open calls count as dropped at a
    /// rotation), rather than for good.
    rotated: bool,
}

impl ThreadCalls {
    fn new(last: Option<u32>, since: u64) -> Self {
        ThreadCalls {
            last,
            open: Vec::new(),
            since,
            until: u64::MAX,
            rotated: false,
        }
    }
}

/// An exact call begun and not yet ended.
#[derive(Debug, Clone, Copy)]
struct OpenCall {
    /// Absolute monotonic time of the push trap.
    start_ns: u64,
    /// The thread's debug traps before the push (see `Probes::traps`).
    traps: u64,
}

impl ThreadCalls {
    /// Classify a write that left `value`: +1 from the last value this thread saw is a push,
    /// -1 a pop. Another thread may have written in between (it called the function too, or
    /// touched `func.__code__`): then a call open on this thread makes it a pop, else a push.
    fn classify(&mut self, value: u32) -> (Edge, bool) {
        let delta = self.last.map(|l| value.wrapping_sub(l) as i32);
        self.last = Some(value);
        match delta {
            Some(1) => (Edge::Push, true),
            Some(-1) => (Edge::Pop, true),
            _ if self.open.is_empty() => (Edge::Push, false),
            _ => (Edge::Pop, false),
        }
    }
}

struct Active {
    info: ProbeInfo,
    /// Code object address.
    code: u64,
    /// Index of the spec it matched: earlier specs win debug registers from later ones.
    prio: usize,
    plan: Option<ExactPlan>,
    /// tid → breakpoints set on it.
    links: HashMap<i32, Vec<Breakpoint>>,
    /// Threads where setting them failed (not retried).
    failed: HashSet<i32>,
    /// Replaced by a sampled probe (too many calls for breakpoints): takes no more calls.
    retired: bool,
    /// Entries since `window_start_ns` (exact probes' rate check).
    window_calls: u64,
    window_start_ns: u64,
}

/// Probe state of one recording.
pub struct Probes {
    specs: Vec<ProbeSpec>,
    active: Vec<Active>,
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
    /// Traps taken inside timed calls (counter `probe_nested_traps`: with
    /// `probe_trap_cost_ns`, how much of the probed calls' time the probes themselves added).
    pub nested_traps: u64,
    /// On-phases that began late because other threads' on-phases held their turn
    /// (counter `probe_phase_late_starts`).
    pub late_starts: u64,
    /// Draws the on-phases' lengths ([`on_phase_len`]).
    rng: u64,
    period_ns: u64,
    quiet: bool,
    pub calls: u64,
    /// Exact entries closed without a return (left by an exception, or attached mid-call).
    pub unfinished: u64,
    /// Pops with no push (the call began before the probe attached).
    pub unmatched_returns: u64,
    /// Writes to a watched reference count whose direction had to be guessed (another thread
    /// wrote it between two of this thread's writes).
    pub ambiguous_edges: u64,
    /// Threads a probe could not be set on (no free debug register).
    pub attach_failures: u64,
    /// Threads a probe was set on after its first.
    pub thread_attaches: u64,
    /// Exact probes switched to sampling for their call rate.
    pub demoted: u64,
    /// tid → the exact probes wanting a register there.
    regs: HashMap<i32, ThreadRegs>,
    /// Watch edges not yet written (absolute times).
    edges: Vec<ProbeWatch>,
    /// Register assignments changed by rotation (one probe out, one in).
    pub rotations: u64,
    /// Calls open on a thread when its watch was removed (rotation): not counted.
    pub rotation_dropped: u64,
    /// Watchpoints that could not be set when their turn came (counted, retried next turn).
    pub rotation_attach_failures: u64,
    /// Length of one register assignment, ns ([`ROTATE_NS`]).
    rotate_ns: u64,
    /// pid → `gcstate->collecting` address, for processes whose GC is watched.
    gc_addr: HashMap<i32, u64>,
    /// tid → its GC watchpoint.
    gc_links: HashMap<i32, Breakpoint>,
    pub gc_attach_failures: u64,
    /// `--probe-budget` as a share (0.02 = 2%); 0 = probes watched all the time.
    budget: f64,
    /// Threads whose on-phases `--probe-budget` re-sized.
    pub budget_resizes: u64,
    /// Watchpoints set, and the recording loop's wait for them.
    pub switches: u64,
    pub switch_ns: u64,
    /// The longest of them, and how many took over [`SLOW_SWITCH_NS`].
    pub switch_max_ns: u64,
    pub switches_slow: u64,
    /// Watches set on every CPU instead of on their thread (counter
    /// `probe_watches_every_cpu`).
    pub watches_every_cpu: u64,
    /// Watchpoints removed, and the loop's time handing them to the helper thread.
    pub removals: u64,
    pub removal_ns: u64,
    /// Watchpoint writes outside any watched interval (before its start was stamped, or
    /// drained after its watch was removed): not timed.
    pub late_hits: u64,
    /// Context switches of threads while they held probe watchpoints, and what they cost
    /// them at the calibrated switch cost ([`crate::bpf::SwitchCost`]).
    pub watched_switches: u64,
    pub watched_switch_ns: u64,
    /// Every watchpoint removed and none set until [`Self::resume`] (`record --measure-cost`'s
    /// off arms).
    suspended: bool,
    /// Calls that began before the window (timed in the warm-up): not written.
    pub calls_before_window: u64,
    /// Events up to here (absolute ns) have been drained ([`Self::drained_to`]).
    drained_ns: u64,
}

impl Probes {
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
            nested_traps: 0,
            late_starts: 0,
            rng: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0x9E37_79B9_7F4A_7C15, |d| d.as_nanos() as u64)
                | 1,
            period_ns: period_ns.max(1),
            quiet,
            calls: 0,
            unfinished: 0,
            unmatched_returns: 0,
            ambiguous_edges: 0,
            attach_failures: 0,
            thread_attaches: 0,
            demoted: 0,
            regs: HashMap::new(),
            edges: Vec::new(),
            rotations: 0,
            rotation_dropped: 0,
            rotation_attach_failures: 0,
            rotate_ns: rotate_ns(),
            gc_addr: HashMap::new(),
            gc_links: HashMap::new(),
            gc_attach_failures: 0,
            budget: 0.0,
            budget_resizes: 0,
            switch_cost: crate::bpf::SwitchCost::default(),
            switches: 0,
            switch_ns: 0,
            switch_max_ns: 0,
            switches_slow: 0,
            removals: 0,
            watches_every_cpu: 0,
            removal_ns: 0,
            late_hits: 0,
            watched_switches: 0,
            watched_switch_ns: 0,
            suspended: false,
            calls_before_window: 0,
            drained_ns: 0,
        }
    }

    /// Watch `gcstate->collecting` at `addr` in every thread of `pid` (and in threads that
    /// appear later). Fails, setting nothing, when the first thread refuses.
    pub fn watch_gc(
        &mut self,
        b: &mut BpfSampler,
        pid: i32,
        addr: u64,
        tids: &[i32],
    ) -> anyhow::Result<()> {
        let mut set = Vec::new();
        for &tid in tids {
            match b.watch_gc_thread(tid, addr) {
                Ok(l) => set.push((tid, l)),
                Err(e) if set.is_empty() => return Err(e),
                Err(_) => self.gc_attach_failures += 1,
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

    pub fn infos(&self) -> impl Iterator<Item = &ProbeInfo> {
        self.active.iter().map(|a| &a.info)
    }

    /// A code object seen for the first time in process `proc`, in a stack of thread `tid`:
    /// probe it if a spec matches. `b` is the BPF sampler when there is one.
    #[allow(clippy::too_many_arguments)]
    pub fn consider(
        &mut self,
        b: Option<&mut BpfSampler>,
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
        self.active.push(Active {
            info: ProbeInfo::default(),
            code,
            plan: plan.clone(),
            links: HashMap::new(),
            failed: HashSet::new(),
            retired: false,
            window_calls: 0,
            window_start_ns: 0,
            prio,
        });
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
        b: &mut BpfSampler,
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
        });
        if !r.want.contains(&i) {
            r.want.push(i);
        }
        let cap = r.cap;
        let on = r
            .want
            .iter()
            .filter(|&&j| self.active[j].links.contains_key(&tid))
            .count();
        let off = self.suspended || self.regs.get(&tid).is_some_and(|r| r.off_until.is_some());
        if self.active[i].links.contains_key(&tid) || on >= cap || off {
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
                self.attach_failures += 1;
                Err(e)
            }
        }
    }

    /// Set probe `i`'s watchpoint on `tid`, seeded with the count now; queue the edge.
    fn watch_on(
        &mut self,
        b: &mut BpfSampler,
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
            self.watches_every_cpu += 1;
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
    fn watch_off(&mut self, b: &mut BpfSampler, tid: i32, i: usize, now_abs: u64, rotation: bool) {
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
        self.switch_ns += ns;
        self.switch_max_ns = self.switch_max_ns.max(ns);
        if ns > SLOW_SWITCH_NS {
            self.switches_slow += 1;
        }
        self.switches += 1;
    }

    /// One watchpoint removed, begun at `t`: counted apart from the settings, with the
    /// loop's time handing it to the helper thread, which removes it without the loop
    /// waiting (µs; the removal itself can take up to seconds on a thread that spins).
    fn note_removal(&mut self, t: std::time::Instant) {
        self.removals += 1;
        self.removal_ns += t.elapsed().as_nanos() as u64;
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
        self.watched_switches += n;
        self.watched_switch_ns += ns;
        r.held_mark = now;
        r.held = r.held.saturating_add_signed(delta as isize);
    }

    /// Write the queued watch edges (their probes' records are written).
    pub fn flush_watches(&mut self, pipe: &mut Pipeline<impl Sink>) -> anyhow::Result<()> {
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
        b: &mut BpfSampler,
        proc_of: impl Fn(i32) -> Option<&'a PythonProcess>,
        now_abs: u64,
    ) {
        if self.suspended {
            return;
        }
        self.apply_budget(now_abs);
        self.phases(b, &proc_of, now_abs);
        let period = self.rotate_ns;
        let tids = self.threads_where(|r| {
            r.rotates() && r.phase >= 1.0 && now_abs.saturating_sub(r.last_ns) >= period
        });
        for tid in tids {
            let Some(r) = self.regs.get_mut(&tid) else {
                continue;
            };
            let chosen = r.advance(now_abs);
            self.rotations += 1;
            self.assign(b, &proc_of, tid, &chosen, now_abs);
        }
    }

    /// Remove every probe watchpoint and set none until [`Self::resume`]: what watching costs
    /// is then nothing but the idle registers (`record --measure-cost`'s off arms). Calls open are
    /// dropped as at a rotation; counts scale by the watched time as under a budget.
    pub fn suspend<'a>(
        &mut self,
        b: &mut BpfSampler,
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
    pub fn resume<'a>(
        &mut self,
        b: &mut BpfSampler,
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
        b: &mut BpfSampler,
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
            if self.watch_on(b, proc, tid, j, now_abs).is_err() {
                self.rotation_attach_failures += 1;
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
    pub fn set_budget(&mut self, budget: f64) {
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
        b: &mut BpfSampler,
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
                    self.late_starts += u64::from(late > 0);
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
                * if r.rotates() { r.want.len() as u64 } else { 1 };
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
            if took == 0 || watched == 0 {
                continue;
            }
            r.measured = true;
            let trap_share = took as f64 * trap_ns as f64 * r.want.len() as f64 / watched as f64;
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
            // The on share that brings the cost under the budget, in steps of a tenth of
            // itself (a thread re-measured a little over or under keeps its phase).
            let want = (self.budget / full).clamp(BUDGET_MIN_PHASE, 1.0);
            let phase = if want >= 1.0 {
                1.0
            } else {
                let step = 10f64.powf((want.log10() * 10.0).floor() / 10.0);
                step.clamp(BUDGET_MIN_PHASE, 1.0)
            };
            if (phase - r.phase).abs() > 1e-9 {
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
            self.budget_resizes += 1;
            if !self.quiet {
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
    /// debug traps, ~30 µs here) is switched to the sampled method: its breakpoints are removed
    /// and a new sampled probe on the same function takes its later calls. `now_ns` absolute.
    pub fn enforce_rate(
        &mut self,
        b: &mut BpfSampler,
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
            a.window_calls = 0;
            a.window_start_ns = now_ns;
            if rate > max_per_s {
                demote.push((i, rate));
            }
        }
        for (i, rate) in demote {
            let why =
                format!("{rate} calls/s is more than --probe-max-rate {max_per_s} for breakpoints");
            self.demote(b, i, &why, now_ns, pipe)?;
        }
        Ok(())
    }

    /// Switch exact probe `i` to the sampled method from `now_ns` on: remove its breakpoints
    /// and add a sampled probe on the same function (a new probe record).
    fn demote(
        &mut self,
        b: &mut BpfSampler,
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
        self.unfinished += dropped;
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
        self.active.push(Active {
            info,
            code,
            prio,
            plan: None,
            links: HashMap::new(),
            failed: HashSet::new(),
            retired: false,
            window_calls: 0,
            window_start_ns: 0,
        });
        self.demoted += 1;
        Ok(())
    }

    /// A stack of thread `tid` of `pid` (raw code object addresses): an exact probe whose
    /// function is in it wants a register on this thread, if it does not have one or a turn.
    pub fn observe(&mut self, b: &mut BpfSampler, proc: &PythonProcess, tid: i32, codes: &[u64]) {
        let pid = proc.pid;
        let now = crate::sys::monotonic_ns();
        let wanted: Vec<usize> = (0..self.active.len())
            .filter(|&i| self.wants_thread(i, pid, tid, codes))
            .collect();
        for i in wanted {
            if self.want(b, proc, tid, i, now).is_ok() {
                self.thread_attaches += 1;
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
    pub fn needs_attach(&self, pid: i32, tid: i32, codes: &[u64]) -> bool {
        (0..self.active.len()).any(|i| self.wants_thread(i, pid, tid, codes))
    }

    /// Whether any exact probe is active in `pid` (stacks must be passed to `observe`).
    pub fn wants_stacks(&self, pid: i32) -> bool {
        self.active
            .iter()
            .any(|a| a.plan.is_some() && !a.retired && a.info.pid == pid)
    }

    /// A thread of `pid` appeared: watch its GC state.
    pub fn thread_added(&mut self, b: &mut BpfSampler, pid: i32, tid: i32) {
        if let Some(&addr) = self.gc_addr.get(&pid) {
            if let std::collections::hash_map::Entry::Vacant(e) = self.gc_links.entry(tid) {
                match b.watch_gc_thread(tid, addr) {
                    Ok(l) => {
                        e.insert(l);
                    }
                    Err(_) => self.gc_attach_failures += 1,
                }
            }
        }
    }

    /// A thread exited: drop its breakpoints and its open calls.
    pub fn thread_gone(&mut self, b: &mut BpfSampler, tid: i32) {
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
    pub fn process_gone(&mut self, b: &mut BpfSampler, pid: i32) {
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
            self.rotation_dropped += n;
        } else {
            self.unfinished += n;
        }
    }

    /// Thread `tid` took a debug trap that is not a probe hit (a GC watchpoint write): counted
    /// inside the calls open on it.
    pub fn note_trap(&mut self, tid: i32, t_ns: u64) {
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
    pub fn drained_to(&mut self, t_ns: u64) {
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
            self.late_hits += 1;
            return Ok(());
        };
        if t_ns > tc.until {
            // After its watch was removed.
            self.late_hits += 1;
            return Ok(());
        }
        let (edge, sure) = tc.classify(f.value as u32);
        if t_ns < tc.since {
            // Before the watch's interval began: the count is kept, nothing is timed.
            self.late_hits += 1;
            return Ok(());
        }
        if !sure {
            self.ambiguous_edges += 1;
        }
        match edge {
            Edge::Push => {
                self.active[probe].window_calls += 1;
                tc.open.push(OpenCall {
                    start_ns: t_ns,
                    traps: before,
                });
                if tc.open.len() > MAX_OPEN_CALLS {
                    // Entries that never saw their pop (an exception left a frame object
                    // holding the reference): the oldest go.
                    tc.open.remove(0);
                    self.unfinished += 1;
                }
            }
            Edge::Pop => match tc.open.pop() {
                Some(OpenCall {
                    start_ns: start,
                    traps: at_push,
                }) => {
                    self.nested_traps += before.saturating_sub(at_push).saturating_sub(1);
                    let dur = t_ns.saturating_sub(start).saturating_sub(self.trap_ns);
                    if !pipe.in_window(start) {
                        // Began before the window (during the warm-up): not in it.
                        self.calls_before_window += 1;
                        return Ok(());
                    }
                    self.calls += 1;
                    pipe.writer.call(&FunctionCall {
                        probe: probe as u32,
                        pid,
                        tid,
                        start_ns: start.saturating_sub(pipe.start_ns),
                        dur_ns: dur,
                    })?;
                }
                None => self.unmatched_returns += 1,
            },
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
        if !pipe.in_window(first) {
            self.calls_before_window += 1;
            return Ok(());
        }
        self.calls += 1;
        pipe.writer.call(&FunctionCall {
            probe: probe as u32,
            pid,
            tid,
            start_ns: first
                .saturating_sub(self.period_ns / 2)
                .saturating_sub(pipe.start_ns),
            dur_ns: last - first + self.period_ns,
        })
    }

    /// Remove every breakpoint and close sampled runs.
    pub fn close(
        &mut self,
        b: Option<&mut BpfSampler>,
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

/// The probe counters, when probes were asked for (`None`: a source that cannot set them, all
/// zero).
pub fn counters(p: Option<&Probes>, out: &mut std::collections::BTreeMap<String, u64>) {
    let v = |f: fn(&Probes) -> u64| p.map_or(0, f);
    out.insert("probe_trap_cost_ns".into(), v(|p| p.trap_ns));
    out.insert("probe_trap_cost_in_use_ns".into(), v(|p| p.budget_trap_ns));
    out.insert("probe_nested_traps".into(), v(|p| p.nested_traps));
    out.insert("probe_phase_late_starts".into(), v(|p| p.late_starts));
    out.insert("probe_calls".into(), v(|p| p.calls));
    out.insert("probe_calls_unfinished".into(), v(|p| p.unfinished));
    out.insert("probe_unmatched_returns".into(), v(|p| p.unmatched_returns));
    out.insert("probe_ambiguous_edges".into(), v(|p| p.ambiguous_edges));
    out.insert("probe_attach_failures".into(), v(|p| p.attach_failures));
    out.insert("probe_thread_attaches".into(), v(|p| p.thread_attaches));
    out.insert("probes_switched_to_sampling".into(), v(|p| p.demoted));
    out.insert("probe_register_rotations".into(), v(|p| p.rotations));
    out.insert("probe_budget_resizes".into(), v(|p| p.budget_resizes));
    out.insert(
        "probe_switch_cost_1reg_ns".into(),
        v(|p| p.switch_cost.one_ns),
    );
    out.insert(
        "probe_switch_cost_4reg_ns".into(),
        v(|p| p.switch_cost.four_ns),
    );
    out.insert("probe_watch_switches".into(), v(|p| p.switches));
    out.insert("probe_watch_switch_ns".into(), v(|p| p.switch_ns));
    out.insert("probe_watch_switch_max_ns".into(), v(|p| p.switch_max_ns));
    out.insert("probe_watch_switches_slow".into(), v(|p| p.switches_slow));
    out.insert("probe_watch_removals".into(), v(|p| p.removals));
    out.insert("probe_watches_every_cpu".into(), v(|p| p.watches_every_cpu));
    out.insert("probe_watch_removal_ns".into(), v(|p| p.removal_ns));
    out.insert("probe_hits_outside_watch".into(), v(|p| p.late_hits));
    out.insert("probe_watched_switches".into(), v(|p| p.watched_switches));
    out.insert("probe_watched_switch_ns".into(), v(|p| p.watched_switch_ns));
    out.insert(
        "probe_calls_before_window".into(),
        v(|p| p.calls_before_window),
    );
    out.insert(
        "probe_calls_dropped_at_rotation".into(),
        v(|p| p.rotation_dropped),
    );
    out.insert(
        "probe_rotation_attach_failures".into(),
        v(|p| p.rotation_attach_failures),
    );
}

/// Set plan `p`'s watchpoints for thread `tid`: on every CPU with `every_cpu` where a slot is
/// free ([`BpfSampler::watch_refcount_cpus`]), else on the thread.
fn attach_all(
    b: &mut BpfSampler,
    tid: i32,
    p: &ExactPlan,
    every_cpu: bool,
) -> anyhow::Result<Vec<Breakpoint>> {
    let mut ls = Vec::new();
    for &addr in std::iter::once(&p.refcnt) {
        let set = if every_cpu {
            b.watch_refcount_cpus(addr)
                .or_else(|_| b.watch_refcount(tid, addr))
        } else {
            b.watch_refcount(tid, addr)
        };
        match set {
            Ok(l) => ls.push(l),
            Err(e) => {
                for l in ls {
                    b.unwatch_refcount(l);
                }
                return Err(e);
            }
        }
    }
    Ok(ls)
}

#[cfg(test)]
mod tests {
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

    /// A write that left the count at `value`.
    fn rc(value: u64) -> ProbeFrame {
        ProbeFrame {
            value,
            ..Default::default()
        }
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
        assert_eq!(p.calls, 4);
        assert_eq!(p.unmatched_returns, 1);
        assert_eq!(p.ambiguous_edges, 2);
        assert_eq!(p.unfinished, 1);
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
        assert_eq!(p.nested_traps, 3);
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
        assert_eq!(p.calls, 3);
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

    /// `--probe-budget`'s phases: each probe on a thread is watched `phase`, times `cap /
    /// probes` where they outnumber the registers, of the time.
    #[test]
    fn budget_phases_give_each_probe_its_share() {
        let regs = |want: usize, cap: usize, phase: f64| ThreadRegs {
            want: (0..want).collect(),
            cap,
            next: 0,
            last_ns: 0,
            phase,
            off_until: None,
            on_since: 0,
            on_len: BUDGET_ON_NS,
            late: 0,
            budget_mark: (0, 0),
            measured: false,
            sched: None,
            window: BudgetWindow::default(),
            held: 0,
            held_mark: None,
        };
        assert_eq!(regs(3, 4, 1.0).duty(), 1.0);
        assert!((regs(3, 4, 0.2).duty() - 0.2).abs() < 1e-9);
        assert!((regs(5, 4, 1.0).duty() - 0.8).abs() < 1e-9);
        assert!((regs(5, 4, 0.5).duty() - 0.4).abs() < 1e-9);
        // On 250 ms, off 750 ms: a quarter of the time.
        assert_eq!(off_phase_ns(250 * MS, 0.25), 750_000_000);
        assert_eq!(off_phase_ns(250 * MS, 1.0), 0);
        // Never below the floor: 5% is on 250 ms, off 4.75 s.
        assert_eq!(off_phase_ns(250 * MS, 0.0), 4_750_000_000);
        // Each on-phase takes the next assignment: five probes on four registers, every
        // probe out once in five turns; three on four, all of them every turn.
        let mut r = regs(5, 4, 0.5);
        let mut seen = [0; 5];
        for t in 0..5 {
            for j in r.advance(t) {
                seen[j] += 1;
            }
        }
        assert_eq!(seen, [4; 5]);
        let mut r = regs(3, 4, 0.5);
        assert_eq!(r.advance(0), vec![0, 1, 2]);
        assert_eq!(r.advance(1), vec![0, 1, 2]);
    }

    /// Runs [`phase_steps`] every `tick` ns for `until` ns over threads of the given
    /// shares, all starting on together: each thread's watched share, and the most on at
    /// once after the first 2 s.
    fn simulate_phases(phases: &[f64], until: u64, tick: u64) -> (Vec<f64>, usize) {
        let mut ts: Vec<PhaseState> = phases
            .iter()
            .enumerate()
            .map(|(i, &phase)| PhaseState {
                tid: i as i32,
                phase,
                off_until: None,
                on_since: 0,
                on_len: BUDGET_ON_NS,
                late: 0,
            })
            .collect();
        let mut on_ns = vec![0u64; phases.len()];
        let (mut rng, mut most, mut now) = (7u64, 0, 0);
        while now < until {
            for (tid, step) in phase_steps(&ts, now) {
                let t = &mut ts[tid as usize];
                match step {
                    PhaseStep::End { off_until } => {
                        on_ns[tid as usize] += now - t.on_since;
                        t.off_until = Some(off_until);
                    }
                    PhaseStep::Start { late } => {
                        t.off_until = None;
                        t.on_since = now;
                        t.on_len = on_phase_len(BUDGET_ON_NS, next_random(&mut rng));
                        t.late = late;
                    }
                }
            }
            let on = ts
                .iter()
                .filter(|t| t.phase < 1.0 && t.off_until.is_none())
                .count();
            if now >= 2_000_000_000 {
                most = most.max(on);
            }
            now += tick;
        }
        for (i, t) in ts.iter().enumerate() {
            if t.off_until.is_none() {
                on_ns[i] += now - t.on_since;
            }
        }
        let shares = on_ns.iter().map(|&n| n as f64 / now as f64).collect();
        (shares, most)
    }

    /// Budgeted threads take turns: one on at a time while their shares add up to at most
    /// one (a step crossing them pays one thread's traps), as many as the shares' sum rounded
    /// up otherwise; each keeps its share, the turns' waits taken off its next off-phase; on
    /// a loop that looks every 10 ms and on one that is 300 ms late.
    #[test]
    fn budgeted_threads_take_turns_and_keep_their_shares() {
        for tick in [10_000_000, 300_000_000] {
            for (phases, most) in [
                (&[0.25, 0.1, 0.05][..], 1),
                (&[0.3, 0.3, 0.3][..], 1),
                (&[0.5, 0.5, 0.5][..], 2),
            ] {
                let (shares, on) = simulate_phases(phases, 600_000_000_000, tick);
                assert!(on <= most, "{phases:?} tick {tick}: {on} on at once");
                for (s, p) in shares.iter().zip(phases) {
                    assert!(
                        (s - p).abs() <= 0.1 * p,
                        "{phases:?} tick {tick}: share {s:.3} for {p}"
                    );
                }
            }
        }
        // A thread back to all the time starts at once, whoever else is on.
        let t = |tid, phase, off_until| PhaseState {
            tid,
            phase,
            off_until,
            on_since: 0,
            on_len: BUDGET_ON_NS,
            late: 0,
        };
        let steps = phase_steps(
            &[t(1, 0.2, None), t(2, 0.2, Some(5)), t(3, 1.0, Some(5))],
            10,
        );
        assert_eq!(steps, vec![(3, PhaseStep::Start { late: 0 })]);
        // The on-phases' lengths: between half and one and a half times the planned one.
        let mut rng = 3u64;
        let lens: Vec<u64> = (0..1000)
            .map(|_| on_phase_len(BUDGET_ON_NS, next_random(&mut rng)))
            .collect();
        assert!(lens
            .iter()
            .all(|&l| (BUDGET_ON_NS / 2..=BUDGET_ON_NS * 3 / 2).contains(&l)));
        let mean = lens.iter().sum::<u64>() as f64 / lens.len() as f64;
        assert!((mean / BUDGET_ON_NS as f64 - 1.0).abs() < 0.05, "{mean}");
    }

    /// A recording loop that gets to an on-phase's end late (here 1 s instead of 250 ms)
    /// makes the off-phase after it as much longer: the share over the cycle stays `phase`.
    #[test]
    fn budget_share_holds_when_the_loop_is_late() {
        for (on, phase) in [
            (BUDGET_ON_NS, 0.25),
            (1_000_000_000, 0.25),
            (3_700_000_000, 0.1),
        ] {
            let end = off_phase_end(500, 500 + on, phase);
            let share = on as f64 / (end - 500) as f64;
            assert!((share - phase).abs() < 1e-6, "on {on} ns: share {share}");
        }
        // Watched all the time: no off-phase.
        assert_eq!(off_phase_end(0, 900, 1.0), 900);
    }

    #[test]
    fn watched_switches_cost_what_the_registers_held_cost() {
        let cost = crate::bpf::SwitchCost {
            one_ns: 1000,
            four_ns: 4000,
        };
        assert_eq!(watched_switches(Some(10), Some(25), 1, cost), (15, 15_000));
        assert_eq!(watched_switches(Some(10), Some(25), 4, cost), (15, 60_000));
        // Nothing held, or a reading missing at either end: nothing counted.
        assert_eq!(watched_switches(Some(10), Some(25), 0, cost), (0, 0));
        assert_eq!(watched_switches(None, Some(25), 2, cost), (0, 0));
        assert_eq!(watched_switches(Some(30), Some(25), 2, cost), (0, 0));
    }

    #[test]
    fn budget_counts_context_switches() {
        let st = |t_ns, run_ns, switches| Schedstat {
            t_ns,
            run_ns,
            switches,
        };
        assert_eq!(Schedstat::parse("2500 77 30\n", 9), Some(st(9, 2500, 30)));
        assert_eq!(Schedstat::parse("2500 77\n", 9), None);
        let cost = crate::bpf::SwitchCost {
            one_ns: 1000,
            four_ns: 4000,
        };
        assert_eq!(cost.with_regs(0), 0);
        assert_eq!(cost.with_regs(2), 2000);
        assert_eq!(cost.with_regs(9), 4000);
        let s = 1_000_000_000;
        // 1% of the wall time in traps, on a thread that switched 5,000 times in 1 s holding
        // one register: +0.5%; holding four, +2%.
        let full = full_cost(0.01, Some(st(0, 0, 0)), Some(st(s, s, 5000)), cost, 1);
        assert!((full - 0.015).abs() < 1e-9, "{full}");
        let full = full_cost(0.01, Some(st(0, 0, 0)), Some(st(s, 0, 5000)), cost, 4);
        assert!((full - 0.03).abs() < 1e-9, "{full}");
        // No counters: the trap share alone.
        assert_eq!(full_cost(0.01, None, Some(st(s, s, 1)), cost, 1), 0.01);
    }

    #[test]
    fn budget_window_counts_watched_probe_time_by_event_time() {
        let mut w = BudgetWindow::default();
        // Two probes on from 100, one off at 300, the other off at 500: 200·2 + 200·1.
        w.watch(100, 1);
        w.watch(100, 1);
        w.watch(300, -1);
        assert_eq!(w.watched(400), 400 + 100);
        w.watch(500, -1);
        assert_eq!(w.watched(900), 600);
        // A new window at 900 with one probe set at 1000: 50 at 1050.
        w.restart(900);
        w.watch(1000, 1);
        assert_eq!(w.watched(1050), 50);
        // An edge stamped before the window's start counts from the start.
        let mut w = BudgetWindow {
            on_mark: 2000,
            ..BudgetWindow::default()
        };
        w.watch(1500, 1);
        assert_eq!(w.watched(2100), 100);
    }

    #[test]
    fn spec_matching() {
        let p = ProbeSpec::parse("MessageQueue.enqueue").unwrap();
        assert!(p.matches("MessageQueue.enqueue", "/x/shm_broadcast.py", true));
        assert!(p.matches("f.<locals>.MessageQueue.enqueue", "a.py", true));
        assert!(!p.matches("OtherMessageQueue.enqueue", "a.py", true));
        assert!(!p.matches("MessageQueue.enqueue_many", "a.py", true));
        let p = ProbeSpec::parse("shm_broadcast.py:MessageQueue.dequeue").unwrap();
        assert!(p.matches(
            "MessageQueue.dequeue",
            "/v/device_communicators/shm_broadcast.py",
            true
        ));
        assert!(p.matches("MessageQueue.dequeue", "shm_broadcast.py", true));
        assert!(!p.matches("MessageQueue.dequeue", "/v/not_shm_broadcast.py", true));
        let p = ProbeSpec::parse("execute_model").unwrap();
        assert!(p.matches("Worker.execute_model", "w.py", true));
        assert!(p.matches("execute_model", "w.py", true));
        let p = ProbeSpec::parse("MessageQueue.enqueue").unwrap();
        assert!(p.matches("enqueue", "a.py", false));
        for bad in ["", ":f", "f.", ".f", "x.py:"] {
            assert!(ProbeSpec::parse(bad).is_err(), "{bad}");
        }
    }
}
