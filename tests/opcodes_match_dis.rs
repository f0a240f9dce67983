//! enginescope finds a probed function's return instructions by walking its adaptive bytecode
//! (specialized instructions and inline caches included) with per-version opcode tables. Check
//! the walk against each interpreter's own `dis` on thousands of warmed-up code objects.

mod common;

use common::*;
use enginescope::cpython::opcodes::{return_sites, WalkError};
use std::process::Command;

fn check(label: &str, minor: u8) {
    let i = interp(label);
    if !available(&i) {
        return;
    }
    let script =
        std::fs::read_to_string(repo_root().join("tests/fixtures/dis_returns.py")).unwrap();
    let mut cmd = match &i.launch {
        Launch::Host(exe) => Command::new(exe),
        Launch::Container { root, exe } => {
            let mut c = Command::new("chroot");
            c.arg(root).arg(exe);
            c
        }
    };
    let out = cmd
        .arg("-c")
        .arg(&script)
        .output()
        .expect("run the interpreter");
    assert!(
        out.status.success(),
        "{label}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (mut n, mut gens) = (0, 0);
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        let code: Vec<u8> = (0..v["code"].as_str().unwrap().len() / 2)
            .map(|k| {
                u8::from_str_radix(&v["code"].as_str().unwrap()[2 * k..2 * k + 2], 16).unwrap()
            })
            .collect();
        let want: Vec<usize> = v["returns"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as usize)
            .collect();
        let got = return_sites(minor, &code);
        if v["gen"].as_bool().unwrap() {
            assert!(
                matches!(got, Err(WalkError::Generator { .. })),
                "{label} {}: a generator must be refused, got {got:?}",
                v["name"]
            );
            gens += 1;
        } else {
            assert_eq!(got, Ok(want), "{label} {}", v["name"]);
        }
        n += 1;
    }
    eprintln!("{label}: {n} code objects ({gens} generators) walked as dis reads them");
    assert!(n >= 1000, "{label}: only {n} code objects");
}

#[test]
fn walk_matches_dis_311() {
    check("pyenv-3.11", 11);
}
#[test]
fn walk_matches_dis_312() {
    check("pyenv-3.12", 12);
}
#[test]
fn walk_matches_dis_313() {
    check("pyenv-3.13", 13);
}
#[test]
fn walk_matches_dis_314() {
    check("sid-3.14", 14);
}
#[test]
fn walk_matches_dis_315() {
    check("sid-3.15", 15);
}
