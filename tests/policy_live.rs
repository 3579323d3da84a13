//! Policies on live traffic from the real Mooncake client through moongate, against the
//! real master: placement by plugin, denial with the plugin's error code, 50 hot swaps
//! under load with zero failed calls, and an A/B experiment over 2,000 keys.

mod support;

use bytes::Bytes;
use moongate::policy::fnv1a;
use moongate::policy::registry::arm_for_hash;
use serde_json::Value;
use support::*;

/// Two segment owners on the master: placement has a real choice to make.
fn two_owners(master: &Master) -> (Background, Background) {
    let a = Background::start("hold", &master.rpc, &master.metadata, &[&master.proc]);
    let b = Background::start("hold", &master.rpc, &master.metadata, &[&master.proc]);
    (a, b)
}

fn plugin_spec(name: &str, file: &str, config: &str) -> String {
    format!(
        "[[policy.plugins]]\nname = \"{name}\"\npath = \"{}\"\nconfig = '''{config}'''\n",
        plugin_path(file).display()
    )
}

fn place(mg: &Moongate, master: &Master, prefix: &str, count: usize) -> Value {
    run_role(
        "place",
        &mg.listen,
        &master.metadata,
        &["--prefix", prefix, "--count", &count.to_string()],
        &[&master.proc, &mg.proc],
    )
}

fn result<'a>(r: &'a Value, name: &str) -> &'a Value {
    &r.as_array().unwrap().iter().find(|o| o[0] == name).unwrap()[1]
}

#[test]
fn tier_placement_puts_keys_where_its_rules_say_and_denies_with_the_code() {
    let master = Master::start();
    let (a, b) = two_owners(&master);
    let (ea, eb) = (a.endpoint().to_string(), b.endpoint().to_string());
    let rules = format!(
        r#"{{"rules": [{{"key_prefix": "a/", "segment": "{ea}"}}, {{"key_prefix": "b/", "segment": "{eb}"}}, {{"key_prefix": "deny/", "deny": -200}}]}}"#
    );
    let mg = Moongate::start_config(&format!(
        "[master_face]\nupstream = \"{}\"\n[policy]\nactive = \"tiers\"\n{}",
        master.rpc,
        plugin_spec("tiers", "tier-placement", &rules)
    ));
    mg.wait_ready(&master);
    for (prefix, want) in [("a/", &ea), ("b/", &eb)] {
        let r = place(&mg, &master, prefix, 20);
        for (k, at) in result(&r, "at").as_object().unwrap() {
            assert_eq!(at, &Value::from(vec![want.clone()]), "{k} landed on {at}");
        }
        assert!(
            result(&r, "rc")
                .as_object()
                .unwrap()
                .values()
                .all(|v| v == 0)
        );
    }
    let r = place(&mg, &master, "deny/", 5);
    for (k, rc) in result(&r, "rc").as_object().unwrap() {
        assert_eq!(rc, -200, "{k}: the client sees the plugin's error code");
    }
    for (k, at) in result(&r, "at").as_object().unwrap() {
        assert_eq!(at, &Value::from(Vec::<String>::new()), "{k} must not exist");
    }
    let m = mg.metrics();
    assert!(m.contains("decision=\"deny_all\"} 5"), "{m}");
    a.finish();
    b.finish();
}

#[test]
fn fifty_hot_swaps_under_load_fail_no_client_call() {
    let master = Master::start();
    let mg = Moongate::start_config(&format!(
        "[master_face]\nupstream = \"{}\"\n{}{}",
        master.rpc,
        plugin_spec(
            "tiers",
            "tier-placement",
            r#"{"rules": [{"min_size": 1, "replicas": 1}]}"#
        ),
        plugin_spec("tiers2", "tier-placement", r#"{"rules": []}"#),
    ));
    mg.wait_ready(&master);
    let logs = [&master.proc, &mg.proc];
    let load1 = Background::start("loop", &mg.listen, &master.metadata, &logs);
    let load2 = Background::start("loop", &mg.listen, &master.metadata, &logs);
    let mut generations = Vec::new();
    for i in 0..50 {
        let name = ["tiers", "tiers2"][i % 2];
        let (status, body) =
            http(&mg.admin, "POST", &format!("/plugins/{name}/activate"), b"").unwrap();
        assert_eq!(status, 200, "{body}");
        let v: Value = serde_json::from_str(&body).unwrap();
        generations.push(v["generation"].as_u64().unwrap());
        std::thread::sleep(std::time::Duration::from_millis(40));
    }
    assert!(generations.windows(2).all(|w| w[1] > w[0]));
    for l in [load1, load2] {
        let (st, res) = l.finish();
        assert!(st.success(), "a client call failed during swaps: {res}");
        assert_eq!(result(&res, "failures"), &Value::from(Vec::<Value>::new()));
        assert!(result(&res, "iterations").as_u64().unwrap() > 20, "{res}");
    }
    let m = mg.metrics();
    // both plugin versions served calls, and no call failed in the host
    let served: Vec<&str> = m
        .lines()
        .filter(|l| l.starts_with("moongate_policy_calls_total{") && l.contains("result=\"ok\""))
        .filter(|l| !l.ends_with(" 0"))
        .collect();
    assert!(served.iter().any(|l| l.contains("plugin=\"tiers\"")), "{m}");
    assert!(
        served.iter().any(|l| l.contains("plugin=\"tiers2\"")),
        "{m}"
    );
    for bad in ["trap", "timeout", "oom", "invalid", "unavailable"] {
        assert!(
            !m.lines()
                .any(|l| l.starts_with("moongate_policy_calls_total{")
                    && l.contains(&format!("result=\"{bad}\""))
                    && !l.ends_with(" 0")),
            "{bad} during swaps\n{m}"
        );
    }
    assert!(metric_value(&m, "moongate_policy_swaps_total") >= 50.0);
}

#[test]
fn ab_experiment_splits_by_weight_and_each_arm_places_by_its_rule() {
    let master = Master::start();
    let (a, b) = two_owners(&master);
    let (ea, eb) = (a.endpoint().to_string(), b.endpoint().to_string());
    let mg = Moongate::start_config(&format!(
        "[master_face]\nupstream = \"{}\"\n{}{}",
        master.rpc,
        plugin_spec(
            "to-a",
            "tier-placement",
            &format!(r#"{{"rules": [{{"segment": "{ea}"}}]}}"#)
        ),
        plugin_spec(
            "to-b",
            "tier-placement",
            &format!(r#"{{"rules": [{{"segment": "{eb}"}}]}}"#)
        ),
    ));
    mg.wait_ready(&master);
    let weights = [30u64, 70];
    let exp = format!(
        r#"{{"assign": "key", "arms": [{{"name": "A", "plugin": "to-a", "weight": {}}}, {{"name": "B", "plugin": "to-b", "weight": {}}}]}}"#,
        weights[0], weights[1]
    );
    let (status, body) = http(&mg.admin, "PUT", "/experiments", exp.as_bytes()).unwrap();
    assert_eq!(status, 200, "{body}");
    let (_, body) = http_get(&mg.admin, "/experiments").unwrap();
    assert!(body.contains("\"to-b\""), "{body}");

    let n = 2000;
    let r = place(&mg, &master, "ab/", n);
    let at = result(&r, "at").as_object().unwrap();
    let mut in_b = 0;
    for (k, eps) in at {
        let arm = arm_for_hash(
            fnv1a(Bytes::copy_from_slice(k.as_bytes()).as_ref()),
            weights.iter().copied(),
        );
        let want = if arm == 0 { &ea } else { &eb };
        assert_eq!(eps, &Value::from(vec![want.clone()]), "{k} (arm {arm})");
        in_b += usize::from(arm == 1);
    }
    let share_b = in_b as f64 / n as f64;
    assert!((share_b - 0.7).abs() <= 0.05, "arm B took {share_b}");
    let m = mg.metrics();
    let arm_puts = |arm: &str| {
        metric_value(
            &m,
            &format!("moongate_arm_requests_total{{arm=\"{arm}\",method=\"PutStart\"}}"),
        )
    };
    assert_eq!(arm_puts("A") + arm_puts("B"), n as f64, "{m}");
    assert_eq!(arm_puts("B"), in_b as f64);
    a.finish();
    b.finish();
}
