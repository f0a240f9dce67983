//! Which functions a probe names: `--probe` specs (vLLM's default probes: [`crate::vllm::probes`]).

pub use crate::vllm::probes::{is_headline, names, VLLM_DEFAULT_PROBES, VLLM_HEADLINE_PROBES};

/// A function to probe, as asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeSpec {
    pub spec: String,
    file: Option<String>,
    name: String,
}

impl ProbeSpec {
    /// `[FILE:]QUALNAME`. QUALNAME matches a function's qualified name exactly or as a
    /// dotted suffix (`MessageQueue.enqueue` matches `pkg.<locals>.MessageQueue.enqueue`; a
    /// bare name matches any function of that name); FILE matches the code's file name
    /// exactly or as a path suffix (`shm_broadcast.py`, `device_communicators/shm_broadcast.py`).
    pub fn parse(s: &str) -> anyhow::Result<Self> {
        let s = s.trim();
        let (file, name) = match s.rsplit_once(':') {
            Some((f, n)) => (Some(f.trim().to_string()), n.trim().to_string()),
            None => (None, s.to_string()),
        };
        anyhow::ensure!(
            !name.is_empty()
                && !name.starts_with('.')
                && !name.ends_with('.')
                && file.as_ref().is_none_or(|f| !f.is_empty()),
            "bad probe {s:?}: expected [FILE:]QUALNAME, e.g. MessageQueue.enqueue or shm_broadcast.py:MessageQueue.dequeue"
        );
        Ok(ProbeSpec {
            spec: s.to_string(),
            file,
            name,
        })
    }

    /// `has_qualname`: false for 3.10 code objects, which carry only the bare name; then the
    /// spec's last component is compared.
    pub fn matches(&self, qualname: &str, filename: &str, has_qualname: bool) -> bool {
        let name_ok = if has_qualname {
            names(qualname, &self.name)
        } else {
            self.name.rsplit('.').next() == Some(qualname)
        };
        let file_ok = match &self.file {
            None => true,
            Some(f) => {
                filename == f
                    || filename
                        .strip_suffix(f.as_str())
                        .is_some_and(|head| head.ends_with('/'))
            }
        };
        name_ok && file_ok
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_matching() {
        let p = ProbeSpec::parse("MessageQueue.enqueue").unwrap();
        assert!(p.matches("MessageQueue.enqueue", "/x/shm_broadcast.py", true));
        assert!(p.matches("f.<locals>.MessageQueue.enqueue", "a.py", true));
        assert!(!p.matches("OtherMessageQueue.enqueue", "a.py", true));
        assert!(!p.matches("MessageQueue.enqueue_many", "a.py", true));
        let p = ProbeSpec::parse("shm_broadcast.py:MessageQueue.dequeue").unwrap();
        assert!(p.matches(
            "MessageQueue.dequeue",
            "/v/device_communicators/shm_broadcast.py",
            true
        ));
        assert!(p.matches("MessageQueue.dequeue", "shm_broadcast.py", true));
        assert!(!p.matches("MessageQueue.dequeue", "/v/not_shm_broadcast.py", true));
        let p = ProbeSpec::parse("execute_model").unwrap();
        assert!(p.matches("Worker.execute_model", "w.py", true));
        assert!(p.matches("execute_model", "w.py", true));
        let p = ProbeSpec::parse("MessageQueue.enqueue").unwrap();
        assert!(p.matches("enqueue", "a.py", false));
        for bad in ["", ":f", "f.", ".f", "x.py:"] {
            assert!(ProbeSpec::parse(bad).is_err(), "{bad}");
        }
    }
}
