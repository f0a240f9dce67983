//! `enginescope dump`: every thread's Python stack, once, without pausing the target.

use std::fmt::Write as _;

use crate::cpython::{PythonProcess, Snapshot};

/// The `python` block of `dump --json` (docs/dump-json.md).
#[derive(Debug, serde::Serialize)]
pub(crate) struct PythonInfo {
    pub version: String,
    pub binary: String,
    pub shared_libpython: bool,
    pub pie: bool,
    pub stripped: bool,
    pub offsets_source: String,
    pub runtime_addr: String,
}

/// `dump --json` output (schema version 1, docs/dump-json.md).
#[derive(Debug, serde::Serialize)]
pub(crate) struct DumpJson<'a> {
    pub schema: u32,
    pub pid: i32,
    pub python: PythonInfo,
    pub threads: &'a [crate::cpython::ThreadSnapshot],
    pub read_errors: u64,
    pub elapsed_ms: f64,
}

pub(crate) fn python_info(p: &PythonProcess) -> PythonInfo {
    PythonInfo {
        version: p.version.to_string(),
        binary: p.binary.path.clone(),
        shared_libpython: p.binary.is_shared_lib,
        pie: p.binary.pie,
        stripped: p.binary.stripped,
        offsets_source: format!("{:?}", p.offsets.source),
        runtime_addr: format!("{:#x}", p.binary.runtime_addr),
    }
}

pub(crate) fn to_json(p: &PythonProcess, s: &Snapshot, elapsed_ms: f64) -> String {
    let d = DumpJson {
        schema: 1,
        pid: p.pid,
        python: python_info(p),
        threads: &s.threads,
        read_errors: s.read_errors,
        elapsed_ms,
    };
    serde_json::to_string_pretty(&d).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
}

/// Human-readable dump, py-spy-like: one block per thread, innermost frame first.
pub(crate) fn to_text(p: &PythonProcess, s: &Snapshot, elapsed_ms: f64) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "Process {}: {}\nPython {} ({}{})  read in {:.2} ms",
        p.pid,
        crate::procinfo::cmdline(p.pid),
        p.version,
        p.binary.path,
        if p.binary.stripped { ", stripped" } else { "" },
        elapsed_ms
    );
    for t in &s.threads {
        let tid = t.tid.map(|x| x.to_string()).unwrap_or_else(|| "?".into());
        let mut flags = Vec::new();
        if t.holds_gil {
            flags.push("holds GIL");
        }
        if t.gc_collecting {
            flags.push("GC running");
        }
        let flags = if flags.is_empty() {
            String::new()
        } else {
            format!(" [{}]", flags.join(", "))
        };
        // The OS name beside the Python name when they differ (before 3.14 every Python
        // thread carries its process's OS name; 3.14+ sets it from the Python name, cut).
        let os = match &t.python_name {
            Some(py) if *py != t.os_name => format!(" (OS name \"{}\")", t.os_name),
            _ => String::new(),
        };
        let _ = writeln!(out, "\nThread {tid} \"{}\"{os}{flags}", t.name);
        if let Some(task) = &t.asyncio_task {
            let _ = writeln!(
                out,
                "    asyncio task \"{}\" ({}), awaiting: {}",
                task.name,
                task.coro,
                if task.chain.is_empty() {
                    "?".to_string()
                } else {
                    task.chain.join(" -> ")
                }
            );
        }
        if t.frames.is_empty() {
            let _ = writeln!(out, "    (no Python frames)");
        }
        for f in &t.frames {
            let line = f.line.map(|l| l.to_string()).unwrap_or_else(|| "?".into());
            let _ = writeln!(out, "    {} ({}:{})", f.function, f.file, line);
        }
        if let Some(e) = &t.error {
            let _ = writeln!(out, "    ... stack read stopped: {e}");
        }
    }
    if s.read_errors > 0 {
        let _ = writeln!(out, "\n{} read error(s) skipped", s.read_errors);
    }
    out
}
