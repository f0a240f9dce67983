//! The `discover` command: the engine tree, each engine's metrics URL and whether it answers.

use std::time::Duration;

use super::discover::{discover_engines, Discovery};
use super::metrics::{check, LiveCheck};

/// Time allowed for each engine's live metrics check.
const CHECK_TIMEOUT: Duration = Duration::from_secs(3);

#[derive(serde::Serialize)]
struct Output<'a> {
    #[serde(flatten)]
    discovery: &'a Discovery,
    /// One per engine, in the order of `engines`.
    metrics_checks: &'a [LiveCheck],
}

/// Run `discover`: find the engines, check each metrics URL, and render text or JSON.
pub fn run(json: bool, metrics_url: Option<&str>) -> anyhow::Result<String> {
    let d = discover_engines(metrics_url)?;
    let checks: Vec<LiveCheck> = d
        .engines
        .iter()
        .map(|e| {
            let mut c = check(&e.metrics_url, CHECK_TIMEOUT);
            if e.api_server_pids.len() > 1 {
                c.several_api_servers();
            }
            c
        })
        .collect();
    if json {
        let out = Output {
            discovery: &d,
            metrics_checks: &checks,
        };
        return Ok(serde_json::to_string_pretty(&out)? + "\n");
    }
    Ok(render_text(&d, &checks))
}

/// The engine tree as text.
pub(crate) fn render_text(d: &Discovery, checks: &[LiveCheck]) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    if d.engines.is_empty() {
        s.push_str(
            "no vLLM engine found: no VLLM::EngineCore / VLLM::Worker process and no `vllm serve`.\n\
             hint: in a container, run enginescope with --pid=host to see the engine's processes; \
             for an engine on another host, pass --metrics-url http://HOST:PORT/metrics\n",
        );
    }
    for (i, e) in d.engines.iter().enumerate() {
        let _ = writeln!(s, "{}", e.id);
        let procs: Vec<_> = d.processes_of(&e.id).collect();
        if procs.is_empty() {
            let _ = writeln!(s, "  (no local process: metrics only)");
        }
        // Depth of each process under the engine's own processes (bounded by their count).
        for p in &procs {
            let mut depth = 0;
            let mut parent = p.ppid;
            while depth < procs.len() {
                match procs.iter().find(|q| q.pid == parent) {
                    Some(q) => {
                        depth += 1;
                        parent = q.ppid;
                    }
                    None => break,
                }
            }
            let mut cmd = p.cmdline.clone();
            if cmd.len() > 120 {
                let cut = (0..=117)
                    .rev()
                    .find(|&i| cmd.is_char_boundary(i))
                    .unwrap_or(0);
                cmd.truncate(cut);
                cmd.push_str("...");
            }
            let _ = writeln!(
                s,
                "  {:indent$}{:<16} pid {:<7} {:>3} threads  {}",
                "",
                p.role,
                p.pid,
                p.threads,
                cmd,
                indent = depth * 2
            );
        }
        let how = match e.metrics_url_source.as_str() {
            "argv" => "from the API server's --host/--port",
            "socket" => "from the API server's listening socket",
            "default" => "vLLM's default port; the API server's port was not found",
            "--metrics-url" => "given with --metrics-url",
            _ => "",
        };
        if e.metrics_url.is_empty() {
            let _ = writeln!(s, "  metrics: none (no API server)");
        } else {
            let _ = writeln!(s, "  metrics: {} ({how})", e.metrics_url);
        }
        if let Some(c) = checks.get(i) {
            if c.ok {
                let _ = write!(
                    s,
                    "  live:    ok, {} vllm: series, {} names",
                    c.vllm_series, c.vllm_names
                );
                let absent: Vec<&str> = c
                    .missing
                    .iter()
                    .filter(|m| !c.not_yet.contains(m))
                    .map(String::as_str)
                    .collect();
                if !absent.is_empty() {
                    let _ = write!(s, "; missing: {}", absent.join(", "));
                }
                if !c.not_yet.is_empty() {
                    let _ = write!(
                        s,
                        "; not served yet: {} (with several API servers vLLM serves its gauges once the engine has published stats, after the first request)",
                        c.not_yet.join(", ")
                    );
                }
                s.push('\n');
            } else if !e.metrics_url.is_empty() {
                let _ = writeln!(s, "  live:    FAILED: {}", c.error);
            }
        }
    }
    for w in &d.warnings {
        let _ = writeln!(s, "warning: {w}");
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::EngineInfo;
    use crate::vllm::discover::EngineProcess;

    #[test]
    fn text_tree() {
        let proc_ = |pid, ppid, role: &str, threads| EngineProcess {
            pid,
            ppid,
            engine: "engine0".into(),
            role: role.into(),
            cmdline: format!("cmd-{pid}"),
            threads,
        };
        let d = Discovery {
            engines: vec![EngineInfo {
                id: "engine0".into(),
                api_server_pid: 10,
                engine_core_pids: vec![11],
                api_server_pids: vec![],
                worker_pids: vec![12],
                metrics_url: "http://127.0.0.1:8000/metrics".into(),
                metrics_url_source: "argv".into(),
                t_ns: 0,
            }],
            processes: vec![
                proc_(10, 1, "api_server", 12),
                proc_(11, 10, "engine_core", 15),
                proc_(12, 11, "worker", 52),
            ],
            ..Default::default()
        };
        let checks = vec![LiveCheck {
            ok: true,
            vllm_series: 330,
            vllm_names: 90,
            ..Default::default()
        }];
        let t = render_text(&d, &checks);
        let want = "engine0\n\
            \x20 api_server       pid 10       12 threads  cmd-10\n\
            \x20   engine_core      pid 11       15 threads  cmd-11\n\
            \x20     worker           pid 12       52 threads  cmd-12\n\
            \x20 metrics: http://127.0.0.1:8000/metrics (from the API server's --host/--port)\n\
            \x20 live:    ok, 330 vllm: series, 90 names\n";
        assert_eq!(t, want);
        assert!(render_text(&Discovery::default(), &[]).starts_with("no vLLM engine found"));

        // With several API servers the engine's gauges come after its first stats: said as
        // such, apart from what is really absent.
        let mut c = LiveCheck {
            ok: true,
            vllm_series: 325,
            vllm_names: 67,
            missing: vec![
                "vllm:kv_cache_usage_perc".into(),
                "vllm:num_requests_running".into(),
                "vllm:time_to_first_token_seconds_bucket".into(),
            ],
            ..Default::default()
        };
        c.several_api_servers();
        assert_eq!(
            c.not_yet,
            ["vllm:kv_cache_usage_perc", "vllm:num_requests_running"]
        );
        let t = render_text(&d, &[c]);
        assert!(
            t.contains("; missing: vllm:time_to_first_token_seconds_bucket; not served yet: vllm:kv_cache_usage_perc, vllm:num_requests_running (with several API servers"),
            "{t}"
        );
    }
}
