//! Older Mooncake releases through moongate: 0.3.11.post1 and 0.3.12.post1, each with
//! its own master and its own Python client (virtualenvs installed by
//! scripts/bootstrap.sh). Their put and lookup calls have other layouts than 0.3.13's;
//! moongate decodes them by type code, so a policy acts on them exactly as on 0.3.13's:
//! placement applied, a denial answered in the client's own layout, no decode errors.

use serde_json::Value;

use crate::support::*;

fn plugin_spec(name: &str, file: &str, config: &str) -> String {
    format!(
        "[[policy.plugins]]\nname = \"{name}\"\npath = \"{}\"\nconfig = '''{config}'''\n",
        plugin_path(file).display()
    )
}

/// Tier placement through moongate with `release`'s clients against `master_release`'s
/// master; `label` is the release the clients' layouts identify.
fn tier_placement_acts_on(release: &'static str, master_release: &'static str, label: &str) {
    let r = (release != "0.3.13.post1").then(|| Release::older(release));
    let r = r.as_ref();
    let master = Master::start_with(MasterOpts {
        release: Some(Release::older(master_release)),
        ..Default::default()
    });
    let hold =
        |logs: &[&Proc]| Background::start_on(r, "hold", &master.rpc, &master.metadata, &[], logs);
    let (a, b) = (hold(&[&master.proc]), hold(&[&master.proc]));
    let (ea, eb) = (a.endpoint().to_string(), b.endpoint().to_string());
    let rules = format!(
        r#"{{"rules": [{{"key_prefix": "a/", "segment": "{ea}"}}, {{"key_prefix": "b/", "segment": "{eb}", "soft_pin_ttl_ms": 60000}}, {{"key_prefix": "deny/", "deny": -200}}]}}"#
    );
    let mg = Moongate::start_config(&format!(
        "[master_face]\nupstream = \"{}\"\n[policy]\nactive = \"tiers\"\ncall_timeout_ms = 1000\n{}",
        master.rpc,
        plugin_spec("tiers", "tier-placement", &rules)
    ));
    mg.wait_ready(&master);
    let logs = [&master.proc, &mg.proc];
    let place = |prefix: &str, count: usize| {
        run_role_on(
            r,
            "place",
            &mg.listen,
            &master.metadata,
            &["--prefix", prefix, "--count", &count.to_string()],
            &logs,
        )
    };
    for (prefix, want) in [("a/", &ea), ("b/", &eb)] {
        let res = place(prefix, 10);
        for (k, at) in result(&res, "at").as_object().unwrap() {
            assert_eq!(
                at,
                &Value::from(vec![want.clone()]),
                "{release}: {k} on {at}"
            );
        }
        for (k, rc) in result(&res, "rc").as_object().unwrap() {
            assert_eq!(rc, 0, "{release}: {k}");
        }
    }
    let res = place("deny/", 5);
    for (k, rc) in result(&res, "rc").as_object().unwrap() {
        assert_eq!(
            rc, -200,
            "{release}: {k}: the client sees the plugin's code"
        );
    }
    let m = mg.metrics();
    assert!(m.contains("decision=\"deny_all\"} 5"), "{m}");
    for method in [
        "PutStart",
        "PutEnd",
        "GetReplicaList",
        "BatchGetReplicaList",
    ] {
        assert_eq!(
            metric_value(
                &m,
                &format!("moongate_master_errors_total{{method=\"{method}\",kind=\"decode\"}}")
            ),
            0.0,
            "{release} {method}"
        );
    }
    assert!(
        !m.contains("moongate_master_unknown_type_codes_total{"),
        "{release}: every layout known\n{m}"
    );
    // A soft-pin TTL cannot travel in older releases' layout: left out, counted.
    let dropped = format!(
        "moongate_policy_fields_dropped_total{{field=\"soft_pin_ttl_ms\",schema=\"{label}\"}}"
    );
    if label == "0.3.13" {
        assert!(!m.contains(&dropped), "{release}: nothing to drop");
    } else {
        assert_eq!(metric_value(&m, &dropped), 10.0, "{release}");
    }
    // Every lookup answer was decoded (in a 0.3.14 master's compatible-section form,
    // too): the tier tally counts the 20 placed keys found in memory.
    assert_eq!(
        metric_value(
            &m,
            "moongate_tier_keys_total{tier=\"memory\",outcome=\"found\",arm=\"tiers\"}"
        ),
        20.0,
        "{release} / {master_release}\n{m}"
    );
    // Each placing client's connection identified its release by its put's layout.
    let (_, status) = http_get(&mg.admin, "/status").unwrap();
    let status: Value = serde_json::from_str(&status).unwrap();
    assert_eq!(
        status["connections_identified_since_start"][label], 3,
        "{release}: {status}"
    );
    if label != "0.3.13" {
        assert_eq!(
            status["connections_identified_since_start"]["0.3.13"], 0,
            "{release}: {status}"
        );
    }
    for h in [a, b] {
        assert_eq!(result(&h.finish(), "close"), 0, "{release}");
    }
}

/// The two-process scenario (an owner puts, a reader on another process reads over
/// TE-TCP, every call of the store API) with `release`'s clients and master, directly and
/// through moongate re-encoding every typed call (`reencode = "always"`): the same
/// results, byte-exact data, every body decoded in its release's layout.
fn scenario_matches_the_direct_run(release: &'static str) {
    use crate::real_mooncake::{assert_all_data_ok, scenario_on};
    let r = Release::older(release);
    let start = || {
        Master::start_with(MasterOpts {
            release: Some(r.clone()),
            ..Default::default()
        })
    };
    let direct_master = start();
    let direct = scenario_on(
        Some(&r),
        &direct_master.rpc,
        &direct_master.metadata,
        &[&direct_master.proc],
    );
    assert_all_data_ok(&direct.0);
    assert_all_data_ok(&direct.1);
    drop(direct_master);

    let master = start();
    let mg = Moongate::start_with(&master.rpc, "reencode = \"always\"");
    mg.wait_ready(&master);
    let via = scenario_on(
        Some(&r),
        &mg.listen,
        &master.metadata,
        &[&master.proc, &mg.proc],
    );
    assert_eq!(via.1, direct.1, "{release}: reader results differ");
    assert_eq!(via.0, direct.0, "{release}: owner results differ");
    let m = mg.metrics();
    let decode_errors = crate::real_mooncake::decode_errors(&m);
    assert!(decode_errors.is_empty(), "{release}: {decode_errors:?}");
    assert!(
        !m.contains("moongate_master_unknown_type_codes_total{"),
        "{release}: every layout known\n{m}"
    );
    assert!(metric_value(&m, "moongate_master_requests_total{method=\"PutStart\"}") >= 1.0);
}

#[test]
fn the_scenario_through_moongate_matches_the_direct_run_on_0_3_11() {
    scenario_matches_the_direct_run("0.3.11.post1");
}

#[test]
fn the_scenario_through_moongate_matches_the_direct_run_on_0_3_12() {
    scenario_matches_the_direct_run("0.3.12.post1");
}

#[test]
fn a_policy_acts_on_mooncake_0_3_11() {
    tier_placement_acts_on("0.3.11.post1", "0.3.11.post1", "0.3.11");
}

#[test]
fn a_policy_acts_on_mooncake_0_3_12() {
    tier_placement_acts_on("0.3.12.post1", "0.3.12.post1", "0.3.12");
}

/// A 0.3.14 master (its client needs the NVIDIA driver; the 0.3.13 client is what runs
/// here) answers puts and lookups with compatible sections: decoded all the same.
#[test]
fn a_policy_acts_on_the_answers_of_a_mooncake_0_3_14_master() {
    tier_placement_acts_on("0.3.13.post1", "0.3.14", "0.3.13");
}
