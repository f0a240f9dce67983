//! Parser for the Prometheus text exposition format (version 0.0.4), as `prometheus_client`
//! (vLLM's exporter) writes it.
//!
//! Why not a crate: `prometheus-parse` 0.2.5 (the maintained-looking one) matches sample and
//! `# TYPE` names with the regex `\w+`, which has no `:`, so every `vllm:` line is silently
//! dropped; it also splits labels on `,` and `=` without honouring quotes or escapes. This
//! parser follows the format's grammar: names `[a-zA-Z_:][a-zA-Z0-9_:]*`, label values quoted
//! with `\\`, `\"`, `\n` escapes, values with `+Inf`/`-Inf`/`NaN`, an optional timestamp.
//! Malformed lines are skipped and reported, never fatal.

use std::collections::{BTreeMap, HashMap};

/// Prometheus metric type of a family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
    Summary,
    Untyped,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
            Kind::Summary => "summary",
            Kind::Untyped => "untyped",
        }
    }

    fn parse(s: &str) -> Kind {
        match s {
            "counter" => Kind::Counter,
            "gauge" => Kind::Gauge,
            "histogram" => Kind::Histogram,
            "summary" => Kind::Summary,
            _ => Kind::Untyped,
        }
    }
}

/// One sample line.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// As exposed, e.g. `vllm:e2e_request_latency_seconds_bucket`.
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub value: f64,
    /// The type of the family the sample belongs to.
    pub kind: Kind,
}

/// A parsed exposition.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Exposition {
    pub samples: Vec<Sample>,
    /// Lines that could not be parsed: "line N: why" (at most [`MAX_REPORTED_ERRORS`]).
    pub errors: Vec<String>,
    /// How many lines were skipped in all.
    pub bad_lines: usize,
}

pub(crate) const MAX_REPORTED_ERRORS: usize = 10;

fn is_name_start(c: char) -> bool {
    c.is_ascii_alphabetic() || c == '_' || c == ':'
}
fn is_name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_' || c == ':'
}

/// Split a metric name off the front of `s`.
fn take_name(s: &str) -> Option<(&str, &str)> {
    let mut chars = s.char_indices();
    let (_, first) = chars.next()?;
    if !is_name_start(first) {
        return None;
    }
    let end = chars
        .find(|(_, c)| !is_name_char(*c))
        .map(|(i, _)| i)
        .unwrap_or(s.len());
    Some((&s[..end], &s[end..]))
}

/// A sample value: a float, `+Inf`, `-Inf`, `NaN`.
pub fn parse_value(s: &str) -> Option<f64> {
    match s {
        "+Inf" | "Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        "NaN" => Some(f64::NAN),
        // Rust also accepts "inf"/"infinity"/"nan" spellings; the format does not.
        _ if s
            .chars()
            .any(|c| c.is_ascii_alphabetic() && !matches!(c, 'e' | 'E')) =>
        {
            None
        }
        _ => s.parse().ok(),
    }
}

/// Parse `{a="x",b="y"}` (the leading `{` already seen); returns labels and the rest.
fn take_labels(mut s: &str) -> Result<(BTreeMap<String, String>, &str), String> {
    let mut labels = BTreeMap::new();
    loop {
        s = s.trim_start();
        if let Some(rest) = s.strip_prefix('}') {
            return Ok((labels, rest));
        }
        let (name, rest) = take_name(s).ok_or("expected a label name")?;
        if name.contains(':') {
            return Err(format!("label name {name:?} has a ':'"));
        }
        let rest = rest
            .trim_start()
            .strip_prefix('=')
            .ok_or_else(|| format!("expected '=' after label {name}"))?;
        let rest = rest
            .trim_start()
            .strip_prefix('"')
            .ok_or_else(|| format!("expected '\"' to open label {name}'s value"))?;
        let mut value = String::new();
        let mut chars = rest.char_indices();
        let end = loop {
            match chars.next() {
                None => return Err(format!("label {name}'s value is not closed")),
                Some((i, '"')) => break i,
                Some((_, '\\')) => match chars.next() {
                    Some((_, 'n')) => value.push('\n'),
                    Some((_, c @ ('\\' | '"'))) => value.push(c),
                    // Unknown escapes are kept literally (the format leaves them undefined).
                    Some((_, c)) => {
                        value.push('\\');
                        value.push(c);
                    }
                    None => return Err(format!("label {name}'s value is not closed")),
                },
                Some((_, c)) => value.push(c),
            }
        };
        if labels.insert(name.to_string(), value).is_some() {
            return Err(format!("label {name} repeated"));
        }
        s = rest[end + 1..].trim_start();
        if let Some(r) = s.strip_prefix(',') {
            s = r;
        } else if !s.starts_with('}') {
            return Err(format!("expected ',' or '}}' after label {name}"));
        }
    }
}

/// One sample line without its family type.
fn parse_sample_line(line: &str) -> Result<(String, BTreeMap<String, String>, f64), String> {
    let (name, rest) = take_name(line).ok_or("does not start with a metric name")?;
    let (labels, rest) = match rest.trim_start().strip_prefix('{') {
        Some(r) => take_labels(r)?,
        None => (BTreeMap::new(), rest),
    };
    let mut fields = rest.split_whitespace();
    let v = fields.next().ok_or("no value")?;
    let value = parse_value(v).ok_or_else(|| format!("bad value {v:?}"))?;
    // An optional integer timestamp (ms); scrape time is what we record.
    if let Some(ts) = fields.next() {
        ts.parse::<i64>()
            .map_err(|_| format!("bad timestamp {ts:?}"))?;
    }
    if let Some(extra) = fields.next() {
        return Err(format!("unexpected {extra:?} after the value"));
    }
    Ok((name.to_string(), labels, value))
}

/// The family a sample belongs to: its own name, or the name less a histogram/summary suffix.
fn family_kind(name: &str, types: &HashMap<&str, Kind>) -> Kind {
    if let Some(k) = types.get(name) {
        return *k;
    }
    for (suffix, kinds) in [
        ("_bucket", &[Kind::Histogram][..]),
        ("_sum", &[Kind::Histogram, Kind::Summary][..]),
        ("_count", &[Kind::Histogram, Kind::Summary][..]),
        // OpenMetrics-style families (`# TYPE x counter` with samples `x_total`).
        ("_total", &[Kind::Counter][..]),
    ] {
        if let Some(k) = name
            .strip_suffix(suffix)
            .and_then(|base| types.get(base))
            .filter(|k| kinds.contains(k))
        {
            return *k;
        }
    }
    Kind::Untyped
}

/// Parse a whole exposition. `keep` filters samples by name before their labels are parsed
/// (cheap skipping of families nobody wants).
pub fn parse(text: &str, keep: impl Fn(&str) -> bool) -> Exposition {
    let mut types: HashMap<&str, Kind> = HashMap::new();
    for line in text.lines() {
        let mut w = line.split_whitespace();
        if let (Some("#"), Some("TYPE"), Some(name), Some(kind)) =
            (w.next(), w.next(), w.next(), w.next())
        {
            types.insert(name, Kind::parse(kind));
        }
    }
    let mut out = Exposition::default();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let name_end = line.find(|c: char| !is_name_char(c)).unwrap_or(line.len());
        if !keep(&line[..name_end]) {
            continue;
        }
        match parse_sample_line(line) {
            Ok((name, labels, value)) => {
                let kind = family_kind(&name, &types);
                out.samples.push(Sample {
                    name,
                    labels,
                    value,
                    kind,
                });
            }
            Err(why) => {
                out.bad_lines += 1;
                if out.errors.len() < MAX_REPORTED_ERRORS {
                    out.errors.push(format!("line {}: {why}", i + 1));
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = include_str!("testdata/metrics-sample.txt");

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect()
    }

    #[test]
    fn vllm_sample_every_line_parses() {
        let e = parse(SAMPLE, |_| true);
        assert_eq!(e.bad_lines, 0, "{:?}", e.errors);
        // Every non-comment, non-empty line is one sample.
        let lines = SAMPLE
            .lines()
            .filter(|l| !l.trim().is_empty() && !l.starts_with('#'))
            .count();
        assert_eq!(e.samples.len(), lines);
        let vllm = parse(SAMPLE, |n| n.starts_with("vllm:"));
        assert_eq!(vllm.samples.len(), 374);
        let gen = vllm
            .samples
            .iter()
            .find(|s| s.name == "vllm:generation_tokens_total")
            .unwrap();
        assert_eq!(gen.value, 32.0);
        assert_eq!(gen.kind, Kind::Counter);
        assert_eq!(
            gen.labels,
            labels(&[("engine", "0"), ("model_name", "tiny-moe")])
        );
        let inf = vllm
            .samples
            .iter()
            .find(|s| {
                s.name == "vllm:time_to_first_token_seconds_bucket" && s.labels["le"] == "+Inf"
            })
            .unwrap();
        assert_eq!((inf.value, inf.kind), (2.0, Kind::Histogram));
        // A histogram whose family name ends in _total.
        let it = vllm
            .samples
            .iter()
            .find(|s| s.name == "vllm:iteration_tokens_total_sum")
            .unwrap();
        assert_eq!(it.kind, Kind::Histogram);
        let kv = vllm
            .samples
            .iter()
            .find(|s| s.name == "vllm:kv_cache_usage_perc")
            .unwrap();
        assert_eq!(kv.kind, Kind::Gauge);
        // prometheus_client's creation timestamps are their own gauge families.
        let created = vllm
            .samples
            .iter()
            .find(|s| s.name == "vllm:generation_tokens_created")
            .unwrap();
        assert_eq!(
            (created.kind, created.value),
            (Kind::Gauge, 1.7960045526697462e9)
        );
        // A summary from the HTTP instrumentation.
        let sum = e
            .samples
            .iter()
            .find(|s| s.name == "http_request_size_bytes_count");
        assert_eq!(sum.map(|s| s.kind), Some(Kind::Summary));
    }

    #[test]
    fn grammar_edges() {
        let text = "# HELP m A help, with \"quotes\"\n# TYPE m gauge\n\
            m{a=\"x,y=z\",b=\"q\\\"uote\\\\ \\n\"} 1.5e3 1700000000000\n\
            m{a=\"2\",} -Inf\n\
            m {} NaN\n\
            m 3\n\
            untyped_thing 4\n\
            # TYPE c counter\n\
            c_total 7\n";
        let e = parse(text, |_| true);
        assert_eq!(e.bad_lines, 0, "{:?}", e.errors);
        assert_eq!(e.samples.len(), 6);
        assert_eq!(
            e.samples[0].labels,
            labels(&[("a", "x,y=z"), ("b", "q\"uote\\ \n")])
        );
        assert_eq!(e.samples[0].value, 1500.0);
        assert_eq!(e.samples[1].value, f64::NEG_INFINITY);
        assert_eq!(e.samples[1].labels, labels(&[("a", "2")]));
        assert!(e.samples[2].value.is_nan());
        assert_eq!((e.samples[3].value, e.samples[3].kind), (3.0, Kind::Gauge));
        assert_eq!(e.samples[4].kind, Kind::Untyped);
        assert_eq!(e.samples[5].kind, Kind::Counter);
    }

    #[test]
    fn bad_lines_are_skipped_and_reported() {
        let text = "ok 1\n\
            bad{a=\"unterminated} 1\n\
            bad2{a=x} 1\n\
            bad3 notanumber\n\
            bad4 inf\n\
            bad5 1 2 3\n\
            bad6{a=\"1\",a=\"2\"} 1\n\
            9bad 1\n\
            bad7{a=\"1\" b=\"2\"} 1\n\
            also_ok{x=\"}\"} 2\n";
        let e = parse(text, |_| true);
        assert_eq!(
            e.samples
                .iter()
                .map(|s| s.name.as_str())
                .collect::<Vec<_>>(),
            ["ok", "also_ok"]
        );
        assert_eq!(e.samples[1].labels, labels(&[("x", "}")]));
        assert_eq!(e.bad_lines, 8, "{:?}", e.errors);
        assert!(e.errors[0].starts_with("line 2:"), "{:?}", e.errors);
    }

    #[test]
    fn filter_skips_before_parsing() {
        let e = parse("vllm:a 1\nother{broken 2\n", |n| n.starts_with("vllm:"));
        assert_eq!(e.samples.len(), 1);
        assert_eq!(e.bad_lines, 0);
    }
}
