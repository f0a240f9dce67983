//! `enginescope record` against ground truth: samples/cpu_mix.py times every call of its
//! functions in-process and writes what really happened. The recording must agree:
//! per-thread on/off-CPU split within ±3 percentage points, per-function shares within ±2.
//!
//! The recorder attaches between the workload's READY and its GO, so the truth window lies
//! inside the recording and the recorder's own start-up does not disturb the window.

mod common;

use common::*;
use enginescope::record::Recording;
use serde_json::Value;
use std::collections::HashMap;

const WINDOW_S: &str = "6";

/// One workload at a time: two on a 2-core machine would make each other's numbers noisier.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

struct Window {
    a: u64,
    b: u64,
}

impl Window {
    fn clip(&self, s: u64, e: u64) -> u64 {
        e.min(self.b).saturating_sub(s.max(self.a))
    }
    fn len(&self) -> u64 {
        self.b - self.a
    }
}

fn stack_has(rec: &Recording, stack: u32, f: &str) -> bool {
    rec.stack_frames(stack).any(|fr| fr.function == f)
}

/// `share_tol`: the bound on function shares. The bpf backend at 1 kHz gives mix-cpu ~5,400
/// samples in the window, so ±2 points is 3 standard errors of a 0.3 share; the memory backend
/// at 200 Hz gives ~1,200, where 3 standard errors are ±4 points (its on/off-CPU split is exact
/// from schedstat and keeps the ±3 bound).
fn check(label: &str, backend: &str, rate: &str, share_tol: f64) {
    check_with(label, backend, rate, share_tol, &[]);
}

/// [`check`] of cpu_mix run with `extra` arguments.
fn check_with(label: &str, backend: &str, rate: &str, share_tol: f64, extra: &[&str]) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let steal_before = common::cpu::steal_s();
    let Some((r, truth, kept)) =
        record_workload_at(&interp(label), "cpu_mix.py", extra, WINDOW_S, backend, rate)
    else {
        return;
    };
    let stolen_s = common::cpu::steal_s() - steal_before;
    let _ = std::fs::remove_file(kept);

    let t0 = r.meta.start_mono_ns;
    let win = Window {
        a: truth["window"]["start_mono_ns"].as_u64().unwrap(),
        b: truth["window"]["end_mono_ns"].as_u64().unwrap(),
    };
    assert!(
        win.a >= t0,
        "{label}: the window began before the recorder attached"
    );
    assert!(
        win.len() > 4_000_000_000,
        "{label}: recorded window too short: {} ns",
        win.len()
    );

    let mut report = Vec::new();
    let mut failures = Vec::new();
    let mut expect = |ok: bool, msg: String| {
        if !ok {
            failures.push(msg);
        }
    };
    for t in truth["threads"].as_array().unwrap() {
        let name = t["name"].as_str().unwrap();
        // The workload has exited: find its threads by their (unique) names in the recording.
        let tid = r
            .threads
            .iter()
            .find(|th| th.name == name)
            .map(|th| th.tid)
            .unwrap_or_else(|| panic!("{label}: thread {name} not in the recording"));
        let samples: Vec<_> = r
            .samples
            .iter()
            .filter(|s| s.tid == tid && (t0 + s.t_ns) >= win.a && (t0 + s.t_ns) < win.b)
            .collect();
        let on_ns: u64 = samples.iter().map(|s| s.weight_ns as u64).sum();
        let offs: Vec<_> = r.offcpu.iter().filter(|o| o.tid == tid).collect();
        let off_ns: u64 = offs
            .iter()
            .map(|o| win.clip(t0 + o.start_ns, t0 + o.start_ns + o.dur_ns))
            .sum();

        // On/off-CPU split.
        let truth_on = t["cpu_s"].as_f64().unwrap() / t["wall_s"].as_f64().unwrap();
        let got_on = on_ns as f64 / win.len() as f64;
        let got_off = off_ns as f64 / win.len() as f64;
        report.push(format!(
            "{name}: on-CPU {:.1}% (truth {:.1}%), off-CPU {:.1}% (truth {:.1}%), {} samples",
            got_on * 100.0,
            truth_on * 100.0,
            got_off * 100.0,
            (1.0 - truth_on) * 100.0,
            samples.len()
        ));
        expect(
            (got_on - truth_on).abs() <= 0.03,
            format!("{name}: on-CPU {got_on:.3} vs truth {truth_on:.3}"),
        );
        // The hypervisor's steal while the thread ran is in the truth's off-CPU (wall less CPU
        // time), and in the BPF backend's as stolen intervals (its runtime at switch-in and
        // switch-out). The memory backend sees no switch: its off-CPU may read low by up to
        // the machine's steal over the run (all CPUs, before the window and after it too: a
        // bound, 0 on a quiet host).
        let stolen_in: u64 = offs
            .iter()
            .filter(|o| o.stolen)
            .map(|o| win.clip(t0 + o.start_ns, t0 + o.start_ns + o.dur_ns))
            .sum();
        let steal = if backend == "bpf" {
            0.0
        } else {
            stolen_s / win.len() as f64 * 1e9
        };
        let off_err = got_off - (1.0 - truth_on);
        expect(
            off_err <= 0.03 && off_err >= -0.03 - steal,
            format!(
                "{name}: off-CPU {got_off:.3} (stolen {:.3}) vs truth {:.3} (machine steal {:.3} of the window)",
                stolen_in as f64 / win.len() as f64,
                1.0 - truth_on,
                stolen_s / win.len() as f64 * 1e9
            ),
        );

        // Function shares. Of on-CPU time, where the thread has enough samples for ±2 points
        // to be a fair bound (≥ 2000: standard error ≤ 1 point); of wall time (on-CPU samples
        // plus exact off-CPU intervals) for every function of every thread.
        let funcs: HashMap<String, Value> = serde_json::from_value(t["functions"].clone()).unwrap();
        for (f, ft) in &funcs {
            if samples.len() >= 2000 {
                let hit: u64 = samples
                    .iter()
                    .filter(|s| stack_has(&r, s.stack, f))
                    .map(|s| s.weight_ns as u64)
                    .sum();
                let got = hit as f64 / on_ns as f64;
                let want = ft["cpu_s"].as_f64().unwrap() / t["cpu_s"].as_f64().unwrap();
                report.push(format!(
                    "  {name} {f}: {:.1}% of on-CPU (truth {:.1}%)",
                    got * 100.0,
                    want * 100.0
                ));
                expect(
                    (got - want).abs() <= share_tol,
                    format!("{name} {f}: on-CPU share {got:.3} vs truth {want:.3}"),
                );
            }
            let on_f: u64 = samples
                .iter()
                .filter(|s| stack_has(&r, s.stack, f))
                .map(|s| s.weight_ns as u64)
                .sum();
            let off_f: u64 = offs
                .iter()
                .filter(|o| stack_has(&r, o.stack, f))
                .map(|o| win.clip(t0 + o.start_ns, t0 + o.start_ns + o.dur_ns))
                .sum();
            // Share of the thread's observed time (on-CPU samples + off-CPU intervals); how much
            // of the window that observed time covers is held by the on/off checks above.
            let got = (on_f + off_f) as f64 / (on_ns + off_ns).max(1) as f64;
            let want = ft["wall_s"].as_f64().unwrap() / t["wall_s"].as_f64().unwrap();
            report.push(format!(
                "  {name} {f}: {:.1}% of wall (truth {:.1}%)",
                got * 100.0,
                want * 100.0
            ));
            expect(
                (got - want).abs() <= share_tol,
                format!("{name} {f}: wall share {got:.3} vs truth {want:.3}"),
            );
        }
    }
    report.push(format!("counters: {:?}", r.counters));
    eprintln!("{label} ({backend}, {rate} Hz):\n{}", report.join("\n"));
    assert!(failures.is_empty(), "{label}: {}", failures.join("; "));
}

crate::interpreter_tests!(check {
    ground_truth_bpf_pyenv_3_12: ("pyenv-3.12", "bpf", "1000", 0.02),
    ground_truth_bpf_sid_3_14_container: ("sid-3.14", "bpf", "1000", 0.02),
    ground_truth_bpf_pyenv_3_10: ("pyenv-3.10", "bpf", "1000", 0.02),
});

// A worker woken every 5 ms on the clock (cpu_mix --paced), 0.5 ms in paced_a then 0.5 ms in
// paced_b: its step is a multiple of the sampling period, so a sampler on a fixed grid meets
// each step at one point for the whole recording (at 1 kHz one sample a step, always in the
// same function or in the sleep). The sampling clock's re-phasing must give each function its
// half: the wall shares hold the same bound as cpu_mix's (the thread has ~1,200 samples at
// 1 kHz, ~240 at 200 Hz, where 3 standard errors of a 0.1 wall share are about 3 points).
#[test]
fn paced_step_sampled_at_every_phase_bpf_1khz_pyenv_3_12() {
    check_with("pyenv-3.12", "bpf", "1000", 0.02, &["--paced"]);
}

#[test]
fn paced_step_sampled_at_every_phase_bpf_200hz_sid_3_15() {
    check_with("sid-3.15", "bpf", "200", 0.035, &["--paced"]);
}

#[test]
fn ground_truth_memory_backend_pyenv_3_12() {
    check("pyenv-3.12", "memory", "200", 0.04);
}
