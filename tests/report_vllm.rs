//! The report's engine, timeline, function-latency and API-server-stall sections, and the
//! `diff` view, on hand-built recordings whose right answers are known by construction.
//!
//! The vLLM fixture (20 s, clean end):
//! - engine0: API server pid 10, EngineCore pid 20. Scrapes every 1 s from 0 to 20 s:
//!   `vllm:generation_tokens_total` rises 100/s for 10 s then 50/s; `vllm:prompt_tokens_total`
//!   rises 10/s but restarts from zero at 6 s; KV usage 0.25 then 0.75; running 4 then 8;
//!   waiting 0 then 2; the TTFT histogram gains 100 observations (20 <= 0.1 s, 40 in
//!   (0.1, 0.2], 40 in (0.2, 0.4]: median 175 ms) on top of 500 from before the recording;
//!   prefix-cache queries +1000, hits +250. One failed scrape.
//! - EngineCore main thread (20:20) on CPU 100% for 10 s, then 50% with 10% of each window
//!   in GC; worker 20:21 on CPU 10%.
//! - Probe 0 `core.py:EngineCore.step` in pid 20: 10 calls of 1, 2, …, 10 ms ending in the
//!   first 2 s.
//! - API server main thread 10:10: 300 ms of consecutive 1 ms samples in
//!   `JSONEncoder.encode` (json/encoder.py) at 3 s, 50 ms idle in `selectors.py` at 5 s, and
//!   50 ms in a handler at 5.1 s (shorter than the 100 ms threshold).

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use enginescope::record::{
    read_recording, EndInfo, EngineInfo, Frame, FunctionCall, GcPause, Meta, MetricPoint,
    MetricSeries, ProbeInfo, ProcessInfo, Recording, RecordingWriter, Sample, ScrapeError,
    ThreadInfo,
};
use enginescope::views::report::{Report, ReportOptions};
use enginescope::views::{self, ReportFormat, Selection};
use serde_json::Value;

const MS: u64 = 1_000_000;
const S: u64 = 1_000_000_000;

fn frame(function: &str, file: &str, line: i32) -> Frame {
    Frame {
        function: function.into(),
        file: file.into(),
        line: Some(line),
    }
}

fn meta() -> Meta {
    Meta {
        tool_version: "0.1.0".into(),
        start_unix_s: 1_700_000_000.0,
        rate_hz: 1000,
        backend: "bpf".into(),
        hostname: "testhost".into(),
        ..Default::default()
    }
}

fn sample(t_ns: u64, pid: i32, tid: i32, stack: u32, weight_ns: u64) -> Sample {
    Sample {
        t_ns,
        pid,
        tid,
        stack,
        flags: 0,
        weight_ns: weight_ns as u32,
    }
}

/// Writes metric series of one engine and their points.
struct Metrics<'w> {
    w: &'w mut RecordingWriter,
    engine: String,
    next: u32,
}

impl Metrics<'_> {
    fn series(&mut self, name: &str, labels: &[(&str, &str)], kind: &str) -> u32 {
        let id = self.next;
        self.next += 1;
        let mut l: BTreeMap<String, String> = labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        l.insert("model_name".into(), "tiny-moe".into());
        self.w
            .series(&MetricSeries {
                id,
                engine: self.engine.clone(),
                name: name.into(),
                labels: l,
                kind: kind.into(),
            })
            .unwrap();
        id
    }
    fn point(&mut self, t_ns: u64, series: u32, value: f64) {
        self.w
            .metric(&MetricPoint {
                t_ns,
                series,
                value,
            })
            .unwrap();
    }
}

fn write_vllm_fixture(path: &Path) {
    let mut w = RecordingWriter::create(path, &meta()).unwrap();
    for (pid, role, cmd) in [
        (
            10,
            "api_server",
            "python3 -m vllm.entrypoints.openai.api_server",
        ),
        (20, "EngineCore", "VLLM::EngineCore"),
    ] {
        w.process(&ProcessInfo {
            pid,
            cmdline: cmd.into(),
            python_version: "3.12.1".into(),
            role: role.into(),
        })
        .unwrap();
    }
    for (pid, tid, name) in [
        (10, 10, "MainThread"),
        (20, 20, "MainThread"),
        (20, 21, "worker"),
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
        api_server_pid: 10,
        api_server_pids: vec![],
        engine_core_pids: vec![20],
        worker_pids: vec![],
        metrics_url: "http://127.0.0.1:8000/metrics".into(),
        metrics_url_source: "argv".into(),
        t_ns: 0,
    })
    .unwrap();

    // Metrics.
    let mut m = Metrics {
        w: &mut w,
        engine: "engine0".into(),
        next: 0,
    };
    let gen = m.series("vllm:generation_tokens_total", &[], "counter");
    let prompt = m.series("vllm:prompt_tokens_total", &[], "counter");
    let kv = m.series("vllm:kv_cache_usage_perc", &[], "gauge");
    let running = m.series("vllm:num_requests_running", &[], "gauge");
    let waiting = m.series("vllm:num_requests_waiting", &[], "gauge");
    let buckets: Vec<(u32, f64)> = [
        ("0.1", 20.0),
        ("0.2", 60.0),
        ("0.4", 100.0),
        ("+Inf", 100.0),
    ]
    .iter()
    .map(|&(le, delta)| {
        (
            m.series(
                "vllm:time_to_first_token_seconds_bucket",
                &[("le", le)],
                "histogram",
            ),
            delta,
        )
    })
    .collect();
    let ttft_sum = m.series("vllm:time_to_first_token_seconds_sum", &[], "histogram");
    let ttft_count = m.series("vllm:time_to_first_token_seconds_count", &[], "histogram");
    let queries = m.series("vllm:prefix_cache_queries_total", &[], "counter");
    let hits = m.series("vllm:prefix_cache_hits_total", &[], "counter");
    for i in 0..=20u64 {
        let t = i * S;
        let x = i as f64;
        let second = i >= 10;
        m.point(
            t,
            gen,
            if second {
                1000.0 + 50.0 * (x - 10.0)
            } else {
                100.0 * x
            },
        );
        // Restarted at 6 s: 10 tokens counted since.
        m.point(t, prompt, if i <= 5 { 10.0 * x } else { 10.0 * (x - 5.0) });
        m.point(t, kv, if second { 0.75 } else { 0.25 });
        m.point(t, running, if second { 8.0 } else { 4.0 });
        m.point(t, waiting, if second { 2.0 } else { 0.0 });
        let done = i == 20;
        for &(id, delta) in &buckets {
            m.point(t, id, 500.0 + if done { delta } else { 0.0 });
        }
        m.point(t, ttft_sum, 70.0 + if done { 15.0 } else { 0.0 });
        m.point(t, ttft_count, 500.0 + if done { 100.0 } else { 0.0 });
        m.point(t, queries, 5000.0 + 50.0 * x);
        m.point(t, hits, 100.0 + 12.5 * x);
    }
    w.scrape_error(&ScrapeError {
        t_ns: 7 * S,
        engine: "engine0".into(),
        url: "http://127.0.0.1:8000/metrics".into(),
        error: "connection refused".into(),
    })
    .unwrap();

    // EngineCore threads.
    let busy = w
        .intern_stack(&[
            frame("EngineCore.step", "/x/vllm/v1/engine/core.py", 300),
            frame("EngineCore.run_busy_loop", "/x/vllm/v1/engine/core.py", 200),
        ])
        .unwrap();
    for k in 0..2000u64 {
        let t = k * 10 * MS;
        // 100% for 10 s (every 10 ms), then 50% (every other 10 ms).
        if t < 10 * S || k % 2 == 0 {
            w.sample(&sample(t, 20, 20, busy, 10 * MS)).unwrap();
        }
        // The worker: 10%.
        if k % 10 == 0 {
            w.sample(&sample(t, 20, 21, busy, 10 * MS)).unwrap();
        }
    }
    for win in 5..10u64 {
        w.gc_pause(&GcPause {
            pid: 20,
            tid: 20,
            start_ns: win * 2 * S + S / 2,
            dur_ns: 200 * MS,
            generation: 2,
            collected: 10,
        })
        .unwrap();
    }
    w.probe(&ProbeInfo {
        id: 0,
        spec: "core.py:EngineCore.step".into(),
        pid: 20,
        function: "EngineCore.step".into(),
        file: "/x/vllm/v1/engine/core.py".into(),
        firstlineno: 290,
        method: "exact".into(),
        resolution_ns: 2000,
        t_ns: 0,
    })
    .unwrap();
    for d in 1..=10u64 {
        w.call(&FunctionCall {
            probe: 0,
            pid: 20,
            tid: 20,
            start_ns: d * 100 * MS,
            dur_ns: d * MS,
        })
        .unwrap();
    }

    // API server main thread.
    let handler = frame(
        "create_completion",
        "/x/vllm/entrypoints/openai/api_server.py",
        50,
    );
    let encode = w
        .intern_stack(&[
            frame(
                "JSONEncoder.encode",
                "/usr/lib/python3.12/json/encoder.py",
                200,
            ),
            frame("dumps", "/usr/lib/python3.12/json/__init__.py", 231),
            handler.clone(),
        ])
        .unwrap();
    let poll = w
        .intern_stack(&[
            frame(
                "EpollSelector.select",
                "/usr/lib/python3.12/selectors.py",
                468,
            ),
            frame(
                "BaseEventLoop._run_once",
                "/usr/lib/python3.12/asyncio/base_events.py",
                1949,
            ),
        ])
        .unwrap();
    let handle = w.intern_stack(std::slice::from_ref(&handler)).unwrap();
    for k in 0..300 {
        w.sample(&sample(3 * S + k * MS, 10, 10, encode, MS))
            .unwrap();
    }
    for k in 0..50 {
        w.sample(&sample(5 * S + k * MS, 10, 10, poll, MS)).unwrap();
        w.sample(&sample(5 * S + 100 * MS + k * MS, 10, 10, handle, MS))
            .unwrap();
    }
    w.counters(&BTreeMap::from([("bpf_samples".to_string(), 2500)]))
        .unwrap();
    w.finish(&EndInfo {
        duration_ns: 20 * S,
        reason: "duration".into(),
    })
    .unwrap();
}

fn vllm_fixture() -> (tempfile::TempDir, std::path::PathBuf, Recording) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("vllm.esrec");
    write_vllm_fixture(&path);
    let rec = read_recording(&path).unwrap();
    assert!(!rec.truncated);
    (dir, path, rec)
}

fn opts(window_s: u64) -> ReportOptions {
    ReportOptions {
        window_ns: window_s * S,
        ..Default::default()
    }
}

fn report_json(rec: &Recording, o: &ReportOptions) -> Value {
    let bytes = views::report_with(rec, &Selection::all(rec), ReportFormat::Json, o).unwrap();
    serde_json::from_slice(&bytes).unwrap()
}

fn close(a: &Value, b: f64) -> bool {
    a.as_f64().is_some_and(|a| (a - b).abs() < 1e-9)
}

#[track_caller]
fn assert_close(a: &Value, b: f64) {
    assert!(close(a, b), "{a} != {b}");
}

#[test]
fn engines_rates_gauges_and_histogram_quantiles() {
    let (_d, _p, rec) = vllm_fixture();
    let v = report_json(&rec, &opts(10));
    assert_eq!(v["schema"], "enginescope.report/1");
    let engines = v["engines"].as_array().unwrap();
    assert_eq!(engines.len(), 1);
    let e = &engines[0];
    assert_eq!(e["id"], "engine0");
    assert_eq!(e["api_server_pid"], 10);
    assert_eq!(e["engine_core_pids"], serde_json::json!([20]));
    assert_eq!(e["metrics_url"], "http://127.0.0.1:8000/metrics");
    assert_eq!(e["scrapes"], 21);
    // 1000 + 500 tokens over 20 s; the 10 s windows give 100 and 50; the scrapes cover 0-20 s.
    assert_eq!(
        e["gen_tok_s"],
        serde_json::json!({"mean": 75.0, "min": 50.0, "max": 100.0, "covers_s": [0.0, 20.0]})
    );
    // The restart at 6 s is not a drop of 50 tokens: 10/s throughout.
    assert_close(&e["prompt_tok_s"]["mean"], 10.0);
    // 10 scrapes at 0.25, 11 at 0.75.
    assert_close(&e["kv_usage"]["mean"], 10.75 / 21.0);
    assert_eq!(e["kv_usage"]["max"], 0.75);
    assert_eq!(e["running"]["max"], 8.0);
    assert_eq!(e["waiting"]["max"], 2.0);
    // Only the 100 observations made during the recording count: p50 in (0.1, 0.2].
    assert_close(&e["ttft_ms"]["p50"], 175.0);
    assert_close(&e["ttft_ms"]["p90"], 350.0);
    assert_close(&e["ttft_ms"]["mean"], 150.0);
    assert_eq!(e["ttft_ms"]["count"], 100.0);
    // No ITL series: nulls.
    assert_eq!(e["itl_ms"]["p50"], Value::Null);
    assert_eq!(e["prefix_cache_hit_rate"], 0.25);
    assert_eq!(e["scrape_errors"], 1);
    assert_eq!(e["last_scrape_error"], "connection refused");
    assert_eq!(v["engine_imbalance"], Value::Null);
}

#[test]
fn windows_correlations_and_drops() {
    let (_d, _p, rec) = vllm_fixture();
    let v = report_json(&rec, &opts(2));
    assert_eq!(v["window_s"], 2.0);
    assert_eq!(
        v["key_threads"],
        serde_json::json!(["20:20 MainThread", "20:21 worker", "10:10 MainThread"])
    );
    let w = v["windows"].as_array().unwrap();
    assert_eq!(w.len(), 10);
    let w0 = &w[0];
    assert_eq!((&w0["start_s"], &w0["end_s"]), (&0.0.into(), &2.0.into()));
    assert_eq!(
        (
            &w0["gen_tok_s"],
            &w0["kv_usage"],
            &w0["running"],
            &w0["waiting"]
        ),
        (&100.0.into(), &0.25.into(), &4.0.into(), &0.0.into())
    );
    assert_eq!(
        w0["threads"],
        serde_json::json!([
            {"thread": "20:20 MainThread", "cpu_pct": 100.0, "gil_wait_pct": 0.0, "gc_pct": 0.0},
            {"thread": "20:21 worker", "cpu_pct": 10.0, "gil_wait_pct": 0.0, "gc_pct": 0.0},
            {"thread": "10:10 MainThread", "cpu_pct": 0.0, "gil_wait_pct": 0.0, "gc_pct": 0.0},
        ])
    );
    assert_eq!(
        w0["probes"],
        serde_json::json!([{"probe": "20:core.py:EngineCore.step", "calls": 10, "calls_per_s": 5.0,
                            "p50_ms": 5.0, "p90_ms": 9.0}])
    );
    assert_eq!(w0["engines"][0]["id"], "engine0");
    // The API server's 300 ms stall lies in window 1 (15% of 2 s).
    assert_eq!(w[1]["threads"][2]["cpu_pct"], 15.0);
    assert_eq!(w[1]["probes"][0]["p50_ms"], Value::Null);
    let w5 = &w[5];
    assert_eq!(
        (&w5["gen_tok_s"], &w5["kv_usage"]),
        (&50.0.into(), &0.75.into())
    );
    assert_eq!(w5["threads"][0]["cpu_pct"], 50.0);
    assert_eq!(w5["threads"][0]["gc_pct"], 10.0);

    // Correlations: the EngineCore's CPU goes with throughput, its GC against it; the
    // worker's constant 10% and everyone's zero GIL wait are left out.
    let c = v["correlations"].as_array().unwrap();
    let key = |x: &Value| {
        format!(
            "{} {}",
            x["signal"].as_str().unwrap(),
            x["subject"].as_str().unwrap()
        )
    };
    assert_eq!(key(&c[0]), "cpu_pct 20:20 MainThread");
    assert_close(&c[0]["r"], 1.0);
    assert_eq!((&c[0]["n"], &c[0]["note"]), (&10.into(), &"".into()));
    assert_eq!(key(&c[1]), "gc_pct 20:20 MainThread");
    assert_close(&c[1]["r"], -1.0);
    assert!(!c.iter().any(|x| key(x) == "cpu_pct 20:21 worker"));
    assert!(!c.iter().any(|x| x["signal"] == "gil_wait_pct"));
    // p50 exists in one window only.
    let p50 = c.iter().find(|x| x["signal"] == "p50_ms").unwrap();
    assert_eq!((&p50["r"], &p50["n"]), (&Value::Null, &1.into()));
    assert!(p50["note"]
        .as_str()
        .unwrap()
        .contains("1 windows with both values: too few"));

    // Drops: windows 5..9 at 50 tok/s against a median of 75 (threshold 20%: < 60).
    assert_eq!(v["throughput_drop_pct"], 20.0);
    let d = v["throughput_drops"].as_array().unwrap();
    assert_eq!(d.len(), 5);
    assert_eq!(
        (&d[0]["start_s"], &d[0]["gen_tok_s"]),
        (&10.0.into(), &50.0.into())
    );
    assert_eq!(d[0]["median_gen_tok_s"], 75.0);
    assert_close(&d[0]["drop_pct"], 100.0 / 3.0);
    let changed: Vec<String> = d[0]["changed"]
        .as_array()
        .unwrap()
        .iter()
        .map(key)
        .collect();
    assert_eq!(
        changed,
        [
            "cpu_pct 20:20 MainThread",
            "gc_pct 20:20 MainThread",
            "kv_usage engines",
            "running engines",
            "waiting engines"
        ]
    );
    let cpu = &d[0]["changed"][0];
    assert_eq!(
        (&cpu["value"], &cpu["median"], &cpu["change"], &cpu["score"]),
        (&50.0.into(), &75.0.into(), &(-25.0).into(), &1.0.into())
    );
    // A stricter threshold finds none.
    let strict = report_json(
        &rec,
        &ReportOptions {
            drop_pct: 50.0,
            ..opts(2)
        },
    );
    assert_eq!(strict["throughput_drops"], serde_json::json!([]));
}

#[test]
fn function_latency_is_exact() {
    let (_d, _p, rec) = vllm_fixture();
    let v = report_json(&rec, &opts(2));
    let f = v["function_latency"].as_array().unwrap();
    assert_eq!(f.len(), 1);
    let f = &f[0];
    assert_eq!(
        (&f["probe"], &f["function"], &f["file"]),
        (
            &"core.py:EngineCore.step".into(),
            &"EngineCore.step".into(),
            &"/x/vllm/v1/engine/core.py".into()
        )
    );
    assert_eq!(
        (&f["pid"], &f["tid"], &f["thread"]),
        (&20.into(), &20.into(), &"MainThread".into())
    );
    assert_eq!((&f["calls"], &f["calls_per_s"]), (&10.into(), &0.5.into()));
    assert_close(&f["total_s"], 0.055);
    assert_eq!(
        f["latency_ms"],
        serde_json::json!({"p50": 5.0, "p90": 9.0, "p99": 10.0, "max": 10.0, "mean": 5.5})
    );
    assert_eq!(
        (&f["method"], &f["resolution_ms"]),
        (&"exact".into(), &0.002.into())
    );
    let series = f["latency_series"].as_array().unwrap();
    assert_eq!(series.len(), 10);
    assert_eq!(
        series[0],
        serde_json::json!({"start_s": 0.0, "calls": 10, "p50_ms": 5.0, "p90_ms": 9.0})
    );
    assert_eq!(
        series[1],
        serde_json::json!({"start_s": 2.0, "calls": 0, "p50_ms": null, "p90_ms": null})
    );
    // A selection without the calling thread has no rows.
    let sel = enginescope::views::Filter::new(&enginescope::views::FilterArgs {
        pid: Some(10),
        ..Default::default()
    })
    .select(&rec);
    let r = Report::build_with(&rec, &sel, &opts(2));
    assert!(r.function_latency.is_empty());
}

#[test]
fn api_server_stall_and_serialization() {
    let (_d, _p, rec) = vllm_fixture();
    let v = report_json(&rec, &opts(10));
    let st = &v["api_server_stalls"];
    assert_eq!(st["threshold_ms"], 100.0);
    let servers = st["servers"].as_array().unwrap();
    assert_eq!(servers.len(), 1);
    let s = &servers[0];
    assert_eq!((&s["pid"], &s["main_tid"]), (&10.into(), &10.into()));
    assert_close(&s["cpu_s"], 0.4);
    // 300 of 400 ms in json encoding.
    assert_eq!(s["serialization_share"], 0.75);
    assert_eq!(
        s["serialization_top"],
        serde_json::json!([{"function": "JSONEncoder.encode",
                            "file": "/usr/lib/python3.12/json/encoder.py", "cpu_s": 0.3}])
    );
    assert_eq!((&s["stalls"], &s["longest_ms"]), (&1.into(), &300.0.into()));
    // The idle poll and the 50 ms handler run are not stalls.
    let stalls = st["stalls"].as_array().unwrap();
    assert_eq!(stalls.len(), 1);
    let x = &stalls[0];
    assert_eq!(
        (&x["pid"], &x["start_s"], &x["duration_ms"], &x["samples"]),
        (&10.into(), &3.0.into(), &300.0.into(), &300.into())
    );
    assert_eq!(
        (&x["serialization_share"], &x["dominant_share"]),
        (&1.0.into(), &1.0.into())
    );
    assert_eq!(
        x["dominant_stack"],
        serde_json::json!([
            "JSONEncoder.encode (encoder.py:200)",
            "dumps (json/__init__.py:231)",
            "create_completion (api_server.py:50)"
        ])
    );
    // A threshold above 300 ms: none; one below 50 ms: the handler run too.
    let r = Report::build_with(
        &rec,
        &Selection::all(&rec),
        &ReportOptions {
            stall_ns: 300 * MS,
            ..opts(10)
        },
    );
    assert!(r.api_server_stalls.stalls.is_empty());
    let r = Report::build_with(
        &rec,
        &Selection::all(&rec),
        &ReportOptions {
            stall_ns: 40 * MS,
            ..opts(10)
        },
    );
    let d: Vec<f64> = r
        .api_server_stalls
        .stalls
        .iter()
        .map(|s| s.duration_ms)
        .collect();
    assert_eq!(d, [300.0, 50.0]);
}

#[test]
fn engine_imbalance_across_engines() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("two.esrec");
    let mut w = RecordingWriter::create(&path, &meta()).unwrap();
    let mut next = 0;
    for (id, rate, kv) in [("engine0", 100.0, 0.2), ("engine1", 50.0, 0.8)] {
        w.engine(&EngineInfo {
            id: id.into(),
            ..Default::default()
        })
        .unwrap();
        let mut m = Metrics {
            w: &mut w,
            engine: id.into(),
            next,
        };
        let gen = m.series(
            "vllm:generation_tokens_total",
            &[("engine", "0")],
            "counter",
        );
        let kvs = m.series("vllm:kv_cache_usage_perc", &[("engine", "0")], "gauge");
        for i in 0..=10u64 {
            m.point(i * S, gen, rate * i as f64);
            m.point(i * S, kvs, kv);
        }
        next = m.next;
    }
    w.finish(&EndInfo {
        duration_ns: 10 * S,
        reason: "duration".into(),
    })
    .unwrap();
    let rec = read_recording(&path).unwrap();
    let v = report_json(&rec, &opts(10));
    let im = &v["engine_imbalance"];
    assert_eq!(im["engines"], 2);
    assert_eq!(
        im["gen_tok_s"],
        serde_json::json!({"max": 100.0, "max_engine": "engine0", "min": 50.0,
                           "min_engine": "engine1", "max_over_min": 2.0, "spread": 50.0,
                           "near_zero": 1.0})
    );
    assert_close(&im["kv_usage"]["max_over_min"], 4.0);
    assert_eq!(im["kv_usage"]["max_engine"], "engine1");
    assert_eq!(im["running"], Value::Null);
    // The window sums the engines' throughput and averages their KV usage.
    assert_eq!(v["windows"][0]["gen_tok_s"], 150.0);
    assert_close(&v["windows"][0]["kv_usage"], 0.5);
}

#[test]
fn markdown_sections_and_cli_flags() {
    let (dir, path, _rec) = vllm_fixture();
    let out = dir.path().join("report.md");
    let o = Command::new(env!("CARGO_BIN_EXE_enginescope"))
        .args([
            "report",
            path.to_str().unwrap(),
            "--format",
            "md",
            "-o",
            out.to_str().unwrap(),
            "--window",
            "2",
            "--stall-ms",
            "100",
            "--flame-link",
            "flame.svg",
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let md = std::fs::read_to_string(&out).unwrap();
    for want in [
        "## Flamegraphs",
        "- [flame.svg](flame.svg)",
        "## Engines",
        "| engine0 | 10 | 20 | - | http://127.0.0.1:8000/metrics | 21 | 1 |",
        "| engine0 | 75.0 | 50.0 | 100.0 | 10.0 |",
        "| engine0 | 175.0 | 350.0 | 395.0 | - | - | - | - | - | - | - | - | - | - | 100 |",
        "## Per-window timeline",
        "10 windows of 2 s.",
        "| window s | gen tok/s | KV | running | waiting | 20:20 MainThread | 20:21 worker | 10:10 MainThread | 20:core.py:EngineCore.step |",
        "| 0.0 | 100.0 | 25.0% | 4.0 | 0.0 | 100.0 / 0.0 / 0.0 | 10.0 / 0.0 / 0.0 | 0.0 / 0.0 / 0.0 | 5.00 (10) |",
        "### Correlation with gen tok/s",
        "| cpu_pct | 20:20 MainThread | 1.00 | 10 |  |",
        "### Throughput drops",
        "| 10.0-12.0 | 50.0 | 33.3% | cpu_pct 20:20 MainThread: 50.00 (median 75.00);",
        "## Function latency",
        "| EngineCore.step (core.py) | MainThread (tid 20) of EngineCore (pid 20) | 10 | 0.50 | 5.000 | 9.000 | 10.000 | 10.000 | 5.500 | exact | 0.002 |",
        "## API-server stalls",
        "| 10 | 0.400 | 0.400 | 75.0% | 1 | 0.300 | 300.0 |",
        "| 10 | 3.000 | 300.0 | 300 | 0.0 | 0.0 | 100.0% | JSONEncoder.encode (encoder.py:200) ← dumps (json/__init__.py:231) ← create_completion (api_server.py:50) | 100.0% |",
    ] {
        assert!(md.contains(want), "missing {want:?} in\n{md}");
    }
    // Bad flags fail with the reason.
    let o = Command::new(env!("CARGO_BIN_EXE_enginescope"))
        .args(["report", path.to_str().unwrap(), "--window", "0"])
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("--window"));
}

#[test]
fn plain_recordings_have_empty_engine_sections() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("plain.esrec");
    let mut w = RecordingWriter::create(&path, &meta()).unwrap();
    let s = w.intern_stack(&[frame("f", "/a.py", 1)]).unwrap();
    for k in 0..100 {
        w.sample(&sample(k * MS, 1, 1, s, MS)).unwrap();
    }
    w.flush().unwrap();
    drop(w);
    let rec = read_recording(&path).unwrap();
    let r = Report::build(&rec, &Selection::all(&rec));
    assert!(r.engines.is_empty() && r.engine_imbalance.is_none());
    assert!(r.function_latency.is_empty() && r.correlations.is_empty());
    assert!(r.throughput_drops.is_empty() && r.api_server_stalls.servers.is_empty());
    // One window of the 100 ms the recording has.
    assert_eq!(r.windows.len(), 1);
    assert_eq!(r.windows[0].threads[0].cpu_pct, 100.0);
    let md = r.to_markdown();
    for absent in [
        "## Engines",
        "## Per-window",
        "## Function latency",
        "## API-server",
    ] {
        assert!(!md.contains(absent), "{absent} in\n{md}");
    }
}

// ---------------------------------------------------------------- diff

/// One run of a small engine, 10 s: pid `pid` (role EngineCore). MainThread (tid = pid) on
/// CPU 100%, `serialize_share` tenths of it in `serialize`, the rest in `step`; "worker" 10%
/// in `poll`; "noisy" busy for `noisy_s` s starting at `noisy_at` s (so its halves differ).
/// gen tokens at `gen_rate`/s. Probe `core.py:step` with 10 calls per half of `1..=10` ms
/// times `call_scale`.
struct Run {
    pid: i32,
    serialize_tenths: u64,
    noisy_at: u64,
    noisy_s: u64,
    gen_rate: f64,
    call_scale: u64,
}

fn write_run(path: &Path, r: &Run) {
    let mut w = RecordingWriter::create(path, &meta()).unwrap();
    let pid = r.pid;
    w.process(&ProcessInfo {
        pid,
        role: "EngineCore".into(),
        ..Default::default()
    })
    .unwrap();
    for (tid, name) in [(pid, "MainThread"), (pid + 1, "worker"), (pid + 2, "noisy")] {
        w.thread(&ThreadInfo {
            pid,
            tid,
            name: name.into(),
            t_ns: 0,
            python_name: None,
        })
        .unwrap();
    }
    // Different venvs: the same package path.
    let venv = format!("/opt/venv{pid}/lib/python3.11/site-packages/vllm");
    let loop_f = frame("run", &format!("{venv}/core.py"), 1);
    let ser = w
        .intern_stack(&[
            frame("serialize", &format!("{venv}/serial.py"), 10),
            loop_f.clone(),
        ])
        .unwrap();
    let step = w
        .intern_stack(&[
            frame("step", &format!("{venv}/core.py"), 20),
            loop_f.clone(),
        ])
        .unwrap();
    let poll = w.intern_stack(&[frame("poll", "/srv/poll.py", 5)]).unwrap();
    let spin = w.intern_stack(&[frame("spin", "/srv/spin.py", 5)]).unwrap();
    for k in 0..1000u64 {
        let t = k * 10 * MS;
        let stack = if k % 10 < r.serialize_tenths {
            ser
        } else {
            step
        };
        w.sample(&sample(t, pid, pid, stack, 10 * MS)).unwrap();
        if k % 10 == 0 {
            w.sample(&sample(t, pid, pid + 1, poll, 10 * MS)).unwrap();
        }
        if t >= r.noisy_at * S && t < (r.noisy_at + r.noisy_s) * S {
            w.sample(&sample(t, pid, pid + 2, spin, 10 * MS)).unwrap();
        }
    }
    w.engine(&EngineInfo {
        id: "engine0".into(),
        engine_core_pids: vec![pid],
        ..Default::default()
    })
    .unwrap();
    let mut m = Metrics {
        w: &mut w,
        engine: "engine0".into(),
        next: 0,
    };
    let gen = m.series("vllm:generation_tokens_total", &[], "counter");
    for i in 0..=10u64 {
        m.point(i * S, gen, r.gen_rate * i as f64);
    }
    w.probe(&ProbeInfo {
        id: 0,
        spec: "core.py:step".into(),
        pid,
        function: "step".into(),
        method: "exact".into(),
        ..Default::default()
    })
    .unwrap();
    for half in 0..2u64 {
        for d in 1..=10u64 {
            w.call(&FunctionCall {
                probe: 0,
                pid,
                tid: pid,
                start_ns: half * 5 * S + d * 100 * MS,
                dur_ns: d * r.call_scale * MS,
            })
            .unwrap();
        }
    }
    w.finish(&EndInfo {
        duration_ns: 10 * S,
        reason: "duration".into(),
    })
    .unwrap();
}

fn diff_fixture() -> (tempfile::TempDir, std::path::PathBuf, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a.esrec");
    let b = dir.path().join("b.esrec");
    write_run(
        &a,
        &Run {
            pid: 100,
            serialize_tenths: 2,
            noisy_at: 0,
            noisy_s: 1,
            gen_rate: 100.0,
            call_scale: 1,
        },
    );
    write_run(
        &b,
        &Run {
            pid: 200,
            serialize_tenths: 5,
            noisy_at: 6,
            noisy_s: 2,
            gen_rate: 60.0,
            call_scale: 2,
        },
    );
    (dir, a, b)
}

fn figure(v: &Value) -> (Value, Value, Value, Value, Value, bool) {
    (
        v["a"].clone(),
        v["b"].clone(),
        v["delta"].clone(),
        v["noise_a"].clone(),
        v["noise_b"].clone(),
        v["beyond_noise"].as_bool().unwrap(),
    )
}

#[test]
fn diff_matches_threads_functions_probes_and_engines() {
    use enginescope::views::diff::Diff;
    let (_dir, pa, pb) = diff_fixture();
    let (a, b) = (read_recording(&pa).unwrap(), read_recording(&pb).unwrap());
    let d = serde_json::to_value(Diff::build(&pa, &a, &pb, &b, 3)).unwrap();
    assert_eq!(d["schema"], "enginescope.diff/1");
    assert_eq!(
        (&d["a"]["duration_s"], &d["b"]["samples"]),
        (&10.0.into(), &1300.into())
    );

    // Threads by role and name across different pids.
    let threads = d["threads"].as_array().unwrap();
    let t = |name: &str| {
        threads
            .iter()
            .find(|t| t["thread"] == name)
            .unwrap_or_else(|| panic!("no thread {name}"))
    };
    assert_eq!(threads.len(), 3);
    assert_eq!(t("MainThread")["process"], "EngineCore");
    assert_eq!(
        (&t("MainThread")["threads_a"], &t("MainThread")["threads_b"]),
        (&1.into(), &1.into())
    );
    assert_eq!(
        figure(&t("MainThread")["cpu_pct"]),
        (
            100.0.into(),
            100.0.into(),
            0.0.into(),
            0.0.into(),
            0.0.into(),
            false
        )
    );
    // noisy: 1 s of 10 in A (all in the first half: halves 20% and 0%), 2 s in B (second
    // half: 0% and 40%); +10 points is within both runs' own variation.
    assert_eq!(
        figure(&t("noisy")["cpu_pct"]),
        (
            10.0.into(),
            20.0.into(),
            10.0.into(),
            20.0.into(),
            40.0.into(),
            false
        )
    );
    // Largest CPU change first.
    assert_eq!(threads[0]["thread"], "noisy");

    // Functions, as shares of all on-CPU time: A has 12 s of CPU (6.5 s in the first half,
    // 5.5 s in the second: noisy ran early), B 13 s (5.5 and 7.5 s). serialize: 2 s of A's
    // (1 s per half), 5 s of B's (2.5 s per half); step: 8 s and 5 s.
    let f = d["functions"].as_array().unwrap();
    assert_eq!(f.len(), 3);
    let names: Vec<&str> = f.iter().map(|x| x["function"].as_str().unwrap()).collect();
    assert_eq!(names, ["step", "serialize", "spin"]);
    assert_eq!(f[1]["file"], "vllm/serial.py");
    let s = &f[1]["self_pct"];
    assert_close(&s["a"], 200.0 / 12.0);
    assert_close(&s["b"], 500.0 / 13.0);
    assert_close(&s["delta"], 500.0 / 13.0 - 200.0 / 12.0);
    assert_close(&s["noise_a"], 100.0 / 5.5 - 100.0 / 6.5);
    assert_close(&s["noise_b"], 250.0 / 5.5 - 250.0 / 7.5);
    assert_eq!(s["beyond_noise"], true);
    // Innermost only in its own samples; total includes them.
    assert_eq!(f[1]["total_pct"], f[1]["self_pct"]);
    assert_close(&f[0]["self_pct"]["delta"], 500.0 / 13.0 - 800.0 / 12.0);
    assert_eq!(f[0]["self_pct"]["beyond_noise"], true);
    // spin only ran in one half of each run: its change is within the noise.
    assert_eq!(f[2]["self_pct"]["beyond_noise"], false);

    // Probe: per-call latency doubled, calls/s unchanged.
    let p = &d["probes"][0];
    assert_eq!(
        (&p["process"], &p["probe"]),
        (&"EngineCore".into(), &"core.py:step".into())
    );
    assert_eq!(
        figure(&p["p50_ms"]),
        (
            5.0.into(),
            10.0.into(),
            5.0.into(),
            0.0.into(),
            0.0.into(),
            true
        )
    );
    assert_eq!(figure(&p["p90_ms"]).2, 9.0);
    assert_eq!(
        figure(&p["calls_per_s"]),
        (
            2.0.into(),
            2.0.into(),
            0.0.into(),
            0.0.into(),
            0.0.into(),
            false
        )
    );

    // Engine: 100 -> 60 tok/s, steady within each run.
    let e = &d["engines"][0];
    assert_eq!(e["engine"], "engine0");
    assert_eq!(
        figure(&e["gen_tok_s"]),
        (
            100.0.into(),
            60.0.into(),
            (-40.0).into(),
            0.0.into(),
            0.0.into(),
            true
        )
    );
    assert_eq!(e["ttft_p50_ms"]["a"], Value::Null);
}

#[test]
fn diff_cli_markdown_json_and_differential_flamegraph() {
    let (dir, pa, pb) = diff_fixture();
    let md_out = dir.path().join("diff.md");
    let svg = dir.path().join("diff.svg");
    let run = |args: &[&str]| {
        let o = Command::new(env!("CARGO_BIN_EXE_enginescope"))
            .args(args)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        o.stdout
    };
    run(&[
        "diff",
        pa.to_str().unwrap(),
        pb.to_str().unwrap(),
        "-o",
        md_out.to_str().unwrap(),
        "--flame",
        svg.to_str().unwrap(),
    ]);
    let md = std::fs::read_to_string(&md_out).unwrap();
    for want in [
        "# enginescope diff",
        "## Engines",
        "| engine0 | **100.0 → 60.0 (-40.0; noise 0.0/0.0)** |",
        "## Threads",
        "| EngineCore | noisy | 1/1 | 10.0 → 20.0 (+10.0; noise 20.0/40.0) |",
        "## Functions",
        "| serialize | serial.py | **16.7 → 38.5 (+21.8; noise 2.8/12.1)** |",
        "## Probes",
        "| EngineCore | core.py:step | **5.000 → 10.000 (+5.000; noise 0.000/0.000)** |",
    ] {
        assert!(md.contains(want), "missing {want:?} in\n{md}");
    }
    let svg = std::fs::read_to_string(&svg).unwrap();
    assert!(svg.contains("<svg") && svg.contains("Differential on-CPU: a.esrec → b.esrec"));
    // Frames without pids or lines, so both runs share them.
    assert!(
        svg.contains("serialize (serial.py)"),
        "serialize frame missing"
    );
    assert!(!svg.contains("pid 200"));
    let json = run(&[
        "diff",
        pa.to_str().unwrap(),
        pb.to_str().unwrap(),
        "--format",
        "json",
    ]);
    let v: Value = serde_json::from_slice(&json).unwrap();
    assert_eq!(v["functions"].as_array().unwrap().len(), 5);
    assert!(v["noise"].as_str().unwrap().contains("half"));
}

#[test]
fn diff_folded_lines_scale_by_duration() {
    let (_dir, pa, _pb) = diff_fixture();
    let a = read_recording(&pa).unwrap();
    let folded = enginescope::views::diff::diff_folded(&a);
    // serialize: 200 samples of 10 ms over 10 s = 200,000 µs of CPU per s.
    assert!(
        folded.contains("EngineCore;MainThread;run (core.py);serialize (serial.py) 200000\n"),
        "{folded}"
    );
    assert!(
        folded.contains("EngineCore;worker;poll (poll.py) 100000\n"),
        "{folded}"
    );
}

/// An older vLLM's spellings (tests/fixtures/metrics-vllm-0.8.txt: `gpu_cache_usage_perc`,
/// `gpu_prefix_cache_{queries,hits}_total`, `time_per_output_token_seconds`): the report shows
/// KV usage, inter-token latency and the prefix-cache hit rate. Two scrapes, 10 s apart: the
/// first with every counter and histogram at zero (a fresh server), the second the page, so
/// the window's increases are the page's values.
/// A recording of one engine (API server pid 10) scraped twice, 10 s apart: `first` (its
/// counters and histograms taken as 0 there, as at an engine's start) and `second`.
fn two_scrapes(first: &str, second: &str) -> (tempfile::TempDir, enginescope::record::Recording) {
    let parse =
        |page| enginescope::vllm::prom_text::parse(page, enginescope::vllm::metrics::is_kept);
    let (a, b) = (parse(first), parse(second));
    assert_eq!(
        a.bad_lines + b.bad_lines,
        0,
        "{:?} {:?}",
        a.errors,
        b.errors
    );
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("two.esrec");
    let mut w = RecordingWriter::create(&path, &meta()).unwrap();
    w.engine(&EngineInfo {
        id: "engine0".into(),
        api_server_pid: 10,
        metrics_url: "http://127.0.0.1:8000/metrics".into(),
        ..Default::default()
    })
    .unwrap();
    for (id, s) in b.samples.iter().enumerate() {
        w.series(&MetricSeries {
            id: id as u32,
            engine: "engine0".into(),
            name: s.name.clone(),
            labels: s.labels.clone(),
            kind: s.kind.as_str().into(),
        })
        .unwrap();
    }
    for (t_ns, exp) in [(0, &a), (10 * S, &b)] {
        for (id, s) in b.samples.iter().enumerate() {
            let same = exp
                .samples
                .iter()
                .find(|x| x.name == s.name && x.labels == s.labels);
            let counts = s.kind.as_str() != "gauge";
            w.metric(&MetricPoint {
                t_ns,
                series: id as u32,
                value: match same {
                    Some(x) => x.value,
                    None if counts => 0.0,
                    None => s.value,
                },
            })
            .unwrap();
        }
    }
    w.finish(&EndInfo {
        duration_ns: 10 * S,
        reason: "duration".into(),
    })
    .unwrap();
    let rec = read_recording(&path).unwrap();
    (dir, rec)
}

#[test]
fn older_vllm_metric_names_in_the_report() {
    let page = include_str!("fixtures/metrics-vllm-0.8.txt");
    let (_dir, rec) = two_scrapes("", page);
    let v = report_json(&rec, &opts(10));
    let e = &v["engines"][0];
    assert_eq!(e["id"], "engine0");
    // KV usage: 0.4375 in both scrapes.
    assert_close(&e["kv_usage"]["mean"], 0.4375);
    assert_close(&e["kv_usage"]["max"], 0.4375);
    // Prefix cache: 120 hits of 480 queried tokens.
    assert_close(&e["prefix_cache_hit_rate"], 0.25);
    // ITL from time_per_output_token_seconds: 30 observations, 29 <= 10 ms, 30 <= 25 ms.
    assert_close(&e["itl_ms"]["count"], 30.0);
    assert_close(&e["itl_ms"]["p50"], 10.0 * 15.0 / 29.0);
    assert_close(&e["itl_ms"]["p90"], 10.0 * 27.0 / 29.0);
    assert_close(&e["itl_ms"]["p99"], 10.0 + 15.0 * 0.7);
    // p50 and p90 fell in the first bucket: only "at most 10 ms" is known.
    assert_eq!(e["itl_ms"]["p50_bucket"], serde_json::json!([0.0, 10.0]));
    assert_eq!(e["itl_ms"]["p99_bucket"], serde_json::json!([10.0, 25.0]));
    // 0.8 had no per-request TPOT.
    assert_eq!(e["tpot_ms"]["p50"], Value::Null);
    // The names that did not change: 32 generated tokens in 10 s; TTFT 2 observations,
    // one <= 20 ms, one <= 40 ms.
    assert_close(&e["gen_tok_s"]["mean"], 3.2);
    assert_close(&e["ttft_ms"]["p50"], 20.0);
    let md = String::from_utf8(
        views::report_with(&rec, &Selection::all(&rec), ReportFormat::Md, &opts(10)).unwrap(),
    )
    .unwrap();
    let rows: Vec<&str> = md
        .lines()
        .filter(|l| l.starts_with("| engine0 |"))
        .collect();
    // The figures table (KV mean and max, hit rate) and the latency table (ITL p50 and p90
    // inside the first bucket, p99 20.5 ms).
    assert!(
        rows.iter()
            .any(|r| r.matches("43.8%").count() == 2 && r.ends_with("| 25.0% |")),
        "{rows:?}"
    );
    assert!(
        rows.iter().any(|r| r.contains("| ≤10.0 | ≤10.0 | 20.5 |")),
        "{rows:?}"
    );
}

/// A data-parallel engine (one API server, two engine cores; vLLM's `engine` label on each
/// series): the report keeps the engine's row (both ranks together) and adds a row per rank
/// with their imbalance.
#[test]
fn data_parallel_ranks_apart() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("dp.esrec");
    let mut w = RecordingWriter::create(&path, &meta()).unwrap();
    w.engine(&EngineInfo {
        id: "engine0".into(),
        api_server_pid: 10,
        engine_core_pids: vec![20, 21],
        ..Default::default()
    })
    .unwrap();
    let mut m = Metrics {
        w: &mut w,
        engine: "engine0".into(),
        next: 0,
    };
    let gen: Vec<u32> = ["0", "1"]
        .iter()
        .map(|r| m.series("vllm:generation_tokens_total", &[("engine", r)], "counter"))
        .collect();
    let waiting: Vec<u32> = ["0", "1"]
        .iter()
        .map(|r| m.series("vllm:num_requests_waiting", &[("engine", r)], "gauge"))
        .collect();
    for i in 0..=10u64 {
        m.point(i * S, gen[0], 100.0 * i as f64);
        m.point(i * S, gen[1], 50.0 * i as f64);
        m.point(i * S, waiting[0], 0.0);
        m.point(i * S, waiting[1], 3.0);
    }
    w.finish(&EndInfo {
        duration_ns: 10 * S,
        reason: "duration".into(),
    })
    .unwrap();
    let rec = read_recording(&path).unwrap();
    let v = report_json(&rec, &opts(10));
    assert_eq!(v["engines"].as_array().unwrap().len(), 1);
    assert_close(&v["engines"][0]["gen_tok_s"]["mean"], 150.0);
    assert_close(&v["engines"][0]["waiting"]["mean"], 3.0);
    let ranks = v["engine_ranks"].as_array().unwrap();
    let ids: Vec<&str> = ranks.iter().map(|r| r["id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["engine0/dp0", "engine0/dp1"]);
    assert_close(&ranks[0]["gen_tok_s"]["mean"], 100.0);
    assert_close(&ranks[1]["gen_tok_s"]["mean"], 50.0);
    let im = &v["rank_imbalance"];
    assert_close(&im["gen_tok_s"]["max_over_min"], 2.0);
    // Waiting 3 vs 0: a difference, no ratio.
    assert_eq!(im["waiting"]["max_over_min"], Value::Null);
    assert_close(&im["waiting"]["spread"], 3.0);
    assert_eq!(im["waiting"]["max_engine"], "engine0/dp1");
    // Without DP (the other fixtures) neither key is there.
    let (_d, _p, plain) = vllm_fixture();
    let v = report_json(&plain, &opts(10));
    assert!(v.get("engine_ranks").is_none() && v.get("rank_imbalance").is_none());
}

/// vLLM's per-request time per output token and where each quantile's rank fell: 100
/// requests, 40 of TPOT <= 10 ms, 50 in (10, 25], 10 in (25, 50], 1.5 s in all; 10 first
/// tokens, 9 <= 100 ms and one past the last bound.
#[test]
fn tpot_and_the_buckets_quantiles_fall_in() {
    let page = "\
# TYPE vllm:request_time_per_output_token_seconds histogram
vllm:request_time_per_output_token_seconds_bucket{engine=\"0\",le=\"0.01\",model_name=\"m\"} 40.0
vllm:request_time_per_output_token_seconds_bucket{engine=\"0\",le=\"0.025\",model_name=\"m\"} 90.0
vllm:request_time_per_output_token_seconds_bucket{engine=\"0\",le=\"0.05\",model_name=\"m\"} 100.0
vllm:request_time_per_output_token_seconds_bucket{engine=\"0\",le=\"+Inf\",model_name=\"m\"} 100.0
vllm:request_time_per_output_token_seconds_count{engine=\"0\",model_name=\"m\"} 100.0
vllm:request_time_per_output_token_seconds_sum{engine=\"0\",model_name=\"m\"} 1.5
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine=\"0\",le=\"0.1\",model_name=\"m\"} 9.0
vllm:time_to_first_token_seconds_bucket{engine=\"0\",le=\"+Inf\",model_name=\"m\"} 10.0
vllm:time_to_first_token_seconds_count{engine=\"0\",model_name=\"m\"} 10.0
vllm:time_to_first_token_seconds_sum{engine=\"0\",model_name=\"m\"} 3.0
";
    let (_dir, rec) = two_scrapes("", page);
    let v = report_json(&rec, &opts(10));
    let t = &v["engines"][0]["tpot_ms"];
    assert_close(&t["count"], 100.0);
    assert_close(&t["mean"], 15.0);
    // Rank 50: 10 of the 50 in (10, 25]; rank 90: all of them; rank 99: 9 of the 10 above.
    assert_close(&t["p50"], 13.0);
    assert_close(&t["p90"], 25.0);
    assert_close(&t["p99"], 47.5);
    assert_eq!(t["p50_bucket"], serde_json::json!([10.0, 25.0]));
    assert_eq!(t["p99_bucket"], serde_json::json!([25.0, 50.0]));
    let f = &v["engines"][0]["ttft_ms"];
    // Rank 9.9 lies past the last bound: Prometheus answers that bound, a lower bound only.
    assert_close(&f["p99"], 100.0);
    assert_eq!(f["p99_bucket"], serde_json::json!([100.0, null]));
    assert_eq!(f["p50_bucket"], serde_json::json!([0.0, 100.0]));
    let md = String::from_utf8(
        views::report_with(&rec, &Selection::all(&rec), ReportFormat::Md, &opts(10)).unwrap(),
    )
    .unwrap();
    let row = md
        .lines()
        .find(|l| l.starts_with("| engine0 |") && l.contains("| 15.00 |"))
        .unwrap_or_else(|| panic!("no latency row with TPOT mean 15.00:\n{md}"));
    // TTFT p50/p90 inside the first bucket, p99 past the last; TPOT mean, p50, p90, p99.
    assert!(
        row.starts_with("| engine0 | ≤100.0 | ≤100.0 | >100.0 | 15.00 | 13.0 | 25.0 | 47.5 |"),
        "{row}"
    );
}

/// vLLM V1's request time decomposition (queue, prefill, decode, inference): per engine, the
/// mean from `_sum`/`_count` and quantiles from the buckets, and the Markdown table that puts
/// queue + prefill beside TTFT.
#[test]
fn request_time_decomposition() {
    let hist = |name: &str, buckets: &[(&str, f64)], count: f64, sum: f64| {
        let mut s = format!("# TYPE vllm:{name} histogram\n");
        for (le, v) in buckets {
            s.push_str(&format!(
                "vllm:{name}_bucket{{engine=\"0\",le=\"{le}\",model_name=\"m\"}} {v}\n"
            ));
        }
        s.push_str(&format!(
            "vllm:{name}_count{{engine=\"0\",model_name=\"m\"}} {count}\n"
        ));
        s.push_str(&format!(
            "vllm:{name}_sum{{engine=\"0\",model_name=\"m\"}} {sum}\n"
        ));
        s
    };
    // 40 requests: queue mean 50 ms (half <= 10 ms, all <= 100 ms); prefill mean 20 ms;
    // decode mean 400 ms; inference mean 420 ms; TTFT mean 75 ms.
    let page = [
        hist(
            "request_queue_time_seconds",
            &[("0.01", 20.0), ("0.1", 40.0), ("+Inf", 40.0)],
            40.0,
            2.0,
        ),
        hist(
            "request_prefill_time_seconds",
            &[("0.01", 0.0), ("0.05", 40.0), ("+Inf", 40.0)],
            40.0,
            0.8,
        ),
        hist(
            "request_decode_time_seconds",
            &[("0.3", 10.0), ("0.5", 40.0), ("+Inf", 40.0)],
            40.0,
            16.0,
        ),
        hist(
            "request_inference_time_seconds",
            &[("0.3", 10.0), ("0.5", 40.0), ("+Inf", 40.0)],
            40.0,
            16.8,
        ),
        hist(
            "time_to_first_token_seconds",
            &[("0.1", 40.0), ("+Inf", 40.0)],
            40.0,
            3.0,
        ),
    ]
    .concat();
    let (_dir, rec) = two_scrapes("", &page);
    let v = report_json(&rec, &opts(10));
    let e = &v["engines"][0];
    assert_close(&e["queue_ms"]["mean"], 50.0);
    assert_close(&e["queue_ms"]["count"], 40.0);
    // Rank 20 of 40: the top of the first bucket (inside it: only "at most 10 ms").
    assert_close(&e["queue_ms"]["p50"], 10.0);
    assert_close(&e["queue_ms"]["p90"], 10.0 + 90.0 * 16.0 / 20.0);
    assert_close(&e["prefill_ms"]["mean"], 20.0);
    assert_close(&e["prefill_ms"]["p50"], 10.0 + 40.0 * 20.0 / 40.0);
    assert_close(&e["decode_ms"]["mean"], 400.0);
    assert_close(&e["inference_ms"]["mean"], 420.0);
    let md = String::from_utf8(
        views::report_with(&rec, &Selection::all(&rec), ReportFormat::Md, &opts(10)).unwrap(),
    )
    .unwrap();
    assert!(md.contains("Where finished requests' time went"), "{md}");
    let row = md
        .lines()
        .find(|l| l.starts_with("| engine0 | 40 |"))
        .unwrap_or_else(|| panic!("no decomposition row:\n{md}"));
    // queue mean, p50 (inside the first bucket), p90; prefill; decode; inference; TTFT mean
    // 75 beside queue + prefill 70; no E2E histogram.
    assert!(
        row.starts_with("| engine0 | 40 | 50.0 | ≤10.0 | 82.0 | 20.0 | 30.0 | 46.0 | 400.0 |"),
        "{row}"
    );
    assert!(row.ends_with("| 420.0 | 75.0 | 70.0 | - |"), "{row}");
}

/// Speculative decoding and NIXL KV transfers (issue 24), from a page with both
/// (tests/fixtures/metrics-vllm-spec-nixl.txt) scraped at an engine's start and 10 s later:
/// 600 draft tokens in 200 drafts, 450 accepted (rate 75%, 3.25 tokens a step); 50 transfers
/// taking 0.3 s in all (6 ms mean; p50 the 25th of 50: 15 of the 30 in (5, 10] ms = 7.5 ms;
/// p90 the 45th: 5 of the 10 in (10, 20] = 15 ms), 1.5 GB (30 MB each, 5,000 MB/s), 2 failed.
/// An engine without those series has neither object.
#[test]
fn spec_decode_and_kv_transfer_figures_from_their_series() {
    let page = include_str!("fixtures/metrics-vllm-spec-nixl.txt");
    let (_dir, rec) = two_scrapes("", page);
    let v = report_json(&rec, &opts(10));
    let e = &v["engines"][0];
    let d = &e["spec_decode"];
    assert_close(&d["drafts"], 200.0);
    assert_close(&d["draft_tokens"], 600.0);
    assert_close(&d["accepted_tokens"], 450.0);
    assert_close(&d["acceptance_rate"], 0.75);
    assert_close(&d["mean_acceptance_length"], 3.25);
    let k = &e["kv_transfer"];
    assert_close(&k["transfers"], 50.0);
    assert_close(&k["xfer_ms"]["mean"], 6.0);
    assert_close(&k["xfer_ms"]["p50"], 7.5);
    assert_close(&k["xfer_ms"]["p90"], 15.0);
    assert_close(&k["bytes"], 1.5e9);
    assert_close(&k["bytes_per_transfer"], 3e7);
    assert_close(&k["mb_per_s"], 5000.0);
    assert_close(&k["failed_transfers"], 2.0);
    assert_close(&k["failed_notifications"], 0.0);
    let md = String::from_utf8(
        views::report_with(&rec, &Selection::all(&rec), ReportFormat::Md, &opts(10)).unwrap(),
    )
    .unwrap();
    assert!(
        md.contains("| engine0 | 200 | 600 | 450 | 75.0% | 3.25 |"),
        "{md}"
    );
    assert!(
        md.contains("| engine0 | 50 | 6.00 | 7.50 | 15.00 | 1500.0 | 30.00 | 5000 | 2 | 0 |"),
        "{md}"
    );

    let (_dir, rec) = two_scrapes("", include_str!("fixtures/metrics-vllm-0.8.txt"));
    let v = report_json(&rec, &opts(10));
    assert!(v["engines"][0].get("spec_decode").is_none());
    assert!(v["engines"][0].get("kv_transfer").is_none());
}
