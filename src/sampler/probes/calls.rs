//! Pairing an exact probe's watchpoint writes into calls: per thread and probe, the last
//! reference count the thread wrote and the calls it has open.

/// Most calls kept open per thread and probe (recursion depth).
pub(super) const MAX_OPEN_CALLS: usize = 64;

/// What a write to a watched reference count was, from the value this thread last saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Edge {
    Push,
    Pop,
}

/// Per thread and exact probe: the last reference count this thread wrote and its open calls
/// (innermost last).
#[derive(Debug, Default)]
pub(super) struct ThreadCalls {
    pub(super) last: Option<u32>,
    pub(super) open: Vec<OpenCall>,
    /// When the watch was known to be set (absolute ns): writes before it (the watch becomes
    /// active somewhere inside the `perf_event_open` that sets it) keep the count but time
    /// nothing, so that every timed call lies inside the watched interval written to the
    /// recording.
    pub(super) since: u64,
    /// When the watch was removed (absolute ns; `u64::MAX` while set): writes up to it,
    /// drained later, are still timed; later ones (the removal takes effect inside the
    /// syscall) are not. The state stays until the watch is set again or the thread goes.
    pub(super) until: u64,
    /// Removed by a rotation or an on-phase's end (its open calls count as dropped at a
    /// rotation), rather than for good.
    pub(super) rotated: bool,
}

impl ThreadCalls {
    pub(super) fn new(last: Option<u32>, since: u64) -> Self {
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
pub(super) struct OpenCall {
    /// Absolute monotonic time of the push trap.
    pub(super) start_ns: u64,
    /// The thread's debug traps before the push (see `Probes::traps`).
    pub(super) traps: u64,
    /// The thread's current frame at the push: the caller's (0 when it was not read). The
    /// call's pop writes with the same frame current again (CPython pops a frame after making
    /// its caller current), and a frame makes one call at a time.
    pub(super) caller: u64,
}

impl ThreadCalls {
    /// Classify a write that left `value`: +1 from the last value this thread saw is a push,
    /// -1 a pop. Another thread may have written in between (it called the function too, or
    /// touched `func.__code__`): then a call open on this thread makes it a pop, else a push.
    pub(super) fn classify(&mut self, value: u32) -> (Edge, bool) {
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
