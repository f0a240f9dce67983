//! `record` as a library call and its failure before attaching:
//!
//! * it runs twice in one process after a stop: the stop is a token passed in (a new one per
//!   run), not a process-global flag, and the second run records for its full duration;
//! * a stopped token stops a run at once (the token, not a global, is what it obeys);
//! * `record -o` into a directory that does not exist fails before attaching to anything: the
//!   target given is not even a Python process, and the error is about the directory.

mod common;

use common::*;
use enginescope::record::format::RecordingReader;
use enginescope::sampler::{record, Backend, RecordOptions};
use enginescope::sys::StopToken;
use std::path::Path;
use std::time::{Duration, Instant};

/// Samples written so far to the recording at `path` (a recorder is appending to it).
fn samples_so_far(path: &Path) -> usize {
    let Ok(bytes) = std::fs::read(path) else {
        return 0;
    };
    let mut r = RecordingReader::default();
    if r.feed(&bytes).is_err() {
        return 0;
    }
    r.recording.samples.len()
}

fn run_twice(backend: Backend) {
    let i = interp("pyenv-3.12");
    if !available(&i) {
        return;
    }
    let w = start(&i, "cpu_bound.py", &["--threads", "2", "--duration", "60"]);
    let dir = tempfile::tempdir().unwrap();

    // Run 1: until stopped from another thread, once samples are on disk.
    let first = dir.path().join("first.esrec");
    let opts = RecordOptions {
        backend,
        quiet: true,
        ..RecordOptions::new(vec![w.pid], first.clone())
    };
    let stop = opts.stop.clone();
    let h = std::thread::spawn(move || record(&opts));
    // The recorder flushes every 200 ms: wait for the condition (samples in the file), with a
    // bound so that a recorder that never writes fails the test instead of hanging it.
    let deadline = Instant::now() + Duration::from_secs(60);
    while samples_so_far(&first) < 5 {
        assert!(
            Instant::now() < deadline && !h.is_finished(),
            "no samples in the first run"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    stop.stop();
    let s1 = h.join().unwrap().expect("first run");
    let r1 = enginescope::record::read_recording(&first).unwrap();
    assert_eq!(r1.end.as_ref().unwrap().reason, "stopped by signal");
    assert!(s1.samples >= 5, "{s1:?}");

    // Run 2, same process, new options: records for its whole duration.
    let second = dir.path().join("second.esrec");
    let opts = RecordOptions {
        backend,
        quiet: true,
        duration: Some(Duration::from_millis(1500)),
        ..RecordOptions::new(vec![w.pid], second.clone())
    };
    let s2 = record(&opts).expect("second run");
    let r2 = enginescope::record::read_recording(&second).unwrap();
    assert_eq!(r2.end.as_ref().unwrap().reason, "duration reached");
    assert!(
        s2.duration_s >= 1.5 && s2.samples > 0,
        "the second run records: {s2:?}"
    );
    assert_eq!(r2.meta.backend, s1.backend);

    // A token already stopped ends a run at once (its header and end are still written).
    let third = dir.path().join("third.esrec");
    let stopped = StopToken::new();
    stopped.stop();
    let opts = RecordOptions {
        backend,
        quiet: true,
        duration: Some(Duration::from_secs(30)),
        stop: stopped,
        ..RecordOptions::new(vec![w.pid], third.clone())
    };
    let s3 = record(&opts).expect("third run");
    assert!(s3.duration_s < 10.0, "{s3:?}");
    let r3 = enginescope::record::read_recording(&third).unwrap();
    assert_eq!(r3.end.as_ref().unwrap().reason, "stopped by signal");
}

#[test]
fn record_runs_twice_in_one_process_memory() {
    run_twice(Backend::Memory);
}

#[test]
fn record_runs_twice_in_one_process_bpf() {
    run_twice(Backend::Bpf);
}

#[test]
fn output_into_a_missing_directory_fails_before_attaching() {
    // Our own pid is not a Python process: attaching first would fail with "not Python".
    let me = std::process::id().to_string();
    let o = enginescope(&[
        "record",
        "--pid",
        &me,
        "--duration",
        "1",
        "-o",
        "/nonexistent-enginescope-dir/sub/x.esrec",
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        err.contains("directory /nonexistent-enginescope-dir/sub does not exist"),
        "{err}"
    );
    assert!(
        !err.contains("Python") && !err.contains("recording 1 process"),
        "{err}"
    );
    assert!(!Path::new("/nonexistent-enginescope-dir").exists());
}

/// The filesystem fills during `record` (a 200 KiB tmpfs, 999 Hz on a busy thread: ~60 KiB a
/// second): the recording stops with an error that names the file, says the filesystem is full
/// and what to do, and leaves a recording that reads whole (its counters and end record, kept
/// room for ahead of it) and says where it stopped; the space kept ahead is given back.
#[test]
fn a_full_filesystem_stops_the_recording_readable() {
    let i = interp("pyenv-3.12");
    if !available(&i) {
        return;
    }
    let Some(fs) = TinyFs::mount("200k") else {
        eprintln!("skipped: cannot mount a tmpfs (not root?)");
        return;
    };
    let w = start(&i, "cpu_bound.py", &["--threads", "1", "--duration", "60"]);
    let out = fs.path().join("r.esrec");
    let out_s = out.to_string_lossy().into_owned();
    let pid = w.pid.to_string();
    let o = enginescope(&[
        "record",
        "--pid",
        &pid,
        "--duration",
        "30",
        "--rate",
        "999",
        "-o",
        &out_s,
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert!(
        err.contains(&format!("error: writing {out_s}: the filesystem is full")),
        "{err}"
    );
    assert!(err.contains("hint: free space on that filesystem"), "{err}");
    let r = enginescope::record::read_recording(&out).unwrap();
    assert!(!r.truncated, "the recording must end whole");
    let end = r.end.as_ref().expect("an end record");
    assert!(
        end.reason.starts_with("error: the filesystem is full"),
        "{}",
        end.reason
    );
    assert!(end.duration_ns < 30_000_000_000, "{}", end.duration_ns);
    assert!(r.samples.len() > 100, "{} samples", r.samples.len());
    assert!(r.counters.contains_key("bpf_ringbuf_full_lost"));
    // The blocks kept ahead were given back: the file takes what it holds.
    let meta = std::fs::metadata(&out).unwrap();
    use std::os::unix::fs::MetadataExt;
    assert!(
        meta.blocks() * 512 < meta.len() + 64 * 1024,
        "{} bytes in {} blocks",
        meta.len(),
        meta.blocks()
    );
    let rep = enginescope(&["report", &out_s]);
    let text = String::from_utf8_lossy(&rep.stdout);
    assert!(rep.status.success());
    assert!(
        text.contains("> **Stopped early:** the filesystem is full"),
        "{text}"
    );
    drop(w);
}
