//! `enginescope top` end to end: plain text when stdout is not a terminal, the dashboard in a
//! real terminal (tmux) over a replayed recording and over a live workload, and the terminal
//! and the kernel left clean after `q` and after `kill -INT`.
//!
//! Waits are on what the screen shows (tmux capture-pane, polled until a deadline): readiness,
//! not a guess at how long something takes.

mod common;

use common::tmux::*;
use common::*;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use enginescope::record::{
    flags, EndInfo, EngineInfo, Frame, FunctionCall, GcPause, GilWait, Meta, MetricPoint,
    MetricSeries, ProbeInfo, ProcessInfo, RecordingWriter, Sample, ThreadInfo,
};

const MS: u64 = 1_000_000;

fn frames(names: &[&str], file: &str) -> Vec<Frame> {
    names
        .iter()
        .map(|n| Frame {
            function: n.to_string(),
            file: file.to_string(),
            line: Some(10),
        })
        .collect()
}

/// A 6 s recording of an engine with known shares: `launcher` on CPU 30% of the time (GIL
/// held) and waiting for the GIL 50% of it, on `aux-writer` (60% CPU) running
/// `AuxOutputStore._evict_to_fit`; one GC pause per second; a probed function; metrics.
fn write_engine_recording(path: &Path) {
    let meta = Meta {
        tool_version: "test".into(),
        backend: "bpf".into(),
        rate_hz: 1000,
        ..Meta::default()
    };
    let mut w = RecordingWriter::create(path, &meta).unwrap();
    for (pid, cmd) in [
        (100, "python3 -m vllm.entrypoints.openai.api_server"),
        (200, "python3"),
    ] {
        w.process(&ProcessInfo {
            pid,
            cmdline: cmd.into(),
            python_version: "3.12.1".into(),
            role: String::new(),
        })
        .unwrap();
    }
    for (pid, tid, name) in [
        (100, 100, "MainThread"),
        (200, 200, "MainThread"),
        (200, 201, "launcher"),
        (200, 202, "aux-writer"),
    ] {
        w.thread(&ThreadInfo {
            pid,
            tid,
            name: name.into(),
            t_ns: 0,
            python_name: None,
        })
        .unwrap();
    }
    w.engine(&EngineInfo {
        id: "engine0".into(),
        api_server_pid: 100,
        engine_core_pids: vec![200],
        metrics_url: "http://127.0.0.1:8000/metrics".into(),
        ..EngineInfo::default()
    })
    .unwrap();
    let launch = w
        .intern_stack(&frames(
            &["Worker.execute_model", "EngineCore.step"],
            "/srv/worker.py",
        ))
        .unwrap();
    let aux = w
        .intern_stack(&frames(
            &["AuxOutputStore._evict_to_fit", "AuxOutputStore.put"],
            "/srv/aux.py",
        ))
        .unwrap();
    for (id, name, kind) in [
        (0, "vllm:generation_tokens_total", "counter"),
        (1, "vllm:kv_cache_usage_perc", "gauge"),
        (2, "vllm:num_requests_running", "gauge"),
        (3, "vllm:num_requests_waiting", "gauge"),
    ] {
        w.series(&MetricSeries {
            id,
            engine: "engine0".into(),
            name: name.into(),
            kind: kind.into(),
            ..MetricSeries::default()
        })
        .unwrap();
    }
    w.probe(&ProbeInfo {
        id: 0,
        spec: "worker.py:Worker.execute_model".into(),
        pid: 200,
        function: "Worker.execute_model".into(),
        file: "/srv/worker.py".into(),
        firstlineno: 1,
        method: "exact".into(),
        resolution_ns: 2000,
        t_ns: 0,
    })
    .unwrap();
    // 60 periods of 100 ms: launcher runs 30 ms, then waits 50 ms for the GIL while the aux
    // writer runs 60 ms.
    for i in 0..60u64 {
        let t0 = i * 100 * MS;
        for ms in 0..30 {
            w.sample(&Sample {
                t_ns: t0 + ms * MS,
                pid: 200,
                tid: 201,
                stack: launch,
                flags: flags::GIL,
                weight_ns: MS as u32,
            })
            .unwrap();
        }
        for ms in 30..90 {
            w.sample(&Sample {
                t_ns: t0 + ms * MS,
                pid: 200,
                tid: 202,
                stack: aux,
                flags: flags::GIL,
                weight_ns: MS as u32,
            })
            .unwrap();
        }
        w.gil_wait(&GilWait {
            pid: 200,
            tid: 201,
            start_ns: t0 + 30 * MS,
            dur_ns: 50 * MS,
            holder_tid: 202,
            holder_stack: aux,
            waiter_stack: launch,
            switch_wait: false,
        })
        .unwrap();
        w.call(&FunctionCall {
            probe: 0,
            pid: 200,
            tid: 201,
            start_ns: t0,
            dur_ns: 80 * MS + (i % 10) * MS,
        })
        .unwrap();
        if i % 10 == 5 {
            w.gc_pause(&GcPause {
                pid: 200,
                tid: 202,
                start_ns: t0 + 85 * MS,
                dur_ns: 4 * MS,
                generation: 2,
                collected: 100,
            })
            .unwrap();
        }
        if i % 5 == 0 {
            for (series, value) in [
                (0, 400.0 * i as f64 / 5.0 * 0.5),
                (1, 0.25 + i as f64 / 400.0),
                (2, 8.0),
                (3, (i / 10) as f64),
            ] {
                w.metric(&MetricPoint {
                    t_ns: t0,
                    series,
                    value,
                })
                .unwrap();
            }
        }
    }
    w.finish(&EndInfo {
        duration_ns: 6_000 * MS,
        reason: "duration reached".into(),
    })
    .unwrap();
}

#[test]
fn replay_prints_plain_text_when_stdout_is_not_a_terminal() {
    let dir = tempfile::tempdir().unwrap();
    let rec = dir.path().join("engine.esrec");
    write_engine_recording(&rec);
    let out = Command::new(env!("CARGO_BIN_EXE_enginescope"))
        .args(["top", "--replay"])
        .arg(&rec)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    eprintln!("{text}");
    // One block per 2 s of recording, the last at its end.
    let blocks: Vec<&str> = text.split("[t ").skip(1).collect();
    assert_eq!(blocks.len(), 3, "{text}");
    assert!(blocks[0].starts_with("2.0 s, window 2.0 s]"), "{text}");
    let last = blocks[2];
    assert!(
        last.starts_with("6.0 s, window 6.0 s] recording ended: duration reached"),
        "{last}"
    );
    // The first line holding `needle`; findings lines only when it asks for one.
    let line = |needle: &str| {
        last.lines()
            .filter(|l| needle.starts_with("finding:") || !l.starts_with("finding:"))
            .find(|l| l.contains(needle))
            .unwrap_or_else(|| panic!("no line with {needle:?} in\n{last}"))
    };
    assert_eq!(line("engine0:"), "engine0: API server 100, EngineCore 200");
    assert_eq!(
        line("EngineCore (pid 200)"),
        "EngineCore (pid 200): 3 threads, CPU 90.0%, GIL held 90.0%, GIL wait 50.0%, GC 0.4% \
         | execute_model p50 84.00 ms, 10/s · aux-writer: AuxOutputStore._evict_to_fit 100%"
    );
    // The answer first: the launcher's GIL fight, behind the writer in its eviction scan.
    assert_eq!(
        line("finding:"),
        "finding: gil_contention 50.0%: launcher (tid 201) of EngineCore (pid 200) waits for the GIL 50.0% of the window (60 waits), 100.0% of it behind aux-writer (tid 202) running AuxOutputStore._evict_to_fit"
    );
    assert_eq!(
        line("launcher"),
        "  launcher (tid 201): CPU 30.0%, GIL held 30.0%, GIL wait 50.0%, GC 0.0%, off-CPU 0.0%, top Worker.execute_model (worker.py) 100.0%"
    );
    assert!(
        line("aux-writer (tid").contains("CPU 60.0%")
            && line("aux-writer (tid").contains("GC 0.4%")
    );
    // The quiet thread folded into one counted line (the busiest of each process stays).
    assert_eq!(line("quiet thread"), "  1 quiet thread: 1 MainThread");
    // 200 tokens per 0.5 s: 400 tokens/s; the KV cache's last scrape (5.5 s) was 0.3875.
    let eng = line("engine engine0:");
    assert!(
        eng.starts_with(
            "engine engine0: generation 400.0 tokens/s, KV cache 38.8%, running 8 (window mean 8.0, max 8), waiting 5 (window mean 2.5, max 5)"
        ),
        "{eng}"
    );
}

#[test]
fn replay_dashboard_in_a_real_terminal() {
    let Some(t) = Tmux::start(160, 40) else {
        return;
    };
    let dir = t.replay("engine.esrec", write_engine_recording);
    // Jump to the end at once (] moves one window forward) so the figures are complete.
    t.wait_for("the thread table", |s| {
        s.contains("PID/TID") && s.contains("aux-writer")
    });
    t.keys(&["]"]);
    let s = t.wait_for("the end of the replay", |s| s.contains("recording ended"));
    show("threads (replay)", &s);
    // The first screen line holding `needle`; the findings line only when it asks for it.
    let row = |s: &str, needle: &str| -> String {
        s.lines()
            .filter(|l| needle.contains("gil_contention") || !l.contains(" gil_contention "))
            .find(|l| l.contains(needle))
            .unwrap_or_else(|| panic!("no {needle:?} on screen:\n{s}"))
            .to_string()
    };
    assert!(row(&s, "t 6.0 / 6.0 s").contains("replay engine.esrec"));
    assert!(row(&s, " launcher ").contains("30.0%"));
    // The findings line, under the header.
    assert!(row(&s, " gil_contention ").contains("behind aux-writer"));
    assert!(row(&s, "engine0: API server 100, EngineCore 200").contains("engine"));
    // Detail of the launcher: select it (the busiest, aux-writer, is first), Enter.
    t.keys(&["Down", "Enter"]);
    let s = t.wait_for("the launcher's detail", |s| s.contains("GIL blame"));
    show("thread detail (replay)", &s);
    assert!(row(&s, "aux-writer (202)").contains("AuxOutputStore._evict_to_fit (aux.py)"));
    t.keys(&["Escape"]);
    t.wait_for("the thread table again", |s| s.contains("PID/TID"));
    t.keys(&["Tab"]);
    let s = t.wait_for("the metrics view", |s| s.contains("generation tokens/s"));
    show("metrics (replay)", &s);
    assert!(row(&s, "generation tokens/s").contains("400.0"));
    t.keys(&["Tab"]);
    let s = t.wait_for("the latency view", |s| s.contains("CALLS/S"));
    show("latency (replay)", &s);
    assert!(row(&s, "Worker.execute_model").contains("exact"));
    // A flamegraph of the window, saved where the status line says.
    t.keys(&["f"]);
    let s = t.wait_for("the flamegraph's path", |s| s.contains("saved to"));
    let saved = row(&s, "saved to");
    let path = saved
        .split("saved to ")
        .nth(1)
        .and_then(|p| p.split_whitespace().next())
        .unwrap_or_default()
        .to_string();
    let svg = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}\n{s}"));
    assert!(
        svg.contains("<svg") && svg.contains("_evict_to_fit"),
        "{path}"
    );
    t.keys(&["q"]);
    t.wait_exit();
    t.assert_terminal_restored(dir.path());
}

/// Eight engines with metrics only: engine k generates 100·(k+1) tok/s, its KV usage is
/// 0.9 - 0.1·k, engine5 runs 12 requests (the others 4) and engine2 fails every other scrape.
fn write_fleet_recording(path: &Path) {
    let meta = Meta {
        tool_version: "test".into(),
        backend: "bpf".into(),
        rate_hz: 1000,
        ..Meta::default()
    };
    let mut w = RecordingWriter::create(path, &meta).unwrap();
    let names = [
        ("vllm:generation_tokens_total", "counter"),
        ("vllm:kv_cache_usage_perc", "gauge"),
        ("vllm:num_requests_running", "gauge"),
        ("vllm:num_requests_waiting", "gauge"),
    ];
    for k in 0..8u32 {
        let id = format!("engine{k}");
        w.engine(&EngineInfo {
            id: id.clone(),
            api_server_pid: 1000 + k as i32,
            metrics_url: format!("http://127.0.0.1:{}/metrics", 8000 + k),
            ..EngineInfo::default()
        })
        .unwrap();
        for (i, (name, kind)) in names.iter().enumerate() {
            w.series(&MetricSeries {
                id: k * 4 + i as u32,
                engine: id.clone(),
                name: name.to_string(),
                kind: kind.to_string(),
                ..MetricSeries::default()
            })
            .unwrap();
        }
    }
    for t in 0..=6u64 {
        for k in 0..8u32 {
            if k == 2 && t % 2 == 1 {
                w.scrape_error(&enginescope::record::ScrapeError {
                    t_ns: t * 1000 * MS,
                    engine: "engine2".into(),
                    url: "http://127.0.0.1:8002/metrics".into(),
                    error: "GET http://127.0.0.1:8002/metrics: timed out".into(),
                })
                .unwrap();
                continue;
            }
            let kf = f64::from(k);
            for (i, value) in [
                100.0 * (kf + 1.0) * t as f64,
                0.9 - 0.1 * kf,
                if k == 5 { 12.0 } else { 4.0 },
                0.0,
            ]
            .into_iter()
            .enumerate()
            {
                w.metric(&MetricPoint {
                    t_ns: t * 1000 * MS,
                    series: k * 4 + i as u32,
                    value,
                })
                .unwrap();
            }
        }
    }
    w.finish(&EndInfo {
        duration_ns: 6_000 * MS,
        reason: "duration reached".into(),
    })
    .unwrap();
}

/// The fleet view: one row per engine, sorted by gen tok/s, then (`s`) by KV usage, then
/// (`r`) reversed; the engine missing scrapes shows its coverage.
#[test]
fn fleet_view_in_a_real_terminal() {
    let Some(t) = Tmux::start(140, 30) else {
        return;
    };
    let dir = t.replay("fleet.esrec", write_fleet_recording);
    // No samples in this recording: the thread view waits for them; the header is up.
    t.wait_for("the dashboard", |s| s.contains("Threads │ Metrics"));
    t.keys(&["]"]);
    t.wait_for("the end of the replay", |s| s.contains("recording ended"));
    t.keys(&["Tab"]);
    let engines_in_order = |s: &str| -> Vec<String> {
        s.lines()
            .filter_map(|l| {
                let w = l.strip_prefix('│')?.split_whitespace().next()?;
                w.starts_with("engine").then(|| w.to_string())
            })
            .collect()
    };
    // tmux may be read while a frame is half written (the header new, rows still coming):
    // wait for the whole table, then check it.
    let s = t.wait_for("the fleet table", |s| {
        s.contains("Fleet: 8 engines") && engines_in_order(s).len() == 8
    });
    show("fleet by gen tok/s", &s);
    assert_eq!(
        engines_in_order(&s),
        ["engine7", "engine6", "engine5", "engine4", "engine3", "engine2", "engine1", "engine0"],
        "{s}"
    );
    let row = |s: &str, e: &str| -> String {
        s.lines()
            .find(|l| l.starts_with(&format!("│{e} ")))
            .unwrap_or_else(|| panic!("no {e} row:\n{s}"))
            .to_string()
    };
    let r5 = row(&s, "engine5");
    assert!(
        r5.contains("600.0") && r5.contains("40.0%") && r5.contains(" 12 "),
        "{r5}"
    );
    // engine2: 4 good scrapes (0, 2, 4, 6 s) of 7.
    assert!(
        row(&s, "engine2").contains("57.1%"),
        "{}",
        row(&s, "engine2")
    );
    assert!(
        row(&s, "engine0").contains("100.0%"),
        "{}",
        row(&s, "engine0")
    );
    t.keys(&["s"]);
    // A frame is written as a diff: the header may show the new order before the rows do,
    // so the wait is for the rows too (a wrong order times out with the screen shown).
    let s = t.wait_for("sorted by KV", |s| {
        s.contains("sort: KV")
            && engines_in_order(s).len() == 8
            && engines_in_order(s)[0] == "engine0"
    });
    assert_eq!(engines_in_order(&s)[0], "engine0", "{s}");
    t.keys(&["r"]);
    let s = t.wait_for("reversed", |s| {
        s.contains("sort: KV ↑")
            && engines_in_order(s).len() == 8
            && engines_in_order(s)[0] == "engine7"
    });
    show("fleet by KV, ascending", &s);
    assert_eq!(engines_in_order(&s)[0], "engine7", "{s}");
    t.keys(&["q"]);
    t.wait_exit();
    t.assert_terminal_restored(dir.path());
}

// ---- live: a real workload, BPF, the terminal and the kernel left clean ----

/// Start `top --pid` on a cpu_mix workload in tmux; returns once the workload's threads are on
/// screen, with the top process's pid and the BPF programs it holds.
fn start_live_top(t: &Tmux, w: &Workload) -> (i32, Vec<u64>, String) {
    t.keys(&[
        &format!(
            "cd {} && {} top --pid {} --rate 499 --window 5; echo TOP-EXIT=$?",
            w.dir.display(),
            env!("CARGO_BIN_EXE_enginescope"),
            w.pid
        ),
        "Enter",
    ]);
    let s = t.wait_for("the workload's threads", |s| {
        s.contains("mix-cpu") && s.contains("mix-sleeper") && s.contains("hot_")
    });
    let pid = top_pid(t.shell_pid()).expect("the top process");
    let held = programs_held_by(pid);
    assert!(
        held.len() >= 2,
        "top's recorder should hold its BPF programs: {held:?}"
    );
    (pid, held, s)
}

fn live_setup() -> Option<(Tmux, Workload)> {
    let i = interp("pyenv-3.12");
    if !available(&i) {
        return None;
    }
    let t = Tmux::start(160, 40)?;
    let w = start(
        &i,
        "cpu_mix.py",
        &["--truth", "{dir}/truth.json", "--duration", "600"],
    );
    Some((t, w))
}

#[test]
fn live_dashboard_keys_and_quit() {
    let Some((t, w)) = live_setup() else {
        return;
    };
    let (pid, held, s) = start_live_top(&t, &w);
    show("threads (live cpu_mix)", &s);
    let row = |s: &str, needle: &str| -> String {
        s.lines()
            .find(|l| l.contains(needle))
            .unwrap_or_else(|| panic!("no {needle:?} on screen:\n{s}"))
            .to_string()
    };
    assert!(row(&s, "enginescope top").contains(&format!("live pid {}", w.pid)));
    t.keys(&["Tab"]);
    let s = t.wait_for("the metrics view", |s| s.contains("No engine metrics"));
    show("metrics (live, no engine)", &s);
    t.keys(&["Tab", "Tab"]);
    // Pause only once the window holds 2 s: keys are handled at once, and a dashboard paused
    // in its first half second held one sample of mix-cpu (hot_b), not its 70/30 split.
    t.wait_for("the thread table over 2 s", |s| {
        s.contains("PID/TID") && window_secs(s).is_some_and(|w| w >= 2.0)
    });
    t.keys(&["p"]);
    let s = t.wait_for("pause", |s| s.contains("PAUSED"));
    show("paused", &s);
    t.keys(&["Enter"]);
    let s = t.wait_for("mix-cpu's detail", |s| s.contains("Top functions: self"));
    show("thread detail (live cpu_mix)", &s);
    assert!(row(&s, "hot_a (cpu_mix.py)").contains('%'));
    t.keys(&["q"]);
    t.wait_exit();
    assert!(
        !Path::new(&format!("/proc/{pid}")).exists(),
        "top is still running"
    );
    assert_programs_released(&held);
    t.assert_terminal_restored(&w.dir);
}

#[test]
fn live_dashboard_restores_the_terminal_on_sigint() {
    let Some((t, w)) = live_setup() else {
        return;
    };
    let (pid, held, _) = start_live_top(&t, &w);
    // SAFETY: kill(2) on the top process this test started.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGINT) }, 0);
    t.wait_exit();
    assert_programs_released(&held);
    t.assert_terminal_restored(&w.dir);
}

/// A dashboard whose terminal goes away (its tmux server killed, as when an ssh session
/// drops) ends by itself: a hung-up tty reads as always ready and empty, and `top` once spun
/// on it at full CPU for as long as it was left, deaf to SIGTERM.
#[test]
fn dashboard_exits_when_its_terminal_hangs_up() {
    let Some(t) = Tmux::start(160, 40) else {
        return;
    };
    let _dir = t.replay("engine.esrec", write_engine_recording);
    t.wait_for("the thread table", |s| s.contains("PID/TID"));
    let pid = top_pid(t.shell_pid()).expect("the top process");
    drop(t); // kill-server: the pane's terminal hangs up
    let alive = || {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|s| {
                s.rsplit_once(')')
                    .and_then(|(_, r)| r.split_whitespace().next().map(|st| st != "Z"))
            })
            .unwrap_or(false)
    };
    let t0 = Instant::now();
    while alive() && t0.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(50));
    }
    let still = alive();
    if still {
        // SAFETY: kill(2) on the top process this test started.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    assert!(!still, "top still runs 20 s after its terminal hung up");
}
