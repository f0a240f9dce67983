//! The static offset tables (3.10–3.12) must equal what the compiler computes from each
//! interpreter's own internal headers (tools/pyoffsets.c), field by field.

mod common;

use common::*;
use std::process::Command;

fn check(label: &str) {
    let i = interp(label);
    if !available(&i) {
        return;
    }
    let Launch::Host(exe) = &i.launch else {
        unreachable!()
    };
    let prefix = exe.parent().unwrap().parent().unwrap();
    let ver = label.trim_start_matches("pyenv-");
    let inc = prefix.join("include").join(format!("python{ver}"));
    assert!(
        inc.join("internal").exists(),
        "{label}: no internal headers at {}",
        inc.display()
    );
    let bin = std::env::temp_dir().join(format!("pyoffsets-{ver}-{}", std::process::id()));
    let cc = Command::new("cc")
        .arg("-DPy_BUILD_CORE")
        .arg(format!("-I{}", inc.display()))
        .arg(format!("-I{}", inc.join("internal").display()))
        .arg(repo_root().join("tools/pyoffsets.c"))
        .arg("-o")
        .arg(&bin)
        .output()
        .expect("cc");
    assert!(
        cc.status.success(),
        "{}",
        String::from_utf8_lossy(&cc.stderr)
    );
    let from_headers = Command::new(&bin).output().unwrap();
    let _ = std::fs::remove_file(&bin);
    let mut want: Vec<String> = String::from_utf8_lossy(&from_headers.stdout)
        .lines()
        .map(String::from)
        .collect();
    want.sort();
    let ours = enginescope(&["doctor", "--offsets-table", ver]);
    assert!(ours.status.success());
    let got: Vec<String> = String::from_utf8_lossy(&ours.stdout)
        .lines()
        .map(String::from)
        .collect();
    for w in &want {
        assert!(
            got.contains(w),
            "{label}: headers say {w}; our table: {got:?}"
        );
    }
    assert_eq!(got, want, "{label}: every field of our table is checked");
}

#[test]
fn table_3_10_matches_headers() {
    check("pyenv-3.10");
}
#[test]
fn table_3_11_matches_headers() {
    check("pyenv-3.11");
}
#[test]
fn table_3_12_matches_headers() {
    check("pyenv-3.12");
}
