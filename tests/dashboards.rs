//! Lint of the Grafana dashboards in dashboards/: valid JSON that Grafana imports (uid, title,
//! schema version, panels on the 24-column grid), a `datasource` variable that every panel,
//! query and template variable uses, and every PromQL expression naming metrics that exist:
//! the agent's (from `agent::metrics::FAMILIES`, with their labels) or vLLM's (from the
//! /metrics page of a real vLLM kept in src/vllm/testdata). Selector labels, `by (…)` labels
//! and legend `{{label}}`s must be labels of the metrics the expression reads.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use serde_json::{json, Value};

/// Known sample names and their label names.
struct Known {
    metrics: BTreeMap<String, BTreeSet<String>>,
}

impl Known {
    fn load() -> Known {
        let mut metrics: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for (name, labels) in enginescope::agent::metrics::exposed_names() {
            metrics.insert(name, labels.iter().map(|s| s.to_string()).collect());
        }
        let sample = std::fs::read_to_string(
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("src/vllm/testdata/metrics-sample.txt"),
        )
        .unwrap();
        for line in sample.lines().filter(|l| l.starts_with("vllm:")) {
            let series = line.rsplit_once(' ').map(|x| x.0).unwrap_or(line);
            let (name, labels) = series.split_once('{').unwrap_or((series, ""));
            let set = metrics.entry(name.to_string()).or_default();
            for kv in labels.trim_end_matches('}').split(',') {
                if let Some((k, _)) = kv.split_once('=') {
                    set.insert(k.to_string());
                }
            }
        }
        Known { metrics }
    }
}

/// Labels every scraped series has.
const TARGET_LABELS: [&str; 2] = ["instance", "job"];

fn is_metric_start(s: &str) -> bool {
    s.starts_with("enginescope_") || s.starts_with("process_") || s.starts_with("vllm:")
}

/// The metrics named in a PromQL expression, each with the label names of its selector.
fn metrics_in(expr: &str) -> Vec<(String, Vec<String>)> {
    let b = expr.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let prev_ok = i == 0 || !(b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_');
        if prev_ok && is_metric_start(&expr[i..]) {
            let start = i;
            while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_' || b[i] == b':') {
                i += 1;
            }
            let name = expr[start..i].to_string();
            let mut labels = Vec::new();
            if b.get(i) == Some(&b'{') {
                let end = expr[i..].find('}').map(|e| i + e).unwrap_or(b.len());
                let body = &expr[i + 1..end];
                // label op "value" pairs; values are quoted and may hold commas
                let mut rest = body;
                while let Some(op) = rest.find(['=', '!']) {
                    let key = rest[..op].trim().trim_start_matches(',').trim();
                    if !key.is_empty() {
                        labels.push(key.to_string());
                    }
                    let Some(q1) = rest[op..].find('"').map(|q| op + q) else {
                        break;
                    };
                    let Some(q2) = rest[q1 + 1..].find('"').map(|q| q1 + 1 + q) else {
                        break;
                    };
                    rest = &rest[q2 + 1..];
                }
                i = end;
            }
            out.push((name, labels));
        } else {
            i += 1;
        }
    }
    out
}

/// Label names in `by (…)` and `without (…)` clauses.
fn grouping_labels(expr: &str) -> Vec<String> {
    let mut out = Vec::new();
    for kw in ["by", "without"] {
        let mut rest = expr;
        while let Some(p) = rest.find(kw) {
            let before_ok = p == 0
                || !rest.as_bytes()[p - 1].is_ascii_alphanumeric()
                    && rest.as_bytes()[p - 1] != b'_';
            let after = rest[p + kw.len()..].trim_start();
            if before_ok && after.starts_with('(') {
                if let Some(end) = after.find(')') {
                    out.extend(
                        after[1..end]
                            .split(',')
                            .map(|s| s.trim().to_string())
                            .filter(|s| !s.is_empty()),
                    );
                }
            }
            rest = &rest[p + kw.len()..];
        }
    }
    out
}

/// `{{label}}`s of a legend format.
fn legend_labels(legend: &str) -> Vec<String> {
    legend
        .split("{{")
        .skip(1)
        .filter_map(|s| s.split_once("}}").map(|x| x.0.trim().to_string()))
        .collect()
}

fn is_ds_ref(v: &Value) -> bool {
    v["type"] == "prometheus" && (v["uid"] == "${datasource}" || v["uid"] == "$datasource")
}

/// Check one expression; `legend` may be empty.
fn lint_expr(known: &Known, where_: &str, expr: &str, legend: &str, errs: &mut Vec<String>) {
    let ms = metrics_in(expr);
    if ms.is_empty() {
        errs.push(format!("{where_}: names no exported metric: {expr}"));
        return;
    }
    let mut labels: BTreeSet<String> = TARGET_LABELS.iter().map(|s| s.to_string()).collect();
    for (m, sel) in &ms {
        match known.metrics.get(m) {
            None => errs.push(format!("{where_}: unknown metric {m}")),
            Some(ls) => {
                for l in sel {
                    if !ls.contains(l) && !TARGET_LABELS.contains(&l.as_str()) {
                        errs.push(format!("{where_}: {m} has no label {l:?}"));
                    }
                }
                labels.extend(ls.iter().cloned());
            }
        }
    }
    for l in grouping_labels(expr)
        .into_iter()
        .chain(legend_labels(legend))
    {
        if !labels.contains(&l) {
            errs.push(format!(
                "{where_}: label {l:?} is not a label of {:?}",
                ms.iter().map(|m| &m.0).collect::<Vec<_>>()
            ));
        }
    }
}

fn lint(known: &Known, name: &str, d: &Value) -> Vec<String> {
    let mut errs = Vec::new();
    for k in ["uid", "title"] {
        if d[k].as_str().is_none_or(str::is_empty) {
            errs.push(format!("{name}: no {k}"));
        }
    }
    if d["schemaVersion"].as_u64().is_none_or(|v| v < 30) {
        errs.push(format!("{name}: schemaVersion missing or older than 30"));
    }
    let vars = d["templating"]["list"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let has_ds = vars.iter().any(|v| {
        v["type"] == "datasource" && v["query"] == "prometheus" && v["name"] == "datasource"
    });
    if !has_ds {
        errs.push(format!(
            "{name}: no `datasource` variable of type datasource (prometheus)"
        ));
    }
    for v in vars.iter().filter(|v| v["type"] == "query") {
        let w = format!("{name}: variable {}", v["name"]);
        if !is_ds_ref(&v["datasource"]) {
            errs.push(format!("{w}: datasource is not ${{datasource}}"));
        }
        let q = v["query"]["query"]
            .as_str()
            .or(v["query"].as_str())
            .unwrap_or("");
        lint_expr(known, &w, q, "", &mut errs);
    }
    let panels = d["panels"].as_array().cloned().unwrap_or_default();
    if panels.iter().filter(|p| p["type"] != "row").count() == 0 {
        errs.push(format!("{name}: no panels"));
    }
    let mut ids = BTreeSet::new();
    for p in &panels {
        let w = format!("{name}: panel {:?}", p["title"].as_str().unwrap_or("?"));
        if !p["id"].as_u64().is_some_and(|id| ids.insert(id)) {
            errs.push(format!("{w}: missing or duplicate id"));
        }
        let g = &p["gridPos"];
        let (x, wd, h) = (g["x"].as_u64(), g["w"].as_u64(), g["h"].as_u64());
        match (x, wd, h, g["y"].as_u64()) {
            (Some(x), Some(wd), Some(h), Some(_)) if wd >= 1 && x + wd <= 24 && h >= 1 => {}
            _ => errs.push(format!("{w}: gridPos off the 24-column grid: {g}")),
        }
        if p["type"] == "row" {
            continue;
        }
        if !is_ds_ref(&p["datasource"]) {
            errs.push(format!("{w}: datasource is not ${{datasource}}"));
        }
        let targets = p["targets"].as_array().cloned().unwrap_or_default();
        if targets.is_empty() {
            errs.push(format!("{w}: no queries"));
        }
        for t in &targets {
            let wt = format!("{w} query {}", t["refId"]);
            if !is_ds_ref(&t["datasource"]) {
                errs.push(format!("{wt}: datasource is not ${{datasource}}"));
            }
            let expr = t["expr"].as_str().unwrap_or("");
            lint_expr(
                known,
                &wt,
                expr,
                t["legendFormat"].as_str().unwrap_or(""),
                &mut errs,
            );
        }
    }
    errs
}

#[test]
fn dashboards_are_valid_and_query_exported_metrics() {
    let known = Known::load();
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("dashboards");
    let mut uids = BTreeSet::new();
    let mut files = 0;
    let mut errs = Vec::new();
    let mut used = BTreeSet::new();
    for e in std::fs::read_dir(&dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().and_then(|x| x.to_str()) != Some("json") {
            continue;
        }
        files += 1;
        let name = p.file_name().unwrap().to_string_lossy().into_owned();
        let text = std::fs::read_to_string(&p).unwrap();
        let d: Value = match serde_json::from_str(&text) {
            Ok(d) => d,
            Err(e) => {
                errs.push(format!("{name}: not valid JSON: {e}"));
                continue;
            }
        };
        if !uids.insert(d["uid"].as_str().unwrap_or("").to_string()) {
            errs.push(format!("{name}: uid used by another dashboard"));
        }
        errs.extend(lint(&known, &name, &d));
        for p in d["panels"].as_array().into_iter().flatten() {
            for t in p["targets"].as_array().into_iter().flatten() {
                for (m, _) in metrics_in(t["expr"].as_str().unwrap_or("")) {
                    used.insert(m);
                }
            }
        }
    }
    assert!(
        files >= 2,
        "expected the overview and the thread dashboards"
    );
    assert!(errs.is_empty(), "{}", errs.join("\n"));
    // The dashboards show what the issue asks for: vLLM throughput, KV usage, TTFT and TPOT beside
    // enginescope's CPU, GIL, GC and queue latency, and the agent's health.
    for m in [
        "vllm:generation_tokens_total",
        "vllm:kv_cache_usage_perc",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:request_time_per_output_token_seconds_sum",
        "vllm:request_time_per_output_token_seconds_bucket",
        "enginescope_thread_cpu_seconds_total",
        "enginescope_thread_gil_wait_seconds_total",
        "enginescope_thread_gil_held_seconds_total",
        "enginescope_thread_offcpu_seconds_total",
        "enginescope_gc_pause_seconds_bucket",
        "enginescope_probe_call_duration_seconds_bucket",
        // Calls per second under the probe budget are the calls timed over the time watched,
        // less each phase's mean call duration.
        "enginescope_probe_watched_seconds_total",
        "enginescope_probe_watch_phases_total",
        "enginescope_probe_call_duration_seconds_sum",
        "enginescope_samples_lost_total",
        "enginescope_probe_errors_total",
    ] {
        assert!(used.contains(m), "no panel shows {m}");
    }
}

#[test]
fn the_lint_catches_mistakes() {
    let known = Known::load();
    let ds = json!({"type": "prometheus", "uid": "${datasource}"});
    let good_var = json!({"name": "datasource", "type": "datasource", "query": "prometheus"});
    let dash = |expr: &str, legend: &str, vars: Value, pds: Value| {
        json!({
            "uid": "x", "title": "x", "schemaVersion": 39,
            "templating": {"list": vars},
            "panels": [{"id": 1, "type": "timeseries", "title": "p", "datasource": pds,
                        "gridPos": {"x": 0, "y": 0, "w": 12, "h": 8},
                        "targets": [{"refId": "A", "datasource": ds.clone(), "expr": expr,
                                     "legendFormat": legend}]}]
        })
    };
    let ok = dash(
        r#"sum by (role) (rate(enginescope_thread_cpu_seconds_total{thread=~"a,b"}[5m]))"#,
        "{{role}}",
        json!([good_var.clone()]),
        ds.clone(),
    );
    assert_eq!(lint(&known, "ok", &ok), Vec::<String>::new());
    let cases = [
        (
            r#"rate(enginescope_thread_cpu_seconds[5m])"#,
            "",
            "unknown metric",
        ),
        (
            r#"rate(enginescope_thread_cpu_seconds_total{pid="1"}[5m])"#,
            "",
            "no label \"pid\"",
        ),
        (
            r#"sum by (model_name) (rate(enginescope_samples_total[5m]))"#,
            "",
            "not a label",
        ),
        (
            r#"rate(vllm:generation_tokens_total[5m])"#,
            "{{thread}}",
            "not a label",
        ),
        (r#"rate(vllm:no_such_thing[5m])"#, "", "unknown metric"),
        (r#"up"#, "", "names no exported metric"),
    ];
    for (expr, legend, want) in cases {
        let errs = lint(
            &known,
            "bad",
            &dash(expr, legend, json!([good_var.clone()]), ds.clone()),
        );
        assert!(
            errs.iter().any(|e| e.contains(want)),
            "{expr}: expected {want:?} in {errs:?}"
        );
    }
    let no_var = dash("enginescope_samples_lost_total", "", json!([]), ds.clone());
    assert!(lint(&known, "v", &no_var)
        .iter()
        .any(|e| e.contains("no `datasource` variable")));
    let fixed_ds = dash(
        "enginescope_samples_lost_total",
        "",
        json!([good_var]),
        json!({"type": "prometheus", "uid": "abc123"}),
    );
    assert!(lint(&known, "d", &fixed_ds)
        .iter()
        .any(|e| e.contains("datasource is not")));
}

/// A panel query with Grafana's variables given values Prometheus accepts: the intervals and
/// ranges a minute, every template variable `.*` (they sit inside `=~"..."` matchers).
fn as_promql(expr: &str) -> String {
    let mut e = expr.to_string();
    for v in ["$__rate_interval", "$__interval", "$__range"] {
        e = e.replace(v, "1m");
    }
    let mut out = String::new();
    let mut rest = e.as_str();
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let after = &rest[i + 1..];
        let (name_len, skip) = if let Some(b) = after.strip_prefix('{') {
            let close = b.find('}').map_or(b.len(), |j| j + 1);
            (close, 1)
        } else {
            (
                after
                    .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                    .unwrap_or(after.len()),
                0,
            )
        };
        out.push_str(".*");
        rest = &after[(skip + name_len).min(after.len())..];
    }
    out.push_str(rest);
    out
}

/// Every panel query of every dashboard parses as PromQL by Prometheus's own parser
/// (`promtool check rules` on a rule file of them): the lint above reads names and labels, not
/// the grammar (a misplaced parenthesis in a band's expression passes it).
#[test]
fn every_query_parses_as_promql() {
    let Some(promtool) = common::tool_binary("promtool", "prometheus") else {
        return;
    };
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("dashboards");
    let mut rules = Vec::new();
    for e in std::fs::read_dir(&dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().and_then(|x| x.to_str()) != Some("json") {
            continue;
        }
        let d: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
        for panel in d["panels"].as_array().into_iter().flatten() {
            for t in panel["targets"].as_array().into_iter().flatten() {
                if let Some(expr) = t["expr"].as_str() {
                    rules.push(json!({
                        "record": format!("r{}", rules.len()),
                        "expr": as_promql(expr),
                    }));
                }
            }
        }
    }
    assert!(rules.len() > 20, "only {} queries found", rules.len());
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("rules.json");
    // JSON is YAML: a rule file promtool reads.
    let body = json!({"groups": [{"name": "dashboards", "rules": rules}]});
    std::fs::write(&file, body.to_string()).unwrap();
    let o = std::process::Command::new(promtool)
        .arg("check")
        .arg("rules")
        .arg(&file)
        .output()
        .expect("run promtool");
    assert!(
        o.status.success(),
        "promtool rejects a dashboard query:\n{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
}
