//! One profiled process: its reader, its BPF configuration, its threads, and the cache that
//! turns raw frames (code object address + instruction offset) into names and lines.

use std::collections::HashMap;

use crate::bpf::abi::EsTarget;
use crate::cpython::binary;
use crate::cpython::offsets::{self, FrameKind};
use crate::cpython::symbols::{RawFrame, Symbolizer};
use crate::cpython::threading::ThreadNames;
use crate::cpython::{Frame, PythonProcess};
use crate::procinfo;

pub struct Target {
    pub proc: PythonProcess,
    pub pid: i32,
    pub cmdline: String,
    /// The program image attached to ([`procinfo::image_id`]): another one means the process
    /// exec'd, and what was read of its interpreter no longer holds.
    pub image: Option<Vec<u8>>,
    /// host tid → (PyThreadState address, thread name)
    pub threads: HashMap<i32, (u64, String)>,
    /// Raw frames to names and lines (both sources share this cache per process).
    pub sym: Symbolizer,
    /// Threads with no Python thread state (native: BLAS/OpenMP pools, torch, gRPC…): tid →
    /// name, so their samples carry a name too.
    pub native: HashMap<i32, String>,
    /// Native threads first seen or renamed at the last `refresh_threads` (tid, name).
    pub native_changes: Vec<(i32, String)>,
    /// Reads Python thread names (`threading`), keeping what it found.
    pub names: ThreadNames,
    /// host tid → Python thread name, as last read.
    pub python_names: HashMap<i32, String>,
    /// When the Python names were last read, and for which thread states.
    names_read: Option<(std::time::Instant, Vec<u64>)>,
    /// The Python names last reported in `refresh_threads`' changes.
    written_python_names: HashMap<i32, String>,
    /// Reads of Python names still to do at the next refreshes (a new thread was unnamed).
    unnamed_retries: u32,
    /// Thread refreshes at which the interpreter's thread list could not be read at all.
    pub thread_list_failures: u64,
    /// Thread refreshes whose read of the thread list ended early (a read error, a cycle):
    /// known threads missing from it were kept.
    pub thread_list_partial_reads: u64,
    /// Known Python threads missing from a thread list read to its end while their OS thread
    /// still ran and their thread state still named them, kept for that refresh.
    pub threads_kept_unlisted: u64,
    /// host tid → the Python frames of its last sample or switch-out that carried its own
    /// stack: what a switch-out sent without frames (`SAME_STACK`) stands for.
    pub last_walked: HashMap<i32, std::sync::Arc<[Frame]>>,
    /// Its thread list, each thread's ids and name read once (`procinfo::TaskCache`).
    task_cache: procinfo::TaskCache,
    /// Threads kept so at the last refresh: missing again, they are gone.
    unlisted: std::collections::HashSet<i32>,
}

/// Refreshes at which Python names are read again after a new thread was found unnamed.
const UNNAMED_RETRIES: u32 = 5;

/// Python thread names are read again at least this often (renames), and whenever a thread
/// comes or goes.
pub(crate) const PYTHON_NAMES_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

impl Target {
    pub fn new(proc: PythonProcess) -> Self {
        let pid = proc.pid;
        Target {
            image: procinfo::image_id(pid),
            cmdline: procinfo::cmdline(pid),
            proc,
            pid,
            threads: HashMap::new(),
            sym: Symbolizer::new(),
            native: HashMap::new(),
            native_changes: Vec::new(),
            names: ThreadNames::default(),
            python_names: HashMap::new(),
            names_read: None,
            written_python_names: HashMap::new(),
            unnamed_retries: 0,
            thread_list_failures: 0,
            thread_list_partial_reads: 0,
            threads_kept_unlisted: 0,
            last_walked: HashMap::new(),
            task_cache: procinfo::TaskCache::default(),
            unlisted: Default::default(),
        }
    }

    /// Python names by thread state of these thread states (sorted), read again when the set
    /// changed or [`PYTHON_NAMES_EVERY`] has passed, else as last read.
    pub(crate) fn python_names_by_tstate(
        &mut self,
        tstates: &[u64],
    ) -> Option<HashMap<u64, String>> {
        let fresh = self
            .names_read
            .as_ref()
            .is_some_and(|(at, ts)| ts == tstates && at.elapsed() < PYTHON_NAMES_EVERY);
        if fresh && self.unnamed_retries == 0 {
            return None;
        }
        let new_threads = self
            .names_read
            .as_ref()
            .is_none_or(|(_, ts)| tstates.iter().any(|t| ts.binary_search(t).is_err()));
        self.unnamed_retries = self.unnamed_retries.saturating_sub(1);
        self.names_read = Some((std::time::Instant::now(), tstates.to_vec()));
        let names = self.proc.python_thread_names(&mut self.names);
        // A thread is in `PyThreadState`'s list a moment before `threading` registers it:
        // while one is unnamed after threads came, read again at the next few refreshes.
        if new_threads && tstates.iter().any(|t| !names.contains_key(t)) {
            self.unnamed_retries = UNNAMED_RETRIES;
        }
        Some(names)
    }

    /// The per-process configuration the BPF programs need. `flags` are `abi::TARGET_*`.
    pub(crate) fn bpf_config(&self, flags: u32) -> anyhow::Result<EsTarget> {
        let p = &self.proc;
        let o = &p.offsets;
        let interp = p.main_interpreter()?;
        let gil = p.gil_addr(interp)?;
        let maps = std::fs::read_to_string(format!("/proc/{}/maps", self.pid))?;
        let (text_lo, text_hi) = binary::parse_maps(&maps)
            .iter()
            .filter(|m| m.path == p.binary.path && m.perms.contains('x'))
            .fold((u64::MAX, 0), |(lo, hi), m| {
                (lo.min(m.start), hi.max(m.end))
            });
        Ok(EsTarget {
            gil_locked_addr: if gil != 0 { gil + o.gil_locked } else { 0 },
            gil_holder_addr: if gil != 0 { gil + o.gil_last_holder } else { 0 },
            gc_collecting_addr: p.gc_collecting_addr(interp),
            code_type_addr: p.binary.symbols.get("PyCode_Type").copied().unwrap_or(0),
            code_tag_mask: o.frame_code_tag_mask,
            text_lo: if text_hi == 0 { 0 } else { text_lo },
            text_hi,
            frame_kind: match o.frame_kind {
                FrameKind::FrameObject => 0,
                FrameKind::Interpreter => 1,
            },
            tstate_frame: o.tstate_frame as u32,
            cframe_current_frame: o.cframe_current_frame.map(|x| x as i32).unwrap_or(-1),
            frame_previous: o.frame_previous as u32,
            frame_code: o.frame_code as u32,
            frame_instr: o.frame_instr as u32,
            frame_owner: o.frame_owner.map(|x| x as i32).unwrap_or(-1),
            code_firstlineno: o.code_firstlineno as u32,
            code_adaptive: o.code_code_adaptive.unwrap_or(0) as u32,
            flags,
            code_name: o.code_name as u32,
            // 3.11 marks frames entered from C with `is_entry` (pycore_frame.h, offset 68);
            // 3.12+ pushes a shim frame instead (frame_owner).
            frame_is_entry: if p.version.minor_tuple() == (3, 11) {
                68
            } else {
                -1
            },
            // struct _gil_runtime_state (pycore_gil.h, unchanged 3.10–3.15 in GIL builds):
            // interval, last_holder, locked, switch_number, then cond (48 bytes, glibc),
            // mutex (40), switch_cond (48), switch_mutex (40): 208 bytes. Used only when the
            // offsets we know agree with that layout.
            gil_addr: if gil != 0 && o.gil_last_holder == 8 && o.gil_locked == 16 {
                gil
            } else {
                0
            },
            gil_cond_off: 32,
            gil_switch_off: 120,
            gil_size: 208,
            gil_mutex_off: 80,
            gil_switch_mutex_off: 168,
            gc_stats_stride: if o.gc_stats_ring {
                offsets::GC_RING_RECORD
            } else {
                24
            },
            gc_stats_addr: o
                .gc_generation_stats
                .map(|g| interp + o.interp_gc + g)
                .unwrap_or(0),
            gc_stats_ring: u32::from(o.gc_stats_ring),
            gc_ring_counts_off: offsets::GC_RING_COUNTS,
            gc_ring_off: offsets::GC_RINGS_315.map(|(off, _)| off),
            gc_ring_slots: offsets::GC_RINGS_315.map(|(_, n)| n),
        })
    }

    /// Re-read the thread list. Returns (new or renamed threads, threads gone).
    pub(crate) fn refresh_threads(&mut self) -> (Vec<(i32, u64, String)>, Vec<i32>) {
        let Ok(tasks) = self.task_cache.tasks(self.pid) else {
            let gone: Vec<i32> = self.threads.keys().copied().collect();
            self.threads.clear();
            return (vec![], gone);
        };
        // The same OS threads as at the last read of the interpreter's list, read under a
        // second ago: nothing to read.
        if !self.task_cache.list_due(&tasks) {
            return (vec![], vec![]);
        }
        let comm: HashMap<i32, &str> = tasks
            .iter()
            .map(|t| (t.host_tid, t.comm.as_str()))
            .collect();
        let mut seen = HashMap::new();
        match self.proc.threads_with_tids(&tasks) {
            Ok((list, complete)) => {
                self.task_cache.list_read(&tasks);
                for (tstate, host) in list {
                    if let Some(h) = host {
                        seen.insert(h, tstate);
                    }
                }
                self.keep_unlisted(&tasks, &mut seen, complete);
            }
            Err(_) => {
                // The interpreter's thread list could not be read this time: that says
                // nothing of its threads. Only those whose OS thread ended are gone (dropping
                // the rest would stop sampling them until the next read succeeds).
                self.thread_list_failures += 1;
                let alive: std::collections::HashSet<i32> =
                    tasks.iter().map(|t| t.host_tid).collect();
                let gone: Vec<i32> = self
                    .threads
                    .keys()
                    .filter(|t| !alive.contains(t))
                    .copied()
                    .collect();
                for t in &gone {
                    self.threads.remove(t);
                    self.last_walked.remove(t);
                }
                return (vec![], gone);
            }
        }
        let mut tstates: Vec<u64> = seen.values().copied().collect();
        tstates.sort_unstable();
        if let Some(by_tstate) = self.python_names_by_tstate(&tstates) {
            let mut py = HashMap::new();
            for (&tid, tstate) in &seen {
                if let Some(n) = by_tstate.get(tstate) {
                    py.insert(tid, n.clone());
                }
            }
            // A thread keeps its last Python name when it leaves `threading`'s registry
            // while it still runs (`_active` is emptied at interpreter shutdown, and a thread
            // leaves it just before it ends) or a read fails.
            for (tid, n) in std::mem::take(&mut self.python_names) {
                if seen.contains_key(&tid) && !py.contains_key(&tid) {
                    py.insert(tid, n);
                }
            }
            self.python_names = py;
        }
        let mut changed = Vec::new();
        for (&tid, &tstate) in &seen {
            let entry = self.threads.get(&tid);
            // An ending thread's `comm` may read empty: it keeps its name.
            let name = match (comm.get(&tid).copied().unwrap_or(""), entry) {
                ("", Some((_, n))) => n.clone(),
                (c, _) => c.to_string(),
            };
            let py = self.python_names.get(&tid);
            if entry.is_none_or(|(ts, n)| *ts != tstate || *n != name)
                || self.written_python_names.get(&tid) != py
            {
                changed.push((tid, tstate, name.clone()));
                self.threads.insert(tid, (tstate, name));
                match py {
                    Some(n) => self.written_python_names.insert(tid, n.clone()),
                    None => self.written_python_names.remove(&tid),
                };
            }
        }
        self.written_python_names
            .retain(|tid, _| seen.contains_key(tid));
        self.native_changes.clear();
        for t in &tasks {
            if seen.contains_key(&t.host_tid) {
                continue;
            }
            // A Python thread whose thread state is gone (interpreter shutdown, a thread
            // ending) is the same thread: no new record unless its OS name changed (an ending
            // thread's `comm` may read empty), so its Python name stays the last one written.
            if self
                .threads
                .get(&t.host_tid)
                .is_some_and(|(_, n)| *n == t.comm || t.comm.is_empty())
            {
                self.native.insert(t.host_tid, t.comm.clone());
                continue;
            }
            if self.native.get(&t.host_tid) != Some(&t.comm) && self.native.len() < 65_536 {
                self.native.insert(t.host_tid, t.comm.clone());
                self.native_changes.push((t.host_tid, t.comm.clone()));
            }
        }
        let alive: std::collections::HashSet<i32> = tasks.iter().map(|t| t.host_tid).collect();
        self.native.retain(|tid, _| alive.contains(tid));
        let gone: Vec<i32> = self
            .threads
            .keys()
            .filter(|t| !seen.contains_key(t))
            .copied()
            .collect();
        for t in &gone {
            self.threads.remove(t);
            self.last_walked.remove(t);
        }
        (changed, gone)
    }

    /// Add to `seen` the known Python threads missing from this read of the thread list that
    /// may still be there: dropping one stops its off-CPU tracing and sampling until the next
    /// refresh, losing its intervals (a loop thread's idle wait, merging two stalls). Kept are
    /// those whose OS thread still runs, when the read ended early (`!complete`); after a read
    /// to the list's end, for one refresh, those whose thread state still names them (a walk
    /// racing the removal of another thread state can follow a stale pointer that reads as
    /// the list's end, and the main thread, the list's tail, is then missing).
    fn keep_unlisted(
        &mut self,
        tasks: &[procinfo::TaskInfo],
        seen: &mut HashMap<i32, u64>,
        complete: bool,
    ) {
        if !complete {
            self.thread_list_partial_reads += 1;
        }
        let by_host: HashMap<i32, i32> = tasks.iter().map(|t| (t.host_tid, t.ns_tid)).collect();
        let mut unlisted = std::collections::HashSet::new();
        for (&tid, &(tstate, _)) in &self.threads {
            if seen.contains_key(&tid) {
                continue;
            }
            let Some(&ns) = by_host.get(&tid) else {
                continue; // its OS thread ended
            };
            let keep = if complete {
                !self.unlisted.contains(&tid) && self.proc.ns_tid(tstate, tasks) == Some(ns)
            } else {
                true
            };
            if keep {
                seen.insert(tid, tstate);
                if complete {
                    self.threads_kept_unlisted += 1;
                    unlisted.insert(tid);
                } else if self.unlisted.contains(&tid) {
                    unlisted.insert(tid);
                }
            }
        }
        self.unlisted = unlisted;
    }

    /// The thread whose `PyThreadState` is at `tstate`.
    pub(crate) fn tid_of_tstate(&self, tstate: u64) -> Option<i32> {
        if tstate == 0 {
            return None;
        }
        self.threads
            .iter()
            .find(|(_, (ts, _))| *ts == tstate)
            .map(|(tid, _)| *tid)
    }

    /// Resolve raw frames (innermost first) to names and lines, attributing code objects met
    /// for the first time to thread `tid` (0: unknown).
    pub fn resolve<F: Copy + Into<RawFrame>>(&mut self, tid: i32, frames: &[F]) -> Vec<Frame> {
        self.sym.resolving_tid = tid;
        self.sym
            .resolve(self.proc.mem.as_ref(), &self.proc.offsets, frames)
    }
}

/// One thread's Python stack at one tick (the memory source).
pub struct ThreadStack {
    pub tid: i32,
    pub frames: Vec<Frame>,
    pub holds_gil: bool,
    pub gc_collecting: bool,
    /// The walk stopped early (the frames read are still right).
    pub partial: bool,
}

impl Target {
    /// Every thread's Python stack now (threads not matched to a host tid are left out).
    pub fn stacks(&mut self) -> Result<Vec<ThreadStack>, crate::cpython::AttachError> {
        let snap = self.proc.snapshot_with(&mut self.sym)?;
        Ok(snap
            .threads
            .into_iter()
            .filter_map(|th| {
                Some(ThreadStack {
                    tid: th.tid?,
                    partial: th.error.is_some(),
                    frames: th.frames,
                    holds_gil: th.holds_gil,
                    gc_collecting: th.gc_collecting,
                })
            })
            .collect())
    }
}

/// The targets being recorded, by pid.
#[derive(Default)]
pub struct Targets {
    list: Vec<Target>,
    index: HashMap<i32, usize>,
}

impl Targets {
    pub fn push(&mut self, t: Target) -> &mut Target {
        self.index.insert(t.pid, self.list.len());
        self.list.push(t);
        let last = self.list.len() - 1;
        &mut self.list[last]
    }

    pub(crate) fn get_mut(&mut self, pid: i32) -> Option<&mut Target> {
        let &i = self.index.get(&pid)?;
        self.list.get_mut(i)
    }

    pub fn contains(&self, pid: i32) -> bool {
        self.index.contains_key(&pid)
    }

    pub fn iter(&self) -> impl Iterator<Item = &Target> {
        self.list.iter()
    }

    pub fn iter_mut(&mut self) -> impl Iterator<Item = &mut Target> {
        self.list.iter_mut()
    }

    pub fn len(&self) -> usize {
        self.list.len()
    }

    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// Remove these processes; returns them.
    pub fn remove(&mut self, pids: &[i32]) -> Vec<Target> {
        let (gone, kept): (Vec<Target>, Vec<Target>) = std::mem::take(&mut self.list)
            .into_iter()
            .partition(|t| pids.contains(&t.pid));
        self.list = kept;
        self.index = self
            .list
            .iter()
            .enumerate()
            .map(|(i, t)| (t.pid, i))
            .collect();
        gone
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bpf::abi::{self, EsFrame};
    use crate::cpython::offsets::PY312;
    use crate::cpython::testutil::Fake;

    fn raw(p: &PythonProcess, code: u64) -> EsFrame {
        let o = &p.offsets;
        let first = p.mem.read_i32(code + o.code_firstlineno).unwrap();
        let name = p.mem.read_u64(code + o.code_name).unwrap();
        EsFrame {
            code,
            instr_offset: 4,
            code_id: abi::code_id(first, name),
        }
    }

    /// A Python thread missing from a read of the thread list while its OS thread runs is
    /// kept: always when the read ended early, for one refresh when the read reached the end
    /// and its thread state still names it; never once its OS thread ended.
    #[test]
    fn unlisted_threads_are_kept_while_they_may_still_be_there() {
        let o = &PY312;
        let mut f = Fake::new();
        let main_ts = f.thread(0, 0);
        let other_ts = f.thread(0, main_ts);
        let freed_ts = f.thread(0, 0);
        let nt = o.tstate_native_thread_id.unwrap();
        f.mem.put_u64(main_ts + nt, 100);
        f.mem.put_u64(other_ts + nt, 101);
        f.mem.put_u64(freed_ts + nt, 7); // reused: names another thread now
        let mut t = Target::new(f.process(other_ts));
        for (tid, ts) in [
            (100, main_ts),
            (101, other_ts),
            (102, freed_ts),
            (103, main_ts),
        ] {
            t.threads.insert(tid, (ts, "python3".into()));
        }
        let task = |tid: i32| procinfo::TaskInfo {
            host_tid: tid,
            ns_tid: tid,
            comm: "python3".into(),
        };
        // Thread 103's OS thread ended.
        let tasks = [task(100), task(101), task(102)];
        let read = |t: &mut Target, complete: bool| {
            let mut seen = HashMap::from([(101, other_ts)]);
            t.keep_unlisted(&tasks, &mut seen, complete);
            let mut tids: Vec<i32> = seen.into_keys().collect();
            tids.sort_unstable();
            tids
        };
        assert_eq!(
            read(&mut t, true),
            [100, 101],
            "kept once: it still names itself"
        );
        assert_eq!(read(&mut t, true), [101], "missing again: gone");
        assert_eq!(
            read(&mut t, false),
            [100, 101, 102],
            "a partial read says nothing"
        );
        assert_eq!(read(&mut t, true), [100, 101]);
        assert_eq!(
            (t.threads_kept_unlisted, t.thread_list_partial_reads),
            (2, 1)
        );
    }

    #[test]
    fn cache_notices_a_reused_code_address() {
        let mut f = Fake::new();
        let a = f.code("first", 10);
        let b = f.code("second", 10); // same co_firstlineno, other name
        let mut t = Target::new(f.process(0));
        let fa = raw(&t.proc, a);
        assert_eq!(t.resolve(0, &[fa])[0].function, "first");
        assert_eq!(t.resolve(0, &[fa])[0].function, "first");
        assert_eq!(t.sym.code_rereads, 0);
        // The code object at `a` is freed and another one is built at the same address.
        let fb = raw(&t.proc, b);
        let o = &PY312;
        let b_name = t.proc.mem.read_u64(b + o.code_name).unwrap();
        let mut bytes = vec![0u8; 512];
        t.proc.mem.read(b, &mut bytes).unwrap();
        // Rebuild the process view over memory where `a` now holds `b`'s bytes.
        let mut f2 = Fake::new();
        let a2 = f2.code("first", 10);
        let b2 = f2.code("second", 10);
        assert_eq!((a2, b2), (a, b));
        f2.mem.put(a, &bytes);
        t.proc = f2.process(0);
        let reused = EsFrame {
            code: a,
            instr_offset: 4,
            code_id: fb.code_id,
        };
        assert_eq!(abi::code_id(10, b_name), fb.code_id);
        assert_eq!(t.resolve(0, &[reused])[0].function, "second");
        assert_eq!(t.sym.code_rereads, 1);
        // A frame whose code object cannot be read is reported, not guessed.
        let gone = EsFrame {
            code: 0xdead_0000,
            instr_offset: 0,
            code_id: 1,
        };
        assert_eq!(t.resolve(0, &[gone])[0].function, "<unknown>");
        assert_eq!(t.sym.unresolved_frames, 1);
    }
}
