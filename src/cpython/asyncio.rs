//! The asyncio task a thread is running, read from outside: its name (`Task.get_name()`), its
//! coroutine's qualified name, and the await chain (the coroutine frames on the thread's stack,
//! outermost first).
//!
//! Where the running task is kept:
//! * 3.10–3.13: the C `_asyncio` module's dict `{loop: task}`, which `asyncio.tasks` imports as
//!   `_current_tasks` (the same object: `_enter_task`/`_leave_task` add and delete the entry
//!   around each step, so it holds a loop only while one of its tasks runs). A loop's thread is
//!   its `_thread_id` attribute (set by `run_forever` from `threading.get_ident()`, the
//!   `PyThreadState.thread_id` of the thread); a loop without one (uvloop's, a C field) is the
//!   one a thread state holds as its running loop ([`AsyncioTasks::running_loops`]).
//! * 3.14+: the thread state's `asyncio_running_task` (what `python -m asyncio ps/pstree` and
//!   3.15's `profiling.sampling --async-aware` read), at the offset the `_asyncio` module
//!   publishes in its `.AsyncioDebug` section (`_Py_AsyncioModuleDebugOffsets`: in the
//!   `_asyncio*.so` of Debian's 3.14, in the interpreter itself when `_asyncio` is built in, as
//!   in Debian's 3.15).
//!
//! The C `TaskObj` layout (`FutureObj_HEAD` then `task_fut_waiter`, `task_coro`, `task_name`,
//! ...) is not in `_Py_DebugOffsets` before 3.14: [`TaskLayout::for_version`] has it per minor
//! version, from `Modules/_asynciomodule.c` of each and checked against the real interpreters
//! (3.10.13, 3.11.7, 3.12.1, 3.13.0, 3.13.18, 3.14.10, 3.15.2: the offsets of a task's coroutine
//! and name, of a coroutine's `__qualname__`, and of `co_flags`, found in live objects). Every
//! read is checked: the task's type name ends in `Task`, its name is a str (or, 3.13+, an int
//! the task formats lazily as `Task-N`), its coroutine's type is `coroutine` and its qualname a
//! str; anything else is an error, counted, never a panic.
//!
//! Pure-Python tasks (asyncio without `_asyncio`, or a `Task` subclass written in Python
//! that overrides nothing of the layout): on 3.10–3.13 they are in the same dict, and a task
//! whose type is not `_asyncio.Task` is read through its `_name`/`_coro` attributes when it has
//! them, else through the C layout (unit-tested, not run live). On 3.14+ pure-Python tasks set
//! no thread-state field and are not seen. uvloop: its tasks are asyncio's C tasks, so 3.14+
//! sees them; on 3.10–3.13 a uvloop loop keeps its thread id in a C field, not an attribute,
//! and is placed through the thread's running loop (checked live with uvloop 0.23 on 3.11).

use std::collections::HashMap;

use super::memory::MemorySource;
use super::objects::{read_unicode, ObjectError};
use super::offsets::Offsets;
use super::symbols::RawFrame;
use super::threading::{dict_items, garbage, object, read_u64_int, Attrs};

/// Most loops with a running task we read per interpreter.
pub(crate) const MAX_LOOPS: usize = 256;
/// Most coroutine frames of an await chain.
pub const MAX_CHAIN: usize = 64;
/// `PyTypeObject.tp_name` (after `PyObject_VAR_HEAD`), every version.
const TYPE_NAME: u64 = 24;
/// Longest type name we read.
const MAX_TYPE_NAME: usize = 128;
/// `co_flags` bits of coroutine code: `async def` (CO_COROUTINE), `@types.coroutine`
/// generators (CO_ITERABLE_COROUTINE), async generators (CO_ASYNC_GENERATOR).
pub(crate) const CO_COROUTINE_FLAGS: u32 = 0x80 | 0x100 | 0x200;

/// Offsets in a C task, a coroutine and a code object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TaskLayout {
    /// `TaskObj.task_coro`.
    pub task_coro: u64,
    /// `TaskObj.task_name`.
    pub task_name: u64,
    /// `PyCoroObject.cr_qualname`.
    pub coro_qualname: u64,
    /// `PyCodeObject.co_flags` (an int).
    pub code_flags: u64,
}

impl TaskLayout {
    /// The layout of a minor version (3.14+: the default build's, which the `.AsyncioDebug`
    /// section, when found, overrides for the task fields).
    pub(crate) fn for_version(minor: u8) -> Option<TaskLayout> {
        let (task_coro, task_name, coro_qualname, code_flags) = match minor {
            // FutureObj_HEAD ends with fut_cancel_msg, dict, weakreflist, _PyErr_StackItem
            // fut_cancelled_exc_state (16 bytes); then task_fut_waiter, task_coro, task_name.
            // PyGenObject: ob_*, gi_frame, gi_code, gi_weakreflist, gi_name, gi_qualname.
            // PyCodeObject: ob_*, 5 ints, co_flags.
            10 => (160, 168, 48, 36),
            // fut_exception_tb added, cancelled_exc_state became fut_cancelled_exc (a pointer),
            // fut_cancel_requested; PyGenObject: gi_code, gi_weakreflist, gi_name, gi_qualname.
            // PyCodeObject: PyObject_VAR_HEAD, co_consts, co_names, co_exceptiontable, co_flags.
            11 | 12 => (136, 144, if minor == 11 { 40 } else { 32 }, 48),
            // fut_log_tb/blocking/cancel_requested packed into bit fields, source_tb gone.
            13 => (120, 128, 32, 48),
            // task_node (a list node) and is_task/awaited_by fields before task_coro.
            14 | 15 => (128, 136, 32, 48),
            _ => return None,
        };
        Some(TaskLayout {
            task_coro,
            task_name,
            coro_qualname,
            code_flags,
        })
    }
}

/// 3.14+ `_Py_AsyncioModuleDebugOffsets`: the task fields we use and where a thread state keeps
/// its running loop and task.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AsyncioDebug {
    pub task_size: u64,
    pub task_name: u64,
    pub task_coro: u64,
    pub tstate_running_loop: u64,
    pub tstate_running_task: u64,
}

/// Parse an `.AsyncioDebug` section: 13 little-endian u64 (task object: size, task_name,
/// task_awaited_by, task_is_task, task_awaited_by_is_set, task_coro, task_node; interpreter
/// state: size, asyncio_tasks_head; thread state: size, asyncio_running_loop,
/// asyncio_running_task, asyncio_tasks_head). `None` when implausible.
pub fn parse_asyncio_debug(b: &[u8]) -> Option<AsyncioDebug> {
    let w = |i: usize| -> Option<u64> {
        Some(u64::from_le_bytes(
            b.get(i * 8..i * 8 + 8)?.try_into().ok()?,
        ))
    };
    let d = AsyncioDebug {
        task_size: w(0)?,
        task_name: w(1)?,
        task_coro: w(5)?,
        tstate_running_loop: w(10)?,
        tstate_running_task: w(11)?,
    };
    let tstate_size = w(9)?;
    let field = |off: u64, size: u64| off >= 16 && off.is_multiple_of(8) && off + 8 <= size;
    let ok = (32..=4096).contains(&d.task_size)
        && (64..=1 << 16).contains(&tstate_size)
        && field(d.task_name, d.task_size)
        && field(d.task_coro, d.task_size)
        && d.task_name != d.task_coro
        && field(d.tstate_running_loop, tstate_size)
        && field(d.tstate_running_task, tstate_size)
        && d.tstate_running_loop != d.tstate_running_task;
    ok.then_some(d)
}

/// The `.AsyncioDebug` section of the files process `pid` maps (the interpreter, or an
/// `_asyncio` extension module).
pub(crate) fn find_asyncio_debug(pid: i32) -> Option<AsyncioDebug> {
    use object::{Object, ObjectSection};
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).ok()?;
    let mut seen = std::collections::HashSet::new();
    for m in super::binary::parse_maps(&maps) {
        let base = m.path.rsplit('/').next().unwrap_or("");
        if !m.path.starts_with('/')
            || !(base.starts_with("_asyncio") || base.contains("python"))
            || !seen.insert(m.path.clone())
        {
            continue;
        }
        let Some((_, cache)) = super::binary::open_mapped_file(pid, &m) else {
            continue;
        };
        let Ok(file) = object::File::parse(&cache) else {
            continue;
        };
        if let Some(data) = file
            .section_by_name(".AsyncioDebug")
            .and_then(|s| s.data().ok())
        {
            if let Some(d) = parse_asyncio_debug(data) {
                return Some(d);
            }
        }
    }
    None
}

/// The task a thread is running: a fact of the recording (record 18), read here.
pub use crate::record::RunningTask;

/// What `_current_tasks` holds (3.10–3.13).
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct CurrentTasks {
    /// Task by the thread ident of its loop (`loop._thread_id`).
    pub by_ident: HashMap<u64, u64>,
    /// `(loop, task)` of loops without a readable `_thread_id` (uvloop).
    pub unplaced: Vec<(u64, u64)>,
}

/// Reads running asyncio tasks, keeping what it found between reads.
#[derive(Default)]
pub struct AsyncioTasks {
    attrs: Attrs,
    /// 3.10–3.13: `asyncio.tasks._current_tasks`, once found (checked again at each read).
    current_tasks: Option<u64>,
    /// Its type (`dict`).
    dict_type: u64,
    /// 3.14+: the `.AsyncioDebug` offsets, once found.
    pub debug: Option<AsyncioDebug>,
    /// When they were last looked for (not found: `_asyncio` not imported yet).
    debug_looked: Option<std::time::Instant>,
    /// 3.10–3.13: when `asyncio.tasks._current_tasks` was last looked for and not found
    /// (asyncio not imported): looked for again at most every [`DEBUG_LOOKUP_EVERY`]. Each
    /// look walks `sys.modules`, a few hundred reads of the target's memory: at every read
    /// (50 a second) that was most of the recorder's own CPU for a process without asyncio.
    current_tasks_missing: Option<std::time::Instant>,
    /// Reads that failed (an implausible object, an unreadable address).
    pub errors: u64,
}

fn type_name(mem: &dyn MemorySource, obj: u64) -> Result<String, ObjectError> {
    let ty = object("type", mem.read_u64(object("object", obj)? + 8)?)?;
    let at = mem.read_u64(ty + TYPE_NAME)?;
    if at == 0 {
        return Err(garbage("type", ty, "no tp_name"));
    }
    // In 16-byte pieces up to the NUL: a short name near the end of a mapping reads too.
    let mut bytes = Vec::with_capacity(32);
    let end = loop {
        if let Some(end) = bytes.iter().position(|&b| b == 0) {
            break end;
        }
        if bytes.len() >= MAX_TYPE_NAME {
            return Err(garbage("type", ty, "tp_name too long"));
        }
        let piece = at
            .checked_add(bytes.len() as u64)
            .ok_or_else(|| garbage("type", ty, "tp_name address"))?;
        match mem.read_vec(piece, 16) {
            Ok(b) => bytes.extend(b),
            // The name ends within 16 bytes of the mapping's end: byte by byte.
            Err(e) => match mem.read_u8(piece) {
                Ok(b) => bytes.push(b),
                Err(_) => return Err(e.into()),
            },
        }
    };
    let s = std::str::from_utf8(&bytes[..end]).map_err(|_| garbage("type", ty, "tp_name"))?;
    Ok(s.to_string())
}

/// While the `.AsyncioDebug` section (3.14+) or `asyncio.tasks._current_tasks` (3.10–3.13) is
/// not found, it is looked for again at most this often (each look reads `/proc/PID/maps` and
/// ELF section headers, or walks `sys.modules`): a loop started later is found within it.
pub(crate) const DEBUG_LOOKUP_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

impl AsyncioTasks {
    /// 3.14+: find the `.AsyncioDebug` offsets of process `pid` if not known yet (at most every
    /// [`DEBUG_LOOKUP_EVERY`]).
    pub(crate) fn find_debug(&mut self, pid: i32) {
        if self.debug.is_some()
            || self
                .debug_looked
                .is_some_and(|t| t.elapsed() < DEBUG_LOOKUP_EVERY)
        {
            return;
        }
        self.debug_looked = Some(std::time::Instant::now());
        self.debug = find_asyncio_debug(pid);
    }

    /// 3.10–3.13: the task object each loop thread is running, from the main interpreter
    /// `interp`'s `asyncio.tasks._current_tasks`: by thread ident for loops with a `_thread_id`
    /// attribute (asyncio's own), and the `(loop, task)` pairs of loops without one (uvloop),
    /// for [`Self::running_loops`] to place. Empty when asyncio is not imported or nothing runs.
    pub(crate) fn current_by_ident(
        &mut self,
        mem: &dyn MemorySource,
        o: &Offsets,
        interp: u64,
    ) -> Result<CurrentTasks, ObjectError> {
        let still =
            |a: u64| self.dict_type != 0 && mem.read_u64(a + 8).is_ok_and(|t| t == self.dict_type);
        let dict = match self.current_tasks.filter(|&a| still(a)) {
            Some(a) => a,
            None => {
                self.current_tasks = None;
                if self
                    .current_tasks_missing
                    .is_some_and(|t| t.elapsed() < DEBUG_LOOKUP_EVERY)
                {
                    return Ok(CurrentTasks::default());
                }
                let Some((dict_type, d)) =
                    self.attrs
                        .module_global(mem, o, interp, "asyncio.tasks", "_current_tasks")?
                else {
                    self.current_tasks_missing = Some(std::time::Instant::now());
                    return Ok(CurrentTasks::default());
                };
                self.current_tasks_missing = None;
                if mem.read_u64(object("_current_tasks", d)? + 8)? != dict_type {
                    return Err(garbage("asyncio.tasks._current_tasks", d, "not a dict"));
                }
                self.dict_type = dict_type;
                self.current_tasks = Some(d);
                d
            }
        };
        let mut out = CurrentTasks::default();
        for (lp, task) in dict_items(mem, o, dict)?.into_iter().take(MAX_LOOPS) {
            let ident = match self.attrs.attribute(mem, o, lp, "_thread_id") {
                Ok(Some(id)) => read_u64_int(mem, o, id).ok(),
                _ => None,
            };
            match ident {
                Some(i) => {
                    out.by_ident.insert(i, task);
                }
                None => out.unplaced.push((lp, task)),
            }
        }
        Ok(out)
    }

    /// 3.10–3.13: the loop objects a thread state may be running, where `_asyncio` keeps its
    /// running loop (`get_running_loop()`): 3.10/3.11 the thread state's dict
    /// (`PyThreadState.dict`, at 152/128) maps `__asyncio_running_event_loop__` to a
    /// `_RunningLoopHolder` whose `rl_loop` follows its head; 3.12 maps it to the loop itself
    /// (dict at 112); 3.13 keeps it in `_PyThreadStateImpl.asyncio_running_loop`, which moved
    /// between patch releases (304 in 3.13.0, 312 in 3.13.18): both words are returned. The
    /// caller compares them with a loop of `_current_tasks`, so a wrong guess matches nothing.
    pub(crate) fn running_loops(
        &mut self,
        mem: &dyn MemorySource,
        o: &Offsets,
        minor: u8,
        tstate: u64,
    ) -> Vec<u64> {
        let dict_at = match minor {
            10 => 152,
            11 => 128,
            12 => 112,
            13 => {
                return [304u64, 312]
                    .iter()
                    .filter_map(|&off| mem.read_u64(tstate.checked_add(off)?).ok())
                    .filter(|&l| l != 0)
                    .collect();
            }
            _ => return Vec::new(),
        };
        let found = (|| -> Result<Option<u64>, ObjectError> {
            let Some(at) = tstate.checked_add(dict_at) else {
                return Ok(None);
            };
            let dict = mem.read_u64(at)?;
            if dict == 0
                || self.dict_type == 0
                || mem.read_u64(object("dict", dict)? + 8)? != self.dict_type
            {
                return Ok(None);
            }
            let Some(v) = self.attrs.lookup(
                mem,
                o,
                dict_items(mem, o, dict)?,
                "__asyncio_running_event_loop__",
            )?
            else {
                return Ok(None);
            };
            if minor >= 12 {
                return Ok(Some(v));
            }
            if type_name(mem, v)? != "_RunningLoopHolder" {
                return Err(garbage("running loop holder", v, "type"));
            }
            Ok(Some(mem.read_u64(v + 16)?))
        })();
        match found {
            Ok(Some(l)) if l != 0 => vec![l],
            Ok(_) => Vec::new(),
            Err(_) => {
                self.errors += 1;
                Vec::new()
            }
        }
    }

    /// 3.14+: the task a thread state is running (0: none).
    pub(crate) fn current_of_tstate(&self, mem: &dyn MemorySource, tstate: u64) -> Option<u64> {
        let d = self.debug?;
        mem.read_u64(tstate.checked_add(d.tstate_running_task)?)
            .ok()
            .filter(|&t| t != 0)
    }

    /// The name and coroutine qualname of a task object.
    pub(crate) fn describe(
        &mut self,
        mem: &dyn MemorySource,
        o: &Offsets,
        layout: &TaskLayout,
        task: u64,
    ) -> Result<(String, String), ObjectError> {
        let task = object("task", task)?;
        let tname = type_name(mem, task)?;
        let (name, coro) = if tname == "_asyncio.Task" || tname.ends_with("Task") {
            let (name_off, coro_off) = match self.debug {
                Some(d) => (d.task_name, d.task_coro),
                None => (layout.task_name, layout.task_coro),
            };
            if tname == "_asyncio.Task" {
                (
                    mem.read_u64(task + name_off)?,
                    mem.read_u64(task + coro_off)?,
                )
            } else {
                // A subclass: a Python class over the C layout, or a pure-Python task
                // (`_name`, `_coro` attributes).
                match self.attrs.attribute(mem, o, task, "_name") {
                    Ok(Some(n)) => (
                        n,
                        self.attrs
                            .attribute(mem, o, task, "_coro")?
                            .ok_or_else(|| garbage("task", task, "no _coro"))?,
                    ),
                    _ => (
                        mem.read_u64(task + name_off)?,
                        mem.read_u64(task + coro_off)?,
                    ),
                }
            }
        } else {
            return Err(garbage("task", task, format!("type {tname}")));
        };
        let name = object("task name", name)?;
        let name = match type_name(mem, name)?.as_str() {
            "str" => read_unicode(mem, o, name)?,
            // 3.13+: the task counter, formatted by `get_name()`.
            "int" => format!("Task-{}", read_u64_int(mem, o, name)?),
            other => return Err(garbage("task name", name, format!("type {other}"))),
        };
        let coro = object("coroutine", coro)?;
        let coro = match type_name(mem, coro)?.as_str() {
            "coroutine" => read_unicode(mem, o, mem.read_u64(coro + layout.coro_qualname)?)?,
            other => format!("<{other}>"),
        };
        Ok((name, coro))
    }
}

/// The coroutine frames among `frames` (innermost first, as walked), outermost first, at most
/// [`MAX_CHAIN`]: those whose code has a [`CO_COROUTINE_FLAGS`] bit. A frame whose flags
/// cannot be read is left out.
pub(crate) fn coroutine_frames(
    mem: &dyn MemorySource,
    layout: &TaskLayout,
    frames: &[RawFrame],
) -> Vec<RawFrame> {
    let mut out: Vec<RawFrame> = frames
        .iter()
        .filter(|f| {
            f.code
                .checked_add(layout.code_flags)
                .and_then(|a| mem.read_u32(a).ok())
                .is_some_and(|flags| flags & CO_COROUTINE_FLAGS != 0)
        })
        .copied()
        .collect();
    out.reverse();
    out.truncate(MAX_CHAIN);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpython::memory::FakeMemory;
    use crate::cpython::offsets::{PY310, PY311, PY312};
    use crate::cpython::threading::tests::Heap;

    /// A type object named `name`.
    fn ty(h: &mut Heap, name: &str) -> u64 {
        let mut n = name.as_bytes().to_vec();
        n.push(0);
        let at = h.put(n);
        let mut t = vec![0u8; 512];
        t[24..32].copy_from_slice(&at.to_le_bytes());
        h.put(t)
    }

    /// Point `obj`'s `ob_type` at `t`.
    fn set_type(h: &mut Heap, obj: u64, t: u64) {
        h.mem.put_u64(obj + 8, t);
    }

    /// A C task named `name` (a str, or an int for 3.13's lazy names) running `qualname`.
    fn task(h: &mut Heap, l: &TaskLayout, name: Option<&str>, n: u64, qualname: &str) -> u64 {
        let str_t = ty(h, "str");
        let int_t = ty(h, "int");
        let coro_t = ty(h, "coroutine");
        let task_t = ty(h, "_asyncio.Task");
        let name_obj = match name {
            Some(s) => {
                let a = h.str(s);
                set_type(h, a, str_t);
                a
            }
            None => {
                let a = h.int(n);
                set_type(h, a, int_t);
                a
            }
        };
        let q = h.str(qualname);
        set_type(h, q, str_t);
        let mut c = vec![0u8; 128];
        c[l.coro_qualname as usize..l.coro_qualname as usize + 8].copy_from_slice(&q.to_le_bytes());
        let coro = h.put(c);
        set_type(h, coro, coro_t);
        let mut t = vec![0u8; 256];
        t[l.task_name as usize..l.task_name as usize + 8].copy_from_slice(&name_obj.to_le_bytes());
        t[l.task_coro as usize..l.task_coro as usize + 8].copy_from_slice(&coro.to_le_bytes());
        let t_at = h.put(t);
        set_type(h, t_at, task_t);
        t_at
    }

    #[test]
    fn describes_tasks_in_every_layout() {
        for minor in 10..=15 {
            let l = TaskLayout::for_version(minor).unwrap();
            let o = if minor >= 12 {
                PY312
            } else if minor == 11 {
                PY311
            } else {
                PY310
            };
            let mut h = Heap::new(o.clone());
            let a = task(&mut h, &l, Some("handler-3"), 0, "handle_request");
            let b = task(&mut h, &l, None, 17, "Server.serve");
            let mut r = AsyncioTasks::default();
            assert_eq!(
                r.describe(&h.mem, &o, &l, a).unwrap(),
                ("handler-3".to_string(), "handle_request".to_string())
            );
            assert_eq!(
                r.describe(&h.mem, &o, &l, b).unwrap(),
                ("Task-17".to_string(), "Server.serve".to_string())
            );
            // Not a task: refused.
            let not = h.str("x");
            let str_t = ty(&mut h, "str");
            set_type(&mut h, not, str_t);
            assert!(r.describe(&h.mem, &o, &l, not).is_err());
        }
    }

    #[test]
    fn current_tasks_by_thread_ident() {
        // sys.modules["asyncio.tasks"]._current_tasks = {loop: task}, loop._thread_id = ident.
        let o = PY310;
        let l = TaskLayout::for_version(10).unwrap();
        let mut h = Heap::new(o.clone());
        let dict_t = h.put(vec![0u8; 512]);
        let t = task(&mut h, &l, Some("handler-0"), 0, "handle_request");
        let k_tid = h.str("_thread_id");
        let ident = h.int(0x7f00_dead_b000);
        let loop_dict = h.dict(dict_t, &[(k_tid, ident)], 1);
        let loop_t = h.put(vec![0u8; 1024]);
        let mut lt = vec![0u8; 1024];
        let off = crate::cpython::offsets::TYPE_DICTOFFSET as usize;
        lt[off..off + 8].copy_from_slice(&16u64.to_le_bytes());
        h.mem.map(loop_t, lt);
        let lp = h.put(Heap::words(&[1, loop_t, loop_dict, 0]));
        // A second loop without `_thread_id` (uvloop): left to place.
        let lp2 = h.put(Heap::words(&[1, loop_t, 0, 0]));
        let current = h.dict(dict_t, &[(lp2, t), (lp, t)], 0);
        let k_ct = h.str("_current_tasks");
        let md = h.dict(dict_t, &[(k_ct, current)], 1);
        let module = h.put(Heap::words(&[1, 0, md]));
        let k_mod = h.str("asyncio.tasks");
        let modules = h.dict(dict_t, &[(k_mod, module)], 1);
        let mut interp = vec![0u8; 8192];
        let mo = o.interp_modules.unwrap() as usize;
        interp[mo..mo + 8].copy_from_slice(&modules.to_le_bytes());
        let interp_at = h.put(interp);
        let mut r = AsyncioTasks::default();
        for _ in 0..2 {
            let got = r.current_by_ident(&h.mem, &o, interp_at).unwrap();
            assert_eq!(got.by_ident, HashMap::from([(0x7f00_dead_b000u64, t)]));
            assert_eq!(got.unplaced, vec![(lp2, t)]);
        }
    }

    /// uvloop's loops have no `_thread_id`: a thread's running loop places them (3.10/3.11 a
    /// `_RunningLoopHolder` in the thread state's dict, 3.12 the loop itself, 3.13 a field).
    #[test]
    fn running_loops_of_a_thread_state() {
        for minor in [11u8, 12, 13] {
            let o = if minor == 11 { PY311 } else { PY312 };
            let mut h = Heap::new(o.clone());
            let dict_t = h.put(vec![0u8; 512]);
            let lp = h.put(vec![0u8; 64]);
            let holder_t = ty(&mut h, "_RunningLoopHolder");
            let holder = h.put(Heap::words(&[1, holder_t, lp]));
            let k = h.str("__asyncio_running_event_loop__");
            let v = if minor == 11 { holder } else { lp };
            let d = h.dict(dict_t, &[(k, v)], 1);
            let mut ts = vec![0u8; 1024];
            let at: usize = match minor {
                11 => 128,
                12 => 112,
                _ => 312,
            };
            ts[at..at + 8].copy_from_slice(&(if minor == 13 { lp } else { d }).to_le_bytes());
            let tstate = h.put(ts);
            let mut r = AsyncioTasks {
                dict_type: dict_t,
                ..Default::default()
            };
            assert!(
                r.running_loops(&h.mem, &o, minor, tstate).contains(&lp),
                "3.{minor}"
            );
            assert_eq!(r.errors, 0);
            // A holder of the wrong type is an error, not a loop.
            if minor == 11 {
                set_type(&mut h, holder, dict_t);
                let mut r = AsyncioTasks {
                    dict_type: dict_t,
                    ..Default::default()
                };
                assert!(r.running_loops(&h.mem, &o, minor, tstate).is_empty());
                assert_eq!(r.errors, 1);
            }
        }
    }

    #[test]
    fn asyncio_debug_sections() {
        // Debian 3.14.10's `_asyncio` and 3.15.2's interpreter.
        let w = |v: &[u64]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
        let d314 = w(&[
            0xa8, 0x88, 0x60, 0x6c, 0x6d, 0x80, 0x98, 0x37248, 0x2a80, 0x3a8, 0x360, 0x368, 0x370,
        ]);
        let d = parse_asyncio_debug(&d314).unwrap();
        assert_eq!((d.task_name, d.task_coro), (0x88, 0x80));
        assert_eq!(d.tstate_running_task, 0x368);
        let l = TaskLayout::for_version(14).unwrap();
        assert_eq!((l.task_name, l.task_coro), (d.task_name, d.task_coro));
        assert!(parse_asyncio_debug(&d314[..90]).is_none());
        let mut bad = d314.clone();
        bad[8..16].copy_from_slice(&0x1000u64.to_le_bytes());
        assert!(parse_asyncio_debug(&bad).is_none());
    }

    #[test]
    fn chain_is_the_coroutine_frames_outermost_first() {
        let l = TaskLayout::for_version(12).unwrap();
        let mut mem = FakeMemory::new();
        let code = |i: u64| 0x40_0000 + i * 0x100;
        for (i, flags) in [(0u64, 0x3u32), (1, 0x83), (2, 0x3), (3, 0x83)] {
            let mut b = vec![0u8; 0x100];
            b[48..52].copy_from_slice(&flags.to_le_bytes());
            mem.map(code(i), b);
        }
        let raw = |c: u64| RawFrame {
            code: c,
            instr_offset: 0,
            code_id: 0,
        };
        // innermost first: dumps (plain), render (coro), _run (plain), handle (coro), then an
        // unreadable code object.
        let frames = [
            raw(code(0)),
            raw(code(1)),
            raw(code(2)),
            raw(code(3)),
            raw(0xdead_0000),
        ];
        let got: Vec<u64> = coroutine_frames(&mem, &l, &frames)
            .iter()
            .map(|f| f.code)
            .collect();
        assert_eq!(got, vec![code(3), code(1)]);
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        let mut seed = 0x1234_5678_9abc_def1u64;
        let mut rnd = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for round in 0..300 {
            let mut mem = FakeMemory::new();
            let bases: Vec<u64> = (0..8).map(|i| 0x300_0000 + i * 0x2000).collect();
            for &b in &bases {
                let mut bytes = Vec::with_capacity(8192);
                for _ in 0..1024 {
                    let r = rnd();
                    let w = if r % 3 == 0 {
                        bases[(r >> 8) as usize % bases.len()] + (((r >> 20) % 8000) & !7)
                    } else if r % 3 == 1 {
                        r & 0xff
                    } else {
                        r
                    };
                    bytes.extend_from_slice(&w.to_le_bytes());
                }
                mem.map(b, bytes);
            }
            let o = [PY310, PY311, PY312][round % 3].clone();
            let l = TaskLayout::for_version(10 + (round % 6) as u8).unwrap();
            let mut r = AsyncioTasks::default();
            let _ = r.current_by_ident(&mem, &o, bases[round % bases.len()]);
            let _ = r.describe(&mem, &o, &l, bases[(round + 3) % bases.len()] + 64);
            let frames: Vec<RawFrame> = bases
                .iter()
                .map(|&b| RawFrame {
                    code: b + (rnd() % 8000),
                    instr_offset: 0,
                    code_id: 0,
                })
                .collect();
            let _ = coroutine_frames(&mem, &l, &frames);
            r.dict_type = bases[round % 5];
            let _ = r.running_loops(&mem, &o, 10 + (round % 4) as u8, bases[round % 7]);
        }
    }
}
