//! Placement by rules. Config (JSON):
//!
//! ```json
//! {"rules": [
//!   {"key_prefix": "hot/", "segment": "10.0.0.7:12001", "replicas": 2},
//!   {"min_size": 1048576, "soft_pin_ttl_ms": 60000},
//!   {"client": "123-456", "key_prefix": "tmp/", "deny": -200}
//! ]}
//! ```
//!
//! The first rule whose conditions all hold (`key_prefix`, `min_size`, `max_size`,
//! `client`; absent = any) applies. Actions: `segment` (preferred segment), `replicas`
//! (memory replica count), `soft_pin_ttl_ms` (soft pin with that TTL), `hard_pin`,
//! `deny` (refuse the key with that ErrorCode). A put-family call carries one config:
//! a batch takes the config actions of the rule matching its first admitted key, while
//! `deny` applies key by key. Keys no rule matches keep Mooncake's behaviour.

use moongate_policy_sdk::*;
use serde::Deserialize;

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct Config {
    #[serde(default)]
    rules: Vec<Rule>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct Rule {
    key_prefix: Option<String>,
    min_size: Option<u64>,
    max_size: Option<u64>,
    client: Option<String>,
    segment: Option<String>,
    replicas: Option<u64>,
    soft_pin_ttl_ms: Option<u64>,
    hard_pin: Option<bool>,
    deny: Option<i32>,
}

impl Rule {
    fn matches(&self, key: &[u8], size: u64, client: &str) -> bool {
        self.key_prefix
            .as_ref()
            .is_none_or(|p| key.starts_with(p.as_bytes()))
            && self.min_size.is_none_or(|m| size >= m)
            && self.max_size.is_none_or(|m| size <= m)
            && self.client.as_ref().is_none_or(|c| c == client)
    }

    fn apply(&self, mut c: ReplicateConfig) -> ReplicateConfig {
        if let Some(s) = &self.segment {
            c.preferred_segment = s.clone();
            c.preferred_segments = vec![s.clone()];
        }
        if let Some(n) = self.replicas {
            c.replica_num = n;
        }
        if let Some(ttl) = self.soft_pin_ttl_ms {
            c.soft_pin_action = SoftPinAction::Enable;
            c.soft_pin_ttl_ms = Some(ttl);
        }
        if let Some(h) = self.hard_pin {
            c.with_hard_pin = h;
        }
        c
    }

    fn changes_config(&self) -> bool {
        self.segment.is_some()
            || self.replicas.is_some()
            || self.soft_pin_ttl_ms.is_some()
            || self.hard_pin.is_some()
    }
}

struct TierPlacement {
    rules: Vec<Rule>,
}

impl Policy for TierPlacement {
    fn new(config: &[u8]) -> Result<(Self, Interest), String> {
        let cfg: Config = if config.is_empty() {
            Config::default()
        } else {
            serde_json::from_slice(config).map_err(|e| format!("tier-placement config: {e}"))?
        };
        for (i, r) in cfg.rules.iter().enumerate() {
            if r.deny.is_some() && r.changes_config() {
                return Err(format!(
                    "rule {i}: `deny` cannot be combined with placement actions"
                ));
            }
            if r.deny == Some(0) {
                return Err(format!("rule {i}: `deny` needs a non-zero ErrorCode"));
            }
        }
        Ok((TierPlacement { rules: cfg.rules }, Interest::PUT))
    }

    fn on_put(&mut self, call: PutCall) -> PutDecision {
        let mut admissions = Vec::with_capacity(call.keys.len());
        let mut config_rule: Option<&Rule> = None;
        let mut any_denied = false;
        for (i, key) in call.keys.iter().enumerate() {
            let size = call.sizes.get(i).copied().unwrap_or(0);
            let rule = self
                .rules
                .iter()
                .find(|r| r.matches(key, size, &call.client));
            match rule.and_then(|r| r.deny) {
                Some(code) => {
                    any_denied = true;
                    admissions.push(Admission::Deny(code));
                }
                None => {
                    admissions.push(Admission::Admit);
                    if config_rule.is_none() {
                        config_rule = rule.filter(|r| r.changes_config());
                    }
                }
            }
        }
        PutDecision {
            config: config_rule.map(|r| r.apply(call.config)),
            admissions: if any_denied { admissions } else { Vec::new() },
        }
    }
}

export_policy!(TierPlacement);

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> ReplicateConfig {
        ReplicateConfig {
            replica_num: 1,
            nof_replica_num: 0,
            dfs_replica_num: 0,
            soft_pin_action: SoftPinAction::Preserve,
            soft_pin_ttl_ms: None,
            with_hard_pin: false,
            preferred_segments: Vec::new(),
            preferred_segment: String::new(),
            prefer_alloc_in_same_node: false,
        }
    }

    fn call(keys: &[&str], sizes: Vec<u64>) -> PutCall {
        PutCall {
            kind: PutKind::BatchPut,
            client: "c1".into(),
            keys: PackedKeys::from_keys(keys),
            sizes,
            config: config(),
        }
    }

    fn policy(json: &str) -> Result<TierPlacement, String> {
        TierPlacement::new(json.as_bytes()).map(|(p, _)| p)
    }

    #[test]
    fn bad_rules_are_refused_at_configure() {
        let e = policy(r#"{"rules":[{"deny":-200,"replicas":2}]}"#)
            .err()
            .unwrap();
        assert!(e.contains("cannot be combined"), "{e}");
        let e = policy(r#"{"rules":[{"deny":0}]}"#).err().unwrap();
        assert!(e.contains("non-zero"), "{e}");
        assert!(policy(r#"{"rules":[{"unknown":1}]}"#).is_err());
        assert!(policy("").is_ok());
    }

    #[test]
    fn the_first_matching_rule_places_and_denies_go_key_by_key() {
        let mut p = policy(
            r#"{"rules":[
                {"key_prefix":"tmp/","deny":-200},
                {"min_size":100,"segment":"s:1","replicas":2,"soft_pin_ttl_ms":5}
            ]}"#,
        )
        .unwrap();
        let d = p.on_put(call(&["tmp/a", "big", "small"], vec![500, 500, 5]));
        assert!(matches!(
            d.admissions[..],
            [Admission::Deny(-200), Admission::Admit, Admission::Admit]
        ));
        let c = d
            .config
            .expect("the rule of the first admitted key applies");
        assert_eq!((c.preferred_segment.as_str(), c.replica_num), ("s:1", 2));
        assert_eq!(c.soft_pin_ttl_ms, Some(5));
        // Nothing matches: Mooncake's behaviour, unchanged.
        let d = p.on_put(call(&["small"], vec![5]));
        assert!(d.config.is_none() && d.admissions.is_empty());
    }
}
