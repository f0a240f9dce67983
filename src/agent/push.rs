//! `agent --push URL`: the agent's CPU profiles pushed to a Pyroscope server (or Grafana
//! Alloy's `pyroscope.receive_http`) on an interval, through Pyroscope's ingest API:
//! `POST URL/ingest?name=APP.cpu{LABELS}&from=UNIX_S&until=UNIX_S&format=pprof&sampleRate=HZ
//! &spyName=enginescope`, the body `multipart/form-data` with the gzipped pprof profile in the
//! field `profile`. Each profile covers the seconds since the previous one, end to end: the
//! window is cut as the pull endpoint cuts it ([`super::profiles`]), so no second is counted
//! twice or left out while the backend takes them.
//!
//! Bounds: a dead or slow backend never grows the agent. One request at a time, each with a
//! timeout; a profile that is not accepted (an error, a non-2xx answer) is kept to be sent
//! again, oldest first, with at most [`MAX_KEPT`] kept: past that the oldest is dropped. The
//! counter `enginescope_profile_pushes{kind="sent"|"failed"|"dropped"}` says what happened.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;

use super::metrics::KindLabels;
use super::profiles;
use crate::views::pprof;

/// Profiles kept while the backend does not take them.
pub(crate) const MAX_KEPT: usize = 4;
/// Most time one push may take.
const TIMEOUT: Duration = Duration::from_secs(10);
/// What separates the multipart body's parts (never inside a gzipped profile's bytes as a
/// line of its own: the body is framed by it with CRLF and dashes around it).
const BOUNDARY: &str = "enginescope-profile-3c1f9a0e7b5d";

/// Where and how often to push.
#[derive(Debug, Clone)]
pub struct PushOptions {
    /// The server's base URL, e.g. `http://pyroscope:4040` (`/ingest` is added).
    pub url: String,
    pub every: Duration,
    /// The application name (`name=APP.cpu{…}`).
    pub app: String,
    /// Labels of every profile (`host` is added when absent).
    pub labels: Vec<(String, String)>,
    /// The sampling rate, Hz (Pyroscope's `sampleRate`).
    pub rate_hz: u32,
}

/// One profile waiting to be sent.
struct Pending {
    from_s: u64,
    until_s: u64,
    body: Vec<u8>,
}

/// Push until `stop`, each window built from the agent's segments as the pull endpoint builds
/// its own.
pub fn run(
    opts: PushOptions,
    profiles: profiles::Profiles,
    counts: Family<KindLabels, Counter>,
    stop: Arc<AtomicBool>,
) {
    let count = |k: &str| {
        counts.get_or_create(&KindLabels { kind: k.into() }).inc();
    };
    let client: ureq::Agent = ureq::Agent::config_builder()
        .timeout_global(Some(TIMEOUT))
        .http_status_as_error(false)
        .build()
        .into();
    let name = app_name(&opts);
    let mut kept: VecDeque<Pending> = VecDeque::new();
    let mut t0 = crate::sys::monotonic_ns();
    let mut since = SystemTime::now();
    profiles.edge();
    while !stop.load(Ordering::SeqCst) {
        if !sleep_unless(&stop, opts.every) {
            break;
        }
        let t1 = crate::sys::monotonic_ns();
        let until = SystemTime::now();
        profiles.edge();
        match profiles
            .build(pprof::Kind::Cpu, since, t0, t1)
            .and_then(|p| pprof::encode(&p))
        {
            Ok(profile) => {
                if kept.len() == MAX_KEPT {
                    kept.pop_front();
                    count("dropped");
                }
                kept.push_back(Pending {
                    from_s: profiles::unix_ns(since) as u64 / 1_000_000_000,
                    until_s: (profiles::unix_ns(until) as u64).div_ceil(1_000_000_000),
                    body: multipart(&profile),
                });
            }
            Err(e) => eprintln!("enginescope: agent: building the profile to push: {e:#}"),
        }
        (t0, since) = (t1, until);
        // Oldest first; the first failure leaves the rest for the next turn.
        while let Some(p) = kept.front() {
            match send(&client, &opts, &name, p) {
                Ok(()) => {
                    kept.pop_front();
                    count("sent");
                }
                Err(e) => {
                    count("failed");
                    eprintln!("enginescope: agent: pushing a profile to {}: {e}", opts.url);
                    break;
                }
            }
        }
    }
}

/// Sleep `d` in short steps; false once `stop` is set.
fn sleep_unless(stop: &AtomicBool, d: Duration) -> bool {
    let step = Duration::from_millis(100);
    let mut left = d;
    while !left.is_zero() {
        if stop.load(Ordering::SeqCst) {
            return false;
        }
        let s = left.min(step);
        std::thread::sleep(s);
        left -= s;
    }
    !stop.load(Ordering::SeqCst)
}

/// `APP.cpu{k=v,…}`, with `host` when not given.
pub(crate) fn app_name(opts: &PushOptions) -> String {
    let mut labels = opts.labels.clone();
    if !labels.iter().any(|(k, _)| k == "host") {
        labels.push(("host".into(), crate::sys::hostname()));
    }
    let inner: Vec<String> = labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
    format!("{}.cpu{{{}}}", opts.app, inner.join(","))
}

/// The ingest request's body: one part, `profile`, holding the gzipped pprof bytes.
pub fn multipart(profile: &[u8]) -> Vec<u8> {
    let mut b = format!(
        "--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"profile\"; filename=\"profile.pprof\"\r\nContent-Type: application/octet-stream\r\n\r\n"
    )
    .into_bytes();
    b.extend_from_slice(profile);
    b.extend_from_slice(format!("\r\n--{BOUNDARY}--\r\n").as_bytes());
    b
}

fn send(client: &ureq::Agent, opts: &PushOptions, name: &str, p: &Pending) -> Result<(), String> {
    let url = format!("{}/ingest", opts.url.trim_end_matches('/'));
    let r = client
        .post(&url)
        .query("name", name)
        .query("from", p.from_s.to_string())
        .query("until", p.until_s.to_string())
        .query("format", "pprof")
        .query("sampleRate", opts.rate_hz.to_string())
        .query("spyName", "enginescope")
        .header(
            "Content-Type",
            format!("multipart/form-data; boundary={BOUNDARY}"),
        )
        .send(&p.body[..])
        .map_err(|e| e.to_string())?;
    let status = r.status().as_u16();
    if (200..300).contains(&status) {
        Ok(())
    } else {
        Err(format!("HTTP {status}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn name_carries_labels_and_host() {
        let o = PushOptions {
            url: "http://x".into(),
            every: Duration::from_secs(1),
            app: "vllm".into(),
            labels: vec![("engine".into(), "e0".into()), ("host".into(), "h1".into())],
            rate_hz: 19,
        };
        assert_eq!(app_name(&o), "vllm.cpu{engine=e0,host=h1}");
        let o = PushOptions {
            labels: vec![],
            ..o
        };
        assert!(
            app_name(&o).starts_with("vllm.cpu{host="),
            "{}",
            app_name(&o)
        );
    }

    #[test]
    fn multipart_frames_the_profile() {
        let body = multipart(b"\x1f\x8bPROFILE");
        let s = String::from_utf8_lossy(&body);
        assert!(s.starts_with(&format!("--{BOUNDARY}\r\n")));
        assert!(s.contains("name=\"profile\""));
        assert!(s.contains("\r\n\r\n\u{1f}\u{fffd}PROFILE\r\n"), "{s:?}");
        assert!(s.ends_with(&format!("\r\n--{BOUNDARY}--\r\n")));
    }
}
