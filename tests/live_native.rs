//! Native frames against ground truth: samples/native_mix.py runs known C hot spots (pickle,
//! json, zlib, hashlib, and a C function the test builds with cc) in one thread and times each
//! call in-process. Recorded with `record --native`, each hot spot's share of the thread's
//! on-CPU samples, counted as the samples whose stack holds the hot spot's native symbol, must
//! be within 3 points of its true share of the thread's CPU time.
//!
//! On Debian's static, stripped interpreters (sid) the C code built into the executable
//! (`_pickle`, `_json`, `zlib`) has no symbol to name it by: it is named from the
//! interpreter's own state, as the builtin or C type method whose function it is
//! (`_pickle.dumps`, `_json.Encoder.__call__`, `zlib.compress`), and checked the same way.

mod common;

use common::*;
use std::collections::HashMap;

/// One workload at a time: two on a 2-core machine would make each other's numbers noisier.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Native symbols that name each hot spot (any of them in a sample's stack). On a stripped
/// interpreter the C functions built into it have no symbol: they are named from the
/// interpreter's own state, as the builtin (`_pickle.dumps`) or C type method
/// (`_json.Encoder.__call__`) whose C function they are (src/cpython/builtins.rs).
fn symbols(hot: &str) -> &'static [&'static str] {
    match hot {
        "pickle" => &["_pickle_dumps", "_pickle.dumps"],
        "json" => &["encoder_call", "_json.Encoder.__call__"],
        // deflate, deflateInit2_, deflateEnd: libz's exported entry points (what a stripped
        // interpreter's built-in zlib module calls).
        "zlib" => &["zlib_compress", "zlib.compress", "deflate"],
        "hashlib" => &[
            "_hashlib_openssl_sha256",
            "EVP_DigestUpdate",
            "SHA256_Update",
        ],
        "cext" => &["spin_native"],
        _ => &[],
    }
}

/// Build the test's C function into `path` (a shared object loaded with ctypes).
fn build_cext(path: &std::path::Path) {
    let src = path.with_extension("c");
    std::fs::write(
        &src,
        "long spin_native(long n) {\n  volatile long x = 0;\n  for (long i = 0; i < n; i++) x += i ^ (x >> 3);\n  return x;\n}\n",
    )
    .unwrap();
    let out = std::process::Command::new("cc")
        .args(["-O1", "-g", "-shared", "-fPIC", "-o"])
        .arg(path)
        .arg(&src)
        .output()
        .expect("run cc");
    assert!(
        out.status.success(),
        "cc: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn check(label: &str) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let i = interp(label);
    if !available(&i) {
        return;
    }
    // The shared object must be visible inside the container's root too.
    let (host_so, inner_so) = match &i.launch {
        Launch::Host(_) => {
            let p = std::env::temp_dir().join(format!("es-native-{}.so", std::process::id()));
            (p.clone(), p.to_string_lossy().into_owned())
        }
        Launch::Container { root, .. } => {
            let name = format!("es-native-{}.so", std::process::id());
            (root.join("tmp").join(&name), format!("/tmp/{name}"))
        }
    };
    build_cext(&host_so);
    let w = start(
        &i,
        "native_mix.py",
        &[
            "--truth",
            "{dir}/truth.json",
            "--duration",
            "12",
            "--go-fifo",
            "{dir}/go",
            "--cext",
            &inner_so,
        ],
    );
    let out = w.dir.join("run.esrec");
    let out_s = out.to_string_lossy().into_owned();
    let pid = w.pid.to_string();
    let rec = Recorder::start(&[
        "--backend",
        "bpf",
        "--rate",
        "1000",
        "--duration",
        "60",
        "--pid",
        &pid,
        "-o",
        &out_s,
        "--native",
    ]);
    w.go();
    let (ok, _, err) = rec.wait();
    let _ = std::fs::remove_file(&host_so);
    let _ = std::fs::remove_file(host_so.with_extension("c"));
    assert!(ok, "{label}: record failed: {err}");
    let truth = read_json(&w.dir.join("truth.json"));
    let r = enginescope::record::read_recording(&out).unwrap();

    let t0 = r.meta.start_mono_ns;
    let (a, b) = (
        truth["window"]["start_mono_ns"].as_u64().unwrap(),
        truth["window"]["end_mono_ns"].as_u64().unwrap(),
    );
    assert!(
        a >= t0,
        "{label}: the window began before the recorder attached"
    );
    let t = &truth["threads"][0];
    let tid = r
        .threads
        .iter()
        .find(|th| th.name == "nat-cpu")
        .map(|th| th.tid)
        .unwrap_or_else(|| panic!("{label}: thread nat-cpu not in the recording"));
    let samples: Vec<_> = r
        .samples
        .iter()
        .filter(|s| s.tid == tid && (t0 + s.t_ns) >= a && (t0 + s.t_ns) < b)
        .collect();
    let on_ns: u64 = samples.iter().map(|s| s.weight_ns as u64).sum();
    // ±3 points on a 6% share is 3 standard errors at 600 samples.
    assert!(
        samples.len() >= 600,
        "{label}: only {} samples in the window",
        samples.len()
    );
    let merged = samples
        .iter()
        .filter(|s| s.flags & enginescope::record::flags::NATIVE_FRAMES != 0)
        .count();
    let has = |stack: u32, names: &[&str]| {
        r.stacks.get(stack as usize).is_some_and(|ids| {
            ids.iter().any(|&f| {
                r.frame_native.contains_key(&f)
                    && r.frames
                        .get(f as usize)
                        .is_some_and(|fr| names.iter().any(|n| fr.function.starts_with(n)))
            })
        })
    };
    let cpu_s = t["cpu_s"].as_f64().unwrap();
    let funcs: HashMap<String, serde_json::Value> =
        serde_json::from_value(t["functions"].clone()).unwrap();
    let mut report = vec![format!(
        "{label}: {} samples in the window, {merged} with native frames",
        samples.len()
    )];
    let mut failures = Vec::new();
    let mut checked = 0;
    for (hot, ft) in &funcs {
        let names = symbols(hot);
        if names.is_empty() {
            continue;
        }
        let hit: u64 = samples
            .iter()
            .filter(|s| has(s.stack, names))
            .map(|s| s.weight_ns as u64)
            .sum();
        let got = hit as f64 / on_ns.max(1) as f64;
        let want = ft["cpu_s"].as_f64().unwrap() / cpu_s;
        report.push(format!(
            "  {hot} {names:?}: {:.1}% of on-CPU (truth {:.1}%)",
            got * 100.0,
            want * 100.0,
        ));
        checked += 1;
        if (got - want).abs() > 0.03 {
            failures.push(format!("{hot}: {got:.3} vs truth {want:.3}"));
        }
    }
    // Kernel frames on off-CPU intervals: the main thread sleeps in time.sleep for the whole
    // window, so its blocking switch-outs carry the kernel's nanosleep path.
    let main_tid = r
        .threads
        .iter()
        .find(|th| th.name == "nat-main")
        .map(|th| th.tid)
        .unwrap_or_else(|| panic!("{label}: thread nat-main not in the recording"));
    let kernel_has = |stack: u32, needle: &str| {
        r.stacks.get(stack as usize).is_some_and(|ids| {
            ids.iter().any(|&f| {
                r.frame_kind(f) == enginescope::record::FRAME_KERNEL
                    && r.frames
                        .get(f as usize)
                        .is_some_and(|fr| fr.function.contains(needle))
            })
        })
    };
    let clip = |s: u64, d: u64| (s + d).min(b).saturating_sub(s.max(a));
    let (mut off, mut off_named) = (0u64, 0u64);
    for o in r.offcpu.iter().filter(|o| o.tid == main_tid) {
        let d = clip(t0 + o.start_ns, o.dur_ns);
        off += d;
        if kernel_has(o.stack, "nanosleep") {
            off_named += d;
        }
    }
    report.push(format!(
        "nat-main off-CPU {:.2} s, {:.1}% of it under a kernel *nanosleep* frame",
        off as f64 / 1e9,
        off_named as f64 * 100.0 / off.max(1) as f64
    ));
    if off < 1_000_000_000 || off_named * 10 < off * 9 {
        failures.push(format!(
            "nat-main: {off_named} of {off} ns off-CPU under a kernel nanosleep frame"
        ));
    }
    // Native and Python frames were merged at the evaluation loop's frames (found by symbol,
    // or on stripped builds as the binary's largest function), not stacked leaf-only.
    let c = |k: &str| r.counters.get(k).copied().unwrap_or(0);
    let exact =
        c("native_merged") as f64 / (c("native_merged") + c("native_merge_fallback")).max(1) as f64;
    report.push(format!("exact merges: {:.1}%", exact * 100.0));
    if exact < 0.9 {
        failures.push(format!(
            "only {:.1}% of stacks merged exactly",
            exact * 100.0
        ));
    }
    report.push(format!("counters: {:?}", r.counters));
    eprintln!("{}", report.join("\n"));
    assert!(checked >= 5, "{label}: hot spots missing from the truth");
    assert!(failures.is_empty(), "{label}: {}", failures.join("; "));
}

crate::interpreter_tests!(check {
    native_shares_pyenv_3_11: ("pyenv-3.11"),
    native_shares_pyenv_3_12: ("pyenv-3.12"),
    native_shares_pyenv_3_13: ("pyenv-3.13"),
    native_shares_sid_3_13_stripped: ("sid-3.13"),
    native_shares_sid_3_14_stripped: ("sid-3.14"),
    native_shares_sid_3_15_stripped: ("sid-3.15"),
});
