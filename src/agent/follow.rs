//! Following the rotating recording while the recorder writes it: each poll reads what was
//! appended to the current segment (through the same incremental reader `top` uses), hands the
//! new events to the [`Aggregator`] and drops them, and moves to the next segment once the
//! recorder has started it. Cost: the recorder's bytes are read back once from the page cache
//! (≈15 bytes per sample) and parsed; memory is one segment's frame, stack and thread tables.

use std::collections::HashSet;
use std::io::Read;
use std::path::{Path, PathBuf};

use anyhow::Context;

use super::metrics::Aggregator;
use crate::record::format::RecordingReader;
use crate::record::rotate::list_segments;

/// Most bytes read per poll (the rest comes at the next poll): a bound on one poll's work
/// when the agent falls behind.
const MAX_READ_PER_POLL: usize = 8 << 20;

struct Open {
    path: PathBuf,
    file: std::fs::File,
    reader: RecordingReader,
}

/// See the module documentation.
pub(crate) struct Follower {
    dir: PathBuf,
    /// Segments that were there before the agent started (another run's): not followed.
    old: HashSet<PathBuf>,
    current: Option<Open>,
    /// Name of the last segment finished: later ones come next.
    done: Option<PathBuf>,
    /// How the last finished segment ended: "rotated" means the next one continues its run.
    last_end_reason: Option<String>,
    buf: Vec<u8>,
    pub segments_followed: u64,
}

impl Follower {
    /// Follow segments that appear in `dir` from now on.
    pub fn new(dir: &Path) -> anyhow::Result<Self> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let old = list_segments(dir)
            .with_context(|| format!("listing {}", dir.display()))?
            .into_iter()
            .map(|s| s.path)
            .collect();
        Ok(Follower {
            dir: dir.to_path_buf(),
            old,
            current: None,
            done: None,
            last_end_reason: None,
            buf: vec![0; 1 << 16],
            segments_followed: 0,
        })
    }

    /// The segment being followed.
    #[cfg(test)]
    pub(crate) fn current(&self) -> Option<&Path> {
        self.current.as_ref().map(|o| o.path.as_path())
    }

    /// Read what is new, apply it to `agg`. Returns the bytes read.
    pub fn poll(&mut self, agg: &mut Aggregator) -> anyhow::Result<usize> {
        let mut total = 0;
        // A few segments per poll at most (many only after a long stall).
        for _ in 0..16 {
            if self.current.is_none() && !self.open_next(agg)? {
                break;
            }
            let n = self.read_some(agg, MAX_READ_PER_POLL.saturating_sub(total))?;
            total += n;
            if total >= MAX_READ_PER_POLL {
                break;
            }
            if n > 0 {
                continue;
            }
            // At the end of the current segment: finished when a newer one exists (the
            // recorder ends a segment, then creates the next).
            if !self.newer_exists()? {
                break;
            }
            // Whatever was appended between our last read and the check.
            total += self.read_some(agg, usize::MAX)?;
            if let Some(o) = self.current.take() {
                self.last_end_reason = o.reader.recording.end.as_ref().map(|e| e.reason.clone());
                self.done = Some(o.path);
            }
        }
        Ok(total)
    }

    fn read_some(&mut self, agg: &mut Aggregator, limit: usize) -> anyhow::Result<usize> {
        let Some(o) = self.current.as_mut() else {
            return Ok(0);
        };
        let mut total = 0;
        while total < limit {
            let n = o
                .file
                .read(&mut self.buf)
                .with_context(|| format!("reading {}", o.path.display()))?;
            if n == 0 {
                break;
            }
            o.reader
                .feed(&self.buf[..n])
                .with_context(|| format!("reading {}", o.path.display()))?;
            total += n;
            agg.apply(&mut o.reader.recording);
        }
        Ok(total)
    }

    fn candidates(&self) -> anyhow::Result<Vec<PathBuf>> {
        Ok(list_segments(&self.dir)
            .with_context(|| format!("listing {}", self.dir.display()))?
            .into_iter()
            .map(|s| s.path)
            .filter(|p| !self.old.contains(p))
            .filter(|p| {
                self.done
                    .as_ref()
                    .is_none_or(|d| p.file_name() > d.file_name())
            })
            .collect())
    }

    fn newer_exists(&self) -> anyhow::Result<bool> {
        let Some(cur) = &self.current else {
            return Ok(false);
        };
        Ok(self
            .candidates()?
            .iter()
            .any(|p| p.file_name() > cur.path.file_name()))
    }

    /// Open the oldest segment not yet followed. False when there is none yet.
    fn open_next(&mut self, agg: &mut Aggregator) -> anyhow::Result<bool> {
        for p in self.candidates()? {
            match std::fs::File::open(&p) {
                Ok(file) => {
                    // A rotation continues the run; anything else (first segment, a recorder
                    // that stopped and started again, a segment pruned before we read it)
                    // starts counting the recorder's counters afresh.
                    let same_run = self.last_end_reason.as_deref() == Some("rotated");
                    agg.begin_segment(same_run);
                    self.current = Some(Open {
                        path: p,
                        file,
                        reader: RecordingReader::default(),
                    });
                    self.segments_followed += 1;
                    return Ok(true);
                }
                // Pruned between listing and opening: the next one.
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    self.last_end_reason = None;
                    continue;
                }
                Err(e) => return Err(e).with_context(|| format!("opening {}", p.display())),
            }
        }
        Ok(false)
    }
}

#[cfg(test)]
mod tests {
    use super::super::metrics::{Limits, Metrics};
    use super::*;
    use crate::record::*;

    #[test]
    fn follows_segments_in_order_across_rotations() {
        let dir = tempfile::tempdir().unwrap();
        // A segment from an earlier run: ignored.
        let mut seq = 0;
        let stale = crate::record::rotate::next_segment_path(dir.path(), 1.0, &mut seq).unwrap();
        let mut w = RecordingWriter::create(&stale, &Meta::default()).unwrap();
        w.sample(&Sample {
            t_ns: 0,
            pid: 1,
            tid: 1,
            stack: 0,
            flags: 0,
            weight_ns: 1_000_000_000,
        })
        .unwrap();
        w.finish(&EndInfo::default()).unwrap();

        let (m, _reg) = Metrics::new();
        let mut agg = Aggregator::new(m.clone(), Limits::default());
        let mut f = Follower::new(dir.path()).unwrap();
        assert_eq!(f.poll(&mut agg).unwrap(), 0);

        let p1 = crate::record::rotate::next_segment_path(dir.path(), 2.0, &mut seq).unwrap();
        let mut w = RecordingWriter::create_rotating(&p1, &Meta::default()).unwrap();
        w.process(&ProcessInfo {
            pid: 1,
            ..Default::default()
        })
        .unwrap();
        w.thread(&ThreadInfo {
            pid: 1,
            tid: 1,
            name: "t".into(),
            t_ns: 0,
            python_name: None,
        })
        .unwrap();
        let sample = |w: &mut RecordingWriter| {
            w.sample(&Sample {
                t_ns: 0,
                pid: 1,
                tid: 1,
                stack: 0,
                flags: 0,
                weight_ns: 250_000_000,
            })
            .unwrap()
        };
        sample(&mut w);
        w.counters(&[("bpf_ringbuf_full_lost".to_string(), 5)].into())
            .unwrap();
        w.flush().unwrap();
        f.poll(&mut agg).unwrap();
        let cpu = |m: &Metrics| {
            m.thread_cpu
                .get_or_create(&super::super::metrics::ThreadLabels {
                    engine: String::new(),
                    role: "pid1".into(),
                    thread: "t".into(),
                })
                .get()
        };
        assert_eq!(cpu(&m), 0.25);
        // Rotation: the rest of the first segment and the second are both read, once.
        sample(&mut w);
        let p2 = crate::record::rotate::next_segment_path(dir.path(), 3.0, &mut seq).unwrap();
        let alive = |_: i32, _: Option<i32>| true;
        w.rotate(
            &p2,
            &Meta::default(),
            &EndInfo {
                duration_ns: 1,
                reason: "rotated".into(),
            },
            &alive,
        )
        .unwrap();
        sample(&mut w);
        w.counters(&[("bpf_ringbuf_full_lost".to_string(), 8)].into())
            .unwrap();
        w.flush().unwrap();
        f.poll(&mut agg).unwrap();
        assert_eq!(cpu(&m), 0.75);
        assert_eq!(f.current(), Some(p2.as_path()));
        assert_eq!(
            m.samples_lost.get(),
            8,
            "counters continue across a rotation"
        );
        f.poll(&mut agg).unwrap();
        assert_eq!(cpu(&m), 0.75, "nothing read twice");
        assert_eq!(f.segments_followed, 2);
    }
}
