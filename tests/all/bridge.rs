//! Clients and masters of different Mooncake releases through moongate: every call of
//! the store API is translated into the master's layout and every answer into the
//! client's, so a client of one release works against a master of another exactly as
//! against its own (the same results, byte-exact data). Directly, such a pair fails.

use std::time::{Duration, Instant};

use serde_json::Value;

use crate::real_mooncake::{assert_all_data_ok, decode_errors, scenario_on};
use crate::support::*;

fn release(name: &'static str) -> Option<Release> {
    (name != "0.3.13.post1").then(|| Release::older(name))
}

fn master_of(name: &'static str) -> Master {
    Master::start_with(MasterOpts {
        release: release(name),
        ..Default::default()
    })
}

fn label(name: &str) -> &str {
    name.trim_end_matches(".post1")
}

/// Mooncake's `RPC_FAIL`: what a client's call that its master could not read, or
/// whose answer it could not read, returns.
const RPC_FAIL: i64 = -900;

/// A `client`-release reader straight against a `master`-release master, beside an
/// owner of the master's release; the reader's results.
fn direct_reader(client: Option<&Release>, master: &'static str) -> Value {
    let m = master_of(master);
    let owner = Background::start_on(
        release(master).as_ref(),
        "owner",
        &m.rpc,
        &m.metadata,
        &[],
        &[&m.proc],
    );
    let r = run_role_on(
        client,
        "reader",
        &m.rpc,
        &m.metadata,
        &["--owner-host", owner.endpoint()],
        &[&m.proc],
    );
    // The owner's own results are not this test's: it reads back what the reader
    // wrote, which the skew kept from being written.
    let _ = owner.finish();
    r
}

/// The scenario with `client`'s clients against their own release's master, every
/// value read back byte-exact: what each pair is compared with.
fn reference(rc: Option<&Release>, client: &'static str) -> (Value, Value) {
    let own = master_of(client);
    let r = scenario_on(rc, &own.rpc, &own.metadata, &[&own.proc]);
    assert_all_data_ok(&r.0);
    assert_all_data_ok(&r.1);
    r
}

/// One record of a scenario result (`[[name, value], ...]`).
fn record<'a>(v: &'a Value, name: &str) -> Option<&'a Value> {
    v.as_array()?.iter().find(|r| r[0] == name).map(|r| &r[1])
}

/// The scenario (owner + reader, every call of the store API) with `client`'s clients
/// against `master`'s master: directly, puts fail and nothing reads back;
/// through moongate, the same results as `client`'s clients against their own master,
/// every call translated.
fn pair_works_through_moongate(client: &'static str, master: &'static str) {
    let rc = release(client);
    let reference = reference(rc.as_ref(), client);

    // Directly, beside an owner of the master's own release (so the store has room and
    // values, and a failure can only be the skew), the reader's calls fail as RPC_FAIL
    // (-900: "invalid rpc arg" or "failed to deserialize rpc return value" in its log).
    let direct = direct_reader(rc.as_ref(), master);
    assert_eq!(
        record(&direct, "put r/k2"),
        Some(&Value::from(RPC_FAIL)),
        "{client} -> {master} directly: {direct}"
    );
    assert_eq!(
        record(&direct, "get o/k1"),
        Some(&serde_json::json!({"len": 0, "ok": false})),
        "{client} -> {master} directly: {direct}"
    );

    let m = master_of(master);
    let mg = Moongate::start(&m.rpc);
    mg.wait_ready(&m);
    let via = scenario_on(rc.as_ref(), &mg.listen, &m.metadata, &[&m.proc, &mg.proc]);
    assert_all_data_ok(&via.0);
    assert_all_data_ok(&via.1);
    assert_eq!(
        via.1, reference.1,
        "{client} -> {master}: reader results differ"
    );
    assert_eq!(
        via.0, reference.0,
        "{client} -> {master}: owner results differ"
    );
    let metrics = mg.metrics();
    let (c, mr) = (label(client), label(master));
    assert!(
        metric_value(&metrics, "moongate_bridge_translated_total") > 0.0,
        "{metrics}"
    );
    assert!(
        mg.proc.log_text().contains("calls and answers translated"),
        "{}",
        mg.proc.log_text()
    );
    let decode_errors = decode_errors(&metrics);
    assert!(decode_errors.is_empty(), "{c} -> {mr}: {decode_errors:?}");
    assert!(
        !metrics.contains("moongate_bridge_untranslatable_total{"),
        "{metrics}"
    );
}

/// Each pair of releases, client != master. A 0.3.12 reader that never puts cannot be
/// told from a 0.3.13 one by its calls (their lookups have one layout, their answers
/// two); moongate reads its release from the wheel its process loaded (the scenario's
/// reader never writes, so these pairs need that: no `client_release` is set).
macro_rules! pairs {
    ($($name:ident: $client:literal -> $master:literal;)*) => {$(
        #[test]
        fn $name() {
            pair_works_through_moongate($client, $master);
        }
    )*};
}

pairs! {
    pair_0_3_11_client_0_3_12_master: "0.3.11.post1" -> "0.3.12.post1";
    pair_0_3_11_client_0_3_13_master: "0.3.11.post1" -> "0.3.13.post1";
    pair_0_3_11_client_0_3_14_master: "0.3.11.post1" -> "0.3.14";
    pair_0_3_12_client_0_3_11_master: "0.3.12.post1" -> "0.3.11.post1";
    pair_0_3_12_client_0_3_13_master: "0.3.12.post1" -> "0.3.13.post1";
    pair_0_3_12_client_0_3_14_master: "0.3.12.post1" -> "0.3.14";
    pair_0_3_13_client_0_3_11_master: "0.3.13.post1" -> "0.3.11.post1";
    pair_0_3_13_client_0_3_12_master: "0.3.13.post1" -> "0.3.12.post1";
    pair_0_3_14_client_0_3_11_master: "0.3.14" -> "0.3.11.post1";
    pair_0_3_14_client_0_3_12_master: "0.3.14" -> "0.3.12.post1";
}

/// Releases whose layouts agree (0.3.13 and 0.3.14: the same calls, 0.3.14 adding
/// struct_pack compatible sections to some answers, which a 0.3.13 client skips and
/// whose absence a 0.3.14 client takes as defaults) work directly, and through moongate
/// the same, nothing translated. The 0.3.14 client runs with the stand-ins of
/// scripts/bootstrap.sh (no NVIDIA driver here).
fn compatible_pair_works_both_ways(client: &'static str, master: &'static str) {
    let rc = release(client);
    let reference = reference(rc.as_ref(), client);

    let m = master_of(master);
    let direct = scenario_on(rc.as_ref(), &m.rpc, &m.metadata, &[&m.proc]);
    assert_eq!(direct, reference, "{client} -> {master} directly");
    drop(m);

    let m = master_of(master);
    let mg = Moongate::start(&m.rpc);
    mg.wait_ready(&m);
    let via = scenario_on(rc.as_ref(), &mg.listen, &m.metadata, &[&m.proc, &mg.proc]);
    assert_eq!(via, reference, "{client} -> {master} through moongate");
    let metrics = mg.metrics();
    assert_eq!(
        metric_value(&metrics, "moongate_bridge_translated_total"),
        0.0,
        "{metrics}"
    );
    let errors = decode_errors(&metrics);
    assert!(errors.is_empty(), "{client} -> {master}: {errors:?}");
    // The master's release was probed (and found to need no translation).
    assert!(
        metric_value(&metrics, "moongate_master_release_probes_total") >= 1.0,
        "{metrics}"
    );
}

#[test]
fn a_0_3_14_client_works_with_a_0_3_14_master_directly_and_through_moongate() {
    compatible_pair_works_both_ways("0.3.14", "0.3.14");
}

#[test]
fn a_0_3_14_client_works_with_a_0_3_13_master_directly_and_through_moongate() {
    compatible_pair_works_both_ways("0.3.14", "0.3.13.post1");
}

#[test]
fn a_0_3_13_client_works_with_a_0_3_14_master_directly_and_through_moongate() {
    compatible_pair_works_both_ways("0.3.13.post1", "0.3.14");
}

/// With `bridge = false`, a call whose layouts differ is refused by moongate with an
/// error saying why (the client sees its call fail, counted, logged), not relayed to
/// fail without a word; while a connection's every data call was refused, `/ready` is
/// 503; once it closes, 200 again.
#[test]
fn with_the_bridge_off_skew_is_refused_loudly_and_marks_moongate_not_ready() {
    let r = release("0.3.12.post1");
    let m = master_of("0.3.13.post1");
    let mg = Moongate::start_with(&m.rpc, "bridge = false\nclient_release = \"0.3.12\"");
    mg.wait_ready(&m);
    let logs = [&m.proc, &mg.proc];
    let mut c = Background::start_on(
        r.as_ref(),
        "steps",
        &mg.listen,
        &m.metadata,
        &["--segment-mib", "0"],
        &logs,
    );
    let put = c.step_json("put k/ 3 4096");
    assert_eq!(put["bad"].as_array().map(Vec::len), Some(3), "{put}");
    let metrics = mg.metrics();
    assert!(
        metric_value(
            &metrics,
            "moongate_bridge_skew_refused_total{method=\"PutStart\"}"
        ) >= 3.0,
        "{metrics}"
    );
    assert_eq!(
        metric_value(&metrics, "moongate_bridge_translated_total"),
        0.0
    );
    assert!(
        mg.proc
            .log_text()
            .contains("master_face.bridge is off: calls whose layouts differ are refused"),
        "{}",
        mg.proc.log_text()
    );
    let (st, why) = http_get(&mg.admin, "/ready").unwrap();
    assert!(
        st == 503 && why.contains("master_face.bridge is off"),
        "{st} {why}\n{}",
        mg.metrics()
    );
    // The client's own log says why ("RPC call failed: moongate: PutStart from a
    // Mooncake 0.3.12 client cannot go to the 0.3.13 master ...").
    let client_log = c.proc.log_text();
    assert!(
        client_log.contains("master_face.bridge is off"),
        "{client_log}"
    );
    drop(c);
    // Not while the client is gone for less than the 30 s window (it may be retrying).
    wait_for("ready again", Duration::from_secs(90), &logs, || {
        http_get(&mg.admin, "/ready").is_some_and(|(s, _)| s == 200)
    });
}

/// A rolling upgrade: two 0.3.12 clients (one writer, one reader that never writes) and
/// one 0.3.13 client read and write through moongate while the master is replaced, a
/// 0.3.12 master stopped and a 0.3.13 one started on its port. Nothing is ever read
/// back wrong: values written before the restart are gone with the old master's state
/// (a miss), those written after read back byte-exact, across releases both ways.
/// The metadata server is a master of its own, kept up, as in a fleet whose metadata
/// service is not the master being upgraded.
#[test]
fn a_rolling_upgrade_of_the_master_reads_no_wrong_value() {
    let old = release("0.3.12.post1");
    let meta = master_of("0.3.13.post1");
    let m = master_of("0.3.12.post1");
    let ports = (m.rpc_port, m.http_port);
    let mg = Moongate::start_with(&m.rpc, "client_release = \"0.3.12\"");
    mg.wait_ready(&m);
    let logs = [&m.proc, &mg.proc, &meta.proc];
    let steps = |r: Option<&Release>, mib: &str| {
        Background::start_on(
            r,
            "steps",
            &mg.listen,
            &meta.metadata,
            &["--segment-mib", mib],
            &logs,
        )
    };
    let (mut w_old, mut r_old, mut w_new) = (
        steps(old.as_ref(), "32"),
        steps(old.as_ref(), "0"),
        steps(None, "32"),
    );
    let none: Value = serde_json::json!([]);
    let check = |c: &mut Background, prefix: &str| {
        let a = c.step_json(&format!("check {prefix} 8 65536"));
        assert_eq!(a["bad"], none, "a wrong value for {prefix}: {a}");
        a["missing"].as_array().map_or(0, Vec::len)
    };
    assert_eq!(w_old.step_json("put a/ 8 65536")["bad"], none);
    assert_eq!(w_new.step_json("put b/ 8 65536")["bad"], none);
    for p in ["a/", "b/"] {
        assert_eq!(check(&mut r_old, p), 0, "{p} before the upgrade");
        assert_eq!(check(&mut w_new, p), 0, "{p} before the upgrade");
        assert_eq!(check(&mut w_old, p), 0, "{p} before the upgrade");
    }
    // Each client keeps its master connections (three or more in all).
    assert!(mg.metric("moongate_peer_release{side=\"master\",release=\"0.3.12\"}") >= 3.0);

    drop(m);
    let m = Master::start_with(MasterOpts {
        ports: Some(ports),
        ..Default::default()
    });
    mg.wait_ready(&m);
    // The clients reconnect and remount on their own; until they have, puts find no
    // segment. Reads meanwhile may miss, never read wrong.
    for p in ["a/", "b/"] {
        check(&mut r_old, p);
        check(&mut w_new, p);
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    let put = |c: &mut Background, prefix: &str| loop {
        let a = c.step_json(&format!("put {prefix} 8 65536"));
        if a["bad"] == none {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "puts of {prefix} after the upgrade: {a}\n{}",
            mg.proc.log_text()
        );
        std::thread::sleep(Duration::from_millis(500));
    };
    put(&mut w_old, "c/");
    put(&mut w_new, "d/");
    for p in ["c/", "d/"] {
        assert_eq!(check(&mut r_old, p), 0, "{p} after the upgrade");
        assert_eq!(check(&mut w_new, p), 0, "{p} after the upgrade");
        assert_eq!(check(&mut w_old, p), 0, "{p} after the upgrade");
    }
    let metrics = mg.metrics();
    assert!(
        metric_value(
            &metrics,
            "moongate_peer_release{side=\"master\",release=\"0.3.13\"}"
        ) >= 3.0,
        "{metrics}"
    );
    assert!(metric_value(&metrics, "moongate_bridge_translated_total") > 0.0);
    for c in [w_old, r_old, w_new] {
        let closed = c.finish();
        assert_eq!(record(&closed, "close"), Some(&Value::from(0)), "{closed}");
    }
}

/// moongate's own calls (the kv face's puts and gets, its own segment's mount) go in
/// the layout of the master's release: against a master of each release, values put
/// through the kv face land in moongate's own segment and read back byte-exact, a
/// client of that release reads them and writes values the kv face reads, and a
/// removal goes through. (Before: against 0.3.11 the segment never mounted, against
/// 0.3.12 every put failed with transport error 4.)
fn kv_face_works_against(master: &'static str) {
    let m = master_of(master);
    let (mg, kv) = kv_moongate(&m, "segment_bytes = 67108864\n");
    let logs = [&m.proc, &mg.proc];
    wait_segment_mounted(&mg);
    for (key, size) in [("own/small", 5000), ("own/big", (3 << 20) + 7)] {
        let path = format!("/v1/kv/{}", key.replace('/', "%2F"));
        let (st, b) = http(&kv, "PUT", &path, &value_of(key, size)).unwrap();
        assert_eq!(st, 201, "{master}: {key}: {b}\n{}", mg.proc.log_text());
        let (st, body) = http_bytes(&kv, "GET", &path, &[]).unwrap();
        assert!(
            st == 200 && body == value_of(key, size),
            "{master}: {key}: {st}"
        );
    }
    let r = run_role_on(
        release(master).as_ref(),
        "guest",
        &mg.listen,
        &m.metadata,
        &[],
        &logs,
    );
    assert_eq!(result(&r, "get own/small")["ok"], true, "{master}: {r}");
    assert_eq!(result(&r, "get own/big")["ok"], true, "{master}: {r}");
    assert_eq!(result(&r, "put py/x"), 0, "{master}: {r}");
    assert_eq!(result(&r, "put py/big"), 0, "{master}: {r}");
    for (key, size) in [("py/x", 70000), ("py/big", (5 << 20) + 1)] {
        let path = format!("/v1/kv/{}", key.replace('/', "%2F"));
        let (st, body) = http_bytes(&kv, "GET", &path, &[]).unwrap();
        assert!(
            st == 200 && body == value_of(key, size),
            "{master}: {key}: {st}"
        );
    }
    // A key never read (a read grants a lease, and a leased key cannot be removed).
    let (st, b) = http(&kv, "PUT", "/v1/kv/own%2Fgone", b"soon gone").unwrap();
    assert_eq!(st, 201, "{master}: {b}");
    let (st, b) = http(&kv, "DELETE", "/v1/kv/own%2Fgone", &[]).unwrap();
    assert_eq!(st, 204, "{master}: {b}");
    let (st, _) = http(&kv, "GET", "/v1/kv/own%2Fgone", &[]).unwrap();
    assert_eq!(st, 404, "{master}");
    let metrics = mg.metrics();
    let errors = decode_errors(&metrics);
    assert!(errors.is_empty(), "{master}: {errors:?}");
}

#[test]
fn the_kv_face_works_against_a_0_3_11_master() {
    kv_face_works_against("0.3.11.post1");
}

#[test]
fn the_kv_face_works_against_a_0_3_12_master() {
    kv_face_works_against("0.3.12.post1");
}

#[test]
fn the_kv_face_works_against_a_0_3_14_master() {
    kv_face_works_against("0.3.14");
}
