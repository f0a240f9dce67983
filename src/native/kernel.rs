//! Kernel addresses named from `/proc/kallsyms`.

use super::*;

/// `/proc/kallsyms`, sorted, text symbols only.
pub struct KernelSymbols {
    /// (address, name's range in `names`), sorted by address.
    syms: Vec<(u64, u32, u32)>,
    names: String,
}

impl KernelSymbols {
    /// Read `/proc/kallsyms`; empty (every kernel frame `[kernel]`) when unreadable or when
    /// addresses are hidden (kptr_restrict).
    pub fn load() -> Self {
        let text = std::fs::read_to_string("/proc/kallsyms").unwrap_or_default();
        Self::parse(&text)
    }

    /// An empty table (kernel frames are not named).
    pub fn empty() -> Self {
        KernelSymbols {
            syms: Vec::new(),
            names: String::new(),
        }
    }

    /// Parse kallsyms text (`ADDR TYPE NAME [MODULE]` lines). Read at every start with kernel
    /// stacks (~120,000 lines here), so by hand, with the names in one string. The
    /// `__pfx_` padding symbols (16 bytes before each function, never executed) are left
    /// out: half the lines.
    pub fn parse(text: &str) -> Self {
        let mut syms = Vec::with_capacity(text.len() / 48);
        let mut names = String::with_capacity(text.len() / 3);
        let sep = |c: char| c == ' ' || c == '\t';
        for l in text.split('\n') {
            // `ADDR T NAME`: the type is the one byte between the first two spaces.
            let Some((addr, rest)) = l.split_once(' ') else {
                continue;
            };
            if !matches!(rest.as_bytes(), [b't' | b'T' | b'w' | b'W', b' ', ..]) {
                continue;
            }
            let name = rest[2..].split(sep).next().unwrap_or("");
            if name.is_empty() || name.starts_with("__pfx_") {
                continue;
            }
            let Ok(addr) = u64::from_str_radix(addr.trim(), 16) else {
                continue;
            };
            let (Ok(start), Ok(len)) = (u32::try_from(names.len()), u32::try_from(name.len()))
            else {
                break;
            };
            if addr == 0 {
                continue;
            }
            names.push_str(name);
            syms.push((addr, start, len));
        }
        syms.sort_unstable_by_key(|s| s.0);
        syms.dedup_by_key(|s| s.0);
        KernelSymbols { syms, names }
    }

    pub fn is_empty(&self) -> bool {
        self.syms.is_empty()
    }

    /// The symbol containing `addr` and its start address.
    pub(crate) fn lookup(&self, addr: u64) -> Option<(u64, &str)> {
        let i = self.syms.partition_point(|s| s.0 <= addr);
        let &(start, from, len) = self.syms.get(i.checked_sub(1)?)?;
        // Past the last text symbol is not kernel text we can name.
        if i == self.syms.len() && addr - start > 1 << 20 {
            return None;
        }
        let name = self
            .names
            .get(from as usize..from as usize + len as usize)
            .unwrap_or("");
        Some((start, name))
    }

    /// A kernel frame for a return address (the call is the byte before it) or the IP.
    pub fn frame(&self, addr: u64, is_return: bool) -> (Frame, NativeFrameInfo) {
        let look = if is_return {
            addr.saturating_sub(1)
        } else {
            addr
        };
        let (start, name) = match self.lookup(look) {
            Some((s, n)) => (s, n.to_string()),
            None => (0, format!("0x{addr:x}")),
        };
        (
            Frame {
                function: name,
                file: KERNEL_MODULE.to_string(),
                line: None,
            },
            NativeFrameInfo {
                kind: FRAME_KERNEL,
                addr: start,
                module: KERNEL_MODULE.to_string(),
                build_id: String::new(),
            },
        )
    }
}
