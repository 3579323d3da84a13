//! A `POST /v1/hints` body, read into named hints with the field at fault named in every
//! error. Pure: JSON in, hints out; the time is passed in.
//!
//! ```json
//! {"hints": [
//!   {"kind": "upcoming", "keys": ["..."], "in_ms": 200, "session": "router-3"},
//!   {"kind": "done", "blocks": [1234567, "9f1c..."], "tenant": "default"},
//!   {"kind": "expect", "keys": ["..."], "within_ms": 30000}
//! ]}
//! ```

use std::sync::Arc;

use bytes::Bytes;
use serde_json::{Map, Value};

use super::table::{Hint, Kind, Name};

/// The longest block digest a hint may name, in bytes: what the policy host allows a
/// plugin's mapping to produce.
pub use crate::policy::host::MAX_DIGEST;
/// The longest session or tenant id, in bytes.
pub const MAX_ID: usize = 256;

/// The limits and times a body is read with.
#[derive(Debug, Clone, Copy)]
pub struct Rules {
    /// Names (keys and blocks) per call.
    pub max_names: usize,
    /// Longest key.
    pub max_key_bytes: usize,
    /// When an `upcoming` hint naming no `in_ms` is due: this long from now.
    pub ttl_ms: u64,
    /// The cap on how long an `upcoming` or `expect` hint is kept past its due time;
    /// `None`: none (it holds one turnover of the cache past it, [`super::table::in_force`]).
    pub slack_cap_ms: Option<u64>,
    /// The cap on how long a `done` hint is kept; `None`: none (it is in force until its
    /// block is read or stored again, which a plugin sees by the block's age, and stays
    /// until the table's bounds push it out).
    pub done_ttl_ms: Option<u64>,
    /// The furthest an `in_ms` / `within_ms` may reach.
    pub max_ttl_ms: u64,
}

/// `at_ms` plus an operator's cap, or never (`u64::MAX`) without one.
fn capped(at_ms: u64, cap_ms: Option<u64>) -> u64 {
    cap_ms.map_or(u64::MAX, |c| at_ms.saturating_add(c))
}

/// Why a body was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    /// A field is missing, of the wrong type, or out of range: `field` names it as a
    /// path (`hints[2].keys[0]`).
    #[error("{field}: {why}")]
    Invalid { field: String, why: String },
    /// More names than a call may carry.
    #[error("{names} names in one call; at most {max} (hints.max_names_per_call)")]
    TooMany { names: usize, max: usize },
}

fn invalid(field: impl Into<String>, why: impl Into<String>) -> ParseError {
    ParseError::Invalid {
        field: field.into(),
        why: why.into(),
    }
}

/// The hints of `body`, each with the name it is about, received at `now_ms`.
pub fn parse(body: &[u8], rules: &Rules, now_ms: u64) -> Result<Vec<(Name, Hint)>, ParseError> {
    let v: Value = serde_json::from_slice(body).map_err(|e| invalid("body", e.to_string()))?;
    let Value::Object(top) = v else {
        return Err(invalid("body", "expected an object {\"hints\": [...]}"));
    };
    if let Some(k) = top.keys().find(|k| *k != "hints") {
        return Err(invalid(k.as_str(), "unknown field (expected \"hints\")"));
    }
    let Some(Value::Array(items)) = top.get("hints") else {
        return Err(invalid("hints", "expected an array of hints"));
    };
    // Count first: a flood is refused before anything is built.
    let names: usize = items
        .iter()
        .filter_map(Value::as_object)
        .map(|o| {
            ["keys", "blocks"]
                .iter()
                .filter_map(|f| o.get(*f).and_then(Value::as_array))
                .map(Vec::len)
                .sum::<usize>()
        })
        .sum();
    if names > rules.max_names {
        return Err(ParseError::TooMany {
            names,
            max: rules.max_names,
        });
    }
    let mut out = Vec::with_capacity(names);
    for (i, item) in items.iter().enumerate() {
        let at = format!("hints[{i}]");
        let Value::Object(o) = item else {
            return Err(invalid(at, "expected an object"));
        };
        one(o, &at, rules, now_ms, &mut out)?;
    }
    Ok(out)
}

const FIELDS: [&str; 7] = [
    "kind",
    "keys",
    "blocks",
    "tenant",
    "session",
    "in_ms",
    "within_ms",
];

fn one(
    o: &Map<String, Value>,
    at: &str,
    rules: &Rules,
    now_ms: u64,
    out: &mut Vec<(Name, Hint)>,
) -> Result<(), ParseError> {
    if let Some(k) = o.keys().find(|k| !FIELDS.contains(&k.as_str())) {
        return Err(invalid(format!("{at}.{k}"), "unknown field"));
    }
    let kind = match o.get("kind").and_then(Value::as_str) {
        Some("upcoming") => Kind::Upcoming,
        Some("done") => Kind::Done,
        Some("expect") => Kind::Expect,
        Some(other) => {
            return Err(invalid(
                format!("{at}.kind"),
                format!("unknown kind {other:?} (upcoming, done, expect)"),
            ));
        }
        None => {
            return Err(invalid(
                format!("{at}.kind"),
                "missing (upcoming, done, expect)",
            ));
        }
    };
    let id = |f: &str| -> Result<Option<&str>, ParseError> {
        match o.get(f) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) if !s.is_empty() && s.len() <= MAX_ID => Ok(Some(s)),
            Some(_) => Err(invalid(
                format!("{at}.{f}"),
                format!("expected a string of 1 to {MAX_ID} bytes"),
            )),
        }
    };
    let tenant = Bytes::copy_from_slice(id("tenant")?.unwrap_or("default").as_bytes());
    let session: Option<Arc<str>> = id("session")?.map(Arc::from);
    let ms = |f: &str| -> Result<Option<u64>, ParseError> {
        match o.get(f) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => match v.as_u64() {
                Some(n) if n <= rules.max_ttl_ms => Ok(Some(n)),
                _ => Err(invalid(
                    format!("{at}.{f}"),
                    format!(
                        "expected milliseconds, 0 to {} (hints.max_ttl_ms)",
                        rules.max_ttl_ms
                    ),
                )),
            },
        }
    };
    let (in_ms, within_ms) = (ms("in_ms")?, ms("within_ms")?);
    let (due_ms, expires_ms) = match kind {
        Kind::Upcoming => {
            if within_ms.is_some() {
                return Err(invalid(
                    format!("{at}.within_ms"),
                    "belongs to expect; upcoming takes in_ms",
                ));
            }
            // Without a time: soon, within the ttl (a plugin may protect it until due).
            let due = now_ms + in_ms.unwrap_or(rules.ttl_ms);
            (due, capped(due, rules.slack_cap_ms))
        }
        Kind::Done => {
            if let Some(f) = ["in_ms", "within_ms"]
                .into_iter()
                .find(|f| o.contains_key(*f))
            {
                return Err(invalid(format!("{at}.{f}"), "done takes no time"));
            }
            (now_ms, capped(now_ms, rules.done_ttl_ms))
        }
        Kind::Expect => {
            if in_ms.is_some() {
                return Err(invalid(
                    format!("{at}.in_ms"),
                    "belongs to upcoming; expect takes within_ms",
                ));
            }
            let Some(within) = within_ms else {
                return Err(invalid(
                    format!("{at}.within_ms"),
                    "missing: by when the next turn is expected",
                ));
            };
            (now_ms + within, capped(now_ms + within, rules.slack_cap_ms))
        }
    };
    let hint = Hint {
        kind,
        at_ms: now_ms,
        due_ms,
        expires_ms,
        session,
    };
    let (keys, blocks) = (o.get("keys"), o.get("blocks"));
    if keys.is_none() && blocks.is_none() {
        return Err(invalid(at, "names nothing: give keys or blocks"));
    }
    if let Some(keys) = keys {
        let Value::Array(keys) = keys else {
            return Err(invalid(
                format!("{at}.keys"),
                "expected an array of strings",
            ));
        };
        for (j, k) in keys.iter().enumerate() {
            match k.as_str() {
                Some(k) if !k.is_empty() && k.len() <= rules.max_key_bytes => out.push((
                    Name::Key {
                        tenant: tenant.clone(),
                        key: Bytes::copy_from_slice(k.as_bytes()),
                    },
                    hint.clone(),
                )),
                _ => {
                    return Err(invalid(
                        format!("{at}.keys[{j}]"),
                        format!(
                            "expected a key string of 1 to {} bytes (kv.max_key_bytes)",
                            rules.max_key_bytes
                        ),
                    ));
                }
            }
        }
    }
    if let Some(blocks) = blocks {
        let Value::Array(blocks) = blocks else {
            return Err(invalid(
                format!("{at}.blocks"),
                "expected an array of block hashes",
            ));
        };
        for (j, b) in blocks.iter().enumerate() {
            let name = block(b).ok_or_else(|| {
                invalid(
                    format!("{at}.blocks[{j}]"),
                    format!(
                        "expected a 64-bit unsigned integer or a hex digest of 1 to {MAX_DIGEST} bytes"
                    ),
                )
            })?;
            out.push((name, hint.clone()));
        }
    }
    Ok(())
}

/// A block hash as the events publish it: vLLM's int, or a digest in hex.
fn block(v: &Value) -> Option<Name> {
    match v {
        Value::Number(n) => n.as_u64().map(Name::Block),
        Value::String(s) => {
            let s = s.strip_prefix("0x").unwrap_or(s);
            if s.is_empty() || s.len() % 2 != 0 || s.len() > 2 * MAX_DIGEST {
                return None;
            }
            let bytes: Option<Vec<u8>> = (0..s.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
                .collect();
            bytes.map(|b| Name::Digest(Bytes::from(b)))
        }
        _ => None,
    }
}

/// Reads `data` as a hints call's body under small limits, and puts what it names into
/// a small table. Never panics on any input; used by the fuzz target `hints` and by
/// tests.
pub fn fuzz_one(data: &[u8]) {
    let rules = Rules {
        max_names: 64,
        max_key_bytes: 64,
        ttl_ms: 1000,
        slack_cap_ms: None,
        done_ttl_ms: None,
        max_ttl_ms: 60_000,
    };
    if let Ok(hints) = parse(data, &rules, 1_000) {
        assert!(hints.len() <= rules.max_names);
        let mut t = super::table::Table::new(16, 4 << 10);
        for (name, hint) in hints {
            assert!(hint.due_ms >= hint.at_ms || hint.kind == Kind::Done);
            t.insert(name.clone(), hint, 1_000);
            let _ = t.get(&name, 1_500, Some(100));
        }
        assert!(t.len() <= 16 && t.bytes() <= 4 << 10);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fuzz entry point over bodies near the grammar: no panic.
    #[test]
    fn random_bodies_never_panic() {
        let parts = [
            "{",
            "}",
            "[",
            "]",
            ",",
            ":",
            "\"hints\"",
            "\"kind\"",
            "\"done\"",
            "\"upcoming\"",
            "\"expect\"",
            "\"keys\"",
            "\"blocks\"",
            "\"in_ms\"",
            "\"within_ms\"",
            "\"a\"",
            "7",
            "-1",
            "1e400",
            "\"0a0b\"",
            "null",
            "true",
        ];
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for n in 0..20_000 {
            let mut body = String::from(r#"{"hints": [{"kind": "#);
            for _ in 0..(n % 12) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                body.push_str(parts[(x % parts.len() as u64) as usize]);
            }
            fuzz_one(body.as_bytes());
        }
        fuzz_one(br#"{"hints": [{"kind": "done", "keys": ["a"]}, {"kind": "upcoming", "blocks": [1, "ff"], "in_ms": 5}]}"#);
    }

    const RULES: Rules = Rules {
        max_names: 8,
        max_key_bytes: 16,
        ttl_ms: 1000,
        slack_cap_ms: None,
        done_ttl_ms: None,
        max_ttl_ms: 60_000,
    };

    fn field_of(body: &str) -> String {
        match parse(body.as_bytes(), &RULES, 0) {
            Err(ParseError::Invalid { field, .. }) => field,
            other => panic!("{body}: {other:?}"),
        }
    }

    #[test]
    fn every_kind_reads_with_its_times() {
        let body = r#"{"hints": [
            {"kind": "upcoming", "keys": ["a", "b"], "in_ms": 200, "session": "r1"},
            {"kind": "done", "blocks": [7, "0a0b"], "tenant": "t"},
            {"kind": "expect", "keys": ["c"], "within_ms": 5000}
        ]}"#;
        let h = parse(body.as_bytes(), &RULES, 100).unwrap();
        assert_eq!(h.len(), 5);
        assert_eq!(h[0].1.kind, Kind::Upcoming);
        // Upcoming and expect hold past their due time by the cache's turnover, read
        // when the table is (no cap by default).
        assert_eq!((h[0].1.due_ms, h[0].1.expires_ms), (300, u64::MAX));
        assert_eq!(h[0].1.session.as_deref(), Some("r1"));
        assert_eq!(h[2].0, Name::Block(7));
        assert_eq!(h[3].0, Name::Digest(Bytes::from_static(&[10, 11])));
        // Done does not lapse with time, unless an operator caps it.
        assert_eq!((h[2].1.kind, h[2].1.expires_ms), (Kind::Done, u64::MAX));
        assert_eq!((h[4].1.kind, h[4].1.due_ms), (Kind::Expect, 5100));
        assert_eq!(h[4].1.expires_ms, u64::MAX);
        let capped = Rules {
            done_ttl_ms: Some(1000),
            slack_cap_ms: Some(500),
            ..RULES
        };
        let h = parse(body.as_bytes(), &capped, 100).unwrap();
        assert_eq!((h[2].1.kind, h[2].1.expires_ms), (Kind::Done, 1100));
        assert_eq!(h[0].1.expires_ms, 800);
        assert_eq!(h[4].1.expires_ms, 5600);
        let Name::Key { tenant, .. } = &h[0].0 else {
            panic!()
        };
        assert_eq!(&tenant[..], b"default");
    }

    #[test]
    fn bad_input_names_the_field_at_fault() {
        for (body, field) in [
            ("not json", "body"),
            ("[]", "body"),
            (r#"{"hint": []}"#, "hint"),
            (r#"{"hints": 3}"#, "hints"),
            (r#"{"hints": [3]}"#, "hints[0]"),
            (r#"{"hints": [{"keys": ["a"]}]}"#, "hints[0].kind"),
            (
                r#"{"hints": [{"kind": "soon", "keys": ["a"]}]}"#,
                "hints[0].kind",
            ),
            (r#"{"hints": [{"kind": "done"}]}"#, "hints[0]"),
            (
                r#"{"hints": [{"kind": "done", "keys": ["a", ""]}]}"#,
                "hints[0].keys[1]",
            ),
            (
                r#"{"hints": [{"kind": "done", "keys": ["aaaaaaaaaaaaaaaaaaaa"]}]}"#,
                "hints[0].keys[0]",
            ),
            (
                r#"{"hints": [{"kind": "done", "keys": "a"}]}"#,
                "hints[0].keys",
            ),
            (
                r#"{"hints": [{"kind": "done", "blocks": [-1]}]}"#,
                "hints[0].blocks[0]",
            ),
            (
                r#"{"hints": [{"kind": "done", "blocks": ["abc"]}]}"#,
                "hints[0].blocks[0]",
            ),
            (
                r#"{"hints": [{"kind": "done", "blocks": ["zz"]}]}"#,
                "hints[0].blocks[0]",
            ),
            (
                r#"{"hints": [{"kind": "done", "keys": ["a"], "in_ms": 5}]}"#,
                "hints[0].in_ms",
            ),
            (
                r#"{"hints": [{"kind": "expect", "keys": ["a"]}]}"#,
                "hints[0].within_ms",
            ),
            (
                r#"{"hints": [{"kind": "expect", "keys": ["a"], "within_ms": 99999999}]}"#,
                "hints[0].within_ms",
            ),
            (
                r#"{"hints": [{"kind": "upcoming", "keys": ["a"], "session": 5}]}"#,
                "hints[0].session",
            ),
            (
                r#"{"hints": [{"kind": "done", "keys": ["a"], "colour": 1}]}"#,
                "hints[0].colour",
            ),
        ] {
            assert_eq!(field_of(body), field, "{body}");
        }
    }

    #[test]
    fn too_many_names_are_refused_before_anything_is_built() {
        let keys: Vec<String> = (0..9).map(|i| format!("\"k{i}\"")).collect();
        let body = format!(
            r#"{{"hints": [{{"kind": "done", "keys": [{}]}}]}}"#,
            keys.join(",")
        );
        assert_eq!(
            parse(body.as_bytes(), &RULES, 0),
            Err(ParseError::TooMany { names: 9, max: 8 })
        );
    }
}
