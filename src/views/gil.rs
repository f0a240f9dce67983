//! What every view says about a GIL wait and a GC pause: the holder's name and innermost
//! function, the generation's label, so that the report, the Chrome trace and the GIL-blame
//! flamegraph name them alike.

use crate::record::{Frame, GcPause, GilWait, Recording};

/// Holder function of a wait that began while no thread held the GIL (`holder_tid` 0): the
/// GIL was free (or the holder could not be read) and the waiter lost the race to take it.
pub(crate) const GIL_FREE: &str = "<gil free>";
/// Holder function of a wait whose holder is known but whose Python stack is empty (it held
/// the GIL outside any Python frame, or its stack could not be read).
pub(crate) const UNKNOWN_FUNCTION: &str = "<unknown>";
/// Holder function of a wait whose holder is the waiter itself: it still held the GIL and was
/// releasing it (`drop_gil` waiting for the GIL's internal mutex), so no other thread kept it
/// waiting.
pub(crate) const RELEASING: &str = "<releasing>";

/// What the holder was running when a wait began.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum HolderFrame<'a> {
    /// `holder_tid` 0.
    Free,
    /// `holder_tid` is the waiter: a wait while releasing the GIL.
    Releasing,
    /// A holder with an empty stack.
    Unknown,
    /// The holder's innermost Python frame.
    Frame(&'a Frame),
}

impl<'a> HolderFrame<'a> {
    pub fn of(rec: &'a Recording, g: &GilWait) -> Self {
        if g.holder_tid == 0 {
            return HolderFrame::Free;
        }
        if g.holder_tid == g.tid {
            return HolderFrame::Releasing;
        }
        match rec.stack_frames(g.holder_stack).next() {
            Some(f) => HolderFrame::Frame(f),
            None => HolderFrame::Unknown,
        }
    }

    /// Qualified function name, or [`GIL_FREE`] / [`RELEASING`] / [`UNKNOWN_FUNCTION`].
    pub fn function(&self) -> &'a str {
        match self {
            HolderFrame::Free => GIL_FREE,
            HolderFrame::Releasing => RELEASING,
            HolderFrame::Unknown => UNKNOWN_FUNCTION,
            HolderFrame::Frame(f) => &f.function,
        }
    }
}

/// The holder's thread name; `tid N` when the recording does not name it, empty when there is
/// no holder (`holder_tid` 0).
pub fn holder_name(rec: &Recording, g: &GilWait) -> String {
    thread_name_or_tid(rec, g.pid, g.holder_tid)
}

/// A thread's name, `tid N` when unnamed, empty for tid 0.
pub(crate) fn thread_name_or_tid(rec: &Recording, pid: i32, tid: i32) -> String {
    if tid == 0 {
        return String::new();
    }
    match rec.thread_name(pid, tid) {
        "" => format!("tid {tid}"),
        n => n.to_string(),
    }
}

/// `"0"`, `"1"`, `"2"` (any generation >= 0 by its number), `"unknown"` for -1.
pub(crate) fn generation_key(g: &GcPause) -> String {
    if g.generation >= 0 {
        g.generation.to_string()
    } else {
        "unknown".to_string()
    }
}
