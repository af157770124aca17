//! CI check: `include/qccl.h` (written by hand) and the library agree.
//!
//! - the functions the header declares, the `extern "C"` functions in `ffi/src/`, and the
//!   `qccl*` symbols `libqccl.so` exports (`nm -D --defined-only`) are the same set;
//! - each function's return and parameter types in the header match the Rust signature
//!   (Rust types mapped to their C spelling);
//! - every enum value and `#define` number in the header matches the Rust constant;
//! - libqccl.so carries the SONAME `libqccl.so.<major>` (ffi/build.rs).

mod common;

use common::{elf_dynamic_names, expected_soname, lib_dir, readelf_soname, root};
use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;

type Sig = (String, Vec<String>);

fn strip_comments(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while !rest.is_empty() {
        if let Some(r) = rest.strip_prefix("/*") {
            rest = r.find("*/").map_or("", |i| &r[i + 2..]);
            out.push(' ');
        } else if let Some(r) = rest.strip_prefix("//") {
            rest = r.find('\n').map_or("", |i| &r[i..]);
        } else {
            let c = rest.chars().next().unwrap();
            out.push(c);
            rest = &rest[c.len_utf8()..];
        }
    }
    out
}

/// Canonical C type text: single spaces, `*` attached to the type, no top-level `const` on
/// a value parameter.
fn canon_c(t: &str) -> String {
    let spaced = t.replace('*', " * ");
    let mut s = spaced.split_whitespace().collect::<Vec<_>>().join(" ");
    s = s.replace(" *", "*");
    if !s.contains('*') {
        if let Some(r) = s.strip_prefix("const ") {
            s = r.to_string();
        }
    }
    s
}

fn is_ident(s: &str) -> bool {
    !s.is_empty()
        && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        && !s.chars().next().unwrap().is_ascii_digit()
}

/// A parameter's type without its name ("const void* sendbuff" -> "const void*").
fn c_param_type(p: &str) -> String {
    let p = p.trim();
    let cut = p
        .rfind(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .map_or(0, |i| i + 1);
    let (ty, name) = p.split_at(cut);
    if is_ident(name) && !ty.trim().is_empty() {
        canon_c(ty)
    } else {
        canon_c(p)
    }
}

fn header_text() -> String {
    std::fs::read_to_string(root().join("include/qccl.h")).unwrap()
}

/// Functions declared in the header.
fn header_functions() -> BTreeMap<String, Sig> {
    let text = strip_comments(&header_text());
    let code: String = text
        .lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .collect::<Vec<_>>()
        .join("\n");
    let mut out = BTreeMap::new();
    for stmt in code.split(';') {
        let stmt = stmt.trim();
        let stmt = stmt.rsplit('}').next().unwrap().trim(); // after a typedef's or extern's brace
        if stmt.starts_with("typedef") || !stmt.contains('(') {
            continue;
        }
        let open = stmt.find('(').unwrap();
        let close = stmt.rfind(')').expect("unbalanced declaration");
        let head = stmt[..open].trim();
        let name = head
            .rsplit(|c: char| c.is_whitespace() || c == '*')
            .next()
            .unwrap();
        let ret = canon_c(&head[..head.len() - name.len()]);
        let params_text = stmt[open + 1..close].trim();
        let params = if params_text == "void" || params_text.is_empty() {
            vec![]
        } else {
            params_text.split(',').map(c_param_type).collect()
        };
        assert!(
            name.starts_with("qccl"),
            "unexpected declaration in qccl.h: {stmt}"
        );
        assert!(
            out.insert(name.to_string(), (ret, params)).is_none(),
            "{name} declared twice"
        );
    }
    out
}

/// The C spelling of a Rust FFI type.
fn rust_to_c(t: &str) -> String {
    let t = t.trim();
    for (prefix, is_const) in [("*const ", true), ("*mut ", false)] {
        if let Some(inner) = t.strip_prefix(prefix) {
            let base = rust_to_c(inner);
            let inner_is_ptr = inner.trim_start().starts_with('*');
            return match (is_const, inner_is_ptr) {
                (true, true) => format!("{base} const*"),
                (true, false) => format!("const {base}*"),
                (false, _) => format!("{base}*"),
            };
        }
    }
    match t {
        "c_void" => "void",
        "c_char" => "char",
        "c_int" => "int",
        "c_float" | "f32" => "float",
        "usize" => "size_t",
        "u64" => "uint64_t",
        other => return other.to_string(),
    }
    .to_string()
}

/// `extern "C"` functions in ffi/src (and whether each is `#[no_mangle]`).
fn source_functions() -> BTreeMap<String, Sig> {
    let mut out = BTreeMap::new();
    let dir = root().join("ffi/src");
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "rs") {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        let mut from = 0;
        while let Some(i) = text[from..].find("extern \"C\" fn ") {
            let at = from + i;
            from = at + 1;
            let before = &text[..at];
            let attrs: Vec<&str> = before
                .lines()
                .rev()
                .skip(1)
                .take_while(|l| {
                    l.trim_start().starts_with("#[") || l.trim_start().starts_with("///")
                })
                .collect();
            let rest = &text[at + "extern \"C\" fn ".len()..];
            let open = rest.find('(').unwrap();
            let name = rest[..open].trim().to_string();
            assert!(
                attrs.iter().any(|l| l.contains("#[no_mangle]")),
                "{name} in {} is not #[no_mangle]",
                path.display()
            );
            let mut depth = 0;
            let mut close = open;
            for (k, c) in rest[open..].char_indices() {
                match c {
                    '(' => depth += 1,
                    ')' => {
                        depth -= 1;
                        if depth == 0 {
                            close = open + k;
                            break;
                        }
                    }
                    _ => {}
                }
            }
            let params: Vec<String> = rest[open + 1..close]
                .split(',')
                .map(str::trim)
                .filter(|p| !p.is_empty())
                .map(|p| rust_to_c(p.split_once(':').expect("param without type").1))
                .collect();
            let after = rest[close + 1..].trim_start();
            let ret = after
                .strip_prefix("->")
                .map(|r| rust_to_c(r[..r.find('{').unwrap()].trim()))
                .unwrap_or_else(|| "void".into());
            assert!(
                out.insert(
                    name.clone(),
                    (canon_c(&ret), params.iter().map(|p| canon_c(p)).collect())
                )
                .is_none(),
                "{name} defined twice"
            );
        }
    }
    out
}

#[test]
fn header_declarations_match_the_rust_functions() {
    let header = header_functions();
    let source = source_functions();
    assert!(
        header.len() >= 35,
        "only {} functions found in qccl.h",
        header.len()
    );
    let hn: BTreeSet<_> = header.keys().collect();
    let sn: BTreeSet<_> = source.keys().collect();
    assert_eq!(
        hn,
        sn,
        "only in qccl.h: {:?}; only in ffi/src: {:?}",
        hn.difference(&sn).collect::<Vec<_>>(),
        sn.difference(&hn).collect::<Vec<_>>()
    );
    for (name, sig) in &header {
        assert_eq!(
            &source[name], sig,
            "{name}: qccl.h and ffi/src disagree (return, params)"
        );
    }
}

#[test]
fn exported_symbols_match_the_header() {
    let lib = lib_dir().join("libqccl.so");
    assert!(lib.exists(), "{} was not built", lib.display());
    let out = match Command::new("nm")
        .args(["-D", "--defined-only"])
        .arg(&lib)
        .output()
    {
        Ok(o) if o.status.success() => o,
        Ok(o) => panic!("nm failed: {}", String::from_utf8_lossy(&o.stderr)),
        Err(e) => {
            // The source check above still compares the header with the Rust functions.
            eprintln!("nm not available ({e}); skipping the exported-symbol check");
            return;
        }
    };
    let exported: BTreeSet<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace().rev();
            let name = f.next()?;
            let kind = f.next()?;
            (kind == "T" && name.starts_with("qccl")).then(|| name.to_string())
        })
        .collect();
    let declared: BTreeSet<String> = header_functions().into_keys().collect();
    assert_eq!(
        declared,
        exported,
        "declared but not exported: {:?}; exported but not declared: {:?}",
        declared.difference(&exported).collect::<Vec<_>>(),
        exported.difference(&declared).collect::<Vec<_>>()
    );
}

#[test]
fn library_soname_is_the_major_version() {
    let lib = lib_dir().join("libqccl.so");
    assert!(lib.exists(), "{} was not built", lib.display());
    if !cfg!(target_os = "linux") {
        eprintln!("not Linux: skipping the SONAME check (ffi/build.rs sets it on ELF targets)");
        return;
    }
    // Read from the ELF dynamic section directly; readelf, where installed, must agree.
    let (soname, _) = elf_dynamic_names(&lib).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        soname.as_deref(),
        Some(expected_soname().as_str()),
        "SONAME of {}",
        lib.display()
    );
    match readelf_soname(&lib) {
        Some(r) => assert_eq!(r, soname, "readelf -d disagrees with the ELF parser"),
        None => eprintln!("readelf not available: SONAME read from the ELF file only"),
    }
}

fn parse_int(s: &str) -> Option<i64> {
    let s = s
        .trim()
        .trim_start_matches('(')
        .trim_end_matches(')')
        .trim();
    s.parse().ok()
}

#[test]
fn header_numbers_match_the_rust_constants() {
    let text = strip_comments(&header_text());
    let mut header: BTreeMap<String, i64> = BTreeMap::new();
    // enum members
    for block in text.split("typedef enum").skip(1) {
        let body = &block[block.find('{').unwrap() + 1..block.find('}').unwrap()];
        for item in body.split(',') {
            if let Some((k, v)) = item.split_once('=') {
                header.insert(k.trim().to_string(), parse_int(v).expect("enum value"));
            }
        }
    }
    // numeric #defines
    for line in text.lines() {
        let mut f = line.split_whitespace();
        if f.next() == Some("#define") {
            let (Some(k), v) = (f.next(), f.collect::<Vec<_>>().join(" ")) else {
                continue;
            };
            if let Some(n) = parse_int(&v) {
                header.insert(k.to_string(), n);
            }
        }
    }
    let types = std::fs::read_to_string(root().join("ffi/src/types.rs")).unwrap();
    let mut rust: BTreeMap<String, i64> = BTreeMap::new();
    for line in types.lines() {
        let Some(rest) = line.trim().strip_prefix("pub const ") else {
            continue;
        };
        let (name, rest) = rest.split_once(':').unwrap();
        let value = rest.split_once('=').unwrap().1.trim_end_matches(';');
        if let Some(n) = parse_int(value) {
            rust.insert(name.trim().to_string(), n);
        }
    }
    assert!(header.len() >= 35, "parsed only {header:?}");
    for (k, v) in &header {
        if k == "QCCL_VERSION_CODE" {
            let want =
                header["QCCL_MAJOR"] * 10000 + header["QCCL_MINOR"] * 100 + header["QCCL_PATCH"];
            assert_eq!(*v, want, "QCCL_VERSION_CODE");
            continue;
        }
        assert_eq!(
            rust.get(k),
            Some(v),
            "{k}: qccl.h says {v}, ffi/src/types.rs {:?}",
            rust.get(k)
        );
    }
    for k in rust.keys() {
        assert!(
            header.contains_key(k),
            "{k} is in ffi/src/types.rs but not in qccl.h"
        );
    }
    // The enum typedefs cross the boundary as int.
    for alias in ["qcclResult_t", "qcclDataType_t", "qcclRedOp_t"] {
        assert!(
            types.contains(&format!("pub type {alias} = c_int;")),
            "{alias} is not c_int"
        );
    }
}

#[test]
fn parsers_understand_the_tricky_spellings() {
    assert_eq!(
        c_param_type("const char* const* names"),
        "const char* const*"
    );
    assert_eq!(c_param_type("const qcclComm_t comm"), "qcclComm_t");
    assert_eq!(c_param_type("qcclUniqueId commId"), "qcclUniqueId");
    assert_eq!(rust_to_c("*const *const c_char"), "const char* const*");
    assert_eq!(rust_to_c("*mut qcclComm_t"), "qcclComm_t*");
    assert_eq!(rust_to_c("*const usize"), "const size_t*");
}
