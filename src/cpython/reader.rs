//! Attaching to a CPython process and reading consistent-enough snapshots of its threads, all
//! from outside: no ptrace stop, no signal, nothing written.

use std::collections::{HashMap, HashSet};

use super::binary::{self, InterpreterBinary};
use super::memory::{MemorySource, ProcessMemory, ReadError};
use super::offsets::{self, FrameKind, Offsets};
use super::symbols::{code_id, RawFrame, Symbolizer};
use super::version::{scan_for_version, PyVersion};
use crate::procinfo::{self, TaskInfo};

/// Deepest Python stack we walk; deeper means garbage or a cycle we failed to see.
pub const MAX_FRAMES: usize = 4096;

/// Bytes read at once from the head of a frame: every field the walk reads lies in the first
/// 128 on every version (3.10's `PyFrameObject.f_lasti` at 104 is the furthest).
const FRAME_HEAD: usize = 128;
/// Code objects remembered per snapshot at most (type, first line, name).
const CODE_CACHE_MAX: usize = 65_536;
/// A snapshot's code objects by address: `Some((first line, name))`, or None where the
/// executable is not a code object.
type CodeCache = HashMap<u64, Option<(i32, u64)>>;
/// Most threads (and interpreters × threads) we walk.
pub const MAX_THREADS: usize = 4096;
const MAX_INTERPRETERS: usize = 64;

/// Oldest and newest minor versions we read.
pub(crate) const SUPPORTED: (u8, u8) = (10, 15);

#[derive(Debug, thiserror::Error)]
pub enum AttachError {
    #[error("process {0} does not exist (or has exited)")]
    Gone(i32),
    #[error("permission denied reading process {0}: run enginescope as root (sudo), or grant it CAP_SYS_PTRACE (setcap cap_sys_ptrace+ep); in a container add --cap-add SYS_PTRACE and share the PID namespace (--pid=host)")]
    Permission(i32),
    #[error(
        "process {pid} ({cmd}) is not a CPython process: no mapped ELF file defines _PyRuntime"
    )]
    NotPython { pid: i32, cmd: String },
    #[error("process {pid} runs Python {version}; enginescope reads CPython 3.{}–3.{}", SUPPORTED.0, SUPPORTED.1)]
    Unsupported { pid: i32, version: String },
    #[error("cannot tell which Python version process {0} runs (no Py_Version symbol, no _Py_DebugOffsets, no version string in .bss)")]
    UnknownVersion(i32),
    #[error("process {pid}: invalid _Py_DebugOffsets: {err}")]
    DebugOffsets {
        pid: i32,
        err: offsets::DebugOffsetsError,
    },
    #[error("process {pid}: {what}: {err}")]
    Read {
        pid: i32,
        what: &'static str,
        err: ReadError,
    },
    #[error("reading /proc/{pid}: {err}")]
    Proc { pid: i32, err: std::io::Error },
}

fn map_read(pid: i32, what: &'static str, err: ReadError) -> AttachError {
    match err {
        ReadError::Gone(p) => AttachError::Gone(p),
        ReadError::Permission { pid } => AttachError::Permission(pid),
        err => AttachError::Read { pid, what, err },
    }
}

/// One frame of a Python stack: the recording's frame (`record::Frame`), which the reader
/// produces; the file format does not depend on the reader.
pub use crate::record::Frame;

/// Thread states, each with its host thread id when it was matched to a task.
pub(crate) type ThreadTids = Vec<(u64, Option<i32>)>;

/// One thread as read at one moment.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct ThreadSnapshot {
    /// Host thread id (`None` only if the thread could not be matched to a task, e.g. it was
    /// exiting while we read).
    pub tid: Option<i32>,
    /// The thread id inside the target's PID namespace (differs from `tid` in containers).
    pub ns_tid: Option<i32>,
    /// The thread's name: its Python name (`threading.Thread.name`) where it has one, else
    /// the OS name.
    pub name: String,
    /// OS thread name (`/proc/PID/task/TID/comm`).
    pub os_name: String,
    /// Python thread name (`threading.Thread.name`), where `threading` knows the thread.
    pub python_name: Option<String>,
    pub holds_gil: bool,
    /// Whether a garbage collection is running in this thread's interpreter.
    pub gc_collecting: bool,
    /// Innermost first.
    pub frames: Vec<Frame>,
    /// Set when the walk stopped early; the frames before it are still right.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub error: Option<String>,
    /// The asyncio task this thread was running (a thread running an event loop, inside one
    /// of its tasks' steps); absent when none or not readable (src/cpython/asyncio.rs).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub asyncio_task: Option<super::asyncio::RunningTask>,
    /// Address of the `PyThreadState`.
    #[serde(skip)]
    pub tstate: u64,
}

/// All threads of a process at one moment.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Snapshot {
    pub threads: Vec<ThreadSnapshot>,
    /// Bad reads that were skipped (counted, never fatal).
    pub read_errors: u64,
}

/// An attached CPython process.
pub struct PythonProcess {
    pub pid: i32,
    pub mem: Box<dyn MemorySource>,
    pub binary: InterpreterBinary,
    pub version: PyVersion,
    /// How the version was found.
    pub version_source: &'static str,
    pub offsets: Offsets,
    /// For 3.10: offset of `tid` inside glibc's `struct pthread`, found and validated at attach.
    pthread_tid_offset: std::cell::Cell<Option<u64>>,
}

impl PythonProcess {
    pub fn attach(pid: i32) -> Result<Self, AttachError> {
        let proc_dir = format!("/proc/{pid}");
        if !std::path::Path::new(&proc_dir).exists() {
            return Err(AttachError::Gone(pid));
        }
        let maps_text =
            std::fs::read_to_string(format!("{proc_dir}/maps")).map_err(|e| match e.kind() {
                std::io::ErrorKind::PermissionDenied => AttachError::Permission(pid),
                std::io::ErrorKind::NotFound => AttachError::Gone(pid),
                _ => AttachError::Proc { pid, err: e },
            })?;
        let maps = binary::parse_maps(&maps_text);
        let mem = ProcessMemory::open(pid).map_err(|e| map_read(pid, "opening memory", e))?;
        let binary = binary::find_interpreter(pid, &maps).ok_or_else(|| {
            if !std::path::Path::new(&proc_dir).exists() {
                AttachError::Gone(pid)
            } else {
                AttachError::NotPython {
                    pid,
                    cmd: procinfo::describe(pid),
                }
            }
        })?;
        // Probe readability once, so permission problems surface with advice.
        mem.read_u64(binary.runtime_addr)
            .map_err(|e| map_read(pid, "reading _PyRuntime", e))?;

        let (version, version_source) =
            detect_version(&mem, &binary).ok_or(AttachError::UnknownVersion(pid))?;
        if version.major != 3 || version.minor < SUPPORTED.0 || version.minor > SUPPORTED.1 {
            return Err(AttachError::Unsupported {
                pid,
                version: version.to_string(),
            });
        }
        let offsets = if version.minor >= 13 {
            offsets::read_debug_offsets(&mem, binary.runtime_addr, Some(version))
                .map_err(|err| AttachError::DebugOffsets { pid, err })?
                .2
        } else {
            Offsets::static_table(version).ok_or(AttachError::Unsupported {
                pid,
                version: version.to_string(),
            })?
        };
        Ok(PythonProcess {
            pid,
            mem: Box::new(mem),
            binary,
            version,
            version_source,
            offsets,
            pthread_tid_offset: std::cell::Cell::new(None),
        })
    }

    /// Assemble a process view from parts (tests use fake memory and hand-made binaries).
    pub fn from_parts(
        pid: i32,
        mem: Box<dyn MemorySource>,
        binary: InterpreterBinary,
        version: PyVersion,
        offsets: Offsets,
    ) -> Self {
        PythonProcess {
            pid,
            mem,
            binary,
            version,
            version_source: "given",
            offsets,
            pthread_tid_offset: std::cell::Cell::new(None),
        }
    }

    fn read(&self, addr: u64) -> Result<u64, ReadError> {
        self.mem.read_u64(addr)
    }

    /// Addresses of all interpreters (the main one first in practice), bounded.
    pub fn interpreters(&self) -> Result<Vec<u64>, ReadError> {
        let o = &self.offsets;
        let mut out = Vec::new();
        let mut seen = HashSet::new();
        let mut interp = self.read(
            self.binary
                .runtime_addr
                .wrapping_add(o.runtime_interpreters_head),
        )?;
        while interp != 0 && out.len() < MAX_INTERPRETERS && seen.insert(interp) {
            out.push(interp);
            interp = self.read(interp.wrapping_add(o.interp_next))?;
        }
        Ok(out)
    }

    /// `PyThreadState` addresses of one interpreter, bounded, cycle-safe. A `next` pointer that
    /// cannot be read (a thread state freed under us) ends the list there: the threads before
    /// it are returned; [`Self::thread_list`] also says what failed.
    pub fn thread_states(&self, interp: u64) -> Result<Vec<u64>, ReadError> {
        match self.thread_list(interp) {
            (list, Some(e), _) if list.is_empty() => Err(e),
            (list, _, _) => Ok(list),
        }
    }

    /// The thread states readable from the list head, the read error that ended the walk
    /// early, if one did, and whether the walk reached the list's end (no read error, no
    /// cycle, not cut at [`MAX_THREADS`]).
    pub(crate) fn thread_list(&self, interp: u64) -> (Vec<u64>, Option<ReadError>, bool) {
        let o = &self.offsets;
        let mut out = Vec::new();
        let mut seen = HashSet::new();
        let mut t = match self.read(interp.wrapping_add(o.interp_threads_head)) {
            Ok(t) => t,
            Err(e) => return (out, Some(e), false),
        };
        while t != 0 && out.len() < MAX_THREADS && seen.insert(t) {
            out.push(t);
            t = match self.read(t.wrapping_add(o.tstate_next)) {
                Ok(n) => n,
                Err(e) => return (out, Some(e), false),
            };
        }
        (out, None, t == 0)
    }

    /// Address of the `_gil_runtime_state` an interpreter uses (0 if none).
    pub fn gil_addr(&self, interp: u64) -> Result<u64, ReadError> {
        let o = &self.offsets;
        match (o.runtime_gil, o.interp_ceval_gil_ptr) {
            (Some(off), _) => Ok(self.binary.runtime_addr.wrapping_add(off)),
            (None, Some(ptr)) => self.read(interp.wrapping_add(ptr)),
            (None, None) => Ok(0),
        }
    }

    /// The GIL holder's `PyThreadState` (0 if the GIL is free) of one interpreter.
    pub fn gil_holder(&self, interp: u64) -> Result<u64, ReadError> {
        let o = &self.offsets;
        let gil = self.gil_addr(interp)?;
        if gil == 0 {
            return Ok(0);
        }
        let locked = self.mem.read_i32(gil.wrapping_add(o.gil_locked))?;
        if locked == 0 {
            return Ok(0);
        }
        self.read(gil.wrapping_add(o.gil_last_holder))
    }

    /// Address of the main interpreter's `gcstate->collecting`.
    pub fn gc_collecting_addr(&self, interp: u64) -> u64 {
        interp
            .wrapping_add(self.offsets.interp_gc)
            .wrapping_add(self.offsets.gc_collecting)
    }

    /// Whether the interpreter has come far enough in its start-up to be recorded: a main
    /// interpreter, its GIL where the interpreter points to one (3.12 on: created just after
    /// the interpreter) and a thread state. A process that has just exec'd a Python is not
    /// there for its first milliseconds, longer on a loaded machine.
    pub fn initialized(&self) -> Result<(), ReadError> {
        let interp = self.main_interpreter()?;
        let not_yet = |what: &str| ReadError::Unreadable {
            addr: interp,
            len: 8,
            reason: format!("the interpreter has no {what} yet (starting up?)"),
        };
        if self.offsets.interp_ceval_gil_ptr.is_some() && self.gil_addr(interp)? == 0 {
            return Err(not_yet("GIL"));
        }
        if self.thread_states(interp)?.is_empty() {
            return Err(not_yet("thread state"));
        }
        Ok(())
    }

    /// The main interpreter: the oldest one (new interpreters are pushed at the list head).
    pub fn main_interpreter(&self) -> Result<u64, ReadError> {
        self.interpreters()?
            .last()
            .copied()
            .ok_or(ReadError::Unreadable {
                addr: self.binary.runtime_addr,
                len: 8,
                reason: "no interpreter (finalizing?)".into(),
            })
    }

    /// Every interpreter's thread states, each with its host thread id when it is one of
    /// `tasks`, and whether every list was read to its end (when not, a thread missing from
    /// the result may still be there).
    pub fn threads_with_tids(&self, tasks: &[TaskInfo]) -> Result<(ThreadTids, bool), ReadError> {
        let by_ns = procinfo::by_ns_tid(tasks);
        let mut out = Vec::new();
        let mut complete = true;
        for interp in self.interpreters()? {
            let (list, err, whole) = self.thread_list(interp);
            match err {
                Some(e) if list.is_empty() => return Err(e),
                _ => complete &= whole,
            }
            for t in list {
                let host = self
                    .ns_tid(t, tasks)
                    .and_then(|n| by_ns.get(&n).map(|t| t.host_tid));
                out.push((t, host));
            }
        }
        Ok((out, complete))
    }

    pub fn gc_collecting(&self, interp: u64) -> Result<bool, ReadError> {
        Ok(self.mem.read_i32(self.gc_collecting_addr(interp))? != 0)
    }

    /// The thread's id inside its PID namespace.
    pub fn ns_tid(&self, tstate: u64, tasks: &[TaskInfo]) -> Option<i32> {
        let o = &self.offsets;
        if let Some(off) = o.tstate_native_thread_id {
            let v = self.read(tstate.wrapping_add(off)).ok()?;
            return i32::try_from(v).ok().filter(|&t| t > 0);
        }
        // 3.10 keeps only the pthread_t, which on glibc/x86-64 is the address of the thread's
        // `struct pthread`; its `tid` field sits at a libc-specific offset, found once and
        // validated against the process's real thread ids.
        let pthread = self.read(tstate.wrapping_add(o.tstate_thread_id)).ok()?;
        let off = match self.pthread_tid_offset.get() {
            Some(off) => off,
            None => {
                let off = self.find_pthread_tid_offset(tasks)?;
                self.pthread_tid_offset.set(Some(off));
                off
            }
        };
        let tid = self.mem.read_i32(pthread.wrapping_add(off)).ok()?;
        tasks.iter().any(|t| t.ns_tid == tid).then_some(tid)
    }

    fn find_pthread_tid_offset(&self, tasks: &[TaskInfo]) -> Option<u64> {
        let o = &self.offsets;
        let ns: HashSet<i32> = tasks.iter().map(|t| t.ns_tid).collect();
        let mut pthreads = Vec::new();
        for interp in self.interpreters().ok()? {
            for t in self.thread_states(interp).ok()? {
                if let Ok(p) = self.read(t.wrapping_add(o.tstate_thread_id)) {
                    pthreads.push(p);
                }
            }
        }
        if pthreads.is_empty() {
            return None;
        }
        // glibc's offset on x86-64 first (0x2d0), then every other 4-byte slot in the first 4 KiB.
        let candidates = std::iter::once(0x2d0u64).chain((0..4096u64).step_by(4));
        for off in candidates {
            let mut vals = HashSet::new();
            let ok = pthreads.iter().all(|&p| {
                self.mem
                    .read_i32(p.wrapping_add(off))
                    .is_ok_and(|v| ns.contains(&v) && vals.insert(v))
            });
            if ok {
                return Some(off);
            }
        }
        None
    }

    /// Walk one thread's Python stack, innermost first, reading per frame what the kernel's
    /// walk reads (code object address, instruction offset, code identity); the
    /// [`Symbolizer`] turns them into names and lines. The error says why the walk stopped
    /// early (the frames before it are still right).
    pub fn walk_raw(&self, tstate: u64) -> (Vec<RawFrame>, Option<String>) {
        self.walk_raw_cached(tstate, &mut CodeCache::default())
    }

    /// [`Self::walk_raw`] with code objects already read (this snapshot's other threads').
    fn walk_raw_cached(
        &self,
        tstate: u64,
        codes: &mut CodeCache,
    ) -> (Vec<RawFrame>, Option<String>) {
        let o = &self.offsets;
        let mut frames = Vec::new();
        let first = (|| -> Result<u64, ReadError> {
            let f = self.read(tstate.wrapping_add(o.tstate_frame))?;
            match o.cframe_current_frame {
                Some(cf) if f != 0 => self.read(f.wrapping_add(cf)),
                _ => Ok(f),
            }
        })();
        let mut frame = match first {
            Ok(f) => f,
            Err(e) => return (frames, Some(e.to_string())),
        };
        let code_type = self.binary.symbols.get("PyCode_Type").copied();
        let mut seen = HashSet::new();
        let mut steps = 0;
        while frame != 0 {
            steps += 1;
            if steps > MAX_FRAMES {
                return (
                    frames,
                    Some(format!("stack deeper than {MAX_FRAMES} frames; truncated")),
                );
            }
            if !seen.insert(frame) {
                return (
                    frames,
                    Some(format!("frame cycle at {frame:#x}; truncated")),
                );
            }
            match self.read_raw_frame(frame, code_type, codes) {
                Ok((Some(f), prev)) => {
                    frames.push(f);
                    frame = prev;
                }
                Ok((None, prev)) => frame = prev,
                Err(e) => return (frames, Some(e.to_string())),
            }
        }
        (frames, None)
    }

    /// One frame: `(frame if it is a real Python frame, previous frame address)`. The same
    /// reads, checks and offset as `ebpf/sampler.bpf.c`'s walk: the frame's fields in one
    /// read of its head (each on its own where that read fails), and each code object's
    /// type, first line and name once per snapshot (`codes`): a 500-frame recursion read
    /// seven times per frame took 4.5 µs a frame.
    fn read_raw_frame(
        &self,
        frame: u64,
        code_type: Option<u64>,
        codes: &mut CodeCache,
    ) -> Result<(Option<RawFrame>, u64), ReadError> {
        let o = &self.offsets;
        let mut head = [0u8; FRAME_HEAD];
        let end = [
            o.frame_previous + 8,
            o.frame_code + 8,
            o.frame_instr + 8,
            o.frame_owner.map_or(0, |x| x + 1),
        ]
        .into_iter()
        .max()
        .unwrap_or(0) as usize;
        let head = (end <= FRAME_HEAD && self.mem.read(frame, &mut head[..end]).is_ok())
            .then_some(&head[..end]);
        let bytes = |off: u64, n: usize| -> Result<u64, ReadError> {
            match head {
                Some(h) => {
                    let mut b = [0u8; 8];
                    b[..n].copy_from_slice(&h[off as usize..off as usize + n]);
                    Ok(u64::from_le_bytes(b))
                }
                None => {
                    let mut b = [0u8; 8];
                    self.mem.read(frame.wrapping_add(off), &mut b[..n])?;
                    Ok(u64::from_le_bytes(b))
                }
            }
        };
        let prev = bytes(o.frame_previous, 8)?;
        if let Some(owner_off) = o.frame_owner {
            // FRAME_OWNED_BY_CSTACK (3.12/3.13) and FRAME_OWNED_BY_INTERPRETER (3.14+) mark
            // shim/entry frames that are not Python code: owner >= 3 in every epoch.
            if bytes(owner_off, 1)? >= 3 {
                return Ok((None, prev));
            }
        }
        let code = bytes(o.frame_code, 8)? & !o.frame_code_tag_mask;
        if code == 0 {
            return Ok((None, prev));
        }
        let known = match codes.get(&code) {
            Some(&k) => k,
            None => {
                let k = match code_type {
                    // 3.13+: f_executable can be a non-code object (None for C entry frames).
                    Some(ct) if self.read(code.wrapping_add(8))? != ct => None,
                    _ => {
                        let firstlineno =
                            self.mem.read_i32(code.wrapping_add(o.code_firstlineno))?;
                        Some((firstlineno, self.read(code.wrapping_add(o.code_name))?))
                    }
                };
                if codes.len() < CODE_CACHE_MAX {
                    codes.insert(code, k);
                }
                k
            }
        };
        let Some((firstlineno, name)) = known else {
            return Ok((None, prev));
        };
        let instr_offset = match o.frame_kind {
            FrameKind::FrameObject => match bytes(o.frame_instr, 4) {
                Ok(lasti) if (lasti as u32 as i32) >= 0 => (lasti as u32 as i32).wrapping_mul(2),
                _ => -1,
            },
            FrameKind::Interpreter => match bytes(o.frame_instr, 8) {
                Ok(instr) => {
                    let base = code.wrapping_add(o.code_code_adaptive.unwrap_or(0));
                    instr.wrapping_sub(base) as i32
                }
                Err(_) => -1,
            },
        };
        Ok((
            Some(RawFrame {
                code,
                instr_offset,
                code_id: code_id(firstlineno, name),
            }),
            prev,
        ))
    }

    /// Read every thread of every interpreter, with names and lines from a fresh symbolizer
    /// (`dump`).
    pub fn snapshot(&self) -> Result<Snapshot, AttachError> {
        self.snapshot_with(&mut Symbolizer::new())
    }

    /// [`Self::snapshot`] through `sym` (a recorder's, whose cache outlives one snapshot).
    pub(crate) fn snapshot_with(&self, sym: &mut Symbolizer) -> Result<Snapshot, AttachError> {
        let raw = self.raw_snapshot()?;
        Ok(self.symbolize(raw, sym))
    }

    /// Read every thread, matching them to `tasks` (the process's threads from `/proc`).
    pub fn snapshot_with_tasks(&self, tasks: &[TaskInfo]) -> Result<Snapshot, AttachError> {
        let raw = self.raw_snapshot_with_tasks(tasks)?;
        Ok(self.symbolize(raw, &mut Symbolizer::new()))
    }

    fn symbolize(&self, raw: RawSnapshot, sym: &mut Symbolizer) -> Snapshot {
        let threads = raw
            .threads
            .into_iter()
            .map(|t| {
                sym.resolving_tid = t.tid.unwrap_or(0);
                ThreadSnapshot {
                    frames: sym.resolve(self.mem.as_ref(), &self.offsets, &t.frames),
                    tid: t.tid,
                    ns_tid: t.ns_tid,
                    os_name: t.name.clone(),
                    name: t.name,
                    python_name: None,
                    holds_gil: t.holds_gil,
                    gc_collecting: t.gc_collecting,
                    error: t.error,
                    asyncio_task: None,
                    tstate: t.tstate,
                }
            })
            .collect();
        Snapshot {
            threads,
            read_errors: raw.read_errors,
        }
    }

    /// Every thread's raw stack now.
    pub(crate) fn raw_snapshot(&self) -> Result<RawSnapshot, AttachError> {
        let pid = self.pid;
        let tasks = procinfo::tasks(pid).map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                AttachError::Gone(pid)
            } else {
                AttachError::Proc { pid, err: e }
            }
        })?;
        let snap = self.raw_snapshot_with_tasks(&tasks)?;
        if snap.threads.is_empty() && !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            return Err(AttachError::Gone(pid));
        }
        Ok(snap)
    }

    /// Every thread's raw stack, matching threads to `tasks`.
    pub(crate) fn raw_snapshot_with_tasks(
        &self,
        tasks: &[TaskInfo],
    ) -> Result<RawSnapshot, AttachError> {
        let pid = self.pid;
        let by_ns: HashMap<i32, &TaskInfo> = procinfo::by_ns_tid(tasks);
        let mut threads = Vec::new();
        let mut read_errors = 0;
        let interps = self
            .interpreters()
            .map_err(|e| map_read(pid, "reading the interpreter list", e))?;
        for interp in interps {
            let (tstates, list_error, _) = self.thread_list(interp);
            match list_error {
                Some(e) if tstates.is_empty() => {
                    return Err(map_read(pid, "reading the thread list", e))
                }
                Some(_) => read_errors += 1,
                None => {}
            }
            let holder = self.gil_holder(interp).unwrap_or_else(|_| {
                read_errors += 1;
                0
            });
            let collecting = self.gc_collecting(interp).unwrap_or_else(|_| {
                read_errors += 1;
                false
            });
            let mut codes = CodeCache::default();
            for t in tstates {
                let ns_tid = self.ns_tid(t, tasks);
                let task = ns_tid.and_then(|n| by_ns.get(&n));
                let (frames, error) = self.walk_raw_cached(t, &mut codes);
                if error.is_some() {
                    read_errors += 1;
                }
                threads.push(RawThread {
                    tid: task.map(|t| t.host_tid),
                    ns_tid,
                    name: task.map(|t| t.comm.clone()).unwrap_or_default(),
                    holds_gil: holder != 0 && holder == t,
                    gc_collecting: collecting,
                    frames,
                    error,
                    tstate: t,
                });
            }
        }
        Ok(RawSnapshot {
            threads,
            read_errors,
        })
    }
}

impl PythonProcess {
    /// The thread's ident (`PyThreadState.thread_id`: `threading.get_ident()`, `pthread_self`).
    pub(crate) fn thread_ident(&self, tstate: u64) -> Option<u64> {
        self.read(tstate.wrapping_add(self.offsets.tstate_thread_id))
            .ok()
            .filter(|&i| i != 0)
    }

    /// Python thread names by `PyThreadState` address, from the `threading` module of each
    /// interpreter (`names` keeps what it found for the next call). Errors are counted in
    /// `names`, never fatal: a thread without a Python name keeps its OS name.
    pub fn python_thread_names(
        &self,
        names: &mut super::threading::ThreadNames,
    ) -> HashMap<u64, String> {
        let mut out = HashMap::new();
        let Ok(interps) = self.interpreters() else {
            names.errors += 1;
            return out;
        };
        // The main interpreter's `threading` (subinterpreters have their own modules; their
        // threads keep OS names).
        let Some(&main) = interps.last() else {
            return out;
        };
        let by_ident = match names.read(self.mem.as_ref(), &self.offsets, main) {
            Ok(m) => m,
            Err(_) => {
                names.errors += 1;
                return out;
            }
        };
        if by_ident.is_empty() {
            return out;
        }
        for t in self.thread_states(main).unwrap_or_default() {
            if let Some(n) = self.thread_ident(t).and_then(|i| by_ident.get(&i)) {
                out.insert(t, n.clone());
            }
        }
        out
    }

    /// Give the threads of a snapshot their Python names.
    pub(crate) fn name_threads(
        &self,
        snap: &mut Snapshot,
        names: &mut super::threading::ThreadNames,
    ) {
        let by_tstate = self.python_thread_names(names);
        for t in &mut snap.threads {
            if let Some(n) = by_tstate.get(&t.tstate) {
                t.python_name = Some(n.clone());
                t.name = n.clone();
            }
        }
    }
}

impl PythonProcess {
    /// The asyncio task object each of these thread states is running (see
    /// src/cpython/asyncio.rs for where each version keeps it). Errors are counted in `tasks`,
    /// never fatal.
    pub fn running_tasks(
        &self,
        tasks: &mut super::asyncio::AsyncioTasks,
        tstates: &[u64],
    ) -> HashMap<u64, u64> {
        let mut out = HashMap::new();
        if self.version.minor >= 14 {
            tasks.find_debug(self.pid);
            for &t in tstates {
                if let Some(task) = tasks.current_of_tstate(self.mem.as_ref(), t) {
                    out.insert(t, task);
                }
            }
            return out;
        }
        let Ok(main) = self.main_interpreter() else {
            tasks.errors += 1;
            return out;
        };
        let by_ident = match tasks.current_by_ident(self.mem.as_ref(), &self.offsets, main) {
            Ok(m) => m,
            Err(_) => {
                tasks.errors += 1;
                return out;
            }
        };
        for &t in tstates {
            if let Some(&task) = self.thread_ident(t).and_then(|i| by_ident.by_ident.get(&i)) {
                out.insert(t, task);
            }
        }
        // Loops without `_thread_id` (uvloop): the thread whose running loop it is.
        for &(lp, task) in &by_ident.unplaced {
            for &t in tstates {
                if !out.contains_key(&t)
                    && tasks
                        .running_loops(self.mem.as_ref(), &self.offsets, self.version.minor, t)
                        .contains(&lp)
                {
                    out.insert(t, task);
                    break;
                }
            }
        }
        out
    }

    /// The task `task` that thread state `tstate` runs, with its await chain from the thread's
    /// stack (walked now, names through `sym`). `None` (counted in `tasks`) when unreadable.
    pub fn describe_running_task(
        &self,
        tasks: &mut super::asyncio::AsyncioTasks,
        sym: &mut Symbolizer,
        tstate: u64,
        task: u64,
    ) -> Option<super::asyncio::RunningTask> {
        let layout = super::asyncio::TaskLayout::for_version(self.version.minor)?;
        let (name, coro) = match tasks.describe(self.mem.as_ref(), &self.offsets, &layout, task) {
            Ok(x) => x,
            Err(_) => {
                tasks.errors += 1;
                return None;
            }
        };
        let (raw, _) = self.walk_raw(tstate);
        let coros = super::asyncio::coroutine_frames(self.mem.as_ref(), &layout, &raw);
        let chain = sym
            .resolve(self.mem.as_ref(), &self.offsets, &coros)
            .into_iter()
            .map(|f| f.function)
            .collect();
        Some(super::asyncio::RunningTask { name, coro, chain })
    }

    /// Give the threads of a snapshot that run an asyncio task that task and its chain.
    pub(crate) fn name_tasks(&self, snap: &mut Snapshot, tasks: &mut super::asyncio::AsyncioTasks) {
        let tstates: Vec<u64> = snap.threads.iter().map(|t| t.tstate).collect();
        let running = self.running_tasks(tasks, &tstates);
        let mut sym = Symbolizer::new();
        for t in &mut snap.threads {
            if let Some(&task) = running.get(&t.tstate) {
                t.asyncio_task = self.describe_running_task(tasks, &mut sym, t.tstate, task);
            }
        }
    }
}

/// One thread as read, its frames not yet symbolized.
#[derive(Debug, Clone)]
pub(crate) struct RawThread {
    pub tid: Option<i32>,
    pub ns_tid: Option<i32>,
    pub name: String,
    pub holds_gil: bool,
    pub gc_collecting: bool,
    pub frames: Vec<RawFrame>,
    pub error: Option<String>,
    pub tstate: u64,
}

/// All threads of a process at one moment, frames not yet symbolized.
#[derive(Debug, Clone)]
pub(crate) struct RawSnapshot {
    pub threads: Vec<RawThread>,
    pub read_errors: u64,
}

/// The version, from the binary itself: `Py_Version` (3.11+), else the `_Py_DebugOffsets`
/// header, else the `sys.version` text `Py_GetVersion` keeps in `.bss` (3.10).
pub fn detect_version(
    mem: &dyn MemorySource,
    b: &InterpreterBinary,
) -> Option<(PyVersion, &'static str)> {
    if let Some(&addr) = b.symbols.get("Py_Version") {
        if let Ok(hex) = mem.read_u32(addr) {
            let v = PyVersion::from_hex(hex as u64);
            if v.major == 3 {
                return Some((v, "Py_Version"));
            }
        }
    }
    if let Ok(head) = mem.read_vec(b.runtime_addr, 16) {
        if &head[..8] == b"xdebugpy" {
            let hex = u64::from_le_bytes(head[8..16].try_into().ok()?);
            return Some((PyVersion::from_hex(hex), "_Py_DebugOffsets"));
        }
    }
    let (start, end) = b.bss?;
    let len = end.checked_sub(start)?.min(16 << 20) as usize;
    // Read in chunks so one unreadable page does not hide the rest.
    let chunk = 1 << 16;
    let mut off = 0;
    while off < len {
        let n = chunk.min(len - off) + 64.min(len - off - chunk.min(len - off));
        if let Ok(bytes) = mem.read_vec(start.wrapping_add(off as u64), n) {
            if let Some(v) = scan_for_version(&bytes) {
                return Some((v, "sys.version in .bss"));
            }
        }
        off += chunk;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpython::memory::FakeMemory;
    use crate::cpython::offsets::PY312;

    use crate::cpython::testutil::*;

    #[test]
    fn walks_frames_and_skips_shims() {
        let mut f = Fake::new();
        let outer = f.code("outer", 10);
        let inner = f.code("Klass.inner", 20);
        let f1 = f.frame(outer, 0, 0);
        let shim = f.frame(outer, f1, 3); // FRAME_OWNED_BY_CSTACK: skipped
        let f2 = f.frame(inner, shim, 0);
        let t = f.thread(f2, 0);
        let p = f.process(t);
        let s = p.snapshot_with_tasks(&[]).unwrap();
        assert_eq!(s.threads.len(), 1);
        let names: Vec<_> = s.threads[0]
            .frames
            .iter()
            .map(|f| (f.function.as_str(), f.line))
            .collect();
        assert_eq!(names, vec![("Klass.inner", Some(20)), ("outer", Some(10))]);
        assert!(s.threads[0].error.is_none());
    }

    #[test]
    fn frame_cycle_is_cut() {
        let mut f = Fake::new();
        let c = f.code("loop", 1);
        let a = f.frame(c, 0, 0);
        let b = f.frame(c, a, 0);
        f.mem.put_u64(a + PY312.frame_previous, b); // a -> b -> a
        let t = f.thread(b, 0);
        let s = f.process(t).snapshot_with_tasks(&[]).unwrap();
        assert_eq!(s.threads[0].frames.len(), 2);
        assert!(s.threads[0].error.as_deref().unwrap().contains("cycle"));
    }

    #[test]
    fn thread_cycle_is_cut() {
        let mut f = Fake::new();
        let t1 = f.thread(0, 0);
        let t2 = f.thread(0, t1);
        f.mem.put_u64(t1 + PY312.tstate_next, t2);
        let s = f.process(t2).snapshot_with_tasks(&[]).unwrap();
        assert_eq!(s.threads.len(), 2);
    }

    /// Issue 15 (live adversarial test): a thread state freed under the reader (its `next`
    /// unreadable) failed the whole snapshot, and the sampler, which re-reads the list, then
    /// dropped every thread. The threads before it are kept and the error counted.
    #[test]
    fn freed_thread_state_keeps_the_threads_before_it() {
        let mut f = Fake::new();
        let c = f.code("alive", 5);
        let a = f.frame(c, 0, 0);
        let t1 = f.thread(a, 0xdead_0000); // next: unmapped (freed)
        let t2 = f.thread(a, t1);
        let p = f.process(t2);
        // The freed one is listed (its address was read), its stack is an error, and the
        // walk of the list ends there.
        let s = p.snapshot_with_tasks(&[]).unwrap();
        assert_eq!(s.threads.len(), 3);
        assert_eq!(s.threads[0].frames[0].function, "alive");
        assert_eq!(s.threads[1].frames[0].function, "alive");
        assert!(s.threads[2].error.is_some());
        assert_eq!(s.read_errors, 2);
        assert_eq!(p.thread_states(INTERP).unwrap(), vec![t2, t1, 0xdead_0000]);
        let (with_tids, complete) = p.threads_with_tids(&[]).unwrap();
        assert_eq!((with_tids.len(), complete), (3, false));
        let (list, err, whole) = p.thread_list(INTERP);
        assert_eq!((list.len(), err.is_some(), whole), (3, true, false));
    }

    /// Found by the `walker` fuzz target (issue 15): pointers read from the target near the
    /// top of the address space overflowed the address arithmetic (`frame + offset`,
    /// `tstate + offset`, `runtime + offset`) before the read that would have failed.
    #[test]
    fn pointers_near_the_top_of_the_address_space_are_read_errors() {
        for wild in [u64::MAX, u64::MAX - 7, u64::MAX - 60] {
            // A thread whose next pointer, and a thread whose frame pointer, is wild.
            let mut f = Fake::new();
            let t1 = f.thread(wild, wild);
            let p = f.process(t1);
            let s = p.snapshot_with_tasks(&[]).unwrap();
            assert_eq!(s.threads.len(), 2);
            assert!(s.threads.iter().all(|t| t.error.is_some()));
            // A frame whose previous pointer is wild.
            let mut f = Fake::new();
            let c = f.code("ok", 3);
            let a = f.frame(c, wild, 0);
            let t = f.thread(a, 0);
            let s = f.process(t).snapshot_with_tasks(&[]).unwrap();
            assert_eq!(s.threads[0].frames.len(), 1);
            assert!(s.threads[0].error.is_some());
        }
        // The interpreter list head itself wild, and a wild runtime address.
        let mut f = Fake::new();
        f.mem
            .put_u64(RUNTIME + PY312.runtime_interpreters_head, u64::MAX - 3);
        let mut p = f.process(0);
        assert!(p.snapshot_with_tasks(&[]).is_err());
        p.binary.runtime_addr = u64::MAX - 1;
        assert!(p.interpreters().is_err());
        assert!(detect_version(p.mem.as_ref(), &p.binary).is_none());
        // A wild thread state's ident (found by the walker fuzz target once asyncio's task
        // reads asked for it: `running_tasks` → `thread_ident`).
        for wild in [u64::MAX, u64::MAX - 7] {
            assert_eq!(p.thread_ident(wild), None);
            let mut tasks = super::super::asyncio::AsyncioTasks::default();
            assert!(p.running_tasks(&mut tasks, &[wild]).is_empty());
        }
    }

    #[test]
    fn truncated_memory_gives_partial_stack() {
        let mut f = Fake::new();
        let c = f.code("ok", 5);
        let a = f.frame(c, 0xdead_0000, 0); // previous frame is unmapped
        let t = f.thread(a, 0);
        let s = f.process(t).snapshot_with_tasks(&[]).unwrap();
        assert_eq!(s.threads[0].frames.len(), 1);
        assert!(s.threads[0].error.is_some());
        assert_eq!(s.read_errors, 1);
    }

    #[test]
    fn non_code_executable_is_skipped() {
        let mut f = Fake::new();
        let c = f.code("real", 5);
        let bogus = f.alloc(64); // ob_type is not PyCode_Type
        let a = f.frame(c, 0, 0);
        let b = f.frame(bogus, a, 0);
        let t = f.thread(b, 0);
        let s = f.process(t).snapshot_with_tasks(&[]).unwrap();
        assert_eq!(s.threads[0].frames.len(), 1);
        assert_eq!(s.threads[0].frames[0].function, "real");
    }

    #[test]
    fn garbage_memory_never_panics_or_hangs() {
        // Every region filled with pseudo-random words that often point back into the regions.
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut rnd = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for round in 0..50 {
            let mut mem = FakeMemory::new();
            let bases: Vec<u64> = (0..16).map(|i| 0x100_0000 + i * 0x1000).collect();
            for &b in &bases {
                let mut bytes = Vec::with_capacity(4096);
                for _ in 0..512 {
                    let r = rnd();
                    let w = if r % 3 == 0 {
                        bases[(r >> 8) as usize % bases.len()] + (r >> 20) % 4000
                    } else {
                        r
                    };
                    bytes.extend_from_slice(&w.to_le_bytes());
                }
                mem.map(b, bytes);
            }
            let binary = InterpreterBinary {
                path: "garbage".into(),
                opened_from: "garbage".into(),
                is_shared_lib: false,
                pie: false,
                stripped: true,
                build_id: None,
                bias: 0,
                runtime_addr: bases[round % bases.len()],
                runtime_found_by: "test".into(),
                symbols: HashMap::new(),
                bss: None,
            };
            let p = PythonProcess::from_parts(
                1,
                Box::new(mem),
                binary,
                PyVersion::new(3, 12, 1),
                PY312,
            );
            let _ = p.snapshot_with_tasks(&[]);
        }
    }
}
