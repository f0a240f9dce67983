//! `enginescope agent` run from a test: started, its stderr followed, its /metrics read and
//! parsed, stopped cleanly (killed if the test fails first).

use std::collections::BTreeMap;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::RecvTimeoutError;
use std::time::{Duration, Instant};

/// A running `enginescope agent`; killed on drop.
pub struct Agent {
    pub child: Child,
    /// Its stderr, and what it said so far (`err.log`).
    pub err: super::StderrLines,
    pub addr: String,
}

impl Agent {
    pub fn start(args: &[&str]) -> Agent {
        Self::start_env(args, &[])
    }

    /// With `env` added to its environment.
    pub fn start_env(args: &[&str], env: &[(&str, &str)]) -> Agent {
        let mut child = Command::new(env!("CARGO_BIN_EXE_enginescope"))
            .arg("agent")
            .args(args)
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn enginescope agent");
        let err = super::StderrLines::follow(&mut child);
        let mut a = Agent {
            child,
            err,
            addr: String::new(),
        };
        let l = a.wait_line("serving metrics on http://", Duration::from_secs(30));
        a.addr = l
            .split("http://")
            .nth(1)
            .and_then(|r| r.split('/').next())
            .unwrap()
            .to_string();
        a
    }

    /// Wait for a stderr line containing `needle`.
    pub fn wait_line(&mut self, needle: &str, within: Duration) -> String {
        match self.err.wait(|l| l.contains(needle), within) {
            Ok(l) => l,
            Err(RecvTimeoutError::Timeout) => {
                panic!(
                    "no line with {needle:?} within {within:?}:\n{}",
                    self.err.log
                )
            }
            Err(RecvTimeoutError::Disconnected) => {
                panic!("agent exited before {needle:?}:\n{}", self.err.log)
            }
        }
    }

    pub fn drain_log(&mut self) {
        self.err.drain();
    }

    pub fn metrics(&self) -> String {
        http_get(&format!("http://{}/metrics", self.addr)).expect("GET /metrics")
    }

    /// SIGINT, then wait (bounded) for a clean exit.
    pub fn stop(mut self) -> String {
        // SAFETY: kill(2) on the agent we started.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGINT) };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                self.drain_log();
                assert!(st.success(), "agent exit {st:?}:\n{}", self.err.log);
                return std::mem::take(&mut self.err.log);
            }
            assert!(
                Instant::now() < deadline,
                "agent did not stop on SIGINT:\n{}",
                self.err.log
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn http_get(url: &str) -> Result<String, String> {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_global(Some(Duration::from_secs(10)))
        .http_status_as_error(false)
        .build()
        .into();
    let mut r = agent.get(url).call().map_err(|e| e.to_string())?;
    let status = r.status().as_u16();
    let body = r.body_mut().read_to_string().map_err(|e| e.to_string())?;
    if status != 200 {
        return Err(format!("{url}: HTTP {status}: {body}"));
    }
    Ok(body)
}

/// One exposed sample: name, labels, value.
#[derive(Debug, Clone)]
pub struct Exposed {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

/// Parse the Prometheus text format (as the agent writes it: no timestamps).
pub fn parse_exposition(text: &str) -> Vec<Exposed> {
    let mut out = Vec::new();
    for line in text.lines() {
        if line.starts_with('#') || line.trim().is_empty() {
            continue;
        }
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let Ok(value) = value.parse::<f64>() else {
            continue;
        };
        let (name, labels) = match series.split_once('{') {
            None => (series.to_string(), BTreeMap::new()),
            Some((n, rest)) => {
                let body = rest.strip_suffix('}').unwrap_or(rest);
                let mut labels = BTreeMap::new();
                let mut chars = body.chars().peekable();
                loop {
                    let key: String = chars.by_ref().take_while(|&c| c != '=').collect();
                    if key.is_empty() {
                        break;
                    }
                    assert_eq!(chars.next(), Some('"'));
                    let mut v = String::new();
                    while let Some(c) = chars.next() {
                        match c {
                            '\\' => {
                                if let Some(e) = chars.next() {
                                    v.push(if e == 'n' { '\n' } else { e });
                                }
                            }
                            '"' => break,
                            c => v.push(c),
                        }
                    }
                    labels.insert(key.trim_start_matches(',').to_string(), v);
                    if chars.peek() == Some(&',') {
                        chars.next();
                    }
                }
                (n.to_string(), labels)
            }
        };
        out.push(Exposed {
            name,
            labels,
            value,
        });
    }
    out
}

/// Sum of the samples named `name` whose labels include every pair of `want`.
pub fn sum_of(exp: &[Exposed], name: &str, want: &[(&str, &str)]) -> f64 {
    exp.iter()
        .filter(|e| e.name == name)
        .filter(|e| {
            want.iter()
                .all(|(k, v)| e.labels.get(*k).map(String::as_str) == Some(*v))
        })
        .map(|e| e.value)
        .sum()
}

/// Poll `f` until it holds or `within` passes (a value the agent exports once per interval);
/// the last value either way.
pub fn poll_until<T>(within: Duration, every: Duration, mut f: impl FnMut() -> (bool, T)) -> T {
    let deadline = Instant::now() + within;
    loop {
        let (ok, v) = f();
        if ok || Instant::now() >= deadline {
            return v;
        }
        std::thread::sleep(every);
    }
}
