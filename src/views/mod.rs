//! Views over recordings: flamegraph SVG, exports (folded, pprof, speedscope, Chrome trace) and
//! the report. Every view reads a [`Recording`] and a [`Selection`] of its threads
//! (`--pid/--tid/--thread-name`, see [`filter`]) and returns bytes; `main` only reads the file and
//! writes the result (docs/views.md).
//!
//! Shared here: how a frame, a process and a thread are labelled, and which synthetic frames
//! stand for sample flags, so that every format shows the same names.

pub mod anatomy;
pub mod chrome;
pub mod cost;
pub mod diff;
pub mod engines;
pub mod filter;
pub mod findings;
pub mod flame;
pub mod fleet;
pub mod folded;
pub mod gil;
pub mod latency;
pub mod pprof;
pub mod report;
mod report_md;
pub mod speedscope;
pub mod stalls;
pub mod timeline;
pub mod waits;
pub mod windows;

use std::io::Write;
use std::path::Path;

use anyhow::Context;

use crate::record::{flags, Frame, Recording};
pub use filter::{Filter, FilterArgs, Selection};

/// `enginescope export --format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ExportFormat {
    /// Brendan Gregg folded stacks, `a;b;c count` (count = samples).
    Folded,
    /// gzipped pprof `perftools.profiles.Profile` (go tool pprof, Pyroscope, ...).
    Pprof,
    /// speedscope JSON, one sampled profile per thread.
    Speedscope,
    /// Chrome Trace Event JSON (Perfetto, chrome://tracing): per-thread on/off-CPU timeline.
    Chrome,
}

/// `enginescope report --format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ReportFormat {
    /// Versioned JSON (docs/report-schema.md).
    Json,
    /// Markdown tables.
    Md,
}

/// Read a recording and select its threads: the common start of every view command. Warns on
/// stderr when the recording was cut short, and fails when the filter matches no thread.
pub fn open(path: &Path, filter: &FilterArgs) -> anyhow::Result<(Recording, Selection)> {
    let mut rec = crate::record::read_recording(path)?;
    if rec.truncated {
        eprintln!(
            "warning: {} was cut short (recorder killed?); showing everything before the cut",
            path.display()
        );
    }
    if let Some((from, to)) = filter.time_range(rec.duration_ns())? {
        rec.trim(from, to);
    }
    prepare_native(&mut rec, filter.no_native);
    let sel = Filter::new(filter).select(&rec);
    sel.ensure_nonempty(&rec)
        .with_context(|| format!("selecting threads in {}", path.display()))?;
    Ok((rec, sel))
}

/// Native and kernel frames as every view shows them: labelled `[module] function`
/// (`[_pickle] save_list`, `[kernel] futex_wait`), or with `hide` removed from every stack so
/// that views show Python frames only, with the synthetic `[native]` / `[kernel]` leaves as for
/// a recording made without native frames. The frames' descriptions (module, address,
/// build-id) stay in `rec.frame_native` for pprof's mappings.
pub(crate) fn prepare_native(rec: &mut Recording, hide: bool) {
    if rec.frame_native.is_empty() {
        return;
    }
    if hide {
        let native = &rec.frame_native;
        for st in rec.stacks.iter_mut() {
            st.retain(|f| !native.contains_key(f));
        }
        for s in rec.samples.iter_mut() {
            s.flags &= !flags::NATIVE_FRAMES;
        }
        return;
    }
    for (&id, info) in &rec.frame_native {
        let Some(f) = rec.frames.get_mut(id as usize) else {
            continue;
        };
        let module = if info.kind == crate::record::FRAME_KERNEL {
            "kernel".to_string()
        } else {
            crate::native::short_module_name(&info.module)
        };
        f.function = format!("[{module}] {}", f.function);
        f.file = String::new();
        f.line = None;
    }
}

/// Render one export format.
pub fn export(rec: &Recording, sel: &Selection, format: ExportFormat) -> anyhow::Result<Vec<u8>> {
    match format {
        ExportFormat::Folded => Ok(folded::render(rec, sel).into_bytes()),
        ExportFormat::Pprof => pprof::render(rec, sel),
        ExportFormat::Speedscope => speedscope::render(rec, sel),
        ExportFormat::Chrome => chrome::render(rec, sel),
    }
}

/// Render the report with default options.
pub fn report(rec: &Recording, sel: &Selection, format: ReportFormat) -> anyhow::Result<Vec<u8>> {
    report_with(rec, sel, format, &report::ReportOptions::default())
}

/// Render the report.
pub fn report_with(
    rec: &Recording,
    sel: &Selection,
    format: ReportFormat,
    opts: &report::ReportOptions,
) -> anyhow::Result<Vec<u8>> {
    let r = report::Report::build_with(rec, sel, opts);
    match format {
        ReportFormat::Json => {
            let mut v = serde_json::to_vec_pretty(&r).context("serializing the report")?;
            v.push(b'\n');
            Ok(v)
        }
        ReportFormat::Md => Ok(r.to_markdown().into_bytes()),
    }
}

/// Write a view's bytes to `path`, or to stdout when `path` is `-`.
pub(crate) fn write_output(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    if path == Path::new("-") {
        let mut out = std::io::stdout().lock();
        out.write_all(bytes).context("writing to stdout")?;
        return out.flush().context("writing to stdout");
    }
    std::fs::write(path, bytes).with_context(|| format!("writing {}", path.display()))
}

/// The file name, or for package markers (`__init__.py`, `__main__.py`) the folder and the
/// file name: enough to tell frames apart in a flamegraph without full paths.
pub(crate) fn short_file(path: &str) -> &str {
    let mut parts = path.rmatch_indices(['/', '\\']);
    let Some((last, _)) = parts.next() else {
        return path;
    };
    let base = &path[last + 1..];
    if base == "__init__.py" || base == "__main__.py" {
        return match parts.next() {
            Some((prev, _)) => &path[prev + 1..],
            None => path,
        };
    }
    base
}

/// `function (file.py:123)`; `function (file.py)` when the line is unknown.
pub fn frame_label(f: &Frame) -> String {
    let file = short_file(&f.file);
    match (file.is_empty(), f.line) {
        (true, _) => f.function.clone(),
        (false, Some(l)) => format!("{} ({file}:{l})", f.function),
        (false, None) => format!("{} ({file})", f.function),
    }
}

/// Executable name from a command line (`/usr/bin/python3.12 -m x` -> `python3.12`).
fn exe_name(cmdline: &str) -> &str {
    let first = cmdline.split_whitespace().next().unwrap_or("");
    first.rsplit('/').next().unwrap_or(first)
}

/// A process's role where one is known (`EngineCore`), else its executable (`python3.12`).
pub fn process_name(rec: &Recording, pid: i32) -> &str {
    match rec.processes.iter().rev().find(|p| p.pid == pid) {
        Some(p) if !p.role.is_empty() => p.role.as_str(),
        Some(p) if !exe_name(&p.cmdline).is_empty() => exe_name(&p.cmdline),
        _ => "process",
    }
}

/// `python3.12 (pid 123)`, or with the role where one is known (`EngineCore (pid 123)`).
pub(crate) fn process_label(rec: &Recording, pid: i32) -> String {
    format!("{} (pid {pid})", process_name(rec, pid))
}

/// `MainThread (tid 124)`; `thread (tid 124)` when the name is unknown.
pub(crate) fn thread_label(rec: &Recording, pid: i32, tid: i32) -> String {
    let name = rec.thread_name(pid, tid);
    let name = if name.is_empty() { "thread" } else { name };
    format!("{name} (tid {tid})")
}

/// Synthetic frame placed at the root of the Python frames of a stack that could not be read
/// completely, so cut stacks do not merge with real roots.
pub(crate) const PARTIAL_FRAME: &str = "[partial stack]";
/// Synthetic leaf of an off-CPU interval where the thread was preempted (still runnable).
pub(crate) const PREEMPTED_FRAME: &str = "[preempted]";

/// Sample flags that change a stack's shape in every view.
pub(crate) const SHAPE_FLAGS: u8 =
    flags::GC | flags::NATIVE | flags::KERNEL | flags::PARTIAL | flags::NATIVE_FRAMES;

/// Synthetic leaf frames for a sample's flags, outermost first: `[gc]` (a collection was
/// running), `[native]` (CPU outside the interpreter core), `[kernel]` (CPU in kernel mode).
pub(crate) fn flag_leaves(f: u8) -> impl Iterator<Item = &'static str> {
    // With the sample's own native and kernel frames in the stack, no synthetic leaf for them.
    let f = if f & flags::NATIVE_FRAMES != 0 {
        f & !(flags::NATIVE | flags::KERNEL)
    } else {
        f
    };
    [
        (flags::GC, "[gc]"),
        (flags::NATIVE, "[native]"),
        (flags::KERNEL, "[kernel]"),
    ]
    .into_iter()
    .filter(move |(bit, _)| f & bit != 0)
    .map(|(_, name)| name)
}

/// Labels of every frame in the recording's frame table, computed once per view.
pub(crate) struct FrameLabels(Vec<String>);

impl FrameLabels {
    pub fn new(rec: &Recording) -> Self {
        FrameLabels(rec.frames.iter().map(frame_label).collect())
    }

    /// Labels of a stack, outermost first, with the synthetic frames for `shape_flags`
    /// ([`PARTIAL_FRAME`] at the root, [`flag_leaves`] at the leaf).
    pub fn stack<'a>(&'a self, rec: &Recording, stack: u32, shape_flags: u8) -> Vec<&'a str> {
        let ids = rec
            .stacks
            .get(stack as usize)
            .map(Vec::as_slice)
            .unwrap_or(&[]);
        let mut out: Vec<&'a str> = Vec::with_capacity(ids.len() + 3);
        if shape_flags & flags::PARTIAL != 0 {
            out.push(PARTIAL_FRAME);
        }
        out.extend(
            ids.iter()
                .rev()
                .filter_map(|&f| self.0.get(f as usize).map(String::as_str)),
        );
        for leaf in flag_leaves(shape_flags) {
            out.push(leaf);
        }
        out
    }
}

/// `2026-05-01 12:34:56 UTC` from seconds since the Unix epoch.
pub(crate) fn format_utc(unix_s: f64) -> String {
    if !unix_s.is_finite() || unix_s <= 0.0 {
        return "unknown date".into();
    }
    let secs = unix_s as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02} UTC",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

/// ns to seconds, dividing once so that round numbers stay exact (300 ms -> 0.3).
pub fn secs(ns: u64) -> f64 {
    ns as f64 / 1e9
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_file_names() {
        assert_eq!(
            short_file("/usr/lib/python3.12/threading.py"),
            "threading.py"
        );
        assert_eq!(short_file("/x/torch/nn/__init__.py"), "nn/__init__.py");
        assert_eq!(short_file("__init__.py"), "__init__.py");
        assert_eq!(short_file("/__init__.py"), "/__init__.py");
        assert_eq!(short_file("<string>"), "<string>");
        assert_eq!(short_file(""), "");
    }

    #[test]
    fn labels() {
        let f = Frame {
            function: "Model.forward".into(),
            file: "/srv/app/model.py".into(),
            line: Some(42),
        };
        assert_eq!(frame_label(&f), "Model.forward (model.py:42)");
        let f = Frame { line: None, ..f };
        assert_eq!(frame_label(&f), "Model.forward (model.py)");
        assert_eq!(exe_name("/usr/bin/python3.12 -m vllm"), "python3.12");
        assert_eq!(exe_name(""), "");
    }

    /// A recording with one Python frame calling a native one, sampled in native code.
    fn native_recording() -> Recording {
        use crate::record::{NativeFrameInfo, Sample, ThreadInfo, FRAME_NATIVE};
        let mut r = Recording::default();
        r.threads.push(ThreadInfo {
            pid: 1,
            tid: 2,
            name: "main".into(),
            t_ns: 0,
            python_name: None,
        });
        r.frames = vec![
            Frame {
                function: "enqueue".into(),
                file: "/x/mq.py".into(),
                line: Some(3),
            },
            Frame {
                function: "save_list".into(),
                file: "/x/_pickle.cpython-312-x86_64-linux-gnu.so".into(),
                line: None,
            },
        ];
        r.frame_native.insert(
            1,
            NativeFrameInfo {
                kind: FRAME_NATIVE,
                addr: 0x4242,
                module: "/x/_pickle.cpython-312-x86_64-linux-gnu.so".into(),
                build_id: "ab".into(),
            },
        );
        r.stacks = vec![vec![], vec![1, 0]];
        r.samples.push(Sample {
            t_ns: 1,
            pid: 1,
            tid: 2,
            stack: 1,
            flags: flags::NATIVE | flags::NATIVE_FRAMES,
            weight_ns: 1_000_000,
        });
        r
    }

    #[test]
    fn native_frames_labelled_and_hidden() {
        let mut r = native_recording();
        prepare_native(&mut r, false);
        let sel = Filter::new(&FilterArgs::default()).select(&r);
        let folded = folded::render(&r, &sel);
        assert!(
            folded.contains("enqueue (mq.py:3);[_pickle] save_list 1"),
            "{folded}"
        );
        assert!(!folded.contains("[native]"), "{folded}");
        let p = pprof::profile(&r, &sel);
        assert_eq!(p.mapping.len(), 1);
        let name = &p.string_table[p.mapping[0].filename as usize];
        assert_eq!(name, "/x/_pickle.cpython-312-x86_64-linux-gnu.so");
        assert!(p
            .location
            .iter()
            .any(|l| l.address == 0x4242 && l.mapping_id == 1));

        let mut r = native_recording();
        prepare_native(&mut r, true);
        let sel = Filter::new(&FilterArgs::default()).select(&r);
        let folded = folded::render(&r, &sel);
        assert!(folded.contains("enqueue (mq.py:3);[native] 1"), "{folded}");
        assert!(!folded.contains("save_list"), "{folded}");
    }

    #[test]
    fn flag_leaf_order() {
        let all: Vec<_> =
            flag_leaves(flags::KERNEL | flags::GC | flags::NATIVE | flags::GIL).collect();
        assert_eq!(all, ["[gc]", "[native]", "[kernel]"]);
        assert_eq!(flag_leaves(flags::GIL).count(), 0);
    }

    #[test]
    fn utc_dates() {
        assert_eq!(format_utc(0.0), "unknown date");
        assert_eq!(format_utc(951_782_400.0), "2000-02-29 00:00:00 UTC");
        assert_eq!(format_utc(1_700_000_000.5), "2023-11-14 22:13:20 UTC");
    }
}
