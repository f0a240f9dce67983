//! What a recording holds, in memory. Views (report, flame, export, TUI replay) work on this.

use std::collections::BTreeMap;

pub use crate::cpython::Frame;

/// Fixed facts about a recording session.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize, PartialEq)]
pub struct Meta {
    /// enginescope version that wrote it.
    pub tool_version: String,
    /// Wall-clock start, seconds since the Unix epoch.
    pub start_unix_s: f64,
    /// `CLOCK_MONOTONIC` at start, ns; all event times in the file are relative to this.
    pub start_mono_ns: u64,
    /// Sampling rate asked for, Hz.
    pub rate_hz: u32,
    /// "bpf" or "memory".
    pub backend: String,
    /// Why this backend was chosen.
    pub backend_reason: String,
    pub hostname: String,
    pub kernel: String,
    /// The command line that made the recording.
    pub command: String,
    /// Number of CPUs sampled.
    pub cpus: u32,
}

/// A target process.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize, PartialEq)]
pub struct ProcessInfo {
    pub pid: i32,
    pub cmdline: String,
    pub python_version: String,
    /// Role, where known (e.g. vLLM `EngineCore`); empty otherwise.
    #[serde(default)]
    pub role: String,
}

/// A target thread; written when first seen and again when its name changes.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize, PartialEq)]
pub struct ThreadInfo {
    pub pid: i32,
    pub tid: i32,
    pub name: String,
    /// When it was first seen (ns since start).
    pub t_ns: u64,
}

/// Sample flags.
pub mod flags {
    /// The thread held the GIL at the sample.
    pub const GIL: u8 = 1;
    /// A garbage collection was running in the thread's interpreter.
    pub const GC: u8 = 2;
    /// The CPU was executing outside the interpreter core (extension modules, libc, kernel):
    /// "on-CPU native" rather than "on-CPU Python".
    pub const NATIVE: u8 = 4;
    /// The CPU was in kernel mode.
    pub const KERNEL: u8 = 8;
    /// The Python stack could not be read completely (the frames present are right).
    pub const PARTIAL: u8 = 16;
}

/// One on-CPU sample of one thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sample {
    /// ns since the recording's start.
    pub t_ns: u64,
    pub pid: i32,
    pub tid: i32,
    /// Index into `Recording::stacks`.
    pub stack: u32,
    /// [`flags`] bits.
    pub flags: u8,
    /// CPU time this sample stands for (the sampling period), ns.
    pub weight_ns: u32,
}

/// One interval a thread spent off CPU (switched out until switched back in).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OffCpu {
    pub pid: i32,
    pub tid: i32,
    /// Switch-out time, ns since start.
    pub start_ns: u64,
    pub dur_ns: u64,
    /// Python stack at switch-out: where it blocked.
    pub stack: u32,
    /// 0 = blocked (sleeping, waiting), 1 = preempted (still runnable when switched out).
    pub preempted: bool,
}

/// One interval a thread spent blocked on the GIL (a futex wait inside the GIL's struct),
/// exact from the kernel, with who held the GIL when the wait began.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GilWait {
    pub pid: i32,
    pub tid: i32,
    pub start_ns: u64,
    pub dur_ns: u64,
    /// Thread holding the GIL when the wait began (0: free or unknown).
    pub holder_tid: i32,
    /// The holder's Python stack when the wait began.
    pub holder_stack: u32,
    /// The waiting thread's Python stack.
    pub waiter_stack: u32,
    /// false: waiting to take the GIL (cond/mutex); true: a dropping thread waiting for the
    /// forced switch to happen (switch_cond/switch_mutex).
    pub switch_wait: bool,
}

/// One garbage collection: from `collecting = 1` to `collecting = 0`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GcPause {
    pub pid: i32,
    /// The thread that ran the collection.
    pub tid: i32,
    pub start_ns: u64,
    pub dur_ns: u64,
    /// Collected generation (0–2), -1 when it could not be read.
    pub generation: i8,
    /// Objects the collection freed (`generation_stats[g].collected` delta), -1 when unknown.
    pub collected: i64,
}

/// A recording, fully read.
#[derive(Debug, Clone, Default)]
pub struct Recording {
    pub meta: Meta,
    pub processes: Vec<ProcessInfo>,
    pub threads: Vec<ThreadInfo>,
    /// Frame table; stacks refer to indices.
    pub frames: Vec<Frame>,
    /// Stack table: frame indices, innermost first. Stack 0 is the empty stack.
    pub stacks: Vec<Vec<u32>>,
    pub samples: Vec<Sample>,
    pub offcpu: Vec<OffCpu>,
    pub gil_waits: Vec<GilWait>,
    pub gc_pauses: Vec<GcPause>,
    /// Failure-path and health counters (last value written wins).
    pub counters: BTreeMap<String, u64>,
    /// Present when the recorder finished cleanly.
    pub end: Option<EndInfo>,
    /// True when the file ended inside a record (recorder killed): everything before it is
    /// intact and was read.
    pub truncated: bool,
}

/// Written last by a recorder that exits cleanly.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize, PartialEq)]
pub struct EndInfo {
    pub duration_ns: u64,
    pub reason: String,
}

impl Recording {
    /// Frames of a stack, innermost first.
    pub fn stack_frames(&self, stack: u32) -> impl Iterator<Item = &Frame> {
        self.stacks
            .get(stack as usize)
            .into_iter()
            .flatten()
            .filter_map(|&f| self.frames.get(f as usize))
    }

    /// Latest known name of a thread.
    pub fn thread_name(&self, pid: i32, tid: i32) -> &str {
        self.threads
            .iter()
            .rev()
            .find(|t| t.pid == pid && t.tid == tid)
            .map(|t| t.name.as_str())
            .unwrap_or("")
    }

    /// Recording length: the clean end's duration, else the last event's time.
    pub fn duration_ns(&self) -> u64 {
        if let Some(e) = &self.end {
            return e.duration_ns;
        }
        let s = self.samples.iter().map(|s| s.t_ns).max().unwrap_or(0);
        let o = self
            .offcpu
            .iter()
            .map(|o| o.start_ns + o.dur_ns)
            .max()
            .unwrap_or(0);
        s.max(o)
    }
}
