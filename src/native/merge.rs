//! Merge a sample's native frames with its Python frames.
//!
//! Both lists are innermost first. The Python frames are cut into runs, one per C-level call
//! of the evaluation loop: a run ends (outwards) at a frame the kernel marked as entered from
//! C (`FRAME_ENTRY`: a shim frame follows it on 3.12+, `is_entry` on 3.11; every frame on
//! 3.10, where each Python call is its own loop call). Walking the native frames from the
//! innermost, the i-th evaluation-loop frame (`_PyEval_EvalFrameDefault`) is replaced by the
//! i-th run, as py-spy's `--native` does. Native frames between two loop frames are the C code
//! one Python run called (`save_list` under `pickle.dumps`, `PyObject_Call` back into Python).
//!
//! Alignment starts from the innermost frames because a copied stack window can end before the
//! outermost ones: when the unwind stops early, the Python runs left over go on top as they
//! are. Without any loop frame (no symbol for the loop, or the window held none), the leaf
//! native function and the kernel frames sit on top of the whole Python stack: at least the
//! C function being executed is named.

use crate::cpython::Frame;
use crate::record::NativeFrameInfo;

use super::NativeFrames;

/// Frames innermost first, each with its native description (`None` for a Python frame).
pub(crate) type Mixed = Vec<(Frame, Option<NativeFrameInfo>)>;

/// How a merge went (for counters and tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MergeKind {
    /// Loop frames matched Python runs one for one.
    Exact,
    /// Some runs or loop frames were left over (a cut window, a truncated walk).
    Partial,
    /// No loop frame: leaf native frames on top of the Python stack.
    LeafOnly,
    /// No Python frames: native (and kernel) frames only.
    NativeOnly,
}

/// Split Python frames (innermost first) into runs at entry marks (a run ends with the frame
/// marked as entered from C).
pub fn runs(python: &[Frame], entry: &[bool]) -> Vec<Vec<Frame>> {
    let mut out: Vec<Vec<Frame>> = Vec::new();
    let mut cur = Vec::new();
    for (i, f) in python.iter().enumerate() {
        cur.push(f.clone());
        if entry.get(i).copied().unwrap_or(false) {
            out.push(std::mem::take(&mut cur));
        }
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

/// Merge. `python` and `entry` are the resolved Python frames and their entry marks.
pub fn merge(python: &[Frame], entry: &[bool], native: &NativeFrames) -> (Mixed, MergeKind) {
    let mut out: Mixed = native
        .kernel
        .iter()
        .map(|(f, i)| (f.clone(), Some(i.clone())))
        .collect();
    let user = &native.user;
    let push_native = |out: &mut Mixed, r: std::ops::Range<usize>| {
        for (f, i, _) in &user[r] {
            out.push((f.clone(), Some(i.clone())));
        }
    };
    if python.is_empty() {
        push_native(&mut out, 0..user.len());
        return (out, MergeKind::NativeOnly);
    }
    let evals: Vec<usize> = user
        .iter()
        .enumerate()
        .filter(|(_, u)| u.2)
        .map(|(i, _)| i)
        .collect();
    let groups = runs(python, entry);
    if evals.is_empty() {
        // The leaf function only: frames further out would be the interpreter's own calls,
        // which cannot be placed between Python frames without the loop's frames.
        if let Some((f, i, _)) = user.first() {
            out.push((f.clone(), Some(i.clone())));
        }
        out.extend(python.iter().map(|f| (f.clone(), None)));
        return (out, MergeKind::LeafOnly);
    }
    let k = evals.len().min(groups.len());
    push_native(&mut out, 0..evals[0]);
    for i in 0..k {
        out.extend(groups[i].iter().map(|f| (f.clone(), None)));
        let from = evals[i] + 1;
        let to = if i + 1 < evals.len() {
            evals[i + 1]
        } else {
            user.len()
        };
        if i + 1 < k {
            push_native(&mut out, from..to);
        }
    }
    // Leftovers: native frames outside the last matched loop frame (with any unmatched loop
    // frames among them, named as they are), then Python runs the window did not reach.
    let last = evals[k - 1] + 1;
    push_native(&mut out, last.min(user.len())..user.len());
    for g in &groups[k..] {
        out.extend(g.iter().map(|f| (f.clone(), None)));
    }
    let kind = if evals.len() == groups.len() {
        MergeKind::Exact
    } else {
        MergeKind::Partial
    };
    (out, kind)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::FRAME_NATIVE;

    fn py(name: &str) -> Frame {
        Frame {
            function: name.into(),
            file: "x.py".into(),
            line: Some(1),
        }
    }

    fn nat(name: &str, eval: bool) -> (Frame, NativeFrameInfo, bool) {
        (
            Frame {
                function: name.into(),
                file: "/lib/libpython3.12.so".into(),
                line: None,
            },
            NativeFrameInfo {
                kind: FRAME_NATIVE,
                addr: 0,
                module: "/lib/libpython3.12.so".into(),
                build_id: String::new(),
            },
            eval,
        )
    }

    fn names(m: &Mixed) -> Vec<&str> {
        m.iter().map(|(f, _)| f.function.as_str()).collect()
    }

    #[test]
    fn loop_frames_become_python_runs() {
        // Python: leaf (called from C via callback), mid, outer (run entered from main).
        let python = [py("leaf"), py("mid"), py("outer")];
        let entry = [true, false, true];
        let native = NativeFrames {
            kernel: vec![],
            user: vec![
                nat("save_list", false),
                nat("_PyEval_EvalFrameDefault", true),
                nat("PyObject_Call", false),
                nat("_PyEval_EvalFrameDefault", true),
                nat("main", false),
            ],
            complete: true,
        };
        let (m, k) = merge(&python, &entry, &native);
        assert_eq!(k, MergeKind::Exact);
        assert_eq!(
            names(&m),
            ["save_list", "leaf", "PyObject_Call", "mid", "outer", "main"]
        );
        assert!(m[1].1.is_none() && m[0].1.is_some());
    }

    #[test]
    fn cut_window_keeps_outer_python() {
        let python = [py("leaf"), py("mid"), py("outer")];
        let entry = [true, true, true];
        let native = NativeFrames {
            kernel: vec![],
            user: vec![
                nat("zlib_deflate", false),
                nat("_PyEval_EvalFrameDefault", true),
            ],
            complete: false,
        };
        let (m, k) = merge(&python, &entry, &native);
        assert_eq!(k, MergeKind::Partial);
        assert_eq!(names(&m), ["zlib_deflate", "leaf", "mid", "outer"]);
    }

    #[test]
    fn without_loop_frames_the_leaf_goes_on_top() {
        let python = [py("leaf"), py("outer")];
        let native = NativeFrames {
            kernel: vec![],
            user: vec![nat("memcpy", false), nat("0x1234", false)],
            complete: false,
        };
        let (m, k) = merge(&python, &[false, false], &native);
        assert_eq!(k, MergeKind::LeafOnly);
        assert_eq!(names(&m), ["memcpy", "leaf", "outer"]);
        let (m, k) = merge(&[], &[], &native);
        assert_eq!(k, MergeKind::NativeOnly);
        assert_eq!(names(&m), ["memcpy", "0x1234"]);
    }
}
