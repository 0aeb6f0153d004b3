//! `pdkv certs init` writes a CA and node certificates that really authenticate nodes to each
//! other over QUIC with mutual TLS.

use std::os::unix::fs::PermissionsExt;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use pdkv_core::plan::RegionLayout;
use pdkv_core::wire::{Incarnation, NodeId, Role};
use pdkv_transport::codec::PROTOCOL_VERSION;
use pdkv_transport::control::{
    ControlClient, ControlLimits, ControlServer, ControlService, Hello, ServerSetup, TransportRuntime,
};
use pdkv_transport::tls::NodeIdentity;

struct Echo;

impl ControlService for Echo {
    type Request = String;
    type Response = String;

    async fn handle(&self, peer: &NodeId, request: String) -> Result<String, String> {
        Ok(format!("{peer} said {request}"))
    }
}

fn hello(node: &str) -> Hello {
    Hello {
        node: NodeId(node.into()),
        role: Role::Decode,
        incarnation: Incarnation(1),
        regions: RegionLayout::default(),
        protocol_version: PROTOCOL_VERSION,
        layout_hash: 7,
        model: pdkv_core::identity::ModelFields::default(),
        engines: vec![],
        host: pdkv_transport::host::host_id(),
    }
}

#[test]
fn certs_init_writes_certificates_that_authenticate_nodes() {
    let out = std::env::temp_dir().join(format!("pdkv-certs-cli-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let pdkv = env!("CARGO_BIN_EXE_pdkv");
    let status = Command::new(pdkv)
        .args([
            "certs",
            "init",
            "--config",
            "cluster.toml",
            "--out",
            out.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(
        status.status.success(),
        "{}",
        String::from_utf8_lossy(&status.stderr)
    );
    for file in [
        "ca.pem",
        "ca.key",
        "prefill-0.pem",
        "prefill-0.key",
        "decode-0.pem",
        "decode-0.key",
    ] {
        assert!(out.join(file).exists(), "{file} missing");
    }
    let mode = std::fs::metadata(out.join("decode-0.key"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o077, 0, "private keys are readable by their owner only");

    // A second init refuses to replace the CA without --force.
    let again = Command::new(pdkv)
        .args(["certs", "init", "--out", out.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(again.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&again.stderr).contains("ca.pem exists (pass --force"),
        "{}",
        String::from_utf8_lossy(&again.stderr)
    );

    // The written certificates admit one node to the other.
    let runtime = TransportRuntime::new(2).unwrap();
    let prefill = NodeIdentity::load(&out, "prefill-0").unwrap();
    let decode = NodeIdentity::load(&out, "decode-0").unwrap();
    let setup = ServerSetup {
        cluster: vec![NodeId("prefill-0".into()), NodeId("decode-0".into())],
        hello: hello("prefill-0"),
        service: Arc::new(Echo),
        tickets: None,
        limits: ControlLimits::default(),
    };
    let server =
        ControlServer::start(&runtime.handle(), "127.0.0.1:0".parse().unwrap(), &prefill, setup).unwrap();
    let client = ControlClient::new(&runtime.handle(), "127.0.0.1:0".parse().unwrap(), &decode).unwrap();
    let address = server.local_addr().unwrap();
    let timeout = Duration::from_secs(5);
    let connection = runtime
        .block_on(client.connect(address, "prefill-0", &hello("decode-0"), timeout))
        .unwrap();
    let reply: String = runtime
        .block_on(connection.request("hi".to_string(), timeout))
        .unwrap();
    assert_eq!(reply, "decode-0 said hi");
    std::fs::remove_dir_all(&out).unwrap();
}

fn certs_init(out: &std::path::Path, extra: &[&str]) -> (Option<i32>, String) {
    let output = Command::new(env!("CARGO_BIN_EXE_pdkv"))
        .args(["certs", "init", "--out", out.to_str().unwrap()])
        .args(extra)
        .output()
        .unwrap();
    (
        output.status.code(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

fn mode(path: &std::path::Path) -> u32 {
    std::fs::symlink_metadata(path).unwrap().permissions().mode() & 0o777
}

const KEYS: [&str; 3] = ["ca.key", "prefill-0.key", "decode-0.key"];

/// `--force` replaces files by writing new ones: keys loosened to 0644 come back 0600, and a key
/// path that is a symlink is replaced by a file, its target untouched.
#[test]
fn forced_init_writes_fresh_0600_keys_and_never_follows_symlinks() {
    let root = std::env::temp_dir().join(format!("pdkv-certs-force-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let out = root.join("certs");
    assert_eq!(certs_init(&out, &[]).0, Some(0));
    for key in KEYS {
        std::fs::set_permissions(out.join(key), std::fs::Permissions::from_mode(0o644)).unwrap();
    }
    let victim = root.join("victim.txt");
    std::fs::write(&victim, "not a key\n").unwrap();
    std::fs::set_permissions(&victim, std::fs::Permissions::from_mode(0o644)).unwrap();
    std::fs::remove_file(out.join("decode-0.key")).unwrap();
    std::os::unix::fs::symlink("../victim.txt", out.join("decode-0.key")).unwrap();
    let old_ca = std::fs::read_to_string(out.join("ca.pem")).unwrap();

    let (code, stderr) = certs_init(&out, &["--force"]);
    assert_eq!(code, Some(0), "{stderr}");
    for key in KEYS {
        assert_eq!(mode(&out.join(key)), 0o600, "{key}");
        assert!(
            std::fs::symlink_metadata(out.join(key))
                .unwrap()
                .file_type()
                .is_file()
        );
    }
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "not a key\n");
    assert_eq!(mode(&victim), 0o644);
    assert_ne!(
        std::fs::read_to_string(out.join("ca.pem")).unwrap(),
        old_ca,
        "a new CA"
    );
    assert!(NodeIdentity::load(&out, "decode-0").is_ok());
    let leftovers: Vec<_> = std::fs::read_dir(&out)
        .unwrap()
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name.starts_with('.'))
        .collect();
    assert!(leftovers.is_empty(), "temporary files left: {leftovers:?}");
    std::fs::remove_dir_all(&root).unwrap();
}

/// Without `--force`, any existing output is refused and left as it was: a lone node key, or a
/// symlink where a key goes.
#[test]
fn init_without_force_refuses_any_existing_output() {
    let root = std::env::temp_dir().join(format!("pdkv-certs-refuse-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let out = root.join("certs");
    std::fs::create_dir_all(&out).unwrap();
    let stale = out.join("prefill-0.key");
    std::fs::write(&stale, "stale").unwrap();
    std::fs::set_permissions(&stale, std::fs::Permissions::from_mode(0o666)).unwrap();
    let (code, stderr) = certs_init(&out, &[]);
    assert_eq!(code, Some(1));
    assert!(
        stderr.contains(&format!("{} exists", stale.display())),
        "{stderr}"
    );
    assert_eq!(std::fs::read_to_string(&stale).unwrap(), "stale");
    assert!(!out.join("ca.key").exists(), "nothing written");

    std::fs::remove_file(&stale).unwrap();
    let victim = root.join("victim.txt");
    std::fs::write(&victim, "mine").unwrap();
    std::os::unix::fs::symlink(&victim, out.join("decode-0.key")).unwrap();
    let (code, stderr) = certs_init(&out, &[]);
    assert_eq!(code, Some(1));
    assert!(stderr.contains("decode-0.key exists"), "{stderr}");
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "mine");
    std::fs::remove_dir_all(&root).unwrap();
}

/// A node named `ca` would overwrite the CA's files: refused at load, nothing written.
#[test]
fn a_node_named_ca_is_refused() {
    let root = std::env::temp_dir().join(format!("pdkv-certs-ca-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root).unwrap();
    let config = root.join("cluster.toml");
    let shipped = std::fs::read_to_string("cluster.toml").unwrap();
    std::fs::write(
        &config,
        shipped.replacen("name = \"decode-0\"", "name = \"ca\"", 1),
    )
    .unwrap();
    let out = root.join("certs");
    let (code, stderr) = certs_init(&out, &["--config", config.to_str().unwrap()]);
    assert_eq!(code, Some(1));
    assert!(stderr.contains("nodes[1].name: \"ca\" is reserved"), "{stderr}");
    assert!(!out.exists(), "nothing written");
    std::fs::remove_dir_all(&root).unwrap();
}
