//! Where things are inside CPython's structs, per layout epoch.
//!
//! 3.10–3.12: static tables. Every value was produced by the compiler from that version's own
//! internal headers (`tools/pyoffsets.c`; `tests/offsets_match_headers.rs` recompiles it against
//! each installed interpreter and compares line by line), and each field names its header.
//! 3.13+: read at run time from `_Py_DebugOffsets` at the start of `_PyRuntime`
//! (Include/internal/pycore_debug_offsets.h, `pycore_runtime.h` in 3.13), then checked for
//! plausibility before use. The layout of that struct itself differs per minor version; the
//! field order of each epoch is in [`debug_layout`].

use super::memory::MemorySource;
use super::version::PyVersion;

/// How the frame chain is laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum FrameKind {
    /// ≤3.10: `PyFrameObject` chain (`f_back`, `f_code`, `f_lasti` as an int in code units).
    FrameObject,
    /// 3.11+: `_PyInterpreterFrame` chain with an instruction pointer into `co_code_adaptive`.
    Interpreter,
}

/// Where the offsets came from, for `doctor` and bug reports.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub enum OffsetsSource {
    StaticTable,
    DebugOffsets,
}

/// Everything the reader needs, in one flat, version-independent shape.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Offsets {
    pub source: OffsetsSource,
    /// `_PyRuntimeState.interpreters.head` (pycore_runtime.h)
    pub runtime_interpreters_head: u64,
    /// `_PyRuntimeState.main_thread` (pycore_runtime.h): pthread id of the main thread; ≤3.12 only.
    pub runtime_main_thread: Option<u64>,
    /// ≤3.11: `_PyRuntimeState.ceval.gil`, the GIL embedded in the runtime (pycore_runtime.h,
    /// pycore_ceval_state.h / pycore_gil.h).
    pub runtime_gil: Option<u64>,
    /// 3.12+: `PyInterpreterState.ceval.gil`, a pointer to the GIL in use (pycore_interp.h).
    pub interp_ceval_gil_ptr: Option<u64>,
    /// `PyInterpreterState.next` (pycore_interp.h)
    pub interp_next: u64,
    /// `PyInterpreterState.threads.head` (3.11+) / `tstate_head` (3.10) (pycore_interp.h)
    pub interp_threads_head: u64,
    /// `PyInterpreterState.gc` (pycore_interp.h)
    pub interp_gc: u64,
    /// `struct _gc_runtime_state.collecting` (pycore_gc.h; pycore_interp_structs.h in 3.14+)
    pub gc_collecting: u64,
    /// `struct _gil_runtime_state.locked` (pycore_gil.h)
    pub gil_locked: u64,
    /// `struct _gil_runtime_state.last_holder` (pycore_gil.h)
    pub gil_last_holder: u64,
    /// `PyThreadState.next` (cpython/pystate.h)
    pub tstate_next: u64,
    /// `PyThreadState.interp`
    pub tstate_interp: u64,
    /// `PyThreadState.thread_id` (pthread_t)
    pub tstate_thread_id: u64,
    /// `PyThreadState.native_thread_id` (3.11+)
    pub tstate_native_thread_id: Option<u64>,
    /// 3.10 `frame`; 3.11/3.12 `cframe`; 3.13+ `current_frame`
    pub tstate_frame: u64,
    /// 3.11/3.12: `_PyCFrame.current_frame` (read through `tstate->cframe`)
    pub cframe_current_frame: Option<u64>,
    pub frame_kind: FrameKind,
    /// `f_back` (3.10) / `_PyInterpreterFrame.previous` (pycore_frame.h)
    pub frame_previous: u64,
    /// `f_code` (≤3.12) / `f_executable` (3.13+, a `_PyStackRef` in 3.14+)
    pub frame_code: u64,
    /// 3.10 `f_lasti` (int); 3.11/3.12 `prev_instr`; 3.13+ `instr_ptr`
    pub frame_instr: u64,
    /// `_PyInterpreterFrame.owner` (3.12+ where owner marks C-stack shim frames)
    pub frame_owner: Option<u64>,
    /// 3.14+: `f_executable` is a tagged `_PyStackRef`; clear these low bits.
    pub frame_code_tag_mask: u64,
    /// `co_filename` (cpython/code.h)
    pub code_filename: u64,
    /// `co_name`
    pub code_name: u64,
    /// `co_qualname` (3.11+)
    pub code_qualname: Option<u64>,
    /// `co_linetable` (3.10 line table, 3.11+ location table)
    pub code_linetable: u64,
    /// `co_firstlineno` (int)
    pub code_firstlineno: u64,
    /// `co_code_adaptive` (3.11+): the bytecode the instruction pointer points into
    pub code_code_adaptive: Option<u64>,
    /// `PyASCIIObject.length`
    pub unicode_length: u64,
    /// `PyASCIIObject.state` (bitfield: interned:2, kind:3, compact:1, ascii:1)
    pub unicode_state: u64,
    /// `sizeof(PyASCIIObject)`: ASCII data follows it
    pub unicode_ascii_size: u64,
    /// `sizeof(PyCompactUnicodeObject)`: non-ASCII compact data follows it
    pub unicode_compact_size: u64,
    /// `PyBytesObject.ob_base.ob_size`
    pub bytes_size: u64,
    /// `PyBytesObject.ob_sval`
    pub bytes_data: u64,
    /// `PyThreadState.holds_gil` (3.14+; from `_Py_DebugOffsets` in 3.15)
    pub tstate_holds_gil: Option<u64>,
    /// `struct _gc_runtime_state.generation_stats` (pycore_gc.h; pycore_interp_structs.h in
    /// 3.14): per generation `{collections, collected, uncollectable}`, 24 bytes each. Not in
    /// `_Py_DebugOffsets`: 3.13 from its headers, 3.14 measured on 3.14.10 (the counters a
    /// `gc.collect(g)` increments by one); 3.15 from `_Py_DebugOffsets.gc.generation_stats`,
    /// there a pointer to `struct gc_stats` (see `gc_stats_ring`); `None` where unknown.
    pub gc_generation_stats: Option<u64>,
    /// 3.15: `gc_generation_stats` is a pointer to `struct gc_stats`, one ring of cumulative
    /// `struct gc_generation_stats` records (64 bytes: `ts_start`, `ts_stop`, `collections`,
    /// `collected`, ...) per generation: 11 for generation 0 at offset 0, 3 for generations 1
    /// and 2 at 712 and 912, each followed by an `int8_t index` of its newest record
    /// (pycore_interp_structs.h; `gc.get_stats()` reads the newest).
    pub gc_stats_ring: bool,
    /// `PyInterpreterState.modules` (≤3.11) / `imports.modules` (3.12+): `sys.modules`
    /// (pycore_interp.h; `_Py_DebugOffsets.interpreter_state.imports_modules` 3.13+).
    pub interp_modules: Option<u64>,
    /// `PyHeapTypeObject.ht_cached_keys` (cpython/object.h): the keys instances of a class
    /// share (3.11+: their attributes' names when the values live outside a dict). 3.11/3.12
    /// from the headers; 3.13–3.15 are not in `_Py_DebugOffsets`: from 3.13.0's headers,
    /// measured on 3.13.18, 3.14.10 and 3.15.2 (the pointer in a class object whose keys hold an
    /// attribute set on an instance).
    pub heaptype_cached_keys: Option<u64>,
    /// Where instances keep their attributes.
    pub instance_dict: InstanceDict,
    /// Layout of `PyDictKeysObject` (pycore_dict.h).
    pub dict_keys: DictKeysLayout,
    /// 3.12+: `PyLongObject` has `lv_tag` (digit count << 3 | sign) where ≤3.11 has a signed
    /// `ob_size` (pycore_long.h, longintrepr.h); digits follow at 24 in both.
    pub long_tagged: bool,
}

/// Where a class instance keeps its attributes (`PyObject_GenericGetDict`; pycore_object.h).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum InstanceDict {
    /// ≤3.10: a `__dict__` pointer at `tp_dictoffset`.
    DictOffset,
    /// 3.11 (`Py_TPFLAGS_MANAGED_DICT`): the dict pointer 3 words before the object, or when
    /// that is NULL the values pointer 4 words before it (names in `ht_cached_keys`).
    Managed311,
    /// 3.12: one tagged word 3 words before the object: a values pointer minus 1 (odd), or a
    /// dict pointer.
    Managed312,
    /// 3.13+ (`Py_TPFLAGS_INLINE_VALUES`): the values inline after the object
    /// (`tp_basicsize`), with a 4-byte header whose `valid` byte says whether they are in use;
    /// else the dict pointer 3 words before the object.
    Inline313,
}

/// `PyDictKeysObject`'s header and where split values start.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum DictKeysLayout {
    /// 3.10: `dk_size` (8), `dk_nentries` (32), indices at 40 (1–8 bytes each by size), then
    /// 24-byte `{hash, key, value}` entries; split values are a plain `PyObject *[]`.
    Py310,
    /// 3.11+: `dk_log2_size` (u8, 8), `dk_log2_index_bytes` (9), `dk_kind` (10),
    /// `dk_nentries` (24), indices at 32; entries of 24 bytes (general) or 16 (`{key, value}`,
    /// unicode and split kinds). `values_at`: where `PyDictValues.values` starts (0 in
    /// 3.11/3.12; 8 in 3.13+, after capacity/size/embedded/valid).
    Py311 { values_at: u64 },
}

/// `PyDictObject.ma_keys` (cpython/dictobject.h), 3.10–3.15.
pub(crate) const DICT_MA_KEYS: u64 = 32;
/// `PyDictObject.ma_values`.
pub(crate) const DICT_MA_VALUES: u64 = 40;
/// `PyModuleObject.md_dict` (pycore_moduleobject.h), 3.10–3.15.
pub(crate) const MODULE_MD_DICT: u64 = 16;
/// `PyTypeObject.tp_basicsize` (cpython/object.h), 3.10–3.15.
pub(crate) const TYPE_BASICSIZE: u64 = 32;
/// `PyTypeObject.tp_flags`.
pub(crate) const TYPE_FLAGS: u64 = 168;
/// `PyTypeObject.tp_dictoffset`.
pub(crate) const TYPE_DICTOFFSET: u64 = 288;
/// `Py_TPFLAGS_INLINE_VALUES` (3.13+).
pub(crate) const TPFLAGS_INLINE_VALUES: u64 = 1 << 2;
/// `Py_TPFLAGS_MANAGED_DICT` (3.11+).
pub(crate) const TPFLAGS_MANAGED_DICT: u64 = 1 << 4;

impl Offsets {
    /// The static table for 3.10–3.12, or `None` for other versions.
    pub fn static_table(v: PyVersion) -> Option<Offsets> {
        match v.minor_tuple() {
            (3, 10) => Some(PY310),
            (3, 11) => Some(PY311),
            (3, 12) => Some(PY312),
            _ => None,
        }
    }

    /// `name=value` lines in the same vocabulary as `tools/pyoffsets.c`, for the header check.
    pub fn header_check_lines(&self) -> Vec<String> {
        let mut v: Vec<(&str, u64)> = vec![
            ("runtime.interpreters_head", self.runtime_interpreters_head),
            ("gil.locked", self.gil_locked),
            ("gil.last_holder", self.gil_last_holder),
            ("interp.threads_head", self.interp_threads_head),
            ("interp.next", self.interp_next),
            ("interp.gc", self.interp_gc),
            ("gc.collecting", self.gc_collecting),
            ("tstate.next", self.tstate_next),
            ("tstate.interp", self.tstate_interp),
            ("tstate.thread_id", self.tstate_thread_id),
            ("frame.previous", self.frame_previous),
            ("frame.code", self.frame_code),
            ("code.filename", self.code_filename),
            ("code.name", self.code_name),
            ("code.linetable", self.code_linetable),
            ("code.firstlineno", self.code_firstlineno),
            ("unicode.length", self.unicode_length),
            ("unicode.state", self.unicode_state),
            ("unicode.ascii_size", self.unicode_ascii_size),
            ("unicode.compact_size", self.unicode_compact_size),
            ("bytes.ob_size", self.bytes_size),
            ("bytes.ob_sval", self.bytes_data),
        ];
        if let Some(g) = self.gc_generation_stats {
            v.push(("gc.generation_stats", g));
        }
        let opt: [(&str, Option<u64>); 10] = [
            ("interp.modules", self.interp_modules),
            ("heaptype.cached_keys", self.heaptype_cached_keys),
            ("runtime.gil", self.runtime_gil),
            ("interp.ceval_gil", self.interp_ceval_gil_ptr),
            ("tstate.native_thread_id", self.tstate_native_thread_id),
            ("cframe.current_frame", self.cframe_current_frame),
            ("frame.owner", self.frame_owner),
            ("code.qualname", self.code_qualname),
            ("code.code_adaptive", self.code_code_adaptive),
            ("runtime.main_thread", self.runtime_main_thread),
        ];
        v.extend(opt.iter().filter_map(|(n, o)| o.map(|x| (*n, x))));
        match self.frame_kind {
            FrameKind::FrameObject => {
                v.push(("tstate.frame", self.tstate_frame));
                v.push(("frame.lasti", self.frame_instr));
            }
            FrameKind::Interpreter => {
                v.push(("tstate.cframe", self.tstate_frame));
                v.push(("frame.prev_instr", self.frame_instr));
            }
        }
        let mut lines: Vec<String> = v.iter().map(|(n, x)| format!("{n}={x}")).collect();
        lines.sort();
        lines
    }
}

/// CPython 3.10 (checked against 3.10.13's headers).
pub(crate) const PY310: Offsets = Offsets {
    source: OffsetsSource::StaticTable,
    runtime_interpreters_head: 32, // pycore_runtime.h: _PyRuntimeState.interpreters.head
    runtime_main_thread: Some(72), // pycore_runtime.h: _PyRuntimeState.main_thread
    runtime_gil: Some(352),        // pycore_runtime.h: ceval (struct _ceval_runtime_state).gil
    interp_ceval_gil_ptr: None,
    interp_next: 0,         // pycore_interp.h: struct _is.next
    interp_threads_head: 8, // pycore_interp.h: struct _is.tstate_head
    interp_gc: 616,         // pycore_interp.h: struct _is.gc
    gc_collecting: 200,     // pycore_gc.h: struct _gc_runtime_state.collecting
    gil_locked: 16,         // pycore_gil.h: struct _gil_runtime_state.locked
    gil_last_holder: 8,     // pycore_gil.h: struct _gil_runtime_state.last_holder
    tstate_next: 8,         // cpython/pystate.h: struct _ts.next
    tstate_interp: 16,      // cpython/pystate.h: struct _ts.interp
    tstate_thread_id: 176,  // cpython/pystate.h: struct _ts.thread_id
    tstate_native_thread_id: None,
    tstate_frame: 24, // cpython/pystate.h: struct _ts.frame
    cframe_current_frame: None,
    frame_kind: FrameKind::FrameObject,
    frame_previous: 24, // cpython/frameobject.h: struct _frame.f_back
    frame_code: 32,     // cpython/frameobject.h: struct _frame.f_code
    frame_instr: 96,    // cpython/frameobject.h: struct _frame.f_lasti
    frame_owner: None,
    frame_code_tag_mask: 0,
    code_filename: 104, // cpython/code.h: PyCodeObject.co_filename
    code_name: 112,     // cpython/code.h: PyCodeObject.co_name
    code_qualname: None,
    code_linetable: 120,  // cpython/code.h: PyCodeObject.co_linetable
    code_firstlineno: 40, // cpython/code.h: PyCodeObject.co_firstlineno
    code_code_adaptive: None,
    unicode_length: 16,       // cpython/unicodeobject.h: PyASCIIObject.length
    unicode_state: 32,        // cpython/unicodeobject.h: PyASCIIObject.state
    unicode_ascii_size: 48,   // sizeof(PyASCIIObject) (has wstr)
    unicode_compact_size: 72, // sizeof(PyCompactUnicodeObject)
    bytes_size: 16,           // cpython/bytesobject.h: PyBytesObject.ob_base.ob_size
    bytes_data: 32,           // cpython/bytesobject.h: PyBytesObject.ob_sval
    tstate_holds_gil: None,
    gc_generation_stats: Some(128), // pycore_gc.h: struct _gc_runtime_state.generation_stats
    gc_stats_ring: false,
    interp_modules: Some(856),  // pycore_interp.h: modules
    heaptype_cached_keys: None, // cpython/object.h: PyHeapTypeObject.ht_cached_keys
    instance_dict: InstanceDict::DictOffset,
    dict_keys: DictKeysLayout::Py310,
    long_tagged: false,
};

/// CPython 3.11 (checked against 3.11.7's headers).
pub(crate) const PY311: Offsets = Offsets {
    source: OffsetsSource::StaticTable,
    runtime_interpreters_head: 40, // pycore_runtime.h
    runtime_main_thread: Some(80), // pycore_runtime.h
    runtime_gil: Some(360),        // pycore_runtime.h: ceval.gil
    interp_ceval_gil_ptr: None,
    interp_next: 0,                     // pycore_interp.h
    interp_threads_head: 16,            // pycore_interp.h: threads.head
    interp_gc: 648,                     // pycore_interp.h
    gc_collecting: 200,                 // pycore_gc.h
    gil_locked: 16,                     // pycore_gil.h
    gil_last_holder: 8,                 // pycore_gil.h
    tstate_next: 8,                     // cpython/pystate.h
    tstate_interp: 16,                  // cpython/pystate.h
    tstate_thread_id: 152,              // cpython/pystate.h
    tstate_native_thread_id: Some(160), // cpython/pystate.h
    tstate_frame: 56,                   // cpython/pystate.h: cframe
    cframe_current_frame: Some(8),      // cpython/pystate.h: _PyCFrame.current_frame
    frame_kind: FrameKind::Interpreter,
    frame_previous: 48, // pycore_frame.h: _PyInterpreterFrame.previous
    frame_code: 32,     // pycore_frame.h: _PyInterpreterFrame.f_code
    frame_instr: 56,    // pycore_frame.h: _PyInterpreterFrame.prev_instr
    // 3.11 has no C-stack shim frames; `is_entry` (68) marks frames entered from C, which are real.
    frame_owner: None,
    frame_code_tag_mask: 0,
    code_filename: 112,            // cpython/code.h
    code_name: 120,                // cpython/code.h
    code_qualname: Some(128),      // cpython/code.h
    code_linetable: 136,           // cpython/code.h
    code_firstlineno: 72,          // cpython/code.h
    code_code_adaptive: Some(184), // cpython/code.h
    unicode_length: 16,
    unicode_state: 32,
    unicode_ascii_size: 48,
    unicode_compact_size: 72,
    bytes_size: 16,
    bytes_data: 32,
    tstate_holds_gil: None,
    gc_generation_stats: Some(128), // pycore_gc.h
    gc_stats_ring: false,
    interp_modules: Some(888),       // pycore_interp.h: modules
    heaptype_cached_keys: Some(872), // cpython/object.h: PyHeapTypeObject.ht_cached_keys
    instance_dict: InstanceDict::Managed311,
    dict_keys: DictKeysLayout::Py311 { values_at: 0 },
    long_tagged: false,
};

/// CPython 3.12 (checked against 3.12.1's headers).
pub(crate) const PY312: Offsets = Offsets {
    source: OffsetsSource::StaticTable,
    runtime_interpreters_head: 40, // pycore_runtime.h
    runtime_main_thread: Some(64), // pycore_runtime.h
    runtime_gil: None,
    interp_ceval_gil_ptr: Some(384), // pycore_interp.h: ceval.gil (pycore_ceval_state.h)
    interp_next: 0,                  // pycore_interp.h
    interp_threads_head: 72,         // pycore_interp.h: threads.head
    interp_gc: 112,                  // pycore_interp.h
    gc_collecting: 200,              // pycore_gc.h
    gil_locked: 16,                  // pycore_gil.h
    gil_last_holder: 8,              // pycore_gil.h
    tstate_next: 8,                  // cpython/pystate.h
    tstate_interp: 16,               // cpython/pystate.h
    tstate_thread_id: 136,           // cpython/pystate.h
    tstate_native_thread_id: Some(144), // cpython/pystate.h
    tstate_frame: 56,                // cpython/pystate.h: cframe
    cframe_current_frame: Some(0),   // cpython/pystate.h: _PyCFrame.current_frame
    frame_kind: FrameKind::Interpreter,
    frame_previous: 8,     // pycore_frame.h
    frame_code: 0,         // pycore_frame.h: f_code
    frame_instr: 56,       // pycore_frame.h: prev_instr
    frame_owner: Some(70), // pycore_frame.h: owner (FRAME_OWNED_BY_CSTACK = 3)
    frame_code_tag_mask: 0,
    code_filename: 112,
    code_name: 120,
    code_qualname: Some(128),
    code_linetable: 136,
    code_firstlineno: 68,
    code_code_adaptive: Some(192),
    unicode_length: 16,
    unicode_state: 32,
    unicode_ascii_size: 40, // wstr removed in 3.12
    unicode_compact_size: 56,
    bytes_size: 16,
    bytes_data: 32,
    tstate_holds_gil: None,
    gc_generation_stats: Some(128), // pycore_gc.h
    gc_stats_ring: false,
    interp_modules: Some(944),       // pycore_interp.h: imports.modules
    heaptype_cached_keys: Some(880), // cpython/object.h: PyHeapTypeObject.ht_cached_keys
    instance_dict: InstanceDict::Managed312,
    dict_keys: DictKeysLayout::Py311 { values_at: 0 },
    long_tagged: true,
};

/// Errors found while reading or checking `_Py_DebugOffsets`.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DebugOffsetsError {
    #[error("no _Py_DebugOffsets cookie at _PyRuntime (found {0:?})")]
    Cookie(Vec<u8>),
    #[error("_Py_DebugOffsets says version {found:#x}, the binary says {expected:#x}")]
    VersionMismatch { found: u64, expected: u64 },
    #[error("free-threaded (nogil) CPython builds are not supported yet")]
    FreeThreaded,
    #[error("no _Py_DebugOffsets layout known for Python {0}.{1}")]
    UnknownLayout(u8, u8),
    #[error("_Py_DebugOffsets field {field} = {value} is implausible ({why})")]
    Implausible {
        field: String,
        value: u64,
        why: &'static str,
    },
    #[error("reading _Py_DebugOffsets: {0}")]
    Read(String),
}

/// The field order of `_Py_DebugOffsets` per minor version: sections of `u64`s, in order.
/// `_` marks fields we do not use. 3.13 from Include/internal/pycore_runtime.h (3.13.0),
/// 3.14 from Include/internal/pycore_debug_offsets.h (3.14); 3.15 from the same header as
/// shipped in 3.15.2 (the values were cross-checked on the running interpreter: thread ids,
/// `gc.collecting` during a collection seen from a `gc.callbacks` hook).
pub(crate) fn debug_layout(
    minor: u8,
) -> Option<&'static [(&'static str, &'static [&'static str])]> {
    const L313: &[(&str, &[&str])] = &[
        (
            "runtime_state",
            &["size", "finalizing", "interpreters_head"],
        ),
        (
            "interpreter_state",
            &[
                "size",
                "id",
                "next",
                "threads_head",
                "gc",
                "imports_modules",
                "sysdict",
                "builtins",
                "ceval_gil",
                "gil_runtime_state",
                "gil_runtime_state_enabled",
                "gil_runtime_state_locked",
                "gil_runtime_state_holder",
            ],
        ),
        (
            "thread_state",
            &[
                "size",
                "prev",
                "next",
                "interp",
                "current_frame",
                "thread_id",
                "native_thread_id",
                "datastack_chunk",
                "status",
            ],
        ),
        (
            "interpreter_frame",
            &[
                "size",
                "previous",
                "executable",
                "instr_ptr",
                "localsplus",
                "owner",
            ],
        ),
        (
            "code_object",
            &[
                "size",
                "filename",
                "name",
                "qualname",
                "linetable",
                "firstlineno",
                "argcount",
                "localsplusnames",
                "localspluskinds",
                "co_code_adaptive",
            ],
        ),
        ("pyobject", &["size", "ob_type"]),
        ("type_object", &["size", "tp_name", "tp_repr", "tp_flags"]),
        ("tuple_object", &["size", "ob_item", "ob_size"]),
        ("list_object", &["size", "ob_item", "ob_size"]),
        ("dict_object", &["size", "ma_keys", "ma_values"]),
        ("float_object", &["size", "ob_fval"]),
        ("long_object", &["size", "lv_tag", "ob_digit"]),
        ("bytes_object", &["size", "ob_size", "ob_sval"]),
        (
            "unicode_object",
            &["size", "state", "length", "asciiobject_size"],
        ),
        ("gc", &["size", "collecting"]),
    ];
    const L314: &[(&str, &[&str])] = &[
        (
            "runtime_state",
            &["size", "finalizing", "interpreters_head"],
        ),
        (
            "interpreter_state",
            &[
                "size",
                "id",
                "next",
                "threads_head",
                "threads_main",
                "gc",
                "imports_modules",
                "sysdict",
                "builtins",
                "ceval_gil",
                "gil_runtime_state",
                "gil_runtime_state_enabled",
                "gil_runtime_state_locked",
                "gil_runtime_state_holder",
                "code_object_generation",
                "tlbc_generation",
            ],
        ),
        (
            "thread_state",
            &[
                "size",
                "prev",
                "next",
                "interp",
                "current_frame",
                "thread_id",
                "native_thread_id",
                "datastack_chunk",
                "status",
            ],
        ),
        (
            "interpreter_frame",
            &[
                "size",
                "previous",
                "executable",
                "instr_ptr",
                "localsplus",
                "owner",
                "stackpointer",
                "tlbc_index",
            ],
        ),
        (
            "code_object",
            &[
                "size",
                "filename",
                "name",
                "qualname",
                "linetable",
                "firstlineno",
                "argcount",
                "localsplusnames",
                "localspluskinds",
                "co_code_adaptive",
                "co_tlbc",
            ],
        ),
        ("pyobject", &["size", "ob_type"]),
        ("type_object", &["size", "tp_name", "tp_repr", "tp_flags"]),
        ("tuple_object", &["size", "ob_item", "ob_size"]),
        ("list_object", &["size", "ob_item", "ob_size"]),
        ("set_object", &["size", "used", "table", "mask"]),
        ("dict_object", &["size", "ma_keys", "ma_values"]),
        ("float_object", &["size", "ob_fval"]),
        ("long_object", &["size", "lv_tag", "ob_digit"]),
        ("bytes_object", &["size", "ob_size", "ob_sval"]),
        (
            "unicode_object",
            &["size", "state", "length", "asciiobject_size"],
        ),
        ("gc", &["size", "collecting"]),
    ];
    const L315: &[(&str, &[&str])] = &[
        (
            "runtime_state",
            &["size", "finalizing", "interpreters_head"],
        ),
        (
            "interpreter_state",
            &[
                "size",
                "id",
                "next",
                "threads_head",
                "threads_main",
                "gc",
                "imports_modules",
                "sysdict",
                "builtins",
                "ceval_gil",
                "gil_runtime_state",
                "gil_runtime_state_enabled",
                "gil_runtime_state_locked",
                "gil_runtime_state_holder",
                "code_object_generation",
                "tlbc_generation",
            ],
        ),
        (
            "thread_state",
            &[
                "size",
                "prev",
                "next",
                "interp",
                "current_frame",
                "base_frame",
                "last_profiled_frame",
                "_",
                "thread_id",
                "native_thread_id",
                "datastack_chunk",
                "status",
                "holds_gil",
                "gil_requested",
                "current_exception",
                "exc_state",
            ],
        ),
        ("err_stackitem", &["exc_value"]),
        (
            "interpreter_frame",
            &[
                "size",
                "previous",
                "executable",
                "instr_ptr",
                "localsplus",
                "owner",
                "stackpointer",
                "tlbc_index",
            ],
        ),
        (
            "code_object",
            &[
                "size",
                "filename",
                "name",
                "qualname",
                "linetable",
                "firstlineno",
                "argcount",
                "localsplusnames",
                "localspluskinds",
                "co_code_adaptive",
                "co_tlbc",
            ],
        ),
        ("pyobject", &["size", "ob_type"]),
        (
            "type_object",
            &["size", "tp_name", "tp_repr", "tp_flags", "_", "_", "_", "_"],
        ),
        ("tuple_object", &["size", "ob_item", "ob_size"]),
        ("list_object", &["size", "ob_item", "ob_size"]),
        ("set_object", &["size", "used", "table", "mask"]),
        ("dict_object", &["size", "ma_keys", "ma_values"]),
        ("float_object", &["size", "ob_fval"]),
        ("long_object", &["size", "lv_tag", "ob_digit"]),
        ("bytes_object", &["size", "ob_size", "ob_sval"]),
        (
            "unicode_object",
            &["size", "state", "length", "asciiobject_size"],
        ),
        ("_", &["_"]),
        (
            "gc",
            &[
                "size",
                "collecting",
                "frame",
                "generation_stats_size",
                "generation_stats",
            ],
        ),
    ];
    match minor {
        13 => Some(L313),
        14 => Some(L314),
        15 => Some(L315),
        _ => None,
    }
}

/// The raw fields of `_Py_DebugOffsets`, by `section.field`.
#[derive(Debug, Clone, Default)]
pub struct DebugOffsets {
    pub fields: std::collections::BTreeMap<String, u64>,
}

impl DebugOffsets {
    fn get(&self, key: &str) -> Result<u64, DebugOffsetsError> {
        self.fields
            .get(key)
            .copied()
            .ok_or_else(|| DebugOffsetsError::Implausible {
                field: key.into(),
                value: 0,
                why: "missing",
            })
    }
}

/// Read `_Py_DebugOffsets` at `runtime_addr` and build [`Offsets`] from it. `expected` is the
/// version found independently (`Py_Version`); `None` accepts what the struct says.
pub fn read_debug_offsets(
    mem: &dyn MemorySource,
    runtime_addr: u64,
    expected: Option<PyVersion>,
) -> Result<(PyVersion, DebugOffsets, Offsets), DebugOffsetsError> {
    let head = mem
        .read_vec(runtime_addr, 24)
        .map_err(|e| DebugOffsetsError::Read(e.to_string()))?;
    if &head[..8] != b"xdebugpy" {
        return Err(DebugOffsetsError::Cookie(head[..8].to_vec()));
    }
    let ver_hex = u64::from_le_bytes(head[8..16].try_into().unwrap_or([0; 8]));
    let free_threaded = u64::from_le_bytes(head[16..24].try_into().unwrap_or([0; 8]));
    let version = PyVersion::from_hex(ver_hex);
    if let Some(exp) = expected {
        // Exact match when either side is a pre-release, else the same minor version.
        let same = if exp.is_prerelease() || version.is_prerelease() {
            exp.hex() == ver_hex
        } else {
            exp.minor_tuple() == version.minor_tuple()
        };
        if !same {
            return Err(DebugOffsetsError::VersionMismatch {
                found: ver_hex,
                expected: exp.hex(),
            });
        }
    }
    if free_threaded != 0 {
        return Err(DebugOffsetsError::FreeThreaded);
    }
    let layout = debug_layout(version.minor)
        .filter(|_| version.major == 3)
        .ok_or(DebugOffsetsError::UnknownLayout(
            version.major,
            version.minor,
        ))?;
    let count: usize = layout.iter().map(|(_, f)| f.len()).sum();
    let raw = mem
        .read_vec(runtime_addr.wrapping_add(24), count * 8)
        .map_err(|e| DebugOffsetsError::Read(e.to_string()))?;
    let mut d = DebugOffsets::default();
    let mut i = 0;
    for (section, fields) in layout {
        for f in fields.iter() {
            let v = u64::from_le_bytes(raw[i * 8..i * 8 + 8].try_into().unwrap_or([0; 8]));
            if *section != "_" && *f != "_" {
                d.fields.insert(format!("{section}.{f}"), v);
            }
            i += 1;
        }
    }
    let offsets = offsets_from_debug(&d, version)?;
    Ok((version, d, offsets))
}

/// Turn checked debug offsets into [`Offsets`].
/// 3.15's ring geometry (see [`Offsets::gc_stats_ring`]): records of [`GC_RING_RECORD`]
/// bytes, `collections` then `collected` at [`GC_RING_COUNTS`] in each.
pub(crate) const GC_RING_RECORD: u32 = 64;
pub(crate) const GC_RING_COUNTS: u32 = 16;
/// Each generation's ring in `struct gc_stats`: (offset, records).
pub(crate) const GC_RINGS_315: [(u32, u32); 3] = [(0, 11), (712, 3), (912, 3)];

/// `gc.generation_stats` of 3.15's `_Py_DebugOffsets`, where the struct it points to has the
/// size of the ring layout we read: 1,112 bytes (three rings and their indexes), or 1,120 with
/// the 8-byte write counter that 3.15.2 adds after them. Another size is another layout:
/// generations are then recorded as unknown rather than read from the wrong place.
fn gc_stats_ring_315(d: &DebugOffsets) -> Option<u64> {
    let size = d.fields.get("gc.generation_stats_size").copied()?;
    let at = d.fields.get("gc.generation_stats").copied()?;
    let gc_size = d.fields.get("gc.size").copied()?;
    ((size == 1112 || size == 1120) && at.checked_add(8).is_some_and(|end| end <= gc_size))
        .then_some(at)
}

pub fn offsets_from_debug(d: &DebugOffsets, v: PyVersion) -> Result<Offsets, DebugOffsetsError> {
    // Each field must lie inside its struct; sizes must be plausible. A wrong layout table or a
    // corrupted struct fails here instead of sending the walker into garbage.
    fn within(
        d: &DebugOffsets,
        section: &str,
        field: &str,
        width: u64,
    ) -> Result<u64, DebugOffsetsError> {
        let size = d.get(&format!("{section}.size"))?;
        let key = format!("{section}.{field}");
        let val = d.get(&key)?;
        if size == 0 || size > (1 << 24) {
            return Err(DebugOffsetsError::Implausible {
                field: format!("{section}.size"),
                value: size,
                why: "struct size out of range",
            });
        }
        if val.checked_add(width).is_none_or(|end| end > size) {
            return Err(DebugOffsetsError::Implausible {
                field: key,
                value: val,
                why: "outside its struct",
            });
        }
        Ok(val)
    }
    let gil_base = within(d, "interpreter_state", "gil_runtime_state", 8)?;
    let gil_locked_abs = within(d, "interpreter_state", "gil_runtime_state_locked", 4)?;
    let gil_holder_abs = within(d, "interpreter_state", "gil_runtime_state_holder", 8)?;
    if gil_locked_abs < gil_base || gil_holder_abs < gil_base {
        return Err(DebugOffsetsError::Implausible {
            field: "interpreter_state.gil_runtime_state_locked".into(),
            value: gil_locked_abs,
            why: "before the GIL struct",
        });
    }
    let pyobject_type = within(d, "pyobject", "ob_type", 8)?;
    if pyobject_type != 8 {
        return Err(DebugOffsetsError::Implausible {
            field: "pyobject.ob_type".into(),
            value: pyobject_type,
            why: "expected 8 on a 64-bit GIL build",
        });
    }
    let ascii_size = d.get("unicode_object.asciiobject_size")?;
    if ascii_size > (1 << 24) {
        return Err(DebugOffsetsError::Implausible {
            field: "unicode_object.asciiobject_size".into(),
            value: ascii_size,
            why: "struct size out of range",
        });
    }
    Ok(Offsets {
        source: OffsetsSource::DebugOffsets,
        runtime_interpreters_head: within(d, "runtime_state", "interpreters_head", 8)?,
        runtime_main_thread: None,
        runtime_gil: None,
        interp_ceval_gil_ptr: Some(within(d, "interpreter_state", "ceval_gil", 8)?),
        interp_next: within(d, "interpreter_state", "next", 8)?,
        interp_threads_head: within(d, "interpreter_state", "threads_head", 8)?,
        interp_gc: within(d, "interpreter_state", "gc", 8)?,
        gc_collecting: within(d, "gc", "collecting", 4)?,
        gil_locked: gil_locked_abs - gil_base,
        gil_last_holder: gil_holder_abs - gil_base,
        tstate_next: within(d, "thread_state", "next", 8)?,
        tstate_interp: within(d, "thread_state", "interp", 8)?,
        tstate_thread_id: within(d, "thread_state", "thread_id", 8)?,
        tstate_native_thread_id: Some(within(d, "thread_state", "native_thread_id", 8)?),
        tstate_frame: within(d, "thread_state", "current_frame", 8)?,
        cframe_current_frame: None,
        frame_kind: FrameKind::Interpreter,
        frame_previous: within(d, "interpreter_frame", "previous", 8)?,
        frame_code: within(d, "interpreter_frame", "executable", 8)?,
        frame_instr: within(d, "interpreter_frame", "instr_ptr", 8)?,
        frame_owner: Some(within(d, "interpreter_frame", "owner", 1)?),
        // 3.14 made f_executable a `_PyStackRef`; its low bits are tags (Py_TAG_BITS).
        frame_code_tag_mask: if v.minor >= 14 { 0b111 } else { 0 },
        code_filename: within(d, "code_object", "filename", 8)?,
        code_name: within(d, "code_object", "name", 8)?,
        code_qualname: Some(within(d, "code_object", "qualname", 8)?),
        code_linetable: within(d, "code_object", "linetable", 8)?,
        code_firstlineno: within(d, "code_object", "firstlineno", 4)?,
        code_code_adaptive: Some(within(d, "code_object", "co_code_adaptive", 2)?),
        unicode_length: within(d, "unicode_object", "length", 8)?,
        unicode_state: within(d, "unicode_object", "state", 4)?,
        unicode_ascii_size: ascii_size,
        // PyCompactUnicodeObject = PyASCIIObject + utf8_length + utf8 (3.12+).
        unicode_compact_size: ascii_size + 16,
        bytes_size: within(d, "bytes_object", "ob_size", 8)?,
        bytes_data: within(d, "bytes_object", "ob_sval", 1)?,
        tstate_holds_gil: d
            .fields
            .get("thread_state.holds_gil")
            .copied()
            .filter(|&o| {
                o.checked_add(4).is_some_and(|end| {
                    end <= d.fields.get("thread_state.size").copied().unwrap_or(0)
                })
            }),
        gc_generation_stats: match v.minor {
            13 => Some(128),
            14 => Some(120),
            15 => gc_stats_ring_315(d),
            _ => None,
        },
        gc_stats_ring: v.minor == 15 && gc_stats_ring_315(d).is_some(),
        interp_modules: Some(within(d, "interpreter_state", "imports_modules", 8)?),
        heaptype_cached_keys: match v.minor {
            13 | 14 => Some(880),
            15 => Some(888),
            _ => None,
        },
        instance_dict: InstanceDict::Inline313,
        dict_keys: DictKeysLayout::Py311 { values_at: 8 },
        long_tagged: true,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpython::memory::FakeMemory;

    /// Found while fuzzing (issue 15): a `_Py_DebugOffsets` header in the last 24 bytes of the
    /// address space overflowed `runtime_addr + 24`.
    #[test]
    fn debug_offsets_at_the_top_of_the_address_space() {
        let mut head = b"xdebugpy".to_vec();
        head.extend_from_slice(&0x030d00f0u64.to_le_bytes());
        head.extend_from_slice(&0u64.to_le_bytes());
        let mut m = FakeMemory::new();
        m.map(u64::MAX - 23, head);
        assert!(read_debug_offsets(&m, u64::MAX - 23, None).is_err());
    }

    /// `_Py_DebugOffsets` of 3.13.0 as read from libpython3.13.so.1.0 on this machine.
    const RAW_3130: &[u64] = &[
        283320, 608, 632, 194968, 7272, 7264, 7344, 7400, 7656, 7640, 7648, 16, 7752, 0, 7768,
        7760, 304, 0, 8, 16, 72, 152, 160, 232, 32, 80, 8, 0, 56, 72, 70, 208, 112, 120, 128, 136,
        68, 52, 96, 104, 200, 16, 8, 416, 24, 88, 168, 32, 24, 16, 40, 24, 16, 48, 32, 40, 24, 16,
        32, 16, 24, 40, 16, 32, 64, 32, 16, 40, 240, 200,
    ];

    fn fake_runtime(version: u64, raw: &[u64]) -> FakeMemory {
        let mut bytes = b"xdebugpy".to_vec();
        bytes.extend_from_slice(&version.to_le_bytes());
        bytes.extend_from_slice(&0u64.to_le_bytes());
        for v in raw {
            bytes.extend_from_slice(&v.to_le_bytes());
        }
        let mut m = FakeMemory::new();
        m.map(0x10000, bytes);
        m
    }

    #[test]
    fn parses_313_debug_offsets() {
        let m = fake_runtime(0x030d00f0, RAW_3130);
        let (v, _, o) = read_debug_offsets(&m, 0x10000, Some(PyVersion::new(3, 13, 0))).unwrap();
        assert_eq!(v.to_string(), "3.13.0");
        assert_eq!(o.runtime_interpreters_head, 632);
        assert_eq!(o.interp_threads_head, 7344);
        assert_eq!(o.gil_locked, 16);
        assert_eq!(o.gil_last_holder, 8);
        assert_eq!(o.tstate_native_thread_id, Some(160));
        assert_eq!(o.frame_owner, Some(70));
        assert_eq!(o.code_code_adaptive, Some(200));
        assert_eq!(o.gc_collecting, 200);
        assert_eq!(o.unicode_ascii_size, 40);
    }

    /// Found by the `walker` fuzz target in a CI smoke run: an offset near 2^64 overflowed
    /// `holds_gil + 4`; the PyASCIIObject size was added to unchecked too.
    #[test]
    fn offsets_near_the_top_of_u64_are_implausible_not_overflows() {
        let m = fake_runtime(0x030d00f0, RAW_3130);
        let (v, d, _) = read_debug_offsets(&m, 0x10000, None).unwrap();
        let mut wild = d.clone();
        wild.fields
            .insert("thread_state.holds_gil".into(), u64::MAX - 1);
        let o = offsets_from_debug(&wild, v).unwrap();
        assert_eq!(o.tstate_holds_gil, None);
        let mut wild = d.clone();
        wild.fields
            .insert("unicode_object.asciiobject_size".into(), u64::MAX - 8);
        assert!(matches!(
            offsets_from_debug(&wild, v),
            Err(DebugOffsetsError::Implausible { .. })
        ));
    }

    /// sid 3.15.2's `_Py_DebugOffsets.gc` (read off the binary): size 176, collecting 112,
    /// frame 120, generation_stats_size 1120, generation_stats 104.
    #[test]
    fn the_315_gc_statistics_are_read_only_in_the_ring_layout_we_know() {
        let gc = |stats_size: u64, at: u64| {
            let mut d = DebugOffsets::default();
            for (k, v) in [
                ("gc.size", 176),
                ("gc.collecting", 112),
                ("gc.generation_stats_size", stats_size),
                ("gc.generation_stats", at),
            ] {
                d.fields.insert(k.into(), v);
            }
            gc_stats_ring_315(&d)
        };
        assert_eq!(gc(1120, 104), Some(104));
        assert_eq!(gc(1112, 104), Some(104));
        // Another ring depth (a free-threaded build has one record per ring) or a pointer
        // outside the struct: unknown, not read from the wrong place.
        assert_eq!(gc(200, 104), None);
        assert_eq!(gc(1120, 170), None);
        assert_eq!(gc(1120, u64::MAX - 4), None);
        assert_eq!(gc_stats_ring_315(&DebugOffsets::default()), None);
        // The rings fit the size they were checked against.
        let (last_off, last_slots) = GC_RINGS_315[2];
        assert_eq!(last_off + last_slots * GC_RING_RECORD + 8, 1112);
    }

    #[test]
    fn rejects_bad_debug_offsets() {
        let m = fake_runtime(0x030d00f0, RAW_3130);
        assert!(matches!(
            read_debug_offsets(&m, 0x10000, Some(PyVersion::new(3, 14, 0))),
            Err(DebugOffsetsError::VersionMismatch { .. })
        ));
        let mut bad = RAW_3130.to_vec();
        bad[16 + 5] = 999; // thread_state.thread_id beyond sizeof(PyThreadState)
        let m = fake_runtime(0x030d00f0, &bad);
        assert!(matches!(
            read_debug_offsets(&m, 0x10000, None),
            Err(DebugOffsetsError::Implausible { .. })
        ));
        let mut m = FakeMemory::new();
        m.map(0x10000, vec![0; 64]);
        assert!(matches!(
            read_debug_offsets(&m, 0x10000, None),
            Err(DebugOffsetsError::Cookie(_))
        ));
        let m = fake_runtime(0x030c00f0, RAW_3130);
        assert!(matches!(
            read_debug_offsets(&m, 0x10000, None),
            Err(DebugOffsetsError::UnknownLayout(3, 12))
        ));
    }
}
