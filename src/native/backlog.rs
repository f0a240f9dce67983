//! Events waiting for symbol tables, in arrival order.
//!
//! The thread that drains the ring buffer never reads a symbol table: an event whose native
//! frames lie in a module whose symbols are still being read ([`super::SymbolLoader`]) waits
//! here, unwound but not named, and so does every event after it (the recording's per-thread
//! order matters: a switch-out before its switch-in, a GIL wait's start before its end). The
//! backlog is bounded: past `cap` events the oldest is written with the names it can have.

use std::collections::VecDeque;

pub(crate) struct Backlog<T> {
    q: VecDeque<T>,
    cap: usize,
    /// Events that waited (counter `native_deferred_events`).
    pub deferred: u64,
    /// The most events waiting at once (`native_backlog_max`).
    pub max_len: u64,
    /// Events written before their symbols were read, the backlog being full
    /// (`native_backlog_overflow`).
    pub overflow: u64,
}

impl<T> Backlog<T> {
    pub fn new(cap: usize) -> Self {
        Backlog {
            q: VecDeque::new(),
            cap: cap.max(1),
            deferred: 0,
            max_len: 0,
            overflow: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.q.len()
    }

    /// Take an event in: returned to be applied now (ready) when nothing waits and it is
    /// `ready`, else queued behind the others; the queue then over its bound gives its oldest
    /// back at once, unready (one drain can bring tens of thousands of events).
    pub(crate) fn admit(&mut self, item: T, ready: bool) -> Option<(T, bool)> {
        if self.q.is_empty() && ready {
            return Some((item, true));
        }
        self.q.push_back(item);
        self.deferred += 1;
        if self.q.len() > self.cap {
            self.overflow += 1;
            return self.q.pop_front().map(|t| (t, false));
        }
        self.max_len = self.max_len.max(self.q.len() as u64);
        None
    }

    /// The next event to apply, and whether it is ready: the oldest, when `ready` says so,
    /// when `all` (finishing), or when the backlog is over its bound.
    pub fn next(&mut self, ready: impl Fn(&T) -> bool, all: bool) -> Option<(T, bool)> {
        let front = self.q.front()?;
        let r = ready(front);
        if r || all {
            return self.q.pop_front().map(|t| (t, r));
        }
        if self.q.len() > self.cap {
            self.overflow += 1;
            return self.q.pop_front().map(|t| (t, false));
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_order_behind_a_waiting_event() {
        let mut b = Backlog::new(10);
        assert_eq!(
            b.admit(1, true),
            Some((1, true)),
            "nothing waits: applied at once"
        );
        assert_eq!(b.admit(2, false), None);
        assert_eq!(b.admit(3, true), None, "ready, but behind a waiting event");
        let ready = |loaded: bool| move |x: &i32| *x != 2 || loaded;
        assert!(b.next(ready(false), false).is_none());
        assert_eq!(b.next(ready(true), false), Some((2, true)));
        assert_eq!(b.next(ready(true), false), Some((3, true)));
        assert!(b.next(ready(true), false).is_none());
        assert_eq!(b.admit(4, true), Some((4, true)));
        assert_eq!((b.deferred, b.max_len, b.overflow), (2, 2, 0));
    }

    #[test]
    fn bounded_and_drained_at_finish() {
        let mut b = Backlog::new(2);
        assert_eq!(b.admit(0, false), None);
        assert_eq!(b.admit(1, false), None);
        // Over the bound: the oldest goes out unready as the newest comes in.
        assert_eq!(b.admit(2, false), Some((0, false)));
        assert_eq!(b.admit(3, false), Some((1, false)));
        let never = |_: &i32| false;
        assert!(b.next(never, false).is_none());
        assert_eq!(
            (b.overflow, b.max_len),
            (2, 2),
            "never more than the bound waits"
        );
        // Finishing: everything, in order.
        assert_eq!(b.next(never, true), Some((2, false)));
        assert_eq!(b.next(never, true), Some((3, false)));
        assert_eq!(b.len(), 0);
    }
}
