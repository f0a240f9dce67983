//! Time windows of a report: the recording cut into `[k·w, (k+1)·w)` from its start, the last
//! one ending with the recording.

use crate::record::Recording;

/// At most this many windows: a smaller `--window` over a long recording is widened.
pub(crate) const MAX_WINDOWS: u64 = 10_000;

/// Time windows of a report.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Windows {
    pub width_ns: u64,
    pub end_ns: u64,
    pub count: usize,
}

impl Windows {
    /// Windows of `width_ns` over `[0, end_ns)`, widened when there would be more than
    /// [`MAX_WINDOWS`].
    pub fn new(width_ns: u64, end_ns: u64) -> Windows {
        let mut width_ns = width_ns.max(1);
        if end_ns / width_ns >= MAX_WINDOWS {
            width_ns = end_ns.div_ceil(MAX_WINDOWS);
        }
        let count = if end_ns == 0 {
            0
        } else {
            end_ns.div_ceil(width_ns) as usize
        };
        Windows {
            width_ns,
            end_ns,
            count,
        }
    }

    /// Window of a time; times at or past the end fall in the last window.
    pub fn index(&self, t_ns: u64) -> Option<usize> {
        if self.count == 0 {
            return None;
        }
        Some(((t_ns / self.width_ns) as usize).min(self.count - 1))
    }

    /// `[start, end)` of window `i`, ns.
    pub fn bounds(&self, i: usize) -> (u64, u64) {
        let start = i as u64 * self.width_ns;
        (start, (start + self.width_ns).min(self.end_ns))
    }

    /// Length of window `i`, ns.
    pub(crate) fn len_ns(&self, i: usize) -> u64 {
        let (a, b) = self.bounds(i);
        b.saturating_sub(a)
    }

    /// Add the parts of `[start, start + dur)` that fall in each window to `acc`.
    pub fn spread(&self, start: u64, dur: u64, acc: &mut [u64]) {
        let end = start.saturating_add(dur).min(self.end_ns);
        let Some(first) = self.index(start) else {
            return;
        };
        for (i, slot) in acc.iter_mut().enumerate().skip(first) {
            let (a, b) = self.bounds(i);
            if a >= end {
                break;
            }
            *slot += end.min(b).saturating_sub(start.max(a));
        }
    }
}

/// How far a recording reaches: its end record's duration, else the end of its last event of
/// any kind (a sample ends one period after its time; off-CPU intervals, GIL waits, GC pauses,
/// calls, metric scrapes).
pub fn extent_ns(rec: &Recording) -> u64 {
    if let Some(e) = &rec.end {
        return e.duration_ns;
    }
    let ends = [
        rec.duration_ns(),
        rec.samples
            .iter()
            .map(|s| s.t_ns.saturating_add(u64::from(s.weight_ns)))
            .max()
            .unwrap_or(0),
        rec.gil_waits
            .iter()
            .map(|g| g.start_ns.saturating_add(g.dur_ns))
            .max()
            .unwrap_or(0),
        rec.gc_pauses
            .iter()
            .map(|g| g.start_ns.saturating_add(g.dur_ns))
            .max()
            .unwrap_or(0),
        rec.calls
            .iter()
            .map(|c| c.start_ns.saturating_add(c.dur_ns))
            .max()
            .unwrap_or(0),
        rec.metrics.iter().map(|m| m.t_ns).max().unwrap_or(0),
    ];
    ends.into_iter().max().unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_cover_the_recording() {
        let w = Windows::new(10, 25);
        assert_eq!(w.count, 3);
        assert_eq!(w.bounds(2), (20, 25));
        assert_eq!(w.len_ns(2), 5);
        assert_eq!(w.index(9), Some(0));
        assert_eq!(w.index(25), Some(2));
        assert_eq!(Windows::new(10, 0).index(0), None);
        // Widened to stay within MAX_WINDOWS.
        let w = Windows::new(1, 1_000_000);
        assert_eq!(w.count as u64, MAX_WINDOWS);
        assert_eq!(w.width_ns, 100);
        // An interval split across windows, clipped at the end.
        let w = Windows::new(10, 25);
        let mut acc = vec![0; 3];
        w.spread(5, 30, &mut acc);
        assert_eq!(acc, [5, 10, 5]);
    }
}
