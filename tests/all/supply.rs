//! Plugins from a real OCI registry (Debian's `docker-registry`, on loopback) and signed
//! with keys made by Debian's `minisign`: push and pull with the CLI, pull by tag and by
//! digest at start-up, through the admin API and through the watched directory, and every
//! way a pull or a signature can be wrong, each refused with the active plugin left as
//! it was.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::Value;

use crate::support::*;

/// A registry on a free loopback port, storing in its own temporary directory.
pub struct OciRegistry {
    pub proc: Proc,
    pub addr: String,
    _dir: tempfile::TempDir,
}

impl OciRegistry {
    /// Plain HTTP (a loopback registry).
    pub fn start() -> OciRegistry {
        OciRegistry::start_with(None, None)
    }

    /// With `tls` = (certificate, key) PEM files: HTTPS only. With `htpasswd`: every
    /// request needs one of its logins.
    pub fn start_with(tls: Option<(&Path, &Path)>, htpasswd: Option<&Path>) -> OciRegistry {
        let dir = tempdir();
        let addr = format!("127.0.0.1:{}", free_port());
        let cfg = dir.path().join("config.yml");
        let tls_cfg = tls.map_or(String::new(), |(c, k)| {
            format!(
                "  tls:\n    certificate: {}\n    key: {}\n",
                c.display(),
                k.display()
            )
        });
        let auth_cfg = htpasswd.map_or(String::new(), |p| {
            format!(
                "auth:\n  htpasswd:\n    realm: moongate-test\n    path: {}\n",
                p.display()
            )
        });
        std::fs::write(
            &cfg,
            format!(
                "version: 0.1\nlog: {{level: info}}\nstorage:\n  filesystem:\n    rootdirectory: {}\n\
                 http:\n  addr: {addr}\n{tls_cfg}{auth_cfg}",
                dir.path().join("data").display()
            ),
        )
        .unwrap();
        let mut cmd = Command::new("docker-registry");
        cmd.arg("serve").arg(&cfg);
        let proc = Proc::spawn("docker-registry", cmd, dir.path().join("registry.log"));
        wait_for("registry ready", Duration::from_secs(20), &[&proc], || {
            if tls.is_some() {
                // It listens once it serves; speaking TLS is the test's business.
                std::net::TcpStream::connect(&addr).is_ok()
            } else {
                // 401 without a login: up all the same.
                http_get(&addr, "/v2/").is_some_and(|(s, _)| s == 200 || s == 401)
            }
        });
        OciRegistry {
            proc,
            addr,
            _dir: dir,
        }
    }

    pub fn reference(&self, repo_tag: &str) -> String {
        format!("oci://{}/{repo_tag}", self.addr)
    }
}

/// A minisign key pair made by the real `minisign`: (public key line, secret key file).
pub fn keypair(dir: &Path, name: &str) -> (String, PathBuf) {
    let (p, s) = (
        dir.join(format!("{name}.pub")),
        dir.join(format!("{name}.sec")),
    );
    let st = Command::new("minisign")
        .args(["-G", "-W", "-p"])
        .arg(&p)
        .arg("-s")
        .arg(&s)
        .output()
        .expect("minisign (installed by scripts/bootstrap.sh)");
    assert!(st.status.success(), "{st:?}");
    let text = std::fs::read_to_string(&p).unwrap();
    (text.lines().nth(1).unwrap().trim().to_string(), s)
}

/// Copies `plugin` to `dir/file` and signs it there with `key` (FILE.minisig).
pub fn signed_copy(dir: &Path, plugin: &str, file: &str, key: Option<&Path>) -> PathBuf {
    let f = dir.join(file);
    std::fs::copy(plugin_path(plugin), &f).unwrap();
    if let Some(key) = key {
        let st = Command::new("minisign")
            .arg("-S")
            .arg("-s")
            .arg(key)
            .arg("-m")
            .arg(&f)
            .output()
            .unwrap();
        assert!(st.status.success(), "{st:?}");
    }
    f
}

/// `moongate plugin ARGS...`: (exit code, stdout, stderr).
fn cli(args: &[&str]) -> (i32, String, String) {
    cli_env(args, &[])
}

/// [`cli`] with extra environment variables.
fn cli_env(args: &[&str], env: &[(&str, &Path)]) -> (i32, String, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_moongate"))
        .arg("plugin")
        .args(args)
        .envs(env.iter().map(|(k, v)| (*k, *v)))
        .output()
        .unwrap();
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stdout).trim().to_string(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

pub fn push(file: &Path, reference: &str) -> String {
    let (code, out, err) = cli(&["push", file.to_str().unwrap(), reference]);
    assert_eq!(code, 0, "push {reference}: {err}");
    assert!(out.contains("@sha256:"), "{out}");
    out
}

pub fn plugins(mg: &Moongate) -> Vec<Value> {
    let (st, body) = http_get(&mg.admin, "/plugins").unwrap();
    assert_eq!(st, 200, "{body}");
    serde_json::from_str::<Value>(&body)
        .unwrap()
        .as_array()
        .unwrap()
        .clone()
}

pub fn plugin(mg: &Moongate, name: &str) -> Value {
    plugins(mg)
        .into_iter()
        .find(|p| p["name"] == name)
        .unwrap_or_else(|| panic!("no plugin {name}: {:?}", plugins(mg)))
}

fn post(mg: &Moongate, query: &str, headers: &[(&str, &str)], body: &[u8]) -> (u16, String) {
    let (st, b) = http_with(
        &mg.admin,
        "POST",
        &format!("/plugins?{query}"),
        headers,
        body,
    )
    .expect("admin answers");
    (st, String::from_utf8_lossy(&b).into_owned())
}

fn enc(s: &str) -> String {
    form_urlencoded::byte_serialize(s.as_bytes()).collect()
}

#[test]
fn plugins_come_signed_from_a_registry_and_everything_wrong_is_refused() {
    let reg = OciRegistry::start();
    let dir = tempdir();
    let d = dir.path();
    let (trusted, trusted_sec) = keypair(d, "trusted");
    let (_, other_sec) = keypair(d, "other");

    // The operator's side: push signed, unsigned and wrongly signed artifacts.
    let lru = signed_copy(d, "lru", "lru.wasm", Some(&trusted_sec));
    let lru_pinned = push(&lru, &reg.reference("moongate/lru:1.0"));
    let prefix = signed_copy(d, "prefix-evict", "prefix.wasm", Some(&trusted_sec));
    let prefix_pinned = push(&prefix, &reg.reference("moongate/prefix:1.0"));
    let unsigned = signed_copy(d, "tier-placement", "unsigned.wasm", None);
    push(&unsigned, &reg.reference("moongate/unsigned:1.0"));
    let foreign = signed_copy(d, "put-budget", "foreign.wasm", Some(&other_sec));
    push(&foreign, &reg.reference("moongate/foreign:1.0"));
    // A valid signature of another file, pushed beside these bytes.
    let swapped = signed_copy(d, "disk-budget", "swapped.wasm", None);
    let (code, _, err) = cli(&[
        "push",
        swapped.to_str().unwrap(),
        &reg.reference("moongate/swapped:1.0"),
        "--signature",
        d.join("lru.wasm.minisig").to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");

    // Pull by tag and by digest with the CLI: the same bytes and signature come back.
    let out = d.join("pulled.wasm");
    let (code, pinned, err) = cli(&[
        "pull",
        &reg.reference("moongate/lru:1.0"),
        "-o",
        out.to_str().unwrap(),
    ]);
    assert_eq!((code, pinned.as_str()), (0, lru_pinned.as_str()), "{err}");
    assert_eq!(std::fs::read(&out).unwrap(), std::fs::read(&lru).unwrap());
    assert_eq!(
        std::fs::read(d.join("pulled.wasm.minisig")).unwrap(),
        std::fs::read(d.join("lru.wasm.minisig")).unwrap()
    );
    let (code, pinned, err) = cli(&["pull", &lru_pinned, "-o", out.to_str().unwrap()]);
    assert_eq!((code, pinned.as_str()), (0, lru_pinned.as_str()), "{err}");
    // The size cap holds before the download.
    let (code, _, err) = cli(&[
        "pull",
        &lru_pinned,
        "-o",
        out.to_str().unwrap(),
        "--max-bytes",
        "1000",
    ]);
    assert!(code != 0 && err.contains("over the cap"), "{err}");
    // A digest that is not there.
    let wrong = format!(
        "{}@sha256:{}",
        reg.reference("moongate/lru"),
        "0".repeat(64)
    );
    let (code, _, err) = cli(&["pull", &wrong, "-o", out.to_str().unwrap()]);
    assert!(code != 0 && err.contains("manifest unknown"), "{err}");

    // moongate trusting one key, starting with a plugin from the registry by tag.
    let watch = tempdir();
    let mg = Moongate::start_config(&format!(
        "[master_face]\nupstream = \"127.0.0.1:1\"\n\
         [policy]\nactive = \"p\"\ntrusted_keys = [\"{trusted}\"]\nwatch_dir = \"{}\"\n\
         watch_interval_ms = 200\n\
         [[policy.plugins]]\nname = \"p\"\nfrom = \"{}\"\n",
        watch.path().display(),
        reg.reference("moongate/lru:1.0"),
    ));
    let p = plugin(&mg, "p");
    assert_eq!(p["state"], "active", "{p}");
    assert_eq!(
        p["source"],
        lru_pinned.as_str(),
        "the tag is recorded as its digest: {p}"
    );
    assert_eq!(p["signed_by"], trusted.as_str(), "{p}");
    let sha_before = p["sha256"].clone();

    // Through the admin API: by digest, then each wrong one refused.
    let (st, body) = post(
        &mg,
        &format!("name=q&from={}", enc(&prefix_pinned)),
        &[],
        b"",
    );
    assert_eq!(st, 200, "{body}");
    for (name, repo, status, reason) in [
        ("u", "moongate/unsigned:1.0", 403, "unsigned"),
        ("f", "moongate/foreign:1.0", 403, "untrusted_key"),
        ("s", "moongate/swapped:1.0", 403, "bad_signature"),
    ] {
        let (st, body) = post(
            &mg,
            &format!("name={name}&from={}", enc(&reg.reference(repo))),
            &[],
            b"",
        );
        assert_eq!(st, status, "{name}: {body}");
        assert_eq!(plugin(&mg, name)["state"], "rejected");
        assert_eq!(
            mg.metric(&format!(
                "moongate_plugin_signature_refusals_total{{reason=\"{reason}\"}}"
            )),
            1.0,
            "{name}"
        );
    }
    let (st, body) = post(&mg, &format!("name=p&from={}", enc(&wrong)), &[], b"");
    assert_eq!(st, 502, "{body}");
    // An upload: signed in a header, or not at all.
    let bytes = std::fs::read(&lru).unwrap();
    let sig = std::fs::read_to_string(d.join("lru.wasm.minisig")).unwrap();
    let sig_b64 = {
        use base64::Engine;
        base64::engine::general_purpose::STANDARD.encode(sig)
    };
    let (st, body) = post(
        &mg,
        "name=up",
        &[("X-Moongate-Signature", &sig_b64)],
        &bytes,
    );
    assert_eq!(st, 200, "{body}");
    assert_eq!(plugin(&mg, "up")["source"], "upload");
    let (st, body) = post(&mg, "name=up2", &[], &bytes);
    assert_eq!(st, 403, "{body}");
    // The watched directory: a signed component file, an unsigned one.
    std::fs::copy(&lru, watch.path().join("w.wasm")).unwrap();
    std::fs::copy(
        d.join("lru.wasm.minisig"),
        watch.path().join("w.wasm.minisig"),
    )
    .unwrap();
    std::fs::copy(&unsigned, watch.path().join("wu.wasm")).unwrap();
    wait_for(
        "watched files tried",
        Duration::from_secs(10),
        &[&mg.proc, &reg.proc],
        || {
            plugins(&mg)
                .iter()
                .any(|p| p["name"] == "w" && p["state"] == "loaded")
                && plugins(&mg)
                    .iter()
                    .any(|p| p["name"] == "wu" && p["state"] == "rejected")
        },
    );
    // Nothing above touched the active plugin.
    let p = plugin(&mg, "p");
    assert_eq!(
        (p["state"].clone(), p["sha256"].clone()),
        ("active".into(), sha_before)
    );

    // The rollout path: a `p.oci` file (a ConfigMap key, a downward-API annotation)
    // names a new digest; the active plugin moves to it.
    std::fs::write(watch.path().join("p.oci"), format!("{prefix_pinned}\n")).unwrap();
    // Loaded first (its new source shows), then activated: wait for both, or a busy
    // machine catches it in between ("loaded": seen in a clean-clone CI run).
    wait_for(
        "p upgraded from the registry and active",
        Duration::from_secs(15),
        &[&mg.proc, &reg.proc],
        || {
            let p = plugin(&mg, "p");
            p["source"] == prefix_pinned.as_str() && p["state"] == "active"
        },
    );
    assert!(mg.metric("moongate_plugin_pulls_total{result=\"ok\"}") >= 3.0);

    // Registry down: pulls fail cleanly, counted; the active plugin stays.
    drop(reg);
    let errors = mg.metric("moongate_plugin_pulls_total{result=\"error\"}");
    let (st, body) = post(&mg, &format!("name=p&from={}", enc(&lru_pinned)), &[], b"");
    assert_eq!(st, 502, "{body}");
    assert!(mg.metric("moongate_plugin_pulls_total{result=\"error\"}") > errors);
    std::fs::write(watch.path().join("p.oci"), format!("{lru_pinned}\n")).unwrap();
    wait_for(
        "the watched pull failed",
        Duration::from_secs(15),
        &[&mg.proc],
        || mg.proc.log_text().contains("watched reference not loaded"),
    );
    let p = plugin(&mg, "p");
    assert_eq!(
        (p["state"].as_str(), p["source"].as_str()),
        (Some("active"), Some(prefix_pinned.as_str()))
    );
    assert!(mg.proc.log_text().contains("plugin refused: signature"));
}

/// A registry that is not there at start-up is a start-up error naming the plugin.
#[test]
fn a_configured_reference_nobody_can_pull_stops_the_start() {
    let dir = tempdir();
    let cfg = dir.path().join("m.toml");
    std::fs::write(
        &cfg,
        format!(
            "[master_face]\nupstream = \"127.0.0.1:1\"\nlisten = \"127.0.0.1:0\"\n\
             [admin]\nlisten = \"127.0.0.1:0\"\n[policy]\npull_timeout_ms = 3000\n\
             [[policy.plugins]]\nname = \"p\"\nfrom = \"oci://127.0.0.1:{}/none:1\"\n",
            free_port()
        ),
    )
    .unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_moongate"))
        .args(["run", "--config"])
        .arg(&cfg)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert!(err.contains("policy.plugins.p"), "{err}");
}

/// A loopback registry that speaks TLS is reached over TLS (HTTPS is always tried
/// first), with the certificate checked against the system's trust store (here
/// `SSL_CERT_FILE`): untrusted, the pull fails, and the plain-HTTP try after it cannot
/// talk to a TLS port either.
#[test]
fn a_registry_that_speaks_tls_is_reached_over_tls_and_its_certificate_checked() {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair};
    let dir = tempdir();
    let d = dir.path();
    let ca_key = KeyPair::generate().unwrap();
    let mut p = CertificateParams::new(vec!["moongate test registry CA".to_string()]).unwrap();
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = p.self_signed(&ca_key).unwrap();
    let key = KeyPair::generate().unwrap();
    let leaf = CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".to_string()])
        .unwrap()
        .signed_by(&key, &ca, &ca_key)
        .unwrap();
    let (ca_pem, cert_pem, key_pem) = (d.join("ca.pem"), d.join("cert.pem"), d.join("key.pem"));
    std::fs::write(&ca_pem, ca.pem()).unwrap();
    std::fs::write(&cert_pem, leaf.pem()).unwrap();
    std::fs::write(&key_pem, key.serialize_pem()).unwrap();
    let reg = OciRegistry::start_with(Some((&cert_pem, &key_pem)), None);
    let trust = [("SSL_CERT_FILE", ca_pem.as_path())];

    let file = signed_copy(d, "lru", "lru.wasm", None);
    let reference = reg.reference("moongate/lru:tls");
    let (code, pinned, err) = cli_env(&["push", file.to_str().unwrap(), &reference], &trust);
    assert_eq!(code, 0, "{err}\n{}", reg.proc.log_text());
    let out = d.join("out.wasm");
    let (code, again, err) = cli_env(&["pull", &reference, "-o", out.to_str().unwrap()], &trust);
    assert_eq!((code, again.as_str()), (0, pinned.as_str()), "{err}");
    assert_eq!(std::fs::read(&out).unwrap(), std::fs::read(&file).unwrap());

    // Not trusted: refused, over both schemes.
    let (code, _, err) = cli_env(
        &["pull", &reference, "-o", out.to_str().unwrap()],
        &[("SSL_CERT_FILE", d.join("key.pem").as_path())],
    );
    assert!(
        code != 0 && err.contains("over HTTPS") && err.contains("over HTTP"),
        "{err}"
    );
}

/// A registry that wants a login: moongate takes it from a Docker-style config file
/// (`policy.registry_auth_file`, the CLI's `--auth-file`); without it, or with a wrong
/// one, the pull is refused and nothing changes.
#[test]
fn a_registry_login_comes_from_a_docker_config_file() {
    let dir = tempdir();
    let d = dir.path();
    let htpasswd = d.join("htpasswd");
    let o = Command::new(python())
        .arg("-c")
        .arg(
            "import bcrypt, sys; open(sys.argv[1], 'w').write('ci:' + \
             bcrypt.hashpw(b'secret', bcrypt.gensalt(rounds=5)).decode() + '\\n')",
        )
        .arg(&htpasswd)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let reg = OciRegistry::start_with(None, Some(&htpasswd));
    let login = |user_pass: &str, file: &str| {
        use base64::Engine;
        let auth = base64::engine::general_purpose::STANDARD.encode(user_pass);
        let p = d.join(file);
        std::fs::write(
            &p,
            format!(r#"{{"auths": {{"{}": {{"auth": "{auth}"}}}}}}"#, reg.addr),
        )
        .unwrap();
        p
    };
    let (good, bad) = (
        login("ci:secret", "good.json"),
        login("ci:wrong", "bad.json"),
    );
    let file = signed_copy(d, "lru", "lru.wasm", None);
    let reference = reg.reference("moongate/lru:1");
    let (code, pinned, err) = cli(&[
        "push",
        file.to_str().unwrap(),
        &reference,
        "--auth-file",
        good.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    let out = d.join("out.wasm");
    for (auth, ok) in [(Some(&good), true), (Some(&bad), false), (None, false)] {
        let mut args = vec!["pull", &reference, "-o", out.to_str().unwrap()];
        if let Some(a) = auth {
            args.extend(["--auth-file", a.to_str().unwrap()]);
        }
        let (code, got, err) = cli(&args);
        if ok {
            assert_eq!((code, got.as_str()), (0, pinned.as_str()), "{err}");
        } else {
            assert!(
                code != 0 && err.contains("Not authorized"),
                "{auth:?}: {err}"
            );
        }
    }
    // moongate itself, with the config file.
    let mg = Moongate::start_config(&format!(
        "[master_face]\nupstream = \"127.0.0.1:1\"\n[policy]\nregistry_auth_file = \"{}\"\n",
        good.display()
    ));
    let (st, body) = post(&mg, &format!("name=q&from={}", enc(&reference)), &[], b"");
    assert_eq!(st, 200, "{body}\n{}", reg.proc.log_text());
    assert_eq!(plugin(&mg, "q")["source"], pinned.as_str());
}
